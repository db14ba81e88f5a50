//! The subcommands' command lines, through the real binary: `kvlb SUB --help` exits 0 and lists
//! every long flag of SUB's clap definition (taken from the library, so a flag added there and
//! left out of the help fails here), and a bad value exits 2 with an error naming the flag and
//! the value.
//!
//! Each subcommand has a test calling `help_lists_every_flag` with its `clap::Command` and
//! `bad_value_is_named` with one bad value.

use clap::CommandFactory;
use std::process::{Command, Output};

fn kvlb(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kvlb"))
        .args(args)
        .output()
        .expect("run kvlb")
}

/// Whether `help` has an option line for `flag` (`  --flag <V>`, `  --flag`, `-h, --flag`),
/// not just a mention of it in another flag's text.
fn has_option_line(help: &str, flag: &str) -> bool {
    help.lines().any(|line| {
        let mut t = line.trim_start();
        let short = t.starts_with('-') && !t.starts_with("--");
        if short && t.get(2..).is_some_and(|rest| rest.starts_with(", ")) {
            t = &t[4..];
        }
        t == flag || t.starts_with(&format!("{flag} ")) || t.starts_with(&format!("{flag}[="))
    })
}

/// `kvlb SUB --help` exits 0 and has an option line for each long flag `cmd` declares.
fn help_lists_every_flag(mut cmd: clap::Command, sub: &str) {
    cmd.build();
    let flags: Vec<String> = cmd
        .get_arguments()
        .filter_map(|a| a.get_long())
        .map(|l| format!("--{l}"))
        .collect();
    assert!(flags.len() > 1, "{sub}: no flags in {flags:?}");
    let out = kvlb(&[sub, "--help"]);
    let help = String::from_utf8(out.stdout).expect("UTF-8 help");
    assert_eq!(
        out.status.code(),
        Some(0),
        "kvlb {sub} --help: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    for flag in &flags {
        assert!(
            has_option_line(&help, flag),
            "kvlb {sub} --help lacks {flag}:\n{help}"
        );
    }
}

/// `kvlb SUB ARGS` exits 2 and its error names `flag` and `value`.
fn bad_value_is_named(sub: &str, args: &[&str], flag: &str, value: &str) {
    let mut all = vec![sub];
    all.extend(args);
    let out = kvlb(&all);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "kvlb {all:?}: {err}");
    assert!(
        err.contains(flag) && err.contains(value),
        "kvlb {all:?}: the error names neither {flag} nor {value:?}: {err}"
    );
}

#[test]
fn serve_help_and_a_bad_value() {
    help_lists_every_flag(kvlb::config::ServeSettings::command(), "serve");
    bad_value_is_named(
        "serve",
        &["--listen", "127.0.0.1:0", "--client-timeout", "forever"],
        "--client-timeout",
        "forever",
    );
}

#[test]
fn replica_help_and_a_bad_value() {
    help_lists_every_flag(kvlb::replica::flags::ReplicaFlags::command(), "replica");
    bad_value_is_named(
        "replica",
        &["--listen", "127.0.0.1:0", "--block-size", "huge"],
        "--block-size",
        "huge",
    );
}

#[test]
fn simulate_help_and_a_bad_value() {
    help_lists_every_flag(kvlb::sim::Options::command(), "simulate");
    bad_value_is_named(
        "simulate",
        &["--trace", "gen:shared-prefix", "--replicas", "0"],
        "--replicas",
        "0",
    );
}

#[test]
fn replay_help_and_a_bad_value() {
    help_lists_every_flag(kvlb::replay::Options::command(), "replay");
    bad_value_is_named(
        "replay",
        &[
            "--target",
            "http://127.0.0.1:9",
            "--trace",
            "gen:shared-prefix",
            "--speedup",
            "slow",
        ],
        "--speedup",
        "slow",
    );
}

#[test]
fn demo_help_and_a_bad_value() {
    help_lists_every_flag(kvlb::demo::Opts::command(), "demo");
    bad_value_is_named("demo", &["--time-scale", "0"], "--time-scale", "0");
}

#[test]
fn option_lines_are_told_from_mentions() {
    let help = "  -h, --help  Print help\n      --duration <S>  after --start\n      --json\n      --explain[=<BOOL>]\n";
    assert!(has_option_line(help, "--help"));
    assert!(has_option_line(help, "--duration"));
    assert!(has_option_line(help, "--explain"));
    assert!(has_option_line(help, "--json"));
    assert!(!has_option_line(help, "--start"));
    assert!(!has_option_line(help, "--dur"));
}

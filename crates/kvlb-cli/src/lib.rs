//! What the subcommands' `clap` definitions share: value parsers whose errors say what was
//! expected (clap puts the flag and the bad value in front), running a definition over the
//! arguments after the subcommand word, and ending a command on a parse error.
//!
//! Each subcommand declares its flags once, as a `#[derive(clap::Parser)]` struct: a field's
//! doc comment is its help, its value parser its validation, and one `validate` per command
//! checks the flags against each other.

#![forbid(unsafe_code)]

use clap::builder::ArgAction;
use clap::error::ErrorKind;
use clap::{Arg, Parser};

/// Parse `args` (the words after the subcommand) as `P`, then `check` it; `name` is the
/// command as usage lines show it (`kvlb replica`). A failed `check` becomes a clap error of
/// `P`'s command, so it prints and exits like a bad value.
pub fn parse<P: Parser>(
    name: &str,
    args: &[String],
    check: impl FnOnce(&P) -> Result<(), String>,
) -> Result<P, clap::Error> {
    let p = P::try_parse_from(std::iter::once(name).chain(args.iter().map(String::as_str)))?;
    match check(&p) {
        Ok(()) => Ok(p),
        Err(message) => Err(P::command()
            .bin_name(name)
            .error(ErrorKind::ValueValidation, message)),
    }
}

/// Print a parse error (`--help` to stdout, anything else to stderr) and return the exit
/// status: 0 for `--help`, 2 for a bad command line.
pub fn exit_status(e: &clap::Error) -> i32 {
    let _ = e.print();
    e.exit_code()
}

/// `#[command(mut_args = cli::hyphen_values)]`: every option takes the next word as its value
/// even when it starts with `-`, as the hand-written parsers did, so `--count -1` is a bad
/// value of `--count` (named in the error), not an unknown flag `-1`. An option taking several
/// values (`--served-model-name A B`) is left alone: its list ends at the next flag.
pub fn hyphen_values(a: Arg) -> Arg {
    let several = a.get_num_args().is_some_and(|n| n.max_values() > 1);
    match a.get_action() {
        ArgAction::Set | ArgAction::Append if !several => a.allow_hyphen_values(true),
        _ => a,
    }
}

/// A whole number in `MIN..=MAX`, as a `T` (which must hold `MAX`).
pub fn int<T: TryFrom<u64>, const MIN: u64, const MAX: u64>(s: &str) -> Result<T, String> {
    s.parse::<u64>()
        .ok()
        .filter(|n| (MIN..=MAX).contains(n))
        .and_then(|n| T::try_from(n).ok())
        .ok_or_else(|| match (MIN, MAX) {
            (0, u64::MAX) => "expected a whole number".to_string(),
            (_, u64::MAX) => format!("expected a whole number >= {MIN}"),
            _ => format!("expected a whole number from {MIN} to {MAX}"),
        })
}

/// Any text but the empty one.
pub fn non_empty(s: &str) -> Result<String, String> {
    if s.is_empty() {
        return Err("expected a value, not an empty one".to_string());
    }
    Ok(s.to_string())
}

/// A finite number above 0.
pub fn positive(s: &str) -> Result<f64, String> {
    s.parse::<f64>()
        .ok()
        .filter(|x| x.is_finite() && *x > 0.0)
        .ok_or_else(|| "expected a number above 0".to_string())
}

/// A finite number, 0 or more.
pub fn non_negative(s: &str) -> Result<f64, String> {
    s.parse::<f64>()
        .ok()
        .filter(|x| x.is_finite() && *x >= 0.0)
        .ok_or_else(|| "expected a number, 0 or more".to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn value_parsers_say_what_they_expect() {
        assert_eq!(int::<u32, 1, 10>("10"), Ok(10));
        assert!(int::<u32, 1, 10>("0").unwrap_err().contains("from 1 to 10"));
        assert!(int::<u32, 1, 10>("x").is_err());
        assert_eq!(
            int::<u64, 0, { u64::MAX }>("x").unwrap_err(),
            "expected a whole number"
        );
        assert_eq!(
            int::<u64, 1, { u64::MAX }>("0").unwrap_err(),
            "expected a whole number >= 1"
        );
        assert_eq!(positive("2.5"), Ok(2.5));
        for bad in ["0", "-1", "nan", "inf", ""] {
            assert!(positive(bad).is_err(), "{bad}");
        }
        assert_eq!(non_negative("0"), Ok(0.0));
        assert!(non_empty("").is_err() && non_empty("x").is_ok());
        assert!(non_negative("-0.5").is_err());
    }
}

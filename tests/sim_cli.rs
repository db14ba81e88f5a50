//! `kvlb simulate` end to end: the real binary on a slice of the Mooncake conversation trace,
//! an Azure trace and the built-in generators. Only robust facts are asserted: every request is
//! accounted for, rates and percentiles are ordered and in range, the per-replica work adds
//! up, and the same input gives byte-identical output.

use serde_json::Value;
use std::path::PathBuf;
use std::process::{Command, Output};

/// The traces shipped with the repository (`traces/README.md`).
const TRACES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/traces");

fn kvlb(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kvlb"))
        .arg("simulate")
        .args(args)
        .output()
        .expect("run kvlb simulate")
}

/// A directory of this test under the system temp dir, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(label: &str) -> TempDir {
        let dir = std::env::temp_dir().join(format!("kvlb-sim-{label}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("create temp dir");
        TempDir(dir)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A trace's path; it is part of the checkout, so a missing one fails the test.
fn trace(name: &str) -> String {
    let p = PathBuf::from(TRACES).join(name);
    assert!(
        p.is_file(),
        "{} is missing (see traces/README.md)",
        p.display()
    );
    p.to_string_lossy().into_owned()
}

/// Run with `--json` and return the parsed array, after checking the exit status.
fn json(args: &[&str]) -> (Vec<Value>, String) {
    let mut all = args.to_vec();
    all.push("--json");
    let out = kvlb(&all);
    let stdout = String::from_utf8(out.stdout).unwrap();
    assert!(
        out.status.success(),
        "{args:?}: {}\n{stdout}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_str(&stdout).expect("stdout is JSON");
    (v.as_array().expect("a JSON array").clone(), stdout)
}

fn num(o: &Value, key: &str) -> f64 {
    o.get(key)
        .and_then(Value::as_f64)
        .unwrap_or_else(|| panic!("{key} missing or not a number in {o}"))
}

/// The facts every policy's summary must satisfy.
fn check_summary(o: &Value, requests: usize, replicas: usize) {
    let policy = o["policy"].as_str().expect("policy name");
    assert_eq!(num(o, "requests") as usize, requests, "{policy}");
    let (finished, rejected) = (num(o, "finished") as usize, num(o, "rejected") as usize);
    assert_eq!(
        finished + rejected,
        requests,
        "{policy}: every request accounted for"
    );
    let hit = num(o, "hit_rate");
    assert!((0.0..=1.0).contains(&hit), "{policy}: hit_rate {hit}");
    let (p50, p90, p99) = (
        num(o, "ttft_p50_s"),
        num(o, "ttft_p90_s"),
        num(o, "ttft_p99_s"),
    );
    assert!(
        0.0 < p50 && p50 <= p90 && p90 <= p99,
        "{policy}: {p50} {p90} {p99}"
    );
    assert!(num(o, "e2e_p99_s") >= p99, "{policy}");
    let (itl50, itl99) = (num(o, "itl_p50_s"), num(o, "itl_p99_s"));
    assert!(0.0 < itl50 && itl50 <= itl99, "{policy}: {itl50} {itl99}");
    assert!(num(o, "max_mean_load") >= 1.0, "{policy}");
    assert!(num(o, "duplicate_kv_blocks") >= 0.0, "{policy}");
    let prefill = num(o, "prefill_tokens") as u64;
    assert!(
        prefill > 0 && prefill <= num(o, "prompt_tokens") as u64,
        "{policy}"
    );
    let per_replica: Vec<u64> = o["replica_prefill_tokens"]
        .as_array()
        .expect("replica_prefill_tokens")
        .iter()
        .map(|v| v.as_u64().unwrap())
        .collect();
    assert_eq!(per_replica.len(), replicas, "{policy}");
    assert_eq!(per_replica.iter().sum::<u64>(), prefill, "{policy}");
}

fn policies(v: &[Value]) -> Vec<String> {
    v.iter()
        .map(|o| o["policy"].as_str().unwrap().to_string())
        .collect()
}

#[test]
fn simulate_mooncake_slice_reports_every_policy() {
    let t = trace("mooncake_conversation_trace.jsonl");
    let (v, _) = json(&["--trace", &t, "--limit", "500", "--speedup", "2"]);
    let names = policies(&v);
    for p in [
        "round_robin",
        "random",
        "least_loaded",
        "power_of_two",
        "consistent_hash",
        "sglang_cache_aware",
        "cache_aware",
    ] {
        assert!(names.iter().any(|n| n == p), "{p} missing from {names:?}");
    }
    for o in &v {
        check_summary(o, 500, 4);
        // Every conversation starts with the same block: some of every prompt is shared.
        assert!(num(o, "hit_rate") > 0.0);
    }
}

#[test]
fn simulate_generators_are_deterministic() {
    for gen in ["gen:shared-prefix", "gen:agent-sessions"] {
        let args = ["--trace", gen, "--limit", "400", "--replicas", "3"];
        let (v, first) = json(&args);
        assert_eq!(v.len(), 7, "{gen}: default policies");
        for o in &v {
            check_summary(o, 400, 3);
        }
        let (_, second) = json(&args);
        assert_eq!(first, second, "{gen}: same input, same output");
        // Another seed is another trace.
        let mut seeded = args.to_vec();
        seeded.extend(["--seed", "7"]);
        let (_, other) = json(&seeded);
        assert_ne!(first, other, "{gen}");
    }
}

#[test]
fn simulate_policy_subset_table_and_plot() {
    let dir = TempDir::new("plot");
    let svg = dir.0.join("ttft.svg");
    let out = kvlb(&[
        "--trace",
        "gen:agent-sessions",
        "--limit",
        "300",
        "--policies",
        "round_robin,sglang_cache_aware",
        "--speedup",
        "1.5",
        "--plot",
        svg.to_str().unwrap(),
    ]);
    let stdout = String::from_utf8(out.stdout).unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let lines: Vec<&str> = stdout.lines().collect();
    assert!(
        lines[1].starts_with("policy") && lines[1].contains("ttft_p99"),
        "{stdout}"
    );
    assert!(lines[2].starts_with("round_robin ") && lines[3].starts_with("sglang_cache_aware "));
    assert!(!stdout.contains("least_loaded"));
    let svg = std::fs::read_to_string(&svg).expect("plot written");
    assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
    assert!(svg.contains("round_robin") && svg.contains("sglang_"));
    assert_eq!(svg.matches("<polyline").count(), 2, "one CDF per policy");
    assert_eq!(
        svg.matches("<rect x=").count(),
        2 * 4 + 2,
        "a bar per replica per policy"
    );
}

/// `--decisions`: a line per request and policy, what cache_aware estimated beside what
/// happened, so a tail can be read request by request.
#[test]
fn simulate_writes_each_decision_against_what_happened() {
    let dir = TempDir::new("decisions");
    let path = dir.0.join("decisions.jsonl");
    let out = kvlb(&[
        "--trace",
        "gen:agent-sessions",
        "--limit",
        "200",
        "--speeds",
        "1,0.333",
        "--replicas",
        "2",
        "--policies",
        "round_robin,cache_aware",
        "--decisions",
        path.to_str().unwrap(),
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = std::fs::read_to_string(&path).expect("decisions written");
    let lines: Vec<Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 400, "200 requests, two policies");
    let (rr, ca): (Vec<&Value>, Vec<&Value>) =
        lines.iter().partition(|l| l["policy"] == "round_robin");
    assert_eq!((rr.len(), ca.len()), (200, 200));
    // Round-robin makes no estimate; cache_aware says what it expected of each request.
    assert!(rr.iter().all(|l| l.get("estimate_s").is_none()));
    for l in &ca {
        let (est, ttft) = (num(l, "estimate_s"), num(l, "ttft_s"));
        assert!(est > 0.0 && ttft > 0.0, "{l}");
        assert!(num(l, "wait_s") >= 0.0 && num(l, "prefill_s") > 0.0, "{l}");
        assert!(
            ["cache", "load"].contains(&l["reason"].as_str().unwrap()),
            "{l}"
        );
        assert!(num(l, "cached_tokens") <= num(l, "prompt_tokens"), "{l}");
        assert!(num(l, "idle_replicas") <= 2.0, "{l}");
    }
    // The first request found an idle fleet; the slow replica is learned as slow.
    assert_eq!(num(ca[0], "idle_replicas"), 2.0);
    let slow: Vec<f64> = ca
        .iter()
        .filter(|l| l["replica"] == 1)
        .map(|l| num(l, "pace_prefill"))
        .collect();
    assert!(slow.last().is_some_and(|p| *p > 1.5), "{slow:?}");
    // Estimates track what happened: the median error is within a factor of two.
    let mut err: Vec<f64> = ca
        .iter()
        .map(|l| num(l, "ttft_s") / num(l, "estimate_s"))
        .collect();
    err.sort_by(f64::total_cmp);
    let median = err[err.len() / 2];
    assert!((0.5..2.0).contains(&median), "{median}");
}

#[test]
fn simulate_azure_trace_shares_nothing() {
    let t = trace("azure_llm_2023_code.csv");
    let (v, _) = json(&[
        "--trace",
        &t,
        "--limit",
        "300",
        "--policies",
        "round_robin,least_loaded",
    ]);
    assert_eq!(policies(&v), vec!["round_robin", "least_loaded"]);
    for o in &v {
        check_summary(o, 300, 4);
        assert_eq!(num(o, "hit_rate"), 0.0);
        assert_eq!(num(o, "duplicate_kv_blocks"), 0.0);
    }
}

#[test]
fn simulate_rejects_bad_input_with_a_message() {
    let dir = TempDir::new("bad");
    let bad = dir.0.join("bad.jsonl");
    std::fs::write(
        &bad,
        "{\"timestamp\": 0, \"input_length\": 10, \"output_length\": 1, \"hash_ids\": [1]}\n{\"timestamp\": 5, \"input_length\": 2000, \"output_length\": 1, \"hash_ids\": [1]}\n",
    )
    .unwrap();
    let bad = bad.to_str().unwrap().to_string();
    let cases: Vec<(Vec<&str>, i32, &str)> = vec![
        (vec![], 2, "not provided:\n  --trace <SPEC>"),
        (
            vec!["--trace", "gen:agent-sessions", "--policies", "fastest"],
            2,
            "unknown policy \"fastest\"",
        ),
        (
            vec!["--trace", "gen:agent-sessions", "--replicas", "0"],
            2,
            "invalid value '0' for '--replicas <N>'",
        ),
        (
            vec!["--trace", "gen:agent-sessions", "--speedup", "-1"],
            2,
            "--speedup",
        ),
        (vec!["--trace", "gen:nothing"], 1, "unknown generator"),
        (
            vec!["--trace", "/nonexistent/trace.jsonl"],
            1,
            "cannot read",
        ),
        (
            vec!["--trace", &bad],
            1,
            "line 2: input_length 2000 needs 4 hash_ids",
        ),
        (
            vec!["--trace", "gen:agent-sessions", "--bogus", "1"],
            2,
            "unexpected argument '--bogus'",
        ),
        (
            vec!["--trace", "gen:agent-sessions", "--set", "speed=2"],
            2,
            "unknown parameter \"speed\"; known: min_match_tokens, recompute_weight",
        ),
        (
            vec!["--trace", "gen:agent-sessions", "--set", "recompute_weight"],
            2,
            "expected NAME=X",
        ),
        (
            vec!["--trace", "gen:agent-sessions", "--set", "chunk_tokens=1.5"],
            1,
            "chunk_tokens takes a whole number, got 1.5",
        ),
        (
            vec![
                "--trace",
                "gen:agent-sessions",
                "--set",
                "recompute_weight=0.5",
            ],
            1,
            "recompute_weight must be a finite number >= 1, got 0.5",
        ),
    ];
    for (args, code, message) in cases {
        let out = kvlb(&args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(code), "{args:?}: {stderr}");
        assert!(stderr.contains(message), "{args:?}: {stderr}");
    }
    drop(dir);
    let help = kvlb(&["--help"]);
    assert!(help.status.success());
    assert!(String::from_utf8_lossy(&help.stdout).contains("--speedup"));
}

/// `--set` changes cache_aware's parameters (and only cache_aware's), `--scrape-interval`
/// feeds it the engines' queue and KV usage; without them the results are the defaults'.
#[test]
fn simulate_set_and_scrape_change_cache_aware_only() {
    let base = [
        "--trace",
        "gen:shared-prefix",
        "--limit",
        "600",
        "--policies",
    ];
    let run = |extra: &[&str]| {
        let mut args = base.to_vec();
        args.push("cache_aware,least_loaded");
        args.extend_from_slice(extra);
        json(&args).0
    };
    let plain = run(&[]);
    // Every hit ignored: cache_aware routes by load alone, and finds fewer of its prefixes.
    let no_hits = run(&["--set", "min_match_tokens=1000000"]);
    assert!(
        num(&no_hits[0], "hit_rate") < num(&plain[0], "hit_rate") - 0.05,
        "{} vs {}",
        no_hits[0],
        plain[0]
    );
    assert_eq!(no_hits[1], plain[1], "least_loaded has no parameters");
    // The default value given explicitly changes nothing.
    assert_eq!(run(&["--set", "recompute_weight=2"]), plain);
    let scraped = run(&["--scrape-interval", "0.5"]);
    check_summary(&scraped[0], 600, 4);
    assert_eq!(scraped[1], plain[1]);
}

#[test]
fn simulate_a_fleet_serving_different_models() {
    // 300 requests of the conversation trace, models by conversation: the 8B and its adapter
    // on two replicas, the 0.6B on one, and a model nobody serves.
    let t = trace("mooncake_conversation_trace.jsonl");
    let args = [
        t.as_str(),
        "--limit",
        "300",
        "--policies",
        "round_robin,cache_aware",
        "--fleet-models",
        "Qwen/Qwen3-8B+sql-lora=2,Qwen/Qwen3-0.6B=1",
        "--models",
        "Qwen/Qwen3-8B=0.5,sql-lora=0.2,Qwen/Qwen3-0.6B=0.2,nobody=0.1",
    ];
    let mut with_trace = vec!["--trace"];
    with_trace.extend_from_slice(&args);
    let (v, first) = json(&with_trace);
    assert_eq!(policies(&v), ["round_robin", "cache_aware"]);
    for o in &v {
        let models: Vec<&Value> = o["models"]
            .as_array()
            .expect("per-model rows")
            .iter()
            .collect();
        let names: Vec<&str> = models
            .iter()
            .map(|m| m["model"].as_str().unwrap())
            .collect();
        assert_eq!(
            names,
            ["Qwen/Qwen3-0.6B", "Qwen/Qwen3-8B", "nobody", "sql-lora"],
            "{o}"
        );
        let count = |m: &Value, k: &str| m[k].as_u64().unwrap() as usize;
        assert_eq!(
            models.iter().map(|m| count(m, "requests")).sum::<usize>(),
            300
        );
        let nobody = models[2];
        assert!(count(nobody, "requests") > 0);
        assert_eq!(count(nobody, "rejected"), count(nobody, "requests"));
        assert!(nobody["ttft_p50_s"].is_null());
        for m in [models[0], models[1], models[3]] {
            assert!(num(m, "ttft_p50_s") > 0.0 && num(m, "ttft_p99_s") >= num(m, "ttft_p50_s"));
        }
        // Every request for a served model finished; only those for nobody were rejected.
        check_summary(o, 300, 3);
        assert_eq!(num(o, "rejected") as usize, count(nobody, "requests"));
    }
    // Deterministic, and the table has the per-model rows.
    let (_, again) = json(&with_trace);
    assert_eq!(first, again);
    let out = kvlb(&with_trace);
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(text.contains("(300 requests, 3 replicas"), "{text}");
    assert!(
        text.lines()
            .any(|l| l.starts_with("cache_aware") && l.contains(" sql-lora ")),
        "{text}"
    );
}

/// `--roles`: two prefill and two decode replicas. Every request takes both legs (always), a
/// slower KV link shows in the time to first token, priced cache_aware computes some prompts
/// on the decode replicas, and the roles are checked against the fleet.
#[test]
fn simulate_a_disaggregated_fleet() {
    let base = [
        "--trace",
        "gen:agent-sessions",
        "--limit",
        "300",
        "--policies",
        "round_robin,cache_aware",
        "--roles",
        "prefill,prefill,decode,decode",
    ];
    let run = |extra: &[&str]| {
        let mut args = base.to_vec();
        args.extend_from_slice(extra);
        json(&args)
    };
    let (always, first) = run(&["--disaggregate", "always"]);
    assert_eq!(policies(&always), ["round_robin", "cache_aware"]);
    for o in &always {
        check_summary(o, 300, 4);
        assert_eq!(num(o, "disaggregated") as usize, 300, "{o}");
        // Decode replicas compute only the last prompt token of each request: not counted.
        let per_replica = o["replica_prefill_tokens"].as_array().unwrap();
        assert_eq!(per_replica[2], 0);
        assert_eq!(per_replica[3], 0);
    }
    let (_, again) = run(&["--disaggregate", "always"]);
    assert_eq!(first, again, "deterministic");
    let (slow, _) = run(&["--disaggregate", "always", "--kv-link-gbps", "2.5"]);
    for (fast, slow) in always.iter().zip(&slow) {
        assert!(
            num(slow, "ttft_p50_s") > num(fast, "ttft_p50_s") + 0.02,
            "{fast}\n{slow}"
        );
    }
    let (priced, _) = run(&[]);
    let n = |o: &Value| num(o, "disaggregated") as usize;
    assert_eq!(n(&priced[0]), 300, "round_robin always disaggregates");
    assert!(n(&priced[1]) < 300, "{}", priced[1]);
    // A whole fleet has no such key; the table names the roles and the column.
    let (whole, _) = json(&base[..6]);
    assert!(whole.iter().all(|o| o.get("disaggregated").is_none()));
    let out = kvlb(&base);
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(
        text.lines().next().unwrap().ends_with(
            "4 replicas, speedup 1, 2 prefill + 2 decode (disaggregate priced, KV link 25 GB/s))"
        ),
        "{text}"
    );
    assert!(text.lines().nth(1).unwrap().contains(" disagg "), "{text}");
    for (roles, message) in [
        ("prefill,decode", "2 roles for --replicas 4"),
        (
            "prefill,prefill,both,both",
            "prefill replicas need decode replicas",
        ),
        (
            "prefill,prefill,decode,gpu",
            "\"gpu\": expected prefill, decode or both",
        ),
    ] {
        let out = kvlb(&["--trace", "gen:agent-sessions", "--roles", roles]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{roles}: {stderr}");
        assert!(stderr.contains(message), "{roles}: {stderr}");
    }
}

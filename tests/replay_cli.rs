//! `kvlb replay` end to end: a real `kvlb replica --count 2` fleet behind a real `kvlb serve`,
//! a small generated shared-prefix trace replayed through it with streaming requests, and the
//! JSON summary checked for facts that hold on a busy machine: every request answered, TTFT
//! measured and ordered, the replicas' own counters adding up to the trace (requests and
//! prompt tokens) with a prefix hit rate above zero. Then `kvlb replay report` on the result,
//! the same trace requests sent as chat, Responses and Messages requests (every answer's usage
//! read: prompt and cached tokens adding up to the replicas' counts), and a target that refuses
//! connections, whose requests must all count as errors.

#[path = "support/mod.rs"]
mod support;

use serde_json::Value;
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use support::proxy::{kvlb_bin, run_kvlb_output as run, Kvlb};

/// A running `kvlb replica --count N`; killed on drop, also when a test panics.
struct Fleet {
    child: Child,
    addrs: Vec<SocketAddr>,
}

impl Fleet {
    fn start(count: usize) -> Fleet {
        let mut child = Command::new(kvlb_bin())
            .args(["replica", "--listen", "127.0.0.1:0", "--model", "sim"])
            .args(["--count", &count.to_string(), "--time-scale", "20"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn kvlb replica");
        let stderr = child.stderr.take().expect("piped stderr");
        let mut fleet = Fleet {
            child,
            addrs: Vec::new(),
        };
        let (tx, rx) = std::sync::mpsc::channel::<String>();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines() {
                let Ok(line) = line else { break };
                let _ = tx.send(line);
            }
        });
        let deadline = Instant::now() + Duration::from_secs(15);
        let mut said = Vec::new();
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let line = rx
                .recv_timeout(left)
                .unwrap_or_else(|_| panic!("kvlb replica not ready: {said:?}"));
            said.push(line.clone());
            if line == "kvlb replica: ready" {
                break;
            }
            if let Some(rest) = line.strip_prefix("kvlb replica: replica ") {
                let addr = rest.split_whitespace().nth(2).expect("address");
                fleet.addrs.push(addr.parse().expect("replica address"));
            }
        }
        assert_eq!(fleet.addrs.len(), count, "{said:?}");
        fleet
    }

    fn urls(&self) -> Vec<String> {
        self.addrs.iter().map(|a| format!("http://{a}")).collect()
    }
}

impl Drop for Fleet {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn num(o: &Value, key: &str) -> f64 {
    o[key]
        .as_f64()
        .unwrap_or_else(|| panic!("{key} missing or not a number in {o}"))
}

#[test]
fn replay_through_kvlb_measures_ttft_and_the_replicas_hit_rate() {
    let fleet = Fleet::start(2);
    let urls = fleet.urls();
    let mut serve_args = vec!["--workers", "1"];
    for u in &urls {
        serve_args.extend(["--replica", u.as_str()]);
    }
    let kvlb = Kvlb::serve(&serve_args);
    let dir = support::TempDir::new("replay-cli");
    let json_path = dir.file("kvlb.json");
    let requests = 40;
    let mut args: Vec<String> = [
        "replay",
        "--target",
        &format!("http://{}", kvlb.listen),
        "--trace",
        "gen:shared-prefix",
        "--limit",
        &requests.to_string(),
        "--speedup",
        "20",
        "--time-scale",
        "20",
        "--max-output",
        "8",
        "--label",
        "kvlb",
        "--json",
        json_path.to_str().unwrap(),
        "--quiet",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    for u in &urls {
        args.extend(["--replica".to_string(), u.clone()]);
    }
    let (ok, stdout, stderr) = run(&args, Duration::from_secs(60));
    assert!(ok, "kvlb replay failed:\n{stderr}\n{stdout}");
    assert!(
        stdout.contains("kvlb") && stdout.contains("ttft_p99"),
        "{stdout}"
    );
    let s: Value = serde_json::from_str(&std::fs::read_to_string(&json_path).unwrap()).unwrap();

    assert_eq!(num(&s, "requests") as usize, requests, "{s}");
    assert_eq!(
        num(&s, "ok") as usize,
        requests,
        "all answered: {}",
        s["error_samples"]
    );
    assert_eq!(num(&s, "errors"), 0.0);
    let (p50, p90, p99) = (
        num(&s, "ttft_p50_s"),
        num(&s, "ttft_p90_s"),
        num(&s, "ttft_p99_s"),
    );
    assert!(0.0 < p50 && p50 <= p90 && p90 <= p99, "{p50} {p90} {p99}");
    assert!(num(&s, "e2e_p99_s") >= p99);
    assert_eq!(s["ttfts_s"].as_array().unwrap().len(), requests);

    // The replicas' own counters account for the whole replay.
    let replicas = s["replicas"].as_array().expect("per-replica shares");
    assert_eq!(replicas.len(), 2);
    let served: f64 = replicas.iter().map(|r| num(r, "requests")).sum();
    assert_eq!(served as usize, requests, "{replicas:?}");
    let hit = num(&s, "hit_rate");
    assert!(
        hit > 0.0 && hit < 1.0,
        "shared prefixes must hit in the replicas' caches: {hit}"
    );
    let prompt = num(&s, "prompt_tokens");
    let computed = num(&s, "prefill_tokens");
    assert!(
        computed > 0.0 && computed < prompt,
        "{computed} of {prompt}"
    );
    assert!(num(&s, "max_mean_load") >= 1.0);
    let min = num(&s, "min_mean_load");
    assert!((0.0..=1.0).contains(&min), "{min}");
    // The replicas' queue gauges were read all along: moments of the fleet, each replica's
    // idle-while-another-queued count among them.
    let occ = &s["occupancy"];
    let moments = num(occ, "samples");
    assert!(moments >= 3.0, "{occ}");
    let per = occ["idle_while_other_queued"]
        .as_array()
        .expect("per replica");
    assert_eq!(per.len(), 2, "{occ}");
    assert!(per.iter().all(|n| n.as_f64().unwrap() <= moments), "{occ}");
    let share = num(&s, "idle_while_queued");
    assert!((0.0..=1.0).contains(&share), "{share}");

    // The report reads the summary back, compares and draws it.
    let svg = dir.file("plot.svg");
    let report_json = dir.file("report.json");
    let (ok, stdout, stderr) = run(
        &[
            "replay".into(),
            "report".into(),
            "--plot".into(),
            svg.to_string_lossy().into(),
            "--json".into(),
            report_json.to_string_lossy().into(),
            "--failed".into(),
            "nginx=did not start".into(),
            json_path.to_string_lossy().into(),
        ],
        Duration::from_secs(20),
    );
    assert!(ok, "{stderr}");
    assert!(
        stdout.contains("nginx") && stdout.contains("FAILED: did not start"),
        "{stdout}"
    );
    assert!(std::fs::read_to_string(&svg).unwrap().starts_with("<svg"));
    let r: Value = serde_json::from_str(&std::fs::read_to_string(&report_json).unwrap()).unwrap();
    assert_eq!(r["balancers"][0]["label"], "kvlb");
    assert_eq!(r["failed"][0]["label"], "nginx");
}

/// Empties every replica's prefix cache.
fn reset_caches(fleet: &Fleet) {
    for a in &fleet.addrs {
        let r = support::client::HttpConn::connect(*a)
            .request("POST", "/reset_prefix_cache", &[], b"")
            .expect("reset_prefix_cache");
        assert_eq!(r.status, 200, "{}", r.describe());
    }
}

#[test]
fn replay_speaks_the_responses_and_messages_apis_through_kvlb() {
    let fleet = Fleet::start(2);
    let urls = fleet.urls();
    let mut serve_args = vec!["--workers", "1"];
    for u in &urls {
        serve_args.extend(["--replica", u.as_str()]);
    }
    let kvlb = Kvlb::serve(&serve_args);
    let requests = 10;
    let mut prompt_tokens = Vec::new();
    for api in ["chat", "responses", "messages"] {
        reset_caches(&fleet);
        let mut args: Vec<String> = [
            "replay",
            "--target",
            &format!("http://{}", kvlb.listen),
            "--trace",
            "gen:agent-sessions",
            "--limit",
            &requests.to_string(),
            "--speedup",
            "20",
            "--time-scale",
            "20",
            "--max-output",
            "8",
            "--api",
            api,
            "--json",
            "-",
            "--quiet",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        for u in &urls {
            args.extend(["--replica".to_string(), u.clone()]);
        }
        let (ok, stdout, stderr) = run(&args, Duration::from_secs(60));
        assert!(ok, "kvlb replay --api {api} failed:\n{stderr}\n{stdout}");
        let s: Value =
            serde_json::from_str(&stdout[stdout.find('{').expect("JSON on stdout")..]).unwrap();
        assert_eq!(s["api"], api);
        assert_eq!(num(&s, "requests") as usize, requests, "{api}: {s}");
        assert_eq!(
            num(&s, "ok") as usize,
            requests,
            "{api}: all answered: {}",
            s["error_samples"]
        );
        assert_eq!(s["ttfts_s"].as_array().unwrap().len(), requests, "{api}");
        assert!(num(&s, "ttft_p50_s") > 0.0, "{api}");
        // Every answer's usage told its prompt tokens and those found cached: their sums are
        // the replicas' own counts of prompt tokens and prefix-cache hits.
        let replicas = s["replicas"].as_array().expect("per-replica shares");
        let sum = |key: &str| -> f64 { replicas.iter().map(|r| num(r, key)).sum() };
        assert_eq!(sum("requests") as usize, requests, "{api}: {replicas:?}");
        let m = &s["models"][0];
        assert_eq!(num(m, "ok") as usize, requests, "{api}: {m}");
        let (prompt, cached) = (num(m, "prompt_tokens"), num(m, "cached_tokens"));
        assert_eq!(prompt, sum("prompt_tokens"), "{api}: {m} {replicas:?}");
        assert_eq!(cached, sum("prefix_hits_tokens"), "{api}: {m} {replicas:?}");
        // The sessions' shared preamble and histories are found in the replicas' caches.
        assert!(
            cached > 0.0 && cached < prompt,
            "{api}: {cached} of {prompt}"
        );
        assert!(num(m, "hit_rate") > 0.0, "{api}: {m}");
        prompt_tokens.push(prompt);
    }
    // The same trace requests: the same prompts, whichever API carries them.
    assert_eq!(prompt_tokens[1], prompt_tokens[0], "responses vs chat");
    assert_eq!(prompt_tokens[2], prompt_tokens[0], "messages vs chat");
}

#[test]
fn a_dead_target_counts_every_request_as_an_error() {
    // A port nothing listens on: bind, note it, close.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let args: Vec<String> = [
        "replay",
        "--target",
        &format!("http://127.0.0.1:{port}"),
        "--trace",
        "gen:shared-prefix",
        "--limit",
        "5",
        "--speedup",
        "100",
        "--json",
        "-",
        "--quiet",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let (ok, stdout, stderr) = run(&args, Duration::from_secs(20));
    assert!(ok, "{stderr}");
    let json = &stdout[stdout.find('{').expect("JSON on stdout")..];
    let s: Value = serde_json::from_str(json).unwrap();
    assert_eq!(num(&s, "errors"), 5.0);
    assert_eq!(num(&s, "ok"), 0.0);
    assert!(s["ttft_p99_s"].is_null());
    assert!(
        s["error_samples"][0].as_str().unwrap().contains("connect"),
        "{}",
        s["error_samples"]
    );
    let (ok, _, stderr) = run(
        &["replay".into(), "--trace".into(), "x".into()],
        Duration::from_secs(10),
    );
    assert!(!ok && stderr.contains("--target"), "{stderr}");
}

//! Calibration against real processes: a mixed fleet in one `kvlb replica` process (`--speed
//! 1,0.25`: the second prefills four times slower) behind `kvlb serve`, fed streamed chat
//! requests over HTTP. kvlb was told nothing of the speeds (nor of `--time-scale`): it must
//! learn each replica's pace from the streams' times to first token, show it in /replicas
//! and /metrics, and price the replicas by it; with `--calibrate=false` it still measures but
//! prices at the configured figures. The replicas' own /metrics are a source too: prefills
//! of requests sent to them directly, not through kvlb, set their paces.

#[path = "support/mod.rs"]
mod support;

use kvlb::replay::{client, Api};
use serde_json::Value;
use std::net::SocketAddr;
use std::time::Duration;
use support::fleet::{
    completion_body, post, replicas_json, serve_subscribed, token_prompt, ReplicaFleet,
};
use support::Kvlb;

/// A streamed chat request with a prompt of about `words` words no other request shares,
/// answered in `max_tokens` tokens.
fn chat(words: usize, salt: usize, max_tokens: u32) -> Vec<u8> {
    let text: String = (0..words).map(|i| format!("w{salt}x{i} ")).collect();
    serde_json::json!({
        "model": "m",
        "messages": [{"role": "user", "content": text}],
        "max_tokens": max_tokens,
        "stream": true,
    })
    .to_string()
    .into_bytes()
}

/// Sends `n` streamed requests through `kvlb`, `parallel` at a time; returns how many each
/// replica (by index) answered.
fn send(
    kvlb: SocketAddr,
    reps: &ReplicaFleet,
    n: usize,
    parallel: usize,
    salt: usize,
) -> Vec<usize> {
    send_answered(kvlb, reps, n, parallel, salt, 4)
}

/// As `send`, each answered in `max_tokens` tokens.
fn send_answered(
    kvlb: SocketAddr,
    reps: &ReplicaFleet,
    n: usize,
    parallel: usize,
    salt: usize,
    max_tokens: u32,
) -> Vec<usize> {
    let urls: Vec<String> = reps.http.iter().map(|h| format!("http://{h}")).collect();
    let mut counts = vec![0; urls.len()];
    for round in 0..n.div_ceil(parallel) {
        let answers: Vec<client::Streamed> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..parallel)
                .map(|k| {
                    let body = chat(6000, salt + round * parallel + k, max_tokens);
                    s.spawn(move || {
                        client::stream(
                            kvlb,
                            "/v1/chat/completions",
                            &body,
                            Api::Chat,
                            Duration::from_secs(30),
                            false,
                        )
                        .expect("a streamed answer")
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for a in answers {
            assert_eq!(a.status, 200, "{}", a.head);
            assert!(a.done, "{}", a.head);
            let url = a.header("x-kvlb-replica").expect("x-kvlb-replica");
            counts[urls.iter().position(|u| u == url).expect("a known replica")] += 1;
        }
    }
    counts
}

fn calibration(kvlb: &Kvlb) -> Vec<Value> {
    replicas_json(kvlb)
        .into_iter()
        .map(|r| r["calibration"].clone())
        .collect()
}

fn pace(c: &Value) -> f64 {
    c["prefill_pace"].as_f64().expect("a prefill pace")
}

#[test]
fn a_mixed_fleet_is_measured_and_each_replica_priced_at_its_pace() {
    // Four times faster than real time: the fast replica's pace is about 0.25 of what the
    // default cost model says, the slow one's about 1.
    let reps = ReplicaFleet::start(2, &["--speed", "1,0.25", "--time-scale", "4"]);
    let kvlb = serve_subscribed(&reps, "", &[]);
    let before = calibration(&kvlb);
    assert!(before
        .iter()
        .all(|c| pace(c) == 1.0 && c["measured"] == false));
    // Four at a time: both replicas get requests, measured or not.
    let warm = send(kvlb.listen, &reps, 24, 4, 0);
    assert!(warm.iter().all(|&n| n > 0), "{warm:?}");
    assert!(support::wait_until(Duration::from_secs(5), || {
        calibration(&kvlb).iter().all(|c| c["measured"] == true)
    }));
    let c = calibration(&kvlb);
    let (fast, slow) = (pace(&c[0]), pace(&c[1]));
    // The prices: a few samples each, shrunk towards the fleet's pace, and the replicas'
    // own overheads (HTTP, tokenizing) unscaled by --speed: about half the true ratio of 4.
    assert!(fast < 0.75, "{c:?}");
    assert!(slow / fast > 1.4 && slow / fast < 8.0, "{c:?}");
    for c in &c {
        let e = c["ttft_observed_over_estimated"].as_f64().unwrap();
        assert!(c["ttft_samples"].as_u64().unwrap() > 0, "{c:?}");
        assert!(e > 0.0 && e.is_finite(), "{c:?}");
    }
    // One at a time now: an idle fast replica beats an idle slow one on every request.
    let idle = send(kvlb.listen, &reps, 6, 1, 1000);
    assert_eq!(idle, vec![6, 0], "{:?}", calibration(&kvlb));
    // Longer answers: their event spacing measures the decode steps too.
    send_answered(kvlb.listen, &reps, 4, 2, 2000, 64);
    assert!(support::wait_until(Duration::from_secs(5), || {
        calibration(&kvlb)[0]["decode_samples"]
            .as_u64()
            .unwrap_or(0)
            > 0
    }));
    let d = calibration(&kvlb)[0]["decode_pace"].as_f64().unwrap();
    assert!(d > 0.0 && d < 1.0, "{:?}", calibration(&kvlb));
    // /metrics carries the same figures.
    let metrics = kvlb.admin_get("/metrics").body_text();
    for family in [
        "kvlb_replica_prefill_pace{",
        "kvlb_replica_queue_pace{",
        "kvlb_replica_ttft_observed_over_estimated{",
        "kvlb_replica_calibration_samples_total{",
    ] {
        assert!(metrics.contains(family), "{family} missing");
    }
}

#[test]
fn with_calibration_off_the_paces_are_measured_but_not_priced() {
    let reps = ReplicaFleet::start(2, &["--speed", "1,0.25", "--time-scale", "4"]);
    let kvlb = serve_subscribed(&reps, "", &["--calibrate=false"]);
    send(kvlb.listen, &reps, 24, 4, 0);
    assert!(support::wait_until(Duration::from_secs(5), || {
        calibration(&kvlb).iter().all(|c| c["measured"] == true)
    }));
    let c = calibration(&kvlb);
    assert!(pace(&c[1]) / pace(&c[0]) > 1.4, "{c:?}");
    // Idle, the two replicas are priced alike (the configured figures): both get requests.
    let idle = send(kvlb.listen, &reps, 16, 1, 1000);
    assert!(idle.iter().all(|&n| n > 0), "{idle:?}");
}

#[test]
fn the_replicas_own_metrics_measure_traffic_kvlb_never_saw() {
    // Three times slower prefill on the second replica. kvlb polls the replicas' /metrics
    // every 200 ms; every request goes to the replicas directly, so nothing kvlb timed itself
    // comes in. The replicas report wall seconds, as GPUs four times faster would.
    let reps = ReplicaFleet::start(2, &["--speed", "1,0.333", "--time-scale", "4"]);
    let kvlb = serve_subscribed(&reps, "", &["--metrics-interval", "200ms"]);
    // One request at a time per replica (prefills that share no steps), each a fresh prompt
    // of 6000 tokens: 0.2 engine seconds of prefill at speed 1, 0.6 at 0.333.
    std::thread::scope(|s| {
        for (r, addr) in reps.http.iter().enumerate() {
            s.spawn(move || {
                for k in 0..24 {
                    let body = completion_body(&token_prompt(6000, 100 * r as u32 + k));
                    let a = post(*addr, "/v1/completions", &body);
                    assert_eq!(a.status, 200, "{}", a.describe());
                }
            });
        }
    });
    // The last requests' reports come with the next scrapes: wait for the slow replica to be
    // priced well above the fast one (it never is without the replicas' reports).
    let apart =
        |c: &[Value]| c.iter().all(|c| c["measured"] == true) && pace(&c[1]) / pace(&c[0]) > 2.0;
    assert!(
        support::wait_until(Duration::from_secs(10), || apart(&calibration(&kvlb))),
        "{:?}",
        calibration(&kvlb)
    );
    let c = calibration(&kvlb);
    for c in &c {
        // kvlb relayed nothing: its own samples are none, the estimate error unknown.
        assert_eq!(c["ttft_samples"], 0, "{c:?}");
        assert_eq!(c["ttft_observed_over_estimated"], Value::Null, "{c:?}");
        assert!(c["metrics_samples"].as_u64().unwrap() > 0, "{c:?}");
        assert_eq!(c["metrics_skipped"]["reset"], 0, "{c:?}");
    }
    let (fast, slow) = (pace(&c[0]), pace(&c[1]));
    // Against the same model the simulated engine runs, four times faster: about 0.25 and
    // 0.75, each shrunk a little towards the fleet's pace by its prior.
    assert!(fast > 0.12 && fast < 0.4, "{c:?}");
    assert!(slow / fast < 4.5, "{c:?}");
    let metrics = kvlb.admin_get("/metrics").body_text();
    let line = format!(
        "kvlb_replica_calibration_samples_total{{replica=\"http://{}\",kind=\"metrics\"}} ",
        reps.http[1]
    );
    let n: u64 = metrics
        .lines()
        .find_map(|l| l.strip_prefix(&line))
        .unwrap_or_else(|| panic!("no {line} in\n{metrics}"))
        .trim()
        .parse()
        .unwrap();
    assert!(n > 0, "{n}");
}

//! Data-parallel engines: one URL, N ranks (`--replica URL,dp_size=N`). kvlb in front of one
//! `kvlb replica --dp-size 2` (two engines behind one HTTP port, chosen by
//! X-Data-Parallel-Rank); in-process publishers standing for ranks whose stream carries the
//! wrong rank, or one rank of an externally balanced deployment; and vLLM's own publisher as
//! DP rank 1, offsetting its ports itself.

#[path = "support/mod.rs"]
mod support;

use kvlb::kv_events::{EventFormat, KvEvent, KvEventBatch, KvEventPublisher};
use serde_json::{json, Value};
use std::net::{SocketAddr, TcpListener};
use std::time::Duration;
use support::engines::{Engine, EnginePublisher};
use support::fleet::{
    completion_body, post, replicas_json, token_prompt, wait_subscribed, ReplicaFleet,
};
use support::proxy::metric_sum;
use support::{client, wait_until, Kvlb};

const T: Duration = Duration::from_secs(20);

/// A base port with `n` free consecutive ports from it on 127.0.0.1 (each bound once and let
/// go: a port could be taken in between, which a test then reports as a bind failure).
fn free_ports(n: u16) -> u16 {
    for _ in 0..50 {
        let base = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .expect("an ephemeral port");
        if base > 65_535 - n {
            continue;
        }
        let all_free = (0..n).all(|i| TcpListener::bind(("127.0.0.1", base + i)).is_ok());
        if all_free {
            return base;
        }
    }
    panic!("no {n} consecutive free ports");
}

fn serve(replicas: &[String]) -> Kvlb {
    let mut args = vec!["--explain", "--workers", "1", "--metrics-interval", "200ms"];
    for r in replicas {
        args.extend_from_slice(&["--replica", r]);
    }
    Kvlb::serve(&args)
}

fn by_url(kvlb: &Kvlb, url: &str) -> Value {
    replicas_json(kvlb)
        .into_iter()
        .find(|r| r["url"] == url)
        .unwrap_or_else(|| panic!("no replica {url} in {:?}", replicas_json(kvlb)))
}

fn stored(tokens: &[u32], first_hash: u64) -> KvEvent {
    KvEvent::BlockStored {
        block_hashes: (0..tokens.len() as u64 / 16)
            .map(|i| first_hash + i)
            .collect(),
        parent_block_hash: None,
        token_ids: tokens.to_vec(),
        block_size: 16,
        lora_id: None,
        key: Default::default(),
        medium: None,
    }
}

fn rank_batch(dp_rank: Option<i64>, event: KvEvent) -> KvEventBatch {
    KvEventBatch {
        ts: 0.0,
        events: vec![event],
        dp_rank,
    }
}

/// A replica with dp_size=2 is two candidates sharing the URL: requests with one long prefix
/// stay on one rank, which the replica is told by X-Data-Parallel-Rank (its per-engine
/// metrics count them there); each rank's events land on its own slot; /replicas and /metrics
/// name both ranks; the one /metrics scrape feeds both slots.
#[test]
fn one_url_two_ranks_routed_by_prefix() {
    let port = free_ports(4);
    let events = format!("tcp://127.0.0.1:{port}");
    let replay = format!("tcp://127.0.0.1:{}", port + 2);
    let reps = ReplicaFleet::start(
        1,
        &[
            "--time-scale",
            "50",
            "--dp-size",
            "2",
            "--kv-events",
            &events,
            "--kv-replay",
            &replay,
        ],
    );
    let http = reps.http[0];
    let kvlb = serve(&[format!(
        "http://{http},kv_events={events},kv_replay={replay},dp_size=2"
    )]);
    let name = |r: u32| format!("http://{http}#{r}");
    wait_subscribed(&kvlb);
    let list = replicas_json(&kvlb);
    assert_eq!(list.len(), 2, "{list:?}");
    for r in 0..2u32 {
        let entry = by_url(&kvlb, &name(r));
        assert_eq!(entry["rank"], r, "{entry}");
        assert_eq!(entry["address"], http.to_string(), "{entry}");
    }

    // One long prefix, several requests: one rank serves them all.
    let prefix = token_prompt(512, 1);
    let mut served = Vec::new();
    for i in 0..4u32 {
        let mut prompt = prefix.clone();
        prompt.extend(token_prompt(16, 100 + i));
        let r = post(kvlb.listen, "/v1/completions", &completion_body(&prompt));
        assert_eq!(r.status, 200, "{}", r.describe());
        served.push(r.header("x-kvlb-replica").unwrap_or("").to_string());
        if i == 0 {
            // The first request's blocks reach kvlb through its rank's events.
            let first = served[0].clone();
            assert!(
                wait_until(T, || by_url(&kvlb, &first)["telemetry"]["events_seen"]
                    .as_u64()
                    > Some(0)),
                "no events from {first}: {}",
                by_url(&kvlb, &first)
            );
        }
    }
    let chosen = served[0].clone();
    assert!(
        served.iter().all(|s| *s == chosen),
        "requests sharing a prefix went to {served:?}"
    );
    let rank: u32 = chosen
        .rsplit('#')
        .next()
        .and_then(|r| r.parse().ok())
        .unwrap_or_else(|| panic!("x-kvlb-replica {chosen:?} names no rank"));
    let other = name(1 - rank);

    // The header reached the replica: its engine `rank` served them, the other none.
    let replica_metrics = client::get(http, "/metrics").body_text();
    let served_on = |r: u32| {
        metric_sum(
            &replica_metrics,
            "vllm:request_success_total",
            &[&format!("engine=\"{r}\"")],
        )
        .unwrap_or(0.0)
    };
    assert_eq!(served_on(rank), 4.0, "{replica_metrics}");
    assert_eq!(served_on(1 - rank), 0.0, "{replica_metrics}");

    // Rank r's events landed on slot r only, none from the wrong rank.
    let mine = by_url(&kvlb, &chosen);
    let theirs = by_url(&kvlb, &other);
    assert!(mine["resident_blocks"].as_u64() >= Some(32), "{mine}");
    assert!(
        mine["telemetry"]["events_seen"].as_u64() > Some(0),
        "{mine}"
    );
    assert_eq!(theirs["telemetry"]["events_seen"], 0, "{theirs}");
    for r in [&mine, &theirs] {
        assert_eq!(r["telemetry"]["wrong_rank"], 0, "{r}");
    }

    // The one scrape of the URL feeds both ranks' slots.
    assert!(
        wait_until(T, || [&chosen, &other]
            .iter()
            .all(
                |u| by_url(&kvlb, u)["telemetry"]["scrapes"].as_u64() > Some(0)
            )),
        "scrapes: {:?}",
        replicas_json(&kvlb)
    );

    // /metrics names both ranks in the replica label.
    let text = kvlb.admin_get("/metrics").body_text();
    for r in 0..2 {
        let label = format!("replica=\"{}\"", name(r));
        assert!(
            metric_sum(&text, "kvlb_replica_kv_events_total", &[&label]).is_some(),
            "no kvlb_replica_kv_events_total for {label}:\n{text}"
        );
    }
    assert_eq!(
        metric_sum(&text, "kvlb_replica_kv_event_wrong_rank_total", &[]),
        Some(0.0)
    );
}

/// Rank 1's endpoint carrying rank 0's batches (ports not offset as kvlb assumes): counted
/// in wrong_rank, logged naming the replica, not applied; rank 1's own batches are. A
/// replica without dp_size (one rank of an externally balanced deployment, vLLM
/// --data-parallel-rank 3) takes batches of any rank.
#[test]
fn a_batch_of_another_rank_is_counted_not_applied() {
    let reps = ReplicaFleet::start(2, &["--time-scale", "50"]);
    let port = free_ports(2);
    let publishers: Vec<KvEventPublisher> = (0..2)
        .map(|r| {
            KvEventPublisher::bind(
                &format!("tcp://127.0.0.1:{}", port + r),
                None,
                "",
                EventFormat::Map,
            )
            .expect("bind a KV publisher")
        })
        .collect();
    let external = KvEventPublisher::bind("tcp://127.0.0.1:0", None, "", EventFormat::Map)
        .expect("bind a KV publisher");
    let kvlb = serve(&[
        format!(
            "http://{},kv_events=tcp://127.0.0.1:{port},dp_size=2,metrics=off",
            reps.http[0]
        ),
        format!(
            "http://{},kv_events=tcp://{},metrics=off",
            reps.http[1],
            external.local_addrs().0
        ),
    ]);
    assert!(
        wait_until(T, || publishers
            .iter()
            .chain([&external])
            .all(|p| p.subscribed_peers() > 0)),
        "kvlb did not subscribe:\n{}",
        kvlb.stderr()
    );
    let rank1 = format!("http://{}#1", reps.http[0]);
    let wrong = token_prompt(64, 2);
    publishers[1].publish(&rank_batch(Some(0), stored(&wrong, 1000)));
    assert!(
        wait_until(T, || by_url(&kvlb, &rank1)["telemetry"]["wrong_rank"] == 1),
        "{}",
        by_url(&kvlb, &rank1)
    );
    assert_eq!(by_url(&kvlb, &rank1)["resident_blocks"], 0);
    assert!(
        wait_until(T, || {
            kvlb.stderr().contains(&format!(
            "replica {rank1}: KV events: batch 0: data_parallel_rank 0, but this endpoint is rank 1's"
        ))
        }),
        "{}",
        kvlb.stderr()
    );
    assert_eq!(
        kvlb.metric(
            "kvlb_replica_kv_event_wrong_rank_total",
            &[&format!("replica=\"{rank1}\"")]
        ),
        Some(1.0)
    );
    publishers[1].publish(&rank_batch(Some(1), stored(&token_prompt(64, 3), 2000)));
    assert!(
        wait_until(T, || by_url(&kvlb, &rank1)["resident_blocks"] == 4),
        "rank 1's own batch not applied: {}",
        by_url(&kvlb, &rank1)
    );

    let plain = format!("http://{}", reps.http[1]);
    external.publish(&rank_batch(Some(3), stored(&token_prompt(64, 4), 3000)));
    assert!(
        wait_until(T, || by_url(&kvlb, &plain)["resident_blocks"] == 4),
        "a batch with data_parallel_rank 3 not applied on a replica without dp_size: {}",
        by_url(&kvlb, &plain)
    );
    assert_eq!(by_url(&kvlb, &plain)["telemetry"]["wrong_rank"], 0);
}

/// vLLM's own ZmqEventPublisher as DP rank 1, given rank 0's ports as vLLM is configured
/// (--kv-events-config endpoint tcp://*:P): it binds P + 1 itself, and kvlb's rank-1 slot of
/// `kv_events=tcp://127.0.0.1:P,dp_size=2` gets its blocks, rank 0 none.
#[test]
fn vllm_publisher_as_rank_1_feeds_rank_1() {
    let port = free_ports(4);
    let (p, q) = (port.to_string(), (port + 2).to_string());
    let mut vllm = EnginePublisher::start(
        Engine::Vllm,
        &["--dp-rank", "1", "--port", &p, "--replay-port", &q],
    );
    let reps = ReplicaFleet::start(1, &["--time-scale", "50"]);
    let http: SocketAddr = reps.http[0];
    let kvlb = serve(&[format!(
        "http://{http},kv_events=tcp://127.0.0.1:{port},kv_replay=tcp://127.0.0.1:{q},dp_size=2,metrics=off"
    )]);
    let rank1 = format!("http://{http}#1");
    let rank0 = format!("http://{http}#0");
    assert!(
        wait_until(T, || by_url(&kvlb, &rank1)["telemetry"]["events_connected"]
            == true),
        "kvlb's rank 1 did not connect to vLLM's rank-1 publisher: {}\n{}",
        by_url(&kvlb, &rank1),
        kvlb.stderr()
    );
    std::thread::sleep(Duration::from_millis(300));
    let tokens = token_prompt(64, 9);
    let deadline = std::time::Instant::now() + T;
    while by_url(&kvlb, &rank1)["resident_blocks"] != 4 && std::time::Instant::now() < deadline {
        vllm.publish(json!([{"type": "store", "tokens": tokens, "from": 0, "to": 4}]));
        std::thread::sleep(Duration::from_millis(200));
    }
    let one = by_url(&kvlb, &rank1);
    assert_eq!(one["resident_blocks"], 4, "{one}\n{}", kvlb.stderr());
    assert_eq!(one["telemetry"]["wrong_rank"], 0, "{one}");
    let zero = by_url(&kvlb, &rank0);
    assert_eq!(zero["resident_blocks"], 0, "{zero}");
    assert_eq!(zero["telemetry"]["events_connected"], false, "{zero}");
}

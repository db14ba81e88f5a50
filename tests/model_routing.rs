//! Routing by model: kvlb in front of `kvlb replica` processes serving different models (each
//! lists its names in GET /v1/models, as vLLM does) sends every request only to replicas
//! serving the model it names, answers GET /v1/models with the fleet's union, and answers a
//! model no replica serves with OpenAI's 404. Replicas whose models are not known (a plain
//! HTTP backend) take any model; names can be pinned per replica (`models=`); a replica
//! restarted with other models is followed.

#[path = "support/mod.rs"]
mod support;

use serde_json::{json, Value};
use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::time::Duration;
use support::client::HttpConn;
use support::fleet::{replicas_json, ReplicaFleet};
use support::{wait_until, Backend, Kvlb};

const T: Duration = Duration::from_secs(20);

/// `kvlb replica --count n --served-model-name NAMES...` (simulated time 50x).
fn fleet(n: usize, names: &[&str]) -> ReplicaFleet {
    fleet_with(n, names, &[])
}

fn fleet_with(n: usize, names: &[&str], extra: &[&str]) -> ReplicaFleet {
    let mut args = vec!["--time-scale", "50"];
    args.extend_from_slice(extra);
    args.push("--served-model-name");
    args.extend_from_slice(names);
    ReplicaFleet::start(n, &args)
}

fn url(a: &SocketAddr) -> String {
    format!("http://{a}")
}

/// `kvlb serve` in front of `replicas` (flag values), with `extra`.
fn serve(replicas: &[String], extra: &[&str]) -> Kvlb {
    let mut args: Vec<&str> = vec!["--workers", "2", "--health-interval", "200ms"];
    for r in replicas {
        args.push("--replica");
        args.push(r);
    }
    args.extend_from_slice(extra);
    Kvlb::serve(&args)
}

/// Waits until /replicas shows the names of every replica (`None`: not known).
fn wait_models(kvlb: &Kvlb, want: &[Option<&[&str]>]) {
    let shown = || -> Vec<Value> {
        replicas_json(kvlb)
            .iter()
            .map(|r| r["models"].clone())
            .collect()
    };
    let expected: Vec<Value> = want
        .iter()
        .map(|w| w.map_or(Value::Null, |names| json!(names)))
        .collect();
    assert!(
        wait_until(T, || shown() == expected),
        "models shown {:?}, want {expected:?}; kvlb said:\n{}",
        shown(),
        kvlb.stderr()
    );
}

fn chat(model: &str, text: &str) -> Vec<u8> {
    chat_tokens(model, text, 2)
}

/// A chat request for `max_tokens` tokens.
fn chat_tokens(model: &str, text: &str, max_tokens: u32) -> Vec<u8> {
    json!({
        "model": model,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": max_tokens,
    })
    .to_string()
    .into_bytes()
}

fn post(conn: &mut HttpConn, path: &str, body: &[u8]) -> support::Response {
    conn.request("POST", path, &[("Content-Type", "application/json")], body)
        .unwrap_or_else(|e| panic!("POST {path}: {e}"))
}

#[test]
fn two_models_on_disjoint_replicas_never_cross() {
    let big = fleet(2, &["big"]);
    let small = fleet(2, &["small"]);
    let urls: Vec<String> = big.http.iter().chain(&small.http).map(url).collect();
    let kvlb = serve(&urls, &["--explain"]);
    wait_models(
        &kvlb,
        &[
            Some(&["big"]),
            Some(&["big"]),
            Some(&["small"]),
            Some(&["small"]),
        ],
    );
    let serving = |model: &str| -> BTreeSet<String> {
        let fleet = if model == "big" { &big } else { &small };
        fleet.http.iter().map(url).collect()
    };
    let mut conn = HttpConn::connect(kvlb.listen);
    let mut seen: BTreeSet<String> = BTreeSet::new();
    // A shared preamble: cache_aware would follow its holder if models did not bound it.
    let preamble = "You are a careful assistant. ".repeat(40);
    for i in 0..24 {
        let model = if i % 3 == 0 { "small" } else { "big" };
        let r = post(
            &mut conn,
            "/v1/chat/completions",
            &chat(model, &format!("{preamble} question {i}")),
        );
        assert_eq!(r.status, 200, "{}", r.describe());
        let replica = r.header("x-kvlb-replica").unwrap().to_string();
        assert!(
            serving(model).contains(&replica),
            "a {model} request went to {replica}"
        );
        assert_eq!(r.json().unwrap()["model"], model);
        seen.insert(replica);
    }
    // Each model's requests stayed within its replicas, which served them all.
    assert!(
        seen.iter().any(|r| serving("big").contains(r))
            && seen.iter().any(|r| serving("small").contains(r)),
        "{seen:?}"
    );
    // No model named: any replica (and each answers with its own).
    let r = post(
        &mut conn,
        "/v1/completions",
        br#"{"prompt":"no model here","max_tokens":1}"#,
    );
    assert_eq!(r.status, 200, "{}", r.describe());

    // The union, each name once, without asking the replicas per request.
    let list = kvlb.get("/v1/models");
    assert_eq!(list.status, 200, "{}", list.describe());
    let v = list.json().unwrap();
    let ids: Vec<&str> = v["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["big", "small"]);
    assert_eq!(v["object"], "list");
    let one = kvlb.get("/v1/models/small");
    assert_eq!(one.status, 200, "{}", one.describe());
    assert_eq!(one.json().unwrap()["id"], "small");
    let metrics = kvlb.admin_get("/metrics").body_text();
    assert!(
        metrics.contains("kvlb_model_replicas{model=\"big\"} 2"),
        "{metrics}"
    );
}

#[test]
fn a_model_no_replica_serves_is_openais_404_and_the_connection_lives() {
    let big = fleet(1, &["big"]);
    let kvlb = serve(&[url(&big.http[0])], &[]);
    wait_models(&kvlb, &[Some(&["big"])]);
    let mut conn = HttpConn::connect(kvlb.listen);
    for (path, body) in [
        ("/v1/chat/completions", chat("gpt-4o", "hi")),
        (
            "/v1/completions",
            br#"{"model":"gpt-4o","prompt":"hi"}"#.to_vec(),
        ),
        (
            "/v1/embeddings",
            br#"{"input":"hi","model":"gpt-4o"}"#.to_vec(),
        ),
    ] {
        let r = post(&mut conn, path, &body);
        assert_eq!(r.status, 404, "{path}: {}", r.describe());
        assert!(r.header("x-kvlb-replica").is_none(), "{}", r.describe());
        let v = r.json().unwrap();
        assert_eq!(
            v["error"]["message"], "The model `gpt-4o` does not exist.",
            "{v}"
        );
        assert_eq!(v["error"]["type"], "invalid_request_error");
        assert_eq!(v["error"]["code"], "model_not_found");
        assert_eq!(v["error"]["param"], "model");
    }
    // The same connection carries on.
    let r = post(&mut conn, "/v1/chat/completions", &chat("big", "hi"));
    assert_eq!(r.status, 200, "{}", r.describe());
    let nope = kvlb.get("/v1/models/nope");
    assert_eq!(nope.status, 404, "{}", nope.describe());
    assert_eq!(nope.json().unwrap()["error"]["code"], "model_not_found");
    assert_eq!(kvlb.metric("kvlb_model_not_found_total", &[]), Some(3.0));
}

#[test]
fn aliases_and_pinned_names_overlap_replicas() {
    // Replica 0 serves big; replica 1 serves big under a second name too (vLLM's
    // --served-model-name list); replica 2 answers no list and is pinned to "small".
    let one = fleet(1, &["big"]);
    let two = fleet(1, &["big", "big-latest"]);
    let backend = Backend::start();
    let urls = [
        url(&one.http[0]),
        url(&two.http[0]),
        format!("{},models=small", backend.url().trim_end_matches('/')),
    ];
    let kvlb = serve(&urls, &["--policy", "round_robin"]);
    wait_models(
        &kvlb,
        &[
            Some(&["big"]),
            Some(&["big", "big-latest"]),
            Some(&["small"]),
        ],
    );
    let mut conn = HttpConn::connect(kvlb.listen);
    let mut went = |model: &str| -> BTreeSet<String> {
        (0..6)
            .map(|i| {
                let r = post(
                    &mut conn,
                    "/v1/completions",
                    format!(r#"{{"model":"{model}","prompt":"p{i}","max_tokens":1}}"#).as_bytes(),
                );
                r.header("x-kvlb-replica").unwrap().to_string()
            })
            .collect()
    };
    assert_eq!(
        went("big"),
        BTreeSet::from([urls[0].clone(), urls[1].clone()])
    );
    assert_eq!(went("big-latest"), BTreeSet::from([urls[1].clone()]));
    assert_eq!(
        went("small"),
        BTreeSet::from([backend.url().trim_end_matches('/').to_string()])
    );
}

#[test]
fn a_replica_listing_no_models_takes_any_model() {
    let big = fleet(1, &["big"]);
    let backend = Backend::start();
    let plain = backend.url().trim_end_matches('/').to_string();
    let kvlb = serve(&[url(&big.http[0]), plain.clone()], &[]);
    wait_models(&kvlb, &[Some(&["big"]), None]);
    assert!(
        kvlb.stderr().contains("it takes requests for any model"),
        "{}",
        kvlb.stderr()
    );
    let mut conn = HttpConn::connect(kvlb.listen);
    for _ in 0..4 {
        // Not big: only the replica whose models are not known may serve it.
        let r = post(&mut conn, "/echo", br#"{"model":"other","input":"x"}"#);
        assert_eq!(
            r.header("x-kvlb-replica"),
            Some(plain.as_str()),
            "{}",
            r.describe()
        );
    }
    assert!(kvlb.metric("kvlb_model_list_failures_total", &[]).unwrap() >= 1.0);
}

#[test]
fn a_replica_restarted_with_other_models_is_followed() {
    let first = fleet(1, &["big"]);
    let addr = first.http[0];
    let kvlb = serve(&[url(&addr)], &["--models-refresh", "300ms"]);
    wait_models(&kvlb, &[Some(&["big"])]);
    drop(first);
    let listen = addr.to_string();
    let _second = ReplicaFleet::start(
        1,
        &[
            "--listen",
            &listen,
            "--time-scale",
            "50",
            "--served-model-name",
            "small",
        ],
    );
    wait_models(&kvlb, &[Some(&["small"])]);
    let mut conn = HttpConn::connect(kvlb.listen);
    let r = post(&mut conn, "/v1/chat/completions", &chat("small", "hi"));
    assert_eq!(r.status, 200, "{}", r.describe());
    let r = post(&mut conn, "/v1/chat/completions", &chat("big", "hi"));
    assert_eq!(r.status, 404, "{}", r.describe());
    assert!(kvlb.stderr().contains("serves small"), "{}", kvlb.stderr());
}

#[test]
fn models_refresh_off_takes_any_model_everywhere() {
    let big = fleet(1, &["big"]);
    let kvlb = serve(&[url(&big.http[0])], &["--models-refresh", "off"]);
    std::thread::sleep(Duration::from_millis(300));
    wait_models(&kvlb, &[None]);
    // kvlb does not answer for the replica: the replica's own 404.
    let mut conn = HttpConn::connect(kvlb.listen);
    let r = post(&mut conn, "/v1/chat/completions", &chat("gpt-4o", "hi"));
    assert_eq!(r.status, 404, "{}", r.describe());
    assert!(r.header("x-kvlb-replica").is_some(), "{}", r.describe());
    assert!(kvlb.metric("kvlb_model_not_found_total", &[]) == Some(0.0));
}

/// The official `openai` client lists the fleet's models through kvlb, uses each, and sees
/// an unknown model as its NotFoundError.
#[test]
fn the_openai_client_lists_and_uses_models_through_kvlb() {
    let big = fleet(1, &["big"]);
    let small = fleet(1, &["small"]);
    let kvlb = serve(&[url(&big.http[0]), url(&small.http[0])], &[]);
    wait_models(&kvlb, &[Some(&["big"]), Some(&["small"])]);
    let script = r#"
import sys, openai
c = openai.OpenAI(base_url=sys.argv[1], api_key="unused", max_retries=0, timeout=30)
ids = [m.id for m in c.models.list().data]
assert ids == ["big", "small"], ids
for m in ids:
    r = c.chat.completions.create(model=m, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert r.model == m, (r.model, m)
try:
    c.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])
    raise SystemExit("no error for an unknown model")
except openai.NotFoundError as e:
    assert e.code == "model_not_found", e.body
print("ok")
"#;
    let out = std::process::Command::new(support::backend::python())
        .args(["-c", script, &kvlb.url("/v1")])
        .output()
        .expect("run python");
    assert!(
        out.status.success() && String::from_utf8_lossy(&out.stdout).contains("ok"),
        "stdout: {}\nstderr: {}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// `lora_adapter`: 32 concurrent first requests for an adapter no replica has loaded wait for
/// one load, on one replica of its base model, and all go there.
#[test]
fn an_adapter_is_loaded_on_demand_once_for_32_concurrent_first_requests() {
    // vLLM serves /v1/load_lora_adapter only with this set; the replicas inherit it.
    std::env::set_var("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "true");
    let base = fleet_with(2, &["big"], &["--enable-lora"]);
    let small = fleet(1, &["small"]);
    let mut urls: Vec<String> = base.http.iter().map(url).collect();
    urls.push(url(&small.http[0]));
    let kvlb = serve(
        &urls,
        &[
            "--lora-adapter",
            "sql=/adapters/sql,base=big",
            "--lora-adapter",
            "far=/adapters/far,base=medium",
        ],
    );
    wait_models(&kvlb, &[Some(&["big"]), Some(&["big"]), Some(&["small"])]);
    let barrier = std::sync::Arc::new(std::sync::Barrier::new(32));
    let listen = kvlb.listen;
    let threads: Vec<_> = (0..32)
        .map(|i| {
            let barrier = barrier.clone();
            std::thread::spawn(move || {
                let mut conn = HttpConn::connect(listen);
                barrier.wait();
                let r = post(
                    &mut conn,
                    "/v1/chat/completions",
                    &chat("sql", &format!("query {i}")),
                );
                (
                    r.status,
                    r.header("x-kvlb-replica").map(str::to_string),
                    r.describe(),
                )
            })
        })
        .collect();
    let mut went = BTreeSet::new();
    for t in threads {
        let (status, replica, describe) = t.join().unwrap();
        assert_eq!(status, 200, "{describe}\nkvlb said:\n{}", kvlb.stderr());
        went.insert(replica.unwrap());
    }
    assert_eq!(went.len(), 1, "{went:?}");
    let loaded_on = went.into_iter().next().unwrap();
    assert!(urls[..2].contains(&loaded_on), "{loaded_on}");
    assert_eq!(
        kvlb.metric(
            "kvlb_lora_loads_total",
            &["adapter=\"sql\"", "result=\"ok\""]
        ),
        Some(1.0),
        "{}",
        kvlb.stderr()
    );
    // The replica lists it now, and kvlb's map follows: later requests go there by name.
    let i = urls.iter().position(|u| *u == loaded_on).unwrap();
    let mut want: Vec<Option<&[&str]>> = vec![Some(&["big"]), Some(&["big"]), Some(&["small"])];
    want[i] = Some(&["big", "sql"]);
    wait_models(&kvlb, &want);
    let mut conn = HttpConn::connect(kvlb.listen);
    let r = post(&mut conn, "/v1/chat/completions", &chat("sql", "again"));
    assert_eq!(r.header("x-kvlb-replica"), Some(loaded_on.as_str()));
    // An adapter of a base no replica serves: 503, saying why.
    let r = post(&mut conn, "/v1/chat/completions", &chat("far", "x"));
    assert_eq!(r.status, 503, "{}", r.describe());
    assert!(
        r.body_text().contains("no replica serving medium"),
        "{}",
        r.describe()
    );
    assert_eq!(
        kvlb.metric(
            "kvlb_lora_loads_total",
            &["adapter=\"sql\"", "result=\"ok\""]
        ),
        Some(1.0)
    );
}

/// A loaded adapter keeps its requests while its replica is idle (a replica without it pays
/// the load), and spreads to a second replica of its base once the first one's queue costs
/// more than a load.
#[test]
fn a_busy_adapter_spreads_to_a_second_replica_of_its_base() {
    std::env::set_var("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "true");
    // Real time: a prompt of thousands of tokens takes a tenth of a second to prefill.
    let base = fleet_with(2, &["big"], &["--enable-lora", "--time-scale", "1"]);
    let urls: Vec<String> = base.http.iter().map(url).collect();
    let kvlb = serve(
        &urls,
        &[
            "--lora-adapter",
            "sql=/adapters/sql,base=big",
            "--lora-load-s",
            "0.005",
        ],
    );
    wait_models(&kvlb, &[Some(&["big"]), Some(&["big"])]);
    let loads = || {
        kvlb.metric(
            "kvlb_lora_loads_total",
            &["adapter=\"sql\"", "result=\"ok\""],
        )
        .unwrap_or(0.0)
    };
    let mut conn = HttpConn::connect(kvlb.listen);
    let first = post(&mut conn, "/v1/chat/completions", &chat("sql", "one"));
    assert_eq!(first.status, 200, "{}", first.describe());
    let holder = first.header("x-kvlb-replica").unwrap().to_string();
    // One at a time: the holder is never busy, so no request pays a second load.
    for i in 0..5 {
        let r = post(
            &mut conn,
            "/v1/chat/completions",
            &chat("sql", &format!("q{i}")),
        );
        assert_eq!(r.header("x-kvlb-replica"), Some(holder.as_str()));
    }
    assert_eq!(loads(), 1.0);
    // Sixteen long prompts at once: the holder's prefill queue soon costs more than a load.
    let listen = kvlb.listen;
    let threads: Vec<_> = (0..16)
        .map(|i| {
            std::thread::spawn(move || {
                let mut conn = HttpConn::connect(listen);
                let text = format!("document {i}: ") + &format!("line {i} of many. ").repeat(800);
                let body = chat_tokens("sql", &text, 4);
                let r = post(&mut conn, "/v1/chat/completions", &body);
                (r.status, r.header("x-kvlb-replica").map(str::to_string))
            })
        })
        .collect();
    let mut went = BTreeSet::new();
    for t in threads {
        let (status, replica) = t.join().unwrap();
        assert_eq!(status, 200, "kvlb said:\n{}", kvlb.stderr());
        went.insert(replica.unwrap());
    }
    assert_eq!(went.len(), 2, "{went:?}");
    // Loaded once more, on the other replica, however many requests went there.
    assert_eq!(loads(), 2.0, "{}", kvlb.stderr());
}

/// `n` replicas of `big` with adapters `sql` and `chat` and one LoRA batch slot, in real time
/// (a request of 300 tokens holds its slot for seconds).
fn one_slot_fleet(n: usize) -> ReplicaFleet {
    fleet_with(
        n,
        &["big"],
        &[
            "--time-scale",
            "1",
            "--enable-lora",
            "--max-loras",
            "1",
            "--lora-modules",
            "sql=/adapters/sql",
            "chat=/adapters/chat",
        ],
    )
}

/// vLLM runs the requests of at most `--max-loras` adapters in one batch: while another
/// adapter's request holds a replica's only slot, a request for `sql` would wait there for the
/// whole of it. kvlb reads the slots from the replica's `vllm:lora_requests_info` and sends
/// the request to the other replica, though the busy one holds its prompt; once the slot is
/// free the wait is no longer priced.
#[test]
fn a_replica_whose_lora_slots_are_held_by_another_adapter_loses_its_hit() {
    let base = one_slot_fleet(2);
    let urls: Vec<String> = base.http.iter().map(url).collect();
    // No KV events here: the scrape is asked for.
    let specs: Vec<String> = urls.iter().map(|u| format!("{u},metrics=on")).collect();
    let kvlb = serve(&specs, &["--explain", "--metrics-interval", "100ms"]);
    let names: &[&str] = &["big", "sql", "chat"];
    wait_models(&kvlb, &[Some(names), Some(names)]);
    let prompt = "Schema: ".to_string() + &"CREATE TABLE t (id int, name text); ".repeat(300);
    let ask = |conn: &mut HttpConn, n: usize| {
        let r = post(
            conn,
            "/v1/chat/completions",
            &chat("sql", &format!("{prompt} question {n}")),
        );
        assert_eq!(r.status, 200, "{}", r.describe());
        r
    };
    let mut conn = HttpConn::connect(kvlb.listen);
    let holder = ask(&mut conn, 0)
        .header("x-kvlb-replica")
        .unwrap()
        .to_string();
    let (busy, other) = match holder == urls[0] {
        true => (base.http[0], &urls[1]),
        false => (base.http[1], &urls[0]),
    };
    // The prompt's holder keeps it while its slot is free.
    let r = ask(&mut conn, 1);
    assert_eq!(r.header("x-kvlb-replica"), Some(holder.as_str()));
    let active = |kvlb: &Kvlb| {
        kvlb.metric(
            "kvlb_replica_lora_adapters_active",
            &[&format!("replica=\"{holder}\"")],
        )
    };
    assert!(
        wait_until(T, || active(&kvlb) == Some(0.0)),
        "kvlb read no LoRA slots from {holder}: {:?}\n{}",
        kvlb.metric("kvlb_replica_lora_slots", &[]),
        kvlb.stderr()
    );
    assert_eq!(
        kvlb.metric(
            "kvlb_replica_lora_slots",
            &[&format!("replica=\"{holder}\"")]
        ),
        Some(1.0)
    );
    // Another client's `chat` request takes the holder's one slot for 300 tokens.
    let long = std::thread::spawn(move || {
        let mut direct = HttpConn::connect(busy);
        direct.set_read_timeout(Duration::from_secs(60));
        let body = chat_tokens("chat", "tell a long story", 300);
        let started = std::time::Instant::now();
        let r = post(&mut direct, "/v1/chat/completions", &body);
        assert_eq!(r.status, 200, "{}", r.describe());
        started.elapsed()
    });
    assert!(
        wait_until(T, || active(&kvlb) == Some(1.0)),
        "the slot held on {holder} never showed: {:?}",
        active(&kvlb)
    );
    let sent = std::time::Instant::now();
    let r = ask(&mut conn, 2);
    let took = sent.elapsed();
    assert_eq!(
        r.header("x-kvlb-replica"),
        Some(other.as_str()),
        "{}",
        r.header("x-kvlb-decision").unwrap_or_default()
    );
    let story = long.join().unwrap();
    assert!(
        took < story / 2,
        "the request took {took:?}, the story {story:?}"
    );
    // While the slot was held, the holder's estimate carried the wait for it (seconds); both
    // replicas hold the prompt now, and once the slot is free neither estimate does.
    let runner_up_ms = |r: &support::Response| -> f64 {
        let d = r.header("x-kvlb-decision").unwrap_or_default().to_string();
        let v = d.split("runner_up_ttft_ms=").nth(1).unwrap_or("");
        v.split(';')
            .next()
            .unwrap_or("")
            .trim()
            .parse()
            .unwrap_or(f64::NAN)
    };
    assert!(
        runner_up_ms(&r) > 1000.0,
        "{:?}",
        r.header("x-kvlb-decision")
    );
    assert!(wait_until(T, || active(&kvlb) == Some(0.0)));
    let r = ask(&mut conn, 3);
    assert!(
        runner_up_ms(&r) < 1000.0,
        "{:?}",
        r.header("x-kvlb-decision")
    );
    assert_eq!(
        r.header("x-kvlb-decision")
            .map(|d| d.contains("reason=cache")),
        Some(true)
    );
    assert_eq!(kvlb.metric("kvlb_lora_slot_waits_total", &[]), Some(0.0));
}

/// kvlb counts its own adapter requests at once, not at the next scrape: right after a
/// scrape that saw no adapter running (scrapes 5 s apart), a request for `sql` sent while
/// kvlb's own `chat` request holds the replica's one slot is counted as waiting for it.
#[test]
fn kvlbs_own_adapter_requests_fill_the_slots_before_any_scrape_shows_them() {
    let base = one_slot_fleet(1);
    let spec = format!("{},metrics=on", url(&base.http[0]));
    let kvlb = serve(&[spec], &["--metrics-interval", "5s"]);
    wait_models(&kvlb, &[Some(&["big", "sql", "chat"])]);
    let waits = || kvlb.metric("kvlb_lora_slot_waits_total", &[]);
    let mut conn = HttpConn::connect(kvlb.listen);
    // The engine reports its slots from its first step on.
    let r = post(&mut conn, "/v1/chat/completions", &chat("sql", "warm up"));
    assert_eq!(r.status, 200, "{}", r.describe());
    assert_eq!(waits(), Some(0.0));
    let slots = || kvlb.metric("kvlb_replica_lora_slots", &[]);
    assert!(wait_until(T, || slots() == Some(1.0)), "{}", kvlb.stderr());
    assert_eq!(
        kvlb.metric("kvlb_replica_lora_adapters_active", &[]),
        Some(0.0)
    );
    let listen = kvlb.listen;
    let long = std::thread::spawn(move || {
        let mut conn = HttpConn::connect(listen);
        conn.set_read_timeout(Duration::from_secs(60));
        let body = chat_tokens("chat", "tell a long story", 200);
        post(&mut conn, "/v1/chat/completions", &body).status
    });
    assert!(wait_until(T, || replicas_json(&kvlb)[0]["in_flight"]
        .as_u64()
        == Some(1)));
    // Its own chat request holds the slot: a second chat request would join it, sql waits.
    let r = post(&mut conn, "/v1/chat/completions", &chat("sql", "now"));
    assert_eq!(r.status, 200, "{}", r.describe());
    assert_eq!(waits(), Some(1.0), "{}", kvlb.stderr());
    assert_eq!(long.join().unwrap(), 200);
    // Both ended: the slot is free, as kvlb counts it.
    let r = post(&mut conn, "/v1/chat/completions", &chat("sql", "later"));
    assert_eq!(r.status, 200, "{}", r.describe());
    assert_eq!(waits(), Some(1.0));
}

/// `[[model]]` tables: a model's own policy, concurrency limit and response timeout, which
/// its aliases without a table do not take; and the per-model metrics, unknown names under
/// `other`.
#[test]
fn model_tables_set_policy_limits_and_timeouts_and_metrics_are_by_model() {
    let big = fleet(2, &["big"]);
    let mid = fleet(2, &["mid"]);
    // Real time: a 150-token answer takes over a second.
    let slow = ReplicaFleet::start(
        1,
        &[
            "--time-scale",
            "1",
            "--served-model-name",
            "small",
            "small-alias",
        ],
    );
    let dir = support::TempDir::new("model-tables");
    let file = dir.file("kvlb.toml");
    std::fs::write(
        &file,
        r#"
queue_size = 0

[[model]]
name = "big"
policy = "round_robin"

[[model]]
name = ["small"]
max_in_flight = 1
upstream_timeout = "300ms"
cost_model = { prefill_s_per_token = 0.0001 }
"#,
    )
    .unwrap();
    let mut urls: Vec<String> = big.http.iter().chain(&mid.http).map(url).collect();
    urls.push(url(&slow.http[0]));
    let kvlb = serve(&urls, &["--config", file.to_str().unwrap()]);
    wait_models(
        &kvlb,
        &[
            Some(&["big"]),
            Some(&["big"]),
            Some(&["mid"]),
            Some(&["mid"]),
            Some(&["small", "small-alias"]),
        ],
    );
    let mut conn = HttpConn::connect(kvlb.listen);
    let preamble = "You are a careful assistant. ".repeat(40);
    let went = |conn: &mut HttpConn, model: &str| -> BTreeSet<String> {
        (0..6)
            .map(|_| {
                let r = post(conn, "/v1/chat/completions", &chat(model, &preamble));
                assert_eq!(r.status, 200, "{}", r.describe());
                r.header("x-kvlb-replica").unwrap().to_string()
            })
            .collect()
    };
    // The same prompt: round_robin for big spreads it, cache_aware for mid follows its holder
    // (once the routing of its first request is in the residency index).
    assert_eq!(went(&mut conn, "big").len(), 2);
    let r = post(&mut conn, "/v1/chat/completions", &chat("mid", &preamble));
    let holder = r.header("x-kvlb-replica").unwrap().to_string();
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(went(&mut conn, "mid"), BTreeSet::from([holder]));

    let long = |model: &str, stream: bool| -> Vec<u8> {
        json!({
            "model": model,
            "messages": [{"role": "user", "content": "count slowly"}],
            "max_tokens": 150,
            "stream": stream,
        })
        .to_string()
        .into_bytes()
    };
    // small's 300 ms timeout: its answer takes longer (504); small-alias has no table.
    let r = post(&mut conn, "/v1/chat/completions", &long("small", false));
    assert_eq!(r.status, 504, "{}", r.describe());
    let mut conn = HttpConn::connect(kvlb.listen);
    let r = post(
        &mut conn,
        "/v1/chat/completions",
        &long("small-alias", false),
    );
    assert_eq!(r.status, 200, "{}", r.describe());

    // small's limit of one request in flight per replica, with no queue: 429 while one runs.
    let listen = kvlb.listen;
    let busy = std::thread::spawn(move || {
        let mut conn = HttpConn::connect(listen);
        post(
            &mut conn,
            "/v1/chat/completions",
            &long("small-alias", true),
        )
        .status
    });
    assert!(
        wait_until(T, || kvlb.metric(
            "kvlb_replica_in_flight",
            &[&format!("replica=\"{}\"", urls[4])]
        ) == Some(1.0)),
        "the streaming request never got in flight"
    );
    let mut conn = HttpConn::connect(kvlb.listen);
    let r = post(&mut conn, "/v1/chat/completions", &chat("small", "x"));
    assert_eq!(r.status, 429, "{}", r.describe());
    // The alias has no limit of its own.
    let r = post(&mut conn, "/v1/chat/completions", &chat("small-alias", "x"));
    assert_eq!(r.status, 200, "{}", r.describe());
    assert_eq!(busy.join().unwrap(), 200);
    let r = post(&mut conn, "/v1/chat/completions", &chat("nope", "x"));
    assert_eq!(r.status, 404, "{}", r.describe());

    let text = kvlb.admin_get("/metrics").body_text();
    let m = |name: &str, labels: &[&str]| support::proxy::metric_sum(&text, name, labels);
    let requests = "kvlb_model_requests_total";
    assert_eq!(
        m(requests, &["model=\"big\"", "status=\"2xx\""]),
        Some(6.0),
        "{text}"
    );
    assert_eq!(m(requests, &["model=\"mid\"", "status=\"2xx\""]), Some(7.0));
    assert_eq!(
        m(requests, &["model=\"small\"", "status=\"5xx\""]),
        Some(1.0)
    );
    assert_eq!(
        m(requests, &["model=\"small\"", "status=\"4xx\""]),
        Some(1.0)
    );
    assert_eq!(
        m(requests, &["model=\"small-alias\"", "status=\"2xx\""]),
        Some(3.0)
    );
    assert_eq!(
        m(requests, &["model=\"other\"", "status=\"4xx\""]),
        Some(1.0)
    );
    let ttft = "kvlb_model_time_to_first_token_seconds_count";
    assert_eq!(m(ttft, &["model=\"big\""]), Some(6.0), "{text}");
    // mid's repeated prompt was found resident after its first request.
    let prompt = m("kvlb_model_prompt_tokens_total", &["model=\"mid\""]).unwrap();
    let matched = m("kvlb_model_matched_tokens_total", &["model=\"mid\""]).unwrap();
    assert!(
        prompt > 0.0 && matched >= prompt / 2.0,
        "{matched} of {prompt}"
    );
    assert_eq!(
        m("kvlb_model_matched_tokens_total", &["model=\"big\""]),
        Some(0.0)
    );

    // A reload rereads the tables: big follows its prefix now, under the global cache_aware.
    std::fs::write(&file, "[[model]]\nname = \"small\"\nmax_in_flight = 1\n").unwrap();
    // Safety: signalling the child we started.
    assert_eq!(
        unsafe { libc::kill(kvlb.pid() as libc::pid_t, libc::SIGHUP) },
        0
    );
    assert!(
        wait_until(T, || kvlb.stderr().contains("1 [[model]] tables")),
        "{}",
        kvlb.stderr()
    );
    let mut conn = HttpConn::connect(kvlb.listen);
    let text = format!("{preamble} after the reload");
    let r = post(&mut conn, "/v1/chat/completions", &chat("big", &text));
    let holder = r.header("x-kvlb-replica").unwrap().to_string();
    std::thread::sleep(Duration::from_millis(300));
    let again: BTreeSet<String> = (0..4)
        .map(|_| {
            let r = post(&mut conn, "/v1/chat/completions", &chat("big", &text));
            r.header("x-kvlb-replica").unwrap().to_string()
        })
        .collect();
    assert_eq!(again, BTreeSet::from([holder]));
}

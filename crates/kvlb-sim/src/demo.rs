//! `kvlb demo`: start a simulated fleet (`kvlb replica --count N`) and, for each policy in turn,
//! `kvlb serve` in front of it; replay agent-style sessions (a long shared system prompt and tool
//! schema, a task per session, histories that grow turn by turn) through it with streaming
//! requests; print time to first token and the replicas' prefix-cache hit rate per policy, side
//! by side with round-robin measured in the same run. Nothing to configure.

use crate::replay::client::{self, http};
use crate::replay::counters::EngineCounters;
use crate::replay::Api;
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Compare routing policies on a simulated fleet, end to end.
///
/// Starts a simulated fleet (`kvlb replica --count N`) and, for each policy in turn, `kvlb
/// serve` in front of it; replays agent-style sessions through it with streaming requests and
/// prints time to first token and the replicas' prefix-cache hit rate per policy, side by side
/// with round-robin measured in the same run.
#[derive(Debug, Clone, PartialEq, clap::Parser)]
#[command(
    name = "kvlb demo",
    args_override_self = true,
    mut_args = crate::cli::hyphen_values
)]
pub struct Opts {
    /// Simulated replicas
    #[arg(long, value_name = "N", default_value_t = 4, value_parser = crate::cli::int::<usize, 1, 64>)]
    pub replicas: usize,
    /// Agent sessions
    #[arg(long, value_name = "N", default_value_t = 32,
          value_parser = crate::cli::int::<usize, 1, 10_000>)]
    pub sessions: usize,
    /// Turns per session
    #[arg(long, value_name = "N", default_value_t = 5, value_parser = crate::cli::int::<usize, 1, 100>)]
    pub turns: usize,
    /// Sessions in flight at once
    #[arg(long, value_name = "N", default_value_t = 12,
          value_parser = crate::cli::int::<usize, 1, 1024>)]
    pub concurrency: usize,
    /// Simulated engine speed-up (at 10 and more on two cores, the client threads and the
    /// replicas compete for the CPU and the engines' times are mostly CPU queueing)
    #[arg(long, value_name = "X", default_value_t = 3.0, value_parser = time_scale)]
    pub time_scale: f64,
    /// Comma-separated policies
    #[arg(long, value_name = "LIST", default_value = "cache_aware,round_robin,least_loaded",
          value_parser = policy_list)]
    pub policies: PolicyList,
    /// Models on the fleet: 1, or 2 (sim-8b on the first half of the replicas, sim-70b,
    /// prefilling 4x slower, on the rest; sessions alternate between them, and kvlb is given
    /// sim-70b's timing in a [[model]] table)
    #[arg(long, value_name = "N", default_value_t = 1, value_parser = crate::cli::int::<usize, 1, 2>)]
    pub models: usize,
    /// Per-replica speed factors of a mixed fleet, passed to kvlb replica --speed: one for all
    /// replicas or one per replica of --replicas (with --models 2 the sim-8b replicas first),
    /// each X (prefill and decode X times the model's speed; 0.333 = three times slower) or
    /// PxD (prefill speed P, decode speed D, e.g. 0.33x0.5), from 0.01 to 100
    #[arg(long, value_name = "LIST", default_value = crate::engine::SpeedList::DEFAULT,
          value_parser = crate::engine::SpeedList::parse)]
    pub speeds: crate::engine::SpeedList,
    /// The API the sessions speak
    #[arg(long, value_enum, default_value_t = DemoApi::Chat)]
    pub api: DemoApi,
    /// Print every request: session, turn, replica, TTFT and kvlb's decision
    #[arg(long)]
    pub verbose: bool,
}

/// `kvlb demo --api`.
#[derive(Debug, Clone, Copy, PartialEq, clap::ValueEnum)]
pub enum DemoApi {
    /// /v1/chat/completions: the system prompt and the history as chat messages; TTFT at the
    /// first event
    Chat,
    /// /v1/responses (OpenAI's Responses API): the system prompt as instructions, the history
    /// as input items, store false; TTFT at the first response.output_text.delta
    Responses,
    /// /v1/messages (Anthropic's Messages API): the system prompt as system, the history as
    /// messages; TTFT at the first text content_block_delta
    Messages,
}

impl DemoApi {
    /// The replayer's name for it (how its stream is read).
    pub fn api(self) -> Api {
        match self {
            DemoApi::Chat => Api::Chat,
            DemoApi::Responses => Api::Responses,
            DemoApi::Messages => Api::Messages,
        }
    }

    fn path(self) -> &'static str {
        match self {
            DemoApi::Chat => "/v1/chat/completions",
            DemoApi::Responses => "/v1/responses",
            DemoApi::Messages => "/v1/messages",
        }
    }

    /// The request body of one turn: `system` the system prompt, `conversation` the session's
    /// messages after it (`{"role", "content"}` objects, comma-separated).
    fn body(self, model: &str, system: &str, tools: &Tools, conversation: &str) -> String {
        let system = json_str(system);
        match self {
            DemoApi::Chat => format!(
                r#"{{"model":"{model}","stream":true,"max_tokens":24,"tools":{TOOLS},"messages":[{{"role":"system","content":{system}}},{conversation}]}}"#
            ),
            DemoApi::Responses => format!(
                r#"{{"model":"{model}","stream":true,"store":false,"max_output_tokens":24,"instructions":{system},"tools":{},"input":[{conversation}]}}"#,
                tools.responses
            ),
            DemoApi::Messages => format!(
                r#"{{"model":"{model}","stream":true,"max_tokens":24,"system":{system},"tools":{},"messages":[{conversation}]}}"#,
                tools.messages
            ),
        }
    }

    /// The text an answer's events carry.
    fn answer_text(self, body: &str) -> String {
        let mut content = String::new();
        for line in body.lines() {
            let Some(data) = line.strip_prefix("data: ") else {
                continue;
            };
            let Ok(v) = serde_json::from_str::<serde_json::Value>(data) else {
                continue;
            };
            let delta = match self {
                DemoApi::Chat => v["choices"][0]["delta"]["content"].as_str(),
                DemoApi::Responses if v["type"] == "response.output_text.delta" => {
                    v["delta"].as_str()
                }
                DemoApi::Messages if v["delta"]["type"] == "text_delta" => {
                    v["delta"]["text"].as_str()
                }
                _ => None,
            };
            content.push_str(delta.unwrap_or(""));
        }
        content
    }
}

/// The demo's tools in the Responses and Messages shapes (JSON).
struct Tools {
    responses: String,
    messages: String,
}

impl Tools {
    fn new() -> Tools {
        let chat: Vec<serde_json::Value> = serde_json::from_str(TOOLS).expect("TOOLS is JSON");
        let (mut responses, mut messages) = (Vec::new(), Vec::new());
        for t in &chat {
            let f = &t["function"];
            responses.push(serde_json::json!({"type": "function", "name": f["name"],
                "description": f["description"], "parameters": f["parameters"]}));
            messages.push(serde_json::json!({"name": f["name"],
                "description": f["description"], "input_schema": f["parameters"]}));
        }
        Tools {
            responses: serde_json::Value::Array(responses).to_string(),
            messages: serde_json::Value::Array(messages).to_string(),
        }
    }
}

/// The demo's models: name, prefill and decode slowdown over the 8B timing.
const MODELS: [(&str, f64, f64); 2] = [("sim-8b", 1.0, 1.0), ("sim-70b", 4.0, 2.5)];

/// A list of policy names (a type of its own so that clap parses `--policies` as one value,
/// not as a repeatable flag).
pub type PolicyList = Vec<String>;

fn time_scale(v: &str) -> Result<f64, String> {
    v.parse::<f64>()
        .ok()
        .filter(|x| *x > 0.0 && *x <= 1000.0)
        .ok_or_else(|| "expected a number in (0, 1000]".to_string())
}

fn policy_list(v: &str) -> Result<PolicyList, String> {
    let list: Vec<String> = v.split(',').map(|s| s.trim().to_string()).collect();
    if let Some(bad) = list
        .iter()
        .find(|p| crate::select::PolicyName::parse(p).is_none())
    {
        return Err(format!(
            "unknown policy {bad:?}; one of {}",
            crate::select::PolicyName::NAMES
        ));
    }
    Ok(list)
}

/// Parse `kvlb demo` flags (without the `demo` word). `--help` comes back as an error of kind
/// `DisplayHelp` (exit status 0), like every parse error ready for `cli::exit_status`.
pub fn parse(args: &[String]) -> Result<Opts, clap::Error> {
    crate::cli::parse("kvlb demo", args, |o: &Opts| {
        if o.models > o.replicas {
            return Err(format!(
                "--models {}: more models than --replicas {}",
                o.models, o.replicas
            ));
        }
        o.speeds.check(
            o.replicas,
            "--speeds",
            &format!("--replicas {}", o.replicas),
        )
    })
}

/// The `--speed` of the replica process serving replicas `range` of the fleet (none when the
/// whole fleet runs at speed 1, so the command line stays as it was).
fn speed_arg(o: &Opts, range: std::ops::Range<usize>) -> Option<String> {
    (!o.speeds.is_one()).then(|| o.speeds.slice(range).to_string())
}

struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        // Safety: kill(2) on our own child's pid.
        unsafe { libc::kill(self.0.id() as i32, libc::SIGTERM) };
        let deadline = Instant::now() + Duration::from_secs(3);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.0.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

pub fn main(args: Vec<String>) -> i32 {
    let opts = match parse(&args) {
        Ok(o) => o,
        Err(e) => return crate::cli::exit_status(&e),
    };
    match run(&opts) {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("kvlb demo: {e}");
            1
        }
    }
}

/// Start a child and read its stderr until a line starting with `ready`; returns the lines.
fn spawn_until_ready(mut cmd: Command, ready: &str) -> Result<(Proc, Vec<String>), String> {
    let mut child = cmd
        .stderr(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()
        .map_err(|e| format!("cannot start {cmd:?}: {e}"))?;
    let stderr = child.stderr.take().expect("piped stderr");
    let proc = Proc(child);
    let mut lines = Vec::new();
    let mut reader = BufReader::new(stderr).lines();
    loop {
        match reader.next() {
            Some(Ok(l)) => {
                let done = l.starts_with(ready);
                lines.push(l);
                if done {
                    break;
                }
            }
            _ => {
                return Err(format!(
                    "{cmd:?} exited before it was ready:\n{}",
                    lines.join("\n")
                ))
            }
        }
    }
    std::thread::spawn(move || for _ in reader {});
    Ok((proc, lines))
}

fn addr_after(line: &str, marker: &str) -> Option<SocketAddr> {
    let rest = &line[line.find(marker)? + marker.len()..];
    rest.split_whitespace().next()?.parse().ok()
}

fn run(o: &Opts) -> Result<(), String> {
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let models = &MODELS[..o.models];
    match o.models {
        1 => eprintln!(
            "kvlb demo: {} simulated replicas (8B model on H100 timing, {}x real time), {} agent sessions x {} turns",
            o.replicas, o.time_scale, o.sessions, o.turns
        ),
        _ => eprintln!(
            "kvlb demo: {} simulated replicas serving two models ({} sim-8b, {} sim-70b prefilling 4x slower; {}x real time), {} agent sessions x {} turns, alternating models",
            o.replicas, o.replicas - o.replicas / 2, o.replicas / 2, o.time_scale, o.sessions, o.turns
        ),
    }
    if !o.speeds.is_one() {
        eprintln!(
            "kvlb demo: replica speeds {} (prefill and decode over the model's timing)",
            o.speeds.slice(0..o.replicas)
        );
    }
    match o.api {
        DemoApi::Chat => {}
        DemoApi::Responses => {
            eprintln!("kvlb demo: sessions speak the Responses API (/v1/responses)")
        }
        DemoApi::Messages => eprintln!("kvlb demo: sessions speak the Messages API (/v1/messages)"),
    }
    // One replica process per model: the first serves the first half of the replicas.
    let mut fleets = Vec::new();
    let mut replicas: Vec<SocketAddr> = Vec::new();
    let mut model_of: Vec<usize> = Vec::new();
    for (m, (name, prefill, decode)) in models.iter().enumerate() {
        let count = match (o.models, m) {
            (1, _) => o.replicas,
            (_, 0) => o.replicas - o.replicas / 2,
            _ => o.replicas / 2,
        };
        let timing = crate::engine::EngineConfig::default();
        let mut cmd = Command::new(&exe);
        cmd.args(["replica", "--listen", "127.0.0.1:0", "--model", name])
            .args(["--count", &count.to_string()])
            .args(["--time-scale", &o.time_scale.to_string()]);
        let first = replicas.len();
        if let Some(speeds) = speed_arg(o, first..first + count) {
            cmd.args(["--speed", &speeds]);
        }
        if m > 0 {
            cmd.args(["--prefill-b-s", &(timing.prefill_b_s * prefill).to_string()])
                .args(["--prefill-c-s", &(timing.prefill_c_s * prefill).to_string()])
                .args([
                    "--decode-base-s",
                    &(timing.decode_base_s * decode).to_string(),
                ]);
        }
        let (fleet, lines) = spawn_until_ready(cmd, "kvlb replica: ready")?;
        let got: Vec<SocketAddr> = lines.iter().filter_map(|l| addr_after(l, " on ")).collect();
        if got.len() != count {
            return Err(format!(
                "expected {count} replicas, saw:\n{}",
                lines.join("\n")
            ));
        }
        model_of.extend(std::iter::repeat_n(m, count));
        replicas.extend(got);
        fleets.push(fleet);
    }
    // The slower model's timing, for cache_aware: one [[model]] table.
    let config = std::env::temp_dir().join(format!("kvlb-demo-{}.toml", std::process::id()));
    if o.models > 1 {
        let cost = crate::select::CacheAwareConfig::default().model;
        let (name, prefill, decode) = MODELS[1];
        let table = format!(
            "[[model]]\nname = {name:?}\ncost_model = {{ prefill_s_per_token = {}, decode_step_s = {} }}\n",
            cost.prefill.b * prefill,
            cost.decode.base * decode
        );
        std::fs::write(&config, table).map_err(|e| format!("{}: {e}", config.display()))?;
    }
    let _remove = RemoveOnDrop(config.clone());

    let mut results = Vec::new();
    for policy in &o.policies {
        for r in &replicas {
            http(*r, "POST", "/reset_prefix_cache", b"")?;
        }
        let before = fleet_counters(&replicas)?;
        let mut cmd = Command::new(&exe);
        cmd.args([
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--admin",
            "127.0.0.1:0",
            "--explain",
        ])
        .args(["--policy", policy]);
        if o.models > 1 {
            cmd.arg("--config").arg(&config);
        }
        for r in &replicas {
            cmd.args(["--replica", &format!("http://{r}")]);
        }
        let (kvlb, lines) = spawn_until_ready(cmd, "kvlb: ready")?;
        let listen = lines
            .iter()
            .find_map(|l| addr_after(l, "listening on "))
            .ok_or("kvlb did not say where it listens")?;
        let urls: Vec<String> = replicas.iter().map(|r| format!("http://{r}")).collect();
        let r = replay(listen, o, policy, &urls, &model_of)?;
        drop(kvlb);
        let after = fleet_counters(&replicas)?;
        let queries = after.0 - before.0;
        let hits = after.1 - before.1;
        results.push((policy.clone(), r, hits / queries.max(1.0), queries - hits));
    }

    println!();
    println!(
        "{:<14} {:>8} {:>10} {:>10} {:>10} {:>10} {:>16}  requests per replica",
        "policy", "requests", "ttft p50", "ttft p90", "ttft p99", "hit rate", "prefill tokens"
    );
    for (policy, r, hit, prefill) in &results {
        println!(
            "{:<14} {:>8} {:>9.3}s {:>9.3}s {:>9.3}s {:>9.1}% {:>16.0}  {:?}",
            policy,
            r.ttft.len(),
            pct(&r.ttft, 0.5),
            pct(&r.ttft, 0.9),
            pct(&r.ttft, 0.99),
            hit * 100.0,
            prefill,
            r.per_replica
        );
        if o.models > 1 {
            for (m, (name, _, _)) in models.iter().enumerate() {
                let ttft: Vec<f64> = r
                    .ttft
                    .iter()
                    .zip(&r.model)
                    .filter(|(_, &mm)| mm == m)
                    .map(|(t, _)| *t)
                    .collect();
                println!(
                    "  {:<12} {:>8} {:>9.3}s {:>9.3}s {:>9.3}s",
                    name,
                    ttft.len(),
                    pct(&ttft, 0.5),
                    pct(&ttft, 0.9),
                    pct(&ttft, 0.99)
                );
            }
        }
    }
    if o.models > 1 {
        let crossed: usize = results.iter().map(|r| r.1.crossed).sum();
        println!(
            "requests answered by a replica of another model: {crossed} (kvlb reads each request's model and routes within its replicas)"
        );
    }
    if let Some((_, base, _, base_prefill)) = results.iter().find(|r| r.0 == "round_robin") {
        for (policy, r, _, prefill) in results.iter().filter(|r| r.0 != "round_robin") {
            println!(
                "{policy} vs round_robin: p99 TTFT x{:.2}, p50 TTFT x{:.2}, prefill computed x{:.2}",
                pct(&r.ttft, 0.99) / pct(&base.ttft, 0.99).max(1e-9),
                pct(&r.ttft, 0.5) / pct(&base.ttft, 0.5).max(1e-9),
                prefill / base_prefill.max(1.0)
            );
        }
    }
    println!("(TTFT in simulated GPU seconds: wall time x time scale)");
    Ok(())
}

fn pct(v: &[f64], p: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    let mut s = v.to_vec();
    s.sort_by(|a, b| a.total_cmp(b));
    s[((s.len() as f64 - 1.0) * p).round() as usize]
}

struct Replay {
    ttft: Vec<f64>,
    /// The model of each TTFT sample (index into `MODELS`).
    model: Vec<usize>,
    per_replica: Vec<usize>,
    /// Requests answered by a replica serving another model.
    crossed: usize,
}

/// Removes a file when dropped (the demo's configuration).
struct RemoveOnDrop(std::path::PathBuf);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// The replicas' prefix-cache query and hit token counters, summed.
fn fleet_counters(replicas: &[SocketAddr]) -> Result<(f64, f64), String> {
    let mut q = 0.0;
    let mut h = 0.0;
    for r in replicas {
        let c = EngineCounters::fetch(*r)?;
        q += c.prefix_queries;
        h += c.prefix_hits;
    }
    Ok((q, h))
}

const SYSTEM: &str = "You are a coding agent working in a large repository. Follow the user's instructions exactly, think step by step, use the tools provided to read and edit files, run the test suite after every change, and report what you changed and why. Never invent file contents: read them first. Keep answers short and precise. ";
const TOOLS: &str = r#"[{"type":"function","function":{"name":"read_file","description":"Read a file of the repository and return its contents with line numbers.","parameters":{"type":"object","properties":{"path":{"type":"string","description":"Path relative to the repository root."},"start":{"type":"integer"},"end":{"type":"integer"}},"required":["path"]}}},{"type":"function","function":{"name":"edit_file","description":"Replace a range of lines of a file with new text.","parameters":{"type":"object","properties":{"path":{"type":"string"},"start":{"type":"integer"},"end":{"type":"integer"},"text":{"type":"string"}},"required":["path","start","end","text"]}}},{"type":"function","function":{"name":"run_tests","description":"Run the test suite, or one test by name, and return its output.","parameters":{"type":"object","properties":{"filter":{"type":"string"}}}}}]"#;

/// A session's own context: its task and the source file it works on (about 6k tokens).
fn session_context(s: usize) -> String {
    let mut text = format!(
        "Task {s}: the function parse_config in src/config_{s}.rs mishandles empty values. Find the cause, fix it, and add a regression test. Here is the file:\n"
    );
    for line in 0..400 {
        text.push_str(&format!(
            "{line:4}  let value_{s}_{line} = settings.get(\"key_{line}\").map(|v| v.trim()).unwrap_or_default();\n"
        ));
    }
    text
}

fn json_str(s: &str) -> String {
    serde_json::to_string(s).expect("string serialises")
}

/// Replay the sessions through kvlb at `listen`.
/// Replay the sessions through kvlb at `listen`; session `s` asks for model `s % models`
/// (`model_of`: each replica's).
fn replay(
    listen: SocketAddr,
    o: &Opts,
    policy: &str,
    urls: &[String],
    model_of: &[usize],
) -> Result<Replay, String> {
    let system = SYSTEM.repeat(12);
    let total = o.sessions * o.turns;
    let next = Arc::new(AtomicUsize::new(0));
    let done = Arc::new(AtomicUsize::new(0));
    let out = Arc::new(Mutex::new((
        Vec::new(),
        Vec::new(),
        None::<String>,
        Vec::new(),
    )));
    let tools = Arc::new(Tools::new());
    let api = o.api;
    let mut threads = Vec::new();
    for _ in 0..o.concurrency.min(o.sessions) {
        let tools = tools.clone();
        let (next, done, out, system) = (next.clone(), done.clone(), out.clone(), system.clone());
        let (sessions, turns, scale, verbose) = (o.sessions, o.turns, o.time_scale, o.verbose);
        let n_models = o.models;
        let policy = policy.to_string();
        let start = Instant::now();
        threads.push(std::thread::spawn(move || loop {
            let s = next.fetch_add(1, Ordering::Relaxed);
            if s >= sessions {
                return;
            }
            // Sessions arrive over time (one every 0.4 simulated seconds), not all at once.
            let arrival = Duration::from_secs_f64(0.4 * s as f64 / scale);
            if let Some(wait) = arrival.checked_sub(start.elapsed()) {
                std::thread::sleep(wait);
            }
            let model = s % n_models;
            let mut messages = format!(
                r#"{{"role":"user","content":{}}}"#,
                json_str(&session_context(s))
            );
            for t in 0..turns {
                let body = api.body(MODELS[model].0, &system, &tools, &messages);
                match stream_turn(listen, api, body.as_bytes()) {
                    Ok((ttft, replica, text, decision)) => {
                        if verbose {
                            eprintln!(
                                "{policy} session {s} turn {t}: {replica} ttft {:.3}s {decision}",
                                ttft * scale
                            );
                        }
                        let mut g = out.lock().unwrap();
                        g.0.push(ttft * scale);
                        g.1.push(replica);
                        g.3.push(model);
                        drop(g);
                        messages.push_str(&format!(
                            r#",{{"role":"assistant","content":{}}},{{"role":"user","content":{}}}"#,
                            json_str(&text),
                            json_str(&format!(
                                "Tool output for step {t} of task {s}: {}",
                                "test_parse_config ... ok; test_empty_values ... FAILED ".repeat(6)
                            ))
                        ));
                    }
                    Err(e) => {
                        out.lock().unwrap().2 = Some(e);
                    }
                }
                let n = done.fetch_add(1, Ordering::Relaxed) + 1;
                progress(&policy, n, total);
            }
        }));
    }
    for t in threads {
        let _ = t.join();
    }
    eprintln!();
    let g = out.lock().unwrap();
    if let Some(e) = &g.2 {
        return Err(format!("a request through kvlb failed: {e}"));
    }
    let per_replica = urls
        .iter()
        .map(|u| g.1.iter().filter(|x| *x == u).count())
        .collect();
    let crossed =
        g.1.iter()
            .zip(&g.3)
            .filter(|(replica, &m)| {
                urls.iter()
                    .position(|u| u == *replica)
                    .is_none_or(|i| model_of[i] != m)
            })
            .count();
    Ok(Replay {
        ttft: g.0.clone(),
        model: g.3.clone(),
        per_replica,
        crossed,
    })
}

fn progress(policy: &str, n: usize, total: usize) {
    let width = 30;
    let filled = n * width / total.max(1);
    if n != total && filled == (n - 1) * width / total.max(1) {
        return;
    }
    eprint!(
        "\r{policy:<14} [{}{}] {n}/{total}",
        "#".repeat(filled),
        "-".repeat(width - filled)
    );
}

/// One streaming request: (seconds to the first SSE event (Responses, Messages: the first text
/// delta), replica, generated text, kvlb's decision header).
fn stream_turn(
    addr: SocketAddr,
    api: DemoApi,
    body: &[u8],
) -> Result<(f64, String, String, String), String> {
    let answer = client::stream(
        addr,
        api.path(),
        body,
        api.api(),
        Duration::from_secs(120),
        true,
    )?;
    let text = String::from_utf8_lossy(&answer.body);
    if answer.status != 200 {
        return Err(format!(
            "{}: {text}",
            answer.head.lines().next().unwrap_or("")
        ));
    }
    let replica = answer.header("x-kvlb-replica").unwrap_or("?").to_string();
    let decision = answer.header("x-kvlb-decision").unwrap_or("").to_string();
    if !answer.done {
        return Err(format!(
            "the stream ended before {}",
            client::end_event(api.api())
        ));
    }
    let content = api.answer_text(&text);
    Ok((
        answer.ttft_s.ok_or("no SSE event")?,
        replica,
        content,
        decision,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(s: &str) -> Vec<String> {
        s.split_whitespace().map(String::from).collect()
    }

    #[test]
    fn flags_defaults_repeats_and_errors() {
        // clap checks its definition in debug builds (`cargo test` without --release).
        <Opts as clap::CommandFactory>::command().debug_assert();
        let o = parse(&[]).unwrap();
        assert_eq!(
            (o.replicas, o.sessions, o.turns, o.concurrency, o.time_scale),
            (4, 32, 5, 12, 3.0)
        );
        assert_eq!(o.policies, ["cache_aware", "round_robin", "least_loaded"]);
        assert!(!o.verbose);
        assert_eq!(o.api, DemoApi::Chat);
        assert_eq!(
            parse(&args("--api messages --api responses")).unwrap().api,
            DemoApi::Responses
        );
        let o = parse(&args(
            "--replicas 2 --replicas=3 --policies round_robin --time-scale 1000 --verbose",
        ))
        .unwrap();
        assert_eq!((o.replicas, o.time_scale, o.verbose), (3, 1000.0, true));
        assert_eq!(o.policies, ["round_robin"]);
        for (bad, flag, value) in [
            ("--replicas 65", "--replicas", "65"),
            ("--sessions 0", "--sessions", "0"),
            ("--turns many", "--turns", "many"),
            ("--concurrency -3", "--concurrency", "-3"),
            ("--time-scale 1001", "--time-scale", "1001"),
            ("--time-scale nan", "--time-scale", "nan"),
            ("--policies cache_aware,best", "--policies", "best"),
            ("--policies cache_aware,", "--policies", "\"\""),
            ("--bogus 1", "--bogus", "--bogus"),
            ("--turns", "--turns", "value is required"),
            ("--api completions", "--api", "completions"),
        ] {
            let e = parse(&args(bad)).unwrap_err().to_string();
            assert!(e.contains(flag) && e.contains(value), "{bad}: {e}");
        }
        let e = parse(&args("--help")).unwrap_err();
        assert_eq!(e.kind(), clap::error::ErrorKind::DisplayHelp);
    }

    #[test]
    fn speeds_go_to_the_replica_processes() {
        let o = parse(&[]).unwrap();
        assert!(o.speeds.is_one());
        assert_eq!(speed_arg(&o, 0..4), None, "no --speed at speed 1");
        let o = parse(&args("--speeds 1,1,0.333,0.33x0.5")).unwrap();
        assert_eq!(speed_arg(&o, 0..4).unwrap(), "1,1,0.333,0.33x0.5");
        // --models 2: each process its half.
        assert_eq!(speed_arg(&o, 0..2).unwrap(), "1,1");
        assert_eq!(speed_arg(&o, 2..4).unwrap(), "0.333,0.33x0.5");
        let o = parse(&args("--replicas 3 --speeds 0.5")).unwrap();
        assert_eq!(speed_arg(&o, 1..3).unwrap(), "0.5,0.5");
        for (bad, says) in [
            ("--speeds 1,2", "--replicas 4"),
            ("--replicas 2 --speeds 1,1,1", "--replicas 2"),
            ("--speeds 0", "0"),
        ] {
            let e = parse(&args(bad)).unwrap_err();
            assert_eq!(e.exit_code(), 2);
            let e = e.to_string();
            assert!(e.contains("--speeds") && e.contains(says), "{bad}: {e}");
        }
    }

    #[test]
    fn each_api_gets_its_body_and_its_answer_text() {
        let tools = Tools::new();
        let conversation =
            r#"{"role":"user","content":"fix it"},{"role":"assistant","content":"ok"}"#;
        for api in [DemoApi::Chat, DemoApi::Responses, DemoApi::Messages] {
            let body: serde_json::Value =
                serde_json::from_str(&api.body("sim-8b", "be brief", &tools, conversation))
                    .unwrap_or_else(|e| panic!("{api:?}: {e}"));
            assert_eq!(
                (&body["model"], &body["stream"]),
                (&"sim-8b".into(), &true.into())
            );
            let (system, history, tool_name) = match api {
                DemoApi::Chat => (
                    &body["messages"][0]["content"],
                    &body["messages"].as_array().unwrap()[1..],
                    &body["tools"][0]["function"]["name"],
                ),
                DemoApi::Responses => (
                    &body["instructions"],
                    &body["input"].as_array().unwrap()[..],
                    &body["tools"][0]["name"],
                ),
                DemoApi::Messages => (
                    &body["system"],
                    &body["messages"].as_array().unwrap()[..],
                    &body["tools"][0]["name"],
                ),
            };
            assert_eq!(system, "be brief", "{api:?}");
            assert_eq!(history.len(), 2, "{api:?}");
            assert_eq!(history[1]["content"], "ok", "{api:?}");
            assert_eq!(tool_name, "read_file", "{api:?}");
        }
        assert_eq!(body_of(DemoApi::Responses)["store"], false);
        assert_eq!(body_of(DemoApi::Responses)["max_output_tokens"], 24);
        assert_eq!(
            body_of(DemoApi::Messages)["tools"][2]["input_schema"]["type"],
            "object"
        );

        let chat = "data: {\"choices\":[{\"delta\":{\"role\":\"assistant\"}}]}\n\ndata: {\"choices\":[{\"delta\":{\"content\":\"a b\"}}]}\n\ndata: [DONE]\n\n";
        assert_eq!(DemoApi::Chat.answer_text(chat), "a b");
        let responses = "event: response.created\ndata: {\"type\":\"response.created\",\"response\":{}}\n\nevent: response.output_text.delta\ndata: {\"delta\":\"a\",\"type\":\"response.output_text.delta\"}\n\nevent: response.output_text.delta\ndata: {\"delta\":\" b\",\"type\":\"response.output_text.delta\"}\n\nevent: response.output_text.done\ndata: {\"text\":\"a b\",\"type\":\"response.output_text.done\"}\n\n";
        assert_eq!(DemoApi::Responses.answer_text(responses), "a b");
        let messages = "event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"delta\":{\"type\":\"text_delta\",\"text\":\"a\"},\"index\":0}\n\nevent: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"delta\":{\"type\":\"text_delta\",\"text\":\" b\"},\"index\":0}\n\nevent: message_stop\ndata: {\"type\":\"message_stop\"}\n\n";
        assert_eq!(DemoApi::Messages.answer_text(messages), "a b");
    }

    fn body_of(api: DemoApi) -> serde_json::Value {
        serde_json::from_str(&api.body("m", "s", &Tools::new(), r#"{"role":"user","content":"x"}"#))
            .unwrap()
    }
}

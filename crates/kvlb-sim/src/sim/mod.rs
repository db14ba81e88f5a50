//! `kvlb simulate`: how would each policy do on a real trace? A discrete-event simulation of a
//! fleet of engines — the same engine model `kvlb replica` serves (`crate::engine`) — behind
//! the same selection code `kvlb serve` runs (`crate::select`), fed a request trace; per
//! policy it reports TTFT percentiles, end-to-end latency, prefix-cache hit rate, prefill work,
//! duplicated KV and load imbalance, as a table, JSON and an SVG plot.
//!
//! * `trace`: Mooncake / Azure files and the built-in generators -> requests with block ids;
//! * `fleet`: the event loop (arrivals, engine steps, KV transfers, the data plane's load
//!   accounting);
//! * `pd`: prefill/decode roles, the legs of a disaggregated request, transfers in flight;
//! * `routed`: what was routed where (estimated uncached tokens, duplicate KV);
//! * `report`: percentiles, table, JSON; `plot`: the SVG.
//!
//! `--roles` makes a prefill/decode disaggregated fleet (`pd`): a request whose model has
//! prefill and decode replicas is prefilled on one, its KV moved over a link of
//! `--kv-link-gbps`, and decoded on the other, as `kvlb serve` sends it.
//!
//! `--residency` says what `cache_aware` learns residency from: its own routing (the default),
//! or routing and the engines' KV events fed back, with or without pending routed blocks
//! (`fleet::ResidencySource`).
//!
//! Deterministic: the same input gives the same output, byte for byte (wall time goes to
//! stderr only).

#![forbid(unsafe_code)]

pub mod fleet;
pub mod pd;
pub mod plot;
pub mod report;
pub mod routed;
pub mod trace;

use crate::engine::{EngineConfig, Speed, SpeedList};
use crate::replica::pd::DEFAULT_KV_LINK_GBPS;
use std::time::Instant;

/// Most replicas a simulated fleet may have.
pub const MAX_REPLICAS: u64 = 256;

const AFTER_HELP: &str = "\
policies: round_robin, random, least_loaded, power_of_two, consistent_hash,
          sglang_cache_aware, cache_aware

Each replica is the simulated engine of `kvlb replica` (default configuration: 8B model on
one H100, 400k KV tokens); each policy is the selection code of `kvlb serve`. Per policy:
  ttft_p50/p90/p99_s, e2e_p50/p99_s  time to first token / to the last token (s)
  itl_p50/p99_s        a request's mean time between output tokens, over requests (s)
  hit_rate             prompt tokens found in the engines' prefix caches (GPU, or loaded
                       from the host tier) / prompt tokens
  host_hit_rate        of those, the part loaded from the host tier
  prefill_tokens       prompt tokens computed (prompt minus cached)
  duplicate_kv_blocks  mean, over samples every 10 s, of 16-token KV blocks held by more
                       than one replica; estimated from the prompts routed to each replica
                       (LRU-bounded by its KV capacity), not read from the engines
  max_mean_load        the busiest replica's prefill_tokens over the mean (1 = even)
With --roles (prefill and decode replicas) a request's first token is its decode replica's,
hit_rate and prefill_tokens are the prompts' (computed on the prefill replicas, or on a decode
replica directly), max_mean_load is over the replicas other than decode ones, and
  disaggregated        requests prefilled on a prefill replica (the rest whole on a decode one)
Requests the engine refuses (prompt over the context limit) count as rejected.";

/// `--fleet-models`: the names each replica serves, one entry per replica (a type of its own
/// so that clap parses the flag as one value).
pub type FleetModels = Vec<Vec<String>>;

/// `--policies`' default: every policy, in report order.
static ALL_POLICIES: std::sync::LazyLock<String> =
    std::sync::LazyLock::new(|| fleet::POLICY_NAMES.join(","));

/// `--roles`: each replica's role (a type of its own so that clap parses the flag as one value).
pub type Roles = Vec<pd::Role>;

/// A list of policy names (a type of its own so that clap parses `--policies` as one value,
/// not as a repeatable flag).
pub type PolicyList = Vec<String>;

/// Simulate a fleet of `kvlb replica` engines behind each routing policy on a request trace.
#[derive(Debug, Clone, PartialEq, clap::Parser)]
#[command(
    name = "kvlb simulate",
    after_help = AFTER_HELP,
    args_override_self = true,
    mut_args = crate::cli::hyphen_values
)]
pub struct Options {
    /// Mooncake JSONL or Azure CSV file, or a generator: gen:shared-prefix, gen:agent-sessions
    #[arg(long, value_name = "SPEC", value_parser = crate::cli::non_empty)]
    pub trace: String,
    /// Simulated replicas
    #[arg(long, value_name = "N", default_value_t = 4,
          value_parser = crate::cli::int::<usize, 1, MAX_REPLICAS>)]
    pub replicas: usize,
    /// Instead of --replicas, replicas by the models they serve, NAME[+NAME...]=N (e.g.
    /// Qwen/Qwen3-8B+sql-lora=2,Qwen/Qwen3-0.6B=2): a request naming a model is routed among
    /// the replicas serving it, one naming a model none serves is rejected, one naming none
    /// goes anywhere
    #[arg(long, value_name = "NAMES=N,...", value_parser = fleet_models,
          conflicts_with = "replicas")]
    pub fleet_models: Option<FleetModels>,
    /// Models for trace rows naming none (a Mooncake line's own "model" key is kept), by
    /// weight, per conversation, as kvlb replay --models (e.g. A=0.7,B=0.3)
    #[arg(long, value_name = "NAME=W,...")]
    pub models: Option<trace::ModelMix>,
    /// Divide inter-arrival times by X
    #[arg(long, value_name = "X", default_value_t = 1.0, value_parser = crate::cli::positive)]
    pub speedup: f64,
    /// Comma-separated policies (default: all of them)
    #[arg(long, value_name = "LIST", value_parser = policy_list,
          default_value = ALL_POLICIES.as_str(), hide_default_value = true)]
    pub policies: PolicyList,
    /// Only the first N requests of the trace
    #[arg(long, value_name = "N", value_parser = crate::cli::int::<usize, 1, { u32::MAX as u64 }>)]
    pub limit: Option<usize>,
    /// Seed for generators and policy random numbers
    #[arg(long, value_name = "N", default_value_t = 1,
          value_parser = crate::cli::int::<u64, 0, { u64::MAX }>)]
    pub seed: u64,
    /// Print a JSON array, one object per policy, instead of a table
    #[arg(long)]
    pub json: bool,
    /// Write the TTFT CDF and per-replica prefill work as an SVG
    #[arg(long, value_name = "FILE.svg")]
    pub plot: Option<String>,
    /// Write one JSON line per request and policy: what the policy saw and estimated when it
    /// chose (cache_aware: estimate, wait, runner-up, match, spill, pace) against what happened
    /// (time to first token, tokens the engine found cached, the engines' queues at arrival)
    #[arg(long, value_name = "FILE.jsonl")]
    pub decisions: Option<String>,
    /// What cache_aware learns residency from
    #[arg(long, value_name = "SOURCE", default_value = "routing", value_parser = residency())]
    pub residency: fleet::ResidencySource,
    /// Per replica, a host-memory KV tier of N tokens (CPU offloading; 0 = none): computed
    /// blocks are kept in host memory and a prefix the GPU evicted is loaded back instead of
    /// recomputed
    #[arg(long, value_name = "N", default_value_t = 0, value_parser = host_kv_tokens)]
    pub host_kv_tokens: u64,
    /// Seconds per token to load KV back from the host tier
    #[arg(long, value_name = "X", default_value_t = EngineConfig::default().host_load_s_per_token,
          value_parser = crate::cli::non_negative)]
    pub host_load_s_per_token: f64,
    /// Set a cache_aware parameter, for ablations (repeatable; docs/cost-model.md lists the
    /// names, most of them fixed in `kvlb serve`; an unknown name's error lists them too)
    #[arg(long = "set", value_name = "NAME=X", value_parser = parameter)]
    pub set: Vec<(String, f64)>,
    /// Feed cache_aware each engine's queue and KV usage as a metrics scrape every X seconds
    /// would (0: never, the policy sees only its own counts)
    #[arg(long, value_name = "X", default_value_t = 0.0, value_parser = crate::cli::non_negative)]
    pub scrape_interval: f64,
    /// Per-replica speed factors of a mixed fleet, comma-separated, one for all replicas or one
    /// per replica (of --replicas or --fleet-models), as kvlb replica --speed: X (prefill and
    /// decode X times the default engine's speed; 0.333 = three times slower) or PxD (prefill
    /// speed P, decode speed D, e.g. 0.33x0.5), each from 0.01 to 100. The policies' cost
    /// model stays the default engine's
    #[arg(long, value_name = "LIST", default_value = SpeedList::DEFAULT, value_parser = SpeedList::parse)]
    pub speeds: SpeedList,
    /// Step-time jitter, as kvlb replica --timing-spread: each engine step's duration is
    /// multiplied by a random lognormal factor of mean 1, exp(X * N(0,1) - X^2/2), from --seed
    /// and the replica (0 = none)
    #[arg(long, value_name = "X", default_value_t = EngineConfig::default().timing_spread,
          value_parser = crate::engine::timing_spread)]
    pub timing_spread: f64,
    /// Price every replica at the cost model's configured speed: no calibration from the
    /// requests' times to first token (kvlb serve calibrates; this shows what it gains)
    #[arg(long)]
    pub no_calibration: bool,
    /// Each replica's part in prefill/decode disaggregation, comma-separated, one per replica
    /// (of --replicas or --fleet-models): prefill, decode or both (the default: whole
    /// requests), e.g. prefill,prefill,decode,decode. A request whose model has prefill and
    /// decode replicas takes two legs, as kvlb serve sends it: the policy chooses a prefill
    /// replica, which computes the prompt and one token and holds the KV; then a decode
    /// replica, which gets the KV over the link (--kv-link-gbps) and decodes
    #[arg(long, value_name = "LIST", value_parser = roles)]
    pub roles: Option<Roles>,
    /// (--roles) Whether such a request always takes both legs, or cache_aware prices a
    /// prefill replica and the transfer against computing the prompt on a decode replica
    /// (priced, kvlb serve's default; other policies always disaggregate)
    #[arg(long, value_name = "MODE", default_value = "priced", value_parser = disaggregate())]
    pub disaggregate: pd::Disaggregate,
    /// (--roles) KV cache bytes per token (all layers, K and V; 128 KiB for the 8B model) a
    /// transfer moves, as kvlb replica --kv-bytes-per-token
    #[arg(long, value_name = "N", default_value_t = EngineConfig::default().kv_bytes_per_token,
          value_parser = crate::cli::int::<u64, 1, { u32::MAX as u64 }>)]
    pub kv_bytes_per_token: u64,
    /// (--roles) KV link bandwidth from the prefill to the decode replicas in GB/s (10^9 bytes
    /// per second), as kvlb replica --kv-link-gbps: the KV of N prompt tokens takes N x
    /// --kv-bytes-per-token / (X x 10^9) seconds; cache_aware prices the transfer at it
    #[arg(long, value_name = "X", default_value_t = DEFAULT_KV_LINK_GBPS,
          value_parser = crate::cli::positive)]
    pub kv_link_gbps: f64,
}

/// `--set NAME=X`: a known cache_aware parameter and a number.
fn parameter(v: &str) -> Result<(String, f64), String> {
    let (name, x) = v
        .split_once('=')
        .ok_or_else(|| "expected NAME=X".to_string())?;
    if !crate::select::cache_aware::PARAMETERS.contains(&name) {
        return Err(format!(
            "unknown parameter {name:?}; known: {}",
            crate::select::cache_aware::PARAMETERS.join(", ")
        ));
    }
    let x: f64 = x
        .parse()
        .ok()
        .filter(|x: &f64| x.is_finite())
        .ok_or_else(|| format!("{name}: expected a number, got {x:?}"))?;
    Ok((name.to_string(), x))
}

fn fleet_models(v: &str) -> Result<FleetModels, String> {
    let mut out: FleetModels = Vec::new();
    for group in v.split(',') {
        let (names, n) = group
            .trim()
            .rsplit_once('=')
            .ok_or(format!("{group:?}: expected NAME[+NAME...]=N"))?;
        let n: usize = n
            .trim()
            .parse()
            .ok()
            .filter(|&n| n >= 1)
            .ok_or(format!("{group:?}: N is not a whole number of replicas"))?;
        let names: Vec<String> = names.split('+').map(|m| m.trim().to_string()).collect();
        if names.iter().any(String::is_empty) {
            return Err(format!("{group:?}: empty model name"));
        }
        if out.len() + n > MAX_REPLICAS as usize {
            return Err(format!("more than {MAX_REPLICAS} replicas"));
        }
        out.extend(std::iter::repeat_n(names, n));
    }
    Ok(out)
}

fn policy_list(v: &str) -> Result<PolicyList, String> {
    let list: Vec<String> = v
        .split(',')
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
        .collect();
    if list.is_empty() {
        return Err("expected at least one policy".into());
    }
    for p in &list {
        if !fleet::POLICY_NAMES.contains(&p.as_str()) {
            return Err(format!(
                "unknown policy {p:?}; known: {}",
                fleet::POLICY_NAMES.join(", ")
            ));
        }
    }
    Ok(list)
}

fn roles(v: &str) -> Result<Roles, String> {
    v.split(',')
        .map(|name| {
            let name = name.trim();
            pd::Role::parse(name)
                .ok_or_else(|| format!("{name:?}: expected prefill, decode or both"))
        })
        .collect()
}

/// `--disaggregate`: the names of `pd::Disaggregate`, each with its help.
fn disaggregate() -> impl clap::builder::TypedValueParser<Value = pd::Disaggregate> {
    use clap::builder::{PossibleValue, PossibleValuesParser, TypedValueParser};
    let help = |d: pd::Disaggregate| match d {
        pd::Disaggregate::Priced => {
            "cache_aware chooses among prefill and decode replicas: the cheaper path wins"
        }
        pd::Disaggregate::Always => "every request takes both legs",
    };
    PossibleValuesParser::new(pd::Disaggregate::NAMES.iter().map(|name| {
        let mode = pd::Disaggregate::parse(name).expect("a listed name parses");
        PossibleValue::new(*name).help(help(mode))
    }))
    .map(|name| pd::Disaggregate::parse(&name).expect("a possible value parses"))
}

fn host_kv_tokens(v: &str) -> Result<u64, String> {
    v.parse::<u64>()
        .ok()
        .filter(|&n| n == 0 || (16..=1 << 40).contains(&n))
        .ok_or_else(|| "expected 0 (none) or a whole number of tokens from 16 to 2^40".to_string())
}

/// `--residency`: the names of `fleet::ResidencySource`, each with its help.
fn residency() -> impl clap::builder::TypedValueParser<Value = fleet::ResidencySource> {
    use clap::builder::{PossibleValue, PossibleValuesParser, TypedValueParser};
    let help = |s: fleet::ResidencySource| match s {
        fleet::ResidencySource::Routing => "its own routing decisions alone",
        fleet::ResidencySource::Events => "routing and the engines' KV events",
        fleet::ResidencySource::EventsPending => {
            "as events, and a block routed to a replica since its last BlockStored there \
             survives a BlockRemoved (the request waiting there will store it again)"
        }
    };
    PossibleValuesParser::new(fleet::ResidencySource::NAMES.iter().map(|name| {
        let source = fleet::ResidencySource::parse(name).expect("a listed name parses");
        PossibleValue::new(*name).help(help(source))
    }))
    .map(|name| fleet::ResidencySource::parse(&name).expect("a possible value parses"))
}

/// Parse the command line (without the `simulate` word). `--help` comes back as an error of
/// kind `DisplayHelp` (exit status 0), like every parse error ready for `cli::exit_status`.
pub fn parse_args(args: &[String]) -> Result<Options, clap::Error> {
    crate::cli::parse("kvlb simulate", args, Options::validate)
}

/// Every policy's results, in the order of `Options::policies`.
pub struct Runs {
    pub summaries: Vec<report::Summary>,
    /// Each policy's sorted TTFTs.
    pub ttfts: Vec<Vec<f64>>,
    /// With a host tier, the host tier's share of each policy's hits (else empty).
    pub host_hit_rates: Vec<f64>,
    /// Per policy, its figures per model (empty when no request names one).
    pub models: Vec<Vec<report::ModelSummary>>,
}

impl Options {
    /// The fleet's size: --fleet-models' replicas, else --replicas.
    pub fn fleet_size(&self) -> usize {
        self.fleet_models.as_ref().map_or(self.replicas, Vec::len)
    }

    /// The checks across flags: --speeds has one value or one per replica, --roles one per
    /// replica, with prefill and decode replicas together or neither.
    pub fn validate(&self) -> Result<(), String> {
        let fleet = match &self.fleet_models {
            Some(f) => format!("the {} replicas of --fleet-models", f.len()),
            None => format!("--replicas {}", self.replicas),
        };
        self.speeds.check(self.fleet_size(), "--speeds", &fleet)?;
        let Some(roles) = &self.roles else {
            return Ok(());
        };
        let names = || {
            roles
                .iter()
                .map(|r| r.as_str())
                .collect::<Vec<_>>()
                .join(",")
        };
        if roles.len() != self.fleet_size() {
            return Err(format!(
                "bad value for --roles: {} ({} roles for {fleet}; give one per replica)",
                names(),
                roles.len()
            ));
        }
        let has = |role| roles.contains(&role);
        if has(pd::Role::Prefill) != has(pd::Role::Decode) {
            return Err(format!(
                "bad value for --roles: {} (prefill replicas need decode replicas to continue \
                 their requests, and decode replicas prefill ones)",
                names()
            ));
        }
        Ok(())
    }

    /// The replicas' roles and how requests use them (every replica whole without --roles).
    pub fn pd(&self) -> pd::Pd {
        pd::Pd {
            roles: self.roles.clone().unwrap_or_default(),
            disaggregate: self.disaggregate,
            transfer_s_per_token: crate::replica::pd::transfer_s_per_token(
                self.kv_bytes_per_token,
                self.kv_link_gbps,
            ),
        }
    }

    /// What the table's first line adds about the fleet's engines: the roles of a
    /// disaggregated fleet, the speeds when not all 1, the timing spread when not 0.
    fn fleet_note(&self) -> String {
        let mut note = String::new();
        let pd = self.pd();
        if pd.is_split() {
            let count = |role| pd.roles.iter().filter(|&&r| r == role).count();
            note.push_str(&format!(
                ", {} prefill + {} decode",
                count(pd::Role::Prefill),
                count(pd::Role::Decode)
            ));
            if count(pd::Role::Both) > 0 {
                note.push_str(&format!(" + {} both", count(pd::Role::Both)));
            }
            note.push_str(&format!(
                " (disaggregate {}, KV link {} GB/s)",
                self.disaggregate.name(),
                self.kv_link_gbps
            ));
        }
        if !self.speeds.is_one() {
            note.push_str(&format!(", speeds {}", self.speeds));
        }
        if self.timing_spread > 0.0 {
            note.push_str(&format!(", timing spread {}", self.timing_spread));
        }
        note
    }
}

/// What every policy's run shares: the trace (sliced, models assigned, sped up), the base
/// engine (the policies' cost model), each replica's speed and role.
pub struct Setup {
    pub trace: trace::Trace,
    pub engine: EngineConfig,
    pub speeds: Vec<Speed>,
    pub pd: pd::Pd,
    /// Whether some request names a model.
    pub named: bool,
}

/// The trace, engine and speeds `o` describes.
pub fn setup(o: &Options) -> Result<Setup, String> {
    o.validate()?;
    // Models are given over the whole trace, so a slice gets the models it has in it.
    let mut t = trace::load(&o.trace, None, o.seed)?;
    if let Some(mix) = &o.models {
        mix.assign(&mut t.requests);
    }
    if let Some(n) = o.limit {
        t.requests.truncate(n);
    }
    let named = t.requests.iter().any(|r| r.model.is_some());
    if t.requests.is_empty() {
        return Err(format!("--trace {:?}: no requests", o.trace));
    }
    for r in &mut t.requests {
        r.arrival_s /= o.speedup;
    }
    let engine = EngineConfig {
        host_kv_capacity_tokens: o.host_kv_tokens,
        host_load_s_per_token: o.host_load_s_per_token,
        timing_spread: o.timing_spread,
        kv_bytes_per_token: o.kv_bytes_per_token,
        ..EngineConfig::default()
    };
    engine.validate()?;
    let speeds = match o.speeds.is_one() {
        true => Vec::new(),
        false => o.speeds.per_replica(o.fleet_size()),
    };
    Ok(Setup {
        trace: t,
        engine,
        speeds,
        pd: o.pd(),
        named,
    })
}

/// Policy `name`'s run on the fleet of `o`, as `run` does it for each policy.
pub fn simulate_policy(o: &Options, s: &Setup, name: &str) -> Result<fleet::Run, String> {
    let replicas = o.fleet_size();
    // cache_aware prices a transfer at the simulated link (unless --set says otherwise).
    let mut set = Vec::new();
    if s.pd.is_split() {
        set.push((
            "kv_transfer_s_per_token".to_string(),
            s.pd.transfer_s_per_token,
        ));
    }
    set.extend_from_slice(&o.set);
    let mut policy = fleet::RoutingPolicy::build_with(name, replicas, &s.engine, &set)?
        .learn_from(o.residency)
        .scrape_every(o.scrape_interval);
    if o.no_calibration {
        policy = policy.without_calibration();
    }
    let fleet = fleet::Fleet {
        replicas,
        serving: o.fleet_models.as_deref(),
        engine: &s.engine,
        speeds: &s.speeds,
        pd: &s.pd,
    };
    fleet::simulate_fleet(&s.trace, &fleet, &mut policy, o.seed)
}

/// Run every policy of `o`.
pub fn run(o: &Options) -> Result<Runs, String> {
    let setup = setup(o)?;
    let (t, named) = (&setup.trace, setup.named);
    let mut summaries = Vec::new();
    let mut ttfts = Vec::new();
    let mut host_hit_rates = Vec::new();
    let mut models = Vec::new();
    let mut decisions = match &o.decisions {
        Some(path) => Some(std::io::BufWriter::new(
            std::fs::File::create(path)
                .map_err(|e| format!("--decisions {path:?}: cannot write: {e}"))?,
        )),
        None => None,
    };
    for name in &o.policies {
        let started = Instant::now();
        let run = simulate_policy(o, &setup, name)?;
        if let (Some(out), Some(path)) = (&mut decisions, &o.decisions) {
            write_decisions(out, &run)
                .map_err(|e| format!("--decisions {path:?}: cannot write: {e}"))?;
        }
        eprintln!(
            "kvlb simulate: {name}: {} requests in {:.2} s wall",
            run.records.len(),
            started.elapsed().as_secs_f64()
        );
        if o.host_kv_tokens > 0 {
            host_hit_rates.push(report::host_hit_rate(&run));
        }
        if named {
            models.push(report::per_model(&run, t));
        }
        summaries.push(report::summarize(&run));
        ttfts.push(report::sorted_ttfts(&run));
    }
    Ok(Runs {
        summaries,
        ttfts,
        host_hit_rates,
        models,
    })
}

/// `--decisions`: one JSON line per request of `run`.
fn write_decisions(out: &mut impl std::io::Write, run: &fleet::Run) -> std::io::Result<()> {
    let num = |v: f64| v.is_finite().then_some(v);
    for (i, r) in run.records.iter().enumerate() {
        let mut line = serde_json::json!({
            "policy": run.policy,
            "index": i,
            "arrival_s": r.arrival_s,
            "replica": r.replica,
            "prompt_tokens": r.prompt_tokens,
            "cached_tokens": r.cached_tokens,
            "estimated_cached_tokens": r.estimated_cached_tokens,
            "ttft_s": num(r.ttft_s),
            "e2e_s": num(r.e2e_s),
            "rejected": r.rejected,
            "running": r.at_arrival.running,
            "waiting": r.at_arrival.waiting,
            "idle_replicas": r.at_arrival.idle_replicas,
            "min_waiting": r.at_arrival.min_waiting,
        });
        if let (Some(p), Some(o)) = (r.prefill_replica, line.as_object_mut()) {
            o.insert("prefill_replica".into(), p.into());
            o.insert("transfer_s".into(), r.transfer_s.into());
        }
        if let Some(d) = r.decision {
            let extra = serde_json::json!({
                "reason": d.reason.as_str(),
                "matched_tokens": d.matched_tokens,
                "estimate_s": num(d.ttft_s),
                "wait_s": num(d.wait.waited_at(d.pace) + d.fixed_s),
                "prefill_s": num(d.prefill.at(d.pace)),
                "runner_up_s": num(d.runner_up_ttft_s),
                "spilled": d.spilled,
                "pace_prefill": d.pace.prefill,
                "pace_queue": d.pace.queue,
            });
            if let (Some(o), serde_json::Value::Object(e)) = (line.as_object_mut(), extra) {
                o.extend(e);
            }
        }
        serde_json::to_writer(&mut *out, &line)?;
        out.write_all(b"\n")?;
    }
    out.flush()
}

pub fn main(args: Vec<String>) -> i32 {
    let o = match parse_args(&args) {
        Ok(o) => o,
        Err(e) => return crate::cli::exit_status(&e),
    };
    let started = Instant::now();
    let Runs {
        summaries,
        ttfts,
        host_hit_rates,
        models,
    } = match run(&o) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("kvlb simulate: {e}");
            return 1;
        }
    };
    let replicas = o.fleet_size();
    if o.json {
        let host = (o.host_kv_tokens > 0).then_some(host_hit_rates.as_slice());
        println!("{}", report::to_json_with(&summaries, host, &models));
    } else {
        let host = if o.host_kv_tokens > 0 {
            format!(", host KV tier {} tokens per replica", o.host_kv_tokens)
        } else {
            String::new()
        };
        println!(
            "{} ({} requests, {} replicas, speedup {}{host}{})",
            o.trace,
            summaries[0].requests,
            replicas,
            o.speedup,
            o.fleet_note()
        );
        let host = (o.host_kv_tokens > 0).then_some(host_hit_rates.as_slice());
        print!("{}", report::to_table_with_host(&summaries, host));
        if !models.is_empty() {
            print!("{}", report::model_table(&models));
        }
    }
    if let Some(path) = &o.plot {
        let title = format!(
            "kvlb simulate: {} — {} requests, {} replicas, speedup {}{}",
            o.trace.rsplit('/').next().unwrap_or(&o.trace),
            summaries[0].requests,
            replicas,
            o.speedup,
            o.fleet_note()
        );
        let svg = plot::render(&title, &summaries, &ttfts);
        if let Err(e) = std::fs::write(path, svg) {
            eprintln!("kvlb simulate: --plot {path:?}: cannot write: {e}");
            return 1;
        }
    }
    eprintln!(
        "kvlb simulate: done in {:.2} s wall",
        started.elapsed().as_secs_f64()
    );
    0
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn residency_source_is_parsed_and_checked() {
        let o = parse_args(&args(&["--trace", "gen:agent-sessions"])).unwrap();
        assert_eq!(o.residency, fleet::ResidencySource::Routing);
        for name in fleet::ResidencySource::NAMES {
            let o = parse_args(&args(&["--trace", "x", "--residency", name])).unwrap();
            assert_eq!(o.residency.name(), *name);
        }
        let o = parse_args(&args(&[
            "--trace",
            "x",
            "--host-kv-tokens",
            "3200000",
            "--host-load-s-per-token",
            "1e-6",
        ]))
        .unwrap();
        assert_eq!(
            (o.host_kv_tokens, o.host_load_s_per_token),
            (3_200_000, 1e-6)
        );
        for bad in [
            ["--host-kv-tokens", "8"],
            ["--host-kv-tokens", "-1"],
            ["--host-load-s-per-token", "nan"],
        ] {
            let e = parse_args(&args(&["--trace", "x", bad[0], bad[1]]))
                .unwrap_err()
                .to_string();
            assert!(e.contains(bad[0]) && e.contains(bad[1]), "{e}");
        }
        let e = parse_args(&args(&["--trace", "x", "--residency", "oracle"]))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("'oracle' for '--residency <SOURCE>'")
                && e.contains("[possible values: routing, events, events-pending]"),
            "{e}"
        );
    }

    #[test]
    fn flags_defaults_repeats_and_errors() {
        // clap checks its definition in debug builds (`cargo test` without --release).
        <Options as clap::CommandFactory>::command().debug_assert();
        let o = parse_args(&args(&["--trace", "gen:shared-prefix"])).unwrap();
        assert_eq!((o.replicas, o.speedup, o.seed, o.limit), (4, 1.0, 1, None));
        assert_eq!(o.policies, fleet::POLICY_NAMES.to_vec());
        for p in fleet::POLICY_NAMES {
            assert!(AFTER_HELP.contains(p), "the help's policy list lacks {p}");
        }
        assert!(!o.json && o.plot.is_none() && o.host_kv_tokens == 0);
        assert_eq!(
            o.host_load_s_per_token,
            EngineConfig::default().host_load_s_per_token
        );
        let o = parse_args(&args(&[
            "--trace",
            "a",
            "--trace",
            "b",
            "--policies",
            "random",
            "--policies",
            " cache_aware, round_robin,",
            "--json",
            "--json",
            "--limit",
            "9",
        ]))
        .unwrap();
        assert_eq!(o.trace, "b", "the last value wins");
        assert_eq!(o.policies, ["cache_aware", "round_robin"]);
        assert!(o.json);
        assert_eq!(o.limit, Some(9));
        for (bad, flag, value) in [
            (&["--replicas", "0"][..], "--replicas", "0"),
            (&["--replicas", "257"], "--replicas", "257"),
            (&["--speedup", "-2"], "--speedup", "-2"),
            (&["--policies", "best"], "--policies", "best"),
            (&["--policies", ","], "--policies", ","),
            (&["--seed", "x"], "--seed", "x"),
            (&["--limit"], "--limit", "value is required"),
            (&["--bogus", "1"], "--bogus", "--bogus"),
        ] {
            let mut a = args(&["--trace", "x"]);
            a.extend(args(bad));
            let e = parse_args(&a).unwrap_err().to_string();
            assert!(e.contains(flag) && e.contains(value), "{bad:?}: {e}");
        }
        let e = parse_args(&args(&["--replicas", "2"]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("--trace"), "{e}");
        let e = parse_args(&args(&["--help"])).unwrap_err();
        assert_eq!(e.kind(), clap::error::ErrorKind::DisplayHelp);
    }

    #[test]
    fn fleet_models_give_each_replica_its_names() {
        let o = parse_args(&args(&[
            "--trace",
            "x",
            "--fleet-models",
            "big+sql=2, small=1",
            "--models",
            "big=2,sql=1,small=1",
        ]))
        .unwrap();
        let f = o.fleet_models.clone().unwrap();
        assert_eq!(f.len(), 3);
        assert_eq!(o.fleet_size(), 3);
        assert_eq!(f[1], ["big", "sql"]);
        assert_eq!(f[2], ["small"]);
        assert_eq!(o.models.unwrap().models.len(), 3);
        assert_eq!(
            parse_args(&args(&["--trace", "x"])).unwrap().fleet_size(),
            4
        );
        for (bad, says) in [
            ("big", "expected NAME[+NAME...]=N"),
            ("big=0", "not a whole number"),
            ("big+=1", "empty model name"),
            ("big=300", "more than 256 replicas"),
        ] {
            let e = parse_args(&args(&["--trace", "x", "--fleet-models", bad]))
                .unwrap_err()
                .to_string();
            assert!(e.contains(says), "{bad}: {e}");
        }
        let e = parse_args(&args(&[
            "--trace",
            "x",
            "--replicas",
            "2",
            "--fleet-models",
            "a=1",
        ]))
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("--fleet-models") && e.contains("--replicas"),
            "{e}"
        );
    }

    /// Median TTFT of the finished requests `run` sent to `replicas`.
    fn median_ttft(run: &fleet::Run, replicas: &[u32]) -> f64 {
        let mut t: Vec<f64> = run
            .records
            .iter()
            .filter(|r| r.finished && replicas.contains(&r.replica))
            .map(|r| r.ttft_s)
            .collect();
        assert!(t.len() > 50, "{} requests on {replicas:?}", t.len());
        t.sort_by(f64::total_cmp);
        t[t.len() / 2]
    }

    #[test]
    fn slow_replicas_of_a_mixed_fleet_answer_later() {
        let flags = |extra: &[&str]| {
            let mut a = args(&[
                "--trace",
                "gen:agent-sessions",
                "--policies",
                "round_robin",
                "--limit",
                "800",
            ]);
            a.extend(args(extra));
            parse_args(&a).unwrap()
        };
        let o = flags(&["--speeds", "1,1,0.333,0.333"]);
        let s = setup(&o).unwrap();
        assert_eq!(s.speeds.len(), 4);
        assert_eq!(s.speeds[2].prefill, 0.333);
        // The policy's model stays the default engine's.
        assert_eq!(s.engine.prefill_b_s, EngineConfig::default().prefill_b_s);
        let mixed = simulate_policy(&o, &s, "round_robin").unwrap();
        let (fast, slow) = (median_ttft(&mixed, &[0, 1]), median_ttft(&mixed, &[2, 3]));
        assert!(slow > 2.5 * fast, "fast {fast} s, slow {slow} s");
        assert_eq!(o.fleet_note(), ", speeds 1,1,0.333,0.333");
        // A uniform fleet: both halves alike.
        let o = flags(&[]);
        let uniform = simulate_policy(&o, &setup(&o).unwrap(), "round_robin").unwrap();
        let (a, b) = (
            median_ttft(&uniform, &[0, 1]),
            median_ttft(&uniform, &[2, 3]),
        );
        assert!(b < 1.5 * a && a < 1.5 * b, "{a} s vs {b} s");
        assert_eq!(o.fleet_note(), "");
        // One value for every replica.
        let o = flags(&["--speeds", "0.5"]);
        assert_eq!(
            setup(&o).unwrap().speeds,
            vec![
                Speed {
                    prefill: 0.5,
                    decode: 0.5
                };
                4
            ]
        );
    }

    #[test]
    fn timing_spread_runs_are_deterministic_for_a_seed() {
        let flags = |seed: &str| {
            parse_args(&args(&[
                "--trace",
                "gen:agent-sessions",
                "--limit",
                "300",
                "--timing-spread",
                "0.3",
                "--speeds",
                "1,0.5x0.8,1,2",
                "--seed",
                seed,
            ]))
            .unwrap()
        };
        let ttfts = |o: &Options| {
            let s = setup(o).unwrap();
            simulate_policy(o, &s, "cache_aware")
                .unwrap()
                .records
                .iter()
                .map(|r| r.ttft_s.to_bits())
                .collect::<Vec<u64>>()
        };
        assert_eq!(ttfts(&flags("5")), ttfts(&flags("5")));
        assert_ne!(ttfts(&flags("5")), ttfts(&flags("6")));
        assert_eq!(
            flags("5").fleet_note(),
            ", speeds 1,0.5x0.8,1,2, timing spread 0.3"
        );
    }

    #[test]
    fn roles_are_one_per_replica_prefill_and_decode_together() {
        let o = parse_args(&args(&["--trace", "x"])).unwrap();
        assert_eq!(o.roles, None);
        assert!(!o.pd().is_split() && o.pd().roles.is_empty());
        assert_eq!(o.disaggregate, pd::Disaggregate::Priced);
        assert_eq!((o.kv_bytes_per_token, o.kv_link_gbps), (131_072, 25.0));
        let o = parse_args(&args(&[
            "--trace",
            "gen:agent-sessions",
            "--roles",
            "prefill, prefill,decode,decode",
            "--disaggregate",
            "always",
            "--kv-link-gbps",
            "12.5",
            "--kv-bytes-per-token",
            "65536",
        ]))
        .unwrap();
        use pd::Role::{Both, Decode, Prefill};
        assert_eq!(
            o.roles.as_deref(),
            Some(&[Prefill, Prefill, Decode, Decode][..])
        );
        let p = o.pd();
        assert!(p.is_split());
        assert_eq!(p.disaggregate, pd::Disaggregate::Always);
        assert_eq!(p.transfer_s_per_token, 65536.0 / 12.5e9);
        assert_eq!(setup(&o).unwrap().engine.kv_bytes_per_token, 65536);
        assert_eq!(
            o.fleet_note(),
            ", 2 prefill + 2 decode (disaggregate always, KV link 12.5 GB/s)"
        );
        // With --fleet-models: one per replica of theirs.
        let o = parse_args(&args(&[
            "--trace",
            "x",
            "--fleet-models",
            "a=2,b=1",
            "--roles",
            "prefill,decode,both",
        ]))
        .unwrap();
        assert_eq!(o.roles.as_deref(), Some(&[Prefill, Decode, Both][..]));
        assert!(o.fleet_note().contains("1 prefill + 1 decode + 1 both"));
        for (extra, says) in [
            (
                &["--roles", "prefill,decode"][..],
                "2 roles for --replicas 4",
            ),
            (
                &["--fleet-models", "a=3", "--roles", "prefill,decode"],
                "2 roles for the 3 replicas of --fleet-models",
            ),
            (
                &["--roles", "prefill,prefill,both,both"],
                "prefill replicas need decode replicas",
            ),
            (
                &["--roles", "decode,both,both,both"],
                "need decode replicas",
            ),
            (
                &["--roles", "prefill,prefill,decode,dec"],
                "\"dec\": expected prefill",
            ),
            (&["--roles", ""], "\"\": expected prefill"),
            (
                &["--disaggregate", "never"],
                "[possible values: priced, always]",
            ),
            (&["--kv-link-gbps", "0"], "--kv-link-gbps"),
            (&["--kv-bytes-per-token", "0"], "--kv-bytes-per-token"),
        ] {
            let mut a = args(&["--trace", "x"]);
            a.extend(args(extra));
            let e = parse_args(&a).unwrap_err();
            assert_eq!(e.exit_code(), 2, "{extra:?}");
            let e = e.to_string();
            assert!(e.contains("--") && e.contains(says), "{extra:?}: {e}");
        }
    }

    /// On a disaggregated fleet the prefix cache that matters is the prefill replicas':
    /// cache_aware's prefill leg follows the prefix there, as it does in a whole fleet.
    #[test]
    fn cache_aware_follows_the_prefix_on_the_prefill_replicas() {
        let o = parse_args(&args(&[
            "--trace",
            "gen:agent-sessions",
            "--limit",
            "600",
            "--roles",
            "prefill,prefill,decode,decode",
            "--disaggregate",
            "always",
        ]))
        .unwrap();
        let s = setup(&o).unwrap();
        let hit_rate = |name: &str| {
            let run = simulate_policy(&o, &s, name).unwrap();
            assert!(run
                .records
                .iter()
                .all(|r| r.finished && r.prefill_replica.is_some()));
            report::summarize(&run).hit_rate
        };
        let (cache_aware, round_robin) = (hit_rate("cache_aware"), hit_rate("round_robin"));
        assert!(
            cache_aware > round_robin + 0.1,
            "cache_aware {cache_aware}, round_robin {round_robin}"
        );
    }

    #[test]
    fn speeds_are_one_or_one_per_replica() {
        for (extra, says) in [
            (&["--speeds", "1,2"][..], "--replicas 4"),
            (&["--replicas", "2", "--speeds", "1,1,1"], "--replicas 2"),
            (
                &["--fleet-models", "a=1,b=2", "--speeds", "1,1"],
                "the 3 replicas of --fleet-models",
            ),
            (&["--speeds", "0.001"], "0.001"),
            (&["--speeds", "1x"], "1x"),
        ] {
            let mut a = args(&["--trace", "x"]);
            a.extend(args(extra));
            let e = parse_args(&a).unwrap_err();
            assert_eq!(e.exit_code(), 2);
            let e = e.to_string();
            assert!(e.contains("--speeds") && e.contains(says), "{extra:?}: {e}");
        }
        let o = parse_args(&args(&[
            "--trace",
            "x",
            "--fleet-models",
            "a=1,b=2",
            "--speeds",
            "1,1,0.25",
        ]))
        .unwrap();
        assert_eq!(o.speeds.of(2).prefill, 0.25);
        for bad in ["-1", "2"] {
            let e = parse_args(&args(&["--trace", "x", "--timing-spread", bad]))
                .unwrap_err()
                .to_string();
            assert!(e.contains("--timing-spread") && e.contains(bad), "{e}");
        }
        let o = parse_args(&args(&["--trace", "x"])).unwrap();
        assert!(o.speeds.is_one() && o.timing_spread == 0.0);
    }
}

//! Which models each replica serves: asked of the replica itself (`GET /v1/models`, where vLLM
//! and SGLang list their served names and loaded LoRA adapters, each adapter with its
//! `parent`), or taken from its `models` option, and published to the workers as one
//! [`ModelMap`] (see `crate::models`).
//!
//! One thread asks every replica without a `models` option when it joins the fleet, every
//! `models_refresh`, and as soon as it is available again after being down (an engine
//! restarted with other adapters). A replica that answers no model list (a 404, not JSON: a
//! plain HTTP backend) takes requests for any model, said once in the log; one that cannot be
//! reached keeps the list it last gave. Every change of a replica's names is logged. Adapter
//! names are also learned into `Shared::adapters`, so token-mode prompts naming one are
//! hashed under it before its first KV event.

#![forbid(unsafe_code)]

use crate::config::ReplicaConfig;
use crate::fleet::EMPTY;
use crate::models::{parse_model_list, LoadJob, ModelCard, ModelMap, SlotModels, FAILED};
use crate::worker::Shared;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Model lists that could not be read: the replica answered something other than a list, or
/// could not be reached (`kvlb_model_list_failures_total`).
pub static LIST_FAILURES: AtomicU64 = AtomicU64::new(0);
/// Requests answered 404 because no replica serves the model they name
/// (`kvlb_model_not_found_total`).
pub static NOT_FOUND: AtomicU64 = AtomicU64::new(0);

/// Largest model list read (a replica with thousands of adapters lists a few hundred KiB).
const MAX_LIST_BYTES: usize = 8 << 20;
/// How often the thread looks at the fleet (a new replica is asked within this).
const TICK: Duration = Duration::from_millis(100);

/// What the thread knows of one slot.
#[derive(Default)]
struct SlotState {
    /// The slot's epoch this state is about.
    epoch: u64,
    /// The replica's names; None: not known (it takes any model).
    cards: Option<Vec<ModelCard>>,
    asked_at: Option<Instant>,
    /// Available at the last look (asked again when it comes back).
    was_up: bool,
    /// The last failure said in the log (said again only when it changes).
    said: Option<String>,
}

/// What asking a replica gave.
enum Answer {
    List(Vec<ModelCard>),
    /// An answer that is no model list: the replica takes any model.
    NoList(String),
    /// No answer: keep what was known.
    Unreachable(String),
}

fn ask(r: &ReplicaConfig, timeout: Duration) -> Answer {
    match crate::telemetry::scrape::http_get(
        r.addr,
        &r.authority,
        "/v1/models",
        "application/json",
        timeout,
        MAX_LIST_BYTES,
    ) {
        Err(e) => Answer::Unreachable(e.to_string()),
        Ok((200, _, body)) => match parse_model_list(&body) {
            Ok(cards) => Answer::List(cards),
            Err(e) => Answer::NoList(format!("its /v1/models is no model list ({e})")),
        },
        Ok((_, line, _)) => Answer::NoList(format!("its /v1/models answered {line:?}")),
    }
}

fn names(cards: &[ModelCard]) -> String {
    let list: Vec<String> = cards
        .iter()
        .map(|c| match &c.parent {
            Some(p) => format!("{} (adapter of {p})", c.id),
            None => c.id.clone(),
        })
        .collect();
    list.join(", ")
}

/// Runs until `stop`: keeps `shared.models` up to date, and loads the adapters requests ask
/// it to (`lora_adapter`).
pub fn spawn(shared: Arc<Shared>, stop: Arc<AtomicBool>) -> std::io::Result<FirstLook> {
    let first = FirstLook(Arc::new(AtomicBool::new(false)));
    let done = first.0.clone();
    std::thread::Builder::new()
        .name("kvlb-models".into())
        .spawn(move || {
            let mut states: Vec<SlotState> = (0..shared.fleet.capacity())
                .map(|_| SlotState::default())
                .collect();
            // When kvlb loaded each adapter on each slot: (adapter, slot) -> time.
            let mut loaded_at: std::collections::HashMap<(usize, usize), Instant> =
                std::collections::HashMap::new();
            // The fleet and configuration the map was built for (a reload bumps it too: the
            // classes follow the `[[model]]` tables).
            let mut generation = 0;
            while !stop.load(Relaxed) {
                match shared.on_demand.inbox.recv_timeout(TICK) {
                    Ok(LoadJob::Load(i)) => start_load(&shared, i),
                    Ok(LoadJob::Done { adapter, slot }) => {
                        let epoch = shared.fleet.slot(slot).epoch.load(Relaxed);
                        if shared.on_demand.adapters[adapter].holds(slot, epoch) {
                            // Asked again now: its list shows the adapter from here on.
                            states[slot].asked_at = None;
                            loaded_at.insert((adapter, slot), Instant::now());
                        }
                    }
                    Err(_) => {}
                }
                let mut changed = look(&shared, &mut states);
                changed |= forget_unloaded(&shared, &states, &mut loaded_at);
                let g = shared.fleet.generation.load(Relaxed);
                if changed || g != generation {
                    generation = g;
                    publish(&shared, &states);
                }
                done.store(true, Relaxed);
            }
        })?;
    Ok(first)
}

/// Set once the thread has asked every replica for its models the first time.
pub struct FirstLook(Arc<AtomicBool>);

impl FirstLook {
    /// Waits for the first look, at most `limit` (replicas that do not answer are asked
    /// again later); true when it came.
    pub fn wait(&self, limit: Duration) -> bool {
        let until = Instant::now() + limit;
        while !self.0.load(Relaxed) {
            if Instant::now() >= until {
                return false;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        true
    }
}

/// An adapter kvlb loaded that its replica's list no longer shows (unloaded, the engine
/// restarted) is no longer taken as held there: a request sent there loads it again. Returns
/// false: the map does not change.
fn forget_unloaded(
    shared: &Shared,
    states: &[SlotState],
    loaded_at: &mut std::collections::HashMap<(usize, usize), Instant>,
) -> bool {
    loaded_at.retain(|&(i, slot), at| {
        let a = &shared.on_demand.adapters[i];
        let st = &states[slot];
        if !a.holds(slot, st.epoch) {
            return false;
        }
        let asked_since = st.asked_at.is_some_and(|t| t > *at);
        let gone = asked_since
            && st
                .cards
                .as_ref()
                .is_some_and(|c| !c.iter().any(|c| c.id == a.name));
        if gone {
            eprintln!(
                "kvlb: LoRA adapter {} is no longer listed by replica slot {slot}, where it was \
                 loaded; a request sent there loads it again",
                a.name
            );
            a.forget(slot);
        }
        !gone
    });
    false
}

/// Loads adapter `i` on the replica it is claimed on, on a thread of its own (a load takes
/// seconds on a real engine); says `LoadJob::Done` when it ends.
fn start_load(shared: &Arc<Shared>, i: usize) {
    let a = &shared.on_demand.adapters[i];
    let Some((slot, epoch)) = a.claimed() else {
        return;
    };
    let Some(r) = shared.fleet.slot(slot).spec() else {
        a.release(slot, epoch);
        return;
    };
    eprintln!(
        "kvlb: loading LoRA adapter {} ({}) on replica {}: a request names it and no replica has it",
        a.name, a.path, r.url
    );
    let timeout = shared.cfg().timeouts.upstream;
    let me = shared.clone();
    let spawned = std::thread::Builder::new()
        .name("kvlb-lora-load".into())
        .spawn(move || {
            let shared = me;
            let a = &shared.on_demand.adapters[i];
            let started = Instant::now();
            let body = serde_json::json!({"lora_name": a.name, "lora_path": a.path}).to_string();
            let result = match crate::telemetry::scrape::http_request(
                r.addr,
                &r.authority,
                "POST",
                "/v1/load_lora_adapter",
                "application/json",
                Some(body.as_bytes()),
                timeout,
                64 << 10,
            ) {
                Ok((200, _, _)) => Ok(()),
                // Loaded already (by an operator, or a load whose answer was lost).
                Ok((400, _, b)) if String::from_utf8_lossy(&b).contains("already been loaded") => {
                    Ok(())
                }
                Ok((_, line, b)) => Err(format!(
                    "replica {} answered {line:?}: {}",
                    r.url,
                    String::from_utf8_lossy(&b[..b.len().min(300)]).trim()
                )),
                Err(e) => Err(format!("replica {}: {e}", r.url)),
            };
            match result {
                Ok(()) => {
                    a.loads.fetch_add(1, Relaxed);
                    shared.on_demand.timed(started.elapsed().as_micros() as u64);
                    a.loaded_on(slot, epoch);
                    eprintln!(
                        "kvlb: LoRA adapter {} loaded on replica {} in {} ms",
                        a.name,
                        r.url,
                        started.elapsed().as_millis()
                    );
                }
                Err(why) => {
                    a.failures.fetch_add(1, Relaxed);
                    eprintln!("kvlb: loading LoRA adapter {} failed: {why}", a.name);
                    a.error.store(Some(Arc::new(why)));
                    a.failed_at_ms.store(shared.now_ms().max(1), Relaxed);
                    a.state.store(FAILED, Relaxed);
                }
            }
            let _ = shared
                .on_demand
                .jobs
                .send(LoadJob::Done { adapter: i, slot });
        });
    if let Err(e) = spawned {
        let a = &shared.on_demand.adapters[i];
        a.error
            .store(Some(Arc::new(format!("cannot start a thread: {e}"))));
        a.failed_at_ms.store(shared.now_ms().max(1), Relaxed);
        a.state.store(FAILED, Relaxed);
    }
}

/// One look at the fleet: takes pinned lists, asks the replicas that are due. Returns whether
/// any slot's names changed.
fn look(shared: &Shared, states: &mut [SlotState]) -> bool {
    let cfg = shared.cfg();
    let refresh = cfg.telemetry.models_refresh;
    let timeout = cfg
        .health
        .timeout
        .clamp(Duration::from_millis(200), Duration::from_secs(5));
    let now_ms = shared.now_ms();
    let mut changed = false;
    let mut due: Vec<(usize, Arc<ReplicaConfig>)> = Vec::new();
    for (i, slot) in shared.fleet.slots() {
        let st = &mut states[i];
        let spec = slot.spec().filter(|_| slot.state() != EMPTY);
        let Some(spec) = spec else {
            if st.cards.is_some() {
                changed = true;
            }
            *st = SlotState::default();
            continue;
        };
        let epoch = slot.epoch.load(Relaxed);
        if st.epoch != epoch {
            *st = SlotState {
                epoch,
                ..SlotState::default()
            };
            changed = true;
        }
        if let Some(pinned) = &spec.models {
            // Compared each time: a reload may change a replica's option in place.
            let cards: Vec<ModelCard> = pinned.iter().map(|n| ModelCard::named(n)).collect();
            if st.cards.as_ref() != Some(&cards) {
                st.cards = Some(cards);
                changed = true;
            }
            continue;
        }
        if refresh.is_zero() {
            changed |= st.cards.take().is_some();
            continue;
        }
        let up = slot.available(now_ms);
        let back = up && !st.was_up && st.asked_at.is_some();
        st.was_up = up;
        if st.asked_at.is_none_or(|t| t.elapsed() >= refresh) || back {
            due.push((i, spec));
        }
    }
    if due.is_empty() {
        return changed;
    }
    // Every due replica at once: one slow replica does not hold up the others' lists.
    let answers: Vec<(usize, Arc<ReplicaConfig>, Answer)> = std::thread::scope(|scope| {
        let handles: Vec<_> = due
            .into_iter()
            .map(|(i, r)| scope.spawn(move || (i, ask(&r, timeout), r)))
            .collect();
        handles
            .into_iter()
            .filter_map(|h| h.join().ok())
            .map(|(i, a, r)| (i, r, a))
            .collect()
    });
    for (i, r, answer) in answers {
        let st = &mut states[i];
        st.asked_at = Some(Instant::now());
        match answer {
            Answer::List(cards) => {
                for c in cards.iter().filter(|c| c.is_adapter()) {
                    shared.adapters.insert(c.id.as_bytes());
                }
                if st.cards.as_ref() != Some(&cards) {
                    eprintln!("kvlb: replica {}: serves {}", r.url, names(&cards));
                    st.cards = Some(cards);
                    changed = true;
                }
                st.said = None;
            }
            Answer::NoList(why) => {
                LIST_FAILURES.fetch_add(1, Relaxed);
                if st.said.as_deref() != Some(why.as_str()) {
                    eprintln!(
                        "kvlb: replica {}: {why}; it takes requests for any model \
                         (kvlb_model_list_failures_total)",
                        r.url
                    );
                    st.said = Some(why);
                }
                changed |= st.cards.take().is_some();
            }
            Answer::Unreachable(why) => {
                LIST_FAILURES.fetch_add(1, Relaxed);
                let why = format!("cannot ask for its models ({why})");
                if st.said.as_deref() != Some(why.as_str()) {
                    let keeps = match &st.cards {
                        Some(c) => format!("keeps serving {}", names(c)),
                        None => "takes requests for any model until it answers".to_string(),
                    };
                    eprintln!("kvlb: replica {}: {why}; it {keeps}", r.url);
                    st.said = Some(why);
                }
            }
        }
    }
    changed
}

/// Builds the map of what the slots serve, with every name's class, and puts it in force.
fn publish(shared: &Shared, states: &[SlotState]) {
    let slots: Vec<SlotModels> = states
        .iter()
        .enumerate()
        .filter_map(|(slot, st)| {
            st.cards.as_ref().map(|cards| SlotModels {
                slot,
                epoch: st.epoch,
                cards: cards.clone(),
            })
        })
        .collect();
    let cfg = shared.cfg();
    let tables: Vec<&[String]> = cfg.models.iter().map(|m| m.names.as_slice()).collect();
    let extra: Vec<(&str, Option<&str>)> = shared
        .on_demand
        .adapters
        .iter()
        .map(|a| (a.name.as_str(), a.base_name.as_deref()))
        .collect();
    let map = ModelMap::build(shared.fleet.capacity(), &slots).with_classes(
        &tables,
        &extra,
        &mut |name| shared.model_labels.label(name),
    );
    shared.models.store(Arc::new(map));
}

/// Most model names with a label of their own in `kvlb_model_replicas`.
const MAX_MODEL_LABELS: usize = 256;

/// The models' figures on /metrics.
pub struct ModelMetrics(pub Arc<Shared>);

impl std::fmt::Debug for ModelMetrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ModelMetrics")
    }
}

impl crate::metrics::Collector for ModelMetrics {
    fn encode(&self, mut enc: crate::metrics::DescriptorEncoder<'_>) -> std::fmt::Result {
        use crate::metrics::families;
        let map = self.0.models.load();
        let mut samples = families::MODEL_REPLICAS.describe(&mut enc)?;
        let mut other = None;
        for (n, (card, slots)) in map.served().enumerate() {
            if n < MAX_MODEL_LABELS {
                samples.gauge(&[card.id.as_str()], slots.len() as u64)?;
            } else {
                *other.get_or_insert(0) += slots.len() as u64;
            }
        }
        if let Some(v) = other {
            samples.gauge(&["other"], v)?;
        }
        let workers = &self.0.workers;
        let labels: Vec<(usize, &str)> = self.0.model_labels.names().collect();
        let mut samples = families::MODEL_REQUESTS.describe(&mut enc)?;
        for &(l, name) in &labels {
            for (c, class) in crate::metrics::STATUS_CLASSES.iter().enumerate() {
                let n = workers
                    .iter()
                    .map(|w| w.models[l].responses[c].load(Relaxed))
                    .sum();
                samples.counter(&[name, class], n)?;
            }
        }
        let mut samples = families::MODEL_TIME_TO_FIRST_TOKEN.describe(&mut enc)?;
        for &(l, name) in &labels {
            let hs: Vec<&crate::metrics::Histogram> =
                workers.iter().map(|w| &w.models[l].first_token).collect();
            samples.latency_of(&[name], &hs)?;
        }
        type Pick = fn(&crate::metrics::ModelStats) -> &AtomicU64;
        let tokens: [(&'static crate::metrics::Family, Pick); 2] = [
            (&families::MODEL_PROMPT_TOKENS, |m| &m.prompt_tokens),
            (&families::MODEL_MATCHED_TOKENS, |m| &m.matched_tokens),
        ];
        for (family, pick) in tokens {
            let mut samples = family.describe(&mut enc)?;
            for &(l, name) in &labels {
                let n = workers
                    .iter()
                    .map(|w| pick(&w.models[l]).load(Relaxed))
                    .sum();
                samples.counter(&[name], n)?;
            }
        }
        families::MODEL_NOT_FOUND
            .describe(&mut enc)?
            .counter(&[], NOT_FOUND.load(Relaxed))?;
        families::MODEL_LIST_FAILURES
            .describe(&mut enc)?
            .counter(&[], LIST_FAILURES.load(Relaxed))?;
        let mut samples = families::LORA_LOADS.describe(&mut enc)?;
        for a in &self.0.on_demand.adapters {
            samples.counter(&[a.name.as_str(), "ok"], a.loads.load(Relaxed))?;
            samples.counter(&[a.name.as_str(), "failed"], a.failures.load(Relaxed))?;
        }
        Ok(())
    }
}

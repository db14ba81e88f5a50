//! Which replica serves which model: the names each replica answers to (its base models and
//! their aliases, its loaded LoRA adapters), as the replica lists them in its `/v1/models` or
//! as configured, gathered into one [`ModelMap`] that workers read without a lock.
//!
//! A request naming a model may go only to the replicas serving it; the policy, the residency
//! index and the cost model then see that model's fleet alone. Replicas whose list is not
//! known (not asked yet, or answering no list: a plain HTTP backend) take any model, as before
//! kvlb knew of models; a request without a `model` may go anywhere.
//!
//! The map is rebuilt whole by one control thread when a list changes and swapped in
//! (`arc-swap`); a lookup is one hash probe and a bit test per candidate, allocation-free.

#![forbid(unsafe_code)]
#![warn(clippy::disallowed_methods, clippy::disallowed_types)]

use serde_json::Value;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicU8, Ordering::Relaxed};
use xxhash_rust::xxh3::xxh3_64;

/// The key a model name is looked up by (`ModelKey::Named`), also the key of an adapter in a
/// replica's LoRA report (`estimate::LoraMask`).
#[inline]
pub fn name_hash(name: &[u8]) -> u64 {
    xxh3_64(name)
}

/// Longest `model` a request may name and still be routed by it (longer names are served by
/// no replica kvlb knows of: routed as unnamed).
pub const MODEL_BYTES: usize = 256;

/// A request's decoded `model`, in a fixed buffer (no allocation per request).
#[derive(Clone)]
pub struct ModelName {
    bytes: [u8; MODEL_BYTES],
    /// Decoded length; past [`MODEL_BYTES`] the name was cut (and names no served model).
    len: usize,
    /// A string `model` was present.
    present: bool,
}

impl Default for ModelName {
    fn default() -> Self {
        ModelName {
            bytes: [0; MODEL_BYTES],
            len: 0,
            present: false,
        }
    }
}

impl std::fmt::Debug for ModelName {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.get() {
            Some(b) => write!(f, "{:?}", String::from_utf8_lossy(b)),
            None => f.write_str("None"),
        }
    }
}

impl ModelName {
    pub fn clear(&mut self) {
        self.len = 0;
        self.present = false;
    }

    /// Appends a decoded piece of the name.
    #[inline]
    pub fn push(&mut self, piece: &[u8]) {
        self.present = true;
        let end = self.len + piece.len();
        if end <= MODEL_BYTES {
            self.bytes[self.len..end].copy_from_slice(piece);
        }
        self.len = end;
    }

    /// The name, when one was given and fits the buffer (an empty string is none).
    #[inline]
    pub fn get(&self) -> Option<&[u8]> {
        (self.present && self.len > 0 && self.len <= MODEL_BYTES).then(|| &self.bytes[..self.len])
    }

    /// A name was given, longer than [`MODEL_BYTES`].
    pub fn too_long(&self) -> bool {
        self.len > MODEL_BYTES
    }

    /// The name as far as it was kept (for an error message).
    pub fn shown(&self) -> std::borrow::Cow<'_, str> {
        String::from_utf8_lossy(&self.bytes[..self.len.min(MODEL_BYTES)])
    }
}

/// The model a request is routed by.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ModelKey {
    /// No model to route by: every replica may take it.
    #[default]
    Any,
    /// The hash of a served name: the replicas serving it, and those whose models are
    /// unknown.
    Named(u64),
}

/// What a lookup of a request's `model` found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Resolved {
    /// Route by this key.
    Route(ModelKey),
    /// No replica is known to serve the name: 404, unless a replica whose models are not
    /// known might serve it (the caller checks the fleet); routed by this key to those.
    NotServed(ModelKey),
}

/// One entry of a replica's model list.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelCard {
    pub id: String,
    /// The base model of a LoRA adapter (vLLM and SGLang list adapters with their parent).
    pub parent: Option<String>,
    /// The card as the replica sent it (echoed by kvlb's own `/v1/models`).
    pub raw: Value,
}

impl ModelCard {
    /// A card for a name configured by hand (`models = [...]`).
    pub fn named(id: &str) -> ModelCard {
        ModelCard {
            id: id.to_string(),
            parent: None,
            raw: serde_json::json!({"id": id, "object": "model", "owned_by": "kvlb", "root": id, "parent": null}),
        }
    }

    pub fn is_adapter(&self) -> bool {
        self.parent.is_some()
    }
}

/// Most cards read from one replica's list (a longer list is cut, and the cut said).
pub const MAX_CARDS: usize = 4096;

/// Parses an OpenAI model list (`{"object":"list","data":[{"id":...,"parent":...},...]}`).
pub fn parse_model_list(body: &[u8]) -> Result<Vec<ModelCard>, String> {
    let v: Value = serde_json::from_slice(body).map_err(|e| format!("not JSON: {e}"))?;
    let data = v
        .get("data")
        .and_then(Value::as_array)
        .ok_or("no \"data\" array")?;
    let mut cards = Vec::with_capacity(data.len().min(MAX_CARDS));
    for (i, card) in data.iter().take(MAX_CARDS).enumerate() {
        let id = card
            .get("id")
            .and_then(Value::as_str)
            .filter(|s| !s.is_empty() && s.len() <= MODEL_BYTES)
            .ok_or_else(|| format!("data[{i}]: no \"id\" string of 1 to {MODEL_BYTES} bytes"))?;
        let parent = match card.get("parent") {
            None | Some(Value::Null) => None,
            Some(Value::String(p)) if !p.is_empty() => Some(p.clone()),
            Some(_) => return Err(format!("data[{i}]: \"parent\" is not a string or null")),
        };
        if cards.iter().any(|c: &ModelCard| c.id == id) {
            continue;
        }
        cards.push(ModelCard {
            id: id.to_string(),
            parent,
            raw: card.clone(),
        });
    }
    Ok(cards)
}

/// One replica slot's models as of a build of the map.
#[derive(Debug, Clone)]
pub struct SlotModels {
    pub slot: usize,
    /// The slot's epoch when its list was taken (a slot given to another replica since is
    /// not covered by the map until the next build).
    pub epoch: u64,
    pub cards: Vec<ModelCard>,
}

/// A hasher for keys that are hashes already.
#[derive(Default, Clone, Copy)]
pub struct KeyHasher(u64);

impl std::hash::Hasher for KeyHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = self.0.rotate_left(8) ^ b as u64;
        }
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }
}

type KeyMap<V> = HashMap<u64, V, std::hash::BuildHasherDefault<KeyHasher>>;

/// Every served name over the fleet, with the replicas serving it.
pub struct ModelMap {
    /// Bitset words per mask (`capacity` slots).
    words: usize,
    /// Slots whose lists the map holds.
    covered: Vec<u64>,
    /// Each slot's epoch as of its list (meaningful where covered).
    epochs: Vec<u64>,
    /// Name hash -> index of its mask in `masks` and of its card in `cards`.
    index: KeyMap<usize>,
    masks: Vec<u64>,
    /// One card per name (the first replica's), in order of first appearance.
    cards: Vec<ModelCard>,
    /// Each covered slot's names (for `/replicas`).
    per_slot: Vec<(usize, Vec<String>)>,
    /// The body of kvlb's own `GET /v1/models`.
    list_json: Vec<u8>,
    /// Name hash -> its label and settings (`with_classes`).
    classes: KeyMap<ModelClass>,
}

/// Most model labels of the per-model metric families, `other` included: the names after
/// the first ones given a label (served names, `[[model]]` names, adapters to load), and
/// every name no replica serves, are counted under `other`.
pub const MAX_MODEL_LABELS: usize = 64;

/// The label of every name without one of its own.
pub const OTHER_LABEL: &str = "other";

/// The names of the model labels, `other` first: given by one thread (the one building the
/// map) and read by any, without a lock. A name keeps its label while kvlb runs.
pub struct ModelLabels {
    names: Vec<std::sync::OnceLock<String>>,
    len: std::sync::atomic::AtomicUsize,
}

impl Default for ModelLabels {
    fn default() -> Self {
        let names: Vec<std::sync::OnceLock<String>> = (0..MAX_MODEL_LABELS)
            .map(|_| std::sync::OnceLock::new())
            .collect();
        let _ = names[0].set(OTHER_LABEL.to_string());
        ModelLabels {
            names,
            len: std::sync::atomic::AtomicUsize::new(1),
        }
    }
}

impl ModelLabels {
    /// The label of `name`, given one while any is left (0: `other`). One thread calls it.
    pub fn label(&self, name: &str) -> u16 {
        use std::sync::atomic::Ordering::{Acquire, Release};
        let n = self.len.load(Acquire);
        if let Some(i) = (1..n).find(|&i| self.names[i].get().is_some_and(|s| s == name)) {
            return i as u16;
        }
        if n == MAX_MODEL_LABELS || name == OTHER_LABEL {
            return 0;
        }
        let _ = self.names[n].set(name.to_string());
        self.len.store(n + 1, Release);
        n as u16
    }

    /// Every label given, `other` first, with its index.
    pub fn names(&self) -> impl Iterator<Item = (usize, &str)> + '_ {
        let n = self.len.load(std::sync::atomic::Ordering::Acquire);
        (0..n).filter_map(move |i| self.names[i].get().map(|s| (i, s.as_str())))
    }
}

/// A request's model as the per-model metrics and settings see it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ModelClass {
    /// Its label in the per-model metric families (0: `other`, every name without one).
    pub label: u16,
    /// Its `[[model]]` table, counted from 1 (0: none, the global settings apply).
    pub table: u16,
    /// A LoRA adapter (listed with a `parent`, or one kvlb loads): it needs one of the
    /// replica's LoRA batch slots.
    pub adapter: bool,
}

impl ModelMap {
    /// The map of a fleet of `capacity` slots whose lists are not known (every replica takes
    /// any model).
    pub fn empty(capacity: usize) -> ModelMap {
        ModelMap::build(capacity, &[])
    }

    pub fn build(capacity: usize, slots: &[SlotModels]) -> ModelMap {
        let words = capacity.div_ceil(64).max(1);
        let mut map = ModelMap {
            words,
            covered: vec![0; words],
            epochs: vec![0; capacity],
            index: KeyMap::default(),
            masks: Vec::new(),
            cards: Vec::new(),
            per_slot: Vec::new(),
            list_json: Vec::new(),
            classes: KeyMap::default(),
        };
        for s in slots.iter().filter(|s| s.slot < capacity) {
            map.covered[s.slot / 64] |= 1 << (s.slot % 64);
            map.epochs[s.slot] = s.epoch;
            for card in &s.cards {
                let h = name_hash(card.id.as_bytes());
                let at = *map.index.entry(h).or_insert_with(|| {
                    map.cards.push(card.clone());
                    map.masks.extend(std::iter::repeat_n(0, words));
                    map.cards.len() - 1
                });
                map.masks[at * words + s.slot / 64] |= 1 << (s.slot % 64);
            }
            map.per_slot
                .push((s.slot, s.cards.iter().map(|c| c.id.clone()).collect()));
        }
        let data: Vec<&Value> = map.cards.iter().map(|c| &c.raw).collect();
        map.list_json = serde_json::to_vec(&serde_json::json!({"object": "list", "data": data}))
            .unwrap_or_default();
        map
    }

    /// Gives each name its class: the `[[model]]` table naming it (`tables[t]` holds table
    /// `t + 1`'s names), or an adapter's parent's table; and its metric label, from `label`
    /// (0 when it has none). Classed: every served name, every table's names, and `extra`
    /// (adapters kvlb may load, served by no replica yet, with their base).
    pub fn with_classes(
        mut self,
        tables: &[&[String]],
        extra: &[(&str, Option<&str>)],
        label: &mut dyn FnMut(&str) -> u16,
    ) -> ModelMap {
        let table_of = |name: &str| {
            tables
                .iter()
                .position(|names| names.iter().any(|n| n == name))
                .map_or(0, |t| t as u16 + 1)
        };
        // (name, parent, whether an adapter)
        let served = self
            .cards
            .iter()
            .map(|c| (c.id.as_str(), c.parent.as_deref(), c.is_adapter()));
        let named = tables
            .iter()
            .flat_map(|names| names.iter().map(|n| (n.as_str(), None, false)));
        let extra = extra.iter().map(|&(name, base)| (name, base, true));
        let all: Vec<(&str, Option<&str>, bool)> = served.chain(named).chain(extra).collect();
        let mut classes = KeyMap::default();
        for (name, parent, adapter) in all {
            let h = name_hash(name.as_bytes());
            if classes.contains_key(&h) {
                continue;
            }
            let table = match table_of(name) {
                0 => parent.map_or(0, table_of),
                t => t,
            };
            classes.insert(
                h,
                ModelClass {
                    label: label(name),
                    table,
                    adapter,
                },
            );
        }
        self.classes = classes;
        self
    }

    /// The class of a request's `model`, as `resolve` found it (the default class: a name
    /// without a label or table).
    #[inline]
    pub fn class(&self, model: &ModelName, resolved: Resolved) -> ModelClass {
        let h = match resolved {
            Resolved::Route(ModelKey::Named(h)) | Resolved::NotServed(ModelKey::Named(h)) => h,
            _ => match model.get() {
                Some(name) => name_hash(name),
                None => return ModelClass::default(),
            },
        };
        self.classes.get(&h).copied().unwrap_or_default()
    }

    /// The class of a name (an adapter kvlb loads on demand).
    pub fn class_of(&self, name: &str) -> ModelClass {
        self.classes
            .get(&name_hash(name.as_bytes()))
            .copied()
            .unwrap_or_default()
    }

    /// Whether any replica's list is known (kvlb answers `/v1/models` itself only then).
    pub fn knows_any(&self) -> bool {
        self.covered.iter().any(|w| *w != 0)
    }

    /// Whether the map holds the list of `slot` as it is now (its `epoch`).
    #[inline]
    pub fn covers(&self, slot: usize, epoch: u64) -> bool {
        self.covered
            .get(slot / 64)
            .is_some_and(|w| w & (1 << (slot % 64)) != 0)
            && self.epochs[slot] == epoch
    }

    /// The key a request's `model` routes by: the name itself when served, else the adapter
    /// of SGLang's `base:adapter` form (each `:` tried from the left, as the base may hold
    /// colons), else the base before it.
    pub fn resolve(&self, model: &ModelName) -> Resolved {
        let Some(name) = model.get() else {
            return match model.too_long() && self.knows_any() {
                // A key no list holds: only replicas whose models are not known take it.
                true => Resolved::NotServed(ModelKey::Named(0)),
                false => Resolved::Route(ModelKey::Any),
            };
        };
        if !self.knows_any() {
            return Resolved::Route(ModelKey::Any);
        }
        let h = name_hash(name);
        if self.index.contains_key(&h) {
            return Resolved::Route(ModelKey::Named(h));
        }
        let mut at = 0;
        while let Some(colon) = name[at..].iter().position(|&b| b == b':') {
            let (base, adapter) = (&name[..at + colon], name[at + colon + 1..].trim_ascii());
            for part in [adapter, base] {
                let h = name_hash(part);
                if !part.is_empty() && self.index.contains_key(&h) {
                    return Resolved::Route(ModelKey::Named(h));
                }
            }
            at += colon + 1;
        }
        Resolved::NotServed(ModelKey::Named(h))
    }

    /// Whether a request routed by `key` may go to `slot` (at `epoch`): it serves the model,
    /// or its models are not known.
    #[inline]
    pub fn allows(&self, key: ModelKey, slot: usize, epoch: u64) -> bool {
        let h = match key {
            ModelKey::Any => return true,
            ModelKey::Named(h) => h,
        };
        if !self.covers(slot, epoch) {
            return true;
        }
        match self.index.get(&h) {
            Some(&at) => self.masks[at * self.words + slot / 64] & (1 << (slot % 64)) != 0,
            None => false,
        }
    }

    /// The body of `GET /v1/models`: every served name once (adapters with their parent).
    pub fn list_json(&self) -> &[u8] {
        &self.list_json
    }

    /// The card of one served name (`GET /v1/models/{id}`).
    pub fn card(&self, id: &[u8]) -> Option<&ModelCard> {
        self.index
            .get(&name_hash(id))
            .map(|&at| &self.cards[at])
            .filter(|c| c.id.as_bytes() == id)
    }

    /// The names `slot` serves, if its list is known.
    pub fn names_of(&self, slot: usize) -> Option<&[String]> {
        self.per_slot
            .iter()
            .find(|(s, _)| *s == slot)
            .map(|(_, n)| n.as_slice())
    }

    /// Every served name with the replicas serving it (slots), in order of first appearance.
    pub fn served(&self) -> impl Iterator<Item = (&ModelCard, Vec<usize>)> + '_ {
        self.cards.iter().enumerate().map(move |(at, card)| {
            let mask = &self.masks[at * self.words..(at + 1) * self.words];
            let slots = (0..self.words * 64)
                .filter(|i| mask[i / 64] & (1 << (i % 64)) != 0)
                .collect();
            (card, slots)
        })
    }
}

/// The load of an adapter on demand: none, in progress, the last one failed.
pub const IDLE: u8 = 0;
pub const LOADING: u8 = 1;
pub const FAILED: u8 = 3;

/// One LoRA adapter kvlb may load on a replica (`lora_adapter`): where kvlb loaded it, and
/// the one load in progress (claimed by the request that chose a replica without it, so that
/// concurrent requests wait for that load instead of each starting their own).
pub struct OnDemandAdapter {
    pub name: String,
    /// Its name's key (as `ModelKey::Named` holds it).
    pub key: u64,
    pub path: String,
    /// The hash of the base model's name (None: any replica whose models are known).
    pub base: Option<u64>,
    pub base_name: Option<String>,
    /// The load in progress, or the last one that failed: `(epoch << 16) | (slot + 1)` of
    /// its replica; 0: none.
    claim: AtomicU64,
    /// Of the claim: `LOADING` or `FAILED` (`IDLE` without one).
    pub state: AtomicU8,
    /// Per replica slot, that slot's epoch + 1 once kvlb loaded the adapter there (0: not).
    loaded: Vec<AtomicU64>,
    /// Ms since start when the last load failed, and why.
    pub failed_at_ms: AtomicU64,
    pub error: arc_swap::ArcSwapOption<String>,
    pub loads: AtomicU64,
    pub failures: AtomicU64,
}

fn claim_word(slot: usize, epoch: u64) -> u64 {
    (epoch << 16) | (slot as u64 + 1)
}

impl OnDemandAdapter {
    /// The replica slot and epoch of the load in progress (or the last failed one).
    pub fn claimed(&self) -> Option<(usize, u64)> {
        match self.claim.load(Relaxed) {
            0 => None,
            c => Some(((c & 0xffff) as usize - 1, c >> 16)),
        }
    }

    /// Claims the load on `slot` at `epoch`; false when another load holds the claim.
    pub fn claim(&self, slot: usize, epoch: u64) -> bool {
        let won = self
            .claim
            .compare_exchange(0, claim_word(slot, epoch), Relaxed, Relaxed)
            .is_ok();
        if won {
            self.state.store(LOADING, Relaxed);
        }
        won
    }

    /// Forgets the claim (its replica left, or a failed load is to be tried again).
    pub fn release(&self, slot: usize, epoch: u64) {
        let c = claim_word(slot, epoch);
        if self.claim.compare_exchange(c, 0, Relaxed, Relaxed).is_ok() {
            self.state.store(IDLE, Relaxed);
        }
    }

    /// The claimed load succeeded: the adapter is on `slot` (at `epoch`) from now on.
    pub fn loaded_on(&self, slot: usize, epoch: u64) {
        if let Some(l) = self.loaded.get(slot) {
            l.store(epoch.wrapping_add(1), Relaxed);
        }
        self.release(slot, epoch);
    }

    /// Whether kvlb loaded it on `slot` as it is now (`epoch`).
    #[inline]
    pub fn holds(&self, slot: usize, epoch: u64) -> bool {
        self.loaded
            .get(slot)
            .is_some_and(|l| l.load(Relaxed) == epoch.wrapping_add(1))
    }

    /// It is no longer on `slot` (unloaded, the engine restarted).
    pub fn forget(&self, slot: usize) {
        if let Some(l) = self.loaded.get(slot) {
            l.store(0, Relaxed);
        }
    }

    /// Every slot kvlb loaded it on, with the epoch it was loaded at.
    pub fn loaded_slots(&self) -> impl Iterator<Item = (usize, u64)> + '_ {
        self.loaded
            .iter()
            .enumerate()
            .filter_map(|(i, l)| match l.load(Relaxed) {
                0 => None,
                e => Some((i, e.wrapping_sub(1))),
            })
    }
}

/// What the model thread is asked to do, and told.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LoadJob {
    /// Load adapter `i` on the replica it is claimed on.
    Load(usize),
    /// Loading adapter `adapter` on `slot` ended (its state says how).
    Done { adapter: usize, slot: usize },
}

/// The adapters kvlb loads on demand, and the queue of loads for the model thread.
pub struct OnDemand {
    pub adapters: Vec<OnDemandAdapter>,
    /// Requests and loader threads send here; the model thread reads `inbox`.
    pub jobs: crossbeam::channel::Sender<LoadJob>,
    pub inbox: crossbeam::channel::Receiver<LoadJob>,
    /// How long the loads took, in µs (a moving average; 0 until one was timed).
    pub load_us: AtomicU64,
}

impl OnDemand {
    /// The adapters of `list` (name, path, base) for a fleet of `capacity` slots.
    pub fn new(list: &[(String, String, Option<String>)], capacity: usize) -> OnDemand {
        let (jobs, inbox) = crossbeam::channel::unbounded();
        OnDemand {
            adapters: list
                .iter()
                .map(|(name, path, base)| OnDemandAdapter {
                    name: name.clone(),
                    key: name_hash(name.as_bytes()),
                    path: path.clone(),
                    base: base.as_deref().map(|b| name_hash(b.as_bytes())),
                    base_name: base.clone(),
                    claim: AtomicU64::new(0),
                    state: AtomicU8::new(IDLE),
                    loaded: (0..capacity).map(|_| AtomicU64::new(0)).collect(),
                    failed_at_ms: AtomicU64::new(0),
                    error: arc_swap::ArcSwapOption::empty(),
                    loads: AtomicU64::new(0),
                    failures: AtomicU64::new(0),
                })
                .collect(),
            jobs,
            inbox,
            load_us: AtomicU64::new(0),
        }
    }

    /// The adapter a request's `model` names, if kvlb may load it.
    pub fn find(&self, model: &ModelName) -> Option<usize> {
        let name = model.get()?;
        self.adapters.iter().position(|a| a.name.as_bytes() == name)
    }

    /// Takes the time of one successful load into the average (two loads ending at once may
    /// lose one of their times: a skew, not an error).
    pub fn timed(&self, us: u64) {
        let old = self.load_us.load(Relaxed);
        let new = match old {
            0 => us.max(1),
            o => (o * 3 + us) / 4,
        };
        self.load_us.store(new.max(1), Relaxed);
    }
}

/// The `model` of a JSON request body, read without decoding anything else (for the paths
/// whose prompt kvlb does not read: embeddings, rerank, score, tokenize, ...). Skims the
/// top-level members' values; a body that is no JSON object leaves `out` empty.
pub fn top_level_model(body: &[u8], out: &mut ModelName) {
    out.clear();
    crate::prompt::top_level_string(body, b"model", &mut |piece| out.push(piece));
}

#[cfg(test)]
mod tests {
    use super::*;

    fn name(s: &str) -> ModelName {
        let mut m = ModelName::default();
        m.push(s.as_bytes());
        m
    }

    fn list(ids: &[(&str, Option<&str>)]) -> Vec<ModelCard> {
        ids.iter()
            .map(|(id, parent)| ModelCard {
                id: id.to_string(),
                parent: parent.map(str::to_string),
                raw: serde_json::json!({"id": id, "parent": parent}),
            })
            .collect()
    }

    fn two_models() -> ModelMap {
        ModelMap::build(
            4,
            &[
                SlotModels {
                    slot: 0,
                    epoch: 1,
                    cards: list(&[("big", None), ("big-alias", None), ("sql", Some("big"))]),
                },
                SlotModels {
                    slot: 1,
                    epoch: 1,
                    cards: list(&[("big", None)]),
                },
                SlotModels {
                    slot: 2,
                    epoch: 1,
                    cards: list(&[("small", None)]),
                },
            ],
        )
    }

    fn key(map: &ModelMap, s: &str) -> ModelKey {
        match map.resolve(&name(s)) {
            Resolved::Route(k) => k,
            Resolved::NotServed(_) => panic!("{s} not served"),
        }
    }

    #[test]
    fn names_take_their_table_and_label_adapters_their_parents_table() {
        let tables: Vec<Vec<String>> = vec![
            vec!["small".into()],
            vec!["big".into(), "big-alias".into()],
            vec!["unserved".into()],
        ];
        let refs: Vec<&[String]> = tables.iter().map(Vec::as_slice).collect();
        let mut given: Vec<String> = Vec::new();
        let mut label = |n: &str| {
            given.push(n.to_string());
            match given.len() < 4 {
                true => given.len() as u16,
                false => 0, // out of labels
            }
        };
        let map = two_models().with_classes(&refs, &[("lazy", Some("small"))], &mut label);
        let class = |s: &str| {
            let m = name(s);
            map.class(&m, map.resolve(&m))
        };
        let base = |label, table| ModelClass {
            label,
            table,
            adapter: false,
        };
        assert_eq!(class("big"), base(1, 2));
        assert_eq!(class("big-alias"), base(2, 2));
        // The adapter follows its parent's table, with a label of its own.
        let sql = ModelClass {
            adapter: true,
            ..base(3, 2)
        };
        assert_eq!(class("sql"), sql);
        // SGLang's base:adapter form is the adapter's class.
        assert_eq!(class("big:sql"), class("sql"));
        // Labels ran out: the table still applies.
        assert_eq!(class("small"), base(0, 1));
        // A table's name no replica serves (a plain backend) and an adapter to load.
        assert_eq!(class("unserved").table, 3);
        assert_eq!(map.class_of("lazy").table, 1);
        assert!(
            map.class_of("lazy").adapter,
            "an adapter to load is an adapter"
        );
        // A name no one knows, and no name at all.
        assert_eq!(class("nope"), ModelClass::default());
        assert_eq!(
            map.class(&ModelName::default(), Resolved::Route(ModelKey::Any)),
            ModelClass::default()
        );
        // Each name was labelled once.
        let mut sorted = given.clone();
        sorted.dedup();
        assert_eq!(sorted.len(), given.len(), "{given:?}");
        // Without any replica's list, a table still applies by the request's name.
        let plain = ModelMap::empty(4).with_classes(&refs, &[], &mut |_| 0);
        let m = name("big");
        assert_eq!(plain.class(&m, plain.resolve(&m)).table, 2);
    }

    #[test]
    fn labels_are_given_once_until_they_run_out() {
        let labels = ModelLabels::default();
        assert_eq!(labels.label("a"), 1);
        assert_eq!(labels.label("b"), 2);
        assert_eq!(labels.label("a"), 1);
        assert_eq!(labels.label(OTHER_LABEL), 0);
        for i in 0..MAX_MODEL_LABELS {
            labels.label(&format!("m{i}"));
        }
        assert_eq!(labels.label("late"), 0);
        let names: Vec<(usize, &str)> = labels.names().collect();
        assert_eq!(names.len(), MAX_MODEL_LABELS);
        assert_eq!(&names[..3], &[(0, OTHER_LABEL), (1, "a"), (2, "b")]);
    }

    #[test]
    fn requests_go_only_to_replicas_serving_their_model() {
        let map = two_models();
        let allowed = |s: &str| -> Vec<usize> {
            let k = key(&map, s);
            (0..4).filter(|&i| map.allows(k, i, 1)).collect()
        };
        // Slot 3's list is not known: it may serve anything.
        assert_eq!(allowed("big"), [0, 1, 3]);
        assert_eq!(allowed("big-alias"), [0, 3]);
        assert_eq!(allowed("sql"), [0, 3]);
        assert_eq!(allowed("small"), [2, 3]);
        // SGLang's base:adapter names the adapter; an unknown adapter after a served base
        // goes to the base's replicas.
        assert_eq!(allowed("big:sql"), [0, 3]);
        assert_eq!(allowed("big:nope"), [0, 1, 3]);
        let Resolved::NotServed(nope) = map.resolve(&name("nope")) else {
            panic!("nope is served");
        };
        assert_eq!(
            (0..4)
                .filter(|&i| map.allows(nope, i, 1))
                .collect::<Vec<_>>(),
            [3]
        );
        assert_eq!(
            map.resolve(&ModelName::default()),
            Resolved::Route(ModelKey::Any)
        );
        // A slot given to another replica since the build is not covered.
        assert!(map.allows(key(&map, "small"), 0, 2));
    }

    #[test]
    fn nothing_known_routes_every_model_anywhere() {
        let map = ModelMap::empty(4);
        assert!(!map.knows_any());
        assert_eq!(map.resolve(&name("x")), Resolved::Route(ModelKey::Any));
        let mut long = ModelName::default();
        long.push(&[b'a'; MODEL_BYTES + 1]);
        assert!(matches!(
            two_models().resolve(&long),
            Resolved::NotServed(_)
        ));
        assert_eq!(map.resolve(&long), Resolved::Route(ModelKey::Any));
    }

    #[test]
    fn the_union_lists_each_name_once_with_its_parent() {
        let map = two_models();
        let v: Value = serde_json::from_slice(map.list_json()).unwrap();
        let ids: Vec<&str> = v["data"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| c["id"].as_str().unwrap())
            .collect();
        assert_eq!(ids, ["big", "big-alias", "sql", "small"]);
        assert_eq!(v["data"][2]["parent"], "big");
        assert_eq!(map.card(b"sql").unwrap().parent.as_deref(), Some("big"));
        assert!(map.card(b"nope").is_none());
        assert_eq!(map.names_of(2).unwrap(), ["small"]);
        let served: Vec<(String, Vec<usize>)> =
            map.served().map(|(c, s)| (c.id.clone(), s)).collect();
        assert_eq!(served[0], ("big".to_string(), vec![0, 1]));
    }

    #[test]
    fn parses_vllm_and_sglang_lists() {
        let vllm = br#"{"object":"list","data":[{"id":"Qwen/Qwen3-8B","object":"model","created":1,"owned_by":"vllm","root":"/models/q","parent":null,"max_model_len":32768,"permission":[]},{"id":"sql","object":"model","root":"/lora/sql","parent":"Qwen/Qwen3-8B"}]}"#;
        let cards = parse_model_list(vllm).unwrap();
        assert_eq!(cards.len(), 2);
        assert_eq!(cards[1].parent.as_deref(), Some("Qwen/Qwen3-8B"));
        assert!(cards[1].is_adapter() && !cards[0].is_adapter());
        for bad in [
            &b"not json"[..],
            br#"{"data":{}}"#,
            br#"{"data":[{"id":7}]}"#,
            br#"{"data":[{"id":""}]}"#,
            br#"{"data":[{"id":"a","parent":3}]}"#,
        ] {
            assert!(
                parse_model_list(bad).is_err(),
                "{}",
                String::from_utf8_lossy(bad)
            );
        }
    }

    #[test]
    fn finds_the_top_level_model_only() {
        let mut m = ModelName::default();
        top_level_model(
            br#"{"input":["a",{"model":"inner"}],"model":"emb\u002dsmall","x":1}"#,
            &mut m,
        );
        assert_eq!(m.get(), Some(&b"emb-small"[..]));
        for body in [
            &b"[1]"[..],
            b"{",
            br#"{"model":3}"#,
            br#"{"input":"x"}"#,
            b"",
        ] {
            top_level_model(body, &mut m);
            assert_eq!(m.get(), None, "{}", String::from_utf8_lossy(body));
        }
    }
}

//! Online calibration: each replica's [`Pace`] (its prefill, queue and decode time over what
//! the model prices), learned from the requests kvlb sends there and from what the replica
//! reports of all its traffic. The configured timing becomes a prior, not the truth: a fleet
//! of GPUs three times slower than configured, or a mix of generations, is priced by what each
//! replica is measured to do.
//!
//! # What is measured
//!
//! When a worker chooses a replica it knows the estimate it made, in two parts (the queue wait
//! and the request's own prefill), each split by what its seconds scale with ([`Seconds`]:
//! prefill time, decode time) at the configured speed, and the seconds no pace scales (an
//! adapter load). When the request's first byte comes back, kvlb knows the time to first byte.
//! That is a [`TtftSample`]:
//!
//! ```text
//! observed ≈ prefill_pace * prefill.prefill + queue_pace * wait.prefill
//!          + decode_pace * (prefill.decode + wait.decode) + fixed
//! ```
//!
//! The prefill pace is the replica's speed. The queue pace is how long the queue it reports
//! or kvlb counts really takes there: the replica's speed again, plus whatever the model cannot
//! see of that queue (other clients' work, hits that were evicted before they were used). A
//! stream's spacing between its events gives the decode time of its steps directly
//! ([`DecodeSample`]): `elapsed ≈ decode_pace * steps * step_s`.
//!
//! A vLLM replica also reports every request's prefill itself, whoever sent it (other kvlb
//! instances, direct clients): `vllm:request_prefill_time_seconds`, first scheduling to first
//! token. Between two scrapes of its /metrics, N requests prefilled C computed tokens in S
//! seconds; the scraper prices the mean one (C / N tokens, the replica's running requests
//! sharing its steps) with the model: a [`PrefillSample`], a time to first token with no
//! queue wait, N requests' worth of it:
//!
//! ```text
//! S / N ≈ prefill_pace * prefill.prefill + decode_pace * prefill.decode
//! ```
//!
//! # The estimator
//!
//! Two levels, each a weighted least-squares fit with exponential forgetting in time
//! ([`HALF_LIFE_MS`], never below a floor of evidence, so a replica measured once keeps its
//! pace until new samples come):
//!
//! - **The fleet** (every replica's samples together): `y = observed - fixed - decode_pace *
//!   decode parts` on `x1 = prefill.prefill` and `x2 = wait.prefill`, regularised by priors
//!   worth [`PRIOR_WEIGHT`] each (its prefill pace towards the configured speed, its queue pace
//!   towards its prefill pace). It gives the fleet's prefill and queue paces, so their ratio:
//!   how the fleet's queues run against what the model counts of them.
//! - **Each replica**: one level, its prefill pace, fit on `x = x1 + shape * x2` (`shape` the
//!   fleet's queue over prefill pace when the sample came), shrunk towards the fleet's prefill
//!   pace by a prior worth [`PRIOR_SAMPLES`] of its own mean sample (and at least
//!   `PRIOR_WEIGHT`). Its queue pace is its level times the fleet's shape. One parameter per
//!   replica, the premise of the model (a GPU k times slower is k times slower in everything),
//!   is what a few samples can carry: fitting each replica's queue pace apart let a prior on
//!   its speed push its queue pace the other way (to 0.05 on a real fleet of two).
//!
//! A [`PrefillSample`] of N requests enters both fits as N samples of its mean request, its
//! queue part 0: it weighs what N streams of that prefill would.
//!
//! Squared errors in seconds let long prefills, whose times say the most about a replica's
//! speed, carry the fits, and short ones (a cache hit, dominated by network and scheduling
//! noise) little. Outliers are winsorised: once a fit holds some evidence, an observation is
//! clamped to within [`OUTLIER_RATIO`] of its prediction before it is added, and counted. A
//! replica no request has measured yet is priced at the fleet's pace.
//!
//! Decode: a one-variable fit per replica, towards the fleet's pooled decode pace. While no
//! stream has measured a replica's decode steps, its decode pace is the fleet's scaled by its
//! level.
//!
//! # Publication
//!
//! One thread (the residency writer's tick in `kvlb serve`) owns [`Calibration`] and drains
//! the samples the workers (and the /metrics scrapers) push into a bounded lock-free queue
//! ([`Samples`]); it publishes each replica's pace into a [`ReplicaPace`] cell, atomic words
//! the workers load per candidate. No lock, no allocation on either side once started.

#![warn(clippy::disallowed_methods, clippy::disallowed_types)]

use super::{Pace, Seconds};
use crossbeam::queue::ArrayQueue;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

/// Evidence halves every this many milliseconds without new samples.
pub const HALF_LIFE_MS: u64 = 60_000;
/// The prior's weight, in the unit of the fit's evidence (seconds squared): one observation of
/// a 0.1 s prefill. A replica's first long prefill outweighs it.
pub const PRIOR_WEIGHT: f64 = 0.01;
/// A replica's own samples outweigh the fleet's pace once they are this many (its prior is
/// worth this many of its mean sample): one slow first request does not make a slow replica.
pub const PRIOR_SAMPLES: f64 = 4.0;
/// Forgetting never takes a fit's evidence below this many priors: a replica measured once
/// keeps its measured pace until new samples come, however long that takes.
pub const KEPT_PRIORS: f64 = 4.0;
/// A sample is clamped to within this factor of the fit's prediction (once the fit holds
/// `KEPT_PRIORS` priors of evidence).
pub const OUTLIER_RATIO: f64 = 3.0;
/// Paces are kept within these bounds: wide enough for a simulated replica run 1000 times
/// faster than real time, or a large model on a small GPU priced with the defaults.
pub const MIN_PACE: f64 = 0.001;
pub const MAX_PACE: f64 = 1000.0;
/// A stream of fewer events (tokens) says too little of the replica's decode steps to be a
/// [`DecodeSample`] (its last events, the finish reason and usage, come with its last token).
pub const MIN_DECODE_EVENTS: u32 = 32;
/// The share of a fit's sums that forgetting leaves `dt_ms` later: half every
/// [`HALF_LIFE_MS`], never below [`KEPT_PRIORS`] priors of `evidence` by forgetting alone.
fn kept(evidence: f64, dt_ms: u64) -> f64 {
    if dt_ms == 0 || evidence <= 0.0 {
        return 1.0;
    }
    let k = 0.5f64.powf(dt_ms as f64 / HALF_LIFE_MS as f64);
    k.max((KEPT_PRIORS * PRIOR_WEIGHT / evidence).min(1.0))
}

/// `y` observed for work of `x` seconds at the configured speed, clamped: within
/// [`OUTLIER_RATIO`] of the prediction `pred` once the fit holds `KEPT_PRIORS` priors of
/// `evidence` (and then counted as an outlier when clamped), within the pace bounds before.
fn winsorise(y: f64, pred: f64, x: f64, evidence: f64) -> (f64, bool) {
    if evidence >= KEPT_PRIORS * PRIOR_WEIGHT {
        let clamped = y.clamp(pred / OUTLIER_RATIO, pred * OUTLIER_RATIO);
        (clamped, clamped != y)
    } else {
        (y.clamp(MIN_PACE * x, MAX_PACE * x), false)
    }
}

/// The weight of a replica's prior given its fit's `evidence` from `n` samples.
fn shrinkage(evidence: f64, n: f64) -> f64 {
    if n > 0.0 {
        (PRIOR_SAMPLES * evidence / n).max(PRIOR_WEIGHT)
    } else {
        PRIOR_WEIGHT
    }
}

/// The estimate error's moving average weighs a new sample this much.
const ERROR_ALPHA: f64 = 0.05;

/// What kvlb knew of a request when it chose its replica, and how long its first byte took.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TtftSample {
    /// The replica's slot, and the slot's epoch (a slot reused by another replica starts over).
    pub replica: u32,
    pub epoch: u64,
    /// The estimate's seconds at the configured speed: the queue wait and the request's own
    /// prefill.
    pub wait: Seconds,
    pub prefill: Seconds,
    /// Seconds of the estimate that no pace scales (an adapter load).
    pub fixed_s: f32,
    /// The pace the estimate was made with.
    pub pace: Pace,
    /// Seconds from the request's arrival to its first response byte.
    pub observed_s: f32,
}

impl TtftSample {
    /// The estimate the request was routed on.
    pub fn estimated_s(&self) -> f64 {
        self.wait.waited_at(self.pace) + self.prefill.at(self.pace) + self.fixed_s as f64
    }
}

/// A stream's decode: `steps` events after its first came `elapsed_s` seconds apart in all,
/// while the model priced one step at `step_s`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DecodeSample {
    pub replica: u32,
    pub epoch: u64,
    pub steps: u32,
    pub step_s: f32,
    pub elapsed_s: f32,
}

/// What a replica's own /metrics said of the prefills it finished between two scrapes:
/// `requests` of them took `observed_s` seconds in all (each from its first scheduling to its
/// first token), while the model priced the mean one (its computed tokens, the decoders
/// sharing its steps) at `prefill`, at the configured speed.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PrefillSample {
    pub replica: u32,
    pub epoch: u64,
    pub requests: u32,
    pub prefill: Seconds,
    pub observed_s: f32,
}

/// A replica's prefill counters as one scrape of its /metrics read them (each the sum over the
/// replica's series, or one rank's).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct PrefillTotals {
    /// `vllm:request_prefill_time_seconds` `_count` and `_sum`: requests recorded (vLLM
    /// records a request when it finishes) and the seconds of their prefills.
    pub requests: f64,
    pub seconds: f64,
    /// `vllm:request_prefill_kv_computed_tokens_sum` (newer vLLM): the prompt tokens those
    /// same requests computed (not found cached). None: not exported.
    pub computed: Option<f64>,
    /// `vllm:prompt_tokens_total` and `vllm:prefix_cache_hits_total` (tokens found cached):
    /// the computed tokens where the histogram above is not exported.
    pub prompt: Option<f64>,
    pub hits: Option<f64>,
}

/// What two scrapes' [`PrefillTotals`] say.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum PrefillDelta {
    /// No request recorded between them: keep the earlier scrape as the base (the token
    /// counters of requests still decoding are matched with their requests when they finish).
    Idle,
    /// A counter went backwards or a series came or went (the replica restarted): start over
    /// from the later scrape.
    Reset,
    /// Requests recorded, but no computed tokens or no seconds to go with them.
    NoWork,
    /// `requests` prefills of `computed_tokens` computed tokens in all (`matched_tokens` found
    /// cached, when known) took `seconds` in all.
    Prefills {
        requests: u32,
        computed_tokens: f64,
        matched_tokens: f64,
        seconds: f64,
    },
}

impl PrefillTotals {
    /// What happened between the scrape `before` and this one.
    pub fn since(&self, before: &PrefillTotals) -> PrefillDelta {
        // Backwards, or not a number.
        let back = |now: f64, then: f64| now < then || now.is_nan() || then.is_nan();
        let gone = |now: Option<f64>, then: Option<f64>| match (now, then) {
            (Some(now), Some(then)) => back(now, then),
            (None, None) => false,
            _ => true,
        };
        if back(self.requests, before.requests)
            || back(self.seconds, before.seconds)
            || gone(self.computed, before.computed)
            || gone(self.prompt, before.prompt)
            || gone(self.hits, before.hits)
        {
            return PrefillDelta::Reset;
        }
        let requests = (self.requests - before.requests).round();
        if requests < 1.0 {
            return PrefillDelta::Idle;
        }
        let delta = |now: Option<f64>, then: Option<f64>| Some(now? - then?);
        let hits = delta(self.hits, before.hits);
        let computed = delta(self.computed, before.computed)
            .or_else(|| Some(delta(self.prompt, before.prompt)? - hits?));
        let seconds = self.seconds - before.seconds;
        match computed {
            Some(c) if c > 0.0 && seconds > 0.0 && seconds.is_finite() && c.is_finite() => {
                PrefillDelta::Prefills {
                    requests: requests.min(u32::MAX as f64) as u32,
                    computed_tokens: c,
                    matched_tokens: hits.unwrap_or(0.0).max(0.0),
                    seconds,
                }
            }
            _ => PrefillDelta::NoWork,
        }
    }
}

/// One replica's prefill reports from scrape to scrape: the scrape the next delta is measured
/// from.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct PrefillBase(Option<PrefillTotals>);

impl PrefillBase {
    /// What happened from the base to the scrape `now`, which becomes the base unless nothing
    /// did. The first scrape is only a base (`Idle`).
    pub fn advance(&mut self, now: PrefillTotals) -> PrefillDelta {
        let Some(base) = self.0 else {
            self.0 = Some(now);
            return PrefillDelta::Idle;
        };
        let d = now.since(&base);
        if d != PrefillDelta::Idle {
            self.0 = Some(now);
        }
        d
    }
}

impl PrefillSample {
    /// The sample of `requests` prefills of `computed_tokens` tokens in all (`matched_tokens`
    /// cached) that took `seconds` in all on slot `replica` (of `epoch`), with about
    /// `decoding` sequences sharing their steps: the mean request priced by `model`.
    pub fn priced(
        replica: u32,
        epoch: u64,
        delta: &PrefillDelta,
        model: &super::TtftModel,
        decoding: u32,
    ) -> Option<PrefillSample> {
        let PrefillDelta::Prefills {
            requests,
            computed_tokens,
            matched_tokens,
            seconds,
        } = *delta
        else {
            return None;
        };
        let n = requests.max(1) as f64;
        let tokens = |t: f64| (t / n).round().clamp(0.0, u32::MAX as f64 / 2.0) as u32;
        let (computed, matched) = (tokens(computed_tokens).max(1), tokens(matched_tokens));
        Some(PrefillSample {
            replica,
            epoch,
            requests,
            prefill: model.prefill_parts(matched, matched + computed, decoding),
            observed_s: seconds as f32,
        })
    }
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Sample {
    Ttft(TtftSample),
    Decode(DecodeSample),
    Prefill(PrefillSample),
}

/// The workers' samples on their way to the calibration: bounded, lock-free; a sample that
/// finds it full is dropped and counted.
pub struct Samples {
    queue: ArrayQueue<Sample>,
    dropped: AtomicU64,
}

impl Samples {
    pub fn new(capacity: usize) -> Samples {
        Samples {
            queue: ArrayQueue::new(capacity.max(1)),
            dropped: AtomicU64::new(0),
        }
    }

    /// Queue `s`; false (and counted) when the queue is full.
    pub fn push(&self, s: Sample) -> bool {
        if self.queue.push(s).is_err() {
            self.dropped.fetch_add(1, Relaxed);
            return false;
        }
        true
    }

    pub fn pop(&self) -> Option<Sample> {
        self.queue.pop()
    }

    /// Samples dropped because the queue was full.
    pub fn dropped(&self) -> u64 {
        self.dropped.load(Relaxed)
    }
}

/// One replica's calibration as the workers and the admin endpoints read it: written by the
/// calibration's owner only.
#[derive(Debug, Default)]
pub struct ReplicaPace {
    /// The pace: prefill and decode (two f32), queue (f32 bits); 0 until published: the
    /// configured speed. The two words are stored apart: a reader may see one from the
    /// publication before the other, which prices one candidate with a pace 0.1 s old.
    pace: AtomicU64,
    queue: std::sync::atomic::AtomicU32,
    /// What the pace was learned from: TTFT samples, decode samples and the replica's own
    /// prefill reports ([`PrefillSample`], one per scrape that saw prefills) taken, outliers
    /// among them clamped.
    pub ttft_samples: AtomicU64,
    pub decode_samples: AtomicU64,
    pub metrics_samples: AtomicU64,
    pub outliers: AtomicU64,
    /// Observed over estimated TTFT of the requests routed there (geometric moving average,
    /// f64 bits; 0 before the first sample).
    error: AtomicU64,
    /// Whether the pace was measured on this replica (not the fleet's).
    measured: AtomicU64,
}

impl ReplicaPace {
    /// The pace to price this replica at.
    pub fn load(&self) -> Pace {
        let (v, q) = (self.pace.load(Relaxed), self.queue.load(Relaxed));
        if v == 0 || q == 0 {
            return Pace::CONFIGURED;
        }
        Pace {
            prefill: f32::from_bits((v >> 32) as u32),
            decode: f32::from_bits(v as u32),
            queue: f32::from_bits(q),
        }
    }

    fn store(&self, p: Pace) {
        let v = ((p.prefill.to_bits() as u64) << 32) | p.decode.to_bits() as u64;
        self.pace.store(v, Relaxed);
        self.queue.store(p.queue.to_bits(), Relaxed);
    }

    /// Observed over estimated time to first token on this replica (moving geometric mean);
    /// None before the first sample.
    pub fn observed_over_estimated(&self) -> Option<f64> {
        match self.error.load(Relaxed) {
            0 => None,
            b => Some(f64::from_bits(b)),
        }
    }

    /// Whether the pace comes from this replica's own samples (false: the fleet's).
    pub fn measured(&self) -> bool {
        self.measured.load(Relaxed) != 0
    }

    /// Back to the configured speed, nothing measured (the slot takes another replica).
    pub fn reset(&self) {
        self.queue.store(0, Relaxed);
        for a in [
            &self.pace,
            &self.ttft_samples,
            &self.decode_samples,
            &self.metrics_samples,
            &self.outliers,
            &self.error,
            &self.measured,
        ] {
            a.store(0, Relaxed);
        }
    }
}

/// A least-squares fit through the origin with forgetting.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct Fit {
    sxx: f64,
    sxy: f64,
    /// Samples in it (forgotten as the sums are).
    n: f64,
    at_ms: u64,
}

impl Fit {
    fn forget(&mut self, now_ms: u64) {
        let k = kept(self.sxx, now_ms.saturating_sub(self.at_ms));
        self.at_ms = self.at_ms.max(now_ms);
        self.sxx *= k;
        self.sxy *= k;
        self.n *= k;
    }

    /// The prior's weight for one replica's fit: [`PRIOR_SAMPLES`] of its own mean sample,
    /// and never less than [`PRIOR_WEIGHT`].
    fn weight(&self) -> f64 {
        shrinkage(self.sxx, self.n)
    }

    fn value(&self, prior: f64, w: f64) -> f64 {
        ((self.sxy + prior * w) / (self.sxx + w)).clamp(MIN_PACE, MAX_PACE)
    }

    fn evidence(&self) -> f64 {
        self.sxx
    }

    /// Add `y` observed for `x`; returns whether it was clamped as an outlier.
    fn add(&mut self, x: f64, y: f64, prior: f64, w: f64) -> bool {
        self.add_n(x, y, prior, w, 1.0)
    }

    /// Add `n` samples of `y` observed for `x`.
    fn add_n(&mut self, x: f64, y: f64, prior: f64, w: f64, n: f64) -> bool {
        if !(x > 0.0 && x.is_finite() && y.is_finite() && n > 0.0 && n.is_finite()) {
            return false;
        }
        let (y, outlier) = winsorise(y, self.value(prior, w) * x, x, self.sxx);
        self.sxx += n * x * x;
        self.sxy += n * x * y;
        self.n += n;
        outlier
    }
}

/// The fit of `y ≈ p·x1 + q·x2` with forgetting: `p` regularised towards a prior, `q`
/// towards `p`.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct Fit2 {
    s11: f64,
    s12: f64,
    s22: f64,
    s1y: f64,
    s2y: f64,
    at_ms: u64,
}

impl Fit2 {
    fn forget(&mut self, now_ms: u64) {
        let k = kept(self.evidence(), now_ms.saturating_sub(self.at_ms));
        self.at_ms = self.at_ms.max(now_ms);
        for v in [
            &mut self.s11,
            &mut self.s12,
            &mut self.s22,
            &mut self.s1y,
            &mut self.s2y,
        ] {
            *v *= k;
        }
    }

    fn evidence(&self) -> f64 {
        self.s11 + self.s22
    }

    /// (p, q) regularised with weight `w`: `p` towards `p0`, `q` towards `r·p` (the fleet's
    /// fit takes `p0 = r = 1`: a queue never seen is priced at the fleet's speed).
    fn solve(&self, p0: f64, r: f64, w: f64) -> (f64, f64) {
        let (a11, a12, a22) = (self.s11 + w + w * r * r, self.s12 - w * r, self.s22 + w);
        let (b1, b2) = (self.s1y + w * p0, self.s2y);
        // Positive definite (the priors add w·[[1 + r², -r], [-r, 1]]): det >= w².
        let det = a11 * a22 - a12 * a12;
        let p = (b1 * a22 - a12 * b2) / det;
        let q = (a11 * b2 - a12 * b1) / det;
        (p.clamp(MIN_PACE, MAX_PACE), q.clamp(MIN_PACE, MAX_PACE))
    }

    /// Add `n` samples of `y` observed for `(x1, x2)`; the prediction is made at `(p, q)`.
    fn add_n(&mut self, x1: f64, x2: f64, y: f64, (p, q): (f64, f64), n: f64) -> bool {
        let x = x1 + x2;
        let sane = n > 0.0 && n.is_finite() && x.is_finite() && y.is_finite();
        if !(x1 >= 0.0 && x2 >= 0.0 && x > 0.0 && sane) {
            return false;
        }
        let (y, outlier) = winsorise(y, p * x1 + q * x2, x, self.evidence());
        self.s11 += n * x1 * x1;
        self.s12 += n * x1 * x2;
        self.s22 += n * x2 * x2;
        self.s1y += n * x1 * y;
        self.s2y += n * x2 * y;
        outlier
    }
}

#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct ReplicaFit {
    epoch: u64,
    /// The replica's prefill pace: its observed times on the configured price of the same
    /// work, the queue part weighed at the fleet's queue over prefill pace.
    level: Fit,
    decode: Fit,
    /// ln(observed / estimated), moving average; `errors` samples in it.
    log_error: f64,
    errors: u64,
    ttft_samples: u64,
    decode_samples: u64,
    metrics_samples: u64,
    outliers: u64,
}

impl ReplicaFit {
    fn measured(&self) -> bool {
        self.level.evidence() > 0.0
    }

    /// The replica's speed over the fleet's (1 until measured).
    fn scale(&self, fleet: Pace) -> f64 {
        if self.measured() {
            let p = fleet.prefill as f64;
            self.level.value(p, self.level.weight()) / p
        } else {
            1.0
        }
    }

    fn pace(&self, fleet: Pace) -> Pace {
        let s = self.scale(fleet);
        let clamp = |v: f64| v.clamp(MIN_PACE, MAX_PACE) as f32;
        let decode = if self.decode.evidence() > 0.0 {
            self.decode.value(fleet.decode as f64, self.decode.weight())
        } else {
            // Not measured: as much slower than the fleet's decode as its prefill is.
            s * fleet.decode as f64
        };
        Pace {
            prefill: clamp(s * fleet.prefill as f64),
            decode: clamp(decode),
            queue: clamp(s * fleet.queue as f64),
        }
    }
}

/// Every replica's calibration, owned by one thread.
#[derive(Debug, Clone)]
pub struct Calibration {
    replicas: Vec<ReplicaFit>,
    /// Every replica's samples together, towards the configured speed: the fleet's pace.
    pooled_prefill: Fit2,
    pooled_decode: Fit,
    fleet: Pace,
    /// Samples of a slot's earlier replica, dropped.
    stale: u64,
}

impl Calibration {
    /// Calibration for up to `replicas` slots, all at the configured speed.
    pub fn new(replicas: usize) -> Calibration {
        Calibration {
            replicas: vec![ReplicaFit::default(); replicas],
            pooled_prefill: Fit2::default(),
            pooled_decode: Fit::default(),
            fleet: Pace::CONFIGURED,
            stale: 0,
        }
    }

    /// The fit of slot `r` for a sample of `epoch`; None for a sample of an earlier replica.
    fn fit(&mut self, r: u32, epoch: u64) -> Option<&mut ReplicaFit> {
        let f = self.replicas.get_mut(r as usize)?;
        if epoch < f.epoch {
            self.stale += 1;
            return None;
        }
        if epoch > f.epoch {
            *f = ReplicaFit {
                epoch,
                ..ReplicaFit::default()
            };
        }
        Some(f)
    }

    /// Learn from one sample taken at `now_ms`.
    pub fn observe(&mut self, s: &Sample, now_ms: u64) {
        let fleet = self.fleet;
        match *s {
            Sample::Ttft(t) => {
                let Some(f) = self.fit(t.replica, t.epoch) else {
                    return;
                };
                f.ttft_samples += 1;
                let estimated = t.estimated_s();
                let observed = t.observed_s as f64;
                if estimated > 0.0 && observed > 0.0 && (observed / estimated).is_finite() {
                    let e = (observed / estimated).ln();
                    f.log_error = if f.errors == 0 {
                        e
                    } else {
                        f.log_error + ERROR_ALPHA * (e - f.log_error)
                    };
                    f.errors += 1;
                }
                let pace = f.pace(fleet);
                let decode = t.wait.decode + t.prefill.decode;
                let y = observed - t.fixed_s as f64 - pace.decode as f64 * decode;
                let x = (t.prefill.prefill, t.wait.prefill);
                self.learn_prefill(t.replica as usize, x, y, 1.0, now_ms);
            }
            Sample::Decode(d) => {
                let Some(f) = self.fit(d.replica, d.epoch) else {
                    return;
                };
                f.decode_samples += 1;
                f.decode.forget(now_ms);
                let x = d.steps as f64 * d.step_s as f64;
                let w = f.decode.weight();
                if f.decode.add(x, d.elapsed_s as f64, fleet.decode as f64, w) {
                    f.outliers += 1;
                }
                self.pooled_decode.forget(now_ms);
                self.pooled_decode
                    .add(x, d.elapsed_s as f64, 1.0, PRIOR_WEIGHT);
            }
            Sample::Prefill(p) => {
                let Some(f) = self.fit(p.replica, p.epoch) else {
                    return;
                };
                f.metrics_samples += 1;
                let n = p.requests as f64;
                if n < 1.0 {
                    return;
                }
                // The mean request, as a time to first token with no queue wait: its decode
                // part taken out at the replica's decode pace, as a TTFT sample's.
                let decode = f.pace(fleet).decode as f64 * p.prefill.decode;
                let y = p.observed_s as f64 / n - decode;
                self.learn_prefill(p.replica as usize, (p.prefill.prefill, 0.0), y, n, now_ms);
            }
        }
    }

    /// Learn `n` observations of `y` seconds (the decode part taken out) for slot `r`'s work
    /// of `x1` seconds of own prefill and `x2` of queued prefill at the configured speed: its
    /// level, the queue part weighed as the fleet's queues run, and the fleet's fit.
    fn learn_prefill(&mut self, r: usize, (x1, x2): (f64, f64), y: f64, n: f64, now_ms: u64) {
        let fleet = self.fleet;
        let Some(f) = self.replicas.get_mut(r) else {
            return;
        };
        f.level.forget(now_ms);
        let shape = fleet.queue as f64 / fleet.prefill as f64;
        let (x, w) = (x1 + shape * x2, f.level.weight());
        if f.level.add_n(x, y, fleet.prefill as f64, w, n) {
            f.outliers += 1;
        }
        // The fleet: every replica's samples together.
        self.pooled_prefill.forget(now_ms);
        let at = self.pooled_prefill.solve(1.0, 1.0, PRIOR_WEIGHT);
        self.pooled_prefill.add_n(x1, x2, y, at, n);
    }

    /// Slot `r` took another replica, of slot epoch `epoch`: back to the fleet's pace, and
    /// samples of an earlier epoch are dropped from now on.
    pub fn forget(&mut self, r: usize, epoch: u64) {
        if let Some(f) = self.replicas.get_mut(r) {
            *f = ReplicaFit {
                epoch,
                ..ReplicaFit::default()
            };
        }
    }

    /// The fleet's pace: the fit of every replica's samples together (configured: none).
    pub fn fleet(&self) -> Pace {
        self.fleet
    }

    /// Slot `r`'s pace.
    pub fn pace(&self, r: usize) -> Pace {
        self.replicas
            .get(r)
            .map_or(self.fleet, |f| f.pace(self.fleet))
    }

    /// Samples dropped because their slot had since taken another replica.
    pub fn stale(&self) -> u64 {
        self.stale
    }

    /// Recompute the fleet's pace and publish every replica's into `cells` (slot order).
    pub fn publish(&mut self, cells: &[ReplicaPace]) {
        self.update_fleet();
        for (f, cell) in self.replicas.iter().zip(cells) {
            cell.store(f.pace(self.fleet));
            cell.ttft_samples.store(f.ttft_samples, Relaxed);
            cell.decode_samples.store(f.decode_samples, Relaxed);
            cell.metrics_samples.store(f.metrics_samples, Relaxed);
            cell.outliers.store(f.outliers, Relaxed);
            cell.measured.store(f.measured() as u64, Relaxed);
            if f.errors > 0 {
                cell.error.store(f.log_error.exp().to_bits(), Relaxed);
            } else {
                cell.error.store(0, Relaxed);
            }
        }
    }

    /// Recompute the fleet's pace (the prior of the replicas not measured yet): the fit of
    /// every replica's samples together.
    pub fn update_fleet(&mut self) {
        let (prefill, queue) = self.pooled_prefill.solve(1.0, 1.0, PRIOR_WEIGHT);
        let decode = if self.pooled_decode.evidence() > 0.0 {
            self.pooled_decode.value(1.0, PRIOR_WEIGHT)
        } else {
            prefill
        };
        self.fleet = Pace {
            prefill: prefill as f32,
            decode: decode as f32,
            queue: queue as f32,
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ttft(replica: u32, prefill: f64, decode: f64, observed: f64) -> Sample {
        Sample::Ttft(TtftSample {
            replica,
            epoch: 0,
            wait: Seconds::default(),
            prefill: Seconds { prefill, decode },
            fixed_s: 0.0,
            pace: Pace::CONFIGURED,
            observed_s: observed as f32,
        })
    }

    /// `observe`, then the fleet's pace updated, as `kvlb serve` publishes every 100 ms.
    fn learn(c: &mut Calibration, s: &Sample, now_ms: u64) {
        c.observe(s, now_ms);
        c.update_fleet();
    }

    fn published(c: &mut Calibration) -> Vec<ReplicaPace> {
        let cells: Vec<ReplicaPace> = (0..c.replicas.len())
            .map(|_| ReplicaPace::default())
            .collect();
        c.publish(&cells);
        cells
    }

    #[test]
    fn the_first_long_prefill_sets_the_fleets_pace_and_more_converge() {
        let mut c = Calibration::new(2);
        learn(&mut c, &ttft(1, 0.3, 0.0, 0.9), 0);
        let cells = published(&mut c);
        // The fleet's pace is that one 0.3 s prefill (evidence 0.09) against the prior (one
        // 0.1 s prefill at the configured speed): 2.8.
        assert!((c.fleet().prefill - 2.8).abs() < 0.01, "{:?}", c.fleet());
        // Replica 1's own, shrunk towards the fleet's by 4 of its samples: 2.84.
        let p = cells[1].load().prefill as f64;
        assert!((p - 2.84).abs() < 0.01, "{p}");
        // Its decode follows its prefill until measured.
        assert!((cells[1].load().decode - cells[1].load().prefill).abs() < 1e-6);
        // The other replica, unmeasured, takes the fleet's pace.
        assert_eq!(cells[0].load(), c.fleet());
        assert!(!cells[0].measured() && cells[1].measured());
        // Many samples: the pace converges on the truth.
        for i in 0..50 {
            learn(
                &mut c,
                &ttft(1, 0.1 + 0.01 * i as f64, 0.0, 3.0 * (0.1 + 0.01 * i as f64)),
                0,
            );
        }
        c.update_fleet();
        let p = c.pace(1).prefill as f64;
        assert!((p - 3.0).abs() < 0.02, "{p}");
    }

    #[test]
    fn one_slow_request_does_not_make_a_slow_replica() {
        let mut c = Calibration::new(2);
        for _ in 0..30 {
            learn(&mut c, &ttft(0, 0.3, 0.0, 0.3), 0);
        }
        learn(&mut c, &ttft(1, 0.3, 0.0, 0.9), 0);
        c.update_fleet();
        // The fleet's 1.06, and replica 1's one 3x sample against 4 of the fleet's: 1.45.
        let p = c.pace(1).prefill;
        assert!((p - 1.45).abs() < 0.01, "{p}");
        // Forty more: it is slow.
        for _ in 0..40 {
            learn(&mut c, &ttft(1, 0.3, 0.0, 0.9), 0);
        }
        c.update_fleet();
        let p = c.pace(1).prefill;
        assert!(p > 2.6, "{p}");
        assert!(c.pace(0).prefill < 1.4, "{:?}", c.pace(0));
    }

    #[test]
    fn queue_errors_show_in_the_queue_pace_not_the_speed() {
        let mut c = Calibration::new(1);
        // A replica at the configured speed whose queues take twice what the model counts
        // (another client's work): prefills of 0.1-0.28 s behind waits of 0-0.36 s.
        for i in 0..40 {
            let (prefill, wait) = (0.1 + 0.02 * (i * 7 % 10) as f64, 0.04 * (i % 10) as f64);
            learn(
                &mut c,
                &Sample::Ttft(TtftSample {
                    replica: 0,
                    epoch: 0,
                    wait: Seconds {
                        prefill: wait,
                        decode: 0.0,
                    },
                    prefill: Seconds {
                        prefill,
                        decode: 0.0,
                    },
                    fixed_s: 0.0,
                    pace: Pace::CONFIGURED,
                    observed_s: (prefill + 2.0 * wait) as f32,
                }),
                0,
            );
        }
        c.update_fleet();
        let p = c.pace(0);
        // The replica's level is fit at the fleet's queue-over-prefill shape as it stood when
        // each sample came (1 at first): a little above 1.
        assert!((p.prefill - 1.0).abs() < 0.12, "{p:?}");
        assert!((p.queue - 2.0).abs() < 0.1, "{p:?}");
        // A replica seen only idle: its queue pace is its prefill pace.
        let mut c = Calibration::new(1);
        for _ in 0..10 {
            learn(&mut c, &ttft(0, 0.3, 0.0, 0.9), 0);
        }
        c.update_fleet();
        let p = c.pace(0);
        assert!(
            (p.queue - p.prefill).abs() < 0.05 && p.prefill > 2.9,
            "{p:?}"
        );
    }

    /// Twenty streams of replica 0 whose 100 decode steps of 0.01 s took 2 s: decode at 2x.
    fn decode_measured_at_2x(c: &mut Calibration) {
        for _ in 0..20 {
            let d = DecodeSample {
                replica: 0,
                epoch: 0,
                steps: 100,
                step_s: 0.01,
                elapsed_s: 2.0,
            };
            learn(c, &Sample::Decode(d), 0);
        }
    }

    #[test]
    fn the_decode_part_is_taken_out_before_the_prefill_fit() {
        let mut c = Calibration::new(1);
        decode_measured_at_2x(&mut c);
        c.update_fleet();
        assert!((c.pace(0).decode - 2.0).abs() < 0.01, "{:?}", c.pace(0));
        // TTFT of 0.2 s prefill at 1.5x plus 0.1 s decode at 2x.
        for _ in 0..20 {
            learn(&mut c, &ttft(0, 0.2, 0.1, 0.2 * 1.5 + 0.1 * 2.0), 0);
        }
        c.update_fleet();
        assert!((c.pace(0).prefill - 1.5).abs() < 0.02, "{:?}", c.pace(0));
    }

    #[test]
    fn outliers_are_clamped_and_counted() {
        let mut c = Calibration::new(1);
        for _ in 0..20 {
            learn(&mut c, &ttft(0, 0.2, 0.0, 0.2), 0);
        }
        // One stall of 20 s: taken as 0.6 s, not 20.
        learn(&mut c, &ttft(0, 0.2, 0.0, 20.0), 0);
        let cells = published(&mut c);
        assert_eq!(cells[0].outliers.load(Relaxed), 1);
        let p = c.pace(0).prefill;
        assert!(p < 1.1, "{p}");
        // A replica that really became 3x slower gets there over a few samples.
        for _ in 0..100 {
            learn(&mut c, &ttft(0, 0.2, 0.0, 0.6), 0);
        }
        assert!(c.pace(0).prefill > 2.5, "{:?}", c.pace(0));
    }

    #[test]
    fn forgetting_follows_a_change_but_keeps_a_floor_of_evidence() {
        let mut c = Calibration::new(1);
        for _ in 0..100 {
            learn(&mut c, &ttft(0, 0.3, 0.0, 0.9), 0);
        }
        let f = c.replicas[0].level;
        // Ten half-lives later the evidence is down to the floor, the pace kept.
        learn(&mut c, &ttft(0, 0.3, 0.0, 0.3), 10 * HALF_LIFE_MS);
        let after = c.replicas[0].level;
        assert!(after.evidence() < f.evidence() / 10.0);
        assert!(after.evidence() >= KEPT_PRIORS * PRIOR_WEIGHT);
        let p = c.pace(0).prefill;
        // The 1x sample (clamped to 1/3 of the 3x prediction) moved it towards 1.
        assert!(p < 2.6 && p > 1.0, "{p}");
    }

    #[test]
    fn a_reused_slot_starts_over_and_late_samples_of_its_old_replica_are_dropped() {
        let mut c = Calibration::new(1);
        for _ in 0..20 {
            learn(&mut c, &ttft(0, 0.3, 0.0, 0.9), 0);
        }
        c.update_fleet();
        assert!(c.pace(0).prefill > 2.9);
        // A sample of the slot's next replica (epoch 1): its own fit starts over.
        let at_epoch = |epoch, observed| {
            let mut s = ttft(0, 0.3, 0.0, observed);
            if let Sample::Ttft(t) = &mut s {
                t.epoch = epoch;
            }
            s
        };
        learn(&mut c, &at_epoch(1, 0.3), 0);
        assert_eq!(c.replicas[0].ttft_samples, 1);
        learn(&mut c, &at_epoch(0, 0.9), 0);
        assert_eq!((c.stale(), c.replicas[0].ttft_samples), (1, 1));
        // Told by the fleet first: the same, and priced at the fleet's pace meanwhile.
        c.forget(0, 2);
        assert_eq!(c.pace(0), c.fleet());
        learn(&mut c, &at_epoch(1, 0.9), 0);
        assert_eq!((c.stale(), c.replicas[0].ttft_samples), (2, 0));
    }

    #[test]
    fn the_fleet_pace_pools_every_replica() {
        let mut c = Calibration::new(5);
        for (r, k) in [(0, 1.0), (1, 2.0), (2, 3.0)] {
            for _ in 0..20 {
                learn(&mut c, &ttft(r, 0.3, 0.0, 0.3 * k), 0);
            }
        }
        let cells = published(&mut c);
        assert!((c.fleet().prefill - 2.0).abs() < 0.02, "{:?}", c.fleet());
        // Unmeasured slots 3 and 4 are priced at the fleet's pace.
        assert!((cells[4].load().prefill - c.fleet().prefill).abs() < 1e-6);
        // The error average: observed 3x what the estimate (at pace 1) said.
        let e = cells[2].observed_over_estimated().unwrap();
        assert!((e - 3.0).abs() < 0.01, "{e}");
        assert_eq!(cells[3].observed_over_estimated(), None);
    }

    #[test]
    fn cells_round_trip_and_a_full_queue_counts_drops() {
        let cell = ReplicaPace::default();
        assert_eq!(cell.load(), Pace::CONFIGURED);
        let p = Pace {
            prefill: 2.5,
            decode: 0.75,
            queue: 4.0,
        };
        cell.store(p);
        assert_eq!(cell.load(), p);
        cell.reset();
        assert_eq!(cell.load(), Pace::CONFIGURED);
        let q = Samples::new(2);
        let s = ttft(0, 0.1, 0.0, 0.1);
        assert!(q.push(s) && q.push(s) && !q.push(s));
        assert_eq!(q.dropped(), 1);
        assert_eq!(q.pop(), Some(s));
    }

    fn prefill(replica: u32, requests: u32, each: f64, observed_each: f64) -> Sample {
        Sample::Prefill(PrefillSample {
            replica,
            epoch: 0,
            requests,
            prefill: Seconds {
                prefill: each,
                decode: 0.0,
            },
            observed_s: (requests as f64 * observed_each) as f32,
        })
    }

    #[test]
    fn a_replica_whose_metrics_say_3x_slower_converges_to_3() {
        let mut c = Calibration::new(2);
        // Ten scrapes each: 5 prefills of 0.1-0.28 s, replica 1 three times slower.
        for i in 0..10 {
            let each = 0.1 + 0.02 * i as f64;
            learn(&mut c, &prefill(0, 5, each, each), 0);
            learn(&mut c, &prefill(1, 5, each, 3.0 * each), 0);
        }
        let cells = published(&mut c);
        let (fast, slow) = (cells[0].load().prefill, cells[1].load().prefill);
        // Fifty requests each against a prior of four, towards the fleet's 2.
        assert!((fast - 1.0).abs() < 0.1, "{fast}");
        assert!((slow - 3.0).abs() < 0.1, "{slow}");
        assert!(cells.iter().all(|c| c.measured()));
        for cell in &cells {
            assert_eq!(cell.metrics_samples.load(Relaxed), 10);
            assert_eq!(cell.ttft_samples.load(Relaxed), 0);
            // Not an estimate kvlb routed on: no observed-over-estimated error.
            assert_eq!(cell.observed_over_estimated(), None);
        }
    }

    #[test]
    fn a_report_of_n_prefills_weighs_as_n_streams() {
        let mut reported = Calibration::new(1);
        learn(&mut reported, &prefill(0, 20, 0.2, 0.6), 0);
        let mut streamed = Calibration::new(1);
        for _ in 0..20 {
            learn(&mut streamed, &ttft(0, 0.2, 0.0, 0.6), 0);
        }
        let (a, b) = (reported.pace(0), streamed.pace(0));
        assert!((a.prefill - b.prefill).abs() < 1e-4, "{a:?} {b:?}");
        assert!((reported.fleet().prefill - streamed.fleet().prefill).abs() < 1e-4);
        // One request's report weighs as one stream: shrunk towards the fleet's pace.
        let mut one = Calibration::new(2);
        learn(&mut one, &prefill(1, 1, 0.3, 0.9), 0);
        let mut first = Calibration::new(2);
        learn(&mut first, &ttft(1, 0.3, 0.0, 0.9), 0);
        assert!((one.pace(1).prefill - first.pace(1).prefill).abs() < 1e-4);
    }

    #[test]
    fn a_reports_decode_part_is_taken_out_at_the_decode_pace() {
        let mut c = Calibration::new(1);
        decode_measured_at_2x(&mut c);
        // 8 prefills of 0.2 s sharing steps with 0.1 s of decoders: 1.5x and 2x.
        for _ in 0..10 {
            let s = PrefillSample {
                replica: 0,
                epoch: 0,
                requests: 8,
                prefill: Seconds {
                    prefill: 0.2,
                    decode: 0.1,
                },
                observed_s: 8.0 * (0.2 * 1.5 + 0.1 * 2.0),
            };
            learn(&mut c, &Sample::Prefill(s), 0);
        }
        assert!((c.pace(0).prefill - 1.5).abs() < 0.02, "{:?}", c.pace(0));
    }

    fn totals(requests: f64, seconds: f64, computed: f64) -> PrefillTotals {
        PrefillTotals {
            requests,
            seconds,
            computed: Some(computed),
            prompt: None,
            hits: None,
        }
    }

    #[test]
    fn scrape_deltas_count_the_prefills_between_them() {
        let base = totals(10.0, 5.0, 20_000.0);
        assert_eq!(base.since(&base), PrefillDelta::Idle);
        assert_eq!(
            totals(14.0, 7.0, 28_000.0).since(&base),
            PrefillDelta::Prefills {
                requests: 4,
                computed_tokens: 8000.0,
                matched_tokens: 0.0,
                seconds: 2.0,
            }
        );
        // Requests without computed tokens or seconds.
        assert_eq!(
            totals(12.0, 6.0, 20_000.0).since(&base),
            PrefillDelta::NoWork
        );
        assert_eq!(
            totals(12.0, 5.0, 24_000.0).since(&base),
            PrefillDelta::NoWork
        );
        // Without the computed-tokens histogram: prompt tokens less those found cached.
        let counters = |requests, seconds, prompt, hits| PrefillTotals {
            requests,
            seconds,
            computed: None,
            prompt: Some(prompt),
            hits: Some(hits),
        };
        let d =
            counters(14.0, 7.0, 70_000.0, 14_000.0).since(&counters(10.0, 5.0, 50_000.0, 10_000.0));
        assert_eq!(
            d,
            PrefillDelta::Prefills {
                requests: 4,
                computed_tokens: 16_000.0,
                matched_tokens: 4000.0,
                seconds: 2.0,
            }
        );
        // The mean request priced: 4000 tokens after 1000 cached.
        let m = crate::estimate::TtftModel::default();
        let s = PrefillSample::priced(1, 7, &d, &m, 3).unwrap();
        assert_eq!((s.replica, s.epoch, s.requests), (1, 7, 4));
        assert_eq!(s.prefill, m.prefill_parts(1000, 5000, 3));
        assert_eq!(s.observed_s, 2.0);
        assert_eq!(
            PrefillSample::priced(1, 7, &PrefillDelta::Reset, &m, 3),
            None
        );
        // Everything cached (hits counted before the prompt tokens): no computed tokens.
        let d =
            counters(11.0, 5.5, 50_000.0, 11_000.0).since(&counters(10.0, 5.0, 50_000.0, 10_000.0));
        assert_eq!(d, PrefillDelta::NoWork);
        // Hits without prompt tokens: nothing to compute them from.
        let mut partial = counters(14.0, 7.0, 0.0, 14_000.0);
        partial.prompt = None;
        let mut before = counters(10.0, 5.0, 0.0, 10_000.0);
        before.prompt = None;
        assert_eq!(partial.since(&before), PrefillDelta::NoWork);
    }

    #[test]
    fn a_counter_reset_is_ignored() {
        let base = totals(10.0, 5.0, 20_000.0);
        // A restarted replica: its counters start over.
        assert_eq!(totals(2.0, 0.4, 3000.0).since(&base), PrefillDelta::Reset);
        assert_eq!(
            totals(12.0, 4.0, 30_000.0).since(&base),
            PrefillDelta::Reset
        );
        assert_eq!(totals(12.0, 6.0, 1000.0).since(&base), PrefillDelta::Reset);
        // A series that appeared or went, and nonsense.
        let mut upgraded = totals(12.0, 6.0, 0.0);
        upgraded.computed = None;
        assert_eq!(upgraded.since(&base), PrefillDelta::Reset);
        assert_eq!(
            totals(f64::NAN, 6.0, 30_000.0).since(&base),
            PrefillDelta::Reset
        );
        // Scrape by scrape, a 3x slower replica restarted halfway: the delta across the
        // restart is dropped, the next measured from it, and the pace is the replica's.
        let m = crate::estimate::TtftModel::default();
        let price = m.prefill_parts(0, 4000, 0).prefill;
        let mut c = Calibration::new(1);
        let mut reports = PrefillBase::default();
        let (mut resets, mut samples) = (0, 0);
        let mut requests = 0.0;
        for scrape in 0..20 {
            if scrape == 10 {
                requests = 0.0;
            }
            requests += 3.0;
            // Idle scrapes between them: the base stays.
            for now in [0, 1] {
                let t = totals(requests, requests * 3.0 * price, requests * 4000.0);
                let d = reports.advance(t);
                if now == 1 {
                    assert_eq!(d, PrefillDelta::Idle);
                }
                if d == PrefillDelta::Reset {
                    resets += 1;
                }
                if let Some(s) = PrefillSample::priced(0, 0, &d, &m, 0) {
                    samples += 1;
                    learn(&mut c, &Sample::Prefill(s), 0);
                }
            }
        }
        // The first scrape and the restart's are bases; 18 deltas.
        assert_eq!((resets, samples), (1, 18));
        assert!((c.pace(0).prefill - 3.0).abs() < 0.1, "{:?}", c.pace(0));
    }

    #[test]
    fn nonsense_prefill_reports_change_nothing() {
        let mut c = Calibration::new(1);
        learn(&mut c, &prefill(0, 0, 0.2, 0.6), 0);
        learn(&mut c, &prefill(0, 5, f64::NAN, 0.6), 0);
        learn(&mut c, &prefill(0, 5, 0.2, f64::INFINITY), 0);
        learn(&mut c, &prefill(0, 5, 0.0, 0.6), 0);
        learn(&mut c, &prefill(3, 5, 0.2, 0.6), 0);
        assert_eq!(c.pace(0), Pace::CONFIGURED);
        assert!(!c.replicas[0].measured());
        assert_eq!(c.replicas[0].metrics_samples, 4);
    }

    #[test]
    fn nonsense_samples_change_nothing() {
        let mut c = Calibration::new(1);
        learn(&mut c, &ttft(0, 0.0, 0.0, 1.0), 0);
        learn(&mut c, &ttft(0, f64::NAN, 0.0, 1.0), 0);
        learn(&mut c, &ttft(0, 0.2, 0.0, f64::INFINITY), 0);
        learn(&mut c, &ttft(7, 0.2, 0.0, 1.0), 0);
        assert_eq!(c.pace(0), Pace::CONFIGURED);
        assert!(!c.replicas[0].measured());
    }
}

//! The one encoder: a `Family` writes its HELP and TYPE lines through prometheus-client's
//! `DescriptorEncoder`, then its samples through `Samples`, which checks them against the
//! family's declaration (type, label names). `render` encodes a whole `Registry` as
//! Prometheus text, version 0.0.4: counters named `..._total` in HELP, TYPE and samples alike
//! (prometheus-client appends the suffix itself, so a family's name is given without it),
//! histogram buckets `le` as Go clients write them (`0.0005`, `1`, `+Inf`), no `# EOF`.

#![forbid(unsafe_code)]

use super::{Histogram, ValueHistogram, BUCKETS};
use prometheus_client::encoding::{DescriptorEncoder, MetricEncoder, NoLabelSet};
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;
use std::fmt;
use std::sync::atomic::Ordering::Relaxed;

/// The content type of what `render` writes.
pub const CONTENT_TYPE: &str = prometheus_client::encoding::prometheus_text::CONTENT_TYPE;

/// Most label names a family has.
const MAX_LABELS: usize = 3;

/// Prometheus text (version 0.0.4) of every collector in `registry`.
pub fn render(registry: &Registry) -> String {
    let mut out = String::with_capacity(32 * 1024);
    // Writing into a String cannot fail; a collector's error (a sample that does not fit its
    // family, see `Samples`) ends the text where it happened.
    let _ = prometheus_client::encoding::prometheus_text::encode(&mut out, registry);
    out
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Counter,
    Gauge,
    Histogram,
}

/// A metric family: declared in `families`, and only there.
#[derive(Debug)]
pub struct Family {
    name: &'static str,
    kind: Kind,
    labels: &'static [&'static str],
    help: &'static str,
}

impl Family {
    pub(super) const fn counter(
        name: &'static str,
        labels: &'static [&'static str],
        help: &'static str,
    ) -> Family {
        Family {
            name,
            kind: Kind::Counter,
            labels,
            help,
        }
    }

    pub(super) const fn gauge(
        name: &'static str,
        labels: &'static [&'static str],
        help: &'static str,
    ) -> Family {
        Family {
            name,
            kind: Kind::Gauge,
            labels,
            help,
        }
    }

    /// A histogram without labels of its own (`le` is the encoder's).
    pub(super) const fn histogram(name: &'static str, help: &'static str) -> Family {
        Family::histogram_by(name, &[], help)
    }

    /// A histogram with labels of its own (beside the encoder's `le`).
    pub(super) const fn histogram_by(
        name: &'static str,
        labels: &'static [&'static str],
        help: &'static str,
    ) -> Family {
        Family {
            name,
            kind: Kind::Histogram,
            labels,
            help,
        }
    }

    /// The name as exposed (a counter's ends with `_total`).
    pub fn name(&self) -> &'static str {
        self.name
    }

    pub fn kind(&self) -> Kind {
        self.kind
    }

    /// Label names, in the order `Samples` takes their values.
    pub fn labels(&self) -> &'static [&'static str] {
        self.labels
    }

    pub fn help(&self) -> &'static str {
        self.help
    }

    /// Writes the family's HELP and TYPE lines; its samples follow through the `Samples`.
    pub fn describe<'e>(
        &'static self,
        enc: &'e mut DescriptorEncoder<'_>,
    ) -> Result<Samples<'e>, fmt::Error> {
        let (name, ty) = match self.kind {
            // prometheus-client appends `_total` to a counter's name.
            Kind::Counter => (
                self.name.strip_suffix("_total").ok_or(fmt::Error)?,
                MetricType::Counter,
            ),
            Kind::Gauge => (self.name, MetricType::Gauge),
            Kind::Histogram => (self.name, MetricType::Histogram),
        };
        let enc = enc.encode_descriptor(name, self.help, None, ty)?;
        Ok(Samples { family: self, enc })
    }
}

/// The samples of one family, each given its label values in the family's label order.
/// A sample of the wrong type or with the wrong number of labels is an error (it ends the
/// text), not a malformed line.
pub struct Samples<'e> {
    family: &'static Family,
    enc: MetricEncoder<'e>,
}

impl Samples<'_> {
    fn check(&self, kind: Kind, values: &[&str]) -> fmt::Result {
        if kind == self.family.kind && values.len() == self.family.labels.len() {
            Ok(())
        } else {
            debug_assert!(
                false,
                "{}: a {kind:?} sample with {} label values does not fit its declaration",
                self.family.name,
                values.len()
            );
            Err(fmt::Error)
        }
    }

    /// Runs `f` on an encoder that adds the family's labels with `values`.
    fn labelled(
        &mut self,
        values: &[&str],
        f: impl FnOnce(&mut MetricEncoder<'_>) -> fmt::Result,
    ) -> fmt::Result {
        if values.is_empty() {
            return f(&mut self.enc);
        }
        let mut set = [("", ""); MAX_LABELS];
        let n = values.len().min(MAX_LABELS);
        for (i, (name, value)) in self.family.labels.iter().zip(values).enumerate().take(n) {
            set[i] = (name, value);
        }
        let set: &[(&str, &str)] = &set[..n];
        let mut enc = self.enc.encode_family(&set)?;
        f(&mut enc)
    }

    pub fn counter(&mut self, values: &[&str], v: u64) -> fmt::Result {
        self.check(Kind::Counter, values)?;
        self.labelled(values, |e| {
            e.encode_counter::<NoLabelSet, u64, u64>(&v, None)
        })
    }

    pub fn gauge(&mut self, values: &[&str], v: u64) -> fmt::Result {
        self.check(Kind::Gauge, values)?;
        self.labelled(values, |e| e.encode_gauge(&v))
    }

    pub fn gauge_f64(&mut self, values: &[&str], v: f64) -> fmt::Result {
        self.check(Kind::Gauge, values)?;
        self.labelled(values, |e| e.encode_gauge(&v))
    }

    /// A histogram: `counts` per bucket of `bounds` (not cumulative), then one more for the
    /// values above the last bound.
    pub fn histogram(&mut self, bounds: &[f64], counts: &[u64], sum: f64) -> fmt::Result {
        self.histogram_of(&[], bounds, counts, sum)
    }

    /// `histogram` with the family's label `values`.
    fn histogram_of(
        &mut self,
        values: &[&str],
        bounds: &[f64],
        counts: &[u64],
        sum: f64,
    ) -> fmt::Result {
        self.check(Kind::Histogram, values)?;
        if counts.len() != bounds.len() + 1 {
            return Err(fmt::Error);
        }
        let buckets: Vec<(f64, u64)> = bounds
            .iter()
            .copied()
            .chain([f64::INFINITY])
            .zip(counts.iter().copied())
            .collect();
        let count = counts.iter().sum();
        self.labelled(values, |e| {
            e.encode_histogram::<NoLabelSet>(sum, count, &buckets, None)
        })
    }

    /// The sum over workers of a latency histogram (`BUCKETS`, in seconds).
    pub fn latency(&mut self, hs: &[&Histogram]) -> fmt::Result {
        self.latency_of(&[], hs)
    }

    /// `latency` with the family's label `values`.
    pub fn latency_of(&mut self, values: &[&str], hs: &[&Histogram]) -> fmt::Result {
        let mut counts = [0u64; BUCKETS.len() + 1];
        for h in hs {
            for (c, a) in counts.iter_mut().zip(&h.counts) {
                *c += a.load(Relaxed);
            }
        }
        let sum_us: u64 = hs.iter().map(|h| h.sum_us.load(Relaxed)).sum();
        self.histogram_of(values, &BUCKETS, &counts, sum_us as f64 / 1e6)
    }

    /// The sum over workers of a histogram of values (all over the same bounds).
    pub fn values(&mut self, hs: &[&ValueHistogram]) -> fmt::Result {
        let bounds = hs.first().map(|h| h.bounds).unwrap_or(&[]);
        let mut counts = vec![0u64; bounds.len() + 1];
        for h in hs {
            for (c, a) in counts.iter_mut().zip(&h.counts) {
                *c += a.load(Relaxed);
            }
        }
        let sum_milli: u64 = hs.iter().map(|h| h.sum_milli.load(Relaxed)).sum();
        self.histogram(bounds, &counts, sum_milli as f64 / 1000.0)
    }
}

#[cfg(test)]
mod tests {
    use super::super::ALL;
    use super::*;

    #[test]
    fn families_are_declared_well() {
        let mut names = std::collections::HashSet::new();
        for f in ALL {
            assert!(names.insert(f.name), "{} declared twice", f.name);
            assert!(f.name.starts_with("kvlb_"), "{}", f.name);
            assert!(f.labels.len() <= MAX_LABELS, "{}", f.name);
            assert!(!f.help.is_empty() && !f.help.contains('\n'), "{}", f.name);
            assert_eq!(
                f.kind == Kind::Counter,
                f.name.ends_with("_total"),
                "{}: counters, and only counters, end with _total",
                f.name
            );
        }
    }
}

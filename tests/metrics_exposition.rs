//! The shape of /metrics: every family kvlb exposes is declared once in `kvlb::metrics::ALL`
//! and written by the one encoder. A live `kvlb serve`'s /metrics is read with a strict
//! parser of the Prometheus text format (0.0.4): each family has one HELP and one TYPE line,
//! then its samples and nothing else; names, types, label names and help texts are those
//! declared, and the names are today's (a rename breaks dashboards, so it must show here).
//! docs/metrics.md lists every family, and no product source writes HELP or TYPE lines by hand.

#[path = "support/mod.rs"]
mod support;

use kvlb::metrics::{Family, Kind, ALL};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::Duration;
use support::{Backend, Kvlb};

/// Every family /metrics shows, and its type. Changing this list changes what scrapers see.
const EXPOSED: &[(&str, &str)] = &[
    ("kvlb_requests_total", "counter"),
    ("kvlb_retries_total", "counter"),
    ("kvlb_ejections_total", "counter"),
    ("kvlb_local_responses_total", "counter"),
    ("kvlb_client_aborts_total", "counter"),
    ("kvlb_cut_responses_total", "counter"),
    ("kvlb_replica_in_flight", "gauge"),
    ("kvlb_replica_queued_prefill_tokens", "gauge"),
    ("kvlb_replica_decoding", "gauge"),
    ("kvlb_worker_in_flight", "gauge"),
    ("kvlb_worker_connections", "gauge"),
    ("kvlb_worker_accepted_total", "counter"),
    ("kvlb_worker_requests_total", "counter"),
    ("kvlb_worker_allocations_total", "counter"),
    ("kvlb_worker_recv_throttled_total", "counter"),
    ("kvlb_spliced_response_bytes_total", "counter"),
    ("kvlb_body_memory_refused_total", "counter"),
    ("kvlb_worker_recv_buffer_shortages_total", "counter"),
    ("kvlb_bytes_total", "counter"),
    ("kvlb_upstream_connections_total", "counter"),
    ("kvlb_time_to_first_byte_seconds", "histogram"),
    ("kvlb_time_to_first_token_seconds", "histogram"),
    ("kvlb_estimated_ttft_seconds", "histogram"),
    ("kvlb_ttft_observed_over_estimated", "histogram"),
    ("kvlb_matched_prefix_tokens", "histogram"),
    ("kvlb_decisions_total", "counter"),
    ("kvlb_hot_prefix_spills_total", "counter"),
    ("kvlb_lora_slot_waits_total", "counter"),
    ("kvlb_response_affinity_total", "counter"),
    ("kvlb_pd_requests_total", "counter"),
    ("kvlb_response_ids_total", "counter"),
    ("kvlb_unparsed_prompts_total", "counter"),
    ("kvlb_prompt_truncated_total", "counter"),
    ("kvlb_request_duration_seconds", "histogram"),
    ("kvlb_draining", "gauge"),
    ("kvlb_queue_waiting", "gauge"),
    ("kvlb_body_memory_bytes", "gauge"),
    ("kvlb_queued_total", "counter"),
    ("kvlb_replica_up", "gauge"),
    ("kvlb_l4_connections_total", "counter"),
    ("kvlb_l4_active_connections", "gauge"),
    ("kvlb_l4_aborted_connections_total", "counter"),
    ("kvlb_l4_bytes_total", "counter"),
    ("kvlb_l4_sockmap_join_failures_total", "counter"),
    ("kvlb_l4_sockmap_loaded", "gauge"),
    ("kvlb_l4_sockmap_sockets", "gauge"),
    ("kvlb_l4_sockmap_peers", "gauge"),
    ("kvlb_tokenized_requests_total", "counter"),
    ("kvlb_tokenize_errors_total", "counter"),
    ("kvlb_tokenize_segment_hits_total", "counter"),
    ("kvlb_tokenize_segment_misses_total", "counter"),
    ("kvlb_access_log_lines_total", "counter"),
    ("kvlb_access_log_dropped_lines_total", "counter"),
    ("kvlb_process_open_fds", "gauge"),
    ("kvlb_process_max_fds", "gauge"),
    ("kvlb_process_resident_memory_bytes", "gauge"),
    ("kvlb_process_threads", "gauge"),
    ("kvlb_admin_connections_refused_total", "counter"),
    ("kvlb_admin_connections_timed_out_total", "counter"),
    ("kvlb_config_reloads_total", "counter"),
    ("kvlb_replica_running", "gauge"),
    ("kvlb_replica_waiting", "gauge"),
    ("kvlb_replica_kv_usage", "gauge"),
    ("kvlb_replica_lora_slots", "gauge"),
    ("kvlb_replica_lora_adapters_active", "gauge"),
    ("kvlb_replica_telemetry_age_seconds", "gauge"),
    ("kvlb_replica_telemetry_stale", "gauge"),
    ("kvlb_replica_kv_events_total", "counter"),
    ("kvlb_replica_kv_event_gaps_total", "counter"),
    ("kvlb_replica_kv_event_restarts_total", "counter"),
    ("kvlb_replica_kv_event_decode_errors_total", "counter"),
    ("kvlb_replica_kv_event_wrong_rank_total", "counter"),
    ("kvlb_replica_kv_event_replays_total", "counter"),
    ("kvlb_replica_kv_event_replay_failures_total", "counter"),
    ("kvlb_replica_kv_event_connect_failures_total", "counter"),
    ("kvlb_replica_kv_event_reuse_reports_total", "counter"),
    ("kvlb_replica_kv_engine_block_size", "gauge"),
    ("kvlb_replica_kv_offloaded_blocks_total", "counter"),
    ("kvlb_replica_kv_offload_resident_blocks", "gauge"),
    ("kvlb_replica_kv_event_skipped_total", "counter"),
    ("kvlb_replica_prefill_pace", "gauge"),
    ("kvlb_replica_decode_pace", "gauge"),
    ("kvlb_replica_queue_pace", "gauge"),
    ("kvlb_replica_ttft_observed_over_estimated", "gauge"),
    ("kvlb_replica_calibration_samples_total", "counter"),
    ("kvlb_replica_calibration_metrics_skipped_total", "counter"),
    ("kvlb_replica_calibration_outliers_total", "counter"),
    ("kvlb_calibration_samples_dropped_total", "counter"),
    ("kvlb_lora_adapters_known", "gauge"),
    ("kvlb_model_replicas", "gauge"),
    ("kvlb_model_requests_total", "counter"),
    ("kvlb_model_time_to_first_token_seconds", "histogram"),
    ("kvlb_model_prompt_tokens_total", "counter"),
    ("kvlb_model_matched_tokens_total", "counter"),
    ("kvlb_model_not_found_total", "counter"),
    ("kvlb_model_list_failures_total", "counter"),
    ("kvlb_lora_loads_total", "counter"),
];

fn type_name(kind: Kind) -> &'static str {
    match kind {
        Kind::Counter => "counter",
        Kind::Gauge => "gauge",
        Kind::Histogram => "histogram",
    }
}

/// One sample: its name, its labels in order, its value.
type Sample = (String, Vec<(String, String)>, f64);

/// One family as read from the text.
#[derive(Debug, Default)]
struct Parsed {
    help: Option<String>,
    kind: Option<String>,
    samples: Vec<Sample>,
}

fn is_name(s: &str) -> bool {
    let mut chars = s.chars();
    matches!(chars.next(), Some(c) if c.is_ascii_alphabetic() || c == '_' || c == ':')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':')
}

fn is_label_name(s: &str) -> bool {
    is_name(s) && !s.contains(':') && !s.starts_with("__")
}

/// `{a="x",b="y"}` (without the braces): the labels in order, or why not.
fn parse_labels(s: &str) -> Result<Vec<(String, String)>, String> {
    let mut out = Vec::new();
    let mut rest = s;
    while !rest.is_empty() {
        let (name, after) = rest
            .split_once("=\"")
            .ok_or_else(|| format!("label without =\"value\": {rest:?}"))?;
        if !is_label_name(name) {
            return Err(format!("bad label name {name:?}"));
        }
        let mut value = String::new();
        let mut chars = after.char_indices();
        let end = loop {
            match chars.next() {
                None => return Err(format!("unterminated label value in {s:?}")),
                Some((i, '"')) => break i,
                Some((_, '\\')) => match chars.next() {
                    Some((_, '\\')) => value.push('\\'),
                    Some((_, '"')) => value.push('"'),
                    Some((_, 'n')) => value.push('\n'),
                    other => return Err(format!("bad escape {other:?} in {s:?}")),
                },
                Some((_, '\n')) => return Err(format!("newline in label value {s:?}")),
                Some((_, c)) => value.push(c),
            }
        };
        if out.iter().any(|(n, _)| n == name) {
            return Err(format!("label {name} twice in {s:?}"));
        }
        out.push((name.to_string(), value));
        rest = &after[end + 1..];
        if let Some(r) = rest.strip_prefix(',') {
            if r.is_empty() {
                return Err(format!("trailing comma in {s:?}"));
            }
            rest = r;
        } else if !rest.is_empty() {
            return Err(format!("expected , between labels in {s:?}"));
        }
    }
    Ok(out)
}

fn parse_value(s: &str) -> Result<f64, String> {
    match s {
        "+Inf" => Ok(f64::INFINITY),
        "-Inf" => Ok(f64::NEG_INFINITY),
        "NaN" => Ok(f64::NAN),
        _ => s.parse::<f64>().map_err(|_| format!("bad value {s:?}")),
    }
}

/// The whole text, strictly: each family's HELP, then its TYPE, then only its samples.
/// Returns the families in order of appearance.
fn parse(text: &str) -> Result<Vec<(String, Parsed)>, String> {
    if !text.ends_with('\n') {
        return Err("the text does not end with a newline".into());
    }
    let mut families: Vec<(String, Parsed)> = Vec::new();
    let mut seen_series = BTreeSet::new();
    for (n, line) in text.lines().enumerate() {
        let at = |e: String| format!("line {}: {e}: {line:?}", n + 1);
        if line.is_empty() {
            return Err(at("empty line".into()));
        }
        if let Some(rest) = line.strip_prefix("# HELP ") {
            let (name, help) = rest.split_once(' ').ok_or_else(|| at("no help".into()))?;
            if !is_name(name) {
                return Err(at("bad family name".into()));
            }
            if families.iter().any(|(f, _)| f == name) {
                return Err(at(format!("second HELP for {name}")));
            }
            let mut escaped = help.chars();
            while let Some(c) = escaped.next() {
                if c == '\\' && !matches!(escaped.next(), Some('\\' | 'n')) {
                    return Err(at("bad escape in help".into()));
                }
            }
            families.push((
                name.to_string(),
                Parsed {
                    help: Some(help.to_string()),
                    ..Parsed::default()
                },
            ));
        } else if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').ok_or_else(|| at("no type".into()))?;
            let Some((last, parsed)) = families.last_mut() else {
                return Err(at("TYPE before any HELP".into()));
            };
            if last != name || parsed.kind.is_some() || !parsed.samples.is_empty() {
                return Err(at(format!("TYPE of {name} not right after its HELP")));
            }
            if !matches!(
                kind,
                "counter" | "gauge" | "histogram" | "summary" | "untyped"
            ) {
                return Err(at(format!("unknown type {kind}")));
            }
            parsed.kind = Some(kind.to_string());
        } else if line.starts_with('#') {
            return Err(at("a comment that is neither HELP nor TYPE".into()));
        } else {
            let (series, value) = line.rsplit_once(' ').ok_or_else(|| at("no value".into()))?;
            let value = parse_value(value).map_err(at)?;
            let (name, labels) = match series.split_once('{') {
                Some((name, rest)) => {
                    let inner = rest
                        .strip_suffix('}')
                        .ok_or_else(|| at("labels not closed (or a timestamp)".into()))?;
                    (name, parse_labels(inner).map_err(at)?)
                }
                None => (series, Vec::new()),
            };
            if !is_name(name) {
                return Err(at("bad sample name".into()));
            }
            let Some((family, parsed)) = families.last_mut() else {
                return Err(at("a sample before any family".into()));
            };
            let Some(kind) = parsed.kind.as_deref() else {
                return Err(at(format!("a sample of {family} before its TYPE")));
            };
            let fits = match kind {
                "histogram" => ["_bucket", "_sum", "_count"]
                    .iter()
                    .any(|s| name.strip_suffix(s) == Some(family.as_str())),
                _ => name == family,
            };
            if !fits {
                return Err(at(format!(
                    "a sample outside its family (the last is {family})"
                )));
            }
            let key = format!("{name}{labels:?}");
            if !seen_series.insert(key) {
                return Err(at("the same series twice".into()));
            }
            if kind == "counter" && (value < 0.0 || value.is_nan()) {
                return Err(at("a counter below zero".into()));
            }
            parsed.samples.push((name.to_string(), labels, value));
        }
    }
    if let Some((name, _)) = families.iter().find(|(_, p)| p.kind.is_none()) {
        return Err(format!("{name} has HELP but no TYPE"));
    }
    Ok(families)
}

/// A histogram's samples: buckets ascending by `le`, cumulative, ending at +Inf = `_count`.
fn check_histogram(name: &str, samples: &[Sample]) {
    let buckets: Vec<(f64, f64)> = samples
        .iter()
        .filter(|(n, _, _)| n.ends_with("_bucket"))
        .map(|(_, labels, v)| {
            assert_eq!(labels.len(), 1, "{name}: bucket labels {labels:?}");
            assert_eq!(labels[0].0, "le", "{name}: bucket labels {labels:?}");
            (parse_value(&labels[0].1).unwrap(), *v)
        })
        .collect();
    assert!(!buckets.is_empty(), "{name}: no buckets");
    for w in buckets.windows(2) {
        assert!(w[0].0 < w[1].0, "{name}: le not ascending: {buckets:?}");
        assert!(
            w[0].1 <= w[1].1,
            "{name}: buckets not cumulative: {buckets:?}"
        );
    }
    let (last_le, last) = *buckets.last().unwrap();
    assert_eq!(
        last_le,
        f64::INFINITY,
        "{name}: the last bucket is not +Inf"
    );
    let count = samples
        .iter()
        .find(|(n, _, _)| n.ends_with("_count"))
        .map(|(_, _, v)| *v);
    assert_eq!(count, Some(last), "{name}: _count is not the +Inf bucket");
    assert!(
        samples.iter().any(|(n, _, _)| n.ends_with("_sum")),
        "{name}: no _sum"
    );
}

fn escape_help(help: &str) -> String {
    help.replace('\\', "\\\\").replace('\n', "\\n")
}

#[test]
fn declared_families_are_todays() {
    let declared: Vec<(&str, &str)> = ALL
        .iter()
        .map(|f| (f.name(), type_name(f.kind())))
        .collect();
    assert_eq!(
        declared, EXPOSED,
        "the declared families (kvlb::metrics::ALL) differ from those /metrics has shown; a \
         rename or a new family must be made in both on purpose"
    );
}

#[test]
fn live_metrics_parse_strictly_as_declared() {
    let a = Backend::start();
    let b = Backend::start();
    let (ua, ub) = (a.url(), b.url());
    let kvlb = Kvlb::serve(&["--replica", &ua, "--replica", &ub, "--workers", "2"]);
    for _ in 0..4 {
        assert_eq!(kvlb.get("/echo").status, 200);
    }
    assert_eq!(kvlb.get("/status?code=500").status, 500);
    // A worker counts a request once its response is sent: wait for the last one.
    let done = |text: &str| {
        support::proxy::metric_sum(text, "kvlb_request_duration_seconds_count", &[]) == Some(5.0)
    };
    support::wait_until(Duration::from_secs(5), || {
        done(&kvlb.admin_get("/metrics").body_text())
    });
    let resp = kvlb.admin_get("/metrics");
    assert_eq!(resp.status, 200, "{}", resp.describe());
    let ctype = resp.header("content-type").unwrap_or("");
    assert!(
        ctype.starts_with("text/plain; version=0.0.4"),
        "content-type {ctype:?}"
    );
    let text = resp.body_text();
    assert!(
        !text.contains("# EOF"),
        "OpenMetrics ending in Prometheus text"
    );
    let parsed = parse(&text).unwrap_or_else(|e| panic!("{e}\n{text}"));

    let order: Vec<&str> = parsed.iter().map(|(n, _)| n.as_str()).collect();
    let expected: Vec<&str> = ALL.iter().map(|f| f.name()).collect();
    assert_eq!(order, expected, "families shown vs declared, in order");

    let by_name: HashMap<&str, &Family> = ALL.iter().map(|f| (f.name(), *f)).collect();
    for (name, p) in &parsed {
        let f = by_name[name.as_str()];
        assert_eq!(p.kind.as_deref(), Some(type_name(f.kind())), "{name}");
        assert_eq!(
            p.help.as_deref(),
            Some(escape_help(f.help()).as_str()),
            "{name}"
        );
        match f.kind() {
            Kind::Histogram => {
                // One histogram per set of the family's own labels (`le` aside).
                let own = |labels: &[(String, String)]| -> Vec<(String, String)> {
                    labels.iter().filter(|(n, _)| n != "le").cloned().collect()
                };
                let mut sets: Vec<Vec<(String, String)>> = Vec::new();
                for (_, labels, _) in &p.samples {
                    let set = own(labels);
                    let names: Vec<&str> = set.iter().map(|(n, _)| n.as_str()).collect();
                    assert_eq!(names, f.labels(), "{name}: label names");
                    if !sets.contains(&set) {
                        sets.push(set);
                    }
                }
                for set in sets {
                    let one: Vec<Sample> = p
                        .samples
                        .iter()
                        .filter(|(_, l, _)| own(l) == set)
                        .map(|(n, l, v)| {
                            let le: Vec<(String, String)> =
                                l.iter().filter(|(k, _)| k == "le").cloned().collect();
                            (n.clone(), le, *v)
                        })
                        .collect();
                    check_histogram(&format!("{name}{set:?}"), &one);
                }
            }
            _ => {
                for (_, labels, _) in &p.samples {
                    let names: Vec<&str> = labels.iter().map(|(n, _)| n.as_str()).collect();
                    assert_eq!(names, f.labels(), "{name}: label names");
                }
            }
        }
    }

    // The values are the ones the traffic made.
    let sample = |family: &str, labels: &[(&str, &str)]| -> f64 {
        let (_, p) = parsed.iter().find(|(n, _)| n == family).unwrap();
        p.samples
            .iter()
            .filter(|(_, l, _)| {
                labels
                    .iter()
                    .all(|(k, v)| l.iter().any(|(lk, lv)| lk == k && lv == v))
            })
            .map(|(_, _, v)| v)
            .sum()
    };
    assert_eq!(
        sample("kvlb_requests_total", &[("status", "2xx")]),
        4.0,
        "{text}"
    );
    assert_eq!(
        sample("kvlb_requests_total", &[("status", "5xx")]),
        1.0,
        "{text}"
    );
    assert_eq!(sample("kvlb_worker_requests_total", &[]), 5.0, "{text}");
    assert_eq!(
        sample("kvlb_replica_up", &[("replica", &ua)]),
        1.0,
        "{text}"
    );
    assert_eq!(sample("kvlb_draining", &[]), 0.0, "{text}");
    let (_, ttfb) = parsed
        .iter()
        .find(|(n, _)| n == "kvlb_request_duration_seconds")
        .unwrap();
    let count = ttfb.samples.iter().find(|(n, _, _)| n.ends_with("_count"));
    assert_eq!(count.map(|s| s.2), Some(5.0), "{text}");
    let les: Vec<&str> = ttfb
        .samples
        .iter()
        .filter(|(n, _, _)| n.ends_with("_bucket"))
        .map(|(_, l, _)| l[0].1.as_str())
        .collect();
    assert_eq!(
        les,
        [
            "0.0005", "0.001", "0.0025", "0.005", "0.01", "0.025", "0.05", "0.1", "0.25", "0.5",
            "1", "2.5", "5", "10", "30", "60", "+Inf"
        ],
        "bucket bounds as today's scrapes and dashboards know them"
    );
}

/// The families table of docs/metrics.md: `| name | type | labels | help |` rows.
fn docs_table() -> BTreeMap<String, (String, String)> {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/docs/metrics.md");
    let text = std::fs::read_to_string(path).unwrap();
    text.lines()
        .filter_map(|l| {
            let cells: Vec<&str> = l
                .trim()
                .strip_prefix('|')?
                .split('|')
                .map(str::trim)
                .collect();
            let name = cells.first()?.strip_prefix('`')?.strip_suffix('`')?;
            let kind = *cells.get(1)?;
            if !is_name(name) || !matches!(kind, "counter" | "gauge" | "histogram") {
                return None;
            }
            Some((
                name.to_string(),
                (kind.to_string(), cells.get(2)?.replace('`', "")),
            ))
        })
        .collect()
}

#[test]
fn docs_list_every_family() {
    let table = docs_table();
    let expected: BTreeMap<String, (String, String)> = ALL
        .iter()
        .map(|f| {
            (
                f.name().to_string(),
                (type_name(f.kind()).to_string(), f.labels().join(", ")),
            )
        })
        .collect();
    if table != expected {
        let rows: Vec<String> = ALL
            .iter()
            .map(|f| {
                let labels: Vec<String> = f.labels().iter().map(|l| format!("`{l}`")).collect();
                format!(
                    "| `{}` | {} | {} | {} |",
                    f.name(),
                    type_name(f.kind()),
                    labels.join(", "),
                    f.help().replace('|', "\\|")
                )
            })
            .collect();
        panic!(
            "docs/metrics.md's table of families differs from kvlb::metrics::ALL; its rows \
             should be:\n{}",
            rows.join("\n")
        );
    }
}

/// Every .rs file under `dir`.
fn sources(dir: &std::path::Path, out: &mut Vec<std::path::PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            sources(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

#[test]
fn no_family_is_rendered_outside_the_registry() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = Vec::new();
    sources(&root.join("src"), &mut files);
    // The simulated engine's vLLM-format metrics (replica, replay) are not kvlb's, and the
    // telemetry tests hold a replica's /metrics as input.
    let not_kvlb = ["src/replica/", "src/replay/", "src/telemetry/tests.rs"];
    let mut offenders = Vec::new();
    for path in files {
        let rel = path
            .strip_prefix(root)
            .unwrap()
            .to_string_lossy()
            .into_owned();
        if not_kvlb.iter().any(|p| rel.starts_with(p)) {
            continue;
        }
        let text = std::fs::read_to_string(&path).unwrap();
        let in_metrics = rel.starts_with("src/metrics/");
        for (n, line) in text.lines().enumerate() {
            let by_hand = line.contains("# HELP") || line.contains("# TYPE");
            let own_encoder = !in_metrics
                && (line.contains("encode_descriptor") || line.contains("prometheus_text"));
            if by_hand || own_encoder {
                offenders.push(format!("{rel}:{}: {}", n + 1, line.trim()));
            }
        }
    }
    assert!(
        offenders.is_empty(),
        "metric families written outside kvlb::metrics (declare them in \
         src/metrics/families.rs and write them with Family::describe):\n{}",
        offenders.join("\n")
    );
}

#[test]
fn the_strict_parser_refuses_what_it_should() {
    let ok = "# HELP a_total x\n# TYPE a_total counter\na_total{r=\"1\"} 2\n";
    assert!(parse(ok).is_ok());
    for bad in [
        "a_total 1\n",                                                   // no family
        "# HELP a x\n# HELP a y\n# TYPE a gauge\n",                      // two HELPs
        "# HELP a x\n# TYPE a gauge\nb 1\n",                             // outside its family
        "# HELP a x\n# TYPE a gauge\na{r=\"1\",} 1\n",                   // trailing comma
        "# HELP a x\n# TYPE a gauge\na 1\na 2\n",                        // same series twice
        "# HELP a x\n# TYPE a gauge\na 1",                               // no final newline
        "# HELP a x\n# TYPE a gauge\n# EOF\n",                           // OpenMetrics
        "# HELP a x\n# TYPE a counter\na -1\n",                          // counter below zero
        "# HELP a x\n# TYPE a gauge\n# HELP b y\n# TYPE b gauge\na 1\n", // interleaved
    ] {
        assert!(parse(bad).is_err(), "accepted {bad:?}");
    }
}

//! The admin listener of `kvlb serve`: /healthz, /metrics (Prometheus text, `kvlb_` names,
//! requests by replica and status, requests in flight) and /replicas (JSON).

#[path = "support/mod.rs"]
mod support;

use std::time::Duration;

use support::{wait_until, Backend, HttpConn, Kvlb};

fn two_replicas() -> (Backend, Backend, Kvlb) {
    let a = Backend::start();
    let b = Backend::start();
    let (ua, ub) = (a.url(), b.url());
    let kvlb = Kvlb::serve(&[
        "--replica",
        ua.as_str(),
        "--replica",
        ub.as_str(),
        "--policy",
        "round_robin",
        "--workers",
        "1",
    ]);
    (a, b, kvlb)
}

/// Sample lines (`name{labels} value`) of metrics whose name starts with `kvlb_`.
fn samples(text: &str) -> Vec<(String, String, f64)> {
    text.lines()
        .filter(|l| l.starts_with("kvlb_"))
        .filter_map(|l| {
            let (series, value) = l.rsplit_once(' ')?;
            let value: f64 = value.parse().ok()?;
            let (name, labels) = match series.split_once('{') {
                Some((n, rest)) => (n.to_string(), rest.trim_end_matches('}').to_string()),
                None => (series.to_string(), String::new()),
            };
            Some((name, labels, value))
        })
        .collect()
}

#[test]
fn healthz_answers_200() {
    let (_a, _b, kvlb) = two_replicas();
    let resp = kvlb.admin_get("/healthz");
    assert_eq!(resp.status, 200, "{}", resp.describe());
}

#[test]
fn metrics_count_requests_by_replica_and_status() {
    let (a, _b, kvlb) = two_replicas();
    for _ in 0..4 {
        assert_eq!(kvlb.get("/echo").status, 200);
    }
    for _ in 0..2 {
        assert_eq!(kvlb.get("/status?code=204").status, 204);
    }
    let resp = kvlb.admin_get("/metrics");
    assert_eq!(resp.status, 200, "{}", resp.describe());
    let ctype = resp.header("content-type").unwrap_or("");
    assert!(ctype.starts_with("text/plain"), "content-type {ctype:?}");
    let text = resp.body_text();
    let series = samples(&text);
    assert!(!series.is_empty(), "no kvlb_ samples in /metrics:\n{text}");
    // Every metric family has a kvlb_ name.
    for line in text.lines().filter(|l| l.starts_with("# TYPE ")) {
        let name = line.split(' ').nth(2).unwrap_or("");
        assert!(
            name.starts_with("kvlb_"),
            "metric {name} lacks the kvlb_ prefix"
        );
    }
    // A request counter labelled by replica and status: replica a served 2 of the 4 echoes
    // and 1 of the 2 204s (round robin over 2).
    let a_host = a.addr.to_string();
    let by = |status: &str| -> f64 {
        series
            .iter()
            .filter(|(n, l, _)| {
                n.contains("request")
                    && !n.ends_with("_bucket")
                    && !n.ends_with("_sum")
                    && !n.ends_with("_count")
                    && l.contains(&a_host)
                    && l.contains(&format!("\"{status}\""))
            })
            .map(|(_, _, v)| *v)
            .sum()
    };
    // The status label is either the code ("200") or its class ("2xx").
    if by("2xx") > 0.0 || by("200") == 0.0 {
        assert_eq!(
            by("2xx"),
            3.0,
            "expected a kvlb_*request* counter with replica {a_host} and status \"2xx\" = 3 \
             (2 of the 200s, 1 of the 204s):\n{text}"
        );
    } else {
        assert_eq!(
            by("200"),
            2.0,
            "expected a kvlb_*request* counter with replica {a_host} and status \"200\" = 2:\n{text}"
        );
        assert_eq!(
            by("204"),
            1.0,
            "status \"204\" for replica {a_host}:\n{text}"
        );
    }
    let in_flight: Vec<_> = series
        .iter()
        .filter(|(n, _, _)| n.contains("in_flight") || n.contains("inflight"))
        .collect();
    assert!(!in_flight.is_empty(), "no in-flight metric:\n{text}");
    // The gauges may lag the last response by the time it takes the worker to see its write
    // complete; they must settle at 0.
    let settled = wait_until(Duration::from_secs(1), || {
        samples(&kvlb.admin_get("/metrics").body_text())
            .iter()
            .filter(|(n, _, _)| n.contains("in_flight") || n.contains("inflight"))
            .all(|(_, _, v)| *v == 0.0)
    });
    assert!(settled, "requests in flight while idle: {in_flight:?}");
}

#[test]
fn metrics_show_a_request_in_flight() {
    let (_a, _b, kvlb) = two_replicas();
    let listen = kvlb.listen;
    let slow = std::thread::spawn(move || {
        let mut conn = HttpConn::connect(listen);
        conn.request("GET", "/slow?ms=1500", &[], b"")
    });
    let flight = || -> f64 {
        samples(&kvlb.admin_get("/metrics").body_text())
            .iter()
            .filter(|(n, _, _)| n.contains("in_flight") || n.contains("inflight"))
            .map(|(_, _, v)| *v)
            .sum()
    };
    let seen = wait_until(Duration::from_millis(1200), || flight() >= 1.0);
    let resp = slow.join().unwrap().expect("slow request");
    assert_eq!(resp.status, 200);
    assert!(
        seen,
        "in-flight metric never showed the slow request:\n{}",
        kvlb.admin_get("/metrics").body_text()
    );
    assert!(
        wait_until(Duration::from_secs(2), || flight() == 0.0),
        "in-flight metric did not return to 0"
    );
}

#[test]
fn replicas_lists_the_configured_urls_as_json() {
    let (a, b, kvlb) = two_replicas();
    let resp = kvlb.admin_get("/replicas");
    assert_eq!(resp.status, 200, "{}", resp.describe());
    let json = resp
        .json()
        .unwrap_or_else(|| panic!("/replicas is not JSON:\n{}", resp.describe()));
    let mut strings = Vec::new();
    collect_strings(&json, &mut strings);
    for url in [a.url(), b.url()] {
        assert!(
            strings.contains(&url),
            "/replicas does not list {url}: {json}"
        );
    }
}

fn collect_strings(v: &serde_json::Value, out: &mut Vec<String>) {
    match v {
        serde_json::Value::String(s) => out.push(s.clone()),
        serde_json::Value::Array(a) => a.iter().for_each(|x| collect_strings(x, out)),
        serde_json::Value::Object(o) => o.values().for_each(|x| collect_strings(x, out)),
        _ => {}
    }
}

#[test]
fn admin_unknown_path_is_404() {
    let (_a, _b, kvlb) = two_replicas();
    assert_eq!(kvlb.admin_get("/no-such-admin-page").status, 404);
}

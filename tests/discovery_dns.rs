//! Replica discovery against a real (tiny) authoritative DNS server on 127.0.0.1: UDP and TCP
//! on one ephemeral port, answering A, AAAA, SRV (+ additional), CNAME, NXDOMAIN, SERVFAIL and
//! truncated answers. The server's encoder is written here, independently of kvlb's codec.

#[path = "support/mod.rs"]
mod support;

use kvlb::discovery::{resolve, Discovery, DiscoveryError, DnsSource};
use std::io::{Read, Write};
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, UdpSocket};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

#[derive(Clone, Debug)]
enum Rec {
    A(Ipv4Addr),
    Aaaa(Ipv6Addr),
    Cname(&'static str),
    Srv(u16, &'static str),
}

#[derive(Default)]
struct Zone {
    records: Vec<(&'static str, Rec)>,
    /// Add the SRV targets' A/AAAA records to the additional section.
    srv_additional: bool,
    /// Answer every query with SERVFAIL.
    servfail: bool,
    /// Names answered over UDP with the TC bit and no records.
    truncate_udp: Vec<&'static str>,
    /// Before each real answer, send one datagram with a wrong id.
    stray_first: bool,
}

const T_A: u16 = 1;
const T_CNAME: u16 = 5;
const T_AAAA: u16 = 28;
const T_SRV: u16 = 33;

fn rtype(r: &Rec) -> u16 {
    match r {
        Rec::A(_) => T_A,
        Rec::Aaaa(_) => T_AAAA,
        Rec::Cname(_) => T_CNAME,
        Rec::Srv(..) => T_SRV,
    }
}

fn put_name(out: &mut Vec<u8>, name: &str) {
    for l in name.split('.') {
        out.push(l.len() as u8);
        out.extend_from_slice(l.as_bytes());
    }
    out.push(0);
}

/// One record; the owner is written as a pointer to the question when it is the query name.
fn put_record(out: &mut Vec<u8>, owner: &str, qname: &str, rec: &Rec) {
    if owner == qname {
        out.extend_from_slice(&[0xC0, 12]);
    } else {
        put_name(out, owner);
    }
    out.extend_from_slice(&rtype(rec).to_be_bytes());
    out.extend_from_slice(&1u16.to_be_bytes());
    out.extend_from_slice(&30u32.to_be_bytes());
    let mut rd = Vec::new();
    match rec {
        Rec::A(a) => rd.extend_from_slice(&a.octets()),
        Rec::Aaaa(a) => rd.extend_from_slice(&a.octets()),
        Rec::Cname(t) => put_name(&mut rd, t),
        Rec::Srv(port, t) => {
            rd.extend_from_slice(&[0, 10, 0, 1]);
            rd.extend_from_slice(&port.to_be_bytes());
            put_name(&mut rd, t);
        }
    }
    out.extend_from_slice(&(rd.len() as u16).to_be_bytes());
    out.extend_from_slice(&rd);
}

/// (qname lower-cased, qtype, end of the question) of a query, or None if it is not one.
fn parse_question(q: &[u8]) -> Option<(String, u16, usize)> {
    let mut pos = 12;
    let mut labels = Vec::new();
    loop {
        let len = *q.get(pos)? as usize;
        if len == 0 {
            break;
        }
        labels.push(String::from_utf8(q.get(pos + 1..pos + 1 + len)?.to_vec()).ok()?);
        pos += 1 + len;
    }
    let qtype = u16::from_be_bytes([*q.get(pos + 1)?, *q.get(pos + 2)?]);
    Some((labels.join(".").to_ascii_lowercase(), qtype, pos + 5))
}

fn answer(zone: &Zone, query: &[u8], over_udp: bool) -> Option<Vec<u8>> {
    let (qname, qtype, qend) = parse_question(query)?;
    let mut flags: u16 = 0x8500; // QR, AA, RD
    let mut answers: Vec<(&str, Rec)> = Vec::new();
    let mut additional: Vec<(&str, Rec)> = Vec::new();
    if zone.servfail {
        flags |= 2;
    } else if over_udp && zone.truncate_udp.contains(&qname.as_str()) {
        flags |= 0x0200;
    } else if !zone.records.iter().any(|(n, _)| *n == qname) {
        flags |= 3; // NXDOMAIN
    } else {
        let mut current = qname.clone();
        for _ in 0..8 {
            let here: Vec<&(&str, Rec)> =
                zone.records.iter().filter(|(n, _)| *n == current).collect();
            let hits: Vec<_> = here.iter().filter(|(_, r)| rtype(r) == qtype).collect();
            if !hits.is_empty() {
                answers.extend(hits.iter().map(|(n, r)| (*n, r.clone())));
                break;
            }
            match here.iter().find_map(|(n, r)| match r {
                Rec::Cname(t) => Some((*n, *t)),
                _ => None,
            }) {
                Some((n, t)) => {
                    answers.push((n, Rec::Cname(t)));
                    current = t.to_string();
                }
                None => break,
            }
        }
        if zone.srv_additional {
            for (_, r) in answers.clone() {
                if let Rec::Srv(_, target) = r {
                    for (n, r) in &zone.records {
                        if *n == target && matches!(r, Rec::A(_) | Rec::Aaaa(_)) {
                            additional.push((n, r.clone()));
                        }
                    }
                }
            }
        }
    }
    let mut out = Vec::new();
    out.extend_from_slice(&query[0..2]);
    out.extend_from_slice(&flags.to_be_bytes());
    out.extend_from_slice(&1u16.to_be_bytes());
    out.extend_from_slice(&(answers.len() as u16).to_be_bytes());
    out.extend_from_slice(&0u16.to_be_bytes());
    out.extend_from_slice(&(additional.len() as u16).to_be_bytes());
    out.extend_from_slice(&query[12..qend]);
    for (n, r) in &answers {
        put_record(&mut out, n, &qname, r);
    }
    for (n, r) in &additional {
        put_record(&mut out, n, &qname, r);
    }
    Some(out)
}

/// The server: stops and joins its threads on drop (also when a test panics).
struct DnsServer {
    addr: SocketAddr,
    zone: Arc<Mutex<Zone>>,
    udp_queries: Arc<AtomicUsize>,
    tcp_queries: Arc<AtomicUsize>,
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<()>>,
}

impl DnsServer {
    fn start(zone: Zone) -> DnsServer {
        let (udp, tcp) = (0..50)
            .find_map(|_| {
                let udp = UdpSocket::bind("127.0.0.1:0").unwrap();
                let port = udp.local_addr().unwrap().port();
                TcpListener::bind(("127.0.0.1", port))
                    .ok()
                    .map(|t| (udp, t))
            })
            .expect("a port free for both UDP and TCP");
        let addr = udp.local_addr().unwrap();
        let zone = Arc::new(Mutex::new(zone));
        let stop = Arc::new(AtomicBool::new(false));
        let udp_queries = Arc::new(AtomicUsize::new(0));
        let tcp_queries = Arc::new(AtomicUsize::new(0));
        let mut threads = Vec::new();
        {
            let (zone, stop, count) = (zone.clone(), stop.clone(), udp_queries.clone());
            udp.set_read_timeout(Some(Duration::from_millis(20)))
                .unwrap();
            threads.push(std::thread::spawn(move || {
                let mut buf = [0u8; 512];
                while !stop.load(Ordering::Relaxed) {
                    let Ok((n, peer)) = udp.recv_from(&mut buf) else {
                        continue;
                    };
                    count.fetch_add(1, Ordering::Relaxed);
                    let z = zone.lock().unwrap();
                    if let Some(reply) = answer(&z, &buf[..n], true) {
                        if z.stray_first {
                            let mut stray = reply.clone();
                            stray[0] ^= 0x5A;
                            let _ = udp.send_to(&stray, peer);
                        }
                        let _ = udp.send_to(&reply, peer);
                    }
                }
            }));
        }
        {
            let (zone, stop, count) = (zone.clone(), stop.clone(), tcp_queries.clone());
            tcp.set_nonblocking(true).unwrap();
            threads.push(std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    let Ok((mut s, _)) = tcp.accept() else {
                        std::thread::sleep(Duration::from_millis(5));
                        continue;
                    };
                    s.set_nonblocking(false).unwrap();
                    s.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
                    let mut len = [0u8; 2];
                    if s.read_exact(&mut len).is_err() {
                        continue;
                    }
                    let mut q = vec![0u8; u16::from_be_bytes(len) as usize];
                    if s.read_exact(&mut q).is_err() {
                        continue;
                    }
                    count.fetch_add(1, Ordering::Relaxed);
                    let reply = answer(&zone.lock().unwrap(), &q, false);
                    if let Some(r) = reply {
                        let _ = s.write_all(&(r.len() as u16).to_be_bytes());
                        let _ = s.write_all(&r);
                    }
                }
            }));
        }
        DnsServer {
            addr,
            zone,
            udp_queries,
            tcp_queries,
            stop,
            threads,
        }
    }

    fn set(&self, f: impl FnOnce(&mut Zone)) {
        f(&mut self.zone.lock().unwrap())
    }
}

impl Drop for DnsServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

const TIMEOUT: Duration = Duration::from_millis(300);

fn sa(s: &str) -> SocketAddr {
    s.parse().unwrap()
}

fn v4(last: u8) -> Rec {
    Rec::A(Ipv4Addr::new(127, 0, 0, last))
}

fn fleet_zone() -> Zone {
    Zone {
        records: vec![
            ("vllm.test", v4(3)),
            ("vllm.test", v4(2)),
            ("vllm.test", Rec::Aaaa(Ipv6Addr::LOCALHOST)),
            ("alias.test", Rec::Cname("alias2.test")),
            ("alias2.test", Rec::Cname("vllm.test")),
            ("_http._tcp.vllm.test", Rec::Srv(8001, "pod-a.vllm.test")),
            ("_http._tcp.vllm.test", Rec::Srv(8002, "pod-b.vllm.test")),
            ("_http._tcp.vllm.test", Rec::Srv(8003, "pod-a.vllm.test")),
            ("pod-a.vllm.test", v4(10)),
            ("pod-b.vllm.test", v4(11)),
            ("pod-b.vllm.test", Rec::Aaaa(Ipv6Addr::LOCALHOST)),
        ],
        srv_additional: true,
        ..Zone::default()
    }
}

fn resolve_spec(server: &DnsServer, spec: &str) -> Result<Vec<SocketAddr>, DiscoveryError> {
    resolve(&DnsSource::parse(spec).unwrap(), &[server.addr], TIMEOUT)
}

#[test]
fn a_and_aaaa_records_give_sorted_replicas() {
    let server = DnsServer::start(fleet_zone());
    assert_eq!(
        resolve_spec(&server, "dns://vllm.test:8000").unwrap(),
        vec![sa("127.0.0.2:8000"), sa("127.0.0.3:8000"), sa("[::1]:8000")]
    );
    assert_eq!(
        resolve_spec(&server, "dns://VLLM.test.:8000,family=ipv4").unwrap(),
        vec![sa("127.0.0.2:8000"), sa("127.0.0.3:8000")]
    );
    assert_eq!(
        resolve_spec(&server, "dns://vllm.test:8000,family=ipv6").unwrap(),
        vec![sa("[::1]:8000")]
    );
}

#[test]
fn cname_chain_is_followed() {
    let server = DnsServer::start(fleet_zone());
    assert_eq!(
        resolve_spec(&server, "dns://alias.test:9000,family=ipv4").unwrap(),
        vec![sa("127.0.0.2:9000"), sa("127.0.0.3:9000")]
    );
}

#[test]
fn srv_records_with_and_without_additional_section() {
    let server = DnsServer::start(fleet_zone());
    let want = vec![
        sa("127.0.0.10:8001"),
        sa("127.0.0.10:8003"),
        sa("127.0.0.11:8002"),
        sa("[::1]:8002"),
    ];
    let before = server.udp_queries.load(Ordering::Relaxed);
    assert_eq!(
        resolve_spec(&server, "dns+srv://_http._tcp.vllm.test").unwrap(),
        want
    );
    assert_eq!(
        server.udp_queries.load(Ordering::Relaxed) - before,
        1,
        "one SRV query"
    );

    server.set(|z| z.srv_additional = false);
    let before = server.udp_queries.load(Ordering::Relaxed);
    assert_eq!(
        resolve_spec(&server, "dns+srv://_http._tcp.vllm.test").unwrap(),
        want
    );
    // SRV + (A, AAAA) for each of the two distinct targets.
    assert_eq!(server.udp_queries.load(Ordering::Relaxed) - before, 5);

    assert_eq!(
        resolve_spec(&server, "dns+srv://_http._tcp.vllm.test,family=ipv4").unwrap(),
        want[..3].to_vec()
    );
}

#[test]
fn nxdomain_is_an_empty_fleet_and_servfail_an_error() {
    let server = DnsServer::start(fleet_zone());
    assert_eq!(
        resolve_spec(&server, "dns://missing.test:8000").unwrap(),
        vec![]
    );
    assert_eq!(
        resolve_spec(&server, "dns+srv://_http._tcp.missing.test").unwrap(),
        vec![]
    );
    server.set(|z| z.servfail = true);
    let e = resolve_spec(&server, "dns://vllm.test:8000")
        .unwrap_err()
        .to_string();
    assert!(e.contains("SERVFAIL") && e.contains("vllm.test"), "{e}");
}

#[test]
fn truncated_answer_is_asked_again_over_tcp() {
    let server = DnsServer::start(fleet_zone());
    server.set(|z| z.truncate_udp = vec!["vllm.test", "_http._tcp.vllm.test"]);
    assert_eq!(
        resolve_spec(&server, "dns://vllm.test:8000").unwrap(),
        vec![sa("127.0.0.2:8000"), sa("127.0.0.3:8000"), sa("[::1]:8000")]
    );
    assert_eq!(
        server.tcp_queries.load(Ordering::Relaxed),
        2,
        "A and AAAA over TCP"
    );
    assert_eq!(
        resolve_spec(&server, "dns+srv://_http._tcp.vllm.test")
            .unwrap()
            .len(),
        4
    );
    assert_eq!(server.tcp_queries.load(Ordering::Relaxed), 3);
}

#[test]
fn stray_datagrams_are_ignored_and_a_silent_resolver_is_skipped() {
    let server = DnsServer::start(fleet_zone());
    server.set(|z| z.stray_first = true);
    assert_eq!(
        resolve_spec(&server, "dns://vllm.test:8000,family=ipv4")
            .unwrap()
            .len(),
        2
    );

    // A resolver that never answers (bound, never read) before the real one.
    let silent = UdpSocket::bind("127.0.0.1:0").unwrap();
    let source = DnsSource::parse("dns://vllm.test:8000,family=ipv4").unwrap();
    let t0 = std::time::Instant::now();
    let got = resolve(
        &source,
        &[silent.local_addr().unwrap(), server.addr],
        TIMEOUT,
    )
    .unwrap();
    assert_eq!(got.len(), 2);
    assert!(
        t0.elapsed() >= TIMEOUT,
        "waited for the silent resolver first"
    );

    // A closed port (ICMP port unreachable) is skipped without waiting for the timeout.
    let closed = UdpSocket::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let t0 = std::time::Instant::now();
    let got = resolve(&source, &[closed, server.addr], Duration::from_secs(3)).unwrap();
    assert_eq!(got.len(), 2);
    assert!(t0.elapsed() < Duration::from_secs(1), "{:?}", t0.elapsed());

    // Only silent resolvers: a timeout error after ATTEMPTS rounds.
    let e = resolve(
        &source,
        &[silent.local_addr().unwrap()],
        Duration::from_millis(100),
    )
    .unwrap_err();
    assert!(e.to_string().contains("did not answer in time"), "{e}");
}

#[test]
fn runner_publishes_changes_and_keeps_the_last_good_set() {
    let server = DnsServer::start(fleet_zone());
    let source = DnsSource::parse("dns://vllm.test:8000,interval=100ms,family=ipv4").unwrap();
    let (tx, rx) = mpsc::channel::<Vec<SocketAddr>>();
    let stop = Arc::new(AtomicBool::new(false));
    let runner = Discovery::start(
        source,
        vec![server.addr],
        TIMEOUT,
        stop.clone(),
        move |set| {
            let _ = tx.send(set.to_vec());
        },
    )
    .unwrap();
    let wait = Duration::from_secs(5);
    assert_eq!(
        rx.recv_timeout(wait).unwrap(),
        vec![sa("127.0.0.2:8000"), sa("127.0.0.3:8000")]
    );
    // Unchanged records over several intervals: no call.
    assert!(rx.recv_timeout(Duration::from_millis(350)).is_err());

    // A scale-up between intervals.
    server.set(|z| z.records.push(("vllm.test", v4(4))));
    assert_eq!(
        rx.recv_timeout(wait).unwrap(),
        vec![
            sa("127.0.0.2:8000"),
            sa("127.0.0.3:8000"),
            sa("127.0.0.4:8000")
        ]
    );

    // The server fails: the last good set stays, no call.
    server.set(|z| z.servfail = true);
    let failing_from = server.udp_queries.load(Ordering::Relaxed);
    assert!(rx.recv_timeout(Duration::from_millis(500)).is_err());
    assert!(
        server.udp_queries.load(Ordering::Relaxed) > failing_from,
        "kept asking"
    );

    // It recovers with a scale-down.
    server.set(|z| {
        z.servfail = false;
        z.records
            .retain(|(n, r)| !(*n == "vllm.test" && matches!(r, Rec::A(a) if a.octets()[3] == 3)));
    });
    assert_eq!(
        rx.recv_timeout(wait).unwrap(),
        vec![sa("127.0.0.2:8000"), sa("127.0.0.4:8000")]
    );

    // The stop flag ends the thread promptly.
    let t0 = std::time::Instant::now();
    stop.store(true, Ordering::Relaxed);
    runner.stop();
    assert!(t0.elapsed() < Duration::from_secs(2));
}

#[test]
fn replica_flags_are_valid_replica_values() {
    let source = DnsSource::parse(
        "dns+srv://_http._tcp.vllm.test,kv_events=tcp://{host}:5557,kv_replay=tcp://{host}:5558,kv_capacity_tokens=100000,metrics=on",
    )
    .unwrap();
    for addr in [sa("127.0.0.10:8001"), sa("[::1]:8002")] {
        let flag = source.replica_flag(addr);
        let r = kvlb::config::parse_replica_flag("--replica-dns", &flag)
            .unwrap_or_else(|e| panic!("{flag}: {e}"));
        assert_eq!(r.addr, addr);
        assert_eq!(r.kv_capacity_tokens, 100_000);
        assert_eq!(r.metrics, Some(true));
        let host = match addr {
            SocketAddr::V4(a) => a.ip().to_string(),
            SocketAddr::V6(a) => format!("[{}]", a.ip()),
        };
        assert_eq!(r.kv_events, Some(format!("tcp://{host}:5557")));
    }
    // One source per pool of a disaggregated fleet.
    let prefill = DnsSource::parse("dns://prefill.test:30000,role=prefill,bootstrap_port=8998")
        .unwrap()
        .replica_flag(sa("127.0.0.11:30000"));
    let r = kvlb::config::parse_replica_flag("--replica-dns", &prefill).unwrap();
    assert_eq!(
        (r.role, r.bootstrap_port),
        (kvlb::config::Role::Prefill, Some(8998))
    );
}

/// kvlb serving replicas found by SRV records, following the records as they change.
#[test]
fn kvlb_follows_the_fleet_dns_announces() {
    let (a, b) = (support::Backend::start(), support::Backend::start());
    let (pa, pb) = (a.addr.port(), b.addr.port());
    let server = DnsServer::start(Zone {
        records: vec![
            ("_http._tcp.fleet.test", Rec::Srv(pa, "pod-a.fleet.test")),
            ("pod-a.fleet.test", v4(1)),
        ],
        srv_additional: true,
        ..Zone::default()
    });
    let dns = server.addr.to_string();
    let kvlb = support::Kvlb::serve(&[
        "--replica-dns",
        "dns+srv://_http._tcp.fleet.test,interval=100ms",
        "--dns-server",
        &dns,
        "--policy",
        "round_robin",
        "--health-interval",
        "0",
        "--slow-start",
        "0",
    ]);
    let urls = || -> Vec<String> {
        let j = kvlb.admin_get("/replicas").json().unwrap();
        let mut v: Vec<String> = j["replicas"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|r| r["state"] == "active")
            .map(|r| r["url"].as_str().unwrap().to_string())
            .collect();
        v.sort();
        v
    };
    assert!(
        support::wait_until(Duration::from_secs(5), || urls() == vec![a.url()]),
        "{:?}\n{}",
        urls(),
        kvlb.stderr()
    );
    let mut conn = support::HttpConn::connect(kvlb.listen);
    let r = conn.request("GET", "/echo", &[], b"").unwrap();
    assert_eq!(r.status, 200, "{}", r.describe());
    assert_eq!(r.header("x-kvlb-replica"), Some(a.url().as_str()));

    // Scale up: b joins and takes its share.
    server.set(|z| {
        z.records
            .push(("_http._tcp.fleet.test", Rec::Srv(pb, "pod-a.fleet.test")))
    });
    let mut want = vec![a.url(), b.url()];
    want.sort();
    assert!(
        support::wait_until(Duration::from_secs(5), || urls() == want),
        "{:?}\n{}",
        urls(),
        kvlb.stderr()
    );
    let served: std::collections::BTreeSet<String> = (0..6)
        .map(|_| {
            let r = conn.request("GET", "/echo", &[], b"").unwrap();
            r.header("x-kvlb-replica").unwrap().to_string()
        })
        .collect();
    assert_eq!(served.len(), 2, "{served:?}");

    // Scale down: a leaves; b takes everything. A failing server keeps the last set.
    server.set(|z| {
        z.records
            .retain(|(_, r)| !matches!(r, Rec::Srv(p, _) if *p == pa))
    });
    assert!(
        support::wait_until(Duration::from_secs(5), || urls() == vec![b.url()]),
        "{:?}\n{}",
        urls(),
        kvlb.stderr()
    );
    server.set(|z| z.servfail = true);
    std::thread::sleep(Duration::from_millis(400));
    assert_eq!(urls(), vec![b.url()]);
    for _ in 0..4 {
        let r = conn.request("GET", "/echo", &[], b"").unwrap();
        assert_eq!(r.header("x-kvlb-replica"), Some(b.url().as_str()));
    }
}

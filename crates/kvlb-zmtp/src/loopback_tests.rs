//! The servers against the clients over loopback TCP. Interop with libzmq itself is proven in
//! tests/kv_events_interop.rs.

#![forbid(unsafe_code)]

use super::wire::{greeting, Connection};
use super::*;
use std::time::Instant;

const T: Duration = Duration::from_secs(5);

fn wait_subscribed(server: &PubServer, n: usize) {
    let deadline = Instant::now() + T;
    while server.subscribed_peers() < n {
        assert!(Instant::now() < deadline, "subscribers never arrived");
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn pub_sub_filters_by_prefix() {
    let server = PubServer::bind("tcp://127.0.0.1:0").unwrap();
    let endpoint = format!("tcp://{}", server.local_addr());
    let mut kv = SubClient::connect(&endpoint, T).unwrap();
    kv.subscribe(b"kv@").unwrap();
    let mut all = SubClient::connect(&endpoint, T).unwrap();
    all.subscribe(b"").unwrap();
    wait_subscribed(&server, 2);

    assert_eq!(server.send(&[b"other", b"1"]), 1);
    assert_eq!(server.send(&[b"kv@pod@model", b"2", b""]), 2);
    let got = kv.recv(T).unwrap().unwrap();
    assert_eq!(
        got,
        vec![b"kv@pod@model".to_vec(), b"2".to_vec(), Vec::new()]
    );
    assert_eq!(all.recv(T).unwrap().unwrap()[1], b"1");
    assert_eq!(all.recv(T).unwrap().unwrap()[1], b"2");
    assert_eq!(kv.recv(Duration::from_millis(50)).unwrap(), None);

    // Large frames use the LONG size form.
    let big = vec![0xABu8; 100_000];
    server.send(&[b"kv@x", &big]);
    assert_eq!(kv.recv(T).unwrap().unwrap()[1], big);

    kv.cancel(b"kv@").unwrap();
    let deadline = Instant::now() + T;
    while server.subscribed_peers() > 1 {
        assert!(Instant::now() < deadline);
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(server.send(&[b"kv@y", b"3"]), 1);
}

#[test]
fn zmtp30_subscription_messages_are_understood() {
    let server = PubServer::bind("tcp://127.0.0.1:0").unwrap();
    // A ZMTP 3.0 subscriber subscribes with a message: 0x01 then the prefix.
    let stream = TcpStream::connect(server.local_addr()).unwrap();
    let mut conn = Connection::handshake(stream, false, "SUB", &["PUB"], T).unwrap();
    conn.send(&[b"\x01ab"]).unwrap();
    wait_subscribed(&server, 1);
    server.send(&[b"abc", b"x"]);
    let deadline = Some(Instant::now() + T);
    assert_eq!(
        conn.read_incoming(deadline).unwrap(),
        Some(wire::Incoming::Message(vec![
            b"abc".to_vec(),
            b"x".to_vec()
        ]))
    );
    conn.send(&[b"\x00ab"]).unwrap();
    let deadline = Instant::now() + T;
    while server.subscribed_peers() > 0 {
        assert!(Instant::now() < deadline);
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn slow_subscriber_loses_messages_instead_of_blocking() {
    let server = PubServer::bind_with_queue("tcp://127.0.0.1:0", 4).unwrap();
    let endpoint = format!("tcp://{}", server.local_addr());
    let mut stalled = SubClient::connect(&endpoint, T).unwrap();
    stalled.subscribe(b"").unwrap();
    wait_subscribed(&server, 1);
    let payload = vec![1u8; 1 << 20];
    let started = Instant::now();
    for _ in 0..200 {
        server.send(&[b"t", &payload]);
    }
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "publisher blocked"
    );
    assert!(server.dropped_messages() > 0);
    // What did arrive is whole messages.
    let first = stalled.recv(T).unwrap().unwrap();
    assert_eq!(first[1].len(), payload.len());
}

#[test]
fn router_answers_dealer_on_same_connection() {
    let server = RouterServer::bind("tcp://127.0.0.1:0", |req: &[Vec<u8>]| {
        (0..3u8)
            .map(|i| {
                let mut m = req.to_vec();
                m.push(vec![i]);
                m
            })
            .collect()
    })
    .unwrap();
    let endpoint = format!("tcp://{}", server.local_addr());
    let mut a = DealerClient::connect(&endpoint, T).unwrap();
    let mut b = DealerClient::connect(&endpoint, T).unwrap();
    b.send(&[b"", b"from b"]).unwrap();
    a.send(&[b"", b"from a"]).unwrap();
    for i in 0..3u8 {
        assert_eq!(
            a.recv(T).unwrap().unwrap(),
            vec![Vec::new(), b"from a".to_vec(), vec![i]]
        );
        assert_eq!(b.recv(T).unwrap().unwrap()[1], b"from b");
    }
}

#[test]
fn wrong_peer_types_and_garbage_are_refused() {
    let server = RouterServer::bind("tcp://127.0.0.1:0", |_: &[Vec<u8>]| Vec::new()).unwrap();
    let endpoint = format!("tcp://{}", server.local_addr());
    // A SUB client cannot talk to a ROUTER.
    let err = SubClient::connect(&endpoint, T).err().unwrap().to_string();
    assert!(err.contains("ROUTER"), "{err}");
    // HTTP is not ZMTP.
    let mut s = TcpStream::connect(server.local_addr()).unwrap();
    use std::io::{Read, Write};
    s.write_all(b"GET /v1/models HTTP/1.1\r\nHost: replica.example\r\nAccept: */*;\r\n\r\n")
        .unwrap();
    let mut buf = Vec::new();
    s.set_read_timeout(Some(T)).unwrap();
    let _ = s.read_to_end(&mut buf);
    assert_eq!(
        &buf[..],
        &greeting(true)[..],
        "server must hang up after its greeting"
    );
    // A frame claiming an absurd size is an error, not an allocation.
    let pub_server = PubServer::bind("tcp://127.0.0.1:0").unwrap();
    let stream = TcpStream::connect(pub_server.local_addr()).unwrap();
    let mut conn = Connection::handshake(stream, false, "SUB", &["PUB"], T).unwrap();
    let mut evil = vec![0x02u8];
    evil.extend_from_slice(&u64::MAX.to_be_bytes());
    conn.write_raw(&evil).unwrap();
    let r = conn.read_incoming(Some(Instant::now() + T));
    assert!(r.is_err(), "{r:?}");
}

#[test]
fn random_bytes_after_handshake_never_panic() {
    use std::io::Write;
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let mut seed = 0x2545_F491_4F6C_DD1Du64;
    let mut next = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    for case in 0..200 {
        let len = (next() % 300) as usize;
        let mut garbage: Vec<u8> = (0..len).map(|_| next() as u8).collect();
        if case % 2 == 0 {
            // Mostly plausible flags, so frames and commands get parsed further.
            for b in garbage.iter_mut().step_by(7) {
                *b &= 0x07;
            }
        }
        let server = std::thread::spawn({
            let listener = listener.try_clone().unwrap();
            move || {
                let (mut s, _) = listener.accept().unwrap();
                let props = [&[11u8][..], b"Socket-Type", &[0, 0, 0, 3], b"PUB"].concat();
                let ready = wire::encode_command("READY", &props);
                let _ = s.write_all(&greeting(true));
                let _ = s.write_all(&ready);
                let _ = s.write_all(&garbage);
                // Half-close and drain, so the peer sees a clean end and not a reset.
                let _ = s.shutdown(std::net::Shutdown::Write);
                let _ = std::io::Read::read_to_end(&mut s, &mut Vec::new());
            }
        });
        let stream = TcpStream::connect(addr).unwrap();
        let mut conn = Connection::handshake(stream, false, "SUB", &["PUB"], T).unwrap();
        loop {
            match conn.read_incoming(Some(Instant::now() + Duration::from_secs(2))) {
                Ok(Some(_)) => continue,
                Ok(None) => panic!("case {case}: closed connection read as a timeout"),
                Err(_) => break,
            }
        }
        drop(conn);
        server.join().unwrap();
    }
}

#[test]
fn a_timeout_in_the_middle_of_a_frame_loses_nothing() {
    use std::io::Write;
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let message = wire::encode_message(&[b"kv@a", &7u64.to_be_bytes(), &[9u8; 1000]]);
    let (half_sent_tx, half_sent_rx) = std::sync::mpsc::channel();
    let (go_tx, go_rx) = std::sync::mpsc::channel::<()>();
    let server = std::thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        let props = [&[11u8][..], b"Socket-Type", &[0, 0, 0, 3], b"PUB"].concat();
        s.write_all(&greeting(true)).unwrap();
        s.write_all(&wire::encode_command("READY", &props)).unwrap();
        s.write_all(&message[..20]).unwrap();
        half_sent_tx.send(()).unwrap();
        go_rx.recv().unwrap();
        s.write_all(&message[20..]).unwrap();
        let _ = s.shutdown(std::net::Shutdown::Write);
        let _ = std::io::Read::read_to_end(&mut s, &mut Vec::new());
    });
    let mut sub = SubClient::connect(&format!("tcp://{addr}"), T).unwrap();
    half_sent_rx.recv().unwrap();
    assert_eq!(sub.recv(Duration::from_millis(100)).unwrap(), None);
    go_tx.send(()).unwrap();
    let got = sub.recv(T).unwrap().unwrap();
    assert_eq!(
        got,
        vec![
            b"kv@a".to_vec(),
            7u64.to_be_bytes().to_vec(),
            vec![9u8; 1000]
        ]
    );
    drop(sub);
    server.join().unwrap();
}

#[test]
fn messages_of_every_size_in_odd_chunks_arrive_whole_and_in_order() {
    use std::io::Write;
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    // Sizes around the receive's read-ahead (64 KiB) and far beyond it, with small ones in
    // between so that several messages share one receive and frames straddle its end.
    let sizes: Vec<usize> = vec![
        0,
        1,
        254,
        255,
        256,
        1000,
        65_535,
        65_536,
        65_537,
        3,
        200_000,
        7,
        131_072,
        64,
        1 << 20,
        5,
    ];
    let payload =
        |i: usize, n: usize| -> Vec<u8> { (0..n).map(|k| (k * 31 + i * 7) as u8).collect() };
    let mut stream = Vec::new();
    for (i, &n) in sizes.iter().enumerate() {
        stream.extend(wire::encode_message(&[
            b"kv@a",
            &(i as u64).to_be_bytes(),
            &payload(i, n),
        ]));
    }
    let server = std::thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        let props = [&[11u8][..], b"Socket-Type", &[0, 0, 0, 3], b"PUB"].concat();
        s.write_all(&greeting(true)).unwrap();
        s.write_all(&wire::encode_command("READY", &props)).unwrap();
        // Chunks of prime lengths, with pauses: the reader sees partial frames and timeouts.
        let mut at = 0;
        for (k, len) in [1usize, 7, 4093, 65_521, 13, 100_003]
            .iter()
            .cycle()
            .enumerate()
        {
            if at >= stream.len() {
                break;
            }
            let end = (at + len).min(stream.len());
            s.write_all(&stream[at..end]).unwrap();
            at = end;
            if k % 5 == 0 {
                std::thread::sleep(Duration::from_millis(2));
            }
        }
        let _ = s.shutdown(std::net::Shutdown::Write);
        let _ = std::io::Read::read_to_end(&mut s, &mut Vec::new());
    });
    let mut sub = SubClient::connect(&format!("tcp://{addr}"), T).unwrap();
    let mut got = 0;
    let deadline = Instant::now() + T;
    while got < sizes.len() {
        assert!(Instant::now() < deadline, "only {got} messages arrived");
        // Short timeouts: most calls end with part of a frame buffered.
        let Some(m) = sub.recv(Duration::from_millis(1)).unwrap() else {
            continue;
        };
        assert_eq!(m.len(), 3);
        assert_eq!(m[1], (got as u64).to_be_bytes().to_vec(), "message order");
        assert!(m[2] == payload(got, sizes[got]), "message {got} corrupted");
        got += 1;
        // Half the messages go back: their buffers, of every size, carry later ones.
        if got % 2 == 1 {
            sub.recycle(m);
        }
    }
    // Then the end of the stream is reported, not a timeout.
    let end = sub.recv(T);
    assert!(end.is_err(), "{end:?}");
    drop(sub);
    server.join().unwrap();
}

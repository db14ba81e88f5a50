//! The executor's multishot receives against real loopback TCP sockets: bytes arrive whole and
//! in order through provided buffers, also when kvlb throttles a receive that its task does not
//! keep up with, when the buffer ring runs dry, and across a deadline.

#![forbid(unsafe_code)]

use super::op::{self, MultiRecv};
use super::Runtime;
use std::io::Write;
use std::net::{TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::time::Duration;

/// A connected pair: (the std end we write to, the accepted end the ring reads).
fn pair() -> (TcpStream, TcpStream) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let a = TcpStream::connect(l.local_addr().unwrap()).unwrap();
    let (b, _) = l.accept().unwrap();
    (a, b)
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

/// Receive through `m` until `want` bytes have arrived.
async fn read_exactly(m: &mut MultiRecv, want: usize) -> Vec<u8> {
    let mut buf = Vec::new();
    while buf.len() < want {
        let n = op::recv_multi(m, &mut buf, Some(Duration::from_secs(5)))
            .await
            .expect("receive");
        assert!(n > 0, "end of stream after {} of {want} bytes", buf.len());
    }
    buf
}

#[test]
fn multishot_delivers_every_send_then_the_end() {
    let rt = Runtime::new(64).unwrap();
    let (mut tx, rx) = pair();
    rt.block_on(async move {
        let mut m = MultiRecv::new(rx.as_raw_fd());
        let mut want = Vec::new();
        for i in 0..20u8 {
            let chunk = pattern(100 + i as usize * 37, i);
            tx.write_all(&chunk).unwrap();
            want.extend_from_slice(&chunk);
            if i % 3 == 0 {
                op::sleep(Duration::from_millis(2)).await;
            }
        }
        let got = read_exactly(&mut m, want.len()).await;
        assert_eq!(got, want);
        assert!(m.quiet());
        drop(tx);
        let mut rest = Vec::new();
        let n = op::recv_multi(&mut m, &mut rest, Some(Duration::from_secs(5))).await;
        assert_eq!(n.unwrap(), 0, "end of stream");
        drop(rx);
    });
}

#[test]
fn a_receive_its_task_does_not_read_is_throttled_without_losing_bytes() {
    let rt = Runtime::new(64).unwrap();
    let (mut tx, rx) = pair();
    rt.block_on(async move {
        let mut m = MultiRecv::new(rx.as_raw_fd());
        assert!(m.arm());
        // Far more than MULTISHOT_QUEUE_MAX buffers' worth, written while nobody reads.
        let want = pattern(
            super::bufring::BUF_SIZE * (super::MULTISHOT_QUEUE_MAX + 8),
            7,
        );
        let writer = std::thread::spawn(move || {
            for c in want.chunks(4096) {
                tx.write_all(c).unwrap();
            }
            (tx, want)
        });
        for _ in 0..20 {
            op::sleep(Duration::from_millis(5)).await;
        }
        assert!(!m.quiet(), "bytes are waiting");
        let got = read_exactly(
            &mut m,
            super::bufring::BUF_SIZE * (super::MULTISHOT_QUEUE_MAX + 8),
        )
        .await;
        let (_tx, want) = writer.join().unwrap();
        assert_eq!(got, want, "every byte once, in order");
        assert!(super::multishot_stats().0 > 0, "the receive was throttled");
        drop(rx);
    });
}

#[test]
fn receives_carry_on_when_the_buffer_ring_runs_dry() {
    let rt = Runtime::new(1024).unwrap();
    // More sockets x queued buffers than the ring holds.
    let n = super::bufring::ENTRIES as usize / (super::MULTISHOT_QUEUE_MAX - 1) + 8;
    let pairs: Vec<(TcpStream, TcpStream)> = (0..n).map(|_| pair()).collect();
    rt.block_on(async move {
        let mut recvs: Vec<MultiRecv> = pairs
            .iter()
            .map(|(_, rx)| MultiRecv::new(rx.as_raw_fd()))
            .collect();
        for m in recvs.iter_mut() {
            assert!(m.arm());
        }
        let per = super::bufring::BUF_SIZE * (super::MULTISHOT_QUEUE_MAX - 1);
        let mut wants = Vec::new();
        for (i, (tx, _)) in pairs.iter().enumerate() {
            let want = pattern(per, i as u8);
            // Small writes: each becomes its own completion, one buffer each.
            for c in want.chunks(per / (super::MULTISHOT_QUEUE_MAX - 1)) {
                (&*tx).write_all(c).unwrap();
                op::sleep(Duration::from_micros(200)).await;
            }
            wants.push(want);
        }
        for (m, want) in recvs.iter_mut().zip(wants) {
            let got = read_exactly(m, want.len()).await;
            assert_eq!(got, want);
        }
        assert!(super::multishot_stats().1 > 0, "the ring ran dry");
        drop(pairs);
    });
}

#[test]
fn a_receive_past_its_deadline_times_out_and_the_socket_still_works() {
    let rt = Runtime::new(64).unwrap();
    let (mut tx, rx) = pair();
    rt.block_on(async move {
        let mut m = MultiRecv::new(rx.as_raw_fd());
        let mut buf = Vec::new();
        let r = op::recv_multi(&mut m, &mut buf, Some(Duration::from_millis(20))).await;
        assert_eq!(r.unwrap_err().kind(), std::io::ErrorKind::TimedOut);
        tx.write_all(b"after").unwrap();
        assert_eq!(read_exactly(&mut m, 5).await, b"after");
        drop(rx);
    });
}

//! The floor of `bench/proxy_bench.sh`: the least CPU a proxy pays per request on this machine
//! when it reads each request and each response once and writes each once, through io_uring
//! the way kvlb's workers do (single issuer, deferred task running, multishot receives into
//! provided buffers), and does nothing else: no HTTP, no routing, no copy. Each client
//! connection gets its own upstream connection, opened when the client connects, and bytes go
//! across unchanged (so a keep-alive HTTP/1.1 exchange works through it). Not a product: a
//! yardstick printed beside kvlb, nginx and HAProxy, so that kvlb's own cost per request reads
//! as "floor + what kvlb does".
//!
//! `relay_floor LISTEN_ADDR UPSTREAM_ADDR`, both `ip:port` on loopback; runs until killed.

use io_uring::types::{BufRingEntry, Fd};
use io_uring::{cqueue, opcode, IoUring};
use std::net::{TcpListener, TcpStream};
use std::os::fd::{AsRawFd, IntoRawFd, RawFd};

const GROUP: u16 = 0;
const BUF_SIZE: usize = 16 * 1024;
const ENTRIES: u16 = 1024;

const OP_ACCEPT: u64 = 1;
const OP_RECV: u64 = 2;
const OP_SEND: u64 = 3;

fn ud(op: u64, bid: u16, fd: RawFd) -> u64 {
    (op << 56) | ((bid as u64) << 32) | fd as u32 as u64
}

struct Buffers {
    ring: *mut BufRingEntry,
    mem: Vec<u8>,
    tail: u16,
}

impl Buffers {
    fn register(uring: &IoUring) -> Buffers {
        let len = ENTRIES as usize * std::mem::size_of::<BufRingEntry>();
        // Safety: anonymous mapping, checked; it lives as long as the process.
        let addr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert_ne!(addr, libc::MAP_FAILED, "mmap");
        let mut b = Buffers {
            ring: addr as *mut BufRingEntry,
            mem: vec![0u8; ENTRIES as usize * BUF_SIZE],
            tail: 0,
        };
        for bid in 0..ENTRIES {
            b.give(bid);
        }
        // Safety: the mapping stays for the life of the process.
        unsafe {
            uring
                .submitter()
                .register_buf_ring_with_flags(addr as u64, ENTRIES, GROUP, 0)
                .expect("provided buffer ring");
        }
        b
    }

    fn ptr(&mut self, bid: u16) -> *mut u8 {
        // Safety: bid < ENTRIES.
        unsafe { self.mem.as_mut_ptr().add(bid as usize * BUF_SIZE) }
    }

    fn give(&mut self, bid: u16) {
        let addr = self.ptr(bid) as u64;
        // Safety: the record index is below ENTRIES; the kernel reads records only below the
        // published tail.
        unsafe {
            let e = &mut *self.ring.add((self.tail & (ENTRIES - 1)) as usize);
            e.set_addr(addr);
            e.set_len(BUF_SIZE as u32);
            e.set_bid(bid);
            self.tail = self.tail.wrapping_add(1);
            let tail = BufRingEntry::tail(self.ring) as *const std::sync::atomic::AtomicU16;
            (*tail).store(self.tail, std::sync::atomic::Ordering::Release);
        }
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.len() != 3 {
        eprintln!("usage: relay_floor LISTEN_ADDR UPSTREAM_ADDR");
        std::process::exit(2);
    }
    let listener = TcpListener::bind(&args[1]).expect("bind");
    let upstream: std::net::SocketAddr = args[2].parse().expect("upstream address");
    let mut uring = IoUring::builder()
        .setup_single_issuer()
        .setup_defer_taskrun()
        .setup_submit_all()
        .build(4096)
        .expect("io_uring");
    let mut bufs = Buffers::register(&uring);
    // peer[fd] = the other socket of the pair (-1: none).
    let mut peer: Vec<RawFd> = vec![-1; 1 << 16];
    // sent[bid] = bytes of buffer bid already sent, len[bid] = bytes received into it.
    let mut sent = vec![0u32; ENTRIES as usize];
    let mut len = vec![0u32; ENTRIES as usize];
    let mut queue: Vec<io_uring::squeue::Entry> = Vec::with_capacity(256);

    let lfd = listener.as_raw_fd();
    queue.push(
        opcode::AcceptMulti::new(Fd(lfd))
            .build()
            .user_data(ud(OP_ACCEPT, 0, lfd)),
    );
    loop {
        {
            let mut sq = uring.submission();
            for e in queue.drain(..) {
                // Safety: every buffer an entry points at lives in `bufs` for the whole run.
                unsafe { sq.push(&e).expect("submission queue full") };
            }
        }
        match uring.submit_and_wait(1) {
            Ok(_) => {}
            Err(e) if e.raw_os_error() == Some(libc::EINTR) => continue,
            Err(e) => panic!("io_uring_enter: {e}"),
        }
        for cqe in uring.completion() {
            let data = cqe.user_data();
            let (op, bid, fd) = (data >> 56, (data >> 32) as u16, data as u32 as RawFd);
            let res = cqe.result();
            match op {
                OP_ACCEPT => {
                    if res >= 0 {
                        let client = res;
                        let up = TcpStream::connect(upstream).expect("connect upstream");
                        up.set_nodelay(true).unwrap();
                        let up = up.into_raw_fd();
                        let on: libc::c_int = 1;
                        // Safety: a valid socket and option value.
                        unsafe {
                            libc::setsockopt(
                                client,
                                libc::IPPROTO_TCP,
                                libc::TCP_NODELAY,
                                &on as *const _ as *const libc::c_void,
                                4,
                            );
                        }
                        peer[client as usize] = up;
                        peer[up as usize] = client;
                        for s in [client, up] {
                            queue.push(
                                opcode::RecvMulti::new(Fd(s), GROUP)
                                    .build()
                                    .user_data(ud(OP_RECV, 0, s)),
                            );
                        }
                    }
                    if !cqueue::more(cqe.flags()) {
                        queue.push(
                            opcode::AcceptMulti::new(Fd(lfd))
                                .build()
                                .user_data(ud(OP_ACCEPT, 0, lfd)),
                        );
                    }
                }
                OP_RECV => {
                    let to = peer[fd as usize];
                    if res > 0 && to >= 0 {
                        let b = cqueue::buffer_select(cqe.flags()).expect("buffer id");
                        sent[b as usize] = 0;
                        len[b as usize] = res as u32;
                        queue.push(
                            opcode::Send::new(Fd(to), bufs.ptr(b), res as u32)
                                .build()
                                .user_data(ud(OP_SEND, b, to)),
                        );
                        if !cqueue::more(cqe.flags()) {
                            queue.push(
                                opcode::RecvMulti::new(Fd(fd), GROUP)
                                    .build()
                                    .user_data(ud(OP_RECV, 0, fd)),
                            );
                        }
                    } else if res == -libc::ENOBUFS {
                        queue.push(
                            opcode::RecvMulti::new(Fd(fd), GROUP)
                                .build()
                                .user_data(ud(OP_RECV, 0, fd)),
                        );
                    } else if !cqueue::more(cqe.flags()) && to >= 0 {
                        // End of stream or error: close the pair (the peer's receive ends
                        // with an error and finds no peer).
                        peer[fd as usize] = -1;
                        peer[to as usize] = -1;
                        // Safety: both are sockets this relay owns.
                        unsafe {
                            libc::close(fd);
                            libc::close(to);
                        }
                    }
                }
                OP_SEND => {
                    let b = bid as usize;
                    if res > 0 && sent[b] + (res as u32) < len[b] {
                        sent[b] += res as u32;
                        let ptr = bufs.ptr(bid).wrapping_add(sent[b] as usize);
                        queue.push(
                            opcode::Send::new(Fd(fd), ptr, len[b] - sent[b])
                                .build()
                                .user_data(ud(OP_SEND, bid, fd)),
                        );
                    } else {
                        bufs.give(bid);
                    }
                }
                _ => {}
            }
        }
    }
}

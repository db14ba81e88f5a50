//! The sockmap relay of a joined L4 connection: kvlb puts the client and the replica socket in
//! the BPF maps of bpf/sockmap.bpf.c and from then on the kernel redirects every received
//! buffer to the other socket's send path; kvlb only watches for the ends.
//!
//! The program is compiled by build.rs and embedded; it is loaded (with aya) once per process,
//! the first time an L4 connection wants it. Where that fails (no clang at build time, no
//! privileges, no kernel support) kvlb says so in one line and L4 connections use splice.
//!
//! What the kernel does not do, this module does:
//! - Bytes queued on a socket before it entered the map are not redirected by themselves. The
//!   replica socket is gated (a receive low-water mark so high that the kernel does not signal
//!   arrivals) while the pair is inserted, then the low-water mark of both sockets is set back
//!   to 1, which makes the kernel run the program over whatever is queued, in order.
//! - FIN is not forwarded. kvlb watches each socket for end of file, waits until every byte the
//!   program redirected from it has reached the peer's send queue (the program counts them; the
//!   peer's TCP_INFO says what it has been given), then shuts the peer's write half down.
//! - The end of file can be seen before the last bytes were redirected: when data and FIN come
//!   in one segment, TCP marks the end (and wakes kvlb) before it hands the data to the
//!   program. So at end of file kvlb first waits for the kernel to finish with the socket (see
//!   `settle`), and only then reads the program's count; bytes the program did not take are
//!   received and sent on by kvlb, after the redirected ones.
//! - A socket already closing cannot be inserted: the connection then uses splice.

use super::{InFlight, Moved};
use crate::metrics::{families, DescriptorEncoder};
use crate::rt::op;
use crate::rt::select::{select, Either};
use crate::worker::Worker;
use aya::maps::{HashMap, MapData, SockHash};
use aya::programs::SkSkb;
use aya::Ebpf;
use std::io;
use std::os::fd::RawFd;
use std::pin::pin;
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

/// The program and its maps, as build.rs compiled them (empty when clang was missing).
static OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/sockmap.bpf.o"));

/// `struct kvlb_sock_key` of bpf/include/kvlb_maps.h: a socket named by its cookie.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SockKey {
    pub cookie: u64,
}

/// `struct kvlb_peer` of bpf/include/kvlb_maps.h.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Peer {
    pub peer: SockKey,
    pub redirected_bytes: u64,
    pub redirected_skbs: u32,
    pub _pad: u32,
}

// Safety: both are repr(C) structs of integers with no implicit padding (checked against the
// C layout by a test), so every bit pattern is a valid value and none is uninitialised.
unsafe impl aya::Pod for SockKey {}
// Safety: as above.
unsafe impl aya::Pod for Peer {}

struct Maps {
    socks: SockHash<MapData, SockKey>,
    peers: HashMap<MapData, SockKey, Peer>,
    /// Keeps the program loaded and attached to `socks`.
    _bpf: Ebpf,
}

/// The loaded program and its maps, shared by every worker (map updates are one bpf(2) call
/// each, made under the lock when a connection is joined or ends).
pub struct Sockmap {
    maps: Mutex<Maps>,
    program_id: u32,
}

static SOCKMAP: OnceLock<Option<Sockmap>> = OnceLock::new();

/// The sockmap program, loaded on first use; None (said once on stderr) where it cannot be.
pub fn get() -> Option<&'static Sockmap> {
    SOCKMAP
        .get_or_init(|| match load() {
            Ok(s) => {
                eprintln!(
                    "kvlb: l4: sockmap forwarding ready (BPF program id {})",
                    s.program_id
                );
                Some(s)
            }
            Err(e) => {
                eprintln!(
                    "kvlb: l4: sockmap forwarding unavailable ({e}); L4 connections use splice"
                );
                None
            }
        })
        .as_ref()
}

/// An error with its causes, for the one log line (aya keeps the errno in the source chain).
fn chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        let s = c.to_string();
        if !out.contains(&s) {
            out.push_str(": ");
            out.push_str(&s);
        }
        cause = c.source();
    }
    out
}

fn load() -> Result<Sockmap, String> {
    if OBJECT.is_empty() {
        return Err("the BPF program was not built: clang was missing at build time".into());
    }
    let mut bpf =
        Ebpf::load(OBJECT).map_err(|e| format!("cannot load the BPF object: {}", chain(&e)))?;
    let socks: SockHash<MapData, SockKey> = bpf
        .take_map("kvlb_socks")
        .ok_or("the BPF object has no kvlb_socks map")?
        .try_into()
        .map_err(|e| format!("kvlb_socks: {e}"))?;
    let peers: HashMap<MapData, SockKey, Peer> = bpf
        .take_map("kvlb_peers")
        .ok_or("the BPF object has no kvlb_peers map")?
        .try_into()
        .map_err(|e| format!("kvlb_peers: {e}"))?;
    let prog: &mut SkSkb = bpf
        .program_mut("kvlb_verdict")
        .ok_or("the BPF object has no kvlb_verdict program")?
        .try_into()
        .map_err(|e| format!("kvlb_verdict: {e}"))?;
    prog.load()
        .map_err(|e| format!("cannot load the stream verdict program: {}", chain(&e)))?;
    let program_id = prog.info().map(|i| i.id()).unwrap_or(0);
    let map_fd = socks
        .fd()
        .try_clone()
        .map_err(|e| format!("cannot duplicate the map descriptor: {e}"))?;
    prog.attach(&map_fd)
        .map_err(|e| format!("cannot attach the stream verdict program: {}", chain(&e)))?;
    Ok(Sockmap {
        maps: Mutex::new(Maps {
            socks,
            peers,
            _bpf: bpf,
        }),
        program_id,
    })
}

/// The sockmap families of /metrics: whether the program is loaded and how many sockets
/// the maps hold.
pub(super) fn encode_metrics(enc: &mut DescriptorEncoder<'_>) -> std::fmt::Result {
    let loaded = SOCKMAP.get().and_then(|s| s.as_ref());
    let (socks, peers) = match loaded {
        Some(s) => {
            let m = s.maps.lock().unwrap_or_else(|e| e.into_inner());
            (
                m.socks.keys().filter(|k| k.is_ok()).count(),
                m.peers.keys().filter(|k| k.is_ok()).count(),
            )
        }
        None => (0, 0),
    };
    let program_id = loaded.map(|s| s.program_id).unwrap_or(0).to_string();
    families::L4_SOCKMAP_LOADED
        .describe(enc)?
        .gauge(&[&program_id], loaded.is_some() as u64)?;
    families::L4_SOCKMAP_SOCKETS
        .describe(enc)?
        .gauge(&[], socks as u64)?;
    families::L4_SOCKMAP_PEERS
        .describe(enc)?
        .gauge(&[], peers as u64)
}

/// The kernel's cookie of a socket (what the program sees as bpf_get_socket_cookie).
fn cookie(fd: RawFd) -> io::Result<SockKey> {
    let mut v: u64 = 0;
    let mut len = std::mem::size_of::<u64>() as libc::socklen_t;
    // Safety: getsockopt(2) writes at most `len` bytes into the u64 we own.
    let r = unsafe {
        libc::getsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_COOKIE,
            &mut v as *mut u64 as *mut libc::c_void,
            &mut len,
        )
    };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(SockKey { cookie: v })
}

/// Set a socket's receive low-water mark. Setting it also makes TCP signal data already
/// queued (that is what runs the program over bytes that arrived before the join).
fn set_rcvlowat(fd: RawFd, bytes: libc::c_int) -> io::Result<()> {
    // Safety: setsockopt(2) with a pointer to a c_int and its size.
    let r = unsafe {
        libc::setsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_RCVLOWAT,
            &bytes as *const libc::c_int as *const libc::c_void,
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

/// Receive every byte queued on `fd` now (without waiting) into `buf`. Afterwards no buffer
/// of the socket's receive queue is partly read.
pub(crate) fn take_queued(fd: RawFd, buf: &mut Vec<u8>) {
    loop {
        let mut queued: libc::c_int = 0;
        // Safety: FIONREAD writes one c_int into the variable we own.
        if unsafe { libc::ioctl(fd, libc::FIONREAD, &mut queued) } < 0 || queued <= 0 {
            return;
        }
        let want = queued as usize;
        buf.reserve(want);
        let len = buf.len();
        // Safety: recv(2) writes at most `want` bytes into the spare capacity reserved above;
        // the length is extended by what it reports.
        let r = unsafe {
            libc::recv(
                fd,
                buf.as_mut_ptr().add(len) as *mut libc::c_void,
                want,
                libc::MSG_DONTWAIT,
            )
        };
        if r <= 0 {
            return;
        }
        // Safety: the kernel initialised `r` bytes after `len`.
        unsafe { buf.set_len(len + r as usize) };
    }
}

/// Called once the end of file of `fd` was seen: returns when the kernel has finished the
/// segment that carried the FIN, so the program has been run over every byte before it and its
/// count is final; bytes still queued (the program did not take them) are received into `rest`.
///
/// TCP sets the end of file and wakes its waiters from within the processing of the FIN
/// segment, before it passes that segment's data to the socket's data-ready callback (the
/// program). That processing holds the socket lock throughout, and SIOCINQ (the first step of
/// `take_queued`) takes the lock, so it cannot return before the program has seen those bytes.
fn settle(fd: RawFd, rest: &mut Vec<u8>) {
    take_queued(fd, rest);
}

/// Send `rest` (what `settle` received) to `to`. Err: `to` failed.
async fn send_rest(to: RawFd, rest: Vec<u8>) -> io::Result<u64> {
    let n = rest.len();
    if n == 0 {
        return Ok(0);
    }
    op::send_all(to, rest, 0, n).await.0.map(|()| n as u64)
}

/// Bytes the socket has been given to send (by kvlb or by the program): what it transmitted
/// once plus what waits in its queue. Exact for data: SYN and FIN are not counted.
fn bytes_written(fd: RawFd) -> io::Result<u64> {
    // struct tcp_info up to tcpi_bytes_retrans (linux/tcp.h, offsets stable since 4.19).
    let mut info = [0u8; 232];
    let mut len = info.len() as libc::socklen_t;
    // Safety: getsockopt(2) writes at most `len` bytes into the array we own.
    let r = unsafe {
        libc::getsockopt(
            fd,
            libc::IPPROTO_TCP,
            libc::TCP_INFO,
            info.as_mut_ptr() as *mut libc::c_void,
            &mut len,
        )
    };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    if (len as usize) < 216 {
        return Err(io::Error::other("TCP_INFO too short (kernel before 4.19)"));
    }
    let u32_at = |o: usize| u32::from_ne_bytes(info[o..o + 4].try_into().unwrap()) as u64;
    let u64_at = |o: usize| u64::from_ne_bytes(info[o..o + 8].try_into().unwrap());
    let notsent = u32_at(144);
    let sent = u64_at(200);
    let retrans = u64_at(208);
    Ok(sent.saturating_sub(retrans) + notsent)
}

impl Sockmap {
    /// Put the pair in the maps; on failure nothing is left in them.
    fn join(&self, cfd: RawFd, ck: SockKey, rfd: RawFd, rk: SockKey) -> Result<(), String> {
        let mut m = self.maps.lock().unwrap_or_else(|e| e.into_inner());
        let entry = |peer| Peer {
            peer,
            ..Peer::default()
        };
        let r = (|| {
            m.peers
                .insert(ck, entry(rk), 0)
                .map_err(|e| format!("peers: {e}"))?;
            m.peers
                .insert(rk, entry(ck), 0)
                .map_err(|e| format!("peers: {e}"))?;
            m.socks
                .insert(rk, rfd, 0)
                .map_err(|e| format!("replica socket: {e}"))?;
            m.socks
                .insert(ck, cfd, 0)
                .map_err(|e| format!("client socket: {e}"))
        })();
        if r.is_err() {
            let _ = m.socks.remove(&ck);
            let _ = m.socks.remove(&rk);
            let _ = m.peers.remove(&ck);
            let _ = m.peers.remove(&rk);
        }
        r
    }

    /// Bytes the program redirected from the socket `k` so far.
    fn redirected(&self, k: SockKey) -> u64 {
        let m = self.maps.lock().unwrap_or_else(|e| e.into_inner());
        m.peers.get(&k, 0).map(|p| p.redirected_bytes).unwrap_or(0)
    }

    /// Take the pair out of the maps; returns the bytes redirected (from client, from replica).
    fn leave(&self, ck: SockKey, rk: SockKey) -> (u64, u64) {
        let mut m = self.maps.lock().unwrap_or_else(|e| e.into_inner());
        let up = m.peers.get(&ck, 0).map(|p| p.redirected_bytes).unwrap_or(0);
        let down = m.peers.get(&rk, 0).map(|p| p.redirected_bytes).unwrap_or(0);
        let _ = m.socks.remove(&ck);
        let _ = m.socks.remove(&rk);
        let _ = m.peers.remove(&ck);
        let _ = m.peers.remove(&rk);
        (up, down)
    }
}

const HUP: u32 = libc::POLLHUP as u32;
const RDHUP: u32 = libc::POLLRDHUP as u32;
const ERR: u32 = libc::POLLERR as u32;

/// Whether a socket was reset or closed under kvlb (TCP_CLOSE or a pending error).
fn failed(fd: RawFd) -> bool {
    let mut err: libc::c_int = 0;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // Safety: getsockopt(2) writes at most `len` bytes into the c_int we own.
    let r = unsafe {
        libc::getsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_ERROR,
            &mut err as *mut libc::c_int as *mut libc::c_void,
            &mut len,
        )
    };
    if r < 0 || err != 0 {
        return true;
    }
    let mut info = [0u8; 8];
    let mut len = info.len() as libc::socklen_t;
    // Safety: as above, the first bytes of struct tcp_info (tcpi_state is the first).
    let r = unsafe {
        libc::getsockopt(
            fd,
            libc::IPPROTO_TCP,
            libc::TCP_INFO,
            info.as_mut_ptr() as *mut libc::c_void,
            &mut len,
        )
    };
    const TCP_CLOSE: u8 = 7;
    r < 0 || info[0] == TCP_CLOSE
}

/// Wait for the next event of one socket: its end of file or failure (poll bits) while it is
/// open, only its failure (ERR) once its end of file was seen (poll would report that end
/// again at once, so the socket is checked every 50 ms instead).
async fn watch(fd: RawFd, eof_seen: bool) -> u32 {
    if !eof_seen {
        return op::poll(fd, RDHUP).await.unwrap_or(ERR);
    }
    loop {
        op::sleep(Duration::from_millis(50)).await;
        if failed(fd) {
            return ERR;
        }
    }
}
/// How long to wait for redirected bytes to reach the peer with no progress, before passing
/// the FIN on regardless.
const FLUSH_STALL: Duration = Duration::from_secs(5);

/// Wait until `to` has been given `expected` bytes (or stops making progress).
async fn flushed(to: RawFd, expected: impl Fn() -> u64) {
    let mut last = 0;
    let mut since = Instant::now();
    let mut pause = Duration::from_micros(200);
    loop {
        let Ok(now) = bytes_written(to) else { return };
        if now >= expected() {
            return;
        }
        if now != last {
            last = now;
            since = Instant::now();
        } else if since.elapsed() > FLUSH_STALL {
            return;
        }
        op::sleep(pause).await;
        pause = (pause * 2).min(Duration::from_millis(10));
    }
}

/// Join client `cfd` and replica `rfd` (which has been sent `prelude` bytes) in the sockmap and
/// watch them until both directions ended or one failed. Err: the pair could not be joined
/// (nothing changed; the caller relays with splice). The caller closes both sockets.
pub(crate) async fn relay(
    _w: &Worker,
    cfd: RawFd,
    rfd: RawFd,
    prelude: u64,
    in_flight: &mut InFlight<'_>,
) -> Result<Moved, ()> {
    let sm = get().ok_or(())?;
    let (ck, rk) = match (cookie(cfd), cookie(rfd)) {
        (Ok(c), Ok(r)) => (c, r),
        _ => return Err(()),
    };
    // Gate the replica socket while the pair goes in: bytes arriving before the client socket
    // is in the map stay queued instead of meeting a program with nowhere to send them.
    let _ = set_rcvlowat(rfd, libc::c_int::MAX);
    if sm.join(cfd, ck, rfd, rk).is_err() {
        let _ = set_rcvlowat(rfd, 1);
        return Err(());
    }
    super::STATS.joined[1].fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    // Open the gate and flush both queues through the program.
    let _ = set_rcvlowat(rfd, 1);
    let _ = set_rcvlowat(cfd, 1);

    let (mut c_eof, mut r_eof) = (false, false);
    let mut aborted = None;
    // Bytes kvlb sent itself at an end of file (see `settle`): client -> replica, back.
    let (mut rest_up, mut rest_down) = (0u64, 0u64);
    while !(c_eof && r_eof) {
        let watch_c = pin!(watch(cfd, c_eof));
        let watch_r = pin!(watch(rfd, r_eof));
        // Until the replica's first byte, look at the program's count now and then.
        let tick = pin!(op::sleep(if in_flight.decoding() {
            Duration::from_secs(3600)
        } else {
            Duration::from_millis(20)
        }));
        match select(select(watch_c, watch_r), tick).await {
            Either::Left(Either::Left(bits)) => {
                // An error, or a full close before kvlb shut this socket's write half: abort.
                if bits & ERR != 0 || (bits & HUP != 0 && !r_eof) {
                    aborted = Some(true);
                    break;
                }
                c_eof = true;
                let mut rest = Vec::new();
                settle(cfd, &mut rest);
                flushed(rfd, || prelude + sm.redirected(ck)).await;
                match send_rest(rfd, rest).await {
                    Ok(n) => rest_up += n,
                    Err(_) => {
                        aborted = Some(false);
                        break;
                    }
                }
                super::shutdown(rfd, libc::SHUT_WR);
            }
            Either::Left(Either::Right(bits)) => {
                if bits & ERR != 0 || (bits & HUP != 0 && !c_eof) {
                    aborted = Some(false);
                    break;
                }
                r_eof = true;
                let mut rest = Vec::new();
                settle(rfd, &mut rest);
                flushed(cfd, || sm.redirected(rk)).await;
                match send_rest(cfd, rest).await {
                    Ok(n) => rest_down += n,
                    Err(_) => {
                        aborted = Some(true);
                        break;
                    }
                }
                super::shutdown(cfd, libc::SHUT_WR);
            }
            Either::Right(()) => {}
        }
        if !in_flight.decoding() && sm.redirected(rk) > 0 {
            in_flight.first_byte();
        }
    }
    let (up, down) = sm.leave(ck, rk);
    let (up, down) = (up + rest_up, down + rest_down);
    if down > 0 {
        in_flight.first_byte();
    }
    if aborted.is_some() {
        super::shutdown(cfd, libc::SHUT_RDWR);
        super::shutdown(rfd, libc::SHUT_RDWR);
    }
    Ok(Moved {
        up,
        down,
        aborted: aborted.is_some(),
        client_aborted: aborted == Some(true),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The Rust structs against the C header, as the host C compiler lays it out (the BPF
    /// target has the same sizes and alignments for these types; the program's own
    /// _Static_asserts pin the sizes on that side).
    #[test]
    fn rust_and_c_layouts_agree() {
        let dir = std::env::temp_dir().join(format!("kvlb-layout-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let src = dir.join("layout.c");
        let exe = dir.join("layout");
        let include = concat!(env!("CARGO_MANIFEST_DIR"), "/bpf/include");
        std::fs::write(
            &src,
            "#include <stdio.h>\n#include <stddef.h>\n#include \"kvlb_maps.h\"\n\
             int main(void) {\n\
             printf(\"key.size=%zu\\n\", sizeof(struct kvlb_sock_key));\n\
             printf(\"key.cookie=%zu\\n\", offsetof(struct kvlb_sock_key, cookie));\n\
             printf(\"peer.size=%zu\\n\", sizeof(struct kvlb_peer));\n\
             printf(\"peer.align=%zu\\n\", _Alignof(struct kvlb_peer));\n\
             printf(\"peer.peer=%zu\\n\", offsetof(struct kvlb_peer, peer));\n\
             printf(\"peer.redirected_bytes=%zu\\n\", offsetof(struct kvlb_peer, redirected_bytes));\n\
             printf(\"peer.redirected_skbs=%zu\\n\", offsetof(struct kvlb_peer, redirected_skbs));\n\
             printf(\"peer._pad=%zu\\n\", offsetof(struct kvlb_peer, _pad));\n\
             printf(\"max_sockets=%d\\n\", KVLB_MAX_SOCKETS);\n\
             return 0; }\n",
        )
        .unwrap();
        let compiler = ["clang", "cc", "gcc"]
            .into_iter()
            .find(|c| {
                std::process::Command::new(c)
                    .arg("--version")
                    .output()
                    .is_ok()
            })
            .expect("a C compiler (clang, cc or gcc) to check the map layouts");
        let out = std::process::Command::new(compiler)
            .arg(format!("-I{include}"))
            .arg(&src)
            .arg("-o")
            .arg(&exe)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{compiler} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let out = std::process::Command::new(&exe).output().unwrap();
        let _ = std::fs::remove_dir_all(&dir);
        let text = String::from_utf8(out.stdout).unwrap();
        let c: std::collections::HashMap<&str, usize> = text
            .lines()
            .filter_map(|l| l.split_once('='))
            .map(|(k, v)| (k, v.parse().unwrap()))
            .collect();
        use std::mem::{align_of, offset_of, size_of};
        let rust = [
            ("key.size", size_of::<SockKey>()),
            ("key.cookie", offset_of!(SockKey, cookie)),
            ("peer.size", size_of::<Peer>()),
            ("peer.align", align_of::<Peer>()),
            ("peer.peer", offset_of!(Peer, peer)),
            ("peer.redirected_bytes", offset_of!(Peer, redirected_bytes)),
            ("peer.redirected_skbs", offset_of!(Peer, redirected_skbs)),
            ("peer._pad", offset_of!(Peer, _pad)),
        ];
        for (name, value) in rust {
            assert_eq!(
                c.get(name),
                Some(&value),
                "{name}: C says {:?}, Rust {value}",
                c.get(name)
            );
        }
        // No implicit padding on the Rust side either: the fields fill the struct.
        assert_eq!(size_of::<Peer>(), 8 + 8 + 4 + 4);
        assert_eq!(c["max_sockets"], 65536);
    }

    #[test]
    fn the_program_was_built() {
        // build.rs compiles it whenever clang is there (it is in this project's test setup).
        if std::process::Command::new("clang")
            .arg("--version")
            .output()
            .is_ok()
        {
            assert!(
                !OBJECT.is_empty(),
                "clang is installed but the BPF object is empty"
            );
            assert_eq!(&OBJECT[..4], b"\x7fELF");
        }
    }
}

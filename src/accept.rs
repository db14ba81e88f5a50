//! A worker thread's life: its io_uring runtime, its `Worker` state, an accept loop per
//! listener handing each connection to the L7 proxy (`proxy::serve_connection`) or to L4
//! forwarding (`l4::serve_connection`), its housekeeping tick, and the drain at shutdown.
//!
//! It sits above `worker`, `proxy` and `l4`, which know nothing of it: the state a connection
//! works with (`worker`) does not depend on the code that serves connections.

#![forbid(unsafe_code)]

use crate::rt::{self, op};
use crate::worker::{Shared, Worker};
use std::os::fd::RawFd;
use std::rc::Rc;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Run worker `id` on the current thread until drained. `listeners` are this worker's own
/// SO_REUSEPORT sockets; `wake_fd` is an eventfd the main thread writes on shutdown.
pub fn run(id: usize, shared: Arc<Shared>, listeners: Vec<RawFd>, wake_fd: RawFd) {
    let rt = match rt::Runtime::new(4096) {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("kvlb: worker {id}: cannot create io_uring: {e}");
            std::process::exit(1);
        }
    };
    let worker = match Worker::new(id, shared) {
        Ok(w) => w,
        Err(e) => {
            eprintln!("kvlb: worker {id}: {e}");
            std::process::exit(2);
        }
    };
    let w = worker.clone();
    let fds = listeners.clone();
    rt.block_on(async move {
        let listeners = fds;
        for (i, &l) in listeners.iter().enumerate() {
            let l4 = w.cfg().listener_mode(i) == crate::config::ListenerMode::L4;
            if l4 {
                // Load the sockmap program (or say why not) before the first connection.
                crate::l4::effective_forwarding(w.cfg().l4_forwarding);
            }
            rt::spawn(accept_loop(w.clone(), l, l4));
        }
        rt::spawn(every_second(w.clone()));
        // Wait for the shutdown signal.
        let _ = op::read_eventfd(wake_fd).await;
        w.draining.set(true);
        for &l in &listeners {
            op::shutdown_listener(l);
        }
        w.wake_idle_clients();
        let deadline = Instant::now() + w.cfg().timeouts.drain;
        while w.open.get() > 0 && Instant::now() < deadline {
            op::sleep(Duration::from_millis(20)).await;
            w.wake_idle_clients();
        }
    });
    worker.close();
    for l in listeners {
        op::close(l);
    }
}

/// The worker's housekeeping (`Worker::housekeeping`), every `access_log::FLUSH_EVERY`.
async fn every_second(w: Rc<Worker>) {
    loop {
        op::sleep(crate::access_log::FLUSH_EVERY).await;
        w.housekeeping();
    }
}

async fn accept_loop(w: Rc<Worker>, listener: RawFd, l4: bool) {
    let mut addr = op::AddrBuf::new();
    loop {
        let (res, a) = op::accept(listener, addr).await;
        addr = a;
        match res {
            Ok(fd) => {
                if w.draining.get() {
                    op::close(fd);
                    return;
                }
                let stats = w.stats();
                crate::metrics::add(&stats.accepted, 1);
                if w.open.get() >= w.cfg().limits.max_connections {
                    rt::spawn(crate::proxy::refuse(w.clone(), fd));
                    continue;
                }
                op::set_nodelay(fd);
                let peer = addr.to_socket_addr();
                if l4 {
                    rt::spawn(crate::l4::serve_connection(w.clone(), fd, peer));
                } else {
                    rt::spawn(crate::proxy::serve_connection(w.clone(), fd, peer));
                }
            }
            Err(e) => {
                if w.draining.get() {
                    return;
                }
                match e.raw_os_error() {
                    Some(libc::EMFILE) | Some(libc::ENFILE) | Some(libc::ENOBUFS)
                    | Some(libc::ENOMEM) => {
                        // Out of descriptors: back off instead of spinning.
                        op::sleep(Duration::from_millis(50)).await;
                    }
                    _ => {}
                }
            }
        }
    }
}

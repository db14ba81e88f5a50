//! A single-threaded io_uring executor: one per worker thread, owning its ring.
//!
//! Tasks are `!Send` futures polled on the thread that spawned them; per-worker state lives in
//! `Rc`/`Cell`, never behind a lock. Every I/O operation (see `op`) is a future that owns its
//! buffers while the kernel may touch them: dropping a pending operation moves those buffers into
//! its slot and submits an async cancel, so memory is never freed under the kernel's feet.
//!
//! Why the io-uring crate rather than tokio-uring: tokio-uring (last release 0.5.0, 2024) drives
//! its ring from an epoll loop inside a tokio runtime and offers no splice, multishot or
//! registered resources; this executor is a few hundred lines and submits and reaps in one
//! `io_uring_enter` per loop turn.
//!
//! Deadlines of operations live in a user-space timing wheel (`deadline`), not in kernel linked
//! timeouts: arming one is a few stores, and only one that expires costs a submission (an async
//! cancel of its operation). The loop's `io_uring_enter` waits no longer than the next deadline.

mod bufring;
mod deadline;
pub mod op;
pub mod select;
pub mod splice;

use io_uring::{cqueue, opcode, squeue, IoUring};
use std::any::Any;
use std::cell::{Cell, RefCell};
use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::rc::Rc;
use std::task::{Context, Poll, RawWaker, RawWakerVTable, Waker};

/// user_data of completions nobody waits for (async cancels).
const IGNORED: u64 = u64::MAX;

/// Opcodes the data plane submits; checked at start-up.
pub const REQUIRED_OPCODES: &[(u8, &str)] = &[
    (opcode::Accept::CODE, "IORING_OP_ACCEPT"),
    (opcode::Connect::CODE, "IORING_OP_CONNECT"),
    (opcode::Recv::CODE, "IORING_OP_RECV"),
    (opcode::Send::CODE, "IORING_OP_SEND"),
    (opcode::Read::CODE, "IORING_OP_READ"),
    (opcode::PollAdd::CODE, "IORING_OP_POLL_ADD"),
    (opcode::Timeout::CODE, "IORING_OP_TIMEOUT"),
    (opcode::AsyncCancel::CODE, "IORING_OP_ASYNC_CANCEL"),
];

/// Check that this kernel's io_uring supports every opcode the data plane uses.
/// The error names what is missing.
pub fn probe_kernel() -> Result<(), String> {
    let ring = IoUring::new(4).map_err(|e| {
        format!(
            "io_uring is not available ({e}); kvlb needs Linux 5.19 or later with io_uring enabled \
             (check /proc/sys/kernel/io_uring_disabled and seccomp filters)"
        )
    })?;
    let mut probe = io_uring::Probe::new();
    ring.submitter()
        .register_probe(&mut probe)
        .map_err(|e| format!("io_uring probe failed: {e}"))?;
    let missing: Vec<&str> = REQUIRED_OPCODES
        .iter()
        .filter(|(code, _)| !probe.is_supported(*code))
        .map(|(_, name)| *name)
        .collect();
    if missing.is_empty() {
        Ok(())
    } else {
        Err(format!(
            "this kernel's io_uring lacks {}; kvlb needs Linux 5.19 or later",
            missing.join(", ")
        ))
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SlotState {
    Free,
    /// Submitted, a future waits for it.
    Pending,
    /// Completed, result not yet taken by its future.
    Done,
    /// Its future was dropped; the slot keeps the buffers until the kernel lets go.
    Abandoned,
}

/// The kernel-facing half of one operation. Boxed individually so its address is stable:
/// the timespec of a standalone timeout lives here until the kernel has read it.
struct Slot {
    state: SlotState,
    waker: Option<Waker>,
    result: i32,
    flags: u32,
    keep: Option<Box<dyn Any>>,
    timespec: io_uring::types::Timespec,
    /// A multishot operation: its completions queue here (`queue`) until its future takes
    /// them; it holds the slot until a completion without `IORING_CQE_F_MORE`.
    multishot: bool,
    queue: VecDeque<(i32, u32)>,
    /// The last completion (no `F_MORE`) is in `queue`.
    ended: bool,
    /// kvlb cancelled it because its future was not keeping up (see
    /// [`MULTISHOT_QUEUE_MAX`]); its data waits in the socket.
    throttled: bool,
}

/// Completions a multishot receive may have waiting for its task before kvlb cancels it: each
/// holds a provided buffer, and a task that is not reading (its peer is slow to take what it
/// sends) must leave the rest in the socket, where TCP flow control applies, instead of
/// draining the shared buffer ring.
pub const MULTISHOT_QUEUE_MAX: usize = 4;

impl Slot {
    /// Back to free after a multishot operation (the queue keeps its capacity).
    fn reset(&mut self) {
        self.state = SlotState::Free;
        self.waker = None;
        self.keep = None;
        self.multishot = false;
        self.queue.clear();
        self.ended = false;
        self.throttled = false;
    }
}

type Task = Pin<Box<dyn Future<Output = ()>>>;

struct TaskEntry {
    future: Option<Task>,
    scheduled: bool,
}

pub(crate) struct Inner {
    ring: RefCell<IoUring>,
    /// Provided buffers for multishot receives (None where the kernel has no buffer rings).
    /// After `ring`: dropped once the ring, and the kernel's use of it, is gone.
    bufs: Option<bufring::BufRing>,
    /// Multishot slots to cancel, gathered while completions are reaped.
    throttle: RefCell<Vec<u32>>,
    /// Multishot receives throttled, and stopped for want of a provided buffer.
    throttled: Cell<u64>,
    buffer_shortages: Cell<u64>,
    /// Boxed one by one: a slot's address must not move while the kernel may read it.
    #[allow(clippy::vec_box)]
    slots: RefCell<Vec<Box<Slot>>>,
    free_slots: RefCell<Vec<u32>>,
    tasks: RefCell<Vec<TaskEntry>>,
    free_tasks: RefCell<Vec<usize>>,
    run_queue: RefCell<VecDeque<usize>>,
    live_tasks: Cell<usize>,
    /// Deadlines of pending operations (by slot), in ms since `epoch`.
    deadlines: RefCell<deadline::Wheel>,
    fired: RefCell<Vec<u32>>,
    epoch: std::time::Instant,
    /// The loop's clock, read once before and once after each wait for completions: every
    /// deadline and latency stamp of one turn shares it (as nginx's cached time does), so a
    /// request costs no clock reads. Its error is at most one turn's work.
    now: Cell<std::time::Instant>,
}

thread_local! {
    static CURRENT: RefCell<Option<Rc<Inner>>> = const { RefCell::new(None) };
}

fn with_current<R>(f: impl FnOnce(&Rc<Inner>) -> R) -> R {
    CURRENT.with(|c| {
        let c = c.borrow();
        let inner = c
            .as_ref()
            .expect("io_uring runtime not running on this thread");
        f(inner)
    })
}

/// A worker's executor.
pub struct Runtime {
    inner: Rc<Inner>,
}

impl Runtime {
    /// A ring with `entries` submission slots. Single-issuer and deferred task running are
    /// requested where the kernel has them: only this thread submits, and completions are
    /// processed when it asks for them, not in interrupt context.
    pub fn new(entries: u32) -> std::io::Result<Runtime> {
        let ring = IoUring::builder()
            .setup_single_issuer()
            .setup_defer_taskrun()
            .setup_submit_all()
            .build(entries)
            .or_else(|_| IoUring::builder().setup_submit_all().build(entries))
            .or_else(|_| IoUring::new(entries))?;
        let bufs = bufring::BufRing::register(&ring).ok();
        Ok(Runtime {
            inner: Rc::new(Inner {
                ring: RefCell::new(ring),
                bufs,
                throttle: RefCell::new(Vec::with_capacity(64)),
                throttled: Cell::new(0),
                buffer_shortages: Cell::new(0),
                slots: RefCell::new(Vec::new()),
                free_slots: RefCell::new(Vec::new()),
                tasks: RefCell::new(Vec::new()),
                free_tasks: RefCell::new(Vec::new()),
                run_queue: RefCell::new(VecDeque::with_capacity(1024)),
                live_tasks: Cell::new(0),
                deadlines: RefCell::new(deadline::Wheel::new(0)),
                fired: RefCell::new(Vec::new()),
                epoch: std::time::Instant::now(),
                now: Cell::new(std::time::Instant::now()),
            }),
        })
    }

    /// Run `main` and every task it spawns until `main` returns. Tasks still alive then are
    /// dropped (their pending operations cancelled).
    pub fn block_on<F: Future<Output = ()> + 'static>(&self, main: F) {
        CURRENT.with(|c| *c.borrow_mut() = Some(self.inner.clone()));
        let done = Rc::new(Cell::new(false));
        let flag = done.clone();
        spawn(async move {
            main.await;
            flag.set(true);
        });
        loop {
            self.inner.run_ready();
            if done.get() {
                break;
            }
            self.inner.submit_and_wait();
            self.inner.now.set(std::time::Instant::now());
            self.inner.reap();
            self.inner.expire_deadlines();
        }
        // Drop remaining tasks while the runtime is still current (their drops cancel ops).
        let leftovers: Vec<Task> = self
            .inner
            .tasks
            .borrow_mut()
            .iter_mut()
            .filter_map(|t| t.future.take())
            .collect();
        drop(leftovers);
        let _ = self.inner.ring.borrow_mut().submit();
        CURRENT.with(|c| *c.borrow_mut() = None);
    }
}

/// The worker loop's clock: the time its current turn began (read once per wait for
/// completions, not per call). Off a worker thread, the real time.
pub fn now() -> std::time::Instant {
    CURRENT.with(|c| match c.borrow().as_ref() {
        Some(inner) => inner.now.get(),
        None => std::time::Instant::now(),
    })
}

/// Spawn a task on the current worker.
pub fn spawn<F: Future<Output = ()> + 'static>(f: F) {
    with_current(|inner| {
        let id = match inner.free_tasks.borrow_mut().pop() {
            Some(id) => id,
            None => {
                let mut tasks = inner.tasks.borrow_mut();
                tasks.push(TaskEntry {
                    future: None,
                    scheduled: false,
                });
                tasks.len() - 1
            }
        };
        {
            let mut tasks = inner.tasks.borrow_mut();
            tasks[id].future = Some(Box::pin(f));
            tasks[id].scheduled = true;
        }
        inner.live_tasks.set(inner.live_tasks.get() + 1);
        inner.run_queue.borrow_mut().push_back(id);
    })
}

/// Number of tasks alive on this worker.
pub fn live_tasks() -> usize {
    with_current(|inner| inner.live_tasks.get())
}

/// Yield to the other ready tasks once.
pub async fn yield_now() {
    let mut yielded = false;
    std::future::poll_fn(move |cx| {
        if yielded {
            Poll::Ready(())
        } else {
            yielded = true;
            cx.waker().wake_by_ref();
            Poll::Pending
        }
    })
    .await
}

impl Inner {
    fn run_ready(self: &Rc<Self>) {
        loop {
            let id = match self.run_queue.borrow_mut().pop_front() {
                Some(id) => id,
                None => return,
            };
            let fut = {
                let mut tasks = self.tasks.borrow_mut();
                let entry = &mut tasks[id];
                entry.scheduled = false;
                entry.future.take()
            };
            let Some(mut fut) = fut else { continue };
            let waker = task_waker(id);
            let mut cx = Context::from_waker(&waker);
            match fut.as_mut().poll(&mut cx) {
                Poll::Ready(()) => {
                    drop(fut);
                    self.free_tasks.borrow_mut().push(id);
                    self.live_tasks.set(self.live_tasks.get() - 1);
                }
                Poll::Pending => {
                    self.tasks.borrow_mut()[id].future = Some(fut);
                }
            }
        }
    }

    fn now_ms(&self) -> u64 {
        self.now.get().duration_since(self.epoch).as_millis() as u64
    }

    /// Submit what is queued and wait for a completion, or for the next deadline.
    fn submit_and_wait(&self) {
        self.now.set(std::time::Instant::now());
        let wait_ms = self.deadlines.borrow().next_wait_ms(self.now_ms());
        let ring = self.ring.borrow_mut();
        loop {
            let r = match wait_ms {
                None => ring.submit_and_wait(1),
                Some(0) => ring.submit(),
                Some(ms) => {
                    let ts = io_uring::types::Timespec::new()
                        .sec(ms / 1000)
                        .nsec((ms % 1000) as u32 * 1_000_000);
                    let args = io_uring::types::SubmitArgs::new().timespec(&ts);
                    ring.submitter().submit_with_args(1, &args)
                }
            };
            match r {
                Ok(_) => return,
                Err(e) if e.raw_os_error() == Some(libc::EINTR) => continue,
                Err(e) if e.raw_os_error() == Some(libc::EBUSY) => return,
                Err(e) if e.raw_os_error() == Some(libc::ETIME) => return,
                Err(e) => panic!("io_uring_enter failed: {e}"),
            }
        }
    }

    /// Cancel the operations whose deadline has passed; each completes with -ECANCELED.
    fn expire_deadlines(&self) {
        let mut fired = self.fired.borrow_mut();
        {
            let mut wheel = self.deadlines.borrow_mut();
            if wheel.armed() == 0 {
                return;
            }
            wheel.expire(self.now_ms(), &mut fired);
        }
        for slot in fired.drain(..) {
            let pending = self.slots.borrow()[slot as usize].state == SlotState::Pending;
            if pending {
                self.push(&[opcode::AsyncCancel::new(slot as u64)
                    .build()
                    .user_data(IGNORED)]);
            }
        }
    }

    fn reap(&self) {
        let mut ring = self.ring.borrow_mut();
        let mut slots = self.slots.borrow_mut();
        for cqe in ring.completion() {
            let ud = cqe.user_data();
            if ud == IGNORED {
                continue;
            }
            let Some(slot) = slots.get_mut(ud as usize) else {
                continue;
            };
            self.deadlines.borrow_mut().disarm(ud as u32);
            if slot.multishot {
                let (res, flags) = (cqe.result(), cqe.flags());
                let last = !cqueue::more(flags);
                match slot.state {
                    SlotState::Pending => {
                        slot.queue.push_back((res, flags));
                        if res == -libc::ENOBUFS {
                            self.buffer_shortages.set(self.buffer_shortages.get() + 1);
                        }
                        if last {
                            slot.ended = true;
                        } else if slot.queue.len() >= MULTISHOT_QUEUE_MAX && !slot.throttled {
                            slot.throttled = true;
                            self.throttled.set(self.throttled.get() + 1);
                            self.throttle.borrow_mut().push(ud as u32);
                        }
                        if let Some(w) = slot.waker.take() {
                            w.wake();
                        }
                    }
                    SlotState::Abandoned => {
                        if let Some(bid) = cqueue::buffer_select(flags) {
                            self.recycle(bid);
                        }
                        if last {
                            slot.reset();
                            self.free_slots.borrow_mut().push(ud as u32);
                        }
                    }
                    SlotState::Free | SlotState::Done => {}
                }
                continue;
            }
            match slot.state {
                SlotState::Pending => {
                    slot.state = SlotState::Done;
                    slot.result = cqe.result();
                    slot.flags = cqe.flags();
                    if let Some(w) = slot.waker.take() {
                        w.wake();
                    }
                }
                SlotState::Abandoned => {
                    slot.state = SlotState::Free;
                    slot.keep = None;
                    slot.waker = None;
                    self.free_slots.borrow_mut().push(ud as u32);
                }
                SlotState::Free | SlotState::Done => {}
            }
        }
        drop(slots);
        drop(ring);
        let mut throttle = self.throttle.borrow_mut();
        for slot in throttle.drain(..) {
            self.push(&[opcode::AsyncCancel::new(slot as u64)
                .build()
                .user_data(IGNORED)]);
        }
    }

    fn recycle(&self, bid: u16) {
        if let Some(b) = &self.bufs {
            b.recycle(bid);
        }
    }

    fn alloc_slot(&self) -> u32 {
        if let Some(i) = self.free_slots.borrow_mut().pop() {
            let mut slots = self.slots.borrow_mut();
            let s = &mut slots[i as usize];
            s.state = SlotState::Pending;
            return i;
        }
        let mut slots = self.slots.borrow_mut();
        slots.push(Box::new(Slot {
            state: SlotState::Pending,
            waker: None,
            result: 0,
            flags: 0,
            keep: None,
            timespec: io_uring::types::Timespec::new(),
            multishot: false,
            queue: VecDeque::new(),
            ended: false,
            throttled: false,
        }));
        (slots.len() - 1) as u32
    }

    /// Store `after` in `slot`'s timespec (kept there until the entry is submitted) and return
    /// a pointer the kernel may read.
    fn set_timespec(
        &self,
        slot: u32,
        after: std::time::Duration,
    ) -> *const io_uring::types::Timespec {
        let mut slots = self.slots.borrow_mut();
        let s = &mut slots[slot as usize];
        s.timespec = io_uring::types::Timespec::new()
            .sec(after.as_secs())
            .nsec(after.subsec_nanos());
        &s.timespec as *const io_uring::types::Timespec
    }

    /// Push entries that must stay contiguous (a linked chain) into the submission queue.
    fn push(&self, entries: &[squeue::Entry]) {
        let mut ring = self.ring.borrow_mut();
        loop {
            {
                let mut sq = ring.submission();
                if sq.capacity() - sq.len() >= entries.len() {
                    for e in entries {
                        // Safety: every pointer in these entries refers to memory owned by the
                        // operation's future or its boxed slot, both kept alive until the
                        // completion is reaped (a dropped future parks its buffers in the slot).
                        unsafe { sq.push(e).expect("submission queue has room") };
                    }
                    return;
                }
            }
            match ring.submit() {
                Ok(_) => {}
                Err(e) if e.raw_os_error() == Some(libc::EBUSY) => {
                    drop(ring);
                    self.reap();
                    ring = self.ring.borrow_mut();
                }
                Err(e) if e.raw_os_error() == Some(libc::EINTR) => {}
                Err(e) => panic!("io_uring submit failed: {e}"),
            }
        }
    }
}

/// Submit one operation and return its slot.
pub(crate) fn submit(entry: squeue::Entry) -> u32 {
    with_current(|inner| {
        let slot = inner.alloc_slot();
        inner.push(&[entry.user_data(slot as u64)]);
        slot
    })
}

/// Submit an operation with a deadline `after` from now: when it passes, the operation is
/// cancelled and completes with -ECANCELED.
pub(crate) fn submit_with_timeout(entry: squeue::Entry, after: std::time::Duration) -> u32 {
    with_current(|inner| {
        let slot = inner.alloc_slot();
        inner.push(&[entry.user_data(slot as u64)]);
        let at = inner.now_ms() + after.as_nanos().div_ceil(1_000_000) as u64;
        inner.deadlines.borrow_mut().arm(slot, at);
        slot
    })
}

/// Move the deadline of a pending operation to `after` from now (None: no deadline).
pub fn set_deadline(slot: u32, after: Option<std::time::Duration>) {
    with_current(|inner| {
        let mut wheel = inner.deadlines.borrow_mut();
        match after {
            Some(d) => wheel.arm(
                slot,
                inner.now_ms() + d.as_nanos().div_ceil(1_000_000) as u64,
            ),
            None => wheel.disarm(slot),
        }
    })
}

/// Submit a standalone timeout that fires `after` from now.
pub(crate) fn submit_timeout(after: std::time::Duration) -> u32 {
    with_current(|inner| {
        let slot = inner.alloc_slot();
        let ts_ptr = inner.set_timespec(slot, after);
        inner.push(&[opcode::Timeout::new(ts_ptr).build().user_data(slot as u64)]);
        slot
    })
}

/// One completion of a multishot operation.
#[derive(Debug, Clone, Copy)]
pub(crate) struct MultiCqe {
    pub res: i32,
    pub flags: u32,
    /// No more completions follow: the slot is freed.
    pub last: bool,
    /// It ended because kvlb throttled it (see [`MULTISHOT_QUEUE_MAX`]), not by itself.
    pub throttled: bool,
}

/// Submit a multishot receive-like operation selecting from the worker's provided buffers.
/// None where the kernel has no buffer rings.
pub(crate) fn submit_multishot(entry: squeue::Entry) -> Option<u32> {
    with_current(|inner| {
        inner.bufs.as_ref()?;
        let slot = inner.alloc_slot();
        inner.slots.borrow_mut()[slot as usize].multishot = true;
        inner.push(&[entry
            .flags(squeue::Flags::BUFFER_SELECT)
            .user_data(slot as u64)]);
        Some(slot)
    })
}

/// Take the oldest completion of multishot `slot`, or register `cx`'s waker when there is none.
pub(crate) fn multishot_next(slot: u32, cx: &mut Context<'_>) -> Option<MultiCqe> {
    with_current(|inner| {
        let mut slots = inner.slots.borrow_mut();
        let s = &mut slots[slot as usize];
        match s.queue.pop_front() {
            Some((res, flags)) => {
                let last = s.ended && s.queue.is_empty();
                let throttled = s.throttled;
                if last {
                    s.reset();
                    drop(slots);
                    inner.free_slots.borrow_mut().push(slot);
                }
                Some(MultiCqe {
                    res,
                    flags,
                    last,
                    throttled,
                })
            }
            None => {
                match &s.waker {
                    Some(w) if w.will_wake(cx.waker()) => {}
                    _ => s.waker = Some(cx.waker().clone()),
                }
                None
            }
        }
    })
}

/// This worker's multishot receive counts: (throttled, stopped for want of a provided buffer).
pub fn multishot_stats() -> (u64, u64) {
    with_current(|inner| (inner.throttled.get(), inner.buffer_shortages.get()))
}

/// Ask multishot `slot` to stop without giving up what it has already received: it is
/// cancelled, and its future keeps taking completions until the last (which reads as a
/// throttled stop, not a timeout).
pub(crate) fn stop_multishot(slot: u32) {
    with_current(|inner| {
        let mut slots = inner.slots.borrow_mut();
        let s = &mut slots[slot as usize];
        if s.state != SlotState::Pending || s.ended || s.throttled {
            return;
        }
        s.throttled = true;
        drop(slots);
        inner.push(&[opcode::AsyncCancel::new(slot as u64)
            .build()
            .user_data(IGNORED)]);
    })
}

/// Whether multishot `slot` has a completion waiting; if not, `cx`'s waker is registered.
pub(crate) fn multishot_ready(slot: u32, cx: &mut Context<'_>) -> bool {
    with_current(|inner| {
        let mut slots = inner.slots.borrow_mut();
        let s = &mut slots[slot as usize];
        if !s.queue.is_empty() {
            return true;
        }
        match &s.waker {
            Some(w) if w.will_wake(cx.waker()) => {}
            _ => s.waker = Some(cx.waker().clone()),
        }
        false
    })
}

/// Whether multishot `slot` has no completion waiting.
pub(crate) fn multishot_quiet(slot: u32) -> bool {
    with_current(|inner| inner.slots.borrow()[slot as usize].queue.is_empty())
}

/// Append the first `len` bytes of provided buffer `bid` to `out` and give the buffer back.
pub(crate) fn take_buffer(bid: u16, len: usize, out: &mut Vec<u8>) {
    with_current(|inner| {
        if let Some(b) = &inner.bufs {
            out.extend_from_slice(b.bytes(bid, len));
            b.recycle(bid);
        }
    })
}

/// Give provided buffer `bid` back unread.
pub(crate) fn recycle_buffer(bid: u16) {
    with_current(|inner| inner.recycle(bid))
}

/// Poll a slot: Ready(result) once completed (and frees the slot), else registers the waker.
pub(crate) fn poll_slot(slot: u32, cx: &mut Context<'_>) -> Poll<(i32, u32)> {
    with_current(|inner| {
        let mut slots = inner.slots.borrow_mut();
        let s = &mut slots[slot as usize];
        match s.state {
            SlotState::Done => {
                s.state = SlotState::Free;
                s.waker = None;
                let r = (s.result, s.flags);
                drop(slots);
                inner.free_slots.borrow_mut().push(slot);
                Poll::Ready(r)
            }
            _ => {
                match &s.waker {
                    Some(w) if w.will_wake(cx.waker()) => {}
                    _ => s.waker = Some(cx.waker().clone()),
                }
                Poll::Pending
            }
        }
    })
}

/// The future of a pending slot was dropped: keep `keep` alive until the kernel completes it,
/// and ask the kernel to cancel it.
pub(crate) fn abandon_slot(slot: u32, keep: Option<Box<dyn Any>>) {
    let _ = CURRENT.try_with(|c| {
        let c = c.borrow();
        let Some(inner) = c.as_ref() else { return };
        let mut slots = inner.slots.borrow_mut();
        let s = &mut slots[slot as usize];
        if s.multishot && s.state == SlotState::Pending {
            for (_, flags) in s.queue.drain(..) {
                if let Some(bid) = cqueue::buffer_select(flags) {
                    inner.recycle(bid);
                }
            }
            inner.deadlines.borrow_mut().disarm(slot);
            if s.ended {
                s.reset();
                drop(slots);
                inner.free_slots.borrow_mut().push(slot);
            } else {
                s.state = SlotState::Abandoned;
                s.waker = None;
                drop(slots);
                inner.push(&[opcode::AsyncCancel::new(slot as u64)
                    .build()
                    .user_data(IGNORED)]);
            }
            return;
        }
        match s.state {
            SlotState::Done => {
                s.state = SlotState::Free;
                s.waker = None;
                drop(slots);
                inner.free_slots.borrow_mut().push(slot);
            }
            SlotState::Pending => {
                s.state = SlotState::Abandoned;
                s.waker = None;
                s.keep = keep;
                drop(slots);
                inner.deadlines.borrow_mut().disarm(slot);
                inner.push(&[opcode::AsyncCancel::new(slot as u64)
                    .build()
                    .user_data(IGNORED)]);
            }
            _ => {}
        }
    });
}

// Wakers carry the task index; waking pushes it on this thread's run queue.

fn task_waker(id: usize) -> Waker {
    // Safety: the vtable functions below uphold RawWaker's contract: the data pointer is a
    // plain integer, clone copies it, and wake/drop need no resource release.
    unsafe { Waker::from_raw(RawWaker::new(id as *const (), &VTABLE)) }
}

static VTABLE: RawWakerVTable = RawWakerVTable::new(clone_raw, wake_raw, wake_raw, drop_raw);

fn clone_raw(p: *const ()) -> RawWaker {
    RawWaker::new(p, &VTABLE)
}

fn wake_raw(p: *const ()) {
    let id = p as usize;
    let _ = CURRENT.try_with(|c| {
        if let Ok(c) = c.try_borrow() {
            if let Some(inner) = c.as_ref() {
                let mut tasks = inner.tasks.borrow_mut();
                if let Some(entry) = tasks.get_mut(id) {
                    if !entry.scheduled {
                        entry.scheduled = true;
                        inner.run_queue.borrow_mut().push_back(id);
                    }
                }
            }
        }
    });
}

fn drop_raw(_: *const ()) {}

#[cfg(test)]
mod tests;

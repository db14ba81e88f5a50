//! The telemetry loop: every replica's KV event subscription and /metrics scrapes on one
//! thread (`kvlb-telemetry`), whatever the fleet size, plus one thread (`kvlb-tel-io`) for
//! what may block: resolving an endpoint's host name and replaying the batches of a gap.
//!
//! The loop waits on every socket at once (epoll, through `mio`): a subscription's TCP
//! connect, its ZMTP handshake and its reads never block (`kvlb_zmtp::Handshake`,
//! `SubClient::try_recv`); a scrape is a non-blocking HTTP/1.0 GET whose reply is read as it
//! comes. Timers (reconnect backoff, connect and scrape deadlines, scrapes due, liveness of
//! idle event connections) are checked on each turn, which comes at least every `MAX_WAIT`.
//!
//! A message that needs a replay (a gap, or joining a running stream, with `kv_replay`
//! configured) moves its whole subscription to the I/O thread, which applies it with the replay
//! (waiting up to `REPLAY_TIMEOUT` for the engine) and hands the subscription back; meanwhile
//! its socket is not read and its messages wait in the kernel. Other replicas' events go on.
//!
//! Fleet changes come as commands (`Hub::start`): a slot's subscription and scrapes are
//! (re)made from its spec and stop when its `StopSignal` is set (removal, reload, shutdown).

#![forbid(unsafe_code)]

use super::events::{
    refusal_needs_hint, EventSource, EventState, ReplayAnswer, SeqCheck, BACKOFF_MAX, BACKOFF_MIN,
    CONNECT_TIMEOUT, EVENT_GATHER, RECV_SLICE, REPLAY_TIMEOUT,
};
use super::scrape::{self, Scraper};
use super::ResidencyOp;
use crate::fleet::StopSignal;
use crate::worker::Shared;
use crate::zmtp::{wire::Handshake, Message, SubClient};
use crossbeam::channel::{Receiver, Sender};
use mio::net::TcpStream as MioStream;
use mio::unix::SourceFd;
use mio::{Events, Interest, Poll, Registry, Token, Waker};
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The longest the loop waits without looking at its timers and stop signals.
const MAX_WAIT: Duration = Duration::from_millis(100);
/// Messages taken from one subscription per turn; the rest wait for the next turn, so one
/// busy engine does not hold up the others.
const MESSAGES_PER_TURN: usize = 256;
/// How long a blocking write on an event connection (greeting, READY, SUBSCRIBE, PONG: a few
/// bytes each) may wait for the peer to read.
const WRITE_TIMEOUT: Duration = Duration::from_millis(500);
/// Threads telemetry runs on: the loop and its I/O thread.
pub const THREADS: usize = 2;

const WAKER: Token = Token(0);

/// The token of slot `r`'s event connection and of its scrape's.
fn event_token(r: usize) -> Token {
    Token(1 + 2 * r)
}
fn scrape_token(r: usize) -> Token {
    Token(2 + 2 * r)
}

enum Command {
    /// (Re)start slot `r`'s telemetry from its spec, until `stop`.
    Start { r: usize, stop: Arc<StopSignal> },
}

/// What the I/O thread is asked to do.
enum Job {
    /// Resolve `endpoint` for slot `r`'s subscription.
    Resolve { r: usize, endpoint: String },
    /// Apply `frames` (which need a replay) to the subscription, then hand it back.
    Receive { sub: Box<EventSub>, frames: Message },
}

/// What the I/O thread hands back.
enum Done {
    Resolved {
        r: usize,
        addrs: io::Result<Vec<SocketAddr>>,
    },
    Returned(Box<EventSub>),
    /// The residency writer is gone.
    WriterGone,
}

/// The loop's handle: starts slots' telemetry.
pub(super) struct Hub {
    commands: Sender<Command>,
    waker: Arc<Waker>,
}

impl Hub {
    /// Start the loop and its I/O thread for `shared`'s fleet; residency operations go to
    /// `ops`.
    pub(super) fn spawn(shared: Arc<Shared>, ops: Sender<ResidencyOp>) -> io::Result<Hub> {
        let poll = Poll::new()?;
        let waker = Arc::new(Waker::new(poll.registry(), WAKER)?);
        let (commands, command_rx) = crossbeam::channel::unbounded();
        let (job_tx, job_rx) = crossbeam::channel::unbounded();
        let (done_tx, done_rx) = crossbeam::channel::unbounded();
        {
            let (shared, ops, waker) = (shared.clone(), ops.clone(), waker.clone());
            std::thread::Builder::new()
                .name("kvlb-tel-io".into())
                .spawn(move || io_thread(shared, ops, job_rx, done_tx, waker))?;
        }
        let slots = shared.fleet.capacity();
        let mut hub = Loop {
            shared,
            ops,
            poll,
            commands: command_rx,
            jobs: job_tx,
            done: done_rx,
            events: (0..slots).map(|_| None).collect(),
            scrapes: (0..slots).map(|_| None).collect(),
            ready: Vec::new(),
            again: Vec::new(),
            op_buf: Vec::new(),
            writer_gone: false,
        };
        std::thread::Builder::new()
            .name("kvlb-telemetry".into())
            .spawn(move || hub.run())?;
        Ok(Hub { commands, waker })
    }

    /// (Re)start slot `r`'s subscription and scrapes, as its spec says, until `stop` is set.
    pub(super) fn start(&self, r: usize, stop: Arc<StopSignal>) -> io::Result<()> {
        self.commands
            .send(Command::Start { r, stop })
            .map_err(|_| io::Error::other("the telemetry loop has stopped"))?;
        self.waker.wake()
    }
}

/// Where a subscription's connection stands.
enum Link {
    /// Not connected; the next attempt at `until`.
    Waiting { until: Instant },
    /// Its host name is being resolved on the I/O thread.
    Resolving,
    /// A TCP connect to `addrs[next - 1]` under way.
    Connecting {
        stream: MioStream,
        addrs: Vec<SocketAddr>,
        next: usize,
        deadline: Instant,
    },
    /// The ZMTP greeting and READY under way.
    Handshaking {
        handshake: Handshake,
        deadline: Instant,
    },
    Live {
        sub: SubClient,
        /// When an idle connection last counted as a sign of life.
        touched: Instant,
    },
}

/// One replica slot's KV event subscription.
struct EventSub {
    r: usize,
    stop: Arc<StopSignal>,
    source: EventSource,
    url: String,
    /// Without metrics, an open event connection is the only sign of life of an idle engine
    /// (an idle engine publishes nothing): it counts as fresh telemetry.
    connection_is_liveness: bool,
    state: EventState,
    link: Link,
    backoff: Duration,
    last_error: String,
    /// Since when connections have been refused without a break, and whether that was
    /// explained in the log.
    refused_since_ms: Option<u64>,
    hinted: bool,
}

/// One replica slot's /metrics scrapes.
struct ScrapeSub {
    stop: Arc<StopSignal>,
    scraper: Scraper,
    next: Instant,
    fetch: Option<Fetch>,
}

/// A scrape under way.
struct Fetch {
    stream: MioStream,
    connected: bool,
    request: Vec<u8>,
    written: usize,
    reply: Vec<u8>,
    deadline: Instant,
}

struct Loop {
    shared: Arc<Shared>,
    ops: Sender<ResidencyOp>,
    poll: Poll,
    commands: Receiver<Command>,
    jobs: Sender<Job>,
    done: Receiver<Done>,
    /// Per slot; None also while the subscription is on the I/O thread.
    events: Vec<Option<Box<EventSub>>>,
    scrapes: Vec<Option<ScrapeSub>>,
    /// Tokens the last wait reported ready.
    ready: Vec<Token>,
    /// Subscriptions that had more messages than one turn takes.
    again: Vec<usize>,
    op_buf: Vec<ResidencyOp>,
    /// The residency writer has gone (shutdown): the loop ends.
    writer_gone: bool,
}

impl Loop {
    fn run(&mut self) {
        let mut events = Events::with_capacity(1024);
        loop {
            while let Ok(cmd) = self.commands.try_recv() {
                match cmd {
                    Command::Start { r, stop } => self.start(r, stop),
                }
            }
            while let Ok(done) = self.done.try_recv() {
                match done {
                    Done::Resolved { r, addrs } => self.resolved(r, addrs),
                    Done::Returned(sub) => self.returned(sub),
                    Done::WriterGone => return,
                }
            }
            let mut took = 0;
            let ready = std::mem::take(&mut self.ready);
            let again = std::mem::take(&mut self.again);
            for t in &ready {
                match t.0 {
                    0 => {}
                    n if n % 2 == 1 => took += self.on_event_ready((n - 1) / 2),
                    n => self.on_scrape_ready((n - 2) / 2),
                }
            }
            for r in again {
                took += self.on_event_ready(r);
            }
            if self.writer_gone {
                return;
            }
            self.ready = ready;
            self.ready.clear();
            let next = self.timers(Instant::now());
            let wait = if !self.again.is_empty() {
                Duration::ZERO
            } else {
                if took > 0 {
                    // An engine publishes a batch per scheduler step; waking for each costs
                    // more than the batch (see `EVENT_GATHER`).
                    std::thread::sleep(EVENT_GATHER);
                }
                next.saturating_duration_since(Instant::now()).min(MAX_WAIT)
            };
            if let Err(e) = self.poll.poll(&mut events, Some(wait)) {
                if e.kind() != io::ErrorKind::Interrupted {
                    eprintln!("kvlb: telemetry loop: {e}");
                    std::thread::sleep(MAX_WAIT);
                }
                continue;
            }
            self.ready.extend(events.iter().map(|e| e.token()));
        }
    }

    fn registry(&self) -> &Registry {
        self.poll.registry()
    }

    /// Slot `r`'s telemetry anew from its spec, replacing whatever it had.
    fn start(&mut self, r: usize, stop: Arc<StopSignal>) {
        self.drop_event(r);
        self.drop_scrape(r);
        let shared = &self.shared;
        let Some(spec) = shared.fleet.slot(r).spec() else {
            return;
        };
        if let Some(endpoint) = spec.kv_events.clone() {
            let mut state =
                EventState::new(r, shared.prefix.token_block_size).with_rank(spec.dp_rank);
            state.learn_adapters(shared.adapters.clone());
            self.events[r] = Some(Box::new(EventSub {
                r,
                stop: stop.clone(),
                source: EventSource {
                    replica: r,
                    endpoint,
                    replay: spec.kv_replay.clone(),
                    token_block_size: shared.prefix.token_block_size,
                    rank: spec.dp_rank,
                },
                url: spec.url.clone(),
                connection_is_liveness: !spec.scrape_metrics(),
                state,
                link: Link::Waiting {
                    until: Instant::now(),
                },
                backoff: BACKOFF_MIN,
                last_error: String::new(),
                refused_since_ms: None,
                hinted: false,
            }));
        }
        // A data-parallel engine's /metrics is scraped once, by rank 0's slot, for every rank.
        if spec.scrape_metrics() && spec.dp_rank.unwrap_or(0) == 0 {
            if let Some(scraper) = Scraper::new(r, shared) {
                self.scrapes[r] = Some(ScrapeSub {
                    stop,
                    scraper,
                    next: Instant::now(),
                    fetch: None,
                });
            }
        }
    }

    fn drop_event(&mut self, r: usize) {
        if let Some(mut sub) = self.events[r].take() {
            self.close_link(&mut sub);
        }
    }

    fn drop_scrape(&mut self, r: usize) {
        if let Some(mut s) = self.scrapes[r].take() {
            if let Some(mut f) = s.fetch.take() {
                let _ = self.registry().deregister(&mut f.stream);
            }
        }
    }

    /// Close the subscription's connection, if any (it is `Waiting` afterwards).
    fn close_link(&self, sub: &mut EventSub) {
        let was = std::mem::replace(
            &mut sub.link,
            Link::Waiting {
                until: Instant::now(),
            },
        );
        match was {
            Link::Connecting { mut stream, .. } => {
                let _ = self.registry().deregister(&mut stream);
            }
            Link::Handshaking { handshake, .. } => {
                let fd = handshake.as_raw_fd();
                let _ = self.registry().deregister(&mut SourceFd(&fd));
            }
            Link::Live { sub: client, .. } => {
                let fd = client.as_raw_fd();
                let _ = self.registry().deregister(&mut SourceFd(&fd));
                self.shared.telemetry[sub.r]
                    .events_connected
                    .store(false, Relaxed);
            }
            Link::Waiting { .. } | Link::Resolving => {}
        }
    }

    /// A connection attempt (or the connection) failed: log it once per distinct error, back
    /// off, and explain refusals that look like an engine connecting instead of binding.
    fn failed(&mut self, r: usize, e: io::Error) {
        let Some(mut sub) = self.events[r].take() else {
            return;
        };
        self.close_link(&mut sub);
        let tel = &self.shared.telemetry[r];
        tel.connect_failures.fetch_add(1, Relaxed);
        let msg = e.to_string();
        if msg != sub.last_error {
            eprintln!(
                "kvlb: replica {}: KV events {}: {msg}; retrying",
                sub.url, sub.source.endpoint
            );
            sub.last_error = msg;
        }
        let now = self.shared.now_ms();
        if e.kind() == io::ErrorKind::ConnectionRefused {
            let since = *sub.refused_since_ms.get_or_insert(now);
            if !sub.hinted && refusal_needs_hint(since, now, tel.last_metrics_ms.load(Relaxed)) {
                sub.hinted = true;
                eprintln!(
                    "kvlb: replica {}: its HTTP side answers but nothing listens at its KV \
                     event endpoint {}: an engine whose --kv-events-config endpoint names a \
                     host (tcp://127.0.0.1:PORT, tcp://10.0.0.5:PORT) connects there instead \
                     of binding; start vLLM with tcp://*:PORT, or give SGLang \"bind\": true \
                     (docs/engines.md)",
                    sub.url, sub.source.endpoint
                );
            }
        } else {
            sub.refused_since_ms = None;
        }
        sub.link = Link::Waiting {
            until: Instant::now() + sub.backoff,
        };
        sub.backoff = (sub.backoff * 2).min(BACKOFF_MAX);
        self.events[r] = Some(sub);
    }

    /// A live connection went away: reconnect at once (as a fresh attempt, no backoff).
    fn disconnected(&mut self, r: usize) {
        if let Some(mut sub) = self.events[r].take() {
            self.close_link(&mut sub);
            self.events[r] = Some(sub);
        }
    }

    /// Begin connecting slot `r`: resolve its endpoint (on the I/O thread unless it names an
    /// address), then connect.
    fn begin_connect(&mut self, r: usize) {
        let Some(sub) = self.events[r].as_mut() else {
            return;
        };
        let endpoint = sub.source.endpoint.clone();
        match crate::zmtp::socket_address(&endpoint) {
            Err(e) => self.failed(r, e),
            Ok(a) => match a.parse::<SocketAddr>() {
                Ok(addr) => self.connect(r, vec![addr], 0),
                Err(_) => {
                    sub.link = Link::Resolving;
                    let _ = self.jobs.send(Job::Resolve { r, endpoint });
                }
            },
        }
    }

    fn resolved(&mut self, r: usize, addrs: io::Result<Vec<SocketAddr>>) {
        match self.events[r].as_ref().map(|s| &s.link) {
            Some(Link::Resolving) => {}
            _ => return,
        }
        match addrs {
            Ok(a) if !a.is_empty() => self.connect(r, a, 0),
            Ok(_) => {
                let ep = self.events[r].as_ref().map(|s| s.source.endpoint.clone());
                self.failed(
                    r,
                    io::Error::new(
                        io::ErrorKind::NotFound,
                        format!("zmtp: {:?} resolves to no address", ep.unwrap_or_default()),
                    ),
                )
            }
            Err(e) => self.failed(r, e),
        }
    }

    /// Connect slot `r` to `addrs[next]` (the next ones if that fails).
    fn connect(&mut self, r: usize, addrs: Vec<SocketAddr>, next: usize) {
        let Some(&addr) = addrs.get(next) else {
            return;
        };
        match open(self.registry(), addr, event_token(r)) {
            Ok(stream) => {
                if let Some(sub) = self.events[r].as_mut() {
                    sub.link = Link::Connecting {
                        stream,
                        addrs,
                        next: next + 1,
                        deadline: Instant::now() + CONNECT_TIMEOUT,
                    };
                }
            }
            Err(e) => self.connect_failed(r, addrs, next + 1, addr, e),
        }
    }

    /// The connect to `addr` failed: try the next address, or give up for now.
    fn connect_failed(
        &mut self,
        r: usize,
        addrs: Vec<SocketAddr>,
        next: usize,
        addr: SocketAddr,
        e: io::Error,
    ) {
        if next < addrs.len() {
            self.disconnected(r);
            self.connect(r, addrs, next);
        } else {
            self.failed(
                r,
                io::Error::new(e.kind(), format!("zmtp: connect {addr}: {e}")),
            );
        }
    }

    /// Slot `r`'s event connection is ready: move its connect or handshake on, or take its
    /// messages. The number of messages taken.
    fn on_event_ready(&mut self, r: usize) -> usize {
        let Some(sub) = self.events[r].as_mut() else {
            return 0;
        };
        match &mut sub.link {
            Link::Connecting {
                stream,
                addrs,
                next,
                ..
            } => match connected(stream) {
                Ok(false) => 0,
                Ok(true) => {
                    let addrs = std::mem::take(addrs);
                    let Link::Connecting { mut stream, .. } = std::mem::replace(
                        &mut sub.link,
                        Link::Waiting {
                            until: Instant::now(),
                        },
                    ) else {
                        unreachable!()
                    };
                    let _ = self.poll.registry().deregister(&mut stream);
                    drop(addrs);
                    self.handshake(r, stream.into());
                    0
                }
                Err(e) => {
                    let (addrs, next) = (std::mem::take(addrs), *next);
                    let addr = addrs[next - 1];
                    let mut s = self.events[r].take().expect("present");
                    self.close_link(&mut s);
                    self.events[r] = Some(s);
                    self.connect_failed(r, addrs, next, addr, e);
                    0
                }
            },
            Link::Handshaking { handshake, .. } => match handshake.advance(Some(Instant::now())) {
                Ok(false) => 0,
                Ok(true) => {
                    self.handshaken(r);
                    self.take_messages(r)
                }
                Err(e) => {
                    self.failed(r, e);
                    0
                }
            },
            Link::Live { .. } => self.take_messages(r),
            Link::Waiting { .. } | Link::Resolving => 0,
        }
    }

    /// Slot `r`'s TCP connection is up: start the ZMTP handshake on it.
    fn handshake(&mut self, r: usize, stream: TcpStream) {
        let setup = stream
            .set_nonblocking(false)
            .and_then(|()| stream.set_write_timeout(Some(WRITE_TIMEOUT)))
            .and_then(|()| {
                let fd = stream.as_raw_fd();
                self.registry()
                    .register(&mut SourceFd(&fd), event_token(r), Interest::READABLE)
            })
            .and_then(|()| SubClient::handshake(stream));
        match setup {
            Ok(handshake) => {
                if let Some(sub) = self.events[r].as_mut() {
                    sub.link = Link::Handshaking {
                        handshake,
                        deadline: Instant::now() + CONNECT_TIMEOUT,
                    };
                }
                // What the peer sent already may not wake the loop again.
                self.again.push(r);
            }
            Err(e) => self.failed(r, e),
        }
    }

    /// Slot `r`'s handshake completed: subscribe to everything.
    fn handshaken(&mut self, r: usize) {
        let Some(sub) = self.events[r].as_mut() else {
            return;
        };
        let Link::Handshaking { handshake, .. } = std::mem::replace(
            &mut sub.link,
            Link::Waiting {
                until: Instant::now(),
            },
        ) else {
            return;
        };
        let mut client = SubClient::from_handshake(handshake);
        if let Err(e) = client.subscribe(b"") {
            let fd = client.as_raw_fd();
            let _ = self.registry().deregister(&mut SourceFd(&fd));
            self.failed(r, e);
            return;
        }
        sub.last_error.clear();
        sub.refused_since_ms = None;
        sub.hinted = false;
        sub.backoff = BACKOFF_MIN;
        let tel = &self.shared.telemetry[r];
        tel.connects.fetch_add(1, Relaxed);
        tel.events_connected.store(true, Relaxed);
        sub.link = Link::Live {
            sub: client,
            touched: Instant::now(),
        };
    }

    /// Take up to `MESSAGES_PER_TURN` messages of slot `r`'s live connection.
    fn take_messages(&mut self, r: usize) -> usize {
        let mut taken = 0;
        while taken < MESSAGES_PER_TURN {
            let Some(sub) = self.events[r].as_mut() else {
                return taken;
            };
            let Link::Live { sub: client, .. } = &mut sub.link else {
                return taken;
            };
            let frames = match client.try_recv() {
                Ok(Some(f)) => f,
                Ok(None) => return taken,
                Err(_) => {
                    self.disconnected(r);
                    return taken;
                }
            };
            taken += 1;
            if needs_replay(sub, &frames) {
                let sub = self.events[r].take().expect("present");
                let _ = self.jobs.send(Job::Receive { sub, frames });
                return taken;
            }
            if !apply_message(
                sub,
                frames,
                &self.shared,
                &self.ops,
                &mut self.op_buf,
                &mut |_| None,
            ) {
                self.writer_gone = true;
                return taken;
            }
        }
        self.again.push(r);
        taken
    }

    /// A subscription back from the I/O thread.
    fn returned(&mut self, sub: Box<EventSub>) {
        let r = sub.r;
        if sub.stop.is_stopped() || self.events[r].is_some() {
            let mut sub = sub;
            self.close_link(&mut sub);
            return;
        }
        self.events[r] = Some(sub);
        // Its socket may have filled meanwhile without a new readiness event.
        self.again.push(r);
    }

    /// Slot `r`'s scrape connection is ready: connect, send, read.
    fn on_scrape_ready(&mut self, r: usize) {
        let Some(s) = self.scrapes[r].as_mut() else {
            return;
        };
        let Some(f) = s.fetch.as_mut() else { return };
        match drive_fetch(f) {
            Ok(None) => {}
            Ok(Some(reply)) => self.scraped(r, Ok(reply)),
            Err(e) => self.scraped(r, Err(e)),
        }
    }

    /// A scrape of slot `r` ended.
    fn scraped(&mut self, r: usize, reply: io::Result<Vec<u8>>) {
        let Some(s) = self.scrapes[r].as_mut() else {
            return;
        };
        if let Some(mut f) = s.fetch.take() {
            let _ = self.poll.registry().deregister(&mut f.stream);
        }
        let text = reply
            .and_then(scrape::parse_reply)
            .and_then(|(status, line, body)| scrape::metrics_body(status, line, body))
            .map_err(|e| io::Error::new(e.kind(), format!("metrics: {e}")));
        s.scraper.finish(&self.shared, text);
    }

    /// Run what is due at `now`; the next time something will be.
    fn timers(&mut self, now: Instant) -> Instant {
        let mut next = now + MAX_WAIT;
        for r in 0..self.events.len() {
            let Some(sub) = self.events[r].as_mut() else {
                continue;
            };
            if sub.stop.is_stopped() {
                self.drop_event(r);
                continue;
            }
            match &mut sub.link {
                Link::Waiting { until } if *until <= now => self.begin_connect(r),
                Link::Waiting { until } => next = next.min(*until),
                Link::Connecting { deadline, .. } | Link::Handshaking { deadline, .. }
                    if *deadline <= now =>
                {
                    self.failed(
                        r,
                        io::Error::new(io::ErrorKind::TimedOut, "connection timed out"),
                    )
                }
                Link::Connecting { deadline, .. } | Link::Handshaking { deadline, .. } => {
                    next = next.min(*deadline)
                }
                Link::Live { touched, .. } => {
                    if sub.connection_is_liveness {
                        if now >= *touched + RECV_SLICE {
                            *touched = now;
                            self.shared.telemetry[r].touch(self.shared.now_ms());
                        }
                        next = next.min(*touched + RECV_SLICE);
                    }
                }
                Link::Resolving => {}
            }
        }
        for r in 0..self.scrapes.len() {
            let Some(s) = self.scrapes[r].as_mut() else {
                continue;
            };
            if s.stop.is_stopped() {
                self.drop_scrape(r);
                continue;
            }
            match &s.fetch {
                Some(f) if f.deadline <= now => {
                    self.scraped(r, Err(io::Error::new(io::ErrorKind::TimedOut, "timed out")))
                }
                Some(f) => next = next.min(f.deadline),
                None if s.next <= now => {
                    s.next = now + s.scraper.interval;
                    let request = s.scraper.begin(&self.shared);
                    let addr = s.scraper.addr;
                    let deadline = now + s.scraper.timeout;
                    let token = scrape_token(s.scraper.slot());
                    match open(self.poll.registry(), addr, token) {
                        Ok(stream) => {
                            s.fetch = Some(Fetch {
                                stream,
                                connected: false,
                                request,
                                written: 0,
                                reply: Vec::new(),
                                deadline,
                            });
                            next = next.min(deadline);
                        }
                        Err(e) => self.scraped(r, Err(e)),
                    }
                }
                None => next = next.min(s.next),
            }
        }
        next
    }
}

/// A non-blocking connect to `addr`, its readiness reported under `token`.
fn open(registry: &Registry, addr: SocketAddr, token: Token) -> io::Result<MioStream> {
    let mut stream = MioStream::connect(addr)?;
    registry.register(&mut stream, token, Interest::READABLE | Interest::WRITABLE)?;
    Ok(stream)
}

/// Whether a connect under way has completed: Ok(false) while it is in progress, the error
/// when it failed (refused, unreachable).
fn connected(stream: &MioStream) -> io::Result<bool> {
    if let Some(e) = stream.take_error()? {
        return Err(e);
    }
    match stream.peer_addr() {
        Ok(_) => Ok(true),
        Err(e) if e.kind() == io::ErrorKind::NotConnected => Ok(false),
        Err(e) => Err(e),
    }
}

/// Move a scrape on as far as its socket allows: Ok(Some(reply)) once the reply is whole.
fn drive_fetch(f: &mut Fetch) -> io::Result<Option<Vec<u8>>> {
    if !f.connected {
        if !connected(&f.stream)? {
            return Ok(None);
        }
        f.connected = true;
    }
    while f.written < f.request.len() {
        match f.stream.write(&f.request[f.written..]) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => f.written += n,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(None),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    let mut chunk = [0u8; 16 * 1024];
    loop {
        match f.stream.read(&mut chunk) {
            Ok(0) => return Ok(Some(std::mem::take(&mut f.reply))),
            Ok(n) => {
                f.reply.extend_from_slice(&chunk[..n]);
                if scrape::reply_complete(&f.reply, scrape::MAX_METRICS_BYTES)? {
                    return Ok(Some(std::mem::take(&mut f.reply)));
                }
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(None),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
}

/// Whether `frames` must be applied with a replay: a gap, or joining a stream already
/// running, on a replica with a replay endpoint.
fn needs_replay(sub: &EventSub, frames: &[Vec<u8>]) -> bool {
    if sub.source.replay.is_none() {
        return false;
    }
    let Some(seq) = frames
        .len()
        .checked_sub(2)
        .and_then(|i| <[u8; 8]>::try_from(frames[i].as_slice()).ok())
        .map(u64::from_be_bytes)
    else {
        return false;
    };
    match sub.state.check_seq(seq) {
        SeqCheck::Gap { .. } => true,
        SeqCheck::First => seq > 0,
        SeqCheck::InOrder | SeqCheck::Backwards => false,
    }
}

/// Apply one message of `sub`'s stream: residency operations to the writer, troubles to the
/// log (rate-limited), its buffers back to the connection. False once the writer is gone.
fn apply_message(
    sub: &mut EventSub,
    frames: Message,
    shared: &Shared,
    ops_tx: &Sender<ResidencyOp>,
    ops: &mut Vec<ResidencyOp>,
    replay: &mut dyn FnMut(u64) -> Option<ReplayAnswer>,
) -> bool {
    let tel = &shared.telemetry[sub.r];
    ops.clear();
    if sub.state.receive(&frames, tel, replay, ops).is_ok() {
        let now = shared.now_ms();
        tel.last_event_ms.store(now.max(1), Relaxed);
        tel.touch(now);
    }
    for (kind, line) in sub.state.take_troubles() {
        if let Some(held) = kind.limit().allow() {
            eprintln!(
                "kvlb: replica {}: KV events: {line}{}",
                sub.url,
                crate::log_limit::more(held)
            );
        }
    }
    if let Link::Live { sub: client, .. } = &mut sub.link {
        client.recycle(frames);
    }
    tel.engine_blocks
        .store(sub.state.known_blocks() as u64, Relaxed);
    for op in ops.drain(..) {
        // Waits while the writer catches up; fails only once the writer has gone.
        if ops_tx.send(op).is_err() {
            tel.events_connected.store(false, Relaxed);
            return false;
        }
    }
    true
}

/// The I/O thread: name resolution and replays, one at a time.
fn io_thread(
    shared: Arc<Shared>,
    ops: Sender<ResidencyOp>,
    jobs: Receiver<Job>,
    done: Sender<Done>,
    waker: Arc<Waker>,
) {
    let mut op_buf = Vec::new();
    for job in jobs.iter() {
        let result = match job {
            Job::Resolve { r, endpoint } => {
                use std::net::ToSocketAddrs;
                let addrs = crate::zmtp::socket_address(&endpoint)
                    .and_then(|a| a.to_socket_addrs())
                    .map(|a| a.collect());
                Done::Resolved { r, addrs }
            }
            Job::Receive { mut sub, frames } => {
                let endpoint = sub.source.replay.clone();
                let mut replay = |from: u64| {
                    endpoint
                        .as_deref()
                        .map(|ep| crate::kv_events::replay(ep, from, REPLAY_TIMEOUT))
                };
                if apply_message(&mut sub, frames, &shared, &ops, &mut op_buf, &mut replay) {
                    Done::Returned(sub)
                } else {
                    Done::WriterGone
                }
            }
        };
        if done.send(result).is_err() {
            return;
        }
        let _ = waker.wake();
    }
}

//! Event queues (ES-API `exs_qcreate`, `exs_qdequeue`) and the adaptive completion wait (US patent 7,577,712,
//! *Efficient event completion in UDAPL*).
//!
//! Every asynchronous call names an [`EventQueue`] and a user context value; it completes with exactly one
//! [`Event`]. A queue of depth `d` accepts at most `d` operations that have not been dequeued yet: the slot is
//! reserved when the operation starts, so completion never overflows the queue, and starting one more returns
//! [`QueueFull`] (EAGAIN).
//!
//! ## The adaptive wait
//! `dequeue(min, max, timeout)` in [`WaitMode::Adaptive`]:
//! 1. poll the queue once (and, with `spin > 0`, up to `spin` more times: "the alternative embodiment");
//!    where the queue's contexts have a transport to poll (threaded contexts), spin for about twice as long as
//!    this queue's recent waits took, when that is shorter than sleeping and waking costs (at most the longest
//!    spin, [`EventQueue::set_adaptive_spin`]; waits that took longer, such as an idle server's, turn spinning off), so a
//!    reply due within microseconds costs no context switch;
//! 2. if fewer than `min` events were found, **block until at least the number still missing has arrived**;
//!    the producer wakes the waiter only when that count is reached, not at every event;
//! 3. then drain without blocking again.
//!
//! So a batch of `n` expected completions costs at most one sleep and one wake-up of a thread that waits on the
//! queue while another thread (the context's progress thread) makes the progress. A waiting thread that makes the
//! progress itself (it leads its context: see `progress`) sleeps on the transport instead, and wakes when the
//! transport has something, to run the protocol, before it sleeps again. [`QueueStats::blocks`] counts the waits
//! that went to sleep, each once however many wake-ups it took (tests assert on it). [`WaitMode::Block`] wakes
//! on every event (the `dat_evd_wait` per event that the patent improves on) and [`WaitMode::BusyPoll`] never
//! sleeps (the `dat_evd_dequeue` loop); both exist to be measured against the adaptive mode.

use std::collections::VecDeque;
use std::fmt;
use std::os::fd::{AsFd, BorrowedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};

use nix::poll::{PollFd, PollFlags};
use nix::sys::eventfd::{EfdFlags, EventFd};

use crate::error::{DequeueError, OpError, QueueFull};
use crate::ids::SocketId;
use crate::progress::lead::{Driver, Follower, Poller};

/// The contexts a dequeue drives or leads: almost always one, so a short list needs no allocation per wait.
pub(crate) type Pollers = smallvec::SmallVec<[Arc<dyn Poller>; 2]>;

/// What kind of operation an event completes (ES-API EXS_EVT_*).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum EventKind {
    /// `exs_connect` finished.
    Connect,
    /// `exs_accept` finished: [`Event::take_accepted`] gives the new socket.
    Accept,
    /// `exs_send` finished.
    Send,
    /// `exs_recv` finished.
    Recv,
    /// `exs_sendfile` finished.
    SendFile,
    /// `exs_poll` readiness.
    Poll,
    /// A shutdown finished. (There is no close event: `Socket::close` returns at once, and the sends it lets
    /// finish report with their own events, the last of them when the close has delivered everything.)
    Shutdown,
    /// A persistent send with notification was read by the peer (the UNH-EXS paper, 4.2).
    ReadNotify,
}

pub use crate::proto::op::EventFlags;

/// How often [`EventQueue::wait_all`] counts again what it waits for (an operation refused as it started gives
/// its slot back with no event).
const WAIT_ALL_RECHECK: Duration = Duration::from_secs(1);

/// The completion of one asynchronous operation.
pub struct Event {
    /// What completed.
    pub kind: EventKind,
    /// Success, or why not.
    pub status: Result<(), OpError>,
    /// Bytes transferred (placed in the receive buffer, or sent).
    pub bytes: usize,
    /// The user context value given when the operation started.
    pub context: u64,
    /// Truncation and end-of-stream.
    pub flags: EventFlags,
    /// The socket the operation was started on.
    pub socket: SocketId,
    /// For [`EventKind::Accept`]: the new connection, until the application takes it
    /// ([`Event::take_accepted`]).
    pub(crate) accepted: Option<Accepted>,
    /// For [`EventKind::Poll`]: the readiness found.
    pub readiness: crate::ids::Readiness,
}

impl Event {
    /// Whether the operation succeeded.
    pub fn is_ok(&self) -> bool {
        self.status.is_ok()
    }
}

impl fmt::Debug for Event {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut d = f.debug_struct("Event");
        d.field("kind", &self.kind)
            .field("status", &self.status)
            .field("bytes", &self.bytes);
        d.field("context", &self.context)
            .field("socket", &self.socket);
        if self.flags != EventFlags::default() {
            d.field("flags", &self.flags);
        }
        if let Some(a) = &self.accepted {
            d.field("accepted", &a.sid);
        }
        d.finish()
    }
}

/// How `dequeue` waits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum WaitMode {
    /// The adaptive completion wait: poll once (plus `spin` more polls), spin for about twice as long as recent
    /// waits took when that is short (at most the longest spin: [`EventQueue::set_adaptive_spin`]), then block
    /// until the missing count has arrived, then drain.
    Adaptive {
        /// Extra polls before blocking, besides the learned spin (0: none).
        spin: u32,
    },
    /// Block and wake on every event.
    Block,
    /// Never block: poll until enough events arrived or the timeout passed.
    BusyPoll,
}

impl Default for WaitMode {
    fn default() -> Self {
        WaitMode::Adaptive { spin: 0 }
    }
}

/// Counters of one queue, for tests and benchmarks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct QueueStats {
    /// Times a `dequeue` went to sleep (or, in the simulator, had to drive the fabric to get events): once per
    /// wait, however many times a leading thread woke to run the protocol during it.
    pub blocks: u64,
    /// Times a producer woke a sleeping `dequeue`.
    pub wakeups: u64,
    /// Events handed out.
    pub dequeued: u64,
    /// Polls of the queue that found it empty.
    pub empty_polls: u64,
    /// Adaptive dequeues whose events arrived while they spun, before they would have slept.
    pub spun: u64,
}

/// The next queue's number ([`EventQueue::id`]).
static NEXT_QUEUE: AtomicU64 = AtomicU64::new(1);

pub(crate) struct EqInner {
    /// This queue's number, never used by another queue of the process (see [`EventQueue::id`]).
    id: u64,
    state: Mutex<EqState>,
    cond: Condvar,
    depth: usize,
    /// The application's descriptor ([`AsFd`]): readable while events are queued. Made with the queue (so that
    /// taking it cannot fail), kept in sync only once taken (`ready_used`): until then a queue that goes from
    /// empty to non-empty and back costs no system call.
    ready: EventFd,
    ready_used: AtomicBool,
    /// How long an adaptive dequeue spins before sleeping, learned from recent waits.
    spin: wait::SpinEstimate,
}

struct EqState {
    events: VecDeque<Event>,
    /// Operations started and not yet completed.
    outstanding: usize,
    /// How many events each dequeue sleeping on the condition variable waits for (one entry per sleeper).
    waiters: Vec<usize>,
    /// Leaders sleeping on their transports, each waiting for a count of events here (see [`sleepers`]).
    sleepers: sleepers::Sleepers,
    /// Bumped when a context's leader lets go, so the threads following it retry leading.
    nudges: u64,
    mode: WaitMode,
    stats: QueueStats,
    /// Whether `ready` has been written since the queue was last empty.
    ready_set: bool,
    /// Manual-progress drivers of the contexts whose operations report here.
    drivers: Vec<Weak<dyn Driver>>,
    /// Threaded contexts whose operations report here (driven directly by a busy-polling dequeue).
    pollers: Vec<Weak<dyn Poller>>,
}

/// Who owns the connections an engine accepts: their context. The engine sits below contexts and sockets (it
/// cannot name them), so an accepted connection travels to the application as its id and its owner, and becomes a
/// `Socket` when the application takes it from its event (`Event::take_accepted`).
pub(crate) trait Owner: std::any::Any + Send + Sync {
    /// Closes an accepted connection that nobody took (its event was dropped, dequeued or not).
    fn abandon(self: Arc<Self>, sid: SocketId);
}

/// An accepted connection the application has not taken yet: closed when dropped (a socket nobody holds).
pub(crate) struct Accepted {
    sid: SocketId,
    owner: Option<Arc<dyn Owner>>,
}

impl Accepted {
    pub(crate) fn new(sid: SocketId, owner: Arc<dyn Owner>) -> Accepted {
        Accepted {
            sid,
            owner: Some(owner),
        }
    }

    /// The connection and its owner, for the caller to wrap in a socket (which closes it from then on).
    pub(crate) fn into_parts(mut self) -> (SocketId, Arc<dyn Owner>) {
        let owner = self
            .owner
            .take()
            .expect("an accepted connection has its owner until taken");
        (self.sid, owner)
    }
}

impl Drop for Accepted {
    fn drop(&mut self) {
        if let Some(owner) = self.owner.take() {
            owner.abandon(self.sid);
        }
    }
}

/// An event queue (ES-API `exs_qcreate`). Cheap to clone (a handle); usable from several threads.
///
/// Operations of any socket and context may report to one queue, up to its depth in flight. A waiting dequeue
/// runs the protocol of the contexts that report here, and sleeps until as many events as it asked for have
/// arrived ([`WaitMode::Adaptive`]; [`WaitMode::Block`] and [`WaitMode::BusyPoll`] on request). The queue is
/// also a file descriptor, readable while events are queued ([`AsFd`]), for `epoll` loops.
///
/// ```
/// # #[cfg(feature = "fabric")] {
/// # std::env::set_var("EXS_BACKEND", "fabric"); // the test's backend, whatever else the build enables
/// use std::time::Duration;
/// use exs::{Context, DequeueError, EventQueue, SockType, Socket};
///
/// let ctx = Context::from_env()?;
/// let eq = EventQueue::new(64)?;
/// // Nothing started: a bounded wait times out.
/// assert!(matches!(eq.next(Some(Duration::from_millis(5))), Err(DequeueError::TimedOut)));
///
/// // Three listeners, each accepting; three connects: wait for all six events in one call.
/// let mut keep = Vec::new();
/// for i in 0..3 {
///     let l = Socket::new(&ctx, SockType::Stream)?;
///     l.bind("127.0.0.1:0".parse()?)?;
///     let addr = l.listen(4)?;
///     l.accept(&eq, i)?;
///     let c = Socket::new(&ctx, SockType::Stream)?;
///     c.connect(&eq, addr, 10 + i)?;
///     keep.push((l, c));
/// }
/// let mut events = Vec::new();
/// while events.len() < 6 {
///     let want = 6 - events.len();
///     eq.dequeue(&mut events, want, want, Some(Duration::from_secs(10)))?;
/// }
/// assert!(events.iter().all(|e| e.is_ok()));
/// # }
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone)]
pub struct EventQueue {
    inner: Arc<EqInner>,
}

/// Readable while events are queued (level-triggered): register it with epoll, mio, or tokio's `AsyncFd`, and call
/// [`EventQueue::poll`] when it is. No thread per queue, no busy polling. Progress meanwhile is the progress
/// thread's (`Progress::Thread`, the default) or a waiting thread's: nobody needs to call into the queue for the
/// descriptor to become readable. The descriptor belongs to the queue (made by [`EventQueue::new`]) and lives as
/// long as its last handle.
impl AsFd for EventQueue {
    fn as_fd(&self) -> BorrowedFd<'_> {
        if !self.inner.ready_used.swap(true, Ordering::SeqCst) {
            let mut s = self.inner.lock();
            self.inner.sync_ready(&mut s);
        }
        self.inner.ready.as_fd()
    }
}

impl fmt::Debug for EventQueue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = self.inner.lock();
        f.debug_struct("EventQueue")
            .field("depth", &self.inner.depth)
            .field("queued", &s.events.len())
            .field("outstanding", &s.outstanding)
            .field("mode", &s.mode)
            .finish()
    }
}

impl EventQueue {
    /// The longest an adaptive dequeue spins before it sleeps unless [`EventQueue::set_adaptive_spin`] says
    /// otherwise: about twice what sleeping and being woken costs on a software transport. A wait longer than
    /// that is cheaper asleep; a longest spin of only one wake-up would let two threads that answer each other
    /// sleep in turns for good, each one's wait as long as the other's wake-up.
    pub const DEFAULT_ADAPTIVE_SPIN: Duration = wait::ADAPTIVE_SPIN_MAX;

    /// This queue's number in the process (from 1; a queue made later never has the number of one dropped).
    pub(crate) fn id(&self) -> u64 {
        self.inner.id
    }

    /// Creates a queue that holds up to `depth` operations in flight or undequeued (ES-API `exs_qcreate(depth)`).
    /// Fails only if the process has no file descriptor left for the queue's readiness descriptor ([`AsFd`]).
    pub fn new(depth: usize) -> std::io::Result<Self> {
        Self::with_mode(depth, WaitMode::default())
    }

    /// Creates a queue with a wait mode.
    pub fn with_mode(depth: usize, mode: WaitMode) -> std::io::Result<Self> {
        let depth = depth.max(1);
        let ready =
            EventFd::from_value_and_flags(0, EfdFlags::EFD_NONBLOCK | EfdFlags::EFD_CLOEXEC)
                .map_err(std::io::Error::from)?;
        Ok(EventQueue {
            inner: Arc::new(EqInner {
                id: NEXT_QUEUE.fetch_add(1, Ordering::Relaxed),
                state: Mutex::new(EqState {
                    events: VecDeque::with_capacity(depth.min(4096)),
                    outstanding: 0,
                    waiters: Vec::new(),
                    sleepers: Default::default(),
                    nudges: 0,
                    ready_set: false,
                    mode,
                    stats: QueueStats::default(),
                    drivers: Vec::new(),
                    pollers: Vec::new(),
                }),
                cond: Condvar::new(),
                depth,
                ready,
                ready_used: AtomicBool::new(false),
                spin: wait::SpinEstimate::new(),
            }),
        })
    }

    /// The queue's depth.
    pub fn depth(&self) -> usize {
        self.inner.depth
    }

    /// Changes how `dequeue` waits.
    pub fn set_wait_mode(&self, mode: WaitMode) {
        self.inner.lock().mode = mode;
    }

    /// The current wait mode.
    pub fn wait_mode(&self) -> WaitMode {
        self.inner.lock().mode
    }

    /// Operations started on this queue and not yet completed.
    pub fn outstanding(&self) -> usize {
        self.inner.lock().outstanding
    }

    /// Events completed and not yet dequeued.
    pub fn len(&self) -> usize {
        self.inner.lock().events.len()
    }

    /// Whether no event waits to be dequeued.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The longest an adaptive dequeue on this queue spins before it sleeps (default
    /// [`EventQueue::DEFAULT_ADAPTIVE_SPIN`]); it spins for about
    /// twice what its recent waits took, within that. `Duration::ZERO` turns the spin off: every dequeue that
    /// finds too few events sleeps at once, the patent's main embodiment. Other wait modes ignore it.
    ///
    /// ```
    /// let q = exs::EventQueue::new(64)?;
    /// q.set_adaptive_spin(std::time::Duration::ZERO); // sleep at once: no CPU spent waiting
    /// # Ok::<(), std::io::Error>(())
    /// ```
    pub fn set_adaptive_spin(&self, max: Duration) {
        self.inner.spin.set_max(max);
    }

    /// Counters.
    pub fn stats(&self) -> QueueStats {
        self.inner.lock().stats
    }

    /// Takes up to `max` events, waiting for at least `min` of them until `timeout` (None: forever).
    ///
    /// Returns how many events were appended to `out`. If the timeout passes with fewer than `min` events, the
    /// events that did arrive are returned (`Ok` with fewer than `min`), or [`DequeueError::TimedOut`] when none did.
    /// ES-API `exs_qdequeue(q, evts, -min, timeout)`.
    pub fn dequeue(
        &self,
        out: &mut Vec<Event>,
        min: usize,
        max: usize,
        timeout: Option<Duration>,
    ) -> Result<usize, DequeueError> {
        if max == 0 {
            return Err(DequeueError::Invalid("max must be at least 1"));
        }
        if min > max {
            return Err(DequeueError::Invalid("min must not exceed max"));
        }
        // More than the queue can ever hold at once would never come (review finding: the wait slept for ever,
        // and the events it did not take filled the queue for every other caller).
        if min > self.depth() {
            return Err(DequeueError::Invalid(
                "min must not exceed the queue's depth",
            ));
        }
        // The adaptive and blocking waits read the clock only once the events already queued are not enough.
        let mode = self.inner.lock().mode;
        let got = match mode {
            WaitMode::Adaptive { spin } => self.dequeue_adaptive(out, min, max, timeout, spin),
            WaitMode::Block => self.dequeue_blocking(out, min, max, timeout),
            // The clock is read only for a timeout.
            WaitMode::BusyPoll => self.dequeue_busy(
                out,
                min,
                max,
                timeout.and_then(|t| crate::config::deadline(Instant::now(), Some(t))),
            ),
        }?;
        if got == 0 && min > 0 {
            return Err(DequeueError::TimedOut);
        }
        Ok(got)
    }

    /// Waits for one event.
    pub fn next(&self, timeout: Option<Duration>) -> Result<Event, DequeueError> {
        let mut v = Vec::with_capacity(1);
        self.dequeue(&mut v, 1, 1, timeout)?;
        v.pop().ok_or(DequeueError::TimedOut)
    }

    /// Takes whatever is queued, without waiting.
    pub fn poll(&self, out: &mut Vec<Event>, max: usize) -> usize {
        let mut s = self.inner.lock();
        let n = drain(&mut s, out, max);
        self.inner.sync_ready(&mut s);
        n
    }

    /// Waits until every outstanding operation has completed (the adaptive completion wait's default count: all still
    /// expected), and returns their events. `timeout` bounds the whole wait: when it passes, the events that came
    /// are returned (fewer than the operations; [`DequeueError::TimedOut`] if none came). Operations started on the
    /// queue meanwhile are waited for too.
    pub fn wait_all(&self, timeout: Option<Duration>) -> Result<Vec<Event>, DequeueError> {
        let deadline = crate::config::deadline(Instant::now(), timeout);
        let mut out = Vec::new();
        loop {
            let (queued, outstanding) = {
                let s = self.inner.lock();
                (s.events.len(), s.outstanding)
            };
            let want = queued + outstanding;
            if want == 0 {
                return Ok(out);
            }
            let left = deadline.map(|d| d.saturating_duration_since(Instant::now()));
            // A slice at a time: an operation counted above may be refused as it starts (its slot given back,
            // with no event), and the count is looked at again. Not on a simulated fabric driven from here: its
            // wait reports a world that can deliver nothing more only when it has no end of its own.
            let wait = match self.has_drivers() {
                true => left,
                false => Some(left.map_or(WAIT_ALL_RECHECK, |l| l.min(WAIT_ALL_RECHECK))),
            };
            // A zero wait still takes what is queued.
            match self.dequeue(&mut out, want, want, wait) {
                Ok(_) | Err(DequeueError::TimedOut) => {}
                // Events taken before the failure (a simulated fabric that can deliver nothing more) are the
                // caller's: never dropped.
                Err(e) if out.is_empty() => return Err(e),
                Err(_) => return Ok(out),
            }
            if deadline.is_some_and(|d| Instant::now() >= d) {
                return match out.is_empty() {
                    true => Err(DequeueError::TimedOut),
                    false => Ok(out),
                };
            }
        }
    }

    /// Reserves a slot for an operation that will complete here.
    pub(crate) fn reserve(
        &self,
        kind: EventKind,
        context: u64,
        socket: SocketId,
    ) -> Result<Ticket, QueueFull> {
        let mut s = self.inner.lock();
        if s.outstanding + s.events.len() >= self.inner.depth {
            return Err(QueueFull {
                depth: self.inner.depth,
            });
        }
        s.outstanding += 1;
        Ok(Ticket {
            eq: Some(Arc::clone(&self.inner)),
            hook: None,
            kind,
            context,
            socket,
        })
    }

    /// The threaded context reporting here, when there is exactly one (a stream's queue).
    #[cfg_attr(not(feature = "tokio"), allow(dead_code))]
    pub(crate) fn threaded_context(&self) -> Option<Arc<dyn Poller>> {
        let mut p = self.pollers();
        (p.len() == 1 && !self.has_drivers()).then(|| p.remove(0))
    }

    fn pollers(&self) -> Pollers {
        let mut s = self.inner.lock();
        s.pollers.retain(|w| w.strong_count() > 0);
        s.pollers.iter().filter_map(Weak::upgrade).collect()
    }

    /// Busy polling: drives the threaded contexts reporting here from this thread. True if any progressed.
    fn poll_contexts(&self) -> bool {
        let pollers = self.pollers();
        let mut any = false;
        for p in pollers {
            any |= p.poll_progress();
        }
        any
    }

    /// Registers a threaded context that a busy-polling dequeue drives itself.
    pub(crate) fn add_poller(&self, poller: &Arc<dyn Poller>) {
        let mut s = self.inner.lock();
        let weak = Arc::downgrade(poller);
        if !s.pollers.iter().any(|w| w.ptr_eq(&weak)) {
            s.pollers.push(weak);
        }
    }

    /// Registers a manual-progress driver (simulated fabric) with this queue.
    pub(crate) fn add_driver(&self, driver: &Arc<dyn Driver>) {
        let mut s = self.inner.lock();
        let weak = Arc::downgrade(driver);
        if !s.drivers.iter().any(|w| w.ptr_eq(&weak)) {
            s.drivers.push(weak);
        }
    }
}

impl Follower for EqInner {
    fn nudge(&self) {
        EqInner::nudge(self);
    }
}

impl EqInner {
    fn lock(&self) -> MutexGuard<'_, EqState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn complete(&self, event: Event) {
        let mut s = self.lock();
        s.outstanding = s.outstanding.saturating_sub(1);
        s.events.push_back(event);
        self.sync_ready(&mut s);
        // Seed 004: wake a sleeper only once the count it waits for has arrived. Every sleeper has its own count,
        // so one waiter's count never hides another's.
        let len = s.events.len();
        let wake_cond = s.waiters.iter().any(|&n| len >= n);
        let wake_fds = s.sleepers.due(len);
        if wake_cond || !wake_fds.is_empty() {
            s.stats.wakeups += 1;
        }
        drop(s);
        sleepers::wake(wake_fds);
        if wake_cond {
            self.cond.notify_all();
        }
    }

    /// A context's leader let go: threads that follow it retry leading.
    pub(crate) fn nudge(&self) {
        let mut s = self.lock();
        s.nudges = s.nudges.wrapping_add(1);
        let fds = s.sleepers.all();
        drop(s);
        sleepers::wake(fds);
        self.cond.notify_all();
    }

    /// Keeps the application's descriptor readable exactly while events are queued (level-triggered, as epoll,
    /// mio and tokio's `AsyncFd` expect). Called under the state lock after every change of `events`.
    fn sync_ready(&self, s: &mut EqState) {
        if !self.ready_used.load(Ordering::Relaxed) {
            return;
        }
        let fd = &self.ready;
        match (s.events.is_empty(), s.ready_set) {
            (false, false) => {
                let _ = fd.write(1);
                s.ready_set = true;
            }
            (true, true) => {
                let _ = fd.read();
                s.ready_set = false;
            }
            _ => {}
        }
    }
}

fn drain(s: &mut EqState, out: &mut Vec<Event>, max: usize) -> usize {
    let n = s.events.len().min(max);
    if n == 0 {
        s.stats.empty_polls += 1;
        return 0;
    }
    out.extend(s.events.drain(..n));
    s.stats.dequeued += n as u64;
    n
}

pub(crate) use ticket::Ticket;

mod sleepers;
mod ticket;
mod wait;
#[cfg_attr(not(feature = "tokio"), allow(unused_imports))]
pub(crate) use wait::AsyncWait;

#[cfg(test)]
mod tests;

//! Who makes progress, and who sleeps on the transport.
//!
//! The protocol moves whenever some thread holds the engine and polls the transport. Which thread that is decides
//! what every operation costs on a machine with few cores, so the rules are:
//!
//! 1. **An API call never wakes anybody** just because it posted work: posting does not block, and the completion
//!    will make the transport's wait descriptor readable for whoever sleeps on it. It wakes a sleeper only when it
//!    moved the earliest timer before that sleeper's wake-up time ([`Shared::after_call`]).
//! 2. **The thread that waits does the work.** A dequeue that has to sleep first tries to become the *leader* of
//!    each context reporting to its queue: the leader runs the protocol itself, arms the transport and sleeps on
//!    the transport's wait descriptor in its own `ppoll`, so a completion costs one wake-up (this thread's), not
//!    two (a progress thread's, then a hand-off). One thread leads a context at a time; others wait on their
//!    queue for the events the leader produces, and are nudged when the leader lets go so one of them leads next.
//! 3. **The progress thread is the fallback.** It leads only when no application thread has waited for a while
//!    ([`STANDBY`]): then it answers adverts and runs timers while the application computes. While applications
//!    lead, it stands aside: it checks back after [`STANDBY`], backing off to sleeping until asked (a leader that
//!    lets go then wakes it once). When an application thread wants to lead while the progress thread holds the
//!    transport, it asks for a hand-over (one wake-up of the progress thread, once per idle period, not per call).
//!
//! This is what UCX (`ucp_worker_arm` + the worker's fd) and rsockets (the caller drives the queue pair, then
//! blocks on the completion channel) do; the seed-004 adaptive wait then acts on completions directly.

use std::os::fd::{AsFd, BorrowedFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};

use nix::poll::{PollFd, PollFlags};
use nix::sys::eventfd::{EfdFlags, EventFd};
use nix::sys::time::TimeSpec;

use crate::context::Shared;
use crate::engine::Engine;
use crate::event::EqInner;
use crate::transport::TransportError;

/// How long after an application thread last led a context the progress thread waits, at least, before it takes
/// over the transport (and how often it checks back while applications lead).
pub(crate) const STANDBY: Duration = Duration::from_millis(1);
/// The most it waits: the standby adapts to how long applications take between two waits (four times their
/// recent gap), so a slow machine (Soft-RoCE under emulation: a millisecond per message) does not hand the
/// transport back and forth on every message.
const STANDBY_MAX: Duration = Duration::from_millis(20);
/// The longest the progress thread checks back while an application leads; beyond it, it sleeps until the
/// leader lets go and wakes it.
const MAX_BACKOFF: Duration = Duration::from_millis(8);
/// Protocol rounds one leader runs before it checks its own queue again (a busy peer cannot keep it forever).
const ROUNDS: usize = 16;

/// A published sleep: nobody sleeps in this role.
const ABSENT: u64 = u64::MAX;
/// A published sleep: sleeping with no timeout.
const FOREVER: u64 = u64::MAX - 1;
/// A published sleep: awake (it will look at the timers before it sleeps again).
const AWAKE: u64 = 0;

/// Counters of a context's progress, for tools and tests.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ProgressStats {
    /// Times the progress thread woke up (from the transport, a timer, a check-back or a kick).
    pub thread_wakeups: u64,
    /// Times an application thread took the lead of the context in a dequeue.
    pub app_leads: u64,
    /// Times an application thread slept on the transport's wait descriptor itself.
    pub app_sleeps: u64,
    /// Times an application thread asked the progress thread to hand the transport over.
    pub handovers: u64,
    /// Times an API call woke a sleeper because it moved a timer earlier.
    pub timer_kicks: u64,
}

#[derive(Debug, Default)]
struct Counters {
    thread_wakeups: AtomicU64,
    app_leads: AtomicU64,
    app_sleeps: AtomicU64,
    handovers: AtomicU64,
    timer_kicks: AtomicU64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Holder {
    Nobody,
    Thread,
    App,
}

#[derive(Debug)]
struct LeadState {
    holder: Holder,
    /// When an application thread last let go.
    last_release: Option<Instant>,
    /// The progress thread sleeps until woken: the next leader to let go wakes it.
    thread_deep: bool,
    /// An application thread waits for the progress thread to hand the transport over.
    handover_asked: bool,
    /// Queues of application threads waiting for the lead.
    followers: Vec<Weak<EqInner>>,
    /// Recent time between an application letting go and leading again (moving average).
    gap: Duration,
}

/// The leadership of one context and the sleepers' wake-up times.
#[derive(Debug)]
pub(crate) struct Lead {
    state: Mutex<LeadState>,
    /// Wakes the thread sleeping on the transport (the leader).
    leader_wake: EventFd,
    /// Wakes the progress thread while it stands aside.
    thread_wake: EventFd,
    epoch: Instant,
    /// When the leader sleeping on the transport wakes (ns after `epoch`), or [`ABSENT`]/[`FOREVER`]/[`AWAKE`].
    leader_sleep: AtomicU64,
    /// When the standing-aside progress thread wakes, likewise.
    thread_sleep: AtomicU64,
    counters: Counters,
}

fn eventfd() -> Result<EventFd, TransportError> {
    EventFd::from_value_and_flags(0, EfdFlags::EFD_NONBLOCK | EfdFlags::EFD_CLOEXEC)
        .map_err(|e| TransportError::os("eventfd", e.into()))
}

impl Lead {
    pub(crate) fn new() -> Result<Lead, TransportError> {
        Ok(Lead {
            state: Mutex::new(LeadState {
                holder: Holder::Nobody,
                last_release: None,
                thread_deep: false,
                handover_asked: false,
                followers: Vec::new(),
                gap: Duration::ZERO,
            }),
            leader_wake: eventfd()?,
            thread_wake: eventfd()?,
            epoch: Instant::now(),
            leader_sleep: AtomicU64::new(ABSENT),
            thread_sleep: AtomicU64::new(ABSENT),
            counters: Counters::default(),
        })
    }

    fn lock(&self) -> MutexGuard<'_, LeadState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn stats(&self) -> ProgressStats {
        let c = &self.counters;
        ProgressStats {
            thread_wakeups: c.thread_wakeups.load(Ordering::Relaxed),
            app_leads: c.app_leads.load(Ordering::Relaxed),
            app_sleeps: c.app_sleeps.load(Ordering::Relaxed),
            handovers: c.handovers.load(Ordering::Relaxed),
            timer_kicks: c.timer_kicks.load(Ordering::Relaxed),
        }
    }

    fn stamp(&self, at: Option<Instant>) -> u64 {
        match at {
            None => FOREVER,
            Some(t) => {
                (t.saturating_duration_since(self.epoch).as_nanos() as u64).clamp(1, FOREVER - 1)
            }
        }
    }

    /// Wakes everyone who might sleep (the context is going away).
    pub(crate) fn wake_all(&self) {
        let _ = self.leader_wake.write(1);
        let _ = self.thread_wake.write(1);
    }

    /// Rule 1: after an API call that moved the earliest timer to `deadline` (under the engine lock), wake the
    /// sleeper whose wake-up time is now too late. A timer may run up to [`MAX_BACKOFF`] late: while an
    /// application thread comes back to wait that often, it runs the timers itself, and no thread is woken.
    pub(crate) fn after_call(&self, deadline: Instant) {
        let d = self.stamp(Some(deadline + MAX_BACKOFF));
        let leader = self.leader_sleep.load(Ordering::SeqCst);
        let thread = self.thread_sleep.load(Ordering::SeqCst);
        let target = if leader != ABSENT {
            (leader != AWAKE && d < leader).then_some(&self.leader_wake)
        } else {
            (thread != AWAKE && thread != ABSENT && d < thread).then_some(&self.thread_wake)
        };
        if let Some(fd) = target {
            self.counters.timer_kicks.fetch_add(1, Ordering::Relaxed);
            let _ = fd.write(1);
        }
    }

    /// An application thread asks to lead. `false`: somebody else leads; `follower` is nudged when they let go.
    pub(crate) fn try_lead_app(&self, follower: &Arc<EqInner>) -> bool {
        let mut s = self.lock();
        if let Some(t) = s.last_release {
            let gap = t.elapsed().min(STANDBY_MAX);
            s.gap = (s.gap * 3 + gap) / 4;
        }
        match s.holder {
            Holder::Nobody => {
                s.holder = Holder::App;
                self.counters.app_leads.fetch_add(1, Ordering::Relaxed);
                true
            }
            holder => {
                if holder == Holder::Thread && !s.handover_asked {
                    s.handover_asked = true;
                    self.counters.handovers.fetch_add(1, Ordering::Relaxed);
                    let _ = self.leader_wake.write(1);
                }
                let weak = Arc::downgrade(follower);
                if !s.followers.iter().any(|w| w.ptr_eq(&weak)) {
                    s.followers.push(weak);
                }
                false
            }
        }
    }

    /// The leader lets go: followers are nudged (one of them leads next), and a progress thread that sleeps until
    /// asked is woken to take over.
    fn release(&self, by_app: bool) {
        let followers = {
            let mut s = self.lock();
            s.holder = Holder::Nobody;
            // A hand-over counts as application activity: the progress thread stands aside from here on.
            let handed_over = std::mem::take(&mut s.handover_asked);
            if by_app || handed_over {
                s.last_release = Some(Instant::now());
                // Followers may have gone (their events came through the leader): the thread checks back either way.
                if s.thread_deep {
                    s.thread_deep = false;
                    let _ = self.thread_wake.write(1);
                }
            }
            std::mem::take(&mut s.followers)
        };
        self.leader_sleep.store(ABSENT, Ordering::SeqCst);
        for f in followers.iter().filter_map(Weak::upgrade) {
            f.nudge();
        }
    }

    /// A busy-polling application thread stopped polling: it counts as a leader letting go (the progress thread
    /// stands aside for a while rather than arming the transport between two dequeues).
    pub(crate) fn busy_poll_ended(&self) {
        let mut s = self.lock();
        s.last_release = Some(Instant::now());
    }

    pub(crate) fn release_app(&self) {
        self.release(true);
    }

    /// The leader's wake-up: marks it awake, and drains its eventfd if that is what woke it (no system call
    /// otherwise).
    pub(crate) fn woke(&self, kicked: bool) {
        self.leader_sleep.store(AWAKE, Ordering::SeqCst);
        if kicked {
            let _ = self.leader_wake.read();
        }
    }

    pub(crate) fn count_app_sleep(&self) {
        self.counters.app_sleeps.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn leader_wake_fd(&self) -> BorrowedFd<'_> {
        self.leader_wake.as_fd()
    }
}

/// Runs the protocol until nothing more happens now (bounded), then arms the transport. `Some(deadline)`: the
/// caller may sleep on the wait descriptor until then (published as the leader's wake-up time); `None`: events
/// slipped in before arming, or the round produced what the caller waits for (`satisfied`): look again.
pub(crate) fn prepare_sleep(
    lead: &Lead,
    engine: &mut Engine,
    satisfied: &dyn Fn() -> bool,
) -> Option<Option<Instant>> {
    // One round, then arm: arming reports anything that arrived meanwhile (another round would only cost the
    // transport polls of finding nothing, system calls on software providers). A round that produced the events
    // the caller waits for does not arm: it would not sleep (issue 12: on libfabric tcp `fi_trywait` is three
    // system calls, paid after every wake-up of a blocking ping-pong).
    engine.progress();
    if satisfied() {
        return None;
    }
    match engine.arm() {
        Ok(true) => {}
        Ok(false) => return None,
        Err(err) => {
            tracing::error!(%err, "arming the completion queue failed");
            return Some(Some(Instant::now() + Duration::from_millis(10)));
        }
    }
    let deadline = engine.next_deadline_real();
    lead.leader_sleep
        .store(lead.stamp(deadline), Ordering::SeqCst);
    Some(deadline)
}

/// `ppoll` on `fds` until `until` (None: no timeout). Interrupted or failed polls simply return.
pub(crate) fn sleep_on(fds: &mut [PollFd<'_>], until: Option<Instant>) {
    let timeout = until.map(|t| {
        TimeSpec::from_duration(
            t.saturating_duration_since(Instant::now())
                .min(Duration::from_secs(60)),
        )
    });
    if let Err(err) = nix::poll::ppoll(fds, timeout, None) {
        if err != nix::errno::Errno::EINTR {
            tracing::error!(%err, "poll failed");
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}

/// Whether a polled descriptor was reported readable.
pub(crate) fn readable(fd: &PollFd<'_>) -> bool {
    fd.revents().is_some_and(|r| r.contains(PollFlags::POLLIN))
}

/// What the progress thread does next.
enum Next {
    /// Lead: sleep on the transport.
    Lead,
    /// Stand aside, checking back after this long (and running due timers).
    Standby(Duration),
    /// Stand aside until the leader lets go.
    Deep,
}

/// The progress thread: the fallback that moves the protocol while no application thread waits.
pub(crate) fn thread(shared: Arc<Shared>) {
    let lead = &shared.lead;
    let wait_fd = shared
        .wait_fd
        .as_ref()
        .expect("thread mode has a wait descriptor");
    let mut backoff = STANDBY;
    loop {
        if shared.stopping() {
            return;
        }
        if shared.busy_polled() {
            stand_back_for_busy_pollers(&shared);
            continue;
        }
        let next = {
            let mut s = lead.lock();
            match s.holder {
                Holder::Nobody => {
                    let since = s.last_release.map(|t| t.elapsed());
                    let standby = (s.gap * 4).clamp(STANDBY, STANDBY_MAX);
                    match since {
                        Some(since) if since < standby => Next::Standby(standby - since),
                        _ => {
                            s.holder = Holder::Thread;
                            Next::Lead
                        }
                    }
                }
                // An application has held the lead for a long while (blocked in a dequeue): sleep until it lets
                // go (it then wakes this thread) rather than checking back.
                Holder::App
                    if backoff >= MAX_BACKOFF
                        && s.last_release.is_none_or(|t| t.elapsed() >= MAX_BACKOFF) =>
                {
                    s.thread_deep = true;
                    Next::Deep
                }
                // Applications come and go (a ping-pong): check back, at most every MAX_BACKOFF.
                Holder::App => {
                    let b = backoff;
                    backoff = (backoff * 2).min(MAX_BACKOFF);
                    Next::Standby(b)
                }
                Holder::Thread => Next::Lead,
            }
        };
        match next {
            Next::Lead => {
                backoff = STANDBY;
                lead.thread_sleep.store(ABSENT, Ordering::SeqCst);
                lead_as_thread(&shared, wait_fd.as_fd());
            }
            Next::Standby(t) => standby(&shared, t),
            Next::Deep => {
                lead.thread_sleep.store(FOREVER, Ordering::SeqCst);
                sleep_thread(&shared, None);
                backoff = STANDBY;
            }
        }
    }
}

fn sleep_thread(shared: &Shared, until: Option<Instant>) {
    let lead = &shared.lead;
    let mut fds = [PollFd::new(lead.thread_wake.as_fd(), PollFlags::POLLIN)];
    sleep_on(&mut fds, until);
    lead.thread_sleep.store(AWAKE, Ordering::SeqCst);
    if readable(&fds[0]) {
        let _ = lead.thread_wake.read();
    }
    lead.counters.thread_wakeups.fetch_add(1, Ordering::Relaxed);
    lead.lock().thread_deep = false;
}

/// The progress thread holds the transport until an application thread asks for it or the context stops.
fn lead_as_thread(shared: &Shared, wait_fd: BorrowedFd<'_>) {
    let lead = &shared.lead;
    loop {
        if shared.stopping() || lead.lock().handover_asked || shared.busy_polled() {
            lead.release(false);
            return;
        }
        let until = {
            let mut e = shared.lock();
            match prepare_sleep(lead, &mut e, &|| false) {
                Some(until) => until,
                None => continue,
            }
        };
        let mut fds = [
            PollFd::new(wait_fd, PollFlags::POLLIN),
            PollFd::new(lead.leader_wake.as_fd(), PollFlags::POLLIN),
        ];
        sleep_on(&mut fds, until);
        let kicked = readable(&fds[1]);
        lead.woke(kicked);
        lead.counters.thread_wakeups.fetch_add(1, Ordering::Relaxed);
    }
}

/// An application thread busy-polls this context: it handles completions, timers and (every few hundred rounds)
/// connection events itself, so this thread stays out of its way: no arming (no completion-channel wake-ups), no
/// rounds (they would only take the engine lock from the poller), and it checks back every [`MAX_BACKOFF`] whether
/// the polling has ended, or at once when woken. Issue 12: checking back every millisecond and running a round
/// cost 0.02-0.03 wake-ups per message on each side of a busy ping-pong on libfabric tcp, two context switches
/// each (0.08-0.23 per round trip in all, against the target of 0.2), and it woke for delayed-acknowledgment
/// deadlines the reply had already cancelled.
fn stand_back_for_busy_pollers(shared: &Shared) {
    let until = Instant::now() + MAX_BACKOFF;
    shared
        .lead
        .thread_sleep
        .store(shared.lead.stamp(Some(until)), Ordering::SeqCst);
    sleep_thread(shared, Some(until));
}

/// Stands aside for `t`: nobody sleeps on the transport meanwhile, so run what is due now (bounded) and wake for
/// the earliest timer if it comes first.
fn standby(shared: &Shared, t: Duration) {
    let lead = &shared.lead;
    let until = {
        let mut e = shared.lock();
        let mut rounds = 0;
        while e.progress() && rounds < ROUNDS {
            rounds += 1;
        }
        let until = Instant::now() + t;
        let until = match e.next_deadline_real() {
            Some(d) => until.min(d),
            _ => until,
        };
        lead.thread_sleep
            .store(lead.stamp(Some(until)), Ordering::SeqCst);
        until
    };
    sleep_thread(shared, Some(until));
}

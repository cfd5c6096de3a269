//! Who leads a context (sleeps on its transport), who follows, and when each sleeper wakes: the rules are in
//! [`crate::progress`]. Below the engine: it knows queues only as [`Follower`]s and contexts only as [`Poller`]s.

use std::os::fd::{AsFd, BorrowedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};

use nix::poll::{PollFd, PollFlags};
use nix::sys::eventfd::{EfdFlags, EventFd};
use nix::sys::time::TimeSpec;

use crate::transport::TransportError;

/// How long after an application thread last led a context the progress thread waits, at least, before it takes
/// over the transport (and how often it checks back while applications lead).
pub(crate) const STANDBY: Duration = Duration::from_millis(1);
/// The most it waits: the standby adapts to how long applications take between two waits (four times their
/// recent gap), so a slow machine (Soft-RoCE under emulation: a millisecond per message) does not hand the
/// transport back and forth on every message.
pub(super) const STANDBY_MAX: Duration = Duration::from_millis(20);
/// The longest the progress thread checks back while an application leads; beyond it, it sleeps until the
/// leader lets go and wakes it. Also how long a busy poller counts as polling after its last dequeue (see
/// [`Lead::busy_lingers`]).
pub(super) const MAX_BACKOFF: Duration = Duration::from_millis(8);
/// Protocol rounds one leader runs before it checks its own queue again (a busy peer cannot keep it forever).
pub(super) const ROUNDS: usize = 16;

/// A published sleep: nobody sleeps in this role.
pub(super) const ABSENT: u64 = u64::MAX;
/// A published sleep: sleeping with no timeout.
pub(super) const FOREVER: u64 = u64::MAX - 1;
/// A published sleep: awake (it will look at the timers before it sleeps again).
pub(super) const AWAKE: u64 = 0;

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
    /// Times an API call, or a round of a thread that does not lead, woke a sleeper because it set a timer earlier
    /// than the sleeper's wake-up.
    pub timer_kicks: u64,
    /// Times an async task took the lead of the context while it waited (feature `tokio`).
    pub task_leads: u64,
    /// Times the progress thread took the lead from a task that had stopped being polled while it led.
    pub task_steals: u64,
}

#[derive(Debug, Default)]
pub(super) struct Counters {
    pub(super) thread_wakeups: AtomicU64,
    pub(super) app_leads: AtomicU64,
    pub(super) app_sleeps: AtomicU64,
    pub(super) handovers: AtomicU64,
    pub(super) timer_kicks: AtomicU64,
    pub(super) task_leads: AtomicU64,
    pub(super) task_steals: AtomicU64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Holder {
    Nobody,
    Thread,
    App,
}

#[derive(Debug)]
pub(super) struct LeadState {
    pub(super) holder: Holder,
    /// When an application thread last let go.
    pub(super) last_release: Option<Instant>,
    /// The progress thread sleeps until woken: the next leader to let go wakes it.
    pub(super) thread_deep: bool,
    /// The last application to let go left sends or a shutdown in flight: while applications come and go, the
    /// progress thread checks back every [`STANDBY`] at most (see `progress::check_back`).
    pub(super) outgoing: bool,
    /// An application thread waits for the progress thread to hand the transport over.
    pub(super) handover_asked: bool,
    /// Queues of application threads waiting for the lead.
    pub(super) followers: Vec<Weak<dyn Follower>>,
    /// Recent time between an application letting go and leading again (moving average).
    pub(super) gap: Duration,
    /// When a busy-polling application thread last stopped polling.
    pub(super) last_busy_end: Option<Instant>,
    /// The application holder is a task on a reactor, which may stop being polled while it leads (see
    /// [`Lead::steal_from_stale_task`]).
    pub(super) task: bool,
    /// Counts the leads taken: a task leads while this is still the term it was given.
    pub(super) term: u64,
    /// Since when the leading task has looked stalled (see [`Lead::steal_from_stale_task`]).
    pub(super) suspect_since: Option<Instant>,
    /// The progress thread's last look at the leading task was a sleep on its descriptors.
    pub(super) watched_deep: bool,
}

/// The leadership of one context and the sleepers' wake-up times.
#[derive(Debug)]
pub(crate) struct Lead {
    pub(super) state: Mutex<LeadState>,
    /// Wakes the thread sleeping on the transport (the leader).
    pub(super) leader_wake: EventFd,
    /// Wakes the progress thread while it stands aside.
    pub(super) thread_wake: EventFd,
    pub(super) epoch: Instant,
    /// When the leader sleeping on the transport wakes (ns after `epoch`), or [`ABSENT`]/[`FOREVER`]/[`AWAKE`].
    pub(super) leader_sleep: AtomicU64,
    /// When the standing-aside progress thread wakes, likewise.
    pub(super) thread_sleep: AtomicU64,
    /// The progress thread stands back from adaptive waits' spins (its sleep is not a check-back on a leader).
    pub(super) thread_spin_stand_back: AtomicBool,
    /// Bumped each time a leading task runs the protocol; with it, the last value the progress thread saw.
    pub(super) task_beat: AtomicU64,
    pub(super) task_beat_seen: AtomicU64,
    /// The reactor's registration of the descriptors a leading task sleeps on, one per context, kept by
    /// `crate::tokio` (only the leader polls it).
    pub(crate) task_fds: Mutex<Option<Arc<dyn std::any::Any + Send + Sync>>>,
    pub(super) counters: Counters,
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
                outgoing: false,
                handover_asked: false,
                followers: Vec::new(),
                gap: Duration::ZERO,
                last_busy_end: None,
                task: false,
                term: 0,
                suspect_since: None,
                watched_deep: false,
            }),
            leader_wake: eventfd()?,
            thread_wake: eventfd()?,
            epoch: Instant::now(),
            leader_sleep: AtomicU64::new(ABSENT),
            thread_sleep: AtomicU64::new(ABSENT),
            thread_spin_stand_back: AtomicBool::new(false),
            task_beat: AtomicU64::new(0),
            task_beat_seen: AtomicU64::new(0),
            task_fds: Mutex::new(None),
            counters: Counters::default(),
        })
    }

    pub(super) fn lock(&self) -> MutexGuard<'_, LeadState> {
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
            task_leads: c.task_leads.load(Ordering::Relaxed),
            task_steals: c.task_steals.load(Ordering::Relaxed),
        }
    }

    pub(super) fn stamp(&self, at: Option<Instant>) -> u64 {
        match at {
            None => FOREVER,
            Some(t) => {
                (t.saturating_duration_since(self.epoch).as_nanos() as u64).clamp(1, FOREVER - 1)
            }
        }
    }

    /// Whether the progress thread sleeps, standing aside, until later than `d` from now.
    fn thread_sleeps_beyond(&self, d: Duration) -> bool {
        match self.thread_sleep.load(Ordering::SeqCst) {
            ABSENT | AWAKE => false,
            FOREVER => true,
            at => at > self.stamp(Some(Instant::now() + d)),
        }
    }

    /// Wakes everyone who might sleep (the context is going away).
    pub(crate) fn wake_all(&self) {
        let _ = self.leader_wake.write(1);
        let _ = self.thread_wake.write(1);
    }

    /// Rule 1: after an API call that set a timer for `deadline` (under the engine lock), wake the sleeper whose
    /// wake-up time is now too late. A timer may run up to [`MAX_BACKOFF`] late: while an
    /// application thread comes back to wait that often, it runs the timers itself, and no thread is woken.
    /// `deadline` is asked for only when somebody sleeps (it reads the clock).
    pub(crate) fn after_call(&self, deadline: impl FnOnce() -> Option<Instant>) {
        let leader = self.leader_sleep.load(Ordering::SeqCst);
        let thread = self.thread_sleep.load(Ordering::SeqCst);
        let asleep = |t| t != ABSENT && t != AWAKE;
        if !asleep(leader) && !asleep(thread) {
            return;
        }
        let Some(deadline) = deadline() else {
            return;
        };
        let d = self.stamp(Some(deadline + MAX_BACKOFF));
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
    pub(crate) fn try_lead_app(&self, follower: Arc<dyn Follower>) -> bool {
        self.try_lead(follower, false).is_some()
    }

    pub(super) fn try_lead(&self, follower: Arc<dyn Follower>, task: bool) -> Option<u64> {
        let mut s = self.lock();
        if let Some(t) = s.last_release {
            let gap = t.elapsed().min(STANDBY_MAX);
            s.gap = (s.gap * 3 + gap) / 4;
        }
        match s.holder {
            Holder::Nobody => {
                s.holder = Holder::App;
                s.task = task;
                s.suspect_since = None;
                s.watched_deep = false;
                s.term = s.term.wrapping_add(1);
                let counter = if task {
                    &self.counters.task_leads
                } else {
                    &self.counters.app_leads
                };
                counter.fetch_add(1, Ordering::Relaxed);
                Some(s.term)
            }
            holder => {
                if holder == Holder::Thread && !s.handover_asked {
                    s.handover_asked = true;
                    self.counters.handovers.fetch_add(1, Ordering::Relaxed);
                    let _ = self.leader_wake.write(1);
                }
                let weak = Arc::downgrade(&follower);
                if !s.followers.iter().any(|w| w.ptr_eq(&weak)) {
                    // Followers gone meanwhile (short-lived queues) leave: the list, and this look through it,
                    // must not grow while one holder keeps the lead.
                    s.followers.retain(|w| w.strong_count() > 0);
                    s.followers.push(weak);
                }
                None
            }
        }
    }

    /// The leader lets go: followers are nudged (one of them leads next), and a progress thread that sleeps until
    /// asked is woken to take over.
    /// `outgoing`: an application lets go with sends or a shutdown in flight (see [`LeadState::outgoing`]).
    pub(super) fn release(&self, by_app: bool, outgoing: bool) {
        self.release_locked(self.lock(), by_app, outgoing);
    }

    /// [`Lead::release`] with the lead's state already locked (a check and the release in one hold).
    pub(super) fn release_locked(
        &self,
        mut s: MutexGuard<'_, LeadState>,
        by_app: bool,
        outgoing: bool,
    ) {
        if by_app {
            s.outgoing = outgoing;
            // A check-back scheduled while the application before let go with nothing in flight may be far: these
            // sends must not wait for it (see `progress::check_back`). Once: the thread's next check-back is near.
            // Not a stand-back from spins: spinners come back within microseconds, and waking the thread at each
            // release of a pump that spins between its waits would cost a wake-up per message.
            if outgoing
                && !s.thread_deep
                && !self.thread_spin_stand_back.load(Ordering::SeqCst)
                && self.thread_sleeps_beyond(STANDBY)
            {
                let _ = self.thread_wake.write(1);
            }
        }
        s.holder = Holder::Nobody;
        s.task = false;
        s.suspect_since = None;
        s.watched_deep = false;
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
        let followers = std::mem::take(&mut s.followers);
        // Under the lock: a leader that follows (its `try_lead` takes the lock) publishes its own time after this.
        self.leader_sleep.store(ABSENT, Ordering::SeqCst);
        drop(s);
        nudge(followers);
    }

    /// A busy-polling application thread stopped polling: it counts as a leader letting go (the progress thread
    /// stands aside for a while rather than arming the transport between two dequeues).
    /// `outgoing`: it stopped with sends or a shutdown in flight (see [`LeadState::outgoing`]).
    pub(crate) fn busy_poll_ended(&self, lingers: bool, outgoing: bool) {
        let mut s = self.lock();
        let now = Instant::now();
        s.last_release = Some(now);
        s.outgoing = outgoing;
        if lingers {
            s.last_busy_end = Some(now);
        }
    }

    /// Until when a busy-polling application counts as still polling after its last dequeue ended
    /// ([`MAX_BACKOFF`] after it), if that is still to come: between two dequeues of a busy ping-pong it posts
    /// and sends, and a progress thread that took the transport (or ran rounds) in that gap would only take the
    /// engine lock from it and arm the completion channel, whose every completion then wakes a thread.
    pub(crate) fn busy_lingers(&self) -> Option<Instant> {
        let end = self.lock().last_busy_end? + MAX_BACKOFF;
        (end > Instant::now()).then_some(end)
    }

    /// An application thread lets go; `outgoing`: with sends or a shutdown in flight.
    pub(crate) fn release_app(&self, outgoing: bool) {
        self.release(true, outgoing);
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

/// Nudges the threads and tasks that followed a leader who let go (or lost the lead): one of them leads next.
pub(super) fn nudge(followers: Vec<Weak<dyn Follower>>) {
    for f in followers.iter().filter_map(Weak::upgrade) {
        f.nudge();
    }
}

/// An event queue whose waiting thread follows a context's leader: nudged when the leader lets go, so that it
/// retries leading.
pub(crate) trait Follower: Send + Sync {
    /// The leader let go.
    fn nudge(&self);
}

/// Something that can move the fabric forward when nobody else does (the simulated fabric's manual mode).
pub(crate) trait Driver: Send + Sync {
    /// Makes progress; returns false when nothing can happen any more.
    fn drive(&self) -> bool;
}

/// A threaded context that a waiting application thread drives itself (see [`crate::progress`]): busy polling
/// runs its protocol without sleeping; a blocking wait leads it (runs it, arms it, sleeps on its descriptor).
pub(crate) trait Poller: Send + Sync {
    /// A thread starts (`true`) or stops busy-polling this context; `lingers`: it counts as polling for a while
    /// after it stops (see [`Lead::busy_lingers`]).
    fn set_busy(&self, on: bool, lingers: bool);
    /// Makes whatever progress is possible without blocking; false if nothing happened (or the context was busy).
    fn poll_progress(&self) -> bool;
    /// Tries to become the context's leader; when another thread leads, `follower` is nudged once it lets go.
    fn try_lead(&self, follower: Arc<dyn Follower>) -> bool;
    /// The leader runs the protocol and arms the transport: `Some(wake-up time)` to sleep, `None` to look again
    /// (events slipped in, or `satisfied` holds after the round: the caller has what it waits for).
    fn prepare_sleep(&self, satisfied: &dyn Fn() -> bool) -> Option<Option<Instant>>;
    /// The descriptors a leader sleeps on (the transport's, and its wake-up eventfd).
    fn sleep_fds(&self) -> [BorrowedFd<'_>; 2];
    /// The leader woke up; `kicked`: its wake-up eventfd was readable.
    fn woke(&self, kicked: bool);
    /// The leader lets go.
    fn release(&self);
    /// Whether the context has sends or a shutdown in flight (see [`LeadState::outgoing`]).
    fn outgoing(&self) -> bool {
        false
    }
    /// Counts a leader's sleep.
    fn count_sleep(&self);
    /// The lead of a task that sleeps on the transport through its reactor: see [`Lead::try_lead_task`] and the
    /// methods after it.
    #[cfg_attr(not(feature = "tokio"), allow(dead_code))]
    fn lead(&self) -> Option<&Lead> {
        None
    }
}

//! Who makes progress, and who sleeps on the transport.
//!
//! The protocol moves whenever some thread holds the engine and polls the transport. Which thread that is decides
//! what every operation costs on a machine with few cores, so the rules are:
//!
//! 1. **An API call never wakes anybody** just because it posted work: posting does not block, and the completion
//!    will make the transport's wait descriptor readable for whoever sleeps on it. It wakes a sleeper only when it
//!    set a timer for earlier than that sleeper's wake-up time ([`Lead::after_call`]).
//! 2. **The thread that waits does the work.** A dequeue that has to sleep first tries to become the *leader* of
//!    each context reporting to its queue: the leader runs the protocol itself, arms the transport and sleeps on
//!    the transport's wait descriptor in its own `ppoll`, so a completion costs one wake-up (this thread's), not
//!    two (a progress thread's, then a hand-off). One thread leads a context at a time; others wait on their
//!    queue for the events the leader produces, and are nudged when the leader lets go so one of them leads next.
//!    An async task (`crate::tokio`) leads the same way through its reactor; the progress thread takes the lead
//!    back from a task that stops being polled while it leads ([`Lead::steal_from_stale_task`]).
//! 3. **The progress thread is the fallback.** It leads only when no application thread has waited for a while
//!    ([`STANDBY`]): then it answers adverts and runs timers while the application computes. While applications
//!    lead, it stands aside: it checks back after [`STANDBY`], backing off to sleeping until asked (a leader that
//!    lets go then wakes it once). When an application thread wants to lead while the progress thread holds the
//!    transport, it asks for a hand-over (one wake-up of the progress thread, once per idle period, not per call).
//!
//! This is what UCX (`ucp_worker_arm` + the worker's fd) and rsockets (the caller drives the queue pair, then
//! blocks on the completion channel) do; the seed-004 adaptive wait then acts on completions directly.

use std::os::fd::OwnedFd;
use std::os::fd::{AsFd, BorrowedFd};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use nix::poll::{PollFd, PollFlags};

use crate::engine::Engine;
use crate::lock::EngineGuard;

pub(crate) mod lead;
mod task;

pub use lead::ProgressStats;
pub(crate) use lead::{readable, sleep_on, Driver, Follower, Lead, Poller, STANDBY};
use lead::{Holder, LeadState, ABSENT, AWAKE, FOREVER, MAX_BACKOFF, ROUNDS, STANDBY_MAX};

/// What a context's threads share: the engine and its leadership.
pub(crate) struct Shared {
    pub(crate) engine: Mutex<Engine>,
    /// Who leads (sleeps on the transport) and when each sleeper wakes: see the module docs.
    pub(crate) lead: Lead,
    pub(crate) stop: AtomicBool,
    /// Application threads busy-polling this context right now (the adaptive wait's spins included).
    pub(crate) busy: AtomicUsize,
    /// Of those, the ones in a busy-polling dequeue (that count as polling for a while after it ends, see
    /// [`Lead::busy_lingers`]); the others spin for a short while before they sleep or return.
    pub(crate) lingering: AtomicUsize,
    pub(crate) wait_fd: Option<OwnedFd>,
    pub(crate) driver: Option<Arc<dyn Driver>>,
}

impl Poller for Shared {
    fn set_busy(&self, on: bool, lingers: bool) {
        // No wake-up either way (a system call per dequeue is what busy polling avoids): a leading progress
        // thread notices at its next wake-up and stops arming; a standing-back one
        // (see `progress::stand_back_for_busy_pollers`) checks back within `progress::MAX_BACKOFF`, or within its
        // backoff (`STANDBY` growing to `MAX_BACKOFF`) while only spins mark the context.
        if on {
            self.busy.fetch_add(1, Ordering::SeqCst);
            if lingers {
                self.lingering.fetch_add(1, Ordering::SeqCst);
            }
        } else {
            self.lead.busy_poll_ended(lingers, self.outgoing());
            if lingers {
                self.lingering.fetch_sub(1, Ordering::SeqCst);
            }
            self.busy.fetch_sub(1, Ordering::SeqCst);
        }
    }

    fn poll_progress(&self) -> bool {
        // Never wait for another thread: if it holds the engine, it is making the progress.
        let Some(mut e) = EngineGuard::try_lock(&self.engine) else {
            return false;
        };
        // One round: the caller polls again if what it waits for is not there yet (another round here would
        // cost a transport poll, a system call on software providers).
        self.reporting_timers(&mut e, Engine::progress_busy)
    }

    fn try_lead(&self, follower: Arc<dyn Follower>) -> bool {
        self.wait_fd.is_some() && self.lead.try_lead_app(follower)
    }

    fn prepare_sleep(&self, satisfied: &dyn Fn() -> bool) -> Option<Option<Instant>> {
        let mut e = self.lock();
        prepare_sleep(&self.lead, &mut e, satisfied)
    }

    fn sleep_fds(&self) -> [std::os::fd::BorrowedFd<'_>; 2] {
        [
            self.wait_fd
                .as_ref()
                .expect("a leader has a wait descriptor")
                .as_fd(),
            self.lead.leader_wake_fd(),
        ]
    }

    fn woke(&self, kicked: bool) {
        self.lead.woke(kicked);
    }

    fn release(&self) {
        self.lead.release_app(self.outgoing());
    }

    fn outgoing(&self) -> bool {
        // A thread holding the engine is running rounds itself: assume work is in flight (the progress thread
        // then only checks back sooner).
        EngineGuard::try_lock(&self.engine).is_none_or(|e| e.outgoing())
    }

    fn count_sleep(&self) {
        self.lead.count_app_sleep();
    }

    fn lead(&self) -> Option<&Lead> {
        self.wait_fd.is_some().then_some(&self.lead)
    }
}

impl Shared {
    pub(crate) fn lock(&self) -> EngineGuard<'_, Engine> {
        EngineGuard::lock(&self.engine)
    }

    /// Runs an API call on the engine. Posting needs no wake-up; only a call that set a timer earlier than the
    /// current sleeper's wake-up time wakes it (see the module docs, rule 1).
    pub(crate) fn call<T>(&self, f: impl FnOnce(&mut Engine) -> T) -> T {
        let mut e = self.lock();
        self.reporting_timers(&mut e, |e| {
            let r = f(e);
            e.drain_done();
            r
        })
    }

    /// Runs `f`, an API call or rounds of a thread that does not lead, then wakes the sleeper if `f` set a timer
    /// earlier than its wake-up time (rule 1). Only what `f` arms is reported: the leader's own rounds set timers
    /// it computed its sleep from, and may have cancelled since (review: reported late, they woke it for
    /// nothing). A round of a thread that does not lead (a busy or spinning dequeue, [`crate::Context::progress`])
    /// sets timers too: a delayed acknowledgment, a held window update (review finding: unreported, they waited
    /// for the leader's own wake-up, the keepalive's 10 s, and the next call forgot them).
    pub(crate) fn reporting_timers<T>(
        &self,
        e: &mut Engine,
        f: impl FnOnce(&mut Engine) -> T,
    ) -> T {
        e.clear_armed();
        let r = f(e);
        if e.armed() {
            self.lead.after_call(|| e.take_armed_real());
        }
        r
    }

    pub(crate) fn stopping(&self) -> bool {
        self.stop.load(Ordering::SeqCst)
    }

    /// Until when an application thread counts as busy-polling this context: [`MAX_BACKOFF`] from now while one
    /// polls, the end of the linger after the last poll (see [`Lead::busy_lingers`]), or `None`. While only
    /// adaptive waits spin, `spins` from now (the progress thread's backoff, see [`spin_stand_back`]): a spin
    /// lasts far less and ends with no wake-up of this thread, and the writes an application makes once its spin
    /// has ended (after a connect's, say) must not wait a whole backoff unless spins went on for that long.
    pub(crate) fn busy_until(&self, spins: Duration) -> Option<Instant> {
        let stand_back = stand_back_for(
            self.lingering.load(Ordering::SeqCst),
            self.busy.load(Ordering::SeqCst),
            spins,
        );
        match stand_back {
            Some(d) => Some(Instant::now() + d),
            None => self.lead.busy_lingers(),
        }
    }

    /// Whether an application thread busy-polls this context, or counts as polling (see [`Shared::busy_until`]).
    fn busy(&self) -> bool {
        self.busy_until(STANDBY).is_some()
    }

    /// Whether only adaptive waits' spins mark this context as polled now.
    fn spinning_only(&self) -> bool {
        self.lingering.load(Ordering::SeqCst) == 0 && self.busy.load(Ordering::SeqCst) > 0
    }
}

/// How long the progress thread stands back from a context that `busy` threads poll, `lingering` of them in
/// busy-polling dequeues (see [`Shared::busy_until`]), `spins` if they only spin; `None` when nobody polls.
fn stand_back_for(lingering: usize, busy: usize, spins: Duration) -> Option<Duration> {
    if lingering > 0 {
        Some(MAX_BACKOFF)
    } else if busy > 0 {
        Some(spins)
    } else {
        None
    }
}

/// How long the progress thread stands back from adaptive waits' spins: its backoff, [`STANDBY`] after it led or
/// slept deep, doubling up to [`MAX_BACKOFF`] at each look while applications spin or lead (a pump or ping-pong
/// whose waits spin keeps it far back; a connect's spin right after a hand-over only for [`STANDBY`]). One backoff
/// for spins and check-backs: a backoff of their own, reset by every look that found no spin, tried, woke the thread
/// twice as often in a pump whose waits spin and lead in turn.
fn spin_stand_back(backoff: &mut Duration) -> Duration {
    let d = *backoff;
    *backoff = (d * 2).min(MAX_BACKOFF);
    d
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
    // the caller waits for does not arm: it would not sleep (issue 12: on libfabric tcp `fi_trywait` costs
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
    let deadline = engine.sleep_deadline();
    // A transport whose completions wake nobody is polled at its interval (libfabric queues without a wait
    // object, for busy polling).
    let deadline = match engine.poll_interval() {
        Some(i) => {
            let poll = Instant::now() + i;
            Some(deadline.map_or(poll, |d| d.min(poll)))
        }
        None => deadline,
    };
    lead.leader_sleep
        .store(lead.stamp(deadline), Ordering::SeqCst);
    Some(deadline)
}

/// What the progress thread does next.
#[derive(Debug)]
enum Next {
    /// Lead: sleep on the transport.
    Lead,
    /// Stand aside, checking back after this long (and running due timers).
    Standby(Duration),
    /// Stand aside until the leader lets go.
    Deep,
    /// An application or a task leads: look at it again at this time (`None`: when woken), and, with `true`, when
    /// the transport signals; running nothing meanwhile (the leader runs the protocol and its timers; with a task,
    /// rounds here would also take what signalled the transport, and with it the sign that it stopped being
    /// polled).
    Watch(Option<Instant>, bool),
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
        // Spinning waits keep it back for the backoff, which grows while they go on (see `spin_stand_back`).
        let spinning = shared.spinning_only();
        let spins = if spinning {
            spin_stand_back(&mut backoff)
        } else {
            STANDBY
        };
        if let Some(until) = shared.busy_until(spins) {
            lead.thread_spin_stand_back
                .store(spinning, Ordering::SeqCst);
            stand_back_for_busy_pollers(&shared, until);
            lead.thread_spin_stand_back.store(false, Ordering::SeqCst);
            continue;
        }
        // What a leading task would have been woken for: the transport, its wake-up eventfd, its wake-up time
        // (its timers, or the transport's polling interval).
        let called = || {
            lead.leader_overdue() || signalled(wait_fd.as_fd()) || signalled(lead.leader_wake_fd())
        };
        if lead.steal_from_stale_task(&called) {
            backoff = STANDBY;
            lead.thread_sleep.store(ABSENT, Ordering::SeqCst);
            // The stale task's reactor registration goes (each completion would wake its runtime for nothing);
            // the next task to lead registers in its own runtime.
            lead.drop_task_fds();
            lead_as_thread(&shared, wait_fd.as_fd());
            continue;
        }
        let next = next_step(lead, &mut backoff);
        match next {
            Next::Lead => {
                backoff = STANDBY;
                lead.thread_sleep.store(ABSENT, Ordering::SeqCst);
                // No task has waited for a while: the reactor's registration of the descriptors goes (every
                // completion would wake the runtime for nothing); the next task to lead registers them again.
                lead.drop_task_fds();
                lead_as_thread(&shared, wait_fd.as_fd());
            }
            Next::Standby(t) => standby(&shared, t),
            Next::Watch(until, transport) => {
                lead.thread_sleep.store(lead.stamp(until), Ordering::SeqCst);
                let fds = [wait_fd.as_fd(), lead.leader_wake_fd()];
                sleep_thread_on(&shared, until, if transport { &fds } else { &[] });
            }
            Next::Deep => {
                lead.thread_sleep.store(FOREVER, Ordering::SeqCst);
                sleep_thread(&shared, None);
                backoff = STANDBY;
            }
        }
    }
}

/// Whether the transport's descriptor is signalled now (a poll that does not wait).
fn signalled(fd: BorrowedFd<'_>) -> bool {
    let mut fds = [PollFd::new(fd, PollFlags::POLLIN)];
    matches!(nix::poll::poll(&mut fds, nix::poll::PollTimeout::ZERO), Ok(n) if n > 0)
        && readable(&fds[0])
}

/// What the progress thread does next, from who holds the lead; `backoff` is how long it stands aside next while
/// another holds it.
fn next_step(lead: &Lead, backoff_now: &mut Duration) -> Next {
    let mut backoff = *backoff_now;
    let mut s = lead.lock();
    let next = match s.holder {
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
        // A task leads. It may stop being polled while it does (see `Lead::steal_from_stale_task`): look at it
        // again soon while it is suspect; while tasks come and go, every STANDBY to MAX_BACKOFF; once one has held
        // the lead for a long while (an idle wait), sleep until it lets go (it then wakes this thread), its
        // transport or its wake-up eventfd signals, or its own wake-up time has passed by MAX_BACKOFF: an idle task
        // costs nothing. Such sleeps alternate with looks MAX_BACKOFF apart: a transport that stays signalled under
        // a busy task (serving other streams) wakes this thread at most twice in that time, not at every signal.
        Holder::App if s.task => {
            let now = Instant::now();
            if s.suspect_since.is_some() {
                Next::Watch(Some(now + STANDBY), false)
            } else if backoff < MAX_BACKOFF
                || s.last_release.is_some_and(|t| t.elapsed() < MAX_BACKOFF)
            {
                let b = check_back(&s, &mut backoff);
                Next::Watch(Some(now + b), false)
            } else if std::mem::take(&mut s.watched_deep) {
                Next::Watch(Some(now + MAX_BACKOFF), false)
            } else {
                s.thread_deep = true;
                s.watched_deep = true;
                Next::Watch(lead.watch_until(now), true)
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
        // Applications come and go (a ping-pong): check back, at most every MAX_BACKOFF, running nothing meanwhile
        // (the leading application runs the protocol and its timers).
        Holder::App => Next::Watch(Some(Instant::now() + check_back(&s, &mut backoff)), false),
        Holder::Thread => Next::Lead,
    };
    *backoff_now = backoff;
    next
}

/// How long the progress thread stands aside before it checks back while applications come and go: the backoff,
/// doubled for the next time up to [`MAX_BACKOFF`]; at most [`STANDBY`] while the last application to let go left
/// sends or a shutdown in flight. Those need rounds to finish (the peer's advertisements and window updates to
/// answer) whether or not the application comes back: a writer that returns from its last write and turns to
/// something else leaves its last bytes to this thread, which took the transport only after its current
/// check-back (up to [`MAX_BACKOFF`] away) and the standby after it.
fn check_back(s: &LeadState, backoff: &mut Duration) -> Duration {
    let b = *backoff;
    *backoff = (b * 2).min(MAX_BACKOFF);
    if s.outgoing {
        b.min(STANDBY)
    } else {
        b
    }
}

fn sleep_thread(shared: &Shared, until: Option<Instant>) {
    sleep_thread_on(shared, until, &[]);
}

/// Sleeps until woken, `until`, or one of `also` is readable.
fn sleep_thread_on(shared: &Shared, until: Option<Instant>, also: &[BorrowedFd<'_>]) {
    let lead = &shared.lead;
    let mut fds: smallvec::SmallVec<[PollFd<'_>; 3]> =
        smallvec::smallvec![PollFd::new(lead.thread_wake.as_fd(), PollFlags::POLLIN)];
    fds.extend(also.iter().map(|fd| PollFd::new(*fd, PollFlags::POLLIN)));
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
        if shared.stopping() || lead.lock().handover_asked || shared.busy() {
            lead.release(false, false);
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

/// An application thread busy-polls this context: it handles completions, timers and (see
/// `Engine::cm_busy_due`) connection events itself, so this thread stays out of its way: no arming (no
/// completion-channel wake-ups), no rounds (they would only take the engine lock from the poller), and it checks
/// back every [`MAX_BACKOFF`] whether the polling has ended (a poller counts as polling until it has been out of
/// its dequeues for that long), or at once when woken; adaptive waits' spins, which end by themselves within
/// microseconds, keep it back for its backoff only (see [`spin_stand_back`]). Issue 12: checking back every millisecond and running a
/// round cost wake-ups (two context switches each) on each side of a busy ping-pong on libfabric tcp, and it woke
/// for delayed-acknowledgment deadlines the reply had already cancelled (the bench README's table of system calls
/// and context switches per round trip has the before and after).
///
/// `until` comes from [`Shared::busy_until`]: between two dequeues, the end of the linger, so that a timer runs at
/// most [`MAX_BACKOFF`] late once the poller has gone for good.
fn stand_back_for_busy_pollers(shared: &Shared, until: Instant) {
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
        let until = match e.sleep_deadline() {
            Some(d) => until.min(d),
            _ => until,
        };
        lead.thread_sleep
            .store(lead.stamp(Some(until)), Ordering::SeqCst);
        until
    };
    sleep_thread(shared, Some(until));
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A lead that nobody holds, whose last application let go just now (`outgoing`: with sends in flight).
    fn let_go(outgoing: bool) -> Lead {
        let lead = Lead::new().unwrap();
        lead.release(true, outgoing);
        lead
    }

    /// Regression (issue 26): while applications (threads or tasks) come and go with sends in flight, the
    /// progress thread checks back every [`STANDBY`] at most, not after a backoff of up to [`MAX_BACKOFF`]: the last
    /// of them may not come back (a tokio stream's writer that had waited for room left its last bytes waiting that
    /// long). A check-back while one leads only looks (`Watch`), and the backoff still grows towards the deep sleep.
    #[test]
    fn while_applications_lead_with_sends_in_flight_the_progress_thread_checks_back_within_the_standby(
    ) {
        for task in [false, true] {
            for outgoing in [true, false] {
                let lead = let_go(outgoing);
                {
                    let mut s = lead.lock();
                    s.holder = Holder::App;
                    s.task = task;
                }
                let mut backoff = MAX_BACKOFF / 2;
                let before = Instant::now();
                let next = next_step(&lead, &mut backoff);
                let after = Instant::now();
                let want = if outgoing { STANDBY } else { MAX_BACKOFF / 2 };
                let case = format!("task {task}, outgoing {outgoing}");
                match next {
                    Next::Watch(Some(at), false) => {
                        assert!(at >= before + want && at <= after + want, "{case}: {at:?}")
                    }
                    next => panic!("{case}: {next:?}"),
                }
                assert_eq!(backoff, MAX_BACKOFF, "{case}");
            }
        }
    }

    /// Regression (issue 26): an application that lets go with sends in flight wakes a progress thread whose
    /// check-back was scheduled further than [`STANDBY`] away (while the one before let go with none), once; with
    /// none in flight, or a check-back that near, it wakes nobody.
    #[test]
    fn letting_go_with_sends_in_flight_brings_a_far_check_back_near() {
        let woken = |outgoing: bool, check_back: Duration| {
            let lead = Lead::new().unwrap();
            lead.thread_sleep.store(
                lead.stamp(Some(Instant::now() + check_back)),
                Ordering::SeqCst,
            );
            lead.release(true, outgoing);
            lead.thread_wake.read().is_ok()
        };
        assert!(woken(true, MAX_BACKOFF));
        assert!(!woken(false, MAX_BACKOFF));
        assert!(!woken(true, STANDBY / 2));
    }

    /// Regression (issue 26): adaptive waits' spins keep the progress thread back for its backoff, [`STANDBY`] at
    /// the first look after it led (a connect's spin made it stand back [`MAX_BACKOFF`], and the writes after the
    /// connect waited that long), doubling while spins go on; busy-polling dequeues keep it back [`MAX_BACKOFF`].
    #[test]
    fn spins_keep_the_progress_thread_back_for_its_backoff_and_busy_pollers_for_the_longest() {
        let mut backoff = STANDBY;
        assert_eq!(spin_stand_back(&mut backoff), STANDBY);
        assert_eq!(spin_stand_back(&mut backoff), STANDBY * 2);
        for _ in 0..8 {
            spin_stand_back(&mut backoff);
        }
        assert_eq!(spin_stand_back(&mut backoff), MAX_BACKOFF);
        assert_eq!(stand_back_for(0, 0, STANDBY), None);
        assert_eq!(stand_back_for(0, 2, STANDBY * 2), Some(STANDBY * 2));
        assert_eq!(stand_back_for(1, 2, STANDBY), Some(MAX_BACKOFF));
    }

    struct Quiet;
    impl Follower for Quiet {
        fn nudge(&self) {}
    }

    /// Regression (review): while one application kept the lead, every queue that asked to lead was added to
    /// the followers, and the entries of queues gone meanwhile stayed until it let go: the list (and the look
    /// through it at every asking) grew with short-lived queues. Gone followers leave as new ones come.
    #[test]
    fn followers_gone_meanwhile_leave_the_list() {
        let lead = Lead::new().unwrap();
        assert!(lead.try_lead_app(Arc::new(Quiet)));
        for _ in 0..1000 {
            assert!(!lead.try_lead_app(Arc::new(Quiet)), "one leads already");
        }
        let kept = Arc::new(Quiet);
        assert!(!lead.try_lead_app(kept.clone()));
        assert!(
            lead.lock().followers.len() <= 2,
            "{} followers, all but one gone",
            lead.lock().followers.len()
        );
    }
}

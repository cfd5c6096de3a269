//! How a dequeue waits (the adaptive completion wait): the adaptive, blocking and busy-polling modes, leading a
//! context's progress while it sleeps, and driving a manual (simulated) world.

use super::*;
use std::sync::atomic::AtomicU64;

use crate::config::deadline;

impl EventQueue {
    pub(super) fn dequeue_adaptive(
        &self,
        out: &mut Vec<Event>,
        min: usize,
        max: usize,
        timeout: Option<Duration>,
        spin: u32,
    ) -> Result<usize, DequeueError> {
        // Step 1: poll once.
        let mut got = self.poll(out, max);
        if got >= min {
            return Ok(got);
        }
        let start = Instant::now();
        let deadline = deadline(start, timeout);
        // The alternative embodiment: poll `spin` more times before blocking.
        let mut spins = 0;
        while got < min && spins < spin {
            if !self.poll_contexts() {
                std::hint::spin_loop();
            }
            got += self.poll(out, max - got);
            spins += 1;
            // Within the caller's timeout (review finding: a large count ran every poll whatever the timeout),
            // the clock read once every few polls.
            if spins % 16 == 0 && deadline.is_some_and(|d| Instant::now() >= d) {
                break;
            }
        }
        // Spin for about as long as recent waits took, when that is shorter than sleeping and waking (see
        // SpinEstimate). Not past the caller's deadline: a dequeue whose time is up only polls.
        let pollers = if got < min && !self.has_drivers() && deadline.is_none_or(|d| start < d) {
            self.pollers()
        } else {
            Pollers::new()
        };
        let mut spun = false;
        if !pollers.is_empty() {
            if let Some(budget) = self.inner.spin.budget() {
                let until = deadline.map_or(start + budget, |d| d.min(start + budget));
                got += self.spin_until(pollers, out, min - got, max - got, Some(until), false)?;
                if got >= min {
                    spun = true;
                    self.inner.lock().stats.spun += 1;
                }
            }
        }
        while got < min {
            // Step 2: block until the number still missing has arrived.
            let need = min - got;
            if !self.block_until(need, deadline, true)? {
                got += self.poll(out, max - got);
                break;
            }
            // Step 3: drain without blocking.
            got += self.poll(out, max - got);
        }
        self.inner.spin.record(match (got >= min, spun) {
            (false, _) => Wait::TimedOut,
            (true, true) => Wait::Spun(start.elapsed()),
            (true, false) => Wait::Slept(start.elapsed()),
        });
        Ok(got)
    }

    pub(super) fn dequeue_blocking(
        &self,
        out: &mut Vec<Event>,
        min: usize,
        max: usize,
        timeout: Option<Duration>,
    ) -> Result<usize, DequeueError> {
        let mut got = 0;
        let mut until = None;
        loop {
            // One event per wake-up: the behaviour the adaptive wait improves on.
            got += self.poll(out, (max - got).min(1));
            if got >= min {
                // Take what else is there without waiting, as any dequeue does.
                got += self.poll(out, max - got);
                return Ok(got);
            }
            let deadline = *until.get_or_insert_with(|| deadline(Instant::now(), timeout));
            if !self.block_until(1, deadline, true)? {
                got += self.poll(out, max - got);
                return Ok(got);
            }
        }
    }

    pub(super) fn dequeue_busy(
        &self,
        out: &mut Vec<Event>,
        min: usize,
        max: usize,
        deadline: Option<Instant>,
    ) -> Result<usize, DequeueError> {
        let got = self.poll(out, max);
        // Even when enough events were waiting, still a busy poller: it drives its contexts (at least one round,
        // see `spin_until`) and marks them as busy-polled, so their progress threads keep standing back. Otherwise
        // a progress thread that led before the polling began would keep leading and queue every event before
        // this thread looked (a wake-up per completion), and no dequeue would ever spin.
        let rest = min.saturating_sub(got);
        Ok(got + self.spin_until(self.pollers(), out, rest, max - got, deadline, true)?)
    }

    /// Polls without sleeping, driving the contexts itself, until `min` events were taken (at most `max`) or
    /// `until` passed; at least one round, whatever `min` and `until` (never a busy mark without a round: a poller
    /// that only takes what is queued must not keep the progress threads out). Returns how many it took.
    fn spin_until(
        &self,
        pollers: Pollers,
        out: &mut Vec<Event>,
        min: usize,
        max: usize,
        until: Option<Instant>,
        lingers: bool,
    ) -> Result<usize, DequeueError> {
        let mut got = 0;
        let spun = self.spin_rounds(pollers, until, Mark::Busy { lingers }, &mut || {
            got += self.poll(out, max - got);
            got >= min
        });
        match spun {
            Spun::Stalled => self.stalled(min - got),
            Spun::Done | Spun::TimeUp => Ok(got),
        }
    }

    /// The rounds of a spin: drives the contexts (or the simulated worlds) until `done` holds or `until` passed,
    /// at least one round.
    fn spin_rounds(
        &self,
        pollers: Pollers,
        until: Option<Instant>,
        mark: Mark,
        done: &mut dyn FnMut() -> bool,
    ) -> Spun {
        // While this thread polls, the contexts' progress threads stand back (see `Poller::set_busy`); with
        // `lingers` (busy polling, not the adaptive wait's spin), for a while after it too. It never lingers when
        // this loop drives simulated worlds instead of the pollers: it must not keep back what it does not drive.
        let manual = self.has_drivers();
        let mark = match mark {
            Mark::Busy { .. } if manual => Mark::Busy { lingers: false },
            m => m,
        };
        let busy = BusyGuard::new(pollers, mark);
        let mut idle_rounds = 0u32;
        let mut rounds = 0u32;
        let mut pause = 0u32;
        let (pause_min, pause_max) = busy_pauses();
        loop {
            // The clock is read after the first round and every SPIN_CLOCK rounds after it: a round polls each
            // transport, longer than a clock read, and a spin of a few microseconds must not overrun by many
            // rounds. The first round always runs, so that a poll whose time is up still drives the contexts it
            // marked as busy-polled (they stand their progress threads back: see `BusyGuard`).
            if rounds % SPIN_CLOCK == 1 && until.is_some_and(|d| Instant::now() >= d) {
                return Spun::TimeUp;
            }
            rounds = rounds.wrapping_add(1);
            if manual {
                if self.drive_once() == Some(true) {
                    idle_rounds = 0;
                } else {
                    idle_rounds += 1;
                    if idle_rounds > 2 && self.inner.lock().events.is_empty() {
                        return Spun::Stalled;
                    }
                }
            } else {
                let mut any = false;
                for p in &busy.0 {
                    any |= p.poll_progress();
                }
                if any {
                    pause = 0;
                } else {
                    // Adaptive polling interval: on software transports every poll is a system call, so an idle
                    // poller backs off, up to BUSY_PAUSE_MAX_NS between polls: fewer calls per round trip for a
                    // fraction of a poll's latency.
                    for _ in 0..pause.max(1) {
                        std::hint::spin_loop();
                    }
                    pause = (pause * 2).clamp(pause_min, pause_max);
                }
            }
            if done() {
                return Spun::Done;
            }
        }
    }

    /// The adaptive wait's spin for a task that sleeps on the reactor rather than in a dequeue (`crate::tokio`;
    /// seed 004's alternative embodiment, polling before blocking, with the learned length of [`SpinEstimate`]):
    /// in the adaptive mode, and with threaded contexts reporting here, drives them until an event is queued, once
    /// per wait. True when an event came; the events stay
    /// queued for the caller to take.
    #[cfg_attr(not(feature = "tokio"), allow(dead_code))]
    pub(crate) fn spin_before_park(&self, wait: &mut AsyncWait) -> bool {
        let start = *wait.started.get_or_insert_with(Instant::now);
        if std::mem::replace(&mut wait.spun, true)
            || !matches!(self.wait_mode(), WaitMode::Adaptive { .. })
            || self.has_drivers()
        {
            return false;
        }
        let pollers = self.pollers();
        if pollers.is_empty() {
            return false;
        }
        let Some(budget) = self.inner.spin.budget() else {
            return false;
        };
        let until = Instant::now() + budget;
        // The progress threads go on leading while it spins (no busy mark): when the spin ends without an event,
        // the task parks on the reactor and relies on them to deliver it, at once.
        if let Spun::Done =
            self.spin_rounds(pollers, Some(until), Mark::Not, &mut || !self.is_empty())
        {
            self.inner.spin.record(Wait::Spun(start.elapsed()));
            self.inner.lock().stats.spun += 1;
            *wait = AsyncWait::default();
            return true;
        }
        false
    }

    /// The task's wait ended (its events came): the adaptive estimate learns how long a wait that went to sleep
    /// took, unless it waited for a leader to let go ([`AsyncWait::followed`]: a hand-over from the progress thread
    /// takes a wake-up of that thread, which says nothing of how soon events come). Nothing when the task did not
    /// wait.
    #[cfg_attr(not(feature = "tokio"), allow(dead_code))]
    pub(crate) fn wait_ended(&self, wait: &mut AsyncWait) {
        let w = std::mem::take(wait);
        if let (Some(start), true, false) = (w.started, w.spun, w.followed) {
            if matches!(self.wait_mode(), WaitMode::Adaptive { .. }) {
                self.inner.spin.record(Wait::Slept(start.elapsed()));
            }
        }
    }

    /// Sleeps until `need` events are queued. Returns false on timeout.
    ///
    /// With threaded contexts reporting here, the sleeping thread leads them (see [`crate::progress`]): it runs
    /// their protocol and sleeps on their wait descriptors itself, so a completion wakes it directly. Contexts
    /// another thread leads deliver their events through the queue.
    pub(super) fn block_until(
        &self,
        need: usize,
        deadline: Option<Instant>,
        count: bool,
    ) -> Result<bool, DequeueError> {
        if count {
            self.inner.lock().stats.blocks += 1;
        }
        if self.has_drivers() {
            return self.drive_until(need, deadline);
        }
        let pollers = self.pollers();
        let mut led = Leads(Pollers::new());
        let done = loop {
            let nudges = {
                let s = self.inner.lock();
                if s.events.len() >= need {
                    break true;
                }
                s.nudges
            };
            if deadline.is_some_and(|d| Instant::now() >= d) {
                break false;
            }
            for p in &pollers {
                if !led.0.iter().any(|l| Arc::ptr_eq(l, p)) && p.try_lead(self.inner.clone()) {
                    led.0.push(Arc::clone(p));
                }
            }
            if led.0.is_empty() {
                // Nobody to lead (a plain queue, or others lead): wait for the events or for a leader to let go.
                if !self.wait_cond(need, nudges, deadline) {
                    break self.inner.lock().events.len() >= need;
                }
                continue;
            }
            let mut until = deadline;
            let mut again = false;
            let satisfied = || self.inner.lock().events.len() >= need;
            for p in &led.0 {
                match p.prepare_sleep(&satisfied) {
                    None => again = true,
                    Some(Some(t)) => until = Some(until.map_or(t, |u| u.min(t))),
                    Some(None) => {}
                }
            }
            if again {
                continue;
            }
            self.sleep_leading(&led.0, need, until, nudges);
        };
        drop(led);
        Ok(done)
    }

    /// Waits on the condition variable until `need` events are queued, a leader let go (`nudges` moved on), or
    /// the deadline. False on timeout.
    pub(super) fn wait_cond(&self, need: usize, nudges: u64, deadline: Option<Instant>) -> bool {
        let mut s = self.inner.lock();
        s.waiters.push(need);
        let mut in_time = true;
        while s.events.len() < need && s.nudges == nudges {
            s = match deadline {
                None => self.inner.cond.wait(s).unwrap_or_else(|p| p.into_inner()),
                Some(d) => {
                    let now = Instant::now();
                    if now >= d {
                        in_time = false;
                        break;
                    }
                    self.inner
                        .cond
                        .wait_timeout(s, d - now)
                        .unwrap_or_else(|p| p.into_inner())
                        .0
                }
            };
        }
        if let Some(i) = s.waiters.iter().position(|&n| n == need) {
            s.waiters.swap_remove(i);
        }
        in_time
    }

    /// The leader's sleep: on the wait descriptors of the contexts it leads, and on this thread's wake-up
    /// descriptor, registered with the queue, for events that other threads complete here. Not at all if the
    /// queue was nudged since `nudges` (a leader of another of its contexts let go, before this thread was
    /// registered to hear it: review finding, that context then went unled until its progress thread checked
    /// back, tens of milliseconds).
    pub(super) fn sleep_leading(
        &self,
        led: &[Arc<dyn Poller>],
        need: usize,
        until: Option<Instant>,
        nudges: u64,
    ) {
        let wake = sleepers::this_thread();
        let mut until = until;
        let mine = {
            let mut s = self.inner.lock();
            if s.events.len() >= need || s.nudges != nudges {
                return;
            }
            match &wake {
                Some(fd) => Some(s.sleepers.register(need, fd)),
                // No descriptor to be woken through: look again soon.
                None => {
                    let soon = Instant::now() + crate::progress::lead::STANDBY;
                    until = Some(until.map_or(soon, |u| u.min(soon)));
                    None
                }
            }
        };
        let mut fds: smallvec::SmallVec<[PollFd<'_>; 6]> = smallvec::SmallVec::new();
        for p in led {
            p.count_sleep();
            for fd in p.sleep_fds() {
                fds.push(PollFd::new(fd, PollFlags::POLLIN));
            }
        }
        if let (Some(_), Some(w)) = (mine, &wake) {
            fds.push(PollFd::new(w.as_fd(), PollFlags::POLLIN));
        }
        crate::progress::lead::sleep_on(&mut fds, until);
        let revents: smallvec::SmallVec<[bool; 6]> =
            fds.iter().map(crate::progress::lead::readable).collect();
        drop(fds);
        for (i, p) in led.iter().enumerate() {
            p.woke(revents[i * 2 + 1]);
        }
        if let (Some(token), Some(w)) = (mine, &wake) {
            self.woke_leading(token, w, revents.last() == Some(&true));
        }
    }

    /// A leader's sleep ended: its registration goes, and it reads its own wake-up descriptor if that was
    /// readable (only this thread reads it, so no other leader's wake-up is taken).
    pub(super) fn woke_leading(&self, token: u64, wake: &EventFd, readable: bool) {
        self.inner.lock().sleepers.unregister(token);
        if readable {
            let _ = wake.read();
        }
    }

    pub(super) fn has_drivers(&self) -> bool {
        !self.inner.lock().drivers.is_empty()
    }

    pub(super) fn drivers(&self) -> Vec<Arc<dyn Driver>> {
        let mut s = self.inner.lock();
        s.drivers.retain(|w| w.strong_count() > 0);
        s.drivers.iter().filter_map(Weak::upgrade).collect()
    }

    /// One round of manual progress, if this queue has drivers. `Some(progressed)`.
    pub(super) fn drive_once(&self) -> Option<bool> {
        let drivers = self.drivers();
        if drivers.is_empty() {
            return None;
        }
        let mut any = false;
        for d in drivers {
            any |= d.drive();
        }
        Some(any)
    }

    /// Manual progress: drive the fabric until `need` events are queued or nothing can happen any more.
    pub(super) fn drive_until(
        &self,
        need: usize,
        deadline: Option<Instant>,
    ) -> Result<bool, DequeueError> {
        loop {
            if self.inner.lock().events.len() >= need {
                return Ok(true);
            }
            if deadline.is_some_and(|d| Instant::now() >= d) {
                return Ok(false);
            }
            match self.drive_once() {
                Some(true) => continue,
                Some(false) => {
                    if self.inner.lock().events.len() >= need {
                        return Ok(true);
                    }
                    // Idle fabric: nothing more will ever arrive. A finite timeout simply expires (virtual
                    // time); an infinite one would hang, which the simulator reports instead.
                    return match deadline {
                        Some(_) => Ok(false),
                        None => self.stalled(need).map(|_| false),
                    };
                }
                None => return Ok(self.inner.lock().events.len() >= need),
            }
        }
    }

    pub(super) fn stalled(&self, waiting: usize) -> Result<usize, DequeueError> {
        let outstanding = self.inner.lock().outstanding;
        Err(DequeueError::Stalled {
            waiting,
            outstanding,
        })
    }
}

/// The longest pause between two polls of an idle busy-poller. A message that arrives during a pause waits for
/// its end, so the cap is latency (half of it, on average, on each side of a round trip) bought for fewer empty
/// polls; `cargo xtask bench` counts both (its `cost` rows). A count of pause instructions is no bound on time
/// (one pause lasts from a few to tens of nanoseconds depending on the CPU and its hypervisor), so the cap is a
/// time, turned into a count of pauses by measuring them once per process.
const BUSY_PAUSE_MAX_NS: u64 = 500;

/// The pause after the second idle poll: no reply comes back sooner after a send, so polls closer together are
/// only system calls.
const BUSY_PAUSE_MIN_NS: u64 = 150;

/// The busy-poller's pause range in pause instructions, from [`BUSY_PAUSE_MIN_NS`] and [`BUSY_PAUSE_MAX_NS`] and
/// what one pause instruction costs here (measured once: 256 of them, a few microseconds at most).
fn busy_pauses() -> (u32, u32) {
    static PAUSES: std::sync::OnceLock<(u32, u32)> = std::sync::OnceLock::new();
    *PAUSES.get_or_init(|| {
        const PROBE: u32 = 256;
        let start = Instant::now();
        for _ in 0..PROBE {
            std::hint::spin_loop();
        }
        let per_pause_ns = (start.elapsed().as_nanos() as u64 / u64::from(PROBE)).max(1);
        let count = |ns: u64| (ns / per_pause_ns).clamp(1, 1024) as u32;
        (count(BUSY_PAUSE_MIN_NS), count(BUSY_PAUSE_MAX_NS))
    })
}

/// A spin reads the clock (for its deadline) after its first round and then every this many rounds.
const SPIN_CLOCK: u32 = 8;

/// The longest an adaptive dequeue spins before it sleeps, unless [`EventQueue::set_adaptive_spin`] says
/// otherwise: about twice what sleeping and being woken costs on a software transport (two context switches and
/// the transport's wake-up calls). Not once: two threads that answer each other, and have both slept, make each
/// other's waits as long as a wake-up and the work after it. With a longest spin below that, neither spin ever
/// catches the other's reply and they go on sleeping in turns; with twice it, the first spin that does ends it
/// (`two_waiters_that_answer_each_other_do_not_sleep_in_turns`).
pub(crate) const ADAPTIVE_SPIN_MAX: Duration = Duration::from_micros(100);

/// How a spin ended.
enum Spun {
    /// What the caller waits for came.
    Done,
    /// Its time passed first.
    TimeUp,
    /// A simulated world has nothing left to do.
    Stalled,
}

/// A task's wait on a queue, across the polls of one wait (see [`EventQueue::spin_before_park`]).
#[derive(Debug, Default)]
pub(crate) struct AsyncWait {
    /// When the wait began (its first poll that found nothing).
    started: Option<Instant>,
    /// Whether it has had its spin (or found it off).
    spun: bool,
    /// It waited for another leader to let go: its length says how long that took, not how soon its events
    /// came, and is not learned from.
    followed: bool,
}

impl AsyncWait {
    /// The wait had to follow another leader (see `followed`).
    #[cfg_attr(not(feature = "tokio"), allow(dead_code))]
    pub(crate) fn followed(&mut self) {
        self.followed = true;
    }
}

/// How an adaptive dequeue's wait ended, for [`SpinEstimate::record`].
#[derive(Clone, Copy, Debug)]
pub(crate) enum Wait {
    /// Its events arrived while it spun, after this long.
    Spun(Duration),
    /// It slept (spinning was off, or its events came later than the spin lasted); this long in all.
    Slept(Duration),
    /// Its deadline passed first.
    TimedOut,
}

/// How long an adaptive dequeue spins before it sleeps, learned from what its recent waits took.
///
/// The adaptive completion wait polls once, then blocks until the missing events have arrived; its alternative
/// embodiment polls N times first. A fixed N is wrong on every machine but one: here the queue keeps an average of
/// its recent waits (from the first empty poll until the events were there) and spins for up to twice that,
/// between an eighth of the longest spin and the longest spin itself ([`ADAPTIVE_SPIN_MAX`] unless set): a
/// request/response exchange whose replies come back within microseconds is answered without two context
/// switches, while a queue whose waits are long (an idle server) does not spin at all, except for one probe in
/// [`SpinEstimate::PROBE_EVERY`] waits. A wait that spinning answered sets the average to what it took: a wait that
/// slept also counts the sleep and the wake-up, so it says how long sleeping takes, not how soon the events come;
/// without that, waits that slept would keep the average above the longest spin and spinning off for good.
#[derive(Debug)]
pub(crate) struct SpinEstimate {
    /// Average of recent waits, nanoseconds (each sample capped at four times the longest spin).
    avg_ns: AtomicU64,
    /// Waits counted while the average was too long to spin, for the probes.
    skipped: AtomicU64,
    /// The longest spin, nanoseconds; 0: never spin.
    max_ns: AtomicU64,
}

impl SpinEstimate {
    /// One wait in this many spins although recent waits were too long to.
    pub(crate) const PROBE_EVERY: u64 = 32;

    pub(crate) fn new() -> Self {
        let max = ADAPTIVE_SPIN_MAX.as_nanos() as u64;
        // No history yet: spin as long as is ever worth it.
        SpinEstimate {
            avg_ns: AtomicU64::new(max / 2),
            skipped: AtomicU64::new(0),
            max_ns: AtomicU64::new(max),
        }
    }

    /// Sets the longest spin (zero: never spin) and forgets what was learned.
    pub(crate) fn set_max(&self, max: Duration) {
        let max = u64::try_from(max.as_nanos()).unwrap_or(u64::MAX);
        self.max_ns.store(max, Ordering::Relaxed);
        self.avg_ns.store(max / 2, Ordering::Relaxed);
    }

    /// How long the next wait should spin before it sleeps, if at all.
    pub(crate) fn budget(&self) -> Option<Duration> {
        let max = self.max_ns.load(Ordering::Relaxed);
        if max == 0 {
            return None;
        }
        let avg = self.avg_ns.load(Ordering::Relaxed);
        if avg <= max {
            return Some(Duration::from_nanos(
                avg.saturating_mul(2).clamp(max / 8, max),
            ));
        }
        let n = self.skipped.fetch_add(1, Ordering::Relaxed) + 1;
        (n % Self::PROBE_EVERY == 0).then_some(Duration::from_nanos(max))
    }

    /// Counts a wait.
    pub(crate) fn record(&self, wait: Wait) {
        let cap = self.max_ns.load(Ordering::Relaxed).saturating_mul(4);
        let sample = match wait {
            Wait::Spun(took) => {
                // What the events took, with no sleep in it: the average starts again from here.
                self.avg_ns.store(nanos(took).min(cap), Ordering::Relaxed);
                return;
            }
            Wait::Slept(took) => nanos(took).min(cap),
            Wait::TimedOut => cap,
        };
        let avg = self.avg_ns.load(Ordering::Relaxed);
        // Half the old average, half the new sample: an idle spell (capped samples) turns spinning off within a
        // wait or two, and one spin that answers turns it back on.
        self.avg_ns.store(avg / 2 + sample / 2, Ordering::Relaxed);
    }
}

fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

/// Marks contexts as busy-polled for as long as it lives.
struct BusyGuard(Pollers, Mark);

/// Whether a spin marks the contexts it drives as busy-polled (see `Poller::set_busy`).
#[derive(Clone, Copy)]
enum Mark {
    /// Their progress threads go on leading: a task that parks after its spin relies on them at once.
    Not,
    /// Their progress threads stand back while it spins; with `lingers`, for a while after it too.
    Busy { lingers: bool },
}

impl BusyGuard {
    fn new(pollers: Pollers, mark: Mark) -> Self {
        if let Mark::Busy { lingers } = mark {
            for p in &pollers {
                p.set_busy(true, lingers);
            }
        }
        BusyGuard(pollers, mark)
    }
}

impl Drop for BusyGuard {
    fn drop(&mut self) {
        if let Mark::Busy { lingers } = self.1 {
            for p in &self.0 {
                p.set_busy(false, lingers);
            }
        }
    }
}

/// The contexts a waiting thread leads, let go however its wait ends: a panic that unwinds through the wait (a
/// transport's arming, a deferred close) lets them go too, as the tokio path's guard does. (The test
/// `a_context_whose_leader_unwound_goes_on_serving_other_waits` passes without it too: the progress thread still
/// runs a context whose leader is gone.)
struct Leads(Pollers);

impl Drop for Leads {
    fn drop(&mut self) {
        for p in self.0.drain(..) {
            p.release();
        }
    }
}

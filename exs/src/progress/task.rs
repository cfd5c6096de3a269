//! A task that leads a context (see [`crate::progress`], rule 2): async tasks (`crate::tokio`) lead as blocking
//! threads do, through their reactor, but a task may stop being polled while it leads, which a thread in `ppoll`
//! cannot. The progress thread watches a leading task and takes the lead back from one that stalled.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::lead::{nudge, Follower, Holder, Lead, LeadState, ABSENT, AWAKE, FOREVER, MAX_BACKOFF};

/// How long a leading task must have looked stalled, at two looks at least, before the progress thread takes
/// the lead from it: longer than a busy runtime takes to poll a woken task (and than a reactor timer's late
/// firing), short enough that a context stands still only briefly behind a task that will not run again.
pub(super) const SUSPECT_GRACE: Duration = Duration::from_millis(2);

#[cfg_attr(not(feature = "tokio"), allow(dead_code))]
impl Lead {
    /// A task asks to lead: its term while it leads, or `None` (somebody else leads; `follower` is nudged when
    /// they let go).
    pub(crate) fn try_lead_task(&self, follower: Arc<dyn Follower>) -> Option<u64> {
        self.try_lead(follower, true)
    }

    /// The task given `term` is about to run the protocol as leader: true (and counted as a sign of life) if it
    /// still leads, false if the progress thread took the lead from it.
    pub(crate) fn task_run(&self, term: u64) -> bool {
        let s = self.lock();
        let leads = task_leads(&s, term);
        if leads {
            self.task_beat.fetch_add(1, Ordering::Relaxed);
        }
        leads
    }

    /// Whether the task given `term` still leads.
    pub(crate) fn task_leads(&self, term: u64) -> bool {
        task_leads(&self.lock(), term)
    }

    /// The task given `term` lets go, if it still leads (checked and released in one hold of the lock: a steal
    /// in between would otherwise be undone).
    /// `outgoing`: with sends or a shutdown in flight (see `LeadState::outgoing`).
    pub(crate) fn release_task(&self, term: u64, outgoing: bool) {
        let s = self.lock();
        if task_leads(&s, term) {
            self.release_locked(s, true, outgoing);
        }
    }

    /// Whether the leading sleeper's published wake-up time has passed (it should be awake by now).
    pub(super) fn leader_overdue(&self) -> bool {
        let at = self.leader_sleep.load(Ordering::SeqCst);
        at != ABSENT && at != AWAKE && at != FOREVER && self.stamp(Some(Instant::now())) > at
    }

    /// When the progress thread, sleeping beside a leading task, looks at it again: [`MAX_BACKOFF`] after the
    /// task's published wake-up time; never when it has none (it sleeps with no timeout); soon when it is between
    /// two sleeps (awake, or not yet published).
    pub(super) fn watch_until(&self, now: Instant) -> Option<Instant> {
        match self.leader_sleep.load(Ordering::SeqCst) {
            FOREVER => None,
            ABSENT | AWAKE => Some(now + MAX_BACKOFF),
            at => Some(self.epoch + Duration::from_nanos(at) + MAX_BACKOFF),
        }
    }

    /// The task given `term` woke up (`kicked`: by its wake-up eventfd), if it still leads: the same as
    /// [`Lead::woke`], under the lock, so that a task the thread took the lead from meanwhile does not mark the
    /// thread awake or read its wake-up. False if it no longer leads.
    pub(crate) fn task_woke(&self, term: u64, kicked: bool) -> bool {
        let s = self.lock();
        let leads = task_leads(&s, term);
        if leads {
            self.woke(kicked);
        }
        leads
    }

    /// Drops the reactor's registration of the descriptors a leading task sleeps on.
    pub(crate) fn drop_task_fds(&self) {
        let fds = self
            .task_fds
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        drop(fds);
    }

    /// The progress thread's look at a leading task. A task leads while it waits (it sleeps on the transport
    /// through its reactor), but it may stop being polled while it leads: its future dropped (a `select!` took
    /// another branch) with the stream kept, or its runtime stalled. Then nobody would run the protocol. A task
    /// that has not run while something it would have been woken for was there (`called`: the transport
    /// signalled, its wake-up eventfd, its own wake-up time passed; asked only then) becomes suspect; still so
    /// [`SUSPECT_GRACE`] later, it loses the lead to the progress thread (true), and the threads and tasks that
    /// follow it are nudged (they ask the thread for the lead back).
    pub(super) fn steal_from_stale_task(&self, called: &dyn Fn() -> bool) -> bool {
        let beat = self.task_beat.load(Ordering::Relaxed);
        let ran = self.task_beat_seen.swap(beat, Ordering::Relaxed) != beat;
        {
            let mut s = self.lock();
            if ran || !(s.holder == Holder::App && s.task) {
                s.suspect_since = None;
                return false;
            }
        }
        // Asked without the lead's lock (it polls descriptors).
        let called = called();
        let mut s = self.lock();
        let still = s.holder == Holder::App && s.task && called;
        if !still || self.task_beat.load(Ordering::Relaxed) != beat {
            s.suspect_since = None;
            return false;
        }
        match s.suspect_since {
            None => {
                s.suspect_since = Some(Instant::now());
                return false;
            }
            Some(t) if t.elapsed() < SUSPECT_GRACE => return false,
            Some(_) => {}
        }
        s.holder = Holder::Thread;
        s.task = false;
        s.suspect_since = None;
        s.term = s.term.wrapping_add(1);
        self.counters.task_steals.fetch_add(1, Ordering::Relaxed);
        let followers = std::mem::take(&mut s.followers);
        drop(s);
        nudge(followers);
        true
    }
}

fn task_leads(s: &LeadState, term: u64) -> bool {
    s.holder == Holder::App && s.task && s.term == term
}

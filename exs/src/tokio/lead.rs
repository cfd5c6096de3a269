//! A task that waits on a stream leads the stream's context (see [`crate::progress`]): it runs the protocol itself
//! and sleeps on the transport's descriptor through its reactor, so that a completion wakes the task that waits
//! for it, as a blocking read's thread is woken, not the progress thread first and the task after it. The progress
//! thread watches a leading task, which may stop being polled while it leads (`Lead::steal_from_stale_task`).

use std::os::fd::{AsFd, AsRawFd, RawFd};
use std::sync::{Arc, Mutex};
use std::task::{Context as TaskContext, Poll, Waker};
use std::time::{Duration, Instant};

use nix::sys::time::TimeSpec;
use nix::sys::timer::Expiration;
use nix::sys::timerfd::{ClockId, TimerFd, TimerFlags, TimerSetTimeFlags};
use tokio::io::unix::AsyncFd;

use super::{async_fd, QueueFd};
use crate::event::EventQueue;
use crate::progress::{Follower, Lead, Poller};

/// A waiting stream direction's part in leading its queue's context, kept across the polls of its waits.
#[derive(Default)]
pub(crate) struct TaskLead {
    poller: Option<Arc<dyn Poller>>,
    follower: Arc<TaskFollower>,
    /// The term of the lead while this task leads.
    term: Option<u64>,
}

/// What one step of a wait that leads found.
pub(crate) enum Step {
    /// Look at the queue again (events came in, the round made them, or the task was woken).
    Again,
    /// The task leads and sleeps on the context's descriptors (its queue's too, the caller's part).
    Sleeps,
    /// Another thread or task leads: this task is woken when it lets go, and waits on its queue meanwhile.
    Follows,
    /// This task cannot lead (no threaded context of its own, no reactor to sleep through): it waits on its queue.
    Alone,
}

/// Wakes the task when the context's leader lets go, so that it leads next.
#[derive(Default)]
struct TaskFollower(Mutex<Option<Waker>>);

impl TaskFollower {
    fn set(&self, waker: &Waker) {
        let mut w = self.0.lock().unwrap_or_else(|p| p.into_inner());
        if !w.as_ref().is_some_and(|old| old.will_wake(waker)) {
            *w = Some(waker.clone());
        }
    }
}

impl Follower for TaskFollower {
    fn nudge(&self) {
        let waker = self.0.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(w) = waker {
            w.wake();
        }
    }
}

/// What a leading task sleeps on, in the reactor: the transport's descriptor, the leader's wake-up eventfd, and a
/// timer for the leader's wake-up time. One set per context (kept in its [`Lead`]), polled only by the task that
/// leads it, so that a transport's signal wakes one task, not every stream that ever led. The set is in one
/// runtime's reactor: a task of another runtime that leads makes a set in its own (a task sleeping on a reactor
/// its runtime does not drive was woken only when the progress thread took the lead from it).
struct ReactorFds {
    /// The runtime whose reactor holds the descriptors.
    runtime: tokio::runtime::Id,
    transport: AsyncFd<QueueFd>,
    kick: AsyncFd<QueueFd>,
    timer: AsyncFd<Timer>,
    /// The wake-up time the timer is set to.
    armed: Mutex<Option<Instant>>,
}

struct Timer(TimerFd);

impl AsRawFd for Timer {
    fn as_raw_fd(&self) -> RawFd {
        self.0.as_fd().as_raw_fd()
    }
}

impl ReactorFds {
    /// In the current runtime's reactor; `None` outside a runtime (a stream polled by another executor waits on
    /// its queue's descriptor only, which went into the reactor when the stream was made).
    fn new(poller: &dyn Poller, runtime: tokio::runtime::Id) -> Option<ReactorFds> {
        let [transport, kick] = poller.sleep_fds();
        let flags = TimerFlags::TFD_NONBLOCK | TimerFlags::TFD_CLOEXEC;
        let timer = TimerFd::new(ClockId::CLOCK_MONOTONIC, flags).ok()?;
        // As in `super::async_fd`: `Timer` owns the descriptor for the AsyncFd's life.
        #[allow(deprecated)]
        let timer = AsyncFd::new(Timer(timer)).ok()?;
        Some(ReactorFds {
            runtime,
            transport: async_fd(transport).ok()?,
            kick: async_fd(kick).ok()?,
            timer,
            armed: Mutex::new(None),
        })
    }

    /// The context's set in the reactor of `runtime` (the current one), made on first use and again by a leader of
    /// another runtime. Called by the task that leads: the set it replaces has no waiter (only the leader polls it).
    fn of(
        lead: &Lead,
        poller: &dyn Poller,
        runtime: tokio::runtime::Id,
    ) -> Option<Arc<ReactorFds>> {
        let mut slot = lead.task_fds.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(fds) = slot.clone().and_then(|a| a.downcast::<ReactorFds>().ok()) {
            if fds.runtime == runtime {
                return Some(fds);
            }
        }
        let fds = Arc::new(ReactorFds::new(poller, runtime)?);
        *slot = Some(fds.clone());
        Some(fds)
    }

    /// Sets the timer to `until` (`None`: unsets it); no call when it is set so already.
    fn arm(&self, until: Option<Instant>) {
        let mut armed = self.armed.lock().unwrap_or_else(|p| p.into_inner());
        if *armed == until {
            return;
        }
        *armed = until;
        let timer = &self.timer.get_ref().0;
        let _ = match until {
            // A zero expiration would unset it: at least a nanosecond.
            Some(t) => timer.set(
                Expiration::OneShot(TimeSpec::from_duration(
                    t.saturating_duration_since(Instant::now())
                        .max(Duration::from_nanos(1)),
                )),
                TimerSetTimeFlags::empty(),
            ),
            None => timer.unset(),
        };
    }

    /// The timer fired: read it (so that it is no longer readable) and note that it is unset.
    fn fired(&self) {
        let _ = self.timer.get_ref().0.wait();
        *self.armed.lock().unwrap_or_else(|p| p.into_inner()) = None;
    }
}

/// How the reactor answered for the three descriptors.
enum Woken {
    /// Readable: look again (`true`: the leader's wake-up eventfd was among them).
    Yes(bool),
    No,
    /// The reactor cannot watch them (its runtime is gone).
    Broken,
}

fn poll_fds(fds: &ReactorFds, cx: &mut TaskContext<'_>) -> Woken {
    let (kick, transport, timer) = (
        fds.kick.poll_read_ready(cx),
        fds.transport.poll_read_ready(cx),
        fds.timer.poll_read_ready(cx),
    );
    if matches!(kick, Poll::Ready(Err(_)))
        || matches!(transport, Poll::Ready(Err(_)))
        || matches!(timer, Poll::Ready(Err(_)))
    {
        return Woken::Broken;
    }
    let mut woke = None;
    if let Poll::Ready(Ok(mut g)) = kick {
        g.clear_ready();
        woke = Some(true);
    }
    // Cleared before the next round runs: a completion after it signals again.
    if let Poll::Ready(Ok(mut g)) = transport {
        g.clear_ready();
        woke = Some(woke.unwrap_or(false));
    }
    if let Poll::Ready(Ok(mut g)) = timer {
        g.clear_ready();
        fds.fired();
        woke = Some(woke.unwrap_or(false));
    }
    woke.map_or(Woken::No, Woken::Yes)
}

impl TaskLead {
    /// Lets go of the lead, if this task holds it (its wait ended, or the stream is dropped).
    pub(crate) fn release(&mut self) {
        if let (Some(term), Some(p)) = (self.term.take(), &self.poller) {
            if let Some(lead) = p.lead() {
                lead.release_task(term, p.outgoing());
            }
        }
    }

    /// One step of a wait that leads (see [`Step`]).
    pub(crate) fn poll_lead(&mut self, eq: &EventQueue, cx: &mut TaskContext<'_>) -> Step {
        if self.poller.is_none() {
            match eq.threaded_context() {
                Some(p) => self.poller = Some(p),
                None => return Step::Alone,
            }
        }
        let poller = Arc::clone(self.poller.as_ref().expect("set above"));
        let Some(lead) = poller.lead() else {
            return Step::Alone;
        };
        // Before taking the lead: a task that cannot sleep through a reactor does not take it (or lets go).
        let Ok(runtime) = tokio::runtime::Handle::try_current().map(|h| h.id()) else {
            self.release();
            return Step::Alone;
        };
        self.follower.set(cx.waker());
        let term = match self.term.filter(|&t| lead.task_run(t)) {
            Some(t) => t,
            None => {
                self.term = lead.try_lead_task(self.follower.clone());
                let Some(t) = self.term else {
                    return Step::Follows;
                };
                if !lead.task_run(t) {
                    self.term = None;
                    return Step::Alone;
                }
                t
            }
        };
        let Some(until) = poller.prepare_sleep(&|| !eq.is_empty()) else {
            // Events came in, or the round made what this task waits for.
            return Step::Again;
        };
        if !lead.task_leads(term) {
            // The progress thread took the lead meanwhile: look again.
            self.term = None;
            return Step::Again;
        }
        // Taken only now that this task leads: a set fetched before could be dropped (by the progress thread,
        // taking the lead in between) while this task went on to lead and sleep on it, with nothing left to wake
        // it.
        let Some(fds) = ReactorFds::of(lead, &*poller, runtime) else {
            self.release();
            return Step::Alone;
        };
        fds.arm(until);
        match poll_fds(&fds, cx) {
            Woken::Yes(kicked) => {
                if !lead.task_woke(term, kicked) {
                    self.term = None;
                }
                Step::Again
            }
            Woken::No => {
                poller.count_sleep();
                Step::Sleeps
            }
            Woken::Broken => {
                // A set in this runtime's reactor next time.
                lead.drop_task_fds();
                Step::Again
            }
        }
    }
}

impl Drop for TaskLead {
    fn drop(&mut self) {
        self.release();
    }
}

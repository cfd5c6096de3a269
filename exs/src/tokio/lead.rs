//! A task that waits on a stream leads the stream's context (see [`crate::progress`]): it runs the protocol itself
//! and sleeps on the transport's descriptor through its reactor, so that a completion wakes the task that waits
//! for it, as a blocking read's thread is woken, not the progress thread first and the task after it. The progress
//! thread watches a leading task, which may stop being polled while it leads (`Lead::steal_from_stale_task`).

use std::os::fd::{AsFd, AsRawFd, BorrowedFd, RawFd};
use std::sync::{Arc, Mutex};
use std::task::{Context as TaskContext, Poll, Waker};
use std::time::{Duration, Instant};

use nix::sys::time::TimeSpec;
use nix::sys::timer::Expiration;
use nix::sys::timerfd::{ClockId, TimerFd, TimerFlags, TimerSetTimeFlags};
use tokio::io::unix::AsyncFd;

use super::QueueFd;
use crate::event::EventQueue;
use crate::progress::{Follower, Lead, Poller};

/// A waiting stream direction's part in leading its queue's context, kept across the polls of its waits.
#[derive(Default)]
pub(crate) struct TaskLead {
    poller: Option<Arc<dyn Poller>>,
    follower: Arc<TaskFollower>,
    /// The term of the lead while this task leads.
    term: Option<u64>,
    /// The last step found another thread or task leading.
    followed: bool,
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
/// leads it, so that a transport's signal wakes one task, not every stream that ever led.
struct ReactorFds {
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

/// `fd` duplicated into the current runtime's reactor.
fn in_reactor(fd: BorrowedFd<'_>) -> Option<AsyncFd<QueueFd>> {
    let fd = fd.try_clone_to_owned().ok()?;
    // As `super::async_fd`: the descriptor is owned by the `QueueFd` for the AsyncFd's life.
    #[allow(deprecated)]
    AsyncFd::new(QueueFd(fd)).ok()
}

impl ReactorFds {
    /// In the current runtime's reactor; `None` outside a runtime (a stream polled by another executor waits on
    /// its queue's descriptor only, which went into the reactor when the stream was made).
    fn new(poller: &dyn Poller) -> Option<ReactorFds> {
        tokio::runtime::Handle::try_current().ok()?;
        let [transport, kick] = poller.sleep_fds();
        let flags = TimerFlags::TFD_NONBLOCK | TimerFlags::TFD_CLOEXEC;
        let timer = TimerFd::new(ClockId::CLOCK_MONOTONIC, flags).ok()?;
        // As above: `Timer` owns the descriptor for the AsyncFd's life.
        #[allow(deprecated)]
        let timer = AsyncFd::new(Timer(timer)).ok()?;
        Some(ReactorFds {
            transport: in_reactor(transport)?,
            kick: in_reactor(kick)?,
            timer,
            armed: Mutex::new(None),
        })
    }

    /// The context's set, made on first use.
    fn of(lead: &Lead, poller: &dyn Poller) -> Option<Arc<ReactorFds>> {
        let mut slot = lead.task_fds.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(fds) = slot.clone().and_then(|a| a.downcast::<ReactorFds>().ok()) {
            return Some(fds);
        }
        let fds = Arc::new(ReactorFds::new(poller)?);
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
    /// Whether the last step that did not lead found another thread or task leading (rather than no reactor or
    /// context to lead through).
    pub(crate) fn followed(&self) -> bool {
        self.followed
    }

    /// Lets go of the lead, if this task holds it (its wait ended, or the stream is dropped).
    pub(crate) fn release(&mut self) {
        if let (Some(term), Some(p)) = (self.term.take(), &self.poller) {
            if let Some(lead) = p.lead() {
                lead.release_task(term);
            }
        }
    }

    /// One step of a wait that leads: `None` when this task cannot lead (another thread or task does: it is
    /// woken when they let go, and waits on its queue meanwhile); `Some(Ready)` when the caller should look at
    /// its queue again; `Some(Pending)` when the task sleeps on the transport (and its wake-up eventfd and
    /// timer), leading.
    pub(crate) fn poll_lead(
        &mut self,
        eq: &EventQueue,
        cx: &mut TaskContext<'_>,
    ) -> Option<Poll<()>> {
        if self.poller.is_none() {
            self.poller = Some(eq.threaded_context()?);
        }
        let poller = Arc::clone(self.poller.as_ref().expect("set above"));
        let lead = poller.lead()?;
        // Before taking the lead: a task that cannot sleep through a reactor does not take it (or lets go).
        let Some(fds) = ReactorFds::of(lead, &*poller) else {
            self.release();
            return None;
        };
        self.follower.set(cx.waker());
        let term = match self.term.filter(|&t| lead.task_run(t)) {
            Some(t) => t,
            None => {
                self.term = lead.try_lead_task(self.follower.clone());
                self.followed = self.term.is_none();
                let t = self.term?;
                if !lead.task_run(t) {
                    self.term = None;
                    return None;
                }
                t
            }
        };
        let Some(until) = poller.prepare_sleep(&|| !eq.is_empty()) else {
            // Events came in, or the round made what this task waits for.
            return Some(Poll::Ready(()));
        };
        if !lead.task_leads(term) {
            // The progress thread took the lead meanwhile: look again.
            self.term = None;
            return Some(Poll::Ready(()));
        }
        fds.arm(until);
        match poll_fds(&fds, cx) {
            Woken::Yes(kicked) => {
                if !lead.task_woke(term, kicked) {
                    self.term = None;
                }
                Some(Poll::Ready(()))
            }
            Woken::No => {
                poller.count_sleep();
                Some(Poll::Pending)
            }
            Woken::Broken => {
                // A set in this runtime's reactor next time.
                *lead.task_fds.lock().unwrap_or_else(|p| p.into_inner()) = None;
                Some(Poll::Ready(()))
            }
        }
    }
}

impl Drop for TaskLead {
    fn drop(&mut self) {
        self.release();
    }
}

//! A task that waits on a stream leads the stream's context (see [`crate::progress`]): it runs the protocol itself
//! and sleeps on the transport's descriptor through its reactor, so that a completion wakes the task that waits
//! for it, as a blocking read's thread is woken, not the progress thread first and the task after it. The progress
//! thread keeps an eye on a leading task, which may stop being polled while it leads (`Lead::steal_from_stale_task`).

use std::future::Future;
use std::os::fd::BorrowedFd;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context as TaskContext, Poll, Waker};

use tokio::io::unix::AsyncFd;

use super::QueueFd;
use crate::event::EventQueue;
use crate::progress::{Follower, Poller};

/// A waiting task's lead of its queue's context, kept across the polls of its waits.
#[derive(Default)]
pub(crate) struct TaskLead {
    ctx: Option<Led>,
    /// The term of the lead while this task leads.
    term: Option<u64>,
    /// The leader's wake-up time as a reactor timer.
    sleep: Option<Pin<Box<tokio::time::Sleep>>>,
}

/// The context and its two descriptors in the reactor: the transport's, and the leader's wake-up eventfd.
struct Led {
    poller: Arc<dyn Poller>,
    transport: AsyncFd<QueueFd>,
    kick: AsyncFd<QueueFd>,
    follower: Arc<TaskFollower>,
}

/// Wakes the task when the context's leader lets go, so that it leads next.
#[derive(Default)]
struct TaskFollower(Mutex<Option<Waker>>);

impl Follower for TaskFollower {
    fn nudge(&self) {
        if let Some(w) = self.0.lock().unwrap_or_else(|p| p.into_inner()).take() {
            w.wake();
        }
    }
}

/// `fd` in the current runtime's reactor; `None` outside a runtime (a stream polled by another executor waits on
/// its queue's descriptor only, which went into the reactor when the stream was made).
fn in_reactor(fd: BorrowedFd<'_>) -> Option<AsyncFd<QueueFd>> {
    tokio::runtime::Handle::try_current().ok()?;
    let fd = fd.try_clone_to_owned().ok()?;
    // As `super::async_fd`: the descriptor is owned by the `QueueFd` for the AsyncFd's life.
    #[allow(deprecated)]
    AsyncFd::new(QueueFd(fd)).ok()
}

impl TaskLead {
    /// Lets go of the lead, if this task holds it (its wait ended, or the stream is dropped).
    pub(crate) fn release(&mut self) {
        if let (Some(term), Some(led)) = (self.term.take(), &self.ctx) {
            if let Some(lead) = led.poller.lead() {
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
        if self.ctx.is_none() {
            let poller = eq.threaded_context()?;
            let [transport, kick] = poller.sleep_fds();
            self.ctx = Some(Led {
                transport: in_reactor(transport)?,
                kick: in_reactor(kick)?,
                poller,
                follower: Arc::default(),
            });
        }
        let led = self.ctx.as_ref().expect("set above");
        let lead = led.poller.lead()?;
        *led.follower.0.lock().unwrap_or_else(|p| p.into_inner()) = Some(cx.waker().clone());
        if !self.term.is_some_and(|t| lead.task_leads(t)) {
            self.term = lead.try_lead_task(led.follower.clone());
            self.term?;
        }
        lead.task_ran();
        let until = match led.poller.prepare_sleep(&|| !eq.is_empty()) {
            None => return Some(Poll::Ready(())),
            Some(until) => until,
        };
        let mut woke = false;
        let mut kicked = false;
        if let Poll::Ready(Ok(mut g)) = led.kick.poll_read_ready(cx) {
            g.clear_ready();
            (woke, kicked) = (true, true);
        }
        if let Poll::Ready(Ok(mut g)) = led.transport.poll_read_ready(cx) {
            // Cleared before the next round runs: a completion after it signals again.
            g.clear_ready();
            woke = true;
        }
        match until {
            Some(t) => {
                let t = tokio::time::Instant::from_std(t);
                let sleep = self
                    .sleep
                    .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(t)));
                sleep.as_mut().reset(t);
                woke |= sleep.as_mut().poll(cx).is_ready();
            }
            None => self.sleep = None,
        }
        if woke {
            led.poller.woke(kicked);
            return Some(Poll::Ready(()));
        }
        led.poller.count_sleep();
        Some(Poll::Pending)
    }
}

impl Drop for TaskLead {
    fn drop(&mut self) {
        self.release();
    }
}

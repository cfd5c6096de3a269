//! Which completion queues a poll reads: never every connection's (unless their queues have no wait object).
//!
//! Every connection has a completion queue of its own (see [`crate::memory`]: keys bound to one connection), and on
//! the software providers each read of a queue is a system call. Reading them all in every poll made one
//! operation cost as much as the connections a context holds, idle or not. So a poll reads:
//!
//! * the **hot** queues: those of endpoints that posted, completed something, or signalled recently. A ping-pong's
//!   connection stays hot, so its queue is read directly, as often as before, whatever else the context holds;
//! * the queues the **epoll set** says have signalled (each queue's wait descriptor is in the transport's epoll
//!   set, which is also what a sleeping thread waits on). The set is consulted every [`CONSULT_EVERY`] polls (by a
//!   poll that found nothing on the hot queues, or by any after twice that), and at once when the first poll after
//!   a sleep finds nothing on the hot queues (the wake-up came from elsewhere).
//!
//! A queue leaves the hot set after [`QUIET`] polls without activity, once it is armed (`fi_trywait` succeeded on
//! it since its last activity): from then on a completion signals its wait descriptor, and the epoll set reports
//! it. Arming before a sleep (`fi_trywait`) covers the event queue and the hot queues not armed since their last
//! activity; the others are armed already.
//!
//! Queues opened without a wait object ([`crate::CqWait::None`]) have no descriptor in the set and
//! cannot signal: they stay hot for their endpoint's life, so on such a context **every** connection's queue is
//! read in every poll (what that mode trades for queues outside any epoll set), and arming leaves them out (a poll
//! that stopped at its maximum makes arming report that completions may remain).

use nix::sys::epoll::{EpollEvent, EpollTimeout};

use exs_transport::{Completion, EndpointId, TransportError};

use crate::call::err;
use crate::ffi::*;
use crate::wait::EpWait;
use crate::FabricTransport;

/// The event queue's entry in the epoll set (completion queues are entered by endpoint id).
pub(crate) const EPOLL_EQ: u64 = u64::MAX;

/// A poll that finds nothing consults the epoll set if this many polls went by since the last consultation, and
/// any poll does after twice as many (a system call; a busy poller polls about every microsecond or two).
pub(crate) const CONSULT_EVERY: u64 = 16;
/// A queue with no activity for this many polls leaves the hot set (once armed).
pub(crate) const QUIET: u64 = 64;
/// Beyond this many hot queues (after many connections came up at once), a queue leaves the hot set as soon as a
/// poll finds nothing in it: a poll must not read hundreds of queues for 64 polls (queues without a wait object
/// excepted: they never leave).
const HOT_MAX: usize = 32;
/// Events one consultation of the epoll set takes in at most (the rest wait for the next one).
const EVENTS: usize = 256;

/// The hot set and the bookkeeping of consultations.
#[derive(Debug)]
pub(crate) struct Ready {
    /// Endpoints whose queues every poll reads.
    hot: Vec<EndpointId>,
    /// Polls so far.
    seq: u64,
    /// The poll that last consulted the epoll set.
    consulted: u64,
    /// The transport was armed since the last poll (a thread may have slept, and been woken by any queue).
    armed: bool,
    /// The last poll stopped at its maximum: completions may be left in queues without a wait object, which
    /// arming cannot report.
    full: bool,
    events: Vec<EpollEvent>,
    /// Counters for tests and stats.
    pub(crate) stats: ReadyStats,
}

/// What polling cost: queues read and consultations of the epoll set.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ReadyStats {
    /// Completion-queue reads (each a system call or more on the software providers).
    pub cq_reads: u64,
    /// Consultations of the epoll set.
    pub consults: u64,
    /// Polls.
    pub polls: u64,
}

impl Default for Ready {
    fn default() -> Self {
        Ready {
            hot: Vec::new(),
            seq: 0,
            consulted: 0,
            armed: false,
            full: false,
            events: vec![EpollEvent::empty(); EVENTS],
            stats: ReadyStats::default(),
        }
    }
}

/// Per endpoint: its place in the hot set and whether its queue is armed.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct EpReady {
    hot: bool,
    /// `fi_trywait` succeeded on the queue since its last activity: a completion will signal it.
    armed: bool,
    /// The poll of its last activity.
    last_active: u64,
    /// The poll that last read its queue.
    read_at: u64,
}

impl FabricTransport {
    /// Something happened on `id` (a post, a completion, a signal): its queue is read in every poll for a while.
    pub(crate) fn touch(&mut self, id: EndpointId) {
        let seq = self.ready.seq;
        let Some(e) = self.eps.get_mut(&id) else {
            return;
        };
        e.ready.armed = false;
        e.ready.last_active = seq;
        if !e.ready.hot {
            e.ready.hot = true;
            self.ready.hot.push(id);
        }
    }

    /// The epoll set reports `id`'s queue: it joins the hot set (without counting as activity: a queue whose
    /// signal is left over from completions already read must still go quiet), and must be armed again.
    fn signalled(&mut self, id: EndpointId) {
        let seq = self.ready.seq;
        let Some(e) = self.eps.get_mut(&id) else {
            return;
        };
        e.ready.armed = false;
        if !e.ready.hot {
            e.ready.hot = true;
            e.ready.last_active = seq;
            self.ready.hot.push(id);
        }
    }

    /// Reads one endpoint's queue (counted), marking it active when it held something.
    fn read_counted(&mut self, id: EndpointId, out: &mut Vec<Completion>, max: usize) -> usize {
        let seq = self.ready.seq;
        match self.eps.get_mut(&id) {
            Some(e) if e.ready.read_at != seq => {
                e.ready.read_at = seq;
                // The read runs the provider's progress, which may change what the queue waits on (a read request
                // taken in, its response queued: POLLOUT) without a completion: its entries in the epoll set are
                // brought up to date by the next arming before it can go quiet.
                if matches!(e.wait, EpWait::PollFd(_)) {
                    e.ready.armed = false;
                }
            }
            _ => return 0,
        }
        self.ready.stats.cq_reads += 1;
        let k = self.read_cq(id, out, max);
        if k > 0 {
            self.touch(id);
        }
        k
    }

    /// [`Transport::poll`](exs_transport::Transport::poll): the backlog, the hot queues, and (see the module
    /// documentation) the queues the epoll set reports.
    pub(crate) fn poll_cqs(&mut self, out: &mut Vec<Completion>, max: usize) -> usize {
        let mut n = 0;
        while n < max {
            let Some(c) = self.cq_backlog.pop_front() else {
                break;
            };
            out.push(c);
            n += 1;
        }
        if n >= max {
            self.ready.full = true;
            return n;
        }
        self.ready.seq += 1;
        self.ready.stats.polls += 1;
        let hot = std::mem::take(&mut self.ready.hot);
        let mut found = 0;
        // Each poll starts one queue further along: a queue whose completions fill `max` in every poll must not keep
        // the queues after it from ever being read.
        let start = (self.ready.seq as usize)
            .checked_rem(hot.len())
            .unwrap_or(0);
        for &id in hot[start..].iter().chain(&hot[..start]) {
            if n >= max {
                break;
            }
            let k = self.read_counted(id, out, max - n);
            n += k;
            found += k;
        }
        // Endpoints made hot while reading (none today) join the list taken out above.
        let added = std::mem::replace(&mut self.ready.hot, hot);
        self.ready.hot.extend(added);
        let woke = std::mem::take(&mut self.ready.armed);
        // A poll that found completions leaves its consultation to the next one, up to twice the interval: the
        // caller is about to act on what it found (a busy ping-pong's reply waited behind this system call in
        // 6-9% of its round trips), and a poll that finds nothing follows soon.
        let due = self.ready.seq - self.ready.consulted;
        if (found == 0 && (woke || due >= CONSULT_EVERY)) || due >= 2 * CONSULT_EVERY {
            n += self.consult(out, max.saturating_sub(n));
        } else if self.ready.hot.len() > HOT_MAX {
            self.retire();
        }
        self.ready.full = n >= max;
        n
    }

    /// Asks the epoll set which queues signalled, reads them, and retires quiet queues from the hot set.
    fn consult(&mut self, out: &mut Vec<Completion>, max: usize) -> usize {
        self.ready.consulted = self.ready.seq;
        self.ready.stats.consults += 1;
        let mut events = std::mem::take(&mut self.ready.events);
        let k = self
            .epoll
            .wait(&mut events, EpollTimeout::ZERO)
            .unwrap_or(0);
        let mut n = 0;
        for ev in &events[..k] {
            let data = ev.data();
            if data == EPOLL_EQ {
                continue;
            }
            let id = EndpointId(data as u32);
            self.signalled(id);
            if n < max {
                n += self.read_counted(id, out, max - n);
            }
        }
        self.ready.events = events;
        self.retire();
        n
    }

    /// Takes queues quiet for [`QUIET`] polls out of the hot set, arming each that is not armed yet (one whose
    /// arming fails has something waiting and stays).
    fn retire(&mut self) {
        let seq = self.ready.seq;
        let quiet = if self.ready.hot.len() > HOT_MAX {
            1
        } else {
            QUIET
        };
        let mut i = 0;
        while i < self.ready.hot.len() {
            let id = self.ready.hot[i];
            let Some(e) = self.eps.get_mut(&id) else {
                self.ready.hot.swap_remove(i);
                continue;
            };
            // A queue without a wait object could not signal once out of the set: it stays.
            if !e.wait.signals() || seq - e.ready.last_active < quiet {
                i += 1;
                continue;
            }
            if !e.ready.armed {
                // SAFETY: the queue is open (its endpoint is in the table); fi_trywait only inspects it.
                let ret = unsafe {
                    let mut fid: *mut fid = &mut (*e.cq).fid;
                    exs_fi_trywait(self.dom.fab.fabric, &mut fid, 1)
                };
                if ret != 0 {
                    e.ready.last_active = seq;
                    i += 1;
                    continue;
                }
                e.ready.armed = true;
                // Armed: from now on only its entries in the epoll set can say it has something.
                if let Err(err) = self.sync_armed(id) {
                    tracing::warn!(?id, %err, "a queue's wait descriptors could not be entered; it stays hot");
                    i += 1;
                    continue;
                }
            }
            if let Some(e) = self.eps.get_mut(&id) {
                e.ready.hot = false;
            }
            self.ready.hot.swap_remove(i);
        }
    }

    /// Brings a queue just armed up to date in the epoll set ([`FabricTransport::sync_wait`]); one whose entries
    /// could not be updated is left unarmed (hot, read in every poll, and armed again before a sleep).
    fn sync_armed(&mut self, id: EndpointId) -> Result<(), TransportError> {
        let r = self.sync_wait(id);
        if r.is_err() {
            if let Some(e) = self.eps.get_mut(&id) {
                e.ready.armed = false;
            }
        }
        r
    }

    /// [`Transport::arm`](exs_transport::Transport::arm): `fi_trywait` over the event queue and the hot queues not
    /// armed since their last activity (every other queue is armed already).
    pub(crate) fn arm_wait(&mut self) -> Result<bool, TransportError> {
        // Queues without a wait object cannot report what is left in them: a poll that stopped at its maximum may
        // have left some.
        if !self.cm_backlog.is_empty()
            || !self.cq_backlog.is_empty()
            || (self.cq_wait == crate::CqWait::None && self.ready.full)
        {
            return Ok(false);
        }
        // The event queue and a few hot queues: no allocation per sleep.
        let mut fids: smallvec::SmallVec<[*mut fid; 8]> = smallvec::SmallVec::new();
        // SAFETY: the event queue and the queues of endpoints in the table are open; fi_trywait only inspects them.
        let ret = unsafe {
            fids.push(&mut (*self.eq).fid);
            for id in &self.ready.hot {
                if let Some(e) = self
                    .eps
                    .get(id)
                    .filter(|e| !e.ready.armed && e.wait.signals())
                {
                    fids.push(&mut (*e.cq).fid);
                }
            }
            exs_fi_trywait(self.dom.fab.fabric, fids.as_mut_ptr(), fids.len() as i32)
        };
        match ret {
            0 => {
                for i in 0..self.ready.hot.len() {
                    let id = self.ready.hot[i];
                    let Some(e) = self.eps.get_mut(&id).filter(|e| e.wait.signals()) else {
                        continue;
                    };
                    let newly = !e.ready.armed;
                    e.ready.armed = true;
                    // Armed now: its entries in the epoll set must say what the queue waits on.
                    if newly {
                        self.sync_armed(id)?;
                    }
                }
                self.ready.armed = true;
                Ok(true)
            }
            r if r == -(FI_EAGAIN as i32) => Ok(false),
            r => Err(err("fi_trywait", r.into())),
        }
    }

    /// How polling went so far (for tests: a poll reads no more queues than are hot or signalled).
    pub fn ready_stats(&self) -> ReadyStats {
        self.ready.stats
    }

    /// Queues in the hot set now.
    pub fn hot_queues(&self) -> usize {
        self.ready.hot.len()
    }
}

//! Errors of a transport's shared queues that another transport read (see [`crate::events`]): rdma_cm hands every
//! user of a device in the process the same device context, so whichever transport reads the context's event
//! descriptor first takes every transport's asynchronous events. An error of a transport's completion queue or
//! shared receive queue (`IBV_EVENT_CQ_ERR`, `IBV_EVENT_SRQ_ERR`) means that none of its operations will complete
//! again; read by another transport, it was only logged, and the owner's connections stalled for good.
//!
//! Each transport now enters its completion queue (and its shared receive queue, once made) here, beside its
//! [`Mailbox`], for as long as the queue lives. A reader of such an error for a queue that is not its own hands it
//! to the owner's mailbox ([`deliver`]), whose descriptor, in the owner's wait set, wakes the owner; the owner's
//! next poll or arming takes it ([`Mailbox::take`]) and takes every connection down, as for its own error.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, Weak};

use nix::sys::eventfd::{EfdFlags, EventFd};

/// No error delivered ([`Mailbox::failed`]).
const NONE: u32 = u32::MAX;

/// Where one transport receives the errors of its queues that others read.
#[derive(Debug)]
pub(crate) struct Mailbox {
    /// The code of the event that failed one of its queues (`enum ibv_event_type`), or [`NONE`].
    failed: AtomicU32,
    /// Readable once an error was delivered: in the owner's wait set.
    wake: EventFd,
}

impl Mailbox {
    pub(crate) fn new() -> std::io::Result<Arc<Mailbox>> {
        let wake =
            EventFd::from_value_and_flags(0, EfdFlags::EFD_NONBLOCK | EfdFlags::EFD_CLOEXEC)?;
        Ok(Arc::new(Mailbox {
            failed: AtomicU32::new(NONE),
            wake,
        }))
    }

    /// The descriptor that becomes readable when an error is delivered.
    pub(crate) fn fd(&self) -> std::os::fd::BorrowedFd<'_> {
        use std::os::fd::AsFd;
        self.wake.as_fd()
    }

    /// Whether an error was delivered and not taken yet (one atomic load: the owner asks in every poll).
    pub(crate) fn pending(&self) -> bool {
        self.failed.load(Ordering::Acquire) != NONE
    }

    /// The code of the error delivered, if any, once.
    pub(crate) fn take(&self) -> Option<u32> {
        let code = self.failed.swap(NONE, Ordering::AcqRel);
        (code != NONE).then_some(code)
    }

    /// Reads the descriptor back to unreadable, before a look at [`Mailbox::take`] (a delivery sets the error,
    /// then writes the descriptor: read after, the descriptor could stay readable with nothing to take).
    pub(crate) fn quiet(&self) {
        let _ = self.wake.read();
    }

    fn post(&self, code: u32) {
        // The first error stays: one is enough to take the transport down.
        let _ = self
            .failed
            .compare_exchange(NONE, code, Ordering::AcqRel, Ordering::Acquire);
        let _ = self.wake.write(1);
    }
}

/// The owners of the queues entered, by the queue's address.
static ROUTES: Mutex<Option<HashMap<usize, Weak<Mailbox>>>> = Mutex::new(None);

fn routes() -> std::sync::MutexGuard<'static, Option<HashMap<usize, Weak<Mailbox>>>> {
    ROUTES.lock().unwrap_or_else(|p| p.into_inner())
}

/// Enters `queue` (a completion queue's or shared receive queue's address) as `owner`'s, until [`leave`].
pub(crate) fn enter<T>(queue: *mut T, owner: &Arc<Mailbox>) {
    routes()
        .get_or_insert_with(HashMap::new)
        .insert(queue as usize, Arc::downgrade(owner));
}

/// Takes `queue` out (before it is destroyed: its address may be another queue's next).
pub(crate) fn leave<T>(queue: *mut T) {
    if let Some(m) = routes().as_mut() {
        m.remove(&(queue as usize));
    }
}

/// Hands the error `code` (`enum ibv_event_type`) of `queue` to its owner; whether one was found (a queue of no
/// transport of this process any more, or of a library outside exs, has none).
pub(crate) fn deliver<T>(queue: *mut T, code: u32) -> bool {
    let owner = routes()
        .as_ref()
        .and_then(|m| m.get(&(queue as usize)))
        .and_then(Weak::upgrade);
    match owner {
        Some(mb) => {
            mb.post(code);
            true
        }
        None => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CQ_ERR: u32 = 0;
    const SRQ_ERR: u32 = 14;

    fn readable(mb: &Mailbox) -> bool {
        use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
        let mut fds = [PollFd::new(mb.fd(), PollFlags::POLLIN)];
        poll(&mut fds, PollTimeout::ZERO).unwrap() == 1
    }

    /// Review finding (the events module's note): a completion queue's error read by another transport on the same
    /// device context was only logged. It now reaches the owner: its descriptor wakes it, and its next look takes
    /// the error, once; another transport's mailbox is untouched, and a queue nobody entered (or that left) finds
    /// no owner.
    #[test]
    fn a_queue_error_read_by_another_transport_reaches_the_queues_owner() {
        let (a, b) = (Mailbox::new().unwrap(), Mailbox::new().unwrap());
        let (mut qa, mut qb) = (0u8, 0u8);
        let (qa, qb): (*mut u8, *mut u8) = (&mut qa, &mut qb);
        enter(qa, &a);
        enter(qb, &b);
        assert!(!b.pending() && !readable(&b));
        assert!(deliver(qb, CQ_ERR), "b's queue has an owner");
        assert!(b.pending() && readable(&b), "b is woken");
        assert!(!a.pending() && !readable(&a), "a's mailbox is untouched");
        // A second error before b looked: one is enough.
        assert!(deliver(qb, SRQ_ERR));
        b.quiet();
        assert!(!readable(&b), "the descriptor read back to quiet");
        assert_eq!(b.take(), Some(CQ_ERR));
        assert_eq!(b.take(), None, "taken once");
        leave(qb);
        assert!(!deliver(qb, CQ_ERR), "a queue that left has no owner");
        drop(a);
        assert!(!deliver(qa, CQ_ERR), "nor one whose transport is gone");
        leave(qa);
    }
}

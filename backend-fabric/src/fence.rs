//! Memory a revoked key may still reach: kept until the connection has shown that the peer's accesses under it are
//! over.
//!
//! A software provider (tcp) checks a remote key once, when an RDMA read's or write's header arrives, and moves the
//! bytes over later progress calls without looking at the registration again: closing the registration
//! ([`FiKey`](crate::memory::FiKey)) stops new accesses, not one under way. The engine revokes a key only once the
//! protocol says the peer is done with it, so an honest peer's accesses are over by then; a hostile one can
//! acknowledge a read it has not taken in (its response stays queued at our side while it does not read its
//! socket), or start a write just before it says it is done. The range's lease still goes back to the application
//! at once (it may read, reuse or drop its buffer as with any other transport), but the buffer's memory itself is
//! held here, so that what the provider may still read or write is never memory handed out again (another
//! buffer of the process, another connection's). It goes once the endpoint shows the access over, in the order the
//! provider keeps on the connection's stream:
//!
//! * a key for remote read: once a transmit request posted after the revocation has completed. The provider
//!   sends its read responses ahead of the requests it was given (`priority_queue` before `tx_queue`), one after
//!   the other, so a request that went out after the revocation went out after every response queued before it.
//! * a key for remote write: once a receive-side completion (a message, a write with immediate data) was
//!   generated after the revocation. The provider takes the peer's stream in order, one transfer at a time, so a
//!   completion of a later transfer means that every write begun before it has landed. "Generated after" is
//!   known from the reads of the queue: one that began after the revocation and found the queue empty at its end
//!   returned everything generated before it, so what later reads return came after.
//!
//! Or when the endpoint is closed (the provider no longer touches anything for it). An idle connection keeps what
//! it holds until its next message or its end; the application's leases are not held, so nothing waits on it.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use exs_dma::DmaBuf;
use exs_transport::RemoteAccess;

/// What an endpoint's revoked keys left to hold, shared by the keys (which add to it from any thread) and the
/// transport (which settles it as the endpoint's queue is read).
#[derive(Debug, Default)]
pub(crate) struct Fence {
    /// Revoked since the transport last looked, not yet stamped with the endpoint's counters.
    new: Mutex<Vec<(Arc<DmaBuf>, RemoteAccess)>>,
    /// `new.len()`, looked at without the lock on every read of the queue.
    waiting: AtomicUsize,
}

impl Fence {
    /// A key of `access` over memory of `buf` was revoked: the memory is held until the endpoint shows the
    /// peer's accesses under it over.
    pub(crate) fn hold(&self, buf: Arc<DmaBuf>, access: RemoteAccess) {
        let mut new = self.new.lock().unwrap_or_else(|p| p.into_inner());
        new.push((buf, access));
        self.waiting.store(new.len(), Ordering::Release);
    }

    fn take_new(&self) -> Vec<(Arc<DmaBuf>, RemoteAccess)> {
        if self.waiting.load(Ordering::Acquire) == 0 {
            return Vec::new();
        }
        let mut new = self.new.lock().unwrap_or_else(|p| p.into_inner());
        self.waiting.store(0, Ordering::Release);
        std::mem::take(&mut *new)
    }
}

/// Memory held for one revoked key, with what the endpoint had done when the transport first saw it (later than
/// the revocation, which only makes the hold longer).
#[derive(Debug)]
struct Held {
    _buf: Arc<DmaBuf>,
    access: RemoteAccess,
    /// Transmit requests posted on the endpoint by then: one numbered above completes the hold of a read key.
    posted: u64,
    /// Reads of the endpoint's queue begun by then (this one included).
    read: u64,
    /// A later read that emptied the queue: receive-side completions of reads after it complete the hold of a
    /// write key.
    drained_at: Option<u64>,
}

/// The transport's side of one endpoint's fence: its counters and what it holds.
#[derive(Debug, Default)]
pub(crate) struct EpFence {
    shared: Arc<Fence>,
    held: Vec<Held>,
    /// Transmit requests (sends, writes, reads) posted so far; each record is numbered with the count.
    posted: u64,
    /// Reads of the queue begun so far.
    reads: u64,
}

/// What one read of the endpoint's queue returned, as far as the fence is concerned.
#[derive(Debug, Default)]
pub(crate) struct ReadTally {
    /// The highest number of a transmit request it completed (0: none).
    pub(crate) tx: u64,
    /// Whether it returned a receive-side completion (a message, a write with immediate data).
    pub(crate) rx: bool,
}

impl EpFence {
    /// The transport's side of `shared`, for an endpoint opening now.
    pub(crate) fn new(shared: Arc<Fence>) -> Self {
        EpFence {
            shared,
            ..Default::default()
        }
    }

    /// Numbers a transmit request about to be posted.
    pub(crate) fn next_tx(&mut self) -> u64 {
        self.posted += 1;
        self.posted
    }

    /// A read of the queue begins: its number. Keys revoked since the last look are stamped now.
    pub(crate) fn read_begins(&mut self) -> u64 {
        self.reads += 1;
        for (buf, access) in self.shared.take_new() {
            self.held.push(Held {
                _buf: buf,
                access,
                posted: self.posted,
                read: self.reads,
                drained_at: None,
            });
        }
        self.reads
    }

    /// Read `read` of the queue ended with `tally`, having emptied the queue (`drained`) or not: lets go of what
    /// the endpoint has shown safe.
    pub(crate) fn read_ends(&mut self, read: u64, tally: &ReadTally, drained: bool) {
        if self.held.is_empty() {
            return;
        }
        self.held.retain_mut(|h| {
            let over = match h.access {
                RemoteAccess::Read => tally.tx > h.posted,
                RemoteAccess::Write => tally.rx && h.drained_at.is_some_and(|d| read > d),
            };
            if !over && drained && h.drained_at.is_none() && read > h.read {
                h.drained_at = Some(read);
            }
            !over
        });
    }

    /// Revoked keys whose memory is held now.
    #[cfg(test)]
    pub(crate) fn held_len(&self) -> usize {
        self.held.len() + self.shared.waiting.load(Ordering::Acquire)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn buf() -> Arc<DmaBuf> {
        DmaBuf::new(4096)
    }

    #[test]
    fn a_read_key_is_held_until_a_request_posted_after_it_completes() {
        let mut f = EpFence::new(Default::default());
        let before = f.next_tx();
        f.shared.hold(buf(), RemoteAccess::Read);
        let r = f.read_begins();
        // The request posted before the revocation completes: the response may still be behind it.
        f.read_ends(
            r,
            &ReadTally {
                tx: before,
                rx: true,
            },
            true,
        );
        assert_eq!(f.held_len(), 1);
        let after = f.next_tx();
        let r = f.read_begins();
        f.read_ends(
            r,
            &ReadTally {
                tx: after,
                rx: false,
            },
            false,
        );
        assert_eq!(f.held_len(), 0);
    }

    #[test]
    fn a_write_key_is_held_until_a_transfer_generated_after_a_drain() {
        let mut f = EpFence::new(Default::default());
        f.shared.hold(buf(), RemoteAccess::Write);
        // The first read after the revocation may return completions generated before it: they do not count,
        // and it did not empty the queue.
        let r = f.read_begins();
        f.read_ends(r, &ReadTally { tx: 0, rx: true }, false);
        // This one empties it, but what it returned may still be older.
        let r = f.read_begins();
        f.read_ends(r, &ReadTally { tx: 0, rx: true }, true);
        assert_eq!(f.held_len(), 1);
        // A transmit completion says nothing of the peer's writes.
        let t = f.next_tx();
        let r = f.read_begins();
        f.read_ends(r, &ReadTally { tx: t, rx: false }, true);
        assert_eq!(f.held_len(), 1);
        let r = f.read_begins();
        f.read_ends(r, &ReadTally { tx: 0, rx: true }, false);
        assert_eq!(f.held_len(), 0);
    }
}

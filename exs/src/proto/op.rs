//! Operations as the protocol sees them: an identifier, and completions reported as values.
//!
//! The protocol never touches an event queue. When it finishes an operation it pushes a [`Done`] into the
//! engine's [`Outbox`]; the engine, the one place that owns the event-queue tickets, turns each into an event
//! after every call and every round of progress.

use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use crate::error::OpError;

/// Extra facts about a completed receive (the protocol's word for them; events carry them as they are).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct EventFlags {
    /// The message was longer than the receive buffer; the rest was discarded (like recvmsg's MSG_TRUNC).
    pub truncated: bool,
    /// End of stream: the peer closed or shut down its sending side; no bytes were received.
    pub eof: bool,
    /// The receive holds the end of one whole message of a `SOCK_SEQPACKET` socket (like recvmsg's `MSG_EOR`).
    /// Not set by a read of a range of the peer's persistent send (`recv_offset`), by a stream receive, or at
    /// end of stream.
    pub eor: bool,
}

impl EventFlags {
    /// End of stream, nothing truncated.
    pub const EOF: EventFlags = EventFlags {
        eof: true,
        truncated: false,
        eor: false,
    };
}

/// What the protocol reports about an operation.
#[derive(Debug)]
pub(crate) enum Done {
    /// The operation finished (exactly once per operation).
    Complete {
        id: u64,
        status: Result<(), OpError>,
        bytes: usize,
        flags: EventFlags,
    },
    /// A persistent send with notification was read `reads` more times (seed 002, 4.2).
    Notify { id: u64, reads: usize },
}

/// Where the protocol's completions wait for the engine. Tokens complete under the engine lock, but one dropped
/// elsewhere reports too, hence the lock; `queued` lets the engine's every round and call skip it while nothing
/// waits (most rounds of a busy poller find nothing).
#[derive(Clone, Default)]
pub(crate) struct Outbox(Arc<Reported>);

#[derive(Default)]
struct Reported {
    done: Mutex<Vec<Done>>,
    /// Set, under the lock, by every report; cleared by the take that moves them.
    queued: AtomicBool,
}

impl fmt::Debug for Outbox {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Outbox")
    }
}

impl Outbox {
    fn push(&self, d: Done) {
        let mut v = self.0.done.lock().unwrap_or_else(|p| p.into_inner());
        v.push(d);
        self.0.queued.store(true, Ordering::Release);
    }

    /// Moves everything reported so far into `into`. A report made while this runs, on another thread, is taken
    /// by the next call.
    pub(crate) fn take(&self, into: &mut Vec<Done>) {
        if !self.0.queued.load(Ordering::Acquire) {
            return;
        }
        let mut v = self.0.done.lock().unwrap_or_else(|p| p.into_inner());
        self.0.queued.store(false, Ordering::Relaxed);
        into.append(&mut v);
    }
}

/// One started operation. Completing it reports a [`Done`]; dropping it uncompleted reports it cancelled, so an
/// operation is never lost, whatever path the protocol takes.
pub(crate) struct OpToken {
    id: u64,
    out: Option<Outbox>,
}

impl fmt::Debug for OpToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "OpToken({})", self.id)
    }
}

impl OpToken {
    pub(crate) fn new(id: u64, out: Outbox) -> Self {
        OpToken { id, out: Some(out) }
    }

    /// Completes the operation.
    pub(crate) fn complete(mut self, status: Result<(), OpError>, bytes: usize, flags: EventFlags) {
        self.finish(status, bytes, flags);
    }

    /// Completes a receive with end-of-stream: no bytes, `flags.eof` set.
    pub(crate) fn complete_eof(self) {
        self.complete(Ok(()), 0, EventFlags::EOF);
    }

    /// Reports `reads` more reads of a persistent send (the engine folds them while the queue is full).
    pub(crate) fn notify(&self, reads: usize) {
        if let Some(out) = &self.out {
            out.push(Done::Notify { id: self.id, reads });
        }
    }

    /// Hands the operation back unreported (it was refused synchronously and never started).
    pub(crate) fn into_id(mut self) -> u64 {
        self.out = None;
        self.id
    }

    fn finish(&mut self, status: Result<(), OpError>, bytes: usize, flags: EventFlags) {
        if let Some(out) = self.out.take() {
            out.push(Done::Complete {
                id: self.id,
                status,
                bytes,
                flags,
            });
        }
    }
}

impl Drop for OpToken {
    fn drop(&mut self) {
        self.finish(Err(OpError::Cancelled), 0, EventFlags::default());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(out: &Outbox) -> Vec<u64> {
        let mut v = Vec::new();
        out.take(&mut v);
        v.iter()
            .map(|d| match d {
                Done::Complete { id, .. } | Done::Notify { id, .. } => *id,
            })
            .collect()
    }

    /// The take skips the lock while nothing was reported; whatever was reported, on this thread or by a token
    /// dropped on another, reaches a take after it, once.
    #[test]
    fn every_report_reaches_one_take_whichever_thread_made_it() {
        let out = Outbox::default();
        assert!(ids(&out).is_empty());
        OpToken::new(1, out.clone()).complete(Ok(()), 8, EventFlags::default());
        let t = OpToken::new(2, out.clone());
        t.notify(3);
        assert_eq!(ids(&out), vec![1, 2]);
        assert!(ids(&out).is_empty());
        std::thread::spawn(move || drop(t)).join().unwrap();
        assert_eq!(ids(&out), vec![2]);
        assert!(ids(&out).is_empty());
    }
}

//! [`Ticket`]: the promise that an operation completes with exactly one event.

use super::*;

/// The promise that an operation will complete with exactly one event. Dropping a ticket without completing it
/// completes it as cancelled, so no operation can be lost silently.
pub(crate) struct Ticket {
    pub(super) eq: Option<Arc<EqInner>>,
    /// Instead of a queue: a continuation of this crate's own (chunked sendfile), run with the event once the
    /// engine lock is let go.
    pub(super) hook: Option<Box<dyn FnOnce(Event) + Send>>,
    pub(super) kind: EventKind,
    pub(super) context: u64,
    pub(super) socket: SocketId,
}

impl fmt::Debug for Ticket {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Ticket")
            .field("kind", &self.kind)
            .field("context", &self.context)
            .finish()
    }
}

impl Ticket {
    /// A ticket whose event goes to `hook` (run outside the engine lock) rather than to a queue.
    pub(crate) fn hooked(
        kind: EventKind,
        context: u64,
        socket: SocketId,
        hook: impl FnOnce(Event) + Send + 'static,
    ) -> Ticket {
        Ticket {
            eq: None,
            hook: Some(Box::new(hook)),
            kind,
            context,
            socket,
        }
    }

    /// Gives the slot back without an event: the operation was refused synchronously and never started.
    pub(crate) fn discard(mut self) {
        self.hook = None;
        if let Some(eq) = self.eq.take() {
            let mut s = eq.lock();
            s.outstanding = s.outstanding.saturating_sub(1);
        }
    }

    /// Completes the operation.
    /// The socket and the kind of operation, for the connection's byte counters.
    pub(crate) fn counted(&self) -> (SocketId, EventKind) {
        (self.socket, self.kind)
    }

    pub(crate) fn complete(mut self, status: Result<(), OpError>, bytes: usize, flags: EventFlags) {
        self.finish(status, bytes, flags, None, crate::ids::Readiness::default());
    }

    /// An extra event for a long-lived operation (a persistent send's read notification, the UNH-EXS paper 4.2), with
    /// the ticket's context value. It takes a free slot of the queue if there is one; when the queue is full it is
    /// not queued and `false` comes back, so the caller can fold it into the next one.
    pub(crate) fn notify(&self, kind: EventKind, bytes: usize) -> bool {
        let Some(eq) = &self.eq else { return false };
        let mut s = eq.lock();
        // This ticket's own slot is counted in `outstanding`; the extra event needs another.
        if s.outstanding + s.events.len() >= eq.depth {
            return false;
        }
        s.outstanding += 1;
        drop(s);
        eq.complete(Event {
            kind,
            status: Ok(()),
            bytes,
            context: self.context,
            flags: EventFlags::default(),
            socket: self.socket,
            accepted: None,
            readiness: Default::default(),
        });
        true
    }

    /// Completes a receive with end-of-stream: no bytes, `flags.eof` set.
    pub(crate) fn complete_eof(self) {
        self.complete(Ok(()), 0, EventFlags::EOF);
    }

    /// Completes an accept with the new connection.
    pub(crate) fn complete_accept(mut self, accepted: Accepted) {
        self.finish(
            Ok(()),
            0,
            EventFlags::default(),
            Some(accepted),
            crate::ids::Readiness::default(),
        );
    }

    /// Completes a poll with readiness.
    pub(crate) fn complete_poll(mut self, readiness: crate::ids::Readiness) {
        self.finish(Ok(()), 0, EventFlags::default(), None, readiness);
    }

    fn finish(
        &mut self,
        status: Result<(), OpError>,
        bytes: usize,
        flags: EventFlags,
        accepted: Option<Accepted>,
        readiness: crate::ids::Readiness,
    ) {
        let event = Event {
            kind: self.kind,
            status,
            bytes,
            context: self.context,
            flags,
            socket: self.socket,
            accepted,
            readiness,
        };
        if let Some(eq) = self.eq.take() {
            eq.complete(event);
        } else if let Some(hook) = self.hook.take() {
            crate::lock::run_unlocked(move || hook(event));
        }
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        self.finish(
            Err(OpError::Cancelled),
            0,
            EventFlags::default(),
            None,
            Default::default(),
        );
    }
}

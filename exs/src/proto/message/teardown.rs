//! The end of a connection: the peer's close, failures, and the release of every operation.

use super::*;

impl MessageProto {
    /// The peer closed: its unread adverts are gone, our receives end with end-of-stream (including those
    /// whose read is still in flight: the sender cancelled that message), our sends fail.
    pub(crate) fn on_peer_close(&mut self, reason: crate::wire::CloseReason) {
        self.peer_closed = true;
        if reason == crate::wire::CloseReason::ShutdownWrite {
            // Half close: every advert the peer sent came before; they are still read (the peer waits for
            // that), and receives beyond them see end-of-stream. Our sends go on.
            self.end_unmatched_receives();
            return;
        }
        self.adverts.clear();
        for r in self.recvs.drain(..) {
            r.ticket.complete_eof();
        }
        for t in self.transfers.iter_mut().filter(|t| t.reads_in_flight > 0) {
            t.failed.get_or_insert(OpError::PeerClosed);
        }
        self.fail_sends(OpError::PeerClosed);
    }

    /// Once the peer has closed its side, receives that no advert can take any more see end-of-stream: those
    /// left when the last advert has been matched or consumed. Nothing else will come (an advert after the close
    /// is a violation). Counting waiting receives against queued adverts is not enough: an ended persistent send
    /// waiting for its read, or the peer's persistent receive, stays queued without ever taking a receive, and
    /// the receives behind it waited for ever (review: a receive after the peer ended its persistent send and shut
    /// down writing).
    ///
    /// Not while a read is still running: its receive was made earlier and completes first (a later receive's
    /// end-of-stream reported before it made an application that closes on end-of-stream lose that message).
    pub(super) fn end_unmatched_receives(&mut self) {
        if self.peer_closed && self.adverts.is_empty() && self.transfers.is_empty() {
            for r in self.recvs.drain(..) {
                r.ticket.complete_eof();
            }
        }
    }

    pub(super) fn fail_sends(&mut self, err: OpError) {
        for s in self.queue.drain(..) {
            if let Some(t) = s.ticket {
                t.complete(Err(err.clone()), 0, EventFlags::default());
            }
        }
        // Their message left: the peer may have it, so never `Cancelled` (issue 14).
        for o in self.unacked.iter_mut() {
            if !o.acked {
                o.failed
                    .get_or_insert_with(|| err.clone().once_started(true));
            }
        }
        self.complete_sends();
    }

    /// Fails the sends not completed yet (the peer stopped receiving).
    pub(crate) fn fail_pending_sends(&mut self, err: OpError) {
        let oldest = self.oldest_unacked();
        self.stopped_from.get_or_insert(oldest);
        self.fail_sends(err);
    }

    /// Fails every operation. Those whose memory is still with the transport complete when it comes back
    /// (or at [`MessageProto::drop_all`]).
    pub(crate) fn fail(&mut self, err: OpError) {
        self.fail_sends(err.clone());
        self.fail_receives(err);
    }

    /// Fails the receiving side's operations (a graceful close keeps the sends going).
    pub(crate) fn fail_receives(&mut self, err: OpError) {
        self.receives_ended = true;
        for r in self.recvs.drain(..) {
            r.ticket
                .complete(Err(err.clone()), 0, EventFlags::default());
        }
        self.adverts.clear();
        for t in self.transfers.iter_mut() {
            t.failed.get_or_insert_with(|| err.clone());
        }
        self.complete_transfers_with(None);
        for w in self.writes.iter_mut() {
            w.failed.get_or_insert_with(|| err.clone());
        }
        if let Some(own) = self.own_precv.as_mut() {
            // Its exposure goes at drop_all, when the peer can no longer write.
            if let Some(t) = own.ticket.take() {
                t.complete(Err(err.clone()), 0, EventFlags::default());
            }
        }
        if self.own_precv.as_ref().is_some_and(|o| o.seq.is_none()) {
            // Its advert is still queued behind the credits: it must not go out now (the peer would get a key to
            // memory whose receive ended). The peer never had the key, so the exposure goes at once.
            self.queue
                .retain(|s| !matches!(s.data, SendData::PersistentRecv));
            self.own_precv = None;
        }
        self.peer_precv = None;
    }

    /// The endpoint is gone and the transport returned every work request: complete everything left.
    pub(crate) fn drop_all(&mut self, err: OpError) {
        for o in self.unacked.iter_mut() {
            o.inline_in_flight = false;
        }
        for t in self.transfers.iter_mut() {
            t.reads_in_flight = 0;
        }
        for w in self.writes.iter_mut() {
            w.done = true;
        }
        self.fail(err.clone());
        while let Some(mut w) = self.writes.pop_front() {
            if let Some(t) = w.ticket.take() {
                t.complete(
                    Err(w.failed.take().unwrap_or_else(|| err.clone())),
                    0,
                    EventFlags::default(),
                );
            }
        }
        self.own_precv = None;
        for (exposure, ticket, e) in self.retired.drain(..) {
            drop(exposure);
            ticket.complete(Err(e), 0, EventFlags::default());
        }
    }
}

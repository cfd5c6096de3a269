//! Acknowledgments (seed 002, 3.2): when to send them, what an arriving one completes, and the order in which
//! sends complete.

use super::*;

impl MessageProto {
    /// Whether an acknowledgment is due.
    pub(crate) fn ack_due(&self) -> bool {
        self.done_seq != self.acked_seq
    }

    /// Whether a due acknowledgment should go now rather than wait for a reply to carry it.
    ///
    /// Like TCP's delayed acknowledgment, but only for request/response traffic: when we have sent adverts since
    /// our last acknowledgment, the application is answering, and its next advert will carry the acknowledgment.
    /// A one-way stream of messages is acknowledged at once, and so is any backlog of half the peer's credits
    /// (the sender must never stall on a delayed acknowledgment).
    pub(crate) fn ack_now(&self) -> bool {
        let waiting = self.expected_seq.wrapping_sub(self.acked_seq);
        let answering = self.stats.adverts_sent > self.ack_marker;
        !self.delay_acks
            || !answering
            || self.peer_closed
            || waiting >= self.recv_window.div_ceil(2)
    }

    /// Queues an explicit ACK if one is due and none is queued (it is dropped at send time if a piggyback took it).
    pub(crate) fn queue_ack(&mut self, link: &mut Link) {
        if self.ack_due() && !link.has_queued(Kind::Ack) {
            link.push_ctrl(Body::Ack, None, None);
        }
    }

    /// Our oldest advert the peer has not acknowledged (the next one when all are).
    pub(super) fn oldest_unacked(&self) -> u32 {
        self.unacked
            .iter()
            .find(|o| !o.acked)
            .map(|o| o.seq)
            .unwrap_or(self.next_seq)
    }

    /// The peer acknowledged `ack` adverts in total (seed 002, 3.2).
    pub(crate) fn on_ack(&mut self, ack: u32, link: &mut Link) -> Result<(), Violation> {
        if let Some(floor) = self.stopped_from {
            // The peer stopped receiving and our sends from `floor` on were failed. Transfers it had under way
            // may still finish and be acknowledged after its notice (soak, with coalescing: an acknowledgment
            // held behind a send in flight left after it); that changes nothing here, but it must not reach
            // beyond what we sent.
            if ack.wrapping_sub(floor) <= self.next_seq.wrapping_sub(floor) {
                return Ok(());
            }
            return Err(Violation::UnknownAck {
                seq: ack,
                oldest: floor,
                outstanding: self.next_seq.wrapping_sub(floor) as usize,
            });
        }
        let oldest = self.oldest_unacked();
        let newly = ack.wrapping_sub(oldest) as usize;
        let waiting = self.unacked.iter().filter(|o| !o.acked).count();
        if newly > waiting {
            return Err(Violation::UnknownAck {
                seq: ack,
                oldest,
                outstanding: waiting,
            });
        }
        let mut marked = 0;
        for o in self.unacked.iter_mut().filter(|o| !o.acked).take(newly) {
            o.acked = true;
            // Revoke the remote key now: the peer is done reading (least exposure).
            o.exposure = None;
            marked += 1;
        }
        self.credits += marked;
        self.complete_sends();
        self.pump(link);
        Ok(())
    }

    /// The control message carrying immediate data for advert `seq` left (its buffer lease came back).
    pub(crate) fn on_inline_sent(&mut self, seq: u32, status: Result<(), WcError>) {
        if let Some(o) = self.unacked.iter_mut().find(|o| o.seq == seq) {
            o.inline_in_flight = false;
            if let Err(e) = status {
                o.failed.get_or_insert_with(|| e.into());
            }
        }
        self.complete_sends();
    }

    /// Completes sends in order: an acknowledged send once its local buffer is free too, and an immediate send
    /// as soon as its control message has left (seed 002, 4.1: the data travels inside the advertisement, so
    /// once the transport has it the buffer is free and nothing remains to wait for; like TCP's `send`, the
    /// event says the bytes are on their way, and the acknowledgment only returns the advertisement's credit).
    /// An immediate send behind one still waiting for its acknowledgment waits too: events stay in order.
    pub(super) fn complete_sends(&mut self) {
        self.retire_finished();
        for o in self.unacked.iter_mut() {
            if o.ticket.is_none() {
                continue; // completed early already
            }
            if !(o.immediate && !o.inline_in_flight && o.failed.is_none()) {
                break;
            }
            if let Some(t) = o.ticket.take() {
                t.complete(Ok(()), o.len, EventFlags::default());
            }
        }
    }

    /// Pops, in order, the sends that are acknowledged (or failed) with their buffers free, completing the
    /// ones not completed yet.
    pub(super) fn retire_finished(&mut self) {
        while let Some(o) = self.unacked.front() {
            let finished = (o.acked || o.failed.is_some()) && !o.inline_in_flight;
            if !finished {
                return;
            }
            let mut o = self.unacked.pop_front().expect("checked");
            if !o.acked && o.exposure.is_some() && o.ticket.is_some() {
                let exposure = o.exposure.take().expect("checked");
                let ticket = o.ticket.take().expect("checked");
                let err = o.failed.take().unwrap_or(OpError::ConnectionReset);
                self.retired.push((exposure, ticket, err));
                continue;
            }
            if let Some(t) = o.ticket.take() {
                match o.failed.take() {
                    None => t.complete(Ok(()), o.len, EventFlags::default()),
                    Some(e) => t.complete(Err(e), 0, EventFlags::default()),
                }
            }
        }
    }
}

impl AckSource for MessageProto {
    fn take_ack(&mut self, carrier: Kind) -> Option<u32> {
        if self.done_seq == self.acked_seq {
            return None;
        }
        self.acked_seq = self.done_seq;
        self.ack_marker = self.stats.adverts_sent - u64::from(carrier == Kind::Advert);
        Some(self.done_seq)
    }
}

//! Persistent sends and receives (seed 002, 4.2-4.4): writes into the peer's persistent receive, read
//! notifications, and the end of a persistent operation.

use super::*;

impl MessageProto {
    /// Seed 002, 4.3: "the same exs_rcv will be used to satisfy all subsequent exs_sends": the send becomes an
    /// RDMA write into the peer's persistent receive (at `offset`), complete when the write is.
    pub(super) fn write_to_peer(&mut self, req: SendReq, p: PeerPersistentRecv, link: &mut Link) {
        let SendData::Inline(sge) = req.data else {
            unreachable!("checked by the caller")
        };
        let Some(ticket) = req.ticket else { return };
        if p.ending || req.offset.saturating_add(req.len as u64) > p.len {
            // The engine checked the range against the receive it saw; it ended since.
            ticket.complete(Err(OpError::PersistentEnded), 0, EventFlags::default());
            return;
        }
        let tag = WRITE_TAG | (self.next_write & !WRITE_TAG);
        self.next_write = self.next_write.wrapping_add(1);
        self.stats.persistent_writes += 1;
        if req.len == 0 {
            drop(sge);
            ticket.complete(Ok(()), 0, EventFlags::default());
            return;
        }
        link.push_write(
            DataOp::Write {
                local: vec![sge],
                remote: RemoteRef {
                    addr: p.addr + req.offset,
                    key: p.key,
                },
                imm: None,
            },
            tag,
        );
        self.writes.push_back(PersistentWrite {
            tag,
            ticket: Some(ticket),
            len: req.len,
            done: false,
            failed: None,
        });
    }

    /// An RDMA write into the peer's persistent receive finished.
    pub(crate) fn on_write_done(&mut self, tag: u32, status: Result<(), WcError>, link: &mut Link) {
        if let Some(w) = self.writes.iter_mut().find(|w| w.tag == tag && !w.done) {
            w.done = true;
            if let Err(e) = status {
                w.failed = Some(e.into());
            }
        }
        while self.writes.front().is_some_and(|w| w.done) {
            let mut w = self.writes.pop_front().expect("checked");
            if let Some(t) = w.ticket.take() {
                match w.failed.take() {
                    None => t.complete(Ok(()), w.len, EventFlags::default()),
                    Some(e) => t.complete(Err(e), 0, EventFlags::default()),
                }
            }
        }
        self.finish_peer_precv(link);
    }

    /// The peer ended its persistent receive: once our writes into it are done, confirm.
    pub(super) fn finish_peer_precv(&mut self, link: &mut Link) {
        if let Some(p) = self.peer_precv {
            if p.ending && self.writes.is_empty() {
                self.peer_precv = None;
                link.push_ctrl(
                    Body::PersistentEnd {
                        seq: p.seq,
                        echo: true,
                    },
                    None,
                    None,
                );
            }
        }
    }

    /// Posts our persistent receive (seed 002, 4.3): its buffer is exposed for remote write and advertised; the
    /// operation completes only when it ends ([`MessageProto::end_persistent`]) or the connection does.
    pub(crate) fn recv_persistent(
        &mut self,
        ticket: OpToken,
        exposure: Box<dyn Exposure>,
        link: &mut Link,
    ) -> Result<(), (OpToken, &'static str)> {
        if self.own_precv.is_some() {
            return Err((
                ticket,
                "a persistent receive is already active on this socket",
            ));
        }
        if let Err(why) = self.may_be_persistent() {
            return Err((ticket, why));
        }
        let len = exposure.len();
        self.own_precv = Some(OwnPersistentRecv {
            seq: None, // set when the advert goes out
            len,
            ticket: Some(ticket),
            exposure: Some(exposure),
            ending: false,
        });
        // The advert is queued like a send: it takes an advert credit, in order with our other adverts.
        self.queue.push_back(SendReq {
            ticket: None,
            len,
            data: SendData::PersistentRecv,
            persistent: None,
            offset: 0,
        });
        self.pump(link);
        Ok(())
    }

    /// The peer read our persistent send `seq` (seed 002, 4.2, the notifying variant): an event for the send's
    /// queue. While the queue is full, reads are counted and reported together in the next event's `bytes`.
    pub(crate) fn on_read_notify(&mut self, seq: u32) -> Result<(), Violation> {
        let Some(o) = self.unacked.iter_mut().find(|o| o.seq == seq) else {
            // An acknowledgment that went on ahead of the notification (a message of its own) may have retired
            // the send already: one of ours, before the oldest outstanding. Nothing is left to report it to.
            let behind = self.oldest_unacked().wrapping_sub(seq);
            if behind != 0 && behind <= u32::MAX / 2 {
                return Ok(());
            }
            return Err(Violation::Persistent(format!(
                "read notification for unknown advert {seq}"
            )));
        };
        let (Some(p), Some(ticket)) = (o.persistent.as_mut(), o.ticket.as_ref()) else {
            return Err(Violation::Persistent(format!(
                "read notification for advert {seq}, which is not a persistent send"
            )));
        };
        if !p.notify {
            return Err(Violation::Persistent(format!(
                "read notification for advert {seq}, which asked for none"
            )));
        }
        p.reads += 1;
        ticket.notify(1);
        Ok(())
    }

    /// Ends our persistent send(s) and receive (seed 002: "ends when the sender cancels"). Returns whether there
    /// was anything to end.
    pub(crate) fn end_persistent(&mut self, link: &mut Link) -> bool {
        let mut any = false;
        for o in self.unacked.iter_mut() {
            if let Some(p) = o.persistent.as_mut() {
                if !p.ending && !o.acked {
                    p.ending = true;
                    any = true;
                    link.push_ctrl(
                        Body::PersistentEnd {
                            seq: o.seq,
                            echo: false,
                        },
                        None,
                        None,
                    );
                }
            }
        }
        if let Some(own) = self.own_precv.as_mut() {
            if let (false, Some(seq)) = (own.ending, own.seq) {
                own.ending = true;
                any = true;
                link.push_ctrl(Body::PersistentEnd { seq, echo: false }, None, None);
            }
        }
        any
    }

    /// PERSISTENT_END from the peer: it ends its persistent send or receive, or confirms the end of ours.
    pub(crate) fn on_persistent_end(
        &mut self,
        seq: u32,
        echo: bool,
        link: &mut Link,
    ) -> Result<(), Violation> {
        if echo {
            let Some(own) = self
                .own_precv
                .as_mut()
                .filter(|o| o.seq == Some(seq) && o.ending)
            else {
                return Err(Violation::Persistent(format!(
                    "confirmation of an end we never asked for ({seq})"
                )));
            };
            // The peer writes no more: revoke the key, then complete the receive.
            own.exposure = None;
            let own = self.own_precv.take().expect("checked");
            if let Some(t) = own.ticket {
                t.complete(Ok(()), own.len, EventFlags::default());
            }
            return Ok(());
        }
        // The peer's persistent send need not be at the head yet: adverts it sent before it may still wait for our
        // receives. It is then consumed, unread, when it reaches the head.
        if let Some(a) = self.adverts.iter_mut().find(|a| {
            a.advert.seq == seq && a.advert.flags.has(AdvertFlags::PERSISTENT) && !a.ending
        }) {
            a.ending = true;
            // Receives waiting behind it now wait for the next advert; offset receives fail.
            self.complete_transfers(link);
            self.match_adverts(link);
            return Ok(());
        }
        if let Some(p) = self.peer_precv.as_mut() {
            if p.seq == seq && !p.ending {
                p.ending = true;
                self.finish_peer_precv(link);
                return Ok(());
            }
        }
        // The peer's persistent receive is taken only at the head of its adverts: ended before it got there, it
        // is let go when it does (`match_adverts`), never written into.
        if let Some(a) = self.adverts.iter_mut().find(|a| {
            a.advert.seq == seq && a.advert.flags.has(AdvertFlags::PERSISTENT_RECV) && !a.ending
        }) {
            a.ending = true;
            return Ok(());
        }
        if self.receives_ended {
            // Our close let go of the peer's adverts and persistent receive: an end that crossed it ends nothing.
            return Ok(());
        }
        Err(Violation::Persistent(format!(
            "end of unknown persistent advert {seq}"
        )))
    }
}

//! Advertisements arriving (seed 002, section 3.1): each checked against the rules, then matched with the
//! receives in order; immediate data copied in, exposed sends read, the peer's persistent buffers taken.

use super::*;

impl MessageProto {
    /// An advertisement arrived. `inline` reads its immediate data out of the control buffer.
    pub(crate) fn on_advert(
        &mut self,
        advert: Advert,
        inline: &mut dyn FnMut(&mut Sge) -> Result<(), Violation>,
        inline_copy: &mut dyn FnMut() -> Result<Vec<u8>, Violation>,
        link: &mut Link,
    ) -> Result<(), Violation> {
        if self.peer_closed && !advert.flags.has(AdvertFlags::PERSISTENT_RECV) {
            // Receives past its adverts saw end-of-stream already (issue 14's rule, as in stream mode). A peer
            // that shut down writing may still post a persistent receive.
            return Err(Violation::Unexpected {
                kind: "ADVERT",
                context: "after the peer's CLOSE",
            });
        }
        self.check_advert(&advert)?;
        self.expected_seq = self.expected_seq.wrapping_add(1);
        self.stats.adverts_received += 1;
        let immediate = advert.flags.has(AdvertFlags::IMMEDIATE);
        if immediate && self.adverts.is_empty() && !self.recvs.is_empty() {
            // Fast path: copy straight from the control buffer into the waiting receive.
            let mut req = self.recvs.pop_front().expect("checked");
            if req.offset.is_some() {
                req.ticket
                    .complete(Err(OpError::PersistentEnded), 0, EventFlags::default());
                self.queue_advert(advert, Some(inline_copy()?), link);
                return Ok(());
            }
            let n = (advert.len as usize).min(req.sge.len());
            if n > 0 {
                inline(&mut req.sge)?;
            }
            self.finish_immediate(advert, req, n);
        } else {
            let data = if immediate {
                Some(inline_copy()?)
            } else {
                None
            };
            self.queue_advert(advert, data, link);
        }
        self.complete_transfers(link);
        Ok(())
    }

    /// Queues an advertisement for the receives to match.
    fn queue_advert(&mut self, advert: Advert, inline: Option<Vec<u8>>, link: &mut Link) {
        self.adverts.push_back(PeerAdvert {
            advert,
            inline,
            ending: false,
        });
        self.match_adverts(link);
    }

    /// Whether an arriving advertisement keeps the rules: in order, within the credits (seed 002, 3.2), its flags
    /// consistent (seed 002, 4.3: one persistent advertisement of each kind, one side active), its range within
    /// the address space.
    fn check_advert(&self, advert: &Advert) -> Result<(), Violation> {
        if advert.seq != self.expected_seq {
            return Err(Violation::AdvertOutOfOrder {
                expected: self.expected_seq,
                got: advert.seq,
            });
        }
        // Seed 002, 3.2: the peer may have at most recv_credits adverts we have not acknowledged.
        let unacked = self.expected_seq.wrapping_sub(self.acked_seq);
        if unacked >= self.recv_window {
            return Err(Violation::AdvertOverrun {
                seq: advert.seq,
                credits: self.recv_window,
            });
        }
        let flags = advert.flags;
        if flags.has(AdvertFlags::PERSISTENT) || flags.has(AdvertFlags::PERSISTENT_RECV) {
            self.check_persistent_advert(advert)?;
        } else if flags.has(AdvertFlags::NOTIFY) {
            return Err(Violation::Persistent(
                "read notification asked for a send that is not persistent".into(),
            ));
        }
        if !flags.has(AdvertFlags::IMMEDIATE)
            && advert.len > 0
            && advert.addr.checked_add(advert.len).is_none()
        {
            return Err(Violation::BadRange(format!(
                "advert {}: address {:#x} + length {} overflows",
                advert.seq, advert.addr, advert.len
            )));
        }
        Ok(())
    }

    /// Seed 002, 4.3: one side must stay active, and the peer has one persistent advertisement of each kind.
    fn check_persistent_advert(&self, advert: &Advert) -> Result<(), Violation> {
        let flags = advert.flags;
        if self.persistence().0 {
            return Err(Violation::Persistent(
                "a persistent advertisement while our side is persistent".into(),
            ));
        }
        if flags.has(AdvertFlags::IMMEDIATE)
            || (flags.has(AdvertFlags::PERSISTENT) && flags.has(AdvertFlags::PERSISTENT_RECV))
        {
            return Err(Violation::Persistent(format!(
                "advert {} has incompatible flags {:#x}",
                advert.seq, flags.0
            )));
        }
        let dup = if flags.has(AdvertFlags::PERSISTENT) {
            self.adverts
                .iter()
                .any(|a| a.advert.flags.has(AdvertFlags::PERSISTENT))
        } else {
            self.peer_precv.is_some()
                || self
                    .adverts
                    .iter()
                    .any(|a| a.advert.flags.has(AdvertFlags::PERSISTENT_RECV))
        };
        if dup {
            return Err(Violation::Persistent(
                "a second persistent advertisement of the same kind".into(),
            ));
        }
        Ok(())
    }

    /// Matches receives with advertisements in order (seed 002, 3.1) and starts the reads. A persistent send at
    /// the head is never consumed: every receive reads it again (seed 002, 4.2), until its owner ends it. A
    /// persistent receive's advert needs no receive: it is taken as it reaches the head.
    pub(super) fn match_adverts(&mut self, link: &mut Link) {
        while let Some(head) = self.adverts.front() {
            let flags = head.advert.flags;
            if flags.has(AdvertFlags::PERSISTENT_RECV) {
                let PeerAdvert { advert, ending, .. } = self.adverts.pop_front().expect("checked");
                self.take_peer_precv(advert);
                if ending {
                    // Its owner ended it before it reached the head: nothing was written into it.
                    if let Some(p) = self.peer_precv.as_mut() {
                        p.ending = true;
                    }
                    self.finish_peer_precv(link);
                }
                continue;
            }
            if flags.has(AdvertFlags::PERSISTENT) {
                if head.ending {
                    break;
                }
                let advert = head.advert;
                let Some(req) = self.recvs.pop_front() else {
                    break;
                };
                self.read_persistent(advert, req, link);
                continue;
            }
            let Some(req) = self.recvs.pop_front() else {
                break;
            };
            if req.offset.is_some() {
                // An offset receive needs the peer's persistent send, which has ended.
                req.ticket
                    .complete(Err(OpError::PersistentEnded), 0, EventFlags::default());
                continue;
            }
            let PeerAdvert { advert, inline, .. } = self.adverts.pop_front().expect("checked");
            self.take_advert(advert, inline, req, link);
        }
        // Transfers that need no read (immediate data, empty receive buffers) are complete now.
        self.complete_transfers(link);
        self.end_unmatched_receives();
    }

    /// The peer's persistent receive reached the head (seed 002, 4.3): our sends with an offset write into it.
    fn take_peer_precv(&mut self, a: Advert) {
        self.peer_precv = Some(PeerPersistentRecv {
            seq: a.seq,
            addr: a.addr,
            key: a.rkey,
            len: a.len,
            ending: false,
        });
        self.transfers.push_back(Transfer {
            seq: a.seq,
            ticket: None,
            bytes: 0,
            truncated: false,
            reads_in_flight: 0,
            failed: None,
            persistent: false,
            whole: false,
        });
    }

    /// A receive reads the peer's persistent send at the head again (seed 002, 4.2), from its offset (4.4).
    fn read_persistent(&mut self, advert: Advert, req: RecvReq, link: &mut Link) {
        let offset = req.offset.unwrap_or(0);
        let avail = advert.len.saturating_sub(offset);
        let n = usize::try_from(avail)
            .unwrap_or(usize::MAX)
            .min(req.sge.len());
        let req_whole = req.offset.is_none();
        let truncated = req_whole && avail > n as u64;
        self.stats.truncated += u64::from(truncated);
        self.stats.persistent_reads += 1;
        let reads = self.push_reads(
            req.sge,
            n,
            advert.addr + offset,
            advert.rkey,
            advert.seq,
            link,
        );
        self.transfers.push_back(Transfer {
            seq: advert.seq,
            ticket: Some(req.ticket),
            bytes: n,
            truncated,
            reads_in_flight: reads,
            failed: None,
            persistent: true,
            whole: req_whole,
        });
    }

    /// A receive takes an advertisement: its immediate data copied in (seed 002, 4.1), or the exposed send read
    /// (3.1); what does not fit is truncated, as a datagram receive truncates.
    fn take_advert(
        &mut self,
        advert: Advert,
        inline: Option<Vec<u8>>,
        mut req: RecvReq,
        link: &mut Link,
    ) {
        let n = usize::try_from(advert.len)
            .unwrap_or(usize::MAX)
            .min(req.sge.len());
        if let Some(data) = inline {
            if n > 0 {
                // The receive's lease is ours until we drop it: writing through it cannot fail.
                req.sge
                    .write(0, &data[..n])
                    .expect("receive lease covers the copy");
            }
            self.finish_immediate(advert, req, n);
            return;
        }
        let truncated = advert.len as usize > n;
        self.stats.truncated += u64::from(truncated);
        let reads = self.push_reads(req.sge, n, advert.addr, advert.rkey, advert.seq, link);
        self.transfers.push_back(Transfer {
            seq: advert.seq,
            ticket: Some(req.ticket),
            bytes: n,
            truncated,
            reads_in_flight: reads,
            failed: None,
            persistent: false,
            whole: true,
        });
    }
}

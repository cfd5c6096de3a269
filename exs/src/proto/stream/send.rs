//! The sending side of a stream (seed 001): choosing between a direct transfer into an advertised receive and
//! an indirect one into the stream buffer, gathering queued sends into writes, and completing them.

use super::*;

impl StreamProto {
    pub(crate) fn send(&mut self, ticket: OpToken, sge: Sge, _flags: MsgFlags) {
        let id = self.tx.next_id;
        self.tx.next_id = self.tx.next_id.wrapping_add(1);
        let len = sge.len();
        self.tx.sends.push_back(SendOp {
            id,
            ticket: Some(ticket),
            rest: Some(sge),
            len,
            in_flight: 0,
            failed: None,
        });
    }

    /// Applies the phase rules to the advertisement at the head of the queue: `Some` when one may be used now.
    pub(super) fn choose_advert(&mut self) -> Result<bool, Violation> {
        loop {
            let Some(a) = self.tx.adverts.front() else {
                return Ok(false);
            };
            let (aseq, aphase) = (a.seq, a.phase);
            if self.tx.phase % 2 == 0 {
                // Seed 001: "During an even numbered phase, direct transfers are always allowed, since the sender
                // and receiver are guaranteed to be in sync": advertisements are taken in order.
                if aphase != self.tx.phase {
                    return Err(Violation::Stream(format!(
                        "advertisement of phase {aphase} while both sides are in phase {}",
                        self.tx.phase
                    )));
                }
                return Ok(true);
            }
            // Seed 001: "During an odd phase, an advertisement can only be accepted by the sender if the
            // advertisement has a higher phase number than the current phase number at the sender, and the
            // sequence number of the advertisement matches the sender's current sequence number."
            if later_phase(aphase, self.tx.phase) && aseq == self.tx.seq {
                // "Once the sender accepts an advertisement, the sender increments its phase back to even."
                self.tx.phase = aphase;
                self.end_resync();
                self.stats.adverts_accepted += 1;
                self.record(StreamTrace::Accepted {
                    seq: aseq,
                    phase: aphase,
                });
                return Ok(true);
            }
            self.chain_rejected(aseq, aphase, a.len, a.used);
            self.tx.adverts.pop_front();
            if later_phase(aphase, self.tx.phase) {
                // "If an advertisement with a higher phase number is rejected, the sender increments its phase to
                // the first odd number beyond the advertisement's phase" (Figure 7: 3 -> 5 on rejecting phase 4).
                self.tx.phase = next_phase(aphase);
            }
            self.stats.adverts_rejected += 1;
            let sender_phase = self.tx.phase;
            let sender_seq = self.tx.seq;
            self.record(StreamTrace::Rejected {
                seq: aseq,
                phase: aphase,
                sender_seq,
                sender_phase,
            });
        }
    }

    /// Records where the rejected receive (`seq`, `phase`, `len` bytes of which `used` were filled directly) ends,
    /// and holds indirect transfers there once a large one was rejected (see `resync_room`).
    ///
    /// The first advertisement of the receiver's new round (a higher phase) carries its exact position (the
    /// receiver advertises again only once it has taken every byte we sent before): the chain starts again from
    /// there. The receives advertised in the even phase we left start no earlier than our first indirect transfer
    /// (`odd_from`): the direct transfers before it filled the receives advertised before them, and their own
    /// estimates lag by the receives queued ahead. The rest of a batch is advertised at estimates (a receive
    /// without MSG_WAITALL at one byte past the one before) and each of those receives may take a whole transfer
    /// of its length, small ones too (the receiver advertises again only once each is filled), so their ends are
    /// chained from the one before, never from our own position: a sender already past the end waits at once
    /// rather than go on by a batch of receives and make the receiver's next advertisement stale on arrival.
    fn chain_rejected(&mut self, seq: u64, phase: u32, len: u64, used: u64) {
        let from = match self.tx.resync_chain {
            Some(end) if !later_phase(phase, self.tx.phase) => end.max(seq),
            _ => seq.max(self.tx.odd_from),
        };
        let end = from.saturating_add(len - used);
        self.tx.resync_chain = Some(end);
        if len >= RESYNC_MIN || self.tx.resync_hold.is_some() {
            if self.tx.resync_hold.is_none() {
                self.tx.resync_mark = self.tx.consumed;
            }
            self.tx.resync_hold = Some(end);
        }
    }

    /// Sends what advertisements and stream-buffer space allow.
    pub(crate) fn pump(&mut self, link: &mut Link) -> Result<(), Violation> {
        loop {
            let Some(first) = self.tx.sends.iter().position(|s| s.rest.is_some()) else {
                return Ok(());
            };
            let advert = self.choose_advert()?;
            let direct = advert && !self.small_via_ring(first, link);
            let resync = if direct { None } else { self.resync_room() };
            if resync == Some(0) || (!advert && self.waits_for_advert()) {
                self.stats.advert_waits += 1;
                return Ok(());
            }
            let Some((room, remote)) = self.target(direct, link) else {
                self.stats.space_stalls += 1;
                return Ok(());
            };
            let limit = (room.min(resync.unwrap_or(u64::MAX)) as usize).min(self.max_chunk);
            if self.holds(first, limit) {
                return Ok(());
            }
            let (pieces, carried, n) = self.gather(first, limit);
            let tag = self.tx.next_tag;
            self.tx.next_tag = self.tx.next_tag.wrapping_add(1);
            let advert_len = self.tx.adverts.front().map_or(0, |a| a.len);
            let imm = if direct {
                self.account_direct(n)
            } else {
                self.account_indirect(n)
            };
            self.tx.seq += n as u64;
            // Only transfers into large receives count for `waits_for_advert`.
            let direct_bytes = if direct && advert_len >= RESYNC_MIN {
                n as u64
            } else {
                0
            };
            self.tx.direct_in_flight += direct_bytes;
            self.tx.writes.push_back((tag, carried, direct_bytes));
            link.push_write(
                DataOp::Write {
                    local: pieces,
                    remote,
                    imm: Some(imm.encode()),
                },
                tag,
            );
        }
    }

    /// Whether a send that finds no advertisement waits for the next one rather than go through the stream
    /// buffer: in an even phase, while [`RESYNC_MIN`] bytes or more of direct transfers into receives of that
    /// size or more are in flight. The receiver advertises its next receive as each of them lands (its advert
    /// credits come back), so the advertisement usually arrives before they have all completed here (each
    /// completion pumps again); going
    /// indirect meanwhile moved both sides to an odd phase for a whole resynchronisation (see `resync_room`),
    /// two copies of every byte in between. Once less is in flight, the send goes indirect as before (small
    /// receives are filled from the buffer anyway): a receiver with nothing posted never holds it up.
    fn waits_for_advert(&self) -> bool {
        self.tx.phase % 2 == 0 && self.tx.direct_in_flight >= RESYNC_MIN
    }

    /// How many bytes indirect transfers may still carry before they wait for the receiver to advertise again,
    /// after the sender rejected a large advertisement (`None`: no limit).
    ///
    /// Seed 001 lets the sender go indirect at any time and resynchronises the two sides only through an
    /// advertisement whose sequence number is the sender's own, which the receiver sends once it has taken every
    /// byte of the stream buffer, having first filled each receive it advertised before (in an odd phase it
    /// "will remain passive until it has flushed all previous advertisements (by receiving indirect
    /// transfers)"). A sender with bulk queued and space in the buffer kept refilling it, so every later
    /// advertisement was stale on arrival and every byte after the first indirect transfer was copied twice, for
    /// good (a pump one receive deeper than the advert credits: one receive went unadvertised, one send went
    /// indirect). Rejecting an advertisement for a receive of [`RESYNC_MIN`] bytes or more shows that the
    /// receiver reads into large receives: the sender then sends indirectly only up to the end of the rejected
    /// advertisements (enough to fill each of them, so that the receiver may advertise again) and then waits
    /// until an advertisement is accepted or [`RESYNC_HOLD`] has passed (the connection's timer: see
    /// [`StreamProto::resync_waiting`]), so a receiver that stops reading holds the sender no longer than that.
    fn resync_room(&mut self) -> Option<u64> {
        if self.tx.phase % 2 == 0 {
            self.end_resync();
        }
        self.tx.resync_hold.map(|to| to.saturating_sub(self.tx.seq))
    }

    /// Whether the sender holds its indirect transfers back for an advertisement (see `resync_room`), from the
    /// rejection on (it may still be sending up to the end of the rejected receives, or have nothing queued):
    /// the connection then keeps a deadline of [`RESYNC_HOLD`] from the first flush after the rejection, started
    /// again by each step of the receiver's progress through the stream buffer (see `take_resync_progress`), and
    /// calls [`StreamProto::end_resync_hold`] when it passes: a hold lasts that long after the receiver stopped
    /// showing progress, queued sends or not (a new rejection starts a new one).
    pub(crate) fn resync_waiting(&self) -> bool {
        self.tx.resync_hold.is_some()
    }

    /// The two sides are in step again (or the sends failed): no hold, and no rejected receives to chain from.
    pub(super) fn end_resync(&mut self) {
        self.tx.resync_hold = None;
        self.tx.resync_chain = None;
        self.tx.resync_progress = false;
    }

    /// The hold has lasted [`RESYNC_HOLD`] since it began or since the receiver's last progress: indirect transfers
    /// go on (the rejected receives stay chained).
    pub(crate) fn end_resync_hold(&mut self) {
        self.tx.resync_hold = None;
        self.tx.resync_progress = false;
    }

    /// Where the next transfer goes and how much fits there: the advertised receive (`direct`), or the contiguous
    /// free space of the peer's stream buffer. `None`: no space (or no stream buffer yet: asked for here, the
    /// peer allocates it on our first need and STREAM_RING answers).
    fn target(&mut self, direct: bool, link: &mut Link) -> Option<(u64, RemoteRef)> {
        if direct {
            let a = self.tx.adverts.front().expect("chosen");
            return Some((
                a.len - a.used,
                RemoteRef {
                    addr: a.remote.addr + a.used,
                    key: a.remote.key,
                },
            ));
        }
        let Some(ring) = self.tx.ring else {
            if !self.tx.ring_requested {
                self.tx.ring_requested = true;
                link.push_ctrl(Body::StreamRingWanted, None, None);
            }
            return None;
        };
        let used = self.tx.tail - self.tx.consumed;
        let free = self.tx.ring_len - used;
        let at = self.tx.tail % self.tx.ring_len;
        let contiguous = self.tx.ring_len - at;
        (free > 0).then_some((
            free.min(contiguous),
            RemoteRef {
                addr: ring.addr + at,
                key: ring.key,
            },
        ))
    }

    /// Gathers up to `limit` bytes from consecutive sends from `first` on (packing small writes into one
    /// transfer): the pieces, the ids of the sends they carry, and their length.
    fn gather(&mut self, first: usize, limit: usize) -> (Vec<Sge>, Vec<u32>, usize) {
        let mut pieces = Vec::new();
        let mut carried = Vec::new();
        let mut n = 0usize;
        let mut i = first;
        while n < limit && pieces.len() < self.max_sge && i < self.tx.sends.len() {
            let s = &mut self.tx.sends[i];
            let Some(rest) = s.rest.take() else { break };
            let take = rest.len().min(limit - n);
            let (lease, reg) = rest.into_parts();
            let (now, later) = lease.split_at(take);
            pieces.push(Sge::new(now, Arc::clone(&reg)).expect("lease stays on its buffer"));
            if !later.is_empty() {
                s.rest = Some(Sge::new(later, reg).expect("lease stays on its buffer"));
            }
            s.in_flight += 1;
            carried.push(s.id);
            n += take;
            if s.rest.is_some() {
                break; // this send continues in the next transfer
            }
            i += 1;
        }
        if carried.len() > 1 {
            self.stats.packed_sends += carried.len() as u64 - 1;
        }
        (pieces, carried, n)
    }

    /// A direct transfer of `n` bytes into the front advertisement (seed 001): "The advertisement is consumed by
    /// this transfer unless the MSG_WAITALL flag was supplied".
    fn account_direct(&mut self, n: usize) -> Imm {
        let (seq, phase) = (self.tx.seq, self.tx.phase);
        let a = self.tx.adverts.front_mut().expect("chosen");
        a.used += n as u64;
        let advert_seq = a.seq;
        if !a.waitall || a.used == a.len {
            self.tx.adverts.pop_front();
        }
        self.stats.direct_sent += 1;
        self.stats.direct_bytes += n as u64;
        self.record(StreamTrace::Direct {
            seq,
            len: n as u64,
            phase,
            advert_seq,
        });
        Imm::Direct(n as u32)
    }

    /// An indirect transfer of `n` bytes into the peer's stream buffer (seed 001): "When the sender sends an
    /// indirect transfer, it increments its phase to an odd number."
    fn account_indirect(&mut self, n: usize) -> Imm {
        if self.tx.phase % 2 == 0 {
            self.tx.phase = next_phase(self.tx.phase);
            self.tx.odd_from = self.tx.seq;
        }
        self.tx.tail += n as u64;
        self.stats.indirect_sent += 1;
        self.stats.indirect_bytes += n as u64;
        self.record(StreamTrace::Indirect {
            seq: self.tx.seq,
            len: n as u64,
            phase: self.tx.phase,
        });
        Imm::Indirect(n as u32)
    }

    /// Whether the small sends queued from `first` go through the peer's stream buffer though an advertisement is
    /// there (issue 26). A direct transfer fills the whole receive it goes into, so each small send cost one write
    /// and, at the peer, one receive reposted and advertised: two operations per message where the stream buffer
    /// takes a batch of them in one write and asks for nothing per message (one copy of a few bytes at the peer;
    /// space comes back in window updates). Seed 001 allows an indirect transfer at any time: the phase rules
    /// then resynchronise the two sides. Only with coalescing on (it is the same gathering); the peer's buffer is
    /// asked for at the first small send, which goes direct meanwhile. A MSG_WAITALL advertisement is not
    /// consumed by a small transfer (seed 001): it is used.
    fn small_via_ring(&mut self, first: usize, link: &mut Link) -> bool {
        if !self.coalesce || self.tx.adverts.front().is_some_and(|a| a.waitall) {
            return false;
        }
        let queued: usize = self
            .tx
            .sends
            .iter()
            .skip(first)
            .map_while(|s| s.rest.as_ref().map(|r| r.len()))
            .take(self.max_sge)
            .sum();
        if queued > SMALL_VIA_RING {
            return false;
        }
        match self.tx.ring {
            Some(_) => self.tx.ring_len > self.tx.tail - self.tx.consumed,
            None => {
                if !self.tx.ring_requested {
                    self.tx.ring_requested = true;
                    link.push_ctrl(Body::StreamRingWanted, None, None);
                }
                false
            }
        }
    }

    /// Whether the batch that starts at send `first` waits for the write in flight: coalescing is on, a write
    /// is in flight (its completion pumps again), and the batch would not fill a write (fewer pieces than the
    /// scatter/gather limit, fewer bytes than the write may carry, `limit`, and than [`CORK_BYTES`]). A direct
    /// transfer into a receive as small as the send is full at once: it never waits.
    pub(super) fn holds(&self, first: usize, limit: usize) -> bool {
        if !self.coalesce || self.tx.writes.is_empty() {
            return false;
        }
        let full = limit.min(CORK_BYTES);
        let mut pieces = 0;
        let mut bytes = 0;
        for s in self.tx.sends.iter().skip(first) {
            let Some(rest) = &s.rest else { break };
            pieces += 1;
            bytes += rest.len();
            if pieces >= self.max_sge || bytes >= full {
                return false;
            }
        }
        true
    }

    /// A transfer of ours completed: the sends it carried may complete.
    pub(crate) fn on_write_done(&mut self, tag: u32, status: Result<(), WcError>) {
        let Some(pos) = self.tx.writes.iter().position(|(t, _, _)| *t == tag) else {
            return;
        };
        let (_, carried, direct_bytes) = self.tx.writes.remove(pos).expect("found");
        self.tx.direct_in_flight -= direct_bytes;
        for id in carried {
            if let Some(s) = self.tx.sends.iter_mut().find(|s| s.id == id) {
                s.in_flight -= 1;
                if let Err(e) = &status {
                    s.failed.get_or_insert_with(|| e.clone().into());
                }
            }
        }
        self.complete_sends();
    }

    pub(super) fn complete_sends(&mut self) {
        while let Some(s) = self.tx.sends.front() {
            let done = s.in_flight == 0 && (s.rest.is_none() || s.failed.is_some());
            if !done {
                return;
            }
            let mut s = self.tx.sends.pop_front().expect("checked");
            if let Some(t) = s.ticket.take() {
                match s.failed.take() {
                    None => t.complete(Ok(()), s.len, EventFlags::default()),
                    Some(e) => t.complete(Err(e), 0, EventFlags::default()),
                }
            }
        }
    }

    /// A peer advertisement arrived (it also carries the peer's stream-buffer consumption).
    pub(crate) fn on_advert(&mut self, a: StreamAdvert, _link: &mut Link) -> Result<(), Violation> {
        if a.phase % 2 != 0 {
            return Err(Violation::Stream(format!(
                "advertisement in odd phase {}",
                a.phase
            )));
        }
        if a.len == 0 || a.addr.checked_add(a.len).is_none() || a.len > u64::from(u32::MAX) * 16 {
            return Err(Violation::BadRange(format!(
                "stream advertisement of {} bytes at {:#x}",
                a.len, a.addr
            )));
        }
        self.on_window(a.consumed)?;
        // The queue judged first: advertisements whose receives the stream buffer filled meanwhile (an indirect
        // transfer that left nothing to send, so nothing judged them) are rejected and dropped here, not counted
        // against the new one.
        self.choose_advert()?;
        // Bounded by the advert credits we granted: the receiver keeps at most that many outstanding (see
        // `advertise`), and a waiting advertisement always has an outstanding receive behind it.
        if self.tx.adverts.len() >= self.max_adverts_in {
            return Err(Violation::StreamAdvertOverrun {
                queued: self.tx.adverts.len() + 1,
                credits: self.max_adverts_in as u32,
            });
        }
        self.tx.adverts.push_back(PeerAdvert {
            remote: RemoteRef {
                addr: a.addr,
                key: a.rkey,
            },
            len: a.len,
            used: 0,
            seq: a.seq,
            phase: a.phase,
            waitall: a.waitall,
        });
        // Judge it now (the phase rules act on arrival), not only when there is data to send.
        self.choose_advert()?;
        Ok(())
    }

    /// The peer reports `consumed` bytes of its stream buffer consumed in total.
    pub(crate) fn on_window(&mut self, consumed: u64) -> Result<(), Violation> {
        if consumed < self.tx.consumed || consumed > self.tx.tail {
            return Err(Violation::Stream(format!(
                "stream buffer consumption {consumed} outside {}..={}",
                self.tx.consumed, self.tx.tail
            )));
        }
        // Progress counts in steps of a quarter of the buffer (the receiver's own reporting step) or at its end:
        // a holding sender adds to the buffer at most up to the end of the rejected receives, so a peer reporting a
        // byte at a time restarts the limit a few times at most.
        let step = (self.tx.ring_len / 4).max(1);
        if self.tx.resync_hold.is_some()
            && (consumed >= self.tx.resync_mark.saturating_add(step)
                || (consumed == self.tx.tail && consumed > self.tx.resync_mark))
        {
            self.tx.resync_progress = true;
            self.tx.resync_mark = consumed;
        }
        self.tx.consumed = consumed;
        Ok(())
    }

    /// Whether the receiver consumed more of the stream buffer since the last call while the sender held, by a
    /// quarter of the buffer or to its end (see `resync_room`): it is still reading, filling the receives the
    /// sender rejected, and will advertise again once they are full, so the hold's time limit (for a receiver that
    /// stopped reading) starts again; a peer that reports a byte at a time restarts it a few times at most. A
    /// receiver that drains a full buffer takes longer than [`RESYNC_HOLD`] on a loaded machine, and a hold ended
    /// meanwhile sent the waiting bytes indirect, past the position the receiver's next advertisement names.
    pub(crate) fn take_resync_progress(&mut self) -> bool {
        std::mem::take(&mut self.tx.resync_progress)
    }
}

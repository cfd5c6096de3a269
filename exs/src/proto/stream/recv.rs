//! The receiving side of a stream (seed 001): receives and their advertisements, bytes arriving directly or
//! through the stream buffer, window updates, and end-of-stream.

use super::*;

impl StreamProto {
    pub(crate) fn recv(
        &mut self,
        ticket: OpToken,
        mem: StreamRecvMemory,
        flags: MsgFlags,
        link: &mut Link,
    ) -> Result<(), Violation> {
        let len = mem.len();
        self.reading();
        self.rx.recvs.push_back(RecvOp {
            ticket,
            mem,
            len,
            filled: 0,
            waitall: flags.contains(MsgFlags::WAITALL),
            counted: None,
        });
        self.drain()?;
        if self.rx.eof && self.rx.tail == self.rx.head {
            self.finish_eof();
        }
        // The advertisement first: it carries the consumption (see `maybe_window`).
        self.advertise(link);
        self.maybe_window(link);
        Ok(())
    }

    /// Copies what the stream buffer holds into the receives at the head of the queue: one copy per byte, from
    /// the ring straight into the posted receive, no allocation (issue 14: it went through a bounce buffer
    /// allocated on every drain).
    pub(super) fn drain(&mut self) -> Result<(), Violation> {
        if self.rx.tail > self.rx.head && self.rx.ring.is_none() {
            return Err(Violation::Stream(
                "stream data before the stream buffer was exposed".into(),
            ));
        }
        while self.rx.tail > self.rx.head {
            let Some(r) = self.rx.recvs.front_mut() else {
                break;
            };
            let want = ((self.rx.tail - self.rx.head) as usize).min(r.len - r.filled);
            let mut done = 0;
            while done < want {
                let at = ((self.rx.head + done as u64) % self.rx.ring_len) as usize;
                let n = (want - done).min(self.rx.ring_len as usize - at);
                let ring = self.rx.ring.as_ref().expect("checked above");
                r.mem
                    .fill_from(r.filled + done, &ring.buf, at, n)
                    .map_err(Violation::BadRange)?;
                done += n;
            }
            r.filled += want;
            self.rx.head += want as u64;
            self.stats.copied_bytes += want as u64;
            if !r.waitall || r.filled == r.len {
                self.complete_front();
            }
        }
        Ok(())
    }

    pub(super) fn complete_front(&mut self) {
        let Some(r) = self.rx.recvs.pop_front() else {
            return;
        };
        let filled = r.filled as u64;
        let advertised = r.counted.is_some();
        match r.counted {
            Some(c) => {
                // Seed 001: "if an advertisement was sent for the operation ... we add the difference to source
                // seqno in order to correct future estimates".
                self.rx.src_seqno = self.rx.src_seqno.wrapping_add(filled).wrapping_sub(c);
                self.rx.outstanding -= 1;
            }
            None => self.rx.src_seqno = self.rx.src_seqno.wrapping_add(filled),
        }
        self.record(StreamTrace::RecvCompleted {
            bytes: filled,
            advertised,
        });
        // The receive's key goes with its exposure (least exposure), then the event.
        drop(r.mem);
        r.ticket.complete(Ok(()), r.filled, EventFlags::default());
    }

    /// Advertises the receives not yet advertised, in an even phase. One with no key yet stops the round and asks
    /// the engine for its key ([`StreamProto::take_recv_to_key`]); the advertisement follows when it comes.
    pub(super) fn advertise(&mut self, link: &mut Link) {
        let mut from = 0;
        while let Some(i) = self.next_to_advertise(from) {
            match &self.rx.recvs[i].mem {
                StreamRecvMemory::Keyed(e) => {
                    let base = e.remote();
                    self.advertise_one(link, i, base);
                }
                StreamRecvMemory::Unkeyed { keyable: true, .. } => {
                    self.rx.key_wanted = true;
                    return;
                }
                // Advertisements go in order: the receives behind it wait.
                StreamRecvMemory::Unkeyed { keyable: false, .. } | StreamRecvMemory::Keying => {
                    return
                }
            }
            from = i + 1;
        }
    }

    /// The receive to advertise now, looking from `from`: the first not yet advertised (nor full), if the phase,
    /// the stream buffer and the advert credits allow.
    fn next_to_advertise(&self, from: usize) -> Option<usize> {
        // "During an odd phase, the receiver will remain passive".
        if self.rx.phase % 2 != 0 || self.rx.eof {
            return None;
        }
        let i = (from..self.rx.recvs.len()).find(|&i| {
            let r = &self.rx.recvs[i];
            r.counted.is_none() && r.filled < r.len
        })?;
        if !self.may_advertise_next(self.rx.recvs[i].waitall) {
            return None;
        }
        if self.rx.tail > self.rx.head {
            // It will take bytes from the stream buffer first; advertising it now would mislead the sender.
            return None;
        }
        Some(i)
    }

    /// Whether the receive to advertise next waits for its key ([`StreamProto::take_recv_to_key`]).
    pub(crate) fn recv_key_wanted(&self) -> bool {
        self.rx.key_wanted
    }

    /// The memory of the receive to advertise next, if it waits for a key (see [`StreamRecvMemory`]): the engine
    /// exposes it and hands the key back with [`StreamProto::give_recv_key`] before anything else reaches the
    /// protocol. If none waits after all, the report of consumed space held back for the advertisement
    /// (`maybe_window`) is decided now.
    pub(crate) fn take_recv_to_key(&mut self, link: &mut Link) -> Option<Sge> {
        if !std::mem::take(&mut self.rx.key_wanted) {
            return None;
        }
        let keyable = |i: &usize| {
            matches!(
                self.rx.recvs[*i].mem,
                StreamRecvMemory::Unkeyed { keyable: true, .. }
            )
        };
        let Some(i) = self.next_to_advertise(0).filter(keyable) else {
            self.decide_window(link);
            return None;
        };
        match std::mem::replace(&mut self.rx.recvs[i].mem, StreamRecvMemory::Keying) {
            StreamRecvMemory::Unkeyed { sge, .. } => Some(sge),
            _ => unreachable!("checked by `keyable`"),
        }
    }

    /// The key of the receive [`StreamProto::take_recv_to_key`] handed out: it is advertised now, the receives
    /// after it as the credits allow, and then the space held back for them. `Err`: the device made no key, and
    /// the receive completes with that error, as its post failed when receives were exposed as they were posted
    /// (no byte of the stream went into it: only the receive at the head takes bytes, and one there with bytes
    /// completes with them); the receives after it go on.
    pub(crate) fn give_recv_key(
        &mut self,
        keyed: Result<Box<dyn Exposure>, OpError>,
        link: &mut Link,
    ) {
        let keying = |r: &RecvOp| matches!(r.mem, StreamRecvMemory::Keying);
        if let Some(i) = self.rx.recvs.iter().position(keying) {
            match keyed {
                Ok(exposure) => self.rx.recvs[i].mem = StreamRecvMemory::Keyed(exposure),
                Err(_) if self.rx.recvs[i].filled > 0 => self.complete_front(),
                Err(e) => {
                    if let Some(r) = self.rx.recvs.remove(i) {
                        r.ticket.complete(Err(e), 0, EventFlags::default());
                    }
                }
            }
        }
        self.advertise(link);
        self.decide_window(link);
    }

    /// The report of consumed space held back while an advertisement waited for its key: forced if its timer
    /// expired meanwhile (`force_window`), else as `maybe_window` decides.
    fn decide_window(&mut self, link: &mut Link) {
        if std::mem::take(&mut self.rx.window_forced) {
            self.force_window(link);
        } else {
            self.maybe_window(link);
        }
    }

    /// Whether the next receive not yet advertised (`waitall`: a MSG_WAITALL one) may be advertised now.
    fn may_advertise_next(&self, waitall: bool) -> bool {
        if self.rx.outstanding >= self.max_adverts_out {
            // The peer's advert credits: the rest waits until an advertised receive completes.
            return false;
        }
        if self.rx.ring_chosen
            && self.coalesce
            && !waitall
            && self.rx.small_flushes >= QUIET_AFTER_FLUSHES
        {
            // The peer keeps sending small writes through the stream buffer (a request/response stream):
            // every advertisement is flushed by its next small write and sent again, two control messages per
            // round trip beside the data (issue 26). None goes until the peer writes a large transfer (more
            // than `SMALL_VIA_RING`, or half our buffer or more) through the buffer, which it does with bulk
            // to send and no advertisement, or a large direct one (see `on_write_imm`); a stream that writes
            // one small header before each bulk body never gets here. Our `coalesce` stands for the peer's
            // (both ends normally share their options): a peer without it passes advertisements over only
            // when its sends overtake them.
            // Advertising is the receiver's choice (seed 001: a receiver with no receive posted advertises
            // nothing and takes every byte indirectly). A MSG_WAITALL receive is still advertised: the
            // sender uses it whatever the size of its writes. Without coalescing (the seed's figures), a
            // new advertisement follows every flush.
            return false;
        }
        // Otherwise one advertisement at a time while the peer writes small: a sender with more to send uses it
        // for a large direct transfer.
        !(self.rx.ring_chosen && self.rx.outstanding > 0)
    }

    /// Sends the advertisement of receive `i`, exposed under `base` (seed 001: its address, key, the bytes it still
    /// takes, the sequence number they start at, the phase) and counts it as outstanding.
    fn advertise_one(&mut self, link: &mut Link, i: usize, base: RemoteRef) {
        let r = &self.rx.recvs[i];
        let remaining = (r.len - r.filled) as u64;
        let est = if r.waitall { remaining } else { 1 };
        let seq = self.rx.src_seqno + r.filled as u64;
        // The advertisement carries what we consumed, unless the sender's view of the buffer is half full
        // or more: then it may be blocked on space, and the space waits for the window update so that it
        // cannot overtake the receives (see `maybe_window`). With more than half free, it is not blocked and
        // the space changes nothing.
        let consumed = if self.window_due() {
            self.rx.reported
        } else {
            self.rx.head
        };
        self.rx.reported = consumed;
        let advert = StreamAdvert {
            addr: base.addr + r.filled as u64,
            rkey: base.key,
            len: remaining,
            seq,
            phase: self.rx.phase,
            waitall: r.waitall,
            consumed,
        };
        let filled = r.filled as u64;
        self.rx.recvs[i].counted = Some(filled + est);
        self.rx.src_seqno += filled + est;
        self.rx.outstanding += 1;
        let id = self.rx.next_advert;
        self.rx.next_advert = self.rx.next_advert.wrapping_add(1);
        self.stats.adverts_sent += 1;
        let phase = self.rx.phase;
        self.record(StreamTrace::AdvertSent {
            id,
            seq,
            len: remaining,
            phase,
        });
        link.push_ctrl(Body::StreamAdvert(advert), None, None);
    }

    /// Whether the sender should hear of consumed space: its view of the buffer is at least half full and we
    /// consumed since the last report, a quarter of the buffer at least unless all it wrote is consumed (see module
    /// docs). The quarter keeps a stream of small writes from costing a window update per write once the buffer is
    /// half full (issue 26); a sender blocked on a full buffer still hears as soon as a quarter is free, and a
    /// posted receive always takes everything the buffer holds, so the rest never waits for a read that waits for
    /// it.
    pub(super) fn window_due(&self) -> bool {
        let unreported = self.rx.head - self.rx.reported;
        let seen_used = self.rx.tail - self.rx.reported;
        unreported > 0
            && seen_used * 2 >= self.rx.ring_len
            && (unreported * 4 >= self.rx.ring_len || self.rx.head == self.rx.tail)
    }

    /// Reports consumed space, after any advertisement of this round; in an even phase (when receives may still
    /// be advertised), only once every advertised receive is filled and [`WINDOW_HOLD`] has passed with no new
    /// one.
    ///
    /// Issue 14: a window update sent ahead of an advertisement let a sender blocked on a full buffer spend the
    /// space on one more indirect transfer, so the advertisement's exact sequence number (seed 001 Figure 5) was
    /// stale on arrival and every later byte went through the buffer; the same when the application reposted its
    /// receive just after the update left, or when the sender used up the first of several advertisements before
    /// the next arrived. Held back, the space cannot overtake the receives the
    /// application posts meanwhile: the blocked sender, still at the advertised sequence number, accepts the
    /// first and takes the rest in order. In an odd phase the receiver advertises nothing, so space goes at once.
    pub(super) fn maybe_window(&mut self, link: &mut Link) {
        if self.rx.key_wanted {
            // An advertisement waits for its key: the space is decided after it (`give_recv_key`), as above.
            return;
        }
        if !self.window_due() {
            self.rx.window_deferred = false;
        } else if self.rx.defer_windows && self.rx.phase % 2 == 0 && !self.rx.ring_chosen {
            self.rx.window_deferred = true;
        } else {
            self.send_window(link);
        }
    }

    pub(super) fn send_window(&mut self, link: &mut Link) {
        self.rx.window_deferred = false;
        self.rx.reported = self.rx.head;
        self.stats.window_updates += 1;
        link.push_ctrl(
            Body::StreamWindow {
                consumed: self.rx.head,
            },
            None,
            None,
        );
    }

    /// Whether held-back space is held for advertisements: in an even phase with receives advertised and not yet
    /// filled, the sender is meant to use those; it gets the space once they are (or at once if it goes indirect,
    /// which moves us to an odd phase).
    pub(super) fn held_for_adverts(&self) -> bool {
        self.rx.phase % 2 == 0 && self.rx.outstanding > 0 && !self.rx.ring_chosen
    }

    /// A window update waits (the engine arms a timer of [`WINDOW_HOLD`], then calls
    /// [`StreamProto::force_window`]); no timer while advertised receives hold it (see `held_for_adverts`).
    pub(crate) fn window_waiting(&self) -> bool {
        self.rx.window_deferred && self.window_due() && !self.held_for_adverts()
    }

    /// The hold expired: report consumption now, unless advertised receives hold it.
    pub(crate) fn force_window(&mut self, link: &mut Link) {
        if self.rx.key_wanted {
            // After the advertisement that waits for its key (`decide_window`).
            self.rx.window_forced = true;
            return;
        }
        if !self.window_due() {
            self.rx.window_deferred = false;
        } else if !self.held_for_adverts() {
            self.send_window(link);
        }
    }

    /// A write-with-immediate from the peer arrived (the data is already in place).
    pub(crate) fn on_write_imm(&mut self, imm: u32, link: &mut Link) -> Result<(), Violation> {
        if self.rx.closed {
            // Our receives were cancelled (we closed, or the connection is failing): a write the peer started
            // before it heard of it is the ordinary race of a close, not a violation. Its bytes are dropped.
            return Ok(());
        }
        if self.rx.eof {
            // Nothing the peer sends after its CLOSE may be delivered (issue 14).
            return Err(Violation::Stream("stream data after end-of-stream".into()));
        }
        match Imm::decode(imm) {
            Imm::Direct(n) => self.on_direct(n as usize)?,
            Imm::Indirect(n) => self.on_indirect(u64::from(n))?,
        }
        // "... until it has flushed all previous advertisements (by receiving indirect transfers), at which point
        // it will increment its phase and send a new advertisement."
        if self.rx.phase % 2 != 0 && self.rx.outstanding == 0 {
            self.rx.phase = next_phase(self.rx.phase);
            let phase = self.rx.phase;
            self.record(StreamTrace::ReceiverPhase { phase });
        }
        self.advertise(link);
        self.maybe_window(link);
        Ok(())
    }

    /// A direct transfer of `n` bytes into the receive at the head of the queue (seed 001).
    fn on_direct(&mut self, n: usize) -> Result<(), Violation> {
        // The direct transfer must be for the receive at the head of the queue (seed 001's guarantee),
        // advertised, in an even phase, and fit.
        let phase = self.rx.phase;
        // Space the sender waits for, held back for the advertisements (see `maybe_window`).
        let space_held_back = self.window_due() && self.rx.defer_windows && self.rx.phase % 2 == 0;
        let Some(r) = self.rx.recvs.front_mut() else {
            return Err(Violation::Stream(
                "direct transfer with no receive posted".into(),
            ));
        };
        if r.counted.is_none() || phase % 2 != 0 || n > r.len - r.filled || n == 0 {
            return Err(Violation::Stream(format!(
                "direct transfer of {n} bytes does not fit the head receive ({} of {} filled, advertised: {}, phase {phase})",
                r.filled,
                r.len,
                r.counted.is_some()
            )));
        }
        r.filled += n;
        if n > SMALL_VIA_RING {
            self.rx.ring_chosen = false;
            self.rx.small_flushes = 0;
        } else if space_held_back {
            // A small transfer into our receive while the sender's view of the buffer is half full or
            // more: its small writes go through the buffer when there is room (`small_via_ring`), so it
            // fell back on the receive for want of space. Holding the space for advertisements would keep
            // it there, one write and one advertisement per message, for as long as the application
            // keeps receives posted (issue 26: a sender that filled the buffer before the first
            // advertisement arrived never came back to it).
            self.rx.ring_chosen = true;
        }
        if !r.waitall || r.filled == r.len {
            self.complete_front();
        }
        Ok(())
    }

    /// An indirect transfer of `n` bytes into the stream buffer (seed 001).
    fn on_indirect(&mut self, n: u64) -> Result<(), Violation> {
        // Judged before anything is counted: bytes counted in the buffer are unread data the connection keeps
        // for the application after a violation, and none can be read from a buffer never exposed (test
        // `hostile_stream_indirect_before_the_buffer_was_exposed`).
        if self.rx.ring.is_none() {
            return Err(Violation::Stream(format!(
                "indirect transfer of {n} bytes before the stream buffer was exposed"
            )));
        }
        let free = self.rx.ring_len - (self.rx.tail - self.rx.head);
        if n == 0 || n > free {
            return Err(Violation::Stream(format!(
                "indirect transfer of {n} bytes with {free} bytes free"
            )));
        }
        self.rx.tail += n;
        if n > SMALL_VIA_RING as u64 || n * 2 >= self.rx.ring_len {
            // More than a small batch through the buffer (or half or more of a buffer too small to take a
            // batch that size) ends a run of small writes. If the run had stopped our advertisements, the
            // sender now has bulk and no advertisement to send it into: advertise again (see
            // `advertise`). Otherwise nothing changes (one advertisement at a time, as before the run).
            if self.rx.small_flushes >= QUIET_AFTER_FLUSHES {
                self.rx.ring_chosen = false;
            }
            self.rx.small_flushes = 0;
        } else if self.rx.phase % 2 == 0 && self.rx.outstanding > 0 {
            self.rx.ring_chosen = true;
            self.rx.small_flushes = self.rx.small_flushes.saturating_add(1);
        }
        // "When the receiver receives an indirect transfer, it also increments its phase if it was
        // previously even."
        if self.rx.phase % 2 == 0 {
            self.rx.phase = next_phase(self.rx.phase);
            let phase = self.rx.phase;
            self.record(StreamTrace::ReceiverPhase { phase });
        }
        self.drain()
    }

    /// No more data will come: receives end with what they have, or with end-of-stream.
    /// Completes the receives once the stream buffer is empty after the end of the stream: with the bytes they
    /// hold, else end-of-stream, or after a reset its error ([`StreamProto::on_reset`]).
    pub(super) fn finish_eof(&mut self) {
        while let Some(r) = self.rx.recvs.pop_front() {
            drop(r.mem);
            match &self.rx.reset {
                Some(e) if r.filled == 0 => {
                    r.ticket.complete(Err(e.clone()), 0, EventFlags::default());
                }
                _ => {
                    let flags = EventFlags {
                        eof: r.filled == 0,
                        truncated: false,
                        eor: false,
                    };
                    r.ticket.complete(Ok(()), r.filled, flags);
                }
            }
        }
    }
}

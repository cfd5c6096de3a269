//! What comes back and what is owed: completions of this side's sends, the reposting of receive buffers and the
//! credits they earn the peer, the credits it returns, and the keepalive check (see "Link credits" in the parent
//! module).

use super::*;

impl Link {
    /// A control send completed (or was flushed): its slot (or pack buffer) and send-queue entry come back;
    /// `notify` gets what each of its messages asked to be told.
    pub(crate) fn on_ctrl_done(&mut self, slot: u32, notify: &mut dyn FnMut(u32)) {
        if slot >= self.tx.count {
            let p = slot - self.tx.count;
            let packs = self.pack.as_ref().map_or(0, |p| p.count);
            if p >= packs || self.free_pack.contains(&p) {
                return;
            }
            self.free_pack.push(p);
            self.sq_free += 1;
            for seq in self.pack_notify[p as usize].drain(..) {
                notify(seq);
            }
            return;
        }
        if self.free_tx.contains(&slot) {
            return;
        }
        self.free_tx.push(slot);
        self.sq_free += 1;
        if let Some(seq) = self.tx_notify[slot as usize].take() {
            notify(seq);
        }
    }

    /// A data operation completed (or was flushed).
    pub(crate) fn on_data_done(&mut self, was_read: bool) {
        self.sq_free += 1;
        if was_read {
            self.reads_free += 1;
        }
    }

    /// This connection's own receive slots.
    pub(crate) fn own_rx(&self) -> Result<&Slots, Violation> {
        self.rx.as_ref().ok_or_else(|| {
            Violation::BadRange(
                "a completion names a private receive slot, but this connection uses the shared pool".into(),
            )
        })
    }

    /// Reposts an own receive slot once its message has been processed; the buffer becomes a credit owed to the
    /// peer.
    pub(crate) fn repost(
        &mut self,
        slot: u32,
        out: &mut Vec<WorkRequest>,
    ) -> Result<(), Violation> {
        out.push(self.own_rx()?.recv_wr(slot, wr_id(WrKind::Recv(slot)))?);
        self.consumed()
    }

    /// A message that consumed one of the buffers promised to the peer has been processed (its buffer went back
    /// to our own slots or to the shared pool): one credit is owed to the peer.
    ///
    /// A peer that keeps its credits has at most `W` messages we have not returned a credit for (every credit we
    /// report leaves in a message we sent, and the peer can have used no more than those): more is an overrun.
    /// With our own receive slots the device refuses it; with the shared pool nothing else would (the peer's
    /// messages would take buffers meant for every connection, and `owed` would grow while our messages wait for
    /// credits the peer withholds).
    pub(crate) fn consumed(&mut self) -> Result<(), Violation> {
        if self.owed >= self.window_in {
            return Err(Violation::CreditOverrun {
                window: self.window_in,
            });
        }
        self.stats.ctrl_received += 1;
        self.owed += 1;
        if self.owed >= self.threshold && !self.credit_queued {
            self.credit_queued = true;
            self.urgent.push_back(Outgoing::Ctrl {
                body: Body::Credit,
                inline: None,
                notify: None,
            });
        }
        Ok(())
    }

    /// Keepalive check: when nothing was posted since the last check, queues a CREDIT (even with no credits
    /// owed) so that a peer that vanished is found by the transport's retries instead of never. Returns whether a
    /// probe was queued.
    ///
    /// A probe needs a credit too: a peer whose device still answers but that returns no credits would hold the
    /// connection for ever. When a queue's messages have waited for credits at three checks in a row (two whole
    /// intervals) and none of them left meanwhile, the peer's side of the protocol has stopped: `Err`. What counts
    /// is that the queue moved, not that a credit came back: a peer that returns one credit at a time feeds our
    /// urgent messages (they may take the last credit) and starves the normal queue (its messages need two),
    /// which would otherwise grow for as long as the peer makes us answer (review finding; test
    /// `a_peer_returning_one_credit_at_a_time_cannot_hold_the_normal_queue`).
    pub(crate) fn keepalive(&mut self) -> Result<bool, Violation> {
        let waiting = Queues {
            urgent: !self.urgent.is_empty() && self.tx_credits() == 0,
            normal: !self.normal.is_empty() && self.tx_credits() < 2,
        };
        let (was, moved) = (self.waited_at_check, self.moved_since_check);
        // Counted only across a whole interval: the queue waited at the check before too, and nothing left it since.
        let stalled = (waiting.urgent && was.urgent && !moved.urgent)
            || (waiting.normal && was.normal && !moved.normal);
        self.starved_checks = if stalled {
            self.starved_checks.saturating_add(1)
        } else {
            0
        };
        self.waited_at_check = waiting;
        self.moved_since_check = Queues::default();
        if self.starved_checks >= 2 {
            return Err(Violation::CreditsWithheld);
        }
        let idle = !self.sent_since_check;
        self.sent_since_check = false;
        if !idle || !self.started || self.keepalive_queued {
            return Ok(false);
        }
        self.keepalive_queued = true;
        self.stats.keepalives += 1;
        self.urgent.push_back(Outgoing::Ctrl {
            body: Body::Credit,
            inline: None,
            notify: None,
        });
        Ok(true)
    }

    /// The peer returned `n` credits.
    pub(crate) fn credits_returned(&mut self, n: u16) -> Result<(), Violation> {
        let n = u32::from(n);
        if n > self.spent {
            return Err(Violation::CreditsBeyondWindow {
                returned: n,
                spent: self.spent,
            });
        }
        self.spent -= n;
        Ok(())
    }
}

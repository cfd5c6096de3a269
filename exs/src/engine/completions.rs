//! Completions: control messages and data transfers handed to the protocol, the shared receive pool's slots,
//! and what follows a fault or a peer's close.

use super::peer_log::peer_warn;
use super::*;

/// How long a shared pool whose growth failed waits before it tries again.
const POOL_RETRY: std::time::Duration = std::time::Duration::from_millis(100);

/// Buffers a pool that covers its promises holds beyond them (see `proto::pool`): room for those taken by
/// connections already released whose completions are not yet read, one batch of completions.
pub(super) const POOL_MARGIN: u32 = COMPLETION_BATCH as u32;

impl Engine {
    pub(super) fn on_completion(&mut self, c: Completion) {
        let pool_slot = Self::pool_slot(&c);
        if let (Some(slot), PoolState::On(pool)) = (pool_slot, &mut self.pool) {
            // Seed 003: a buffer flushed from a connection that went down goes back to the pool at once.
            pool.taken(&c.status);
            if let Err(e) = &c.status {
                // A receive that failed otherwise than flushed (a message longer than the pool's buffers, the
                // peer's doing) ends the connection it came on, as on a connection's own buffers
                // (`Conn::on_completion`). Review finding: it was taken for a flush; on verbs the queue pair is then
                // in error and no connection event follows, so the connection stayed up and its receives waited
                // for good.
                let fault = (*e != crate::transport::WcError::Flushed).then(|| Fault::of_recv(e));
                self.repost_pool(slot);
                if let (Some(fault), Some(&sid)) = (fault, self.eps.get(&c.ep)) {
                    self.fault(sid, fault);
                }
                return;
            }
        }
        let Some(&sid) = self.eps.get(&c.ep) else {
            self.release_early(vec![c]);
            return;
        };
        let Some(sock) = self.sockets.get_mut(&sid) else {
            self.release_early(vec![c]);
            return;
        };
        let established = sock.conn.as_ref().is_some_and(Conn::is_established);
        if !established {
            if matches!(sock.phase, Phase::Connecting | Phase::Accepting) {
                // The connection-management event that brings this connection up has not been handled yet. An
                // honest peer sends no more than the control buffers we posted before it (issue 15: they grew
                // without bound on tcp, where writes with immediate data consume no receive).
                let bound = sock
                    .conn
                    .as_ref()
                    .map_or(0, |c| c.link.window_in() as usize)
                    .max(16);
                if sock.early.len() >= bound {
                    self.release_early(vec![c]);
                    self.fault(
                        sid,
                        Fault::Peer(Violation::CreditOverrun {
                            window: bound as u32,
                        }),
                    );
                    return;
                }
                sock.early.push(c);
            } else {
                self.release_early(vec![c]);
            }
            return;
        }
        self.handle_completion(sid, c);
    }

    /// Completions that will never be handled: their pool buffers go back to the pool.
    pub(super) fn release_early(&mut self, early: Vec<Completion>) {
        for c in early {
            if let Some(slot) = Self::pool_slot(&c) {
                self.repost_pool(slot);
            }
        }
    }

    pub(super) fn repost_pool(&mut self, slot: u32) {
        if let PoolState::On(pool) = &mut self.pool {
            match pool.repost(slot) {
                Ok(wr) => self.pool_posts.push(wr),
                Err(v) => {
                    tracing::error!(%v, "shared receive pool slot cannot be reposted");
                    pool.lost(1);
                }
            }
        }
    }

    /// Allocates, registers and posts the pool's next chunk (seed 003: the pool grows by chunks up to its
    /// maximum). The pool itself only says what it needs. A chunk that cannot be registered leaves the pool as it
    /// was; one registered but not posted is the pool's, and its buffers wait with those to repost.
    fn grow_pool(&mut self, pool: &mut RecvPool) -> Result<(), TransportError> {
        let Some(bytes) = pool.next_chunk() else {
            return Ok(());
        };
        let buf = DmaBuf::new(bytes);
        let reg = self.register(&buf)?;
        let mut wrs = pool
            .add_chunk(buf, reg)
            .map_err(|v| TransportError::Invalid(v.to_string()))?;
        let n = wrs.len();
        self.stats.posted += n as u64;
        let posted = self.transport.post_shared_recv(&mut wrs);
        // What is left in `wrs` was not posted, and waits with the buffers to repost. On an error the transport
        // may have dropped some of the others (the trait allows it): they are counted lost.
        let gone = (n - wrs.len()) as u32;
        match posted {
            Ok(()) => pool.reposted(gone as usize),
            Err(_) => pool.lost(gone),
        }
        self.pool_posts.append(&mut wrs);
        posted
    }

    /// Grows the pool, taken out while it grows and always put back.
    fn grow_pool_in_place(&mut self) -> Result<(), TransportError> {
        let PoolState::On(mut p) = std::mem::replace(&mut self.pool, PoolState::Undecided) else {
            unreachable!("called on a pool that is on")
        };
        let grown = self.grow_pool(&mut p);
        self.pool = PoolState::On(p);
        grown
    }

    /// Where the pool covers its promises (a transport without receiver-not-ready retry: iWARP), grows it until
    /// it holds a buffer for every credit promised, `window` more for endpoint `ep`, and counts `ep`'s promise;
    /// a connection it cannot cover is refused before it promises anything (its peer's messages would otherwise
    /// find the queue empty and end their connection).
    pub(super) fn cover_pool(&mut self, ep: EndpointId, window: u32) -> Result<(), TransportError> {
        loop {
            let PoolState::On(p) = &mut self.pool else {
                return Ok(());
            };
            let short = p.shortfall(window);
            if short == 0 {
                p.promise(ep, window);
                return Ok(());
            }
            if p.next_chunk().is_none() {
                let st = p.stats();
                return Err(TransportError::Resource(format!(
                    "the shared receive pool cannot hold another connection's {window} buffers: on {} a message \
                     that finds no receive posted ends its connection (no receiver-not-ready retry: iWARP), so the \
                     pool keeps a buffer for every credit its connections promised, {} now, and {POOL_MARGIN} more, \
                     in at most {} buffers (ContextOptions::shared_recv.max_slots, within the device's shared \
                     queue); raise it, or leave shared_recv.enabled unset to give connections receives of their own",
                    self.caps.name, st.promised, st.slots
                )));
            }
            self.grow_pool_in_place()?;
        }
    }

    /// A pool with no buffer posted (its first chunk could not be registered, or every buffer is taken) grows
    /// before a new connection relies on it, whatever its watermark says: a connection that only receives would
    /// otherwise wait for a completion that never comes (review finding).
    pub(super) fn fill_empty_pool(&mut self) -> Result<(), TransportError> {
        match &self.pool {
            PoolState::On(p) if p.stats().posted == 0 && p.next_chunk().is_some() => {
                self.grow_pool_in_place()
            }
            _ => Ok(()),
        }
    }

    /// Posts the pool buffers that came back, and grows the pool below its low watermark.
    pub(super) fn flush_pool(&mut self) {
        let PoolState::On(pool) = &self.pool else {
            return;
        };
        // The watermark is checked first: the buffers this batch took are not back yet. A growth that failed
        // (out of locked memory) once dropped the pool, and the next connection, finding none, asked the
        // transport for a second shared queue and failed, as did every one after it (review finding); now the
        // pool stays, and a failed growth is tried again only after `POOL_RETRY`, not at every batch.
        if pool.wants_growth() && self.pool_retry_at.is_none_or(|at| self.now() >= at) {
            match self.grow_pool_in_place() {
                Ok(()) => self.pool_retry_at = None,
                Err(e) => {
                    tracing::warn!(%e, "the shared receive pool cannot grow");
                    self.pool_retry_at = Some(self.now() + POOL_RETRY);
                }
            }
        }
        let PoolState::On(pool) = &mut self.pool else {
            return;
        };
        if !self.pool_posts.is_empty() {
            let n = self.pool_posts.len();
            self.stats.posted += n as u64;
            match self.transport.post_shared_recv(&mut self.pool_posts) {
                Ok(()) => pool.reposted(n),
                Err(e) => {
                    tracing::error!(%e, "reposting to the shared receive queue failed");
                    // Which of them reached the queue is not told: all are counted lost.
                    pool.lost(n as u32);
                    self.pool_posts.clear();
                }
            }
        }
    }

    pub(super) fn handle_completion(&mut self, sid: SocketId, c: Completion) {
        let _span = self.conn_span(sid).entered();
        let pool_slot = Self::pool_slot(&c);
        let Some(sock) = self.sockets.get_mut(&sid) else {
            self.release_early(vec![c]);
            return;
        };
        let Some(conn) = sock.conn.as_mut() else {
            self.release_early(vec![c]);
            return;
        };
        let mut posts = std::mem::take(&mut self.posts);
        let pool = match &self.pool {
            PoolState::On(p) => Some(p),
            _ => None,
        };
        let result = conn.on_completion(&c, &mut posts, pool);
        let ep = conn.ep;
        if let Some(slot) = pool_slot {
            self.repost_pool(slot);
        }
        self.post_all(sid, ep, &mut posts);
        self.posts = posts;
        match result {
            Ok(Incoming::Nothing) => {}
            Ok(Incoming::PeerClose(reason)) => self.on_peer_close(sid, reason),
            Err(fault) => self.fault(sid, fault),
        }
        self.mark(sid);
    }

    pub(super) fn on_peer_close(&mut self, sid: SocketId, reason: CloseReason) {
        tracing::debug!(?sid, ?reason, "peer sent CLOSE");
        let Some(sock) = self.sockets.get_mut(&sid) else {
            return;
        };
        if reason == CloseReason::StopReceiving {
            // Not the end: the peer's data and its final CLOSE follow. Only our sends end.
            if let Some(conn) = sock.conn.as_mut() {
                conn.on_peer_stopped_receiving();
            }
            self.mark(sid);
            return;
        }
        if let Some(conn) = sock.conn.as_mut() {
            conn.on_peer_close(reason);
        }
        match reason {
            CloseReason::ShutdownWrite => {
                // Half close: the peer still receives.
                sock.peer_closed = true;
            }
            CloseReason::StopReceiving => {}
            CloseReason::Close | CloseReason::Violation => {
                sock.peer_closed = true;
                sock.peer_full_close = true;
                let err = if reason == CloseReason::Violation {
                    OpError::PeerMisbehaved(Violation::Unexpected {
                        kind: "CLOSE",
                        context: "sent by a peer that says we broke the protocol",
                    })
                } else {
                    OpError::PeerClosed
                };
                sock.down.get_or_insert_with(|| err.clone());
                if let Some(conn) = sock.conn.as_mut() {
                    conn.fail(err);
                }
                if matches!(sock.phase, Phase::Open | Phase::Closing) {
                    self.disconnect(sid);
                }
            }
        }
    }

    /// Brings a connection down after a fault: operations fail with the reason; a violation is reported to the
    /// peer with CLOSE before disconnecting.
    pub(super) fn fault(&mut self, sid: SocketId, fault: Fault) {
        let Some(sock) = self.sockets.get_mut(&sid) else {
            return;
        };
        if matches!(sock.phase, Phase::Disconnecting | Phase::Down) {
            return;
        }
        let is_violation = matches!(fault, Fault::Peer(_));
        let err = fault.into_op_error();
        if is_violation {
            self.stats.violations += 1;
            peer_warn!(self.peer_log, ?sid, %err, "peer violated the protocol; closing the connection");
        } else {
            peer_warn!(self.fail_log, ?sid, %err, "connection failed");
        }
        sock.down.get_or_insert_with(|| err.clone());
        if let Some(t) = sock.ticket.take() {
            t.complete(Err(err.clone()), 0, EventFlags::default());
        }
        if let Some(conn) = sock.conn.as_mut() {
            conn.fail(err);
            if is_violation && conn.is_established() && sock.phase == Phase::Open {
                conn.queue_close(CloseReason::Violation);
                sock.phase = Phase::Closing;
                sock.drop_after_close = true;
                let at = self.clock.now() + self.linger;
                self.timers.set_earliest(sid, TimerKind::Linger, at);
                self.mark(sid);
                return;
            }
        }
        self.disconnect(sid);
        self.mark(sid);
    }

    pub(super) fn disconnect(&mut self, sid: SocketId) {
        let Some(sock) = self.sockets.get_mut(&sid) else {
            return;
        };
        if matches!(sock.phase, Phase::Disconnecting | Phase::Down) {
            return;
        }
        match sock.ep() {
            Some(ep) => {
                sock.phase = Phase::Disconnecting;
                self.transport.disconnect(ep);
            }
            None => sock.phase = Phase::Down,
        }
    }
}

//! Connection management: requests, accepts, established and disconnected connections, the backlog, and
//! building a connection's protocol state (control buffers, pool slots) from the handshake.

use super::*;

impl Engine {
    pub(super) fn on_cm(&mut self, ev: CmEvent) {
        tracing::debug!(?ev, "connection management");
        match ev {
            CmEvent::ConnectRequest {
                listener,
                request,
                peer,
                private,
            } => self.on_connect_request(listener, request, peer, private),
            CmEvent::Established { ep, private } => self.on_established(ep, private),
            CmEvent::ConnectFailed { ep, reason } => {
                if let Some(&sid) = self.eps.get(&ep) {
                    let err = match reason {
                        ConnectFailure::Refused(_) => OpError::Refused,
                        ConnectFailure::Unreachable => OpError::Unreachable,
                        ConnectFailure::TimedOut => OpError::TimedOut,
                        ConnectFailure::Other(s) => OpError::Transport(TransportError::Invalid(s)),
                    };
                    self.fail_connect(sid, err);
                }
            }
            CmEvent::Disconnected { ep } => {
                self.poll_completions();
                self.on_disconnected(ep);
            }
        }
    }

    /// Refuses the requests that waited in a listener's backlog longer than the connect timeout (their peers have
    /// given up by then).
    pub(super) fn expire_backlog(&mut self, lsid: SocketId, now: Instant) {
        let timeout = self.connect_timeout;
        let Some(l) = self
            .sockets
            .get_mut(&lsid)
            .and_then(|s| s.listening.as_mut())
        else {
            return;
        };
        while l.backlog.front().is_some_and(|b| b.3 + timeout <= now) {
            let (request, peer, _, _) = l.backlog.pop_front().expect("checked");
            tracing::debug!(%peer, "connection request expired in the backlog");
            self.stats.expired_requests += 1;
            self.transport.reject(request);
        }
        let next = l.backlog.front().map(|b| b.3 + timeout);
        self.timers.set(lsid, TimerKind::Backlog, next);
    }

    pub(super) fn fail_connect(&mut self, sid: SocketId, err: OpError) {
        let Some(sock) = self.sockets.get_mut(&sid) else {
            return;
        };
        if let Some(t) = sock.ticket.take() {
            t.complete(Err(err.clone()), 0, EventFlags::default());
        }
        sock.down = Some(err);
        // Release the endpoint now: it never carried a connection.
        if let Some(ep) = sock.ep() {
            self.eps.remove(&ep);
            self.release_endpoint(ep);
        }
        let sock = self.sockets.get_mut(&sid).expect("looked up above");
        sock.conn = None;
        let early = std::mem::take(&mut sock.early);
        sock.phase = Phase::Down;
        if sock.user_closed {
            self.remove_socket(sid);
        }
        self.release_early(early);
    }

    pub(super) fn on_connect_request(
        &mut self,
        listener: ListenerId,
        request: RequestId,
        peer: SocketAddr,
        private: Vec<u8>,
    ) {
        let Some(&lsid) = self.listeners.get(&listener) else {
            self.transport.reject(request);
            return;
        };
        if self.eps.len() >= self.max_connections {
            tracing::debug!(%peer, limit = self.max_connections, "connection limit reached, refusing");
            self.stats.refused_over_limit += 1;
            self.transport.reject(request);
            return;
        }
        let Some(lsock) = self.sockets.get_mut(&lsid) else {
            self.transport.reject(request);
            return;
        };
        let hs = match Handshake::decode(&private) {
            Ok(hs) => hs,
            Err(e) => {
                tracing::warn!(%peer, %e, "rejecting a connection request with a bad handshake");
                self.stats.violations += 1;
                self.transport.reject(request);
                return;
            }
        };
        let want = match lsock.ty {
            SockType::SeqPacket => WireSockType::SeqPacket,
            SockType::Stream => WireSockType::Stream,
        };
        if hs.sock_type != want {
            tracing::warn!(%peer, "rejecting a connection request for another socket type");
            self.transport.reject(request);
            return;
        }
        let Some(l) = lsock.listening.as_mut() else {
            self.transport.reject(request);
            return;
        };
        if let Some(ticket) = l.accepts.pop_front() {
            self.accept_request(lsid, request, peer, hs, ticket);
        } else if l.backlog.len() < lsock.opts.backlog as usize {
            let now = self.clock.now();
            l.backlog.push_back((request, peer, hs, now));
            // One timer per listener, at the oldest waiting request's expiry (`expire_backlog` moves it on).
            self.timers
                .set_earliest(lsid, TimerKind::Backlog, now + self.connect_timeout);
            self.check_polls(lsid);
        } else {
            tracing::debug!(%peer, "backlog full, rejecting");
            self.transport.reject(request);
        }
    }

    pub(super) fn accept_request(
        &mut self,
        lsid: SocketId,
        request: RequestId,
        peer: SocketAddr,
        hs: Handshake,
        ticket: Ticket,
    ) {
        let Some(l) = self.sockets.get(&lsid) else {
            return;
        };
        let (ty, opts, bound) = (l.ty, l.opts, l.bound);
        let sid = self.new_socket_id();
        let ep = self.new_ep();
        // On every failure below the endpoint goes too: whatever the transport set up for it (a connection's own
        // domain) would otherwise stay behind.
        let mut conn = match self.build_conn(ep, ty, &opts) {
            Ok(c) => c,
            Err(e) => {
                self.transport.reject(request);
                self.release_endpoint(ep);
                ticket.complete(Err(OpError::Transport(e)), 0, EventFlags::default());
                return;
            }
        };
        let recvs = match conn.link.initial_recvs() {
            Ok(r) => r,
            Err(v) => {
                self.transport.reject(request);
                drop(conn);
                self.release_endpoint(ep);
                ticket.complete(Err(OpError::PeerMisbehaved(v)), 0, EventFlags::default());
                return;
            }
        };
        let private = conn.local.encode();
        if let Err(e) = self.transport.accept(request, ep, &private, recvs) {
            drop(conn);
            self.release_endpoint(ep);
            ticket.complete(Err(OpError::Transport(e)), 0, EventFlags::default());
            return;
        }
        let mut sock = Sock::new(ty, opts);
        sock.bound = bound;
        sock.phase = Phase::Accepting;
        sock.conn = Some(conn);
        sock.ticket = Some(ticket);
        sock.peer_hs = Some(hs);
        sock.peer_addr = Some(peer);
        self.sockets.insert(sid, sock);
        self.eps.insert(ep, sid);
        // A peer that never completes the connection does not hold the endpoint forever.
        let at = self.clock.now() + self.connect_timeout;
        self.timers.set(sid, TimerKind::ConnectTimeout, Some(at));
    }

    pub(super) fn on_established(&mut self, ep: EndpointId, private: Vec<u8>) {
        let Some(&sid) = self.eps.get(&ep) else {
            return;
        };
        let Some(sock) = self.sockets.get_mut(&sid) else {
            return;
        };
        let peer = match sock.phase {
            Phase::Connecting => match Handshake::decode(&private) {
                Ok(hs) => hs,
                Err(e) => {
                    self.fault(sid, Fault::Peer(Violation::Handshake(e.to_string())));
                    return;
                }
            },
            Phase::Accepting => match sock.peer_hs.take() {
                Some(hs) => hs,
                None => return,
            },
            _ => return, // already torn down (a close raced with the connection)
        };
        let opts = sock.opts;
        let conn = sock
            .conn
            .as_mut()
            .expect("connecting sockets have a connection");
        if let Err(v) = conn.establish(&peer, &opts, self.clock.now()) {
            self.fault(sid, Fault::Peer(v));
            return;
        }
        if opts.stream_buffer_eager {
            if let Some(st) = conn.stream() {
                // As if the peer had asked: the buffer and its STREAM_RING go with the first flush.
                st.on_ring_wanted();
            }
        }
        let Some(sock) = self.sockets.get_mut(&sid) else {
            return;
        };
        self.stats.connections += 1;
        let passive = sock.phase == Phase::Accepting;
        sock.phase = Phase::Open;
        self.timers.set(sid, TimerKind::ConnectTimeout, None);
        if sock.peer_addr.is_none() {
            sock.peer_addr = self.transport.peer_addr(ep);
        }
        let ticket = sock.ticket.take();
        let early = std::mem::take(&mut sock.early);
        if let Some(t) = ticket {
            if passive {
                match self.ctx.upgrade() {
                    Some(inner) => t.complete_accept(crate::socket::Socket::from_engine(
                        Context::from_inner(inner),
                        sid,
                    )),
                    None => t.complete(Err(OpError::Cancelled), 0, EventFlags::default()),
                }
            } else {
                t.complete(Ok(()), 0, EventFlags::default());
            }
        }
        for c in early {
            self.handle_completion(sid, c);
        }
        self.mark(sid);
    }

    pub(super) fn on_disconnected(&mut self, ep: EndpointId) {
        tracing::debug!(?ep, "disconnected");
        let Some(sid) = self.eps.remove(&ep) else {
            self.release_endpoint(ep);
            return;
        };
        self.release_endpoint(ep);
        let Some(sock) = self.sockets.get_mut(&sid) else {
            return;
        };
        let err = sock.down.clone().unwrap_or(OpError::ConnectionReset);
        if let Some(t) = sock.ticket.take() {
            t.complete(Err(err.clone()), 0, EventFlags::default());
        }
        if let Some(mut conn) = sock.conn.take() {
            self.stats.ctrl_recv_bytes = self
                .stats
                .ctrl_recv_bytes
                .saturating_sub(conn_rx_bytes(&conn));
            if sock.peer_closed && sock.down.is_none() {
                conn.drop_all(OpError::PeerClosed);
            } else {
                conn.drop_all(err.clone());
            }
            // A stream whose peer closed keeps its state: bytes that arrived before the close are still read
            // (as after a TCP FIN), then receives see end-of-stream.
            if sock.ty == SockType::Stream && sock.peer_closed && !sock.user_closed {
                sock.conn = Some(conn);
            }
        }
        sock.down.get_or_insert(err);
        sock.phase = Phase::Down;
        let early = std::mem::take(&mut sock.early);
        if sock.user_closed {
            self.remove_socket(sid);
        }
        self.release_early(early);
        self.check_polls(sid);
    }
}

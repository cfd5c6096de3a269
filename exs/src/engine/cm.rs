//! Connection management: requests, accepts, established and disconnected connections, the backlog, and
//! building a connection's protocol state (control buffers, pool slots) from the handshake.

use super::peer_log::peer_warn;
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
                    let peer = self.sockets.get(&sid).and_then(|s| s.peer_addr);
                    let err = match reason {
                        ConnectFailure::Refused(_) => OpError::Refused,
                        ConnectFailure::Unreachable => OpError::Unreachable,
                        ConnectFailure::TimedOut => OpError::TimedOut,
                        ConnectFailure::NotAPeer(why) => {
                            tracing::debug!(?peer, %why, "connect: not an exs peer");
                            OpError::NotAPeer(
                                peer.map_or_else(|| "the far end".into(), |a| a.to_string()),
                            )
                        }
                        // Review finding: this was `Invalid(text)`, "invalid argument" without the call or its
                        // code, as if the caller had erred.
                        ConnectFailure::Other(e) => OpError::Transport(e),
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
        let conn = sock.conn.take();
        let early = std::mem::take(&mut sock.early);
        sock.phase = Phase::Down;
        if sock.user_closed {
            self.remove_socket(sid);
        } else {
            // A poll waiting for the connection learns of its failure (no other event of the socket follows).
            self.check_polls(sid);
        }
        self.release_early(early);
        if let Some(conn) = conn {
            self.forget_conn(conn);
        }
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
                peer_warn!(self.peer_log, %peer, %e, "rejecting a connection request with a bad handshake");
                self.stats.violations += 1;
                self.transport.reject(request);
                return;
            }
        };
        // Issue 27: a handshake that decodes but fails a check is refused here, before anything is set up for it
        // (it used to surface from the application's accept).
        if let Err(v) = crate::proto::conn::check_peer_handshake(&hs, lsock.ty, &lsock.opts) {
            peer_warn!(self.peer_log, %peer, %v, "refusing a connection request");
            if !matches!(v, Violation::SocketTypeMismatch { .. }) {
                self.stats.violations += 1;
            }
            self.stats.dropped_before_accept += 1;
            self.transport.reject(request);
            return;
        }
        let Some(l) = lsock.listening.as_ref() else {
            self.transport.reject(request);
            return;
        };
        // The backlog bounds what the listener holds for the application: connections being set up, and
        // established ones not yet accepted (TCP's SYN and accept queues).
        if l.pending.len() + l.ready.len() < lsock.opts.backlog as usize {
            self.accept_request(lsid, request, peer, hs);
        } else {
            tracing::debug!(%peer, "backlog full, rejecting");
            self.stats.refused_backlog_full += 1;
            self.transport.reject(request);
        }
    }

    /// Sets an incoming connection up for its listener (no application has it yet: see [`Listening`]).
    pub(super) fn accept_request(
        &mut self,
        lsid: SocketId,
        request: RequestId,
        peer: SocketAddr,
        hs: Handshake,
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
                peer_warn!(self.peer_log, %peer, %e, "cannot set an incoming connection up; refusing it");
                self.transport.reject(request);
                self.release_endpoint(ep);
                self.stats.dropped_before_accept += 1;
                return;
            }
        };
        let recvs = match conn.link.initial_recvs() {
            Ok(r) => r,
            Err(v) => {
                peer_warn!(self.peer_log, %peer, %v, "refusing an incoming connection");
                self.transport.reject(request);
                self.forget_conn(conn);
                self.release_endpoint(ep);
                self.stats.dropped_before_accept += 1;
                return;
            }
        };
        let private = conn.local.encode();
        if let Err(e) = self.transport.accept(request, ep, &private, recvs) {
            tracing::debug!(%peer, %e, "accepting an incoming connection failed");
            // A transport that failed before it took the request left it waiting: refuse it (does nothing if
            // the transport answered it already).
            self.transport.reject(request);
            self.forget_conn(conn);
            self.release_endpoint(ep);
            self.stats.dropped_before_accept += 1;
            return;
        }
        let now = self.clock.now();
        let mut sock = Sock::new(ty, opts);
        sock.bound = bound;
        sock.phase = Phase::Accepting;
        sock.handshake_began = Some(now);
        sock.conn = Some(conn);
        sock.peer_hs = Some(hs);
        sock.peer_addr = Some(peer);
        // The listener's until established: gone without a trace if it fails before (`remove_socket` counts it).
        sock.user_closed = true;
        sock.listener = Some(lsid);
        self.sockets.insert(sid, sock);
        self.eps.insert(ep, sid);
        if let Some(l) = self
            .sockets
            .get_mut(&lsid)
            .and_then(|l| l.listening.as_mut())
        {
            l.pending.insert(sid);
        }
        // A peer that never completes the connection does not hold the endpoint forever.
        self.timers.set(
            sid,
            TimerKind::ConnectTimeout,
            Some(now + self.connect_timeout),
        );
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
                st.want_ring_now();
            }
        }
        let Some(sock) = self.sockets.get_mut(&sid) else {
            return;
        };
        self.stats.connections += 1;
        let passive = sock.phase == Phase::Accepting;
        sock.phase = Phase::Open;
        // From when the handshake began: the connect timer's deadline says nothing of it once a call chose its own
        // timeout.
        let now = self.clock.now();
        sock.handshake = sock
            .handshake_began
            .take()
            .map(|began| now.saturating_duration_since(began));
        self.timers.set(sid, TimerKind::ConnectTimeout, None);
        if sock.peer_addr.is_none() {
            sock.peer_addr = self.transport.peer_addr(ep);
        }
        sock.local_addr = self.transport.local_addr(ep);
        sock.span = tracing::debug_span!(
            parent: None,
            "exs_conn",
            id = sid.0,
            peer = ?sock.peer_addr,
            backend = %self.caps.name
        );
        tracing::debug!(parent: &sock.span, handshake = ?sock.handshake, passive, "connection up");
        let ticket = sock.ticket.take();
        let early = std::mem::take(&mut sock.early);
        if let Some(t) = ticket {
            t.complete(Ok(()), 0, EventFlags::default());
        }
        if passive {
            self.established_for_listener(sid);
        }
        for c in early {
            self.handle_completion(sid, c);
        }
        self.mark(sid);
    }

    /// An incoming connection is established: the first accept waiting takes it, or it waits for one (the
    /// application owns it from here: a failure now is the application's to see).
    fn established_for_listener(&mut self, sid: SocketId) {
        let Some(lsid) = self.sockets.get_mut(&sid).and_then(|s| {
            s.user_closed = false;
            s.listener
        }) else {
            return;
        };
        let Some(l) = self
            .sockets
            .get_mut(&lsid)
            .and_then(|l| l.listening.as_mut())
        else {
            return;
        };
        l.pending.remove(&sid);
        match l.accepts.pop_front() {
            Some(ticket) => self.hand_over(ticket, sid),
            None => {
                l.ready.push_back(sid);
                self.check_polls(lsid);
            }
        }
    }

    /// Completes an accept with an established incoming connection.
    pub(super) fn hand_over(&mut self, ticket: Ticket, sid: SocketId) {
        if let Some(s) = self.sockets.get_mut(&sid) {
            s.listener = None;
            // What waited for the application (a stream buffer its peer asked for: `provide_ring`) goes now.
            self.flush(sid);
        }
        match self.owner.upgrade() {
            Some(owner) => ticket.complete_accept(crate::event::Accepted::new(sid, owner)),
            None => ticket.complete(Err(OpError::Cancelled), 0, EventFlags::default()),
        }
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
            uncount_rx_bytes(&mut self.stats, &conn);
            // A stream keeps its receiving state: bytes that arrived before the peer's close are still read (as
            // after a TCP FIN), then receives see end-of-stream; after a reset, as TCP delivers the bytes it
            // acknowledged, those the stream buffer holds are read, then receives fail with the reset's error.
            // Only an established stream's; after a reset, only while the buffer holds bytes (the receive that
            // empties it lets the connection go: `Engine::recv`).
            let graceful = sock.peer_closed && sock.down.is_none();
            let keep = sock.ty == SockType::Stream && !sock.user_closed && conn.stream().is_some();
            if graceful {
                conn.drop_all(OpError::PeerClosed);
            } else {
                if keep {
                    conn.on_reset(err.clone());
                }
                conn.drop_all(err.clone());
            }
            let unread = conn.stream().is_some_and(|s| s.holds_unread());
            if keep && (sock.peer_closed || unread) {
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

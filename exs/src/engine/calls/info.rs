//! What a socket says of itself and how it is tuned: its options (read, and changed within what the connection
//! allows), its error, addresses, stream trace and counters.

use super::*;

impl Engine {
    /// Applies every changed field of `new`, or none: a value out of range, or a negotiated field changed after
    /// the connection started, refuses the whole set.
    pub(crate) fn set_options(&mut self, sid: SocketId, new: &SocketOptions) -> R<(), OptionError> {
        let s = self.sock(sid)?;
        let mut next = s.opts;
        for change in s.opts.changes(new) {
            // Issue 26: whether a stream's small writes wait for the write in flight is the sender's own rule
            // (TCP_NODELAY), not negotiated: it may change at any time.
            let sender_rule = matches!(change, Opt::Coalesce(_)) && s.ty == SockType::Stream;
            // A listener's options are those of the connections it accepts from then on (review finding: they
            // were refused as "after connect").
            let open = matches!(s.phase, Phase::Fresh | Phase::Listening);
            if change.negotiated() && !sender_rule && !open {
                return Err(OptionError::Locked(change.name()));
            }
            change.apply(&mut next)?;
        }
        if let Some(st) = s.conn.as_mut().and_then(|c| c.stream()) {
            if next.coalesce != s.opts.coalesce {
                st.set_coalesce(next.coalesce);
            }
            // Review finding: a change after connect was taken and did nothing (turned off, the records kept
            // growing until read).
            if next.trace != s.opts.trace {
                st.set_trace(next.trace);
            }
        }
        s.opts = next;
        Ok(())
    }

    pub(crate) fn options(&mut self, sid: SocketId) -> R<SocketOptions, StateError> {
        Ok(self.sock(sid)?.opts)
    }

    pub(crate) fn socket_error(&mut self, sid: SocketId) -> R<Option<OpError>, StateError> {
        Ok(self.sock(sid)?.down.clone())
    }

    /// The socket's address: its connection's while the transport has it, else the one recorded when the
    /// connection came up (after a disconnect, as TCP's `getsockname`), else the one it was bound to.
    pub(crate) fn local_addr(&mut self, sid: SocketId) -> R<Option<SocketAddr>, StateError> {
        let s = self.sock(sid)?;
        let (recorded, ep) = (s.local_addr.or(s.bound), s.ep());
        Ok(ep.and_then(|ep| self.transport.local_addr(ep)).or(recorded))
    }

    /// The peer's address as recorded when the connection was set up, whatever became of the connection since
    /// (an accepted connection whose peer already wrote and closed is still accepted, as TCP's is).
    pub(crate) fn recorded_peer_addr(
        &mut self,
        sid: SocketId,
    ) -> R<Option<SocketAddr>, StateError> {
        Ok(self.sock(sid)?.peer_addr)
    }

    /// The peer's address while the connection is up, and after the peer closed it (until this side reads the
    /// end of its stream and closes, as TCP's `getpeername` in CLOSE_WAIT); not after a reset.
    pub(crate) fn peer_addr(&mut self, sid: SocketId) -> R<Option<SocketAddr>, StateError> {
        let s = self.sock(sid)?;
        if s.phase != Phase::Open && !s.peer_full_close {
            return Err(StateError::NotConnected);
        }
        let (peer, ep) = (s.peer_addr, s.ep());
        Ok(peer.or_else(|| ep.and_then(|ep| self.transport.peer_addr(ep))))
    }

    /// The recorded stream-protocol decisions of a socket (with the trace option on).
    pub(crate) fn stream_trace(&mut self, sid: SocketId) -> Vec<crate::proto::stream::StreamTrace> {
        let Some(conn) = self.sockets.get_mut(&sid).and_then(|s| s.conn.as_mut()) else {
            return Vec::new();
        };
        conn.stream().map(|s| s.take_trace()).unwrap_or_default()
    }

    /// Counters of the connection of a socket (tests and tools).
    pub(crate) fn conn_stats(&mut self, sid: SocketId) -> Option<crate::engine::ConnStats> {
        let s = self.sockets.get_mut(&sid)?;
        let conn = s.conn.as_mut()?;
        Some(crate::engine::ConnStats {
            link: conn.link.stats(),
            message: conn.message().map(|m| m.stats).unwrap_or_default(),
            stream: conn.stream().map(|st| st.stats()).unwrap_or_default(),
            window_in: conn.link.window_in(),
            slot_size: conn.link.slot_size(),
            bytes_sent: s.bytes_sent,
            bytes_received: s.bytes_received,
            handshake: s.handshake,
        })
    }
}

//! The ES-API calls on sockets (seed 002, section 2): socket, bind, listen, accept, connect, send, recv,
//! shutdown, close, abort, poll; options and what a socket says of itself are in `info`.

use super::*;
use crate::exposure::ExposeError;
use crate::proto::conn::HoldId;
use crate::proto::stream::StreamRecvMemory;

mod info;

/// The application's memory that a send or receive names (a `Slice` of a registered region): the engine sits below
/// the public memory types and sees them through this.
pub(crate) trait Buffer {
    /// Bytes named.
    fn len(&self) -> usize;
    /// Refuses memory of another context, and a range outside its region.
    fn check(&self, ctx: u64) -> Result<(), crate::error::BufferError>;
    /// Leases the bytes with their registration, as one step with respect to deregistration.
    fn lease(&self, kind: LeaseKind) -> Result<crate::transport::Sge, crate::error::BufferError>;
}

/// The highest socket number ([`SocketId::LAST`]); the numbers come round to 1 after it.
const LAST_SOCKET_ID: u32 = SocketId::LAST;

impl Engine {
    // ---------------------------------------------------------------------------------------------------------
    // Connections

    /// The number of a new socket: the next one this engine does not hold, counting from 1 to [`LAST_SOCKET_ID`]
    /// and round again. A socket that outlives half a billion others keeps its number to itself (a number that came
    /// round used to name two sockets at once, and the C API's table filed the new one over the old), and a
    /// program that makes sockets for ever never runs out.
    pub(super) fn new_socket_id(&mut self) -> SocketId {
        // Each socket the map holds costs far more than a byte, so a free number is always there to find.
        loop {
            let id = SocketId(self.next_socket);
            self.next_socket = if self.next_socket >= LAST_SOCKET_ID {
                1
            } else {
                self.next_socket + 1
            };
            if !self.sockets.contains_key(&id) {
                return id;
            }
        }
    }

    /// Starts the socket numbers at `next`, to test their wrap without making half a billion sockets.
    #[cfg(test)]
    pub(crate) fn set_next_socket_id(&mut self, next: u32) {
        self.next_socket = next;
    }

    /// The next endpoint number, skipping those of endpoints the engine still holds (after 2^32 of them the count
    /// comes round; a number in use would have sent one connection's completions to another).
    pub(super) fn new_ep(&mut self) -> EndpointId {
        loop {
            let id = EndpointId(self.next_ep);
            self.next_ep = self.next_ep.wrapping_add(1).max(1);
            if !self.eps.contains_key(&id) {
                return id;
            }
        }
    }

    /// Starts the endpoint numbers at `next`, to test their wrap without making four billion connections.
    #[cfg(test)]
    pub(crate) fn set_next_ep(&mut self, next: u32) {
        self.next_ep = next;
    }

    /// Allocates and registers a connection's control buffers as the protocol lays them out ([`Layout`]).
    pub(super) fn build_conn(
        &mut self,
        ep: EndpointId,
        ty: SockType,
        opts: &SocketOptions,
    ) -> Result<Conn, TransportError> {
        let pooled = self.pool_slot_size()?;
        let layout = Layout::new(ty, opts, pooled);
        let bytes = layout.bytes();
        let charge = self.budget.charge(bytes as u64).ok_or_else(|| {
            TransportError::Resource(format!(
                "the context's memory budget ({} bytes, {} held) cannot hold another connection's {bytes} bytes of \
                 control buffers",
                self.budget.limit(),
                self.budget.held()
            ))
        })?;
        let rx = match pooled {
            // Seed 003: every buffer of the shared pool has the context's one slot size; the connection owns none.
            Some(slot) => Err((layout.window, slot)),
            None => Ok(self.slots(layout.slot, layout.window)?),
        };
        let tx = self.slots(TX_SLOT, layout.tx_count)?;
        let pack = if layout.pack {
            // Pack buffers as large as our own receive buffers (the peer's usually match).
            Some(self.slots(layout.slot, PACK_SLOTS)?)
        } else {
            None
        };
        let link = Link::new(
            rx,
            tx,
            pack,
            self.caps.max_send_wr,
            self.caps.max_read_depth,
            self.caps.imm_consumes_recv,
        );
        let local = layout.handshake(ty, opts, self.caps.native_write_imm);
        self.stats.ctrl_recv_bytes += link_rx_bytes(&link);
        let setup = crate::proto::conn::Setup {
            limits: self.limits(),
            timing: self.timing(),
            stream: Layout::stream_setup(ty, opts),
            charge,
        };
        if pooled.is_some() {
            // Last, so that nothing above fails after the promise is counted (the endpoint's release forgets it).
            self.cover_pool(ep, layout.window)?;
        }
        Ok(Conn::new(ep, ty, link, local, setup))
    }

    /// `count` slots of `size` bytes, allocated and registered.
    fn slots(&mut self, size: usize, count: u32) -> Result<Slots, TransportError> {
        let buf = DmaBuf::new(size * count as usize);
        let reg = self.register(&buf)?;
        Ok(Slots {
            buf,
            reg,
            size,
            count,
        })
    }

    /// The shared pool's slot size when connections use the pool (creating the pool at the first connection),
    /// `None` when they post their own receives.
    pub(super) fn pool_slot_size(&mut self) -> Result<Option<usize>, TransportError> {
        if matches!(self.pool, PoolState::Undecided) {
            self.decide_pool()?;
        }
        self.fill_empty_pool()?;
        Ok(match &self.pool {
            PoolState::On(p) => Some(p.stats().slot_size),
            _ => None,
        })
    }

    /// Decides at the first connection whether connections use the shared pool, creating it if so.
    fn decide_pool(&mut self) -> Result<(), TransportError> {
        let want = self.shared_recv.enabled;
        match (want, self.caps.max_shared_recv > 0) {
            (Some(false), _) | (None, false) => self.pool = PoolState::Off,
            // Without receiver-not-ready retry (iWARP) a pool must hold every buffer its connections promise, and a
            // peer that sends past its credits would take buffers promised to others, ending their connections.
            // Receives of each connection's own, unless the application requires the pool.
            (None, true) if !self.caps.rnr_retry => self.pool = PoolState::Off,
            (Some(true), false) => {
                return Err(TransportError::Unsupported(format!(
                    "{} has no shared receive queue (ContextOptions::shared_recv)",
                    self.caps.name
                )))
            }
            (_, true) => {
                let o = &self.shared_recv;
                let max = o.max_slots.min(self.caps.max_shared_recv);
                let slot = ctrl_slot_size(o.small_packet_max_size as usize, 1);
                let mut pool = RecvPool::new(slot, o.chunk_slots.min(max), max, o.low_watermark);
                if !self.caps.rnr_retry {
                    pool.cover_promises(super::completions::POOL_MARGIN);
                }
                if let Err(e) = self.transport.create_shared_recv(max) {
                    if want.is_some() {
                        return Err(e);
                    }
                    tracing::warn!(%e, "no shared receive pool; connections post their own receives");
                    self.pool = PoolState::Off;
                    return Ok(());
                }
                // From now on the transport's endpoints take their receives from the shared queue, so the pool
                // stays whatever its first growth does (`fill_empty_pool`, next): this connection fails, and a
                // later one grows it again. Falling back to receives of their own, as before, made every later
                // connection fail on a transport that refuses them once the shared queue exists (review finding).
                self.pool = PoolState::On(pool);
            }
        }
        Ok(())
    }

    // ---------------------------------------------------------------------------------------------------------
    // API

    pub(crate) fn socket(&mut self, ty: SockType) -> SocketId {
        let sid = self.new_socket_id();
        let mut opts = SocketOptions::default();
        if ty == SockType::SeqPacket {
            // Seed 002, 4.1: the immediate-data threshold this transport does best with (still settable).
            opts.small_packet_max_size = self.caps.immediate_default.min(SocketOptions::MAX_SMALL);
        }
        self.sockets.insert(sid, Sock::new(ty, opts));
        sid
    }

    pub(super) fn sock(&mut self, sid: SocketId) -> Result<&mut Sock, StateError> {
        if let Some(why) = &self.failed {
            return Err(StateError::ConnectionDown(failed_error(why)));
        }
        match self.sockets.get_mut(&sid) {
            Some(s) if !s.user_closed => Ok(s),
            _ => Err(StateError::InvalidSocket),
        }
    }

    pub(crate) fn socket_type(&mut self, sid: SocketId) -> Result<SockType, StateError> {
        Ok(self.sock(sid)?.ty)
    }

    pub(crate) fn bind(&mut self, sid: SocketId, addr: SocketAddr) -> R<(), SocketError> {
        let s = self.sock(sid)?;
        // A socket that listens or is connected has its address, as bind(2) says of TCP's (EINVAL).
        if s.phase != Phase::Fresh || s.bound.is_some() {
            return Err(StateError::AlreadyBound.into());
        }
        s.bound = Some(addr);
        Ok(())
    }

    pub(crate) fn listen(&mut self, sid: SocketId, backlog: u32) -> R<SocketAddr, SocketError> {
        let s = self.sock(sid)?;
        let again = match s.phase {
            Phase::Fresh => false,
            Phase::Listening => true,
            _ => return Err(StateError::AlreadyConnected.into()),
        };
        let addr = s.bound.ok_or(StateError::NotBound)?;
        if backlog > 0 {
            s.opts.backlog = backlog.min(65535);
        }
        if again {
            // Listening again changes only the backlog of connections not yet set up, as listen(2) does; the
            // listener keeps the one it was opened with.
            return Ok(addr);
        }
        let backlog = s.opts.backlog;
        let (listener, bound) = self.transport.listen(addr, backlog)?;
        let s = self.sock(sid)?;
        s.bound = Some(bound);
        s.phase = Phase::Listening;
        s.listening = Some(Listening {
            listener,
            accepts: VecDeque::new(),
            pending: Default::default(),
            ready: VecDeque::new(),
        });
        self.listeners.insert(listener, sid);
        Ok(bound)
    }

    pub(crate) fn accept(
        &mut self,
        sid: SocketId,
        ticket: &mut Option<Ticket>,
    ) -> R<(), AcceptError> {
        let s = self.sock(sid)?;
        let Some(l) = s.listening.as_mut() else {
            return Err(StateError::NotListening.into());
        };
        let ticket = ticket.take().expect("ticket given");
        match l.ready.pop_front() {
            Some(conn) => self.hand_over(ticket, conn),
            None => l.accepts.push_back(ticket),
        }
        self.flush_dirty();
        Ok(())
    }

    /// Starts a connection attempt, which fails `TimedOut` after `timeout` (`None`: the context's
    /// `connect_timeout`; a time too long to count: never).
    pub(crate) fn connect(
        &mut self,
        sid: SocketId,
        addr: SocketAddr,
        timeout: Option<Duration>,
        ticket: &mut Option<Ticket>,
    ) -> R<(), ConnectError> {
        let s = self.sock(sid)?;
        match s.phase {
            Phase::Fresh => {}
            Phase::Listening => return Err(StateError::Listening.into()),
            Phase::Connecting | Phase::Accepting => return Err(StateError::Connecting.into()),
            // A socket whose connection failed or ended cannot connect again (a new socket can): why it went
            // down, where "already connected" (`EISCONN`) told a retry loop it had succeeded (review finding).
            Phase::Down => {
                let why = s.down.clone().unwrap_or(OpError::ConnectionReset);
                return Err(StateError::ConnectionDown(why).into());
            }
            _ => return Err(StateError::AlreadyConnected.into()),
        }
        // Review finding: the address was ignored (the transports choose an outgoing connection's own), and
        // `local_addr` then named it until the connection came up.
        if let Some(b) = s
            .bound
            .filter(|b| !b.ip().is_unspecified() || b.port() != 0)
        {
            return Err(TransportError::Unsupported(format!(
                "connecting from {b}: the transport chooses an outgoing connection's own address (bind is for listen)"
            ))
            .into());
        }
        let (ty, opts) = (s.ty, s.opts);
        if self.eps.len() >= self.max_connections {
            return Err(TransportError::Resource(format!(
                "the context's connection limit ({}) is reached",
                self.max_connections
            ))
            .into());
        }
        let ep = self.new_ep();
        let mut conn = self.build_conn(ep, ty, &opts)?;
        let recvs = match conn.link.initial_recvs() {
            Ok(r) => r,
            Err(v) => {
                self.forget_conn(conn);
                self.release_endpoint(ep);
                return Err(TransportError::Invalid(format!("control buffers: {v}")).into());
            }
        };
        let private = conn.local.encode();
        if let Err(e) = self.transport.connect(ep, addr, &private, recvs) {
            // Whatever the transport set up for the endpoint (a connection's own domain) goes with it.
            self.forget_conn(conn);
            self.release_endpoint(ep);
            return Err(e.into());
        }
        let now = self.clock.now();
        // Too long to count means never, as for the context's own (`config::countable`).
        let wait = crate::config::countable(timeout.unwrap_or(self.connect_timeout));
        let at = crate::config::deadline(now, Some(wait));
        let s = self.sock(sid)?;
        s.handshake_began = Some(now);
        s.phase = Phase::Connecting;
        s.conn = Some(conn);
        s.ticket = ticket.take();
        s.peer_addr = Some(addr);
        self.eps.insert(ep, sid);
        self.timers.set(sid, TimerKind::ConnectTimeout, at);
        Ok(())
    }

    /// Why a send on `sid` would be refused now, if it would (shut down for writing, not connected, down): what
    /// a send of nothing checks, having nothing to hand over.
    pub(crate) fn check_sendable(&mut self, sid: SocketId) -> R<(), StateError> {
        self.sendable_conn(sid).map(|_| ())
    }

    /// The open connection a send on `sid` goes out on, or why it would be refused.
    fn sendable_conn(&mut self, sid: SocketId) -> R<&mut Conn, StateError> {
        if self.sock(sid)?.shut_write {
            return Err(StateError::Shutdown);
        }
        let conn = self.open_conn(sid)?;
        match conn.refuses_sends() {
            Some(e) => Err(StateError::ConnectionDown(e)),
            None => Ok(conn),
        }
    }

    /// The open connection of a socket, or why there is none.
    pub(super) fn open_conn(&mut self, sid: SocketId) -> Result<&mut Conn, StateError> {
        let s = self.sock(sid)?;
        match s.phase {
            Phase::Open => Ok(s.conn.as_mut().expect("open sockets have a connection")),
            Phase::Fresh | Phase::Connecting | Phase::Accepting => Err(StateError::NotConnected),
            Phase::Listening => Err(StateError::Listening),
            Phase::Closing | Phase::Disconnecting | Phase::Down => Err(StateError::ConnectionDown(
                s.down.clone().unwrap_or(OpError::ConnectionReset),
            )),
        }
    }

    /// `offset`: `exs_send_offset` (seed 002, 4.4) into the peer's persistent receive. The connection plans how
    /// the bytes travel ([`Conn::plan_send`]); this leases or exposes them as planned and hands them over.
    pub(crate) fn send(
        &mut self,
        sid: SocketId,
        slice: &dyn Buffer,
        flags: MsgFlags,
        offset: Option<u64>,
        ticket: &mut Option<Ticket>,
    ) -> R<(), SendError> {
        self.send_on(sid, slice, flags, offset, ticket, None)
    }

    /// The next part of held send `hold` ([`Engine::hold_sends`]): goes out as [`Engine::send`] does, and also
    /// after the application closed the socket or shut its writing down, ahead of the end of stream the hold keeps
    /// back.
    pub(crate) fn send_held(
        &mut self,
        sid: SocketId,
        hold: HoldId,
        slice: &dyn Buffer,
        ticket: &mut Option<Ticket>,
    ) -> R<(), SendError> {
        self.send_on(sid, slice, MsgFlags::NONE, None, ticket, Some(hold))
    }

    fn send_on(
        &mut self,
        sid: SocketId,
        slice: &dyn Buffer,
        flags: MsgFlags,
        offset: Option<u64>,
        ticket: &mut Option<Ticket>,
        held: Option<HoldId>,
    ) -> R<(), SendError> {
        slice.check(self.ctx_id)?;
        let conn = self.send_conn(sid, held)?;
        let plan = conn.plan_send(slice.len(), flags, offset)?;
        let ep = conn.ep;
        let sge = slice.lease(plan.lease_kind())?;
        let data = match plan {
            SendPlan::Inline => SendData::Inline(sge),
            SendPlan::Exposed { .. } => {
                let (lease, reg) = sge.into_parts();
                SendData::Exposed(
                    self.expose_op(ep, &reg, lease, RemoteAccess::Read)
                        .map_err(ExposeError::into_op::<SendError>)?,
                )
            }
        };
        let token = self.token(ticket);
        self.send_conn(sid, held)?
            .start_send(token, data, slice.len(), flags, offset, held);
        self.flush(sid);
        Ok(())
    }

    /// The connection a send goes out on: an application's send needs the socket open for writing
    /// ([`Engine::sendable_conn`]); the next part of a held send may also go out while the connection closes
    /// gracefully or after a write shutdown, as long as the hold stands (a failure, or the linger time running
    /// out, ends it), and only then: a part whose hold has ended is refused with the socket's reason, or as an
    /// unknown socket (the sendfile names its socket by number, which a later socket may take once this one is
    /// gone).
    fn send_conn(&mut self, sid: SocketId, held: Option<HoldId>) -> R<&mut Conn, StateError> {
        // The application may have closed the socket since (`sock` refuses it then): the hold is the sendfile's.
        let holding = held.is_some_and(|h| {
            self.failed.is_none()
                && self.sockets.get(&sid).is_some_and(|s| {
                    matches!(s.phase, Phase::Open | Phase::Closing)
                        && s.conn
                            .as_ref()
                            .is_some_and(|c| c.holds_sends(h) && c.refuses_sends().is_none())
                })
        });
        if holding {
            let s = self.sockets.get_mut(&sid).expect("checked above");
            return Ok(s.conn.as_mut().expect("checked above"));
        }
        if held.is_some() {
            return Err(self
                .sendable_conn(sid)
                .err()
                .unwrap_or(StateError::InvalidSocket));
        }
        self.sendable_conn(sid)
    }

    /// A send handed over in parts begins (a stream sendfile, which reads its file as it goes): until
    /// [`Engine::release_sends`], a graceful close or write shutdown holds its end of stream back, so that the
    /// peer gets the whole of it, never a clean end after part of it, and the sends made meanwhile go after all of
    /// it ([`Conn::hold_sends`]). Refused where a send would be.
    pub(crate) fn hold_sends(&mut self, sid: SocketId) -> R<HoldId, StateError> {
        Ok(self.sendable_conn(sid)?.hold_sends())
    }

    /// A held send has handed over its last part, or gave up (`gave_up`: part of it went out, the rest never
    /// will): the sends made after it start, and the end of stream it held back goes out once the sends before it
    /// have completed. One that gave up resets the connection instead, as the linger timer does: what followed part
    /// of it on the stream (a send made after it, a close's clean end, a send the application makes before it
    /// learns of the failure) would tell the peer it had the whole of it; [`Conn::fail`] fails what waits.
    pub(crate) fn release_sends(&mut self, sid: SocketId, hold: HoldId, gave_up: bool) {
        // A failed context has already failed every connection (and ended every hold).
        if self.failed.is_some() {
            return;
        }
        // Also once the application has closed the socket: that close is what the hold kept waiting.
        let Some(s) = self.sockets.get_mut(&sid) else {
            return;
        };
        // A connection already down sends nothing more (its sends failed with it); one whose peer closed keeps
        // what it received for the application to read.
        let live = matches!(s.phase, Phase::Open | Phase::Closing);
        let Some(c) = s.conn.as_mut() else {
            return;
        };
        // The hold names its connection: a socket that took the number of the sendfile's, gone since, is not
        // reset for it (review finding; test `a_sendfile_giving_up_leaves_a_socket_that_took_its_number_alone`).
        if !c.holds_sends(hold) {
            return;
        }
        if gave_up && live {
            tracing::debug!(?sid, "a held send gave up part way: resetting");
            s.down.get_or_insert(OpError::Cancelled);
            c.fail(OpError::Cancelled);
            self.disconnect(sid);
            return;
        }
        c.release_sends(hold);
        self.flush(sid);
    }

    /// `offset`: `exs_recv_offset` (seed 002, 4.4) from the peer's persistent send. The connection plans how the
    /// receive is taken ([`Conn::plan_recv`]); this leases or exposes its memory as planned and hands it over.
    pub(crate) fn recv(
        &mut self,
        sid: SocketId,
        slice: &dyn Buffer,
        flags: MsgFlags,
        offset: Option<u64>,
        ticket: &mut Option<Ticket>,
    ) -> R<(), RecvError> {
        slice.check(self.ctx_id)?;
        let s = self.sock(sid)?;
        // After the peer closed, a message receive reports end-of-stream (as read(2) returns 0); a stream receive
        // first takes what the stream buffer still holds (after a reset too, then the reset's error).
        let closed_stream = s.ty == SockType::Stream
            && s.conn.is_some()
            && (s.peer_closed || matches!(s.phase, Phase::Disconnecting | Phase::Down));
        if s.peer_closed && !closed_stream && matches!(s.phase, Phase::Disconnecting | Phase::Down)
        {
            crate::proto::conn::check_flags(flags, s.ty, offset.is_some())?;
            let t = ticket.take().expect("ticket given");
            t.complete_eof();
            return Ok(());
        }
        let conn = if closed_stream {
            s.conn.as_mut().expect("checked above")
        } else {
            self.open_conn(sid)?
        };
        let plan = conn.plan_recv(slice.len(), flags, offset, closed_stream)?;
        let ep = conn.ep;
        let sge = slice.lease(plan.lease_kind())?;
        let mem = match plan {
            RecvPlan::Message => RecvMemory::Leased(sge),
            RecvPlan::Persistent => {
                let (lease, reg) = sge.into_parts();
                RecvMemory::Exposed(self.expose(ep, &reg, lease, RemoteAccess::Write)?)
            }
            // Under the trusted policy the key is the region's, made once per connection: the receive takes it
            // now (so a receive beside a borrow of the region is refused at once). Otherwise it gets a key of
            // its own only if the protocol advertises it (`Engine::provide_recv_keys`).
            RecvPlan::Stream { keyless: false }
                if self.exposure == ExposurePolicy::TrustedPeers =>
            {
                let (lease, reg) = sge.into_parts();
                RecvMemory::Stream(StreamRecvMemory::Keyed(
                    self.expose_op(ep, &reg, lease, RemoteAccess::Write)
                        .map_err(ExposeError::into_op::<RecvError>)?,
                ))
            }
            RecvPlan::Stream { keyless } => RecvMemory::Stream(StreamRecvMemory::Unkeyed {
                sge,
                keyable: !keyless,
            }),
        };
        let token = self.token(ticket);
        let conn = self
            .sockets
            .get_mut(&sid)
            .and_then(|s| s.conn.as_mut())
            .expect("checked above");
        match conn.start_recv(token, mem, flags, offset) {
            Ok(()) => {}
            Err(RecvRefused::Persistent(t, why)) => {
                *ticket = Some(self.untoken(t));
                return Err(StateError::Persistent(why).into());
            }
            Err(RecvRefused::Peer(v)) => self.fault(sid, Fault::Peer(v)),
        }
        // A stream kept after a reset for the bytes its buffer held lets the connection go once they are read:
        // later receives are refused with the reset, as on a connection that held none.
        if let Some(s) = closed_stream.then(|| self.sockets.get_mut(&sid)).flatten() {
            let drained = s
                .conn
                .as_mut()
                .and_then(|c| c.stream())
                .is_some_and(|st| !st.holds_unread());
            if s.phase == Phase::Down && !s.peer_closed && drained {
                s.conn = None;
            }
        }
        self.flush(sid);
        Ok(())
    }

    /// Shuts the sending side down (half close): after the sends already started, the peer sees end-of-stream;
    /// receiving goes on. The ticket completes once every earlier send has.
    pub(crate) fn shutdown_write(
        &mut self,
        sid: SocketId,
        ticket: &mut Option<Ticket>,
    ) -> R<(), StateError> {
        let s = self.sock(sid)?;
        if s.shut_write {
            return Err(StateError::Shutdown);
        }
        self.open_conn(sid)?;
        self.sockets.get_mut(&sid).expect("checked").shut_write = true;
        let token = self.token(ticket);
        self.open_conn(sid)?.shutdown_write(token);
        self.flush(sid);
        Ok(())
    }

    /// Abortive close: pending operations are cancelled and the connection is torn down at once, without the
    /// orderly CLOSE (the peer sees a reset, as with SO_LINGER 0).
    pub(crate) fn abort(&mut self, sid: SocketId) -> R<(), CloseError> {
        let s = self.sock(sid)?;
        match s.phase {
            Phase::Open | Phase::Closing | Phase::Connecting | Phase::Accepting => {
                s.user_closed = true;
                if let Some(t) = s.ticket.take() {
                    t.complete(Err(OpError::Cancelled), 0, EventFlags::default());
                }
                s.down.get_or_insert(OpError::Cancelled);
                if let Some(conn) = s.conn.as_mut() {
                    conn.fail(OpError::Cancelled);
                }
                self.disconnect(sid);
                Ok(())
            }
            // A socket with no connection to tear down (fresh, listening, down, disconnecting) closes as `close`
            // would. It was marked closed first, which `close` then refused: the socket, a listener's port, a
            // down connection's memory stayed for the context's life (review finding; test
            // `abort_of_a_listener_a_fresh_or_a_down_socket_closes_it`).
            _ => self.close(sid),
        }
    }

    /// What the socket is ready for now (ES-API `exs_poll`).
    pub(super) fn readiness(&self, sid: SocketId) -> Readiness {
        let Some(s) = self.sockets.get(&sid) else {
            return Readiness {
                error: true,
                hangup: true,
                ..Readiness::default()
            };
        };
        if let Some(l) = &s.listening {
            return Readiness {
                readable: !l.ready.is_empty(),
                ..Readiness::default()
            };
        }
        let open = s.phase == Phase::Open;
        let (readable, writable) = match (&s.conn, open) {
            (Some(c), true) => c.readiness(),
            // A connection whose peer closed is readable: bytes still buffered, then end-of-stream (or, after a
            // reset, its error).
            (Some(_), false) if s.peer_closed || s.phase == Phase::Down => (true, false),
            _ => (false, false),
        };
        let error = matches!(
            &s.down,
            Some(e) if !matches!(e, OpError::PeerClosed | OpError::Cancelled)
        );
        Readiness {
            readable: readable || s.peer_closed,
            writable: writable && !s.shut_write,
            error,
            hangup: s.peer_closed || matches!(s.phase, Phase::Down | Phase::Disconnecting),
        }
    }

    /// Polls readiness: completes at once if the socket is ready for something in `interest` (errors and
    /// hang-ups always count), else when it becomes so.
    pub(crate) fn poll(
        &mut self,
        sid: SocketId,
        interest: Readiness,
        ticket: &mut Option<Ticket>,
    ) -> R<(), StateError> {
        let s = self.sock(sid)?;
        if matches!(s.phase, Phase::Fresh) {
            return Err(StateError::NotConnected);
        }
        s.polls
            .push((ticket.take().expect("ticket given"), interest));
        // Waiting to read is reading: a stream buffer the peer asked for now serves data (as a receive does).
        if interest.readable {
            if let Some(st) = s.conn.as_mut().and_then(|c| c.stream()) {
                st.reading();
                self.mark(sid);
            }
        }
        self.check_polls(sid);
        self.flush_dirty();
        Ok(())
    }

    pub(super) fn check_polls(&mut self, sid: SocketId) {
        if self.sockets.get(&sid).is_none_or(|s| s.polls.is_empty()) {
            return;
        }
        let r = self.readiness(sid);
        let Some(s) = self.sockets.get_mut(&sid) else {
            return;
        };
        let mut keep = Vec::new();
        for (t, want) in s.polls.drain(..) {
            let hit = Readiness {
                readable: r.readable && want.readable,
                writable: r.writable && want.writable,
                error: r.error,
                hangup: r.hangup,
            };
            if hit.readable || hit.writable || hit.error || hit.hangup {
                t.complete_poll(hit);
            } else {
                keep.push((t, want));
            }
        }
        s.polls = keep;
    }

    /// Ends this side's persistent send and receive (their events come when the peer has let go).
    pub(crate) fn end_persistent(&mut self, sid: SocketId) -> R<(), StateError> {
        if !self.open_conn(sid)?.end_persistent() {
            return Err(StateError::Persistent(
                "no persistent send or receive to end on this socket",
            ));
        }
        self.flush(sid);
        Ok(())
    }

    pub(crate) fn close(&mut self, sid: SocketId) -> R<(), CloseError> {
        let s = self.sock(sid)?;
        s.user_closed = true;
        for (t, _) in s.polls.drain(..) {
            t.complete(Err(OpError::Cancelled), 0, EventFlags::default());
        }
        match s.phase {
            Phase::Fresh | Phase::Down => {
                self.remove_socket(sid);
            }
            Phase::Listening => {
                let l = s
                    .listening
                    .take()
                    .expect("listening sockets have a listener");
                for t in l.accepts {
                    t.complete(Err(OpError::Cancelled), 0, EventFlags::default());
                }
                self.listeners.remove(&l.listener);
                self.transport.close_listener(l.listener);
                self.remove_socket(sid);
                // The connections it held for the application go with it (no application has them).
                for conn in l.pending.into_iter().chain(l.ready) {
                    let Some(s) = self.sockets.get_mut(&conn) else {
                        continue;
                    };
                    s.listener = None;
                    s.user_closed = true;
                    s.down.get_or_insert(OpError::Cancelled);
                    if s.phase == Phase::Down {
                        self.remove_socket(conn);
                    } else {
                        self.disconnect(conn);
                    }
                }
            }
            Phase::Connecting | Phase::Accepting => {
                if let Some(t) = s.ticket.take() {
                    t.complete(Err(OpError::Cancelled), 0, EventFlags::default());
                }
                s.down = Some(OpError::Cancelled);
                self.disconnect(sid);
            }
            Phase::Open => {
                s.down = Some(OpError::Cancelled);
                let conn = s.conn.as_mut().expect("open sockets have a connection");
                if s.peer_full_close {
                    conn.fail(OpError::Cancelled);
                    self.disconnect(sid);
                } else {
                    // Graceful, like TCP's close (issue 14): pending receives are cancelled, sends already posted
                    // complete and reach the peer before its end-of-stream, within the linger time.
                    conn.close_gracefully();
                    s.phase = Phase::Closing;
                    let at = self.clock.now() + self.linger;
                    self.timers.set_earliest(sid, TimerKind::Linger, at);
                    self.flush(sid);
                }
            }
            Phase::Closing | Phase::Disconnecting => {}
        }
        Ok(())
    }

    /// Whether a closed connection is still closing gracefully (its sends and CLOSE on their way, within the
    /// linger time).
    pub(crate) fn lingering(&self) -> bool {
        self.sockets.values().any(|s| s.phase == Phase::Closing)
    }

    /// How long a closing connection lingers at most ([`crate::ContextOptions::linger`]).
    pub(crate) fn linger(&self) -> Duration {
        self.linger
    }

    /// Closes every socket (context teardown).
    pub(crate) fn shutdown(&mut self) {
        let ids: Vec<SocketId> = self.sockets.keys().copied().collect();
        for sid in ids {
            if self.sockets.get(&sid).is_some_and(|s| !s.user_closed) {
                let _ = self.close(sid);
            }
        }
        self.flush_dirty();
        self.disconnect_every_endpoint();
        self.drain_done();
    }

    /// Disconnects every connection's endpoint and acts on it at once (the context's shutdown, or its failure:
    /// no later round will).
    pub(super) fn disconnect_every_endpoint(&mut self) {
        let eps: Vec<EndpointId> = self.eps.keys().copied().collect();
        for ep in eps {
            self.transport.disconnect(ep);
            self.on_disconnected(ep);
        }
    }
}

#[cfg(all(test, feature = "sim"))]
mod tests;

//! The engine of one context: sockets, connection management, and execution of protocol output.
//!
//! The engine is the only place that calls the [`Transport`]: it registers and exposes memory, posts the work
//! requests connections produce, feeds completions and connection-management events back to them, and runs
//! timers. All of it runs under the context's lock, from API calls and from the progress thread.

mod calls;
mod cm;
mod completions;
mod ops;
mod peer_log;
mod rounds;
mod stats;
mod timers;

pub(crate) use calls::Buffer;
pub use stats::{ConnStats, EngineStats};

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use exs_dma::{DmaBuf, LeaseKind};
use rustc_hash::{FxHashMap, FxHashSet};

use crate::config::{countable, Clock, ContextOptions, LazyNow};
use crate::error::{
    AcceptError, CloseError, ConnectError, OpError, OptionError, RecvError, SendError, SocketError,
    StateError, Violation,
};
use crate::event::{EventFlags, EventKind, Owner, Ticket};
use crate::exposure::{ExposeError, ExposurePolicy, TrustedKeys};
use crate::ids::{Readiness, SocketId};
use crate::options::{MsgFlags, Opt, SockType, SocketOptions};
use crate::proto::conn::layout::{ctrl_slot_size, Layout, TX_SLOT};
use crate::proto::conn::{
    Conn, Fault, Incoming, Limits, RecvMemory, RecvPlan, RecvRefused, SendPlan, Timing,
};
use crate::proto::link::{wr_kind, Link, Slots, WrKind, PACK_SLOTS};
use crate::proto::message::SendData;
use crate::proto::op::{Done, OpToken, Outbox};
use crate::proto::pool::RecvPool;
use crate::transport::{
    Capabilities, CmEvent, Completion, ConnectFailure, EndpointId, ListenerId, Registration,
    RemoteAccess, RequestId, Transport, TransportError, WorkRequest,
};
use crate::wire::{CloseReason, Handshake};

/// Whether the context uses the shared receive pool.
#[derive(Debug)]
enum PoolState {
    /// Decided at the first connection.
    Undecided,
    Off,
    On(RecvPool),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Fresh,
    Listening,
    /// Active side, waiting for the connection.
    Connecting,
    /// Passive side: accepted, waiting for the connection.
    Accepting,
    Open,
    /// Local close or violation: CLOSE queued, disconnect once it left (or the linger timer fires).
    Closing,
    /// `disconnect` called, waiting for the transport's `Disconnected`.
    Disconnecting,
    /// Gone.
    Down,
}

/// A listening socket: like TCP's, it sets incoming connections up on its own, and an `accept` takes one only once
/// it is established. A connection that fails or goes silent on the way never reaches the application.
#[derive(Debug)]
struct Listening {
    listener: ListenerId,
    /// The application's accepts waiting for a connection.
    accepts: VecDeque<Ticket>,
    /// Connections being set up (accepted at the transport, not yet established): the listener's own.
    pending: FxHashSet<SocketId>,
    /// Established connections waiting for an accept.
    ready: VecDeque<SocketId>,
}

#[derive(Debug)]
struct Sock {
    ty: SockType,
    opts: SocketOptions,
    bound: Option<SocketAddr>,
    phase: Phase,
    conn: Option<Conn>,
    /// The connect or accept operation, until the connection is up.
    ticket: Option<Ticket>,
    listening: Option<Listening>,
    /// Passive side: the peer's handshake from its request.
    peer_hs: Option<Handshake>,
    peer_addr: Option<SocketAddr>,
    /// This side's address of the connection, recorded when it came up: still the socket's address once the
    /// transport's endpoint is gone (as TCP's `getsockname` after the connection ended).
    local_addr: Option<SocketAddr>,
    /// Completions that arrived before the connection-management event that establishes the connection.
    early: Vec<Completion>,
    /// Why the connection is down, reported to later operations.
    down: Option<OpError>,
    /// The peer sent CLOSE (or shut its sending side down): receives see end-of-stream.
    peer_closed: bool,
    /// The peer closed the whole connection (not only its sending side).
    peer_full_close: bool,
    /// Closing after a violation: disconnect as soon as the CLOSE has left (not waiting for the peer).
    drop_after_close: bool,
    /// We shut our sending side down.
    shut_write: bool,
    /// Pending polls and what each waits for.
    polls: Vec<(Ticket, Readiness)>,
    /// The application closed the socket (or never had it: a connection its listener is still setting up); the
    /// entry goes away once the connection is gone.
    user_closed: bool,
    /// The listener this incoming connection belongs to until an `accept` hands it to the application.
    listener: Option<SocketId>,
    /// Bytes of the sends and receives that completed successfully (`ConnStats`).
    bytes_sent: u64,
    bytes_received: u64,
    /// From the connect (or the request's arrival) to the connection being up.
    handshake: Option<Duration>,
    /// When the handshake began (the connect, or the request's arrival), until the connection is up.
    handshake_began: Option<Instant>,
    /// The connection's tracing span (id, peer, backend), entered around its protocol work; disabled until the
    /// connection is up, and whenever nothing subscribes at debug level.
    span: tracing::Span,
    /// In the engine's list of sockets to flush.
    dirty: bool,
    /// What the connection's timers are set to.
    armed: timers::Armed,
}

impl Sock {
    fn new(ty: SockType, opts: SocketOptions) -> Self {
        Sock {
            ty,
            opts,
            bound: None,
            phase: Phase::Fresh,
            conn: None,
            ticket: None,
            listening: None,
            peer_hs: None,
            peer_addr: None,
            local_addr: None,
            early: Vec::new(),
            down: None,
            peer_closed: false,
            peer_full_close: false,
            drop_after_close: false,
            shut_write: false,
            polls: Vec::new(),
            user_closed: false,
            listener: None,
            bytes_sent: 0,
            bytes_received: 0,
            dirty: false,
            armed: timers::Armed::default(),
            handshake: None,
            handshake_began: None,
            span: tracing::Span::none(),
        }
    }

    /// The connection's endpoint, while the transport has it (a stream's connection kept after a disconnect
    /// names a released one).
    fn ep(&self) -> Option<EndpointId> {
        match self.phase {
            Phase::Down => None,
            _ => self.conn.as_ref().map(|c| c.ep),
        }
    }
}

pub(crate) struct Engine {
    transport: Box<dyn Transport>,
    caps: Capabilities,
    ctx_id: u64,
    /// The context, as the owner of the connections this engine accepts (they reach the application through
    /// their accept events).
    owner: Weak<dyn Owner>,
    clock: Arc<dyn Clock>,
    linger: Duration,
    connect_timeout: Duration,
    /// Connections (endpoints) this context holds at most; requests beyond are refused.
    max_connections: usize,
    ack_delay: Duration,
    keepalive: Option<Duration>,
    sockets: FxHashMap<SocketId, Sock>,
    eps: FxHashMap<EndpointId, SocketId>,
    listeners: FxHashMap<ListenerId, SocketId>,
    next_socket: u32,
    next_ep: u32,
    completions: Vec<Completion>,
    posts: Vec<WorkRequest>,
    /// Sockets with something to post, each once (`Sock::dirty` says which are in the list: a linear search made
    /// closing thousands of connections at once quadratic).
    dirty: Vec<SocketId>,
    timers: Timers,
    /// Rounds since the last look at connection events: rounds that handled completions (see `progress_round`)
    /// and busy-poll rounds (see `progress_busy_round`).
    cm_skipped: u32,
    /// The last arm said no connection event was waiting (`Transport::arm_covers_cm`): rounds that find no
    /// completions need not look until an arm fails (see `progress_round`).
    cm_quiet: bool,
    /// When a busy-poll round last looked at connection events.
    cm_busy_looked: Option<Instant>,
    stats: EngineStats,
    shared_recv: crate::config::SharedRecv,
    pool: PoolState,
    pool_posts: Vec<WorkRequest>,
    /// A growth of the shared pool failed: the next is not tried before then.
    pool_retry_at: Option<Instant>,
    /// Operations handed to the protocol, by identifier: their tickets, and reads not yet reported (a full
    /// queue folds read notifications into the next one).
    ops: ops::Ops,
    /// Why the context failed (a panic in a progress round), if it did.
    failed: Option<String>,
    /// Taking a failed context's reports panicked (`Engine::discard_reports`): they are left alone.
    discard_panicked: bool,
    /// Where the protocol reports completions (see [`crate::proto::op`]).
    outbox: Outbox,
    done: Vec<Done>,
    /// What the connections' device-visible memory is charged against.
    budget: crate::budget::Budget,
    /// How operations' memory is exposed, and the trusted policy's keys.
    exposure: ExposurePolicy,
    trusted: TrustedKeys,
    /// How much is logged about what peers do (see [`peer_log`]): refused requests and violations, and failed
    /// connections.
    peer_log: peer_log::PeerLog,
    fail_log: peer_log::PeerLog,
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("transport", &self.caps.name)
            .field("sockets", &self.sockets.len())
            .finish()
    }
}

type R<T, E> = Result<T, E>;

use rounds::COMPLETION_BATCH;
use timers::{TimerKind, Timers};

impl Engine {
    pub(crate) fn new(
        transport: Box<dyn Transport>,
        ctx_id: u64,
        owner: Weak<dyn Owner>,
        opts: &ContextOptions,
    ) -> Self {
        let caps = transport.capabilities().clone();
        Engine {
            transport,
            caps,
            ctx_id,
            owner,
            clock: Arc::clone(&opts.clock),
            // Settings too long to count mean never (`config::countable`): the timers add them to the time.
            linger: countable(opts.linger),
            connect_timeout: countable(opts.connect_timeout),
            max_connections: opts.max_connections,
            exposure: opts.exposure,
            budget: crate::budget::Budget::new(opts.memory_budget),
            trusted: TrustedKeys::default(),
            ack_delay: countable(opts.ack_delay),
            keepalive: opts.keepalive.map(countable),
            sockets: FxHashMap::default(),
            eps: FxHashMap::default(),
            listeners: FxHashMap::default(),
            next_socket: 1,
            next_ep: 1,
            completions: Vec::with_capacity(64),
            posts: Vec::with_capacity(64),
            dirty: Vec::new(),
            timers: Timers::default(),
            cm_skipped: 0,
            cm_quiet: false,
            cm_busy_looked: None,
            stats: EngineStats::default(),
            peer_log: peer_log::PeerLog::new(Instant::now()),
            fail_log: peer_log::PeerLog::new(Instant::now()),
            shared_recv: opts.shared_recv.clone(),
            pool: PoolState::Undecided,
            pool_posts: Vec::new(),
            pool_retry_at: None,
            ops: ops::Ops::default(),
            failed: None,
            discard_panicked: false,
            outbox: Outbox::default(),
            done: Vec::new(),
        }
    }

    pub(crate) fn capabilities(&self) -> &Capabilities {
        &self.caps
    }

    pub(crate) fn stats(&self) -> EngineStats {
        let mut s = self.stats;
        s.connection_bytes = self.budget.held();
        if let PoolState::On(p) = &self.pool {
            s.pool = Some(p.stats());
        }
        s.trusted_keys = self.trusted.len() as u64;
        s.timers = self.timers.len() as u64;
        s
    }

    pub(crate) fn now(&self) -> Instant {
        self.clock.now()
    }

    /// How long a sleeper may wait on the transport before it polls again (see `Transport::poll_interval`).
    pub(crate) fn poll_interval(&self) -> Option<std::time::Duration> {
        self.transport.poll_interval()
    }

    pub(crate) fn arm(&mut self) -> Result<bool, TransportError> {
        self.stats.arms += 1;
        let armed = self.transport.arm();
        self.cm_quiet = matches!(armed, Ok(true)) && self.transport.arm_covers_cm();
        armed
    }

    /// Registers memory (counted: a registration pins memory on hardware; the data path makes none).
    pub(crate) fn register(
        &mut self,
        buf: &Arc<DmaBuf>,
    ) -> Result<Arc<dyn Registration>, TransportError> {
        self.stats.registrations += 1;
        self.transport.register(buf)
    }

    /// Allocates, registers and exposes the stream buffer of a connection whose peer asked for it, and queues
    /// its STREAM_RING. Seed 001: the peer may write any part of it at any time, so the lease is of the kind for
    /// ranges the device writes concurrently.
    fn provide_ring(
        &mut self,
        sid: SocketId,
        ep: EndpointId,
        len: usize,
    ) -> Result<(), TransportError> {
        // A connection no application has accepted yet gets none: nobody could read what its peer wrote into it,
        // and the peers of a listener's whole backlog could each have one (a review found a tools server's
        // backlog holding 128 buffers of 64 MiB). It is given once the connection is handed over (`hand_over`
        // flushes it, and the flush asks again).
        if self.sockets.get(&sid).is_some_and(|s| s.listener.is_some()) {
            return Ok(());
        }
        let reading = self
            .sockets
            .get_mut(&sid)
            .and_then(|s| s.conn.as_mut())
            .and_then(|c| c.stream())
            .is_some_and(|st| st.is_reading());
        // Under pressure (half the budget held), a connection whose application does not read yet waits: its
        // peer's data would only sit in the buffer (it is asked again at every flush, and given once it reads).
        if !reading && self.budget.held() + len as u64 > self.budget.limit() / 2 {
            return Ok(());
        }
        let Some(charge) = self.budget.charge(len as u64) else {
            // Issue 27: the peer's wish does not outgrow the context: the connection goes on with direct transfers
            // into advertised receives, and asks the budget again at its next receive.
            tracing::debug!(
                ?sid,
                len,
                held = self.budget.held(),
                limit = self.budget.limit(),
                "memory budget: no stream buffer"
            );
            self.stats.rings_refused += 1;
            if let Some(st) = self
                .sockets
                .get_mut(&sid)
                .and_then(|s| s.conn.as_mut())
                .and_then(|c| c.stream())
            {
                st.ring_refused();
            }
            return Ok(());
        };
        // Only the peer's device writes it, while we copy out: word-sized copies (`try_new_device_written`).
        let buf = DmaBuf::try_new_device_written(len).ok_or_else(|| {
            TransportError::Invalid(format!("cannot allocate a stream buffer of {len} bytes"))
        })?;
        let reg = self.register(&buf)?;
        let lease = buf
            .lease(0..buf.len(), LeaseKind::DeviceWriteShared)
            .map_err(|e| TransportError::Invalid(e.to_string()))?;
        let exposure = self.expose(ep, &reg, lease, RemoteAccess::Write)?;
        if let Some(conn) = self.sockets.get_mut(&sid).and_then(|s| s.conn.as_mut()) {
            let link = &mut conn.link;
            if let Some(crate::proto::conn::Mode::Stream(st)) = conn.mode.as_mut() {
                st.set_local_ring(exposure, buf, reg, charge, link);
            }
        }
        Ok(())
    }

    /// Exposes a leased range to the peer of `ep` alone (counted).
    fn expose(
        &mut self,
        ep: EndpointId,
        reg: &Arc<dyn Registration>,
        lease: exs_dma::Lease,
        access: RemoteAccess,
    ) -> Result<Box<dyn crate::transport::Exposure>, TransportError> {
        let exposure = self.transport.expose(ep, reg, lease, access)?;
        self.stats.exposures += 1;
        Ok(exposure)
    }

    /// Keys the stream receives the protocol is about to advertise (seed 001: a receive is exposed only when
    /// advertised; see [`crate::proto::stream::StreamRecvMemory`]), each as the exposure policy says.
    fn provide_recv_keys(&mut self, sid: SocketId) {
        loop {
            let Some(conn) = self.sockets.get_mut(&sid).and_then(|s| s.conn.as_mut()) else {
                return;
            };
            let ep = conn.ep;
            let Some(sge) = conn.take_recv_to_key() else {
                return;
            };
            let (lease, reg) = sge.into_parts();
            let keyed = self
                .expose_op(ep, &reg, lease, RemoteAccess::Write)
                .map_err(|e| {
                    // The device made no key (out of registrations or memory windows): the receive fails with
                    // the transport's error, as its post did when receives were exposed as they were posted.
                    self.stats.keys_refused += 1;
                    let e = e.into_op_error();
                    tracing::debug!(?sid, %e, "no key for a stream receive");
                    e
                });
            if let Some(conn) = self.sockets.get_mut(&sid).and_then(|s| s.conn.as_mut()) {
                conn.give_recv_key(keyed);
            }
        }
    }

    /// Exposes an operation's range (a send the peer reads, a receive it writes) as the context's policy says:
    /// a key of its own, or the trusted policy's key for the whole region on this connection.
    fn expose_op(
        &mut self,
        ep: EndpointId,
        reg: &Arc<dyn Registration>,
        lease: exs_dma::Lease,
        access: RemoteAccess,
    ) -> Result<Box<dyn crate::transport::Exposure>, ExposeError> {
        match self.exposure {
            ExposurePolicy::TrustedPeers => {
                let (exposure, made) =
                    self.trusted
                        .expose(self.transport.as_mut(), ep, reg, lease, access)?;
                if made {
                    self.stats.exposures += 1;
                }
                Ok(exposure)
            }
            _ => Ok(self.expose(ep, reg, lease, access)?),
        }
    }

    /// Frees an endpoint after its connection went down, then revokes the trusted policy's keys on it. After, as
    /// for the connection's other keys: the release stops the provider's accesses first, and a backend whose
    /// endpoint could not be closed knows it when the keys go (it keeps their ranges then).
    fn release_endpoint(&mut self, ep: EndpointId) {
        self.transport.release(ep);
        self.trusted.forget_endpoint(ep);
        if let PoolState::On(p) = &mut self.pool {
            p.release_promise(ep);
        }
    }

    /// Trusted-policy keys naming `buf` (a region being deregistered counts them among its leases).
    pub(crate) fn trusted_keys(&self, buf: &Arc<DmaBuf>) -> usize {
        self.trusted.count(buf)
    }

    /// Revokes the trusted-policy keys naming `buf` (its region is deregistered; no operation uses it).
    pub(crate) fn forget_trusted(&mut self, buf: &Arc<DmaBuf>) {
        self.trusted.forget_buffer(buf);
    }

    /// Whether a send or shutdown has started and not completed: the protocol still has something to move out
    /// (bytes queued behind the peer's advertisements or window), which needs rounds whoever runs them.
    pub(crate) fn outgoing(&self) -> bool {
        self.ops.any_outgoing()
    }

    /// The earliest timer, perhaps a connection's that will find nothing to do (see [`timers`]). What a sleep
    /// waits for comes from [`Engine::sleep_deadline`].
    pub(crate) fn next_deadline(&self) -> Option<Instant> {
        self.timers.next()
    }

    /// The earliest deadline set since the last call, as a point in real time: what a call that set it must wake a
    /// sleeping thread for, if it comes before the thread's wake-up time.
    pub(crate) fn take_armed_real(&mut self) -> Option<Instant> {
        let d = self.timers.take_armed()?;
        Some(self.real(d))
    }

    /// Forgets the deadlines set so far ([`Engine::take_armed_real`] reports those set after).
    pub(crate) fn clear_armed(&mut self) {
        self.timers.take_armed();
    }

    /// Whether a deadline was set since [`Engine::clear_armed`].
    pub(crate) fn armed(&self) -> bool {
        self.timers.armed()
    }

    /// The earliest timer that has something to do, as a point in real time: what a thread about to sleep waits
    /// for.
    pub(crate) fn sleep_deadline(&mut self) -> Option<Instant> {
        if self.failed.is_some() {
            // No timer runs on a failed context (review finding: a keepalive left due made every sleep a
            // zero-length one, and its leaders spin).
            return None;
        }
        self.settle_timers();
        self.next_deadline_real()
    }

    /// Puts right the connection timers at the front that were left earlier than their connection's deadline
    /// (cleared or moved later since: [`Timers::arm`]), until the earliest is one that has something to do.
    pub(crate) fn settle_timers(&mut self) {
        while let Some((at, sid, TimerKind::Proto)) = self.timers.first() {
            let Some(sock) = self.sockets.get_mut(&sid) else {
                self.timers.set(sid, TimerKind::Proto, None);
                continue;
            };
            let near = sock.conn.as_ref().and_then(|c| c.poll_timeout().near);
            if near == Some(at) {
                break;
            }
            self.timers.set_near(sid, &mut sock.armed, near);
        }
    }

    /// The earliest timer as a point in real time (the engine's clock may be virtual).
    pub(crate) fn next_deadline_real(&self) -> Option<Instant> {
        let d = self.next_deadline()?;
        Some(self.real(d))
    }

    /// `d` on the engine's clock (which may be virtual) as a point in real time.
    fn real(&self, d: Instant) -> Instant {
        let now = Instant::now();
        if self.clock.is_real_time() {
            // The same as below, with one reading where two were the same clock's.
            return d.max(now);
        }
        now + d.saturating_duration_since(self.now())
    }

    fn limits(&self) -> Limits {
        Limits {
            max_send_wr: self.caps.max_send_wr,
            max_message: self.caps.max_message,
            max_sge: self.caps.max_sge,
        }
    }

    /// Hands an operation's ticket to the protocol as a token (the engine keeps the ticket).
    fn token(&mut self, ticket: &mut Option<Ticket>) -> OpToken {
        let id = self.ops.insert((ticket.take().expect("ticket given"), 0));
        OpToken::new(id, self.outbox.clone())
    }

    /// Takes back the ticket of a token the protocol refused synchronously.
    fn untoken(&mut self, token: OpToken) -> Ticket {
        let id = token.into_id();
        self.ops.remove(id).expect("a token's ticket is kept").0
    }

    /// Turns what the protocol reported into events (after every call and every round of progress).
    pub(crate) fn drain_done(&mut self) {
        self.outbox.take(&mut self.done);
        if self.done.is_empty() {
            // Most busy-poll rounds: nothing finished.
            return;
        }
        for d in self.done.drain(..) {
            match d {
                Done::Complete {
                    id,
                    status,
                    bytes,
                    flags,
                } => {
                    if let Some((t, _)) = self.ops.remove(id) {
                        if status.is_ok() {
                            count_bytes(&mut self.sockets, &t, bytes);
                        }
                        t.complete(status, bytes, flags);
                    }
                }
                Done::Notify { id, reads } => {
                    if let Some((t, unreported)) = self.ops.get_mut(id) {
                        *unreported += reads;
                        if t.notify(crate::event::EventKind::ReadNotify, *unreported) {
                            *unreported = 0;
                        }
                    }
                }
            }
        }
    }

    fn on_timer(&mut self, sid: SocketId, kind: TimerKind, now: Instant) {
        match kind {
            TimerKind::Linger => {
                if let Some(s) = self
                    .sockets
                    .get_mut(&sid)
                    .filter(|s| s.phase == Phase::Closing)
                {
                    tracing::debug!(?sid, "linger expired, disconnecting");
                    // Sends still going are ended: `Aborted` where part may have reached the peer.
                    if let Some(conn) = s.conn.as_mut() {
                        conn.fail(OpError::Cancelled);
                    }
                    self.disconnect(sid);
                }
            }
            TimerKind::ConnectTimeout => {
                let connecting = self
                    .sockets
                    .get(&sid)
                    .is_some_and(|s| matches!(s.phase, Phase::Connecting | Phase::Accepting));
                if connecting {
                    self.fail_connect(sid, OpError::TimedOut);
                }
            }
            TimerKind::Proto | TimerKind::Keepalive => {
                let Some(sock) = self.sockets.get_mut(&sid) else {
                    return;
                };
                Timers::fired(&mut sock.armed, kind);
                if let Some(conn) = sock.conn.as_mut() {
                    match conn.handle_timeout(now) {
                        // The flush posts what it queued and sets the connection's next deadline.
                        Ok(_) => self.mark(sid),
                        Err(fault) => self.fault(sid, fault),
                    }
                }
            }
        }
    }

    /// Forgets a socket that is gone, with its timers. An incoming connection that goes before it was established
    /// leaves its listener, counted: nobody else ever hears of it.
    fn remove_socket(&mut self, sid: SocketId) {
        if let Some(lsid) = self.sockets.remove(&sid).and_then(|s| s.listener) {
            let l = self
                .sockets
                .get_mut(&lsid)
                .and_then(|l| l.listening.as_mut());
            if l.is_some_and(|l| l.pending.remove(&sid)) {
                self.stats.dropped_before_accept += 1;
            }
        }
        self.timers.forget(sid);
    }

    /// The protocol timings every connection of this context gets.
    fn timing(&self) -> Timing {
        Timing {
            ack_delay: self.ack_delay,
            keepalive: self.keepalive,
        }
    }

    /// Flushes the sockets marked since the last flush, all at one reading of the clock (if any needs it).
    fn flush_dirty(&mut self) {
        if !self.dirty.is_empty() {
            self.flush_dirty_at(None);
        }
    }

    /// `now`: the round's reading of the clock, if it made one (else the first flush that needs the time reads it).
    fn flush_dirty_at(&mut self, mut now: Option<Instant>) {
        while let Some(sid) = self.dirty.pop() {
            if let Some(s) = self.sockets.get_mut(&sid) {
                s.dirty = false;
            }
            now = self.flush_at(sid, now);
            self.check_polls(sid);
        }
    }

    fn mark(&mut self, sid: SocketId) {
        if let Some(s) = self.sockets.get_mut(&sid).filter(|s| !s.dirty) {
            s.dirty = true;
            self.dirty.push(sid);
        }
    }

    /// The span of `sid`'s connection, to enter around its protocol work (a reference count, no allocation).
    pub(super) fn conn_span(&self, sid: SocketId) -> tracing::Span {
        self.sockets
            .get(&sid)
            .map_or_else(tracing::Span::none, |s| s.span.clone())
    }

    /// Posts what a connection has ready, and moves a closing connection on once its CLOSE has left.
    fn flush(&mut self, sid: SocketId) {
        self.flush_at(sid, None);
    }

    /// [`Engine::flush`] at `now` (read from the clock only if the protocol asks for the time, when it starts a
    /// timer). Returns the time if it was read, for the next flush of the same round.
    fn flush_at(&mut self, sid: SocketId, now: Option<Instant>) -> Option<Instant> {
        let _span = self.conn_span(sid).entered();
        // A connection kept after a disconnect (a stream's bytes still to be read) has no endpoint to post to.
        let Some(mut conn) = self
            .sockets
            .get_mut(&sid)
            .filter(|s| s.phase != Phase::Down)
            .and_then(|s| s.conn.as_mut())
        else {
            return now;
        };
        // The keys first: the advertisements they let go out must not be overtaken by the STREAM_RING that gives
        // the sender space in the stream buffer (issue 14's order).
        if conn.recv_key_wanted() {
            self.provide_recv_keys(sid);
            let Some(c) = self.sockets.get_mut(&sid).and_then(|s| s.conn.as_mut()) else {
                return now;
            };
            conn = c;
        }
        if let Some(len) = conn.stream().and_then(|st| st.ring_needed()) {
            let ep = conn.ep;
            if let Err(e) = self.provide_ring(sid, ep, len) {
                self.fault(
                    sid,
                    Fault::Transport(crate::transport::WcError::Other(e.to_string())),
                );
                return now;
            }
        }
        let Some(sock) = self.sockets.get_mut(&sid) else {
            return now;
        };
        let Some(conn) = sock.conn.as_mut() else {
            return now;
        };
        let mut posts = std::mem::take(&mut self.posts);
        let mut lazy = LazyNow::new(now, &*self.clock);
        let flushed = conn.flush(&mut posts, &mut lazy);
        let now = lazy.at();
        let deadline = conn.poll_timeout();
        let ep = conn.ep;
        // After a violation, the connection goes as soon as our CLOSE has left. After a graceful close it does
        // not: the peer takes the CLOSE after everything before it and answers by disconnecting, which ends it
        // (`on_disconnected`); disconnecting ourselves could overtake the data and the CLOSE still on their way on
        // some transports (libfabric tcp reset the peer's last receives). A peer that never answers is cut off
        // when the linger time runs out.
        let closing_done = sock.phase == Phase::Closing
            && sock.drop_after_close
            && conn.close_sent()
            && conn.sends_drained();
        if flushed.is_ok() {
            self.timers
                .arm(sid, &mut sock.armed, deadline.near, deadline.keepalive);
        }

        self.post_all(sid, ep, &mut posts);
        self.posts = posts;
        if let Err(v) = flushed {
            self.fault(sid, Fault::Peer(v));
            return now;
        }
        if closing_done {
            self.disconnect(sid);
        }
        now
    }

    fn post_all(&mut self, sid: SocketId, ep: EndpointId, posts: &mut Vec<WorkRequest>) {
        if posts.is_empty() {
            return;
        }
        self.stats.posted += posts.len() as u64;
        // Requests not posted after an error are dropped: they never reached the hardware, so their leases go back.
        if let Err(e) = self.transport.post_many(ep, posts) {
            tracing::warn!(?sid, %e, "post failed; connection goes down");
            self.fault(
                sid,
                Fault::Transport(crate::transport::WcError::Other(e.to_string())),
            );
        }
    }

    /// The pool slot a completion returns, if it is a shared receive.
    fn pool_slot(c: &Completion) -> Option<u32> {
        match wr_kind(c.wr_id) {
            Some(WrKind::Pool(slot)) => Some(slot),
            _ => None,
        }
    }
}

/// What operations and calls of a failed context report.
fn failed_error(why: &str) -> OpError {
    OpError::ContextFailed(why.to_owned())
}

fn link_rx_bytes(link: &Link) -> u64 {
    link.own_rx_bytes() as u64
}

/// Takes a connection's control buffers out of the count `build_conn` added them to.
fn uncount_rx_bytes(stats: &mut EngineStats, conn: &Conn) {
    stats.ctrl_recv_bytes = stats
        .ctrl_recv_bytes
        .saturating_sub(link_rx_bytes(&conn.link));
}

impl Engine {
    /// Drops a connection that never went into service (a connect or accept that failed): its control buffers
    /// leave the count (review finding: only a disconnection took them out, and the count grew with every failed
    /// connect).
    pub(super) fn forget_conn(&mut self, conn: Conn) {
        uncount_rx_bytes(&mut self.stats, &conn);
    }
}

/// Adds a completed data operation's bytes to its socket's counters.
fn count_bytes(sockets: &mut FxHashMap<SocketId, Sock>, t: &Ticket, bytes: usize) {
    let (sid, kind) = t.counted();
    if let Some(s) = sockets.get_mut(&sid) {
        match kind {
            EventKind::Send | EventKind::SendFile => s.bytes_sent += bytes as u64,
            EventKind::Recv => s.bytes_received += bytes as u64,
            _ => {}
        }
    }
}

//! The engine of one context: sockets, connection management, and execution of protocol output.
//!
//! The engine is the only place that calls the [`Transport`]: it registers and exposes memory, posts the work
//! requests connections produce, feeds completions and connection-management events back to them, and runs
//! timers. All of it runs under the context's lock, from API calls and from the progress thread.

use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use exs_dma::{DmaBuf, LeaseKind};

use crate::context::{Clock, Context, ContextOptions, CtxInner};
use crate::error::{
    AcceptError, BufferError, CloseError, ConnectError, OpError, OptionError, RecvError, SendError,
    SocketError, StateError, Violation,
};
use crate::event::{EventFlags, Ticket};
use crate::exposure::{ExposurePolicy, TrustedKeys};
use crate::memory::Slice;
use crate::options::{MsgFlags, SockType, SocketOption, SocketOptions};
use crate::proto::conn::{Conn, Fault, Incoming, Limits};
use crate::proto::link::{wr_kind, Link, Slots, WrKind};
use crate::proto::message::{RecvReq, SendData, SendReq, RECV_LEASE};
use crate::proto::op::{Done, OpToken, Outbox};
use crate::proto::pool::{PoolStats, RecvPool};
use crate::proto::stream::StreamSetup;
use crate::socket::{Readiness, SocketId};
use crate::transport::{
    Capabilities, CmEvent, Completion, ConnectFailure, EndpointId, ListenerId, Registration,
    RemoteAccess, RequestId, Transport, TransportError, WorkRequest,
};
use crate::wire::{CloseReason, Handshake, WireSockType, HEADER_LEN};

/// Bytes of a control send slot: a header and the largest body (immediate data goes as a second entry).
const TX_SLOT: usize = 64;

/// Counters of one context.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EngineStats {
    /// Completions handled.
    pub completions: u64,
    /// Connection-management events handled.
    pub cm_events: u64,
    /// Work requests posted.
    pub posted: u64,
    /// Connections brought down because the peer broke the protocol.
    pub violations: u64,
    /// Connections established.
    pub connections: u64,
    /// Bytes of control receive buffers currently registered for connections (their own, not the pool's).
    pub ctrl_recv_bytes: u64,
    /// The shared receive pool (seed 003), when the context uses one.
    pub pool: Option<PoolStats>,
    /// Memory registrations the context made (memory regions, control and stream buffers, pool chunks).
    pub registrations: u64,
    /// Remote keys handed out (each bound to one connection): one per operation, or under the trusted policy one
    /// per region, connection and access.
    pub exposures: u64,
    /// Whole-region keys of the trusted policy valid now ([`crate::ExposurePolicy::TrustedPeers`]).
    pub trusted_keys: u64,
    /// Connection requests refused because the context held `ContextOptions::max_connections` already.
    pub refused_over_limit: u64,
    /// Connection requests that waited in a backlog longer than the connect timeout and were refused.
    pub expired_requests: u64,
    /// Device-visible memory the connections hold now: control send and receive slots and stream buffers
    /// (these only once the peer first needed one). The shared pool is counted in `pool`.
    pub connection_bytes: u64,
}

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

#[derive(Debug)]
struct Listening {
    listener: ListenerId,
    accepts: VecDeque<Ticket>,
    /// Requests waiting for an accept, with when they came (they expire after the connect timeout).
    backlog: VecDeque<(RequestId, SocketAddr, Handshake, Instant)>,
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
    /// The application closed the socket; the entry goes away once the connection is gone.
    user_closed: bool,
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
            early: Vec::new(),
            down: None,
            peer_closed: false,
            peer_full_close: false,
            drop_after_close: false,
            shut_write: false,
            polls: Vec::new(),
            user_closed: false,
        }
    }

    fn ep(&self) -> Option<EndpointId> {
        self.conn.as_ref().map(|c| c.ep)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum TimerKind {
    Linger,
    ConnectTimeout,
    /// A listener's oldest waiting requests expire.
    Backlog,
    Ack,
    Keepalive,
}

pub(crate) struct Engine {
    transport: Box<dyn Transport>,
    caps: Capabilities,
    ctx_id: u64,
    ctx: Weak<CtxInner>,
    clock: Arc<dyn Clock>,
    linger: Duration,
    connect_timeout: Duration,
    /// Connections (endpoints) this context holds at most; requests beyond are refused.
    max_connections: usize,
    ack_delay: Duration,
    keepalive: Option<Duration>,
    sockets: HashMap<SocketId, Sock>,
    eps: HashMap<EndpointId, SocketId>,
    listeners: HashMap<ListenerId, SocketId>,
    next_socket: u32,
    next_ep: u32,
    completions: Vec<Completion>,
    posts: Vec<WorkRequest>,
    dirty: Vec<SocketId>,
    timers: Vec<(Instant, SocketId, TimerKind)>,
    stats: EngineStats,
    shared_recv: crate::context::SharedRecv,
    pool: PoolState,
    pool_posts: Vec<WorkRequest>,
    /// Operations handed to the protocol, by identifier: their tickets, and reads not yet reported (a full
    /// queue folds read notifications into the next one).
    ops: HashMap<u64, (Ticket, usize)>,
    next_op: u64,
    /// Why the context failed (a panic in a progress round), if it did.
    failed: Option<String>,
    /// Where the protocol reports completions (see [`crate::proto::op`]).
    outbox: Outbox,
    done: Vec<Done>,
    /// How operations' memory is exposed, and the trusted policy's keys.
    exposure: ExposurePolicy,
    trusted: TrustedKeys,
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

impl Engine {
    pub(crate) fn new(
        transport: Box<dyn Transport>,
        ctx_id: u64,
        ctx: Weak<CtxInner>,
        opts: &ContextOptions,
    ) -> Self {
        let caps = transport.capabilities().clone();
        Engine {
            transport,
            caps,
            ctx_id,
            ctx,
            clock: Arc::clone(&opts.clock),
            linger: opts.linger,
            connect_timeout: opts.connect_timeout,
            max_connections: opts.max_connections,
            exposure: opts.exposure,
            trusted: TrustedKeys::default(),
            ack_delay: opts.ack_delay,
            keepalive: opts.keepalive,
            sockets: HashMap::new(),
            eps: HashMap::new(),
            listeners: HashMap::new(),
            next_socket: 1,
            next_ep: 1,
            completions: Vec::with_capacity(64),
            posts: Vec::with_capacity(64),
            dirty: Vec::new(),
            timers: Vec::new(),
            stats: EngineStats::default(),
            shared_recv: opts.shared_recv.clone(),
            pool: PoolState::Undecided,
            pool_posts: Vec::new(),
            ops: HashMap::new(),
            next_op: 1,
            failed: None,
            outbox: Outbox::default(),
            done: Vec::new(),
        }
    }

    pub(crate) fn capabilities(&self) -> &Capabilities {
        &self.caps
    }

    pub(crate) fn stats(&self) -> EngineStats {
        let mut s = self.stats;
        s.connection_bytes = self
            .sockets
            .values()
            .filter_map(|s| s.conn.as_ref())
            .map(|c| c.memory_bytes())
            .sum();
        if let PoolState::On(p) = &self.pool {
            s.pool = Some(p.stats());
        }
        s.trusted_keys = self.trusted.len() as u64;
        s
    }

    pub(crate) fn now(&self) -> Instant {
        self.clock.now()
    }

    pub(crate) fn arm(&mut self) -> Result<bool, TransportError> {
        self.transport.arm()
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
    fn provide_ring(&mut self, sid: SocketId, ep: EndpointId, len: usize) -> Result<(), TransportError> {
        let buf = DmaBuf::try_new(len).ok_or_else(|| {
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
                st.set_local_ring(exposure, buf, reg, link);
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
        self.stats.exposures += 1;
        self.transport.expose(ep, reg, lease, access)
    }

    /// Exposes an operation's range (a send the peer reads, a receive it writes) as the context's policy says:
    /// a key of its own, or the trusted policy's key for the whole region on this connection.
    fn expose_op(
        &mut self,
        ep: EndpointId,
        reg: &Arc<dyn Registration>,
        lease: exs_dma::Lease,
        access: RemoteAccess,
    ) -> Result<Box<dyn crate::transport::Exposure>, TransportError> {
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
            _ => self.expose(ep, reg, lease, access),
        }
    }

    /// Frees an endpoint after its connection went down, revoking the trusted policy's keys on it first.
    fn release_endpoint(&mut self, ep: EndpointId) {
        self.trusted.forget_endpoint(ep);
        self.transport.release(ep);
    }

    /// Trusted-policy keys naming `buf` (a region being deregistered counts them among its leases).
    pub(crate) fn trusted_keys(&self, buf: &Arc<DmaBuf>) -> usize {
        self.trusted.count(buf)
    }

    /// Revokes the trusted-policy keys naming `buf` (its region is deregistered; no operation uses it).
    pub(crate) fn forget_trusted(&mut self, buf: &Arc<DmaBuf>) {
        self.trusted.forget_buffer(buf);
    }

    pub(crate) fn next_deadline(&self) -> Option<Instant> {
        self.timers.iter().map(|t| t.0).min()
    }

    /// The earliest timer as a point in real time (the engine's clock may be virtual).
    pub(crate) fn next_deadline_real(&self) -> Option<Instant> {
        let d = self.next_deadline()?;
        Some(Instant::now() + d.saturating_duration_since(self.now()))
    }

    fn limits(&self) -> Limits {
        Limits {
            max_send_wr: self.caps.max_send_wr,
            max_message: self.caps.max_message,
            max_sge: self.caps.max_sge,
        }
    }

    // ---------------------------------------------------------------------------------------------------------
    // Progress

    /// Handles every pending event once. Returns whether anything happened.
    ///
    /// Completions go first. Connection-management events arrive on another channel, so a completion can be
    /// seen before the `Established` that brings its connection up (it waits in `early`), and a `Disconnected`
    /// can be seen while messages that arrived before it (a CLOSE) still sit in the completion queue: the queue
    /// is drained once more before a disconnect is acted on.
    /// One round of progress. A panic in it is a bug (no peer input may cause one: issue 15): the context then
    /// fails as a whole (see [`Engine::fail_context`]) rather than stopping silently with its operations pending.
    pub(crate) fn progress(&mut self) -> bool {
        self.guarded("a progress round", Engine::progress_round)
    }

    /// One round for a busy poller (completions and timers; connection events are the progress thread's).
    pub(crate) fn progress_busy(&mut self) -> bool {
        self.guarded("a busy-poll round", Engine::progress_busy_round)
    }

    fn guarded(&mut self, what: &str, round: fn(&mut Engine) -> bool) -> bool {
        if self.failed.is_some() {
            return false;
        }
        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| round(self))) {
            Ok(did) => did,
            Err(panic) => {
                let msg = panic
                    .downcast_ref::<&str>()
                    .map(|s| s.to_string())
                    .or_else(|| panic.downcast_ref::<String>().cloned())
                    .unwrap_or_else(|| "a panic".into());
                self.fail_context(format!("{what} panicked: {msg}"));
                true
            }
        }
    }

    /// After a panic nothing in the engine can be trusted: every pending operation fails with a transport error,
    /// every connection and listener is released, and every later call on a socket of this context fails
    /// (`StateError::ConnectionDown`). Best effort: a second panic here leaves the rest to the context's drop.
    fn fail_context(&mut self, why: String) {
        tracing::error!(%why, "the context failed; every operation ends with an error");
        let err = failed_error(&why);
        self.failed = Some(why);
        let ids: Vec<SocketId> = self.sockets.keys().copied().collect();
        let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            for sid in ids {
                let Some(s) = self.sockets.get_mut(&sid) else {
                    continue;
                };
                s.down.get_or_insert(err.clone());
                if let Some(t) = s.ticket.take() {
                    t.complete(Err(err.clone()), 0, EventFlags::default());
                }
                for (t, _) in s.polls.drain(..) {
                    t.complete(Err(err.clone()), 0, EventFlags::default());
                }
                if let Some(l) = s.listening.take() {
                    for t in l.accepts {
                        t.complete(Err(err.clone()), 0, EventFlags::default());
                    }
                    for (request, _, _, _) in l.backlog {
                        self.transport.reject(request);
                    }
                    self.listeners.remove(&l.listener);
                    self.transport.close_listener(l.listener);
                }
                if let Some(conn) = s.conn.as_mut() {
                    conn.fail(err.clone());
                }
                self.disconnect(sid);
            }
            self.drain_done();
        }));
    }

    fn progress_round(&mut self) -> bool {
        let mut did = self.poll_completions();
        let mut disconnected = Vec::new();
        while let Some(ev) = self.transport.poll_cm() {
            self.stats.cm_events += 1;
            did = true;
            match ev {
                CmEvent::Disconnected { ep } => disconnected.push(ep),
                other => self.on_cm(other),
            }
        }
        if !disconnected.is_empty() {
            self.poll_completions();
            for ep in disconnected {
                self.on_disconnected(ep);
            }
        }
        did |= self.run_timers();
        self.flush_dirty();
        self.drain_done();
        did
    }

    /// Progress for a thread that busy-polls: completions, timers and posting, but not the connection-management
    /// channel (a system call per look; the progress thread sleeps on it and handles it).
    fn progress_busy_round(&mut self) -> bool {
        let mut did = self.poll_completions();
        did |= self.run_timers();
        self.flush_dirty();
        self.drain_done();
        did
    }

    /// Hands an operation's ticket to the protocol as a token (the engine keeps the ticket).
    fn token(&mut self, ticket: &mut Option<Ticket>) -> OpToken {
        let id = self.next_op;
        self.next_op += 1;
        self.ops
            .insert(id, (ticket.take().expect("ticket given"), 0));
        OpToken::new(id, self.outbox.clone())
    }

    /// Takes back the ticket of a token the protocol refused synchronously.
    fn untoken(&mut self, token: OpToken) -> Ticket {
        let id = token.into_id();
        self.ops.remove(&id).expect("a token's ticket is kept").0
    }

    /// Turns what the protocol reported into events (after every call and every round of progress).
    pub(crate) fn drain_done(&mut self) {
        self.outbox.take(&mut self.done);
        for d in self.done.drain(..) {
            match d {
                Done::Complete {
                    id,
                    status,
                    bytes,
                    flags,
                } => {
                    if let Some((t, _)) = self.ops.remove(&id) {
                        t.complete(status, bytes, flags);
                    }
                }
                Done::Notify { id, reads } => {
                    if let Some((t, unreported)) = self.ops.get_mut(&id) {
                        *unreported += reads;
                        if t.notify(crate::event::EventKind::ReadNotify, *unreported) {
                            *unreported = 0;
                        }
                    }
                }
            }
        }
    }

    /// Handles up to [`ROUND_BATCHES`] batches of completions. Bounded (issue 15: a peer flooding one connection
    /// kept the engine locked, and connection events and timers unhandled, for as long as it sent): the round's
    /// caller handles connection events and timers, lets the lock go, and comes back (arming the completion queue
    /// reports that completions remain).
    fn poll_completions(&mut self) -> bool {
        const BATCH: usize = 64;
        let mut did = false;
        for _ in 0..ROUND_BATCHES {
            let mut batch = std::mem::take(&mut self.completions);
            let n = self.transport.poll(&mut batch, BATCH);
            for c in batch.drain(..) {
                self.stats.completions += 1;
                self.on_completion(c);
            }
            self.completions = batch;
            self.flush_pool();
            did |= n > 0;
            // Fewer than asked: the queue is drained (polling it again would only cost another call).
            if n < BATCH {
                break;
            }
        }
        did
    }

    fn run_timers(&mut self) -> bool {
        if self.timers.is_empty() {
            return false;
        }
        let now = self.clock.now();
        if self.timers.iter().all(|t| t.0 > now) {
            return false;
        }
        let (due, keep): (Vec<_>, Vec<_>) = self.timers.drain(..).partition(|t| t.0 <= now);
        self.timers = keep;
        for (_, sid, kind) in &due {
            match kind {
                TimerKind::Linger => {
                    if let Some(s) = self
                        .sockets
                        .get_mut(sid)
                        .filter(|s| s.phase == Phase::Closing)
                    {
                        tracing::debug!(?sid, "linger expired, disconnecting");
                        // Sends still going are ended: `Aborted` where part may have reached the peer.
                        if let Some(conn) = s.conn.as_mut() {
                            conn.fail(OpError::Cancelled);
                        }
                        self.disconnect(*sid);
                    }
                }
                TimerKind::ConnectTimeout => {
                    let connecting = self
                        .sockets
                        .get(sid)
                        .is_some_and(|s| matches!(s.phase, Phase::Connecting | Phase::Accepting));
                    if connecting {
                        self.fail_connect(*sid, OpError::TimedOut);
                    }
                }
                TimerKind::Backlog => self.expire_backlog(*sid, now),
                TimerKind::Ack => {
                    if let Some(conn) = self.sockets.get_mut(sid).and_then(|s| s.conn.as_mut()) {
                        conn.force_ack();
                        self.mark(*sid);
                    }
                }
                TimerKind::Keepalive => {
                    let Some(sock) = self.sockets.get_mut(sid) else {
                        continue;
                    };
                    if sock.phase != Phase::Open {
                        continue; // the timer dies with the connection
                    }
                    if let Some(conn) = sock.conn.as_mut() {
                        if conn.link.keepalive() {
                            self.mark(*sid);
                        }
                    }
                    if let Some(k) = self.keepalive {
                        self.timers.push((now + k, *sid, TimerKind::Keepalive));
                    }
                }
            }
        }
        !due.is_empty()
    }

    fn flush_dirty(&mut self) {
        while let Some(sid) = self.dirty.pop() {
            self.flush(sid);
            self.check_polls(sid);
        }
    }

    fn mark(&mut self, sid: SocketId) {
        if !self.dirty.contains(&sid) {
            self.dirty.push(sid);
        }
    }

    /// Posts what a connection has ready, and moves a closing connection on once its CLOSE has left.
    fn flush(&mut self, sid: SocketId) {
        let Some(sock) = self.sockets.get_mut(&sid) else {
            return;
        };
        let Some(conn) = sock.conn.as_mut() else {
            return;
        };
        if let Some(len) = conn.stream().and_then(|st| st.ring_needed()) {
            let ep = conn.ep;
            if let Err(e) = self.provide_ring(sid, ep, len) {
                self.fault(
                    sid,
                    Fault::Transport(crate::transport::WcError::Other(e.to_string())),
                );
                return;
            }
        }
        let Some(sock) = self.sockets.get_mut(&sid) else {
            return;
        };
        let Some(conn) = sock.conn.as_mut() else {
            return;
        };
        let mut posts = std::mem::take(&mut self.posts);
        let flushed = conn.flush(&mut posts);
        let ep = conn.ep;
        let stream = conn.sock_type == SockType::Stream;
        // After a violation, the connection goes as soon as our CLOSE has left. After a graceful close it does
        // not: the peer takes the CLOSE after everything before it and answers by disconnecting, which ends it
        // (`on_disconnected`); disconnecting ourselves could overtake the data and the CLOSE still on their way on
        // some transports (libfabric tcp reset the peer's last receives). A peer that never answers is cut off
        // when the linger time runs out.
        let closing_done = sock.phase == Phase::Closing
            && sock.drop_after_close
            && conn.close_sent()
            && conn.sends_drained();

        self.post_all(sid, ep, &mut posts);
        self.posts = posts;
        let delayed_ack = match flushed {
            Ok(d) => d,
            Err(v) => {
                self.fault(sid, Fault::Peer(v));
                return;
            }
        };
        let ack_timer = self
            .timers
            .iter()
            .position(|t| t.1 == sid && t.2 == TimerKind::Ack);
        match (delayed_ack, ack_timer) {
            (true, None) => {
                // Message mode delays an acknowledgment; stream mode holds back a window update.
                let delay = if stream {
                    crate::proto::stream::WINDOW_HOLD
                } else {
                    self.ack_delay
                };
                self.timers.push((self.clock.now() + delay, sid, TimerKind::Ack));
            }
            // A reply carried the acknowledgment: the timer goes, so no sleeper is woken for it.
            (false, Some(i)) => {
                self.timers.swap_remove(i);
            }
            _ => {}
        }
        if closing_done {
            self.disconnect(sid);
        }
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

    fn on_completion(&mut self, c: Completion) {
        let pool_slot = Self::pool_slot(&c);
        if let (Some(slot), PoolState::On(pool)) = (pool_slot, &mut self.pool) {
            // Seed 003: a buffer flushed from a connection that went down goes back to the pool at once.
            pool.taken(c.status.is_err());
            if c.status.is_err() {
                self.repost_pool(slot);
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
    fn release_early(&mut self, early: Vec<Completion>) {
        for c in early {
            if let Some(slot) = Self::pool_slot(&c) {
                self.repost_pool(slot);
            }
        }
    }

    fn repost_pool(&mut self, slot: u32) {
        if let PoolState::On(pool) = &mut self.pool {
            match pool.repost(slot) {
                Ok(wr) => self.pool_posts.push(wr),
                Err(v) => tracing::error!(%v, "shared receive pool slot cannot be reposted"),
            }
        }
    }

    /// Allocates, registers and posts the pool's next chunk (seed 003: the pool grows by chunks up to its
    /// maximum). The pool itself only says what it needs.
    fn grow_pool(&mut self, mut pool: RecvPool) -> Result<RecvPool, TransportError> {
        let Some(bytes) = pool.next_chunk() else {
            return Ok(pool);
        };
        let buf = DmaBuf::new(bytes);
        let reg = self.register(&buf)?;
        let mut wrs = pool
            .add_chunk(buf, reg)
            .map_err(|v| TransportError::Invalid(v.to_string()))?;
        let n = wrs.len();
        self.stats.posted += n as u64;
        self.transport.post_shared_recv(&mut wrs)?;
        pool.reposted(n);
        Ok(pool)
    }

    /// Posts the pool buffers that came back, and grows the pool below its low watermark.
    fn flush_pool(&mut self) {
        let PoolState::On(pool) = &mut self.pool else {
            return;
        };
        // The watermark is checked first: the buffers this batch took are not back yet.
        if pool.wants_growth() {
            let PoolState::On(p) = std::mem::replace(&mut self.pool, PoolState::Undecided) else {
                unreachable!("checked above")
            };
            self.pool = match self.grow_pool(p) {
                Ok(p) => PoolState::On(p),
                Err(e) => {
                    tracing::warn!(%e, "the shared receive pool cannot grow");
                    return;
                }
            };
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
                    self.pool_posts.clear();
                }
            }
        }
    }

    fn handle_completion(&mut self, sid: SocketId, c: Completion) {
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

    fn on_peer_close(&mut self, sid: SocketId, reason: CloseReason) {
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
                sock.down.get_or_insert(err.clone());
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
    fn fault(&mut self, sid: SocketId, fault: Fault) {
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
            tracing::warn!(?sid, %err, "peer violated the protocol; closing the connection");
        } else {
            tracing::warn!(?sid, %err, "connection failed");
        }
        sock.down.get_or_insert(err.clone());
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
                self.timers.push((at, sid, TimerKind::Linger));
                self.mark(sid);
                return;
            }
        }
        self.disconnect(sid);
        self.mark(sid);
    }

    fn disconnect(&mut self, sid: SocketId) {
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

    fn on_cm(&mut self, ev: CmEvent) {
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
    fn expire_backlog(&mut self, lsid: SocketId, now: Instant) {
        let timeout = self.connect_timeout;
        let Some(l) = self.sockets.get_mut(&lsid).and_then(|s| s.listening.as_mut()) else {
            return;
        };
        while l.backlog.front().is_some_and(|b| b.3 + timeout <= now) {
            let (request, peer, _, _) = l.backlog.pop_front().expect("checked");
            tracing::debug!(%peer, "connection request expired in the backlog");
            self.stats.expired_requests += 1;
            self.transport.reject(request);
        }
    }

    fn fail_connect(&mut self, sid: SocketId, err: OpError) {
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
            self.trusted.forget_endpoint(ep);
            self.transport.release(ep);
        }
        sock.conn = None;
        let early = std::mem::take(&mut sock.early);
        sock.phase = Phase::Down;
        if sock.user_closed {
            self.sockets.remove(&sid);
        }
        self.release_early(early);
    }

    fn on_connect_request(
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
            self.timers
                .push((now + self.connect_timeout, lsid, TimerKind::Backlog));
            self.check_polls(lsid);
        } else {
            tracing::debug!(%peer, "backlog full, rejecting");
            self.transport.reject(request);
        }
    }

    fn accept_request(
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
        self.timers.push((at, sid, TimerKind::ConnectTimeout));
    }

    fn on_established(&mut self, ep: EndpointId, private: Vec<u8>) {
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
        if let Err(v) = conn.establish(&peer, &opts, !self.ack_delay.is_zero()) {
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
        self.timers
            .retain(|t| !(t.1 == sid && t.2 == TimerKind::ConnectTimeout));
        if let Some(k) = self.keepalive {
            let at = self.clock.now() + k;
            self.timers.push((at, sid, TimerKind::Keepalive));
        }
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

    fn on_disconnected(&mut self, ep: EndpointId) {
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
            self.sockets.remove(&sid);
        }
        self.release_early(early);
        self.check_polls(sid);
    }

    // ---------------------------------------------------------------------------------------------------------
    // Connections

    fn new_socket_id(&mut self) -> SocketId {
        let id = SocketId(self.next_socket);
        self.next_socket = self.next_socket.wrapping_add(1).max(1);
        id
    }

    fn new_ep(&mut self) -> EndpointId {
        let id = EndpointId(self.next_ep);
        self.next_ep = self.next_ep.wrapping_add(1).max(1);
        id
    }

    /// Allocates and registers a connection's control buffers (and a stream buffer for stream sockets).
    fn build_conn(
        &mut self,
        ep: EndpointId,
        ty: SockType,
        opts: &SocketOptions,
    ) -> Result<Conn, TransportError> {
        let window = u32::from(opts.effective_window(ty));
        let small = opts.small_packet_max_size as usize;
        let pooled = self.pool_slot_size()?;
        let (rx, slot) = match pooled {
            // Seed 003: every buffer of the shared pool has the context's one slot size; the connection owns none.
            Some(slot) => (Err((window, slot)), slot),
            None => {
                let slot = ctrl_slot_size(small);
                let rx_buf = DmaBuf::new(slot * window as usize);
                let rx_reg = self.register(&rx_buf)?;
                (
                    Ok(Slots {
                        buf: rx_buf,
                        reg: rx_reg,
                        size: slot,
                        count: window,
                    }),
                    slot,
                )
            }
        };
        let tx_count = window.max(16);
        let tx_buf = DmaBuf::new(TX_SLOT * tx_count as usize);
        let tx_reg = self.register(&tx_buf)?;
        let link = Link::new(
            rx,
            Slots {
                buf: tx_buf,
                reg: tx_reg,
                size: TX_SLOT,
                count: tx_count,
            },
            self.caps.max_send_wr,
            self.caps.max_read_depth,
            self.caps.imm_consumes_recv,
        );
        // The stream buffer is allocated when the peer first needs it; its address and key follow then
        // (STREAM_RING), so the handshake carries only its length.
        let stream_setup = match ty {
            SockType::SeqPacket => None,
            SockType::Stream => Some(StreamSetup {
                len: opts.stream_buffer_size as usize,
            }),
        };
        let (stream_len, stream_addr, stream_rkey) =
            (stream_setup.map_or(0, |s| s.len as u32), 0, 0);
        let local = Handshake {
            sock_type: match ty {
                SockType::SeqPacket => WireSockType::SeqPacket,
                SockType::Stream => WireSockType::Stream,
            },
            ctrl_window: window as u16,
            slot_size: slot as u16,
            send_credits: opts.send_credits,
            recv_credits: opts.recv_credits,
            small_max: opts.small_packet_max_size,
            stream_len,
            stream_addr,
            stream_rkey,
            native_imm: self.caps.native_write_imm,
        };
        self.stats.ctrl_recv_bytes += link_rx_bytes(&link);
        Ok(Conn::new(ep, ty, link, local, self.limits(), stream_setup))
    }

    /// The shared pool's slot size when connections use the pool (creating the pool at the first connection),
    /// `None` when they post their own receives.
    fn pool_slot_size(&mut self) -> Result<Option<usize>, TransportError> {
        if matches!(self.pool, PoolState::Undecided) {
            let want = self.shared_recv.enabled;
            let has = self.caps.max_shared_recv > 0;
            self.pool = match (want, has) {
                (Some(false), _) | (None, false) => PoolState::Off,
                (Some(true), false) => {
                    return Err(TransportError::Unsupported(format!(
                        "{} has no shared receive queue (ContextOptions::shared_recv)",
                        self.caps.name
                    )))
                }
                (_, true) => {
                    let o = &self.shared_recv;
                    let max = o.max_slots.min(self.caps.max_shared_recv);
                    let slot = ctrl_slot_size(o.small_packet_max_size as usize);
                    let pool = RecvPool::new(slot, o.chunk_slots.min(max), max, o.low_watermark);
                    match self
                        .transport
                        .create_shared_recv(max)
                        .and_then(|()| self.grow_pool(pool))
                    {
                        Ok(p) => PoolState::On(p),
                        Err(e) if want.is_none() => {
                            tracing::warn!(%e, "no shared receive pool; connections post their own receives");
                            PoolState::Off
                        }
                        Err(e) => return Err(e),
                    }
                }
            };
        }
        Ok(match &self.pool {
            PoolState::On(p) => Some(p.stats().slot_size),
            _ => None,
        })
    }

    // ---------------------------------------------------------------------------------------------------------
    // API

    pub(crate) fn socket(&mut self, ty: SockType) -> SocketId {
        let sid = self.new_socket_id();
        let mut opts = SocketOptions::default();
        if ty == SockType::SeqPacket {
            // Seed 002, 4.1: the immediate-data threshold this transport does best with (still settable).
            opts.small_packet_max_size = self
                .caps
                .immediate_default
                .min(SocketOptions::MAX_SMALL);
        }
        self.sockets.insert(sid, Sock::new(ty, opts));
        sid
    }

    fn sock(&mut self, sid: SocketId) -> Result<&mut Sock, StateError> {
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
        if s.phase != Phase::Fresh {
            return Err(StateError::AlreadyConnected.into());
        }
        if s.bound.is_some() {
            return Err(StateError::AlreadyBound.into());
        }
        s.bound = Some(addr);
        Ok(())
    }

    pub(crate) fn listen(&mut self, sid: SocketId, backlog: u32) -> R<SocketAddr, SocketError> {
        let s = self.sock(sid)?;
        if s.phase != Phase::Fresh {
            return Err(StateError::AlreadyConnected.into());
        }
        let addr = s.bound.ok_or(StateError::NotBound)?;
        if backlog > 0 {
            s.opts.backlog = backlog.min(65535);
        }
        let backlog = s.opts.backlog;
        let (listener, bound) = self.transport.listen(addr, backlog)?;
        let s = self.sock(sid)?;
        s.bound = Some(bound);
        s.phase = Phase::Listening;
        s.listening = Some(Listening {
            listener,
            accepts: VecDeque::new(),
            backlog: VecDeque::new(),
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
        if let Some((request, peer, hs, _)) = l.backlog.pop_front() {
            self.accept_request(sid, request, peer, hs, ticket);
        } else {
            l.accepts.push_back(ticket);
        }
        self.flush_dirty();
        Ok(())
    }

    pub(crate) fn connect(
        &mut self,
        sid: SocketId,
        addr: SocketAddr,
        ticket: &mut Option<Ticket>,
    ) -> R<(), ConnectError> {
        let s = self.sock(sid)?;
        match s.phase {
            Phase::Fresh => {}
            Phase::Listening => return Err(StateError::Listening.into()),
            _ => return Err(StateError::AlreadyConnected.into()),
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
        let recvs = conn
            .link
            .initial_recvs()
            .map_err(|v| TransportError::Invalid(format!("control buffers: {v}")))?;
        let private = conn.local.encode();
        if let Err(e) = self.transport.connect(ep, addr, &private, recvs) {
            // Whatever the transport set up for the endpoint (a connection's own domain) goes with it.
            drop(conn);
            self.release_endpoint(ep);
            return Err(e.into());
        }
        let at = self.clock.now() + self.connect_timeout;
        let s = self.sock(sid)?;
        s.phase = Phase::Connecting;
        s.conn = Some(conn);
        s.ticket = ticket.take();
        s.peer_addr = Some(addr);
        self.eps.insert(ep, sid);
        self.timers.push((at, sid, TimerKind::ConnectTimeout));
        Ok(())
    }

    /// The open connection of a socket, or why there is none.
    fn open_conn(&mut self, sid: SocketId) -> Result<&mut Conn, StateError> {
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

    /// `offset`: `exs_send_offset` (seed 002, 4.4) into the peer's persistent receive.
    pub(crate) fn send(
        &mut self,
        sid: SocketId,
        slice: &Slice,
        flags: MsgFlags,
        offset: Option<u64>,
        ticket: &mut Option<Ticket>,
    ) -> R<(), SendError> {
        slice.check(self.ctx_id)?;
        let s = self.sock(sid)?;
        let ty = s.ty;
        if s.shut_write {
            return Err(StateError::Shutdown.into());
        }
        check_flags(flags, ty, offset.is_some())?;
        let persistent = flags.contains(MsgFlags::PERSISTENT);
        let conn = self.open_conn(sid)?;
        match ty {
            SockType::SeqPacket => {
                let len = slice.len();
                let m = conn.message().expect("message socket");
                if persistent {
                    m.may_be_persistent().map_err(StateError::Persistent)?;
                }
                match (offset, m.peer_precv_len()) {
                    (Some(_), None) => return Err(StateError::Persistent(
                        "send_offset needs the peer's persistent receive, and it has none active",
                    )
                    .into()),
                    (o, Some(size)) if !persistent => {
                        let offset = o.unwrap_or(0);
                        if offset.checked_add(len as u64).is_none_or(|end| end > size) {
                            return Err(StateError::OffsetOutOfRange {
                                offset,
                                len: len as u64,
                                size,
                            }
                            .into());
                        }
                    }
                    _ => {}
                }
                let data = if persistent || (!m.writes_to_peer() && !m.is_immediate(len)) {
                    // Seed 002, 4.2: the application keeps updating a persistent send's memory while the peer
                    // reads it (copies in through `MemoryRegion::write`; the reader may see a mix).
                    let kind = if persistent {
                        LeaseKind::DeviceReadShared
                    } else {
                        LeaseKind::DeviceRead
                    };
                    let sge = slice.lease(kind)?;
                    let (lease, reg) = sge.into_parts();
                    let ep = self.open_conn(sid)?.ep;
                    SendData::Exposed(self.expose_op(ep, &reg, lease, RemoteAccess::Read)?)
                } else {
                    SendData::Inline(slice.lease(LeaseKind::DeviceRead)?)
                };
                self.open_conn(sid)?;
                let token = self.token(ticket);
                let conn = self.open_conn(sid)?;
                conn.send_message(SendReq {
                    ticket: Some(token),
                    len,
                    data,
                    persistent: persistent.then_some(flags.contains(MsgFlags::NOTIFY)),
                    offset: offset.unwrap_or(0),
                });
            }
            SockType::Stream => {
                if slice.is_empty() {
                    return Err(BufferError::Empty.into());
                }
                let sge = slice.lease(LeaseKind::DeviceRead)?;
                self.open_conn(sid)?;
                let token = self.token(ticket);
                let stream = self
                    .open_conn(sid)?
                    .stream()
                    .expect("stream socket");
                stream.send(token, sge, flags);
            }
        }
        self.flush(sid);
        Ok(())
    }

    /// `offset`: `exs_recv_offset` (seed 002, 4.4) from the peer's persistent send.
    pub(crate) fn recv(
        &mut self,
        sid: SocketId,
        slice: &Slice,
        flags: MsgFlags,
        offset: Option<u64>,
        ticket: &mut Option<Ticket>,
    ) -> R<(), RecvError> {
        slice.check(self.ctx_id)?;
        let s = self.sock(sid)?;
        let ty = s.ty;
        check_flags(flags, ty, offset.is_some())?;
        let closed_stream = ty == SockType::Stream && s.peer_closed && s.conn.is_some();
        // After the peer closed, a message receive reports end-of-stream (as read(2) returns 0); a stream receive
        // first takes what the stream buffer still holds.
        if s.peer_closed && !closed_stream && matches!(s.phase, Phase::Disconnecting | Phase::Down)
        {
            let t = ticket.take().expect("ticket given");
            t.complete_eof();
            return Ok(());
        }
        match ty {
            SockType::SeqPacket if flags.contains(MsgFlags::PERSISTENT) => {
                let m = self.open_conn(sid)?.message().expect("message socket");
                m.may_be_persistent().map_err(StateError::Persistent)?;
                if slice.is_empty() {
                    return Err(BufferError::Empty.into());
                }
                // Seed 002, 4.3: the application reads the current values while the peer writes them.
                let sge = slice.lease(LeaseKind::DeviceWriteShared)?;
                let (lease, reg) = sge.into_parts();
                let ep = self.open_conn(sid)?.ep;
                let exposure = self.expose(ep, &reg, lease, RemoteAccess::Write)?;
                let token = self.token(ticket);
                let conn = self.open_conn(sid)?;
                if let Err((t, why)) = conn.recv_persistent(token, exposure) {
                    *ticket = Some(self.untoken(t));
                    return Err(StateError::Persistent(why).into());
                }
            }
            SockType::SeqPacket => {
                let conn = self.open_conn(sid)?;
                if let Some(offset) = offset {
                    let len = slice.len() as u64;
                    let size = conn.message().expect("message socket").peer_psend_len().ok_or(
                        StateError::Persistent(
                            "recv_offset needs the peer's persistent send, and none has arrived (or it ended)",
                        ),
                    )?;
                    if offset.checked_add(len).is_none_or(|end| end > size) {
                        return Err(StateError::OffsetOutOfRange { offset, len, size }.into());
                    }
                }
                let sge = slice.lease(RECV_LEASE)?;
                let token = self.token(ticket);
                self.open_conn(sid)?.recv_message(RecvReq {
                    ticket: token,
                    sge,
                    offset,
                });
            }
            SockType::Stream => {
                if slice.is_empty() {
                    return Err(BufferError::Empty.into());
                }
                if !closed_stream {
                    self.open_conn(sid)?;
                }
                let Some(ep) = self.sockets.get(&sid).and_then(|s| s.ep()) else {
                    return Err(StateError::NotConnected.into());
                };
                let sge = slice.lease(LeaseKind::DeviceWrite)?;
                let (lease, reg) = sge.into_parts();
                let exposure: Box<dyn crate::transport::Exposure> = if closed_stream {
                    // The peer closed: it writes nothing more, so no key; the stream buffer's rest is copied in.
                    Box::new(crate::transport::KeyedLease::new(
                        crate::transport::RemoteRef { addr: 0, key: 0 },
                        lease,
                        crate::transport::NoKey,
                    ))
                } else {
                    self.expose_op(ep, &reg, lease, RemoteAccess::Write)?
                };
                let token = self.token(ticket);
                let conn = self
                    .sockets
                    .get_mut(&sid)
                    .and_then(|s| s.conn.as_mut())
                    .expect("checked above");
                if let Err(v) = conn.recv_stream(token, exposure, reg, flags) {
                    self.fault(sid, Fault::Peer(v));
                }
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
        s.user_closed = true;
        match s.phase {
            Phase::Open | Phase::Closing | Phase::Connecting | Phase::Accepting => {
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
            _ => self.close(sid),
        }
    }

    /// What the socket is ready for now (ES-API `exs_poll`).
    fn readiness(&self, sid: SocketId) -> Readiness {
        let Some(s) = self.sockets.get(&sid) else {
            return Readiness {
                error: true,
                hangup: true,
                ..Readiness::default()
            };
        };
        if let Some(l) = &s.listening {
            return Readiness {
                readable: !l.backlog.is_empty(),
                ..Readiness::default()
            };
        }
        let open = s.phase == Phase::Open;
        let (readable, writable) = match (&s.conn, open) {
            (Some(c), true) => c.readiness(),
            // A connection whose peer closed is readable: bytes still buffered, then end-of-stream.
            (Some(_), false) if s.peer_closed => (true, false),
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
        self.check_polls(sid);
        Ok(())
    }

    fn check_polls(&mut self, sid: SocketId) {
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
                self.sockets.remove(&sid);
            }
            Phase::Listening => {
                let l = s
                    .listening
                    .take()
                    .expect("listening sockets have a listener");
                for t in l.accepts {
                    t.complete(Err(OpError::Cancelled), 0, EventFlags::default());
                }
                for (request, _, _, _) in l.backlog {
                    self.transport.reject(request);
                }
                self.listeners.remove(&l.listener);
                self.transport.close_listener(l.listener);
                self.sockets.remove(&sid);
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
                    self.timers.push((at, sid, TimerKind::Linger));
                    self.flush(sid);
                }
            }
            Phase::Closing | Phase::Disconnecting => {}
        }
        Ok(())
    }

    pub(crate) fn set_option(&mut self, sid: SocketId, opt: SocketOption) -> R<(), OptionError> {
        let s = self.sock(sid)?;
        if opt.negotiated() && s.phase != Phase::Fresh {
            return Err(OptionError::Locked(opt.name()));
        }
        opt.apply(&mut s.opts)
    }

    pub(crate) fn options(&mut self, sid: SocketId) -> R<SocketOptions, StateError> {
        Ok(self.sock(sid)?.opts)
    }

    pub(crate) fn socket_error(&mut self, sid: SocketId) -> R<Option<OpError>, StateError> {
        Ok(self.sock(sid)?.down.clone())
    }

    pub(crate) fn local_addr(&mut self, sid: SocketId) -> R<Option<SocketAddr>, StateError> {
        let s = self.sock(sid)?;
        let (bound, ep) = (s.bound, s.ep());
        Ok(ep.and_then(|ep| self.transport.local_addr(ep)).or(bound))
    }

    pub(crate) fn peer_addr(&mut self, sid: SocketId) -> R<Option<SocketAddr>, StateError> {
        let s = self.sock(sid)?;
        if s.phase != Phase::Open {
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
    pub(crate) fn conn_stats(&mut self, sid: SocketId) -> Option<crate::socket::ConnStats> {
        let s = self.sockets.get_mut(&sid)?;
        let conn = s.conn.as_mut()?;
        Some(crate::socket::ConnStats {
            link: conn.link.stats,
            message: conn.message().map(|m| m.stats).unwrap_or_default(),
            stream: conn.stream().map(|st| st.stats()).unwrap_or_default(),
            window_in: conn.link.window_in(),
            slot_size: conn.link.slot_size(),
        })
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
        let eps: Vec<EndpointId> = self.eps.keys().copied().collect();
        for ep in eps {
            self.transport.disconnect(ep);
            self.on_disconnected(ep);
        }
        self.drain_done();
    }
}

/// Flags and offsets that a socket type cannot take.
fn check_flags(flags: MsgFlags, ty: SockType, offset: bool) -> Result<(), StateError> {
    let known = MsgFlags::WAITALL.0 | MsgFlags::PERSISTENT.0 | MsgFlags::NOTIFY.0;
    if flags.0 & !known != 0 {
        return Err(StateError::Persistent("unknown flag bits"));
    }
    if flags.contains(MsgFlags::NOTIFY) && !flags.contains(MsgFlags::PERSISTENT) {
        return Err(StateError::Persistent(
            "NOTIFY applies to persistent sends only",
        ));
    }
    if ty == SockType::Stream && (flags.contains(MsgFlags::PERSISTENT) || offset) {
        return Err(StateError::Persistent(
            "persistent and offset transfers exist on SOCK_SEQPACKET sockets only",
        ));
    }
    Ok(())
}

/// A control receive slot holds a header, the largest body, and immediate data up to `small` bytes.
fn ctrl_slot_size(small: usize) -> usize {
    (HEADER_LEN + 48 + small)
        .max(HEADER_LEN + 48)
        .next_multiple_of(64)
        .min(u16::MAX as usize & !63)
}

/// Batches of completions one progress round handles at most (see `Engine::poll_completions`).
const ROUND_BATCHES: usize = 4;

/// What operations and calls of a failed context report.
fn failed_error(why: &str) -> OpError {
    OpError::Transport(TransportError::Invalid(format!("the context failed: {why}")))
}

fn link_rx_bytes(link: &Link) -> u64 {
    link.own_rx_bytes() as u64
}

fn conn_rx_bytes(conn: &Conn) -> u64 {
    link_rx_bytes(&conn.link)
}

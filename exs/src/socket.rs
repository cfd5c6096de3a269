//! Sockets: the ES-API calls of the UNH-EXS paper, Figure 2.
//!
//! | ES-API              | here                         |
//! |---------------------|------------------------------|
//! | `exs_socket`        | [`Socket::new`]              |
//! | `exs_bind`          | [`Socket::bind`]             |
//! | `exs_listen`        | [`Socket::listen`]           |
//! | `exs_accept`        | [`Socket::accept`] (async)   |
//! | `exs_connect`       | [`Socket::connect`] (async)  |
//! | `exs_send`          | [`Socket::send`] (async)     |
//! | `exs_recv`          | [`Socket::recv`] (async)     |
//! | `exs_close`         | [`Socket::close`]            |
//! | `exs_getsockname`   | [`Socket::local_addr`]       |
//! | `exs_getpeername`   | [`Socket::peer_addr`]        |
//! | `exs_fcntl`         | [`Socket::set_options`], [`Socket::options`] |
//!
//! Every asynchronous call takes an [`EventQueue`] and a user context value, and completes with exactly one
//! [`Event`](crate::Event). A call that returns an error started nothing and produces no event.

use std::fmt;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use crate::context::Context;
use crate::engine::ConnStats;
use crate::error::{
    AcceptError, CloseError, ConnectError, OptionError, PollError, RecvError, SendError,
    SocketError, StateError,
};
use crate::event::{Event, EventKind, EventQueue, Ticket};
use crate::memory::Slice;
use crate::options::{MsgFlags, SockType, SocketOptions};
use crate::proto::conn::HoldId;

use crate::ids::{Readiness, SocketId};

struct Handle {
    ctx: Context,
    id: SocketId,
    closed: AtomicBool,
    /// The queue ([`EventQueue::id`]) the context was last attached to (0: none yet).
    attached: AtomicU64,
}

impl Drop for Handle {
    fn drop(&mut self) {
        if !self.closed.swap(true, Ordering::SeqCst) {
            self.ctx.close_unheld(self.id);
        }
    }
}

/// An RDMA socket. Cheap to clone (a handle); the socket closes when [`Socket::close`] is called or the last
/// handle is dropped.
///
/// Every call that moves data is asynchronous: it starts the operation and returns; the operation's [`Event`]
/// arrives on the [`EventQueue`] the call named, with the `context` value it was given. The memory an operation
/// names is leased until then. A SOCK_SEQPACKET exchange, both ends in one program:
///
/// ```
/// # #[cfg(feature = "fabric")] {
/// # std::env::set_var("EXS_BACKEND", "fabric"); // the test's backend, whatever else the build enables
/// use exs::{Context, EventKind, EventQueue, MemoryRegion, MsgFlags, SockType, Socket};
///
/// let (server, client) = (Context::from_env()?, Context::from_env()?);
/// let eq = EventQueue::new(16)?;
/// let listener = Socket::new(&server, SockType::SeqPacket)?;
/// listener.bind("127.0.0.1:0".parse()?)?;
/// let addr = listener.listen(8)?;
/// listener.accept(&eq, 1)?;
/// let sock = Socket::new(&client, SockType::SeqPacket)?;
/// sock.connect(&eq, addr, 2)?;
/// // The accept (with the server's end of the connection) and the connect, in either order.
/// let mut accepted = None;
/// for _ in 0..2 {
///     let mut ev = eq.next(None)?;
///     if ev.kind == EventKind::Accept {
///         accepted = ev.take_accepted();
///     }
///     ev.status?;
/// }
/// let peer = accepted.expect("the accept event carries the socket");
///
/// let inbox = MemoryRegion::alloc(&server, 64)?;
/// peer.recv(&eq, &inbox.all(), MsgFlags::NONE, 3)?;
/// let msg = MemoryRegion::from_vec(&client, b"one message".to_vec())?;
/// sock.send(&eq, &msg.all(), MsgFlags::NONE, 4)?;
/// let mut received = 0;
/// for _ in 0..2 {
///     let ev = eq.next(None)?;
///     ev.status?;
///     if ev.context == 3 {
///         received = ev.bytes;
///     }
/// }
/// assert_eq!(&inbox.to_vec()?[..received], b"one message");
/// # }
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
///
/// [`Event`]: crate::Event
#[derive(Clone)]
pub struct Socket {
    h: Arc<Handle>,
}

impl fmt::Debug for Socket {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Socket")
            .field("id", &self.h.id.0)
            .field("context", &self.h.ctx.id())
            .finish()
    }
}

impl Socket {
    /// Creates a socket (ES-API `exs_socket`).
    pub fn new(ctx: &Context, ty: SockType) -> Result<Socket, SocketError> {
        let id = ctx.shared().lock().socket(ty);
        Ok(Self::from_engine(ctx.clone(), id))
    }

    fn from_engine(ctx: Context, id: SocketId) -> Socket {
        Socket {
            h: Arc::new(Handle {
                ctx,
                id,
                closed: AtomicBool::new(false),
                attached: AtomicU64::new(0),
            }),
        }
    }

    /// The socket's number.
    pub fn id(&self) -> SocketId {
        self.h.id
    }

    /// The context.
    pub fn context(&self) -> &Context {
        &self.h.ctx
    }

    /// The socket type.
    pub fn sock_type(&self) -> Result<SockType, StateError> {
        self.engine(|e, id| e.socket_type(id))
    }

    fn engine<T>(&self, f: impl FnOnce(&mut crate::engine::Engine, SocketId) -> T) -> T {
        on_engine(&self.h.ctx, self.h.id, f)
    }

    /// Starts an asynchronous operation: reserves its event, runs it, and gives the slot back if it was refused.
    fn start<E: From<crate::error::QueueFull>>(
        &self,
        eq: &EventQueue,
        kind: EventKind,
        context: u64,
        f: impl FnOnce(&mut crate::engine::Engine, SocketId, &mut Option<Ticket>) -> Result<(), E>,
    ) -> Result<(), E> {
        self.attach(eq);
        let mut ticket = Some(eq.reserve(kind, context, self.h.id)?);
        let r = self.engine(|e, id| f(e, id, &mut ticket));
        if let Some(t) = ticket {
            debug_assert!(r.is_err(), "a started operation must take its ticket");
            t.discard();
        }
        r
    }

    /// Binds to a local address (ES-API `exs_bind`), for [`Socket::listen`]. Port 0 lets `listen` pick one. The
    /// transports choose an outgoing connection's own address: a socket bound to one is refused by
    /// [`Socket::connect`] (`Unsupported`), where TCP would connect from it; the unspecified address with port 0
    /// is taken.
    pub fn bind(&self, addr: SocketAddr) -> Result<(), SocketError> {
        self.engine(|e, id| e.bind(id, addr))
    }

    /// Listens for connections (ES-API `exs_listen`); returns the bound address. `backlog` 0 keeps the
    /// option's value; a larger one than 65,535 (the option's limit) is taken as 65,535, as `listen(2)` takes one
    /// beyond `somaxconn`. On a listening socket it sets only the backlog, as `listen(2)` does.
    ///
    /// Like a TCP listener, it sets incoming connections up by itself: a connection is established (the peer's
    /// connect completes) before any accept, and waits for one. The backlog bounds the connections being set up
    /// and those waiting; a request beyond it is refused. A request with a bad handshake is refused, and a
    /// connection that fails or goes silent before it is established is dropped: neither ever reaches an accept
    /// (both are counted in [`EngineStats::dropped_before_accept`](crate::stats::EngineStats::dropped_before_accept)).
    pub fn listen(&self, backlog: u32) -> Result<SocketAddr, SocketError> {
        self.engine(|e, id| e.listen(id, backlog))
    }

    /// Accepts one connection, asynchronously (ES-API `exs_accept`). The [`EventKind::Accept`] event carries the
    /// new socket in [`Event::take_accepted`](crate::Event::take_accepted): always an established connection (see
    /// [`Socket::listen`]); another peer's failure never ends an accept.
    pub fn accept(&self, eq: &EventQueue, context: u64) -> Result<(), AcceptError> {
        self.start(eq, EventKind::Accept, context, |e, id, t| e.accept(id, t))
    }

    /// Connects to `addr`, asynchronously (ES-API `exs_connect`): the event of kind `Connect` comes on `eq`. The
    /// event queue comes first, as in every asynchronous call. Options negotiated at connect are frozen from here
    /// on. A socket bound to an address is refused (`Unsupported`: see [`Socket::bind`]); so is a socket whose
    /// connect failed or whose connection ended, with why ([`StateError::ConnectionDown`]): a new socket connects.
    pub fn connect(
        &self,
        eq: &EventQueue,
        addr: SocketAddr,
        context: u64,
    ) -> Result<(), ConnectError> {
        self.connect_within(eq, addr, None, context)
    }

    /// [`Socket::connect`], failing `TimedOut` after `timeout` (`None`: the context's `connect_timeout`), longer
    /// or shorter than the context's: the streams' per-call connect timeout.
    pub(crate) fn connect_within(
        &self,
        eq: &EventQueue,
        addr: SocketAddr,
        timeout: Option<std::time::Duration>,
        context: u64,
    ) -> Result<(), ConnectError> {
        self.start(eq, EventKind::Connect, context, |e, id, t| {
            e.connect(id, addr, timeout, t)
        })
    }

    /// Sends the bytes of `buf`, asynchronously (ES-API `exs_send`). The range stays leased (the application
    /// cannot write it) until the event.
    pub fn send(
        &self,
        eq: &EventQueue,
        buf: &Slice,
        flags: MsgFlags,
        context: u64,
    ) -> Result<(), SendError> {
        self.start(eq, EventKind::Send, context, |e, id, t| {
            e.send(id, buf, flags, None, t)
        })
    }

    /// Writes `buf` at `offset` inside the peer's persistent receive buffer (UNH-EXS `exs_send_offset`, the UNH-EXS
    /// paper 4.4), completing when the write has. Outside that buffer, or with no persistent receive at the peer, it is
    /// refused at once ([`StateError::OffsetOutOfRange`], [`StateError::Persistent`]); so is one longer than the
    /// transport's largest message (`Capabilities::max_message`: it is one RDMA write), to send in parts.
    pub fn send_offset(
        &self,
        eq: &EventQueue,
        buf: &Slice,
        offset: u64,
        flags: MsgFlags,
        context: u64,
    ) -> Result<(), SendError> {
        self.start(eq, EventKind::Send, context, |e, id, t| {
            e.send(id, buf, flags, Some(offset), t)
        })
    }

    /// Reads `buf.len()` bytes from `offset` inside the peer's persistent send (UNH-EXS `exs_recv_offset`, seed
    /// 002 4.4). Refused at once outside it, or when the peer has no persistent send here.
    pub fn recv_offset(
        &self,
        eq: &EventQueue,
        buf: &Slice,
        offset: u64,
        flags: MsgFlags,
        context: u64,
    ) -> Result<(), RecvError> {
        self.start(eq, EventKind::Recv, context, |e, id, t| {
            e.recv(id, buf, flags, Some(offset), t)
        })
    }

    /// Shuts the sending side down (`shutdown(SHUT_WR)`): after the sends already started, the peer's receives see
    /// end-of-stream; this side keeps receiving. Completes (event `Shutdown`) once every earlier send has. A graceful
    /// close that drains is this, then [`Socket::close`] after the event.
    pub fn shutdown(&self, eq: &EventQueue, context: u64) -> Result<(), CloseError> {
        self.start(eq, EventKind::Shutdown, context, |e, id, t| {
            e.shutdown_write(id, t).map_err(CloseError::from)
        })
    }

    /// Abortive close: pending operations end at once and the connection is torn down without the orderly close
    /// (the peer sees the connection reset, as with `SO_LINGER` 0). A send part of which was handed to the
    /// transport ends `Aborted` (the peer may have some of it), any other operation `Cancelled`.
    pub fn abort(&self) -> Result<(), CloseError> {
        if self.h.closed.swap(true, Ordering::SeqCst) {
            return Err(StateError::InvalidSocket.into());
        }

        self.engine(|e, id| e.abort(id))
    }

    /// Readiness (ES-API `exs_poll`): completes with an event of kind `Poll` whose `readiness` says what the
    /// socket is ready for, at once if it already is for something in `interest`, else when it becomes so.
    /// Errors and hang-ups are always reported. Post one on each of many sockets with one queue to wait for
    /// whichever is ready first.
    pub fn poll(
        &self,
        eq: &EventQueue,
        interest: Readiness,
        context: u64,
    ) -> Result<(), PollError> {
        self.start(eq, EventKind::Poll, context, |e, id, t| {
            e.poll(id, interest, t).map_err(PollError::from)
        })
    }

    /// Sends `buf` with an event of `kind` (sendfile's message).
    pub(crate) fn send_as(
        &self,
        eq: &EventQueue,
        buf: &Slice,
        kind: EventKind,
        context: u64,
    ) -> Result<(), SendError> {
        self.start(eq, kind, context, |e, id, t| {
            e.send(id, buf, MsgFlags::NONE, None, t)
        })
    }

    /// This socket named without keeping it open (see [`SocketRef`]).
    pub(crate) fn by_ref(&self) -> SocketRef {
        SocketRef {
            ctx: self.h.ctx.clone(),
            id: self.h.id,
        }
    }

    /// Reserves an event of `kind` for an operation this crate completes itself (chunked sendfile).
    pub(crate) fn reserve(
        &self,
        eq: &EventQueue,
        kind: EventKind,
        context: u64,
    ) -> Result<Ticket, crate::error::QueueFull> {
        self.attach(eq);
        eq.reserve(kind, context, self.h.id)
    }

    /// Lets a busy dequeue on `eq` drive this socket's context: once per queue, not on every call (a lock and
    /// reference counts each time). A queue keeps every context attached to it for as long as that context lives,
    /// and this handle keeps it alive; another queue in between attaches again. (Release and acquire: a thread that
    /// sees the id sees the attachment made before it was stored.)
    fn attach(&self, eq: &EventQueue) {
        let id = eq.id();
        if self.h.attached.load(Ordering::Acquire) != id {
            self.h.ctx.attach(eq);
            self.h.attached.store(id, Ordering::Release);
        }
    }

    /// Ends this side's persistent send and persistent receive (`EXS_PERSISTENT`, the UNH-EXS paper 4.2 and 4.3). Their
    /// events (`Send`, `Recv`, status Ok) come once the peer has stopped touching the memory; only then is its
    /// key revoked.
    pub fn end_persistent(&self) -> Result<(), StateError> {
        self.engine(|e, id| e.end_persistent(id))
    }

    /// Receives into `buf`, asynchronously (ES-API `exs_recv`). The range stays leased (the application cannot
    /// read it) until the event.
    pub fn recv(
        &self,
        eq: &EventQueue,
        buf: &Slice,
        flags: MsgFlags,
        context: u64,
    ) -> Result<(), RecvError> {
        self.start(eq, EventKind::Recv, context, |e, id, t| {
            e.recv(id, buf, flags, None, t)
        })
    }

    /// Closes the socket (ES-API `exs_close`), gracefully like TCP's `close()`: pending receives complete as
    /// `Cancelled`; sends already posted go on, reach the peer and complete `Ok`, then the peer sees end-of-stream
    /// (persistent operations end as [`Socket::end_persistent`] ends them). Whatever is still going when the
    /// context's linger time runs out ends `Aborted` (part may have reached the peer) or `Cancelled` (none did),
    /// and the connection is torn down. [`Socket::abort`] ends everything at once. Closing twice is an error.
    pub fn close(&self) -> Result<(), CloseError> {
        if self.h.closed.swap(true, Ordering::SeqCst) {
            return Err(StateError::InvalidSocket.into());
        }

        self.engine(|e, id| e.close(id))
    }

    /// The local address (ES-API `exs_getsockname`): a connected socket's stays after its connection ended.
    pub fn local_addr(&self) -> Result<Option<SocketAddr>, StateError> {
        self.engine(|e, id| e.local_addr(id))
    }

    /// The peer's address (ES-API `exs_getpeername`), while the connection is up and after the peer closed it (as
    /// TCP's in CLOSE_WAIT, while its last bytes are read); [`StateError::NotConnected`] otherwise, a reset
    /// included.
    pub fn peer_addr(&self) -> Result<Option<SocketAddr>, StateError> {
        self.engine(|e, id| e.peer_addr(id))
    }

    /// Why a send would be refused now, if it would (see `Engine::check_sendable`).
    pub(crate) fn check_sendable(&self) -> Result<(), StateError> {
        self.engine(|e, id| e.check_sendable(id))
    }

    /// The peer's address as recorded when the connection was set up, also once it has ended.
    pub(crate) fn recorded_peer_addr(&self) -> Result<Option<SocketAddr>, StateError> {
        self.engine(|e, id| e.recorded_peer_addr(id))
    }

    /// Changes options (ES-API `exs_fcntl`): every field of `opts` that differs from the options in effect
    /// ([`Socket::options`], then the `with_*` setters of [`SocketOptions`]). All or nothing: a value out of
    /// range, or a field negotiated at connect changed after the connection started, refuses the whole set
    /// ([`OptionError`] names the field).
    pub fn set_options(&self, opts: SocketOptions) -> Result<(), OptionError> {
        self.engine(|e, id| e.set_options(id, &opts))
    }

    /// Changes options from those in effect in one step (`change` gets them and returns the options to set, as
    /// [`Socket::set_options`] takes them), under the socket's lock: two threads changing different options at
    /// once keep both changes, where [`Socket::options`] then [`Socket::set_options`] from each could write the
    /// other's field back to its old value. `change` runs with the context locked: it must not call into exs.
    pub fn update_options(
        &self,
        change: impl FnOnce(SocketOptions) -> SocketOptions,
    ) -> Result<(), OptionError> {
        self.engine(|e, id| {
            let new = change(e.options(id)?);
            e.set_options(id, &new)
        })
    }

    /// The options in effect.
    pub fn options(&self) -> Result<SocketOptions, StateError> {
        self.engine(|e, id| e.options(id))
    }

    /// The stream-protocol decisions recorded since the last call (the `Trace` option must be on), oldest first.
    pub fn stream_trace(&self) -> Vec<crate::proto::stream::StreamTrace> {
        self.engine(|e, id| e.stream_trace(id))
    }

    /// Why the connection went down, once it has (like `SO_ERROR`): a local close, the peer closing, a transport
    /// failure, or [`crate::OpError::PeerMisbehaved`] naming the peer's protocol violation. `None` while it is up.
    pub fn error(&self) -> Result<Option<crate::OpError>, StateError> {
        self.engine(|e, id| e.socket_error(id))
    }

    /// Counters of the connection, while there is one.
    pub fn stats(&self) -> Option<ConnStats> {
        self.engine(|e, id| e.conn_stats(id))
    }
}

impl Event {
    /// For a successful [`EventKind::Accept`]: the new connection, established, as a socket of the listener's
    /// context. It is given once (`None` after, and for every other event). A connection nobody takes is closed
    /// when its event is dropped, as a dropped socket is.
    pub fn take_accepted(&mut self) -> Option<Socket> {
        let (id, owner) = self.accepted.take()?.into_parts();
        let owner: Arc<dyn std::any::Any + Send + Sync> = owner;
        match owner.downcast::<crate::context::CtxInner>() {
            Ok(inner) => Some(Socket::from_engine(Context::from_inner(inner), id)),
            Err(_) => unreachable!("contexts are the only owners of accepted connections"),
        }
    }
}

/// A socket named by its context and number, without keeping it open: what an operation the crate carries on by
/// itself holds (a stream sendfile, which posts its later chunks as earlier ones complete), so that dropping the
/// application's last handle still closes the socket. The close is graceful: it waits for the sendfile within the
/// linger time, then resets the connection. (A sendfile that held a handle kept the socket, and its connection,
/// open for as long as a peer that stopped reading wished.) Once the socket is gone its calls are refused.
#[derive(Clone, Debug)]
pub(crate) struct SocketRef {
    ctx: Context,
    id: SocketId,
}

impl SocketRef {
    /// The socket's number.
    pub(crate) fn id(&self) -> SocketId {
        self.id
    }

    fn engine<T>(&self, f: impl FnOnce(&mut crate::engine::Engine, SocketId) -> T) -> T {
        on_engine(&self.ctx, self.id, f)
    }

    /// Sends the next part of held send `hold`, completing `ticket` (a hooked one: chunked sendfile; see
    /// [`SocketRef::hold_sends`]).
    pub(crate) fn send_held(
        &self,
        hold: HoldId,
        buf: &Slice,
        ticket: Ticket,
    ) -> Result<(), SendError> {
        let mut ticket = Some(ticket);
        let r = self.engine(|e, id| e.send_held(id, hold, buf, &mut ticket));
        if let Some(t) = ticket {
            t.discard();
        }
        r
    }

    /// Holds the end of stream back for a send handed over in parts, and the sends made after it until its last
    /// part (see `Engine::hold_sends`).
    pub(crate) fn hold_sends(&self) -> Result<HoldId, StateError> {
        self.engine(|e, id| e.hold_sends(id))
    }

    /// Lets go of a hold taken by [`SocketRef::hold_sends`]; `gave_up`: part of the send went out and the rest never
    /// will (see `Engine::release_sends`).
    pub(crate) fn release_sends(&self, hold: HoldId, gave_up: bool) {
        self.engine(|e, id| e.release_sends(id, hold, gave_up))
    }
}

/// Runs `f` on `ctx`'s engine for socket `id` ([`Socket`] and [`SocketRef`] alike).
fn on_engine<T>(
    ctx: &Context,
    id: SocketId,
    f: impl FnOnce(&mut crate::engine::Engine, SocketId) -> T,
) -> T {
    ctx.shared().call(|e| f(e, id))
}

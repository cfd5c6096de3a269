//! Errors, one type per operation, each saying whose fault it is.
//!
//! Synchronous calls return `Result<_, XxxError>` for what can be decided at once (misuse, bad buffers, a full
//! queue). Asynchronous outcomes arrive in the operation's [`Event`](crate::Event) as an [`OpError`].
//! Every error converts into `std::io::Error` with a fitting [`std::io::ErrorKind`].

use std::io;

use exs_dma::DmaError;

pub use crate::transport::TransportError;
pub use crate::wire::WireError;

/// Whose fault an error is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Blame {
    /// The application misused the API (bad handle, bad buffer, wrong state). Fix the caller.
    Local,
    /// The remote peer broke the protocol, closed, or vanished.
    Peer,
    /// The fabric, device or provider failed, or refused a resource.
    Transport,
}

/// A rule of the protocol the peer broke. The connection is closed; other connections are untouched.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Violation {
    /// A control message could not be decoded.
    #[error("malformed control message: {0}")]
    Malformed(#[from] WireError),
    /// The handshake was not ours or had an unsupported version.
    #[error("incompatible handshake: {0}")]
    Handshake(String),
    /// The peer's socket type differs from ours (stream vs seqpacket).
    #[error("socket type mismatch: we are {ours}, the peer is {theirs}")]
    SocketTypeMismatch {
        /// Our socket type ("stream" or "seqpacket").
        ours: &'static str,
        /// The socket type the peer's handshake announced.
        theirs: &'static str,
    },
    /// More control messages arrived than the receive buffers we granted.
    #[error("the peer sent beyond its {window} control-buffer credits")]
    CreditOverrun {
        /// The control-buffer credits we granted the peer.
        window: u32,
    },
    /// More advertisements arrived than the advert credits we granted (the UNH-EXS paper, 3.2).
    #[error("the peer sent advertisement {seq} beyond its {credits} advert credits")]
    AdvertOverrun {
        /// Sequence number of the advertisement that overran.
        seq: u32,
        /// The advert credits we granted the peer (our `recv_credits`).
        credits: u32,
    },
    /// More stream advertisements are waiting at this side than the advert credits we granted allow (without
    /// this bound a peer could queue any number).
    #[error(
        "the peer has {queued} stream advertisements waiting, beyond its {credits} advert credits"
    )]
    StreamAdvertOverrun {
        /// Stream advertisements waiting at this side, counting the one that overran.
        queued: usize,
        /// The advert credits we granted the peer.
        credits: u32,
    },
    /// An advertisement's sequence number is not the next one.
    #[error("advertisement out of order: expected {expected}, got {got}")]
    AdvertOutOfOrder {
        /// The sequence number we expected next.
        expected: u32,
        /// The sequence number the advertisement carried.
        got: u32,
    },
    /// An acknowledgment for an operation we never sent.
    #[error("acknowledgment for unknown advertisement {seq} (next unacked {oldest}, {outstanding} outstanding)")]
    UnknownAck {
        /// The cumulative acknowledgment count the peer sent.
        seq: u32,
        /// Sequence number of our oldest advertisement not yet acknowledged.
        oldest: u32,
        /// How many of our advertisements await an acknowledgment.
        outstanding: usize,
    },
    /// More credits were returned than we ever spent.
    #[error("{returned} credits returned with only {spent} outstanding")]
    CreditsBeyondWindow {
        /// Credits the peer returned in one message.
        returned: u32,
        /// Credits we had spent and not yet got back.
        spent: u32,
    },
    /// The peer returned none of our control-buffer credits for two keepalive intervals while our messages waited
    /// for them: its side of the protocol stopped (a peer that runs returns them as it processes our messages,
    /// whatever its application does; one stopped that long in a debugger or by SIGSTOP is closed too).
    #[error("the peer returned no control-buffer credits for two keepalive intervals while messages waited for them")]
    CreditsWithheld,
    /// More stream advertisements and window updates waited for the peer's control-buffer credits than one
    /// connection may hold: the peer kept writing into our stream buffer (which costs it no credit on some
    /// transports) while it returned none.
    #[error("{queued} stream advertisements and window updates waited for the peer's control-buffer credits, more than a connection may hold")]
    ControlBacklog {
        /// Control messages queued when the connection was closed.
        queued: usize,
    },
    /// An advertised length or address range does not fit.
    #[error("advertised range is invalid: {0}")]
    BadRange(String),
    /// A stream-protocol rule (phase, sequence, stream buffer) was broken (the dynamic stream protocol).
    #[error("stream protocol violation: {0}")]
    Stream(String),
    /// A message of a kind that this socket type or state does not accept.
    #[error("unexpected {kind} message {context}")]
    Unexpected {
        /// What arrived (a message kind, or a kind of transfer).
        kind: &'static str,
        /// Why it is not accepted here (the socket type or state).
        context: &'static str,
    },
    /// A persistent operation was refused by the rules of the UNH-EXS paper, 4.3.
    #[error("persistent operation refused: {0}")]
    Persistent(String),
    /// RDMA access by the peer was rejected by the hardware (bad key, bad bounds).
    #[error("remote access error reported by the transport: {0}")]
    RemoteAccess(String),
    /// The peer sent a message longer than the control receive buffers it was told of in the handshake (the
    /// device reported a local length error on our receive).
    #[error("a message longer than the receive buffers the peer was told of")]
    MessageTooLong,
}

/// How an asynchronous operation ended, when it did not succeed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum OpError {
    /// The operation was cancelled by a local close or abort before any of it reached the peer.
    #[error("cancelled by close")]
    Cancelled,
    /// A local abort (or a close whose linger time ran out) ended this send after part of it had been handed to
    /// the transport: the peer may have received some of it.
    #[error("aborted by a local close after part of it may have reached the peer")]
    Aborted,
    /// The peer closed the connection before this operation completed.
    #[error("the peer closed the connection")]
    PeerClosed,
    /// The connection was lost (peer gone, transport disconnected) before this operation completed.
    #[error("connection reset")]
    ConnectionReset,
    /// The peer broke the protocol; the connection was closed.
    #[error("peer misbehaved: {0}")]
    PeerMisbehaved(Violation),
    /// The connection attempt was refused (nobody listens, or the listener rejected it).
    #[error("connection refused")]
    Refused,
    /// The connection attempt or operation timed out.
    #[error("timed out")]
    TimedOut,
    /// The address could not be reached.
    #[error("address unreachable")]
    Unreachable,
    /// Something answered the connection at this address (named), but not as an exs peer does: it is another
    /// kind of server.
    #[error("{0} is not an exs peer (it does not speak exs's connection handshake)")]
    NotAPeer(String),
    /// The transport failed.
    #[error("transport failure: {0}")]
    Transport(TransportError),
    /// `sendfile`: reading the file failed after part of it had been sent.
    #[error("{0}")]
    File(FileError),
    /// An offset receive found that the peer had ended its persistent send (the UNH-EXS paper, 4.4).
    #[error("the peer ended its persistent send")]
    PersistentEnded,
    /// The context failed (a panic in its engine or transport: nothing in it can be trusted any more) and ended
    /// every operation; every later call of it fails the same way (`EIO` in the C API).
    #[error("the context failed: {0}")]
    ContextFailed(String),
}

impl From<crate::transport::WcError> for OpError {
    /// How a failed work request ends the operations that depended on it.
    fn from(e: crate::transport::WcError) -> Self {
        use crate::transport::WcError;
        match e {
            // The connection went down under the operation, or the peer stopped answering, or stopped taking
            // messages (no receive posted for one within its credits, beyond the retries).
            WcError::Flushed | WcError::RetryExceeded | WcError::RnrRetryExceeded => {
                OpError::ConnectionReset
            }
            WcError::RemoteAccess => OpError::PeerMisbehaved(Violation::RemoteAccess(
                "the peer's device refused our RDMA access".into(),
            )),
            // Not an argument of the caller's (it read as "invalid argument", EINVAL in C): the device's own.
            other => OpError::Transport(TransportError::RequestFailed(other)),
        }
    }
}

impl OpError {
    /// Whose fault it is.
    pub fn blame(&self) -> Blame {
        match self {
            OpError::Cancelled | OpError::Aborted | OpError::File(_) => Blame::Local,
            OpError::PeerClosed
            | OpError::ConnectionReset
            | OpError::PeerMisbehaved(_)
            | OpError::Refused
            | OpError::NotAPeer(_)
            | OpError::PersistentEnded => Blame::Peer,
            OpError::TimedOut
            | OpError::Unreachable
            | OpError::Transport(_)
            | OpError::ContextFailed(_) => Blame::Transport,
        }
    }

    /// The closest `std::io::ErrorKind`.
    pub fn io_kind(&self) -> io::ErrorKind {
        match self {
            // Not `Interrupted`: std's `read_to_end` and `read_exact` retry that, and a cancelled operation stays so.
            OpError::Cancelled => io::ErrorKind::ConnectionAborted,
            OpError::Aborted => io::ErrorKind::ConnectionAborted,
            OpError::File(e) => e.kind,
            OpError::PeerClosed => io::ErrorKind::BrokenPipe,
            OpError::ConnectionReset => io::ErrorKind::ConnectionReset,
            OpError::PeerMisbehaved(_) => io::ErrorKind::InvalidData,
            OpError::Refused => io::ErrorKind::ConnectionRefused,
            OpError::TimedOut => io::ErrorKind::TimedOut,
            OpError::Unreachable => io::ErrorKind::HostUnreachable,
            OpError::NotAPeer(_) => io::ErrorKind::InvalidData,
            OpError::Transport(e) => e.io_kind(),
            OpError::PersistentEnded => io::ErrorKind::NotFound,
            OpError::ContextFailed(_) => io::ErrorKind::Other,
        }
    }

    /// The error for an operation part of which may have reached the peer (`started`): a local cancellation
    /// becomes [`OpError::Aborted`], so no operation is reported `Cancelled` for bytes the peer received.
    pub(crate) fn once_started(self, started: bool) -> OpError {
        match self {
            OpError::Cancelled if started => OpError::Aborted,
            other => other,
        }
    }
}

/// Misuse of a buffer handed to an operation.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum BufferError {
    /// The range is not inside the memory region.
    #[error("range {start}..{end} is outside the region of {len} bytes")]
    OutOfRegion {
        /// Start of the requested range (bytes into the region).
        start: usize,
        /// End of the requested range (exclusive).
        end: usize,
        /// Length of the region.
        len: usize,
    },
    /// The region belongs to another context (device) than the socket.
    #[error("the memory region was registered with another context")]
    WrongContext,
    /// The range is already in use in a way that excludes this use: by a pending operation, or by a borrow of
    /// its bytes (`MemoryRegion::with_slice`) where the operation needs the trusted policy's key over the region.
    #[error("the buffer is in use: {0}")]
    Busy(DmaError),
    /// The region was deregistered.
    #[error("the memory region has been deregistered")]
    Deregistered,
    /// A zero-length buffer where the operation needs bytes.
    #[error("zero-length buffer not allowed here")]
    Empty,
}

impl From<DmaError> for BufferError {
    fn from(e: DmaError) -> Self {
        match e {
            DmaError::OutOfBounds { start, end, len } => {
                BufferError::OutOfRegion { start, end, len }
            }
            other => BufferError::Busy(other),
        }
    }
}

/// Misuse of a socket handle or state.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum StateError {
    /// The socket was closed (or never existed in this context).
    #[error("invalid or closed socket")]
    InvalidSocket,
    /// The socket is not connected yet.
    #[error("socket is not connected")]
    NotConnected,
    /// The socket is already connected.
    #[error("socket is already connected")]
    AlreadyConnected,
    /// A connection attempt of the socket is under way (`EALREADY` in the C API).
    #[error("a connection attempt of the socket is under way")]
    Connecting,
    /// The socket is listening; data operations and connects are not allowed (in the C API `ENOTCONN`, and
    /// `EISCONN` for a connect, as a TCP listener's).
    #[error("socket is listening")]
    Listening,
    /// The socket is not listening.
    #[error("socket is not listening")]
    NotListening,
    /// The socket is not bound to an address.
    #[error("socket is not bound")]
    NotBound,
    /// The socket is already bound.
    #[error("socket is already bound")]
    AlreadyBound,
    /// The sending (or receiving) direction was shut down.
    #[error("this direction of the socket was shut down")]
    Shutdown,
    /// The connection failed or was closed by the peer; new operations cannot start.
    #[error("the connection is down: {0}")]
    ConnectionDown(OpError),
    /// The operation does not apply to this socket type.
    #[error("operation not supported on a {0} socket")]
    WrongType(&'static str),
    /// A rule of persistent operations (the UNH-EXS paper, 4.2-4.4) forbids this now.
    #[error("persistent operations: {0}")]
    Persistent(&'static str),
    /// An offset transfer would reach outside the peer's persistent memory.
    #[error("offset {offset} + {len} bytes is outside the peer's {size}-byte persistent buffer")]
    OffsetOutOfRange {
        /// Requested offset.
        offset: u64,
        /// Bytes to transfer.
        len: u64,
        /// Size of the peer's persistent buffer.
        size: u64,
    },
}

/// The event queue cannot take another outstanding operation.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("event queue is full: {depth} operations already outstanding")]
pub struct QueueFull {
    /// The queue's depth.
    pub depth: usize,
}

macro_rules! op_error {
    ($(#[$m:meta])* $name:ident { $($(#[$vm:meta])* $var:ident($ty:ty) => $blame:expr, $kind:expr;)* }) => {
        $(#[$m])*
        #[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
        #[non_exhaustive]
        pub enum $name {
            $(
                $(#[$vm])*
                #[error(transparent)]
                $var(
                    #[doc = concat!("The underlying [`", stringify!($ty), "`].")]
                    #[from]
                    $ty
                ),
            )*
        }

        impl $name {
            /// Whose fault it is.
            pub fn blame(&self) -> Blame {
                #[allow(unused_variables)]
                match self { $($name::$var(e) => ($blame)(e),)* }
            }

            /// The closest `std::io::ErrorKind`.
            pub fn io_kind(&self) -> io::ErrorKind {
                #[allow(unused_variables)]
                match self { $($name::$var(e) => ($kind)(e),)* }
            }
        }

        impl From<$name> for io::Error {
            fn from(e: $name) -> io::Error {
                io::Error::new(e.io_kind(), e)
            }
        }
    };
}

fn state_kind(e: &StateError) -> io::ErrorKind {
    match e {
        StateError::InvalidSocket => io::ErrorKind::InvalidInput,
        StateError::NotConnected | StateError::NotBound | StateError::NotListening => {
            io::ErrorKind::NotConnected
        }
        StateError::AlreadyConnected | StateError::AlreadyBound | StateError::Connecting => {
            io::ErrorKind::AlreadyExists
        }
        StateError::Listening => io::ErrorKind::NotConnected,
        StateError::WrongType(_) => io::ErrorKind::Unsupported,
        StateError::Shutdown => io::ErrorKind::BrokenPipe,
        StateError::Persistent(_) | StateError::OffsetOutOfRange { .. } => {
            io::ErrorKind::InvalidInput
        }
        StateError::ConnectionDown(e) => e.io_kind(),
    }
}

impl From<StateError> for io::Error {
    fn from(e: StateError) -> Self {
        io::Error::new(state_kind(&e), e)
    }
}

fn state_blame(e: &StateError) -> Blame {
    match e {
        StateError::ConnectionDown(op) => op.blame(),
        _ => Blame::Local,
    }
}

fn buffer_kind(e: &BufferError) -> io::ErrorKind {
    match e {
        BufferError::Busy(_) => io::ErrorKind::ResourceBusy,
        _ => io::ErrorKind::InvalidInput,
    }
}

op_error! {
    /// Why `send` (exs_send) was refused.
    SendError {
        /// The socket's handle or state does not allow it: the caller's fault, or the peer's or the transport's
        /// when the connection is down.
        State(StateError) => state_blame, state_kind;
        /// The buffer cannot be used (out of its region, busy, deregistered): the caller's fault.
        Buffer(BufferError) => |_| Blame::Local, buffer_kind;
        /// The event queue is full: the caller's fault (dequeue events first; it maps to `WouldBlock`).
        Queue(QueueFull) => |_| Blame::Local, |_| io::ErrorKind::WouldBlock;
        /// A socket option could not be read or set: the caller's fault.
        Option(OptionError) => |_| Blame::Local, |_| io::ErrorKind::InvalidInput;
        /// The transport refused or failed: the transport's fault.
        Transport(TransportError) => |_| Blame::Transport, |e: &TransportError| e.io_kind();
        /// `sendfile`: the file could not be read.
        File(FileError) => |_| Blame::Local, |e: &FileError| e.kind;
        /// `sendfile`: its bounce buffer could not be registered.
        Memory(MemoryError) => |e: &MemoryError| e.blame(), |_| io::ErrorKind::OutOfMemory;
    }
}

/// A file could not be read (`sendfile`).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("reading the file: {message}")]
#[non_exhaustive]
pub struct FileError {
    /// The `std::io::ErrorKind` of the read.
    pub kind: io::ErrorKind,
    /// The operating system's error code, when a system call failed (`EBADF` for a descriptor not open for
    /// reading, `EISDIR`, `EMFILE` for exs's own copy of the descriptor): the C API's `errno`.
    pub os_error: Option<i32>,
    /// Its message.
    pub message: String,
}

impl From<io::Error> for FileError {
    fn from(e: io::Error) -> Self {
        FileError {
            kind: e.kind(),
            os_error: e.raw_os_error(),
            message: e.to_string(),
        }
    }
}

op_error! {
    /// Why `poll` (exs_poll) was refused at once.
    PollError {
        /// The socket's handle or state does not allow it: the caller's fault, or the peer's or the transport's
        /// when the connection is down.
        State(StateError) => state_blame, state_kind;
        /// The event queue is full: the caller's fault (dequeue events first; it maps to `WouldBlock`).
        Queue(QueueFull) => |_| Blame::Local, |_| io::ErrorKind::WouldBlock;
    }
}

op_error! {
    /// Why `recv` (exs_recv) was refused.
    RecvError {
        /// The socket's handle or state does not allow it: the caller's fault, or the peer's or the transport's
        /// when the connection is down.
        State(StateError) => state_blame, state_kind;
        /// The buffer cannot be used (out of its region, busy, deregistered): the caller's fault.
        Buffer(BufferError) => |_| Blame::Local, buffer_kind;
        /// The event queue is full: the caller's fault (dequeue events first; it maps to `WouldBlock`).
        Queue(QueueFull) => |_| Blame::Local, |_| io::ErrorKind::WouldBlock;
        /// A socket option could not be read or set: the caller's fault.
        Option(OptionError) => |_| Blame::Local, |_| io::ErrorKind::InvalidInput;
        /// The transport refused or failed: the transport's fault.
        Transport(TransportError) => |_| Blame::Transport, |e: &TransportError| e.io_kind();
    }
}

op_error! {
    /// Why `connect` (exs_connect) was refused at once. Later failures arrive in the event.
    ConnectError {
        /// The socket's handle or state does not allow it: the caller's fault, or the peer's or the transport's
        /// when the connection is down.
        State(StateError) => state_blame, state_kind;
        /// The event queue is full: the caller's fault (dequeue events first; it maps to `WouldBlock`).
        Queue(QueueFull) => |_| Blame::Local, |_| io::ErrorKind::WouldBlock;
        /// The transport refused or failed: the transport's fault.
        Transport(TransportError) => |_| Blame::Transport, |e: &TransportError| e.io_kind();
    }
}

op_error! {
    /// Why `accept` (exs_accept) was refused at once.
    AcceptError {
        /// The socket's handle or state does not allow it: the caller's fault, or the peer's or the transport's
        /// when the connection is down.
        State(StateError) => state_blame, state_kind;
        /// The event queue is full: the caller's fault (dequeue events first; it maps to `WouldBlock`).
        Queue(QueueFull) => |_| Blame::Local, |_| io::ErrorKind::WouldBlock;
        /// The transport refused or failed: the transport's fault.
        Transport(TransportError) => |_| Blame::Transport, |e: &TransportError| e.io_kind();
    }
}

op_error! {
    /// Why `bind`/`listen`/`socket` (exs_bind, exs_listen, exs_socket) failed.
    SocketError {
        /// The socket's handle or state does not allow it: the caller's fault, or the peer's or the transport's
        /// when the connection is down.
        State(StateError) => state_blame, state_kind;
        /// The transport refused or failed: the transport's fault.
        Transport(TransportError) => |_| Blame::Transport, |e: &TransportError| e.io_kind();
    }
}

op_error! {
    /// Why `close`/`shutdown` (exs_close) failed.
    CloseError {
        /// The socket's handle or state does not allow it: the caller's fault, or the peer's or the transport's
        /// when the connection is down.
        State(StateError) => state_blame, state_kind;
        /// The event queue is full: the caller's fault (dequeue events first; it maps to `WouldBlock`).
        Queue(QueueFull) => |_| Blame::Local, |_| io::ErrorKind::WouldBlock;
    }
}

/// Why an option could not be read or set (exs_fcntl).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum OptionError {
    /// The option can only change before the connection is established (a listener's at any time, for the
    /// connections set up after the change).
    #[error("option {0} cannot change once the connection is set up")]
    Locked(&'static str),
    /// The value is out of the allowed range.
    #[error("option {name}: {value} is out of range ({allowed})")]
    OutOfRange {
        /// The option's name.
        name: &'static str,
        /// The value that was refused.
        value: u64,
        /// The allowed range, in words.
        allowed: &'static str,
    },
    /// The socket is invalid or closed.
    #[error(transparent)]
    State(#[from] StateError),
}

impl OptionError {
    /// Whose fault it is (always the caller's).
    pub fn blame(&self) -> Blame {
        Blame::Local
    }
}

impl From<OptionError> for io::Error {
    fn from(e: OptionError) -> io::Error {
        io::Error::new(io::ErrorKind::InvalidInput, e)
    }
}

/// Why memory registration (exs_mregister) or deregistration (exs_mderegister) failed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum MemoryError {
    /// Pending operations or exposed remote keys still use the region.
    #[error("the region is still used by {leases} pending operation(s) or remote key(s)")]
    InUse {
        /// Pending operations and remote keys still holding a lease on the region.
        leases: usize,
    },
    /// The transport refused the registration.
    #[error(transparent)]
    Transport(#[from] TransportError),
    /// A zero-length region.
    #[error("cannot register zero bytes")]
    Empty,
    /// The memory could not be had (a length beyond the address space, or the system refused it).
    #[error("cannot allocate {len} bytes")]
    NoMemory {
        /// What was asked for.
        len: usize,
    },
    /// The device kept the memory: undoing its registration, or revoking a key over it, failed in the device,
    /// which may still reach the memory, so it is never handed back (memory of the program's own, as the C API's,
    /// must never be freed or reused).
    #[error(
        "the device kept the memory (undoing its registration or a key failed): never handed back"
    )]
    Kept,
}

impl MemoryError {
    /// Whose fault it is.
    pub fn blame(&self) -> Blame {
        match self {
            MemoryError::Transport(_) | MemoryError::Kept => Blame::Transport,
            _ => Blame::Local,
        }
    }
}

impl From<MemoryError> for io::Error {
    fn from(e: MemoryError) -> io::Error {
        let kind = match &e {
            MemoryError::InUse { .. } => io::ErrorKind::ResourceBusy,
            MemoryError::Transport(t) => t.io_kind(),
            MemoryError::Empty => io::ErrorKind::InvalidInput,
            MemoryError::NoMemory { .. } => io::ErrorKind::OutOfMemory,
            MemoryError::Kept => io::ErrorKind::Other,
        };
        io::Error::new(kind, e)
    }
}

/// Why `dequeue` (exs_qdequeue) returned without the events asked for.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DequeueError {
    /// The timeout expired before enough events arrived (the events that did arrive were returned first).
    #[error("timed out waiting for events")]
    TimedOut,
    /// Bad arguments (min greater than max, or max zero).
    #[error("invalid dequeue arguments: {0}")]
    Invalid(&'static str),
    /// In the simulated fabric only: nothing can ever arrive (every endpoint is idle), so waiting would hang.
    #[error("deadlock: {waiting} event(s) awaited, {outstanding} operation(s) outstanding, and the fabric is idle")]
    Stalled {
        /// Events the dequeue waited for.
        waiting: usize,
        /// Operations outstanding on the queue.
        outstanding: usize,
    },
}

impl DequeueError {
    /// Whose fault it is.
    pub fn blame(&self) -> Blame {
        match self {
            DequeueError::TimedOut => Blame::Transport,
            DequeueError::Invalid(_) | DequeueError::Stalled { .. } => Blame::Local,
        }
    }
}

impl From<DequeueError> for io::Error {
    fn from(e: DequeueError) -> io::Error {
        let kind = match &e {
            DequeueError::TimedOut => io::ErrorKind::TimedOut,
            DequeueError::Invalid(_) => io::ErrorKind::InvalidInput,
            DequeueError::Stalled { .. } => io::ErrorKind::WouldBlock,
        };
        io::Error::new(kind, e)
    }
}

impl From<OpError> for io::Error {
    fn from(e: OpError) -> io::Error {
        io::Error::new(e.io_kind(), e)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_convert_to_io_with_fitting_kind_and_blame() {
        let e = SendError::from(StateError::NotConnected);
        assert_eq!(e.blame(), Blame::Local);
        assert_eq!(io::Error::from(e).kind(), io::ErrorKind::NotConnected);

        let e = RecvError::from(BufferError::Busy(DmaError::InUse { leases: 1 }));
        assert_eq!(io::Error::from(e).kind(), io::ErrorKind::ResourceBusy);

        let e = SendError::from(QueueFull { depth: 4 });
        assert_eq!(io::Error::from(e).kind(), io::ErrorKind::WouldBlock);

        let down = StateError::ConnectionDown(OpError::PeerMisbehaved(Violation::CreditOverrun {
            window: 4,
        }));
        let e = SendError::from(down);
        assert_eq!(e.blame(), Blame::Peer);
        assert_eq!(io::Error::from(e).kind(), io::ErrorKind::InvalidData);

        assert_eq!(OpError::Refused.io_kind(), io::ErrorKind::ConnectionRefused);
        assert_eq!(OpError::TimedOut.io_kind(), io::ErrorKind::TimedOut);
        assert_ne!(OpError::Refused.io_kind(), OpError::TimedOut.io_kind());
    }
}

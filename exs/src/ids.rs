//! The small values a socket is named and described by, below everything that uses them.

/// A socket's number within its context (what an ES-API file descriptor is): from 1 to [`SocketId::LAST`], then
/// round again from 1, skipping the numbers of sockets the context still holds. Two sockets of a context never
/// have the same number at once.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SocketId(pub u32);

impl SocketId {
    /// The highest socket number, 2^29 - 1: well within a C `int` (a file descriptor's type), which leaves the C
    /// API room to number its queues and memory handles apart from sockets (a handle of one kind passed for
    /// another is then `EBADF`, not another object).
    pub const LAST: u32 = (1 << 29) - 1;
}

/// Readiness found by `poll` (ES-API `exs_poll`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Readiness {
    /// A receive would find data (or end-of-stream) at once.
    pub readable: bool,
    /// A send would be taken at once (credits available); on a stream socket it may still wait behind a `sendfile`
    /// started before it ([`Socket::sendfile`](crate::Socket::sendfile)).
    pub writable: bool,
    /// The connection failed.
    pub error: bool,
    /// The peer closed.
    pub hangup: bool,
}

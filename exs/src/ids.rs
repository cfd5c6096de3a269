//! The small values a socket is named and described by, below everything that uses them.

/// A socket's number within its context (what an ES-API file descriptor is).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SocketId(pub u32);

/// Readiness found by `poll` (ES-API `exs_poll`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Readiness {
    /// A receive would find data (or end-of-stream) at once.
    pub readable: bool,
    /// A send would start at once (credits available).
    pub writable: bool,
    /// The connection failed.
    pub error: bool,
    /// The peer closed.
    pub hangup: bool,
}

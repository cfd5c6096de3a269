//! # exs: Extended Sockets over RDMA
//!
//! The transport-independent core of `exs`, a Rust implementation of the Extended Sockets API (ES-API) and the
//! UNH-EXS protocols: sockets with asynchronous operations and registered memory, over any RDMA [`Transport`].
//!
//! ```text
//!  application ── Socket / EventQueue / MemoryRegion        (socket.rs, event.rs, memory.rs)
//!                      │
//!                 Context + Engine: one progress thread      (context.rs, engine.rs)
//!                      │
//!                 proto: link credits, message mode, stream  (proto/)
//!                      │ work requests, completions
//!                 Transport trait ── backends: verbs, libfabric, simulated fabric (transport.rs, sim/)
//! ```
//!
//! The wire format lives in [`wire`]. Memory handed to the hardware is leased (crate `exs-dma`), so a buffer
//! outlives every work request and remote key that names it. FFI and raw pointers live only in the backends; `unsafe` is forbidden here.
//!
//! Sources: seed 001 (dynamic stream protocol), seed 002 (UNH-EXS paper: ES-API, message mode, credits,
//! immediate data, persistent operations), seed 003 (shared receive queue), seed 004 (adaptive completion wait).

#![forbid(unsafe_code)]
#![deny(missing_docs)]

mod budget;
pub mod context;
mod engine;
pub mod error;
pub mod event;
mod exposure;
mod lock;
pub mod memory;
mod open;
pub mod options;
mod progress;
mod proto;
pub mod sendfile;
pub mod socket;
mod stats;
mod stream_io;
/// A crafted peer for tests (feature `testing`): a bare transport speaking the wire format, no engine.
#[cfg(feature = "testing")]
pub mod testing;
#[cfg(feature = "tokio")]
pub mod tokio;
/// The seam between the protocol and hardware: the [`Transport`] trait every backend implements (crate
/// `exs-transport`, below both exs and the backends).
pub use exs_transport as transport;
#[cfg(feature = "testing")]
pub mod wire;
#[cfg(not(feature = "testing"))]
#[allow(dead_code)]
mod wire;

#[cfg(feature = "sim")]
pub mod sim;

pub use context::{
    Clock, Context, ContextOptions, ManualDriver, Progress, SharedRecv, SystemClock,
};
pub use engine::EngineStats;
pub use error::{
    AcceptError, Blame, BufferError, CloseError, ConnectError, DequeueError, FileError,
    MemoryError, OpError, OptionError, PollError, QueueFull, RecvError, SendError, SocketError,
    StateError, Violation,
};
pub use event::{Event, EventFlags, EventKind, EventQueue, QueueStats, WaitMode};
pub use exposure::ExposurePolicy;
pub use memory::{MemoryRegion, Slice};
#[cfg(feature = "fabric")]
pub use open::fabric;
#[cfg(feature = "sim")]
pub use open::sim_addr;
#[cfg(feature = "verbs")]
pub use open::verbs;
pub use open::{compiled, Backend, BackendKind, UnknownBackend};
pub use options::{MsgFlags, SockType, SocketOption, SocketOptions};
pub use progress::ProgressStats;
pub use proto::link::LinkStats;
pub use proto::message::MessageStats;
pub use proto::pool::PoolStats;
pub use proto::stream::{StreamStats, StreamTrace};
pub use socket::{ConnStats, Readiness, Socket, SocketId};
pub use stream_io::{Listener, Stream, STREAM_IO_BUFFER};
pub use transport::{Capabilities, Transport, TransportError};

/// The ES-API version this library implements (`EXS_VERSION`).
pub const EXS_VERSION: u32 = 1;

/// Why [`init`] refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("ES-API version {requested} requested; this library implements version {EXS_VERSION}")]
pub struct InitError {
    /// The version the caller asked for.
    pub requested: u32,
}

impl From<InitError> for std::io::Error {
    fn from(e: InitError) -> std::io::Error {
        std::io::Error::new(std::io::ErrorKind::Unsupported, e)
    }
}

/// Checks that the caller speaks our ES-API version (ES-API `exs_init(EXS_VERSION)`).
///
/// Devices are opened by the backends; [`Context::new`] then wraps one.
pub fn init(version: u32) -> Result<(), InitError> {
    if version != EXS_VERSION {
        return Err(InitError { requested: version });
    }
    Ok(())
}

/// The README's code, compiled as doc tests (its first program must stay true).
#[cfg(doctest)]
#[doc = include_str!("../../README.md")]
pub struct ReadmeDoctests;

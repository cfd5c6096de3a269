//! # exs: Extended Sockets over RDMA
//!
//! Sockets whose data moves by RDMA: the Extended Sockets API (ES-API) and the UNH-EXS protocols, with
//! asynchronous operations on registered memory and event queues, zero copy where the protocol allows it. The same
//! program runs on InfiniBand, RoCE and iWARP adapters (rdma-core verbs), on anything libfabric drives (its `tcp`
//! provider needs no RDMA at all), and on a simulated fabric for tests. Above the ES-API calls sit [`Stream`] and
//! [`Listener`] (`std::io`, like `std::net`) and `exs::tokio` streams.
//!
//! ```toml
//! [dependencies]
//! exs = { version = "0.1", features = ["fabric"] }   # libfabric; "verbs" for rdma-core, or both
//! ```
//!
//! ## A blocking echo
//!
//! A [`Listener`] and a [`Stream`] behave like `std::net`'s `TcpListener` and `TcpStream`: code that uses what they
//! share (connect, bind, accept, incoming, reading and writing, shutdown, timeouts, non-blocking streams,
//! `set_nodelay`, `try_clone`, the addresses) ports by renaming; the rest of `std::net` (`peek`, `take_error`, TTLs,
//! a non-blocking or cloned listener) is not there. [`Listener::bind`] and [`Stream::connect`] run on the
//! process's [default context](default_context), opened on first use with the backend the environment names (as
//! [`Context::from_env`]); `bind_in` and `connect_in` take a [`Context`] of your own.
//!
//! ```
//! # #[cfg(feature = "fabric")] {
//! # std::env::set_var("EXS_BACKEND", "fabric"); // the test's backend, whatever else the build enables
//! use std::io::{Read, Write};
//!
//! let listener = exs::Listener::bind("127.0.0.1:0")?;
//! let addr = listener.local_addr()?;
//! let echo = std::thread::spawn(move || -> std::io::Result<()> {
//!     let (mut s, _peer) = listener.accept()?;
//!     let mut buf = [0u8; 4096];
//!     loop {
//!         let n = s.read(&mut buf)?;
//!         if n == 0 {
//!             return Ok(()); // end of stream
//!         }
//!         s.write_all(&buf[..n])?;
//!     }
//! });
//! let mut c = exs::Stream::connect(addr)?;
//! c.write_all(b"hello over RDMA")?;
//! let mut back = [0u8; 15];
//! c.read_exact(&mut back)?;
//! assert_eq!(&back, b"hello over RDMA");
//! c.shutdown(std::net::Shutdown::Write)?;
//! echo.join().unwrap()?;
//! # }
//! # Ok::<(), std::io::Error>(())
//! ```
//!
//! ## With tokio
//!
//! Feature `tokio`: `exs::tokio::Listener` and `Stream` have `tokio::net`'s shapes; the stream implements
//! `AsyncRead` and `AsyncWrite`, and its event queues' descriptors go into tokio's reactor, so no thread waits per
//! connection.
//!
//! ```
//! # #[cfg(all(feature = "fabric", feature = "tokio"))] {
//! # std::env::set_var("EXS_BACKEND", "fabric"); // the test's backend, whatever else the build enables
//! use tokio::io::{AsyncReadExt, AsyncWriteExt};
//!
//! # tokio::runtime::Builder::new_multi_thread().enable_all().build()?.block_on(async {
//! let listener = exs::tokio::Listener::bind("127.0.0.1:0").await?;
//! let addr = listener.local_addr()?;
//! let echo = tokio::spawn(async move {
//!     let (mut s, _) = listener.accept().await?;
//!     let mut buf = [0u8; 4096];
//!     loop {
//!         let n = s.read(&mut buf).await?;
//!         if n == 0 {
//!             return s.shutdown().await;
//!         }
//!         s.write_all(&buf[..n]).await?;
//!     }
//! });
//! let mut c = exs::tokio::Stream::connect(addr).await?;
//! c.write_all(b"hello, async").await?;
//! c.shutdown().await?;
//! let mut back = Vec::new();
//! c.read_to_end(&mut back).await?;
//! assert_eq!(back, b"hello, async");
//! echo.await.unwrap()
//! # })?;
//! # }
//! # Ok::<(), std::io::Error>(())
//! ```
//!
//! ## Features
//!
//! | feature | what it adds |
//! | --- | --- |
//! | `fabric` | the libfabric backend (`exs::fabric`): MSG endpoints, the `tcp` provider by default, `verbs` and others by name; needs libfabric >= 1.17 (`libfabric-dev`) |
//! | `verbs` | the rdma-core backend (`exs::verbs`): verbs and rdma_cm on InfiniBand, RoCE, iWARP, Soft-RoCE, soft-iWARP; needs `libibverbs-dev` and `librdmacm-dev` |
//! | `tokio` | `exs::tokio`: async streams and listeners, `EventQueue::next_async` |
//! | `sim` | `exs::sim`: the simulated fabric, deterministic and with fault injection (implies `testing`) |
//! | `testing` | `exs::wire` (the wire format) and `testing::RawPeer`, a crafted peer for tests and fuzzing |
//!
//! No feature is on by default: a program names the backends it wants. Building either backend needs clang
//! (bindgen) and pkg-config.
//!
//! ## Building for speed
//!
//! A message's path runs through this crate, the transport and memory crates and a backend. Compiled apart (the
//! release profile's default), they inline into each other only what is generic or marked; a program that wants
//! the shortest path builds as one unit, as the `exs` tool is built:
//!
//! ```toml
//! [profile.release]
//! lto = "fat"
//! codegen-units = 1
//! ```
//!
//! Fewer instructions and instruction-cache misses per message: the bench README measures both ("Built as one
//! unit").
//!
//! ## Choosing a backend
//!
//! With several backends compiled in, the program picks one at run time: [`Context::from_env`] reads
//! `EXS_BACKEND` (`verbs`, `fabric`, `sim`) and the backend's settings (`EXS_ADDR` and `EXS_DEVICE` for verbs,
//! `EXS_PROVIDER`, `EXS_DOMAIN` and `EXS_FABRIC_CQ_WAIT` for libfabric). Unset or `auto`, it takes verbs when an RDMA device carries
//! `EXS_ADDR`, else libfabric, else the simulator when it is the only backend compiled in: features are additive, and
//! [`Context::backend`] says which was taken. [`Context::open`] takes a [`Backend`] and its configuration in code instead; [`compiled`] lists
//! what this build offers. The [backends chapter](manual::backends) of the manual has every setting.
//!
//! ## The main types
//!
//! - [`Context`]: one device (a backend's transport) with its progress; every other object belongs to one.
//! - [`Socket`]: the ES-API calls: asynchronous `connect`, `accept`, `send`, `recv`, persistent operations,
//!   `sendfile`, `poll`; each completes with one [`Event`] on the [`EventQueue`] it names.
//! - [`EventQueue`]: where events arrive; waits adaptively, and is a file descriptor for `epoll` or tokio.
//! - [`MemoryRegion`]: registered memory; a [`Slice`] of it names what an operation reads or writes, leased until
//!   the operation's event.
//! - [`Stream`], [`Listener`]: `std::io` over SOCK_STREAM sockets, for code written against `std::net`.
//! - [`stats`]: what a context, a connection and an event queue counted ([`Context::stats`], [`Socket::stats`],
//!   [`EventQueue::stats`]).
//! - Errors are typed per operation ([`SendError`], [`RecvError`], [`ConnectError`], ...) and convert into
//!   `std::io::Error`; an operation's failure arrives in its event as an [`OpError`].
//!
//! ## The manual
//!
//! [`manual`] explains how the ES-API maps onto RDMA and the protocols behind it: [message
//! mode](manual::message_mode) and persistent memory (R. D. Russell, *A General-Purpose API for iWARP and
//! InfiniBand*), [stream mode](manual::stream_mode) (the design note *Dynamic UNH EXS Stream Protocol*), [the shared
//! receive pool](manual::shared_pool) (uDAPL's shared receive queue), [progress and waiting](manual::progress) (the
//! adaptive completion wait of *Efficient event completion in UDAPL*), [memory and keys](manual::memory), and
//! [reliability](manual::reliability).
//!
//! ```text
//!  application ── Socket / EventQueue / MemoryRegion, Stream / Listener
//!                      │
//!                 Context + engine: progress in the thread that waits, or one progress thread
//!                      │
//!                 protocols: link credits, message mode, stream mode
//!                      │ work requests, completions
//!                 Transport trait ── backends: verbs, libfabric, simulated fabric
//! ```
//!
//! Memory handed to the hardware is leased (crate `exs-dma`), so a buffer outlives every work request and remote
//! key that names it. FFI and raw pointers live only in the backends; `unsafe` is forbidden in this crate.

#![forbid(unsafe_code)]
#![deny(missing_docs)]

mod budget;
mod config;
mod context;
mod engine;
mod error;
mod event;
mod exposure;
mod ids;
mod lock;
pub mod manual;
mod memory;
mod open;
mod options;
mod progress;
mod proto;
mod sendfile;
mod socket;
pub mod stats;
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

pub use config::{Clock, ContextOptions, ManualDriver, Progress, SharedRecv, SystemClock};
pub use context::{Context, WeakContext};
pub use error::{
    AcceptError, Blame, BufferError, CloseError, ConnectError, DequeueError, FileError,
    MemoryError, OpError, OptionError, PollError, QueueFull, RecvError, SendError, SocketError,
    StateError, Violation,
};
pub use event::{Event, EventFlags, EventKind, EventQueue, WaitMode};
pub use exposure::ExposurePolicy;
pub use memory::{MemoryRegion, Slice};
#[cfg(feature = "fabric")]
pub use open::fabric;
#[cfg(feature = "sim")]
pub use open::sim_addr;
#[cfg(feature = "verbs")]
pub use open::verbs;
pub use open::{compiled, Backend, BackendKind, UnknownBackend};
pub use options::{MsgFlags, SockType, SocketOptions};
pub use sendfile::{SENDFILE_CHUNK, SENDFILE_DEPTH};

pub use ids::{Readiness, SocketId};
pub use socket::Socket;
pub use stream_io::{default_context, Listener, Stream, StreamConfig};
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

//! Streams with the shape of `std::net`: [`Stream`] is a connected SOCK_STREAM socket that
//! implements `std::io::Read` and `Write` (on `&Stream` too, as `TcpStream` does), [`Listener`] accepts them.
//! Code written for `TcpStream` / `TcpListener` ports by renaming as long as it keeps to the calls they share:
//! connect (with a timeout too), bind, accept, `incoming`, `Read`/`Write`, `shutdown`, read and write timeouts,
//! `set_nonblocking` on a stream, `set_nodelay`, `try_clone` of a stream, `local_addr`/`peer_addr`. Not there:
//! `peek`, `take_error`, TTLs and the other socket options, `set_nonblocking` and `try_clone` of a listener (the
//! tokio streams likewise lack `readable`/`try_read`/`try_write`). [`Stream::connect`] and [`Listener::bind`] open
//! the process's [default context](default_context) on first use (the backend chosen by the cargo features and
//! the environment, as [`Context::from_env`]); the `_in` forms take a context.
//!
//! Registered buffers are managed inside, per stream ([`StreamConfig`]): several receives posted ahead into which
//! the peer writes directly, and a send ring with several sends in flight, so the wire does not wait for the
//! application's copy nor the copy for the wire (what each byte costs: `core.rs`). The zero-copy path stays the
//! ES-API calls on [`Socket`], which [`Stream::socket`] hands out.
//!
//! The semantics are TCP's: a write returns once its bytes are copied and on their way; `flush` has nothing to
//! wait for; `shutdown(Write)` queues end-of-stream behind the bytes written and returns (a peer that does not
//! read does not hold it up); a read after `shutdown(Read)` returns end-of-stream; a read error (the peer's
//! reset) is returned by one read, after every byte before it, and the reads after it return end-of-stream (a
//! write error stays, for every later write); dropping the last handle
//! closes gracefully (the bytes written are delivered, within the context's linger time, in the background, also
//! when the context's last handle goes with it). One difference from TCP: the close runs in this process, not in
//! a kernel, so a process that exits right after dropping a stream cuts what is still on its way. A program that
//! must know its peer has everything does what a careful TCP program does: `shutdown(Write)`, then read until the
//! peer's end-of-stream.
//!
//! A second difference: before the server's application accepts a connection, the connection holds no receive
//! buffers at the server (so that connections nobody takes cost the server nothing beyond their set-up), where a
//! kernel buffers a TCP connection's first bytes before the accept. A client's writes wait for the accept: a
//! client that writes and closes gets its bytes delivered if the server accepts within the client's linger time
//! ([`ContextOptions::linger`](crate::ContextOptions::linger), 10 s by default); past it the close resets the
//! connection. A server busy elsewhere accepts on a thread (or task) of its own, as a loop over
//! [`Listener::incoming`] does.
//!
//! ```
//! # #[cfg(feature = "sim")] {
//! use std::io::{Read, Write};
//! let world = exs::sim::World::threaded(exs::sim::SimConfig::default());
//! let (server, client) = (world.host(), world.host());
//! let listener = exs::Listener::bind_in(&server, world.addr(0, 9000)).unwrap();
//! let echo = std::thread::spawn(move || {
//!     let (mut s, _peer) = listener.accept().unwrap();
//!     let mut buf = [0u8; 5];
//!     s.read_exact(&mut buf).unwrap();
//!     s.write_all(&buf).unwrap();
//! });
//! let mut c = exs::Stream::connect_in(&client, world.addr(0, 9000)).unwrap();
//! c.write_all(b"hello").unwrap();
//! let mut back = [0u8; 5];
//! c.read_exact(&mut back).unwrap();
//! assert_eq!(&back, b"hello");
//! echo.join().unwrap();
//! # }
//! ```

use std::io;
use std::net::SocketAddr;
use std::sync::Mutex;
use std::time::Duration;

use crate::context::Context;
use crate::error::DequeueError;
use crate::event::{Event, EventQueue};
use crate::options::SockType;
use crate::socket::Socket;

mod blocking;
mod core;

pub use blocking::{Listener, Stream};
#[cfg(feature = "tokio")]
pub(crate) use core::{is_wake, wake_each};
pub(crate) use core::{Failure, ReadSink, Reader, SliceSink, Writer};

/// How a stream of this module buffers; the defaults suit bulk transfers and request/response alike.
///
/// Memory per stream: `recv_buffer` from the start (its receives are posted at once), `send_buffer` from the first
/// write; both registered with the context. The protocol's own stream buffer (the dynamic stream protocol's
/// intermediate buffer, [`SocketOptions::stream_buffer_size`](crate::SocketOptions::stream_buffer_size), 1 MiB) comes on top,
/// and only once the peer writes when no receive is advertised.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct StreamConfig {
    /// Bytes of the send ring (default 1 MiB): how much a writer may have in flight before a write waits.
    pub send_buffer: usize,
    /// Most bytes of one send (default 512 KiB, half the ring): a large write is cut into sends of this size, so
    /// that the ring's space comes back piece by piece while the next piece is copied in.
    pub send_piece: usize,
    /// Bytes of the receive buffer (default 1 MiB), cut into `recv_pieces` receives posted ahead.
    pub recv_buffer: usize,
    /// Receives posted ahead (default 2): the peer's sends go directly into them (zero copy on the wire) while
    /// the reader copies out of the ones filled before. Each receive costs an advertisement to the peer and a
    /// completion, so fewer, larger receives move bulk data with less work per byte; two keep one filling while
    /// the other is read. Taken as at least 1 and at most 256, and at most `recv_buffer` (a receive holds a byte
    /// at least).
    pub recv_pieces: usize,
    /// How long a connection attempt may take, longer or shorter than the context's (`None`: the context's
    /// `connect_timeout`, 10 s by default).
    pub connect_timeout: Option<Duration>,
}

impl Default for StreamConfig {
    fn default() -> Self {
        StreamConfig {
            send_buffer: 1 << 20,
            send_piece: 512 << 10,
            recv_buffer: 1 << 20,
            recv_pieces: 2,
            connect_timeout: None,
        }
    }
}

/// The process's default context, opened on first use as [`Context::from_env`] opens one (the backend
/// [`Backend::from_env`](crate::Backend::from_env) chooses: the one `EXS_BACKEND` names, else verbs when an RDMA
/// device carries `EXS_ADDR`, else libfabric, else the simulator when it is the only backend compiled in) and kept
/// for the process's life:
/// [`Stream::connect`], [`Listener::bind`] and their tokio forms run on it. A failed opening is not kept (the
/// next call tries again).
pub fn default_context() -> io::Result<Context> {
    let mut d = DEFAULT.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(c) = &*d {
        return Ok(c.clone());
    }
    let c = Context::from_env()?;
    *d = Some(c.clone());
    Ok(c)
}

/// The default context (see [`default_context`]) if it is open already; `None` while another thread opens it,
/// without waiting for that: tokio's tasks look here on the runtime's threads, and the opening (in the blocking
/// pool) holds the lock for as long as it takes (review finding: every task that looked meanwhile held its
/// runtime thread that long).
#[cfg_attr(not(feature = "tokio"), allow(dead_code))]
pub(crate) fn default_context_if_open() -> Option<Context> {
    match DEFAULT.try_lock() {
        Ok(d) => d.clone(),
        Err(std::sync::TryLockError::Poisoned(p)) => p.into_inner().clone(),
        Err(std::sync::TryLockError::WouldBlock) => None,
    }
}

static DEFAULT: Mutex<Option<Context>> = Mutex::new(None);

/// The first success of `f` over `addrs`, or the last error.
pub(crate) fn each_addr<T>(
    addrs: impl IntoIterator<Item = SocketAddr>,
    mut f: impl FnMut(SocketAddr) -> io::Result<T>,
) -> io::Result<T> {
    let mut last = None;
    for a in addrs {
        match f(a) {
            Ok(t) => return Ok(t),
            Err(e) => last = Some(e),
        }
    }
    Err(last.unwrap_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "no address to use")))
}

/// Starts a connection attempt: the socket, and the queue its `Connect` event comes to.
/// Starts a stream connection to `addr` that fails after `timeout` (`None`: the context's `connect_timeout`).
pub(crate) fn start_connect(
    ctx: &Context,
    addr: SocketAddr,
    timeout: Option<std::time::Duration>,
) -> io::Result<(Socket, EventQueue)> {
    let sock = Socket::new(ctx, SockType::Stream)?;
    let eq = EventQueue::new(2)?;
    sock.connect_within(&eq, addr, timeout, 0)?;
    Ok((sock, eq))
}

/// The end of a connection attempt to `addr`: its event, or the wait's error (a timeout ends the attempt). A
/// timeout says that nothing at `addr` finished exs's handshake (a silent server, or no host).
pub(crate) fn end_connect(
    sock: &Socket,
    addr: SocketAddr,
    ev: Result<Event, DequeueError>,
) -> io::Result<()> {
    let timed_out = || {
        io::Error::new(
            io::ErrorKind::TimedOut,
            format!("connecting to {addr}: timed out; no exs peer answered"),
        )
    };
    match ev {
        Ok(ev) => match ev.status {
            Ok(()) => Ok(()),
            Err(crate::error::OpError::TimedOut) => Err(timed_out()),
            Err(e) => Err(e.into()),
        },
        Err(DequeueError::TimedOut) => {
            let _ = sock.abort();
            Err(timed_out())
        }
        Err(e) => Err(e.into()),
    }
}

/// A listening stream socket at `addr`.
pub(crate) fn listen(ctx: &Context, addr: SocketAddr) -> io::Result<Socket> {
    let sock = Socket::new(ctx, SockType::Stream)?;
    sock.bind(addr)?;
    sock.listen(0)?;
    Ok(sock)
}

/// The socket an `Accept` event carries, and its peer's address.
pub(crate) fn accepted(mut ev: Event) -> io::Result<(Socket, SocketAddr)> {
    let sock = ev.take_accepted();
    std::mem::replace(&mut ev.status, Ok(())).map_err(io::Error::from)?;
    let sock = sock.ok_or_else(|| io::Error::other("an accept event without its socket"))?;
    // Recorded at set-up: a connection whose peer already wrote and closed before the accept was taken is
    // accepted with its bytes and end of stream to read, as TCP's is (its live address is gone by then).
    let peer = sock
        .recorded_peer_addr()?
        .ok_or_else(|| io::Error::other("an accepted socket without a peer address"))?;
    Ok((sock, peer))
}

/// A socket's address, or `NotConnected`.
pub(crate) fn addr_of(
    a: Result<Option<SocketAddr>, crate::error::StateError>,
) -> io::Result<SocketAddr> {
    a?.ok_or_else(|| io::Error::new(io::ErrorKind::NotConnected, "no address"))
}

/// `set_nodelay`: TCP_NODELAY is coalescing off (small writes leave at once even while a write is in flight).
pub(crate) fn set_nodelay(sock: &Socket, nodelay: bool) -> io::Result<()> {
    sock.update_options(|o| o.with_coalesce(!nodelay))
        .map_err(io::Error::from)
}

/// See [`set_nodelay`].
pub(crate) fn nodelay(sock: &Socket) -> io::Result<bool> {
    Ok(!sock.options()?.coalesce)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Review finding: see [`default_context_if_open`].
    #[test]
    fn a_look_at_the_default_context_does_not_wait_for_its_opening() {
        // Held as an opening thread holds it.
        let opening = DEFAULT.lock().unwrap_or_else(|p| p.into_inner());
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let _ = tx.send(default_context_if_open().is_none());
        });
        let looked = rx.recv_timeout(Duration::from_secs(5));
        drop(opening);
        assert_eq!(looked, Ok(true), "the look waited for the opening");
    }
}

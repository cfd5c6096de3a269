//! Blocking streams with the shape of `std::net` (issue 16): [`Stream`] is a connected SOCK_STREAM socket that
//! implements `std::io::Read` and `Write`, [`Listener`] accepts them. Registered buffers are managed inside (one
//! copy in each direction, between them and the caller's slices); the zero-copy path stays the ES-API calls on
//! [`Socket`], which [`Stream::socket`] hands out.
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

use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, ToSocketAddrs};
use std::time::Duration;

use crate::context::Context;
use crate::error::{DequeueError, OpError};
use crate::event::{EventKind, EventQueue};
use crate::memory::MemoryRegion;
use crate::options::{MsgFlags, SockType};
use crate::socket::Socket;

/// Bytes of each internal registered buffer (one for reads, one for writes).
pub const STREAM_IO_BUFFER: usize = 256 * 1024;

fn other(e: impl std::fmt::Display) -> io::Error {
    io::Error::other(e.to_string())
}

/// A dequeue's timeout as `std` reports it on Unix: `WouldBlock`.
fn wait_err(e: DequeueError) -> io::Error {
    match e {
        DequeueError::TimedOut => io::Error::new(io::ErrorKind::WouldBlock, "timed out"),
        e => io::Error::from(e),
    }
}

/// What a connected stream needs whichever way its caller waits: the socket, its queue, the registered buffers and
/// the steps that never block (the blocking [`Stream`] and the async `exs::tokio::Stream` wait between them).
#[derive(Debug)]
pub(crate) struct Core {
    pub(crate) sock: Socket,
    pub(crate) eq: EventQueue,
    rx: MemoryRegion,
    tx: MemoryRegion,
    /// Bytes received into `rx` not yet read: `rx[at..end]`.
    at: usize,
    end: usize,
    /// A receive is posted.
    recv_posted: bool,
    /// A send is in flight.
    send_posted: bool,
    /// A write shutdown is in flight / done.
    pub(crate) shutdown_posted: bool,
    pub(crate) shutdown_done: bool,
    pub(crate) eof: bool,
    /// Events taken from the queue so far, by the direction that waits for them: `[receives, sends and
    /// shutdowns]` (an async caller compares them across a step, see `exs::tokio`).
    pub(crate) absorbed: [u64; 2],
}

impl Core {
    pub(crate) fn new(ctx: &Context, sock: Socket, eq: EventQueue) -> io::Result<Core> {
        Ok(Core {
            sock,
            eq,
            rx: MemoryRegion::alloc(ctx, STREAM_IO_BUFFER)?,
            tx: MemoryRegion::alloc(ctx, STREAM_IO_BUFFER)?,
            at: 0,
            end: 0,
            recv_posted: false,
            send_posted: false,
            shutdown_posted: false,
            shutdown_done: false,
            eof: false,
            absorbed: [0; 2],
        })
    }

    /// Takes in one event of this stream's queue.
    pub(crate) fn absorb(&mut self, ev: crate::event::Event) -> io::Result<()> {
        self.absorbed[usize::from(ev.kind != EventKind::Recv)] += 1;
        match ev.kind {
            EventKind::Recv => {
                self.recv_posted = false;
                ev.status.map_err(io::Error::from)?;
                if ev.flags.eof {
                    self.eof = true;
                }
                self.at = 0;
                self.end = ev.bytes;
            }
            EventKind::Send => {
                self.send_posted = false;
                ev.status.map_err(io::Error::from)?;
            }
            EventKind::Shutdown => {
                self.shutdown_posted = false;
                self.shutdown_done = true;
                ev.status.map_err(io::Error::from)?;
            }
            _ => {}
        }
        Ok(())
    }

    /// Takes in whatever is queued, without waiting.
    pub(crate) fn absorb_queued(&mut self) -> io::Result<()> {
        let mut evs = Vec::new();
        self.eq.poll(&mut evs, 8);
        for ev in evs {
            self.absorb(ev)?;
        }
        Ok(())
    }

    /// Bytes (or end-of-stream: 0) if there are some now; otherwise makes sure a receive is posted and says
    /// `None`: wait for the queue, then call again.
    pub(crate) fn try_read(&mut self, buf: &mut [u8]) -> io::Result<Option<usize>> {
        if buf.is_empty() {
            return Ok(Some(0));
        }
        self.absorb_queued()?;
        if self.at == self.end {
            if self.eof {
                return Ok(Some(0));
            }
            if !self.recv_posted {
                self.sock
                    .recv(&self.eq, &self.rx.all(), MsgFlags::NONE, 0)
                    .map_err(io::Error::from)?;
                self.recv_posted = true;
            }
            return Ok(None);
        }
        let n = buf.len().min(self.end - self.at);
        self.rx.read(self.at, &mut buf[..n]).map_err(other)?;
        self.at += n;
        Ok(Some(n))
    }

    /// Copies up to [`STREAM_IO_BUFFER`] bytes into the registered send buffer and sends them, once the previous
    /// send has completed (`None` until then: wait for the queue, then call again).
    pub(crate) fn try_write(&mut self, buf: &[u8]) -> io::Result<Option<usize>> {
        if buf.is_empty() {
            return Ok(Some(0));
        }
        self.absorb_queued()?;
        if self.send_posted {
            return Ok(None);
        }
        let n = buf.len().min(STREAM_IO_BUFFER);
        self.tx.write(0, &buf[..n]).map_err(other)?;
        self.sock
            .send(&self.eq, &self.tx.slice(..n), MsgFlags::NONE, 0)
            .map_err(io::Error::from)?;
        self.send_posted = true;
        Ok(Some(n))
    }

    /// Whether every byte written has left.
    pub(crate) fn try_flush(&mut self) -> io::Result<bool> {
        self.absorb_queued()?;
        Ok(!self.send_posted)
    }

    /// Shuts the writing side down once the bytes written have left; `true` when done.
    pub(crate) fn try_shutdown(&mut self) -> io::Result<bool> {
        if !self.try_flush()? {
            return Ok(false);
        }
        if !self.shutdown_posted && !self.shutdown_done {
            match self.sock.shutdown(&self.eq, 1) {
                Ok(()) => {}
                // The peer closed the whole connection: there is no writing side left to shut down.
                Err(crate::error::CloseError::State(crate::error::StateError::ConnectionDown(
                    crate::error::OpError::PeerClosed,
                ))) => {
                    self.shutdown_done = true;
                    return Ok(true);
                }
                Err(e) => return Err(e.into()),
            }
            self.shutdown_posted = true;
            self.absorb_queued()?;
        }
        Ok(self.shutdown_done)
    }

    pub(crate) fn local_addr(&self) -> io::Result<SocketAddr> {
        self.sock
            .local_addr()?
            .ok_or_else(|| io::Error::new(io::ErrorKind::NotConnected, "no local address"))
    }

    pub(crate) fn peer_addr(&self) -> io::Result<SocketAddr> {
        self.sock
            .peer_addr()?
            .ok_or_else(|| io::Error::new(io::ErrorKind::NotConnected, "no peer address"))
    }
}

/// A connected stream, like `std::net::TcpStream`. A write returns once its bytes are in the registered send
/// buffer and sent (an error of that send comes with the next write or `flush`); `flush` waits until they have
/// left.
#[derive(Debug)]
pub struct Stream {
    core: Core,
    read_timeout: Option<Duration>,
    write_timeout: Option<Duration>,
}

impl Stream {
    /// Connects on `ctx` to the first address of `addr` that answers (like TCP's, the connection completes when
    /// the listener has set it up, before its application accepts it).
    pub fn connect_in(ctx: &Context, addr: impl ToSocketAddrs) -> io::Result<Stream> {
        let mut last = io::Error::new(io::ErrorKind::InvalidInput, "no address to connect to");
        for a in addr.to_socket_addrs()? {
            match Self::connect_one(ctx, a) {
                Ok(s) => return Ok(s),
                Err(e) => last = e,
            }
        }
        Err(last)
    }

    fn connect_one(ctx: &Context, addr: SocketAddr) -> io::Result<Stream> {
        let sock = Socket::new(ctx, SockType::Stream)?;
        let eq = EventQueue::new(8);
        sock.connect(addr, &eq, 0)?;
        let ev = eq.next(None).map_err(io::Error::from)?;
        ev.status.map_err(|e| match e {
            // A connect timer ran out: nothing at `addr` finished exs's handshake (a silent server, or no host).
            OpError::TimedOut => io::Error::new(
                io::ErrorKind::TimedOut,
                format!("connecting to {addr}: timed out; no exs peer answered"),
            ),
            other => io::Error::from(other),
        })?;
        Self::from_socket(ctx, sock, eq)
    }

    fn from_socket(ctx: &Context, sock: Socket, eq: EventQueue) -> io::Result<Stream> {
        Ok(Stream {
            core: Core::new(ctx, sock, eq)?,
            read_timeout: None,
            write_timeout: None,
        })
    }

    /// The ES-API socket underneath (zero-copy sends and receives of registered memory).
    pub fn socket(&self) -> &Socket {
        &self.core.sock
    }

    /// This side's address.
    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        self.core.local_addr()
    }

    /// The peer's address.
    pub fn peer_addr(&self) -> io::Result<SocketAddr> {
        self.core.peer_addr()
    }

    /// Shuts the writing side down (the peer reads end-of-stream after the bytes already written), like
    /// `TcpStream::shutdown`. Shutting the reading side down only stops this side's reads.
    pub fn shutdown(&mut self, how: Shutdown) -> io::Result<()> {
        if matches!(how, Shutdown::Read | Shutdown::Both) {
            self.core.eof = true;
        }
        if matches!(how, Shutdown::Write | Shutdown::Both) {
            while !self.core.try_shutdown()? {
                self.wait(self.write_timeout)?;
            }
        }
        Ok(())
    }

    /// How long a read may wait (`None`: for ever); a read that waits longer fails with `WouldBlock`.
    pub fn set_read_timeout(&mut self, t: Option<Duration>) -> io::Result<()> {
        if t == Some(Duration::ZERO) {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "zero timeout"));
        }
        self.read_timeout = t;
        Ok(())
    }

    /// How long a write may wait for the previous bytes to leave (`None`: for ever).
    pub fn set_write_timeout(&mut self, t: Option<Duration>) -> io::Result<()> {
        if t == Some(Duration::ZERO) {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "zero timeout"));
        }
        self.write_timeout = t;
        Ok(())
    }

    /// See [`Stream::set_read_timeout`].
    pub fn read_timeout(&self) -> io::Result<Option<Duration>> {
        Ok(self.read_timeout)
    }

    /// See [`Stream::set_write_timeout`].
    pub fn write_timeout(&self) -> io::Result<Option<Duration>> {
        Ok(self.write_timeout)
    }

    /// Waits for one event of the stream's queue and takes it in.
    fn wait(&mut self, timeout: Option<Duration>) -> io::Result<()> {
        let ev = self.core.eq.next(timeout).map_err(wait_err)?;
        self.core.absorb(ev)
    }
}

impl Read for Stream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        loop {
            if let Some(n) = self.core.try_read(buf)? {
                return Ok(n);
            }
            self.wait(self.read_timeout)?;
        }
    }
}

impl Write for Stream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        loop {
            if let Some(n) = self.core.try_write(buf)? {
                return Ok(n);
            }
            self.wait(self.write_timeout)?;
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        while !self.core.try_flush()? {
            self.wait(self.write_timeout)?;
        }
        Ok(())
    }
}

/// Accepts streams, like `std::net::TcpListener`.
#[derive(Debug)]
pub struct Listener {
    sock: Socket,
    ctx: Context,
    eq: EventQueue,
}

impl Listener {
    /// Listens on `ctx` at the first address of `addr` that can be bound (port 0: one is chosen).
    pub fn bind_in(ctx: &Context, addr: impl ToSocketAddrs) -> io::Result<Listener> {
        let mut last = io::Error::new(io::ErrorKind::InvalidInput, "no address to bind");
        for a in addr.to_socket_addrs()? {
            let sock = Socket::new(ctx, SockType::Stream)?;
            match sock.bind(a).and_then(|()| sock.listen(0).map(|_| ())) {
                Ok(()) => {
                    return Ok(Listener {
                        sock,
                        ctx: ctx.clone(),
                        eq: EventQueue::new(4),
                    })
                }
                Err(e) => last = e.into(),
            }
        }
        Err(last)
    }

    /// The address it listens on.
    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        self.sock
            .local_addr()?
            .ok_or_else(|| io::Error::new(io::ErrorKind::NotConnected, "not bound"))
    }

    /// Waits for a connection; returns it and the peer's address.
    pub fn accept(&self) -> io::Result<(Stream, SocketAddr)> {
        self.sock.accept(&self.eq, 0)?;
        let mut ev = self.eq.next(None).map_err(io::Error::from)?;
        ev.status.map_err(io::Error::from)?;
        let sock = ev
            .accepted
            .take()
            .ok_or_else(|| other("an accept event without its socket"))?;
        let peer = sock
            .peer_addr()?
            .ok_or_else(|| other("an accepted socket without a peer address"))?;
        let s = Stream::from_socket(&self.ctx, sock, EventQueue::new(8))?;
        Ok((s, peer))
    }

    /// Connections as they come, for ever (like `TcpListener::incoming`).
    pub fn incoming(&self) -> impl Iterator<Item = io::Result<Stream>> + '_ {
        std::iter::repeat_with(move || self.accept().map(|(s, _)| s))
    }
}

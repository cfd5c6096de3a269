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
use crate::error::DequeueError;
use crate::event::{EventKind, EventQueue};
use crate::memory::MemoryRegion;
use crate::options::{MsgFlags, SockType};
use crate::socket::Socket;

/// Bytes of each internal registered buffer (one for reads, one for writes).
pub const STREAM_IO_BUFFER: usize = 256 * 1024;

/// A connected stream, like `std::net::TcpStream`.
#[derive(Debug)]
pub struct Stream {
    sock: Socket,
    eq: EventQueue,
    rx: MemoryRegion,
    tx: MemoryRegion,
    /// Bytes received into `rx` not yet read: `rx[at..end]`.
    at: usize,
    end: usize,
    /// A receive is posted (a read timed out waiting for it).
    recv_posted: bool,
    /// A send is in flight (a write timed out waiting for it).
    send_posted: bool,
    eof: bool,
    read_timeout: Option<Duration>,
    write_timeout: Option<Duration>,
}

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

impl Stream {
    /// Connects on `ctx` to the first address of `addr` that answers.
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
        ev.status.map_err(io::Error::from)?;
        Self::from_socket(ctx, sock, eq)
    }

    fn from_socket(ctx: &Context, sock: Socket, eq: EventQueue) -> io::Result<Stream> {
        Ok(Stream {
            sock,
            eq,
            rx: MemoryRegion::alloc(ctx, STREAM_IO_BUFFER)?,
            tx: MemoryRegion::alloc(ctx, STREAM_IO_BUFFER)?,
            at: 0,
            end: 0,
            recv_posted: false,
            send_posted: false,
            eof: false,
            read_timeout: None,
            write_timeout: None,
        })
    }

    /// The ES-API socket underneath (zero-copy sends and receives of registered memory).
    pub fn socket(&self) -> &Socket {
        &self.sock
    }

    /// This side's address.
    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        self.sock
            .local_addr()?
            .ok_or_else(|| io::Error::new(io::ErrorKind::NotConnected, "no local address"))
    }

    /// The peer's address.
    pub fn peer_addr(&self) -> io::Result<SocketAddr> {
        self.sock
            .peer_addr()?
            .ok_or_else(|| io::Error::new(io::ErrorKind::NotConnected, "no peer address"))
    }

    /// Shuts the writing side down (the peer reads end-of-stream after the bytes already written), like
    /// `TcpStream::shutdown`. Shutting the reading side down only stops this side's reads.
    pub fn shutdown(&mut self, how: Shutdown) -> io::Result<()> {
        if matches!(how, Shutdown::Read | Shutdown::Both) {
            self.eof = true;
        }
        if matches!(how, Shutdown::Write | Shutdown::Both) {
            self.finish_send(None)?;
            self.sock.shutdown(&self.eq, 1)?;
            loop {
                let ev = self.eq.next(None).map_err(io::Error::from)?;
                if ev.kind == EventKind::Shutdown {
                    ev.status.map_err(io::Error::from)?;
                    break;
                }
                self.absorb(ev)?;
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

    /// How long a write may wait for the bytes to leave (`None`: for ever).
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

    /// An event that is not the one being waited for (receives and sends share the queue).
    fn absorb(&mut self, ev: crate::event::Event) -> io::Result<()> {
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
            _ => {}
        }
        Ok(())
    }

    /// Waits for the send in flight, if any.
    fn finish_send(&mut self, timeout: Option<Duration>) -> io::Result<()> {
        while self.send_posted {
            let ev = self.eq.next(timeout).map_err(wait_err)?;
            self.absorb(ev)?;
        }
        Ok(())
    }
}

impl Read for Stream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if buf.is_empty() {
            return Ok(0);
        }
        while self.at == self.end {
            if self.eof {
                return Ok(0);
            }
            if !self.recv_posted {
                self.sock
                    .recv(&self.eq, &self.rx.all(), MsgFlags::NONE, 0)
                    .map_err(io::Error::from)?;
                self.recv_posted = true;
            }
            let ev = self.eq.next(self.read_timeout).map_err(wait_err)?;
            self.absorb(ev)?;
        }
        let n = buf.len().min(self.end - self.at);
        self.rx.read(self.at, &mut buf[..n]).map_err(other)?;
        self.at += n;
        Ok(n)
    }
}

impl Write for Stream {
    /// Copies up to [`STREAM_IO_BUFFER`] bytes into the registered send buffer and sends them; returns once
    /// they have left (a stream send completes when its bytes are at the peer).
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        if buf.is_empty() {
            return Ok(0);
        }
        self.finish_send(self.write_timeout)?;
        let n = buf.len().min(STREAM_IO_BUFFER);
        self.tx.write(0, &buf[..n]).map_err(other)?;
        self.sock
            .send(&self.eq, &self.tx.slice(..n), MsgFlags::NONE, 0)
            .map_err(io::Error::from)?;
        self.send_posted = true;
        self.finish_send(self.write_timeout)?;
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.finish_send(self.write_timeout)
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

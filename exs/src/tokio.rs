//! Async streams for tokio (feature `tokio`): [`Stream`] implements `AsyncRead` and `AsyncWrite`,
//! [`Listener`] accepts them, and [`EventQueue::next_async`] waits for any queue. An event queue's descriptor
//! (readable while events are queued, see [`EventQueue::readiness_fd`]) goes into tokio's reactor as an `AsyncFd`:
//! no thread per queue, no busy polling; the context's progress thread moves the protocol meanwhile, so contexts
//! used here must keep their default `Progress::Thread`.
//!
//! ```
//! # #[cfg(feature = "sim")]
//! # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
//! use tokio::io::{AsyncReadExt, AsyncWriteExt};
//! let world = exs::sim::World::threaded(exs::sim::SimConfig::default());
//! let (server, client) = (world.host(), world.host());
//! let listener = exs::tokio::Listener::bind_in(&server, world.addr(0, 9200)).unwrap();
//! let echo = tokio::spawn(async move {
//!     let (mut s, _) = listener.accept().await.unwrap();
//!     let mut buf = [0u8; 5];
//!     s.read_exact(&mut buf).await.unwrap();
//!     s.write_all(&buf).await.unwrap();
//!     s.flush().await.unwrap();
//! });
//! let mut c = exs::tokio::Stream::connect_in(&client, world.addr(0, 9200)).await.unwrap();
//! c.write_all(b"hello").await.unwrap();
//! let mut back = [0u8; 5];
//! c.read_exact(&mut back).await.unwrap();
//! assert_eq!(&back, b"hello");
//! echo.await.unwrap();
//! # });
//! ```

use std::io;
use std::net::{SocketAddr, ToSocketAddrs};
use std::os::fd::{AsFd, AsRawFd, OwnedFd, RawFd};
use std::pin::Pin;
use std::task::{ready, Context as TaskContext, Poll};

use tokio::io::unix::AsyncFd;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use crate::context::Context;
use crate::event::{Event, EventQueue};
use crate::options::SockType;
use crate::socket::Socket;
use crate::stream_io::Core;

/// A queue's readiness descriptor, duplicated so that each `AsyncFd` registers a descriptor of its own.
struct QueueFd(OwnedFd);

impl AsRawFd for QueueFd {
    fn as_raw_fd(&self) -> RawFd {
        self.0.as_raw_fd()
    }
}

fn async_fd(eq: &EventQueue) -> io::Result<AsyncFd<QueueFd>> {
    let fd = eq.readiness_fd()?.try_clone_to_owned()?;
    // tokio's newer registration call asks its caller to promise that the descriptor stays open and the same for
    // the AsyncFd's life, which this crate (no promises of that kind allowed here) keeps by construction: `QueueFd`
    // owns it (an `OwnedFd`, closed only when the AsyncFd drops it) and always returns it. `new` is the same call
    // without the promise marker (deprecated for callers that cannot keep it).
    #[allow(deprecated)]
    AsyncFd::new(QueueFd(fd))
}

/// Waits until `eq` has an event, then takes it.
async fn next_event(eq: &EventQueue, fd: &AsyncFd<QueueFd>) -> io::Result<Event> {
    loop {
        let mut evs = Vec::with_capacity(1);
        if eq.poll(&mut evs, 1) == 1 {
            return Ok(evs.pop().expect("one event"));
        }
        let mut guard = fd.readable().await?;
        if eq.is_empty() {
            // Not cleared if the descriptor was signalled since the guard was taken (tokio tracks that).
            guard.clear_ready();
        }
    }
}

impl EventQueue {
    /// Waits, without blocking the thread, for the next event (feature `tokio`).
    pub async fn next_async(&self) -> io::Result<Event> {
        let fd = async_fd(self)?;
        next_event(self, &fd).await
    }
}

/// A connected stream, like `tokio::net::TcpStream`.
pub struct Stream {
    core: Core,
    fd: AsyncFd<QueueFd>,
}

impl std::fmt::Debug for Stream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Stream").field("core", &self.core).finish()
    }
}

impl Stream {
    /// Connects on `ctx` to the first address of `addr` that answers (once the listener accepts).
    pub async fn connect_in(ctx: &Context, addr: impl ToSocketAddrs) -> io::Result<Stream> {
        let mut last = io::Error::new(io::ErrorKind::InvalidInput, "no address to connect to");
        for a in addr.to_socket_addrs()? {
            let sock = Socket::new(ctx, SockType::Stream)?;
            let eq = EventQueue::new(8);
            let fd = async_fd(&eq)?;
            sock.connect(a, &eq, 0)?;
            let ev = next_event(&eq, &fd).await?;
            match ev.status {
                Ok(()) => {
                    return Ok(Stream {
                        core: Core::new(ctx, sock, eq)?,
                        fd,
                    })
                }
                Err(e) => last = e.into(),
            }
        }
        Err(last)
    }

    /// The ES-API socket underneath.
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

    /// Runs `step` until it has an answer, waiting on the queue's descriptor in between.
    /// One step of `dir` (0: reading, 1: writing, flushing, shutting down) under the task's waker.
    fn poll_step<T>(
        &mut self,
        cx: &mut TaskContext<'_>,
        dir: usize,
        mut step: impl FnMut(&mut Core) -> io::Result<Option<T>>,
    ) -> Poll<io::Result<T>> {
        loop {
            let absorbed = self.core.absorbed;
            let done = step(&mut self.core)?;
            if self.core.absorbed[1 - dir] != absorbed[1 - dir] {
                // The step took events that the other direction waits for (a read's data while flushing, say).
                // The queue's descriptor went back to not readable with them, so the reactor may never report the
                // edge they made (epoll drops an edge whose condition is gone): wake this task so that whatever
                // waits for them is polled again, whether this step finished or not. Without it hyper, which polls
                // read then flush in one task, hung with the request's bytes absorbed by a flush that had nothing
                // to wait for (`a_read_absorbed_by_a_finished_flush_wakes_the_reader`), or by one that did
                // (`a_read_absorbed_while_flushing_wakes_the_reader`).
                cx.waker().wake_by_ref();
                if done.is_none() {
                    return Poll::Pending;
                }
            }
            if let Some(t) = done {
                return Poll::Ready(Ok(t));
            }
            if self.core.absorbed != absorbed {
                // Its own events, and still not done: look again before sleeping on the descriptor.
                continue;
            }
            let mut guard = ready!(self.fd.poll_read_ready(cx))?;
            if self.core.eq.is_empty() {
                guard.clear_ready();
            }
        }
    }
}

impl AsyncRead for Stream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut TaskContext<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let n = ready!(this.poll_step(cx, 0, |c| c.try_read(buf.initialize_unfilled())))?;
        buf.advance(n);
        Poll::Ready(Ok(()))
    }
}

impl AsyncWrite for Stream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut TaskContext<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        self.get_mut().poll_step(cx, 1, |c| c.try_write(buf))
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut TaskContext<'_>) -> Poll<io::Result<()>> {
        self.get_mut()
            .poll_step(cx, 1, |c| Ok(c.try_flush()?.then_some(())))
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut TaskContext<'_>) -> Poll<io::Result<()>> {
        self.get_mut()
            .poll_step(cx, 1, |c| Ok(c.try_shutdown()?.then_some(())))
    }
}

/// Accepts streams, like `tokio::net::TcpListener`.
pub struct Listener {
    sock: Socket,
    ctx: Context,
    eq: EventQueue,
    fd: AsyncFd<QueueFd>,
}

impl std::fmt::Debug for Listener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Listener")
            .field("sock", &self.sock)
            .finish()
    }
}

impl Listener {
    /// Listens on `ctx` at the first address of `addr` that can be bound.
    pub fn bind_in(ctx: &Context, addr: impl ToSocketAddrs) -> io::Result<Listener> {
        let mut last = io::Error::new(io::ErrorKind::InvalidInput, "no address to bind");
        for a in addr.to_socket_addrs()? {
            let sock = Socket::new(ctx, SockType::Stream)?;
            match sock.bind(a).and_then(|()| sock.listen(0).map(|_| ())) {
                Ok(()) => {
                    let eq = EventQueue::new(4);
                    let fd = async_fd(&eq)?;
                    return Ok(Listener {
                        sock,
                        ctx: ctx.clone(),
                        eq,
                        fd,
                    });
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

    /// Waits for a connection; returns it and the peer's address. Not cancel-safe: a dropped `accept` leaves its
    /// accept posted, and the next call gets that connection.
    pub async fn accept(&self) -> io::Result<(Stream, SocketAddr)> {
        if self.eq.outstanding() == 0 && self.eq.is_empty() {
            self.sock.accept(&self.eq, 0)?;
        }
        let mut ev = next_event(&self.eq, &self.fd).await?;
        ev.status.map_err(io::Error::from)?;
        let sock = ev
            .accepted
            .take()
            .ok_or_else(|| io::Error::other("an accept event without its socket"))?;
        let peer = sock
            .peer_addr()?
            .ok_or_else(|| io::Error::other("an accepted socket without a peer address"))?;
        let eq = EventQueue::new(8);
        let fd = async_fd(&eq)?;
        Ok((
            Stream {
                core: Core::new(&self.ctx, sock, eq)?,
                fd,
            },
            peer,
        ))
    }
}

impl AsFd for Listener {
    fn as_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        self.eq.as_fd()
    }
}

//! Async streams for tokio (feature `tokio`): [`Stream`] implements `AsyncRead` and
//! `AsyncWrite`, [`Listener`] accepts them, and [`EventQueue::next_async`] waits for any queue. Each direction of
//! a stream has its own event queue, whose descriptor (its `AsFd`, readable while events are queued) goes into
//! tokio's reactor as an `AsyncFd`: no thread per queue, and a task that reads never takes the writer's
//! completions (or the other way round). Contexts used here must keep their default `Progress::Thread`.
//!
//! A task that waits on a stream waits as a blocking stream's thread does (see the manual's
//! [progress chapter](crate::manual::progress)): the adaptive wait's short spin (learned from the queue's recent
//! waits; off while they are long), then it leads the stream's context, running its protocol
//! and sleeping on the transport's descriptor through the reactor, so that a completion wakes the task waiting for
//! it rather than the progress thread first. While another thread or task leads, it sleeps on its queue's
//! descriptor. The progress thread takes the lead back from a task that stops being polled while it leads (its
//! read dropped by a `select!`, its runtime stalled) a few milliseconds after the task would have been woken.
//!
//! The shapes are `tokio::net`'s: [`Stream::connect`] and [`Listener::bind`] resolve names with
//! `tokio::net::lookup_host` (never a blocking lookup in an `async fn`) and run on the process's
//! [default context](crate::default_context); the `_in` forms take a context. [`Stream::into_split`] and
//! [`Stream::split`] give halves that a reading and a writing task can own. Buffers and semantics are those of
//! [`crate::Stream`] (see [`crate::StreamConfig`]).
//!
//! # Cancellation safety
//! As tokio documents its own: [`Listener::accept`] is cancel safe (a connection accepted for a call that was
//! dropped goes to the next call). Reading (`AsyncReadExt::read` and the rest over `poll_read`) is cancel safe:
//! bytes are taken from the stream only by a poll that returns them. Writing (`write`, over `poll_write`) is
//! cancel safe: bytes are copied and sent only by a poll that returns their count. `write_all` and `read_exact`
//! are not, as with any tokio stream (part may have been moved). [`Stream::connect`] is not: dropping it abandons
//! the attempt.
//!
//! ```
//! # #[cfg(feature = "sim")]
//! # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
//! use tokio::io::{AsyncReadExt, AsyncWriteExt};
//! let world = exs::sim::World::threaded(exs::sim::SimConfig::default());
//! let (server, client) = (world.host(), world.host());
//! let listener = exs::tokio::Listener::bind_in(&server, world.addr(0, 9200)).await.unwrap();
//! let echo = tokio::spawn(async move {
//!     let (mut s, _) = listener.accept().await.unwrap();
//!     let mut buf = [0u8; 5];
//!     s.read_exact(&mut buf).await.unwrap();
//!     s.write_all(&buf).await.unwrap();
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
use std::net::SocketAddr;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::pin::Pin;
use std::task::{ready, Context as TaskContext, Poll};

use tokio::io::unix::AsyncFd;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use crate::context::Context;
use crate::event::{AsyncWait, Event, EventQueue};
use crate::socket::Socket;
use crate::stream_io::{self as sio, Reader, StreamConfig, Writer};

mod lead;
mod split;

pub use split::{OwnedReadHalf, OwnedWriteHalf, ReadHalf, ReuniteError, WriteHalf};

/// A queue's readiness descriptor, duplicated so that each `AsyncFd` registers a descriptor of its own.
struct QueueFd(OwnedFd);

impl AsRawFd for QueueFd {
    fn as_raw_fd(&self) -> RawFd {
        self.0.as_raw_fd()
    }
}

/// `fd` duplicated into the current runtime's reactor.
fn async_fd(fd: BorrowedFd<'_>) -> io::Result<AsyncFd<QueueFd>> {
    let fd = fd.try_clone_to_owned()?;
    // tokio's newer registration call asks its caller to promise that the descriptor stays open and the same for
    // the AsyncFd's life, which this crate (no promises of that kind allowed here) keeps by construction: `QueueFd`
    // owns it (an `OwnedFd`, closed only when the AsyncFd drops it) and always returns it. `new` is the same call
    // without the promise marker (deprecated for callers that cannot keep it).
    #[allow(deprecated)]
    AsyncFd::new(QueueFd(fd))
}

/// Waits until `eq` has an event, then takes it. It does not lead its context as a stream's wait does
/// ([`Waiter::poll_until`]): accepts, connects and `next_async` leave the protocol to the progress thread meanwhile.
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

/// How one direction of a stream waits: its queue's descriptor in the reactor, the adaptive wait's state, and its
/// part in leading the context.
struct Waiter {
    fd: AsyncFd<QueueFd>,
    wait: AsyncWait,
    lead: lead::TaskLead,
}

impl Waiter {
    fn new(eq: &EventQueue) -> io::Result<Waiter> {
        Ok(Waiter {
            fd: async_fd(eq.as_fd())?,
            wait: AsyncWait::default(),
            lead: lead::TaskLead::default(),
        })
    }

    /// Runs `step` until it has an answer. In between, the task waits as a blocking stream's thread does (see
    /// [`crate::progress`]): after the adaptive wait's spin (seed 004: [`EventQueue::spin_before_park`]) it leads
    /// the stream's context, sleeping on the transport's descriptor through the reactor (see [`lead`]), or, while
    /// another thread or task leads, on its queue's descriptor until its events come or the leader lets go.
    fn poll_until<T>(
        &mut self,
        eq: &EventQueue,
        cx: &mut TaskContext<'_>,
        mut step: impl FnMut() -> io::Result<Option<T>>,
    ) -> Poll<io::Result<T>> {
        let r = loop {
            match step() {
                Ok(None) => {}
                Ok(Some(t)) => break Ok(t),
                Err(e) => break Err(e),
            }
            if eq.spin_before_park(&mut self.wait) {
                continue;
            }
            match self.lead.poll_lead(eq, cx) {
                lead::Step::Again => continue,
                lead::Step::Sleeps | lead::Step::Alone => {}
                lead::Step::Follows => self.wait.followed(),
            }
            // Events that others complete here (another leader, a call that completes at once).
            match self.fd.poll_read_ready(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Err(e)) => break Err(e),
                Poll::Ready(Ok(mut guard)) => {
                    if eq.is_empty() {
                        guard.clear_ready();
                    }
                }
            }
        };
        self.lead.release();
        eq.wait_ended(&mut self.wait);
        Poll::Ready(r)
    }
}

impl EventQueue {
    /// Waits, without blocking the thread, for the next event (feature `tokio`).
    pub async fn next_async(&self) -> io::Result<Event> {
        let fd = async_fd(self.as_fd())?;
        next_event(self, &fd).await
    }
}

/// The reading direction of a stream with its descriptor in the reactor.
pub(crate) struct ReadPart {
    pub(crate) core: Reader,
    waiter: Waiter,
}

/// The writing direction of a stream with its descriptor in the reactor.
pub(crate) struct WritePart {
    pub(crate) core: Writer,
    waiter: Waiter,
}

/// A tokio `ReadBuf` as the destination of a read: each copy fills the next bytes only (`put_slice` needs none
/// initialised; the fallback copy initialises only those it fills).
struct BufSink<'a, 'b>(&'a mut ReadBuf<'b>);

impl sio::ReadSink for BufSink<'_, '_> {
    fn put(&mut self, bytes: &[u8]) {
        self.0.put_slice(bytes);
    }

    fn fill(&mut self, k: usize, f: &mut dyn FnMut(&mut [u8]) -> io::Result<()>) -> io::Result<()> {
        f(self.0.initialize_unfilled_to(k))?;
        self.0.advance(k);
        Ok(())
    }
}

impl ReadPart {
    pub(crate) fn poll_read(
        &mut self,
        cx: &mut TaskContext<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let core = &mut self.core;
        let eq = core.eq.clone();
        // The unfilled part is not zeroed first (`initialize_unfilled` would zero all of it, on every fresh buffer: a
        // whole `read_to_end` vector's capacity).
        let max = buf.remaining();
        ready!(self
            .waiter
            .poll_until(&eq, cx, || core.try_read_with(max, &mut BufSink(buf))))?;
        Poll::Ready(Ok(()))
    }
}

impl WritePart {
    pub(crate) fn poll_write(
        &mut self,
        cx: &mut TaskContext<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let core = &mut self.core;
        let eq = core.eq.clone();
        self.waiter.poll_until(&eq, cx, || {
            core.try_write_vectored(&[io::IoSlice::new(buf)])
        })
    }

    pub(crate) fn poll_write_vectored(
        &mut self,
        cx: &mut TaskContext<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let core = &mut self.core;
        let eq = core.eq.clone();
        self.waiter
            .poll_until(&eq, cx, || core.try_write_vectored(bufs))
    }
}

/// A connected stream, like `tokio::net::TcpStream` (see the module documentation).
pub struct Stream {
    pub(crate) read: ReadPart,
    pub(crate) write: WritePart,
}

impl std::fmt::Debug for Stream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Stream")
            .field("socket", &self.read.core.sock)
            .finish()
    }
}

/// The process's [default context](crate::default_context), opened on tokio's blocking pool the first time, not on
/// the task's thread: opening a context looks for devices and providers and takes long enough to stall a runtime
/// (libfabric's first `fi_getinfo` in a process reads `/proc/kallsyms`: the backends chapter says what it costs).
async fn default_context() -> io::Result<Context> {
    if let Some(c) = sio::default_context_if_open() {
        return Ok(c);
    }
    match tokio::task::spawn_blocking(sio::default_context).await {
        Ok(r) => r,
        Err(e) => Err(io::Error::other(format!(
            "opening the default context failed: {e}"
        ))),
    }
}

impl Stream {
    /// Connects on the process's [default context](crate::default_context) to the first address of `addr` that
    /// answers, resolving names with `tokio::net::lookup_host`, like `tokio::net::TcpStream::connect`. Not
    /// cancel safe: dropping the future abandons the attempt.
    pub async fn connect(addr: impl tokio::net::ToSocketAddrs) -> io::Result<Stream> {
        Self::connect_with(&default_context().await?, addr, &StreamConfig::default()).await
    }

    /// Connects on `ctx` to the first address of `addr` that answers (like TCP's, the connection completes when
    /// the listener has set it up, before its application accepts it).
    pub async fn connect_in(
        ctx: &Context,
        addr: impl tokio::net::ToSocketAddrs,
    ) -> io::Result<Stream> {
        Self::connect_with(ctx, addr, &StreamConfig::default()).await
    }

    /// Connects on `ctx` with `cfg`'s buffers and connect timeout.
    pub async fn connect_with(
        ctx: &Context,
        addr: impl tokio::net::ToSocketAddrs,
        cfg: &StreamConfig,
    ) -> io::Result<Stream> {
        let mut last = None;
        for a in tokio::net::lookup_host(addr).await? {
            match Self::connect_one(ctx, a, cfg).await {
                Ok(s) => return Ok(s),
                Err(e) => last = Some(e),
            }
        }
        Err(last.unwrap_or_else(|| {
            io::Error::new(io::ErrorKind::InvalidInput, "no address to connect to")
        }))
    }

    async fn connect_one(
        ctx: &Context,
        addr: SocketAddr,
        cfg: &StreamConfig,
    ) -> io::Result<Stream> {
        // The connect's own timeout (the engine's timer ends it with `TimedOut`): no tokio timer, so a runtime
        // without the time driver connects with a timeout too.
        let (sock, eq) = sio::start_connect(ctx, addr, cfg.connect_timeout)?;
        let fd = async_fd(eq.as_fd())?;
        let ev = Ok(next_event(&eq, &fd).await?);
        sio::end_connect(&sock, addr, ev)?;
        Self::from_socket(ctx, sock, cfg)
    }

    fn from_socket(ctx: &Context, sock: Socket, cfg: &StreamConfig) -> io::Result<Stream> {
        let reader = Reader::new(ctx, sock.clone(), cfg)?;
        let writer = Writer::new(ctx, sock, cfg)?;
        Ok(Stream {
            read: ReadPart {
                waiter: Waiter::new(&reader.eq)?,
                core: reader,
            },
            write: WritePart {
                waiter: Waiter::new(&writer.eq)?,
                core: writer,
            },
        })
    }

    /// The ES-API socket underneath.
    pub fn socket(&self) -> &Socket {
        &self.read.core.sock
    }

    /// This side's address.
    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        sio::addr_of(self.socket().local_addr())
    }

    /// The peer's address.
    pub fn peer_addr(&self) -> io::Result<SocketAddr> {
        sio::addr_of(self.socket().peer_addr())
    }

    /// Like TCP_NODELAY (see [`crate::Stream::set_nodelay`]).
    pub fn set_nodelay(&self, nodelay: bool) -> io::Result<()> {
        sio::set_nodelay(self.socket(), nodelay)
    }

    /// See [`Stream::set_nodelay`].
    pub fn nodelay(&self) -> io::Result<bool> {
        sio::nodelay(self.socket())
    }

    /// Splits the stream into halves that borrow it (like `TcpStream::split`): one task reads while another
    /// writes.
    pub fn split(&mut self) -> (ReadHalf<'_>, WriteHalf<'_>) {
        (ReadHalf(&mut self.read), WriteHalf(&mut self.write))
    }

    /// Splits the stream into owned halves (like `TcpStream::into_split`). Dropping the write half shuts the
    /// writing side down (the peer reads end-of-stream after the bytes written); the stream closes when both
    /// halves are gone. [`OwnedReadHalf::reunite`] puts them back together.
    pub fn into_split(self) -> (OwnedReadHalf, OwnedWriteHalf) {
        split::into_split(self)
    }
}

impl AsyncRead for Stream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut TaskContext<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        self.get_mut().read.poll_read(cx, buf)
    }
}

impl AsyncWrite for Stream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut TaskContext<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        self.get_mut().write.poll_write(cx, buf)
    }

    /// The slices are gathered into the send ring: a header and its body leave in one send.
    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut TaskContext<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        self.get_mut().write.poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        true
    }

    /// Ready at once, like tokio's `TcpStream`: every byte written is already on its way. Reports the error of
    /// an earlier write's send, if one failed.
    fn poll_flush(self: Pin<&mut Self>, _cx: &mut TaskContext<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(self.get_mut().write.core.flush())
    }

    /// Shuts the writing side down and is ready at once, like tokio's `TcpStream` (see
    /// [`crate::Stream::shutdown`]).
    fn poll_shutdown(self: Pin<&mut Self>, _cx: &mut TaskContext<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(self.get_mut().write.core.shutdown())
    }
}

/// Accepts streams, like `tokio::net::TcpListener`.
pub struct Listener {
    sock: Socket,
    ctx: Context,
    eq: EventQueue,
    fd: AsyncFd<QueueFd>,
    cfg: StreamConfig,
    /// The `accept` calls waiting now, and why accepts can no longer be posted.
    accepting: std::sync::Mutex<Accepting>,
}

/// The `accept` calls waiting now (each has an accept posted, or its connection queued, for it, up to the queue's
/// depth), and the failure that ended posting for good.
#[derive(Default)]
struct Accepting {
    waiting: usize,
    failed: Option<sio::Failure>,
}

impl Accepting {
    fn failure(&self) -> Option<io::Error> {
        self.failed.as_ref().map(sio::Failure::io)
    }
}

/// One `accept` call counted in [`Listener::accepting`] until it returns or is dropped.
struct Waiting<'a>(&'a Listener);

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        let l = self.0;
        let mut a = l.lock_accepting();
        a.waiting -= 1;
        // Callers past the queue's depth wait without an accept of their own: one more for them now. When that
        // fails (the context failed, the listener is gone), no accept will ever wake them: each gets a wake-up
        // event and returns the failure (review finding: the tokio listener's callers past 64 waited for ever
        // once the context had failed; test
        // `tasks_accepting_beyond_the_queue_depth_all_fail_when_the_context_does`).
        if let Err(e) = l.post_accepts(a.waiting) {
            a.failed.get_or_insert_with(|| sio::Failure::of_io(&e));
            let held = l.eq.outstanding() + l.eq.len();
            sio::wake_each(&l.eq, &l.sock, a.waiting.saturating_sub(held));
        }
    }
}

impl std::fmt::Debug for Listener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Listener")
            .field("sock", &self.sock)
            .finish()
    }
}

impl Listener {
    /// Listens on the process's [default context](crate::default_context) at the first address of `addr` that
    /// can be bound, resolving names with `tokio::net::lookup_host`, like `tokio::net::TcpListener::bind`.
    pub async fn bind(addr: impl tokio::net::ToSocketAddrs) -> io::Result<Listener> {
        Self::bind_with(&default_context().await?, addr, &StreamConfig::default()).await
    }

    /// Listens on `ctx` at the first address of `addr` that can be bound.
    pub async fn bind_in(
        ctx: &Context,
        addr: impl tokio::net::ToSocketAddrs,
    ) -> io::Result<Listener> {
        Self::bind_with(ctx, addr, &StreamConfig::default()).await
    }

    /// Listens on `ctx`; the streams it accepts buffer as `cfg` says.
    pub async fn bind_with(
        ctx: &Context,
        addr: impl tokio::net::ToSocketAddrs,
        cfg: &StreamConfig,
    ) -> io::Result<Listener> {
        let addrs = tokio::net::lookup_host(addr).await?;
        let sock = sio::each_addr(addrs, |a| sio::listen(ctx, a))?;
        let eq = EventQueue::new(64)?;
        let fd = async_fd(eq.as_fd())?;
        Ok(Listener {
            sock,
            ctx: ctx.clone(),
            eq,
            fd,
            cfg: cfg.clone(),
            accepting: Default::default(),
        })
    }

    /// The address it listens on.
    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        sio::addr_of(self.sock.local_addr())
    }

    /// Waits for a connection; returns it and the peer's address. Several tasks may wait at once (each gets its
    /// own connection, as with `tokio::net::TcpListener`). Cancel safe: a dropped `accept` leaves its accept
    /// posted, and the next call gets that connection.
    pub async fn accept(&self) -> io::Result<(Stream, SocketAddr)> {
        let _waiting = self.wait_for_one()?;
        let ev = next_event(&self.eq, &self.fd).await?;
        if sio::is_wake(&ev) {
            return Err(self
                .lock_accepting()
                .failure()
                .unwrap_or_else(|| io::Error::other("the listener failed")));
        }
        let (sock, peer) = sio::accepted(ev)?;
        Ok((Stream::from_socket(&self.ctx, sock, &self.cfg)?, peer))
    }
}

impl Listener {
    /// Counts the caller among those waiting and posts accepts until there is one, posted or with its connection
    /// queued, for each of them (a single posted accept shared by two waiting tasks left one of them waiting for
    /// ever).
    fn wait_for_one(&self) -> io::Result<Waiting<'_>> {
        let mut a = self.lock_accepting();
        if let Some(e) = a.failure() {
            return Err(e);
        }
        a.waiting += 1;
        let posted = self.post_accepts(a.waiting);
        drop(a);
        // Counted from here: a failure is undone as the guard goes.
        let guard = Waiting(self);
        posted?;
        Ok(guard)
    }

    fn lock_accepting(&self) -> std::sync::MutexGuard<'_, Accepting> {
        self.accepting.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Posts accepts until `waiting` callers have one each, posted or with its connection queued, as far as the
    /// queue holds events (callers past its depth wait for one to leave). Called with `accepting` locked.
    fn post_accepts(&self, waiting: usize) -> io::Result<()> {
        while self.eq.outstanding() + self.eq.len() < waiting.min(self.eq.depth()) {
            self.sock.accept(&self.eq, 0)?;
        }
        Ok(())
    }
}

//! The blocking [`Stream`] and [`Listener`], like `std::net::TcpStream` and `TcpListener`.

use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::context::Context;
use crate::error::DequeueError;
use crate::event::{Event, EventQueue};
use crate::socket::Socket;

use super::{ReadSink, Reader, SliceSink, StreamConfig, Writer};

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// A read or write timeout as `std` reports it on Unix: `WouldBlock`.
fn timed_out() -> io::Error {
    io::Error::new(io::ErrorKind::WouldBlock, "timed out")
}

/// A non-blocking call that would have to wait.
fn would_block() -> io::Error {
    io::Error::new(io::ErrorKind::WouldBlock, "would block")
}

/// Waits until `deadline` (`None`: for ever) for at least one event of `eq`; returns those that came.
fn wait(eq: &EventQueue, deadline: Option<Instant>, out: &mut Vec<Event>) -> io::Result<()> {
    let left = match deadline {
        Some(d) => match d.checked_duration_since(Instant::now()) {
            Some(l) if !l.is_zero() => Some(l),
            _ => return Err(timed_out()),
        },
        None => None,
    };
    match eq.dequeue(out, 1, 16, left) {
        Ok(_) => Ok(()),
        Err(DequeueError::TimedOut) => Err(timed_out()),
        Err(e) => Err(e.into()),
    }
}

/// Whose turn it is to read. Readers take turns (the bytes of one receive go to one reader), and each waits for
/// its turn within its own timeout: a read waiting for data in one thread, with no timeout, held the reader's lock,
/// and a read with a timeout in another thread waited for that lock past its timeout, for ever if no data came
/// (review finding).
#[derive(Debug, Default)]
struct Turns {
    busy: Mutex<bool>,
    freed: Condvar,
}

/// A reader's turn, given back when dropped.
struct Turn<'a>(&'a Turns);

impl Turns {
    /// Waits for the turn until `deadline` (`None`: for ever); `None` once the deadline passed first.
    fn take(&self, deadline: Option<Instant>) -> Option<Turn<'_>> {
        let mut busy = lock(&self.busy);
        while *busy {
            busy = match deadline {
                None => self.freed.wait(busy).unwrap_or_else(|p| p.into_inner()),
                Some(d) => {
                    let left = d.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        return None;
                    }
                    let waited = self.freed.wait_timeout(busy, left);
                    waited.unwrap_or_else(|p| p.into_inner()).0
                }
            };
        }
        *busy = true;
        Some(Turn(self))
    }

    /// The turn if nobody has it.
    fn try_take(&self) -> Option<Turn<'_>> {
        let mut busy = lock(&self.busy);
        (!*busy).then(|| {
            *busy = true;
            Turn(self)
        })
    }
}

impl Drop for Turn<'_> {
    fn drop(&mut self) {
        *lock(&self.0.busy) = false;
        self.0.freed.notify_one();
    }
}

#[derive(Debug)]
struct Shared {
    sock: Socket,
    /// Taken before `reader` by a read (see [`Turns`]).
    turns: Turns,
    reader: Mutex<Reader>,
    writer: Mutex<Writer>,
    /// The reader's queue, to wake a blocked reader without its lock.
    read_eq: EventQueue,
    read_shut: AtomicBool,
    nonblocking: AtomicBool,
    /// (read, write).
    timeouts: Mutex<(Option<Duration>, Option<Duration>)>,
}

/// A connected stream, like `std::net::TcpStream`: `Read` and `Write` on `Stream` and on `&Stream` (one thread
/// may read while another writes), [`Stream::try_clone`] for another handle. A write returns once its bytes are
/// copied into the stream's send ring and on their way; an error of that send comes with a later write or
/// `flush`. Dropping the last handle closes the stream gracefully (see the module documentation).
///
/// ```
/// # #[cfg(feature = "fabric")] {
/// # std::env::set_var("EXS_BACKEND", "fabric"); // the test's backend, whatever else the build enables
/// use std::io::{Read, Write};
///
/// let (server, client) = (exs::Context::from_env()?, exs::Context::from_env()?);
/// let listener = exs::Listener::bind_in(&server, "127.0.0.1:0")?;
/// let addr = listener.local_addr()?;
/// let reader = std::thread::spawn(move || -> std::io::Result<Vec<u8>> {
///     let (mut s, _peer) = listener.accept()?;
///     let mut all = Vec::new();
///     s.read_to_end(&mut all)?; // until the writer shuts down
///     Ok(all)
/// });
/// let mut s = exs::Stream::connect_in(&client, addr)?;
/// s.set_write_timeout(Some(std::time::Duration::from_secs(10)))?;
/// for line in ["one\n", "two\n", "three\n"] {
///     s.write_all(line.as_bytes())?;
/// }
/// s.shutdown(std::net::Shutdown::Write)?;
/// assert_eq!(reader.join().unwrap()?, b"one\ntwo\nthree\n");
/// # }
/// # Ok::<(), std::io::Error>(())
/// ```
#[derive(Debug)]
pub struct Stream {
    inner: Arc<Shared>,
}

impl Stream {
    /// Connects on the process's [default context](super::default_context) to the first address of `addr` that
    /// answers, like `TcpStream::connect`.
    pub fn connect(addr: impl ToSocketAddrs) -> io::Result<Stream> {
        Self::connect_with(&super::default_context()?, addr, &StreamConfig::default())
    }

    /// Connects on the default context, waiting at most `timeout` (like `TcpStream::connect_timeout`).
    pub fn connect_timeout(addr: &SocketAddr, timeout: Duration) -> io::Result<Stream> {
        if timeout.is_zero() {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "zero timeout"));
        }
        let cfg = StreamConfig {
            connect_timeout: Some(timeout),
            ..Default::default()
        };
        Self::connect_with(&super::default_context()?, addr, &cfg)
    }

    /// Connects on `ctx` to the first address of `addr` that answers (like TCP's, the connection completes when
    /// the listener has set it up, before its application accepts it).
    pub fn connect_in(ctx: &Context, addr: impl ToSocketAddrs) -> io::Result<Stream> {
        Self::connect_with(ctx, addr, &StreamConfig::default())
    }

    /// Connects on `ctx` with `cfg`'s buffers and connect timeout.
    pub fn connect_with(
        ctx: &Context,
        addr: impl ToSocketAddrs,
        cfg: &StreamConfig,
    ) -> io::Result<Stream> {
        super::each_addr(addr.to_socket_addrs()?, |a| {
            let (sock, eq) = super::start_connect(ctx, a, cfg.connect_timeout)?;
            super::end_connect(&sock, a, eq.next(cfg.connect_timeout))?;
            Self::from_socket(ctx, sock, cfg)
        })
    }

    pub(crate) fn from_socket(
        ctx: &Context,
        sock: Socket,
        cfg: &StreamConfig,
    ) -> io::Result<Stream> {
        let reader = Reader::new(ctx, sock.clone(), cfg)?;
        let read_eq = reader.eq.clone();
        Ok(Stream {
            inner: Arc::new(Shared {
                writer: Mutex::new(Writer::new(ctx, sock.clone(), cfg)?),
                turns: Turns::default(),
                reader: Mutex::new(reader),
                read_eq,
                sock,
                read_shut: AtomicBool::new(false),
                nonblocking: AtomicBool::new(false),
                timeouts: Mutex::new((None, None)),
            }),
        })
    }

    /// Another handle to the same stream (like `TcpStream::try_clone`): reads and writes through either go to
    /// the same connection; it closes when the last handle is dropped.
    pub fn try_clone(&self) -> io::Result<Stream> {
        Ok(Stream {
            inner: Arc::clone(&self.inner),
        })
    }

    /// The ES-API socket underneath (zero-copy sends and receives of registered memory).
    pub fn socket(&self) -> &Socket {
        &self.inner.sock
    }

    /// This side's address.
    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        super::addr_of(self.inner.sock.local_addr())
    }

    /// The peer's address.
    pub fn peer_addr(&self) -> io::Result<SocketAddr> {
        super::addr_of(self.inner.sock.peer_addr())
    }

    /// Like `TcpStream::shutdown`. `Write`: end-of-stream is queued behind the bytes already written and the
    /// call returns at once (the peer reads every byte, then end-of-stream); later writes fail with `BrokenPipe`,
    /// a write waiting in another thread for room included; on a connection the peer reset, `NotConnected`.
    /// `Read`: every later read returns end-of-stream, a read blocked in another thread included; bytes still
    /// unread are dropped, and a peer that goes on writing waits once the receives and the stream buffer are
    /// full (as a TCP peer's window closes).
    pub fn shutdown(&self, how: Shutdown) -> io::Result<()> {
        if matches!(how, Shutdown::Read | Shutdown::Both) {
            self.inner.read_shut.store(true, Ordering::SeqCst);
            let _ = super::core::wake(&self.inner.read_eq, &self.inner.sock);
        }
        if matches!(how, Shutdown::Write | Shutdown::Both) {
            lock(&self.inner.writer).shutdown()?;
        }
        Ok(())
    }

    /// How long a read may wait (`None`: for ever); a read that waits longer fails with `WouldBlock`. Reads from
    /// several threads take turns, and the time a read waits for the one before it to return counts.
    pub fn set_read_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        if t == Some(Duration::ZERO) {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "zero timeout"));
        }
        lock(&self.inner.timeouts).0 = t;
        Ok(())
    }

    /// How long a write may wait for room in the send ring (`None`: for ever); then it fails with
    /// `WouldBlock`.
    pub fn set_write_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        if t == Some(Duration::ZERO) {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "zero timeout"));
        }
        lock(&self.inner.timeouts).1 = t;
        Ok(())
    }

    /// See [`Stream::set_read_timeout`].
    pub fn read_timeout(&self) -> io::Result<Option<Duration>> {
        Ok(lock(&self.inner.timeouts).0)
    }

    /// See [`Stream::set_write_timeout`].
    pub fn write_timeout(&self) -> io::Result<Option<Duration>> {
        Ok(lock(&self.inner.timeouts).1)
    }

    /// Non-blocking mode: a read or write that would wait fails with `WouldBlock` instead.
    pub fn set_nonblocking(&self, on: bool) -> io::Result<()> {
        self.inner.nonblocking.store(on, Ordering::SeqCst);
        Ok(())
    }

    /// Like TCP_NODELAY: `true` sends small writes at once even while an earlier write is in flight; `false`
    /// (the default) lets them join the write in flight (coalescing, [`SocketOptions::coalesce`]).
    ///
    /// [`SocketOptions::coalesce`]: crate::SocketOptions::coalesce
    pub fn set_nodelay(&self, nodelay: bool) -> io::Result<()> {
        super::set_nodelay(&self.inner.sock, nodelay)
    }

    /// See [`Stream::set_nodelay`].
    pub fn nodelay(&self) -> io::Result<bool> {
        super::nodelay(&self.inner.sock)
    }

    /// When a wait started now ends (`None`: never, also for a timeout too long to count), or `WouldBlock` in
    /// non-blocking mode.
    fn deadline(&self, timeout: Option<Duration>) -> io::Result<Option<Instant>> {
        if self.inner.nonblocking.load(Ordering::Relaxed) {
            return Err(would_block());
        }
        Ok(crate::config::deadline(Instant::now(), timeout))
    }

    fn read_inner(&self, buf: &mut [u8]) -> io::Result<usize> {
        self.read_with(buf.len(), &mut SliceSink { buf, len: 0 })
    }

    /// `read_to_end` without first zeroing the vector's spare room as a whole (std's default would, for a `Read`
    /// that cannot take uninitialised memory): it grows by each copy out of the receive buffer.
    fn read_to_end_inner(&self, buf: &mut Vec<u8>) -> io::Result<usize> {
        let start = buf.len();
        loop {
            match self.read_with(usize::MAX, buf) {
                Ok(0) => return Ok(buf.len() - start),
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
    }

    /// `read_to_end`, then the bytes as UTF-8; `buf` is left as it was if they are not (as std's).
    fn read_to_string_inner(&self, buf: &mut String) -> io::Result<usize> {
        let mut bytes = Vec::new();
        let read = self.read_to_end_inner(&mut bytes);
        match String::from_utf8(bytes) {
            Ok(text) => {
                buf.push_str(&text);
                read
            }
            Err(_) => read.and_then(|_| {
                Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    "stream did not contain valid UTF-8",
                ))
            }),
        }
    }

    /// One read of at most `max` bytes into `dst`; waits (within the read timeout) for the first.
    fn read_with(&self, max: usize, dst: &mut dyn ReadSink) -> io::Result<usize> {
        let s = &*self.inner;
        // Readers take turns (see `Turns`), each within its own timeout, counted from the call. A non-blocking
        // read does not wait for another thread's blocking read to give the turn back.
        let (start, timeout) = (Instant::now(), lock(&s.timeouts).0);
        let _turn = if s.nonblocking.load(Ordering::Relaxed) {
            s.turns.try_take().ok_or_else(would_block)?
        } else {
            let until = crate::config::deadline(start, timeout);
            s.turns.take(until).ok_or_else(timed_out)?
        };
        let mut r = lock(&s.reader);
        let mut deadline = None;
        let mut evs = Vec::new();
        loop {
            if s.read_shut.load(Ordering::SeqCst) {
                r.shut();
            }
            if let Some(n) = r.try_read_with(max, dst)? {
                return Ok(n);
            }
            if deadline.is_none() {
                self.deadline(None)?; // non-blocking now: `WouldBlock`
                deadline = Some(crate::config::deadline(start, timeout));
            }
            wait(&r.eq, deadline.flatten(), &mut evs)?;
            for ev in evs.drain(..) {
                r.absorb(ev);
            }
        }
    }

    fn write_inner(&self, buf: &[u8]) -> io::Result<usize> {
        self.write_vectored_inner(&[io::IoSlice::new(buf)])
    }

    /// A write of several slices, gathered into the send ring (see `Writer::try_write_vectored`).
    fn write_vectored_inner(&self, bufs: &[io::IoSlice<'_>]) -> io::Result<usize> {
        let s = &*self.inner;
        let mut deadline = None;
        let mut evs = Vec::new();
        loop {
            let eq = {
                let mut w = lock(&s.writer);
                let took = !evs.is_empty();
                for ev in evs.drain(..) {
                    w.absorb(ev);
                }
                let wrote = w.try_write_vectored(bufs);
                if took && w.waiters > 0 && !matches!(wrote, Ok(None)) {
                    // Leaving with completions other waiting writers did not see (the room they wait for may be
                    // there now, and none may be in flight to wake them).
                    w.wake_waiters();
                }
                if let Some(n) = wrote? {
                    return Ok(n);
                }
                if deadline.is_none() {
                    deadline = Some(self.deadline(lock(&s.timeouts).1)?);
                }
                // Counted before the lock goes: a thread that takes the completions meanwhile wakes this one.
                w.waiters += 1;
                w.eq.clone()
            };
            // Waits without the lock, so that `shutdown` and `flush` from another thread never wait for a peer
            // that does not read (the writer's events may be taken in any order: each frees the oldest send).
            let waited = wait(&eq, deadline.flatten(), &mut evs);
            lock(&s.writer).waiters -= 1;
            waited?;
        }
    }
}

impl Read for &Stream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.read_inner(buf)
    }

    fn read_to_end(&mut self, buf: &mut Vec<u8>) -> io::Result<usize> {
        self.read_to_end_inner(buf)
    }

    fn read_to_string(&mut self, buf: &mut String) -> io::Result<usize> {
        self.read_to_string_inner(buf)
    }
}

impl Write for &Stream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.write_inner(buf)
    }

    /// The slices are gathered into the send ring: a header and its body leave in one send.
    fn write_vectored(&mut self, bufs: &[io::IoSlice<'_>]) -> io::Result<usize> {
        self.write_vectored_inner(bufs)
    }

    /// Like `TcpStream::flush`, returns at once: every byte written is already on its way. Reports the error of
    /// an earlier write's send, if one failed.
    fn flush(&mut self) -> io::Result<()> {
        lock(&self.inner.writer).flush()
    }
}

impl Read for Stream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.read_inner(buf)
    }

    fn read_to_end(&mut self, buf: &mut Vec<u8>) -> io::Result<usize> {
        self.read_to_end_inner(buf)
    }

    fn read_to_string(&mut self, buf: &mut String) -> io::Result<usize> {
        self.read_to_string_inner(buf)
    }
}

impl Write for Stream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.write_inner(buf)
    }

    /// The slices are gathered into the send ring: a header and its body leave in one send.
    fn write_vectored(&mut self, bufs: &[io::IoSlice<'_>]) -> io::Result<usize> {
        self.write_vectored_inner(bufs)
    }

    /// See the `Write for &Stream` implementation.
    fn flush(&mut self) -> io::Result<()> {
        (&*self).flush()
    }
}

/// Accepts streams, like `std::net::TcpListener`.
///
/// ```
/// # #[cfg(feature = "fabric")] {
/// # std::env::set_var("EXS_BACKEND", "fabric"); // the test's backend, whatever else the build enables
/// use std::io::{Read, Write};
///
/// let (server, client) = (exs::Context::from_env()?, exs::Context::from_env()?);
/// let listener = exs::Listener::bind_in(&server, "127.0.0.1:0")?;
/// let addr = listener.local_addr()?;
/// // A server that answers each connection with its length, for two clients.
/// let served = std::thread::spawn(move || -> std::io::Result<()> {
///     for stream in listener.incoming().take(2) {
///         let mut s = stream?;
///         let mut got = Vec::new();
///         s.read_to_end(&mut got)?;
///         s.write_all(&(got.len() as u32).to_le_bytes())?;
///         s.shutdown(std::net::Shutdown::Write)?;
///     }
///     Ok(())
/// });
/// for n in [10usize, 1000] {
///     let mut c = exs::Stream::connect_in(&client, addr)?;
///     c.write_all(&vec![1u8; n])?;
///     c.shutdown(std::net::Shutdown::Write)?;
///     let mut answer = [0u8; 4];
///     c.read_exact(&mut answer)?;
///     assert_eq!(u32::from_le_bytes(answer) as usize, n);
/// }
/// served.join().unwrap()?;
/// # }
/// # Ok::<(), std::io::Error>(())
/// ```
#[derive(Debug)]
pub struct Listener {
    sock: Socket,
    ctx: Context,
    eq: EventQueue,
    cfg: StreamConfig,
    /// Threads in [`Listener::accept`], and accepts posted for them (see there).
    accepting: Mutex<Accepting>,
    /// [`Listener::set_nonblocking`].
    nonblocking: AtomicBool,
}

/// Threads waiting in [`Listener::accept`] and the accepts posted on the listener's queue.
#[derive(Debug, Default)]
struct Accepting {
    waiting: usize,
    posted: usize,
    /// Posting failed for good (the context failed, the listener is gone): every later accept fails so.
    failed: Option<super::Failure>,
}

impl Accepting {
    fn failure(&self) -> Option<io::Error> {
        self.failed.as_ref().map(super::Failure::io)
    }
}

/// Accepts a listener keeps posted at most: its queue's depth.
const ACCEPTS_POSTED: usize = 64;

impl Listener {
    /// Listens on the process's [default context](super::default_context) at the first address of `addr` that
    /// can be bound (port 0: one is chosen), like `TcpListener::bind`.
    pub fn bind(addr: impl ToSocketAddrs) -> io::Result<Listener> {
        Self::bind_with(&super::default_context()?, addr, &StreamConfig::default())
    }

    /// Listens on `ctx` at the first address of `addr` that can be bound.
    pub fn bind_in(ctx: &Context, addr: impl ToSocketAddrs) -> io::Result<Listener> {
        Self::bind_with(ctx, addr, &StreamConfig::default())
    }

    /// Listens on `ctx`; the streams it accepts buffer as `cfg` says.
    pub fn bind_with(
        ctx: &Context,
        addr: impl ToSocketAddrs,
        cfg: &StreamConfig,
    ) -> io::Result<Listener> {
        let sock = super::each_addr(addr.to_socket_addrs()?, |a| super::listen(ctx, a))?;
        Ok(Listener {
            sock,
            ctx: ctx.clone(),
            eq: EventQueue::new(ACCEPTS_POSTED)?,
            cfg: cfg.clone(),
            accepting: Mutex::default(),
            nonblocking: AtomicBool::new(false),
        })
    }

    /// Non-blocking mode, like `TcpListener::set_nonblocking`: [`Listener::accept`] returns a connection that has
    /// come, or fails with `WouldBlock` at once (an accept stays posted for the next call: a connection that
    /// comes meanwhile is kept for it).
    pub fn set_nonblocking(&self, on: bool) -> io::Result<()> {
        self.nonblocking.store(on, Ordering::SeqCst);
        Ok(())
    }

    /// The address it listens on.
    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        super::addr_of(self.sock.local_addr())
    }

    /// Waits for a connection; returns it and the peer's address. Any number of threads may wait at once: each
    /// takes the next connection that comes.
    pub fn accept(&self) -> io::Result<(Stream, SocketAddr)> {
        // An accept is posted per waiting thread, up to the queue's depth (each posted one filled a slot: the
        // 65th thread's post failed with `WouldBlock`, which a blocking listener never returns). A thread beyond
        // that waits for the events of the posted ones, and every thread that takes an event posts again for
        // the waiters left without one.
        self.post_accepts(1)?;
        // Non-blocking: one look (a round of progress where this thread drives it), no wait.
        let nonblocking = self.nonblocking.load(Ordering::SeqCst);
        let ev = self.eq.next(nonblocking.then_some(Duration::ZERO));
        let mut a = self.lock_accepting();
        a.waiting -= 1;
        let woken = matches!(&ev, Ok(e) if super::core::is_wake(e));
        if ev.is_ok() && !woken {
            a.posted = a.posted.saturating_sub(1);
        }
        drop(a);
        if let Err(e) = self.post_accepts(0) {
            // Posting failed for good: the waiters beyond the posted accepts would wait for ever. Each is woken
            // to fail with the same error. This thread's connection, if it got one, is still its to return.
            self.fail_waiters(e);
        }
        if woken {
            let a = self.lock_accepting();
            return Err(a
                .failure()
                .unwrap_or_else(|| io::Error::other("the listener failed")));
        }
        let ev = match ev {
            Err(DequeueError::TimedOut) if nonblocking => return Err(would_block()),
            ev => ev,
        };
        let (sock, peer) = super::accepted(ev?)?;
        Ok((Stream::from_socket(&self.ctx, sock, &self.cfg)?, peer))
    }

    /// Records `e` as the listener's failure and wakes the waiting threads that no posted accept will wake.
    fn fail_waiters(&self, e: io::Error) {
        let mut a = self.lock_accepting();
        a.failed.get_or_insert_with(|| super::Failure::of_io(&e));
        // A full queue holds events that will wake threads, which come back here.
        super::core::wake_each(&self.eq, &self.sock, a.waiting.saturating_sub(a.posted));
    }

    /// Counts `more` waiting threads and posts accepts until there is one per waiting thread (or the queue's
    /// depth of them).
    fn post_accepts(&self, more: usize) -> io::Result<()> {
        let mut a = self.lock_accepting();
        if let Some(e) = a.failure() {
            return Err(e);
        }
        a.waiting += more;
        while a.posted < a.waiting.min(ACCEPTS_POSTED) {
            if let Err(e) = self.sock.accept(&self.eq, 0) {
                a.waiting -= more;
                return Err(e.into());
            }
            a.posted += 1;
        }
        Ok(())
    }

    fn lock_accepting(&self) -> MutexGuard<'_, Accepting> {
        self.accepting.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Connections as they come, for ever (like `TcpListener::incoming`).
    pub fn incoming(&self) -> impl Iterator<Item = io::Result<Stream>> + '_ {
        std::iter::repeat_with(move || self.accept().map(|(s, _)| s))
    }
}

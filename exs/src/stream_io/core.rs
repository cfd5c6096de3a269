//! The two directions of a stream, each with its own event queue and registered buffers, as steps that never
//! block: the blocking [`Stream`](super::Stream) and the async `exs::tokio::Stream` wait between them (on the
//! queue, or on its descriptor in tokio's reactor). A direction's queue carries only its own events, so a reader
//! and a writer in different threads or tasks never take each other's completions.
//!
//! **Reading.** The receive buffer is cut into [`StreamConfig::recv_pieces`] receives, all posted ahead: each is
//! advertised to the peer, whose sends go straight into it (the dynamic stream protocol's direct transfer), so the wire
//! fills the next receive while the application copies out of the last one. A receive completes with whatever arrived
//! (1 byte up to its length); the reader copies completed receives out in order and posts each again once empty.
//!
//! **Writing.** The send buffer is a ring: a write copies into the free space after the bytes in flight and posts
//! a send of that range (at most [`StreamConfig::send_piece`] bytes each), so several sends are in flight and a
//! write waits only when the ring is full. Sends complete in order; each completion frees its range.
//!
//! What each byte costs: one copy into the send ring; then one RDMA write, into the peer's posted receive when it
//! advertised one (direct) or into its stream buffer (indirect, one more copy at the peer into the receive); then
//! one copy out of the receive into the reader's slice. A direct byte is copied twice in all, as TCP copies it
//! (into the kernel, out of it); an indirect byte three times.

use std::collections::VecDeque;
use std::io;

use crate::context::Context;
use crate::error::{CloseError, OpError, SendError, StateError};
use crate::event::{Event, EventKind, EventQueue};
use crate::memory::MemoryRegion;
use crate::options::MsgFlags;
use crate::socket::Socket;

use super::StreamConfig;

fn other(e: impl std::fmt::Display) -> io::Error {
    io::Error::other(e.to_string())
}

/// An error kept to be reported later (an `io::Error` cannot be cloned).
#[derive(Debug, Clone)]
pub(crate) struct Failure(io::ErrorKind, String);

impl Failure {
    fn of(e: &OpError) -> Failure {
        Failure(e.io_kind(), e.to_string())
    }

    /// The failure `e` says.
    pub(crate) fn of_io(e: &io::Error) -> Failure {
        Failure(e.kind(), e.to_string())
    }

    pub(crate) fn io(&self) -> io::Error {
        io::Error::new(self.0, self.1.clone())
    }
}

/// The context value of a wake-up event on a reader's queue (see [`Reader::wake`]).
const WAKE: u64 = u64::MAX;

/// A receive that completed with bytes not yet read: `buf[slot * piece ..][at..end]`.
#[derive(Debug)]
struct Filled {
    slot: usize,
    at: usize,
    end: usize,
}

/// Where a read copies its bytes.
pub(crate) trait ReadSink {
    /// Appends `bytes`.
    fn put(&mut self, bytes: &[u8]);

    /// Hands `f` the next `k` bytes of the destination to overwrite; they count as read only if `f` succeeds.
    fn fill(&mut self, k: usize, f: &mut dyn FnMut(&mut [u8]) -> io::Result<()>) -> io::Result<()>;
}

/// A caller's slice, filled from its start.
pub(crate) struct SliceSink<'a> {
    pub(crate) buf: &'a mut [u8],
    pub(crate) len: usize,
}

impl ReadSink for SliceSink<'_> {
    fn put(&mut self, bytes: &[u8]) {
        self.buf[self.len..self.len + bytes.len()].copy_from_slice(bytes);
        self.len += bytes.len();
    }

    fn fill(&mut self, k: usize, f: &mut dyn FnMut(&mut [u8]) -> io::Result<()>) -> io::Result<()> {
        f(&mut self.buf[self.len..self.len + k])?;
        self.len += k;
        Ok(())
    }
}

/// A vector, appended to (`read_to_end`): it grows by what each copy takes, never zeroed as a whole.
impl ReadSink for Vec<u8> {
    fn put(&mut self, bytes: &[u8]) {
        self.extend_from_slice(bytes);
    }

    fn fill(&mut self, k: usize, f: &mut dyn FnMut(&mut [u8]) -> io::Result<()>) -> io::Result<()> {
        let at = self.len();
        self.resize(at + k, 0);
        let r = f(&mut self[at..]);
        if r.is_err() {
            self.truncate(at);
        }
        r
    }
}

/// The reading direction (see the module documentation).
#[derive(Debug)]
pub(crate) struct Reader {
    pub(crate) sock: Socket,
    pub(crate) eq: EventQueue,
    buf: MemoryRegion,
    piece: usize,
    /// Slots neither posted nor holding unread bytes.
    free: Vec<usize>,
    /// Completed receives with unread bytes, in stream order.
    ready: VecDeque<Filled>,
    posted: usize,
    eof: bool,
    /// `shutdown(Read)`: reads return end-of-stream; the receives already posted take what arrives and are
    /// not posted again, so a peer that goes on writing waits once they and the stream buffer are full (as a
    /// TCP peer's window closes).
    shut: bool,
    /// A receive failed: reported once every byte before it has been read, by one read; the reads after it
    /// return end-of-stream, as TCP's do after `ECONNRESET` (a loop that logs an error and reads on until
    /// end-of-stream spun for ever on the same error: review finding).
    failed: Option<Failure>,
    failure_told: bool,
    scratch: Vec<Event>,
}

/// Most receives a stream posts ahead ([`StreamConfig::recv_pieces`] is capped here).
pub(crate) const MAX_RECV_PIECES: usize = 256;

impl Reader {
    /// Allocates the receive buffer and posts every receive.
    pub(crate) fn new(ctx: &Context, sock: Socket, cfg: &StreamConfig) -> io::Result<Reader> {
        // Whatever the configuration asks: one receive at least, at most MAX_RECV_PIECES, each of a byte at least
        // (the buffer stays the size asked for; a count past it made pieces of a byte and a buffer of the count).
        let pieces = cfg
            .recv_pieces
            .clamp(1, MAX_RECV_PIECES)
            .min(cfg.recv_buffer.max(1));
        let piece = (cfg.recv_buffer / pieces).max(1);
        let mut r = Reader {
            sock,
            // Room for every receive and a wake-up.
            eq: EventQueue::new(pieces + 2)?,
            buf: MemoryRegion::alloc(ctx, piece * pieces)?,
            piece,
            free: (0..pieces).rev().collect(),
            ready: VecDeque::new(),
            posted: 0,
            eof: false,
            shut: false,
            failed: None,
            failure_told: false,
            scratch: Vec::with_capacity(pieces + 2),
        };
        r.refill();
        Ok(r)
    }

    /// Takes in one event of the reader's queue.
    pub(crate) fn absorb(&mut self, ev: Event) {
        if ev.kind != EventKind::Recv || ev.context == WAKE {
            return;
        }
        self.posted -= 1;
        let slot = ev.context as usize;
        match ev.status {
            Ok(()) if ev.bytes > 0 && !self.shut => self.ready.push_back(Filled {
                slot,
                at: 0,
                end: ev.bytes,
            }),
            Ok(()) => {
                self.eof |= ev.flags.eof;
                self.free.push(slot);
            }
            Err(e) => {
                self.free.push(slot);
                if !self.eof && !self.shut {
                    self.failed.get_or_insert_with(|| Failure::of(&e));
                }
            }
        }
    }

    /// Takes in every event queued, without waiting: none is lost, whatever its status.
    pub(crate) fn absorb_queued(&mut self) {
        let mut evs = std::mem::take(&mut self.scratch);
        while self.eq.poll(&mut evs, 16) > 0 {
            for ev in evs.drain(..) {
                self.absorb(ev);
            }
        }
        self.scratch = evs;
    }

    /// How many receives the buffer holds.
    fn pieces(&self) -> usize {
        self.buf.len() / self.piece
    }

    /// Posts every free slot, while more may come.
    fn refill(&mut self) {
        if self.eof || self.shut || self.failed.is_some() {
            return;
        }
        while let Some(slot) = self.free.pop() {
            let range = slot * self.piece..(slot + 1) * self.piece;
            if let Err(e) = self.sock.recv(
                &self.eq,
                &self.buf.slice(range),
                MsgFlags::NONE,
                slot as u64,
            ) {
                // Reported once the bytes already received have been read.
                self.free.push(slot);
                let e = io::Error::from(e);
                self.failed = Some(Failure(e.kind(), e.to_string()));
                return;
            }
            self.posted += 1;
        }
    }

    /// Bytes (at most `max`, copied out of the receive buffer into `dst`: the one copy, into a destination that
    /// is not zeroed beforehand as a whole, such as tokio's `ReadBuf` or a `Vec`'s spare room), or end-of-stream
    /// (`Some(0)`), if there are some now; `None` otherwise (wait for the queue, then call again).
    pub(crate) fn try_read_with(
        &mut self,
        max: usize,
        dst: &mut dyn ReadSink,
    ) -> io::Result<Option<usize>> {
        if max == 0 {
            return Ok(Some(0));
        }
        self.absorb_queued();
        if self.shut {
            return Ok(Some(0));
        }
        let mut n = 0;
        while n < max {
            let Some(f) = self.ready.front_mut() else {
                break;
            };
            let k = (max - n).min(f.end - f.at);
            let at = f.slot * self.piece + f.at;
            // Borrowed, the bytes are copied once straight into the destination. The trusted-peers exposure
            // policy keeps a long-lived key over the whole buffer, beside which no borrow is lent: then a copy
            // into the destination's next bytes, zeroed first.
            let buf = &self.buf;
            let copied = match buf.with_slice(at..at + k, |bytes| dst.put(bytes)) {
                Ok(()) => Ok(()),
                Err(_) => dst.fill(k, &mut |out| buf.read(at, out).map_err(other)),
            };
            if let Err(e) = copied {
                if n > 0 {
                    // The bytes before are the caller's; the next read meets the error again.
                    break;
                }
                return Err(e);
            }
            f.at += k;
            n += k;
            if f.at == f.end {
                let slot = f.slot;
                self.ready.pop_front();
                self.free.push(slot);
            }
        }
        // Emptied receives go back in batches, once half of them are out (or none is posted): their adverts then
        // share one control send (coalescing), where one repost per receive cost a send per message in
        // request/response traffic.
        if self.posted * 2 <= self.pieces() {
            self.refill();
        }
        if n > 0 {
            return Ok(Some(n));
        }
        if let Some(f) = &self.failed {
            if !std::mem::replace(&mut self.failure_told, true) {
                return Err(f.io());
            }
            return Ok(Some(0));
        }
        if self.eof {
            return Ok(Some(0));
        }
        Ok(None)
    }

    /// `shutdown(Read)`: every later read returns end-of-stream; bytes still unread are dropped.
    pub(crate) fn shut(&mut self) {
        self.shut = true;
        for f in self.ready.drain(..) {
            self.free.push(f.slot);
        }
    }
}

/// Whether `ev` is a wake-up queued by [`wake`], not an operation's event.
pub(crate) fn is_wake(ev: &Event) -> bool {
    ev.context == WAKE
}

/// Puts a wake-up event in a direction's queue, so that a thread waiting on it looks at the stream again
/// (`shutdown(Read)` from another thread; a writer left with completions the writers still waiting did not see). Nothing
/// happens if the queue is full (`false`): its waiter is awake anyway. Both directions pass it over when they take
/// it in.
pub(crate) fn wake(eq: &EventQueue, sock: &Socket) -> bool {
    match eq.reserve(EventKind::Recv, WAKE, sock.id()) {
        Ok(t) => {
            t.complete(Err(OpError::Cancelled), 0, Default::default());
            true
        }
        Err(_) => false,
    }
}

/// Puts up to `n` wake-up events in `eq` (see [`wake`]), one per waiter no other event will wake; stops at a full
/// queue, whose events wake waiters that come back for more.
pub(crate) fn wake_each(eq: &EventQueue, sock: &Socket, n: usize) {
    for _ in 0..n {
        if !wake(eq, sock) {
            break;
        }
    }
}

/// Whether the writing side was shut down.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Shut {
    Open,
    /// The shutdown is posted; its event has not come.
    Posted,
    Done,
}

/// The writing direction (see the module documentation).
#[derive(Debug)]
pub(crate) struct Writer {
    pub(crate) sock: Socket,
    pub(crate) eq: EventQueue,
    ctx: Context,
    /// The send ring, allocated at the first write (a stream that only reads holds none).
    ring: Option<MemoryRegion>,
    len: usize,
    piece: usize,
    /// Ring offset of the oldest byte in flight, and how many bytes are in flight.
    head: usize,
    used: usize,
    /// Lengths of the sends in flight, oldest first (stream sends complete in order).
    in_flight: VecDeque<usize>,
    max_sends: usize,
    shut: Shut,
    /// A send failed: reported by every later write and flush, and by the first shutdown (bytes of the stream were
    /// lost, so it stays broken, as a TCP socket after `EPIPE`; review finding: it was reported once, and the
    /// writes after it were taken).
    failed: Option<Failure>,
    /// The connection was reset or lost when the shutdown was asked for: every later shutdown says `NotConnected`
    /// (the first says a failed write's error, if one failed before). A shutdown that was posted before a reset
    /// stays done (`Ok`).
    reset: Option<OpError>,
    scratch: Vec<Event>,
    /// Threads of a blocking stream waiting on `eq` without the lock, for room in the ring (counted under the
    /// lock before they wait). While there are any, only they take the queue's events.
    pub(crate) waiters: usize,
    /// A wake-up for them is in the queue (at most one is: the queue has room for it beside every send and the
    /// shutdown).
    wake_queued: bool,
}

/// Most sends a writer keeps in flight (small writes each post one; the protocol gathers them).
const MAX_SENDS: usize = 256;

impl Writer {
    pub(crate) fn new(ctx: &Context, sock: Socket, cfg: &StreamConfig) -> io::Result<Writer> {
        Ok(Writer {
            sock,
            // Room for every send, the shutdown and a wake-up.
            eq: EventQueue::new(MAX_SENDS + 2)?,
            ctx: ctx.clone(),
            ring: None,
            len: cfg.send_buffer.max(1),
            piece: cfg.send_piece.clamp(1, cfg.send_buffer.max(1)),
            head: 0,
            used: 0,
            in_flight: VecDeque::new(),
            max_sends: MAX_SENDS,
            shut: Shut::Open,
            reset: None,
            failed: None,
            scratch: Vec::with_capacity(16),
            waiters: 0,
            wake_queued: false,
        })
    }

    /// Wakes the threads waiting on the queue for room (see `waiters`), unless a wake-up is already queued.
    pub(crate) fn wake_waiters(&mut self) {
        if !self.wake_queued {
            self.wake_queued = wake(&self.eq, &self.sock);
        }
    }

    /// Takes in one event of the writer's queue.
    pub(crate) fn absorb(&mut self, ev: Event) {
        if ev.context == WAKE {
            self.wake_queued = false;
            return;
        }
        match ev.kind {
            EventKind::Send => {
                if let Some(n) = self.in_flight.pop_front() {
                    self.head = (self.head + n) % self.len;
                    self.used -= n;
                }
                if let Err(e) = &ev.status {
                    self.failed.get_or_insert_with(|| Failure::of(e));
                }
            }
            EventKind::Shutdown => self.shut = Shut::Done,
            _ => {}
        }
    }

    /// Takes in every event queued, without waiting.
    pub(crate) fn absorb_queued(&mut self) {
        // While threads wait on the queue for room (blocking writes), its events are theirs: taken here, they
        // would leave a waiter waiting for completions that already came.
        if self.waiters > 0 {
            return;
        }
        let mut evs = std::mem::take(&mut self.scratch);
        while self.eq.poll(&mut evs, 16) > 0 {
            for ev in evs.drain(..) {
                self.absorb(ev);
            }
        }
        self.scratch = evs;
    }

    /// The error of an earlier send, every time.
    fn sent_failure(&mut self) -> io::Result<()> {
        match &self.failed {
            Some(f) => Err(f.io()),
            None => Ok(()),
        }
    }

    /// Free bytes after the ones in flight, up to the end of the ring: (offset, length).
    fn room(&mut self) -> (usize, usize) {
        if self.used == 0 {
            self.head = 0;
            return (0, self.len);
        }
        let tail = (self.head + self.used) % self.len;
        if tail > self.head {
            (tail, self.len - tail)
        } else {
            (tail, self.head - tail)
        }
    }

    /// Copies as much of `bufs` (several slices, in order) as the ring has room for and sends it; `None` when the
    /// ring is full (wait for the queue, then call again). The slices are gathered into the ring: the bytes of
    /// small ones (a header and its body) leave in one send rather than one each.
    pub(crate) fn try_write_vectored(
        &mut self,
        bufs: &[io::IoSlice<'_>],
    ) -> io::Result<Option<usize>> {
        let total: usize = bufs.iter().map(|b| b.len()).sum();
        self.absorb_queued();
        self.sent_failure()?;
        if self.shut != Shut::Open {
            return Err(io::Error::new(
                io::ErrorKind::BrokenPipe,
                "the stream is shut down for writing",
            ));
        }
        if total == 0 {
            // As TCP's send of nothing: what a send would meet now, and no byte (review finding: `Ok(0)` came
            // before every check, after a shutdown or a reset too).
            return match self.sock.check_sendable() {
                Ok(()) => Ok(Some(0)),
                Err(e) => Err(self.refused(SendError::State(e))),
            };
        }
        if self.ring.is_none() {
            self.ring = Some(MemoryRegion::alloc(&self.ctx, self.len)?);
        }
        let mut src = Gather::new(bufs);
        let mut n = 0;
        while n < total && self.in_flight.len() < self.max_sends {
            let (at, room) = self.room();
            let k = room.min(self.piece).min(total - n);
            if k == 0 {
                break;
            }
            let ring = self.ring.as_ref().expect("allocated above");
            if let Err(e) = ring.with_slice_mut(at..at + k, |dst| src.fill(dst)) {
                if n > 0 {
                    // The bytes before are on their way; the next write meets the error again.
                    break;
                }
                return Err(other(e));
            }
            if let Err(e) = self
                .sock
                .send(&self.eq, &ring.slice(at..at + k), MsgFlags::NONE, 0)
            {
                let e = self.refused(e);
                if n > 0 {
                    // The bytes before are on their way; the next write gets the error.
                    break;
                }
                return Err(e);
            }
            self.in_flight.push_back(k);
            self.used += k;
            n += k;
        }
        Ok((n > 0).then_some(n))
    }

    /// A send the connection refused, as the write's error; one refused because the connection is down leaves the
    /// stream broken for every later write (see `failed`).
    fn refused(&mut self, e: SendError) -> io::Error {
        if let SendError::State(StateError::ConnectionDown(op)) = &e {
            self.failed.get_or_insert_with(|| Failure::of(op));
        }
        e.into()
    }

    /// Reports the error of an earlier send, if any. Every byte written is already on its way (a write posts
    /// its send), so there is nothing to wait for: like `TcpStream::flush`.
    pub(crate) fn flush(&mut self) -> io::Result<()> {
        self.absorb_queued();
        self.sent_failure()
    }

    /// Shuts the writing side down, like TCP's `shutdown(SHUT_WR)`: end-of-stream is queued behind the bytes
    /// written and the call returns (a peer that does not read does not hold it up).
    pub(crate) fn shutdown(&mut self) -> io::Result<()> {
        self.absorb_queued();
        if self.shut != Shut::Open {
            return self.not_reset();
        }
        match self.sock.shutdown(&self.eq, 0) {
            Ok(()) => self.shut = Shut::Posted,
            // The peer closed the whole connection: there is no writing side left (TCP's `shutdown` in
            // CLOSE_WAIT succeeds too).
            Err(CloseError::State(
                StateError::ConnectionDown(OpError::PeerClosed) | StateError::Shutdown,
            )) => self.shut = Shut::Done,
            // Reset, or lost: `NotConnected`, as TCP's `ENOTCONN` after a reset (review finding: it returned
            // `Ok`, and the next write failed).
            Err(CloseError::State(StateError::ConnectionDown(why))) => {
                self.shut = Shut::Done;
                self.reset = Some(why);
            }
            Err(e) => return Err(e.into()),
        }
        // Writers waiting for room in another thread fail now with `BrokenPipe`, as TCP's `EPIPE` (review
        // finding: they slept until their write timeout, or for ever, as the room needs the peer to read).
        if self.waiters > 0 {
            self.wake_waiters();
        }
        self.sent_failure()?;
        self.not_reset()
    }

    /// `NotConnected` if the connection was reset or lost when the shutdown was asked for.
    fn not_reset(&self) -> io::Result<()> {
        match &self.reset {
            Some(why) => Err(io::Error::new(io::ErrorKind::NotConnected, why.clone())),
            None => Ok(()),
        }
    }
}

/// A cursor over the slices of a vectored write.
struct Gather<'a, 'b> {
    bufs: &'a [io::IoSlice<'b>],
    /// Bytes of `bufs[0]` already taken.
    at: usize,
}

impl<'a, 'b> Gather<'a, 'b> {
    fn new(bufs: &'a [io::IoSlice<'b>]) -> Self {
        Gather { bufs, at: 0 }
    }

    /// Fills `dst` with the next bytes (the caller asks for no more than are left).
    fn fill(&mut self, dst: &mut [u8]) {
        let mut n = 0;
        while n < dst.len() {
            let Some(first) = self.bufs.first() else {
                return;
            };
            let k = (first.len() - self.at).min(dst.len() - n);
            dst[n..n + k].copy_from_slice(&first[self.at..self.at + k]);
            n += k;
            self.at += k;
            if self.at == first.len() {
                self.bufs = &self.bufs[1..];
                self.at = 0;
            }
        }
    }
}

//! `exs_sendfile` with bounded memory (an earlier version read the whole file into a vector, copied it into a region
//! of the same size, and sent it as one operation: the file twice in memory).
//!
//! A SOCK_SEQPACKET socket sends the file as one message (its boundary is the file's), so the whole file must be in
//! registered memory: it is read straight into the region, in [`SENDFILE_CHUNK`]-byte reads, no second copy. A
//! SOCK_STREAM socket has no boundaries to keep: the file goes in [`SENDFILE_CHUNK`]-byte sends through at most
//! [`SENDFILE_DEPTH`] registered buffers, each refilled when its send completes, so memory stays at `SENDFILE_CHUNK *
//! SENDFILE_DEPTH` bytes whatever the file's size. The call reads and posts the first chunks and returns; each chunk's
//! completion reads and posts the next (on whichever thread drives progress, outside the engine lock); one `SendFile`
//! event reports the total bytes, or the first error, when the last chunk has completed.

use std::collections::VecDeque;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::sync::{Arc, Mutex};

use crate::error::{FileError, OpError, SendError};
use crate::event::{Event, EventFlags, EventKind, EventQueue, Ticket};
use crate::memory::MemoryRegion;
use crate::options::SockType;
use crate::proto::conn::HoldId;
use crate::socket::{Socket, SocketRef};

/// What the sendfile's event says when the next chunk could not be sent: the connection's end, or the local
/// close that stopped it, as a send of those bytes would meet (review finding: every refusal but the file's read
/// as the transport's "invalid argument", where `abort` promises `Aborted`).
fn refused(e: SendError) -> OpError {
    use crate::error::StateError;
    match e {
        SendError::File(f) => OpError::File(f),
        SendError::State(StateError::ConnectionDown(why)) => why,
        SendError::State(StateError::InvalidSocket | StateError::Shutdown) => OpError::Aborted,
        SendError::Transport(t) => OpError::Transport(t),
        other => OpError::Transport(crate::TransportError::Invalid(other.to_string())),
    }
}

/// Bytes per read (and, on a stream socket, per send).
pub const SENDFILE_CHUNK: usize = 1 << 20;
/// Stream sockets: chunks in flight (and buffers held).
pub const SENDFILE_DEPTH: usize = 4;

impl Socket {
    /// Sends `len` bytes of `file` from `offset` (ES-API `exs_sendfile`), completing with an event of kind
    /// `SendFile`. The bytes are read into registered memory of this socket's context (no mapping of the file): on
    /// a SOCK_SEQPACKET socket all of them before the call returns, so the file may change afterwards without
    /// affecting what is sent; on a SOCK_STREAM socket chunk by chunk as earlier ones are sent, so the file must stay
    /// as it is until the event. A SOCK_STREAM sendfile reads through a copy of `file`'s descriptor, closed when
    /// the event comes: closing any descriptor of a file releases the process's POSIX record locks (`F_SETLK`) on
    /// it, so a lock held across a stream sendfile is an open file description lock (`F_OFD_SETLK`) or `flock`. A
    /// range that goes past the end of a regular file is refused
    /// ([`SendError::File`], `UnexpectedEof`) before any memory is taken for it. On a SOCK_STREAM socket, a `len`
    /// of 0 sends nothing and completes at once (its event may
    /// come before those of sends still in flight), or is refused where a send would be. Dropping the
    /// application's last handle of the socket while a stream sendfile runs closes it as
    /// [`close`](Socket::close) does. Like any send already started, the whole file goes before the end of stream of a
    /// [`close`](Socket::close) or [`shutdown`](Socket::shutdown) made meanwhile: a close waits for it at most the
    /// linger time ([`ContextOptions::linger`](crate::ContextOptions::linger)), then resets the connection. A
    /// shutdown has no time limit of its own: to give up on a peer that stops reading, `close` the socket. The
    /// chunks are sends of their own, posted as earlier ones complete. Sends made on the socket after a stream
    /// sendfile began (the application's, another sendfile) go after the whole file: they wait, their events
    /// reserved, until the sendfile has posted its last chunk. A stream sendfile that gives up part way (a read of
    /// the file fails after the call: the file shrank, or an I/O error) resets the connection,
    /// and what waited behind it fails: whatever followed part of the file (a clean end of stream, the next send's
    /// bytes) would tell the peer it had all of it.
    pub fn sendfile(
        &self,
        eq: &EventQueue,
        file: &std::fs::File,
        offset: u64,
        len: usize,
        context: u64,
    ) -> Result<(), SendError> {
        sendfile(self, eq, file, offset, len, context)
    }
}

pub(crate) fn sendfile(
    sock: &Socket,
    eq: &EventQueue,
    file: &File,
    offset: u64,
    len: usize,
    context: u64,
) -> Result<(), SendError> {
    let ty = sock.sock_type()?;
    within_file(file, offset, len)?;
    match ty {
        SockType::SeqPacket => {
            let region = MemoryRegion::alloc(sock.context(), len.max(1))?;
            let mut at = 0;
            while at < len {
                let n = SENDFILE_CHUNK.min(len - at);
                region
                    .with_slice_mut(at..at + n, |b| file.read_exact_at(b, offset + at as u64))?
                    .map_err(|e| SendError::File(FileError::from(e)))?;
                at += n;
            }
            // The send's lease keeps the memory registered and alive after `region` goes out of scope.
            sock.send_as(eq, &region.slice(..len), EventKind::SendFile, context)
        }
        SockType::Stream => chunked(sock, eq, file, offset, len, context),
    }
}

/// Refuses a range that goes past the end of a regular file, as the read would, but before any memory is taken
/// for it: a SOCK_SEQPACKET sendfile holds the whole range at once, and a count far past a small file's end (64 GiB
/// of a 1 KiB file) had it allocate and register that much first. A SOCK_STREAM sendfile reads as it goes, and
/// found such a range only at the chunk past the end: the call succeeded, the connection was reset once part of the
/// file had gone, and a range within its first chunks was refused instead (a review). Other files (pipes, devices,
/// `/proc`) report no size to go by: their reads decide.
fn within_file(file: &File, offset: u64, len: usize) -> Result<(), SendError> {
    let meta = file
        .metadata()
        .map_err(|e| SendError::File(FileError::from(e)))?;
    if !meta.is_file() {
        return Ok(());
    }
    let left = meta.len().saturating_sub(offset);
    if u64::try_from(len).map_or(true, |len| len > left) {
        return Err(SendError::File(FileError {
            kind: std::io::ErrorKind::UnexpectedEof,
            os_error: None,
            message: format!(
                "{len} bytes from offset {offset} go past the end of the file ({} bytes)",
                meta.len()
            ),
        }));
    }
    Ok(())
}

/// One stream sendfile in progress. Chunk completions arrive in `inbox`; whoever takes `state` drives (reads and
/// posts in file order, completes the user's event). A completion can arrive while its own thread drives (a post
/// lets the engine lock go, which runs deferred completions): it then only lands in the inbox and the driver
/// picks it up before letting go.
struct FileSend {
    inbox: Mutex<VecDeque<Event>>,
    state: Mutex<Progress>,
}

struct Progress {
    /// The socket, without keeping it open: dropping the application's last handle closes it (see [`SocketRef`]).
    sock: SocketRef,
    file: File,
    offset: u64,
    len: usize,
    bufs: MemoryRegion,
    /// Bytes read and posted so far.
    next: usize,
    /// Bytes whose sends completed.
    sent: usize,
    in_flight: usize,
    failure: Option<OpError>,
    user: Option<Ticket>,
    /// The socket's end of stream, and the sends made on it after this sendfile began, wait for it
    /// ([`SocketRef::hold_sends`]): a close or write shutdown meanwhile lets every chunk go first, within the linger
    /// time. Let go once the last chunk is posted or the sendfile has failed.
    held: Option<HoldId>,
}

impl Progress {
    /// Reads the chunk at `self.next` into buffer `slot`; returns its length.
    fn read(&mut self, slot: usize) -> Result<usize, FileError> {
        let n = SENDFILE_CHUNK.min(self.len - self.next);
        let at = self.offset + self.next as u64;
        let file = &self.file;
        self.bufs
            .with_slice_mut(slot * SENDFILE_CHUNK..slot * SENDFILE_CHUNK + n, |b| {
                file.read_exact_at(b, at)
            })
            .map_err(|e| FileError {
                kind: std::io::ErrorKind::Other,
                os_error: None,
                message: e.to_string(),
            })?
            .map_err(FileError::from)?;
        Ok(n)
    }

    /// Reads and posts the next chunk into `slot`, if any is left and nothing failed; lets the socket's end of
    /// stream go once nothing is.
    fn refill(&mut self, slot: usize, me: &Arc<FileSend>) -> Result<(), SendError> {
        let r = self.post_next(slot, me);
        if r.is_err() || self.failure.is_some() {
            self.let_go(true);
        } else if self.next >= self.len {
            self.let_go(false);
        }
        r
    }

    fn post_next(&mut self, slot: usize, me: &Arc<FileSend>) -> Result<(), SendError> {
        if self.failure.is_some() || self.next >= self.len {
            return Ok(());
        }
        let n = match self.read(slot) {
            Ok(n) => n,
            Err(e) => {
                self.failure = Some(OpError::File(e));
                return Ok(());
            }
        };
        self.post(slot, n, me)
    }

    /// Posts the `n` bytes read into `slot`.
    fn post(&mut self, slot: usize, n: usize, me: &Arc<FileSend>) -> Result<(), SendError> {
        // Chunks are posted only while the sendfile holds its socket (it lets go once it failed or posted all).
        let Some(hold) = self.held else {
            debug_assert!(false, "a chunk posted after the sendfile let go");
            self.failure.get_or_insert(OpError::Cancelled);
            return Ok(());
        };
        let me = Arc::clone(me);
        let ticket = Ticket::hooked(EventKind::Send, slot as u64, self.sock.id(), move |ev| {
            me.arrived(ev)
        });
        let at = slot * SENDFILE_CHUNK;
        self.sock
            .send_held(hold, &self.bufs.slice(at..at + n), ticket)?;
        self.next += n;
        self.in_flight += 1;
        Ok(())
    }

    /// Lets go of the socket's end of stream (once): no chunk is left to post. `gave_up`: the file was not sent
    /// whole (a close or write shutdown waiting for it then resets the connection: see `Engine::release_sends`).
    fn let_go(&mut self, gave_up: bool) {
        if let Some(hold) = self.held.take() {
            self.sock.release_sends(hold, gave_up);
        }
    }
}

impl FileSend {
    fn arrived(self: &Arc<Self>, ev: Event) {
        self.inbox
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push_back(ev);
        self.drive();
    }

    fn drive(self: &Arc<Self>) {
        loop {
            let mut st = match self.state.try_lock() {
                Ok(st) => st,
                // A panic in an earlier drive: the state is whole between two steps; go on (a sendfile that stopped
                // here would hold its socket's end of stream for ever).
                Err(std::sync::TryLockError::Poisoned(p)) => p.into_inner(),
                // The driver will see the inbox before it lets go.
                Err(std::sync::TryLockError::WouldBlock) => return,
            };
            loop {
                let ev = self
                    .inbox
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .pop_front();
                let Some(ev) = ev else { break };
                st.in_flight -= 1;
                match ev.status {
                    Ok(()) => st.sent += ev.bytes,
                    Err(e) => {
                        st.failure.get_or_insert(e);
                    }
                }
                if let Err(e) = st.refill(ev.context as usize, self) {
                    st.failure.get_or_insert_with(|| refused(e));
                }
            }
            if st.in_flight == 0 {
                if let Some(t) = st.user.take() {
                    let sent = st.sent;
                    match st.failure.take() {
                        None => t.complete(Ok(()), sent, EventFlags::default()),
                        // A chunk posted may have reached the peer, completed or not: never `Cancelled` then.
                        Some(e) => {
                            let started = st.next > 0;
                            t.complete(Err(e.once_started(started)), sent, EventFlags::default())
                        }
                    }
                }
            }
            drop(st);
            // A completion that landed after the last look, while the lock was still held, needs a driver.
            if self
                .inbox
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .is_empty()
            {
                return;
            }
        }
    }
}

fn chunked(
    sock: &Socket,
    eq: &EventQueue,
    file: &File,
    offset: u64,
    len: usize,
    context: u64,
) -> Result<(), SendError> {
    if len == 0 {
        // Nothing to send, as sendfile(2) with a count of 0 (an empty file copied whole): done at once, where a
        // zero-length send (refused on a stream) failed the call.
        // Refused where a send would be (not connected yet, shut down for writing, down).
        sock.check_sendable()?;
        let user = sock.reserve(eq, EventKind::SendFile, context)?;
        user.complete(Ok(()), 0, EventFlags::default());
        return Ok(());
    }
    let user = sock.reserve(eq, EventKind::SendFile, context)?;
    let depth = SENDFILE_DEPTH.min(len.div_ceil(SENDFILE_CHUNK)).max(1);
    let file = match file.try_clone() {
        Ok(f) => f,
        Err(e) => {
            user.discard();
            return Err(SendError::File(FileError::from(e)));
        }
    };
    let bufs = match MemoryRegion::alloc(sock.context(), SENDFILE_CHUNK * depth) {
        Ok(b) => b,
        Err(e) => {
            user.discard();
            return Err(e.into());
        }
    };
    let me = Arc::new(FileSend {
        inbox: Mutex::new(VecDeque::new()),
        state: Mutex::new(Progress {
            sock: sock.by_ref(),
            file,
            offset,
            len,
            bufs,
            next: 0,
            sent: 0,
            in_flight: 0,
            failure: None,
            user: Some(user),
            held: None,
        }),
    });
    {
        let mut st = me.state.lock().unwrap_or_else(|p| p.into_inner());
        // Nothing has gone to the peer before the first chunk: its errors are the call's.
        let first = match st.read(0) {
            Ok(n) => st.post_first(n, &me),
            Err(e) => Err(SendError::File(e)),
        };
        if let Err(e) = first {
            // Nothing of the file went out: an end of stream after the bytes before it is true.
            st.let_go(false);
            if let Some(t) = st.user.take() {
                t.discard();
            }
            return Err(e);
        }
        if st.next >= st.len {
            st.let_go(false);
        }
        for slot in 1..depth {
            if let Err(e) = st.refill(slot, &me) {
                st.failure.get_or_insert_with(|| refused(e));
                break;
            }
        }
    }
    // Completions that came while the first chunks were posted.
    me.drive();
    Ok(())
}

impl Progress {
    /// Holds the socket's end of stream back, then posts chunk 0, already read (`n` bytes): errors here are the
    /// call's, nothing having gone to the peer yet.
    fn post_first(&mut self, n: usize, me: &Arc<FileSend>) -> Result<(), SendError> {
        self.held = Some(self.sock.hold_sends()?);
        self.post(0, n, me)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::StateError;

    /// Review finding: see [`refused`].
    #[test]
    fn a_sendfile_stopped_between_chunks_says_why() {
        let down = StateError::ConnectionDown(OpError::ConnectionReset);
        assert_eq!(refused(SendError::State(down)), OpError::ConnectionReset);
        assert_eq!(
            refused(SendError::State(StateError::InvalidSocket)),
            OpError::Aborted
        );
        assert_eq!(
            refused(SendError::State(StateError::Shutdown)),
            OpError::Aborted
        );
        let t = crate::TransportError::Resource("queue".into());
        assert_eq!(
            refused(SendError::Transport(t.clone())),
            OpError::Transport(t)
        );
    }
}

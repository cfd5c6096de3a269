//! Event queues: `exs_qcreate`, `exs_qdelete`, `exs_qdequeue` (ES-API), `exs_qfd` and `exs_qwait_mode` (exs's
//! own). Each function is one call of [`exs::EventQueue`]; events become `exs_event_t`s here.

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::os::fd::{AsFd, AsRawFd};
use std::sync::Mutex;
use std::time::Duration;

use exs::{DequeueError, Event, EventKind, EventQueue, WaitMode};
use libc::{c_int, c_void, timespec};

use crate::abi::*;
use crate::errno::{call, Errno, ToErrno};
use crate::handles::QUEUES;
use crate::socket::{file_accepted, revents};

/// Creates an event queue (ES-API `exs_qcreate`) that holds up to `depth` operations started and not yet
/// dequeued: starting one more fails with `EAGAIN`, so completions never overflow it. Returns its handle, or -1
/// with `errno` `EINVAL` (`depth` < 1) or `EMFILE` (no descriptor left for the queue's `exs_qfd`). Needs no
/// `exs_init`.
#[no_mangle]
pub extern "C" fn exs_qcreate(depth: c_int) -> exs_qhandle_t {
    call(|| {
        let depth = usize::try_from(depth)
            .ok()
            .filter(|&d| d > 0)
            .ok_or(Errno(libc::EINVAL))?;
        let eq =
            EventQueue::new(depth).map_err(|e| Errno(e.raw_os_error().unwrap_or(libc::EMFILE)))?;
        QUEUES.insert_new(eq)
    })
}

/// Deletes an event queue (ES-API `exs_qdelete`); events still in it are discarded (an accepted socket among
/// them is closed). -1 with `errno`: `EBADF`, `EBUSY` while operations started on it have not completed (their
/// events would have nowhere to go: close their sockets or dequeue first) or while another thread waits in
/// `exs_qdequeue` on it (a deleted queue would keep it waiting for events that can no longer come). An operation
/// that another thread starts on the queue meanwhile either started before (`EBUSY` here) or fails with `EBADF`:
/// none starts on a deleted queue.
#[no_mangle]
pub extern "C" fn exs_qdelete(qh: exs_qhandle_t) -> c_int {
    call(|| {
        let mut table = QUEUES.write();
        match table.get(&qh).map(|eq| eq.outstanding() + starting(qh)) {
            None => Err(Errno(libc::EBADF)),
            Some(0) => {
                let gone = table.remove(&qh);
                // Its events (and any socket in them) go once the lock is let go.
                drop(table);
                drop(gone);
                Ok(0)
            }
            Some(_) => Err(Errno(libc::EBUSY)),
        }
    })
}

/// Starts an operation on the queue `qh`. The start is counted for the queue under the queue table's read lock,
/// and `exs_qdelete` (which needs the lock for writing) refuses a queue with starts counted as it refuses one with
/// operations outstanding: so the queue is deleted either before the look-up (`EBADF`, nothing started) or not
/// until the start is over (`EBUSY` meanwhile, and then the operation's event is reserved on it). With a copy taken
/// out of the table and nothing counted, the queue could be deleted in between and the operation's event would go
/// to a queue nobody can reach, its memory busy until the socket closed. `start` itself runs with no table lock
/// held (a SOCK_SEQPACKET sendfile reads its whole file in it). Returns 0 once started.
pub(crate) fn start_on<E>(
    qh: exs_qhandle_t,
    start: impl FnOnce(&EventQueue) -> Result<(), E>,
) -> Result<c_int, Errno>
where
    Errno: From<E>,
{
    let (eq, _started) = counted(qh)?;
    start(&eq).map_err(Errno::from)?;
    Ok(0)
}

/// The queue `qh`, counted as in use (by a start, or a dequeue) under the queue table's read lock until the
/// returned [`Starting`] goes: `exs_qdelete` refuses it meanwhile (see [`start_on`]).
fn counted(qh: exs_qhandle_t) -> Result<(EventQueue, Starting), Errno> {
    let eq = QUEUES.with(qh, |eq| {
        count_start(qh, true);
        eq.clone()
    })?;
    Ok((eq, Starting(qh)))
}

/// Operations being started, and dequeues under way, on each queue (see [`start_on`] and [`exs_qdequeue`]).
static STARTING: Mutex<BTreeMap<exs_qhandle_t, usize>> = Mutex::new(BTreeMap::new());

fn count_start(qh: exs_qhandle_t, more: bool) {
    let mut m = STARTING.lock().unwrap_or_else(|p| p.into_inner());
    let n = m.entry(qh).or_insert(0);
    if more {
        *n += 1;
    } else {
        *n -= 1;
        if *n == 0 {
            m.remove(&qh);
        }
    }
}

fn starting(qh: exs_qhandle_t) -> usize {
    let m = STARTING.lock().unwrap_or_else(|p| p.into_inner());
    m.get(&qh).copied().unwrap_or(0)
}

/// One start (or dequeue) counted for its queue until it is over.
struct Starting(exs_qhandle_t);

impl Drop for Starting {
    fn drop(&mut self) {
        count_start(self.0, false);
    }
}

/// Chooses how `exs_qdequeue` waits on this queue: `EXS_WAIT_ADAPTIVE` (the default: poll once, spin while replies
/// have recently come back within microseconds (no longer than a sleep and a wake-up would cost), then sleep until
/// the number of events still missing has arrived, seed 004), `EXS_WAIT_BLOCK` (sleep, wake on every event) or
/// `EXS_WAIT_BUSY` (never sleep: the waiting thread runs the protocol itself, for the lowest latency at the cost
/// of a busy core). -1 with `errno` `EBADF`, `EINVAL`.
#[no_mangle]
pub extern "C" fn exs_qwait_mode(qh: exs_qhandle_t, mode: c_int) -> c_int {
    call(|| {
        let eq = QUEUES.get(qh)?;
        let mode = match mode {
            EXS_WAIT_ADAPTIVE => WaitMode::Adaptive { spin: 0 },
            EXS_WAIT_BLOCK => WaitMode::Block,
            EXS_WAIT_BUSY => WaitMode::BusyPoll,
            _ => return Err(Errno(libc::EINVAL)),
        };
        eq.set_wait_mode(mode);
        Ok(0)
    })
}

/// A descriptor that is readable while events are queued (level-triggered), for `epoll`, `poll` or `select`:
/// when it is, `exs_qdequeue` with a zero timeout takes them. It belongs to the queue (do not close it) and
/// lives until `exs_qdelete`: a call racing `exs_qdelete` of the same queue on another thread may return a
/// descriptor that is being closed, whose number the next `open` can reuse (as any descriptor another thread
/// closes); stop using it before deleting the queue. -1 with `errno` `EBADF`.
#[no_mangle]
pub extern "C" fn exs_qfd(qh: exs_qhandle_t) -> c_int {
    call(|| {
        let eq = QUEUES.get(qh)?;
        Ok(eq.as_fd().as_raw_fd())
    })
}

thread_local! {
    /// The events of one dequeue on their way to the caller's array (kept per thread: no allocation per call).
    static TAKEN: RefCell<Vec<Event>> = const { RefCell::new(Vec::new()) };
}

/// Takes completed operations' events (ES-API `exs_qdequeue`) into `events`: with `nevents` > 0, between 1 and
/// `nevents` of them; with `nevents` < 0, waits for `-nevents` of them (seed 004's count: one wake-up for the
/// batch), returning fewer only at the timeout. `timeout` NULL waits as long as it takes, zero only looks.
/// Returns how many were taken, 0 if none came before the timeout, -1 with `errno` `EBADF`, `EINVAL` (`nevents`
/// 0, `-nevents` beyond the queue's depth, a null `events`, a bad `timeout`), `EDEADLK` (only on a simulated
/// fabric that can deliver nothing more, before any event was taken: a wait that took some first returns them,
/// fewer than asked, as at a timeout).
///
/// A wait without a timeout lasts until its events come: nothing else ends it (`exs_qdelete` of the queue fails
/// with `EBUSY` meanwhile, and closing a socket ends only the operations it has on the queue). A thread that must
/// be able to stop (at a program's shutdown) waits with a timeout and looks at its own flag between waits.
///
/// # Safety
/// `events` is null or valid for writes of `|nevents|` events; `timeout` is null or points to a `timespec`.
#[no_mangle]
pub unsafe extern "C" fn exs_qdequeue(
    qh: exs_qhandle_t,
    events: *mut exs_event_t,
    nevents: c_int,
    timeout: *const timespec,
) -> c_int {
    call(|| {
        // Counted like a start, so that `exs_qdelete` refuses the queue while this waits on it.
        let (eq, _dequeuing) = counted(qh)?;
        let n = nevents.unsigned_abs() as usize;
        if events.is_null() || n == 0 {
            return Err(Errno(libc::EINVAL));
        }
        let min = if nevents < 0 { n } else { 1 };
        if min > eq.depth() {
            // More events than the queue can ever hold at once: the wait could only end at the timeout.
            return Err(Errno(libc::EINVAL));
        }
        // SAFETY: the caller's promise above.
        let timeout = unsafe { duration(timeout) }?;
        TAKEN.with(|taken| {
            let mut taken = taken.borrow_mut();
            taken.clear();
            match eq.dequeue(&mut taken, min, n, timeout) {
                Ok(_) | Err(DequeueError::TimedOut) => {}
                // A wait that stalled may have taken events first: they are out of the queue and the caller's
                // now (an accepted socket among them would be closed if they were dropped).
                Err(DequeueError::Stalled { .. }) if !taken.is_empty() => {}
                Err(e) => return Err(e.into()),
            }
            let got = taken.len();
            for (i, ev) in taken.drain(..).enumerate() {
                // SAFETY: i < got <= n, and `events` holds n (the caller's promise).
                unsafe { events.add(i).write(to_c(ev)) };
            }
            Ok(got as c_int)
        })
    })
}

/// A `timespec` as a wait: `None` for a null pointer (forever).
///
/// # Safety
/// `t` is null or points to a `timespec`.
unsafe fn duration(t: *const timespec) -> Result<Option<Duration>, Errno> {
    if t.is_null() {
        return Ok(None);
    }
    // SAFETY: non-null, so it points to a timespec (the caller).
    let t = unsafe { t.read_unaligned() };
    let secs = u64::try_from(t.tv_sec).map_err(|_| Errno(libc::EINVAL))?;
    let nanos = u32::try_from(t.tv_nsec)
        .ok()
        .filter(|&n| n < 1_000_000_000)
        .ok_or(Errno(libc::EINVAL))?;
    Ok(Some(Duration::new(secs, nanos)))
}

/// An accept event's socket number and errno: an accepted socket that could not be filed under a number (the
/// table full) is -1 with `EMFILE`, where it was -1 with errno 0, which a program reads as success (review finding).
fn accepted_and_errno(errno: c_int, filed: Option<Result<c_int, Errno>>) -> (c_int, c_int) {
    match filed {
        Some(Ok(fd)) => (fd, errno),
        Some(Err(Errno(e))) if errno == 0 => (-1, e),
        _ => (-1, errno),
    }
}

/// The C form of an event: an accepted socket gets its number here.
fn to_c(mut ev: Event) -> exs_event_t {
    let fd = c_int::try_from(ev.socket.0).unwrap_or(-1);
    let kind = match ev.kind {
        EventKind::Connect => EXS_EVT_CONNECT,
        EventKind::Accept => EXS_EVT_ACCEPT,
        EventKind::Send => EXS_EVT_SEND,
        EventKind::Recv => EXS_EVT_RECV,
        EventKind::SendFile => EXS_EVT_SENDFILE,
        EventKind::Poll => EXS_EVT_POLL,
        EventKind::Shutdown => EXS_EVT_SHUTDOWN,
        EventKind::ReadNotify => EXS_EVT_READ_NOTIFY,
        // exs reports no other kind through these calls.
        _ => 0,
    };
    let ok = ev.status.is_ok();
    let mut flags = 0;
    if ev.flags.truncated {
        flags |= libc::MSG_TRUNC;
    }
    // From the event itself: the socket may be closed (and gone from the table) by the time its events are taken.
    if kind == EXS_EVT_RECV && ok && ev.flags.eor {
        flags |= libc::MSG_EOR;
    }
    if kind == EXS_EVT_RECV && ok && ev.flags.eof {
        flags |= EXS_EOF;
    }
    let (accepted, errno) = accepted_and_errno(
        ev.status.as_ref().err().map_or(0, ToErrno::errno),
        ev.take_accepted().map(file_accepted),
    );
    exs_event_t {
        exs_evt_type: kind,
        exs_evt_errno: errno,
        exs_evt_context: ev.context as usize as *mut c_void,
        exs_evt_fd: fd,
        exs_evt_bytes: ev.bytes as libc::ssize_t,
        exs_evt_accepted: accepted,
        exs_evt_flags: flags,
        exs_evt_revents: revents(ev.readiness),
    }
}

#[cfg(test)]
mod tests {
    use std::ptr;
    use std::sync::mpsc;
    use std::thread;

    use exs::sim::{SimConfig, World};
    use exs::{SockType, Socket};

    use super::*;
    use crate::errno::last_errno as errno;
    use crate::handles::SOCKETS;

    const NO_EVENT: exs_event_t = exs_event_t {
        exs_evt_type: 0,
        exs_evt_errno: 0,
        exs_evt_context: ptr::null_mut(),
        exs_evt_fd: -1,
        exs_evt_bytes: 0,
        exs_evt_accepted: -1,
        exs_evt_flags: 0,
        exs_evt_revents: 0,
    };

    #[test]
    fn an_accepted_socket_left_without_a_number_is_told_as_emfile() {
        assert_eq!(accepted_and_errno(0, Some(Ok(7))), (7, 0));
        assert_eq!(
            accepted_and_errno(0, Some(Err(Errno(libc::EMFILE)))),
            (-1, libc::EMFILE)
        );
        assert_eq!(
            accepted_and_errno(libc::ECONNRESET, None),
            (-1, libc::ECONNRESET)
        );
        assert_eq!(accepted_and_errno(0, None), (-1, 0));
    }

    /// A listening socket of `ctx` (host `host` of `world`) whose accepts stay outstanding until a peer connects.
    fn listener(world: &World, ctx: &exs::Context, host: usize, port: u16) -> Socket {
        let l = Socket::new(ctx, SockType::Stream).unwrap();
        l.bind(world.addr(host, port)).unwrap();
        l.listen(4).unwrap();
        l
    }

    /// Thread A starts an accept on a queue while thread B deletes it. B's `exs_qdelete` comes between A's look-up
    /// of the queue and its start (A waits there for B); it returned 0, the accept then started on the deleted
    /// queue, and its event went where nobody could dequeue it. Now B gets `EBUSY` at once (a start is counted on
    /// the queue, and B does not wait for it), and the event reaches the queue.
    #[test]
    fn a_queue_deleted_while_an_operation_starts_on_it_keeps_it_or_refuses_it() {
        let world = World::new(SimConfig::default());
        let ctx = world.host();
        let l = listener(&world, &ctx, 0, 7000);
        let qh = exs_qcreate(4);
        assert!(qh > 0, "errno {}", errno());
        let (deleted_tx, deleted_rx) = mpsc::channel();
        let mut deleter = None;
        let started = start_on(qh, |eq| {
            deleter = Some(thread::spawn(move || {
                let r = (exs_qdelete(qh), errno());
                let _ = deleted_tx.send(());
                r
            }));
            // Time for the deletion to finish, if it can before the start.
            let _ = deleted_rx.recv_timeout(Duration::from_millis(300));
            l.accept(eq, 1)
        });
        assert_eq!(started, Ok(0));
        let deleted = deleter.expect("the start ran").join().unwrap();
        assert_eq!(
            deleted,
            (-1, libc::EBUSY),
            "the queue holds a started accept"
        );
        // The accept's event reaches the queue: closing the listener cancels it.
        l.close().unwrap();
        let mut ev = NO_EVENT;
        let zero = timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: one event's room, and a timespec.
        assert_eq!(unsafe { exs_qdequeue(qh, &mut ev, 1, &zero) }, 1);
        assert_eq!(
            (ev.exs_evt_type, ev.exs_evt_errno),
            (EXS_EVT_ACCEPT, libc::ECANCELED)
        );
        assert_eq!(exs_qdelete(qh), 0);
        // Once it is deleted, an operation refuses to start on it.
        let late = start_on(qh, |_| -> Result<(), Errno> {
            panic!("an operation started on a deleted queue")
        });
        assert_eq!(late, Err(Errno(libc::EBADF)));
    }

    /// Thread A waits in `exs_qdequeue` while thread B deletes the queue. B's delete returned 0, and A went on
    /// waiting on a queue nothing could reach any more (for ever, without a timeout). Now B gets `EBUSY` while A
    /// waits, and the delete succeeds once A's wait is over.
    #[test]
    fn a_queue_is_not_deleted_while_a_thread_waits_in_dequeue_on_it() {
        let qh = exs_qcreate(4);
        assert!(qh > 0, "errno {}", errno());
        let waiter = thread::spawn(move || {
            let mut ev = NO_EVENT;
            let wait = timespec {
                tv_sec: 1,
                tv_nsec: 0,
            };
            // SAFETY: one event's room, and a timespec.
            (unsafe { exs_qdequeue(qh, &mut ev, 1, &wait) }, errno())
        });
        // Until the waiter is counted (at most 500 ms: before the fix it never was).
        let t0 = std::time::Instant::now();
        while starting(qh) == 0 && t0.elapsed() < Duration::from_millis(500) {
            thread::sleep(Duration::from_millis(1));
        }
        assert_eq!(
            (exs_qdelete(qh), errno()),
            (-1, libc::EBUSY),
            "a thread waits on the queue"
        );
        assert_eq!(
            waiter.join().unwrap().0,
            0,
            "the wait ends at its timeout, with no event"
        );
        assert_eq!(exs_qdelete(qh), 0);
    }

    /// A wait for three events on a simulated fabric that goes idle after two: the dequeue took the two, then
    /// found that the third could never come (`DequeueError::Stalled`) and returned -1 with `EDEADLK`; the next
    /// dequeue on the thread threw the two away, closing the accepted socket among them. Now they are returned,
    /// as at a timeout.
    #[test]
    fn a_dequeue_that_stalls_after_taking_events_returns_them() {
        let world = World::new(SimConfig::default());
        let (a, b) = (world.host(), world.host());
        let eq = EventQueue::new(4).unwrap();
        let qh = QUEUES.insert_new(eq.clone()).unwrap();
        let l = listener(&world, &b, 1, 7000);
        l.accept(&eq, 1).unwrap();
        let c = Socket::new(&a, SockType::Stream).unwrap();
        c.connect(&eq, world.addr(1, 7000), 2).unwrap();
        // An accept nobody will ever complete.
        let idle = listener(&world, &b, 1, 7001);
        idle.accept(&eq, 3).unwrap();
        world.run_until_idle(100_000);
        assert_eq!(eq.len(), 2, "the accept and the connect are queued");
        let mut evs = [NO_EVENT; 3];
        // SAFETY: room for three events; no timeout.
        let n = unsafe { exs_qdequeue(qh, evs.as_mut_ptr(), -3, ptr::null()) };
        assert_eq!(n, 2, "errno {}", errno());
        let accept = evs[..2]
            .iter()
            .find(|e| e.exs_evt_type == EXS_EVT_ACCEPT)
            .expect("the accept's event");
        let server = accept.exs_evt_accepted;
        assert!(server > 0, "{accept:?}");
        assert!(SOCKETS.get(server).is_ok(), "the accepted socket is open");
        // Nothing else was taken: the next wait has none to return.
        // SAFETY: as above.
        let again = unsafe { exs_qdequeue(qh, evs.as_mut_ptr(), -1, ptr::null()) };
        assert_eq!((again, errno()), (-1, libc::EDEADLK));
        SOCKETS.remove(server).unwrap().sock.close().unwrap();
        for s in [c, l, idle] {
            s.close().unwrap();
        }
        assert_eq!(exs_qdelete(qh), 0);
    }

    /// A SOCK_SEQPACKET connection on a simulated world whose progress runs only when the test says: the world,
    /// its two contexts, a queue filed in the C table (and its handle), the listener (on `port` of host 1), the
    /// client and the accepted server socket. The accept's and the connect's events are taken.
    struct SeqPair {
        world: World,
        a: exs::Context,
        b: exs::Context,
        eq: EventQueue,
        qh: exs_qhandle_t,
        l: Socket,
        c: Socket,
        server: Socket,
    }

    fn seqpacket_pair(port: u16) -> SeqPair {
        let world = World::new(SimConfig::default());
        let (a, b) = (world.host(), world.host());
        let eq = EventQueue::new(8).unwrap();
        let qh = QUEUES.insert_new(eq.clone()).unwrap();
        let l = Socket::new(&b, SockType::SeqPacket).unwrap();
        l.bind(world.addr(1, port)).unwrap();
        l.listen(4).unwrap();
        l.accept(&eq, 1).unwrap();
        let c = Socket::new(&a, SockType::SeqPacket).unwrap();
        c.connect(&eq, world.addr(1, port), 2).unwrap();
        let mut evs = Vec::new();
        eq.dequeue(&mut evs, 2, 2, None).unwrap();
        let server = evs
            .iter_mut()
            .find_map(|e| e.take_accepted())
            .expect("the accept's event");
        SeqPair {
            world,
            a,
            b,
            eq,
            qh,
            l,
            c,
            server,
        }
    }

    /// A message taken from the queue after its socket was closed (gone from the socket table) lost its
    /// `MSG_EOR`: the flag came from a look-up of the socket's type in the table. It comes with the event now.
    #[test]
    fn a_message_taken_after_its_socket_is_closed_still_says_eor() {
        let SeqPair {
            world,
            a,
            b,
            eq,
            qh,
            l,
            c,
            server,
        } = seqpacket_pair(7002);
        let dst = exs::MemoryRegion::alloc(&b, 64).unwrap();
        let src = exs::MemoryRegion::from_vec(&a, vec![7; 10]).unwrap();
        server
            .recv(&eq, &dst.all(), exs::MsgFlags::NONE, 3)
            .unwrap();
        c.send(&eq, &src.all(), exs::MsgFlags::NONE, 4).unwrap();
        world.run_until_idle(100_000);
        // Closed before its events are taken (the socket is in no table here, as after exs_close).
        server.close().unwrap();
        let mut got = [NO_EVENT; 2];
        // SAFETY: room for two events; no timeout.
        let n = unsafe { exs_qdequeue(qh, got.as_mut_ptr(), -2, ptr::null()) };
        assert_eq!(n, 2, "errno {}", errno());
        let recv = got
            .iter()
            .find(|e| e.exs_evt_type == EXS_EVT_RECV)
            .expect("the receive's event");
        assert_eq!(
            (recv.exs_evt_errno, recv.exs_evt_bytes),
            (0, 10),
            "{recv:?}"
        );
        assert_eq!(
            recv.exs_evt_flags & libc::MSG_EOR,
            libc::MSG_EOR,
            "{recv:?}"
        );
        for s in [c, l] {
            s.close().unwrap();
        }
        world.run_until_idle(100_000);
        let _ = exs_qdelete(qh);
    }

    /// An empty SOCK_SEQPACKET message and the end of stream both completed a receive with 0 bytes, and the header
    /// called 0 the end of stream: a program that stopped there took an empty message for the peer's close. The end
    /// of stream now says so (`EXS_EOF`), and the empty message has `MSG_EOR`.
    #[test]
    fn an_empty_message_and_the_end_of_stream_are_told_apart() {
        let SeqPair {
            world,
            a,
            b,
            eq,
            qh,
            l,
            c,
            server,
        } = seqpacket_pair(7003);
        let dst = exs::MemoryRegion::alloc(&b, 64).unwrap();
        let empty = exs::MemoryRegion::from_vec(&a, vec![7; 8]).unwrap();
        for (range, ctx) in [(0..32, 3), (32..64, 4)] {
            server
                .recv(&eq, &dst.slice(range), exs::MsgFlags::NONE, ctx)
                .unwrap();
        }
        c.send(&eq, &empty.slice(0..0), exs::MsgFlags::NONE, 5)
            .unwrap();
        world.run_until_idle(100_000);
        c.close().unwrap();
        world.run_until_idle(100_000);
        let mut got = [NO_EVENT; 3];
        // SAFETY: room for three events; no timeout.
        let n = unsafe { exs_qdequeue(qh, got.as_mut_ptr(), -3, ptr::null()) };
        assert_eq!(n, 3, "errno {}", errno());
        let recv = |ctx: usize| {
            *got.iter()
                .find(|e| e.exs_evt_type == EXS_EVT_RECV && e.exs_evt_context as usize == ctx)
                .expect("the receive's event")
        };
        let (message, end) = (recv(3), recv(4));
        assert_eq!(
            (message.exs_evt_errno, message.exs_evt_bytes),
            (0, 0),
            "{message:?}"
        );
        assert_eq!(
            message.exs_evt_flags,
            libc::MSG_EOR,
            "an empty message: {message:?}"
        );
        assert_eq!((end.exs_evt_errno, end.exs_evt_bytes), (0, 0), "{end:?}");
        assert_eq!(end.exs_evt_flags, EXS_EOF, "the end of stream: {end:?}");
        for s in [server, l] {
            s.close().unwrap();
        }
        world.run_until_idle(100_000);
        let _ = exs_qdelete(qh);
    }
}

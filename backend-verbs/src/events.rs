//! The device's asynchronous events (`ibv_get_async_event`): a completion queue or queue pair in error, a port
//! gone, a device failed. The device context's event descriptor is in the wait set; its events are read when
//! arming finds it readable, logged (errors as errors: a completion queue that overflowed says so here), and
//! acknowledged at once (destroying a queue pair waits for its events to be acknowledged). A queue pair in error
//! completes its requests flushed, which is what the engine acts on. A device that failed (its fatal event, or its
//! descriptor gone) completes nothing more: every connection of the transport is then reported down
//! ([`VerbsTransport::fail_device`]).
//!
//! rdma_cm hands every user of a device in the process the same context, and so the same event descriptor: every
//! transport on the device has it in its wait set, and whichever reads first takes the event. One transport may
//! read (and log, and acknowledge) another's events, which that one then never sees: its queue pair's number is
//! not in the reader's table, so the event is logged without an endpoint. A queue pair's trouble reaches its owner
//! anyway (its requests complete flushed), and so does a failed device (its next calls fail). An error of another
//! transport's completion queue or shared receive queue (`IBV_EVENT_CQ_ERR`, `IBV_EVENT_SRQ_ERR`) is handed to
//! that transport ([`crate::routes`]), which takes its connections down as if it had read it itself (it was only
//! logged, and the owner's connections stalled for good). Each transport sets the shared descriptor non-blocking
//! and removes it from its own wait set only.
//!
//! A device that goes away (disassociated: unplugged, its driver unloaded) leaves the descriptor readable for
//! good (`EPOLLERR`) while every read fails (`EIO`): the descriptor then leaves the wait set, with one warning,
//! or the wait set would stay readable and the engine would wake in a loop.

use std::mem::MaybeUninit;
use std::os::fd::{BorrowedFd, RawFd};

use nix::sys::epoll::Epoll;
use rdma_sys::*;

use crate::VerbsTransport;

/// What a failed read of the event descriptor says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ReadFailure {
    /// No event is pending (`EAGAIN`).
    Empty,
    /// A signal interrupted the read: read again.
    Interrupted,
    /// The descriptor will not deliver events any more (`EIO` after the device went): it left the wait set.
    Gone,
}

/// What the failed read `err` of the event descriptor `fd` says; when it will not deliver events any more, `fd`
/// leaves `epoll` (the wait set) and a warning says so.
pub(crate) fn after_failed_read(epoll: &Epoll, fd: RawFd, err: &std::io::Error) -> ReadFailure {
    match err.kind() {
        std::io::ErrorKind::WouldBlock => return ReadFailure::Empty,
        std::io::ErrorKind::Interrupted => return ReadFailure::Interrupted,
        _ => {}
    }
    // SAFETY: `fd` is the device context's event descriptor, open while the context is (longer than this call).
    let bfd = unsafe { BorrowedFd::borrow_raw(fd) };
    let removed = epoll.delete(bfd);
    tracing::warn!(
        %err,
        removed = removed.is_ok(),
        "the device's asynchronous events cannot be read (the device is gone?): no longer waited for"
    );
    ReadFailure::Gone
}

/// How loudly an event is logged.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Severity {
    Error,
    Warn,
    Debug,
}

/// The name and severity of the event with code `code` (`enum ibv_event_type` of verbs.h, read as a number: a
/// code this binding's enum lacks is not a valid value of it).
pub(crate) fn describe(code: u32) -> (&'static str, Severity) {
    use Severity::*;
    match code {
        0 => ("completion queue error (overrun)", Error),
        1 => ("queue pair fatal error", Error),
        2 => ("queue pair invalid request error", Error),
        3 => ("queue pair access error", Error),
        4 => ("communication established", Debug),
        5 => ("send queue drained", Debug),
        6 => ("path migrated", Debug),
        7 => ("path migration error", Error),
        8 => ("device fatal error", Error),
        9 => ("port active", Debug),
        10 => ("port error", Warn),
        11..=13 | 17 | 18 => ("port attribute change", Debug),
        14 => ("shared receive queue error", Error),
        15 => ("shared receive queue limit reached", Debug),
        16 => ("last work request reached", Debug),
        19 => ("work queue fatal error", Error),
        _ => ("unknown event", Warn),
    }
}

/// Whether the event's element is a queue pair (its number then says whose).
fn names_qp(code: u32) -> bool {
    matches!(code, 1..=7 | 16)
}

impl VerbsTransport {
    /// Reads, logs and acknowledges the device's pending asynchronous events (its descriptor is non-blocking); a
    /// descriptor that fails otherwise than for want of events leaves the wait set ([`after_failed_read`]).
    pub(crate) fn read_async_events(&mut self) {
        loop {
            let mut ev = MaybeUninit::<ibv_async_event>::uninit();
            // SAFETY: open context; the call fills `ev` when it returns 0, else sets errno (that of its read).
            if unsafe { ibv_get_async_event(self.ctx, ev.as_mut_ptr()) } != 0 {
                let err = std::io::Error::last_os_error();
                // SAFETY: open context; its descriptor stays open with it.
                let fd = unsafe { (*self.ctx).async_fd };
                match after_failed_read(&self.epoll, fd, &err) {
                    ReadFailure::Interrupted => continue,
                    ReadFailure::Empty => return,
                    ReadFailure::Gone => {
                        self.fail_device("ibv_get_async_event", err.raw_os_error().unwrap_or(0));
                        return;
                    }
                }
            }
            let p = ev.as_mut_ptr();
            // SAFETY: filled by the call. The type is read as the C enum's integer; the element as the queue pair
            // only for queue pair events, whose queue pair lives until the event is acknowledged (below).
            let (code, qp_num, mine, queue) = unsafe {
                let code = std::ptr::addr_of!((*p).event_type).cast::<u32>().read();
                let qp = names_qp(code)
                    .then(|| (*p).element.qp)
                    .filter(|q| !q.is_null());
                // Whether the queue the event names is this transport's own (another transport may share the
                // device context).
                let queue: *mut std::ffi::c_void = match code {
                    0 => (*p).element.cq.cast(),
                    14 => (*p).element.srq.cast(),
                    _ => std::ptr::null_mut(),
                };
                let mine = match code {
                    0 => queue == self.cq.cast(),
                    14 => !self.srq.is_null() && queue == self.srq.cast(),
                    _ => false,
                };
                (code, qp.map(|q| (*q).qp_num), mine, queue)
            };
            let ep = qp_num.and_then(|n| self.qpn.get(&n).copied());
            let (what, severity) = describe(code);
            match severity {
                Severity::Error => tracing::error!(code, qp_num, ?ep, "device event: {what}"),
                Severity::Warn => tracing::warn!(code, qp_num, ?ep, "device event: {what}"),
                Severity::Debug => tracing::debug!(code, qp_num, ?ep, "device event: {what}"),
            }
            // Another transport's queue (see `routes`): handed to its owner before the acknowledgment, which lets
            // the owner destroy the queue (review: acknowledged first, the queue could be destroyed, its address
            // entered by a new transport's queue, and the error taken to that one).
            if !mine
                && !queue.is_null()
                && fails_transport(code, true).is_some()
                && crate::routes::deliver(queue, code)
            {
                tracing::debug!(code, "handed to the transport whose queue it names");
            }
            if code == ibv_event_type::IBV_EVENT_COMM_EST as u32 {
                self.notify_established(ep);
            }
            // SAFETY: an event we got, acknowledged once, after its last use.
            unsafe { ibv_ack_async_event(p) };
            if let Some(what) = fails_transport(code, mine) {
                self.fail_device(what, 0);
            }
        }
    }

    /// `IBV_EVENT_COMM_EST`: data reached a queue pair whose connection rdma_cm has not seen established (the
    /// peer's ready-to-use message lost or late, on InfiniBand or RoCE). rdma_notify(3) tells rdma_cm, which then
    /// takes the connection as established at once (review finding: it was only logged, and `Established` waited
    /// for the retransmissions, or the accept failed after data had come).
    fn notify_established(&mut self, ep: Option<exs_transport::EndpointId>) {
        let Some(e) = ep.and_then(|ep| self.eps.get(&ep)) else {
            return;
        };
        // SAFETY: a live cm id of ours, whose queue pair the event names (alive until it is acknowledged).
        if unsafe { rdma_notify(e.id, ibv_event_type::IBV_EVENT_COMM_EST) } != 0 {
            tracing::debug!(?ep, "rdma_notify: {}", std::io::Error::last_os_error());
        }
    }

    /// Takes an error of this transport's queues that another transport read (see [`crate::routes`]): every
    /// connection goes down, as when it reads its own.
    pub(crate) fn take_routed(&mut self) {
        if !self.mailbox.pending() {
            return;
        }
        if let Some(code) = self.mailbox.take() {
            let what =
                fails_transport(code, true).unwrap_or("a queue error another transport read");
            self.fail_device(what, 0);
        }
    }

    /// The device, or the completion queue or shared receive queue every connection of this transport shares,
    /// failed (`call` said so, with `code`): no request will complete any more, so every connection is reported
    /// down, once, and the engine ends its operations and releases it (the queue pair destroyed before its records
    /// and their leases go) instead of waiting for ever. Logged once. Later listens, connects and accepts are
    /// refused ([`VerbsTransport::refuse_if_failed`]: a new queue pair would use the failed queue). Another
    /// transport on the same device context may have read a fatal device event instead (see the module's note): the
    /// device's later calls fail, or rdma_cm's device removal, reaches it.
    pub(crate) fn fail_device(&mut self, call: &str, code: i32) {
        if !self.device_failed {
            self.device_failed = true;
            tracing::error!(
                call,
                code,
                connections = self.eps.len(),
                "the RDMA device, or a queue every connection shares, failed: every connection is taken down"
            );
        }
        let ids: Vec<_> = self.eps.keys().copied().collect();
        for ep in ids {
            if let Some(ev) = self.report_down(ep) {
                self.cm_backlog.push_back(ev);
            }
        }
    }
}

impl VerbsTransport {
    /// Refuses a new listener or connection once the device, or a queue every connection shares, failed
    /// ([`VerbsTransport::fail_device`]; review finding: a new queue pair was put on the failed completion queue or
    /// shared receive queue, and its requests never completed).
    pub(crate) fn refuse_if_failed(&self) -> Result<(), exs_transport::TransportError> {
        match self.device_failed {
            true => Err(exs_transport::TransportError::Resource(
                "the RDMA device, or a queue every connection of this transport shares, failed: open a new \
                 context"
                    .into(),
            )),
            false => Ok(()),
        }
    }
}

/// Whether the event with code `code` says that what every connection of this transport needs failed: the
/// device (`IBV_EVENT_DEVICE_FATAL`), or, when `mine` (the queue it names is this transport's), the completion
/// queue they share (`IBV_EVENT_CQ_ERR`: an overrun drops completions, so their operations would never end) or
/// the shared receive queue (`IBV_EVENT_SRQ_ERR`: no shared receive completes again). Review finding: the last two
/// were logged and nothing else, and the connections stalled. Returns the event's name.
fn fails_transport(code: u32, mine: bool) -> Option<&'static str> {
    match code {
        8 => Some("IBV_EVENT_DEVICE_FATAL"),
        0 if mine => Some("IBV_EVENT_CQ_ERR"),
        14 if mine => Some("IBV_EVENT_SRQ_ERR"),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use nix::sys::epoll::{EpollCreateFlags, EpollEvent, EpollFlags, EpollTimeout};
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

    /// Events ready in `epoll` right now.
    fn ready(epoll: &Epoll) -> usize {
        let mut events = [EpollEvent::empty(); 2];
        epoll.wait(&mut events, EpollTimeout::ZERO).unwrap()
    }

    #[test]
    fn the_fatal_device_event_and_errors_of_this_transports_shared_queues_take_every_connection_down(
    ) {
        assert_eq!(fails_transport(8, false), Some("IBV_EVENT_DEVICE_FATAL"));
        assert_eq!(describe(8), ("device fatal error", Severity::Error));
        // Review finding: an overrun of the completion queue every connection shares, or an error of the shared
        // receive queue, was logged and nothing else.
        assert_eq!(fails_transport(0, true), Some("IBV_EVENT_CQ_ERR"));
        assert_eq!(fails_transport(14, true), Some("IBV_EVENT_SRQ_ERR"));
        // Another transport's queues on the same device context are its own business.
        assert_eq!(fails_transport(0, false), None);
        assert_eq!(fails_transport(14, false), None);
        // A queue pair's or a port's trouble is the connection's (its requests complete flushed) or passes.
        for code in (0..=19).filter(|&c| ![0, 8, 14].contains(&c)) {
            assert_eq!(fails_transport(code, true), None, "event {code}");
        }
    }

    #[test]
    fn a_device_gone_takes_its_event_descriptor_out_of_the_wait_set() {
        // A descriptor readable for good, as a disassociated device's is.
        // SAFETY: eventfd returns a new descriptor (or -1, checked), owned here.
        let fd = unsafe { libc::eventfd(1, libc::EFD_NONBLOCK) };
        assert!(fd >= 0);
        // SAFETY: just created, owned by nothing else.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        let epoll = Epoll::new(EpollCreateFlags::EPOLL_CLOEXEC).unwrap();
        epoll
            .add(&fd, EpollEvent::new(EpollFlags::EPOLLIN, 3))
            .unwrap();
        assert_eq!(ready(&epoll), 1);
        let raw = fd.as_raw_fd();
        let err = |code| std::io::Error::from_raw_os_error(code);
        // No event pending, or a signal: the descriptor stays.
        assert_eq!(
            after_failed_read(&epoll, raw, &err(libc::EAGAIN)),
            ReadFailure::Empty
        );
        assert_eq!(
            after_failed_read(&epoll, raw, &err(libc::EINTR)),
            ReadFailure::Interrupted
        );
        assert_eq!(ready(&epoll), 1);
        // The device is gone: the wait set no longer wakes for it.
        assert_eq!(
            after_failed_read(&epoll, raw, &err(libc::EIO)),
            ReadFailure::Gone
        );
        assert_eq!(ready(&epoll), 0, "the wait set stays readable");
    }

    #[test]
    fn a_completion_queue_overrun_or_a_fatal_queue_pair_is_logged_as_an_error() {
        use ibv_event_type::*;
        for e in [
            IBV_EVENT_CQ_ERR,
            IBV_EVENT_QP_FATAL,
            IBV_EVENT_QP_ACCESS_ERR,
            IBV_EVENT_SRQ_ERR,
            IBV_EVENT_DEVICE_FATAL,
        ] {
            assert_eq!(describe(e as u32).1, Severity::Error, "{e:?}");
        }
        for e in [
            IBV_EVENT_QP_LAST_WQE_REACHED,
            IBV_EVENT_COMM_EST,
            IBV_EVENT_PORT_ACTIVE,
        ] {
            assert_eq!(describe(e as u32).1, Severity::Debug, "{e:?}");
        }
        assert_eq!(describe(IBV_EVENT_PORT_ERR as u32).1, Severity::Warn);
        assert_eq!(describe(99), ("unknown event", Severity::Warn));
        assert!(
            names_qp(IBV_EVENT_QP_FATAL as u32) && names_qp(IBV_EVENT_QP_LAST_WQE_REACHED as u32)
        );
        assert!(!names_qp(IBV_EVENT_CQ_ERR as u32) && !names_qp(IBV_EVENT_SRQ_ERR as u32));
    }
}

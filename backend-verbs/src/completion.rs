//! Completions: the shared completion queue drained into exs completions (retiring send-queue records in order,
//! turning emulated write-with-immediate messages back into immediates), work completion statuses as
//! [`WcError`]s, and waiting (arming the completion channel, the epoll set over it and the rdma_cm channel).

use std::ffi::CStr;
use std::os::fd::{BorrowedFd, RawFd};
use std::ptr;

use exs_transport::{Completed, Completion, EndpointId, TransportError, WcError};
use nix::sys::epoll::{Epoll, EpollEvent, EpollFlags, EpollTimeout};
use rdma_sys::*;

use crate::queue::WrIds;
use crate::{emulated, ret_err, VerbsTransport};

pub(crate) fn epoll_add(epoll: &Epoll, fd: RawFd, data: u64) -> Result<(), TransportError> {
    // SAFETY: the descriptor belongs to a channel that stays open while it is in the set.
    let bfd = unsafe { BorrowedFd::borrow_raw(fd) };
    epoll
        .add(bfd, EpollEvent::new(EpollFlags::EPOLLIN, data))
        .map_err(|e| TransportError::os("epoll_ctl", e.into()))
}

fn wc_error(status: u32) -> WcError {
    match status {
        ibv_wc_status::IBV_WC_WR_FLUSH_ERR => WcError::Flushed,
        ibv_wc_status::IBV_WC_REM_ACCESS_ERR => WcError::RemoteAccess,
        ibv_wc_status::IBV_WC_RETRY_EXC_ERR => WcError::RetryExceeded,
        ibv_wc_status::IBV_WC_RNR_RETRY_EXC_ERR => WcError::RnrRetryExceeded,
        ibv_wc_status::IBV_WC_LOC_PROT_ERR => WcError::LocalProtection,
        ibv_wc_status::IBV_WC_LOC_LEN_ERR => WcError::LocalLength,
        other => {
            // SAFETY: ibv_wc_status_str returns a static string for any status.
            let s = unsafe { CStr::from_ptr(ibv_wc_status_str(other)) };
            WcError::Other(s.to_string_lossy().into_owned())
        }
    }
}

impl VerbsTransport {
    /// Polls the completion queue until it is empty, into the transport's own array of work completions (a busy
    /// poller comes here every round: nothing is allocated or cleared per call).
    pub(crate) fn drain_cq(&mut self) -> usize {
        // Taken out while its entries are handled (`on_wc` needs the transport); an empty Vec allocates nothing.
        let mut wcs = std::mem::take(&mut self.wcs);
        let mut total = 0;
        loop {
            // SAFETY: live CQ; `wcs` holds `wcs.len()` initialised entries.
            let n = unsafe { ibv_poll_cq(self.cq, wcs.len() as i32, wcs.as_mut_ptr()) };
            if n <= 0 {
                self.wcs = wcs;
                if n < 0 {
                    // Not an empty queue: taken for one, every request would wait for ever.
                    self.fail_device("ibv_poll_cq", n);
                }
                return total;
            }
            for wc in &wcs[..n as usize] {
                self.on_wc(wc);
            }
            total += n as usize;
        }
    }

    fn on_wc(&mut self, wc: &ibv_wc) {
        let status = if wc.status == ibv_wc_status::IBV_WC_SUCCESS {
            Ok(())
        } else {
            Err(wc_error(wc.status))
        };
        if WrIds::is_recv(wc.wr_id) {
            self.on_recv_wc(wc, status);
        } else {
            self.on_send_wc(wc, status);
        }
    }

    /// A receive completed: its record goes back to the engine with the length and the immediate, native or
    /// emulated (see [`emulated`]).
    fn on_recv_wc(&mut self, wc: &ibv_wc, status: Result<(), WcError>) {
        let Some((owner, rec)) = self.recvs.remove(&wc.wr_id) else {
            return;
        };
        if owner.is_some() {
            // A shared receive's room is the shared queue's reservation; an endpoint's own was taken when posted.
            self.cq_budget.give(1);
        }
        // A shared receive belongs to the QP that dequeued it; EndpointId(0) if that one is gone.
        let ep =
            owner.unwrap_or_else(|| self.qpn.get(&wc.qp_num).copied().unwrap_or(EndpointId(0)));
        let mut imm = None;
        let mut len = wc.byte_len;
        if status.is_ok() {
            if wc.opcode == ibv_wc_opcode::IBV_WC_RECV_RDMA_WITH_IMM
                || wc.wc_flags & ibv_wc_flags::IBV_WC_WITH_IMM.0 != 0
            {
                // SAFETY: with an immediate (write-with-immediate, or a send with one) the union holds it, in
                // network byte order.
                imm = Some(u32::from_be(unsafe {
                    wc.imm_data_invalidated_rkey_union.imm_data
                }));
            } else if wc.byte_len == 8 {
                let mut b = [0u8; 8];
                if let Some(v) = rec
                    .sge
                    .lease()
                    .read(0, &mut b)
                    .ok()
                    .and_then(|_| emulated::decode(&b))
                {
                    imm = Some(v);
                    len = 0;
                }
            }
        }
        self.cq_backlog.push_back((
            Completion {
                ep,
                wr_id: rec.wr_id,
                op: Completed::Recv { len, imm },
                status,
            },
            owner.is_none(),
        ));
    }

    /// A send-queue request completed: it and every earlier unsignalled one are retired.
    fn on_send_wc(&mut self, wc: &ibv_wc, status: Result<(), WcError>) {
        let Some(&ep) = self.qpn.get(&wc.qp_num) else {
            return;
        };
        let Some(e) = self.eps.get_mut(&ep) else {
            return;
        };
        // A signalled (or failed) request completes every earlier unsignalled one: in order, successfully. A
        // completion that names none of this endpoint's requests retires nothing: it is a late one of a queue pair
        // destroyed before this one got its number (identifiers are never reused), or a repeated one. What may
        // still complete of a request (the flushed send of an emulated write-with-immediate whose write failed)
        // keeps its room until it does (`SendQueue::retire_each`).
        let backlog = &mut self.cq_backlog;
        let freed = e
            .sends
            .retire_each(wc.wr_id, status.is_err(), |rec, named| {
                let mut st = if named { status.clone() } else { Ok(()) };
                if rec.broken && st.is_ok() {
                    st = Err(WcError::Other(
                        "only part of the request reached the device".into(),
                    ));
                }
                let Some(op) = rec.item.kind else {
                    if let Err(e) = st {
                        // A failed window bind breaks the queue pair: the requests after it complete flushed.
                        tracing::warn!(?ep, %e, "memory window bind failed");
                    }
                    return;
                };
                backlog.push_back((
                    Completion {
                        ep,
                        wr_id: rec.item.wr_id,
                        op,
                        status: st,
                    },
                    false,
                ));
            });
        self.cq_budget.give(freed);
    }

    /// [`Transport::poll`](exs_transport::Transport::poll): the completion queue drained into the backlog, then the
    /// backlog handed out.
    pub(crate) fn poll_cq(&mut self, out: &mut Vec<Completion>, max: usize) -> usize {
        self.take_routed();
        if self.cq_backlog.len() < max {
            self.drain_cq();
        }
        let n = self.cq_backlog.len().min(max);
        if n > 0 {
            out.extend(self.cq_backlog.drain(..n).map(|(c, _)| c));
        }
        n
    }

    /// [`Transport::arm`](exs_transport::Transport::arm): `ibv_req_notify_cq`, then one more poll; `true` also
    /// says that no rdma_cm event is waiting ([`Transport::arm_covers_cm`](exs_transport::Transport::arm_covers_cm)).
    ///
    /// One look at the wait set (zero timeout) says which channels have something: the completion channel is then
    /// read until it is empty, and an rdma_cm event waiting makes the arm fail so the next round takes it. This
    /// spares the read of an empty completion channel, which failed on every arm with nothing pending, and the
    /// engine's read of the rdma_cm channel in every round that finds no completions (each a system call).
    ///
    /// The channel is emptied, not read once: an event of the arming before the last can arrive after that arm's
    /// look and wait beside the last one's, and a channel left readable keeps the wait set readable, which a
    /// sleeper registered edge-triggered (a tokio task) would never see change.
    pub(crate) fn arm_wait(&mut self) -> Result<bool, TransportError> {
        let mut events = [EpollEvent::empty(); 4];
        let n = self
            .epoll
            .wait(&mut events, EpollTimeout::ZERO)
            .map_err(|e| TransportError::os("epoll_wait", e.into()))?;
        let ready = |data: u64| events[..n].iter().any(|e| e.data() == data);
        // An error of our queues that another transport read (see `routes`): its descriptor is read back to quiet
        // first (level-triggered: left readable, it would wake every sleep), then the error taken; one delivered
        // after the look above makes the descriptor readable again, and wakes the sleep that follows.
        if ready(WAIT_ROUTED) {
            self.mailbox.quiet();
        }
        self.take_routed();
        if ready(WAIT_ASYNC) {
            self.read_async_events();
        }
        if ready(WAIT_COMP) {
            let mut read = 0;
            loop {
                let mut cq = ptr::null_mut();
                let mut ctx = ptr::null_mut();
                // SAFETY: non-blocking channel; returns -1 when no event is pending.
                if unsafe { ibv_get_cq_event(self.comp, &mut cq, &mut ctx) } != 0 {
                    break;
                }
                read += 1;
            }
            if read > 0 {
                // SAFETY: acknowledging the events we got, for our CQ (its only channel).
                unsafe { ibv_ack_cq_events(self.cq, read) };
            }
        }
        // SAFETY: live CQ. It returns its error code (errno is not set).
        let rc = unsafe { ibv_req_notify_cq(self.cq, 0) };
        if rc != 0 {
            return Err(ret_err("ibv_req_notify_cq", rc));
        }
        // A completion that arrived before the re-arm would otherwise never wake us.
        self.drain_cq();
        Ok(self.cq_backlog.is_empty() && self.cm_backlog.is_empty() && !ready(WAIT_CM))
    }
}

/// The completion channel's entry in the wait set.
pub(crate) const WAIT_COMP: u64 = 1;
/// The rdma_cm event channel's entry in the wait set.
pub(crate) const WAIT_CM: u64 = 2;
/// The device's asynchronous events' entry in the wait set.
pub(crate) const WAIT_ASYNC: u64 = 3;
/// The entry of the descriptor that says another transport read an error of this one's queues (see
/// [`crate::routes`]).
pub(crate) const WAIT_ROUTED: u64 = 4;

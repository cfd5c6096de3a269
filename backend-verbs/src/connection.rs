//! Connections: endpoints (an rdma_cm id and its reliable-connected queue pair), listeners, connecting and
//! accepting, refusing requests, disconnecting and releasing.

use std::ffi::c_void;
use std::net::SocketAddr;
use std::ptr;

use exs_transport::{EndpointId, ListenerId, RequestId, Transport, TransportError, WorkRequest};
use nix::sys::socket::{SockaddrLike, SockaddrStorage};
use rdma_sys::*;
use rustc_hash::FxHashMap;

use crate::emulated::ImmSlab;
use crate::memory::{revoke_on_release, MwSlot};
use crate::post::RecvRec;
use crate::queue::{SendQueue, Signaler};
use crate::record::SendRec;
use crate::{os_err, VerbsTransport, RESOLVE_TIMEOUT_MS, TAG_EP, TAG_LISTENER};

pub(crate) fn sockaddr(a: SocketAddr) -> SockaddrStorage {
    SockaddrStorage::from(a)
}

pub(crate) fn to_socketaddr(p: *const libc::sockaddr) -> Option<SocketAddr> {
    if p.is_null() {
        return None;
    }
    // SAFETY: rdma_cm returns a pointer to a sockaddr inside the cm id, valid while the id lives; from_raw reads
    // it according to its family.
    let s = unsafe { SockaddrStorage::from_raw(p, None) }?;
    if let Some(v4) = s.as_sockaddr_in() {
        return Some(SocketAddr::from((v4.ip(), v4.port())));
    }
    s.as_sockaddr_in6()
        .map(|v6| SocketAddr::from((v6.ip(), v6.port())))
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum EpState {
    Resolving,
    Connecting,
    Connected,
    Down,
}

/// The RDMA read depths of a connection from this side's point of view: `initiator`, the reads this side may have
/// outstanding at the peer (its queue pair's `max_rd_atomic`); `responder`, the peer's reads this side holds at
/// once (`max_dest_rd_atomic`). rdma_cm carries each in a byte. In a connection request or a reply the kernel has
/// already turned the peer's values around (a requester's responder resources arrive as `initiator_depth`), so an
/// event's `param.conn` reads the same way.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct ReadDepths {
    pub(crate) initiator: u8,
    pub(crate) responder: u8,
}

impl ReadDepths {
    /// What this side offers: `read_depth` both ways.
    pub(crate) fn offer(read_depth: u32) -> ReadDepths {
        let rd = read_depth.min(u32::from(u8::MAX)) as u8;
        ReadDepths {
            initiator: rd,
            responder: rd,
        }
    }

    /// As a connection-management event states them (see above).
    pub(crate) fn of_event(conn: &rdma_conn_param) -> ReadDepths {
        ReadDepths {
            initiator: conn.initiator_depth,
            responder: conn.responder_resources,
        }
    }

    /// What the accepting side answers a request with: no more reads initiated than the requester holds (its
    /// responder resources, `request.initiator`), no more resources than the requester will use (its initiator
    /// depth, `request.responder`), and neither more than `ours`.
    pub(crate) fn accept(ours: ReadDepths, request: ReadDepths) -> ReadDepths {
        ReadDepths {
            initiator: ours.initiator.min(request.initiator),
            responder: ours.responder.min(request.responder),
        }
    }
}

pub(crate) struct Ep {
    pub(crate) id: *mut rdma_cm_id,
    pub(crate) qp: *mut ibv_qp,
    pub(crate) state: EpState,
    pub(crate) reported_down: bool,
    /// This side connected (rather than accepted).
    pub(crate) active: bool,
    /// Active side: what to do once the route is resolved.
    pub(crate) pending: Option<(Vec<u8>, Vec<WorkRequest>)>,
    pub(crate) sends: SendQueue<SendRec>,
    pub(crate) signal: Signaler,
    /// Native entries the send queue holds (as created: at least what was asked for).
    pub(crate) sq_cap: u32,
    /// Windows bound to this queue pair: deallocated before it is destroyed (see [`MwSlot`]).
    pub(crate) windows: Vec<std::sync::Weak<MwSlot>>,
    /// Largest inline payload of this queue pair (as created).
    pub(crate) max_inline: u32,
    /// The read depths agreed with the peer (accepted, or granted in the peer's accept); zero until then.
    pub(crate) reads: ReadDepths,
    /// Where emulated immediates' payloads live when they are not sent inline (emulating transports only).
    pub(crate) imm_slab: Option<ImmSlab>,
    pub(crate) local: Option<SocketAddr>,
    pub(crate) peer: Option<SocketAddr>,
}

impl Ep {
    /// The endpoint is down; whether this is the first time its end is reported (an endpoint ends once, as
    /// `Disconnected` or as `ConnectFailed`, whichever comes first).
    pub(crate) fn end(&mut self) -> bool {
        self.state = EpState::Down;
        !std::mem::replace(&mut self.reported_down, true)
    }

    /// The endpoint failed before it was established: `ConnectFailed` for a connect of ours; an accepted one is
    /// reported down (the transport's `accept` ends with `Established` or `Disconnected`); nothing if its end was
    /// reported already.
    pub(crate) fn failed_before_up(
        &mut self,
        ep: EndpointId,
        reason: exs_transport::ConnectFailure,
    ) -> Option<exs_transport::CmEvent> {
        let active = self.active;
        self.end().then_some(if active {
            exs_transport::CmEvent::ConnectFailed { ep, reason }
        } else {
            exs_transport::CmEvent::Disconnected { ep }
        })
    }
}

impl VerbsTransport {
    pub(crate) fn new_ep(id: *mut rdma_cm_id) -> Ep {
        Ep {
            id,
            qp: ptr::null_mut(),
            state: EpState::Resolving,
            reported_down: false,
            active: false,
            pending: None,
            sends: SendQueue::default(),
            signal: Signaler::default(),
            sq_cap: 0,
            windows: Vec::new(),
            max_inline: 0,
            reads: ReadDepths::default(),
            imm_slab: None,
            local: None,
            peer: None,
        }
    }

    /// Creates the queue pair of an endpoint (same device as ours) and posts its initial receives.
    pub(crate) fn create_qp(
        &mut self,
        ep: EndpointId,
        recvs: Vec<WorkRequest>,
    ) -> Result<(), TransportError> {
        let id = self.eps.get(&ep).ok_or(TransportError::NoEndpoint)?.id;
        // SAFETY: live cm id; after address resolution its verbs context is set.
        if unsafe { (*id).verbs } != self.ctx {
            return Err(TransportError::Unsupported(
                "the peer is reached through another RDMA device".into(),
            ));
        }
        let attr = self.create_fitting_qp(id)?;
        let inline = self.qp_inline;
        let e = self.eps.get_mut(&ep).ok_or(TransportError::NoEndpoint)?;
        // SAFETY: rdma_create_qp set id->qp.
        let qp = unsafe { (*e.id).qp };
        e.qp = qp;
        // What the queue pair got, but no more than was asked for (a provider may round up).
        e.max_inline = attr.cap.max_inline_data.min(inline);
        // rdma_create_qp wrote back the depth the queue pair got (at least the one asked for).
        e.sq_cap = attr.cap.max_send_wr;
        if self.settings.emulated_imm {
            // Registered only where the payloads cannot go inline (see `emulated`).
            let pd = (e.max_inline < 8).then_some(&self.pd);
            e.imm_slab = Some(ImmSlab::new(pd, e.sq_cap)?);
        }
        // SAFETY: live QP.
        let num = unsafe { (*qp).qp_num };
        self.qpn.insert(num, ep);
        let mut batch = recvs;
        self.post_many(ep, &mut batch)
    }

    /// What an endpoint's queue pair asks for, with `inline` bytes of inline data.
    fn qp_init_attr(&self, inline: u32) -> ibv_qp_init_attr {
        let mut attr: ibv_qp_init_attr = unsafe {
            // SAFETY: plain data, zero is valid before we fill it.
            std::mem::zeroed()
        };
        attr.send_cq = self.cq;
        attr.recv_cq = self.cq;
        attr.qp_type = ibv_qp_type::IBV_QPT_RC;
        attr.sq_sig_all = 0;
        // Room for every request the engine may have outstanding with its share of extra entries (the send of an
        // emulated write-with-immediate, a window bind): a full queue would refuse a chain part-way.
        // On iWARP the active side's first message takes one more (`send_first_message`).
        attr.cap.max_send_wr = self.settings.qp_send_wr();
        if self.srq.is_null() {
            attr.cap.max_recv_wr = self.caps.max_recv_wr;
            attr.cap.max_recv_sge = 1;
        } else {
            // Receives come from the shared queue.
            attr.srq = self.srq;
        }
        attr.cap.max_send_sge = self.caps.max_sge;
        attr.cap.max_inline_data = inline;
        attr
    }

    /// `rdma_create_qp` on `id`, with the inline size lowered ([`smaller_inline`]) while the device refuses the
    /// queue pair for its size. The inline size was probed on a queue pair of one entry and one scatter/gather
    /// entry (`device::probe_inline`); ours are deeper and wider, and on providers where inline data shares the
    /// work-request size with the scatter/gather list the probed size can be refused for every connection. The
    /// size that worked is kept for the next ones. Returns what the queue pair got.
    fn create_fitting_qp(
        &mut self,
        id: *mut rdma_cm_id,
    ) -> Result<ibv_qp_init_attr, TransportError> {
        let mut inline = self.qp_inline;
        loop {
            let mut attr = self.qp_init_attr(inline);
            // SAFETY: live id with a resolved route (or a connection request) and no queue pair (a refused
            // creation leaves none), our PD, attr filled.
            if unsafe { rdma_create_qp(id, self.pd.0, &mut attr) } == 0 {
                if inline != self.qp_inline {
                    tracing::warn!(
                        "queue pairs take {inline} bytes inline, not the probed {}: using {inline} from now on",
                        self.qp_inline
                    );
                    self.qp_inline = inline;
                }
                return Ok(attr);
            }
            let err = std::io::Error::last_os_error();
            let Some(next) = smaller_inline(inline, err.raw_os_error()) else {
                return Err(TransportError::os("rdma_create_qp", err));
            };
            tracing::debug!(%err, inline, next, "rdma_create_qp refused the queue pair; less inline data");
            inline = next;
        }
    }

    /// What `rdma_connect` or `rdma_accept` sends: our private data, read depths (see [`ReadDepths`]) and whether
    /// the peer's adapter retries a message that finds no receive posted (for ever, 7; or not at all).
    pub(crate) fn conn_param(
        private: &[u8],
        reads: ReadDepths,
        rnr_retry: bool,
    ) -> rdma_conn_param {
        rdma_conn_param {
            private_data: private.as_ptr() as *const c_void,
            private_data_len: private.len().min(255) as u8,
            responder_resources: reads.responder,
            initiator_depth: reads.initiator,
            flow_control: 1,
            retry_count: 7,
            rnr_retry_count: if rnr_retry { 7 } else { 0 },
            srq: 0,
            qp_num: 0,
        }
    }

    /// Keeps (and logs) the read depths a connection agreed on. The engine takes its read depth from the
    /// capabilities (one for every connection); a connection granted fewer holds the reads beyond them in its
    /// queue pair, whose depth rdma_cm set to the agreed one, rather than sending more than the peer can take.
    pub(crate) fn agreed(&mut self, ep: EndpointId, reads: ReadDepths, peer: ReadDepths) {
        let ours = self.settings.read_depth;
        if let Some(e) = self.eps.get_mut(&ep) {
            e.reads = reads;
        }
        tracing::debug!(
            ep = ep.0,
            initiator = reads.initiator,
            responder = reads.responder,
            ours,
            peer_initiator = peer.responder,
            peer_responder = peer.initiator,
            "read depths agreed"
        );
        if u32::from(reads.initiator) < ours {
            tracing::info!(
                ep = ep.0,
                "the peer takes {} reads at once, fewer than our {ours}: the others wait on the device",
                reads.initiator
            );
        }
    }

    pub(crate) fn addresses(&mut self, ep: EndpointId) {
        if let Some(e) = self.eps.get_mut(&ep) {
            // SAFETY: live id; the returned pointers point into it.
            unsafe {
                e.local = to_socketaddr(rdma_get_local_addr(&*e.id) as *const _);
                e.peer = to_socketaddr(rdma_get_peer_addr(&*e.id) as *const _);
            }
        }
    }

    /// Refuses a connection request and destroys its id: the one way a request that is not accepted ends.
    pub(crate) fn reject_id(id: *mut rdma_cm_id) {
        // SAFETY: `id` is a live connection-request id that nothing else holds (it was just taken out of the
        // request table, or never entered it); after the reject nothing uses it, and it is destroyed once.
        unsafe {
            if rdma_reject(id, ptr::null(), 0) != 0 {
                tracing::debug!(
                    "rdma_reject: {} (destroying the request anyway)",
                    std::io::Error::last_os_error()
                );
            }
            rdma_destroy_id(id);
        }
    }

    /// [`Transport::listen`](exs_transport::Transport::listen): `rdma_bind_addr` and `rdma_listen` on the device's
    /// address, with a device queue of at least [`MIN_DEVICE_BACKLOG`] (see [`device_backlog`]).
    pub(crate) fn start_listening(
        &mut self,
        addr: SocketAddr,
        backlog: u32,
    ) -> Result<(ListenerId, SocketAddr), TransportError> {
        // An unspecified address would listen on every device; ours is the one carrying the configured address.
        let addr = if addr.ip().is_unspecified() {
            SocketAddr::new(self.cfg.addr, addr.port())
        } else {
            addr
        };
        let id_num = ListenerId(self.next_listener);
        self.next_listener += 1;
        let mut id = ptr::null_mut();
        let ctx = (TAG_LISTENER | id_num.0 as usize) as *mut c_void;
        // SAFETY: our channel; `id` receives a new id.
        if unsafe { rdma_create_id(self.ch, &mut id, ctx, rdma_port_space::RDMA_PS_TCP) } != 0 {
            return Err(os_err("rdma_create_id"));
        }
        let sa = sockaddr(addr);
        // SAFETY: live id; sockaddr lives across the calls.
        let failed = unsafe {
            if rdma_bind_addr(id, sa.as_ptr() as *mut _) != 0 {
                Some("rdma_bind_addr")
            } else if rdma_listen(id, device_backlog(backlog)) != 0 {
                Some("rdma_listen")
            } else {
                None
            }
        };
        if let Some(call) = failed {
            let e = std::io::Error::last_os_error();
            // SAFETY: the id is ours and unused.
            unsafe { rdma_destroy_id(id) };
            return Err(listen_error(addr, call, e));
        }
        // SAFETY: bound id.
        let port = u16::from_be(unsafe { rdma_get_src_port(id) });
        self.listeners.insert(id_num, id);
        Ok((id_num, SocketAddr::new(addr.ip(), port)))
    }

    /// [`Transport::close_listener`](exs_transport::Transport::close_listener), refusing its requests first.
    pub(crate) fn stop_listening(&mut self, listener: ListenerId) {
        if let Some(id) = self.listeners.remove(&listener) {
            // Requests handed out and not answered are refused first: their ids outlive the listener's.
            for (id, _) in self.requests.take_listener(listener) {
                Self::reject_id(id);
            }
            // SAFETY: our listening id, removed from the table and destroyed once; every event naming it was
            // acknowledged in `poll_cm`, so destroying it does not wait.
            unsafe { rdma_destroy_id(id) };
        }
    }

    /// [`Transport::connect`](exs_transport::Transport::connect): starts address resolution; the rest follows in
    /// connection-management events.
    pub(crate) fn start_connect(
        &mut self,
        ep: EndpointId,
        addr: SocketAddr,
        private: &[u8],
        recvs: Vec<WorkRequest>,
    ) -> Result<(), TransportError> {
        id_free(&self.eps, ep)?;
        let mut id = ptr::null_mut();
        let ctx = (TAG_EP | ep.0 as usize) as *mut c_void;
        // SAFETY: our channel.
        if unsafe { rdma_create_id(self.ch, &mut id, ctx, rdma_port_space::RDMA_PS_TCP) } != 0 {
            return Err(os_err("rdma_create_id"));
        }
        let src = sockaddr(SocketAddr::new(self.cfg.addr, 0));
        let dst = sockaddr(addr);
        // SAFETY: live id; both sockaddrs live across the call (rdma_cm copies them).
        if unsafe {
            rdma_resolve_addr(
                id,
                src.as_ptr() as *mut _,
                dst.as_ptr() as *mut _,
                RESOLVE_TIMEOUT_MS,
            )
        } != 0
        {
            let e = os_err("rdma_resolve_addr");
            // SAFETY: the id is ours and unused.
            unsafe { rdma_destroy_id(id) };
            return Err(e);
        }
        let mut e = Self::new_ep(id);
        e.active = true;
        e.pending = Some((private.to_vec(), recvs));
        self.eps.insert(ep, e);
        Ok(())
    }

    /// [`Transport::accept`](exs_transport::Transport::accept): a queue pair on the request's id, then
    /// `rdma_accept`.
    pub(crate) fn accept_request(
        &mut self,
        request: RequestId,
        ep: EndpointId,
        private: &[u8],
        recvs: Vec<WorkRequest>,
    ) -> Result<(), TransportError> {
        // Checked before the request is taken: it stays for the engine to reject.
        id_free(&self.eps, ep)?;
        let (_, (id, offered)) = self
            .requests
            .take(request)
            .ok_or_else(|| TransportError::Invalid("unknown request".into()))?;
        // SAFETY: the request's id is live and ours; from now on it names this endpoint.
        unsafe { (*id).context = (TAG_EP | ep.0 as usize) as *mut c_void };
        let mut e = Self::new_ep(id);
        e.state = EpState::Connecting;
        self.eps.insert(ep, e);
        if let Err(err) = self.create_qp(ep, recvs) {
            // SAFETY: the id is live; rejecting tells the peer. `release` destroys it (once: it is the endpoint's).
            unsafe { rdma_reject(id, ptr::null(), 0) };
            self.release_ep(ep);
            return Err(err);
        }
        // Never more than the requester can take: rdma_cm moves our queue pair to the depths we accept with.
        let reads = ReadDepths::accept(ReadDepths::offer(self.settings.read_depth), offered);
        let mut param = Self::conn_param(private, reads, self.settings.rnr_retry);
        // SAFETY: live id with a QP; private data copied by the call.
        if unsafe { rdma_accept(id, &mut param) } != 0 {
            let err = os_err("rdma_accept");
            self.release_ep(ep);
            return Err(err);
        }
        self.agreed(ep, reads, offered);
        Ok(())
    }

    /// [`Transport::disconnect`](exs_transport::Transport::disconnect): `rdma_disconnect`, or down at once when not
    /// connected.
    pub(crate) fn start_disconnect(&mut self, ep: EndpointId) {
        let Some(e) = self.eps.get_mut(&ep) else {
            return;
        };
        match e.state {
            EpState::Connected | EpState::Connecting => {
                // SAFETY: live id; DISCONNECTED follows on both sides.
                unsafe { rdma_disconnect(e.id) };
                if e.state == EpState::Connecting {
                    if let Some(ev) = self.report_down(ep) {
                        self.cm_backlog.push_back(ev);
                    }
                }
            }
            EpState::Resolving | EpState::Down => {
                if let Some(ev) = self.report_down(ep) {
                    self.cm_backlog.push_back(ev);
                }
            }
        }
    }

    /// [`Transport::release`](exs_transport::Transport::release): windows, queue pair and id destroyed, then the
    /// records dropped; or, if the device would not destroy the queue pair, kept for good with their buffers.
    pub(crate) fn release_ep(&mut self, ep: EndpointId) {
        let Some(e) = self.eps.remove(&ep) else {
            return;
        };
        // Whatever is still on the queue pair completes (flushed) rather than vanishing with it: a queue pair
        // released without a DISCONNECTED (a connect abandoned, a transport dropped) was never moved to error.
        let in_error = e.qp.is_null() || Self::break_qp(e.qp).is_ok();
        if !e.qp.is_null() && !self.srq.is_null() {
            // Seed 003: shared buffers this QP dequeued but had not completed are flushed now it is in error;
            // collect those completions while the QP still maps to this endpoint, so the buffers go back (some
            // devices drop a destroyed QP's completions from the queue).
            //
            // KNOWN GAP (review item 4, not fixed): the flush is asynchronous on rxe and mlx5, so this drain, the
            // one after the destruction included, can run before the flush completion of a shared receive this QP
            // had dequeued is written; the destruction then discards it, and its `recvs` record (with the engine's
            // pool slot and lease) stays until the transport is dropped. The verbs way is to wait, after the move
            // to error, for IBV_EVENT_QP_LAST_WQE_REACHED of this QP (read through `read_async_events`), bounded
            // (~100 ms), then drain and destroy. Not done yet because: the event may already have come and gone
            // (a DISCONNECTED moved the QP to error earlier, `flush_ep`), so what was seen must be remembered per
            // QP number; another transport on the same device context may read it first (see `events`), so that
            // memory would have to be shared by the process; and a kernel whose rxe never raises it would stall
            // every release (under the engine's lock) for the whole bound. Debian 12's rxe (6.1, `rxe_resp.c`)
            // is such a kernel: its responder completes the shared receive it took with a flush error when its
            // task next runs (scheduled by the move to error, not run by it), and raises no such event.
            self.drain_cq();
        }
        // Windows still bound to the queue pair die first: it cannot be destroyed while they are bound, and their
        // keys end with the connection. A window whose bind is still queued stays if the queue pair is not in
        // error (the bind could still run); its record, dropped below, deallocates it.
        let queued: Vec<&std::sync::Arc<MwSlot>> = if in_error {
            Vec::new()
        } else {
            e.sends
                .items()
                .filter_map(|r| r._bind.as_ref())
                .map(|b| &b._slot)
                .collect()
        };
        revoke_on_release(&e.windows, &queued, in_error);
        drop(queued);
        if self.destroy_qp(&e) {
            self.forget_records(ep, e);
        } else {
            self.cq_backlog.retain(|(c, shared)| c.ep != ep || *shared);
            self.kept_qp = true;
            keep_records(ep, e, &mut self.recvs);
        }
    }

    /// Destroys a released endpoint's queue pair and id, then collects the completions its queue pair left. Says
    /// whether the queue pair is gone: `false` if the device would not destroy it, when it may still reach every
    /// buffer posted on it.
    fn destroy_qp(&mut self, e: &Ep) -> bool {
        // SAFETY: the QP is live until destroyed just below; its number is read first.
        let qpn = (!e.qp.is_null()).then(|| unsafe { (*e.qp).qp_num });
        // `ibv_destroy_qp` rather than `rdma_destroy_qp`, which says nothing of a failure: it also clears the id's
        // pointer to the queue pair, and destroys the completion queues librdmacm made for the id, of which there
        // are none (the queue pair is made on the transport's own).
        let destroyed = e.qp.is_null()
            || {
                // SAFETY: the QP is ours and live; destroying it first stops the device from touching any posted
                // buffer, so the records (and their leases) can be dropped after.
                let rc = unsafe { ibv_destroy_qp(e.qp) };
                if rc == 0 {
                    // SAFETY: the id is ours and live; its queue pair is gone.
                    unsafe { (*e.id).qp = ptr::null_mut() };
                } else {
                    tracing::error!(
                    qpn,
                    rc,
                    "ibv_destroy_qp of a released endpoint failed; the buffers posted on it are kept for the \
                     process's life"
                );
                }
                rc == 0
            };
        // SAFETY: the id is ours; nothing uses it after this.
        unsafe { rdma_destroy_id(e.id) };
        if let Some(n) = qpn {
            // Others leave them in the queue, and write some between the drain before and the destruction:
            // collect those too while the number still names this endpoint (after a destruction no more come),
            // so a shared receive is never credited to the next endpoint that gets the number; and so that the
            // room the endpoint's requests took in the completion queue is free when it is given back.
            self.drain_cq();
            self.qpn.remove(&n);
        }
        destroyed
    }

    /// Drops the records of a released endpoint, whose queue pair is destroyed, giving back the room they took in
    /// the completion queue.
    fn forget_records(&mut self, ep: EndpointId, e: Ep) {
        // Completions of the destroyed QP still in the queue name none of the records of whoever gets its number
        // next (identifiers are never reused), so they are ignored when they come. The entries still counted
        // include those of flushed sends still to come after their write's failed completion.
        self.cq_budget.give(e.sends.entries());
        drop(e);
        let before = self.recvs.len();
        self.recvs.retain(|_, (owner, _)| *owner != Some(ep));
        self.cq_budget
            .give((before - self.recvs.len()).try_into().unwrap_or(u32::MAX));
        // Completions of a released endpoint are dropped, except shared receives: the engine reposts those.
        self.cq_backlog.retain(|(c, shared)| c.ep != ep || *shared);
    }
}

/// Keeps for good the records of released endpoint `ep`, whose queue pair the device would not destroy: it may
/// still reach every buffer posted on it, so neither the records nor their leases go back, and the buffers are
/// marked kept ([`exs_dma::DmaBuf::keep_for_good`]: their owners are told). Nor does the room they took in the
/// completion queue: the queue pair may still complete them.
fn keep_records(ep: EndpointId, e: Ep, recvs: &mut FxHashMap<u64, (Option<EndpointId>, RecvRec)>) {
    for r in e.sends.items() {
        if let Some(op) = &r.op {
            op.mark_kept_for_good();
        }
        // A window whose bind may still be queued on the queue pair keeps its exposure's lease.
        if let Some(b) = &r._bind {
            b._reg.buf().keep_for_good();
        }
    }
    let mine: Vec<u64> = recvs
        .iter()
        .filter(|(_, (owner, _))| *owner == Some(ep))
        .map(|(&id, _)| id)
        .collect();
    for id in mine {
        if let Some((_, rec)) = recvs.remove(&id) {
            rec.sge.mark_kept_for_good();
            std::mem::forget(rec);
        }
    }
    std::mem::forget(e);
}

/// Why listening on `addr` failed in `call` with `e`: the documented [`TransportError::AddrInUse`] (its message is
/// the API's: `address in use: ADDR`), or [`TransportError::AddrNotAvailable`] naming the call and its code. Neither
/// variant has a source to carry them (`exs-transport`'s), so the call and code are logged as well.
fn listen_error(addr: SocketAddr, call: &str, e: std::io::Error) -> TransportError {
    tracing::debug!(call, code = e.raw_os_error(), %addr, "listening failed");
    match e.kind() {
        std::io::ErrorKind::AddrInUse => TransportError::AddrInUse(addr),
        _ => TransportError::AddrNotAvailable(format!(
            "{addr}: {call} returned {} ({})",
            e.raw_os_error().unwrap_or(0),
            exs_transport::plain_text(&e.to_string())
        )),
    }
}

/// The inline size to ask for after `rdma_create_qp` refused a queue pair with `inline` bytes and `errno`, or
/// `None` to give up: half as much, 0 below 8 bytes (less carries neither an emulated immediate nor a header),
/// and only for the codes providers give for capabilities they cannot meet.
fn smaller_inline(inline: u32, errno: Option<i32>) -> Option<u32> {
    if inline == 0 || !matches!(errno, Some(libc::EINVAL | libc::ENOMEM)) {
        return None;
    }
    let half = inline / 2;
    Some(if half >= 8 { half } else { 0 })
}

/// Refuses an endpoint id that names a live endpoint: inserting over it would drop its record without destroying
/// its queue pair or id, and leave the queue pair's number naming the new one.
fn id_free<V>(eps: &FxHashMap<EndpointId, V>, ep: EndpointId) -> Result<(), TransportError> {
    if eps.contains_key(&ep) {
        return Err(TransportError::Invalid(format!(
            "endpoint {} is in use",
            ep.0
        )));
    }
    Ok(())
}

/// The shortest queue of connection requests a listener asks the device for.
pub(crate) const MIN_DEVICE_BACKLOG: u32 = 128;

/// The backlog passed to `rdma_listen`. The engine holds the application's backlog itself (it refuses a request
/// beyond it: `Engine` in `exs/src/engine/cm.rs`), so the device's queue only has to take requests until the engine
/// has seen them. On iWARP the device's backlog is a TCP listening socket's (siw passes it to `kernel_listen`):
/// one as short as a small application backlog drops the handshakes of a burst of connects before they become
/// requests, and a dropped handshake is retried by TCP until the connect times out, where the engine would have
/// refused it at once.
pub(crate) fn device_backlog(backlog: u32) -> i32 {
    backlog.clamp(MIN_DEVICE_BACKLOG, 1024) as i32
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use exs_dma::{DmaBuf, LeaseKind};
    use exs_transport::{Completed, Op, Registration, Sge};

    use super::*;
    use crate::memory::NoDevice;
    use crate::queue::Posted;

    fn sge(buf: &Arc<DmaBuf>, kind: LeaseKind) -> Sge {
        let reg: Arc<dyn Registration> = Arc::new(NoDevice(Arc::clone(buf)));
        Sge::of(&reg, 0..64, kind).unwrap()
    }

    #[test]
    fn an_endpoint_whose_queue_pair_outlives_it_keeps_what_was_posted_on_it_for_good() {
        let (sent, received, others) = (DmaBuf::new(4096), DmaBuf::new(4096), DmaBuf::new(4096));
        let (ep, other) = (EndpointId(1), EndpointId(2));
        let mut e = VerbsTransport::new_ep(ptr::null_mut());
        e.sends.push(Posted {
            seq: 1,
            entries: 1,
            broken: false,
            own: false,
            item: SendRec {
                wr_id: 1,
                kind: Some(Completed::Send),
                _sink: None,
                _bind: None,
                op: Some(Op::Send {
                    sges: vec![sge(&sent, LeaseKind::DeviceRead)],
                    imm: None,
                }),
            },
        });
        let mut recvs = FxHashMap::default();
        let rec = |buf: &Arc<DmaBuf>, wr_id| RecvRec {
            wr_id,
            sge: sge(buf, LeaseKind::DeviceWrite),
        };
        let shared = DmaBuf::new(4096);
        recvs.insert(10, (Some(ep), rec(&received, 10)));
        recvs.insert(11, (Some(other), rec(&others, 11)));
        recvs.insert(12, (None, rec(&shared, 12)));
        keep_records(ep, e, &mut recvs);
        assert!(
            sent.is_range_leased(0..64) && sent.kept_for_good(),
            "a send posted on it"
        );
        assert!(
            received.is_range_leased(0..64) && received.kept_for_good(),
            "a receive posted on it"
        );
        assert_eq!(recvs.len(), 2, "its receives' records leave the table");
        assert!(
            !others.kept_for_good() && !shared.kept_for_good(),
            "another endpoint's receive, and the shared queue's, stay as they were (the transport's drop judges \
             the shared ones)"
        );
    }

    #[test]
    fn a_listen_that_fails_keeps_the_documented_error_or_names_the_call_and_code() {
        let addr: SocketAddr = "10.0.0.1:7471".parse().unwrap();
        let e = listen_error(
            addr,
            "rdma_bind_addr",
            std::io::Error::from_raw_os_error(libc::EADDRINUSE),
        );
        assert_eq!(e.to_string(), "address in use: 10.0.0.1:7471");
        let e = listen_error(
            addr,
            "rdma_listen",
            std::io::Error::from_raw_os_error(libc::ENODEV),
        );
        assert_eq!(e.io_kind(), std::io::ErrorKind::AddrNotAvailable);
        assert_eq!(
            e.to_string(),
            "address not available: 10.0.0.1:7471: rdma_listen returned 19 (no such device)"
        );
    }

    #[test]
    fn an_endpoint_id_in_use_is_refused_not_overwritten() {
        let mut eps = FxHashMap::default();
        assert!(id_free(&eps, EndpointId(7)).is_ok());
        eps.insert(EndpointId(7), "live");
        let e = id_free(&eps, EndpointId(7)).unwrap_err();
        assert!(
            matches!(&e, TransportError::Invalid(m) if m == "endpoint 7 is in use"),
            "{e}"
        );
        assert!(id_free(&eps, EndpointId(8)).is_ok());
    }

    /// A connection asks the peer's adapter for receiver-not-ready retries for ever (7) only where the settings
    /// allow them; otherwise none (0), so that on rxe driven the iWARP way a message with no receive fails.
    #[test]
    fn the_connection_parameters_carry_the_receiver_not_ready_retry() {
        let on = VerbsTransport::conn_param(&[], ReadDepths::default(), true);
        let off = VerbsTransport::conn_param(&[], ReadDepths::default(), false);
        assert_eq!((on.rnr_retry_count, off.rnr_retry_count), (7, 0));
    }

    /// Review item: the accepting side sent its own read depth both ways whatever the request said, so against a
    /// requester with fewer responder resources it initiated more reads than the requester could hold.
    #[test]
    fn an_accept_never_grants_more_reads_than_the_request_can_take() {
        // A requester with initiator depth 8 and 4 responder resources, as the connection request's event states
        // it (turned around by the kernel): we may initiate 4, it will initiate 8.
        let event = rdma_conn_param {
            initiator_depth: 4,
            responder_resources: 8,
            ..VerbsTransport::conn_param(&[], ReadDepths::default(), true)
        };
        let request = ReadDepths::of_event(&event);
        let reads = ReadDepths::accept(ReadDepths::offer(16), request);
        let param = VerbsTransport::conn_param(&[], reads, true);
        assert_eq!((param.initiator_depth, param.responder_resources), (4, 8));
        // Our own depth bounds both when the request offers more.
        let reads = ReadDepths::accept(ReadDepths::offer(2), request);
        assert_eq!((reads.initiator, reads.responder), (2, 2));
        // A request that takes no reads gets none initiated at it.
        let none = ReadDepths::accept(ReadDepths::offer(16), ReadDepths::default());
        assert_eq!((none.initiator, none.responder), (0, 0));
        // rdma_cm carries a depth in a byte.
        assert_eq!(ReadDepths::offer(1000), ReadDepths::offer(255));
        assert_eq!(ReadDepths::offer(1000).initiator, 255);
    }

    /// Review item: the inline size was probed on a one-entry queue pair and then asked of every real one as it
    /// was; a device that refuses it at our depth and scatter/gather count refused every connection.
    #[test]
    fn a_queue_pair_refused_for_its_inline_size_is_retried_with_half_down_to_none() {
        let mut tries = vec![];
        let mut inline = 256;
        while let Some(next) = smaller_inline(inline, Some(libc::EINVAL)) {
            tries.push(next);
            inline = next;
        }
        assert_eq!(tries, [128, 64, 32, 16, 8, 0]);
        assert_eq!(smaller_inline(12, Some(libc::ENOMEM)), Some(0));
        // Refusals that are not about the queue pair's size, and no errno at all, end the retries.
        assert_eq!(smaller_inline(256, Some(libc::EPERM)), None);
        assert_eq!(smaller_inline(256, None), None);
        // Nothing inline refused as well: the refusal stands.
        assert_eq!(smaller_inline(0, Some(libc::EINVAL)), None);
    }

    #[test]
    fn a_small_listen_backlog_still_asks_the_device_for_a_deep_queue() {
        assert_eq!(device_backlog(0), MIN_DEVICE_BACKLOG as i32);
        assert_eq!(device_backlog(4), MIN_DEVICE_BACKLOG as i32);
        assert_eq!(device_backlog(500), 500);
        assert_eq!(device_backlog(u32::MAX), 1024);
    }
}

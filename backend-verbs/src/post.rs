//! Posting work requests: send-queue chains (one doorbell, selective signalling, emulated write-with-immediate),
//! receive chains on an endpoint or on the shared receive queue, and the records that keep each request's leases
//! until it completes. A chain the device refuses part-way leaves the requests before the refused one on the
//! device; the others come back whole.

use std::ptr;

use exs_transport::{Completed, EndpointId, Op, RemoteRef, Sge, TransportError, WorkRequest};
use rdma_sys::*;

use crate::connection::EpState;
use crate::memory::SinkMr;
use crate::queue::{self, Posted, Signaler};
use crate::{os_err, VerbsTransport, IMM_MAGIC};

/// One native send request of a work request (an emulated write-with-immediate makes two): opcode, gather list,
/// remote range, immediate.
type NativePart = (u32, Vec<ibv_sge>, Option<RemoteRef>, Option<u32>);

/// A send-queue request: kept until its completion (or a later signalled one) arrives, its operation (and the
/// leases in it) with it. `kind` is `None` for the backend's own requests (window binds), which the engine never
/// hears of.
pub(crate) struct SendRec {
    pub(crate) wr_id: u64,
    pub(crate) kind: Option<Completed>,
    /// An RDMA read's sink registration (iWARP), dropped before the operation's leases (field order).
    pub(crate) _sink: Option<SinkMr>,
    pub(crate) op: Option<Op>,
}

/// Requests a post did not get onto the device, whole and in order, and why.
pub(crate) struct Refused {
    pub(crate) error: TransportError,
    pub(crate) wrs: Vec<WorkRequest>,
}

impl Refused {
    fn new(error: TransportError, wrs: Vec<WorkRequest>) -> Self {
        Refused { error, wrs }
    }
}

pub(crate) struct RecvRec {
    pub(crate) wr_id: u64,
    pub(crate) sge: Sge,
}

impl VerbsTransport {
    /// Native send-queue requests a work request takes: two for an emulated write-with-immediate.
    fn parts_of(&self, wr: &WorkRequest) -> u32 {
        match wr.op {
            Op::Write { imm: Some(_), .. } if self.emulate => 2,
            _ => 1,
        }
    }

    /// Moves a queue pair to the error state: everything on it completes (flushed), signalled or not.
    fn break_qp(qp: *mut ibv_qp) {
        let mut attr: ibv_qp_attr = unsafe {
            // SAFETY: plain data, zero is valid before we fill it.
            std::mem::zeroed()
        };
        attr.qp_state = ibv_qp_state::IBV_QPS_ERR;
        // SAFETY: a live queue pair of ours; moving to the error state needs only the state attribute.
        let rc = unsafe { ibv_modify_qp(qp, &mut attr, ibv_qp_attr_mask::IBV_QP_STATE.0 as i32) };
        if rc != 0 {
            tracing::error!(rc, "ibv_modify_qp(IBV_QPS_ERR) failed");
        }
    }

    /// Posts a chain of send-queue requests (one doorbell). Signals the last one and every SIGNAL_EVERY-th.
    ///
    /// Requests that do not fit in the send queue, and requests the device refuses, come back whole; the ones
    /// before them are on the device and keep their records until they complete. A request the device took in
    /// part (the write of an emulated write-with-immediate without its send) is kept too: it cannot come back while
    /// the device may still read its memory, so its queue pair goes to error and it completes with an error.
    fn post_sends(&mut self, ep: EndpointId, mut wrs: Vec<WorkRequest>) -> Result<(), Refused> {
        let Some(e) = self.eps.get(&ep) else {
            return Err(Refused::new(TransportError::NoEndpoint, wrs));
        };
        if e.qp.is_null() {
            return Err(Refused::new(
                TransportError::Invalid("post before the queue pair exists".into()),
                wrs,
            ));
        }
        if wrs.iter().any(|w| matches!(w.op, Op::Recv { .. })) {
            return Err(Refused::new(
                TransportError::Invalid("a receive in the send chain".into()),
                wrs,
            ));
        }
        // The records bound what the device holds; completions waiting in the completion queue free entries.
        let need: u32 = wrs.iter().map(|w| self.parts_of(w)).sum();
        if e.sends.entries() + need > e.sq_cap {
            self.drain_cq();
        }
        let room = {
            let e = &self.eps[&ep];
            e.sq_cap.saturating_sub(e.sends.entries())
        };
        let mut fit = 0;
        let mut used = 0;
        for w in &wrs {
            let p = self.parts_of(w);
            if used + p > room {
                break;
            }
            used += p;
            fit += 1;
        }
        let mut rest = wrs.split_off(fit);
        let full = || TransportError::Resource("send queue full".into());
        if wrs.is_empty() {
            return Err(Refused::new(full(), rest));
        }
        // iWARP: each read's sink gets its registration with remote write now, before anything is posted (a
        // failure refuses the whole batch, which then never reached the device).
        let mut sinks: Vec<Option<SinkMr>> = Vec::with_capacity(wrs.len());
        for w in &wrs {
            sinks.push(match &w.op {
                Op::Read { local, .. } if self.read_sinks => {
                    match SinkMr::new(&self.pd, local.addr(), local.len()) {
                        Ok(m) => Some(m),
                        Err(err) => {
                            wrs.append(&mut rest);
                            return Err(Refused::new(err, wrs));
                        }
                    }
                }
                _ => None,
            });
        }
        let emulate = self.emulate;
        let ids = &mut self.ids;
        let e = self.eps.get_mut(&ep).expect("checked above");
        let n = wrs.len();
        // Native verbs structures for the whole chain; kept alive until ibv_post_send returns.
        let mut sges: Vec<Vec<ibv_sge>> = Vec::with_capacity(n * 2);
        let mut natives: Vec<ibv_send_wr> = Vec::with_capacity(n * 2);
        // The signalling state after each native request, to restore the one after the last posted.
        let mut signal_after: Vec<Signaler> = Vec::with_capacity(n * 2);
        let mut signal = e.signal;
        let mut recs = Vec::with_capacity(n);
        // At most one payload per request: with this capacity the vector never reallocates, so the addresses the
        // scatter entries take from it stay valid until ibv_post_send has copied the (inline) payloads.
        let mut imm_payloads: Vec<[u8; 8]> = Vec::with_capacity(n);
        for (i, (wr, sink)) in wrs.into_iter().zip(sinks).enumerate() {
            let last = i + 1 == n;
            let seq = ids.send();
            let sge_of = |s: &Sge| ibv_sge {
                addr: s.addr(),
                length: s.len() as u32,
                lkey: s.local_key() as u32,
            };
            let (kind, parts): (Completed, Vec<NativePart>) = match &wr.op {
                Op::Send { sges: s, imm } => {
                    let opc = if imm.is_some() {
                        ibv_wr_opcode::IBV_WR_SEND_WITH_IMM
                    } else {
                        ibv_wr_opcode::IBV_WR_SEND
                    };
                    (
                        Completed::Send,
                        vec![(opc, s.iter().map(sge_of).collect(), None, *imm)],
                    )
                }
                Op::Write {
                    local,
                    remote,
                    imm: Some(imm),
                } if emulate => {
                    // Emulated write-with-immediate: the write, then a send carrying the immediate.
                    let mut payload = [0u8; 8];
                    payload[..4].copy_from_slice(&IMM_MAGIC.to_le_bytes());
                    payload[4..].copy_from_slice(&imm.to_le_bytes());
                    debug_assert!(
                        imm_payloads.len() < imm_payloads.capacity(),
                        "payloads must not reallocate"
                    );
                    imm_payloads.push(payload);
                    (
                        Completed::Write,
                        vec![
                            (
                                ibv_wr_opcode::IBV_WR_RDMA_WRITE,
                                local.iter().map(sge_of).collect(),
                                Some(*remote),
                                None,
                            ),
                            (ibv_wr_opcode::IBV_WR_SEND, Vec::new(), None, Some(u32::MAX)),
                        ],
                    )
                }
                Op::Write { local, remote, imm } => {
                    let opc = if imm.is_some() {
                        ibv_wr_opcode::IBV_WR_RDMA_WRITE_WITH_IMM
                    } else {
                        ibv_wr_opcode::IBV_WR_RDMA_WRITE
                    };
                    (
                        Completed::Write,
                        vec![(opc, local.iter().map(sge_of).collect(), Some(*remote), *imm)],
                    )
                }
                Op::Read { local, remote } => {
                    let mut s = sge_of(local);
                    if let Some(m) = &sink {
                        s.lkey = m.lkey;
                    }
                    (
                        Completed::Read,
                        vec![(
                            ibv_wr_opcode::IBV_WR_RDMA_READ,
                            vec![s],
                            Some(*remote),
                            None,
                        )],
                    )
                }
                Op::Recv { .. } => unreachable!("receives were refused above"),
            };
            let nparts = parts.len();
            for (j, (opc, list, remote, imm)) in parts.into_iter().enumerate() {
                let final_part = j + 1 == nparts;
                let mut w: ibv_send_wr = unsafe {
                    // SAFETY: plain data, zero is valid before we fill it.
                    std::mem::zeroed()
                };
                w.wr_id = seq;
                w.opcode = opc;
                let mut flags = 0u32;
                // The emulated immediate's send is the only part with an immediate and the plain SEND opcode: a
                // protocol send with an immediate is a SEND_WITH_IMM, one without has no immediate.
                let emulated_imm =
                    imm == Some(u32::MAX) && opc == ibv_wr_opcode::IBV_WR_SEND && list.is_empty();
                if emulated_imm {
                    flags |= ibv_send_flags::IBV_SEND_INLINE.0;
                } else if let Some(v) = imm {
                    w.imm_data_invalidated_rkey_union.imm_data = v.to_be();
                }
                let total: u32 = list.iter().map(|s| s.length).sum();
                if !emulated_imm
                    && opc != ibv_wr_opcode::IBV_WR_RDMA_READ
                    && total <= e.max_inline
                    && total > 0
                {
                    flags |= ibv_send_flags::IBV_SEND_INLINE.0;
                }
                if final_part && signal.next(last) {
                    flags |= ibv_send_flags::IBV_SEND_SIGNALED.0;
                }
                signal_after.push(signal);
                w.send_flags = flags;
                if let Some(r) = remote {
                    w.wr.rdma = rdma_t {
                        remote_addr: r.addr,
                        rkey: r.key as u32,
                    };
                }
                sges.push(if emulated_imm {
                    let p = imm_payloads.last().expect("pushed above");
                    vec![ibv_sge {
                        addr: p.as_ptr() as u64,
                        length: 8,
                        lkey: 0,
                    }]
                } else {
                    list
                });
                natives.push(w);
            }
            recs.push(Posted {
                seq,
                entries: nparts as u32,
                broken: false,
                item: SendRec {
                    wr_id: wr.wr_id,
                    kind: Some(kind),
                    _sink: sink,
                    op: Some(wr.op),
                },
            });
        }
        for (w, list) in natives.iter_mut().zip(sges.iter_mut()) {
            w.sg_list = list.as_mut_ptr();
            w.num_sge = list.len() as i32;
        }
        for i in 0..natives.len().saturating_sub(1) {
            let next: *mut ibv_send_wr = &mut natives[i + 1];
            natives[i].next = next;
        }
        let mut bad: *mut ibv_send_wr = ptr::null_mut();
        // SAFETY: live QP; the chain and its scatter/gather lists live until the call returns; the memory they
        // name is leased by the records we keep until completion (inline payloads are copied by the call).
        let rc = unsafe { ibv_post_send(e.qp, natives.as_mut_ptr(), &mut bad) };
        if rc == 0 {
            e.signal = signal;
            for r in recs {
                e.sends.push(r);
            }
            return if rest.is_empty() {
                Ok(())
            } else {
                Err(Refused::new(full(), rest))
            };
        }
        let error = TransportError::os("ibv_post_send", std::io::Error::from_raw_os_error(rc));
        // Everything before `bad` is on the device, nothing from it on. A provider that names no request of the
        // chain leaves us not knowing: then every request is treated as on the device (kept, and flushed below).
        let bad_at = natives.iter().position(|w| ptr::eq(w, bad));
        let posted_natives = bad_at.unwrap_or(natives.len());
        let cut = match bad_at {
            Some(b) => queue::cut(recs.iter().map(|r| r.entries as usize), b),
            None => queue::Cut {
                posted: recs.len(),
                partial: false,
            },
        };
        e.signal = match posted_natives {
            0 => e.signal,
            k => signal_after[k - 1],
        };
        let mut refused = Vec::new();
        for (i, mut r) in recs.into_iter().enumerate() {
            if i < cut.posted {
                e.sends.push(r);
            } else if i == cut.posted && cut.partial {
                r.broken = true;
                e.sends.push(r);
            } else {
                let SendRec { wr_id, op, .. } = r.item;
                refused.push(WorkRequest {
                    wr_id,
                    op: op.expect("the engine's requests carry their operation"),
                });
            }
        }
        if cut.partial || bad_at.is_none() {
            tracing::error!(?ep, %error, "a request reached the device in part; its connection goes down");
            Self::break_qp(e.qp);
        }
        refused.append(&mut rest);
        Err(Refused::new(error, refused))
    }

    fn post_recvs(&mut self, ep: EndpointId, wrs: Vec<WorkRequest>) -> Result<(), Refused> {
        let Some(e) = self.eps.get(&ep) else {
            return Err(Refused::new(TransportError::NoEndpoint, wrs));
        };
        if e.qp.is_null() {
            return Err(Refused::new(
                TransportError::Invalid("post before the queue pair exists".into()),
                wrs,
            ));
        }
        if !self.srq.is_null() {
            return Err(Refused::new(
                TransportError::Invalid(
                    "this endpoint takes its receives from the shared receive queue".into(),
                ),
                wrs,
            ));
        }
        let qp = e.qp;
        self.post_recv_chain(Some(ep), wrs, |chain, bad| {
            // SAFETY: live QP; the chain lives across the call; the buffers are leased by the records we keep.
            unsafe { ibv_post_recv(qp, chain, bad) }
        })
    }

    /// Builds a chain of receive work requests, posts it with `post`, and keeps the records (and their leases)
    /// until completion. `owner` is the endpoint, or `None` for the shared receive queue. When the device refuses
    /// the chain part-way, the receives before the refused one are on it and keep their records; the others come
    /// back whole.
    fn post_recv_chain(
        &mut self,
        owner: Option<EndpointId>,
        wrs: Vec<WorkRequest>,
        post: impl FnOnce(*mut ibv_recv_wr, *mut *mut ibv_recv_wr) -> i32,
    ) -> Result<(), Refused> {
        if wrs.iter().any(|w| !matches!(w.op, Op::Recv { .. })) {
            return Err(Refused::new(
                TransportError::Invalid("not a receive".into()),
                wrs,
            ));
        }
        let mut sges = Vec::with_capacity(wrs.len());
        let mut natives: Vec<ibv_recv_wr> = Vec::with_capacity(wrs.len());
        let mut recs = Vec::with_capacity(wrs.len());
        for wr in wrs {
            let Op::Recv { sge } = wr.op else {
                unreachable!("checked above");
            };
            let id = self.ids.recv();
            sges.push(ibv_sge {
                addr: sge.addr(),
                length: sge.len() as u32,
                lkey: sge.local_key() as u32,
            });
            natives.push(ibv_recv_wr {
                wr_id: id,
                next: ptr::null_mut(),
                sg_list: ptr::null_mut(),
                num_sge: 1,
            });
            recs.push((
                id,
                RecvRec {
                    wr_id: wr.wr_id,
                    sge,
                },
            ));
        }
        for (w, s) in natives.iter_mut().zip(sges.iter_mut()) {
            w.sg_list = s;
        }
        for i in 0..natives.len().saturating_sub(1) {
            let next: *mut ibv_recv_wr = &mut natives[i + 1];
            natives[i].next = next;
        }
        if natives.is_empty() {
            return Ok(());
        }
        let mut bad: *mut ibv_recv_wr = ptr::null_mut();
        let rc = post(natives.as_mut_ptr(), &mut bad);
        // Everything before `bad` is on the device, nothing from it on. A provider that names no request of the
        // chain leaves us not knowing: then every receive is treated as on the device (kept until it completes or
        // its queue is destroyed).
        let posted = if rc == 0 {
            recs.len()
        } else {
            natives
                .iter()
                .position(|w| ptr::eq(w, bad))
                .unwrap_or(recs.len())
        };
        let mut refused = Vec::new();
        for (i, (id, rec)) in recs.into_iter().enumerate() {
            if i < posted {
                self.recvs.insert(id, (owner, rec));
            } else {
                refused.push(WorkRequest {
                    wr_id: rec.wr_id,
                    op: Op::Recv { sge: rec.sge },
                });
            }
        }
        if rc == 0 {
            return Ok(());
        }
        Err(Refused::new(
            TransportError::os(
                if owner.is_some() {
                    "ibv_post_recv"
                } else {
                    "ibv_post_srq_recv"
                },
                std::io::Error::from_raw_os_error(rc),
            ),
            refused,
        ))
    }

    /// Posts requests on an endpoint: receives, then sends, each kind in order. On error, the requests that did
    /// not reach the device come back whole.
    pub(crate) fn post_inner(
        &mut self,
        ep: EndpointId,
        wrs: Vec<WorkRequest>,
    ) -> Result<(), Refused> {
        let down = match self.eps.get(&ep) {
            None => return Err(Refused::new(TransportError::NoEndpoint, wrs)),
            Some(e) => e.state == EpState::Down && !e.qp.is_null(),
        };
        if down {
            // Posting on a dead connection completes with a flush, as hardware does.
            for wr in wrs {
                self.cq_backlog.push_back((wr.flushed(ep), false));
            }
            return Ok(());
        }
        // Receives and sends go to different queues; keep each kind's order.
        let mut sends = Vec::new();
        let mut recvs = Vec::new();
        for wr in wrs {
            if matches!(wr.op, Op::Recv { .. }) {
                recvs.push(wr);
            } else {
                sends.push(wr);
            }
        }
        if !recvs.is_empty() {
            if let Err(mut r) = self.post_recvs(ep, recvs) {
                r.wrs.extend(sends);
                return Err(r);
            }
        }
        if !sends.is_empty() {
            self.post_sends(ep, sends)?;
        }
        Ok(())
    }

    /// [`Transport::create_shared_recv`](exs_transport::Transport::create_shared_recv): `ibv_create_srq`, once.
    pub(crate) fn create_srq(&mut self, depth: u32) -> Result<(), TransportError> {
        if self.caps.max_shared_recv == 0 {
            return Err(TransportError::Unsupported(format!(
                "{} has no shared receive queue",
                self.caps.name
            )));
        }
        if !self.srq.is_null() {
            return Err(TransportError::Invalid(
                "the shared receive queue exists".into(),
            ));
        }
        let mut attr = ibv_srq_init_attr {
            srq_context: ptr::null_mut(),
            attr: ibv_srq_attr {
                max_wr: depth.clamp(1, self.caps.max_shared_recv),
                max_sge: 1,
                srq_limit: 0,
            },
        };
        // SAFETY: our PD; `attr` is a valid in/out argument.
        let srq = unsafe { ibv_create_srq(self.pd.0, &mut attr) };
        if srq.is_null() {
            return Err(os_err("ibv_create_srq"));
        }
        self.srq = srq;
        Ok(())
    }

    /// [`Transport::post_shared_recv`](exs_transport::Transport::post_shared_recv): one chain, one
    /// `ibv_post_srq_recv`.
    pub(crate) fn post_srq_recvs(
        &mut self,
        wrs: &mut Vec<WorkRequest>,
    ) -> Result<(), TransportError> {
        if self.srq.is_null() {
            wrs.clear();
            return Err(TransportError::Invalid("no shared receive queue".into()));
        }
        let srq = self.srq;
        let batch = std::mem::take(wrs);
        self.post_recv_chain(None, batch, |chain, bad| {
            // SAFETY: live SRQ; the chain lives across the call; the buffers are leased by the records we keep.
            unsafe { ibv_post_srq_recv(srq, chain, bad) }
        })
        // The receives that did not reach the queue are dropped, as the trait says.
        .map_err(|r| r.error)
    }
}

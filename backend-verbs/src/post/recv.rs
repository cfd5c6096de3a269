//! The receive side of posting: chains of receive requests on an endpoint or on the shared receive queue, and the
//! records that keep each receive's lease until it completes.

use std::ptr;

use exs_transport::{EndpointId, Op, Sge, TransportError, WorkRequest};
use rdma_sys::*;

use super::{chain_next, check_lengths, post_error, sge_of, Few, Refused};
use crate::queue::WrIds;
use crate::{os_err, VerbsTransport};

/// What is kept of a posted receive until it completes: the engine's id and the lease of its buffer.
pub(crate) struct RecvRec {
    pub(crate) wr_id: u64,
    pub(crate) sge: Sge,
}

/// A chain of receive requests being built (one scatter entry each), with the records of the engine's receives;
/// as a send [`Chain`](super::Chain), it must not move between [`RecvChain::link`] and the post.
struct RecvChain {
    natives: Few<ibv_recv_wr>,
    sges: Few<ibv_sge>,
    recs: Few<(u64, RecvRec)>,
}

impl RecvChain {
    /// `wrs` are receives (checked by the caller).
    fn new(ids: &mut WrIds, wrs: &mut Vec<WorkRequest>) -> Self {
        let mut c = RecvChain {
            natives: Few::with_capacity(wrs.len()),
            sges: Few::with_capacity(wrs.len()),
            recs: Few::with_capacity(wrs.len()),
        };
        for wr in wrs.drain(..) {
            let Op::Recv { sge } = wr.op else {
                unreachable!("the caller passes receives only");
            };
            let id = ids.recv();
            c.sges.push(sge_of(&sge));
            c.natives.push(ibv_recv_wr {
                wr_id: id,
                next: ptr::null_mut(),
                sg_list: ptr::null_mut(),
                num_sge: 1,
            });
            c.recs.push((
                id,
                RecvRec {
                    wr_id: wr.wr_id,
                    sge,
                },
            ));
        }
        c
    }

    /// Points each request at its scatter entry and at the next request; returns the head.
    fn link(&mut self) -> *mut ibv_recv_wr {
        for (w, s) in self.natives.iter_mut().zip(self.sges.iter_mut()) {
            w.sg_list = s;
        }
        chain_next(&mut self.natives, |w: &mut ibv_recv_wr, next| w.next = next)
    }
}

impl VerbsTransport {
    pub(super) fn post_recvs(
        &mut self,
        ep: EndpointId,
        wrs: &mut Vec<WorkRequest>,
    ) -> Result<(), Refused> {
        let Some(e) = self.eps.get(&ep) else {
            return Err(Refused::new(
                TransportError::NoEndpoint,
                std::mem::take(wrs),
            ));
        };
        if e.qp.is_null() {
            return Err(Refused::new(
                TransportError::Invalid("post before the queue pair exists".into()),
                std::mem::take(wrs),
            ));
        }
        if !self.srq.is_null() {
            return Err(Refused::new(
                TransportError::Invalid(
                    "this endpoint takes its receives from the shared receive queue".into(),
                ),
                std::mem::take(wrs),
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
        wrs: &mut Vec<WorkRequest>,
        post: impl FnOnce(*mut ibv_recv_wr, *mut *mut ibv_recv_wr) -> i32,
    ) -> Result<(), Refused> {
        if wrs.iter().any(|w| !matches!(w.op, Op::Recv { .. })) {
            return Err(Refused::new(
                TransportError::Invalid("not a receive".into()),
                std::mem::take(wrs),
            ));
        }
        if let Err(e) = wrs.iter().try_for_each(|w| check_lengths(&w.op)) {
            return Err(Refused::new(e, std::mem::take(wrs)));
        }
        if wrs.is_empty() {
            return Ok(());
        }
        // An endpoint's own receives take room in the completion queue while posted (the shared queue's reserved
        // its depth when it was created).
        if owner.is_some() {
            if let Err(e) = self.cq_room(wrs.len().try_into().unwrap_or(u32::MAX)) {
                return Err(Refused::new(e, std::mem::take(wrs)));
            }
        }
        let mut chain = RecvChain::new(&mut self.ids, wrs);
        let mut bad: *mut ibv_recv_wr = ptr::null_mut();
        let rc = post(chain.link(), &mut bad);
        // Everything before `bad` is on the device, nothing from it on. A provider that names no request of the
        // chain leaves us not knowing: then every receive is treated as on the device (kept until it completes or
        // its queue is destroyed).
        let posted = if rc == 0 {
            chain.recs.len()
        } else {
            chain
                .natives
                .iter()
                .position(|w| ptr::eq(w, bad))
                .unwrap_or(chain.recs.len())
        };
        let mut refused = Vec::new();
        for (i, (id, rec)) in chain.recs.into_iter().enumerate() {
            if i < posted {
                if owner.is_some() {
                    self.cq_budget.take(1);
                }
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
        let call = if owner.is_some() {
            "ibv_post_recv"
        } else {
            "ibv_post_srq_recv"
        };
        Err(Refused::new(post_error(call, rc), refused))
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
        let depth = depth.clamp(1, self.caps.max_shared_recv);
        // Every receive posted to it completes into the completion queue: it must hold them all.
        self.cq_room_for_shared(depth)?;
        let mut attr = ibv_srq_init_attr {
            srq_context: ptr::null_mut(),
            attr: ibv_srq_attr {
                max_wr: depth,
                max_sge: 1,
                srq_limit: 0,
            },
        };
        // SAFETY: our PD; `attr` is a valid in/out argument.
        let srq = unsafe { ibv_create_srq(self.pd.0, &mut attr) };
        if srq.is_null() {
            return Err(os_err("ibv_create_srq"));
        }
        // The provider wrote back the depth it gave (it may round up): the queue then takes more receives.
        let got = attr.attr.max_wr.max(depth);
        if got > depth {
            if let Err(e) = self.cq_room_for_shared(got) {
                // SAFETY: the queue was just created; nothing was posted to it or attached to it.
                unsafe { ibv_destroy_srq(srq) };
                return Err(e);
            }
        }
        self.cq_budget.reserve_shared(got);
        self.srq = srq;
        crate::routes::enter(srq, &self.mailbox);
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
        self.post_recv_chain(None, wrs, |chain, bad| {
            // SAFETY: live SRQ; the chain lives across the call; the buffers are leased by the records we keep.
            unsafe { ibv_post_srq_recv(srq, chain, bad) }
        })
        // The receives that did not reach the queue are dropped, as the trait says.
        .map_err(|r| r.error)
    }
}

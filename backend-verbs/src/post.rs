//! Posting work requests: send-queue chains (one doorbell, selective signalling, emulated write-with-immediate)
//! and the records that keep each request's leases until it completes; receive chains on an endpoint or on the
//! shared receive queue in [`recv`]. A chain the device refuses part-way leaves the requests before the refused one
//! on the device; the others come back whole.

use std::ptr;

use exs_transport::{Completed, EndpointId, Op, RemoteRef, Sge, TransportError, WorkRequest};
use rdma_sys::*;

use crate::connection::EpState;
use crate::emulated::ImmSlab;
use crate::memory::SinkMr;
use crate::queue::{self, native_signal, Posted, Signaler};
use crate::record::SendRec;
use crate::VerbsTransport;

mod recv;
pub(crate) use recv::RecvRec;

/// The lists a post builds (a chain's requests, their gather lists, their records): short for one message, so
/// on the stack; a long batch spills to the heap.
type Few<T> = smallvec::SmallVec<[T; 4]>;

/// How a native send request carries an immediate.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum ImmKind {
    None,
    /// In the work request (`*_WITH_IMM`).
    Native(u32),
    /// As the 8-byte payload of a plain send (see [`crate::emulated`]).
    Emulated(u32),
}

/// One native send request of a work request (an emulated write-with-immediate makes two).
struct NativePart {
    opcode: u32,
    sges: Few<ibv_sge>,
    remote: Option<RemoteRef>,
    imm: ImmKind,
}

impl NativePart {
    fn new(opcode: u32, sges: Few<ibv_sge>, remote: Option<RemoteRef>, imm: ImmKind) -> Self {
        NativePart {
            opcode,
            sges,
            remote,
            imm,
        }
    }
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

/// Why requests that did not fit in the send queue come back.
pub(crate) fn queue_full() -> TransportError {
    TransportError::Resource("send queue full".into())
}

/// An error code of a post call: providers return a positive errno (rxe, mlx5) or a negative one (siw).
pub(crate) fn post_error(call: &str, rc: i32) -> TransportError {
    crate::ret_err(call, rc)
}

/// A scatter/gather entry's length as verbs carries it (32 bits); a longer one is refused, never truncated (a
/// 4 GiB + 1 entry would otherwise move one byte).
fn sge_length(len: usize) -> Result<u32, TransportError> {
    u32::try_from(len).map_err(|_| {
        TransportError::Invalid(format!(
            "a scatter/gather entry of {len} bytes: verbs carries at most {} in one",
            u32::MAX
        ))
    })
}

/// Refuses an operation with an entry longer than verbs carries ([`sge_length`]), or whose leases do not allow
/// what the device does with them ([`Op::check_leases`]), before anything is posted.
pub(crate) fn check_lengths(op: &Op) -> Result<(), TransportError> {
    op.check_leases()?;
    let check = |s: &Sge| sge_length(s.len()).map(drop);
    match op {
        Op::Send { sges, .. } => sges.iter().try_for_each(check),
        Op::Write { local, .. } => local.iter().try_for_each(check),
        Op::Read { local, .. } => check(local),
        Op::Recv { sge } => check(sge),
    }
}

/// The native entry of `s`, whose length [`check_lengths`] accepted.
fn sge_of(s: &Sge) -> ibv_sge {
    ibv_sge {
        addr: s.addr(),
        length: sge_length(s.len()).expect("checked before the chain is built (check_lengths)"),
        lkey: s.local_key() as u32,
    }
}

/// The native requests of one operation, and what the engine is told when it completes.
fn native_parts(
    op: &Op,
    emulate: bool,
    sink: Option<&SinkMr>,
) -> (Completed, smallvec::SmallVec<[NativePart; 2]>) {
    use ibv_wr_opcode::*;
    use smallvec::smallvec;
    let imm_of = |imm: &Option<u32>| imm.map_or(ImmKind::None, ImmKind::Native);
    let emulated =
        |imm: u32| NativePart::new(IBV_WR_SEND, Few::new(), None, ImmKind::Emulated(imm));
    let list = |s: &[Sge]| s.iter().map(sge_of).collect::<Few<_>>();
    match op {
        // A zero-length send with an immediate is what a write-with-immediate of nothing looks like to the
        // receiver; without immediates it is the emulated immediate alone (`check_sends` refused one with data).
        Op::Send { sges, imm: Some(v) } if emulate && sges.is_empty() => {
            (Completed::Send, smallvec![emulated(*v)])
        }
        Op::Send { sges, imm } => {
            let opc = if imm.is_some() {
                IBV_WR_SEND_WITH_IMM
            } else {
                IBV_WR_SEND
            };
            let part = NativePart::new(opc, list(sges), None, imm_of(imm));
            (Completed::Send, smallvec![part])
        }
        Op::Write {
            local,
            remote,
            imm: Some(v),
        } if emulate => {
            let write =
                NativePart::new(IBV_WR_RDMA_WRITE, list(local), Some(*remote), ImmKind::None);
            (Completed::Write, smallvec![write, emulated(*v)])
        }
        Op::Write { local, remote, imm } => {
            let opc = if imm.is_some() {
                IBV_WR_RDMA_WRITE_WITH_IMM
            } else {
                IBV_WR_RDMA_WRITE
            };
            let part = NativePart::new(opc, list(local), Some(*remote), imm_of(imm));
            (Completed::Write, smallvec![part])
        }
        Op::Read { local, remote } => {
            let mut s = sge_of(local);
            if let Some(m) = sink {
                s.lkey = m.lkey;
            }
            let part =
                NativePart::new(IBV_WR_RDMA_READ, smallvec![s], Some(*remote), ImmKind::None);
            (Completed::Read, smallvec![part])
        }
        Op::Recv { .. } => unreachable!("receives never reach the send chain (check_sends)"),
    }
}

/// A chain of native send requests being built: the requests, their gather lists (kept alive until the post
/// returns), the signalling state after each, and the records of the engine's requests. [`Chain::link`] points
/// the requests at each other and at their lists: nothing may be pushed between it and the post (short lists
/// live inside `sges`). The transport keeps one and reuses it, emptied when a post starts (its records leave it
/// for the endpoint's send queue or come back refused): a post allocates nothing once its lists have grown to
/// the longest chain, and moves no inline arrays around.
#[derive(Default)]
pub(crate) struct Chain {
    natives: Vec<ibv_send_wr>,
    sges: Vec<Few<ibv_sge>>,
    signal_after: Vec<Signaler>,
    /// Slots of the endpoint's emulated-immediate slab taken by the requests up to each (to give back those of
    /// requests the device refuses).
    slab_after: Vec<usize>,
    recs: Vec<Posted<SendRec>>,
    signal: Signaler,
}

impl Chain {
    /// Empties the chain (what `link` pointed at included) and starts it from the endpoint's signalling state.
    fn start(&mut self, signal: Signaler) {
        self.natives.clear();
        self.sges.clear();
        self.signal_after.clear();
        self.slab_after.clear();
        self.recs.clear();
        self.signal = signal;
    }

    /// Appends one native request of the engine's request `seq`.
    fn push(
        &mut self,
        seq: u64,
        part: NativePart,
        signalled: bool,
        max_inline: u32,
        slab: Option<&mut ImmSlab>,
    ) {
        let mut w: ibv_send_wr = unsafe {
            // SAFETY: plain data, zero is valid before we fill it.
            std::mem::zeroed()
        };
        w.wr_id = seq;
        w.opcode = part.opcode;
        let mut flags = 0u32;
        let taken = self.slab_after.last().copied().unwrap_or(0)
            + usize::from(matches!(part.imm, ImmKind::Emulated(_)));
        self.slab_after.push(taken);
        let list = match part.imm {
            ImmKind::Emulated(v) => {
                let slot = slab
                    .expect("an endpoint of an emulating transport has a slab")
                    .next(v);
                if max_inline >= 8 {
                    flags |= ibv_send_flags::IBV_SEND_INLINE.0;
                }
                smallvec::smallvec![slot]
            }
            ImmKind::Native(v) => {
                w.imm_data_invalidated_rkey_union.imm_data = v.to_be();
                part.sges
            }
            ImmKind::None => part.sges,
        };
        let total: u64 = list.iter().map(|s| u64::from(s.length)).sum();
        // An emulated immediate's payload was placed above; a read's list is where the data lands.
        let inline_ok = part.opcode != ibv_wr_opcode::IBV_WR_RDMA_READ
            && !matches!(part.imm, ImmKind::Emulated(_));
        if inline_ok && total > 0 && total <= u64::from(max_inline) {
            flags |= ibv_send_flags::IBV_SEND_INLINE.0;
        }
        if signalled {
            flags |= ibv_send_flags::IBV_SEND_SIGNALED.0;
        }
        w.send_flags = flags;
        if let Some(r) = part.remote {
            w.wr.rdma = rdma_t {
                remote_addr: r.addr,
                rkey: r.key as u32,
            };
        }
        self.signal_after.push(self.signal);
        self.sges.push(list);
        self.natives.push(w);
    }

    /// Slots of the emulated-immediate slab that the requests from the `from`-th on took.
    fn slab_taken_from(&self, from: usize) -> usize {
        let all = self.slab_after.last().copied().unwrap_or(0);
        let before = from
            .checked_sub(1)
            .and_then(|i| self.slab_after.get(i))
            .copied()
            .unwrap_or(0);
        all - before
    }

    /// Points each request at its gather list and at the next request; returns the head.
    fn link(&mut self) -> *mut ibv_send_wr {
        for (w, list) in self.natives.iter_mut().zip(self.sges.iter_mut()) {
            w.sg_list = list.as_mut_ptr();
            w.num_sge = list.len() as i32;
        }
        chain_next(&mut self.natives, |w: &mut ibv_send_wr, next| w.next = next)
    }
}

/// Points each request of `natives` at the one after it (`set_next`) and returns the head. Every pointer comes from
/// the one base pointer of the list's buffer: a pointer taken from an element borrowed mutably would be invalidated,
/// under Rust's aliasing rules, by the next mutable borrow of the list (the indexing that stores it), though the
/// compiled code was the same.
fn chain_next<T>(natives: &mut [T], set_next: impl Fn(&mut T, *mut T)) -> *mut T {
    let n = natives.len();
    let base = natives.as_mut_ptr();
    for i in 0..n.saturating_sub(1) {
        // SAFETY: `i + 1 < n`, so both elements are in the buffer `base` points at; the list is not touched
        // otherwise while these pointers are made, and the reference to element `i` ends with the call.
        unsafe { set_next(&mut *base.add(i), base.add(i + 1)) };
    }
    base
}

impl VerbsTransport {
    /// Native send-queue requests a work request takes: two for an emulated write-with-immediate.
    fn parts_of(&self, wr: &WorkRequest) -> u32 {
        match wr.op {
            Op::Write { imm: Some(_), .. } if self.settings.emulated_imm => 2,
            _ => 1,
        }
    }

    /// Moves a queue pair to the error state: everything on it completes (flushed), signalled or not, and nothing
    /// queued on it executes any more. A failure is logged and returned: the queue pair may still be running.
    pub(crate) fn break_qp(qp: *mut ibv_qp) -> Result<(), TransportError> {
        let mut attr: ibv_qp_attr = unsafe {
            // SAFETY: plain data, zero is valid before we fill it.
            std::mem::zeroed()
        };
        attr.qp_state = ibv_qp_state::IBV_QPS_ERR;
        // SAFETY: a live queue pair of ours; moving to the error state needs only the state attribute. It returns
        // its error code.
        let rc = unsafe { ibv_modify_qp(qp, &mut attr, ibv_qp_attr_mask::IBV_QP_STATE.0 as i32) };
        if rc != 0 {
            let e = crate::ret_err("ibv_modify_qp(IBV_QPS_ERR)", rc);
            tracing::error!(%e, "a queue pair could not be moved to the error state");
            return Err(e);
        }
        Ok(())
    }

    /// What no send chain may hold, refused before anything is posted: an unknown endpoint or one without its
    /// queue pair, a receive, or a send with both data and an immediate where immediates are emulated (the
    /// immediate's send cannot carry data too; the protocol never asks for one).
    fn check_sends(&self, ep: EndpointId, wrs: &[WorkRequest]) -> Result<(), TransportError> {
        let e = self.eps.get(&ep).ok_or(TransportError::NoEndpoint)?;
        if e.qp.is_null() {
            return Err(TransportError::Invalid(
                "post before the queue pair exists".into(),
            ));
        }
        for w in wrs {
            check_lengths(&w.op)?;
            match &w.op {
                Op::Recv { .. } => {
                    return Err(TransportError::Invalid(
                        "a receive in the send chain".into(),
                    ))
                }
                Op::Send { sges, imm: Some(_) }
                    if self.settings.emulated_imm && !sges.is_empty() =>
                {
                    return Err(TransportError::Unsupported(format!(
                        "{} has no immediate data: a send with an immediate carries no bytes here",
                        self.caps.name
                    )))
                }
                _ => {}
            }
        }
        Ok(())
    }

    /// Splits off the requests that do not fit in the send queue (draining the completion queue first if they would
    /// not, since completions waiting there free entries).
    fn fit_sends(&mut self, ep: EndpointId, wrs: &mut Vec<WorkRequest>) -> Vec<WorkRequest> {
        let need: u32 = wrs.iter().map(|w| self.parts_of(w)).sum();
        let room = |t: &Self| {
            let e = &t.eps[&ep];
            e.sq_cap.saturating_sub(e.sends.entries())
        };
        let mut free = room(self);
        if need > free {
            self.drain_cq();
            free = room(self);
        }
        if need <= free {
            return Vec::new();
        }
        let mut used = 0;
        let fit = wrs
            .iter()
            .take_while(|w| {
                used += self.parts_of(w);
                used <= free
            })
            .count();
        wrs.split_off(fit)
    }

    /// iWARP: each read's sink gets its registration with remote write, before anything is posted (one entry per
    /// request; none at all where reads need no sink).
    fn sink_registrations(
        &self,
        wrs: &[WorkRequest],
    ) -> Result<Few<Option<SinkMr>>, TransportError> {
        if !self.settings.read_sinks {
            return Ok(Few::new());
        }
        wrs.iter()
            .map(|w| match &w.op {
                Op::Read { local, .. } => {
                    SinkMr::new(&self.pd, local.addr(), local.len()).map(Some)
                }
                _ => Ok(None),
            })
            .collect()
    }

    /// Builds into `chain` the native requests of `wrs` on endpoint `ep`: the last request and every
    /// SIGNAL_EVERY-th is signalled, and on a device that sends unsignalled requests from the application's pages
    /// (siw) every native of a page or more ([`native_signal`]).
    fn build_chain(
        &mut self,
        ep: EndpointId,
        wrs: &mut Vec<WorkRequest>,
        sinks: Few<Option<SinkMr>>,
        chain: &mut Chain,
    ) {
        let emulate = self.settings.emulated_imm;
        let zero_copy = self.settings.limits.sends_unsignalled_from_user_pages();
        let ids = &mut self.ids;
        let e = self.eps.get_mut(&ep).expect("checked by check_sends");
        let max_inline = e.max_inline;
        let n = wrs.len();
        let mut sinks = sinks.into_iter();
        for (i, wr) in wrs.drain(..).enumerate() {
            let sink = sinks.next().flatten();
            let seq = ids.send();
            let (kind, parts) = native_parts(&wr.op, emulate, sink.as_ref());
            let nparts = parts.len();
            // A read is always signalled and retired only by its own completion (see `queue`: iWARP completes
            // reads out of order).
            let read = kind == Completed::Read;
            for (j, part) in parts.into_iter().enumerate() {
                // Summed only on such a device: the hot path elsewhere does not pay for it.
                let must = zero_copy
                    && part.sges.iter().map(|s| u64::from(s.length)).sum::<u64>()
                        >= exs_dma::PAGE as u64;
                let (id, signalled) =
                    native_signal(seq, j, nparts, must, i + 1 == n || read, &mut chain.signal);
                chain.push(id, part, signalled, max_inline, e.imm_slab.as_mut());
            }
            chain.recs.push(Posted {
                seq,
                entries: nparts as u32,
                broken: false,
                own: read,
                item: SendRec {
                    wr_id: wr.wr_id,
                    kind: Some(kind),
                    _sink: sink,
                    _bind: None,
                    op: Some(wr.op),
                },
            });
        }
    }

    /// iWARP, active side, once connected: a zero-length RDMA write before anything else. MPA (RFC 5044) has the
    /// passive side send only after the active side's first message; exs's first message may come from either
    /// side (its handshake is in the private data), so without the drivers' peer-to-peer mode (RFC 6581, whose
    /// ready-to-receive message is this same write) a passive side that waits for it would wait for an
    /// application that waits for it. A zero-length write names no memory (its key is not checked) and reaches no
    /// receive; it is the backend's own request, retired by the next signalled one.
    pub(crate) fn send_first_message(&mut self, ep: EndpointId) {
        let fill = |w: &mut ibv_send_wr| {
            w.opcode = ibv_wr_opcode::IBV_WR_RDMA_WRITE;
            // As the drivers' own ready-to-receive write: key 1 (some devices treat key 0 specially), address 0.
            w.wr.rdma = rdma_t {
                remote_addr: 0,
                rkey: 1,
            };
        };
        // SAFETY: a zero-length write with no scatter entries names no local memory.
        match unsafe { self.post_own_send(ep, "ibv_post_send", fill, None) } {
            Ok(()) | Err(TransportError::NoEndpoint) => {}
            Err(error) => tracing::warn!(?ep, %error, "the active side's first message"),
        }
    }

    /// Posts one of the backend's own send-queue requests (a window bind, the active side's first write) on
    /// `ep`'s queue pair: `fill` sets its opcode and operands. It is recorded with no operation of its own, with
    /// `hold` (a bind's window and registration), and retired by its own completion or a later one. A request with
    /// something to hold is signalled, so that goes soon; the others only when the signalling period says so.
    /// [`TransportError::NoEndpoint`] when `ep` has no queue pair.
    ///
    /// # Safety
    /// Whatever `fill` makes the request name (a window, the registration it binds over, local memory) stays valid
    /// until the request retires: `hold` may keep it.
    pub(crate) unsafe fn post_own_send(
        &mut self,
        ep: EndpointId,
        what: &str,
        fill: impl FnOnce(&mut ibv_send_wr),
        hold: Option<crate::memory::BindHold>,
    ) -> Result<(), TransportError> {
        if self.eps.get(&ep).is_none_or(|e| e.qp.is_null()) {
            return Err(TransportError::NoEndpoint);
        }
        self.cq_room(1)?;
        let seq = self.ids.send();
        let e = self.eps.get_mut(&ep).ok_or(TransportError::NoEndpoint)?;
        let mut w: ibv_send_wr = unsafe {
            // SAFETY: plain data, zero is valid before we fill it.
            std::mem::zeroed()
        };
        w.wr_id = seq;
        fill(&mut w);
        // The signalling state changes only if the request reaches the device.
        let mut signal = e.signal;
        if signal.next(hold.is_some()) {
            w.send_flags |= ibv_send_flags::IBV_SEND_SIGNALED.0;
        }
        let mut bad = ptr::null_mut();
        // SAFETY: live, connected QP; the request lives until the call returns; what it names outlives it (the
        // caller's contract).
        let rc = unsafe { ibv_post_send(e.qp, &mut w, &mut bad) };
        if rc != 0 {
            return Err(post_error(what, rc));
        }
        e.signal = signal;
        self.cq_budget.take(1);
        e.sends.push(Posted {
            seq,
            entries: 1,
            broken: false,
            own: false,
            item: SendRec {
                wr_id: 0,
                kind: None,
                _sink: None,
                _bind: hold,
                op: None,
            },
        });
        Ok(())
    }

    /// Posts a chain of send-queue requests (one doorbell). Signals the last one and every SIGNAL_EVERY-th.
    ///
    /// Requests that do not fit in the send queue, and requests the device refuses, come back whole; the ones
    /// before them are on the device and keep their records until they complete. A request the device took in
    /// part (the write of an emulated write-with-immediate without its send) is kept too: it cannot come back while
    /// the device may still read its memory, so its queue pair goes to error and it completes with an error.
    fn post_sends(&mut self, ep: EndpointId, wrs: &mut Vec<WorkRequest>) -> Result<(), Refused> {
        if let Err(e) = self.check_sends(ep, wrs) {
            return Err(Refused::new(e, std::mem::take(wrs)));
        }
        let mut rest = self.fit_sends(ep, wrs);
        if wrs.is_empty() {
            return Err(Refused::new(queue_full(), rest));
        }
        // Every entry may complete (flushed, when the connection fails): the completion queue must hold it.
        let need = wrs.iter().map(|w| self.parts_of(w)).sum();
        if let Err(err) = self.cq_room(need) {
            wrs.append(&mut rest);
            return Err(Refused::new(err, std::mem::take(wrs)));
        }
        // A failure here refuses the whole batch, which then never reached the device.
        let sinks = match self.sink_registrations(wrs) {
            Ok(s) => s,
            Err(err) => {
                wrs.append(&mut rest);
                return Err(Refused::new(err, std::mem::take(wrs)));
            }
        };
        let signal = self.eps.get(&ep).expect("checked by check_sends").signal;
        let mut chain = std::mem::take(&mut self.chain);
        chain.start(signal);
        let result = self.post_chain(ep, wrs, sinks, &mut chain, rest);
        self.chain = chain;
        result
    }

    /// The rest of [`VerbsTransport::post_sends`] once the requests fit: builds `chain`, posts it and keeps the
    /// records of what reached the device; `rest` (what did not fit) comes back refused after whatever the device
    /// refused of the chain.
    fn post_chain(
        &mut self,
        ep: EndpointId,
        wrs: &mut Vec<WorkRequest>,
        sinks: Few<Option<SinkMr>>,
        chain: &mut Chain,
        mut rest: Vec<WorkRequest>,
    ) -> Result<(), Refused> {
        self.build_chain(ep, wrs, sinks, chain);
        let head = chain.link();
        let e = self.eps.get_mut(&ep).expect("checked by check_sends");
        let mut bad: *mut ibv_send_wr = ptr::null_mut();
        // SAFETY: live QP; the chain and its scatter/gather lists live until the call returns; the memory they
        // name is leased by the records we keep until completion (inline payloads are copied by the call; emulated
        // immediates not sent inline are in the endpoint's slab, see `emulated`).
        let rc = unsafe { ibv_post_send(e.qp, head, &mut bad) };
        // Where the device stopped, found while the chain is where `link` left it.
        let bad_at = chain.natives.iter().position(|w| ptr::eq(w, bad));
        if rc == 0 {
            e.signal = chain.signal;
            let refused = e
                .sends
                .keep(chain.recs.drain(..), queue::Cut::ALL, &mut self.cq_budget);
            debug_assert!(refused.is_empty());
            return if rest.is_empty() {
                Ok(())
            } else {
                Err(Refused::new(queue_full(), rest))
            };
        }
        let mut refused = self.keep_posted_part(ep, chain, bad_at, rc);
        refused.wrs.append(&mut rest);
        Err(refused)
    }

    /// After the device refused a chain at `bad`: keeps the records of what reached it (a request cut in two
    /// breaks its queue pair, see `post_sends`) and returns the rest.
    fn keep_posted_part(
        &mut self,
        ep: EndpointId,
        chain: &mut Chain,
        bad_at: Option<usize>,
        rc: i32,
    ) -> Refused {
        let e = self.eps.get_mut(&ep).expect("checked by check_sends");
        let error = post_error("ibv_post_send", rc);
        // Everything before `bad_at` is on the device, nothing from it on. A provider that names no request of the
        // chain leaves us not knowing: then every request is treated as on the device (kept, and flushed below).
        let posted_natives = bad_at.unwrap_or(chain.natives.len());
        let cut = match bad_at {
            Some(b) => queue::cut(chain.recs.iter().map(|r| r.entries as usize), b),
            None => queue::Cut {
                posted: chain.recs.len(),
                partial: false,
            },
        };
        if posted_natives > 0 {
            e.signal = chain.signal_after[posted_natives - 1];
        }
        if let Some(slab) = e.imm_slab.as_mut() {
            slab.give_back(chain.slab_taken_from(posted_natives));
        }
        let refused = e
            .sends
            .keep(chain.recs.drain(..), cut, &mut self.cq_budget)
            .into_iter()
            // Never on the device: the peer never saw a read sink's key, so the request goes back whole.
            .map(|mut r: SendRec| WorkRequest {
                wr_id: r.wr_id,
                op: r
                    .op
                    .take()
                    .expect("the engine's requests carry their operation"),
            })
            .collect();
        if cut.partial || bad_at.is_none() {
            tracing::error!(?ep, %error, "a request reached the device in part; its connection goes down");
            // A failure is logged; the request still completes with an error (it is `broken`).
            let _ = Self::break_qp(e.qp);
        }
        Refused::new(error, refused)
    }

    /// Posts requests on an endpoint: receives, then sends, each kind in order. On error, the requests that did
    /// not reach the device come back whole.
    pub(crate) fn post_inner(
        &mut self,
        ep: EndpointId,
        wrs: &mut Vec<WorkRequest>,
    ) -> Result<(), Refused> {
        let down = match self.eps.get(&ep) {
            None => {
                return Err(Refused::new(
                    TransportError::NoEndpoint,
                    std::mem::take(wrs),
                ))
            }
            Some(e) => e.state == EpState::Down && !e.qp.is_null(),
        };
        if down {
            // Posting on a dead connection completes with a flush, as hardware does, once the request is one the
            // device could have taken.
            if let Err(e) = wrs.iter().try_for_each(|w| w.op.check_leases()) {
                return Err(Refused::new(e, std::mem::take(wrs)));
            }
            for wr in wrs.drain(..) {
                self.cq_backlog.push_back((wr.flushed(ep), false));
            }
            return Ok(());
        }
        // Receives and sends go to different queues; keep each kind's order. A batch of one kind (one message's
        // send, a receive reposted) goes as it is.
        let is_recv = |wr: &WorkRequest| matches!(wr.op, Op::Recv { .. });
        if wrs.is_empty() {
            return Ok(());
        }
        if wrs.iter().all(is_recv) {
            return self.post_recvs(ep, wrs);
        }
        if !wrs.iter().any(is_recv) {
            return self.post_sends(ep, wrs);
        }
        let mut sends = Vec::new();
        let mut recvs = Vec::new();
        for wr in wrs.drain(..) {
            if matches!(wr.op, Op::Recv { .. }) {
                recvs.push(wr);
            } else {
                sends.push(wr);
            }
        }
        if !recvs.is_empty() {
            if let Err(mut r) = self.post_recvs(ep, &mut recvs) {
                r.wrs.extend(sends);
                return Err(r);
            }
        }
        if !sends.is_empty() {
            self.post_sends(ep, &mut sends)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::NoDevice;

    /// A chain the device refuses part-way gives back the slab slots of the emulated immediates from the refused
    /// request on, and only those (what `keep_posted_part` gives back).
    #[test]
    fn a_chain_knows_the_slab_slots_of_its_requests_from_any_one_on() {
        use ibv_wr_opcode::*;
        let mut slab = crate::emulated::ImmSlab::new(None, 8).expect("slab");
        let mut chain = Chain::default();
        chain.start(Signaler::default());
        let write = || NativePart::new(IBV_WR_RDMA_WRITE, Few::new(), None, ImmKind::None);
        let imm = |v| NativePart::new(IBV_WR_SEND, Few::new(), None, ImmKind::Emulated(v));
        for part in [write(), imm(1), write(), imm(2)] {
            chain.push(0, part, false, 0, Some(&mut slab));
        }
        let taken: Vec<usize> = (0..=4).map(|i| chain.slab_taken_from(i)).collect();
        assert_eq!(taken, [2, 2, 1, 1, 0]);
    }

    /// A native request's shape as far as chaining goes.
    struct Wr {
        id: usize,
        next: *mut Wr,
    }

    /// What the post paths check every operation with (`check_sends`, `post_recv_chain`), before anything is built.
    #[test]
    fn a_scatter_gather_entry_over_4_gib_is_refused_not_truncated() {
        use exs_dma::{DmaBuf, LeaseKind};
        // Mapped, never touched: no memory is used.
        let buf = DmaBuf::new((1 << 32) + 1);
        let reg: std::sync::Arc<dyn exs_transport::Registration> =
            std::sync::Arc::new(NoDevice(std::sync::Arc::clone(&buf)));
        let sge = |len: usize, kind| Sge::of(&reg, 0..len, kind).unwrap();
        let remote = RemoteRef { addr: 0, key: 1 };
        let refused = |op: &Op| match check_lengths(op) {
            Err(TransportError::Invalid(m)) => assert!(m.contains("4294967297 bytes"), "{m}"),
            other => panic!("{other:?}"),
        };
        let small = sge(64, LeaseKind::DeviceRead);
        refused(&Op::Send {
            sges: vec![small, sge(buf.len(), LeaseKind::DeviceRead)],
            imm: None,
        });
        refused(&Op::Write {
            local: vec![sge(buf.len(), LeaseKind::DeviceRead)],
            remote,
            imm: Some(1),
        });
        refused(&Op::Read {
            local: sge(buf.len(), LeaseKind::DeviceWrite),
            remote,
        });
        refused(&Op::Recv {
            sge: sge(buf.len(), LeaseKind::DeviceWrite),
        });
        // The longest entry verbs carries goes through whole.
        let longest = sge(u32::MAX as usize, LeaseKind::DeviceWrite);
        assert_eq!(sge_of(&longest).length, u32::MAX);
        assert!(check_lengths(&Op::Recv { sge: longest }).is_ok());
    }

    /// Each request points at the next and the last at nothing, through pointers that stay valid together: all
    /// come from one base pointer (the indexing this replaced made each pointer from a mutable borrow that the next
    /// store's borrow invalidated under Rust's aliasing rules, Stacked Borrows as Miri checks them).
    #[test]
    fn a_chain_of_requests_links_each_to_the_next_through_pointers_that_stay_valid() {
        for n in [0, 1, 2, 5] {
            let mut wrs: Vec<Wr> = (0..n)
                .map(|id| Wr {
                    id,
                    next: ptr::null_mut(),
                })
                .collect();
            let head = chain_next(&mut wrs, |w: &mut Wr, next| w.next = next);
            let mut seen = Vec::new();
            let mut at = head;
            for _ in 0..n {
                // SAFETY: `at` is the head or a `next` that `chain_next` set, in `wrs`'s buffer, which has not
                // moved or been borrowed since.
                let w = unsafe { &*at };
                seen.push(w.id);
                at = w.next;
            }
            assert_eq!(seen, (0..n).collect::<Vec<_>>());
            assert!(n == 0 || at.is_null(), "the last request ends the chain");
        }
    }
}

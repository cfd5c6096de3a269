//! Posting work requests: each is a boxed record whose address is the operation context, owning the request (and
//! its leases) until its completion is read or its endpoint is closed; a request the provider refuses comes back
//! whole.

use std::ffi::c_void;

use exs_transport::{EndpointId, Op, PostError, RemoteRef, Sge, TransportError, WorkRequest};

use crate::call::err;
use crate::connection::EpState;
use crate::ffi::*;
use crate::record::WrRecord;
use crate::FabricTransport;

impl FabricTransport {
    /// Posts one record; returns the libfabric result.
    fn post_record(&mut self, ep: *mut fid_ep, rec: *mut WrRecord) -> isize {
        // SAFETY: `rec` is a live boxed record we own until its completion is read; the addresses inside its
        // scatter/gather entries are leased DmaBuf ranges (kept alive by the record) and the local keys are
        // descriptors of live registrations (held by the entries). `ep` is an enabled endpoint.
        unsafe {
            let ctx = rec as *mut c_void;
            match &(*rec).op {
                Op::Recv { sge } => exs_fi_recv(
                    ep,
                    sge.addr() as *mut c_void,
                    sge.len(),
                    sge.local_key() as *mut c_void,
                    ctx,
                ),
                Op::Send { sges, imm: None } => with_gather(sges, |iov, desc| {
                    exs_fi_sendv(ep, iov.as_ptr(), desc.as_mut_ptr(), iov.len(), ctx)
                }),
                Op::Send {
                    sges,
                    imm: Some(imm),
                } => {
                    // Sends with immediate carry one buffer (the protocol never gathers them).
                    let (addr, len, key) = sges
                        .first()
                        .map_or((0, 0, 0), |s| (s.addr(), s.len(), s.local_key()));
                    exs_fi_senddata(
                        ep,
                        addr as *const c_void,
                        len,
                        key as *mut c_void,
                        u64::from(*imm),
                        ctx,
                    )
                }
                Op::Write {
                    local,
                    remote,
                    imm: Some(imm),
                } if local.len() == 1 => {
                    let l = &local[0];
                    exs_fi_writedata(
                        ep,
                        l.addr() as *const c_void,
                        l.len(),
                        l.local_key() as *mut c_void,
                        u64::from(*imm),
                        remote.addr,
                        remote.key,
                        ctx,
                    )
                }
                Op::Write { local, remote, imm } => write_gathered(ep, ctx, local, *remote, *imm),
                Op::Read { local, remote } => exs_fi_read(
                    ep,
                    local.addr() as *mut c_void,
                    local.len(),
                    local.local_key() as *mut c_void,
                    remote.addr,
                    remote.key,
                    ctx,
                ),
            }
        }
    }

    /// [`Transport::post`](exs_transport::Transport::post): one record, retried while the provider's queue is full.
    /// The refused request comes back whole in the error, as the trait's `post` says (hot path: not boxed).
    #[allow(clippy::result_large_err)]
    pub(crate) fn post_one(&mut self, ep: EndpointId, wr: WorkRequest) -> Result<(), PostError> {
        let Some(e) = self.eps.get(&ep) else {
            return Err(PostError {
                error: TransportError::NoEndpoint,
                wr,
            });
        };
        if let Err(error) = wr.op.check_leases() {
            return Err(PostError { error, wr });
        }
        if matches!(&wr.op, Op::Send { sges, imm: Some(_) } if sges.len() > 1) {
            // `fi_senddata` takes one buffer: the rest would be dropped unseen (review finding).
            return Err(PostError {
                error: TransportError::Invalid(
                    "a send with immediate data carries one buffer on libfabric (fi_senddata)"
                        .into(),
                ),
                wr,
            });
        }
        if e.state == EpState::Down {
            // Posting on a dead connection completes with a flush, as hardware does.
            self.cq_backlog.push_back(wr.flushed(ep));
            return Ok(());
        }
        let raw_ep = e.ep;
        let rec = self.records.leak(WrRecord {
            ctx: fi_context2::default(),
            ep,
            wr_id: wr.wr_id,
            op: wr.op,
        });
        let mut tries = 0;
        loop {
            let ret = self.post_record(raw_ep, rec);
            if ret == 0 {
                self.eps
                    .get_mut(&ep)
                    .expect("checked")
                    .pending
                    .insert(rec as usize);
                // Its completion will be in this endpoint's queue: read it in the next polls.
                self.touch(ep);
                return Ok(());
            }
            if ret == -(FI_EAGAIN as isize) && tries < 1000 {
                // The provider's queue is momentarily full: let it make progress (reading completions into our
                // backlog), then retry.
                tries += 1;
                let mut backlog = std::mem::take(&mut self.cq_backlog);
                self.read_cq(ep, &mut backlog, 64);
                self.cq_backlog = backlog;
                continue;
            }
            // The reads above ran the provider's progress on the queue (what it waits on may have changed): it is
            // read in the next polls and armed anew before it goes quiet, as after a post.
            if tries > 0 {
                self.touch(ep);
            }
            // SAFETY: the provider refused the record, so it never saw the pointer; we reclaim it once.
            let rec = unsafe { self.records.take(rec) };
            return Err(PostError {
                error: err(call_name(&rec.op), ret as i64),
                wr: WorkRequest {
                    wr_id: rec.wr_id,
                    op: rec.op,
                },
            });
        }
    }
}

/// Lists of at most this many entries are gathered on the stack (a control message and its inline data, a write
/// from a few sends); longer ones (a stream write gathered from many small sends) in vectors.
const GATHER_INLINE: usize = 4;

/// Calls `f` with the iovec and descriptor lists of `sges` (no allocation for short lists: one send per message).
fn with_gather<R>(sges: &[Sge], f: impl FnOnce(&[iovec], &mut [*mut c_void]) -> R) -> R {
    let entry = |s: &Sge| {
        (
            iovec {
                iov_base: s.addr() as *mut c_void,
                iov_len: s.len(),
            },
            s.local_key() as *mut c_void,
        )
    };
    if sges.len() <= GATHER_INLINE {
        let mut iov = [iovec {
            iov_base: std::ptr::null_mut(),
            iov_len: 0,
        }; GATHER_INLINE];
        let mut desc = [std::ptr::null_mut(); GATHER_INLINE];
        for (i, s) in sges.iter().enumerate() {
            (iov[i], desc[i]) = entry(s);
        }
        f(&iov[..sges.len()], &mut desc[..sges.len()])
    } else {
        let (iov, mut desc): (Vec<iovec>, Vec<*mut c_void>) = sges.iter().map(entry).unzip();
        f(&iov, &mut desc)
    }
}

/// The provider call [`FabricTransport::post_record`] makes for `op` (named in a refusal's error).
fn call_name(op: &Op) -> &'static str {
    match op {
        Op::Recv { .. } => "fi_recv",
        Op::Send { imm: None, .. } => "fi_sendv",
        Op::Send { imm: Some(_), .. } => "fi_senddata",
        Op::Write {
            local,
            imm: Some(_),
            ..
        } if local.len() == 1 => "fi_writedata",
        Op::Write { .. } => "fi_writemsg",
        Op::Read { .. } => "fi_read",
    }
}

/// Gathered write: one fi_writemsg with an iovec per entry and one remote range. A plain write (into a persistent
/// receive) completes only once the bytes are at the peer, as an RC write does on verbs: the sender's completion is
/// the only signal the peer gets (FI_DELIVERY_COMPLETE; found when faster progress let the sender's event overtake
/// them).
///
/// # Safety
/// As [`FabricTransport::post_record`]: `ep` is an enabled endpoint, `ctx` a live record that owns `local`, whose
/// entries are leased ranges with the keys of live registrations.
unsafe fn write_gathered(
    ep: *mut fid_ep,
    ctx: *mut c_void,
    local: &[Sge],
    remote: RemoteRef,
    imm: Option<u32>,
) -> isize {
    let len: usize = local.iter().map(|s| s.len()).sum();
    let rma = fi_rma_iov {
        addr: remote.addr,
        len,
        key: remote.key,
    };
    let flags = if imm.is_some() {
        FI_REMOTE_CQ_DATA as u64
    } else {
        FI_DELIVERY_COMPLETE as u64
    };
    with_gather(local, |iov, desc| {
        let msg = fi_msg_rma {
            msg_iov: iov.as_ptr(),
            desc: desc.as_mut_ptr(),
            iov_count: iov.len(),
            addr: 0,
            rma_iov: &rma,
            rma_iov_count: 1,
            context: ctx,
            data: imm.map_or(0, u64::from),
        };
        // SAFETY: the caller's contract; `iov`, `desc`, `rma` and `msg` live across the call.
        unsafe { exs_fi_writemsg(ep, &msg, flags) }
    })
}

//! Completions: one endpoint's completion queue read into exs completions (reclaiming the posted records),
//! provider errors as [`WcError`]s, and waiting (an epoll set over every queue's wait descriptor, `fi_trywait`).

use std::ffi::c_void;

use exs_transport::{Completed, Completion, EndpointId, Op, WcError};

use crate::connection::Ep;
use crate::ffi::*;
use crate::record::WrRecord;
use crate::FabricTransport;

impl FabricTransport {
    /// Reads up to `max` completions of one endpoint into `out`. Returns how many.
    pub(crate) fn read_cq(
        &mut self,
        id: EndpointId,
        out: &mut impl Extend<Completion>,
        max: usize,
    ) -> usize {
        let Some(e) = self.eps.get_mut(&id) else {
            return 0;
        };
        let mut entries = [fi_cq_data_entry::default(); 16];
        let mut n = 0;
        while n < max {
            let want = entries.len().min(max - n);
            // SAFETY: open queue; the buffer holds `want` data entries.
            let ret = unsafe { exs_fi_cq_read(e.cq, entries.as_mut_ptr() as *mut c_void, want) };
            if ret > 0 {
                let drained = (ret as usize) < want;
                for ent in &entries[..ret as usize] {
                    out.extend(Some(complete(
                        e,
                        id,
                        ent.op_context,
                        ent.flags,
                        ent.len,
                        ent.data,
                        Ok(()),
                    )));
                    n += 1;
                }
                // Fewer than asked: nothing more is queued now (another read would only cost a system call).
                if drained {
                    break;
                }
                continue;
            }
            if ret == -(FI_EAVAIL as isize) {
                let mut ee = fi_cq_err_entry::default();
                // SAFETY: an error entry is available; `ee` is a valid buffer.
                let r = unsafe { exs_fi_cq_readerr(e.cq, &mut ee, 0) };
                if r > 0 {
                    tracing::debug!(err = ee.err, prov_errno = ee.prov_errno, "completion error");
                    let status = Err(wc_error(ee.err));
                    out.extend(Some(complete(
                        e,
                        id,
                        ee.op_context,
                        ee.flags,
                        ee.len,
                        ee.data,
                        status,
                    )));
                    n += 1;
                    continue;
                }
            }
            break;
        }
        n
    }
}

fn wc_error(err: i32) -> WcError {
    match err as u32 {
        FI_ECANCELED => WcError::Flushed,
        FI_ETIMEDOUT => WcError::RetryExceeded,
        // Connection reset / broken pipe / not connected / I/O error: the connection is gone.
        104 | 32 | 107 | 5 => WcError::Flushed,
        13 | 1 => WcError::RemoteAccess, // EACCES, EPERM
        _ => WcError::Other(strerror(err.into())),
    }
}

/// Turns a completion entry into an exs completion, reclaiming its record.
fn complete(
    e: &mut Ep,
    id: EndpointId,
    op_context: *mut c_void,
    flags: u64,
    len: usize,
    data: u64,
    status: Result<(), WcError>,
) -> Completion {
    if op_context.is_null() {
        // A write-with-immediate that consumed no receive (remote CQ data).
        return Completion {
            ep: id,
            wr_id: 0,
            op: Completed::RemoteWrite { imm: data as u32 },
            status,
        };
    }
    let key = op_context as usize;
    e.pending.remove(&key);
    // SAFETY: non-null operation contexts are records we boxed in `post` and leaked into the provider; each
    // completes exactly once, so the box is reclaimed exactly once (and removed from `pending`).
    let rec = unsafe { Box::from_raw(op_context as *mut WrRecord) };
    let imm = (flags & FI_REMOTE_CQ_DATA as u64 != 0).then_some(data as u32);
    let op = match rec.op {
        Op::Send { .. } => Completed::Send,
        Op::Write { .. } => Completed::Write,
        Op::Read { .. } => Completed::Read,
        Op::Recv { .. } => Completed::Recv {
            len: len as u32,
            imm,
        },
    };
    Completion {
        ep: id,
        wr_id: rec.wr_id,
        op,
        status,
    }
}

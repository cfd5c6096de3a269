//! Completions: one endpoint's completion queue read into exs completions (reclaiming the posted records),
//! provider errors as [`WcError`]s, and waiting (an epoll set over every queue's wait descriptor, `fi_trywait`).

use std::ffi::c_void;
use std::mem::MaybeUninit;

use exs_transport::{Completed, Completion, EndpointId, Op, WcError};

use crate::connection::Ep;
use crate::ffi::*;
use crate::record::{Records, WrRecord};
use crate::FabricTransport;

impl FabricTransport {
    /// Reads up to `max` completions of one endpoint into `out`. Returns how many.
    ///
    /// A queue that cannot be read (`fi_cq_read` failing otherwise than for want of entries, or an error entry
    /// that cannot be taken) takes its connection down: reported once as a disconnection, logged with the call
    /// and its code. Treated as empty, its requests would never complete and the engine would wait for ever.
    pub(crate) fn read_cq(
        &mut self,
        id: EndpointId,
        out: &mut impl Extend<Completion>,
        max: usize,
    ) -> usize {
        let Some(e) = self.eps.get_mut(&id) else {
            return 0;
        };
        let records = &mut self.records;
        // Not zeroed (it was, on every read: most reads of a busy poller find nothing): the provider writes the
        // entries it returns, and only those are read.
        let mut entries = [const { MaybeUninit::<fi_cq_data_entry>::uninit() }; 16];
        let mut n = 0;
        let mut failed = None;
        while n < max {
            let want = entries.len().min(max - n);
            // SAFETY: open queue; the buffer holds `want` data entries.
            let ret = unsafe { exs_fi_cq_read(e.cq, entries.as_mut_ptr() as *mut c_void, want) };
            match CqRead::of(ret) {
                CqRead::Entries(got) => {
                    for ent in &entries[..got] {
                        // SAFETY: fi_cq_read wrote its first `got` entries.
                        let ent = unsafe { ent.assume_init_ref() };
                        if let Some(c) = complete(e, records, id, Entry::of(ent), Ok(())) {
                            out.extend(Some(c));
                            n += 1;
                        }
                    }
                    // Fewer than asked: nothing more is queued now (another read would only cost a system call).
                    if got < want {
                        break;
                    }
                }
                CqRead::Empty => break,
                CqRead::ErrorEntry => {
                    let mut ee = fi_cq_err_entry::default();
                    // SAFETY: an error entry is available; `ee` is a valid buffer.
                    let r = unsafe { exs_fi_cq_readerr(e.cq, &mut ee, 0) };
                    if r <= 0 {
                        failed = Some(("fi_cq_readerr", r));
                        break;
                    }
                    tracing::debug!(err = ee.err, prov_errno = ee.prov_errno, "completion error");
                    let status = Err(wc_error(ee.err, ee.prov_errno));
                    if let Some(c) = complete(e, records, id, Entry::of_error(&ee), status) {
                        out.extend(Some(c));
                        n += 1;
                    }
                }
                CqRead::Failed => {
                    failed = Some(("fi_cq_read", ret));
                    break;
                }
            }
        }
        if let Some((call, code)) = failed {
            // Logged once: the queue may fail again at every read until the engine releases the endpoint.
            if let Some(ev) = self.report_down(id) {
                tracing::error!(
                    ?id,
                    call,
                    code,
                    "the connection's completion queue cannot be read ({}): taking the connection down",
                    strerror(code as i64)
                );
                self.cm_backlog.push_back(ev);
            } else {
                tracing::debug!(
                    ?id,
                    call,
                    code,
                    "a connection already down: its completion queue cannot be read"
                );
            }
        }
        n
    }
}

/// What a return of `fi_cq_read` says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum CqRead {
    /// That many entries were written.
    Entries(usize),
    /// No entry is queued (`-FI_EAGAIN`, or 0).
    Empty,
    /// An error entry is at the head of the queue (`-FI_EAVAIL`): `fi_cq_readerr` takes it.
    ErrorEntry,
    /// Any other code: the queue cannot be read.
    Failed,
}

impl CqRead {
    fn of(ret: isize) -> Self {
        match ret {
            n if n > 0 => CqRead::Entries(n as usize),
            // The manual says no entry is -FI_EAGAIN; a provider that said 0 would mean the same.
            0 => CqRead::Empty,
            n if n == -(FI_EAGAIN as isize) => CqRead::Empty,
            n if n == -(FI_EAVAIL as isize) => CqRead::ErrorEntry,
            _ => CqRead::Failed,
        }
    }
}

/// The status of a failed request, from its error entry's code and the provider's own (the latter only in words:
/// what it means depends on the provider).
fn wc_error(err: i32, prov_errno: i32) -> WcError {
    match err as u32 {
        FI_ECANCELED => WcError::Flushed,
        FI_ETIMEDOUT => WcError::RetryExceeded,
        // A message longer than the receive it landed in (as verbs' IBV_WC_LOC_LEN_ERR).
        FI_ETRUNC => WcError::LocalLength,
        // Connection reset / broken pipe / not connected / I/O error: the connection is gone.
        104 | 32 | 107 | 5 => WcError::Flushed,
        13 | 1 => WcError::RemoteAccess, // EACCES, EPERM
        _ => WcError::Other(format!(
            "fi_cq_readerr: {} (error {err}, provider error {prov_errno})",
            strerror(err.into())
        )),
    }
}

/// What a completion entry (a data entry or an error entry) says of its request.
struct Entry {
    op_context: *mut c_void,
    flags: u64,
    len: usize,
    data: u64,
}

impl Entry {
    fn of(ent: &fi_cq_data_entry) -> Self {
        Entry {
            op_context: ent.op_context,
            flags: ent.flags,
            len: ent.len,
            data: ent.data,
        }
    }

    fn of_error(ee: &fi_cq_err_entry) -> Self {
        Entry {
            op_context: ee.op_context,
            flags: ee.flags,
            len: ee.len,
            data: ee.data,
        }
    }
}

/// Turns a completion entry into an exs completion, reclaiming its record; `None` for an entry naming no
/// pending request of the endpoint.
fn complete(
    e: &mut Ep,
    records: &mut Records,
    id: EndpointId,
    entry: Entry,
    status: Result<(), WcError>,
) -> Option<Completion> {
    let Entry {
        op_context,
        flags,
        len,
        data,
    } = entry;
    if op_context.is_null() {
        // A write-with-immediate that consumed no receive (remote CQ data). One that failed on its way in (a
        // reset mid-transfer, our shutdown cutting it) is an error entry of the same shape: its status says so,
        // and the protocol ends the connection on it. A success that carries no remote data names nothing.
        let status = match status {
            Ok(()) if flags & FI_REMOTE_CQ_DATA as u64 == 0 => Err(WcError::Other(
                "a completion naming no request and carrying no remote data".into(),
            )),
            s => s,
        };
        return Some(Completion {
            ep: id,
            wr_id: 0,
            op: Completed::RemoteWrite { imm: data as u32 },
            status,
        });
    }
    let key = op_context as usize;
    if !e.pending.remove(&key) {
        // Not a request of ours in flight (a provider that completed one twice): taking it back would free or
        // reuse its allocation twice. Not reached with the providers tested; the entry is left alone.
        tracing::error!(
            ?id,
            "a completion for a request that is not pending; ignored"
        );
        return None;
    }
    // SAFETY: non-null operation contexts are records leaked into the provider by `post`; each completes exactly
    // once, so it is taken back exactly once (and removed from `pending`).
    let rec = unsafe { records.take(op_context as *mut WrRecord) };
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
    Some(Completion {
        ep: id,
        wr_id: rec.wr_id,
        op,
        status,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_completion_queue_that_cannot_be_read_is_not_taken_for_an_empty_one() {
        assert_eq!(CqRead::of(3), CqRead::Entries(3));
        assert_eq!(CqRead::of(-(FI_EAGAIN as isize)), CqRead::Empty);
        assert_eq!(CqRead::of(-(FI_EAVAIL as isize)), CqRead::ErrorEntry);
        // Any other code (a provider or device failure) takes the connection down instead of hanging it.
        for code in [FI_EIO, FI_EINVAL, FI_ENOMEM, FI_EOTHER] {
            assert_eq!(CqRead::of(-(code as isize)), CqRead::Failed, "code {code}");
        }
        assert_eq!(CqRead::of(0), CqRead::Empty);
    }

    #[test]
    fn a_failed_request_of_no_known_kind_keeps_the_providers_codes() {
        let WcError::Other(what) = wc_error(FI_EOTHER as i32, 77) else {
            panic!("an unknown code is no known status");
        };
        assert!(what.starts_with("fi_cq_readerr: "), "{what}");
        assert!(what.contains(&format!("error {FI_EOTHER}")), "{what}");
        assert!(what.contains("provider error 77"), "{what}");
        assert_eq!(wc_error(FI_ETRUNC as i32, 0), WcError::LocalLength);
    }
}

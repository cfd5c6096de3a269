//! The record of a send-queue request, kept by its endpoint until the request completes.

use exs_transport::{Completed, Op};

use crate::memory::{BindHold, SinkMr};

/// A send-queue request: kept until its completion (or a later signalled one) arrives, its operation (and the
/// leases in it) with it. `kind` is `None` for the backend's own requests (window binds), which the engine never
/// hears of.
pub(crate) struct SendRec {
    pub(crate) wr_id: u64,
    pub(crate) kind: Option<Completed>,
    /// An RDMA read's sink registration (iWARP), deregistered before the operation's leases go (see the drop).
    pub(crate) _sink: Option<SinkMr>,
    /// A window bind's window and registration, held until the bind retires.
    pub(crate) _bind: Option<BindHold>,
    pub(crate) op: Option<Op>,
}

impl Drop for SendRec {
    /// The read's sink goes first; if it could not be deregistered, its key (which allows remote write, and the
    /// peer had it) may still name the sink, and the read's leases are never released (review finding: they were
    /// released whatever the deregistration did, while `MrKey` and windows already kept theirs).
    fn drop(&mut self) {
        if let Some(mut sink) = self._sink.take() {
            if !sink.close() {
                if let Some(op) = self.op.take() {
                    op.keep_for_good();
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use exs_dma::{DmaBuf, LeaseKind};
    use exs_transport::{Op, Registration, RemoteRef, Sge};

    use super::*;
    use crate::memory::{NoDevice, Pd};

    fn read_with_sink(
        buf: &Arc<DmaBuf>,
        pd: &Arc<Pd>,
        dereg: fn(*mut rdma_sys::ibv_mr) -> i32,
    ) -> SendRec {
        let reg: Arc<dyn Registration> = Arc::new(NoDevice(Arc::clone(buf)));
        SendRec {
            wr_id: 1,
            kind: Some(Completed::Read),
            _sink: Some(SinkMr::with_dereg(
                std::ptr::NonNull::dangling().as_ptr(),
                pd,
                dereg,
            )),
            _bind: None,
            op: Some(Op::Read {
                local: Sge::of(&reg, 0..64, LeaseKind::DeviceWrite).unwrap(),
                remote: RemoteRef { addr: 0, key: 1 },
            }),
        }
    }

    fn failing_dereg(_: *mut rdma_sys::ibv_mr) -> i32 {
        libc::EBUSY
    }

    fn good_dereg(_: *mut rdma_sys::ibv_mr) -> i32 {
        0
    }

    #[test]
    fn a_read_whose_sink_could_not_be_deregistered_keeps_its_range_leased() {
        let (kept, other) = (DmaBuf::new(4096), DmaBuf::new(4096));
        // A stand-in domain, never deallocated (its last Arc is forgotten before anything can fail).
        let pd = Arc::new(Pd(std::ptr::null_mut()));
        drop(read_with_sink(&kept, &pd, failing_dereg));
        drop(read_with_sink(&other, &pd, good_dereg));
        std::mem::forget(pd);
        assert!(
            kept.is_range_leased(0..64),
            "the sink's key may still let the peer write there"
        );
        assert!(!other.is_range_leased(0..64), "a sink deregistered lets go");
        assert!(kept.kept_for_good() && !other.kept_for_good());
    }
}

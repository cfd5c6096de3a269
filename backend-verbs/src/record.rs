//! The record of a send-queue request, kept by its endpoint until the request completes.

use exs_transport::{Completed, Op};

use crate::memory::{BindHold, SinkMr};

/// A send-queue request: kept until its completion (or a later signalled one) arrives, its operation (and the
/// leases in it) with it. `kind` is `None` for the backend's own requests (window binds), which the engine never
/// hears of.
pub(crate) struct SendRec {
    pub(crate) wr_id: u64,
    pub(crate) kind: Option<Completed>,
    /// An RDMA read's sink registration (iWARP), dropped before the operation's leases (field order).
    pub(crate) _sink: Option<SinkMr>,
    /// A window bind's window and registration, held until the bind retires.
    pub(crate) _bind: Option<BindHold>,
    pub(crate) op: Option<Op>,
}

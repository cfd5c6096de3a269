//! The record of a posted work request: its address is the operation context libfabric hands back with the
//! completion; it owns the request (and its leases) until then.

use exs_transport::{EndpointId, Op};

use crate::ffi::*;

/// A posted work request. Its address is the operation context; `ctx` comes first for FI_CONTEXT providers.
#[repr(C)]
pub(crate) struct WrRecord {
    pub(crate) ctx: fi_context2,
    pub(crate) ep: EndpointId,
    pub(crate) wr_id: u64,
    pub(crate) op: Op,
}

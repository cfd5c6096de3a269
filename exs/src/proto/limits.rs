//! What the protocol needs to know of the transport.

/// Limits of the transport that the protocol needs.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Limits {
    /// Largest message (or RDMA transfer) the transport carries.
    pub max_message: u64,
    /// Send-queue entries of one endpoint.
    pub max_send_wr: u32,
    /// Scatter/gather entries of one work request.
    pub max_sge: u32,
}

//! The one seam between the protocol and hardware.
//!
//! A [`Transport`] is one device (an rdma-core verbs context, a libfabric domain, or the simulated fabric) with
//! one completion queue shared by all its endpoints and one connection-management event source. The protocol never
//! sees `ibv_*` or `fi_*`; a backend never sees adverts, credits or phases. The mapping is direct:
//!
//! | trait                | rdma-core verbs + rdma_cm                          | libfabric MSG endpoint                  |
//! |----------------------|----------------------------------------------------|-----------------------------------------|
//! | `register`           | `ibv_reg_mr` (local write)                          | `fi_mr_reg`                              |
//! | `expose`             | `ibv_reg_mr` with remote access on the range (or MW) | `fi_mr_reg` with FI_REMOTE_READ/WRITE   |
//! | `listen`             | `rdma_bind_addr` + `rdma_listen`                   | `fi_passive_ep` + `fi_listen`            |
//! | `connect`            | resolve addr/route, `rdma_create_qp`, post initial receives, `rdma_connect` | `fi_endpoint`, `fi_recv`..., `fi_connect` |
//! | `accept`             | `rdma_create_qp`, post receives, `rdma_accept`     | `fi_endpoint`, `fi_recv`..., `fi_accept` |
//! | `post` Send          | `ibv_post_send` IBV_WR_SEND\[_WITH_IMM\], inline when small | `fi_sendv` / `fi_senddata`         |
//! | `post` Write + imm   | IBV_WR_RDMA_WRITE_WITH_IMM (or write + send fallback) | `fi_writedata` / `fi_writemsg` + data |
//! | `post` Read          | IBV_WR_RDMA_READ                                   | `fi_read`                               |
//! | `post` Recv          | `ibv_post_recv`                                    | `fi_recv`                               |
//! | `post_shared_recv`   | `ibv_create_srq` once, then `ibv_post_srq_recv`    | (not offered: per-endpoint receives)    |
//! | `poll`               | `ibv_poll_cq`                                      | `fi_cq_read` / `fi_cq_readerr`           |
//! | `poll_cm`            | `rdma_get_cm_event`                                | `fi_eq_read`                             |
//! | `arm` + `wait_fd`    | `ibv_req_notify_cq` + completion channel fd (epoll with the cm fd) | `fi_trywait` + FI_GETWAIT fd |
//!
//! ## Memory rules (enforced by types)
//! Every work request owns the [`Lease`]s of the memory it names (inside its [`Sge`]s), and each `Sge` holds the
//! [`Registration`] that makes the key valid. A transport keeps a work request's leases until the hardware can no
//! longer touch the memory: until its completion is returned, or until the endpoint is destroyed after a flush.
//! An [`Exposure`] (a remote key for one leased range) keeps its lease until it is dropped, and dropping it revokes
//! remote access where the transport can (least exposure).

#![forbid(unsafe_code)]
#![deny(missing_docs)]

use std::any::Any;
use std::collections::HashMap;
use std::fmt;
use std::net::SocketAddr;
use std::os::fd::OwnedFd;
use std::sync::Arc;
use std::time::Duration;

use exs_dma::{DmaBuf, DmaError, Lease, LeaseKind};

mod error;
mod exposure;
pub use error::{plain_text, CallError, TransportError};
use exposure::device_may_write;
pub use exposure::{check_exposure, Exposure, KeyedLease, NoKey, Released, Revoke};

/// An endpoint (queue pair) of a transport, named by the engine when it creates it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct EndpointId(pub u32);

/// A listening endpoint of a transport.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ListenerId(pub u32);

/// An incoming connection request, to accept or reject.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RequestId(pub u64);

/// What a transport (device, provider) can do. The protocol adapts to it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Capabilities {
    /// Backend and device/provider name, for logs and `exs info`.
    pub name: String,
    /// Largest payload sent inline with the work request (no DMA from the source).
    pub max_inline: usize,
    /// Largest single send, write or read in bytes.
    pub max_message: u64,
    /// Whether RDMA write-with-immediate is native. When false the backend emulates it (write, then a send
    /// carrying the immediate); the protocol does not notice except in speed.
    pub native_write_imm: bool,
    /// Whether an incoming write-with-immediate consumes a posted receive (verbs: yes; libfabric without
    /// FI_RX_CQ_DATA: no).
    pub imm_consumes_recv: bool,
    /// Send queue depth per endpoint: work requests outstanding at once.
    pub max_send_wr: u32,
    /// Receive queue depth per endpoint.
    pub max_recv_wr: u32,
    /// Scatter/gather entries per send.
    pub max_sge: u32,
    /// RDMA reads outstanding at once per endpoint (initiator depth).
    pub max_read_depth: u32,
    /// Bytes of private data a connect request can carry.
    pub max_private_data: usize,
    /// Depth of a shared receive queue (seed 003), or 0 when the transport has none.
    pub max_shared_recv: u32,
    /// Whether a message that finds no receive posted waits for one: the sender retries (receiver-not-ready
    /// retry on InfiniBand/RoCE reliable connections) or the provider holds it (libfabric's tcp leaves it in the
    /// socket). `false` on iWARP, where it ends the connection (the receiver terminates it, DDP's "no buffer"):
    /// a receiver there must keep a receive posted for every message it lets its peer send, so a shared pool
    /// holds a buffer for every credit its connections promised (seed 002, 3.2: "or the RDMA hardware will
    /// cause a fatal error").
    pub rnr_retry: bool,
    /// The default `small_packet_max_size` of message sockets here (seed 002, 4.1): up to this size the data
    /// travels inside the advertisement (one message) rather than being pulled by an RDMA read (advert, read,
    /// acknowledgment). Each backend sets it from `cargo xtask bench`'s crossover on that kind of transport,
    /// bounded by the receive memory it costs per connection; a socket can still set its own.
    pub immediate_default: u32,
    /// Exposures can be made only once the endpoint is connected (memory windows bind on the queue pair). The
    /// stream buffer's key then follows the handshake in a STREAM_RING message instead of travelling in it.
    pub keys_after_connect: bool,
}

/// Registered memory: a whole [`DmaBuf`] made usable for local access by one transport.
///
/// Dropping the last `Arc` deregisters it. Backends keep the buffer's `Arc` inside, so the memory outlives the
/// registration.
pub trait Registration: Send + Sync + fmt::Debug + Any {
    /// Local key (verbs lkey, libfabric descriptor) for scatter/gather entries.
    fn local_key(&self) -> u64;
    /// The registered buffer.
    fn buf(&self) -> &Arc<DmaBuf>;
    /// For downcasting by the backend that made it.
    fn as_any(&self) -> &dyn Any;
}

/// Registers memory for local access without the [`Transport`] (see [`Transport::registrar`]): any thread, at any
/// time, while the engine goes on with its connections.
pub trait Registrar: Send + Sync + fmt::Debug {
    /// As [`Transport::register`].
    fn register(&self, buf: &Arc<DmaBuf>) -> Result<Arc<dyn Registration>, TransportError>;
}

/// How a peer addresses memory we exposed: the remote address of the first byte and the key.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RemoteRef {
    /// Address as the peer's transport uses it (virtual address, or offset for offset-addressed providers).
    pub addr: u64,
    /// Remote key.
    pub key: u64,
}

/// Which remote access an exposure grants.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RemoteAccess {
    /// The peer may RDMA-read the range (a send waiting to be pulled, a persistent send).
    Read,
    /// The peer may RDMA-write the range (an advertised receive, a stream buffer, a persistent receive).
    Write,
}

/// One scatter/gather entry: leased memory plus the registration that names it.
#[derive(Debug)]
pub struct Sge {
    lease: Lease,
    reg: Arc<dyn Registration>,
}

impl Sge {
    /// Marks the buffer kept for good ([`exs_dma::DmaBuf::keep_for_good`]), for an entry whose lease is never given
    /// back because a device may still reach its range.
    pub fn mark_kept_for_good(&self) {
        self.lease.buf().keep_for_good();
    }

    /// Pairs a lease with the registration of its buffer. Fails if the lease is on another buffer.
    pub fn new(lease: Lease, reg: Arc<dyn Registration>) -> Result<Self, TransportError> {
        if !Arc::ptr_eq(lease.buf(), reg.buf()) {
            return Err(TransportError::Invalid(
                "scatter/gather lease is not on the registered buffer".into(),
            ));
        }
        Ok(Self { lease, reg })
    }

    /// Leases `range` of the registration's own buffer for the device (`kind`) and pairs it with the
    /// registration: the buffer is the registered one by construction, so only the lease can fail (the range is
    /// outside the buffer, or leased in a conflicting way).
    pub fn of(
        reg: &Arc<dyn Registration>,
        range: std::ops::Range<usize>,
        kind: LeaseKind,
    ) -> Result<Self, DmaError> {
        let lease = reg.buf().lease(range, kind)?;
        Ok(Self {
            lease,
            reg: Arc::clone(reg),
        })
    }

    /// Device address of the first byte.
    pub fn addr(&self) -> u64 {
        self.lease.addr()
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.lease.len()
    }

    /// Whether the entry is empty.
    pub fn is_empty(&self) -> bool {
        self.lease.is_empty()
    }

    /// Local key of the registration.
    pub fn local_key(&self) -> u64 {
        self.reg.local_key()
    }

    /// The lease (for backends that move bytes themselves, such as the simulator or an emulation path).
    pub fn lease(&self) -> &Lease {
        &self.lease
    }

    /// Copies `src` into the entry's range at `offset` (a receive filled by software: the simulator, an inline
    /// payload). The lease itself is not handed out mutably: swapping in a lease of another buffer would part it
    /// from the registration the entry was checked against.
    pub fn write(&mut self, offset: usize, src: &[u8]) -> Result<(), DmaError> {
        self.lease.write(offset, src)
    }

    /// Copies `len` bytes of `src` at `src_offset` into the entry's range at `offset`.
    pub fn fill_from(
        &mut self,
        offset: usize,
        src: &DmaBuf,
        src_offset: usize,
        len: usize,
    ) -> Result<(), DmaError> {
        src.copy_into(src_offset, &mut self.lease, offset, len)
    }

    /// Copies `len` bytes of the lease `src` at `src_offset` into the entry's range at `offset`.
    pub fn fill_from_lease(
        &mut self,
        offset: usize,
        src: &Lease,
        src_offset: usize,
        len: usize,
    ) -> Result<(), DmaError> {
        src.copy_to(src_offset, &mut self.lease, offset, len)
    }

    /// The registration.
    pub fn registration(&self) -> &Arc<dyn Registration> {
        &self.reg
    }

    /// Splits into the lease and the registration.
    pub fn into_parts(self) -> (Lease, Arc<dyn Registration>) {
        (self.lease, self.reg)
    }
}

/// An operation to post on an endpoint.
#[derive(Debug)]
pub enum Op {
    /// Two-sided send of the gathered entries, optionally with a 32-bit immediate.
    Send {
        /// Gather list (at most [`Capabilities::max_sge`]).
        sges: Vec<Sge>,
        /// Immediate value.
        imm: Option<u32>,
    },
    /// Post a receive buffer (on an endpoint, or on the shared receive queue).
    Recv {
        /// Where the incoming message lands.
        sge: Sge,
    },
    /// RDMA write gathered from `local` to `remote`; with `imm`, a write-with-immediate that completes a receive
    /// at the peer.
    Write {
        /// Local sources, gathered in order (at most [`Capabilities::max_sge`]).
        local: Vec<Sge>,
        /// Remote destination.
        remote: RemoteRef,
        /// Immediate value (write-with-immediate).
        imm: Option<u32>,
    },
    /// RDMA read from `remote` into `local`.
    Read {
        /// Local sink.
        local: Sge,
        /// Remote source.
        remote: RemoteRef,
    },
}

impl Op {
    /// Refuses an operation whose leases do not allow what the device does with them: a receive's target or an
    /// RDMA read's sink needs a lease the device may write ([`exs_dma::LeaseKind::DeviceWrite`],
    /// [`exs_dma::LeaseKind::DeviceWriteShared`] or [`exs_dma::LeaseKind::TrustedKey`]). A lease that only lets
    /// the device read goes beside the CPU's borrows, which would then see the device write under them. Every
    /// transport checks this before it posts (the sources of sends and writes are only read by the device: any
    /// lease keeps them alive).
    pub fn check_leases(&self) -> Result<(), TransportError> {
        let sink = match self {
            Op::Recv { sge } => sge,
            Op::Read { local, .. } => local,
            Op::Send { .. } | Op::Write { .. } => return Ok(()),
        };
        let kind = sink.lease.kind();
        if device_may_write(kind) {
            return Ok(());
        }
        Err(TransportError::Invalid(format!(
            "the device would write into memory leased as {kind:?}: a receive or a read needs a lease the device \
             may write"
        )))
    }

    /// Never gives the operation's leases back, and marks their buffers kept for good
    /// ([`exs_dma::DmaBuf::keep_for_good`]): a device may still reach them (the read sink's registration could not
    /// be undone, say).
    pub fn keep_for_good(self) {
        self.mark_kept_for_good();
        std::mem::forget(self);
    }

    /// Marks the buffers of the operation's leases kept for good, for an operation that is never given back
    /// (see [`Op::keep_for_good`]).
    pub fn mark_kept_for_good(&self) {
        let sges: &[Sge] = match self {
            Op::Send { sges, .. } | Op::Write { local: sges, .. } => sges,
            Op::Recv { sge } | Op::Read { local: sge, .. } => std::slice::from_ref(sge),
        };
        for sge in sges {
            sge.mark_kept_for_good();
        }
    }
}

/// An operation plus the identifier its completion will carry.
#[derive(Debug)]
pub struct WorkRequest {
    /// Returned in the completion.
    pub wr_id: u64,
    /// The operation.
    pub op: Op,
}

/// What completed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Completed {
    /// A send.
    Send,
    /// An RDMA write (with or without immediate).
    Write,
    /// An RDMA read.
    Read,
    /// A posted receive was consumed: by a send (`len` bytes, `imm` if it carried one) or by a
    /// write-with-immediate (`imm` set; `len` unreliable across providers, so the protocol does not use it).
    Recv {
        /// Bytes received (sends only).
        len: u32,
        /// Immediate value.
        imm: Option<u32>,
    },
    /// A write-with-immediate arrived without consuming a posted receive (`imm_consumes_recv == false`).
    /// `wr_id` is meaningless.
    RemoteWrite {
        /// Immediate value.
        imm: u32,
    },
}

/// Why a work request failed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum WcError {
    /// Flushed because the endpoint went to error or was disconnected.
    #[error("flushed (endpoint disconnected)")]
    Flushed,
    /// The peer rejected our RDMA access (bad key, out of bounds, no permission).
    #[error("remote access error")]
    RemoteAccess,
    /// Our own memory/key was refused locally.
    #[error("local protection error")]
    LocalProtection,
    /// The peer did not answer (transport retries exhausted).
    #[error("transport retry count exceeded (peer unreachable)")]
    RetryExceeded,
    /// The peer had no receive posted for too long.
    #[error("receiver-not-ready retries exceeded")]
    RnrRetryExceeded,
    /// The incoming message did not fit the receive buffer.
    #[error("local length error")]
    LocalLength,
    /// Anything else, with the backend's words.
    #[error("{0}")]
    Other(String),
}

/// A completion from the shared completion queue.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Completion {
    /// The endpoint the work request was posted on (or that consumed the receive).
    pub ep: EndpointId,
    /// The work request's identifier.
    pub wr_id: u64,
    /// What completed (valid even on error, so the protocol knows which resource came back).
    pub op: Completed,
    /// Outcome.
    pub status: Result<(), WcError>,
}

/// Why an outgoing connection failed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ConnectFailure {
    /// Nobody listens there, or the listener rejected us. Private data of a reject, if any.
    Refused(Vec<u8>),
    /// No route or address resolution failed.
    Unreachable,
    /// The peer did not answer in time.
    TimedOut,
    /// Something answered at the address, but not in the transport's connection protocol (a plain TCP server
    /// under libfabric's tcp provider): it is not an exs peer. The provider's own words, for debug logs.
    NotAPeer(String),
    /// Anything else: the call that failed and its code (the error's `source()`).
    Other(TransportError),
}

/// A connection-management event.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CmEvent {
    /// A peer wants to connect to one of our listeners.
    ConnectRequest {
        /// The listener.
        listener: ListenerId,
        /// Handle for accept/reject.
        request: RequestId,
        /// The peer's address.
        peer: SocketAddr,
        /// The peer's private data (our handshake).
        private: Vec<u8>,
    },
    /// A connection is up. For the active side, `private` is the acceptor's private data.
    Established {
        /// The endpoint.
        ep: EndpointId,
        /// Private data of the accept (active side) or empty (passive side).
        private: Vec<u8>,
    },
    /// An outgoing connection failed.
    ConnectFailed {
        /// The endpoint.
        ep: EndpointId,
        /// Why.
        reason: ConnectFailure,
    },
    /// The connection is down (peer disconnected, or our disconnect finished, or the peer vanished).
    Disconnected {
        /// The endpoint.
        ep: EndpointId,
    },
}

/// A post that the transport refused; the work request (and its leases) comes back.
#[derive(Debug)]
pub struct PostError {
    /// Why.
    pub error: TransportError,
    /// The refused work request.
    pub wr: WorkRequest,
}

/// One RDMA device or provider domain. See the module documentation for the mapping.
///
/// All methods are called with the engine's lock held, from one thread at a time, and must not block.
pub trait Transport: Send + fmt::Debug {
    /// What the transport can do.
    fn capabilities(&self) -> &Capabilities;

    /// Registers a buffer for local access.
    fn register(&mut self, buf: &Arc<DmaBuf>) -> Result<Arc<dyn Registration>, TransportError>;

    /// What registers the application's memory outside the engine's lock, where registering needs nothing of
    /// the transport's own state (the device pins a buffer's pages, which takes a while for a large one, and
    /// every connection of the context waited meanwhile). `None` (the default): [`Transport::register`], under
    /// the lock.
    fn registrar(&self) -> Option<Arc<dyn Registrar>> {
        None
    }

    /// Grants the peer of endpoint `ep`, and no other, `access` to the leased range of a registered buffer.
    ///
    /// The key works only for operations that arrive on `ep` (memory windows bound to the queue pair on verbs,
    /// the endpoint's own domain on libfabric; a backend that cannot bind a key to one connection says so in
    /// its documentation and the README). `ep` may be named before `connect`/`accept` creates it (the stream
    /// buffer travels in the handshake). Dropping the exposure revokes the key.
    fn expose(
        &mut self,
        ep: EndpointId,
        reg: &Arc<dyn Registration>,
        lease: Lease,
        access: RemoteAccess,
    ) -> Result<Box<dyn Exposure>, TransportError>;

    /// Starts listening. Port 0 picks a free port; the bound address is returned.
    fn listen(
        &mut self,
        addr: SocketAddr,
        backlog: u32,
    ) -> Result<(ListenerId, SocketAddr), TransportError>;

    /// Stops listening.
    fn close_listener(&mut self, listener: ListenerId);

    /// Starts connecting endpoint `ep` to `addr`. `recvs` are posted on the endpoint before the request leaves,
    /// so the peer can send as soon as the connection is up. Ends with `Established` or `ConnectFailed`.
    fn connect(
        &mut self,
        ep: EndpointId,
        addr: SocketAddr,
        private: &[u8],
        recvs: Vec<WorkRequest>,
    ) -> Result<(), TransportError>;

    /// Accepts a request on a new endpoint `ep`, posting `recvs` first. Ends with `Established` (or
    /// `Disconnected` if the peer went away). On error the request may still wait for an answer (a transport
    /// checks `recvs` and its own state before it takes the request): the caller rejects it, which does nothing
    /// if the transport answered it already.
    fn accept(
        &mut self,
        request: RequestId,
        ep: EndpointId,
        private: &[u8],
        recvs: Vec<WorkRequest>,
    ) -> Result<(), TransportError>;

    /// Rejects a request (the peer sees a refusal).
    fn reject(&mut self, request: RequestId);

    /// Posts a work request on an endpoint. A refused request comes back whole in the error (its leases with
    /// it), which makes the error as large as a request: posting is the hot path, so it is not boxed.
    #[allow(clippy::result_large_err)]
    fn post(&mut self, ep: EndpointId, wr: WorkRequest) -> Result<(), PostError>;

    /// Posts a batch of work requests on an endpoint, in order, draining `wrs`. A transport that can ring the
    /// doorbell once per batch, or signal only the last request of a batch, overrides this. On error, the
    /// requests not posted are dropped (they never reached the hardware) and the error is returned.
    fn post_many(
        &mut self,
        ep: EndpointId,
        wrs: &mut Vec<WorkRequest>,
    ) -> Result<(), TransportError> {
        let mut result = Ok(());
        for wr in wrs.drain(..) {
            if result.is_ok() {
                if let Err(e) = self.post(ep, wr) {
                    result = Err(e.error);
                }
            }
        }
        result
    }

    /// Creates the shared receive queue (seed 003) with room for `depth` buffers. Every endpoint created after
    /// this call takes its receives from it: `connect` and `accept` then get no receives of their own, and a
    /// completion of a shared receive names the endpoint that dequeued it, or `EndpointId(0)` when that endpoint
    /// is already gone. Receives an endpoint dequeued but had not completed when it went down complete flushed.
    fn create_shared_recv(&mut self, depth: u32) -> Result<(), TransportError> {
        let _ = depth;
        Err(TransportError::Unsupported(format!(
            "{} has no shared receive queue",
            self.capabilities().name
        )))
    }

    /// Posts receives (each an [`Op::Recv`]) on the shared receive queue, draining `wrs`.
    fn post_shared_recv(&mut self, wrs: &mut Vec<WorkRequest>) -> Result<(), TransportError> {
        wrs.clear();
        Err(TransportError::Unsupported(format!(
            "{} has no shared receive queue",
            self.capabilities().name
        )))
    }

    /// Starts tearing the connection down. Outstanding work requests complete (flushed if need be) and a
    /// `Disconnected` event follows.
    fn disconnect(&mut self, ep: EndpointId);

    /// Frees the endpoint after `Disconnected`. Every work request still held is dropped only once the hardware
    /// can no longer touch its memory.
    fn release(&mut self, ep: EndpointId);

    /// Moves up to `max` completions into `out`; returns how many.
    fn poll(&mut self, out: &mut Vec<Completion>, max: usize) -> usize;

    /// Takes the next connection-management event, if any.
    fn poll_cm(&mut self) -> Option<CmEvent>;

    /// Arms notification before sleeping on [`Transport::wait_fd`]. Returns `false` when events are already
    /// pending (poll again instead of sleeping): arming then polling once more is what keeps a notification
    /// from being lost between the last poll and the sleep.
    fn arm(&mut self) -> Result<bool, TransportError>;

    /// Whether an [`arm`](Transport::arm) that returns `true` also says that no connection-management event is
    /// waiting (libfabric's `fi_trywait` looks at the event queue too). The engine then stops looking for
    /// connection events in rounds that find no completions, from such an arm until one returns `false` (or a
    /// few rounds have passed): on software providers each look is a system call. `false` (the default): arming
    /// says nothing about them, and every round that finds no completions looks.
    fn arm_covers_cm(&self) -> bool {
        false
    }

    /// A file descriptor that becomes readable after `arm` when there is something to poll, as an owned
    /// duplicate (the context keeps it for its progress thread). `None` for transports that are driven by stepping
    /// (the simulated fabric in manual mode).
    fn wait_fd(&self) -> Option<OwnedFd>;

    /// How long a thread may sleep on [`Transport::wait_fd`] before it polls again. `None` (the default): every
    /// completion makes the descriptor readable once armed. `Some`: completions signal nothing (libfabric
    /// completion queues opened without a wait object, for applications that busy-poll), so a sleeper wakes this
    /// often to poll; events that signal the descriptor (a connection event queued by the provider) still wake it
    /// at once. Asked before every sleep: it may change as the transport's state does.
    fn poll_interval(&self) -> Option<Duration> {
        None
    }

    /// Local address of a connected endpoint.
    fn local_addr(&self, ep: EndpointId) -> Option<SocketAddr>;

    /// Peer address of a connected endpoint.
    fn peer_addr(&self, ep: EndpointId) -> Option<SocketAddr>;
}

/// Connection requests a backend handed to the engine ([`CmEvent::ConnectRequest`]) and that are not yet accepted
/// or rejected, each with the listener that received it and the backend's handle of it (a libfabric `fi_info`, an
/// rdma_cm id).
///
/// A backend answers every request exactly once, by [`Transport::accept`] or [`Transport::reject`]; requests still
/// waiting when their listener closes must be refused before it closes ([`PendingRequests::take_listener`] hands
/// them back for that), or their connections leak.
#[derive(Debug)]
pub struct PendingRequests<T> {
    requests: HashMap<RequestId, (ListenerId, T)>,
    next: u64,
}

impl<T> Default for PendingRequests<T> {
    fn default() -> Self {
        PendingRequests {
            requests: HashMap::new(),
            next: 1,
        }
    }
}

impl<T> PendingRequests<T> {
    /// Records a request `listener` received; returns its identifier (1, 2, 3...: never reused).
    pub fn insert(&mut self, listener: ListenerId, handle: T) -> RequestId {
        let request = RequestId(self.next);
        self.next += 1;
        self.requests.insert(request, (listener, handle));
        request
    }

    /// Takes a request out, to accept or reject it; `None` if it is unknown or already answered.
    pub fn take(&mut self, request: RequestId) -> Option<(ListenerId, T)> {
        self.requests.remove(&request)
    }

    /// Takes out every request of `listener` (in no particular order), to refuse them before the listener closes.
    pub fn take_listener(&mut self, listener: ListenerId) -> Vec<T> {
        let stale: Vec<RequestId> = self
            .requests
            .iter()
            .filter(|(_, (l, _))| *l == listener)
            .map(|(r, _)| *r)
            .collect();
        stale
            .into_iter()
            .filter_map(|r| self.requests.remove(&r).map(|(_, handle)| handle))
            .collect()
    }

    /// Takes out every request (in no particular order), each with its listener.
    pub fn take_all(&mut self) -> Vec<(ListenerId, T)> {
        self.requests.drain().map(|(_, v)| v).collect()
    }
}

impl WorkRequest {
    /// The completion of this request when it never reaches the hardware because its endpoint is down (posting on
    /// a dead connection completes with a flush, as hardware does): its kind, no bytes, [`WcError::Flushed`].
    pub fn flushed(&self, ep: EndpointId) -> Completion {
        let op = match self.op {
            Op::Send { .. } => Completed::Send,
            Op::Write { .. } => Completed::Write,
            Op::Read { .. } => Completed::Read,
            Op::Recv { .. } => Completed::Recv { len: 0, imm: None },
        };
        Completion {
            ep,
            wr_id: self.wr_id,
            op,
            status: Err(WcError::Flushed),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pending_requests_number_once_and_hand_back_a_closing_listeners_requests() {
        let (a, b) = (ListenerId(1), ListenerId(2));
        let mut p = PendingRequests::default();
        let r1 = p.insert(a, "a1");
        let r2 = p.insert(b, "b1");
        let r3 = p.insert(a, "a2");
        assert_eq!((r1, r2, r3), (RequestId(1), RequestId(2), RequestId(3)));
        // An answered request is gone; its identifier is not given again.
        assert_eq!(p.take(r2), Some((b, "b1")));
        assert_eq!(p.take(r2), None);
        assert_eq!(p.insert(b, "b2"), RequestId(4));
        let mut stale = p.take_listener(a);
        stale.sort_unstable();
        assert_eq!(stale, ["a1", "a2"]);
        assert_eq!(p.take(r1), None);
        assert!(p.take_listener(a).is_empty());
        assert_eq!(p.take_all(), [(b, "b2")]);
        assert!(p.take_all().is_empty());
    }

    #[test]
    fn a_flushed_request_completes_as_its_kind_with_no_bytes() {
        let wr = WorkRequest {
            wr_id: 7,
            op: Op::Send {
                sges: Vec::new(),
                imm: Some(3),
            },
        };
        assert_eq!(
            wr.flushed(EndpointId(2)),
            Completion {
                ep: EndpointId(2),
                wr_id: 7,
                op: Completed::Send,
                status: Err(WcError::Flushed),
            }
        );
    }
}

//! exs over libfabric MSG endpoints.
//!
//! The tcp provider is the default (it works without kernel RDMA); `verbs`, `net` and `sockets` are chosen by name.
//! Only this crate touches libfabric, through our own FFI: bindgen over the system headers (>= 1.17) and a C shim
//! for the calls that are `static inline` in the headers (see `shim/`).
//!
//! ## Mapping (see `exs::transport` for the trait)
//! * One fabric, domain and event queue per transport; **one completion queue per endpoint**. A
//!   write-with-immediate that lands without consuming a posted receive (tcp has no `FI_RX_CQ_DATA`) produces a
//!   completion with no context, and a MSG endpoint's completion entry does not name the endpoint: only a
//!   per-endpoint queue tells which connection it belongs to. (Putting a connection token in the immediate would
//!   let a hostile peer forge one.)
//! * Polling and waiting (see `src/ready.rs`): our own epoll set over the event queue's and every completion queue's
//!   wait descriptors is the transport's wait descriptor. A poll reads only the queues that were busy recently or
//!   that the set reports as signalled, never every connection's; arming (`fi_trywait`) covers the event queue and
//!   the queues not armed since their last activity.
//! * Memory: `fi_mr_reg` honouring the provider's `mr_mode` (virtual addresses or offsets, provider or requested
//!   keys, local descriptors). A remote key is a registration of exactly the exposed range, closed when the
//!   exposure is dropped (least exposure).
//! * Work requests: each posted operation is a boxed record whose address is the operation context (which also
//!   satisfies `FI_CONTEXT`/`FI_CONTEXT2`). The record owns the work request, so its leases live until the
//!   completion is read, or until `fi_close` of the endpoint guarantees the provider no longer touches them.

mod call;
mod cm;
mod completion;
mod connection;
mod device;
pub mod ffi;
mod memory;
mod post;
mod ready;
mod record;
mod sockaddr;
mod wait;

pub use ready::ReadyStats;

use std::collections::VecDeque;
use std::ffi::CStr;
use std::net::SocketAddr;
use std::os::fd::{AsFd, OwnedFd};
use std::ptr;
use std::sync::Arc;

use exs_dma::{DmaBuf, Lease};
use exs_transport::{
    Capabilities, CmEvent, Completion, EndpointId, Exposure, ListenerId, PendingRequests,
    PostError, Registrar, Registration, RemoteAccess, RequestId, Transport, TransportError,
    WorkRequest,
};
use nix::sys::epoll::Epoll;
use rustc_hash::FxHashMap;

use call::Info;
use connection::Ep;
use ffi::*;
use memory::Domain;

/// Which provider and domain to open.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FabricConfig {
    /// Provider name: `tcp` (default), `verbs`, `net`, `sockets`.
    pub provider: String,
    /// Domain (interface or device) name; `None` takes the provider's first.
    pub domain: Option<String>,
    /// How a thread sleeps until a completion queue has something ([`CqWait`]; `EXS_FABRIC_CQ_WAIT`).
    pub cq_wait: CqWait,
}

/// The wait object a connection's completion queue is opened with: what lets a thread sleep until a completion
/// comes, and what the provider does on every message because of it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum CqWait {
    /// `FI_WAIT_POLLFD` (the default; `EXS_FABRIC_CQ_WAIT=pollfd`): the provider keeps the queue's descriptors
    /// (its signal and its connection's socket) in a list and drives its sockets with `poll`, as without a wait
    /// object; the transport puts those descriptors themselves in its epoll set, brought up to date each time the
    /// queue is armed ([`fi_trywait`](https://ofiwg.github.io/libfabric/main/man/fi_poll.3.html)). A busy 8-byte
    /// ping-pong runs nearly as fast as without a wait object (the bench README), and a thread can still sleep.
    /// A provider that refuses it gets [`CqWait::Fd`], as does any provider but libfabric 1.17's tcp: the
    /// transport relies on what that provider does with the list, which the API leaves open.
    #[default]
    PollFd,
    /// `FI_WAIT_FD` (`EXS_FABRIC_CQ_WAIT=fd`): the queue's wait object is an epoll set of the provider's, nested in
    /// the transport's. On the tcp provider every completion read then consults that set (`epoll_wait`), and a
    /// busy ping-pong is slower than with [`CqWait::PollFd`] (the bench README measures both).
    Fd,
    /// No wait object (`EXS_FABRIC_CQ_WAIT=none`), as `fi_pingpong`'s busy-polling mode opens its queues: a queue
    /// is in no epoll set. For applications that busy-poll: a thread that sleeps on such a context (a blocking or
    /// adaptive dequeue, the progress thread) cannot be woken by a completion and, while the context holds
    /// endpoints, polls every [`NO_WAIT_POLL`] instead; every connection's queue is read in every poll.
    None,
}

/// [`FabricConfig::cq_wait`] from its setting's text (`EXS_FABRIC_CQ_WAIT`): `pollfd` (the default), `fd` or
/// `none`, in any case and with spaces around; `None` for anything else.
pub fn parse_cq_wait(value: &str) -> Option<CqWait> {
    match value.trim().to_ascii_lowercase().as_str() {
        "pollfd" => Some(CqWait::PollFd),
        "fd" => Some(CqWait::Fd),
        "none" => Some(CqWait::None),
        _ => None,
    }
}

/// How often a thread sleeping on a context whose completion queues have no wait object polls them (see
/// [`CqWait::None`]).
pub const NO_WAIT_POLL: std::time::Duration = std::time::Duration::from_millis(1);

impl Default for FabricConfig {
    fn default() -> Self {
        FabricConfig {
            provider: "tcp".into(),
            domain: None,
            cq_wait: CqWait::default(),
        }
    }
}

impl FabricConfig {
    /// A configuration for a provider by name.
    pub fn provider(name: &str) -> Self {
        FabricConfig {
            provider: name.into(),
            domain: None,
            cq_wait: CqWait::default(),
        }
    }
}

/// Provider names this machine's libfabric offers for MSG endpoints with RMA (none where libfabric cannot be loaded).
pub fn providers() -> Vec<String> {
    let mut names = Vec::new();
    if call::loaded().is_err() {
        return names;
    }
    let _tables = call::getinfo_lock();
    // SAFETY: a zeroed hints structure asking for MSG endpoints; the result list is walked read-only and freed.
    unsafe {
        let h = exs_fi_allocinfo();
        if h.is_null() {
            return names;
        }
        (*(*h).ep_attr).type_ = fi_ep_type_FI_EP_MSG;
        (*h).caps = (FI_MSG | FI_RMA) as u64;
        let mut out = ptr::null_mut();
        if exs_fi_getinfo(API_VERSION, ptr::null(), ptr::null(), 0, h, &mut out) == 0 {
            let mut cur = out;
            while !cur.is_null() {
                let name = CStr::from_ptr((*(*cur).fabric_attr).prov_name)
                    .to_string_lossy()
                    .into_owned();
                if !names.contains(&name) {
                    names.push(name);
                }
                cur = (*cur).next;
            }
            exs_fi_freeinfo(out);
        }
        exs_fi_freeinfo(h);
    }
    names
}

/// One libfabric fabric as an exs [`Transport`]: the context's domain, and (see `src/memory.rs`) a domain per
/// connection where the provider allows it.
pub struct FabricTransport {
    dom: Arc<Domain>,
    /// Each connection has a domain of its own (keys bound to one connection): the provider needs no local
    /// descriptors.
    per_conn: bool,
    /// The domains of connections, by endpoint (made at the first exposure or at connect/accept).
    conn_domains: FxHashMap<EndpointId, Arc<Domain>>,
    provider: String,
    domain_name: String,
    eq: *mut fid_eq,
    epoll: Epoll,
    /// Which endpoint entered each queue descriptor in `epoll` (see [`wait`]): a descriptor number the provider
    /// closed and gave to another queue is that queue's, and the first one's updates leave it alone.
    fd_owners: FxHashMap<std::os::fd::RawFd, EndpointId>,
    caps: Capabilities,
    eps: FxHashMap<EndpointId, Ep>,
    /// The open endpoints by the address of their fid: an event-queue entry's fid is looked up here, never read
    /// through (it may name an object closed since).
    ep_fids: FxHashMap<usize, EndpointId>,
    listeners: FxHashMap<ListenerId, *mut fid_pep>,
    /// Connection requests handed to the engine and not yet accepted or rejected.
    requests: PendingRequests<Info>,
    next_listener: u32,
    cm_backlog: VecDeque<CmEvent>,
    cq_backlog: VecDeque<Completion>,
    /// Record allocations kept for the next posts.
    records: record::Records,
    /// Which completion queues polls read (see [`ready`]).
    ready: ready::Ready,
    /// The wait object completion queues are opened with ([`FabricConfig::cq_wait`]).
    cq_wait: CqWait,
}

// SAFETY: all libfabric objects were opened on a FI_THREAD_SAFE domain and are owned by this value; the engine
// calls it from one thread at a time.
unsafe impl Send for FabricTransport {}

impl std::fmt::Debug for FabricTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FabricTransport")
            .field("provider", &self.provider)
            .field("domain", &self.domain_name)
            .finish()
    }
}

impl Transport for FabricTransport {
    fn capabilities(&self) -> &Capabilities {
        &self.caps
    }

    fn register(&mut self, buf: &Arc<DmaBuf>) -> Result<Arc<dyn Registration>, TransportError> {
        self.registrar().register(buf)
    }

    fn registrar(&self) -> Option<Arc<dyn Registrar>> {
        Some(Arc::new(self.registrar()))
    }

    fn expose(
        &mut self,
        ep: EndpointId,
        reg: &Arc<dyn Registration>,
        lease: Lease,
        access: RemoteAccess,
    ) -> Result<Box<dyn Exposure>, TransportError> {
        self.expose_lease(ep, reg, lease, access)
    }

    fn listen(
        &mut self,
        addr: SocketAddr,
        backlog: u32,
    ) -> Result<(ListenerId, SocketAddr), TransportError> {
        self.start_listening(addr, backlog)
    }

    fn close_listener(&mut self, listener: ListenerId) {
        self.stop_listening(listener)
    }

    fn connect(
        &mut self,
        ep: EndpointId,
        addr: SocketAddr,
        private: &[u8],
        recvs: Vec<WorkRequest>,
    ) -> Result<(), TransportError> {
        self.start_connect(ep, addr, private, recvs)
    }

    fn accept(
        &mut self,
        request: RequestId,
        ep: EndpointId,
        private: &[u8],
        recvs: Vec<WorkRequest>,
    ) -> Result<(), TransportError> {
        self.accept_request(request, ep, private, recvs)
    }

    fn reject(&mut self, request: RequestId) {
        if let Some((listener, info)) = self.requests.take(request) {
            self.reject_info(listener, info);
        }
    }

    fn post(&mut self, ep: EndpointId, wr: WorkRequest) -> Result<(), PostError> {
        self.post_one(ep, wr)
    }

    fn disconnect(&mut self, ep: EndpointId) {
        self.start_disconnect(ep)
    }

    fn release(&mut self, ep: EndpointId) {
        self.release_ep(ep)
    }

    fn poll(&mut self, out: &mut Vec<Completion>, max: usize) -> usize {
        self.poll_cqs(out, max)
    }

    fn poll_cm(&mut self) -> Option<CmEvent> {
        self.next_cm_event()
    }

    fn arm(&mut self) -> Result<bool, TransportError> {
        self.arm_wait()
    }

    fn arm_covers_cm(&self) -> bool {
        // `arm_wait` passes the event queue to fi_trywait and fails while the backlog holds an event.
        true
    }

    fn wait_fd(&self) -> Option<OwnedFd> {
        self.epoll.0.as_fd().try_clone_to_owned().ok()
    }

    fn poll_interval(&self) -> Option<std::time::Duration> {
        // With no endpoint there is no queue to poll: a context that holds no connection sleeps until its event
        // queue signals, as with wait objects.
        (self.cq_wait == CqWait::None && !self.eps.is_empty()).then_some(NO_WAIT_POLL)
    }

    fn local_addr(&self, ep: EndpointId) -> Option<SocketAddr> {
        self.eps.get(&ep).and_then(|e| e.local)
    }

    fn peer_addr(&self, ep: EndpointId) -> Option<SocketAddr> {
        self.eps.get(&ep).and_then(|e| e.peer)
    }
}

impl Drop for FabricTransport {
    fn drop(&mut self) {
        let ids: Vec<EndpointId> = self.eps.keys().copied().collect();
        for id in ids {
            self.release(id);
        }
        let listeners: Vec<ListenerId> = self.listeners.keys().copied().collect();
        for l in listeners {
            self.close_listener(l);
        }
        drop(self.requests.take_all());
        // SAFETY: nothing is bound to the event queue any more.
        unsafe { exs_fi_close(&mut (*self.eq).fid) };
    }
}

#[cfg(test)]
mod tests;

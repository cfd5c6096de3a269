//! exs over rdma-core: verbs for the data path, rdma_cm for connections (through `rdma-sys`).
//!
//! Works on any RDMA device rdma-core drives: InfiniBand and RoCE adapters (Mellanox), iWARP adapters (Chelsio),
//! Soft-RoCE (rxe) and soft-iWARP (siw). The device is the one rdma_cm resolves for the configured local address.
//!
//! ## Mapping
//! * One protection domain, one completion channel and one completion queue per transport; a reliable-connected
//!   queue pair per connection, created and connected through rdma_cm (address and route resolution, then
//!   `rdma_connect` with our handshake as private data; `rdma_accept` on the passive side).
//! * Waiting: an epoll set over the completion channel and the rdma_cm event channel. Arming is
//!   `ibv_req_notify_cq` followed by one more poll, so a completion that slipped in between is not slept through.
//! * Posting: a batch of requests is chained into one `ibv_post_send` (one doorbell). Only every
//!   [`SIGNAL_EVERY`]-th request and the last of each batch is signalled; a signalled completion also completes the
//!   unsignalled requests before it (a reliable connection completes in order), so the send queue never holds
//!   more than its depth and every request gets its completion. A chain the device refuses part-way leaves the
//!   requests before the refused one on the device: their records (and leases) stay until they complete, and
//!   only the requests that never reached it come back.
//! * Identifiers: every request the device carries has an identifier no other request of the transport ever
//!   had (see [`queue`]), so a late completion of a destroyed queue pair whose number went to a new one cannot
//!   complete the new one's requests.
//! * Memory: the base registration grants local access only (plus remote write on iWARP, where the sink of an
//!   RDMA read must allow it); a remote key is a registration of exactly the exposed range, deregistered when the
//!   exposure is dropped (least exposure).
//! * Write-with-immediate: native where the device has it; otherwise (siw, some iWARP adapters, or forced by
//!   configuration) an RDMA write followed by an inline send of 8 bytes, a magic and the immediate, which the
//!   receiving side turns back into an immediate. Both sides' protocol code sees the same thing.
//!
//! All `unsafe` of the verbs side is here, each block with its invariant.

use std::collections::{HashMap, VecDeque};
use std::ffi::{c_void, CStr};
use std::net::{IpAddr, SocketAddr};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd, RawFd};
use std::ptr;
use std::sync::Arc;

use exs_transport::{
    Capabilities, CmEvent, Completed, Completion, ConnectFailure, EndpointId, Exposure, ListenerId,
    Op, PostError, Registration, RemoteAccess, RemoteRef, RequestId, Sge, Transport,
    TransportError, WcError, WorkRequest,
};
use exs_dma::{DmaBuf, Lease};
use nix::fcntl::{fcntl, FcntlArg, OFlag};
use nix::sys::epoll::{Epoll, EpollCreateFlags, EpollEvent, EpollFlags};
use nix::sys::socket::{SockaddrLike, SockaddrStorage};
use rdma_sys::*;

mod memory;
mod queue;
use exs_transport::KeyedLease;
use memory::{reg_mr, MrKey, MrPtr, MwSlot, Pd, VerbsRegistration, WindowKey};
pub use queue::SIGNAL_EVERY;
use queue::{Posted, SendQueue, Signaler, WrIds};

/// Magic of an emulated write-with-immediate ("EXSI", little-endian), followed by the immediate.
const IMM_MAGIC: u32 = u32::from_le_bytes(*b"EXSI");
const TAG_EP: usize = 1 << 40;
const TAG_LISTENER: usize = 2 << 40;
const RESOLVE_TIMEOUT_MS: i32 = 2000;
const SQ_DEPTH: u32 = 512;
const RQ_DEPTH: u32 = 1024;
const CQ_DEPTH: i32 = 8192;
/// Most buffers the shared receive queue holds.
const SRQ_DEPTH: u32 = 16384;

/// Where and how to open a device.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VerbsConfig {
    /// Local IP address; rdma_cm resolves the device that carries it.
    pub addr: IpAddr,
    /// Expected device name (checked), if any.
    pub device: Option<String>,
    /// Emulate write-with-immediate even if the device has it (tests the fallback used on siw and iWARP).
    pub emulate_write_imm: bool,
    /// Expose memory through type 2 memory windows bound to one queue pair: `None` (default) where the device
    /// has them, `Some(false)` never (a registration per exposure, its key valid on every queue pair of the
    /// protection domain), `Some(true)` required.
    pub memory_windows: Option<bool>,
}

impl VerbsConfig {
    /// A configuration for the device carrying `addr`.
    pub fn new(addr: IpAddr) -> Self {
        VerbsConfig {
            addr,
            device: None,
            emulate_write_imm: false,
            memory_windows: None,
        }
    }
}

/// Issue 15 (fork safety): asks libibverbs to keep registered memory out of children (`MADV_DONTFORK` on every
/// registration, including buffers the dma crate did not allocate itself), once per process, before the first
/// registration. Kernels that keep pinned pages with the parent across fork need nothing
/// (`IBV_FORK_UNNEEDED`); where verbs were already used in this process (say by a libfabric provider) it cannot be
/// turned on any more, which is logged: the dma crate's own `MADV_DONTFORK` still covers the buffers it allocates.
fn fork_safe() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        // SAFETY: no preconditions; it only reads the kernel's fork support and sets libibverbs' own flag.
        if unsafe { ibv_is_fork_initialized() } == IBV_FORK_UNNEEDED {
            return;
        }
        // SAFETY: called before this process registers memory through this backend (first `open`).
        let r = unsafe { ibv_fork_init() };
        if r != 0 {
            tracing::warn!(
                errno = r,
                "ibv_fork_init failed: registrations made outside exs buffers are not fork-safe"
            );
        }
    });
}

fn os_err(call: &str) -> TransportError {
    TransportError::os(call, std::io::Error::last_os_error())
}

fn sockaddr(a: SocketAddr) -> SockaddrStorage {
    SockaddrStorage::from(a)
}

fn to_socketaddr(p: *const libc::sockaddr) -> Option<SocketAddr> {
    if p.is_null() {
        return None;
    }
    // SAFETY: rdma_cm returns a pointer to a sockaddr inside the cm id, valid while the id lives; from_raw reads
    // it according to its family.
    let s = unsafe { SockaddrStorage::from_raw(p, None) }?;
    if let Some(v4) = s.as_sockaddr_in() {
        return Some(SocketAddr::from((v4.ip(), v4.port())));
    }
    s.as_sockaddr_in6()
        .map(|v6| SocketAddr::from((v6.ip(), v6.port())))
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum EpState {
    Resolving,
    Connecting,
    Connected,
    Down,
}

/// One native send request of a work request (an emulated write-with-immediate makes two): opcode, gather list,
/// remote range, immediate.
type NativePart = (u32, Vec<ibv_sge>, Option<RemoteRef>, Option<u32>);

/// A send-queue request: kept until its completion (or a later signalled one) arrives, its operation (and the
/// leases in it) with it. `kind` is `None` for the backend's own requests (window binds), which the engine never
/// hears of.
struct SendRec {
    wr_id: u64,
    kind: Option<Completed>,
    op: Option<Op>,
}

/// Requests a post did not get onto the device, whole and in order, and why.
struct Refused {
    error: TransportError,
    wrs: Vec<WorkRequest>,
}

impl Refused {
    fn new(error: TransportError, wrs: Vec<WorkRequest>) -> Self {
        Refused { error, wrs }
    }
}

struct RecvRec {
    wr_id: u64,
    sge: Sge,
}

struct Ep {
    id: *mut rdma_cm_id,
    qp: *mut ibv_qp,
    state: EpState,
    reported_down: bool,
    /// Active side: what to do once the route is resolved.
    pending: Option<(Vec<u8>, Vec<WorkRequest>)>,
    sends: SendQueue<SendRec>,
    signal: Signaler,
    /// Native entries the send queue holds (as created: at least what was asked for).
    sq_cap: u32,
    /// Windows bound to this queue pair: deallocated before it is destroyed (see [`MwSlot`]).
    windows: Vec<std::sync::Weak<MwSlot>>,
    max_inline: u32,
    local: Option<SocketAddr>,
    peer: Option<SocketAddr>,
}

/// One rdma-core device as an exs [`Transport`].
pub struct VerbsTransport {
    cfg: VerbsConfig,
    ch: *mut rdma_event_channel,
    ctx: *mut ibv_context,
    pd: Arc<Pd>,
    comp: *mut ibv_comp_channel,
    cq: *mut ibv_cq,
    epoll: Epoll,
    caps: Capabilities,
    iwarp: bool,
    emulate: bool,
    /// Exposures are type 2 memory windows bound to the connection's queue pair (see [`memory`]).
    windows: bool,
    /// Native send-queue entries one request of the engine may take: itself, the send of an emulated
    /// write-with-immediate, the bind of a window it exposes.
    sq_share: u32,
    rd_atom: u8,
    eps: HashMap<EndpointId, Ep>,
    qpn: HashMap<u32, EndpointId>,
    /// Posted receives: the endpoint they were posted on, or `None` for the shared receive queue.
    recvs: HashMap<u64, (Option<EndpointId>, RecvRec)>,
    /// The shared receive queue (seed 003), once the engine asked for it; QPs created after use it.
    srq: *mut ibv_srq,
    /// Identifiers of work requests, never reused (see [`queue`]).
    ids: WrIds,
    listeners: HashMap<ListenerId, *mut rdma_cm_id>,
    /// Connection requests handed to the engine and not yet accepted or rejected, with their listener.
    requests: HashMap<RequestId, (ListenerId, *mut rdma_cm_id)>,
    next_listener: u32,
    next_request: u64,
    cm_backlog: VecDeque<CmEvent>,
    /// Completions ready for the engine; `true` marks a shared receive (kept when its endpoint is released, so
    /// the engine gets its buffer back).
    cq_backlog: VecDeque<(Completion, bool)>,
    unacked_cq_events: u32,
}

// SAFETY: the verbs and rdma_cm objects are owned by this value and used from one thread at a time (the engine
// holds its lock for every call).
unsafe impl Send for VerbsTransport {}

impl std::fmt::Debug for VerbsTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VerbsTransport")
            .field("device", &self.caps.name)
            .finish()
    }
}

fn set_nonblocking(fd: RawFd) -> Result<(), TransportError> {
    // `fd` is a descriptor owned by an open verbs/rdma_cm channel for the duration of the call.
    let flags = fcntl(fd, FcntlArg::F_GETFL).map_err(|e| TransportError::os("fcntl", e.into()))?;
    fcntl(
        fd,
        FcntlArg::F_SETFL(OFlag::from_bits_truncate(flags) | OFlag::O_NONBLOCK),
    )
    .map_err(|e| TransportError::os("fcntl", e.into()))?;
    Ok(())
}

fn epoll_add(epoll: &Epoll, fd: RawFd, data: u64) -> Result<(), TransportError> {
    // SAFETY: the descriptor belongs to a channel that stays open while it is in the set.
    let bfd = unsafe { BorrowedFd::borrow_raw(fd) };
    epoll
        .add(bfd, EpollEvent::new(EpollFlags::EPOLLIN, data))
        .map_err(|e| TransportError::os("epoll_ctl", e.into()))
}

/// RDMA devices this machine has, for error messages.
pub fn device_names() -> Vec<String> {
    let mut n = 0;
    // SAFETY: ibv_get_device_list returns a null-terminated array (or null) that we free once.
    unsafe {
        let list = ibv_get_device_list(&mut n);
        if list.is_null() {
            return Vec::new();
        }
        let mut names = Vec::new();
        for i in 0..n.max(0) as usize {
            let d = *list.add(i);
            if !d.is_null() {
                names.push(
                    CStr::from_ptr(ibv_get_device_name(d))
                        .to_string_lossy()
                        .into_owned(),
                );
            }
        }
        ibv_free_device_list(list);
        names
    }
}

fn wc_error(status: u32) -> WcError {
    match status {
        ibv_wc_status::IBV_WC_WR_FLUSH_ERR => WcError::Flushed,
        ibv_wc_status::IBV_WC_REM_ACCESS_ERR => WcError::RemoteAccess,
        ibv_wc_status::IBV_WC_RETRY_EXC_ERR => WcError::RetryExceeded,
        ibv_wc_status::IBV_WC_RNR_RETRY_EXC_ERR => WcError::RnrRetryExceeded,
        ibv_wc_status::IBV_WC_LOC_PROT_ERR => WcError::LocalProtection,
        ibv_wc_status::IBV_WC_LOC_LEN_ERR => WcError::LocalLength,
        other => {
            // SAFETY: ibv_wc_status_str returns a static string for any status.
            let s = unsafe { CStr::from_ptr(ibv_wc_status_str(other)) };
            WcError::Other(s.to_string_lossy().into_owned())
        }
    }
}

impl VerbsTransport {
    /// Opens the device carrying `cfg.addr`. With no RDMA at all, the error lists the devices that exist (none).
    pub fn open(cfg: &VerbsConfig) -> Result<VerbsTransport, TransportError> {
        fork_safe();
        let not_found = |why: String| TransportError::NotFound {
            wanted: format!("an RDMA device for {} ({why})", cfg.addr),
            available: device_names(),
        };
        // SAFETY: creating an event channel has no preconditions; null means failure (errno set).
        let ch = unsafe { rdma_create_event_channel() };
        if ch.is_null() {
            return Err(not_found(format!(
                "rdma_create_event_channel: {}",
                std::io::Error::last_os_error()
            )));
        }
        let mut probe = ptr::null_mut();
        // SAFETY: valid channel; `probe` receives a new id.
        if unsafe {
            rdma_create_id(
                ch,
                &mut probe,
                ptr::null_mut(),
                rdma_port_space::RDMA_PS_TCP,
            )
        } != 0
        {
            let e = std::io::Error::last_os_error();
            // SAFETY: the channel is ours and unused.
            unsafe { rdma_destroy_event_channel(ch) };
            return Err(not_found(format!("rdma_create_id: {e}")));
        }
        let sa = sockaddr(SocketAddr::new(cfg.addr, 0));
        // SAFETY: valid id; the sockaddr lives across the call.
        let bound = unsafe { rdma_bind_addr(probe, sa.as_ptr() as *mut _) };
        // SAFETY: `probe` is valid; rdma_bind_addr sets its verbs context on success.
        let ctx = unsafe { (*probe).verbs };
        // SAFETY: the probe id is ours; destroying it leaves the device context (owned by librdmacm) open.
        unsafe { rdma_destroy_id(probe) };
        if bound != 0 || ctx.is_null() {
            let e = std::io::Error::last_os_error();
            // SAFETY: the channel is ours and no id uses it any more.
            unsafe { rdma_destroy_event_channel(ch) };
            return Err(not_found(format!(
                "no RDMA device carries this address: {e}"
            )));
        }
        // SAFETY: `ctx` is an open device context; its device pointer and name are valid while it is open.
        let (name, transport_type) = unsafe {
            let dev = (*ctx).device;
            (
                CStr::from_ptr(ibv_get_device_name(dev))
                    .to_string_lossy()
                    .into_owned(),
                (*dev).transport_type,
            )
        };
        if let Some(want) = &cfg.device {
            if *want != name {
                // SAFETY: as above.
                unsafe { rdma_destroy_event_channel(ch) };
                return Err(not_found(format!(
                    "{} is on device {name}, not {want}",
                    cfg.addr
                )));
            }
        }
        let iwarp = transport_type == ibv_transport_type::IBV_TRANSPORT_IWARP;
        let mut attr: ibv_device_attr = unsafe {
            // SAFETY: ibv_device_attr is plain data; zero is a valid bit pattern before the query fills it.
            std::mem::zeroed()
        };
        // SAFETY: open context; `attr` is a valid out-buffer.
        if unsafe { ibv_query_device(ctx, &mut attr) } != 0 {
            // SAFETY: as above.
            unsafe { rdma_destroy_event_channel(ch) };
            return Err(os_err("ibv_query_device"));
        }
        let has_windows = attr.device_cap_flags
            & ibv_device_cap_flags::IBV_DEVICE_MEM_WINDOW_TYPE_2B.0
            != 0
            && !iwarp;
        let windows = match cfg.memory_windows {
            None => has_windows,
            Some(false) => false,
            Some(true) if has_windows => true,
            Some(true) => {
                // SAFETY: as above.
                unsafe { rdma_destroy_event_channel(ch) };
                return Err(TransportError::Unsupported(format!(
                    "{name} has no type 2 memory windows"
                )));
            }
        };
        // SAFETY: open context.
        let pd = unsafe { ibv_alloc_pd(ctx) };
        if pd.is_null() {
            // SAFETY: as above.
            unsafe { rdma_destroy_event_channel(ch) };
            return Err(os_err("ibv_alloc_pd"));
        }
        let pd = Arc::new(Pd(pd));
        // SAFETY: open context.
        let comp = unsafe { ibv_create_comp_channel(ctx) };
        if comp.is_null() {
            // SAFETY: as above.
            unsafe { rdma_destroy_event_channel(ch) };
            return Err(os_err("ibv_create_comp_channel"));
        }
        let cqe = CQ_DEPTH.min(attr.max_cqe);
        // SAFETY: open context and completion channel.
        let cq = unsafe { ibv_create_cq(ctx, cqe, ptr::null_mut(), comp, 0) };
        if cq.is_null() {
            // SAFETY: the channels are ours and unused.
            unsafe {
                ibv_destroy_comp_channel(comp);
                rdma_destroy_event_channel(ch);
            }
            return Err(os_err("ibv_create_cq"));
        }
        // SAFETY: valid channel pointers; their fds stay open until we destroy the channels.
        let (comp_fd, ch_fd) = unsafe { ((*comp).fd, (*ch).fd) };
        set_nonblocking(comp_fd)?;
        set_nonblocking(ch_fd)?;
        let epoll = Epoll::new(EpollCreateFlags::EPOLL_CLOEXEC)
            .map_err(|e| TransportError::os("epoll_create", e.into()))?;
        epoll_add(&epoll, comp_fd, 1)?;
        epoll_add(&epoll, ch_fd, 2)?;
        let emulate = cfg.emulate_write_imm || iwarp;
        let rd_atom = attr
            .max_qp_rd_atom
            .min(attr.max_qp_init_rd_atom)
            .clamp(1, 16) as u8;
        let sq = SQ_DEPTH.min(attr.max_qp_wr as u32);
        // An emulated write-with-immediate takes two send-queue entries, and each window bind one more.
        let sq_share = 1 + u32::from(emulate) + u32::from(windows);
        let caps = Capabilities {
            name: format!("verbs/{name}"),
            max_inline: 64,
            max_message: 1 << 30,
            native_write_imm: !emulate,
            imm_consumes_recv: true,
            max_send_wr: sq / sq_share,
            max_recv_wr: RQ_DEPTH.min(attr.max_qp_wr as u32),
            max_sge: (attr.max_sge as u32).clamp(1, 16),
            max_read_depth: u32::from(rd_atom),
            max_private_data: 56,
            max_shared_recv: if attr.max_srq > 0 {
                (attr.max_srq_wr.max(0) as u32).min(SRQ_DEPTH)
            } else {
                0
            },
            // Zero-copy reads win early on RDMA hardware; no hardware was at hand to measure the crossover, so this
            // is UNH-EXS's 512-byte default (the pool's slot size, seed 003, matches it).
            immediate_default: 512,
            keys_after_connect: windows,
        };
        let t = VerbsTransport {
            cfg: cfg.clone(),
            ch,
            ctx,
            pd,
            comp,
            cq,
            epoll,
            caps,
            iwarp,
            emulate,
            windows,
            sq_share,
            rd_atom,
            eps: HashMap::new(),
            qpn: HashMap::new(),
            recvs: HashMap::new(),
            srq: ptr::null_mut(),
            ids: WrIds::default(),
            listeners: HashMap::new(),
            requests: HashMap::new(),
            next_listener: 1,
            next_request: 1,
            cm_backlog: VecDeque::new(),
            cq_backlog: VecDeque::new(),
            unacked_cq_events: 0,
        };
        // SAFETY: `cq` was just created.
        unsafe { ibv_req_notify_cq(t.cq, 0) };
        tracing::debug!(device = %name, iwarp, emulate, "verbs device open");
        Ok(t)
    }

    fn new_ep(id: *mut rdma_cm_id) -> Ep {
        Ep {
            id,
            qp: ptr::null_mut(),
            state: EpState::Resolving,
            reported_down: false,
            pending: None,
            sends: SendQueue::default(),
            signal: Signaler::default(),
            sq_cap: 0,
            windows: Vec::new(),
            max_inline: 0,
            local: None,
            peer: None,
        }
    }

    /// Creates the queue pair of an endpoint (same device as ours) and posts its initial receives.
    fn create_qp(&mut self, ep: EndpointId, recvs: Vec<WorkRequest>) -> Result<(), TransportError> {
        let e = self.eps.get_mut(&ep).ok_or(TransportError::NoEndpoint)?;
        // SAFETY: live cm id; after address resolution its verbs context is set.
        if unsafe { (*e.id).verbs } != self.ctx {
            return Err(TransportError::Unsupported(
                "the peer is reached through another RDMA device".into(),
            ));
        }
        let mut attr: ibv_qp_init_attr = unsafe {
            // SAFETY: plain data, zero is valid before we fill it.
            std::mem::zeroed()
        };
        attr.send_cq = self.cq;
        attr.recv_cq = self.cq;
        attr.qp_type = ibv_qp_type::IBV_QPT_RC;
        attr.sq_sig_all = 0;
        // Room for every request the engine may have outstanding with its share of extra entries (the send of an
        // emulated write-with-immediate, a window bind): a full queue would refuse a chain part-way.
        attr.cap.max_send_wr = self.caps.max_send_wr * self.sq_share;
        if self.srq.is_null() {
            attr.cap.max_recv_wr = self.caps.max_recv_wr;
            attr.cap.max_recv_sge = 1;
        } else {
            // Receives come from the shared queue.
            attr.srq = self.srq;
        }
        attr.cap.max_send_sge = self.caps.max_sge;
        attr.cap.max_inline_data = 64;
        // SAFETY: live id with a resolved route (or a connection request), our PD, attr filled.
        if unsafe { rdma_create_qp(e.id, self.pd.0, &mut attr) } != 0 {
            return Err(os_err("rdma_create_qp"));
        }
        // SAFETY: rdma_create_qp set id->qp.
        let qp = unsafe { (*e.id).qp };
        e.qp = qp;
        e.max_inline = attr.cap.max_inline_data;
        // rdma_create_qp wrote back the depth the queue pair got (at least the one asked for).
        e.sq_cap = attr.cap.max_send_wr;
        // SAFETY: live QP.
        let num = unsafe { (*qp).qp_num };
        self.qpn.insert(num, ep);
        let mut batch = recvs;
        self.post_many(ep, &mut batch)
    }

    fn conn_param(private: &[u8], rd: u8) -> rdma_conn_param {
        rdma_conn_param {
            private_data: private.as_ptr() as *const c_void,
            private_data_len: private.len().min(255) as u8,
            responder_resources: rd,
            initiator_depth: rd,
            flow_control: 1,
            retry_count: 7,
            rnr_retry_count: 7,
            srq: 0,
            qp_num: 0,
        }
    }

    fn addresses(&mut self, ep: EndpointId) {
        if let Some(e) = self.eps.get_mut(&ep) {
            // SAFETY: live id; the returned pointers point into it.
            unsafe {
                e.local = to_socketaddr(rdma_get_local_addr(&*e.id) as *const _);
                e.peer = to_socketaddr(rdma_get_peer_addr(&*e.id) as *const _);
            }
        }
    }

    /// Refuses a connection request and destroys its id: the one way a request that is not accepted ends.
    fn reject_id(id: *mut rdma_cm_id) {
        // SAFETY: `id` is a live connection-request id that nothing else holds (it was just taken out of the
        // request table, or never entered it); after the reject nothing uses it, and it is destroyed once.
        unsafe {
            if rdma_reject(id, ptr::null(), 0) != 0 {
                tracing::debug!(
                    "rdma_reject: {} (destroying the request anyway)",
                    std::io::Error::last_os_error()
                );
            }
            rdma_destroy_id(id);
        }
    }

    fn report_down(&mut self, ep: EndpointId) -> Option<CmEvent> {
        let e = self.eps.get_mut(&ep)?;
        e.state = EpState::Down;
        if e.reported_down {
            return None;
        }
        e.reported_down = true;
        Some(CmEvent::Disconnected { ep })
    }

    fn connect_failed(&mut self, ep: EndpointId, reason: ConnectFailure) -> Option<CmEvent> {
        let e = self.eps.get_mut(&ep)?;
        e.state = EpState::Down;
        e.reported_down = true;
        Some(CmEvent::ConnectFailed { ep, reason })
    }

    /// Handles one rdma_cm event; returns what the engine should see.
    fn on_cm_event(&mut self, ev: *mut rdma_cm_event) -> Option<CmEvent> {
        // SAFETY: `ev` came from rdma_get_cm_event and is acknowledged by our caller after this returns.
        let (kind, id, listen_id, status, data) = unsafe {
            let e = &*ev;
            let conn = &e.param.conn;
            let data = if conn.private_data.is_null() || conn.private_data_len == 0 {
                Vec::new()
            } else {
                std::slice::from_raw_parts(
                    conn.private_data as *const u8,
                    conn.private_data_len as usize,
                )
                .to_vec()
            };
            (e.event, e.id, e.listen_id, e.status, data)
        };
        // SAFETY: ids in events are live (acknowledgment comes later); the context is what we set.
        let tag = unsafe { (*id).context as usize };
        let ep = EndpointId((tag & 0xffff_ffff) as u32);
        use rdma_cm_event_type::*;
        match kind {
            RDMA_CM_EVENT_CONNECT_REQUEST => {
                // SAFETY: the listener's id is live; its context is the listener tag.
                let ltag = unsafe { (*listen_id).context as usize };
                let listener = ListenerId((ltag & 0xffff_ffff) as u32);
                if ltag & TAG_LISTENER == 0 || !self.listeners.contains_key(&listener) {
                    // A request nobody will answer: the peer is refused and the id goes (a connection request
                    // counts as an event of its listener, so destroying the new id before the event is
                    // acknowledged does not wait for it).
                    Self::reject_id(id);
                    return None;
                }
                let request = RequestId(self.next_request);
                self.next_request += 1;
                self.requests.insert(request, (listener, id));
                // SAFETY: live id.
                let peer = to_socketaddr(unsafe { rdma_get_peer_addr(&*id) } as *const _)
                    .unwrap_or_else(|| SocketAddr::from(([0, 0, 0, 0], 0)));
                Some(CmEvent::ConnectRequest {
                    listener,
                    request,
                    peer,
                    private: data,
                })
            }
            _ if tag & TAG_EP == 0 => None,
            RDMA_CM_EVENT_ADDR_RESOLVED => {
                let e = self.eps.get(&ep)?;
                // SAFETY: live id with a resolved address.
                if unsafe { rdma_resolve_route(e.id, RESOLVE_TIMEOUT_MS) } != 0 {
                    return self.connect_failed(
                        ep,
                        ConnectFailure::Other(format!(
                            "rdma_resolve_route: {}",
                            std::io::Error::last_os_error()
                        )),
                    );
                }
                None
            }
            RDMA_CM_EVENT_ROUTE_RESOLVED => {
                let (private, recvs) = self.eps.get_mut(&ep)?.pending.take()?;
                if let Err(err) = self.create_qp(ep, recvs) {
                    return self.connect_failed(ep, ConnectFailure::Other(err.to_string()));
                }
                let e = self.eps.get_mut(&ep)?;
                e.state = EpState::Connecting;
                let mut param = Self::conn_param(&private, self.rd_atom);
                // SAFETY: live id with a QP; private data lives across the call (copied by rdma_connect).
                if unsafe { rdma_connect(e.id, &mut param) } != 0 {
                    return self.connect_failed(
                        ep,
                        ConnectFailure::Other(format!(
                            "rdma_connect: {}",
                            std::io::Error::last_os_error()
                        )),
                    );
                }
                None
            }
            RDMA_CM_EVENT_ADDR_ERROR | RDMA_CM_EVENT_ROUTE_ERROR => {
                self.connect_failed(ep, ConnectFailure::Unreachable)
            }
            RDMA_CM_EVENT_UNREACHABLE => self.connect_failed(ep, ConnectFailure::TimedOut),
            RDMA_CM_EVENT_REJECTED => {
                if self.eps.get(&ep)?.state == EpState::Connected {
                    return self.report_down(ep);
                }
                self.connect_failed(ep, ConnectFailure::Refused(data))
            }
            RDMA_CM_EVENT_CONNECT_ERROR => self.connect_failed(
                ep,
                ConnectFailure::Other(format!("connect error (status {status})")),
            ),
            RDMA_CM_EVENT_ESTABLISHED => {
                let e = self.eps.get_mut(&ep)?;
                if e.state == EpState::Down {
                    return None;
                }
                e.state = EpState::Connected;
                self.addresses(ep);
                Some(CmEvent::Established { ep, private: data })
            }
            RDMA_CM_EVENT_DISCONNECTED | RDMA_CM_EVENT_DEVICE_REMOVAL => self.report_down(ep),
            _ => None,
        }
    }

    /// Native send-queue requests a work request takes: two for an emulated write-with-immediate.
    fn parts_of(&self, wr: &WorkRequest) -> u32 {
        match wr.op {
            Op::Write { imm: Some(_), .. } if self.emulate => 2,
            _ => 1,
        }
    }

    /// Moves a queue pair to the error state: everything on it completes (flushed), signalled or not.
    fn break_qp(qp: *mut ibv_qp) {
        let mut attr: ibv_qp_attr = unsafe {
            // SAFETY: plain data, zero is valid before we fill it.
            std::mem::zeroed()
        };
        attr.qp_state = ibv_qp_state::IBV_QPS_ERR;
        // SAFETY: a live queue pair of ours; moving to the error state needs only the state attribute.
        let rc = unsafe { ibv_modify_qp(qp, &mut attr, ibv_qp_attr_mask::IBV_QP_STATE.0 as i32) };
        if rc != 0 {
            tracing::error!(rc, "ibv_modify_qp(IBV_QPS_ERR) failed");
        }
    }

    /// Posts a chain of send-queue requests (one doorbell). Signals the last one and every SIGNAL_EVERY-th.
    ///
    /// Requests that do not fit in the send queue, and requests the device refuses, come back whole; the ones
    /// before them are on the device and keep their records until they complete. A request the device took in
    /// part (the write of an emulated write-with-immediate without its send) is kept too: it cannot come back while
    /// the device may still read its memory, so its queue pair goes to error and it completes with an error.
    fn post_sends(&mut self, ep: EndpointId, mut wrs: Vec<WorkRequest>) -> Result<(), Refused> {
        let Some(e) = self.eps.get(&ep) else {
            return Err(Refused::new(TransportError::NoEndpoint, wrs));
        };
        if e.qp.is_null() {
            return Err(Refused::new(
                TransportError::Invalid("post before the queue pair exists".into()),
                wrs,
            ));
        }
        if wrs.iter().any(|w| matches!(w.op, Op::Recv { .. })) {
            return Err(Refused::new(
                TransportError::Invalid("a receive in the send chain".into()),
                wrs,
            ));
        }
        // The records bound what the device holds; completions waiting in the completion queue free entries.
        let need: u32 = wrs.iter().map(|w| self.parts_of(w)).sum();
        if e.sends.entries() + need > e.sq_cap {
            self.drain_cq();
        }
        let room = {
            let e = &self.eps[&ep];
            e.sq_cap.saturating_sub(e.sends.entries())
        };
        let mut fit = 0;
        let mut used = 0;
        for w in &wrs {
            let p = self.parts_of(w);
            if used + p > room {
                break;
            }
            used += p;
            fit += 1;
        }
        let mut rest = wrs.split_off(fit);
        let full = || TransportError::Resource("send queue full".into());
        if wrs.is_empty() {
            return Err(Refused::new(full(), rest));
        }
        let emulate = self.emulate;
        let ids = &mut self.ids;
        let e = self.eps.get_mut(&ep).expect("checked above");
        let n = wrs.len();
        // Native verbs structures for the whole chain; kept alive until ibv_post_send returns.
        let mut sges: Vec<Vec<ibv_sge>> = Vec::with_capacity(n * 2);
        let mut natives: Vec<ibv_send_wr> = Vec::with_capacity(n * 2);
        // The signalling state after each native request, to restore the one after the last posted.
        let mut signal_after: Vec<Signaler> = Vec::with_capacity(n * 2);
        let mut signal = e.signal;
        let mut recs = Vec::with_capacity(n);
        // At most one payload per request: with this capacity the vector never reallocates, so the addresses the
        // scatter entries take from it stay valid until ibv_post_send has copied the (inline) payloads.
        let mut imm_payloads: Vec<[u8; 8]> = Vec::with_capacity(n);
        for (i, wr) in wrs.into_iter().enumerate() {
            let last = i + 1 == n;
            let seq = ids.send();
            let sge_of = |s: &Sge| ibv_sge {
                addr: s.addr(),
                length: s.len() as u32,
                lkey: s.local_key() as u32,
            };
            let (kind, parts): (Completed, Vec<NativePart>) = match &wr.op {
                Op::Send { sges: s, imm } => {
                    let opc = if imm.is_some() {
                        ibv_wr_opcode::IBV_WR_SEND_WITH_IMM
                    } else {
                        ibv_wr_opcode::IBV_WR_SEND
                    };
                    (
                        Completed::Send,
                        vec![(opc, s.iter().map(sge_of).collect(), None, *imm)],
                    )
                }
                Op::Write {
                    local,
                    remote,
                    imm: Some(imm),
                } if emulate => {
                    // Emulated write-with-immediate: the write, then a send carrying the immediate.
                    let mut payload = [0u8; 8];
                    payload[..4].copy_from_slice(&IMM_MAGIC.to_le_bytes());
                    payload[4..].copy_from_slice(&imm.to_le_bytes());
                    debug_assert!(
                        imm_payloads.len() < imm_payloads.capacity(),
                        "payloads must not reallocate"
                    );
                    imm_payloads.push(payload);
                    (
                        Completed::Write,
                        vec![
                            (
                                ibv_wr_opcode::IBV_WR_RDMA_WRITE,
                                local.iter().map(sge_of).collect(),
                                Some(*remote),
                                None,
                            ),
                            (ibv_wr_opcode::IBV_WR_SEND, Vec::new(), None, Some(u32::MAX)),
                        ],
                    )
                }
                Op::Write { local, remote, imm } => {
                    let opc = if imm.is_some() {
                        ibv_wr_opcode::IBV_WR_RDMA_WRITE_WITH_IMM
                    } else {
                        ibv_wr_opcode::IBV_WR_RDMA_WRITE
                    };
                    (
                        Completed::Write,
                        vec![(opc, local.iter().map(sge_of).collect(), Some(*remote), *imm)],
                    )
                }
                Op::Read { local, remote } => (
                    Completed::Read,
                    vec![(
                        ibv_wr_opcode::IBV_WR_RDMA_READ,
                        vec![sge_of(local)],
                        Some(*remote),
                        None,
                    )],
                ),
                Op::Recv { .. } => unreachable!("receives were refused above"),
            };
            let nparts = parts.len();
            for (j, (opc, list, remote, imm)) in parts.into_iter().enumerate() {
                let final_part = j + 1 == nparts;
                let mut w: ibv_send_wr = unsafe {
                    // SAFETY: plain data, zero is valid before we fill it.
                    std::mem::zeroed()
                };
                w.wr_id = seq;
                w.opcode = opc;
                let mut flags = 0u32;
                let emulated_imm =
                    imm == Some(u32::MAX) && opc == ibv_wr_opcode::IBV_WR_SEND && list.is_empty();
                if emulated_imm {
                    flags |= ibv_send_flags::IBV_SEND_INLINE.0;
                } else if let Some(v) = imm {
                    w.imm_data_invalidated_rkey_union.imm_data = v.to_be();
                }
                let total: u32 = list.iter().map(|s| s.length).sum();
                if !emulated_imm
                    && opc != ibv_wr_opcode::IBV_WR_RDMA_READ
                    && total <= e.max_inline
                    && total > 0
                {
                    flags |= ibv_send_flags::IBV_SEND_INLINE.0;
                }
                if final_part && signal.next(last) {
                    flags |= ibv_send_flags::IBV_SEND_SIGNALED.0;
                }
                signal_after.push(signal);
                w.send_flags = flags;
                if let Some(r) = remote {
                    w.wr.rdma = rdma_t {
                        remote_addr: r.addr,
                        rkey: r.key as u32,
                    };
                }
                sges.push(if emulated_imm {
                    let p = imm_payloads.last().expect("pushed above");
                    vec![ibv_sge {
                        addr: p.as_ptr() as u64,
                        length: 8,
                        lkey: 0,
                    }]
                } else {
                    list
                });
                natives.push(w);
            }
            recs.push(Posted {
                seq,
                entries: nparts as u32,
                broken: false,
                item: SendRec {
                    wr_id: wr.wr_id,
                    kind: Some(kind),
                    op: Some(wr.op),
                },
            });
        }
        for (w, list) in natives.iter_mut().zip(sges.iter_mut()) {
            w.sg_list = list.as_mut_ptr();
            w.num_sge = list.len() as i32;
        }
        for i in 0..natives.len().saturating_sub(1) {
            let next: *mut ibv_send_wr = &mut natives[i + 1];
            natives[i].next = next;
        }
        let mut bad: *mut ibv_send_wr = ptr::null_mut();
        // SAFETY: live QP; the chain and its scatter/gather lists live until the call returns; the memory they
        // name is leased by the records we keep until completion (inline payloads are copied by the call).
        let rc = unsafe { ibv_post_send(e.qp, natives.as_mut_ptr(), &mut bad) };
        if rc == 0 {
            e.signal = signal;
            for r in recs {
                e.sends.push(r);
            }
            return if rest.is_empty() {
                Ok(())
            } else {
                Err(Refused::new(full(), rest))
            };
        }
        let error = TransportError::os("ibv_post_send", std::io::Error::from_raw_os_error(rc));
        // Everything before `bad` is on the device, nothing from it on. A provider that names no request of the
        // chain leaves us not knowing: then every request is treated as on the device (kept, and flushed below).
        let bad_at = natives.iter().position(|w| ptr::eq(w, bad));
        let posted_natives = bad_at.unwrap_or(natives.len());
        let cut = match bad_at {
            Some(b) => queue::cut(recs.iter().map(|r| r.entries as usize), b),
            None => queue::Cut {
                posted: recs.len(),
                partial: false,
            },
        };
        e.signal = match posted_natives {
            0 => e.signal,
            k => signal_after[k - 1],
        };
        let mut refused = Vec::new();
        for (i, mut r) in recs.into_iter().enumerate() {
            if i < cut.posted {
                e.sends.push(r);
            } else if i == cut.posted && cut.partial {
                r.broken = true;
                e.sends.push(r);
            } else {
                let SendRec { wr_id, op, .. } = r.item;
                refused.push(WorkRequest {
                    wr_id,
                    op: op.expect("the engine's requests carry their operation"),
                });
            }
        }
        if cut.partial || bad_at.is_none() {
            tracing::error!(?ep, %error, "a request reached the device in part; its connection goes down");
            Self::break_qp(e.qp);
        }
        refused.append(&mut rest);
        Err(Refused::new(error, refused))
    }

    fn post_recvs(&mut self, ep: EndpointId, wrs: Vec<WorkRequest>) -> Result<(), Refused> {
        let Some(e) = self.eps.get(&ep) else {
            return Err(Refused::new(TransportError::NoEndpoint, wrs));
        };
        if e.qp.is_null() {
            return Err(Refused::new(
                TransportError::Invalid("post before the queue pair exists".into()),
                wrs,
            ));
        }
        if !self.srq.is_null() {
            return Err(Refused::new(
                TransportError::Invalid(
                    "this endpoint takes its receives from the shared receive queue".into(),
                ),
                wrs,
            ));
        }
        let qp = e.qp;
        self.post_recv_chain(Some(ep), wrs, |chain, bad| {
            // SAFETY: live QP; the chain lives across the call; the buffers are leased by the records we keep.
            unsafe { ibv_post_recv(qp, chain, bad) }
        })
    }

    /// Builds a chain of receive work requests, posts it with `post`, and keeps the records (and their leases)
    /// until completion. `owner` is the endpoint, or `None` for the shared receive queue. When the device refuses
    /// the chain part-way, the receives before the refused one are on it and keep their records; the others come
    /// back whole.
    fn post_recv_chain(
        &mut self,
        owner: Option<EndpointId>,
        wrs: Vec<WorkRequest>,
        post: impl FnOnce(*mut ibv_recv_wr, *mut *mut ibv_recv_wr) -> i32,
    ) -> Result<(), Refused> {
        if wrs.iter().any(|w| !matches!(w.op, Op::Recv { .. })) {
            return Err(Refused::new(
                TransportError::Invalid("not a receive".into()),
                wrs,
            ));
        }
        let mut sges = Vec::with_capacity(wrs.len());
        let mut natives: Vec<ibv_recv_wr> = Vec::with_capacity(wrs.len());
        let mut recs = Vec::with_capacity(wrs.len());
        for wr in wrs {
            let Op::Recv { sge } = wr.op else {
                unreachable!("checked above");
            };
            let id = self.ids.recv();
            sges.push(ibv_sge {
                addr: sge.addr(),
                length: sge.len() as u32,
                lkey: sge.local_key() as u32,
            });
            natives.push(ibv_recv_wr {
                wr_id: id,
                next: ptr::null_mut(),
                sg_list: ptr::null_mut(),
                num_sge: 1,
            });
            recs.push((
                id,
                RecvRec {
                    wr_id: wr.wr_id,
                    sge,
                },
            ));
        }
        for (w, s) in natives.iter_mut().zip(sges.iter_mut()) {
            w.sg_list = s;
        }
        for i in 0..natives.len().saturating_sub(1) {
            let next: *mut ibv_recv_wr = &mut natives[i + 1];
            natives[i].next = next;
        }
        if natives.is_empty() {
            return Ok(());
        }
        let mut bad: *mut ibv_recv_wr = ptr::null_mut();
        let rc = post(natives.as_mut_ptr(), &mut bad);
        // Everything before `bad` is on the device, nothing from it on. A provider that names no request of the
        // chain leaves us not knowing: then every receive is treated as on the device (kept until it completes or
        // its queue is destroyed).
        let posted = if rc == 0 {
            recs.len()
        } else {
            natives
                .iter()
                .position(|w| ptr::eq(w, bad))
                .unwrap_or(recs.len())
        };
        let mut refused = Vec::new();
        for (i, (id, rec)) in recs.into_iter().enumerate() {
            if i < posted {
                self.recvs.insert(id, (owner, rec));
            } else {
                refused.push(WorkRequest {
                    wr_id: rec.wr_id,
                    op: Op::Recv { sge: rec.sge },
                });
            }
        }
        if rc == 0 {
            return Ok(());
        }
        Err(Refused::new(
            TransportError::os(
                if owner.is_some() {
                    "ibv_post_recv"
                } else {
                    "ibv_post_srq_recv"
                },
                std::io::Error::from_raw_os_error(rc),
            ),
            refused,
        ))
    }

    /// Posts requests on an endpoint: receives, then sends, each kind in order. On error, the requests that did
    /// not reach the device come back whole.
    fn post_inner(&mut self, ep: EndpointId, wrs: Vec<WorkRequest>) -> Result<(), Refused> {
        let down = match self.eps.get(&ep) {
            None => return Err(Refused::new(TransportError::NoEndpoint, wrs)),
            Some(e) => e.state == EpState::Down && !e.qp.is_null(),
        };
        if down {
            // Posting on a dead connection completes with a flush, as hardware does.
            for wr in wrs {
                let op = match wr.op {
                    Op::Send { .. } => Completed::Send,
                    Op::Write { .. } => Completed::Write,
                    Op::Read { .. } => Completed::Read,
                    Op::Recv { .. } => Completed::Recv { len: 0, imm: None },
                };
                self.cq_backlog.push_back((
                    Completion {
                        ep,
                        wr_id: wr.wr_id,
                        op,
                        status: Err(WcError::Flushed),
                    },
                    false,
                ));
            }
            return Ok(());
        }
        // Receives and sends go to different queues; keep each kind's order.
        let mut sends = Vec::new();
        let mut recvs = Vec::new();
        for wr in wrs {
            if matches!(wr.op, Op::Recv { .. }) {
                recvs.push(wr);
            } else {
                sends.push(wr);
            }
        }
        if !recvs.is_empty() {
            if let Err(mut r) = self.post_recvs(ep, recvs) {
                r.wrs.extend(sends);
                return Err(r);
            }
        }
        if !sends.is_empty() {
            self.post_sends(ep, sends)?;
        }
        Ok(())
    }

    fn drain_cq(&mut self) -> usize {
        let mut wcs: [ibv_wc; 32] = unsafe {
            // SAFETY: plain data.
            std::mem::zeroed()
        };
        let mut total = 0;
        loop {
            // SAFETY: live CQ; `wcs` holds 32 entries.
            let n = unsafe { ibv_poll_cq(self.cq, wcs.len() as i32, wcs.as_mut_ptr()) };
            if n <= 0 {
                return total;
            }
            for wc in &wcs[..n as usize] {
                self.on_wc(wc);
            }
            total += n as usize;
        }
    }

    /// Binds a type 2 memory window over the leased range to `ep`'s queue pair (see [`memory`]). The bind is a
    /// send-queue request, so it executes before anything posted after it, in particular the message that hands
    /// the key to the peer; it is unsignalled and retired by the next signalled request, like any other.
    fn bind_window(
        &mut self,
        ep: EndpointId,
        reg: &Arc<dyn Registration>,
        lease: Lease,
        access: RemoteAccess,
    ) -> Result<Box<dyn Exposure>, TransportError> {
        let base = reg
            .as_any()
            .downcast_ref::<VerbsRegistration>()
            .ok_or_else(|| TransportError::Invalid("not a registration of this device".into()))?;
        let e = self.eps.get(&ep).ok_or(TransportError::NoEndpoint)?;
        if e.qp.is_null() || e.state != EpState::Connected {
            return Err(TransportError::Invalid(
                "a memory window binds to a connected queue pair".into(),
            ));
        }
        if e.sends.entries() >= e.sq_cap {
            // Completions waiting in the completion queue free entries.
            self.drain_cq();
        }
        let e = self.eps.get_mut(&ep).ok_or(TransportError::NoEndpoint)?;
        if e.sends.entries() >= e.sq_cap {
            return Err(TransportError::Resource("send queue full".into()));
        }
        // SAFETY: open protection domain.
        let mw = unsafe { ibv_alloc_mw(self.pd.0, ibv_mw_type::IBV_MW_TYPE_2) }
            .filter(|m| !m.is_null())
            .ok_or_else(|| os_err("ibv_alloc_mw"))?;
        // SAFETY: `mw` is a live window; the key's low byte moves on with each bind so a stale key fails.
        let rkey = unsafe { ibv_inc_rkey((*mw).rkey) };
        let mw_access = match access {
            RemoteAccess::Read => ibv_access_flags::IBV_ACCESS_REMOTE_READ.0,
            RemoteAccess::Write => ibv_access_flags::IBV_ACCESS_REMOTE_WRITE.0,
        };
        let seq = self.ids.send();
        let mut w: ibv_send_wr = unsafe {
            // SAFETY: plain data, zero is valid before we fill it.
            std::mem::zeroed()
        };
        w.wr_id = seq;
        w.opcode = ibv_wr_opcode::IBV_WR_BIND_MW;
        // The signalling state changes only if the bind reaches the device.
        let mut signal = e.signal;
        if signal.next(false) {
            w.send_flags = ibv_send_flags::IBV_SEND_SIGNALED.0;
        }
        w.bind_mw_tso_union.bind_mw = bind_mw_t {
            mw,
            rkey,
            bind_info: ibv_mw_bind_info {
                mr: base.mr,
                addr: lease.addr(),
                length: lease.len() as u64,
                mw_access_flags: mw_access,
            },
        };
        let mut bad = ptr::null_mut();
        // SAFETY: live, connected QP; the request lives until the call returns; the window, the registration it
        // binds over and the leased memory outlive the binding (the returned exposure owns all three).
        let rc = unsafe { ibv_post_send(e.qp, &mut w, &mut bad) };
        if rc != 0 {
            // SAFETY: the window was never bound; deallocated once.
            unsafe { ibv_dealloc_mw(mw) };
            return Err(TransportError::os(
                "ibv_post_send (window bind)",
                std::io::Error::from_raw_os_error(rc),
            ));
        }
        e.signal = signal;
        e.sends.push(Posted {
            seq,
            entries: 1,
            broken: false,
            item: SendRec {
                wr_id: 0,
                kind: None,
                op: None,
            },
        });
        let slot = MwSlot::new(mw);
        if e.windows.len() >= 64 {
            e.windows.retain(|w| w.strong_count() > 0);
        }
        e.windows.push(Arc::downgrade(&slot));
        Ok(Box::new(KeyedLease::new(
            RemoteRef {
                addr: lease.addr(),
                key: u64::from(rkey),
            },
            lease,
            WindowKey {
                slot,
                _reg: Arc::clone(reg),
                _pd: Arc::clone(&self.pd),
            },
        )))
    }

    fn on_wc(&mut self, wc: &ibv_wc) {
        let status = if wc.status == ibv_wc_status::IBV_WC_SUCCESS {
            Ok(())
        } else {
            Err(wc_error(wc.status))
        };
        if WrIds::is_recv(wc.wr_id) {
            let Some((owner, rec)) = self.recvs.remove(&wc.wr_id) else {
                return;
            };
            // A shared receive belongs to the QP that dequeued it; EndpointId(0) if that one is gone.
            let ep =
                owner.unwrap_or_else(|| self.qpn.get(&wc.qp_num).copied().unwrap_or(EndpointId(0)));
            let mut imm = None;
            let mut len = wc.byte_len;
            if status.is_ok() {
                if wc.opcode == ibv_wc_opcode::IBV_WC_RECV_RDMA_WITH_IMM
                    || wc.wc_flags & ibv_wc_flags::IBV_WC_WITH_IMM.0 != 0
                {
                    // SAFETY: with an immediate (write-with-immediate, or a send with one) the union holds it, in
                    // network byte order.
                    imm = Some(u32::from_be(unsafe {
                        wc.imm_data_invalidated_rkey_union.imm_data
                    }));
                } else if wc.byte_len == 8 {
                    // Possibly an emulated write-with-immediate: 8 bytes starting with the magic (the protocol's
                    // own control messages are never shorter than 16 bytes).
                    let mut b = [0u8; 8];
                    if rec.sge.lease().read(0, &mut b).is_ok() && b[..4] == IMM_MAGIC.to_le_bytes()
                    {
                        imm = Some(u32::from_le_bytes(b[4..].try_into().expect("4 bytes")));
                        len = 0;
                    }
                }
            }
            self.cq_backlog.push_back((
                Completion {
                    ep,
                    wr_id: rec.wr_id,
                    op: Completed::Recv { len, imm },
                    status,
                },
                owner.is_none(),
            ));
            return;
        }
        let Some(&ep) = self.qpn.get(&wc.qp_num) else {
            return;
        };
        let Some(e) = self.eps.get_mut(&ep) else {
            return;
        };
        // A signalled (or failed) request completes every earlier unsignalled one: in order, successfully. A
        // completion that names none of this endpoint's requests retires nothing: it is a late one of a queue pair
        // destroyed before this one got its number (identifiers are never reused), or a repeated one.
        for (rec, named) in e.sends.retire(wc.wr_id) {
            let mut st = if named { status.clone() } else { Ok(()) };
            if rec.broken && st.is_ok() {
                st = Err(WcError::Other(
                    "only part of the request reached the device".into(),
                ));
            }
            let Some(op) = rec.item.kind else {
                if let Err(e) = st {
                    // A failed window bind breaks the queue pair: the requests after it complete flushed.
                    tracing::warn!(?ep, %e, "memory window bind failed");
                }
                continue;
            };
            self.cq_backlog.push_back((
                Completion {
                    ep,
                    wr_id: rec.item.wr_id,
                    op,
                    status: st,
                },
                false,
            ));
        }
    }
}

impl Transport for VerbsTransport {
    fn capabilities(&self) -> &Capabilities {
        &self.caps
    }

    fn register(&mut self, buf: &Arc<DmaBuf>) -> Result<Arc<dyn Registration>, TransportError> {
        let mut access = ibv_access_flags::IBV_ACCESS_LOCAL_WRITE.0;
        if self.iwarp {
            // iWARP: the local sink of an RDMA read must allow remote write.
            access |= ibv_access_flags::IBV_ACCESS_REMOTE_WRITE.0;
        }
        if self.windows {
            // Exposures are windows bound over this registration (no remote access of its own).
            access |= ibv_access_flags::IBV_ACCESS_MW_BIND.0;
        }
        if buf.is_empty() {
            return Err(TransportError::Invalid("cannot register zero bytes".into()));
        }
        let mr = reg_mr(&self.pd, buf.addr(), buf.len(), access)?;
        // SAFETY: live MR.
        let lkey = unsafe { (*mr).lkey };
        Ok(Arc::new(VerbsRegistration {
            _pd: Arc::clone(&self.pd),
            mr,
            lkey,
            buf: Arc::clone(buf),
        }))
    }

    fn expose(
        &mut self,
        ep: EndpointId,
        reg: &Arc<dyn Registration>,
        lease: Lease,
        access: RemoteAccess,
    ) -> Result<Box<dyn Exposure>, TransportError> {
        exs_transport::check_exposure(reg, &lease, access)?;
        if self.windows {
            return self.bind_window(ep, reg, lease, access);
        }
        let remote = match access {
            RemoteAccess::Read => ibv_access_flags::IBV_ACCESS_REMOTE_READ.0,
            RemoteAccess::Write => ibv_access_flags::IBV_ACCESS_REMOTE_WRITE.0,
        };
        let mr = reg_mr(
            &self.pd,
            lease.addr(),
            lease.len(),
            ibv_access_flags::IBV_ACCESS_LOCAL_WRITE.0 | remote,
        )?;
        // SAFETY: live MR.
        let rkey = unsafe { (*mr).rkey };
        let remote = RemoteRef {
            addr: lease.addr(),
            key: u64::from(rkey),
        };
        Ok(Box::new(KeyedLease::new(
            remote,
            lease,
            MrKey {
                mr: MrPtr(mr),
                _pd: Arc::clone(&self.pd),
            },
        )))
    }

    fn listen(
        &mut self,
        addr: SocketAddr,
        backlog: u32,
    ) -> Result<(ListenerId, SocketAddr), TransportError> {
        // An unspecified address would listen on every device; ours is the one carrying the configured address.
        let addr = if addr.ip().is_unspecified() {
            SocketAddr::new(self.cfg.addr, addr.port())
        } else {
            addr
        };
        let id_num = ListenerId(self.next_listener);
        self.next_listener += 1;
        let mut id = ptr::null_mut();
        let ctx = (TAG_LISTENER | id_num.0 as usize) as *mut c_void;
        // SAFETY: our channel; `id` receives a new id.
        if unsafe { rdma_create_id(self.ch, &mut id, ctx, rdma_port_space::RDMA_PS_TCP) } != 0 {
            return Err(os_err("rdma_create_id"));
        }
        let sa = sockaddr(addr);
        // SAFETY: live id; sockaddr lives across the calls.
        let rc = unsafe {
            if rdma_bind_addr(id, sa.as_ptr() as *mut _) != 0 {
                -1
            } else {
                rdma_listen(id, backlog.clamp(1, 1024) as i32)
            }
        };
        if rc != 0 {
            let e = std::io::Error::last_os_error();
            // SAFETY: the id is ours and unused.
            unsafe { rdma_destroy_id(id) };
            return Err(match e.kind() {
                std::io::ErrorKind::AddrInUse => TransportError::AddrInUse(addr),
                _ => TransportError::AddrNotAvailable(format!("{addr}: {e}")),
            });
        }
        // SAFETY: bound id.
        let port = u16::from_be(unsafe { rdma_get_src_port(id) });
        self.listeners.insert(id_num, id);
        Ok((id_num, SocketAddr::new(addr.ip(), port)))
    }

    fn close_listener(&mut self, listener: ListenerId) {
        if let Some(id) = self.listeners.remove(&listener) {
            // Requests handed out and not answered are refused first: their ids outlive the listener's.
            let stale: Vec<RequestId> = self
                .requests
                .iter()
                .filter(|(_, (l, _))| *l == listener)
                .map(|(r, _)| *r)
                .collect();
            for r in stale {
                self.reject(r);
            }
            // SAFETY: our listening id, removed from the table and destroyed once; every event naming it was
            // acknowledged in `poll_cm`, so destroying it does not wait.
            unsafe { rdma_destroy_id(id) };
        }
    }

    fn connect(
        &mut self,
        ep: EndpointId,
        addr: SocketAddr,
        private: &[u8],
        recvs: Vec<WorkRequest>,
    ) -> Result<(), TransportError> {
        let mut id = ptr::null_mut();
        let ctx = (TAG_EP | ep.0 as usize) as *mut c_void;
        // SAFETY: our channel.
        if unsafe { rdma_create_id(self.ch, &mut id, ctx, rdma_port_space::RDMA_PS_TCP) } != 0 {
            return Err(os_err("rdma_create_id"));
        }
        let src = sockaddr(SocketAddr::new(self.cfg.addr, 0));
        let dst = sockaddr(addr);
        // SAFETY: live id; both sockaddrs live across the call (rdma_cm copies them).
        if unsafe {
            rdma_resolve_addr(
                id,
                src.as_ptr() as *mut _,
                dst.as_ptr() as *mut _,
                RESOLVE_TIMEOUT_MS,
            )
        } != 0
        {
            let e = os_err("rdma_resolve_addr");
            // SAFETY: the id is ours and unused.
            unsafe { rdma_destroy_id(id) };
            return Err(e);
        }
        let mut e = Self::new_ep(id);
        e.pending = Some((private.to_vec(), recvs));
        self.eps.insert(ep, e);
        Ok(())
    }

    fn accept(
        &mut self,
        request: RequestId,
        ep: EndpointId,
        private: &[u8],
        recvs: Vec<WorkRequest>,
    ) -> Result<(), TransportError> {
        let (_, id) = self
            .requests
            .remove(&request)
            .ok_or(TransportError::Invalid("unknown request".into()))?;
        // SAFETY: the request's id is live and ours; from now on it names this endpoint.
        unsafe { (*id).context = (TAG_EP | ep.0 as usize) as *mut c_void };
        let mut e = Self::new_ep(id);
        e.state = EpState::Connecting;
        self.eps.insert(ep, e);
        if let Err(err) = self.create_qp(ep, recvs) {
            // SAFETY: the id is live; rejecting tells the peer. `release` destroys it (once: it is the endpoint's).
            unsafe { rdma_reject(id, ptr::null(), 0) };
            self.release(ep);
            return Err(err);
        }
        let mut param = Self::conn_param(private, self.rd_atom);
        // SAFETY: live id with a QP; private data copied by the call.
        if unsafe { rdma_accept(id, &mut param) } != 0 {
            let err = os_err("rdma_accept");
            self.release(ep);
            return Err(err);
        }
        Ok(())
    }

    fn reject(&mut self, request: RequestId) {
        if let Some((_, id)) = self.requests.remove(&request) {
            Self::reject_id(id);
        }
    }

    /// A request the device took in part (see `post_sends`) is not refused: it cannot come back while the device
    /// may read its memory, so it completes with an error instead, its connection down.
    fn post(&mut self, ep: EndpointId, wr: WorkRequest) -> Result<(), PostError> {
        match self.post_inner(ep, vec![wr]) {
            Ok(()) => Ok(()),
            Err(Refused { error, mut wrs }) => match wrs.pop() {
                Some(wr) => Err(PostError { error, wr }),
                None => Ok(()),
            },
        }
    }

    fn post_many(
        &mut self,
        ep: EndpointId,
        wrs: &mut Vec<WorkRequest>,
    ) -> Result<(), TransportError> {
        // The requests that did not reach the device are dropped, as the trait says.
        self.post_inner(ep, std::mem::take(wrs))
            .map_err(|r| r.error)
    }

    fn create_shared_recv(&mut self, depth: u32) -> Result<(), TransportError> {
        if self.caps.max_shared_recv == 0 {
            return Err(TransportError::Unsupported(format!(
                "{} has no shared receive queue",
                self.caps.name
            )));
        }
        if !self.srq.is_null() {
            return Err(TransportError::Invalid(
                "the shared receive queue exists".into(),
            ));
        }
        let mut attr = ibv_srq_init_attr {
            srq_context: ptr::null_mut(),
            attr: ibv_srq_attr {
                max_wr: depth.clamp(1, self.caps.max_shared_recv),
                max_sge: 1,
                srq_limit: 0,
            },
        };
        // SAFETY: our PD; `attr` is a valid in/out argument.
        let srq = unsafe { ibv_create_srq(self.pd.0, &mut attr) };
        if srq.is_null() {
            return Err(os_err("ibv_create_srq"));
        }
        self.srq = srq;
        Ok(())
    }

    fn post_shared_recv(&mut self, wrs: &mut Vec<WorkRequest>) -> Result<(), TransportError> {
        if self.srq.is_null() {
            wrs.clear();
            return Err(TransportError::Invalid("no shared receive queue".into()));
        }
        let srq = self.srq;
        let batch = std::mem::take(wrs);
        self.post_recv_chain(None, batch, |chain, bad| {
            // SAFETY: live SRQ; the chain lives across the call; the buffers are leased by the records we keep.
            unsafe { ibv_post_srq_recv(srq, chain, bad) }
        })
        // The receives that did not reach the queue are dropped, as the trait says.
        .map_err(|r| r.error)
    }

    fn disconnect(&mut self, ep: EndpointId) {
        let Some(e) = self.eps.get_mut(&ep) else {
            return;
        };
        match e.state {
            EpState::Connected | EpState::Connecting => {
                // SAFETY: live id; DISCONNECTED follows on both sides.
                unsafe { rdma_disconnect(e.id) };
                if e.state == EpState::Connecting {
                    if let Some(ev) = self.report_down(ep) {
                        self.cm_backlog.push_back(ev);
                    }
                }
            }
            EpState::Resolving | EpState::Down => {
                if let Some(ev) = self.report_down(ep) {
                    self.cm_backlog.push_back(ev);
                }
            }
        }
    }

    fn release(&mut self, ep: EndpointId) {
        let Some(e) = self.eps.remove(&ep) else {
            return;
        };
        let shared = !e.qp.is_null() && !self.srq.is_null();
        if shared {
            // Seed 003: shared buffers this QP dequeued but had not completed are flushed when it went to error;
            // collect those completions while the QP still maps to this endpoint, so the buffers go back (some
            // devices drop a destroyed QP's completions from the queue).
            self.drain_cq();
        }
        // Windows still bound to the queue pair die first: it cannot be destroyed while they are bound, and their
        // keys end with the connection.
        for w in &e.windows {
            if let Some(slot) = w.upgrade() {
                slot.dealloc();
            }
        }
        // SAFETY: the QP is live until destroyed just below; its number is read first.
        let qpn = (!e.qp.is_null()).then(|| unsafe { (*e.qp).qp_num });
        // SAFETY: the QP and id are ours; destroying the QP first stops the hardware from touching any posted
        // buffer, so the records (and their leases) can be dropped after.
        unsafe {
            if !e.qp.is_null() {
                rdma_destroy_qp(e.id);
            }
            rdma_destroy_id(e.id);
        }
        if shared {
            // Others leave them in the queue, and write some between the drain above and the destruction: collect
            // those too while the number still names this endpoint (after the destruction no more come), so a
            // shared receive is never credited to the next endpoint that gets the number.
            self.drain_cq();
        }
        if let Some(n) = qpn {
            self.qpn.remove(&n);
        }
        // Completions of the destroyed QP still in the queue name none of the records of whoever gets its number
        // next (identifiers are never reused), so they are ignored when they come.
        drop(e.sends);
        self.recvs.retain(|_, (owner, _)| *owner != Some(ep));
        // Completions of a released endpoint are dropped, except shared receives: the engine reposts those.
        self.cq_backlog.retain(|(c, shared)| c.ep != ep || *shared);
    }

    fn poll(&mut self, out: &mut Vec<Completion>, max: usize) -> usize {
        if self.cq_backlog.len() < max {
            self.drain_cq();
        }
        let n = self.cq_backlog.len().min(max);
        out.extend(self.cq_backlog.drain(..n).map(|(c, _)| c));
        n
    }

    fn poll_cm(&mut self) -> Option<CmEvent> {
        loop {
            if let Some(ev) = self.cm_backlog.pop_front() {
                return Some(ev);
            }
            let mut ev = ptr::null_mut();
            // SAFETY: non-blocking channel; on success `ev` is a live event we acknowledge below.
            if unsafe { rdma_get_cm_event(self.ch, &mut ev) } != 0 {
                return None;
            }
            let out = self.on_cm_event(ev);
            // SAFETY: every event is acknowledged exactly once.
            unsafe { rdma_ack_cm_event(ev) };
            if let Some(o) = out {
                return Some(o);
            }
        }
    }

    fn arm(&mut self) -> Result<bool, TransportError> {
        // Consume completion-channel events (acknowledging them), re-arm, then poll once more: a completion that
        // arrived before the re-arm would otherwise never wake us.
        loop {
            let mut cq = ptr::null_mut();
            let mut ctx = ptr::null_mut();
            // SAFETY: non-blocking channel; returns -1 when no event is pending.
            if unsafe { ibv_get_cq_event(self.comp, &mut cq, &mut ctx) } != 0 {
                break;
            }
            self.unacked_cq_events += 1;
        }
        if self.unacked_cq_events > 0 {
            // SAFETY: acknowledging the events we got, for our CQ.
            unsafe { ibv_ack_cq_events(self.cq, self.unacked_cq_events) };
            self.unacked_cq_events = 0;
        }
        // SAFETY: live CQ.
        if unsafe { ibv_req_notify_cq(self.cq, 0) } != 0 {
            return Err(os_err("ibv_req_notify_cq"));
        }
        self.drain_cq();
        Ok(self.cq_backlog.is_empty() && self.cm_backlog.is_empty())
    }

    fn wait_fd(&self) -> Option<OwnedFd> {
        self.epoll.0.as_fd().try_clone_to_owned().ok()
    }

    fn local_addr(&self, ep: EndpointId) -> Option<SocketAddr> {
        self.eps.get(&ep).and_then(|e| e.local)
    }

    fn peer_addr(&self, ep: EndpointId) -> Option<SocketAddr> {
        self.eps.get(&ep).and_then(|e| e.peer)
    }
}

impl Drop for VerbsTransport {
    fn drop(&mut self) {
        let eps: Vec<EndpointId> = self.eps.keys().copied().collect();
        for ep in eps {
            self.release(ep);
        }
        let reqs: Vec<RequestId> = self.requests.keys().copied().collect();
        for r in reqs {
            self.reject(r);
        }
        let ls: Vec<ListenerId> = self.listeners.keys().copied().collect();
        for l in ls {
            self.close_listener(l);
        }
        if !self.srq.is_null() {
            // SAFETY: every QP attached to it was destroyed above; the PD outlives it (we hold an Arc).
            unsafe { ibv_destroy_srq(self.srq) };
            self.srq = ptr::null_mut();
        }
        // The hardware can no longer touch any posted buffer: the leases go back.
        self.recvs.clear();
        // SAFETY: no QP uses the CQ any more; pending channel events are acknowledged by destroying the CQ after
        // acking; the channels are ours.
        unsafe {
            if self.unacked_cq_events > 0 {
                ibv_ack_cq_events(self.cq, self.unacked_cq_events);
            }
            ibv_destroy_cq(self.cq);
            ibv_destroy_comp_channel(self.comp);
            rdma_destroy_event_channel(self.ch);
        }
    }
}


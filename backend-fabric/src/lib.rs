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
//! * Waiting: our own epoll set over the event queue's and every completion queue's wait descriptors is the
//!   transport's wait descriptor; `fi_trywait` over all of them is the "arm" step.
//! * Memory: `fi_mr_reg` honouring the provider's `mr_mode` (virtual addresses or offsets, provider or requested
//!   keys, local descriptors). A remote key is a registration of exactly the exposed range, closed when the
//!   exposure is dropped (least exposure).
//! * Work requests: each posted operation is a boxed record whose address is the operation context (which also
//!   satisfies `FI_CONTEXT`/`FI_CONTEXT2`). The record owns the work request, so its leases live until the
//!   completion is read, or until `fi_close` of the endpoint guarantees the provider no longer touches them.

pub mod ffi;
mod memory;
mod sockaddr;

use std::collections::{HashMap, HashSet, VecDeque};
use std::ffi::{c_void, CStr, CString};
use std::net::SocketAddr;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd, RawFd};
use std::ptr;
use std::sync::Arc;

use exs_transport::{
    Capabilities, CmEvent, Completed, Completion, ConnectFailure, EndpointId, Exposure, ListenerId,
    Op, PostError, Registration, RemoteAccess, RemoteRef, RequestId, Transport, TransportError,
    WcError, WorkRequest,
};
use exs_dma::{DmaBuf, Lease};
use nix::sys::epoll::{Epoll, EpollCreateFlags, EpollEvent, EpollFlags};

use ffi::*;
use memory::{Domain, Fabric, FiKey, FiRegistration, MrHandle};

/// Which provider and domain to open.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FabricConfig {
    /// Provider name: `tcp` (default), `verbs`, `net`, `sockets`.
    pub provider: String,
    /// Domain (interface or device) name; `None` takes the provider's first.
    pub domain: Option<String>,
}

impl Default for FabricConfig {
    fn default() -> Self {
        FabricConfig {
            provider: "tcp".into(),
            domain: None,
        }
    }
}

impl FabricConfig {
    /// A configuration for a provider by name.
    pub fn provider(name: &str) -> Self {
        FabricConfig {
            provider: name.into(),
            domain: None,
        }
    }
}

const TAG_SHIFT: u32 = 40;
const TAG_EP: usize = 1 << TAG_SHIFT;
const TAG_LISTENER: usize = 2 << TAG_SHIFT;
const CM_ENTRY_LEN: usize = std::mem::size_of::<fi_eq_cm_entry>();
const MAX_CM_DATA: usize = 256;
const EPOLL_EQ: u64 = u64::MAX;

fn err(call: &str, ret: i64) -> TransportError {
    let code = ret.unsigned_abs();
    let kind = match code as u32 {
        FI_EAGAIN => std::io::ErrorKind::WouldBlock,
        FI_ECONNREFUSED => std::io::ErrorKind::ConnectionRefused,
        FI_ETIMEDOUT => std::io::ErrorKind::TimedOut,
        98 => std::io::ErrorKind::AddrInUse,
        99 => std::io::ErrorKind::AddrNotAvailable,
        12 => std::io::ErrorKind::OutOfMemory,
        22 => std::io::ErrorKind::InvalidInput,
        61 => std::io::ErrorKind::NotFound, // FI_ENODATA
        _ => std::io::ErrorKind::Other,
    };
    TransportError::Os {
        call: call.into(),
        kind,
        message: format!("{} ({ret})", strerror(ret)),
    }
}

fn check(call: &str, ret: i32) -> Result<(), TransportError> {
    if ret < 0 {
        Err(err(call, ret.into()))
    } else {
        Ok(())
    }
}

/// An owned `fi_info` list.
struct Info(*mut fi_info);

impl Drop for Info {
    fn drop(&mut self) {
        if !self.0.is_null() {
            // SAFETY: the pointer came from fi_getinfo/fi_dupinfo or a connection request and is freed once.
            unsafe { fi_freeinfo(self.0) };
        }
    }
}

/// Strings referenced by a hints structure while fi_getinfo runs (freed by Rust, not by fi_freeinfo).
struct Hints {
    info: *mut fi_info,
    _strings: Vec<CString>,
}

impl Drop for Hints {
    fn drop(&mut self) {
        // SAFETY: `info` came from fi_allocinfo; the string fields we set point into `_strings` and are cleared
        // first so fi_freeinfo does not free memory it does not own.
        unsafe {
            (*(*self.info).fabric_attr).prov_name = ptr::null_mut();
            (*(*self.info).domain_attr).name = ptr::null_mut();
            fi_freeinfo(self.info);
        }
    }
}

fn hints(provider: &str, domain: Option<&str>) -> Result<Hints, TransportError> {
    // SAFETY: fi_allocinfo returns a zeroed fi_info with allocated attribute structs (or null).
    let info = unsafe { exs_fi_allocinfo() };
    if info.is_null() {
        return Err(TransportError::Resource("fi_allocinfo".into()));
    }
    let mut strings = Vec::new();
    let prov = CString::new(provider)
        .map_err(|_| TransportError::Invalid("provider name has a NUL".into()))?;
    // SAFETY: `info` and its attribute structs were just allocated by libfabric; we only set plain fields and
    // pointers into `strings`, which outlive the hints (see `Hints::drop`).
    unsafe {
        let i = &mut *info;
        i.caps = (FI_MSG
            | FI_RMA
            | FI_READ
            | FI_WRITE
            | FI_RECV
            | FI_SEND
            | FI_REMOTE_READ
            | FI_REMOTE_WRITE) as u64;
        // Our operation contexts point at records with fi_context2 storage, and we post receives for remote CQ
        // data when a provider asks for it.
        i.mode = FI_CONTEXT | FI_CONTEXT2 | FI_RX_CQ_DATA;
        (*i.ep_attr).type_ = fi_ep_type_FI_EP_MSG;
        (*i.domain_attr).mr_mode =
            (FI_MR_LOCAL | FI_MR_VIRT_ADDR | FI_MR_ALLOCATED | FI_MR_PROV_KEY) as i32;
        (*i.domain_attr).threading = fi_threading_FI_THREAD_SAFE;
        (*i.fabric_attr).prov_name = prov.as_ptr() as *mut _;
        strings.push(prov);
        if let Some(d) = domain {
            let d = CString::new(d)
                .map_err(|_| TransportError::Invalid("domain name has a NUL".into()))?;
            (*i.domain_attr).name = d.as_ptr() as *mut _;
            strings.push(d);
        }
    }
    Ok(Hints {
        info,
        _strings: strings,
    })
}

fn getinfo(
    provider: &str,
    domain: Option<&str>,
    node: Option<&str>,
    service: Option<&str>,
    flags: u64,
) -> Result<Info, TransportError> {
    let h = hints(provider, domain)?;
    let node = node.map(|n| CString::new(n).expect("addresses have no NUL"));
    let service = service.map(|s| CString::new(s).expect("ports have no NUL"));
    let mut out = ptr::null_mut();
    // SAFETY: valid hints; node/service are NUL-terminated or null; `out` receives an allocated list.
    let ret = unsafe {
        fi_getinfo(
            API_VERSION,
            node.as_ref().map_or(ptr::null(), |c| c.as_ptr()),
            service.as_ref().map_or(ptr::null(), |c| c.as_ptr()),
            flags,
            h.info,
            &mut out,
        )
    };
    if ret != 0 || out.is_null() {
        return Err(err("fi_getinfo", ret.into()));
    }
    Ok(Info(out))
}

/// Provider names this machine's libfabric offers for MSG endpoints with RMA.
pub fn providers() -> Vec<String> {
    let mut names = Vec::new();
    // SAFETY: a zeroed hints structure asking for MSG endpoints; the result list is walked read-only and freed.
    unsafe {
        let h = exs_fi_allocinfo();
        if h.is_null() {
            return names;
        }
        (*(*h).ep_attr).type_ = fi_ep_type_FI_EP_MSG;
        (*h).caps = (FI_MSG | FI_RMA) as u64;
        let mut out = ptr::null_mut();
        if fi_getinfo(API_VERSION, ptr::null(), ptr::null(), 0, h, &mut out) == 0 {
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
            fi_freeinfo(out);
        }
        fi_freeinfo(h);
    }
    names
}

/// Why [`FabricTransport::create_ep`] failed, and whether it got as far as opening the endpoint.
#[derive(Debug)]
struct EpError {
    error: TransportError,
    opened: bool,
}

impl EpError {
    fn before(error: TransportError) -> Self {
        EpError {
            error,
            opened: false,
        }
    }
}

impl From<EpError> for TransportError {
    fn from(e: EpError) -> Self {
        e.error
    }
}

/// A posted work request. Its address is the operation context; `ctx` comes first for FI_CONTEXT providers.
#[repr(C)]
struct WrRecord {
    ctx: fi_context2,
    ep: EndpointId,
    wr_id: u64,
    op: Op,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum EpState {
    Connecting,
    Connected,
    Down,
}

struct Ep {
    /// The domain the endpoint and its queue live in (closed after them).
    _dom: Arc<Domain>,
    ep: *mut fid_ep,
    cq: *mut fid_cq,
    cq_fd: RawFd,
    pending: HashSet<usize>,
    state: EpState,
    reported_down: bool,
    local: Option<SocketAddr>,
    peer: Option<SocketAddr>,
}

/// One libfabric fabric as an exs [`Transport`]: the context's domain, and (see [`memory`]) a domain per
/// connection where the provider allows it.
pub struct FabricTransport {
    dom: Arc<Domain>,
    /// Each connection has a domain of its own (keys bound to one connection): the provider needs no local
    /// descriptors.
    per_conn: bool,
    /// The domains of connections, by endpoint (made at the first exposure or at connect/accept).
    conn_domains: HashMap<EndpointId, Arc<Domain>>,
    provider: String,
    domain_name: String,
    eq: *mut fid_eq,
    epoll: Epoll,
    caps: Capabilities,
    eps: HashMap<EndpointId, Ep>,
    listeners: HashMap<ListenerId, *mut fid_pep>,
    requests: HashMap<RequestId, (ListenerId, Info)>,
    next_listener: u32,
    next_request: u64,
    cm_backlog: VecDeque<CmEvent>,
    cq_backlog: VecDeque<Completion>,
    poll_ids: Vec<EndpointId>,
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

fn cstr(p: *const std::os::raw::c_char) -> String {
    if p.is_null() {
        return String::new();
    }
    // SAFETY: libfabric strings are NUL-terminated and live as long as their fi_info.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

fn wait_fd_of(fid: *mut fid) -> Result<RawFd, TransportError> {
    let mut fd: i32 = -1;
    // SAFETY: FI_GETWAIT on a queue opened with FI_WAIT_FD writes one int.
    let ret = unsafe { exs_fi_control(fid, FI_GETWAIT as i32, &mut fd as *mut i32 as *mut c_void) };
    check("fi_control(FI_GETWAIT)", ret)?;
    Ok(fd)
}

fn epoll_add(epoll: &Epoll, fd: RawFd, data: u64) -> Result<(), TransportError> {
    // SAFETY: `fd` is a wait descriptor owned by a libfabric queue that stays open while it is in the set (it is
    // removed before the queue is closed).
    let bfd = unsafe { BorrowedFd::borrow_raw(fd) };
    epoll
        .add(bfd, EpollEvent::new(EpollFlags::EPOLLIN, data))
        .map_err(|e| TransportError::os("epoll_ctl(ADD)", e.into()))
}

fn context_of(f: *mut fid) -> usize {
    if f.is_null() {
        return 0;
    }
    // SAFETY: event-queue entries name a fid of one of our objects, whose context we set at creation.
    unsafe { (*f).context as usize }
}

impl FabricTransport {
    /// Opens a provider's domain. A provider that does not exist gives an error listing those that do.
    pub fn open(cfg: &FabricConfig) -> Result<FabricTransport, TransportError> {
        let info = getinfo(&cfg.provider, cfg.domain.as_deref(), None, None, 0).map_err(|e| {
            let available = providers();
            if available.iter().any(|p| p == &cfg.provider) {
                e
            } else {
                TransportError::NotFound {
                    wanted: cfg.provider.clone(),
                    available,
                }
            }
        })?;
        // SAFETY: `info.0` is a valid list from fi_getinfo; we use its first entry, which stays alive in `dom`.
        let i = unsafe { &*info.0 };
        // SAFETY: attribute pointers of a returned fi_info are valid.
        let (tx, rx, ep_attr, dattr, fattr) = unsafe {
            (
                &*i.tx_attr,
                &*i.rx_attr,
                &*i.ep_attr,
                &*i.domain_attr,
                &*i.fabric_attr,
            )
        };
        let provider = cstr(fattr.prov_name);
        let domain_name = cstr(dattr.name);
        let mr_mode = dattr.mr_mode as u64;
        if mr_mode & FI_MR_ENDPOINT as u64 != 0 {
            return Err(TransportError::Unsupported(format!(
                "provider {provider} needs FI_MR_ENDPOINT"
            )));
        }
        if dattr.cq_data_size < 4 {
            return Err(TransportError::Unsupported(format!(
                "provider {provider} carries {} bytes of remote CQ data; write-with-immediate needs 4",
                dattr.cq_data_size
            )));
        }
        let mut fabric = ptr::null_mut();
        // SAFETY: fabric_attr of a returned info; out-pointer for the fabric.
        check("fi_fabric", unsafe {
            fi_fabric(i.fabric_attr, &mut fabric, ptr::null_mut())
        })?;
        let fab = Arc::new(Fabric { fabric, info });
        let dom = Domain::open(&fab, mr_mode)?;
        let caps = Capabilities {
            name: format!("fabric/{provider}/{domain_name}"),
            max_inline: tx.inject_size,
            max_message: (ep_attr.max_msg_size as u64).min(1 << 30),
            native_write_imm: true,
            imm_consumes_recv: (i.mode | rx.mode) & FI_RX_CQ_DATA != 0,
            max_send_wr: tx.size.min(4096) as u32,
            max_recv_wr: rx.size.min(4096) as u32,
            max_sge: tx.iov_limit.clamp(1, 4) as u32,
            max_read_depth: if provider == "verbs" {
                16
            } else {
                (tx.size / 2).clamp(1, 64) as u32
            },
            max_private_data: 56,
            // The tcp provider's shared receive contexts are not used: each endpoint posts its own receives.
            max_shared_recv: 0,
            // Software providers (tcp, sockets, net) copy through the kernel either way, and a read is a
            // request and a reply: `exs pump` (libfabric tcp, depth 8) moved 512 B 61 vs 41 MB/s, 2 KiB 221 vs
            // 148, 8 KiB 1049 vs 493, 32 KiB 2544 vs 1892 immediate vs normal, so immediate wins at every size it
            // can carry. 4 KiB bounds each connection's receive slots (16 credits: ~70 KiB). A hardware
            // provider (verbs) keeps the 512-byte default of the verbs backend.
            immediate_default: if provider == "verbs" { 512 } else { 4096 },
            keys_after_connect: false,
        };
        let mut attr = fi_eq_attr {
            size: 1024,
            wait_obj: fi_wait_obj_FI_WAIT_FD,
            ..Default::default()
        };
        let mut eq = ptr::null_mut();
        // SAFETY: open fabric; attr lives across the call.
        check("fi_eq_open", unsafe {
            exs_fi_eq_open(fab.fabric, &mut attr, &mut eq, ptr::null_mut())
        })?;
        let epoll = Epoll::new(EpollCreateFlags::EPOLL_CLOEXEC)
            .map_err(|e| TransportError::os("epoll_create", e.into()))?;
        let t = FabricTransport {
            dom,
            per_conn: mr_mode & FI_MR_LOCAL as u64 == 0,
            conn_domains: HashMap::new(),
            provider,
            domain_name,
            eq,
            epoll,
            caps,
            eps: HashMap::new(),
            listeners: HashMap::new(),
            requests: HashMap::new(),
            next_listener: 1,
            next_request: 1,
            cm_backlog: VecDeque::new(),
            cq_backlog: VecDeque::new(),
            poll_ids: Vec::new(),
        };
        // SAFETY: `eq` is open; its fid is valid.
        let eq_fd = wait_fd_of(unsafe { &mut (*t.eq).fid })?;
        epoll_add(&t.epoll, eq_fd, EPOLL_EQ)?;
        tracing::debug!(name = %t.caps.name, mr_mode, "libfabric domain open");
        Ok(t)
    }

    /// Provider name.
    pub fn provider(&self) -> &str {
        &self.provider
    }

    /// The domain of a connection: its own where the provider allows it, else the context's.
    fn domain_for(&mut self, id: EndpointId) -> Result<Arc<Domain>, TransportError> {
        if !self.per_conn {
            return Ok(Arc::clone(&self.dom));
        }
        if let Some(d) = self.conn_domains.get(&id) {
            return Ok(Arc::clone(d));
        }
        let d = Domain::open(&self.dom.fab, self.dom.mr_mode)?;
        self.conn_domains.insert(id, Arc::clone(&d));
        Ok(d)
    }

    /// Opens an endpoint and its completion queue. On error, `EpError::opened` says whether an endpoint was
    /// opened from `info` (and closed again): from a connection request's info, that endpoint took the
    /// connection over, so the request is no longer the provider's to refuse.
    fn create_ep(&mut self, info: *mut fi_info, id: EndpointId) -> Result<Ep, EpError> {
        let dom = self.domain_for(id).map_err(EpError::before)?;
        let mut ep = ptr::null_mut();
        let ctx = (TAG_EP | id.0 as usize) as *mut c_void;
        // SAFETY: open domain; `info` is a valid entry (from fi_getinfo or a connection request).
        check("fi_endpoint", unsafe {
            exs_fi_endpoint(dom.domain, info, &mut ep, ctx)
        })
        .map_err(EpError::before)?;
        self.finish_ep(dom, ep, ctx, id).map_err(|error| EpError {
            error,
            opened: true,
        })
    }

    /// The rest of [`FabricTransport::create_ep`] once the endpoint is open: its queue, bindings, enabling. On
    /// error the endpoint is closed.
    fn finish_ep(
        &mut self,
        dom: Arc<Domain>,
        ep: *mut fid_ep,
        ctx: *mut c_void,
        id: EndpointId,
    ) -> Result<Ep, TransportError> {
        let size = (self.caps.max_send_wr + self.caps.max_recv_wr) as usize;
        let mut attr = fi_cq_attr {
            size,
            format: fi_cq_format_FI_CQ_FORMAT_DATA,
            wait_obj: fi_wait_obj_FI_WAIT_FD,
            ..Default::default()
        };
        let mut cq = ptr::null_mut();
        // SAFETY: open domain; attr lives across the call.
        let ret = unsafe { exs_fi_cq_open(dom.domain, &mut attr, &mut cq, ctx) };
        let cleanup_ep = |ep: *mut fid_ep| {
            // SAFETY: the endpoint was opened above and is not used elsewhere.
            unsafe { exs_fi_close(&mut (*ep).fid) };
        };
        if ret < 0 {
            cleanup_ep(ep);
            return Err(err("fi_cq_open", ret.into()));
        }
        let close_both = |ep: *mut fid_ep, cq: *mut fid_cq| {
            cleanup_ep(ep);
            // SAFETY: the queue was opened above and is bound to nothing else.
            unsafe { exs_fi_close(&mut (*cq).fid) };
        };
        // SAFETY: endpoint, queue and event queue are open; binding flags per fi_endpoint(3).
        let r = unsafe {
            let r = exs_fi_ep_bind(ep, &mut (*self.eq).fid, 0);
            if r < 0 {
                r
            } else {
                exs_fi_ep_bind(ep, &mut (*cq).fid, (FI_TRANSMIT | FI_RECV) as u64)
            }
        };
        if r < 0 {
            close_both(ep, cq);
            return Err(err("fi_ep_bind", r.into()));
        }
        // SAFETY: bound endpoint.
        let r = unsafe { exs_fi_enable(ep) };
        if r < 0 {
            close_both(ep, cq);
            return Err(err("fi_enable", r.into()));
        }
        // SAFETY: `cq` is open.
        let cq_fd = match wait_fd_of(unsafe { &mut (*cq).fid }) {
            Ok(fd) => fd,
            Err(e) => {
                close_both(ep, cq);
                return Err(e);
            }
        };
        if let Err(e) = epoll_add(&self.epoll, cq_fd, u64::from(id.0)) {
            close_both(ep, cq);
            return Err(e);
        }
        Ok(Ep {
            _dom: dom,
            ep,
            cq,
            cq_fd,
            pending: HashSet::new(),
            state: EpState::Connecting,
            reported_down: false,
            local: None,
            peer: None,
        })
    }

    fn post_initial(
        &mut self,
        id: EndpointId,
        recvs: Vec<WorkRequest>,
    ) -> Result<(), TransportError> {
        for wr in recvs {
            self.post(id, wr).map_err(|e| e.error)?;
        }
        Ok(())
    }

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
                Op::Send { sges, imm: None } => {
                    let iov: Vec<iovec> = sges
                        .iter()
                        .map(|s| iovec {
                            iov_base: s.addr() as *mut c_void,
                            iov_len: s.len(),
                        })
                        .collect();
                    let mut desc: Vec<*mut c_void> =
                        sges.iter().map(|s| s.local_key() as *mut c_void).collect();
                    exs_fi_sendv(ep, iov.as_ptr(), desc.as_mut_ptr(), iov.len(), ctx)
                }
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
                Op::Write { local, remote, imm } => {
                    // Gathered write: one fi_writemsg with an iovec per entry and one remote range. A plain write
                    // (into a persistent receive) completes only once the bytes are at the peer, as an RC write
                    // does on verbs: the sender's completion is the only signal the peer gets
                    // (FI_DELIVERY_COMPLETE; found when faster progress let the sender's event overtake them).
                    let iov: Vec<iovec> = local
                        .iter()
                        .map(|s| iovec {
                            iov_base: s.addr() as *mut c_void,
                            iov_len: s.len(),
                        })
                        .collect();
                    let mut desc: Vec<*mut c_void> =
                        local.iter().map(|s| s.local_key() as *mut c_void).collect();
                    let len: usize = local.iter().map(|s| s.len()).sum();
                    let rma = fi_rma_iov {
                        addr: remote.addr,
                        len,
                        key: remote.key,
                    };
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
                    let flags = if imm.is_some() {
                        FI_REMOTE_CQ_DATA as u64
                    } else {
                        FI_DELIVERY_COMPLETE as u64
                    };
                    exs_fi_writemsg(ep, &msg, flags)
                }
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

    /// Reads up to `max` completions of one endpoint into `out`. Returns how many.
    fn read_cq(&mut self, id: EndpointId, out: &mut impl Extend<Completion>, max: usize) -> usize {
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

    fn addresses(&mut self, id: EndpointId) {
        let Some(e) = self.eps.get_mut(&id) else {
            return;
        };
        let mut buf = [0u8; 128];
        let mut len = buf.len();
        // SAFETY: connected endpoint; `buf` holds `len` bytes.
        if unsafe { exs_fi_getname(&mut (*e.ep).fid, buf.as_mut_ptr() as *mut c_void, &mut len) }
            == 0
        {
            e.local = sockaddr::decode(&buf[..len.min(buf.len())]);
        }
        let mut len = buf.len();
        // SAFETY: as above.
        if unsafe { exs_fi_getpeer(e.ep, buf.as_mut_ptr() as *mut c_void, &mut len) } == 0 {
            e.peer = sockaddr::decode(&buf[..len.min(buf.len())]);
        }
    }

    /// Refuses a connection request through the listener that received it, then frees its info (once, by
    /// dropping it). The only ways a request ends are this and `accept`.
    fn reject_info(&mut self, listener: ListenerId, info: Info) {
        match self.listeners.get(&listener) {
            Some(&pep) => {
                // SAFETY: an open passive endpoint and the handle of a request it received (from the request's
                // info, alive until `info` drops below); the provider frees the handle, not the info.
                let ret = unsafe { exs_fi_reject(pep, (*info.0).handle, ptr::null(), 0) };
                if ret < 0 {
                    tracing::debug!("fi_reject: {}", strerror(ret.into()));
                }
            }
            // Not reached: `close_listener` rejects a listener's requests before closing it.
            None => tracing::error!(
                ?listener,
                "rejecting a request of a closed listener; its connection handle leaks"
            ),
        }
        drop(info);
    }

    fn report_down(&mut self, id: EndpointId) -> Option<CmEvent> {
        let e = self.eps.get_mut(&id)?;
        e.state = EpState::Down;
        if e.reported_down {
            return None;
        }
        e.reported_down = true;
        Some(CmEvent::Disconnected { ep: id })
    }

    fn read_eq(&mut self) -> Option<CmEvent> {
        #[repr(C, align(8))]
        struct Buf([u8; CM_ENTRY_LEN + MAX_CM_DATA]);
        let mut buf = Buf([0; CM_ENTRY_LEN + MAX_CM_DATA]);
        loop {
            let mut event: u32 = 0;
            // SAFETY: open event queue; `buf` is aligned for fi_eq_cm_entry and long enough for private data.
            let ret = unsafe {
                exs_fi_eq_read(
                    self.eq,
                    &mut event,
                    buf.0.as_mut_ptr() as *mut c_void,
                    buf.0.len(),
                    0,
                )
            };
            if ret == -(FI_EAGAIN as isize) {
                return None;
            }
            if ret == -(FI_EAVAIL as isize) {
                let mut ee = fi_eq_err_entry::default();
                // SAFETY: an error entry is available.
                if unsafe { exs_fi_eq_readerr(self.eq, &mut ee, 0) } <= 0 {
                    return None;
                }
                let tag = context_of(ee.fid);
                if tag & TAG_EP == 0 {
                    tracing::warn!(
                        err = ee.err,
                        "event queue error on a listener: {}",
                        strerror(ee.err.into())
                    );
                    continue;
                }
                let id = EndpointId((tag & 0xffff_ffff) as u32);
                let Some(e) = self.eps.get(&id) else { continue };
                if e.state == EpState::Connecting {
                    let reason = match ee.err as u32 {
                        FI_ECONNREFUSED => ConnectFailure::Refused(Vec::new()),
                        FI_ETIMEDOUT => ConnectFailure::TimedOut,
                        113 | 101 => ConnectFailure::Unreachable, // EHOSTUNREACH, ENETUNREACH
                        _ => ConnectFailure::Other(strerror(ee.err.into())),
                    };
                    if let Some(e) = self.eps.get_mut(&id) {
                        e.state = EpState::Down;
                        e.reported_down = true;
                    }
                    return Some(CmEvent::ConnectFailed { ep: id, reason });
                }
                match self.report_down(id) {
                    Some(ev) => return Some(ev),
                    None => continue,
                }
            }
            if ret < 0 {
                tracing::error!("fi_eq_read: {}", strerror(ret as i64));
                return None;
            }
            let len = ret as usize;
            // SAFETY: the provider wrote a cm entry (header plus `len - CM_ENTRY_LEN` bytes of data) into `buf`.
            let entry = unsafe { &*(buf.0.as_ptr() as *const fi_eq_cm_entry) };
            let data = buf.0[CM_ENTRY_LEN.min(len)..len.min(buf.0.len())].to_vec();
            let tag = context_of(entry.fid);
            match event {
                FI_CONNREQ => {
                    let info = Info(entry.info);
                    let listener = ListenerId((tag & 0xffff_ffff) as u32);
                    if tag & TAG_LISTENER == 0 || !self.listeners.contains_key(&listener) {
                        // Not reached: a listener is closed only after its requests waiting in this queue were read
                        // and rejected (`close_listener`), and fi_reject needs the passive endpoint that received
                        // the request. The info goes (fi_freeinfo, once, by `Info`); its connection handle cannot.
                        tracing::error!(
                            tag,
                            "connection request for a listener that is not open; its connection handle leaks"
                        );
                        continue;
                    }
                    // SAFETY: a connection request's info carries the peer's address.
                    let peer = unsafe {
                        let i = &*info.0;
                        sockaddr::decode(std::slice::from_raw_parts(
                            i.dest_addr as *const u8,
                            i.dest_addrlen,
                        ))
                    };
                    let request = RequestId(self.next_request);
                    self.next_request += 1;
                    self.requests.insert(request, (listener, info));
                    let peer = peer.unwrap_or_else(|| SocketAddr::from(([0, 0, 0, 0], 0)));
                    return Some(CmEvent::ConnectRequest {
                        listener,
                        request,
                        peer,
                        private: data,
                    });
                }
                FI_CONNECTED => {
                    let id = EndpointId((tag & 0xffff_ffff) as u32);
                    let Some(e) = self.eps.get_mut(&id) else {
                        continue;
                    };
                    if e.state != EpState::Connecting {
                        continue;
                    }
                    e.state = EpState::Connected;
                    self.addresses(id);
                    return Some(CmEvent::Established {
                        ep: id,
                        private: data,
                    });
                }
                FI_SHUTDOWN => {
                    let id = EndpointId((tag & 0xffff_ffff) as u32);
                    if let Some(ev) = self.report_down(id) {
                        return Some(ev);
                    }
                }
                other => tracing::debug!(event = other, "ignored event-queue event"),
            }
        }
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

impl Transport for FabricTransport {
    fn capabilities(&self) -> &Capabilities {
        &self.caps
    }

    fn register(&mut self, buf: &Arc<DmaBuf>) -> Result<Arc<dyn Registration>, TransportError> {
        if self.per_conn {
            // No local descriptors: the provider names local memory by address (see `memory`).
            return Ok(Arc::new(FiRegistration {
                _domain: None,
                mr: ptr::null_mut(),
                desc: 0,
                buf: Arc::clone(buf),
            }));
        }
        let access = (FI_SEND | FI_RECV | FI_READ | FI_WRITE) as u64;
        let mr = self.dom.register(buf.addr(), buf.len(), access)?;
        // SAFETY: `mr` is a live registration.
        let desc = unsafe { exs_fi_mr_desc(mr) } as u64;
        Ok(Arc::new(FiRegistration {
            _domain: Some(Arc::clone(&self.dom)),
            mr,
            desc,
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
        let flags = match access {
            RemoteAccess::Read => FI_REMOTE_READ,
            RemoteAccess::Write => FI_REMOTE_WRITE,
        } as u64;
        let dom = self.domain_for(ep)?;
        let mr = dom.register(lease.addr(), lease.len(), flags)?;
        // SAFETY: live registration.
        let key = unsafe { exs_fi_mr_key(mr) };
        let addr = if dom.mr_mode & FI_MR_VIRT_ADDR as u64 != 0 {
            lease.addr()
        } else {
            0
        };
        Ok(Box::new(exs_transport::KeyedLease::new(
            RemoteRef { addr, key },
            lease,
            FiKey {
                mr: MrHandle(mr),
                _domain: dom,
            },
        )))
    }

    fn listen(
        &mut self,
        addr: SocketAddr,
        _backlog: u32,
    ) -> Result<(ListenerId, SocketAddr), TransportError> {
        let info = getinfo(
            &self.provider,
            None,
            Some(&addr.ip().to_string()),
            Some(&addr.port().to_string()),
            FI_SOURCE,
        )
        .map_err(|e| match e {
            TransportError::Os { .. } => TransportError::AddrNotAvailable(format!("{addr}: {e}")),
            other => other,
        })?;
        let id = ListenerId(self.next_listener);
        self.next_listener += 1;
        let mut pep = ptr::null_mut();
        let ctx = (TAG_LISTENER | id.0 as usize) as *mut c_void;
        // SAFETY: open fabric and a valid info.
        check("fi_passive_ep", unsafe {
            exs_fi_passive_ep(self.dom.fab.fabric, info.0, &mut pep, ctx)
        })?;
        // SAFETY: `pep` was just opened; binding it to our event queue, then listening.
        let ret = unsafe {
            let r = exs_fi_pep_bind(pep, &mut (*self.eq).fid, 0);
            if r < 0 {
                r
            } else {
                exs_fi_listen(pep)
            }
        };
        if ret < 0 {
            // SAFETY: the passive endpoint is ours and unused.
            unsafe { exs_fi_close(&mut (*pep).fid) };
            if ret.unsigned_abs() == 98 {
                return Err(TransportError::AddrInUse(addr));
            }
            return Err(err("fi_listen", ret.into()));
        }
        let mut buf = [0u8; 128];
        let mut len = buf.len();
        // SAFETY: listening passive endpoint; `buf` holds `len` bytes.
        let bound = if unsafe {
            exs_fi_getname(&mut (*pep).fid, buf.as_mut_ptr() as *mut c_void, &mut len)
        } == 0
        {
            sockaddr::decode(&buf[..len.min(buf.len())]).unwrap_or(addr)
        } else {
            addr
        };
        self.listeners.insert(id, pep);
        Ok((id, bound))
    }

    fn close_listener(&mut self, listener: ListenerId) {
        if !self.listeners.contains_key(&listener) {
            return;
        }
        // Connection requests for this listener may wait in the event queue (the provider's progress publishes
        // them while a read runs, and the read returns one). Read them while the passive endpoint is open: once
        // it is closed their entries name a freed object, and their connections can no longer be refused, so
        // their sockets would leak. The provider makes no progress between this and the close below (the event
        // queue's progress runs in reads, and the engine's lock is held), so none can follow.
        while let Some(ev) = self.read_eq() {
            self.cm_backlog.push_back(ev);
        }
        let stale: Vec<RequestId> = self
            .requests
            .iter()
            .filter(|(_, (l, _))| *l == listener)
            .map(|(r, _)| *r)
            .collect();
        for r in stale {
            self.reject(r);
        }
        // Requests just read for it are answered: the engine never sees them.
        self.cm_backlog.retain(
            |ev| !matches!(ev, CmEvent::ConnectRequest { listener: l, .. } if *l == listener),
        );
        if let Some(pep) = self.listeners.remove(&listener) {
            // SAFETY: the passive endpoint is removed from our table and closed once; no request of it is left.
            unsafe { exs_fi_close(&mut (*pep).fid) };
        }
    }

    fn connect(
        &mut self,
        ep: EndpointId,
        addr: SocketAddr,
        private: &[u8],
        recvs: Vec<WorkRequest>,
    ) -> Result<(), TransportError> {
        let node = addr.ip().to_string();
        let service = addr.port().to_string();
        let info = getinfo(
            &self.provider,
            Some(&self.domain_name),
            Some(&node),
            Some(&service),
            0,
        )
        .or_else(|_| getinfo(&self.provider, None, Some(&node), Some(&service), 0))?;
        let e = self.create_ep(info.0, ep)?;
        self.eps.insert(ep, e);
        if let Err(err) = self.post_initial(ep, recvs) {
            self.release(ep);
            return Err(err);
        }
        let e = self.eps.get(&ep).expect("inserted");
        // SAFETY: enabled endpoint; `info` carries the destination address; private data is copied by the call.
        let ret = unsafe {
            exs_fi_connect(
                e.ep,
                (*info.0).dest_addr,
                private.as_ptr() as *const c_void,
                private.len(),
            )
        };
        if ret < 0 {
            self.release(ep);
            if ret.unsigned_abs() == FI_ECONNREFUSED {
                self.cm_backlog.push_back(CmEvent::ConnectFailed {
                    ep,
                    reason: ConnectFailure::Refused(Vec::new()),
                });
                return Ok(());
            }
            return Err(err("fi_connect", ret.into()));
        }
        Ok(())
    }

    fn accept(
        &mut self,
        request: RequestId,
        ep: EndpointId,
        private: &[u8],
        recvs: Vec<WorkRequest>,
    ) -> Result<(), TransportError> {
        let (listener, info) = self
            .requests
            .remove(&request)
            .ok_or(TransportError::Invalid("unknown request".into()))?;
        let e = match self.create_ep(info.0, ep) {
            Ok(e) => e,
            Err(EpError { error, opened }) => {
                // The connection's own domain, if one was made for it, goes with it.
                self.conn_domains.remove(&ep);
                if !opened {
                    // The request is still the provider's: refuse it (the peer sees a refusal, its socket goes).
                    self.reject_info(listener, info);
                }
                // Otherwise the endpoint made from it took the connection over and closed it.
                return Err(error);
            }
        };
        self.eps.insert(ep, e);
        if let Err(err) = self.post_initial(ep, recvs) {
            self.release(ep);
            return Err(err);
        }
        let e = self.eps.get(&ep).expect("inserted");
        // SAFETY: enabled endpoint created from the request's info; private data is copied by the call.
        let ret = unsafe { exs_fi_accept(e.ep, private.as_ptr() as *const c_void, private.len()) };
        if ret < 0 {
            self.release(ep);
            return Err(err("fi_accept", ret.into()));
        }
        Ok(())
    }

    fn reject(&mut self, request: RequestId) {
        if let Some((listener, info)) = self.requests.remove(&request) {
            self.reject_info(listener, info);
        }
    }

    fn post(&mut self, ep: EndpointId, wr: WorkRequest) -> Result<(), PostError> {
        let Some(e) = self.eps.get(&ep) else {
            return Err(PostError {
                error: TransportError::NoEndpoint,
                wr,
            });
        };
        if e.state == EpState::Down {
            // Posting on a dead connection completes with a flush, as hardware does.
            let op = match wr.op {
                Op::Send { .. } => Completed::Send,
                Op::Write { .. } => Completed::Write,
                Op::Read { .. } => Completed::Read,
                Op::Recv { .. } => Completed::Recv { len: 0, imm: None },
            };
            self.cq_backlog.push_back(Completion {
                ep,
                wr_id: wr.wr_id,
                op,
                status: Err(WcError::Flushed),
            });
            return Ok(());
        }
        let raw_ep = e.ep;
        let rec = Box::into_raw(Box::new(WrRecord {
            ctx: fi_context2::default(),
            ep,
            wr_id: wr.wr_id,
            op: wr.op,
        }));
        let mut tries = 0;
        loop {
            let ret = self.post_record(raw_ep, rec);
            if ret == 0 {
                self.eps
                    .get_mut(&ep)
                    .expect("checked")
                    .pending
                    .insert(rec as usize);
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
            // SAFETY: the provider refused the record, so it never saw the pointer; we reclaim it once.
            let rec = unsafe { Box::from_raw(rec) };
            return Err(PostError {
                error: err("post", ret as i64),
                wr: WorkRequest {
                    wr_id: rec.wr_id,
                    op: rec.op,
                },
            });
        }
    }

    fn disconnect(&mut self, ep: EndpointId) {
        let Some(e) = self.eps.get_mut(&ep) else {
            return;
        };
        if e.state != EpState::Down {
            // SAFETY: open endpoint.
            unsafe { exs_fi_shutdown(e.ep, 0) };
        }
        if let Some(ev) = self.report_down(ep) {
            self.cm_backlog.push_back(ev);
        }
    }

    fn release(&mut self, ep: EndpointId) {
        // The connection's domain closes once the endpoint and the last exposure of it are gone.
        self.conn_domains.remove(&ep);
        let Some(e) = self.eps.remove(&ep) else {
            return;
        };
        // SAFETY: the wait descriptor belongs to the queue we are about to close.
        let _ = self
            .epoll
            .delete(unsafe { BorrowedFd::borrow_raw(e.cq_fd) });
        // SAFETY: closing the endpoint stops the provider from touching any posted buffer; then the queue.
        unsafe {
            exs_fi_close(&mut (*e.ep).fid);
            exs_fi_close(&mut (*e.cq).fid);
        }
        for key in e.pending {
            // SAFETY: records still pending were leaked into the provider, which can no longer complete them now
            // that the endpoint is closed; each is reclaimed once, dropping its leases.
            drop(unsafe { Box::from_raw(key as *mut WrRecord) });
        }
        self.cq_backlog.retain(|c| c.ep != ep);
    }

    fn poll(&mut self, out: &mut Vec<Completion>, max: usize) -> usize {
        let mut n = 0;
        while n < max {
            let Some(c) = self.cq_backlog.pop_front() else {
                break;
            };
            out.push(c);
            n += 1;
        }
        if n < max {
            // The endpoint list is reused from poll to poll: no allocation on the data path.
            let mut ids = std::mem::take(&mut self.poll_ids);
            ids.clear();
            ids.extend(self.eps.keys().copied());
            for &id in &ids {
                if n >= max {
                    break;
                }
                n += self.read_cq(id, out, max - n);
            }
            self.poll_ids = ids;
        }
        n
    }

    fn poll_cm(&mut self) -> Option<CmEvent> {
        if let Some(ev) = self.cm_backlog.pop_front() {
            return Some(ev);
        }
        self.read_eq()
    }

    fn arm(&mut self) -> Result<bool, TransportError> {
        if !self.cm_backlog.is_empty() || !self.cq_backlog.is_empty() {
            return Ok(false);
        }
        // SAFETY: the event queue and every endpoint's queue are open; fi_trywait only inspects them.
        let ret = unsafe {
            let mut fids: Vec<*mut fid> = Vec::with_capacity(1 + self.eps.len());
            fids.push(&mut (*self.eq).fid);
            for e in self.eps.values() {
                fids.push(&mut (*e.cq).fid);
            }
            exs_fi_trywait(self.dom.fab.fabric, fids.as_mut_ptr(), fids.len() as i32)
        };
        match ret {
            0 => Ok(true),
            r if r == -(FI_EAGAIN as i32) => Ok(false),
            r => Err(err("fi_trywait", r.into())),
        }
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
        self.requests.clear();
        // SAFETY: nothing is bound to the event queue any more.
        unsafe { exs_fi_close(&mut (*self.eq).fid) };
    }
}

#[cfg(test)]
mod tests;

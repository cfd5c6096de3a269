//! Opening a provider's domain: `fi_getinfo` and its hints, the fabric, the context's domain and event queue, and
//! the capabilities the provider reports; libfabric's error codes as transport errors.

use std::collections::VecDeque;
use std::ffi::{CStr, CString};
use std::ptr;
use std::sync::Arc;

use exs_transport::{Capabilities, PendingRequests, TransportError};
use nix::sys::epoll::{Epoll, EpollCreateFlags};
use rustc_hash::FxHashMap;

use crate::completion::{epoll_add, wait_fd_of};
use crate::ffi::*;
use crate::memory::{Domain, Fabric};
use crate::{providers, FabricConfig, FabricTransport};

/// The event queue's entry in the epoll set (completion queues are entered by endpoint id).
pub(crate) const EPOLL_EQ: u64 = u64::MAX;

pub(crate) fn err(call: &str, ret: i64) -> TransportError {
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
    tracing::debug!(call, ret, "libfabric call failed: {}", strerror(ret));
    TransportError::Os {
        call: exs_transport::CallError {
            call: call.into(),
            code: ret,
        },
        kind,
        message: exs_transport::plain_text(&strerror(ret)),
    }
}

/// Serialises the calls that read or build libfabric's process-wide provider tables (`fi_getinfo`, `fi_fabric`).
/// A provider fills its lists lazily at the first of them; two threads opening transports at once (the test
/// suites do) crashed inside `fi_dupinfo` once. They are not on the data path.
pub(crate) static GETINFO: std::sync::Mutex<()> = std::sync::Mutex::new(());

pub(crate) fn getinfo_lock() -> std::sync::MutexGuard<'static, ()> {
    GETINFO.lock().unwrap_or_else(|p| p.into_inner())
}

pub(crate) fn check(call: &str, ret: i32) -> Result<(), TransportError> {
    if ret < 0 {
        Err(err(call, ret.into()))
    } else {
        Ok(())
    }
}

/// An owned `fi_info` list.
pub(crate) struct Info(pub(crate) *mut fi_info);

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
    // Owned from here: an error below frees it (`Hints::drop`), with whichever name pointers are set.
    let mut h = Hints {
        info,
        _strings: Vec::new(),
    };
    let prov = CString::new(provider)
        .map_err(|_| TransportError::Invalid("provider name has a NUL".into()))?;
    let dom = domain
        .map(CString::new)
        .transpose()
        .map_err(|_| TransportError::Invalid("domain name has a NUL".into()))?;
    // SAFETY: `info` and its attribute structs were just allocated by libfabric; we only set plain fields and
    // pointers into the strings, which `h` keeps for as long as the hints live (see `Hints::drop`).
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
        if let Some(d) = &dom {
            (*i.domain_attr).name = d.as_ptr() as *mut _;
        }
    }
    h._strings.push(prov);
    h._strings.extend(dom);
    Ok(h)
}

pub(crate) fn getinfo(
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
    let _tables = getinfo_lock();
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

fn cstr(p: *const std::os::raw::c_char) -> String {
    if p.is_null() {
        return String::new();
    }
    // SAFETY: libfabric strings are NUL-terminated and live as long as their fi_info.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

impl FabricTransport {
    /// Opens a provider's domain. A provider that does not exist gives an error listing those that do.
    pub fn open(cfg: &FabricConfig) -> Result<FabricTransport, TransportError> {
        let info = provider_info(cfg)?;
        // SAFETY: `info.0` is a valid list from fi_getinfo; we use its first entry, which stays alive in `fab`.
        let i = unsafe { &*info.0 };
        // SAFETY: attribute pointers of a returned fi_info are valid.
        let (dattr, fattr) = unsafe { (&*i.domain_attr, &*i.fabric_attr) };
        let provider = cstr(fattr.prov_name);
        let domain_name = cstr(dattr.name);
        let mr_mode = dattr.mr_mode as u64;
        check_domain(&provider, dattr)?;
        let caps = capabilities(i, &provider, &domain_name);
        let mut fabric = ptr::null_mut();
        // SAFETY: fabric_attr of a returned info; out-pointer for the fabric.
        check("fi_fabric", unsafe {
            let _tables = getinfo_lock();
            fi_fabric(i.fabric_attr, &mut fabric, ptr::null_mut())
        })?;
        let fab = Arc::new(Fabric { fabric, info });
        let dom = Domain::open(&fab, mr_mode)?;
        // Before the event queue: a failure here leaves nothing to close.
        let epoll = Epoll::new(EpollCreateFlags::EPOLL_CLOEXEC)
            .map_err(|e| TransportError::os("epoll_create", e.into()))?;
        let eq = open_eq(&fab)?;
        // From here `t` owns the event queue: an error below closes it (`Drop`).
        let t = FabricTransport {
            dom,
            per_conn: mr_mode & FI_MR_LOCAL as u64 == 0,
            conn_domains: FxHashMap::default(),
            provider,
            domain_name,
            eq,
            epoll,
            caps,
            eps: FxHashMap::default(),
            listeners: FxHashMap::default(),
            requests: PendingRequests::default(),
            next_listener: 1,
            cm_backlog: VecDeque::new(),
            cq_backlog: VecDeque::new(),
            ready: crate::ready::Ready::default(),
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
}

/// The provider's info for `cfg`; a provider that does not exist is [`TransportError::NotFound`], with the list of
/// those that do.
fn provider_info(cfg: &FabricConfig) -> Result<Info, TransportError> {
    getinfo(&cfg.provider, cfg.domain.as_deref(), None, None, 0).map_err(|e| {
        if matches!(e, TransportError::Invalid(_)) {
            return e;
        }
        let available = providers();
        if available.iter().any(|p| p == &cfg.provider) {
            e
        } else {
            TransportError::NotFound {
                wanted: format!("libfabric provider {} (EXS_PROVIDER)", cfg.provider),
                available,
            }
        }
    })
}

/// Refuses a domain exs cannot use: keys bound to endpoints, or remote CQ data too short for an immediate.
fn check_domain(provider: &str, dattr: &fi_domain_attr) -> Result<(), TransportError> {
    if dattr.mr_mode as u64 & FI_MR_ENDPOINT as u64 != 0 {
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
    Ok(())
}

/// What the transport offers, from the provider's info `i`.
fn capabilities(i: &fi_info, provider: &str, domain_name: &str) -> Capabilities {
    // SAFETY: attribute pointers of a returned fi_info are valid.
    let (tx, rx, ep_attr) = unsafe { (&*i.tx_attr, &*i.rx_attr, &*i.ep_attr) };
    Capabilities {
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
        // request and a reply, so immediate data beats advert + read at every size it can carry (`exs pump
        // --mode immediate` against `--mode normal`; bench/README.md keeps the comparison). 4 KiB bounds each
        // connection's receive slots (16 credits of immediate-sized buffers). A hardware provider (verbs)
        // keeps the 512-byte default of the verbs backend.
        immediate_default: if provider == "verbs" { 512 } else { 4096 },
        keys_after_connect: false,
    }
}

/// The context's event queue, with a file descriptor to wait on.
fn open_eq(fab: &Fabric) -> Result<*mut fid_eq, TransportError> {
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
    Ok(eq)
}

//! Opening a device: the one rdma_cm resolves for the configured address, its capabilities (queried, and the inline
//! size probed with a queue pair that is never connected), the protection domain, the completion channel and
//! queue, and the event channel; fork safety, once per process.

use std::collections::VecDeque;
use std::ffi::CStr;
use std::net::SocketAddr;
use std::os::fd::{AsRawFd, RawFd};
use std::ptr;
use std::sync::Arc;

use crate::settings::{Atomics, DeviceLimits, VerbsSettings};
use exs_transport::{Capabilities, PendingRequests, TransportError};
use nix::fcntl::{fcntl, FcntlArg, OFlag};
use nix::sys::epoll::{Epoll, EpollCreateFlags};
use nix::sys::socket::SockaddrLike;
use rdma_sys::*;
use rustc_hash::FxHashMap;

use crate::completion::{epoll_add, WAIT_ASYNC, WAIT_CM, WAIT_COMP, WAIT_ROUTED};
use crate::connection::sockaddr;
use crate::cq::CqBudget;
use crate::memory::Pd;
use crate::queue::WrIds;
use crate::routes;
use crate::{device_names, os_err, ret_err, VerbsConfig, VerbsTransport};

/// The largest inline size the probe asks a device for (it halves the request until the device accepts one).
const PROBE_INLINE: u32 = 1024;

/// Issue 15 (fork safety): asks libibverbs to keep registered memory out of children (`MADV_DONTFORK` on every
/// registration, including buffers the dma crate did not allocate itself), once per process, before the first
/// registration. Kernels that keep pinned pages with the parent across fork need nothing
/// (`IBV_FORK_UNNEEDED`); where verbs were already used in this process (say by a libfabric provider) it cannot be
/// turned on any more, which is logged: the dma crate's own `MADV_WIPEONFORK` still covers the buffers it allocates.
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

/// The channels and queue of a transport being opened, destroyed again if opening fails before they are handed
/// over ([`Opening::into_parts`]).
struct Opening {
    ch: *mut rdma_event_channel,
    comp: *mut ibv_comp_channel,
    cq: *mut ibv_cq,
}

impl Opening {
    fn into_parts(mut self) -> (*mut rdma_event_channel, *mut ibv_comp_channel, *mut ibv_cq) {
        let parts = (self.ch, self.comp, self.cq);
        (self.ch, self.comp, self.cq) = (ptr::null_mut(), ptr::null_mut(), ptr::null_mut());
        parts
    }
}

impl Drop for Opening {
    fn drop(&mut self) {
        // SAFETY: each is ours, used by nothing else yet (no queue pair was created on the CQ), destroyed once:
        // the CQ before its completion channel.
        unsafe {
            if !self.cq.is_null() {
                ibv_destroy_cq(self.cq);
            }
            if !self.comp.is_null() {
                ibv_destroy_comp_channel(self.comp);
            }
            if !self.ch.is_null() {
                rdma_destroy_event_channel(self.ch);
            }
        }
    }
}

/// The device rdma_cm resolves for `cfg.addr` (bound through a probe id on `ch`): its context, name and whether it
/// is iWARP.
fn resolve_device(
    ch: *mut rdma_event_channel,
    cfg: &VerbsConfig,
) -> Result<(*mut ibv_context, String, bool), TransportError> {
    let not_found = |why: String| TransportError::NotFound {
        wanted: format!("an RDMA device for {} ({why})", cfg.addr),
        available: device_names(),
    };
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
        return Err(not_found(format!(
            "rdma_create_id: {}",
            std::io::Error::last_os_error()
        )));
    }
    let sa = sockaddr(SocketAddr::new(cfg.addr, 0));
    // SAFETY: valid id; the sockaddr lives across the call.
    let bound = unsafe { rdma_bind_addr(probe, sa.as_ptr() as *mut _) };
    let err = std::io::Error::last_os_error();
    // SAFETY: `probe` is valid; rdma_bind_addr sets its verbs context on success.
    let ctx = unsafe { (*probe).verbs };
    // SAFETY: the probe id is ours; destroying it leaves the device context (owned by librdmacm) open.
    unsafe { rdma_destroy_id(probe) };
    if bound != 0 || ctx.is_null() {
        return Err(not_found(format!(
            "no RDMA device carries this address: {err}"
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
            return Err(not_found(format!(
                "{} is on device {name}, not {want}",
                cfg.addr
            )));
        }
    }
    Ok((
        ctx,
        name,
        transport_type == ibv_transport_type::IBV_TRANSPORT_IWARP,
    ))
}

/// The name of the RDMA device that carries `addr` (rdma_cm binds a probe id to it), or why none does. Opens
/// nothing that outlives the call; `exs::Context::from_env` asks this before it picks verbs on its own.
pub fn device_for(addr: std::net::IpAddr) -> Result<String, TransportError> {
    // SAFETY: creating an event channel has no preconditions; null means failure (errno set).
    let ch = unsafe { rdma_create_event_channel() };
    if ch.is_null() {
        return Err(TransportError::NotFound {
            wanted: format!(
                "an RDMA device for {addr} (rdma_cm: {})",
                std::io::Error::last_os_error()
            ),
            available: device_names(),
        });
    }
    let found = resolve_device(ch, &VerbsConfig::new(addr)).map(|(_, name, _)| name);
    // SAFETY: the channel is ours and its only id (the probe) was destroyed inside `resolve_device`.
    unsafe { rdma_destroy_event_channel(ch) };
    found
}

/// The largest inline payload a reliable-connected queue pair of this device accepts, found by creating (and
/// destroying at once) queue pairs that are never connected: verbs reports it only per queue pair. Each try halves
/// the request; a device that accepts none sends nothing inline. The connections' queue pairs are deeper and
/// wider than the probe's: one refused with this size is asked again with less (`create_fitting_qp`).
fn probe_inline(pd: *mut ibv_pd, cq: *mut ibv_cq) -> u32 {
    let mut want = PROBE_INLINE;
    loop {
        let mut attr: ibv_qp_init_attr = unsafe {
            // SAFETY: plain data, zero is valid before we fill it.
            std::mem::zeroed()
        };
        attr.send_cq = cq;
        attr.recv_cq = cq;
        attr.qp_type = ibv_qp_type::IBV_QPT_RC;
        attr.cap = ibv_qp_cap {
            max_send_wr: 1,
            max_recv_wr: 1,
            max_send_sge: 1,
            max_recv_sge: 1,
            max_inline_data: want,
        };
        // SAFETY: our PD and CQ; `attr` is a valid in/out argument; the QP is destroyed before anything else.
        let qp = unsafe { ibv_create_qp(pd, &mut attr) };
        if !qp.is_null() {
            // SAFETY: the QP was just created, never connected, nothing posted on it.
            unsafe { ibv_destroy_qp(qp) };
            // The provider wrote back what the queue pair got (at least what was asked for).
            return attr.cap.max_inline_data.max(want);
        }
        if want == 0 {
            return 0;
        }
        want = if want > 16 { want / 2 } else { 0 };
    }
}

/// What the device reports, plus the probed inline size.
fn device_limits(
    ctx: *mut ibv_context,
    pd: *mut ibv_pd,
    cq: *mut ibv_cq,
    iwarp: bool,
) -> Result<DeviceLimits, TransportError> {
    let mut attr: ibv_device_attr = unsafe {
        // SAFETY: plain data; zero is a valid bit pattern before the query fills it.
        std::mem::zeroed()
    };
    // SAFETY: open context; `attr` is a valid out-buffer. It returns its error code (errno is not set).
    let rc = unsafe { ibv_query_device(ctx, &mut attr) };
    if rc != 0 {
        return Err(ret_err("ibv_query_device", rc));
    }
    let mut port: ibv_port_attr = unsafe {
        // SAFETY: plain data, as above.
        std::mem::zeroed()
    };
    // SAFETY: open context, port 1 (every device rdma_cm resolves has it); `port` is a valid out-buffer. The
    // ibv_query_port macro's compatibility shim is not in rdma-sys: this is the call it makes.
    // It returns its error code, as ibv_query_device.
    let rc = unsafe { ___ibv_query_port(ctx, 1, &mut port) };
    if rc != 0 {
        return Err(ret_err("ibv_query_port", rc));
    }
    let n = |v: i32| u32::try_from(v).unwrap_or(0);
    Ok(DeviceLimits {
        iwarp,
        vendor_id: attr.vendor_id,
        max_inline: probe_inline(pd, cq),
        max_qp_wr: n(attr.max_qp_wr),
        max_cqe: n(attr.max_cqe),
        max_sge: n(attr.max_sge),
        max_sge_rd: n(attr.max_sge_rd),
        max_msg: u64::from(port.max_msg_sz),
        max_rd_atom: n(attr.max_qp_rd_atom.min(attr.max_qp_init_rd_atom)),
        max_srq_wr: if attr.max_srq > 0 {
            n(attr.max_srq_wr)
        } else {
            0
        },
        atomics: match attr.atomic_cap {
            ibv_atomic_cap::IBV_ATOMIC_HCA => Atomics::Adapter,
            ibv_atomic_cap::IBV_ATOMIC_GLOB => Atomics::Global,
            _ => Atomics::None,
        },
        windows: attr.device_cap_flags & ibv_device_cap_flags::IBV_DEVICE_MEM_WINDOW_TYPE_2B.0 != 0,
    })
}

/// The transport's wait descriptor: an epoll set over the completion channel, the rdma_cm event channel and the
/// device's asynchronous events (see [`crate::events`]), all made non-blocking.
fn wait_set(o: &Opening, ctx: *mut ibv_context) -> Result<Epoll, TransportError> {
    // SAFETY: valid channel pointers and open context; their fds stay open until we destroy the channels (the
    // context's for as long as rdma_cm keeps the device open, which outlives our ids).
    let (comp_fd, ch_fd, async_fd) = unsafe { ((*o.comp).fd, (*o.ch).fd, (*ctx).async_fd) };
    set_nonblocking(comp_fd)?;
    set_nonblocking(ch_fd)?;
    set_nonblocking(async_fd)?;
    let epoll = Epoll::new(EpollCreateFlags::EPOLL_CLOEXEC)
        .map_err(|e| TransportError::os("epoll_create", e.into()))?;
    epoll_add(&epoll, comp_fd, WAIT_COMP)?;
    epoll_add(&epoll, ch_fd, WAIT_CM)?;
    epoll_add(&epoll, async_fd, WAIT_ASYNC)?;
    Ok(epoll)
}

/// What the engine sees of a transport with these settings.
fn capabilities(s: &VerbsSettings) -> Capabilities {
    Capabilities {
        name: format!("verbs/{}", s.device),
        max_inline: s.inline as usize,
        max_message: s.max_message,
        native_write_imm: !s.emulated_imm,
        imm_consumes_recv: true,
        max_send_wr: s.engine_send_wr(),
        max_recv_wr: s.recv_depth,
        max_sge: s.sge,
        max_read_depth: s.read_depth,
        max_private_data: 56,
        max_shared_recv: s.srq_depth,
        rnr_retry: s.rnr_retry,
        // Zero-copy reads win early on RDMA hardware; no hardware was at hand to measure the crossover, so this
        // is UNH-EXS's 512-byte default (the pool's slot size, seed 003, matches it).
        immediate_default: 512,
        keys_after_connect: s.memory_windows,
    }
}

/// The rdma_cm event channel; with no RDMA at all, an error that lists the devices that exist (none).
fn event_channel(cfg: &VerbsConfig) -> Result<*mut rdma_event_channel, TransportError> {
    // SAFETY: creating an event channel has no preconditions; null means failure (errno set).
    let ch = unsafe { rdma_create_event_channel() };
    if ch.is_null() {
        return Err(TransportError::NotFound {
            wanted: format!(
                "an RDMA device for {} (rdma_create_event_channel: {})",
                cfg.addr,
                std::io::Error::last_os_error()
            ),
            available: device_names(),
        });
    }
    Ok(ch)
}

/// The device's limits, probed on a small completion queue of its own: the probe queue pairs need one, and the
/// settings say how large the real one is.
fn probe_limits(
    ctx: *mut ibv_context,
    pd: *mut ibv_pd,
    iwarp: bool,
) -> Result<DeviceLimits, TransportError> {
    // SAFETY: open context; no completion channel.
    let probe_cq = unsafe { ibv_create_cq(ctx, 4, ptr::null_mut(), ptr::null_mut(), 0) };
    if probe_cq.is_null() {
        return Err(os_err("ibv_create_cq"));
    }
    let limits = device_limits(ctx, pd, probe_cq, iwarp);
    // SAFETY: the probe queue pairs on it are destroyed.
    unsafe { ibv_destroy_cq(probe_cq) };
    limits
}

impl VerbsTransport {
    /// Opens the device carrying `cfg.addr`, with `cfg` completed from the environment ([`VerbsConfig::with_env`]).
    /// With no RDMA at all, the error lists the devices that exist (none).
    pub fn open(cfg: &VerbsConfig) -> Result<VerbsTransport, TransportError> {
        fork_safe();
        let cfg = cfg.with_env()?;
        let mut o = Opening {
            ch: event_channel(&cfg)?,
            comp: ptr::null_mut(),
            cq: ptr::null_mut(),
        };
        let (ctx, name, iwarp) = resolve_device(o.ch, &cfg)?;
        // SAFETY: open context.
        let pd = unsafe { ibv_alloc_pd(ctx) };
        if pd.is_null() {
            return Err(os_err("ibv_alloc_pd"));
        }
        // From here the PD is deallocated by its owner when anything fails.
        let pd = Arc::new(Pd(pd));
        // SAFETY: open context.
        o.comp = unsafe { ibv_create_comp_channel(ctx) };
        if o.comp.is_null() {
            return Err(os_err("ibv_create_comp_channel"));
        }
        let limits = probe_limits(ctx, pd.0, iwarp)?;
        let settings = VerbsSettings::decide(&name, limits, &cfg)?;
        // SAFETY: open context and completion channel.
        o.cq = unsafe { ibv_create_cq(ctx, settings.cq_depth as i32, ptr::null_mut(), o.comp, 0) };
        if o.cq.is_null() {
            return Err(os_err("ibv_create_cq"));
        }
        // SAFETY: the CQ was just created; the provider wrote the entries it got (at least those asked for).
        let cqe = unsafe { (*o.cq).cqe };
        let cq_budget = CqBudget::new(
            u32::try_from(cqe).unwrap_or(settings.cq_depth),
            settings.limits.max_cqe,
        );
        let epoll = wait_set(&o, ctx)?;
        let mailbox = routes::Mailbox::new().map_err(|e| TransportError::os("eventfd", e))?;
        epoll_add(&epoll, mailbox.fd().as_raw_fd(), WAIT_ROUTED)?;
        raise_memlock_limit();
        let (ch, comp, cq) = o.into_parts();
        let t = VerbsTransport {
            cfg,
            ch,
            ctx,
            pd,
            comp,
            cq,
            cq_budget,
            epoll,
            caps: capabilities(&settings),
            qp_inline: settings.inline,
            settings,
            eps: FxHashMap::default(),
            qpn: FxHashMap::default(),
            recvs: FxHashMap::default(),
            kept_qp: false,
            srq: ptr::null_mut(),
            ids: WrIds::default(),
            listeners: FxHashMap::default(),
            requests: PendingRequests::default(),
            next_listener: 1,
            cm_backlog: VecDeque::new(),
            cq_backlog: VecDeque::new(),
            wcs: (0..32)
                // SAFETY: plain data; zero is a valid bit pattern (ibv_poll_cq fills what it returns).
                .map(|_| unsafe { std::mem::zeroed() })
                .collect(),
            one: Vec::with_capacity(1),
            chain: Default::default(),
            device_failed: false,
            mailbox,
        };
        routes::enter(t.cq, &t.mailbox);
        // SAFETY: `cq` was just created.
        let rc = unsafe { ibv_req_notify_cq(t.cq, 0) };
        if rc != 0 {
            // Dropping `t` destroys what was opened.
            return Err(ret_err("ibv_req_notify_cq", rc));
        }
        tracing::debug!(device = %name, settings = ?t.settings, "verbs device open");
        Ok(t)
    }
}

/// Raises this process's soft limit on locked memory to its hard limit, once. Registrations pin memory, and some
/// drivers (siw) count every pinned page against `RLIMIT_MEMLOCK` even for root; the hard limit is what the
/// administrator allows, so nothing beyond it is taken. A registration that still does not fit says so
/// ([`crate::memory::reg_mr`]).
fn raise_memlock_limit() {
    use nix::sys::resource::{getrlimit, setrlimit, Resource};
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        if let Ok((soft, hard)) = getrlimit(Resource::RLIMIT_MEMLOCK) {
            if soft < hard {
                if let Err(e) = setrlimit(Resource::RLIMIT_MEMLOCK, hard, hard) {
                    tracing::debug!(%e, "could not raise the locked-memory limit to its hard limit");
                }
            }
        }
    });
}

//! Opening a device: the one rdma_cm resolves for the configured address, its capabilities, the protection
//! domain, the completion channel and queue, and the event channel; fork safety, once per process.

use std::collections::{HashMap, VecDeque};
use std::ffi::CStr;
use std::net::SocketAddr;
use std::os::fd::RawFd;
use std::ptr;
use std::sync::Arc;

use exs_transport::{Capabilities, PendingRequests, TransportError};
use nix::fcntl::{fcntl, FcntlArg, OFlag};
use nix::sys::epoll::{Epoll, EpollCreateFlags};
use nix::sys::socket::SockaddrLike;
use rdma_sys::*;

use crate::completion::epoll_add;
use crate::connection::sockaddr;
use crate::memory::Pd;
use crate::queue::WrIds;
use crate::{device_names, os_err, VerbsConfig, VerbsTransport};

const SQ_DEPTH: u32 = 512;
const RQ_DEPTH: u32 = 1024;
const CQ_DEPTH: i32 = 8192;
/// Most buffers the shared receive queue holds.
const SRQ_DEPTH: u32 = 16384;

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
        let has_windows =
            attr.device_cap_flags & ibv_device_cap_flags::IBV_DEVICE_MEM_WINDOW_TYPE_2B.0 != 0
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
            emulate,
            windows,
            read_sinks: cfg.read_sink_registration.unwrap_or(iwarp),
            sq_share,
            rd_atom,
            eps: HashMap::new(),
            qpn: HashMap::new(),
            recvs: HashMap::new(),
            srq: ptr::null_mut(),
            ids: WrIds::default(),
            listeners: HashMap::new(),
            requests: PendingRequests::default(),
            next_listener: 1,
            cm_backlog: VecDeque::new(),
            cq_backlog: VecDeque::new(),
            unacked_cq_events: 0,
        };
        // SAFETY: `cq` was just created.
        unsafe { ibv_req_notify_cq(t.cq, 0) };
        tracing::debug!(device = %name, iwarp, emulate, "verbs device open");
        Ok(t)
    }
}

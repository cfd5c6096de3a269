//! Opening a provider's domain: the fabric, the context's domain and event queue, and the capabilities the provider
//! reports (`fi_getinfo` and the error codes: [`crate::call`]).

use std::collections::VecDeque;
use std::ptr;
use std::sync::Arc;

use exs_transport::{Capabilities, PendingRequests, TransportError};
use nix::sys::epoll::{Epoll, EpollCreateFlags};
use rustc_hash::FxHashMap;

use crate::call::{check, cstr, epoll_add, getinfo, getinfo_lock, wait_fd_of, Info};
use crate::ffi::*;
use crate::memory::{Domain, Fabric};
use crate::ready::EPOLL_EQ;
use crate::{providers, CqWait, FabricConfig, FabricTransport};

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
        let cq_wait = cq_wait_for(cfg.cq_wait, &provider, fattr.prov_version);
        check_domain(&provider, dattr)?;
        let caps = capabilities(i, &provider, &domain_name);
        let mut fabric = ptr::null_mut();
        // SAFETY: fabric_attr of a returned info; out-pointer for the fabric.
        check("fi_fabric", unsafe {
            let _tables = getinfo_lock();
            exs_fi_fabric(i.fabric_attr, &mut fabric, ptr::null_mut())
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
            fd_owners: FxHashMap::default(),
            caps,
            eps: FxHashMap::default(),
            ep_fids: FxHashMap::default(),
            listeners: FxHashMap::default(),
            requests: PendingRequests::default(),
            next_listener: 1,
            cm_backlog: VecDeque::new(),
            cq_backlog: VecDeque::new(),
            records: Default::default(),
            ready: crate::ready::Ready::default(),
            cq_wait,
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

impl FabricConfig {
    /// The wait object a transport opened with this configuration gives its completion queues: `cq_wait`, but
    /// [`CqWait::Fd`] for [`CqWait::PollFd`] on any provider but libfabric 1.17's tcp (see [`CqWait::PollFd`]).
    /// Asks libfabric for the provider (`fi_getinfo`).
    pub fn effective_cq_wait(&self) -> Result<CqWait, TransportError> {
        let info = provider_info(self)?;
        // SAFETY: `info.0` is a valid list from fi_getinfo; its first entry's attributes are valid while it lives.
        let fattr = unsafe { &*(*info.0).fabric_attr };
        Ok(cq_wait_for(
            self.cq_wait,
            &cstr(fattr.prov_name),
            fattr.prov_version,
        ))
    }
}

/// The wait object the queues are opened with: [`CqWait::PollFd`] only on the provider whose code its use was
/// checked against, libfabric 1.17's tcp (provider version 117.x). What the transport relies on there (reading the
/// event queue moves no completion queue's data; a queue's descriptors are its signal and its connection's socket)
/// is that provider's own doing, not the API's, and a later tcp provider runs every domain's progress when the event
/// queue is read. Elsewhere [`CqWait::Fd`], the wait object the API describes.
pub(crate) fn cq_wait_for(asked: CqWait, provider: &str, prov_version: u32) -> CqWait {
    let checked = provider == "tcp" && prov_version >> 16 == 117;
    if asked == CqWait::PollFd && !checked {
        tracing::debug!(
            provider,
            major = prov_version >> 16,
            minor = prov_version & 0xffff,
            "completion queues wait with FI_WAIT_FD: FI_WAIT_POLLFD is used only with libfabric 1.17's tcp provider"
        );
        return CqWait::Fd;
    }
    asked
}

/// The provider's info for `cfg`; a provider that does not exist is [`TransportError::NotFound`], with the list of
/// those that do.
fn provider_info(cfg: &FabricConfig) -> Result<Info, TransportError> {
    getinfo(&cfg.provider, cfg.domain.as_deref(), None, None, 0).map_err(|e| {
        // A bad argument, or no libfabric at all: said as it is, not as a provider missing from an empty list.
        if matches!(
            e,
            TransportError::Invalid(_) | TransportError::Unsupported(_)
        ) {
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
        // The software providers leave a message no receive waits for in the socket until one is posted. The
        // verbs provider may be on iWARP, which has no such retry (not told apart here: it matters only to a
        // shared pool, which this backend does not use).
        rnr_retry: provider != "verbs",
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

#[cfg(test)]
mod tests {
    use super::*;

    /// libfabric's `FI_VERSION(major, minor)`.
    fn version(major: u32, minor: u32) -> u32 {
        (major << 16) | minor
    }

    #[test]
    fn queues_wait_on_a_pollfd_list_only_with_the_provider_that_was_checked() {
        let tcp_1_17 = version(117, 0);
        assert_eq!(cq_wait_for(CqWait::PollFd, "tcp", tcp_1_17), CqWait::PollFd);
        assert_eq!(
            cq_wait_for(CqWait::PollFd, "tcp", version(117, 10)),
            CqWait::PollFd
        );
        // A later tcp provider, or another provider: the API's wait object.
        assert_eq!(
            cq_wait_for(CqWait::PollFd, "tcp", version(118, 0)),
            CqWait::Fd
        );
        assert_eq!(
            cq_wait_for(CqWait::PollFd, "tcp", version(200, 0)),
            CqWait::Fd
        );
        assert_eq!(cq_wait_for(CqWait::PollFd, "sockets", tcp_1_17), CqWait::Fd);
        // The other settings stay as asked.
        assert_eq!(cq_wait_for(CqWait::Fd, "tcp", tcp_1_17), CqWait::Fd);
        assert_eq!(
            cq_wait_for(CqWait::None, "tcp", version(118, 0)),
            CqWait::None
        );
    }

    #[test]
    fn the_installed_tcp_provider_is_the_one_whose_pollfd_use_was_checked() {
        let asked = FabricConfig::default();
        assert_eq!(asked.effective_cq_wait().unwrap(), CqWait::PollFd);
        // The transport tests of the pollfd wait (tests.rs) run on this library: if it is not 1.17's, they test the
        // fallback, which this says loudly.
        let _serial = crate::tests::serial();
        let t = FabricTransport::open(&FabricConfig::default()).expect("open tcp");
        assert_eq!(
            t.cq_wait,
            CqWait::PollFd,
            "the installed libfabric's tcp provider is not 1.17's: queues wait with FI_WAIT_FD"
        );
    }
}

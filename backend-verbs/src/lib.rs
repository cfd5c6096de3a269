//! exs over rdma-core: verbs for the data path, rdma_cm for connections (through `rdma-sys`).
//!
//! Works on any RDMA device rdma-core drives: InfiniBand and RoCE adapters (Mellanox), iWARP adapters (Chelsio),
//! Soft-RoCE (rxe) and soft-iWARP (siw). The device is the one rdma_cm resolves for the configured local address.
//!
//! ## Mapping
//! * One protection domain, one completion channel and one completion queue per transport; a reliable-connected
//!   queue pair per connection, created and connected through rdma_cm (address and route resolution, then
//!   `rdma_connect` with our handshake as private data; `rdma_accept` on the passive side).
//! * Waiting: an epoll set over the completion channel, the rdma_cm event channel and the device's asynchronous
//!   events (logged: see `src/events.rs`). Arming is
//!   `ibv_req_notify_cq` followed by one more poll, so a completion that slipped in between is not slept through;
//!   it fails while an rdma_cm event waits, so a successful one also says the engine need not look for them.
//! * Posting: a batch of requests is chained into one `ibv_post_send` (one doorbell). Only every
//!   [`SIGNAL_EVERY`]-th request and the last of each batch is signalled; a signalled completion also completes the
//!   unsignalled requests before it (a reliable connection completes in order), so the send queue never holds
//!   more than its depth and every request gets its completion. A chain the device refuses part-way leaves the
//!   requests before the refused one on the device: their records (and leases) stay until they complete, and
//!   only the requests that never reached it come back.
//! * Identifiers: every request the device carries has an identifier no other request of the transport ever
//!   had (see `src/queue.rs`), so a late completion of a destroyed queue pair whose number went to a new one cannot
//!   complete the new one's requests.
//! * Memory: the base registration grants local access only, iWARP included (there the sink of an RDMA read gets
//!   remote write from a registration of its own for the read's duration); a remote key is a memory window bound
//!   to one queue pair, or a registration of exactly the exposed range, revoked when the exposure is dropped
//!   (least exposure).
//! * Write-with-immediate: native where the device has it; otherwise (siw, some iWARP adapters, or forced by
//!   configuration) an RDMA write followed by a send of 8 bytes, a magic and the immediate (inline where the
//!   device sends 8 bytes inline, else from a small registered slab per connection), which the receiving side
//!   turns back into an immediate. Both sides' protocol code sees the same thing. A zero-length send with an
//!   immediate (a crafted peer's) takes the same form there.
//! * Settings: from the device's capabilities (see [`settings`]), overridable in [`VerbsConfig::limits`] and the
//!   environment (`EXS_VERBS_*`); [`VerbsTransport::settings`] says what was chosen.
//!
//! All `unsafe` of the verbs side is here, each block with its invariant.

use std::collections::VecDeque;
use std::ffi::CStr;
use std::net::{IpAddr, SocketAddr};
use std::os::fd::{AsFd, OwnedFd};
use std::sync::Arc;

use exs_dma::{DmaBuf, Lease};
use exs_transport::{
    Capabilities, CmEvent, Completion, EndpointId, Exposure, ListenerId, PendingRequests,
    PostError, Registrar, Registration, RemoteAccess, RequestId, Transport, TransportError,
    WorkRequest,
};
use nix::sys::epoll::Epoll;
use rdma_sys::*;
use rustc_hash::FxHashMap;

mod cm;
mod completion;
mod connection;
mod cq;
mod device;
mod emulated;
mod events;
mod expose;
mod memory;
mod post;
mod queue;
mod record;
mod routes;
pub mod settings;
use connection::Ep;
pub use device::device_for;
use memory::Pd;
use post::{RecvRec, Refused};
use queue::WrIds;
pub use queue::SIGNAL_EVERY;
pub use settings::{Atomics, DeviceLimits, VerbsLimits, VerbsSettings};

const TAG_EP: usize = 1 << 40;
const TAG_LISTENER: usize = 2 << 40;
const RESOLVE_TIMEOUT_MS: i32 = 2000;

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
    /// Give the local sink of each RDMA read a registration of its own with remote write, for the read's
    /// duration: iWARP adapters check a read's sink for remote write, and base registrations grant no remote access
    /// at all. `None` (default): on iWARP devices; `Some(true)`: always (tests that path on other devices);
    /// `Some(false)`: never, refused where the device checks sinks (allowed on siw, which checks a read's sink for
    /// local write only: a registration saved per read, but each read request then carries a base registration's
    /// key, which a siw peer can invalidate; [`DeviceLimits::read_sink_needs_remote_write`]).
    pub read_sink_registration: Option<bool>,
    /// Ask the peer's adapter to retry a message that finds no receive posted (receiver-not-ready, retried for
    /// ever): `None` (default) where the device can (not on iWARP, which has no such retry), `Some(false)` never,
    /// so that such a message fails its connection at once, as on iWARP (tests that path on InfiniBand/RoCE).
    pub rnr_retry: Option<bool>,
    /// Overrides of the queue depths, inline size, scatter/gather entries and largest message (default: the
    /// device's, within exs's defaults).
    pub limits: VerbsLimits,
}

impl VerbsConfig {
    /// A configuration for the device carrying `addr`.
    pub fn new(addr: IpAddr) -> Self {
        VerbsConfig {
            addr,
            device: None,
            emulate_write_imm: false,
            memory_windows: None,
            read_sink_registration: None,
            rnr_retry: None,
            limits: VerbsLimits::default(),
        }
    }

    /// This configuration with what it leaves unset taken from the environment: `EXS_VERBS_EMULATE_IMM=1`
    /// (write-with-immediate emulated), `EXS_VERBS_WINDOWS=0|1`, `EXS_VERBS_READ_SINKS=0|1`,
    /// `EXS_VERBS_RNR_RETRY=0|1` and the limits
    /// (`EXS_VERBS_INLINE`, `_SEND_DEPTH`, `_RECV_DEPTH`, `_CQ_DEPTH`, `_SRQ_DEPTH`, `_SGE`, `_MAX_MESSAGE`,
    /// `_READ_DEPTH`). [`VerbsTransport::open`] applies it, so every process of a deployment (and each child
    /// process of a test) obeys the same variables.
    pub fn with_env(&self) -> Result<VerbsConfig, TransportError> {
        self.with_vars(|k| std::env::var(k).ok().filter(|v| !v.is_empty()))
    }

    /// [`VerbsConfig::with_env`] over any source of variables.
    pub fn with_vars(
        &self,
        var: impl Fn(&str) -> Option<String>,
    ) -> Result<VerbsConfig, TransportError> {
        // `0` or `1` (`false`/`true`, `no`/`yes`, `off`/`on` too, in any case); anything else is refused, naming the
        // variable: `EXS_VERBS_WINDOWS=false` turned windows on when every value but `0` meant yes.
        let flag = |k: &str| -> Result<Option<bool>, TransportError> {
            // Empty is unset, as for the limits.
            let Some(v) = var(k).filter(|v| !v.trim().is_empty()) else {
                return Ok(None);
            };
            match v.trim().to_ascii_lowercase().as_str() {
                "1" | "true" | "yes" | "on" => Ok(Some(true)),
                "0" | "false" | "no" | "off" => Ok(Some(false)),
                _ => Err(TransportError::Invalid(format!("{k}={v}: 0 or 1"))),
            }
        };
        let emulate = flag("EXS_VERBS_EMULATE_IMM")?;
        let windows = flag("EXS_VERBS_WINDOWS")?;
        let sinks = flag("EXS_VERBS_READ_SINKS")?;
        let rnr = flag("EXS_VERBS_RNR_RETRY")?;
        Ok(VerbsConfig {
            addr: self.addr,
            device: self.device.clone(),
            emulate_write_imm: self.emulate_write_imm || emulate == Some(true),
            memory_windows: self.memory_windows.or(windows),
            read_sink_registration: self.read_sink_registration.or(sinks),
            rnr_retry: self.rnr_retry.or(rnr),
            limits: self.limits.clone().or(VerbsLimits::from_vars(&var)?),
        })
    }
}

/// A call that failed and set `errno` (rdma_cm's calls, and verbs' that return a pointer).
fn os_err(call: &str) -> TransportError {
    TransportError::os(call, std::io::Error::last_os_error())
}

/// A call that returns its error code rather than setting `errno` (`ibv_query_device`, `ibv_req_notify_cq`, the
/// posts): positive, or negative on some providers (siw).
pub(crate) fn ret_err(call: &str, rc: i32) -> TransportError {
    TransportError::os(call, std::io::Error::from_raw_os_error(rc.saturating_abs()))
}

/// A failed call told in our own words (`message`), its call and code kept as the error's `source()`.
pub(crate) fn call_err(
    call: &str,
    code: i32,
    kind: std::io::ErrorKind,
    message: String,
) -> TransportError {
    tracing::debug!(call, code, %message, "call failed");
    TransportError::Os {
        call: exs_transport::CallError {
            call: call.into(),
            code: code.into(),
        },
        kind,
        message,
    }
}

/// One rdma-core device as an exs [`Transport`].
pub struct VerbsTransport {
    cfg: VerbsConfig,
    ch: *mut rdma_event_channel,
    ctx: *mut ibv_context,
    pd: Arc<Pd>,
    comp: *mut ibv_comp_channel,
    cq: *mut ibv_cq,
    /// What the completion queue holds and what may still complete into it (see [`cq`]).
    cq_budget: cq::CqBudget,
    epoll: Epoll,
    caps: Capabilities,
    /// What this transport uses (emulated immediates, memory windows, read sinks, depths, inline size).
    settings: VerbsSettings,
    /// The inline size queue pairs are created with: the settings' at first, lowered for good when the device
    /// refuses a queue pair with it (`connection::create_fitting_qp`).
    qp_inline: u32,
    eps: FxHashMap<EndpointId, Ep>,
    qpn: FxHashMap<u32, EndpointId>,
    /// Posted receives: the endpoint they were posted on, or `None` for the shared receive queue.
    recvs: FxHashMap<u64, (Option<EndpointId>, RecvRec)>,
    /// A released endpoint's queue pair outlived it (the device would not destroy it): it may still take shared
    /// receives and write into them, so they are never given back (see the drop).
    kept_qp: bool,
    /// The shared receive queue (seed 003), once the engine asked for it; QPs created after use it.
    srq: *mut ibv_srq,
    /// Identifiers of work requests, never reused (see [`queue`]).
    ids: WrIds,
    listeners: FxHashMap<ListenerId, *mut rdma_cm_id>,
    /// Connection requests handed to the engine and not yet accepted or rejected, with their listener and the read
    /// depths they offer.
    requests: PendingRequests<(*mut rdma_cm_id, connection::ReadDepths)>,
    next_listener: u32,
    cm_backlog: VecDeque<CmEvent>,
    /// Completions ready for the engine; `true` marks a shared receive (kept when its endpoint is released, so
    /// the engine gets its buffer back).
    cq_backlog: VecDeque<(Completion, bool)>,
    /// Where `drain_cq` polls completions into (allocated once).
    wcs: Vec<ibv_wc>,
    /// The list a single [`Transport::post`](exs_transport::Transport::post) goes through (allocated once).
    one: Vec<WorkRequest>,
    /// The chain a post of sends builds, kept for the next post (see [`post::Chain`]).
    chain: post::Chain,
    /// The device or its completion queue failed (see [`VerbsTransport::fail_device`]).
    device_failed: bool,
    /// Where errors of this transport's queues that another transport read arrive (see [`routes`]).
    mailbox: Arc<routes::Mailbox>,
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

impl VerbsTransport {
    /// The settings chosen for this device, and what the device reported.
    pub fn settings(&self) -> &VerbsSettings {
        &self.settings
    }

    /// The RDMA read depths a connection agreed with its peer, as (initiator depth, responder resources): reads
    /// this side may have outstanding at the peer, and reads of the peer it holds at once. `None` for an unknown
    /// endpoint; zeros until the connection is accepted or established.
    pub fn read_depths(&self, ep: EndpointId) -> Option<(u32, u32)> {
        let r = self.eps.get(&ep)?.reads;
        Some((u32::from(r.initiator), u32::from(r.responder)))
    }
}

impl Transport for VerbsTransport {
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
        self.refuse_if_failed()?;
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
        self.refuse_if_failed()?;
        // Refused now rather than as a failed connect once the route is resolved and the receives posted.
        recvs.iter().try_for_each(|w| w.op.check_leases())?;
        self.start_connect(ep, addr, private, recvs)
    }

    fn accept(
        &mut self,
        request: RequestId,
        ep: EndpointId,
        private: &[u8],
        recvs: Vec<WorkRequest>,
    ) -> Result<(), TransportError> {
        self.refuse_if_failed()?;
        recvs.iter().try_for_each(|w| w.op.check_leases())?;
        self.accept_request(request, ep, private, recvs)
    }

    fn reject(&mut self, request: RequestId) {
        if let Some((_, (id, _))) = self.requests.take(request) {
            Self::reject_id(id);
        }
    }

    /// A request the device took in part (see `post_sends`) is not refused: it cannot come back while the device
    /// may read its memory, so it completes with an error instead, its connection down.
    fn post(&mut self, ep: EndpointId, wr: WorkRequest) -> Result<(), PostError> {
        // One request through the batch path, in a list the transport keeps (no allocation per post).
        let mut one = std::mem::take(&mut self.one);
        one.push(wr);
        let result = self.post_inner(ep, &mut one);
        one.clear();
        self.one = one;
        match result {
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
        let result = self.post_inner(ep, wrs).map_err(|r| r.error);
        wrs.clear();
        result
    }

    fn create_shared_recv(&mut self, depth: u32) -> Result<(), TransportError> {
        self.create_srq(depth)
    }

    fn post_shared_recv(&mut self, wrs: &mut Vec<WorkRequest>) -> Result<(), TransportError> {
        self.post_srq_recvs(wrs)
    }

    fn disconnect(&mut self, ep: EndpointId) {
        self.start_disconnect(ep)
    }

    fn release(&mut self, ep: EndpointId) {
        self.release_ep(ep)
    }

    fn poll(&mut self, out: &mut Vec<Completion>, max: usize) -> usize {
        self.poll_cq(out, max)
    }

    fn poll_cm(&mut self) -> Option<CmEvent> {
        self.next_cm_event()
    }

    fn arm(&mut self) -> Result<bool, TransportError> {
        self.arm_wait()
    }

    fn arm_covers_cm(&self) -> bool {
        true
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
        for (_, (id, _)) in self.requests.take_all() {
            Self::reject_id(id);
        }
        let ls: Vec<ListenerId> = self.listeners.keys().copied().collect();
        for l in ls {
            self.close_listener(l);
        }
        routes::leave(self.srq);
        let srq_gone = self.srq.is_null() || {
            // SAFETY: every QP attached to it was destroyed above, unless the device kept one (then this fails);
            // the PD outlives it (we hold an Arc).
            let rc = unsafe { ibv_destroy_srq(self.srq) };
            if rc != 0 {
                tracing::error!(
                    rc,
                    "ibv_destroy_srq failed; its receive buffers are kept for the process's life"
                );
            }
            rc == 0
        };
        if self.kept_qp || !srq_gone {
            // A queue pair the device kept may still take a shared receive and write into it: none goes back.
            for (_, (_, rec)) in self.recvs.drain() {
                rec.sge.mark_kept_for_good();
                std::mem::forget(rec);
            }
        }
        // Otherwise the hardware can no longer touch any posted buffer: the leases go back.
        self.recvs.clear();
        // Its address may be another queue's next.
        routes::leave(self.cq);
        // SAFETY: no QP uses the CQ any more; every channel event read was acknowledged when read (see
        // `arm_wait`); the channels are ours.
        unsafe {
            ibv_destroy_cq(self.cq);
            ibv_destroy_comp_channel(self.comp);
            rdma_destroy_event_channel(self.ch);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::error::Error;

    /// `EXS_VERBS_WINDOWS=false` turned memory windows on: every value but `0` meant yes. Words mean what they say
    /// now, and a value that is neither is refused, naming the variable.
    #[test]
    fn verbs_flags_read_words_and_refuse_anything_else() {
        let with = |k: &'static str, v: &'static str| {
            VerbsConfig::new([127, 0, 0, 1].into())
                .with_vars(move |name| (name == k).then(|| v.to_string()))
        };
        for (v, want) in [
            ("0", false),
            ("false", false),
            ("Off", false),
            ("1", true),
            (" yes ", true),
        ] {
            let c = with("EXS_VERBS_WINDOWS", v).unwrap();
            assert_eq!(c.memory_windows, Some(want), "{v:?}");
            let c = with("EXS_VERBS_READ_SINKS", v).unwrap();
            assert_eq!(c.read_sink_registration, Some(want), "{v:?}");
            let c = with("EXS_VERBS_RNR_RETRY", v).unwrap();
            assert_eq!(c.rnr_retry, Some(want), "{v:?}");
            assert_eq!(
                with("EXS_VERBS_EMULATE_IMM", v).unwrap().emulate_write_imm,
                want
            );
        }
        let e = with("EXS_VERBS_WINDOWS", "maybe").unwrap_err();
        assert!(e.to_string().contains("EXS_VERBS_WINDOWS=maybe"), "{e}");
    }

    /// The posts report what `ibv_post_send` and `ibv_post_recv` return (through `post_error`): a positive code
    /// (rxe, mlx5) or a negative one (siw), never errno, which these calls do not set.
    #[test]
    fn a_post_that_returns_its_error_code_is_reported_with_that_code_positive_or_negative() {
        for rc in [libc::ENOMEM, -libc::ENOMEM] {
            let e = post::post_error("ibv_post_send", rc);
            assert_eq!(
                e.source().map(|s| s.to_string()).as_deref(),
                Some("ibv_post_send returned 12")
            );
            assert_eq!(e.io_kind(), std::io::ErrorKind::OutOfMemory);
        }
    }
}

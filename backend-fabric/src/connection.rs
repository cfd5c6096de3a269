//! Connections: listeners, endpoints (each with its own completion queue, in the connection's domain) made to
//! connect or to accept a request, refusing requests, disconnecting and releasing.

use std::ffi::c_void;
use std::net::SocketAddr;
use std::ptr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use exs_transport::{
    CmEvent, ConnectFailure, EndpointId, ListenerId, RequestId, TransportError, WorkRequest,
};
use rustc_hash::FxHashSet;

use crate::call::{both_failed, check, epoll_add, err, getinfo, wait_fd_of, Info};
use crate::ffi::*;
use crate::memory::Domain;
use crate::record::WrRecord;
use crate::wait::{pollfds_of, EpWait};
use crate::{sockaddr, CqWait, FabricTransport};

/// A closing listener's event queue is read until no request for it came for this long (`settle_requests`).
const SETTLE_QUIET: Duration = Duration::from_millis(2);
/// A closing listener's event queue is read for this long at most.
const SETTLE_MAX: Duration = Duration::from_millis(20);
/// The pause between two reads meanwhile.
const SETTLE_PAUSE: Duration = Duration::from_micros(200);

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

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum EpState {
    /// `fi_connect` called, `FI_CONNECTED` not come yet.
    Connecting,
    /// `fi_accept` called, `FI_CONNECTED` not come yet: a failure now is the connection going down (the trait's
    /// `accept` ends with `Established` or `Disconnected`), not a failed connect.
    Accepting,
    Connected,
    Down,
}

pub(crate) struct Ep {
    /// The domain the endpoint and its queue live in (closed after them).
    dom: Arc<Domain>,
    pub(crate) ep: *mut fid_ep,
    pub(crate) cq: *mut fid_cq,
    /// The queue's wait object, as the transport's epoll set holds it (see [`crate::wait`]).
    pub(crate) wait: EpWait,
    pub(crate) pending: FxHashSet<usize>,
    pub(crate) state: EpState,
    pub(crate) reported_down: bool,
    pub(crate) local: Option<SocketAddr>,
    pub(crate) peer: Option<SocketAddr>,
    /// Its place in the hot set (see [`crate::ready`]).
    pub(crate) ready: crate::ready::EpReady,
}

impl FabricTransport {
    /// Opens an endpoint and its completion queue. On error, `EpError::opened` says whether an endpoint was
    /// opened from `info` (and closed again): from a connection request's info, that endpoint took the
    /// connection over, so the request is no longer the provider's to refuse.
    fn create_ep(&mut self, info: *mut fi_info, id: EndpointId) -> Result<Ep, EpError> {
        let dom = self.domain_for(id).map_err(EpError::before)?;
        let mut ep = ptr::null_mut();
        // Its number, for a debugger's eyes: exs never reads a context back (event-queue entries are matched to
        // endpoints by address, `ep_fids`).
        let ctx = id.0 as usize as *mut c_void;
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
        let close_ep = |ep: *mut fid_ep| {
            // SAFETY: the endpoint was opened by our caller and is not used elsewhere.
            unsafe { exs_fi_close(&mut (*ep).fid) };
        };
        let (cq, kind) = match self.open_cq(&dom, ctx) {
            Ok(cq) => cq,
            Err(e) => {
                close_ep(ep);
                return Err(e);
            }
        };
        let wait = match self.bind_and_enable(ep, cq, kind, id) {
            Ok(w) => w,
            Err(e) => {
                close_ep(ep);
                // SAFETY: the queue was opened above and nothing is bound to it any more (its endpoint is closed).
                unsafe { exs_fi_close(&mut (*cq).fid) };
                return Err(e);
            }
        };
        Ok(Ep {
            dom,
            ep,
            cq,
            wait,
            pending: FxHashSet::default(),
            state: EpState::Connecting,
            reported_down: false,
            local: None,
            peer: None,
            ready: Default::default(),
        })
    }

    /// A completion queue for one endpoint (sends and receives), with the wait object the transport asks for
    /// (a provider that refuses `FI_WAIT_POLLFD` gets `FI_WAIT_FD`), and the kind it was opened with.
    fn open_cq(
        &self,
        dom: &Domain,
        ctx: *mut c_void,
    ) -> Result<(*mut fid_cq, CqWait), TransportError> {
        let refused =
            |ret: i32| [FI_ENOSYS, FI_EOPNOTSUPP, FI_EINVAL].contains(&ret.unsigned_abs());
        match self.open_cq_with(dom, ctx, self.cq_wait) {
            Err(ret) if self.cq_wait == CqWait::PollFd && refused(ret) => {
                static SAID: std::sync::Once = std::sync::Once::new();
                SAID.call_once(|| {
                    tracing::info!(
                        provider = %self.provider,
                        "the provider refuses FI_WAIT_POLLFD completion queues ({}): they wait with FI_WAIT_FD",
                        strerror(ret.into())
                    )
                });
                let cq = self
                    .open_cq_with(dom, ctx, CqWait::Fd)
                    .map_err(|ret| err("fi_cq_open", ret.into()))?;
                Ok((cq, CqWait::Fd))
            }
            r => r
                .map(|cq| (cq, self.cq_wait))
                .map_err(|ret| err("fi_cq_open", ret.into())),
        }
    }

    fn open_cq_with(
        &self,
        dom: &Domain,
        ctx: *mut c_void,
        kind: CqWait,
    ) -> Result<*mut fid_cq, i32> {
        let size = (self.caps.max_send_wr + self.caps.max_recv_wr) as usize;
        let mut attr = fi_cq_attr {
            size,
            format: fi_cq_format_FI_CQ_FORMAT_DATA,
            wait_obj: match kind {
                CqWait::PollFd => fi_wait_obj_FI_WAIT_POLLFD,
                CqWait::Fd => fi_wait_obj_FI_WAIT_FD,
                CqWait::None => fi_wait_obj_FI_WAIT_NONE,
            },
            ..Default::default()
        };
        let mut cq = ptr::null_mut();
        // SAFETY: open domain; attr lives across the call.
        let ret = unsafe { exs_fi_cq_open(dom.domain, &mut attr, &mut cq, ctx) };
        if ret < 0 {
            return Err(ret);
        }
        Ok(cq)
    }

    /// Binds `ep` to the transport's event queue and to `cq`, enables it, and enters `cq`'s wait object (if it
    /// has one, of `kind`) in the transport's epoll set under `id`. On error the caller closes both.
    fn bind_and_enable(
        &mut self,
        ep: *mut fid_ep,
        cq: *mut fid_cq,
        kind: CqWait,
        id: EndpointId,
    ) -> Result<EpWait, TransportError> {
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
            return Err(err("fi_ep_bind", r.into()));
        }
        // SAFETY: bound endpoint.
        let r = unsafe { exs_fi_enable(ep) };
        if r < 0 {
            return Err(err("fi_enable", r.into()));
        }
        match kind {
            CqWait::None => Ok(EpWait::None),
            CqWait::Fd => {
                // SAFETY: `cq` is open.
                let fd = wait_fd_of(unsafe { &mut (*cq).fid })?;
                epoll_add(&self.epoll, fd, u64::from(id.0))?;
                self.own(fd, id);
                Ok(EpWait::Fd(fd))
            }
            CqWait::PollFd => {
                // The connection's socket joins the set later, at the latest by the queue's first arming.
                let now = pollfds_of(cq)?;
                let (entered, r) = self.enter_pollfds(id, &[], &now);
                if let Err(e) = r {
                    self.leave_epoll(id, &EpWait::PollFd(entered));
                    return Err(e);
                }
                Ok(EpWait::PollFd(entered))
            }
        }
    }

    fn post_initial(
        &mut self,
        id: EndpointId,
        recvs: Vec<WorkRequest>,
    ) -> Result<(), TransportError> {
        for wr in recvs {
            self.post_one(id, wr).map_err(|e| e.error)?;
        }
        Ok(())
    }

    pub(crate) fn addresses(&mut self, id: EndpointId) {
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
    /// dropping it). The only ways a request ends are this and `accept` (and, for a request naming no open
    /// listener, being dropped unanswered: see `on_connect_request` in `cm`).
    pub(crate) fn reject_info(&mut self, listener: ListenerId, info: Info) {
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

    /// [`Transport::listen`](exs_transport::Transport::listen): a passive endpoint bound to our event queue.
    pub(crate) fn start_listening(
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
            // No interface of the provider's carries the address (review finding: every failure of the call
            // read as this, and lost its call and code).
            TransportError::Os { call, .. }
                if call.code.unsigned_abs() == u64::from(FI_ENODATA) =>
            {
                TransportError::AddrNotAvailable(format!(
                    "{addr}: no {} interface carries it ({call})",
                    self.provider
                ))
            }
            other => other,
        })?;
        let id = ListenerId(self.next_listener);
        self.next_listener += 1;
        let mut pep = ptr::null_mut();
        // As an endpoint's: never read back (requests are matched to listeners by address).
        let ctx = id.0 as usize as *mut c_void;
        // SAFETY: open fabric and a valid info.
        let ret = unsafe { exs_fi_passive_ep(self.dom.fab.fabric, info.0, &mut pep, ctx) };
        if ret < 0 {
            // The tcp provider binds here, so a taken address shows up at this call, not at fi_listen.
            return Err(listen_error(addr, "fi_passive_ep", ret));
        }
        // SAFETY: `pep` was just opened; binding it to our event queue, then listening.
        let (call, ret) = unsafe {
            match exs_fi_pep_bind(pep, &mut (*self.eq).fid, 0) {
                r if r < 0 => ("fi_pep_bind", r),
                _ => ("fi_listen", exs_fi_listen(pep)),
            }
        };
        if ret < 0 {
            // SAFETY: the passive endpoint is ours and unused.
            unsafe { exs_fi_close(&mut (*pep).fid) };
            return Err(listen_error(addr, call, ret));
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

    /// [`Transport::close_listener`](exs_transport::Transport::close_listener), refusing its requests first.
    pub(crate) fn stop_listening(&mut self, listener: ListenerId) {
        if !self.listeners.contains_key(&listener) {
            return;
        }
        // Connection requests for this listener may wait in the event queue (the provider's progress publishes
        // them while a read runs, and the read returns one). Read them while the passive endpoint is open: once
        // it is closed their entries name a freed object, and their connections can no longer be refused, so
        // their sockets would leak. Handshakes the provider took in but whose request has not come yet are given
        // until requests stop coming (see `settle_requests`).
        self.settle_requests(listener);
        for info in self.requests.take_listener(listener) {
            self.reject_info(listener, info);
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

    /// Reads the event queue into the backlog while requests for `listener` keep coming ([`settle`]).
    ///
    /// libfabric's tcp provider (1.17, Debian 12's) takes a connection in before reading its request, and a
    /// passive endpoint closed in between does not end that handshake: when the request comes, the provider
    /// reads the freed endpoint to queue it (newer providers abort such handshakes at the close). So while
    /// requests are coming the endpoint is kept open a little longer, to publish and refuse those handshakes;
    /// one that takes longer still meets the provider's fault (the peer's connect then times out).
    fn settle_requests(&mut self, listener: ListenerId) {
        let mut read = Vec::new();
        settle(listener, || self.read_eq(), |ev| read.push(ev));
        self.cm_backlog.extend(read);
    }

    /// [`Transport::connect`](exs_transport::Transport::connect): an endpoint from `fi_getinfo` for the address,
    /// then `fi_connect`.
    pub(crate) fn start_connect(
        &mut self,
        ep: EndpointId,
        addr: SocketAddr,
        private: &[u8],
        recvs: Vec<WorkRequest>,
    ) -> Result<(), TransportError> {
        // Refused before anything is made or posted (`post_initial` would post the receives before a bad one).
        recvs.iter().try_for_each(|w| w.op.check_leases())?;
        let node = addr.ip().to_string();
        let service = addr.port().to_string();
        let info = getinfo(
            &self.provider,
            Some(&self.domain_name),
            Some(&node),
            Some(&service),
            0,
        )
        .or_else(|first| {
            getinfo(&self.provider, None, Some(&node), Some(&service), 0)
                .map_err(|second| both_failed(&self.domain_name, first, second))
        })?;
        let e = self.create_ep(info.0, ep)?;
        self.file_ep(ep, e);
        self.touch(ep);
        if let Err(err) = self.post_initial(ep, recvs) {
            self.release_ep(ep);
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
            self.release_ep(ep);
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

    /// [`Transport::accept`](exs_transport::Transport::accept): an endpoint from the request's info, then `fi_accept`.
    pub(crate) fn accept_request(
        &mut self,
        request: RequestId,
        ep: EndpointId,
        private: &[u8],
        recvs: Vec<WorkRequest>,
    ) -> Result<(), TransportError> {
        recvs.iter().try_for_each(|w| w.op.check_leases())?;
        let (listener, info) = self
            .requests
            .take(request)
            .ok_or_else(|| TransportError::Invalid("unknown request".into()))?;
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
        self.file_ep(ep, e);
        self.touch(ep);
        if let Err(err) = self.post_initial(ep, recvs) {
            self.release_ep(ep);
            return Err(err);
        }
        let e = self.eps.get_mut(&ep).expect("inserted");
        e.state = EpState::Accepting;
        // SAFETY: enabled endpoint created from the request's info; private data is copied by the call.
        let ret = unsafe { exs_fi_accept(e.ep, private.as_ptr() as *const c_void, private.len()) };
        if ret < 0 {
            self.release_ep(ep);
            return Err(err("fi_accept", ret.into()));
        }
        Ok(())
    }

    /// [`Transport::disconnect`](exs_transport::Transport::disconnect): `fi_shutdown`, and the endpoint is down.
    pub(crate) fn start_disconnect(&mut self, ep: EndpointId) {
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

    /// Files an open endpoint under `id` (and its fid's address, see `ep_fids`).
    fn file_ep(&mut self, id: EndpointId, e: Ep) {
        self.ep_fids.insert(fid_addr(e.ep), id);
        self.eps.insert(id, e);
    }

    /// [`Transport::release`](exs_transport::Transport::release): closes the endpoint, then reclaims its records.
    pub(crate) fn release_ep(&mut self, ep: EndpointId) {
        // The connection's domain closes once the endpoint and the last exposure of it are gone.
        self.conn_domains.remove(&ep);
        // A released endpoint's place in the hot set goes at the next retirement (identifiers are not reused).
        let Some(e) = self.eps.remove(&ep) else {
            return;
        };
        self.ep_fids.remove(&fid_addr(e.ep));
        self.leave_epoll(ep, &e.wait);
        // Its connection events still in the event queue go with it: closing an endpoint removes them
        // (`ofi_eq_remove_fid_events` in the tcp provider's close), so `read_eq` never sees the closed fid; events
        // read before the close name the endpoint by its id, which is looked up, not trusted.
        // SAFETY: closing the endpoint stops the provider from touching any posted buffer; then the queue, only
        // once the endpoint is closed (an endpoint left open may still write completions into it; review finding).
        let closed = unsafe {
            let ep_ret = exs_fi_close(&mut (*e.ep).fid);
            let cq_ret = if ep_ret == 0 {
                exs_fi_close(&mut (*e.cq).fid)
            } else {
                0
            };
            (ep_ret, cq_ret)
        };
        if closed != (0, 0) {
            // The provider may still hold the records' addresses (and DMA into their buffers): they are leaked,
            // with their leases, rather than freed under it.
            tracing::error!(
                ?ep,
                ep_ret = closed.0,
                cq_ret = closed.1,
                pending = e.pending.len(),
                "fi_close of a released endpoint failed; its requests' buffers are kept for the process's life"
            );
            self.cq_backlog.retain(|c| c.ep != ep);
            // Nor do the ranges its keys named go back: the endpoint may still serve the peer's accesses. The
            // endpoint, its queue and its domain stay open (never closed under the provider).
            e.dom.endpoint_stuck(ep);
            for &key in &e.pending {
                // SAFETY: a pending record stays allocated for good now (leaked to the provider, never taken
                // back); the provider uses only its `ctx` field: reading its operation races with nothing.
                unsafe { (*(key as *const WrRecord)).op.mark_kept_for_good() };
            }
            std::mem::forget(e);
            return;
        }
        for key in e.pending {
            // SAFETY: records still pending were leaked into the provider, which can no longer complete them now
            // that the endpoint is closed; each is reclaimed once, dropping its leases.
            drop(unsafe { self.records.take(key as *mut WrRecord) });
        }
        self.cq_backlog.retain(|c| c.ep != ep);
    }
}

/// What a failed `fi_passive_ep` or `fi_listen` means for the address, in plain words; the call and its code go
/// to the debug log.
fn listen_error(addr: SocketAddr, call: &str, ret: i32) -> TransportError {
    tracing::debug!(%addr, call, ret, "listen failed: {}", strerror(ret.into()));
    match ret.unsigned_abs() {
        98 => TransportError::AddrInUse(addr),
        99 => TransportError::AddrNotAvailable(format!("{addr} is not an address of this host")),
        _ => err(call, ret.into()),
    }
}

/// Reads events (`read`) into `keep` until no request for `listener` has come for [`SETTLE_QUIET`] (at once when
/// the first reads bring none), for [`SETTLE_MAX`] at most, however fast events come: a peer that kept the queue
/// full of requests for other listeners held the closing one's reads, and the engine, for good.
pub(crate) fn settle(
    listener: ListenerId,
    mut read: impl FnMut() -> Option<CmEvent>,
    mut keep: impl FnMut(CmEvent),
) {
    let start = Instant::now();
    let mut last = None;
    loop {
        while let Some(ev) = read() {
            if matches!(ev, CmEvent::ConnectRequest { listener: l, .. } if l == listener) {
                last = Some(Instant::now());
            }
            keep(ev);
            if start.elapsed() >= SETTLE_MAX {
                // A flood of events: the rest wait for the engine's next look.
                return;
            }
        }
        let Some(at) = last else {
            return;
        };
        if at.elapsed() >= SETTLE_QUIET || start.elapsed() >= SETTLE_MAX {
            return;
        }
        std::thread::sleep(SETTLE_PAUSE);
    }
}

/// The address of an endpoint's fid (what event-queue entries name it by), taken without reading through it.
pub(crate) fn fid_addr(ep: *mut fid_ep) -> usize {
    // SAFETY: only the field's address is computed, from an endpoint pointer of ours; nothing is read.
    unsafe { ptr::addr_of_mut!((*ep).fid) as usize }
}

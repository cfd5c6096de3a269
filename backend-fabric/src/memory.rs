//! Fabric and domains, registrations and exposures: who can reach which memory, with which key, on which
//! connection.
//!
//! ## Keys bound to one connection
//! libfabric offers no endpoint-bound keys on the software providers (`FI_MR_ENDPOINT` is not implemented by tcp,
//! sockets or net in 1.17), and a key of a domain works on every endpoint of that domain. So where the provider
//! needs no local descriptors (`FI_MR_LOCAL` clear: tcp, sockets, net), **every connection gets a domain of its
//! own**: its endpoint, completion queue and every exposure it hands out live there, so a key one connection
//! learned names nothing on another. Keys are requested ones (where the provider lets us choose) drawn from the
//! operating system's randomness, so they are not guessable on the connection either. Base registrations
//! (`register`, ES-API `exs_mregister`) then need nothing from the provider: local buffers are named by address.
//!
//! Where the provider needs local descriptors (`FI_MR_LOCAL`, e.g. the verbs provider), descriptors must come from
//! the endpoint's own domain, so one domain serves all connections and a key (the provider's, unguessable on
//! hardware) is valid domain-wide for as long as its exposure lives. The README states this per provider.

use std::collections::hash_map::RandomState;
use std::ffi::c_void;
use std::hash::{BuildHasher, Hasher};
use std::ptr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use exs_dma::{DmaBuf, Lease};
use exs_transport::{
    EndpointId, Exposure, Registrar, Registration, Released, RemoteAccess, RemoteRef, Revoke,
    TransportError,
};

use crate::call::{check, err, Info};
use crate::ffi::*;
use crate::FabricTransport;

/// The fabric, closed after every domain on it.
pub(crate) struct Fabric {
    pub(crate) fabric: *mut fid_fabric,
    /// The fi_info the fabric and domains were opened from, kept alive (and freed) with it.
    pub(crate) info: Info,
}

// SAFETY: the fabric was opened with FI_THREAD_SAFE; libfabric serializes internally.
unsafe impl Send for Fabric {}
// SAFETY: as above.
unsafe impl Sync for Fabric {}

impl Drop for Fabric {
    fn drop(&mut self) {
        // SAFETY: every domain holds an Arc of the fabric, so all are closed by now.
        unsafe { exs_fi_close(&mut (*self.fabric).fid) };
    }
}

/// Unguessable 64-bit keys: SipHash under a key the operating system drew at random, over a counter.
struct Keys {
    hasher: RandomState,
    next: AtomicU64,
}

impl Keys {
    fn new() -> Self {
        Keys {
            hasher: RandomState::new(),
            next: AtomicU64::new(1),
        }
    }

    fn draw(&self) -> u64 {
        let mut h = self.hasher.build_hasher();
        h.write_u64(self.next.fetch_add(1, Ordering::Relaxed));
        h.finish().max(1)
    }
}

/// One libfabric domain: the context's, or one connection's own.
pub(crate) struct Domain {
    pub(crate) fab: Arc<Fabric>,
    pub(crate) domain: *mut fid_domain,
    pub(crate) mr_mode: u64,
    keys: Keys,
    /// Endpoints of the domain that could not be closed: the provider may still serve their peers' accesses, so
    /// no range exposed to one of them is released any more ([`FiKey`]). Rare: looked at only when `any_stuck`.
    stuck: std::sync::Mutex<Vec<EndpointId>>,
    any_stuck: std::sync::atomic::AtomicBool,
}

// SAFETY: the domain was opened with FI_THREAD_SAFE; libfabric serializes internally.
unsafe impl Send for Domain {}
// SAFETY: as above; `&Domain` only hands out the handles for thread-safe calls.
unsafe impl Sync for Domain {}

impl std::fmt::Debug for Domain {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Domain")
            .field("mr_mode", &self.mr_mode)
            .finish()
    }
}

impl Drop for Domain {
    fn drop(&mut self) {
        // SAFETY: every endpoint, queue and registration using the domain holds an Arc of it, so all are closed.
        unsafe { exs_fi_close(&mut (*self.domain).fid) };
    }
}

impl Domain {
    /// Records that endpoint `ep` of the domain could not be closed ([`FabricTransport::release_ep`]).
    pub(crate) fn endpoint_stuck(&self, ep: EndpointId) {
        self.stuck
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(ep);
        self.any_stuck.store(true, Ordering::Release);
    }

    /// Whether endpoint `ep` of the domain could not be closed.
    fn is_stuck(&self, ep: EndpointId) -> bool {
        self.any_stuck.load(Ordering::Acquire)
            && self
                .stuck
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .contains(&ep)
    }

    /// Opens a domain on the fabric.
    pub(crate) fn open(fab: &Arc<Fabric>, mr_mode: u64) -> Result<Arc<Domain>, TransportError> {
        let mut domain = ptr::null_mut();
        // SAFETY: open fabric, the info it was opened from.
        let ret = unsafe { exs_fi_domain(fab.fabric, fab.info.0, &mut domain, ptr::null_mut()) };
        if ret < 0 {
            return Err(err("fi_domain", ret.into()));
        }
        Ok(Arc::new(Domain {
            fab: Arc::clone(fab),
            domain,
            mr_mode,
            keys: Keys::new(),
            stuck: std::sync::Mutex::new(Vec::new()),
            any_stuck: std::sync::atomic::AtomicBool::new(false),
        }))
    }

    pub(crate) fn register(
        &self,
        addr: u64,
        len: usize,
        access: u64,
    ) -> Result<*mut fid_mr, TransportError> {
        let key = if self.mr_mode & FI_MR_PROV_KEY as u64 != 0 {
            0
        } else {
            self.keys.draw()
        };
        let mut mr = ptr::null_mut();
        // SAFETY: the caller guarantees `addr..addr+len` is live memory (a leased or registered DmaBuf) that
        // outlives the registration; the domain is open.
        let ret = unsafe {
            exs_fi_mr_reg(
                self.domain,
                addr as *const c_void,
                len,
                access,
                0,
                key,
                0,
                &mut mr,
                ptr::null_mut(),
            )
        };
        check("fi_mr_reg", ret)?;
        Ok(mr)
    }
}

/// Closes a registration; whether it is gone. A close that failed is logged with its code: the registration may
/// still name its memory (and a key to it still work), so the caller keeps that memory for ever.
pub(crate) fn close_mr(mr: *mut fid_mr) -> bool {
    if mr.is_null() {
        return true;
    }
    // SAFETY: `mr` was returned by fi_mr_reg and is closed exactly once, by its owner.
    let ret = unsafe { exs_fi_close(&mut (*mr).fid) };
    if ret != 0 {
        tracing::error!(
            code = ret,
            "fi_close of a memory registration failed ({}): the memory it names is kept for ever",
            strerror(ret.into())
        );
    }
    ret == 0
}

/// A whole buffer registered for local access (or, where the provider needs no local descriptors, only
/// remembered: nothing to register).
pub(crate) struct FiRegistration {
    pub(crate) _domain: Option<Arc<Domain>>,
    pub(crate) mr: *mut fid_mr,
    pub(crate) desc: u64,
    pub(crate) buf: Arc<DmaBuf>,
}

// SAFETY: the MR handle is only used to close it (thread-safe domain); the buffer is Send + Sync.
unsafe impl Send for FiRegistration {}
// SAFETY: see Send.
unsafe impl Sync for FiRegistration {}

impl std::fmt::Debug for FiRegistration {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FiRegistration")
            .field("buf", &self.buf)
            .field("registered", &!self.mr.is_null())
            .finish()
    }
}

impl Drop for FiRegistration {
    fn drop(&mut self) {
        // Closed before `buf` (declared later) is released: memory outlives its registration, and one that could
        // not be closed keeps its buffer, and its domain (which cannot close under it), for ever.
        if !close_mr(self.mr) {
            self.buf.keep_for_good();
            std::mem::forget(Arc::clone(&self.buf));
            std::mem::forget(self._domain.clone());
        }
    }
}

impl Registration for FiRegistration {
    fn local_key(&self) -> u64 {
        self.desc
    }
    fn buf(&self) -> &Arc<DmaBuf> {
        &self.buf
    }
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

/// What revokes a key on libfabric: the range's own registration in the connection's domain (closed, then the
/// domain may close). The lease goes back at once (`FiKey`'s [`Revoke::release`]), though on the software providers
/// closing the registration does not stop an access the peer began before (see the backends chapter, "A revoked key
/// and an access already under way"): the engine revokes a key only once the protocol says the peer is done with
/// it, or at the endpoint's release, which stops the provider's accesses. A registration that could not be closed
/// may still let the peer in, as may its endpoint if that could not be closed: its range is never released then,
/// as [`Revoke::release`] asks.
#[derive(Debug)]
pub(crate) struct FiKey {
    pub(crate) mr: MrHandle,
    pub(crate) domain: Arc<Domain>,
    /// The endpoint whose peer was given the key.
    pub(crate) ep: EndpointId,
    /// What closes the registration ([`close_mr`]; a test makes it fail).
    pub(crate) close: fn(*mut fid_mr) -> bool,
    /// The close failed: the lease is kept.
    pub(crate) open: bool,
}

impl FiKey {
    pub(crate) fn new(mr: *mut fid_mr, domain: Arc<Domain>, ep: EndpointId) -> Self {
        FiKey {
            mr: MrHandle(mr),
            domain,
            ep,
            close: close_mr,
            open: false,
        }
    }
}

/// A registration handle (closed at most once).
pub(crate) struct MrHandle(pub(crate) *mut fid_mr);

// SAFETY: the MR handle is only used to close it (thread-safe domain).
unsafe impl Send for MrHandle {}

impl std::fmt::Debug for MrHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("MrHandle")
    }
}

impl Revoke for FiKey {
    fn revoke(&mut self) {
        let mr = std::mem::replace(&mut self.mr.0, std::ptr::null_mut());
        self.open = !(self.close)(mr);
        if self.open {
            // Nor may its domain close under it.
            std::mem::forget(Arc::clone(&self.domain));
        }
    }

    fn release(&mut self, lease: Released) {
        if self.open || self.domain.is_stuck(self.ep) {
            // The key may still work, or its endpoint, which could not be closed, still reach the range: it stays
            // leased for ever (never reused, never freed).
            lease.keep_for_good();
        } else {
            lease.release();
        }
    }
}

/// Registers buffers for local descriptors, or only names them where none are needed, from any thread (the domain
/// is `FI_THREAD_SAFE`).
#[derive(Debug)]
pub(crate) struct FabricRegistrar {
    dom: Arc<Domain>,
    per_conn: bool,
}

impl Registrar for FabricRegistrar {
    fn register(&self, buf: &Arc<DmaBuf>) -> Result<Arc<dyn Registration>, TransportError> {
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
}

impl FabricTransport {
    /// The domain of a connection: its own where the provider allows it, else the context's.
    pub(crate) fn domain_for(&mut self, id: EndpointId) -> Result<Arc<Domain>, TransportError> {
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

    /// [`Transport::register`](exs_transport::Transport::register) and
    /// [`Transport::registrar`](exs_transport::Transport::registrar): registrations need the context's domain
    /// (opened thread-safe) and whether connections have domains of their own, nothing else of the transport.
    pub(crate) fn registrar(&self) -> FabricRegistrar {
        FabricRegistrar {
            dom: Arc::clone(&self.dom),
            per_conn: self.per_conn,
        }
    }

    /// [`Transport::expose`](exs_transport::Transport::expose): a registration of exactly the range in the
    /// connection's domain.
    pub(crate) fn expose_lease(
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
            FiKey::new(mr, dom, ep),
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::FabricConfig;
    use exs_dma::LeaseKind;
    use exs_transport::KeyedLease;

    fn failing_close(_: *mut fid_mr) -> bool {
        false
    }

    fn good_close(_: *mut fid_mr) -> bool {
        true
    }

    /// The first 64 bytes of `buf` exposed to endpoint `ep` in `domain`, under a stand-in registration that
    /// `close` closes.
    fn exposed(
        buf: &Arc<DmaBuf>,
        domain: &Arc<Domain>,
        ep: u32,
        close: fn(*mut fid_mr) -> bool,
    ) -> KeyedLease<FiKey> {
        let lease = buf.lease(0..64, LeaseKind::DeviceWriteShared).unwrap();
        let key = FiKey {
            close,
            ..FiKey::new(ptr::null_mut(), Arc::clone(domain), EndpointId(ep))
        };
        KeyedLease::new(RemoteRef { addr: 0, key: 0 }, lease, key)
    }

    #[test]
    fn a_key_whose_registration_could_not_be_closed_keeps_its_range_leased() {
        let _serial = crate::tests::serial();
        let t = FabricTransport::open(&FabricConfig::default()).expect("open tcp");
        let (kept, other) = (DmaBuf::new(4096), DmaBuf::new(4096));
        drop(exposed(&kept, &t.dom, 1, failing_close));
        drop(exposed(&other, &t.dom, 1, good_close));
        assert!(
            kept.is_range_leased(0..64),
            "the key may still let the peer in"
        );
        assert!(!other.is_range_leased(0..64), "a key closed lets go");
        assert!(kept.kept_for_good() && !other.kept_for_good());
    }

    #[test]
    fn no_range_exposed_to_an_endpoint_that_could_not_be_closed_goes_back() {
        let _serial = crate::tests::serial();
        let t = FabricTransport::open(&FabricConfig::default()).expect("open tcp");
        let (kept, other) = (DmaBuf::new(4096), DmaBuf::new(4096));
        // Two endpoints' keys in one domain (a provider whose connections share the context's).
        let (a, b) = (
            exposed(&kept, &t.dom, 7, good_close),
            exposed(&other, &t.dom, 8, good_close),
        );
        // What `release_ep` records when `fi_close` of endpoint 7 fails.
        t.dom.endpoint_stuck(EndpointId(7));
        drop((a, b));
        assert!(
            kept.is_range_leased(0..64),
            "the endpoint may still serve the peer's accesses there"
        );
        assert!(
            !other.is_range_leased(0..64),
            "another endpoint's keys let go"
        );
    }
}

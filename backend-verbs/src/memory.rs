//! Protection domain, registrations and exposures: who can reach which memory, with which key, on which queue pair.
//!
//! * A base registration (`register`, ES-API `exs_mregister`) grants local access, plus `IBV_ACCESS_MW_BIND`
//!   where memory windows are used; never remote access. On iWARP, where the sink of an RDMA read must allow
//!   remote write, each read's sink is registered on its own for the read's duration ([`SinkMr`]).
//! * Where the device has type 2 memory windows (`IBV_DEVICE_MEM_WINDOW_TYPE_2B`: Soft-RoCE, Mellanox), an
//!   exposure is a window bound to **one queue pair**: the bind is a work request posted on that
//!   connection's send queue ahead of the message that hands the key out (a queue pair executes in order), the
//!   key works for that connection only, and deallocating the window when the exposure is dropped revokes it
//!   ([`WindowKey`]). No memory is registered on the data path. Each bind moves the key's low byte on
//!   (`ibv_inc_rkey`).
//! * Elsewhere (siw and iWARP adapters without windows) an exposure is a registration of exactly the exposed
//!   range ([`MrKey`]): a key valid on every queue pair of the protection domain while it lives, and a
//!   registration per operation. The README says so.

use std::ffi::c_void;
use std::ptr;
use std::sync::{Arc, Mutex};

use exs_dma::{DmaBuf, Lease};
use exs_transport::{
    EndpointId, Exposure, KeyedLease, Registration, RemoteAccess, RemoteRef, Revoke, TransportError,
};
use rdma_sys::*;

use crate::connection::EpState;
use crate::post::post_error;
use crate::post::SendRec;
use crate::queue::Posted;
use crate::{os_err, VerbsTransport};

/// The protection domain, shared with registrations and windows so it is deallocated last.
pub(crate) struct Pd(pub(crate) *mut ibv_pd);

// SAFETY: verbs objects may be used from any thread; rdma-core serialises internally where needed.
unsafe impl Send for Pd {}
// SAFETY: see Send.
unsafe impl Sync for Pd {}

impl std::fmt::Debug for Pd {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Pd")
    }
}

impl Drop for Pd {
    fn drop(&mut self) {
        // SAFETY: every MR, window and QP of this PD is gone: registrations and windows hold this Arc, QPs are
        // destroyed by the transport's Drop before its Arc is released.
        unsafe { ibv_dealloc_pd(self.0) };
    }
}

pub(crate) fn reg_mr(
    pd: &Pd,
    addr: u64,
    len: usize,
    access: u32,
) -> Result<*mut ibv_mr, TransportError> {
    // SAFETY: the caller guarantees `addr..addr+len` is live memory (a DmaBuf or a lease of one) outliving the MR.
    let mr = unsafe { ibv_reg_mr(pd.0, addr as *mut c_void, len, access as i32) };
    if mr.is_null() {
        let e = std::io::Error::last_os_error();
        if e.raw_os_error() == Some(libc::ENOMEM) {
            // Pinning counts against RLIMIT_MEMLOCK (siw counts it even for root): say which limit ran out.
            let limit = nix::sys::resource::getrlimit(nix::sys::resource::Resource::RLIMIT_MEMLOCK)
                .map(|(soft, _)| soft);
            return Err(TransportError::Resource(match limit {
                Ok(l) if l != nix::sys::resource::RLIM_INFINITY => format!(
                    "cannot register {len} bytes: the locked-memory limit (ulimit -l, RLIMIT_MEMLOCK: {l} bytes) \
                     or the device's memory ran out"
                ),
                _ => format!("cannot register {len} bytes: the device or the system is out of memory"),
            }));
        }
        return Err(TransportError::os("ibv_reg_mr", e));
    }
    Ok(mr)
}

fn dereg(mr: *mut ibv_mr) {
    // SAFETY: `mr` came from ibv_reg_mr and is deregistered exactly once, by its owner's Drop.
    unsafe { ibv_dereg_mr(mr) };
}

/// The registration of one RDMA read's local sink with remote write (iWARP writes read responses into the sink
/// through an STag that must allow it), held by the read's record and deregistered when the read is done.
pub(crate) struct SinkMr {
    mr: *mut ibv_mr,
    pub(crate) lkey: u32,
    _pd: Arc<Pd>,
}

impl SinkMr {
    /// Registers `addr..addr+len`, which the caller's lease keeps alive for longer than the result.
    pub(crate) fn new(pd: &Arc<Pd>, addr: u64, len: usize) -> Result<Self, TransportError> {
        let mr = reg_mr(
            pd,
            addr,
            len,
            ibv_access_flags::IBV_ACCESS_LOCAL_WRITE.0
                | ibv_access_flags::IBV_ACCESS_REMOTE_WRITE.0,
        )?;
        // SAFETY: live MR.
        let lkey = unsafe { (*mr).lkey };
        Ok(SinkMr {
            mr,
            lkey,
            _pd: Arc::clone(pd),
        })
    }
}

impl Drop for SinkMr {
    fn drop(&mut self) {
        dereg(self.mr);
    }
}

// SAFETY: the MR handle is only used to deregister it.
unsafe impl Send for SinkMr {}

pub(crate) struct VerbsRegistration {
    pub(crate) _pd: Arc<Pd>,
    pub(crate) mr: *mut ibv_mr,
    pub(crate) lkey: u32,
    pub(crate) buf: Arc<DmaBuf>,
}

// SAFETY: the MR handle is only used to deregister it and to name it in window binds.
unsafe impl Send for VerbsRegistration {}
// SAFETY: see Send.
unsafe impl Sync for VerbsRegistration {}

impl std::fmt::Debug for VerbsRegistration {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VerbsRegistration")
            .field("lkey", &self.lkey)
            .field("buf", &self.buf)
            .finish()
    }
}

impl Drop for VerbsRegistration {
    fn drop(&mut self) {
        // Before `buf` is released (field order). Every window bound to this registration holds its Arc
        // (`WindowKey::_reg`), so none is bound any more (ibv_dereg_mr fails while one is).
        dereg(self.mr);
    }
}

impl Registration for VerbsRegistration {
    fn local_key(&self) -> u64 {
        u64::from(self.lkey)
    }
    fn buf(&self) -> &Arc<DmaBuf> {
        &self.buf
    }
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

/// What revokes a key on a device without windows: the range's own registration.
#[derive(Debug)]
pub(crate) struct MrKey {
    pub(crate) mr: MrPtr,
    pub(crate) _pd: Arc<Pd>,
}

/// A registration pointer (deregistered at most once).
pub(crate) struct MrPtr(pub(crate) *mut ibv_mr);

// SAFETY: the MR handle is only used to deregister it.
unsafe impl Send for MrPtr {}

impl std::fmt::Debug for MrPtr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("MrPtr")
    }
}

impl Revoke for MrKey {
    fn revoke(&mut self) {
        let mr = std::mem::replace(&mut self.mr.0, std::ptr::null_mut());
        if !mr.is_null() {
            dereg(mr);
        }
    }
}

/// A window's handle, shared by its exposure and its endpoint: whichever comes first deallocates it. The
/// endpoint must, before its queue pair is destroyed: a queue pair with windows still bound to it cannot be
/// destroyed (rxe waits for them, then warns), and the keys die with the connection anyway.
pub(crate) struct MwSlot(Mutex<*mut ibv_mw>);

// SAFETY: the window pointer is only used under the mutex, to deallocate it once.
unsafe impl Send for MwSlot {}
// SAFETY: see Send.
unsafe impl Sync for MwSlot {}

impl MwSlot {
    pub(crate) fn new(mw: *mut ibv_mw) -> Arc<MwSlot> {
        Arc::new(MwSlot(Mutex::new(mw)))
    }

    /// Deallocates the window (revoking its key), once.
    pub(crate) fn dealloc(&self) {
        let mut mw = self.0.lock().unwrap_or_else(|p| p.into_inner());
        if !mw.is_null() {
            // SAFETY: `*mw` came from ibv_alloc_mw and is deallocated exactly once: the pointer is cleared under
            // the lock.
            unsafe { ibv_dealloc_mw(*mw) };
            *mw = std::ptr::null_mut();
        }
    }
}

/// What revokes a key bound as a type 2 memory window: deallocating the window. The registration it is bound over
/// stays registered until then (deregistering fails while a window is bound).
#[derive(Debug)]
pub(crate) struct WindowKey {
    pub(crate) slot: Arc<MwSlot>,
    pub(crate) _reg: Arc<dyn Registration>,
    pub(crate) _pd: Arc<Pd>,
}

impl std::fmt::Debug for MwSlot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("MwSlot")
    }
}

impl Revoke for WindowKey {
    fn revoke(&mut self) {
        self.slot.dealloc();
    }
}

impl VerbsTransport {
    /// Binds a type 2 memory window over the leased range to `ep`'s queue pair (see [`memory`](crate::memory)).
    /// The bind is a send-queue request, so it executes before anything posted after it, in particular the message
    /// that hands the key to the peer; it is unsignalled and retired by the next signalled request, like any other.
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
        self.room_for_bind(ep)?;
        // SAFETY: open protection domain.
        let mw = unsafe { ibv_alloc_mw(self.pd.0, ibv_mw_type::IBV_MW_TYPE_2) }
            .filter(|m| !m.is_null())
            .ok_or_else(|| os_err("ibv_alloc_mw"))?;
        let info = ibv_mw_bind_info {
            mr: base.mr,
            addr: lease.addr(),
            length: lease.len() as u64,
            mw_access_flags: match access {
                RemoteAccess::Read => ibv_access_flags::IBV_ACCESS_REMOTE_READ.0,
                RemoteAccess::Write => ibv_access_flags::IBV_ACCESS_REMOTE_WRITE.0,
            },
        };
        let rkey = match self.post_bind(ep, mw, info) {
            Ok(k) => k,
            Err(e) => {
                // SAFETY: the window was never bound; deallocated once.
                unsafe { ibv_dealloc_mw(mw) };
                return Err(e);
            }
        };
        let slot = MwSlot::new(mw);
        let e = self.eps.get_mut(&ep).ok_or(TransportError::NoEndpoint)?;
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

    /// A window binds only on a connected queue pair with a free send-queue entry (completions waiting in the
    /// completion queue free entries).
    fn room_for_bind(&mut self, ep: EndpointId) -> Result<(), TransportError> {
        let e = self.eps.get(&ep).ok_or(TransportError::NoEndpoint)?;
        if e.qp.is_null() || e.state != EpState::Connected {
            return Err(TransportError::Invalid(
                "a memory window binds to a connected queue pair".into(),
            ));
        }
        if e.sends.entries() >= e.sq_cap {
            self.drain_cq();
        }
        let e = self.eps.get(&ep).ok_or(TransportError::NoEndpoint)?;
        if e.sends.entries() >= e.sq_cap {
            return Err(TransportError::Resource("send queue full".into()));
        }
        Ok(())
    }

    /// Posts the bind of `mw` over `info` on `ep`'s queue pair and records it; returns the window's new key.
    fn post_bind(
        &mut self,
        ep: EndpointId,
        mw: *mut ibv_mw,
        info: ibv_mw_bind_info,
    ) -> Result<u32, TransportError> {
        // SAFETY: `mw` is a live window; the key's low byte moves on with each bind so a stale key fails.
        let rkey = unsafe { ibv_inc_rkey((*mw).rkey) };
        let seq = self.ids.send();
        let e = self.eps.get_mut(&ep).ok_or(TransportError::NoEndpoint)?;
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
            bind_info: info,
        };
        let mut bad = ptr::null_mut();
        // SAFETY: live, connected QP; the request lives until the call returns; the window, the registration it
        // binds over and the leased memory outlive the binding (the caller's exposure owns all three).
        let rc = unsafe { ibv_post_send(e.qp, &mut w, &mut bad) };
        if rc != 0 {
            return Err(post_error("ibv_post_send (window bind)", rc));
        }
        e.signal = signal;
        e.sends.push(Posted {
            seq,
            entries: 1,
            broken: false,
            own: false,
            item: SendRec {
                wr_id: 0,
                kind: None,
                _sink: None,
                op: None,
            },
        });
        Ok(rkey)
    }

    /// [`Transport::register`](exs_transport::Transport::register): a registration for local access (and window
    /// binds where windows are used).
    pub(crate) fn register_buf(
        &mut self,
        buf: &Arc<DmaBuf>,
    ) -> Result<Arc<dyn Registration>, TransportError> {
        // Local access only, iWARP included: there a read's sink gets remote write from a registration of its own
        // for the read's duration (`SinkMr`), so no base registration is ever writable from the network.
        let mut access = ibv_access_flags::IBV_ACCESS_LOCAL_WRITE.0;
        if self.settings.memory_windows {
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

    /// [`Transport::expose`](exs_transport::Transport::expose): a window bound to the endpoint's queue pair, or a
    /// registration of exactly the range.
    pub(crate) fn expose_lease(
        &mut self,
        ep: EndpointId,
        reg: &Arc<dyn Registration>,
        lease: Lease,
        access: RemoteAccess,
    ) -> Result<Box<dyn Exposure>, TransportError> {
        exs_transport::check_exposure(reg, &lease, access)?;
        if self.settings.memory_windows {
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
}

//! Protection domain, registrations and exposures: who can reach which memory, with which key, on which queue pair.
//!
//! * A base registration (`register`, ES-API `exs_mregister`) grants local access, plus `IBV_ACCESS_MW_BIND`
//!   where memory windows are used; never remote access. On iWARP (where the device needs remote write on a read's
//!   sink, and by default on siw: see `DeviceLimits::read_sink_needs_remote_write`), each read's sink is registered
//!   on its own for the read's duration ([`SinkMr`]): the read request carries the sink's key.
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
use std::sync::{Arc, Mutex};

use exs_dma::DmaBuf;
use exs_transport::{Registration, Revoke, TransportError};
use rdma_sys::*;

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

/// The registration of one RDMA read's local sink with remote write (iWARP adapters write read responses into the
/// sink through an STag that must allow it), held by the read's record and deregistered when the read is done.
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

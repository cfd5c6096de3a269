//! Protection domain, registrations and exposures: who can reach which memory, with which key, on which queue pair.
//!
//! * A base registration (`register`, ES-API `exs_mregister`) grants local access, plus `IBV_ACCESS_MW_BIND`
//!   where memory windows are used (and remote write on iWARP, where the sink of an RDMA read must allow it).
//! * Where the device has type 2 memory windows (`IBV_DEVICE_MEM_WINDOW_TYPE_2B`: Soft-RoCE, Mellanox), an
//!   exposure is a window bound to **one queue pair** ([`VerbsWindow`]): the bind is a work request posted on that
//!   connection's send queue ahead of the message that hands the key out (a queue pair executes in order), the
//!   key works for that connection only, and deallocating the window when the exposure is dropped revokes it.
//!   No memory is registered on the data path. Each bind moves the key's low byte on (`ibv_inc_rkey`).
//! * Elsewhere (siw and iWARP adapters without windows) an exposure is a registration of exactly the exposed
//!   range ([`VerbsExposure`]): a key valid on every queue pair of the protection domain while it lives, and a
//!   registration per operation. The README says so.

use std::ffi::c_void;
use std::sync::{Arc, Mutex};

use exs::transport::{Exposure, Registration, RemoteRef, TransportError};
use exs_dma::{DmaBuf, Lease};
use rdma_sys::*;

use crate::os_err;

/// The protection domain, shared with registrations and windows so it is deallocated last.
pub(crate) struct Pd(pub(crate) *mut ibv_pd);

// SAFETY: verbs objects may be used from any thread; rdma-core serialises internally where needed.
unsafe impl Send for Pd {}
// SAFETY: see Send.
unsafe impl Sync for Pd {}

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
        return Err(os_err("ibv_reg_mr"));
    }
    Ok(mr)
}

fn dereg(mr: *mut ibv_mr) {
    // SAFETY: `mr` came from ibv_reg_mr and is deregistered exactly once, by its owner's Drop.
    unsafe { ibv_dereg_mr(mr) };
}

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
        // (`VerbsWindow::_reg`), so none is bound any more (ibv_dereg_mr fails while one is).
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

/// Reads and writes through an exposure's lease (the owner of an exposure uses the exposed bytes through it).
fn lease_read(lease: &Lease, offset: usize, dst: &mut [u8]) -> Result<(), TransportError> {
    lease
        .read(offset, dst)
        .map_err(|e| TransportError::Invalid(e.to_string()))
}

fn lease_write(lease: &mut Lease, offset: usize, src: &[u8]) -> Result<(), TransportError> {
    lease
        .write(offset, src)
        .map_err(|e| TransportError::Invalid(e.to_string()))
}

/// An exposure as a registration of exactly the range (devices without type 2 windows).
pub(crate) struct VerbsExposure {
    pub(crate) _pd: Arc<Pd>,
    pub(crate) mr: *mut ibv_mr,
    pub(crate) remote: RemoteRef,
    pub(crate) len: usize,
    pub(crate) lease: Lease,
}

// SAFETY: as VerbsRegistration.
unsafe impl Send for VerbsExposure {}

impl std::fmt::Debug for VerbsExposure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VerbsExposure")
            .field("rkey", &self.remote.key)
            .field("len", &self.len)
            .finish()
    }
}

impl Drop for VerbsExposure {
    fn drop(&mut self) {
        dereg(self.mr); // the key dies before the lease goes
    }
}

impl Exposure for VerbsExposure {
    fn remote(&self) -> RemoteRef {
        self.remote
    }
    fn len(&self) -> usize {
        self.len
    }
    fn read(&self, offset: usize, dst: &mut [u8]) -> Result<(), TransportError> {
        lease_read(&self.lease, offset, dst)
    }
    fn write(&mut self, offset: usize, src: &[u8]) -> Result<(), TransportError> {
        lease_write(&mut self.lease, offset, src)
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

/// A type 2 memory window bound to one queue pair over a leased range of a base registration.
pub(crate) struct VerbsWindow {
    pub(crate) slot: Arc<MwSlot>,
    pub(crate) remote: RemoteRef,
    pub(crate) len: usize,
    pub(crate) lease: Lease,
    /// The registration the window is bound to: deregistering it fails while a window is bound.
    pub(crate) _reg: Arc<dyn Registration>,
    pub(crate) _pd: Arc<Pd>,
}

impl std::fmt::Debug for VerbsWindow {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VerbsWindow")
            .field("rkey", &self.remote.key)
            .field("len", &self.len)
            .finish()
    }
}

impl Drop for VerbsWindow {
    fn drop(&mut self) {
        // The key dies before the lease and the registration are released (field order).
        self.slot.dealloc();
    }
}

impl Exposure for VerbsWindow {
    fn remote(&self) -> RemoteRef {
        self.remote
    }
    fn len(&self) -> usize {
        self.len
    }
    fn read(&self, offset: usize, dst: &mut [u8]) -> Result<(), TransportError> {
        lease_read(&self.lease, offset, dst)
    }
    fn write(&mut self, offset: usize, src: &[u8]) -> Result<(), TransportError> {
        lease_write(&mut self.lease, offset, src)
    }
}

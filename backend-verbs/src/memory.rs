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
use exs_transport::{Registrar, Registration, Released, Revoke, TransportError};
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
        // destroyed by the transport's Drop before its Arc is released. A QP the device would not destroy keeps
        // the PD in use, and the device refuses this (the PD stays, as the QP does).
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
        let limit = nix::sys::resource::getrlimit(nix::sys::resource::Resource::RLIMIT_MEMLOCK)
            .ok()
            .map(|(soft, _)| soft);
        return Err(reg_error(len, e, limit));
    }
    Ok(mr)
}

/// Why `ibv_reg_mr` of `len` bytes failed with `e`, `ibv_reg_mr` and its code as the error's source; `limit` is
/// the soft locked-memory limit.
fn reg_error(len: usize, e: std::io::Error, limit: Option<u64>) -> TransportError {
    let Some(code) = e.raw_os_error().filter(|&c| c == libc::ENOMEM) else {
        return TransportError::os("ibv_reg_mr", e);
    };
    // Pinning counts against RLIMIT_MEMLOCK (siw counts it even for root): say which limit ran out.
    let message = match limit {
        Some(l) if l != nix::sys::resource::RLIM_INFINITY => format!(
            "cannot register {len} bytes: the locked-memory limit (ulimit -l, RLIMIT_MEMLOCK: {l} bytes) or the \
             device's memory ran out"
        ),
        _ => format!("cannot register {len} bytes: the device or the system is out of memory"),
    };
    crate::call_err("ibv_reg_mr", code, std::io::ErrorKind::OutOfMemory, message)
}

/// `ibv_dereg_mr`; a failure is logged (the registration, and its key, may still be valid) and returned.
fn dereg(mr: *mut ibv_mr) -> i32 {
    // SAFETY: `mr` came from ibv_reg_mr and is deregistered exactly once, by its owner (Drop, or `MrKey::end`,
    // which clears it).
    let rc = unsafe { ibv_dereg_mr(mr) };
    if rc != 0 {
        tracing::error!(
            rc,
            "ibv_dereg_mr failed: the registration, and its key, may still be valid"
        );
    }
    rc
}

/// The registration of one RDMA read's local sink with remote write (iWARP adapters write read responses into the
/// sink through an STag that must allow it), held by the read's record and deregistered when the read is done.
pub(crate) struct SinkMr {
    /// Null once deregistered.
    mr: *mut ibv_mr,
    pub(crate) lkey: u32,
    _pd: Arc<Pd>,
    /// `ibv_dereg_mr` (a stand-in in tests, which have no device).
    dereg: fn(*mut ibv_mr) -> i32,
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
            dereg,
        })
    }

    /// A sink registration of `mr` deregistered with `dereg` (tests: a stand-in handle and call).
    #[cfg(test)]
    pub(crate) fn with_dereg(mr: *mut ibv_mr, pd: &Arc<Pd>, dereg: fn(*mut ibv_mr) -> i32) -> Self {
        SinkMr {
            mr,
            lkey: 0,
            _pd: Arc::clone(pd),
            dereg,
        }
    }

    /// Deregisters the sink, once. False if that failed: its key, which allows remote write, may still be valid,
    /// so the memory it names must never be handed back (the read's record then keeps its leases for ever).
    pub(crate) fn close(&mut self) -> bool {
        let mr = std::mem::replace(&mut self.mr, std::ptr::null_mut());
        mr.is_null() || (self.dereg)(mr) == 0
    }
}

impl Drop for SinkMr {
    fn drop(&mut self) {
        // Closed by its record before the read's leases go (`SendRec`'s drop); a failure is logged by `dereg`.
        self.close();
    }
}

// SAFETY: the MR handle is only used to deregister it.
unsafe impl Send for SinkMr {}

/// A registration of a buffer that no device has (tests: the checks before a post, and what a record keeps, need
/// only the buffer).
#[cfg(test)]
#[derive(Debug)]
pub(crate) struct NoDevice(pub(crate) Arc<exs_dma::DmaBuf>);

#[cfg(test)]
impl Registration for NoDevice {
    fn local_key(&self) -> u64 {
        1
    }
    fn buf(&self) -> &Arc<exs_dma::DmaBuf> {
        &self.0
    }
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

pub(crate) struct VerbsRegistration {
    pub(crate) _pd: Arc<Pd>,
    pub(crate) mr: *mut ibv_mr,
    pub(crate) lkey: u32,
    pub(crate) buf: Arc<DmaBuf>,
    /// `ibv_dereg_mr` (a stand-in in tests, which have no device).
    pub(crate) dereg: fn(*mut ibv_mr) -> i32,
}

/// Registers buffers for local access (and window binds where windows are used), from any thread: `ibv_reg_mr`
/// on the protection domain, which rdma-core serialises where it must.
#[derive(Debug)]
pub(crate) struct VerbsRegistrar {
    pub(crate) pd: Arc<Pd>,
    pub(crate) memory_windows: bool,
}

impl Registrar for VerbsRegistrar {
    fn register(&self, buf: &Arc<DmaBuf>) -> Result<Arc<dyn Registration>, TransportError> {
        // Local access only, iWARP included: there a read's sink gets remote write from a registration of its own
        // for the read's duration (`SinkMr`), so no base registration is ever writable from the network, nor its
        // key handed out (unless read sinks are turned off on siw: then each read request carries it).
        let mut access = ibv_access_flags::IBV_ACCESS_LOCAL_WRITE.0;
        if self.memory_windows {
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
            dereg,
        }))
    }
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
        // (`WindowKey::_reg`, and `BindHold::_reg` while its bind is queued), so none is bound any more (ibv_dereg_mr fails while one is).
        if (self.dereg)(self.mr) != 0 {
            // The registration may still be valid: its memory must never be reused or freed (in C,
            // `exs_mderegister` then says `EIO`), nor its protection domain deallocated under it.
            self.buf.keep_for_good();
            std::mem::forget(Arc::clone(&self.buf));
            std::mem::forget(Arc::clone(&self._pd));
        }
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
    /// `ibv_dereg_mr` (a stand-in in tests, which have no device).
    pub(crate) dereg: fn(*mut ibv_mr) -> i32,
    /// The deregistration failed: the key may still name the range.
    pub(crate) failed: bool,
}

impl MrKey {
    pub(crate) fn new(mr: *mut ibv_mr, pd: &Arc<Pd>) -> Self {
        MrKey {
            mr: MrPtr(mr),
            _pd: Arc::clone(pd),
            dereg,
            failed: false,
        }
    }
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
    /// Deregisters the range, once.
    fn revoke(&mut self) {
        let mr = std::mem::replace(&mut self.mr.0, std::ptr::null_mut());
        if !mr.is_null() && (self.dereg)(mr) != 0 {
            self.failed = true;
        }
    }

    /// Releases the lease, unless the deregistration failed: its key may still be valid, so it never is.
    fn release(&mut self, lease: Released) {
        if self.failed {
            lease.keep_for_good();
        } else {
            lease.release();
        }
    }
}

/// A window's handle, shared by its exposure, the record of its bind (while the bind is on the send queue) and,
/// weakly, its endpoint. The window is deallocated (its key revoked) when the last of the first two goes, or when
/// the endpoint forces it: a queue pair with windows still bound to it cannot be destroyed (rxe waits for them, then
/// warns), and the keys die with the connection anyway. A bind still queued names the window and the registration
/// it binds over, so neither may go before the bind retires ([`BindHold`]); and a key that may still be valid must
/// not outlive the lease of the range it names, so an exposure dropped before its window is deallocated leaves its
/// lease parked here, released once the window is.
pub(crate) struct MwSlot(Mutex<Window>);

/// The window of an [`MwSlot`] and the lease parked on it.
struct Window {
    mw: *mut ibv_mw,
    /// Kept as a [`Released`]: should anything panic before the window goes, the range stays leased.
    parked: Option<Released>,
    /// `ibv_dealloc_mw` failed: the key may still be valid, so parked leases are never released.
    failed: bool,
    /// `ibv_dealloc_mw` (a stand-in in tests, which have no device).
    dealloc: fn(*mut ibv_mw) -> i32,
}

// SAFETY: the window pointer is only used under the mutex, to deallocate it once.
unsafe impl Send for MwSlot {}
// SAFETY: see Send.
unsafe impl Sync for MwSlot {}

fn dealloc_mw(mw: *mut ibv_mw) -> i32 {
    // SAFETY: `mw` came from ibv_alloc_mw and is deallocated exactly once: `Window::revoke` clears it under the
    // slot's lock.
    unsafe { ibv_dealloc_mw(mw) }
}

impl Window {
    /// Deallocates the window, once, then releases a parked lease; a failure keeps the lease for ever.
    fn revoke(&mut self) {
        if !self.mw.is_null() {
            let rc = (self.dealloc)(self.mw);
            self.mw = std::ptr::null_mut();
            if rc != 0 {
                tracing::error!(
                    rc,
                    "ibv_dealloc_mw failed: the window's key may still be valid; its range stays leased"
                );
                self.failed = true;
            }
        }
        if let Some(lease) = self.parked.take() {
            self.release(lease);
        }
    }

    /// Releases `lease`, unless the window's key may still name its range: then it is leaked, with its buffer.
    fn release(&self, lease: Released) {
        if self.failed {
            lease.keep_for_good();
        } else {
            lease.release();
        }
    }
}

impl MwSlot {
    pub(crate) fn new(mw: *mut ibv_mw) -> Arc<MwSlot> {
        Self::with_dealloc(mw, dealloc_mw)
    }

    fn with_dealloc(mw: *mut ibv_mw, dealloc: fn(*mut ibv_mw) -> i32) -> Arc<MwSlot> {
        Arc::new(MwSlot(Mutex::new(Window {
            mw,
            parked: None,
            failed: false,
            dealloc,
        })))
    }

    fn window(&self) -> std::sync::MutexGuard<'_, Window> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Deallocates the window (revoking its key) now, once; a lease parked on it goes back.
    pub(crate) fn dealloc(&self) {
        self.window().revoke();
    }

    /// Keeps `lease` until the window is deallocated (released at once if it already is).
    fn park(&self, lease: Released) {
        let mut w = self.window();
        if w.mw.is_null() {
            w.release(lease);
        } else {
            w.parked = Some(lease);
        }
    }
}

/// Deallocates the windows bound to a queue pair about to be destroyed (one with windows still bound cannot be: rxe
/// waits for them, then warns; and their keys end with the connection), except, when the queue pair could not be
/// moved to the error state (`in_error` false), those whose bind is still on its send queue (`queued`: the windows
/// the send queue's records hold). Such a bind may still execute, and must not find its window gone: its window
/// goes with its record, which is dropped after the queue pair is destroyed, or later with its exposure. In the
/// error state a queued bind is flushed, never executed. Returns how many were deallocated.
pub(crate) fn revoke_on_release(
    windows: &[std::sync::Weak<MwSlot>],
    queued: &[&Arc<MwSlot>],
    in_error: bool,
) -> usize {
    let mut n = 0;
    for slot in windows.iter().filter_map(std::sync::Weak::upgrade) {
        if in_error || !queued.iter().any(|q| Arc::ptr_eq(q, &slot)) {
            slot.dealloc();
            n += 1;
        }
    }
    n
}

impl Drop for MwSlot {
    fn drop(&mut self) {
        // The last holder went: the exposure, and the bind's record if the bind was still queued.
        self.0.get_mut().unwrap_or_else(|p| p.into_inner()).revoke();
    }
}

impl std::fmt::Debug for MwSlot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("MwSlot")
    }
}

/// What a window bind's record holds until the bind retires: the window (field order: deallocated first, if this
/// is its last holder) and the registration it binds over (which holds the buffer and the protection domain).
pub(crate) struct BindHold {
    pub(crate) _slot: Arc<MwSlot>,
    pub(crate) _reg: Arc<dyn Registration>,
}

/// A window's key: the window, shared with its bind's record while the bind is queued (field order: the slot goes
/// before the registration it binds over).
#[derive(Debug)]
pub(crate) struct WindowKey {
    pub(crate) slot: Arc<MwSlot>,
    pub(crate) _reg: Arc<dyn Registration>,
    pub(crate) _pd: Arc<Pd>,
}

impl Revoke for WindowKey {
    /// Nothing yet: the window is deallocated when the slot's last holder goes (this key right after its lease is
    /// parked, unless a queued bind still holds the slot).
    fn revoke(&mut self) {}

    /// Parks the lease on the window: released when the window is deallocated.
    fn release(&mut self, lease: Released) {
        self.slot.park(lease);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use exs_dma::LeaseKind;
    use exs_transport::{KeyedLease, RemoteRef};
    use std::sync::atomic::{AtomicUsize, Ordering};

    static DEALLOCS: AtomicUsize = AtomicUsize::new(0);

    fn fake_dealloc(_: *mut ibv_mw) -> i32 {
        DEALLOCS.fetch_add(1, Ordering::SeqCst);
        0
    }

    fn failing_dealloc(_: *mut ibv_mw) -> i32 {
        libc::EBUSY
    }

    /// A window that is never touched (the stand-ins do not dereference it).
    fn fake_mw() -> *mut ibv_mw {
        std::ptr::NonNull::dangling().as_ptr()
    }

    #[test]
    fn a_registration_out_of_memory_names_the_limit_with_the_call_and_code_as_its_source() {
        use std::error::Error;
        let e = reg_error(
            4096,
            std::io::Error::from_raw_os_error(libc::ENOMEM),
            Some(65536),
        );
        assert!(e.to_string().contains("RLIMIT_MEMLOCK: 65536 bytes"), "{e}");
        assert_eq!(e.io_kind(), std::io::ErrorKind::OutOfMemory);
        assert_eq!(
            e.source().map(|s| s.to_string()).as_deref(),
            Some("ibv_reg_mr returned 12")
        );
        let other = reg_error(4096, std::io::Error::from_raw_os_error(libc::EFAULT), None);
        assert_eq!(
            other.source().map(|s| s.to_string()).as_deref(),
            Some("ibv_reg_mr returned 14")
        );
    }

    #[test]
    fn a_window_whose_bind_is_still_queued_outlives_its_exposure_and_keeps_the_range_leased() {
        let buf = DmaBuf::new(4096);
        let lease = buf.lease(0..100, LeaseKind::DeviceWrite).unwrap();
        let before = DEALLOCS.load(Ordering::SeqCst);
        let slot = MwSlot::with_dealloc(fake_mw(), fake_dealloc);
        // The bind's record holds the window while the bind is queued.
        let bind = Arc::clone(&slot);
        // The exposure goes first: the window stays, and so does the lease of the range its key may name.
        slot.park(Released::new(lease));
        drop(slot);
        assert_eq!(
            DEALLOCS.load(Ordering::SeqCst),
            before,
            "not deallocated under a queued bind"
        );
        assert!(
            buf.is_range_leased(0..100),
            "the range stays leased while the key may be valid"
        );
        // The bind retires: the window goes, then the lease.
        drop(bind);
        assert_eq!(DEALLOCS.load(Ordering::SeqCst), before + 1);
        assert!(!buf.is_range_leased(0..100));
    }

    fn failing_dereg(_: *mut ibv_mr) -> i32 {
        libc::EBUSY
    }

    #[test]
    fn a_range_registration_that_fails_to_deregister_keeps_its_range_leased() {
        let buf = DmaBuf::new(4096);
        let lease = buf.lease(0..64, LeaseKind::DeviceWrite).unwrap();
        // A stand-in domain, never deallocated (its last Arc is forgotten below).
        let pd = Arc::new(Pd(std::ptr::null_mut()));
        let key = MrKey {
            mr: MrPtr(std::ptr::NonNull::dangling().as_ptr()),
            _pd: Arc::clone(&pd),
            dereg: failing_dereg,
            failed: false,
        };
        let exposed = KeyedLease::new(RemoteRef { addr: 0, key: 1 }, lease, key);
        drop(exposed);
        std::mem::forget(pd);
        assert!(
            buf.is_range_leased(0..64),
            "its key may still name the range"
        );
        assert!(buf.kept_for_good(), "and its owner is told so");
    }

    #[test]
    fn a_base_registration_that_fails_to_deregister_keeps_its_buffer() {
        let buf = DmaBuf::new(4096);
        // A stand-in domain, never deallocated (the registration keeps it when deregistering fails).
        let pd = Arc::new(Pd(std::ptr::null_mut()));
        let reg = VerbsRegistration {
            _pd: Arc::clone(&pd),
            mr: std::ptr::NonNull::dangling().as_ptr(),
            lkey: 1,
            buf: Arc::clone(&buf),
            dereg: failing_dereg,
        };
        drop(reg);
        assert_eq!(
            Arc::strong_count(&buf),
            2,
            "the registration may still be valid: its memory is never given back"
        );
        assert!(buf.kept_for_good(), "and its owner is told so");
        assert_eq!(
            Arc::strong_count(&pd),
            2,
            "nor its protection domain deallocated"
        );
        std::mem::forget(pd);
    }

    fn deallocated(slot: &MwSlot) -> bool {
        slot.window().mw.is_null()
    }

    #[test]
    fn a_release_leaves_a_queued_binds_window_alone_when_its_queue_pair_could_not_be_broken() {
        let queued = MwSlot::with_dealloc(fake_mw(), fake_dealloc);
        let retired = MwSlot::with_dealloc(fake_mw(), fake_dealloc);
        let gone = std::sync::Weak::new();
        let windows = [Arc::downgrade(&queued), Arc::downgrade(&retired), gone];
        // ibv_modify_qp failed: the queued bind may still run, so its window stays (its record drops it after
        // the queue pair is destroyed); the window whose bind retired goes.
        assert_eq!(revoke_on_release(&windows, &[&queued], false), 1);
        assert!(!deallocated(&queued) && deallocated(&retired));
        // In the error state the bind is flushed: every window goes.
        assert_eq!(revoke_on_release(&windows, &[&queued], true), 2);
        assert!(deallocated(&queued));
    }

    #[test]
    fn a_window_that_fails_to_deallocate_keeps_its_range_leased_for_ever() {
        let buf = DmaBuf::new(4096);
        let slot = MwSlot::with_dealloc(fake_mw(), failing_dealloc);
        slot.park(Released::new(
            buf.lease(0..64, LeaseKind::DeviceRead).unwrap(),
        ));
        slot.dealloc();
        assert!(
            buf.is_range_leased(0..64),
            "the key may still name the range"
        );
        drop(slot);
        assert!(buf.is_range_leased(0..64));
        assert!(buf.kept_for_good(), "and its owner is told so");
    }
}

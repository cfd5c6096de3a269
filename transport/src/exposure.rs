//! Remote access to leased memory: an [`Exposure`] of one range under a remote key, what revokes the key
//! ([`Revoke`]), the [`KeyedLease`] every backend hands out, and the checks made before exposing a lease.

use std::fmt;
use std::sync::Arc;

use exs_dma::{DmaBuf, Lease, LeaseKind};

use crate::{Registration, RemoteAccess, RemoteRef, TransportError};

/// Remote access to one leased range. Dropping it revokes the key where the transport can, then releases the lease.
///
/// The exposure owns the lease, so the owner of the exposure reads and writes the exposed bytes through it (the
/// stream protocol copies its intermediate buffer into exposed receive buffers this way).
pub trait Exposure: Send + fmt::Debug {
    /// What the peer needs to address the first byte of the range.
    fn remote(&self) -> RemoteRef;
    /// Copies exposed bytes out, from `offset` within the range.
    fn read(&self, offset: usize, dst: &mut [u8]) -> Result<(), TransportError>;
    /// Copies bytes into the exposed range at `offset` (the range must be exposed for remote write).
    fn write(&mut self, offset: usize, src: &[u8]) -> Result<(), TransportError>;
    /// Copies `len` bytes of `src` from `src_offset` (memory this side reads, such as its stream buffer) into the
    /// exposed range at `offset`: one copy, no bounce buffer (the range must be exposed for remote write).
    fn fill_from(
        &mut self,
        offset: usize,
        src: &DmaBuf,
        src_offset: usize,
        len: usize,
    ) -> Result<(), TransportError>;
    /// Length of the exposed range.
    fn len(&self) -> usize;
    /// Whether the exposed range is empty.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// What revokes a remote key when its exposure goes: a backend's registration of the range, or its memory window.
pub trait Revoke: Send + fmt::Debug {
    /// Makes the key useless (deregister, deallocate the window), or arranges it; called once, before the lease is
    /// handed to [`Revoke::release`].
    fn revoke(&mut self);
    /// Takes the exposed range's lease once the key is revoked; by default it is released at once. A backend whose
    /// key is revoked later (a memory window a queued bind still names) keeps it until then
    /// ([`Released::into_lease`]), and one whose key could not be revoked (and may still name the range) never
    /// releases it ([`Released::keep_for_good`]). Should this panic, or return without saying, the range is kept
    /// for good.
    fn release(&mut self, lease: Released) {
        lease.release();
    }
}

/// A revoked key's lease, handed to [`Revoke::release`], which says what becomes of it. Dropped without a word (a
/// `release` that panicked, or a path that forgot), it keeps its range leased for good: a key that may still name
/// the range must not outlive its lease (review finding: a panic in a window's release dropped the lease as it
/// unwound, while the window might be live).
#[derive(Debug)]
pub struct Released(Option<Lease>);

impl Released {
    /// `lease`, to be said what becomes of it (a backend that parks a lease keeps it in this form; its tests make
    /// one).
    pub fn new(lease: Lease) -> Self {
        Released(Some(lease))
    }

    /// The range goes back to its buffer: the key is revoked.
    pub fn release(mut self) {
        drop(self.0.take());
    }

    /// The range is never given back, and its buffer is marked so ([`Lease::keep_for_good`]): the key may still
    /// name it.
    pub fn keep_for_good(mut self) {
        if let Some(lease) = self.0.take() {
            lease.keep_for_good();
        }
    }

    /// The lease itself, for a backend that releases it once its key really goes.
    pub fn into_lease(mut self) -> Lease {
        self.0
            .take()
            .expect("a Released holds its lease until it is said what becomes of it")
    }
}

impl Drop for Released {
    fn drop(&mut self) {
        if let Some(lease) = self.0.take() {
            lease.keep_for_good();
        }
    }
}

/// No key to revoke (a receive only this side writes into).
#[derive(Debug)]
pub struct NoKey;

impl Revoke for NoKey {
    fn revoke(&mut self) {}
}

/// The [`Exposure`] every backend hands out: a key, the leased range it names, and what revokes it. Dropping it
/// revokes the key first, then releases the lease (the memory outlives every key naming it).
#[derive(Debug)]
pub struct KeyedLease<R: Revoke> {
    remote: RemoteRef,
    revoke: R,
    /// Always `Some` until dropped (then handed to [`Revoke::release`]).
    lease: Option<Lease>,
}

impl<R: Revoke> KeyedLease<R> {
    /// The exposure of `lease` under `remote`, revoked by `revoke`.
    pub fn new(remote: RemoteRef, lease: Lease, revoke: R) -> Self {
        KeyedLease {
            remote,
            revoke,
            lease: Some(lease),
        }
    }

    fn lease(&self) -> &Lease {
        self.lease
            .as_ref()
            .expect("the lease is taken only when dropped")
    }

    fn lease_mut(&mut self) -> &mut Lease {
        self.lease
            .as_mut()
            .expect("the lease is taken only when dropped")
    }
}

impl<R: Revoke> Drop for KeyedLease<R> {
    fn drop(&mut self) {
        let Some(lease) = self.lease.take() else {
            return;
        };
        // Should the revocation panic, the key may still name the range: the lease is kept for good as the panic
        // unwinds, rather than dropped with this field (review finding); so it is if `release` panics.
        let held = Released(Some(lease));
        self.revoke.revoke();
        self.revoke.release(held);
    }
}

impl<R: Revoke> Exposure for KeyedLease<R> {
    fn remote(&self) -> RemoteRef {
        self.remote
    }
    fn read(&self, offset: usize, dst: &mut [u8]) -> Result<(), TransportError> {
        self.lease()
            .read(offset, dst)
            .map_err(|e| TransportError::Invalid(e.to_string()))
    }
    fn write(&mut self, offset: usize, src: &[u8]) -> Result<(), TransportError> {
        self.lease_mut()
            .write(offset, src)
            .map_err(|e| TransportError::Invalid(e.to_string()))
    }
    fn fill_from(
        &mut self,
        offset: usize,
        src: &DmaBuf,
        src_offset: usize,
        len: usize,
    ) -> Result<(), TransportError> {
        src.copy_into(src_offset, self.lease_mut(), offset, len)
            .map_err(|e| TransportError::Invalid(e.to_string()))
    }
    fn len(&self) -> usize {
        self.lease().len()
    }
}

/// The checks every transport makes before exposing a lease for remote access: the lease lies on the
/// registered buffer, is not empty, and is of a kind that allows the access (a remote write needs a lease the
/// device may write, a remote read one it may read), so no exposure can contradict the lease table.
pub fn check_exposure(
    reg: &Arc<dyn Registration>,
    lease: &Lease,
    access: RemoteAccess,
) -> Result<(), TransportError> {
    if !Arc::ptr_eq(reg.buf(), lease.buf()) {
        return Err(TransportError::Invalid(
            "exposure lease is not on the registered buffer".into(),
        ));
    }
    if lease.is_empty() {
        return Err(TransportError::Invalid("cannot expose zero bytes".into()));
    }
    let fits = match access {
        RemoteAccess::Read => matches!(
            lease.kind(),
            LeaseKind::DeviceRead | LeaseKind::DeviceReadShared | LeaseKind::TrustedKey
        ),
        RemoteAccess::Write => device_may_write(lease.kind()),
    };
    if !fits {
        return Err(TransportError::Invalid(format!(
            "a {:?} lease cannot be exposed for {access:?}",
            lease.kind()
        )));
    }
    Ok(())
}

/// Whether a lease of `kind` lets a device write its range: the target of a remote write, a receive, or the sink of
/// an RDMA read.
pub(crate) fn device_may_write(kind: LeaseKind) -> bool {
    matches!(
        kind,
        LeaseKind::DeviceWrite | LeaseKind::DeviceWriteShared | LeaseKind::TrustedKey
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Panics in its revocation, or in its release.
    #[derive(Debug)]
    struct PanickingRevoke {
        in_release: bool,
    }

    impl Revoke for PanickingRevoke {
        fn revoke(&mut self) {
            assert!(
                self.in_release,
                "the device call behind the revocation panicked"
            );
        }
        fn release(&mut self, _lease: Released) {
            panic!("the release panicked");
        }
    }

    /// Drops an exposure whose revocation (or release) panics; its range must stay leased, for good.
    fn kept_after_a_panic(in_release: bool) {
        let buf = DmaBuf::new(4096);
        let lease = buf.lease(0..64, LeaseKind::DeviceRead).unwrap();
        let exposed = KeyedLease::new(
            RemoteRef { addr: 0, key: 1 },
            lease,
            PanickingRevoke { in_release },
        );
        let unwound = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| drop(exposed)));
        assert!(unwound.is_err());
        assert!(
            buf.is_range_leased(0..64),
            "the key may still name the range"
        );
        assert!(buf.kept_for_good(), "and its owner is told so");
    }

    #[test]
    fn a_key_whose_revocation_panics_keeps_its_range_leased_for_good() {
        kept_after_a_panic(false);
    }

    #[test]
    fn a_key_whose_release_panics_keeps_its_range_leased_for_good() {
        kept_after_a_panic(true);
    }

    #[test]
    fn a_released_lease_goes_back_and_one_never_told_is_kept() {
        let buf = DmaBuf::new(4096);
        Released(Some(buf.lease(0..64, LeaseKind::DeviceRead).unwrap())).release();
        assert!(!buf.is_range_leased(0..64));
        drop(Released(Some(
            buf.lease(0..64, LeaseKind::DeviceRead).unwrap(),
        )));
        assert!(buf.is_range_leased(0..64) && buf.kept_for_good());
    }
}

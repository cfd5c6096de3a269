//! Registered memory: `exs_mregister` / `exs_mderegister`.
//!
//! A [`MemoryRegion`] is a buffer registered with one [`Context`]'s transport. Operations name a range of it
//! with a [`Slice`]. While an operation is pending, its range is leased (see `exs-dma`): the application cannot
//! write a range a send is exposing or read a range a receive may be filling (it gets
//! [`BufferError::Busy`]), the region cannot be deregistered
//! ([`MemoryError::InUse`]), and dropping every handle keeps the memory alive until the last pending operation and
//! remote key are gone. No sequence of safe calls can make the hardware touch freed memory.

use std::fmt;
use std::ops::{Bound, Range, RangeBounds};
use std::sync::{Arc, Mutex, Weak};

use exs_dma::{DmaBuf, LeaseKind};

use crate::context::Context;
use crate::error::{BufferError, MemoryError};
use crate::progress::Shared;
use crate::transport::{Registration, Sge};

/// Memory registered for RDMA with one context (ES-API `exs_mregister`). Cheap to clone (a handle).
///
/// An operation names a [`Slice`] of a region; the range is leased to it until its event, and the region
/// refuses what would race the device meanwhile (a copy into a range a send is reading, a deregistration).
///
/// Registering pins the region's pages, and deregistering unpins them: a while for a large region, on the calling
/// thread. The context's connections go on meanwhile (neither holds the engine's lock, on every backend here).
///
/// ```
/// # #[cfg(feature = "fabric")] {
/// use exs::{fabric::FabricConfig, Backend, Context, MemoryRegion};
///
/// let ctx = Context::open(&Backend::Fabric(FabricConfig::default()))?;
/// let region = MemoryRegion::alloc(&ctx, 4096)?;          // zeroed, page-aligned, registered
/// region.write(0, b"header")?;
/// let body = region.slice(6..4096);                        // what a send or receive would name
/// assert_eq!((body.offset(), body.len()), (6, 4090));
/// let mut head = [0u8; 6];
/// region.read(0, &mut head)?;
/// assert_eq!(&head, b"header");
///
/// // A vector, registered in place and given back once nothing uses it.
/// let mine = MemoryRegion::from_vec(&ctx, vec![7u8; 100])?;
/// assert_eq!(mine.into_vec().map_err(|(_, e)| e)?, vec![7u8; 100]);
/// # }
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone)]
pub struct MemoryRegion {
    inner: Arc<RegionInner>,
}

struct RegionInner {
    buf: Arc<DmaBuf>,
    /// `None` once deregistered. The lock also orders "take a lease" against "check for leases, deregister".
    reg: Mutex<Option<Arc<dyn Registration>>>,
    context_id: u64,
    /// The context's engine, for the trusted policy's keys (revoked at deregistration). Weak: a region does not
    /// keep its context alive.
    ctx: Weak<Shared>,
    /// Revokes those keys when the last handle goes.
    _revoke: RevokeOnDrop,
}

/// Issue 27: dropping the last handle of a region revokes the whole-region keys the trusted-peer policy handed out
/// for it (they used to live, with the memory and its registration, until their connections ended, and a peer could
/// still read the region). Keys of pending operations go with their operations, under every policy; the memory
/// is freed only once the last of them is gone (each holds a lease).
struct RevokeOnDrop {
    ctx: Weak<Shared>,
    buf: Weak<DmaBuf>,
}

impl Drop for RevokeOnDrop {
    fn drop(&mut self) {
        // A buffer nothing else holds has no key left; a context that is gone took its keys with it.
        let (Some(shared), Some(buf)) = (self.ctx.upgrade(), self.buf.upgrade()) else {
            return;
        };
        // Not under this thread's engine lock, if it holds it (a region can be dropped inside an engine call).
        crate::lock::run_unlocked(move || {
            let mut engine = shared.lock();
            if engine.trusted_keys(&buf) > 0 {
                engine.forget_trusted(&buf);
            }
        });
    }
}

impl MemoryRegion {
    /// Allocates `len` zeroed, page-aligned bytes and registers them (ES-API `exs_mregister`).
    pub fn alloc(ctx: &Context, len: usize) -> Result<Self, MemoryError> {
        if len == 0 {
            return Err(MemoryError::Empty);
        }
        let buf = DmaBuf::try_new(len).ok_or(MemoryError::NoMemory { len })?;
        Self::register(ctx, buf)
    }

    /// Registers the bytes of a vector without copying them (ES-API `exs_mregister` of caller memory).
    /// Get them back with [`MemoryRegion::into_vec`]. Unlike [`MemoryRegion::alloc`]'s pages, the vector's share
    /// pages with the rest of the heap and are not kept out of a forked child (`MADV_DONTFORK`): a process that
    /// forks while the region is in use should register `alloc`ated memory instead (see the memory chapter).
    pub fn from_vec(ctx: &Context, bytes: Vec<u8>) -> Result<Self, MemoryError> {
        if bytes.is_empty() {
            return Err(MemoryError::Empty);
        }
        Self::register(ctx, DmaBuf::from_vec(bytes))
    }

    /// Registers a buffer made elsewhere without copying it: memory the caller owns
    /// ([`DmaBuf::from_raw_parts`], how the C API's `exs_mregister` takes a program's own memory; the promise
    /// about its lifetime was made there), or any other [`DmaBuf`]. Give it back with
    /// [`MemoryRegion::into_dma_buf`].
    pub fn from_dma_buf(ctx: &Context, buf: Arc<DmaBuf>) -> Result<Self, MemoryError> {
        if buf.is_empty() {
            return Err(MemoryError::Empty);
        }
        Self::register(ctx, buf)
    }

    fn register(ctx: &Context, buf: Arc<DmaBuf>) -> Result<Self, MemoryError> {
        let reg = ctx.register(&buf)?;
        let revoke = RevokeOnDrop {
            ctx: Arc::downgrade(ctx.shared()),
            buf: Arc::downgrade(&buf),
        };
        Ok(Self {
            inner: Arc::new(RegionInner {
                buf,
                reg: Mutex::new(Some(reg)),
                context_id: ctx.id(),
                ctx: Arc::downgrade(ctx.shared()),
                _revoke: revoke,
            }),
        })
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.inner.buf.len()
    }

    /// Whether the region is empty (never true for a registered region).
    pub fn is_empty(&self) -> bool {
        self.inner.buf.is_empty()
    }

    /// Names a range for an operation. Nothing is checked until the operation starts.
    pub fn slice(&self, range: impl RangeBounds<usize>) -> Slice {
        let start = match range.start_bound() {
            Bound::Included(&s) => s,
            Bound::Excluded(&s) => s.saturating_add(1),
            Bound::Unbounded => 0,
        };
        let end = match range.end_bound() {
            Bound::Included(&e) => e.saturating_add(1),
            Bound::Excluded(&e) => e,
            Bound::Unbounded => self.len(),
        };
        Slice {
            region: self.clone(),
            start,
            end,
        }
    }

    /// The whole region.
    pub fn all(&self) -> Slice {
        self.slice(..)
    }

    /// Copies bytes out. Refused while a pending receive may be writing the range; allowed alongside a persistent
    /// receive, in which case the bytes may be a mixture of old and new (the UNH-EXS paper, 4.3).
    pub fn read(&self, offset: usize, dst: &mut [u8]) -> Result<(), BufferError> {
        Ok(self.inner.buf.read_at(offset, dst)?)
    }

    /// Copies bytes in. Refused while a pending send exposes the range; allowed alongside a persistent send
    /// (the UNH-EXS paper, 4.2: the sender keeps updating what the peer samples).
    pub fn write(&self, offset: usize, src: &[u8]) -> Result<(), BufferError> {
        Ok(self.inner.buf.write_at(offset, src)?)
    }

    /// Borrows a range for reading, without copying. Refused while a device may write the range, and while the
    /// trusted-peers exposure policy has a key over the region (a peer may write any byte then: copy with
    /// [`MemoryRegion::read`]); while the borrow lives, an operation under that policy that would make the
    /// region's first key for its connection fails, saying the range is in use.
    pub fn with_slice<R>(
        &self,
        range: Range<usize>,
        f: impl FnOnce(&[u8]) -> R,
    ) -> Result<R, BufferError> {
        Ok(self.inner.buf.with_slice(range, f)?)
    }

    /// Borrows a range for writing, without copying. Refused while a device uses the range, and under a
    /// trusted-peers key as [`MemoryRegion::with_slice`] is.
    pub fn with_slice_mut<R>(
        &self,
        range: Range<usize>,
        f: impl FnOnce(&mut [u8]) -> R,
    ) -> Result<R, BufferError> {
        Ok(self.inner.buf.with_slice_mut(range, f)?)
    }

    /// Copies the whole region into a new vector.
    pub fn to_vec(&self) -> Result<Vec<u8>, BufferError> {
        let mut v = vec![0u8; self.len()];
        self.read(0, &mut v)?;
        Ok(v)
    }

    /// Number of pending operations and remote keys using the region.
    pub fn leases(&self) -> usize {
        self.inner.buf.lease_count()
    }

    /// Deregisters the region (ES-API `exs_mderegister`). Refused while any operation or remote key uses it.
    /// Other handles (clones, slices) become unusable for new operations.
    /// Under the trusted-peer policy ([`crate::ExposurePolicy::TrustedPeers`]) the keys the region's connections
    /// hold for it are not counted as uses: they are revoked here.
    pub fn deregister(&self) -> Result<(), MemoryError> {
        self.deregister_if(false)
    }

    /// [`MemoryRegion::deregister`]; with `unheld`, also refused while anything but the region and its
    /// registration holds the buffer or the registration (see [`MemoryRegion::into_dma_buf`]).
    fn deregister_if(&self, unheld: bool) -> Result<(), MemoryError> {
        let taken = self.take_registration(unheld)?;
        // Undone once the locks are let go: undoing a registration (the device unpins the pages) takes time in
        // proportion to the region, and the engine's lock held meanwhile stalled every connection of the context.
        drop(taken);
        Ok(())
    }

    /// The checks and bookkeeping of [`MemoryRegion::deregister_if`], under the engine's lock and the region's:
    /// the registration taken out (no lease can be taken on it any more), for the caller to drop unlocked.
    fn take_registration(
        &self,
        unheld: bool,
    ) -> Result<Option<Arc<dyn Registration>>, MemoryError> {
        // The engine's lock before the region's: the engine leases slices while it holds its own.
        let shared = self.inner.ctx.upgrade();
        let mut engine = shared.as_ref().map(|s| s.lock());
        let mut reg = self.inner.reg.lock().unwrap_or_else(|p| p.into_inner());
        let keys = engine
            .as_ref()
            .map_or(0, |e| e.trusted_keys(&self.inner.buf));
        let leases = self.inner.buf.lease_count().saturating_sub(keys);
        if leases > 0 {
            return Err(MemoryError::InUse { leases });
        }
        if keys > 0 {
            // Revoked whether or not the region then goes: they are made again at the next use.
            if let Some(e) = engine.as_mut() {
                e.forget_trusted(&self.inner.buf);
            }
        }
        // A lease dropped on another thread lets go of its table entry first, then of the buffer, and its
        // scatter/gather entry of the registration after that: in between, no lease is counted but the buffer
        // cannot be handed back yet. Nothing new can take hold meanwhile (leases are taken under `reg`).
        let held = |r: &Arc<dyn Registration>| {
            Arc::strong_count(&self.inner.buf) > 2 || Arc::strong_count(r) > 1
        };
        if unheld && reg.as_ref().is_some_and(held) {
            return Err(MemoryError::InUse { leases: 0 });
        }
        Ok(reg.take())
    }

    /// Deregisters and gives the bytes back, if this is the only handle and nothing uses the region.
    pub fn into_vec(self) -> Result<Vec<u8>, (Self, MemoryError)> {
        let buf = self.into_dma_buf()?;
        Ok(DmaBuf::into_vec(Arc::new(buf)).unwrap_or_else(|_| {
            unreachable!("a buffer just taken out of its only Arc has no other handle")
        }))
    }

    /// Deregisters and gives the buffer itself back, if this is the only handle and nothing holds the buffer any
    /// more (no operation, remote key or registration): once this returns `Ok` and the buffer is dropped, exs
    /// keeps no reference to the memory, so the owner of memory given with [`DmaBuf::from_raw_parts`] may free
    /// it (the C API's `exs_mderegister`). Otherwise the region comes back with [`MemoryError::InUse`], or, if
    /// the device kept the memory (undoing its registration or revoking a key over it failed),
    /// [`MemoryError::Kept`], for good: the memory is never handed back.
    pub fn into_dma_buf(self) -> Result<DmaBuf, (Self, MemoryError)> {
        // A key over it that could not be revoked keeps a lease for good: no wait ends that.
        if self.inner.buf.kept_for_good() {
            return Err((self, MemoryError::Kept));
        }
        // Another handle (a clone, a slice) could start an operation: refused before anything changes.
        if Arc::strong_count(&self.inner) > 1 {
            let leases = self.inner.buf.lease_count();
            return Err((self, MemoryError::InUse { leases }));
        }
        if let Err(e) = self.deregister_if(true) {
            return Err((self, e));
        }
        let inner = match Arc::try_unwrap(self.inner) {
            Ok(inner) => inner,
            Err(inner) => {
                let leases = inner.buf.lease_count();
                return Err((MemoryRegion { inner }, MemoryError::InUse { leases }));
            }
        };
        Arc::try_unwrap(inner.buf).map_err(|buf| {
            let leases = buf.lease_count();
            // The device kept it (its deregistration failed): `InUse` said to try again, for ever (review finding).
            let e = match buf.kept_for_good() {
                true => MemoryError::Kept,
                false => MemoryError::InUse { leases },
            };
            let region = MemoryRegion {
                inner: Arc::new(RegionInner {
                    _revoke: RevokeOnDrop {
                        ctx: Weak::new(),
                        buf: Arc::downgrade(&buf),
                    },
                    buf,
                    reg: Mutex::new(None),
                    context_id: inner.context_id,
                    ctx: Weak::new(),
                }),
            };
            (region, e)
        })
    }

    pub(crate) fn context_id(&self) -> u64 {
        self.inner.context_id
    }

    /// Leases a range and pairs it with the registration, as one step with respect to deregistration.
    pub(crate) fn lease(&self, range: Range<usize>, kind: LeaseKind) -> Result<Sge, BufferError> {
        let reg = self.inner.reg.lock().unwrap_or_else(|p| p.into_inner());
        let reg = reg.as_ref().ok_or(BufferError::Deregistered)?;
        let lease = self.inner.buf.lease(range, kind)?;
        Sge::new(lease, Arc::clone(reg)).map_err(|_| BufferError::Deregistered)
    }
}

impl fmt::Debug for MemoryRegion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryRegion")
            .field("len", &self.len())
            .field("leases", &self.leases())
            .field("context", &self.inner.context_id)
            .finish()
    }
}

/// A range of a [`MemoryRegion`] named for one operation.
#[derive(Clone, Debug)]
pub struct Slice {
    region: MemoryRegion,
    start: usize,
    end: usize,
}

impl Slice {
    /// The region.
    pub fn region(&self) -> &MemoryRegion {
        &self.region
    }

    /// Offset of the first byte in the region.
    pub fn offset(&self) -> usize {
        self.start
    }

    /// Length in bytes (zero if the range is inverted; the operation will refuse it).
    pub fn len(&self) -> usize {
        self.end.saturating_sub(self.start)
    }

    /// Whether the slice is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub(crate) fn range(&self) -> Range<usize> {
        self.start..self.end
    }

    /// Checks that the slice lies in its region and that the region belongs to context `ctx`.
    pub(crate) fn check(&self, ctx: u64) -> Result<(), BufferError> {
        if self.region.context_id() != ctx {
            return Err(BufferError::WrongContext);
        }
        if self.start > self.end || self.end > self.region.len() {
            return Err(BufferError::OutOfRegion {
                start: self.start,
                end: self.end,
                len: self.region.len(),
            });
        }
        Ok(())
    }

    pub(crate) fn lease(&self, kind: LeaseKind) -> Result<Sge, BufferError> {
        self.region.lease(self.range(), kind)
    }
}

impl crate::engine::Buffer for Slice {
    fn len(&self) -> usize {
        Slice::len(self)
    }

    fn check(&self, ctx: u64) -> Result<(), BufferError> {
        Slice::check(self, ctx)
    }

    fn lease(&self, kind: LeaseKind) -> Result<Sge, BufferError> {
        Slice::lease(self, kind)
    }
}

#[cfg(all(test, feature = "sim"))]
mod tests {
    use std::sync::atomic::{AtomicU8, Ordering};

    use super::*;
    use crate::sim::{SimConfig, World};

    /// A registration that, when it goes, records whether the context's engine was free (1) or locked (2).
    #[derive(Debug)]
    struct Probe {
        buf: Arc<DmaBuf>,
        ctx: Weak<Shared>,
        seen: Arc<AtomicU8>,
    }

    impl Registration for Probe {
        fn local_key(&self) -> u64 {
            0
        }
        fn buf(&self) -> &Arc<DmaBuf> {
            &self.buf
        }
        fn as_any(&self) -> &dyn std::any::Any {
            self
        }
    }

    impl Drop for Probe {
        fn drop(&mut self) {
            let free = self
                .ctx
                .upgrade()
                .is_some_and(|s| crate::lock::EngineGuard::try_lock(&s.engine).is_some());
            self.seen.store(if free { 1 } else { 2 }, Ordering::SeqCst);
        }
    }

    /// Registering pins the buffer's pages, a while for a large one: done under the engine's lock, as it was,
    /// it stalled every connection of the context meanwhile. A region is now registered while another thread
    /// holds the engine, and counted with the context's registrations.
    #[test]
    fn a_region_is_registered_while_another_thread_holds_the_engine() {
        let world = World::new(SimConfig::default());
        let ctx = world.host();
        let before = ctx.stats().registrations;
        let engine = ctx.shared().lock();
        let (tx, rx) = std::sync::mpsc::channel();
        let c = ctx.clone();
        let t = std::thread::spawn(move || {
            let _ = tx.send(MemoryRegion::alloc(&c, 4096).map(|r| r.len()));
        });
        let registered = rx.recv_timeout(std::time::Duration::from_secs(30));
        drop(engine);
        t.join().expect("the registering thread");
        assert_eq!(
            registered.map_err(|e| e.to_string()),
            Ok(Ok(4096)),
            "the registration waited for the engine"
        );
        assert_eq!(ctx.stats().registrations, before + 1);
    }

    /// Undoing a registration unpins the region's pages, which takes time in proportion to its size: done under
    /// the engine's lock, as it was, it stalled every connection of the context meanwhile.
    #[test]
    fn a_registration_is_undone_after_the_engines_lock_is_let_go() {
        let world = World::new(SimConfig::default());
        let ctx = world.host();
        for handing_back in [false, true] {
            let region = MemoryRegion::alloc(&ctx, 4096).expect("region");
            let seen = Arc::new(AtomicU8::new(0));
            let probe = Probe {
                buf: Arc::clone(&region.inner.buf),
                ctx: region.inner.ctx.clone(),
                seen: Arc::clone(&seen),
            };
            *region.inner.reg.lock().expect("not poisoned") = Some(Arc::new(probe));
            if handing_back {
                region
                    .into_dma_buf()
                    .map_err(|(_, e)| e)
                    .expect("nothing uses the region");
            } else {
                region.deregister().expect("nothing uses the region");
            }
            assert_eq!(
                seen.load(Ordering::SeqCst),
                1,
                "the registration went while the engine was locked (into_dma_buf: {handing_back})"
            );
        }
    }
}

//! Memory that a device may read or write behind the compiler's back.
//!
//! RDMA hands memory to hardware (and, through remote keys, to a remote peer). From Rust's point of view that
//! memory is written "by nobody": the compiler cannot see the device. Two things must therefore hold for every
//! byte we hand out:
//!
//! 1. **Lifetime**: the memory outlives every work request and every remote key that names it.
//! 2. **Exclusion**: no Rust reference to a range exists while a device may write it, and no device is told to
//!    write a range that Rust code is reading or writing.
//!
//! This crate encodes both. A [`DmaBuf`] is a fixed, page-aligned allocation that never moves. Every use of a
//! range (by a device or by the CPU) holds a [`Lease`] on it, except a short copy, which holds the lease table of
//! its buffer (of both buffers, for a copy from one into a lease on another) for its time instead (no lease can be
//! taken meanwhile). A lease holds an `Arc` of its buffer, so the
//! memory lives as long as any lease does (rule 1), and the buffer's lease table refuses a lease (or a copy) that
//! conflicts with one already held (rule 2). A work request *owns* the leases of the memory it names, and a
//! transport drops them only when the hardware is done with it (completion or flush). Remote exposure (a remote
//! key) is a lease too.
//!
//! Two lease kinds are racy by design, because the EXS paper asks for it (seed 002, sections 4.2 and 4.3):
//! a persistent send lets the remote side read memory the application keeps updating, and a persistent receive
//! lets the remote side overwrite memory the application keeps reading. For those, the CPU may only *copy*
//! ([`DmaBuf::read_at`], [`DmaBuf::write_at`]), never borrow, and copies of such ranges use relaxed atomic loads
//! and stores so that a racing writer (a simulated device is a Rust thread) is never a data race in Rust's sense;
//! a reader may see a torn mixture of old and new bytes, which is what the paper describes.
//!
//! This is the only crate of the protocol side that contains `unsafe`; each block states its invariant.

#![deny(missing_docs)]

use std::fmt;
use std::ops::Range;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

mod access;
mod arena;
mod lease;
mod table;

pub use lease::Lease;

use access::{copy, load, store, Plain};

use table::{Entry, Table};

/// The kernel's page size in bytes (what `/proc` counts memory in), 0 if it cannot be told.
pub fn page_size() -> usize {
    arena::system_page()
}

/// The longest copy ([`DmaBuf::read_at`], [`DmaBuf::write_at`], [`DmaBuf::copy_into`]) that runs under the
/// buffer's lease table lock rather than under a lease of its own.
const COPY_UNDER_LOCK: usize = 4096;

/// Alignment of buffers allocated by [`DmaBuf::new`]: a page, which registration and DMA engines prefer.
pub const PAGE: usize = 4096;

/// What a lease lets its holder do with a range, and so what it excludes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum LeaseKind {
    /// A device reads the range: the source of a send or an RDMA write, or memory exposed for remote read.
    /// The CPU may read alongside; nobody may write.
    DeviceRead,
    /// A device writes the range: a receive target, the sink of an RDMA read, memory exposed for remote write.
    /// Exclusive.
    DeviceWrite,
    /// Persistent send (seed 002, 4.2): the remote side reads at any time while the application keeps updating
    /// the memory through [`DmaBuf::write_at`] copies.
    DeviceReadShared,
    /// Persistent receive (seed 002, 4.3) or a stream buffer: the remote side writes at any time; the CPU reads
    /// only through copies.
    DeviceWriteShared,
    /// A remote key of the trusted-peer policy (UNH-EXS, seed 002 section 4: the registration's key is exposed for
    /// its lifetime): held over the whole buffer while the key is valid. It goes over any other lease but a borrow
    /// of the bytes ([`DmaBuf::with_slice`], [`DmaBuf::with_slice_mut`]: refused), after any copy in progress that
    /// found nothing racy and so copies without atomics (it waits for that copy to end); while it is held the CPU
    /// may copy in and out (atomically) but not borrow: the peer could write any byte at any time. The operations
    /// that use the key take their own leases as usual.
    TrustedKey,
    /// The CPU reads the range (a borrow, or a copy longer than a short one: [`DmaBuf::read_at`]).
    CpuRead,
    /// The CPU writes the range (a mutable borrow, or a copy longer than a short one: [`DmaBuf::write_at`]).
    CpuWrite,
}

impl LeaseKind {
    fn writes(self) -> bool {
        matches!(
            self,
            Self::DeviceWrite | Self::DeviceWriteShared | Self::TrustedKey | Self::CpuWrite
        )
    }

    /// A CPU lease.
    fn cpu(self) -> bool {
        matches!(self, Self::CpuRead | Self::CpuWrite)
    }

    fn shared(self) -> bool {
        matches!(
            self,
            Self::DeviceReadShared | Self::DeviceWriteShared | Self::TrustedKey
        )
    }
}

/// How the CPU wants to touch a range: a borrow must be exclusive of any writer (a trusted key comes over it unless
/// it hands out references), a copy tolerates the racy kinds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum CpuMode {
    /// A CPU lease of [`DmaBuf::lease`]: its holder copies through it, excluding writers.
    Borrow,
    /// A borrow that hands out references to the bytes ([`DmaBuf::with_slice`]): a borrow, and a trusted key
    /// cannot come over it.
    Refs,
    /// A copy of [`DmaBuf::read_at`] and its kin.
    Copy,
}

/// Whether a new lease of `new` kind (CPU leases with `mode`) may coexist with an overlapping `held` lease
/// (`held_refs`: a borrow that hands out references).
fn compatible(held: LeaseKind, held_refs: bool, new: LeaseKind, mode: Option<CpuMode>) -> bool {
    use LeaseKind::*;
    // A trusted-policy key goes over whatever is there but a borrow that hands out references (a reference must
    // not see a peer's writes);
    // while it is held, the CPU only copies (atomically: the kind is shared), since the peer may write any byte
    // at any time. A copy in progress that found no racy lease, and so does not copy atomically, ends before the
    // key is taken (`DmaBuf::acquire` waits for it).
    if new == TrustedKey {
        return !held_refs;
    }
    if held == TrustedKey {
        return !matches!(mode, Some(CpuMode::Borrow | CpuMode::Refs));
    }
    if !held.writes() && !new.writes() {
        return true;
    }
    match (held, new, mode) {
        // Persistent receive: the remote writes, the application copies out.
        (DeviceWriteShared, CpuRead, Some(CpuMode::Copy)) => true,
        // Persistent send: the remote reads, the application copies in.
        (DeviceReadShared, CpuWrite, Some(CpuMode::Copy)) => true,
        _ => false,
    }
}

/// Why a lease or an access was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DmaError {
    /// The range does not lie inside the buffer.
    #[error("range {start}..{end} is outside the buffer of {len} bytes")]
    OutOfBounds {
        /// Start of the requested range (bytes into the buffer).
        start: usize,
        /// End of the requested range (exclusive).
        end: usize,
        /// Length of the buffer.
        len: usize,
    },
    /// Another holder uses an overlapping range in a way that excludes this one.
    #[error("range {start}..{end} is in use ({held:?}); refused {wanted:?}")]
    Busy {
        /// Start of the requested range.
        start: usize,
        /// End of the requested range (exclusive).
        end: usize,
        /// The kind of the conflicting lease already held.
        held: LeaseKind,
        /// The kind of lease (or CPU access) that was refused.
        wanted: LeaseKind,
    },
    /// The lease does not allow this access (for example writing through a read lease).
    #[error("a {kind:?} lease does not allow {access}")]
    WrongKind {
        /// The lease's kind.
        kind: LeaseKind,
        /// The access that was attempted (for example "writing").
        access: &'static str,
    },
    /// The buffer still has leases (or other handles), so it cannot be taken apart.
    #[error("the buffer is still in use by {leases} lease(s)")]
    InUse {
        /// Leases still held on the buffer.
        leases: usize,
    },
}

enum Storage {
    /// Whole pages of our own (see [`arena`]).
    Pages(arena::Origin),
    /// Taken from a caller's `Vec<u8>` (pointer, length and capacity are kept to rebuild it).
    Vec { capacity: usize },
    /// Memory the caller owns and frees ([`DmaBuf::from_raw_parts`]): never freed here.
    Foreign,
    /// Zero length: nothing was allocated.
    Empty,
}

/// A fixed allocation whose address never changes and whose every use is leased.
///
/// Create one with [`DmaBuf::new`] (page-aligned, zeroed) or take over a `Vec<u8>` with [`DmaBuf::from_vec`].
/// It is always used through an `Arc`, because leases keep it alive.
pub struct DmaBuf {
    ptr: NonNull<u8>,
    len: usize,
    storage: Storage,
    leases: Mutex<Table>,
    /// Signalled when a plain access ends while somebody waits (`Table::waiting`) to take a trusted key.
    plain_ended: Condvar,
    /// Every copy into or out of the bytes is word-sized atomics, and they are never borrowed
    /// ([`DmaBuf::try_new_device_written`]).
    words: bool,
    /// A device may still reach the bytes for good ([`DmaBuf::keep_for_good`]).
    kept: std::sync::atomic::AtomicBool,
}

// SAFETY: DmaBuf owns its allocation (no thread affinity). All access to the bytes goes through lease-checked
// paths: exclusive ranges are touched by one holder at a time, shared ranges only through atomic copies.
unsafe impl Send for DmaBuf {}
// SAFETY: see `Send`; `&DmaBuf` only exposes lease-checked access, the lease table is behind a Mutex.
unsafe impl Sync for DmaBuf {}

pub(crate) static NEXT_LEASE: AtomicU64 = AtomicU64::new(1);

impl DmaBuf {
    /// Allocates `len` zeroed bytes aligned to [`PAGE`].
    pub fn new(len: usize) -> Arc<Self> {
        Self::try_new(len)
            .unwrap_or_else(|| panic!("cannot allocate {len} bytes of device-visible memory"))
    }

    /// [`DmaBuf::new`], or `None` when `len` bytes cannot be had (a length beyond what a layout can describe, or
    /// an allocation the system refuses) instead of aborting: for lengths an application chose.
    pub fn try_new(len: usize) -> Option<Arc<Self>> {
        Self::obtain(len, false)
    }

    /// [`DmaBuf::try_new`] for bytes a device writes while the CPU reads them, all their life (a stream buffer
    /// the peer writes into and the receiver copies out of): every access to them, by the CPU or by a device
    /// through a lease (a simulated one is Rust code), is word-sized atomics on the word grid, and references to
    /// them are refused ([`DmaBuf::with_slice`], [`DmaBuf::with_slice_mut`]). A shared range of
    /// any other buffer is copied with byte-sized atomics, several times slower than memory: sizes cannot mix
    /// where a write races (undefined behaviour), and its other users cannot all be made to use words. The
    /// allocation is whole pages, so the words that hold the first and last bytes are the buffer's own.
    pub fn try_new_device_written(len: usize) -> Option<Arc<Self>> {
        Self::obtain(len, true)
    }

    /// Whole pages no other allocation shares, not inherited by a forked child (see `arena`, `dont_fork`), copied
    /// a word at a time if `words` ([`DmaBuf::try_new_device_written`]).
    fn obtain(len: usize, words: bool) -> Option<Arc<Self>> {
        if len == 0 {
            return Some(Arc::new(Self::empty()));
        }
        let (ptr, origin) = arena::obtain(len)?;
        Some(Arc::new(Self {
            ptr,
            len,
            storage: Storage::Pages(origin),
            leases: Mutex::new(Table::default()),
            plain_ended: Condvar::new(),
            words,
            kept: Default::default(),
        }))
    }

    /// Takes ownership of a vector's bytes without copying. Its length becomes the buffer's length.
    pub fn from_vec(v: Vec<u8>) -> Arc<Self> {
        if v.capacity() == 0 {
            return Arc::new(Self::empty());
        }
        let mut v = std::mem::ManuallyDrop::new(v);
        let len = v.len();
        let capacity = v.capacity();
        let ptr =
            NonNull::new(v.as_mut_ptr()).expect("a vector with capacity has a non-null pointer");
        Arc::new(Self {
            ptr,
            len,
            storage: Storage::Vec { capacity },
            leases: Mutex::new(Table::default()),
            plain_ended: Condvar::new(),
            words: false,
            kept: Default::default(),
        })
    }

    /// Takes a range of memory that the caller owns (a C program's `malloc`, `mmap` or static buffer, through
    /// `exs_mregister`) without copying it. The buffer never frees it; it only leases it.
    ///
    /// # Safety
    /// The caller promises, until the returned buffer is dropped (its last `Arc`, and so its last lease, is
    /// gone; `exs::MemoryRegion::into_dma_buf` says when that is):
    /// 1. `ptr..ptr + len` is one allocation, valid for reads and writes, initialized (every byte written once, as
    ///    `calloc` or `mmap` give it; `malloc`'s must be filled first), that does not move and is not freed or
    ///    unmapped;
    /// 2. no other `DmaBuf` covers any of these bytes (two buffers would keep two lease tables, and each would lend
    ///    the same bytes out);
    /// 3. code outside this buffer accesses the range only where no lease excludes it and no call on this buffer
    ///    is copying it (`read_at`, `write_at`, `copy_into` and `copy_to` copy short ranges under the buffer's lock
    ///    and hold no lease): it does not write a range a device reads (a send in flight) and does not touch a
    ///    range a device writes (a receive in flight). Ranges under the shared kinds
    ///    ([`LeaseKind::DeviceReadShared`], [`LeaseKind::DeviceWriteShared`]) may be accessed by the owner while
    ///    the peer's device does, as seed 002 (4.2, 4.3) describes; the bytes it sees may then be a mixture. Where
    ///    the device is simulated in this process (the `sim` backend) such accesses must be atomic or volatile.
    ///
    /// These are the rules any asynchronous I/O interface states for the memory handed to it (POSIX AIO, io_uring,
    /// ibv_reg_mr); the lease table still keeps every use made through this buffer in order.
    /// Unlike [`DmaBuf::new`], the pages are not marked for fork (`MADV_WIPEONFORK`: they may hold the owner's other
    /// data).
    pub unsafe fn from_raw_parts(ptr: NonNull<u8>, len: usize) -> Arc<Self> {
        Arc::new(Self {
            ptr,
            len,
            storage: Storage::Foreign,
            leases: Mutex::new(Table::default()),
            plain_ended: Condvar::new(),
            words: false,
            kept: Default::default(),
        })
    }

    fn empty() -> Self {
        Self {
            ptr: NonNull::dangling(),
            len: 0,
            storage: Storage::Empty,
            leases: Mutex::new(Table::default()),
            plain_ended: Condvar::new(),
            words: false,
            kept: Default::default(),
        }
    }

    /// Gives the bytes back as a vector, if nobody else holds the buffer (no lease, no other `Arc`).
    pub fn into_vec(this: Arc<Self>) -> Result<Vec<u8>, (Arc<Self>, DmaError)> {
        match Arc::try_unwrap(this) {
            Ok(buf) => Ok(buf.take_vec()),
            Err(this) => {
                let leases = this.table().len();
                Err((this, DmaError::InUse { leases }))
            }
        }
    }

    fn take_vec(self) -> Vec<u8> {
        let mut me = std::mem::ManuallyDrop::new(self);
        let mut out = Vec::with_capacity(me.len);
        match me.storage {
            Storage::Vec { capacity } => {
                // SAFETY: ptr/len/capacity came from a Vec<u8> we took over in `from_vec` and never freed; `me`
                // is ManuallyDrop so its Drop will not free it again. No lease exists (we own the only handle).
                out = unsafe { Vec::from_raw_parts(me.ptr.as_ptr(), me.len, capacity) };
            }
            Storage::Pages(origin) => {
                // SAFETY: we own the only handle, so no lease or device uses the bytes; the pages are valid for
                // `len` bytes. Afterwards they are given back exactly once, here.
                unsafe {
                    out.extend_from_slice(std::slice::from_raw_parts(me.ptr.as_ptr(), me.len));
                    arena::release(me.ptr, origin);
                }
            }
            Storage::Foreign => {
                // SAFETY: we own the only handle, so no lease or device uses the bytes, and the owner keeps them
                // valid until this buffer is gone (`from_raw_parts`). The owner's memory is copied, not freed.
                out.extend_from_slice(unsafe {
                    std::slice::from_raw_parts(me.ptr.as_ptr(), me.len)
                });
            }
            Storage::Empty => {}
        }
        // The lease table is empty (we were the only handle); drop it explicitly since `me` is ManuallyDrop.
        // SAFETY: `me.leases` is read exactly once and never used again.
        drop(unsafe { std::ptr::read(&me.leases) });
        // SAFETY: the same, for the condition variable beside it (nobody waits: we were the only handle).
        unsafe { std::ptr::drop_in_place(&mut me.plain_ended) };
        out
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer has no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The address of the first byte, as a device sees it. Registering memory needs it; it is only a number
    /// here: using it to touch memory requires a lease.
    pub fn addr(&self) -> u64 {
        self.ptr.as_ptr() as u64
    }

    /// Marks the buffer as kept for good: a device may still reach its bytes (undoing a registration or revoking
    /// a key over it failed), so whoever holds it for that (a registration, a lease) is never let go, and its
    /// owner is told the memory never comes back ([`DmaBuf::kept_for_good`]), not to wait for it.
    pub fn keep_for_good(&self) {
        self.kept.store(true, std::sync::atomic::Ordering::SeqCst);
    }

    /// Whether the buffer is kept for good ([`DmaBuf::keep_for_good`]).
    pub fn kept_for_good(&self) -> bool {
        self.kept.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Number of leases currently held on this buffer.
    pub fn lease_count(&self) -> usize {
        self.table().len()
    }

    /// Whether any lease overlapping `range` is held.
    pub fn is_range_leased(&self, range: Range<usize>) -> bool {
        self.table().overlapping(&range).next().is_some()
    }

    fn table(&self) -> MutexGuard<'_, Table> {
        // A panic while holding this lock cannot leave the table inconsistent (each change is one push or removal),
        // so a poisoned lock is still usable.
        self.leases.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn check_range(&self, range: &Range<usize>) -> Result<(), DmaError> {
        if range.start > range.end || range.end > self.len {
            return Err(DmaError::OutOfBounds {
                start: range.start,
                end: range.end,
                len: self.len,
            });
        }
        Ok(())
    }

    fn acquire(
        &self,
        range: Range<usize>,
        kind: LeaseKind,
        mode: Option<CpuMode>,
    ) -> Result<u64, DmaError> {
        self.check_range(&range)?;
        let mut table = self.table();
        if kind == LeaseKind::TrustedKey {
            // A copy that found no racy lease stores and loads without atomics: the key, which would let a peer
            // write the bytes meanwhile, waits for it. Copies do nothing else, and those that begin meanwhile are
            // atomic (`Table::racy`), so the wait is at most the longest copy in progress.
            if table.plain_overlaps(&range) {
                let token = table.begin_wait(range.clone());
                while table.plain_overlaps(&range) {
                    table = self
                        .plain_ended
                        .wait(table)
                        .unwrap_or_else(|p| p.into_inner());
                }
                table.end_wait(token);
            }
        }
        Self::acquire_in(&mut table, range, kind, mode)
    }

    fn acquire_in(
        table: &mut Table,
        range: Range<usize>,
        kind: LeaseKind,
        mode: Option<CpuMode>,
    ) -> Result<u64, DmaError> {
        Self::check_free(table, &range, kind, mode)?;
        let id = NEXT_LEASE.fetch_add(1, Ordering::Relaxed);
        table.push(Entry {
            id,
            start: range.start,
            end: range.end,
            kind,
            refs: mode == Some(CpuMode::Refs),
        });
        Ok(id)
    }

    /// Whether `range` may be leased for `kind` beside the leases `table` holds.
    fn check_free(
        table: &Table,
        range: &Range<usize>,
        kind: LeaseKind,
        mode: Option<CpuMode>,
    ) -> Result<(), DmaError> {
        // Empty ranges overlap nothing; they are still recorded so that the buffer stays alive and counted.
        if range.start < range.end {
            if let Some(e) = table
                .overlapping(range)
                .find(|e| !compatible(e.kind, e.refs, kind, mode))
            {
                return Err(DmaError::Busy {
                    start: range.start,
                    end: range.end,
                    held: e.kind,
                    wanted: kind,
                });
            }
        }
        Ok(())
    }

    /// Runs the copy `f` over `range` (`kind`: [`LeaseKind::CpuRead`] or [`LeaseKind::CpuWrite`]) while no lease
    /// that excludes it is held, telling it whether a racy one overlaps (the copy must then be atomic). A copy of
    /// up to [`COPY_UNDER_LOCK`] bytes runs under the table's lock, where no lease can be taken meanwhile (the
    /// short copies of control messages took and gave back a lease of their own twice per message); a longer one
    /// takes a lease for its time, so that other ranges can be leased meanwhile.
    fn copying<R>(
        &self,
        range: Range<usize>,
        kind: LeaseKind,
        f: impl FnOnce(bool) -> R,
    ) -> Result<R, DmaError> {
        self.check_range(&range)?;
        let mut table = self.table();
        if range.len() <= COPY_UNDER_LOCK {
            Self::check_free(&table, &range, kind, Some(CpuMode::Copy))?;
            let racy = table.racy(&range);
            return Ok(f(racy));
        }
        let id = Self::acquire_in(&mut table, range.clone(), kind, Some(CpuMode::Copy))?;
        let racy = table.racy(&range);
        // Gives the copy's lease back and ends its plain record when the copy is over.
        let _done = Plain {
            buf: self,
            token: (!racy).then(|| table.begin_plain(range)),
            lease: Some(id),
        };
        drop(table);
        Ok(f(racy))
    }

    fn release(&self, id: u64) {
        self.table().remove(id);
    }

    /// Whether any shared (racy-by-design) lease overlaps the range: copies must then be atomic.
    #[cfg(test)]
    fn racy(&self, range: &Range<usize>) -> bool {
        self.table().racy(range)
    }

    /// Leases `range` for `kind`. Device leases are what work requests and remote keys hold.
    pub fn lease(
        self: &Arc<Self>,
        range: Range<usize>,
        kind: LeaseKind,
    ) -> Result<Lease, DmaError> {
        self.lease_for(range, kind, kind.cpu().then_some(CpuMode::Borrow))
    }

    fn lease_for(
        self: &Arc<Self>,
        range: Range<usize>,
        kind: LeaseKind,
        mode: Option<CpuMode>,
    ) -> Result<Lease, DmaError> {
        let id = self.acquire(range.clone(), kind, mode)?;
        Ok(Lease {
            buf: Arc::clone(self),
            start: range.start,
            end: range.end,
            kind,
            id,
        })
    }

    /// Copies bytes out of the buffer. Allowed alongside device reads and alongside a persistent receive
    /// (in which case the copy may see a mixture of old and new bytes).
    pub fn read_at(&self, offset: usize, dst: &mut [u8]) -> Result<(), DmaError> {
        let range = offset..offset.saturating_add(dst.len());
        self.copying(range, LeaseKind::CpuRead, |racy| {
            // SAFETY: the range is inside the buffer (checked by `copying`), and while this runs no lease that
            // lets anything write it is held but a shared one (`racy`), whose writer `load` races with atomic
            // loads only: not a data race.
            unsafe { load(self.ptr.as_ptr().add(offset), dst, self.atomicity(racy)) }
        })
    }

    /// Copies bytes into the buffer. Allowed alongside a persistent send (the remote may read a mixture).
    pub fn write_at(&self, offset: usize, src: &[u8]) -> Result<(), DmaError> {
        let range = offset..offset.saturating_add(src.len());
        self.copying(range, LeaseKind::CpuWrite, |racy| {
            // SAFETY: in bounds (checked by `copying`), and while this runs nobody else writes or borrows the
            // range; a shared reader (persistent send) is tolerated through atomic stores.
            unsafe { store(self.ptr.as_ptr().add(offset), src, self.atomicity(racy)) }
        })
    }

    /// Copies `len` bytes from `offset` in this buffer straight into `dst` at `dst_offset` (one copy, no bounce
    /// buffer): how a receiver takes bytes out of a ring the peer's device writes into the receive the
    /// application posted. Allowed alongside shared device writers of the source (their bytes are loaded
    /// atomically), refused if `dst` cannot be written or either range is out of bounds.
    pub fn copy_into(
        &self,
        offset: usize,
        dst: &mut Lease,
        dst_offset: usize,
        len: usize,
    ) -> Result<(), DmaError> {
        dst.may_write()?;
        let d = dst.check(dst_offset, len)?;
        let range = offset..offset.saturating_add(len);
        if len <= COPY_UNDER_LOCK {
            return self.copy_short_into(range, dst, dst_offset, d);
        }
        // A long copy holds no table while it copies: the destination's access is recorded (its table is not
        // held while `copying` holds this buffer's: `dst` may be on this buffer).
        let (dst_racy, _plain) = dst.access(dst_offset, len);
        self.copying(range, LeaseKind::CpuRead, |racy| {
            // SAFETY: the source range is in bounds (`copying`) and, while this runs, no lease that lets anything
            // write it is held but shared device leases, whose accesses are atomic (`racy`); the destination is
            // in bounds (check) and leased for writing by `dst`. They do not overlap: `copying` refuses a CPU
            // read next to an exclusive write of the same bytes, and a shared destination makes both sides
            // atomic.
            unsafe {
                copy(
                    self.ptr.as_ptr().add(offset),
                    d,
                    len,
                    self.atomicity(racy),
                    dst.buf.atomicity(dst_racy),
                )
            }
        })
    }

    /// Runs the short copy `f` from `src` of this buffer (through a `src_shared` lease, or none) into `dst` at
    /// `dst_offset`, holding this buffer's table and `dst`'s, and tells it (this table, then) whether each side
    /// must be atomic: the locks hold that true while it runs (no lease can be taken or given back). They are
    /// taken in the order of the `DmaBuf`s' own addresses (one, if `dst` is on this buffer), so that two copies
    /// going opposite ways between two buffers cannot deadlock: the only place that holds two tables' locks
    /// ([`DmaBuf::copy_into`], [`Lease::copy_to`] of short copies).
    pub(crate) fn with_both<R>(
        &self,
        src: &Range<usize>,
        src_shared: bool,
        dst: &Lease,
        dst_offset: usize,
        f: impl FnOnce(&Table, bool, bool) -> R,
    ) -> R {
        let other: &DmaBuf = &dst.buf;
        let (mine, theirs) = if std::ptr::eq(self, other) {
            (self.table(), None)
        } else if (self as *const Self) < (other as *const Self) {
            let mine = self.table();
            (mine, Some(other.table()))
        } else {
            let theirs = other.table();
            (self.table(), Some(theirs))
        };
        let dst_range = dst.start + dst_offset..dst.start + dst_offset + src.len();
        let src_racy = src_shared || mine.racy(src);
        let dst_racy = dst.kind.shared() || theirs.as_ref().unwrap_or(&mine).racy(&dst_range);
        f(&mine, src_racy, dst_racy)
    }

    /// [`DmaBuf::copy_into`] of a short copy (`range` of this buffer into `dst` at `dst_offset`, whose address
    /// is `d`), under both tables' locks ([`DmaBuf::with_both`]), where no lease can be taken on either range
    /// meanwhile.
    fn copy_short_into(
        &self,
        range: Range<usize>,
        dst: &Lease,
        dst_offset: usize,
        d: *mut u8,
    ) -> Result<(), DmaError> {
        self.check_range(&range)?;
        self.with_both(&range, false, dst, dst_offset, |mine, racy, dst_racy| {
            Self::check_free(mine, &range, LeaseKind::CpuRead, Some(CpuMode::Copy))?;
            // SAFETY: both ranges are in bounds (`check_range`, and `dst.check` in `copy_into`); the source has
            // no lease that lets anything write it but shared ones (`check_free`; accessed atomically if `racy`),
            // and the destination is leased for writing by `dst`. They do not overlap: `check_free` refuses a CPU
            // read next to an exclusive write of the same bytes (on one buffer, `mine` holds `dst`'s own entry),
            // and a shared destination is atomic on both sides; `with_both` keeps both sides' racy-or-not true.
            unsafe {
                copy(
                    self.ptr.as_ptr().add(range.start),
                    d,
                    range.len(),
                    self.atomicity(racy),
                    dst.buf.atomicity(dst_racy),
                )
            };
            Ok(())
        })
    }

    /// Borrows a range for reading. Refused while a device may write it, and always on a buffer only devices
    /// write ([`DmaBuf::try_new_device_written`]: copies only).
    pub fn with_slice<R>(
        self: &Arc<Self>,
        range: Range<usize>,
        f: impl FnOnce(&[u8]) -> R,
    ) -> Result<R, DmaError> {
        self.may_borrow(LeaseKind::CpuRead)?;
        let lease = self.lease_for(range, LeaseKind::CpuRead, Some(CpuMode::Refs))?;
        Ok(f(lease.as_slice()))
    }

    /// Borrows a range for writing. Refused while any device uses it, and always on a buffer only devices write.
    pub fn with_slice_mut<R>(
        self: &Arc<Self>,
        range: Range<usize>,
        f: impl FnOnce(&mut [u8]) -> R,
    ) -> Result<R, DmaError> {
        self.may_borrow(LeaseKind::CpuWrite)?;
        let mut lease = self.lease_for(range, LeaseKind::CpuWrite, Some(CpuMode::Refs))?;
        Ok(f(lease.as_mut_slice()))
    }

    /// Whether references to the bytes may be handed out: never for a buffer only devices write, whose every
    /// access is word-sized atomics that reach past the range to the whole words at its edges (their other bytes
    /// may be another lease's, read or written by a device meanwhile), which a plain reference would race.
    fn may_borrow(&self, kind: LeaseKind) -> Result<(), DmaError> {
        if self.words {
            return Err(DmaError::WrongKind {
                kind,
                access: "borrowing a buffer only devices write (it is copied, never borrowed)",
            });
        }
        Ok(())
    }
}

impl Drop for DmaBuf {
    fn drop(&mut self) {
        // No lease can exist here: every lease holds an Arc of this buffer.
        match self.storage {
            Storage::Pages(origin) => {
                // SAFETY: obtained in `try_new` and given back only here; no lease exists, and the registration
                // that let a device touch the pages held an `Arc` of this buffer, so it is gone too.
                unsafe { arena::release(self.ptr, origin) }
            }
            Storage::Vec { capacity } => {
                // SAFETY: rebuilt from the parts `from_vec` took over; freed only here.
                drop(unsafe { Vec::from_raw_parts(self.ptr.as_ptr(), self.len, capacity) })
            }
            // The owner frees it, after this buffer is gone (`from_raw_parts`).
            Storage::Foreign | Storage::Empty => {}
        }
    }
}

impl fmt::Debug for DmaBuf {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DmaBuf")
            .field("addr", &format_args!("{:#x}", self.addr()))
            .field("len", &self.len)
            .finish()
    }
}

#[cfg(test)]
mod tests;

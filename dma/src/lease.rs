//! A [`Lease`]: the right to use one range of a [`DmaBuf`] in one way, and the accesses made through it.

use std::fmt;
use std::ops::Range;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use crate::access::{copy, load, store, Plain};
use crate::table::Entry;
use crate::{DmaBuf, DmaError, LeaseKind, COPY_UNDER_LOCK, NEXT_LEASE};

/// The right to use one range of a [`DmaBuf`] in one way, for as long as the lease lives.
///
/// A lease keeps its buffer alive. Dropping it gives the range back. Device leases travel inside work requests:
/// a transport must keep the lease until the hardware can no longer touch the range.
pub struct Lease {
    pub(crate) buf: Arc<DmaBuf>,
    pub(crate) start: usize,
    pub(crate) end: usize,
    pub(crate) kind: LeaseKind,
    pub(crate) id: u64,
}

impl Lease {
    /// Never gives this lease back, and marks its buffer kept for good ([`DmaBuf::keep_for_good`]): a device may
    /// still reach the range (a key over it could not be revoked).
    pub fn keep_for_good(self) {
        self.buf.keep_for_good();
        std::mem::forget(self);
    }

    /// The buffer this lease is on.
    pub fn buf(&self) -> &Arc<DmaBuf> {
        &self.buf
    }

    /// Offset of the first byte inside the buffer.
    pub fn offset(&self) -> usize {
        self.start
    }

    /// Length of the leased range.
    pub fn len(&self) -> usize {
        self.end - self.start
    }

    /// Whether the range is empty.
    pub fn is_empty(&self) -> bool {
        self.start == self.end
    }

    /// What the lease allows.
    pub fn kind(&self) -> LeaseKind {
        self.kind
    }

    /// Device address of the first leased byte (for a scatter/gather entry).
    pub fn addr(&self) -> u64 {
        self.buf.addr() + self.start as u64
    }

    /// Splits the lease in two at `at` bytes (relative to the lease). Both halves keep the kind.
    pub fn split_at(self, at: usize) -> (Lease, Lease) {
        assert!(
            at <= self.len(),
            "split point {at} beyond lease of {} bytes",
            self.len()
        );
        let me = std::mem::ManuallyDrop::new(self);
        // SAFETY: `me` is ManuallyDrop and its Arc is read exactly once here, so its reference is moved, not
        // duplicated; the table entry of `me.id` is replaced by the two new entries below.
        let buf = unsafe { std::ptr::read(&me.buf) };
        let mid = me.start + at;
        let first_id = NEXT_LEASE.fetch_add(1, Ordering::Relaxed);
        let second_id = NEXT_LEASE.fetch_add(1, Ordering::Relaxed);
        {
            let mut t = buf.table();
            let refs = t.remove(me.id).is_some_and(|e| e.refs);
            t.push(Entry {
                id: first_id,
                start: me.start,
                end: mid,
                kind: me.kind,
                refs,
            });
            t.push(Entry {
                id: second_id,
                start: mid,
                end: me.end,
                kind: me.kind,
                refs,
            });
        }
        let first = Lease {
            buf: Arc::clone(&buf),
            start: me.start,
            end: mid,
            kind: me.kind,
            id: first_id,
        };
        let second = Lease {
            buf,
            start: mid,
            end: me.end,
            kind: me.kind,
            id: second_id,
        };
        (first, second)
    }

    /// Narrows the lease to `range` (relative to the lease), giving back the rest.
    pub fn narrow(self, range: Range<usize>) -> Lease {
        assert!(
            range.start <= range.end && range.end <= self.len(),
            "narrow {range:?} beyond {}",
            self.len()
        );
        let (_, rest) = self.split_at(range.start);
        let (mid, _) = rest.split_at(range.end - range.start);
        mid
    }

    pub(crate) fn check(&self, offset: usize, len: usize) -> Result<*mut u8, DmaError> {
        let end = offset.checked_add(len).filter(|&e| e <= self.len());
        match end {
            // SAFETY: start+offset+len <= end <= buf.len, so the pointer stays inside the allocation.
            Some(_) => Ok(unsafe { self.buf.ptr.as_ptr().add(self.start + offset) }),
            None => Err(DmaError::OutOfBounds {
                start: self.start.saturating_add(offset),
                end: self.start.saturating_add(offset).saturating_add(len),
                len: self.buf.len,
            }),
        }
    }

    /// Reads bytes through the lease (as the device that holds it).
    pub fn read(&self, offset: usize, dst: &mut [u8]) -> Result<(), DmaError> {
        let p = self.check(offset, dst.len())?;
        let range = self.start + offset..self.start + offset + dst.len();
        self.buf.accessing(&range, self.kind.shared(), |racy| {
            // SAFETY: in bounds (check); this lease excludes Rust writers of the range except racy-shared ones,
            // which are handled with atomic loads, and `accessing` keeps `racy` true while this runs.
            unsafe { load(p, dst, self.buf.atomicity(racy)) }
        });
        Ok(())
    }

    /// Writes bytes through the lease (as the device that holds it). Only write leases allow it.
    pub fn write(&mut self, offset: usize, src: &[u8]) -> Result<(), DmaError> {
        if !self.kind.writes() {
            return Err(DmaError::WrongKind {
                kind: self.kind,
                access: "writing",
            });
        }
        let p = self.check(offset, src.len())?;
        let range = self.start + offset..self.start + offset + src.len();
        self.buf.accessing(&range, self.kind.shared(), |racy| {
            // SAFETY: in bounds; a write lease excludes all other users except racy CPU copies of a shared lease,
            // which are atomic on both sides (`accessing` keeps `racy` true while this runs).
            unsafe { store(p, src, self.buf.atomicity(racy)) }
        });
        Ok(())
    }

    /// Whether an access of `len` bytes at `offset` (checked in bounds) must be atomic: the lease is shared, or a
    /// shared lease (a persistent exposure, a trusted-policy key) overlaps the range; the guard keeps it so.
    pub(crate) fn access(&self, offset: usize, len: usize) -> (bool, Plain<'_>) {
        let range = self.start + offset..self.start + offset + len;
        self.buf.access(&range, self.kind.shared())
    }

    /// Whether this lease may be written through (a destination of a copy).
    pub(crate) fn may_write(&self) -> Result<(), DmaError> {
        if self.kind.writes() {
            Ok(())
        } else {
            Err(DmaError::WrongKind {
                kind: self.kind,
                access: "writing",
            })
        }
    }

    /// Copies `len` bytes from this lease at `offset` into `dst` at `dst_offset` (device-to-device).
    pub fn copy_to(
        &self,
        offset: usize,
        dst: &mut Lease,
        dst_offset: usize,
        len: usize,
    ) -> Result<(), DmaError> {
        dst.may_write()?;
        let s = self.check(offset, len)?;
        let d = dst.check(dst_offset, len)?;
        let copy_racy = |src_racy, dst_racy| {
            // SAFETY: both ranges are in bounds and leased (source for reading, destination for writing). The
            // two leases cannot overlap in a conflicting way (the table refused that), so the ranges do not alias
            // unless both are shared, in which case everything goes through atomic loads/stores of a bounce
            // buffer. The caller keeps both sides' racy-or-not true while this runs.
            unsafe {
                copy(
                    s,
                    d,
                    len,
                    self.buf.atomicity(src_racy),
                    dst.buf.atomicity(dst_racy),
                )
            }
        };
        if len <= COPY_UNDER_LOCK {
            // Under both tables' locks (a control message's inline bytes, once per message).
            let src = self.start + offset..self.start + offset + len;
            self.buf.with_both(
                &src,
                self.kind.shared(),
                dst,
                dst_offset,
                |_, src_racy, dst_racy| copy_racy(src_racy, dst_racy),
            );
            return Ok(());
        }
        let (src_racy, _src) = self.access(offset, len);
        let (dst_racy, _dst) = dst.access(dst_offset, len);
        copy_racy(src_racy, dst_racy);
        Ok(())
    }

    /// A shared slice of the leased bytes. Only CPU leases hand out references.
    pub(crate) fn as_slice(&self) -> &[u8] {
        debug_assert!(matches!(
            self.kind,
            LeaseKind::CpuRead | LeaseKind::CpuWrite
        ));
        // SAFETY: a borrow lease that hands out references (`CpuMode::Refs`: `with_slice`, the only caller)
        // excludes every writer (including racy shared ones and a trusted key: `compatible` refuses either beside
        // it), so the bytes do not change while the reference lives; in bounds by construction.
        unsafe { std::slice::from_raw_parts(self.buf.ptr.as_ptr().add(self.start), self.len()) }
    }

    pub(crate) fn as_mut_slice(&mut self) -> &mut [u8] {
        debug_assert_eq!(self.kind, LeaseKind::CpuWrite);
        // SAFETY: a CpuWrite borrow lease that hands out references (`CpuMode::Refs`: `with_slice_mut`, the only
        // caller) excludes every other lease on the range, a trusted key included, and `&mut self` makes this the
        // only reference derived from it.
        unsafe { std::slice::from_raw_parts_mut(self.buf.ptr.as_ptr().add(self.start), self.len()) }
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.buf.release(self.id);
    }
}

impl fmt::Debug for Lease {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Lease")
            .field("buf", &format_args!("{:#x}", self.buf.addr()))
            .field("range", &(self.start..self.end))
            .field("kind", &self.kind)
            .finish()
    }
}

//! How the bytes are touched: whether an access must be atomic, kept so while it runs, and the copies
//! themselves.

use crate::{DmaBuf, COPY_UNDER_LOCK};
use std::ops::Range;
use std::sync::atomic::{AtomicU8, Ordering};

impl DmaBuf {
    /// Runs the access `f` to `range` through a lease already held, telling it whether it must be atomic: its
    /// lease is `shared`, or a racy lease overlaps it. Whether it must stays true while it runs: a short access
    /// runs under the table's lock, where no lease can be taken; a longer one that must not be atomic is recorded
    /// as plain while it runs ([`DmaBuf::access`]), and a trusted key, the only lease that could write over it,
    /// waits for it to end.
    pub(crate) fn accessing<R>(
        &self,
        range: &Range<usize>,
        shared: bool,
        f: impl FnOnce(bool) -> R,
    ) -> R {
        if !shared && range.len() <= COPY_UNDER_LOCK {
            return f(self.table().racy(range));
        }
        let (racy, _done) = self.access(range, shared);
        f(racy)
    }

    /// Whether an access to `range` (through a `shared` lease, or not) must be atomic, and the guard of its plain
    /// record if it need not: the access runs without the table's lock (it may be long, or take another
    /// buffer's lock).
    pub(crate) fn access(&self, range: &Range<usize>, shared: bool) -> (bool, Plain<'_>) {
        let mut plain = Plain {
            buf: self,
            token: None,
            lease: None,
        };
        if shared {
            return (true, plain);
        }
        let mut table = self.table();
        let racy = table.racy(range);
        if !racy {
            plain.token = Some(table.begin_plain(range.clone()));
        }
        (racy, plain)
    }
}

/// An access in progress: its plain record (if it copies without atomics) and the lease of a copy (if it took
/// one), ended and given back when dropped (also if the access panicked: a plain record left behind would hold a
/// trusted key off for ever). Wakes the keys waiting for a plain access to end.
pub(crate) struct Plain<'a> {
    pub(crate) buf: &'a DmaBuf,
    pub(crate) token: Option<u64>,
    pub(crate) lease: Option<u64>,
}

impl Drop for Plain<'_> {
    fn drop(&mut self) {
        if self.token.is_none() && self.lease.is_none() {
            return;
        }
        let mut table = self.buf.table();
        if let Some(id) = self.lease {
            table.remove(id);
        }
        if let Some(token) = self.token {
            if table.end_plain(token) {
                self.buf.plain_ended.notify_all();
            }
        }
    }
}

/// Copies `dst.len()` bytes from `src`.
///
/// # Safety
/// `src` is valid for reads of `dst.len()` bytes and no Rust code writes them concurrently unless `racy`, in which
/// case every concurrent Rust writer uses atomic stores.
pub(crate) unsafe fn load(src: *const u8, dst: &mut [u8], racy: bool) {
    if !racy {
        // SAFETY: caller guarantees validity and absence of concurrent writers; `dst` is a distinct &mut.
        unsafe { std::ptr::copy_nonoverlapping(src, dst.as_mut_ptr(), dst.len()) };
        return;
    }
    // Byte-sized atomic loads, like every racy access here (mixing access sizes on racing bytes is not defined).
    for (i, d) in dst.iter_mut().enumerate() {
        // SAFETY: in bounds per caller; AtomicU8 has the layout of u8 and any address is aligned for it.
        *d = unsafe { &*(src.add(i) as *const AtomicU8) }.load(Ordering::Relaxed);
    }
}

/// Copies `src` to `dst`.
///
/// # Safety
/// `dst` is valid for writes of `src.len()` bytes; no Rust code accesses them concurrently unless `racy`, in which
/// case every concurrent access is atomic.
pub(crate) unsafe fn store(dst: *mut u8, src: &[u8], racy: bool) {
    if !racy {
        // SAFETY: per caller, `dst` is exclusively ours for these bytes and does not overlap `src`.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst, src.len()) };
        return;
    }
    for (i, s) in src.iter().enumerate() {
        // SAFETY: in bounds per caller; AtomicU8 has the layout of u8.
        unsafe { &*(dst.add(i) as *const AtomicU8) }.store(*s, Ordering::Relaxed);
    }
}

/// Copies `len` bytes between two leased ranges, once: only when both sides are shared does it go through a
/// bounce buffer.
///
/// # Safety
/// Both pointers are valid for `len` bytes; they do not overlap unless both are racy; racy sides are only accessed
/// atomically by everyone.
pub(crate) unsafe fn copy(
    src: *const u8,
    dst: *mut u8,
    len: usize,
    src_racy: bool,
    dst_racy: bool,
) {
    match (src_racy, dst_racy) {
        (false, false) => {
            // SAFETY: per caller, valid, non-overlapping, and not concurrently accessed.
            unsafe { std::ptr::copy_nonoverlapping(src, dst, len) };
        }
        (true, false) => {
            // SAFETY: `dst` is not racy, so nothing else accesses it: a unique slice over it is sound.
            let d = unsafe { std::slice::from_raw_parts_mut(dst, len) };
            // SAFETY: `src` valid for `len`; its concurrent writers are atomic.
            unsafe { load(src, d, true) };
        }
        (false, true) => {
            // SAFETY: `src` is not racy, so nobody writes it while this shared slice lives.
            let s = unsafe { std::slice::from_raw_parts(src, len) };
            // SAFETY: `dst` valid for `len`; its concurrent users are atomic.
            unsafe { store(dst, s, true) };
        }
        (true, true) => {
            let mut bounce = [0u8; 4096];
            let mut done = 0;
            while done < len {
                let n = (len - done).min(bounce.len());
                // SAFETY: sub-ranges of the caller's valid ranges; the bounce buffer is a local.
                unsafe {
                    load(src.add(done), &mut bounce[..n], true);
                    store(dst.add(done), &bounce[..n], true);
                }
                done += n;
            }
        }
    }
}

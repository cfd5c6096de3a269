//! How the bytes are touched: whether an access must be atomic, kept so while it runs, and the copies
//! themselves.

use crate::{DmaBuf, COPY_UNDER_LOCK};
use std::ops::Range;
use std::sync::atomic::{AtomicU8, AtomicUsize, Ordering};

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

/// How an access touches bytes that others may touch while it runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Atomicity {
    /// Nobody else does: a plain copy.
    Plain,
    /// A device may (a shared lease): byte-sized atomics, as every other racy access to the buffer.
    Bytes,
    /// A buffer every copy into or out of which is word-sized atomics on the word grid, and which is never
    /// borrowed ([`DmaBuf::try_new_device_written`]): an access reaches the whole words at the edges of its range,
    /// whose other bytes may be another lease's, and every Rust access to them is word-sized atomic too, so no
    /// access of another size can race one; words copy several times faster than bytes.
    Words,
}

impl DmaBuf {
    /// How an access to this buffer that must be atomic or not (`racy`) is made. Every copy into or out of a
    /// buffer is made as this says, and a buffer only devices write is never borrowed, which is what the contract
    /// of [`load`] and [`store`] asks of [`Atomicity::Words`].
    pub(crate) fn atomicity(&self, racy: bool) -> Atomicity {
        match (self.words, racy) {
            (true, _) => Atomicity::Words,
            (false, true) => Atomicity::Bytes,
            (false, false) => Atomicity::Plain,
        }
    }
}

const W: usize = std::mem::size_of::<usize>();

/// Copies `dst.len()` bytes from `src`.
///
/// # Safety
/// `src` is valid for reads of `dst.len()` bytes. `Plain`: no Rust code writes them concurrently. `Bytes`: every
/// concurrent Rust writer uses byte-sized atomic stores. `Words`: `src` lies in a buffer every Rust access to which
/// is [`Atomicity::Words`] (it is never borrowed), whose allocation holds the whole words around the range; their
/// bytes outside it may be accessed meanwhile, word-sized and atomically by Rust code, or by a device.
pub(crate) unsafe fn load(src: *const u8, dst: &mut [u8], how: Atomicity) {
    match how {
        Atomicity::Plain => {
            // SAFETY: caller guarantees validity and absence of concurrent writers; `dst` is a distinct &mut.
            unsafe { std::ptr::copy_nonoverlapping(src, dst.as_mut_ptr(), dst.len()) };
        }
        Atomicity::Bytes => {
            for (i, d) in dst.iter_mut().enumerate() {
                // SAFETY: in bounds per caller; AtomicU8 has the layout of u8 and any address is aligned for it.
                *d = unsafe { &*(src.add(i) as *const AtomicU8) }.load(Ordering::Relaxed);
            }
        }
        // SAFETY: per caller, the words around the range are the buffer's, and accessed word-sized only.
        Atomicity::Words => unsafe { load_words(src, dst) },
    }
}

/// Copies `src` to `dst`.
///
/// # Safety
/// `dst` is valid for writes of `src.len()` bytes. `Plain`: no Rust code accesses them concurrently. `Bytes`: every
/// concurrent Rust access is byte-sized atomic. `Words`: as for [`load`].
pub(crate) unsafe fn store(dst: *mut u8, src: &[u8], how: Atomicity) {
    match how {
        Atomicity::Plain => {
            // SAFETY: per caller, `dst` is exclusively ours for these bytes and does not overlap `src`.
            unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst, src.len()) };
        }
        Atomicity::Bytes => {
            for (i, s) in src.iter().enumerate() {
                // SAFETY: in bounds per caller; AtomicU8 has the layout of u8.
                unsafe { &*(dst.add(i) as *const AtomicU8) }.store(*s, Ordering::Relaxed);
            }
        }
        // SAFETY: as for `load`.
        Atomicity::Words => unsafe { store_words(dst, src) },
    }
}

/// The word-aligned word that holds the byte at `p`, and where in it that byte is.
///
/// # Safety
/// As for [`load`] with [`Atomicity::Words`]: the word around `p` is in the allocation `p` points into.
unsafe fn word_at(p: *const u8) -> (*const AtomicUsize, usize) {
    let head = p as usize % W;
    // SAFETY: the word around the first byte is in the allocation (caller); it is word-aligned.
    (unsafe { p.sub(head) } as *const AtomicUsize, head)
}

/// [`load`] of a word-grid buffer: the part-words at the edges and the whole words between, each one atomic load.
///
/// # Safety
/// As for [`load`] with [`Atomicity::Words`].
unsafe fn load_words(src: *const u8, dst: &mut [u8]) {
    let len = dst.len();
    if len == 0 {
        return;
    }
    // SAFETY: per caller.
    let (base, head) = unsafe { word_at(src) };
    let word = |k: usize| {
        // SAFETY: called only for words `k` that hold a byte of the range, so in the allocation (caller),
        // aligned, and accessed as AtomicUsize only; AtomicUsize has the layout of usize.
        unsafe { &*base.add(k) }
            .load(Ordering::Relaxed)
            .to_ne_bytes()
    };
    let first = (W - head).min(len);
    dst[..first].copy_from_slice(&word(0)[head..head + first]);
    let whole = (len - first) / W;
    for (k, d) in dst[first..first + whole * W]
        .chunks_exact_mut(W)
        .enumerate()
    {
        d.copy_from_slice(&word(1 + k));
    }
    let done = first + whole * W;
    if done < len {
        dst[done..].copy_from_slice(&word(1 + whole)[..len - done]);
    }
}

/// [`store`] of a word-grid buffer: whole words are stored, part-words at the edges replace only their bytes of
/// the word (a compare-and-swap: a concurrent write of the word's other bytes is kept).
///
/// # Safety
/// As for [`store`] with [`Atomicity::Words`].
unsafe fn store_words(dst: *mut u8, src: &[u8]) {
    let len = src.len();
    if len == 0 {
        return;
    }
    // SAFETY: per caller.
    let (base, head) = unsafe { word_at(dst) };
    let word = |k: usize| {
        // SAFETY: as in `load_words`.
        unsafe { &*base.add(k) }
    };
    let part = |k: usize, at: usize, bytes: &[u8]| {
        let _ = word(k).fetch_update(Ordering::Relaxed, Ordering::Relaxed, |old| {
            let mut b = old.to_ne_bytes();
            b[at..at + bytes.len()].copy_from_slice(bytes);
            Some(usize::from_ne_bytes(b))
        });
    };
    let first = (W - head).min(len);
    if first == W {
        word(0).store(
            usize::from_ne_bytes(src[..W].try_into().expect("a word")),
            Ordering::Relaxed,
        );
    } else {
        part(0, head, &src[..first]);
    }
    let whole = (len - first) / W;
    for (k, s) in src[first..first + whole * W].chunks_exact(W).enumerate() {
        word(1 + k).store(
            usize::from_ne_bytes(s.try_into().expect("a word")),
            Ordering::Relaxed,
        );
    }
    let done = first + whole * W;
    if done < len {
        part(1 + whole, 0, &src[done..]);
    }
}

/// Copies `len` bytes between two leased ranges, once: only when both sides are shared does it go through a
/// bounce buffer.
///
/// # Safety
/// Both pointers are valid for `len` bytes; they do not overlap unless neither side is `Plain`; each side's
/// concurrent users are as its atomicity says (see [`load`] and [`store`]).
pub(crate) unsafe fn copy(
    src: *const u8,
    dst: *mut u8,
    len: usize,
    from: Atomicity,
    to: Atomicity,
) {
    match (from, to) {
        (Atomicity::Plain, Atomicity::Plain) => {
            // SAFETY: per caller, valid, non-overlapping, and not concurrently accessed.
            unsafe { std::ptr::copy_nonoverlapping(src, dst, len) };
        }
        (_, Atomicity::Plain) => {
            // SAFETY: `dst` is not racy, so nothing else accesses it: a unique slice over it is sound.
            let d = unsafe { std::slice::from_raw_parts_mut(dst, len) };
            // SAFETY: `src` valid for `len`; its concurrent users are as `from` says.
            unsafe { load(src, d, from) };
        }
        (Atomicity::Plain, _) => {
            // SAFETY: `src` is not racy, so nobody writes it while this shared slice lives.
            let s = unsafe { std::slice::from_raw_parts(src, len) };
            // SAFETY: `dst` valid for `len`; its concurrent users are as `to` says.
            unsafe { store(dst, s, to) };
        }
        _ => {
            let mut bounce = [0u8; 4096];
            let mut done = 0;
            while done < len {
                let n = (len - done).min(bounce.len());
                // SAFETY: sub-ranges of the caller's valid ranges; the bounce buffer is a local.
                unsafe {
                    load(src.add(done), &mut bounce[..n], from);
                    store(dst.add(done), &bounce[..n], to);
                }
                done += n;
            }
        }
    }
}

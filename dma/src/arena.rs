//! Where [`DmaBuf`](crate::DmaBuf) memory comes from: whole pages, carved out of a few large mappings.
//!
//! Device-visible memory must not share a page with anything else, and must not be copied-on-write into a forked
//! child while a device may write it (`MADV_WIPEONFORK`, see `map`). Each buffer used to be a page-aligned
//! allocation of its own with its own `madvise`, and the kernel keeps every such range as a mapping of its own:
//! with ~10,000 connections (a few control buffers each, both sides in one process) a process reached
//! `vm.max_map_count` (65,530 by default) and allocations failed. So buffers of up to [`MAX_BLOCK_PAGES`] pages
//! come from [`CHUNK_PAGES`]-page chunks that are mapped and marked once, in power-of-two blocks; a freed block's
//! pages go back to the kernel (`MADV_DONTNEED`: they read as zero afterwards, so a block is zeroed when it is
//! handed out again without being written) and the block waits on a free list for the next buffer of its size.
//! A block is at least one kernel page: where the kernel's pages are larger than [`PAGE`] (16 or 64 KiB), a small
//! buffer takes a whole kernel page. Larger buffers get a mapping of their own.

use std::ptr::NonNull;
use std::sync::Mutex;

use crate::PAGE;

/// The largest block, in pages, taken from a chunk (larger buffers are mapped on their own).
pub(crate) const MAX_BLOCK_PAGES: usize = 256;
/// Pages of one chunk.
const CHUNK_PAGES: usize = 2048;
/// Block classes: `1 << class` pages, for class 0 ..= CLASSES - 1.
const CLASSES: usize = MAX_BLOCK_PAGES.trailing_zeros() as usize + 1;

/// Free blocks by class, and the part of the newest chunk not handed out yet.
struct State {
    free: [Vec<usize>; CLASSES],
    /// Next unused byte of the newest chunk, and its end.
    bump: usize,
    end: usize,
    /// Chunks mapped so far (they are never unmapped: their pages go back to the kernel block by block).
    chunks: usize,
}

static STATE: Mutex<State> = Mutex::new(State {
    free: [const { Vec::new() }; CLASSES],
    bump: 0,
    end: 0,
    chunks: 0,
});

/// How a buffer's memory was obtained (what [`release`] needs).
#[derive(Debug, Clone, Copy)]
pub(crate) enum Origin {
    /// A block of `1 << class` pages of a chunk.
    Block(u8),
    /// A mapping of its own of this many bytes.
    Mapping(usize),
}

fn class_of(pages: usize) -> usize {
    pages.next_power_of_two().trailing_zeros() as usize
}

/// Maps `bytes` (whole pages) of zeroed anonymous memory, marked not to be inherited by a forked child.
///
/// Fork safety: registered memory is pinned. If a fork left it copy-on-write, the parent's next write would move
/// the parent to a fresh page while the device kept reading and writing the old one, now the child's, and
/// transfers would silently lose data. With `MADV_WIPEONFORK` the kernel copies nothing of such a mapping into the
/// child, which gets it zero-filled, and the parent's pages never move: what `ibv_fork_init` arranges for
/// registrations, done here for every buffer this crate allocates, whatever the backend. `MADV_DONTFORK` (the
/// fallback, for kernels before 4.14) left the child with no mapping at all, while the child's copy of the arena
/// and of every buffer still named those addresses: a buffer used in the child faulted, and one allocated there
/// could be handed memory another mapping of the child had taken (a review). Buffers taken over from a
/// `Vec` are not covered (their pages may hold other allocations, which a child may need).
fn map(bytes: usize) -> Option<NonNull<u8>> {
    // SAFETY: an anonymous private mapping at an address the kernel chooses: no existing memory is affected.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            bytes,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return None;
    }
    // SAFETY: the range was just mapped by us; madvise changes only how fork treats it. Failure of both (no such
    // kernel) leaves the default behaviour.
    let r = unsafe {
        match libc::madvise(p, bytes, libc::MADV_WIPEONFORK) {
            0 => 0,
            _ => libc::madvise(p, bytes, libc::MADV_DONTFORK),
        }
    };
    debug_assert_eq!(r, 0, "madvise(MADV_WIPEONFORK / MADV_DONTFORK) failed");
    NonNull::new(p.cast())
}

/// The kernel's page size (0 if it cannot be told).
pub(crate) fn system_page() -> usize {
    static SIZE: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    // SAFETY: sysconf reads a constant of the system.
    *SIZE.get_or_init(|| usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).unwrap_or(0))
}

/// The block class a buffer of `pages` [`PAGE`]s takes, `None` for a mapping of its own. A block is at least one
/// kernel page: with kernel pages larger than ours (16 KiB, 64 KiB on some arm64 and ppc64 kernels) a smaller block
/// shared a kernel page with its neighbours, and the `MADV_DONTNEED` that gives a freed block back zeroed the
/// whole kernel page, live neighbours included (review finding). A kernel page size that cannot be told, is not a
/// power of two or is larger than the largest block gives every buffer a mapping of its own.
fn block_class(pages: usize, system_page: usize) -> Option<usize> {
    let unit = system_page.max(PAGE);
    if pages > MAX_BLOCK_PAGES || !system_page.is_power_of_two() || unit > MAX_BLOCK_PAGES * PAGE {
        return None;
    }
    Some(class_of(pages).max((unit / PAGE).trailing_zeros() as usize))
}

/// `len` zeroed bytes (`len > 0`) on whole pages of their own: the address and how to give them back.
pub(crate) fn obtain(len: usize) -> Option<(NonNull<u8>, Origin)> {
    let pages = len.checked_next_multiple_of(PAGE)? / PAGE;
    let system = system_page();
    let Some(class) = block_class(pages, system) else {
        let bytes = pages.checked_mul(PAGE)?;
        return map(bytes).map(|p| (p, Origin::Mapping(bytes)));
    };
    let bytes = PAGE << class;
    // The smallest block: one kernel page (chunks are mapped on kernel pages, and every block is a whole number of
    // them, so every block starts on one).
    let unit = system.max(PAGE);
    let mut s = STATE.lock().unwrap_or_else(|p| p.into_inner());
    let addr = match s.free[class].pop() {
        Some(a) => a,
        None => {
            if s.end - s.bump < bytes {
                // What is left of the chunk goes to the free lists, largest blocks first (a rest smaller than a
                // kernel page is left unused).
                while s.end - s.bump >= unit {
                    let c = ((s.end - s.bump) / PAGE).ilog2().min(CLASSES as u32 - 1) as usize;
                    let at = s.bump;
                    s.free[c].push(at);
                    s.bump += PAGE << c;
                }
                let chunk = map(CHUNK_PAGES * PAGE)?;
                s.bump = chunk.as_ptr() as usize;
                s.end = s.bump + CHUNK_PAGES * PAGE;
                s.chunks += 1;
            }
            let a = s.bump;
            s.bump += bytes;
            a
        }
    };
    drop(s);
    NonNull::new(addr as *mut u8).map(|p| (p, Origin::Block(class as u8)))
}

/// Gives back the memory of a buffer.
///
/// # Safety
/// `ptr` and `origin` came from one [`obtain`], nothing uses the memory any more (no reference, no device: its
/// registration is gone), and it is given back once.
pub(crate) unsafe fn release(ptr: NonNull<u8>, origin: Origin) {
    match origin {
        Origin::Mapping(bytes) => {
            // SAFETY: per the caller, our own mapping of `bytes`, unused and unmapped once.
            unsafe { libc::munmap(ptr.as_ptr().cast(), bytes) };
        }
        Origin::Block(class) => {
            let bytes = PAGE << class;
            // SAFETY: per the caller, a block of a chunk we mapped that nothing uses: its pages go back to the
            // kernel and read as zero when next touched (private anonymous memory).
            let r = unsafe { libc::madvise(ptr.as_ptr().cast(), bytes, libc::MADV_DONTNEED) };
            if r != 0 {
                // Not reached on Linux; zero it by hand so that the next owner still gets zeroed memory.
                // SAFETY: as above, the block is ours and unused.
                unsafe { std::ptr::write_bytes(ptr.as_ptr(), 0, bytes) };
            }
            let mut s = STATE.lock().unwrap_or_else(|p| p.into_inner());
            s.free[class as usize].push(ptr.as_ptr() as usize);
        }
    }
}

/// Chunks mapped so far (for tests).
#[cfg(test)]
pub(crate) fn chunks() -> usize {
    STATE.lock().unwrap_or_else(|p| p.into_inner()).chunks
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A review found it: with kernel pages larger than ours, a freed block's `MADV_DONTNEED` zeroed the live
    /// blocks beside it on the same kernel page. A block is at least one kernel page.
    #[test]
    fn a_block_is_at_least_one_kernel_page() {
        assert_eq!(block_class(1, PAGE), Some(0));
        assert_eq!(block_class(3, PAGE), Some(2));
        assert_eq!(block_class(MAX_BLOCK_PAGES, PAGE), Some(8));
        assert_eq!(block_class(MAX_BLOCK_PAGES + 1, PAGE), None);
        // 64 KiB kernel pages: sixteen of ours at least.
        assert_eq!(block_class(1, 16 * PAGE), Some(4));
        assert_eq!(block_class(32, 16 * PAGE), Some(5));
        // A page size that cannot be told (0), is not a power of two, or exceeds the largest block: a mapping.
        assert_eq!(block_class(1, 0), None);
        assert_eq!(block_class(1, 3 * PAGE), None);
        assert_eq!(block_class(1, 2 * MAX_BLOCK_PAGES * PAGE), None);
    }
}

//! Registered memory: `exs_mregister`, `exs_mderegister` (ES-API). The program's own memory is registered in
//! place ([`exs_dma::DmaBuf::from_raw_parts`], [`exs::MemoryRegion::from_dma_buf`]): the device reads and writes
//! it directly, the zero-copy promise of seed 002.

use std::ptr::NonNull;

use exs::{MemoryRegion, Slice};
use exs_dma::DmaBuf;
use libc::{c_int, c_void};

use crate::abi::{exs_mhandle_t, EXS_ACCESS_READ, EXS_ACCESS_WRITE};
use crate::errno::{call, Errno};
use crate::handles::{context, MemEntry, MEMORY};

/// Registers `len` bytes of the program's memory at `addr` (ES-API `exs_mregister`) for sends
/// (`EXS_ACCESS_READ`), receives (`EXS_ACCESS_WRITE`) or both. Any memory the program may write will do
/// (`malloc`, `mmap` with `PROT_WRITE`, a static buffer not declared `const`), even for sends only: RDMA devices
/// register memory for local writes whatever the access. It is used where it is, never copied. Each byte is
/// registered once: a range that overlaps memory registered already is refused (register the whole range once,
/// with both accesses, and pass slices of it; two registrations of one byte would let a send and a receive on it
/// run at once, which exs refuses within one).
/// Returns a memory handle, or -1 with `errno`: `EINVAL` (null, empty, access), `EBUSY` (overlaps a registered
/// range), `ENOMEM`, `ENODEV` (no `exs_init`), or the device's own (`EFAULT`: memory it cannot register).
///
/// Registration does not pin a child process's view: pages of registered memory shared with a child after
/// `fork()` are the caller's to avoid (`madvise(MADV_DONTFORK)`), as with `ibv_reg_mr`.
///
/// # Safety
/// The memory is one allocation (one `malloc` block, one mapping, one array), readable and writable, initialized
/// (every byte written once: `calloc` and `mmap` memory is; fill `malloc` memory before registering it), and stays
/// valid (not freed, unmapped or reallocated) until `exs_mderegister` of the handle has returned 0. While an operation on a range of it is in flight (between its
/// call and its event) the program does not write a range being sent nor touch a range being received into; a
/// persistent operation's memory (`EXS_PERSISTENT`) may be used meanwhile, and may then be seen half old, half
/// new (seed 002, 4.2-4.3).
#[no_mangle]
pub unsafe extern "C" fn exs_mregister(
    addr: *mut c_void,
    len: usize,
    access: c_int,
) -> exs_mhandle_t {
    call(|| {
        let ctx = context()?;
        let all = EXS_ACCESS_READ | EXS_ACCESS_WRITE;
        if access & all == 0 || access & !all != 0 || len == 0 {
            return Err(Errno(libc::EINVAL));
        }
        let ptr = NonNull::new(addr.cast::<u8>()).ok_or(Errno(libc::EINVAL))?;
        let base = ptr.as_ptr() as usize;
        base.checked_add(len).ok_or(Errno(libc::EINVAL))?;
        // SAFETY: the caller's promise above is `from_raw_parts`'s: the memory outlives the buffer, because the
        // buffer is dropped before `exs_mderegister` returns 0 (`into_dma_buf` hands back the only handle), and
        // the program keeps away from ranges in flight.
        let buf = unsafe { DmaBuf::from_raw_parts(ptr, len) };
        let region = MemoryRegion::from_dma_buf(ctx, buf)?;
        let entry = MemEntry {
            region,
            base,
            len,
            access,
        };
        // Each registration has its own lease table: only one per byte lets exs see every operation on it.
        MEMORY.insert_new_unless(entry, |filed| {
            let end = base + len;
            match filed
                .values()
                .any(|m| m.base < end && base < m.base + m.len)
            {
                true => Err(Errno(libc::EBUSY)),
                false => Ok(()),
            }
        })
    })
}

/// Deregisters memory (ES-API `exs_mderegister`): once it returns 0, exs holds nothing of it and the program
/// may free it. -1 with `errno`: `EBADF`, `EBUSY` while an operation on it is in flight or about to start
/// (nothing changed: the handle stays valid; try again after the events).
#[no_mangle]
pub extern "C" fn exs_mderegister(mh: exs_mhandle_t) -> c_int {
    call(|| {
        // Under the table's write lock no other call can take a new handle to the region meanwhile.
        let mut table = MEMORY.write();
        let MemEntry {
            region,
            base,
            len,
            access,
        } = table.remove(&mh).ok_or(Errno(libc::EBADF))?;
        match region.into_dma_buf() {
            // Dropped here: nothing of exs refers to the memory any more.
            Ok(_buf) => Ok(0),
            Err((region, e)) => {
                let entry = MemEntry {
                    region,
                    base,
                    len,
                    access,
                };
                table.insert(mh, entry);
                Err(e.into())
            }
        }
    })
}

/// The range `buf..buf + len` of the memory `mh` as an operation's buffer, if `mh` was registered with `need`
/// access (`EACCES`) and the range lies inside it (`EINVAL`).
pub(crate) fn slice(
    mh: exs_mhandle_t,
    buf: *const c_void,
    len: usize,
    need: c_int,
) -> Result<Slice, Errno> {
    MEMORY.with(mh, |m| {
        if m.access & need == 0 {
            return Err(Errno(libc::EACCES));
        }
        let start = (buf as usize)
            .checked_sub(m.base)
            .ok_or(Errno(libc::EINVAL))?;
        match start.checked_add(len) {
            Some(end) if end <= m.len => Ok(m.region.slice(start..end)),
            _ => Err(Errno(libc::EINVAL)),
        }
    })?
}

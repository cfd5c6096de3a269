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
/// `fork()`: on the verbs backend, unless the kernel keeps pinned pages with the parent across a fork
/// (`ibv_is_fork_initialized` says `IBV_FORK_UNNEEDED`), libibverbs keeps registered memory out of children
/// (`ibv_fork_init`): every page a registration touches is missing in a child, with whatever else shares those
/// pages (other `malloc` blocks). A child must not touch those pages, nor call exs: it inherits no working
/// library (no progress thread, no connection). Register whole pages (`posix_memalign`, `mmap`) to keep other data
/// out of them.
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
        let end = base.checked_add(len).ok_or(Errno(libc::EINVAL))?;
        let overlapping = |filed: &std::collections::BTreeMap<c_int, MemEntry>| {
            filed
                .values()
                .any(|m| m.base < end && base < m.base + m.len)
        };
        // Refused before the memory is registered (pinned) and before a second buffer covers its bytes (review
        // finding: a gigabyte registered twice was pinned again first, and refused with the pinning's ENOMEM
        // under RLIMIT_MEMLOCK rather than EBUSY). Checked again as it is filed, for a registration of another
        // thread meanwhile.
        if overlapping(&MEMORY.write()) {
            return Err(Errno(libc::EBUSY));
        }
        // SAFETY: the caller's promise above is `from_raw_parts`'s: the memory outlives the buffer, because the
        // buffer is dropped before `exs_mderegister` returns 0 (`into_dma_buf` hands back the only handle), and
        // the program keeps away from ranges in flight.
        let buf = unsafe { DmaBuf::from_raw_parts(ptr, len) };
        let region = MemoryRegion::from_dma_buf(ctx, buf)?;
        let entry = MemEntry {
            region: Some(region),
            base,
            len,
            access,
        };
        // Each registration has its own lease table: only one per byte lets exs see every operation on it.
        MEMORY.insert_new_unless(entry, |filed| match overlapping(filed) {
            true => Err(Errno(libc::EBUSY)),
            false => Ok(()),
        })
    })
}

/// Deregisters memory (ES-API `exs_mderegister`): once it returns 0, exs holds nothing of it and the program
/// may free it. -1 with `errno`: `EBADF`; `EBUSY` while an operation on it is in flight or about to start
/// (nothing changed: the handle stays valid; try again after the events), or while another thread deregisters
/// it (the handle stays valid only if that deregistration is refused: a retry may find it gone, `EBADF`).
/// `EIO`: the device kept the memory (undoing its registration, or revoking a key over it, failed in the device,
/// which may still reach it): the handle is gone, and the memory must never be freed or reused.
/// Calls of other threads that name the handle while it runs fail with `EBADF`; it holds no lock they need
/// meanwhile (undoing a large registration takes a while).
#[no_mangle]
pub extern "C" fn exs_mderegister(mh: exs_mhandle_t) -> c_int {
    call(|| {
        // Taken out under the table's write lock, its number and range left filed: no other call can take a new
        // handle to the region meanwhile, and the registration is undone (the device unpins the pages, in time
        // proportional to the region) without holding the lock every call that names memory takes.
        let region = {
            let mut table = MEMORY.write();
            let entry = table.get_mut(&mh).ok_or(Errno(libc::EBADF))?;
            // Another thread is deregistering it: it may yet fail and leave the handle valid.
            entry.region.take().ok_or(Errno(libc::EBUSY))?
        };
        // A panic below (caught by `call`, `EIO`) drops the region while unwinding: the entry must not stay
        // filed without it, its number and range taken for good.
        let unfile = Unfile(mh);
        let outcome = region.into_dma_buf();
        std::mem::forget(unfile);
        match outcome {
            Ok(buf) => {
                // Nothing of exs refers to the memory any more: the number and the range go.
                drop(buf);
                MEMORY.write().remove(&mh);
                Ok(0)
            }
            // For good: the handle goes (review finding: it was filed again without its registration, and
            // every later call failed, `EBUSY` for ever from this one).
            Err((region, exs::MemoryError::Kept)) => {
                drop(region);
                MEMORY.write().remove(&mh);
                Err(Errno(libc::EIO))
            }
            Err((region, e)) => {
                if let Some(entry) = MEMORY.write().get_mut(&mh) {
                    entry.region = Some(region);
                }
                Err(e.into())
            }
        }
    })
}

/// Takes memory handle `.0` out of the table when dropped: on the unwinding of a panic in `exs_mderegister`.
struct Unfile(exs_mhandle_t);

impl Drop for Unfile {
    fn drop(&mut self) {
        MEMORY.write().remove(&self.0);
    }
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
        // Being deregistered: as good as gone.
        let region = m.region.as_ref().ok_or(Errno(libc::EBADF))?;
        if m.access & need == 0 {
            return Err(Errno(libc::EACCES));
        }
        let start = (buf as usize)
            .checked_sub(m.base)
            .ok_or(Errno(libc::EINVAL))?;
        match start.checked_add(len) {
            Some(end) if end <= m.len => Ok(region.slice(start..end)),
            _ => Err(Errno(libc::EINVAL)),
        }
    })?
}

#[cfg(test)]
mod tests {
    use exs::sim::{SimConfig, World};

    use super::*;
    use crate::abi::EXS_VERSION;
    use crate::errno::last_errno as errno;

    const BASE: usize = 0x10_0000;

    fn slice_errno(mh: exs_mhandle_t) -> Option<c_int> {
        slice(mh, BASE as *const c_void, 16, EXS_ACCESS_READ)
            .err()
            .map(|e| e.0)
    }

    /// `exs_mderegister` undoes the registration without the table's lock (other threads' calls that name memory
    /// took it meanwhile): the entry stays filed with its region taken out. Calls naming the handle then fail
    /// (`EBADF`), a second deregistration is `EBUSY`; one that fails (an operation holds the memory) puts the region
    /// back, and the handle works again.
    #[test]
    fn memory_being_deregistered_is_named_by_no_call_and_a_failed_deregistration_leaves_it_valid() {
        let world = World::new(SimConfig::default());
        let ctx = world.host();
        let entry = MemEntry {
            region: Some(MemoryRegion::alloc(&ctx, 4096).expect("region")),
            base: BASE,
            len: 4096,
            access: EXS_ACCESS_READ | EXS_ACCESS_WRITE,
        };
        let mh = MEMORY.insert_new(entry).expect("a number");
        assert_eq!(slice_errno(mh), None);

        // As while another thread's exs_mderegister runs.
        let region = MEMORY
            .write()
            .get_mut(&mh)
            .and_then(|e| e.region.take())
            .expect("filed");
        assert_eq!(slice_errno(mh), Some(libc::EBADF));
        assert_eq!((exs_mderegister(mh), errno()), (-1, libc::EBUSY));
        MEMORY.write().get_mut(&mh).expect("still filed").region = Some(region);

        // An operation's buffer holds the region: refused, and the handle stays as it was.
        let held = slice(mh, BASE as *const c_void, 16, EXS_ACCESS_READ).expect("a slice");
        assert_eq!((exs_mderegister(mh), errno()), (-1, libc::EBUSY));
        assert_eq!(
            slice_errno(mh),
            None,
            "a failed deregistration leaves the handle valid"
        );
        drop(held);

        assert_eq!(exs_mderegister(mh), 0, "errno {}", errno());
        assert_eq!(slice_errno(mh), Some(libc::EBADF));
        assert_eq!((exs_mderegister(mh), errno()), (-1, libc::EBADF));
    }

    /// Review finding: a range overlapping registered memory was registered (pinned) first and refused only as it
    /// was filed: a gigabyte registered twice was pinned twice, and under `RLIMIT_MEMLOCK` the call failed with the
    /// pinning's `ENOMEM` instead of `EBUSY`. It is refused before any registration.
    #[test]
    fn an_overlapping_range_is_refused_before_it_is_registered() {
        std::env::set_var("EXS_BACKEND", "sim");
        assert_eq!(crate::exs_init(EXS_VERSION), 0, "errno {}", errno());
        let ctx = context().expect("initialised");
        let mut mem = vec![0u8; 8192];
        let at = mem.as_mut_ptr().cast::<c_void>();
        // SAFETY: `mem` is readable, writable and initialised, and outlives the registration (deregistered below).
        let mh = unsafe { exs_mregister(at, 8192, EXS_ACCESS_READ) };
        assert!(mh > 0, "errno {}", errno());
        let before = ctx.stats().registrations;
        // SAFETY: as above; refused.
        let again = unsafe { exs_mregister(at.wrapping_byte_add(4096), 4096, EXS_ACCESS_READ) };
        assert_eq!((again, errno()), (-1, libc::EBUSY));
        assert_eq!(
            ctx.stats().registrations,
            before,
            "registered before it was refused"
        );
        assert_eq!(exs_mderegister(mh), 0, "errno {}", errno());
        drop(mem);
    }

    /// Review finding: when the device failed to undo a registration and kept the memory (as the verbs and
    /// libfabric backends keep a buffer whose deregistration failed), the handle was filed again without its
    /// registration: every operation on it failed and every `exs_mderegister` said `EBUSY`, for ever. It is
    /// `EIO`, once, and the handle is gone (the program must never free the memory).
    #[test]
    fn memory_the_device_kept_is_eio_once_and_its_handle_goes() {
        let world = World::new(SimConfig::default());
        let ctx = world.host();
        world.keep_deregistered_memory(0, true);
        let base = BASE + 0x10_0000;
        let entry = MemEntry {
            region: Some(MemoryRegion::alloc(&ctx, 4096).expect("region")),
            base,
            len: 4096,
            access: EXS_ACCESS_READ,
        };
        let mh = MEMORY.insert_new(entry).expect("a number");
        assert_eq!((exs_mderegister(mh), errno()), (-1, libc::EIO));
        assert_eq!((exs_mderegister(mh), errno()), (-1, libc::EBADF));
        let named = slice(mh, base as *const c_void, 16, EXS_ACCESS_READ).err();
        assert_eq!(named.map(|e| e.0), Some(libc::EBADF));
    }
}

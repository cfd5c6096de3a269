//! The record of a posted work request: its address is the operation context libfabric hands back with the
//! completion; it owns the request (and its leases) until then.

use std::mem::MaybeUninit;

use exs_transport::{EndpointId, Op};

use crate::ffi::*;

/// A posted work request. Its address is the operation context; `ctx` comes first for FI_CONTEXT providers.
#[repr(C)]
pub(crate) struct WrRecord {
    pub(crate) ctx: fi_context2,
    pub(crate) ep: EndpointId,
    pub(crate) wr_id: u64,
    pub(crate) op: Op,
}

/// At most this many empty records are kept for later posts (a bounded pool: what a burst of posts allocated
/// beyond it is freed as its completions come).
const KEPT: usize = 256;

/// The allocations of records whose requests completed, kept for the next posts: a post would otherwise allocate
/// its record and the completion free it, on every message.
#[derive(Default)]
pub(crate) struct Records {
    // Boxed: each allocation is handed to the provider by address and must not move.
    #[allow(clippy::vec_box)]
    free: Vec<Box<MaybeUninit<WrRecord>>>,
}

impl Records {
    /// Moves `rec` into a record allocation (a kept one if any) and leaks it: the pointer is the operation
    /// context handed to the provider, taken back once with [`Records::take`].
    pub(crate) fn leak(&mut self, rec: WrRecord) -> *mut WrRecord {
        let mut slot = self.free.pop().unwrap_or_else(Box::new_uninit);
        slot.write(rec);
        Box::into_raw(slot).cast()
    }

    /// Takes the request back out of a leaked record and keeps its allocation for a later post.
    ///
    /// # Safety
    /// `ptr` came from [`Records::leak`] (of any `Records`) and is taken back exactly once: the provider completed
    /// it, refused it, or can no longer touch it (its endpoint is closed).
    pub(crate) unsafe fn take(&mut self, ptr: *mut WrRecord) -> WrRecord {
        // SAFETY: (the caller's contract) `ptr` is a live, initialised record that nobody else reads or frees;
        // reading it out moves the request (its leases) to the caller, and the allocation is then handed back as
        // uninitialised memory (same layout: `MaybeUninit<T>` is laid out as `T`), so the record is never dropped
        // twice.
        unsafe {
            let rec = std::ptr::read(ptr);
            let slot = Box::from_raw(ptr.cast::<MaybeUninit<WrRecord>>());
            if self.free.len() < KEPT {
                self.free.push(slot);
            }
            rec
        }
    }
}

impl std::fmt::Debug for Records {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Records")
            .field("kept", &self.free.len())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(wr_id: u64) -> WrRecord {
        WrRecord {
            ctx: fi_context2::default(),
            ep: EndpointId(1),
            wr_id,
            op: Op::Send {
                sges: Vec::new(),
                imm: None,
            },
        }
    }

    #[test]
    fn a_completed_record_s_allocation_carries_the_next_post_and_the_pool_stays_bounded() {
        let mut records = Records::default();
        let first = records.leak(record(1));
        // SAFETY: leaked just above, taken back once.
        let back = unsafe { records.take(first) };
        assert_eq!(back.wr_id, 1);
        let second = records.leak(record(2));
        assert_eq!(
            second, first,
            "the next post reuses the completed record's allocation"
        );
        // SAFETY: leaked just above, taken back once.
        assert_eq!(unsafe { records.take(second) }.wr_id, 2);

        // A burst beyond the pool's bound: what completes past it is freed, not kept.
        let burst: Vec<_> = (0..KEPT as u64 + 10)
            .map(|i| records.leak(record(i)))
            .collect();
        for (i, p) in burst.into_iter().enumerate() {
            // SAFETY: each was leaked above and is taken back once.
            assert_eq!(unsafe { records.take(p) }.wr_id, i as u64);
        }
        assert_eq!(records.free.len(), KEPT);
    }
}

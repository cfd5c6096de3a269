//! Write-with-immediate where the device has none (iWARP: RDMAP carries no immediate data; or forced by
//! configuration): the write, then a send of 8 bytes, a magic and the immediate, which the receiving backend turns
//! back into an immediate (the protocol's own control messages are never shorter than 16 bytes, so 8 bytes with
//! the magic are never one of them).
//!
//! The 8 bytes go inline where the device sends that much inline; otherwise (a device, or an override, with less)
//! the send gathers them from a slab registered once per connection, one slot per send-queue entry, reused in
//! turn. A slot is rewritten only after the send that used it completed: at most `entries` native requests are on
//! the send queue at once and each emulated send takes at least one, so the send that used a slot `entries` sends
//! ago has been retired before the slot comes round again. Only sends that reached the device count: the slots of
//! requests the device refused are given back ([`ImmSlab::give_back`]).

use std::sync::Arc;

use exs_transport::TransportError;
use rdma_sys::*;

use crate::memory::{reg_mr, Pd};

/// Magic of an emulated write-with-immediate ("EXSI", little-endian), followed by the immediate.
pub(crate) const IMM_MAGIC: u32 = u32::from_le_bytes(*b"EXSI");

/// The 8 bytes that carry `imm`.
pub(crate) fn payload(imm: u32) -> [u8; 8] {
    let mut p = [0u8; 8];
    p[..4].copy_from_slice(&IMM_MAGIC.to_le_bytes());
    p[4..].copy_from_slice(&imm.to_le_bytes());
    p
}

/// The immediate a received message of exactly these bytes carries, if it is an emulated one.
pub(crate) fn decode(bytes: &[u8; 8]) -> Option<u32> {
    (bytes[..4] == IMM_MAGIC.to_le_bytes())
        .then(|| u32::from_le_bytes([bytes[4], bytes[5], bytes[6], bytes[7]]))
}

/// Slots for the payloads of one connection's emulated immediates, one per send-queue entry (see the module
/// documentation); registered where they are not sent inline.
pub(crate) struct ImmSlab {
    mem: *mut [u8; 8],
    slots: usize,
    next: usize,
    /// The registration and its key, when the device reads the slots (not inline).
    mr: Option<(*mut ibv_mr, u32, Arc<Pd>)>,
    /// What deregisters it (`ibv_dereg_mr`; a test makes it fail).
    dereg: unsafe fn(*mut ibv_mr) -> i32,
}

// SAFETY: the slab's memory is owned by it and written only through `&mut self`; the MR handle is only used to
// deregister it.
unsafe impl Send for ImmSlab {}

impl ImmSlab {
    /// A slab of `slots` payloads (the connection's send-queue entries), registered for local access in `pd`
    /// if given (payloads the device reads from memory rather than inline).
    pub(crate) fn new(pd: Option<&Arc<Pd>>, slots: u32) -> Result<ImmSlab, TransportError> {
        let slots = slots.max(1) as usize;
        let mem = Box::into_raw(vec![[0u8; 8]; slots].into_boxed_slice()) as *mut [u8; 8];
        let mut slab = ImmSlab {
            mem,
            slots,
            next: 0,
            mr: None,
            dereg: dereg_mr,
        };
        if let Some(pd) = pd {
            // On failure the slab's Drop frees the memory (nothing registered).
            let mr = reg_mr(pd, mem as u64, slots * 8, 0)?;
            // SAFETY: live MR.
            let lkey = unsafe { (*mr).lkey };
            slab.mr = Some((mr, lkey, Arc::clone(pd)));
        }
        Ok(slab)
    }

    /// Gives back the last `n` slots taken, for requests the device refused (never on its queue, so no longer
    /// read): they are taken again next, so that a slot still comes round only after `slots` requests that reached
    /// the device (review finding: refused ones counted too, so a slot could be rewritten while a send that reached
    /// the device before the refusal still read it).
    pub(crate) fn give_back(&mut self, n: usize) {
        self.next = (self.next + self.slots - n % self.slots) % self.slots;
    }

    /// Writes `imm`'s payload into the next slot and returns its scatter entry.
    pub(crate) fn next(&mut self, imm: u32) -> ibv_sge {
        let i = self.next;
        self.next = (self.next + 1) % self.slots;
        // SAFETY: `i < slots`; the slot's last send completed (module documentation), so the device no longer reads
        // it; no reference into the slab exists.
        let slot = unsafe { self.mem.add(i) };
        // SAFETY: as above; a plain write of 8 bytes into memory we own.
        unsafe { slot.write(payload(imm)) };
        ibv_sge {
            addr: slot as u64,
            length: 8,
            lkey: self.mr.as_ref().map_or(0, |m| m.1),
        }
    }
}

/// `ibv_dereg_mr`.
///
/// # Safety
/// `mr` is a live registration, deregistered once.
unsafe fn dereg_mr(mr: *mut ibv_mr) -> i32 {
    // SAFETY: the caller's.
    unsafe { ibv_dereg_mr(mr) }
}

impl Drop for ImmSlab {
    fn drop(&mut self) {
        if let Some((mr, _, pd)) = self.mr.take() {
            // SAFETY: the connection's queue pair is destroyed before its endpoint (and this slab) is dropped, so
            // no request reads a slot any more; the registration is deregistered once.
            if unsafe { (self.dereg)(mr) } != 0 {
                // It may still be valid: its memory and its protection domain stay, for the process's life, as
                // every other registration's whose deregistration failed (review finding: the slab was freed).
                std::mem::forget(pd);
                return;
            }
        }
        // SAFETY: nothing registered names the memory any more (above); it was allocated by `new` as a boxed
        // slice of `slots` payloads and is freed once.
        unsafe {
            drop(Box::from_raw(std::ptr::slice_from_raw_parts_mut(
                self.mem, self.slots,
            )))
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    unsafe fn failing_dereg(_: *mut ibv_mr) -> i32 {
        libc::EBUSY
    }

    /// A review found it: a slab whose deregistration failed freed its memory all the same (every other
    /// registration keeps its memory then). Its memory and protection domain stay.
    #[test]
    fn a_slab_that_fails_to_deregister_keeps_its_memory_and_domain() {
        // A stand-in domain and registration, never touched (the stand-in deregistration fails).
        let pd = Arc::new(Pd(std::ptr::null_mut()));
        let mut slab = ImmSlab::new(None, 4).expect("slab");
        slab.mr = Some((std::ptr::NonNull::dangling().as_ptr(), 1, Arc::clone(&pd)));
        slab.dereg = failing_dereg;
        drop(slab);
        assert_eq!(
            Arc::strong_count(&pd),
            2,
            "the registration may still be valid: its domain is never deallocated"
        );
        std::mem::forget(pd);
    }

    /// The slots of refused requests are taken again at once: the next request that reaches the device uses the
    /// slot the refused one had, and the slot of one that reached it comes round only after `slots` such requests.
    #[test]
    fn slots_of_refused_requests_are_taken_again_first() {
        let mut slab = ImmSlab::new(None, 4).expect("slab");
        let first = slab.next(1).addr;
        let refused = [slab.next(2).addr, slab.next(3).addr];
        slab.give_back(2);
        assert_eq!(slab.next(4).addr, refused[0]);
        assert_eq!(slab.next(5).addr, refused[1]);
        assert_ne!(
            slab.next(6).addr,
            first,
            "three requests since the first reached the device"
        );
        assert_eq!(slab.next(7).addr, first, "four");
        slab.give_back(0);
        assert_eq!(
            slab.next(8).addr,
            refused[0],
            "nothing given back: the next in turn"
        );
    }

    #[test]
    fn an_emulated_immediate_round_trips_and_other_bytes_are_not_one() {
        for imm in [0, 1, 0xdead_beef, u32::MAX] {
            assert_eq!(decode(&payload(imm)), Some(imm));
        }
        assert_eq!(decode(b"EXSJ\0\0\0\0"), None);
    }
}

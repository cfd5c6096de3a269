//! The completion queue's budget. Every queue pair and the shared receive queue complete into the transport's one
//! completion queue, and when connections fail every request on them completes at once (flushed, signalled or
//! not): a queue holding fewer entries than that overflows (rxe drops the completions, mlx5 puts the queue in the
//! error state and every connection with it). So nothing goes on the device unless the queue has room for its
//! completion:
//!
//! * the shared receive queue reserves its whole depth when it is created (each receive posted to it completes
//!   once, on whichever queue pair dequeued it);
//! * every send-queue entry and every receive posted on an endpoint's own queue takes one entry while it is on
//!   the device (until its completion, or a later signalled one, retires it, or its endpoint is released).
//!
//! A post that would not fit grows the queue (`ibv_resize_cq`, to twice its size or what is needed, up to the
//! device's `max_cqe`); where it cannot grow, the post is refused with a resource error. Counting what is on the
//! device rather than reserving each send queue's depth: a hundred idle connections of 512-entry send queues
//! (the conformance suite's) would not fit rxe's 32,767 entries beside a shared receive queue, though they never
//! have more than a few requests out. [`CqBudget`] is the arithmetic, tested without a device.

use exs_transport::TransportError;
use rdma_sys::*;

use crate::VerbsTransport;

/// What the completion queue can hold and what may still complete into it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct CqBudget {
    /// Entries the queue holds (as the provider created or resized it: it may round up).
    capacity: u32,
    /// The device's `max_cqe`: the queue grows no further.
    device_max: u32,
    /// Entries reserved for the shared receive queue (its depth), 0 without one.
    shared: u32,
    /// Requests on the device that may still complete: send-queue entries not yet retired, receives on an
    /// endpoint's own queue not yet completed.
    load: u64,
}

/// Whether more requests fit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Room {
    /// They fit as the queue is.
    Fits,
    /// They fit once the queue holds this many entries.
    Grow(u32),
    /// They would need this many entries, more than the device's `max_cqe`.
    Full(u64),
}

/// The deepest shared receive queue a device's completion queue holds beside the connections' send queues: half
/// of its `max_cqe`, the other half left for what connections have on the device.
pub(crate) fn shared_depth_bound(max_cqe: u32) -> u32 {
    max_cqe / 2
}

impl CqBudget {
    /// A queue of `capacity` entries on a device whose queues hold at most `device_max`.
    pub(crate) fn new(capacity: u32, device_max: u32) -> Self {
        CqBudget {
            capacity,
            device_max: device_max.max(capacity),
            shared: 0,
            load: 0,
        }
    }

    /// Entries the queue holds.
    pub(crate) fn capacity(&self) -> u32 {
        self.capacity
    }

    /// Entries that may be written into the queue as things stand.
    #[cfg(test)]
    pub(crate) fn used(&self) -> u64 {
        u64::from(self.shared) + self.load
    }

    fn room_for(&self, total: u64) -> Room {
        if total <= u64::from(self.capacity) {
            Room::Fits
        } else if total <= u64::from(self.device_max) {
            // Doubling keeps resizes rare as load climbs; never past the device's limit.
            let doubled = u64::from(self.capacity) * 2;
            Room::Grow(total.max(doubled).min(u64::from(self.device_max)) as u32)
        } else {
            Room::Full(total)
        }
    }

    /// Whether `more` requests fit on the device beside what is there.
    pub(crate) fn room(&self, more: u32) -> Room {
        self.room_for(u64::from(self.shared) + self.load + u64::from(more))
    }

    /// Whether a shared receive queue of `depth` entries fits.
    pub(crate) fn room_for_shared(&self, depth: u32) -> Room {
        self.room_for(u64::from(self.shared) + self.load + u64::from(depth))
    }

    /// The queue now holds `capacity` entries.
    pub(crate) fn grown(&mut self, capacity: u32) {
        self.capacity = capacity;
        self.device_max = self.device_max.max(capacity);
    }

    /// A shared receive queue of `depth` entries was created.
    pub(crate) fn reserve_shared(&mut self, depth: u32) {
        self.shared += depth;
    }

    /// `n` requests went on the device.
    pub(crate) fn take(&mut self, n: u32) {
        self.load += u64::from(n);
    }

    /// `n` requests left the device (completed, retired, or their queue pair destroyed).
    pub(crate) fn give(&mut self, n: u32) {
        debug_assert!(self.load >= u64::from(n), "more given back than taken");
        self.load = self.load.saturating_sub(u64::from(n));
    }
}

impl VerbsTransport {
    /// Makes room in the completion queue for `more` requests (growing it if it must), or says why there is none.
    pub(crate) fn cq_room(&mut self, more: u32) -> Result<(), TransportError> {
        let room = self.cq_budget.room(more);
        self.make_room(room, "the requests on the device")
    }

    /// Makes room for a shared receive queue of `depth` entries.
    pub(crate) fn cq_room_for_shared(&mut self, depth: u32) -> Result<(), TransportError> {
        let room = self.cq_budget.room_for_shared(depth);
        self.make_room(room, "a shared receive queue")
    }

    fn make_room(&mut self, room: Room, what: &str) -> Result<(), TransportError> {
        match room {
            Room::Fits => Ok(()),
            Room::Grow(to) => self.grow_cq(to, what),
            Room::Full(need) => Err(TransportError::Resource(format!(
                "the completion queue cannot hold {what}: {need} completions could be outstanding, and {} \
                 holds at most {} (EXS_VERBS_SEND_DEPTH, EXS_VERBS_RECV_DEPTH and EXS_VERBS_SRQ_DEPTH lower it)",
                self.settings.device, self.settings.limits.max_cqe
            ))),
        }
    }

    /// Resizes the completion queue to `to` entries (`ibv_resize_cq`; not every provider can: siw cannot).
    fn grow_cq(&mut self, to: u32, what: &str) -> Result<(), TransportError> {
        // SAFETY: live CQ; resizing keeps the completions it holds, and no other thread polls it (the engine
        // holds its lock for every call).
        let rc = unsafe { ibv_resize_cq(self.cq, to as i32) };
        if rc != 0 {
            return Err(crate::call_err(
                "ibv_resize_cq",
                rc.saturating_abs(),
                std::io::ErrorKind::OutOfMemory,
                format!(
                    "the completion queue ({} entries) cannot grow to {to} for {what}",
                    self.cq_budget.capacity()
                ),
            ));
        }
        // SAFETY: live CQ; the provider wrote what it gave (at least what was asked for).
        let got = unsafe { (*self.cq).cqe };
        tracing::debug!(
            from = self.cq_budget.capacity(),
            to = got,
            "completion queue grown"
        );
        self.cq_budget
            .grown(u32::try_from(got).unwrap_or(to).max(to));
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::queue::{cut, Cut, Posted, SendQueue, WrIds};

    /// rxe's `max_cqe`.
    const RXE_MAX_CQE: u32 = 32_767;

    #[test]
    fn a_full_shared_receive_queue_and_flushed_send_queues_never_exceed_the_completion_queue() {
        // The review's case: an 8,192-entry queue, a 16,384-deep shared receive queue and sixteen full 512-entry
        // send queues would overflow it. The shared queue's depth is bounded and reserved, and grows the queue.
        let mut b = CqBudget::new(8192, RXE_MAX_CQE);
        let srq = 16_384.min(shared_depth_bound(RXE_MAX_CQE));
        assert_eq!(srq, 16_383);
        assert_eq!(b.room_for_shared(srq), Room::Grow(16_384));
        b.grown(16_384);
        b.reserve_shared(srq);
        // Each full send queue grows the queue until the device's limit, then is refused.
        let mut queues = 0;
        loop {
            match b.room(512) {
                Room::Fits => b.take(512),
                Room::Grow(to) => {
                    assert!(to <= RXE_MAX_CQE && u64::from(to) >= b.used() + 512);
                    b.grown(to);
                    b.take(512);
                }
                Room::Full(need) => {
                    assert!(need > u64::from(RXE_MAX_CQE));
                    break;
                }
            }
            queues += 1;
            assert!(
                b.used() <= u64::from(b.capacity()),
                "never more outstanding than the queue holds"
            );
        }
        assert_eq!(queues, (RXE_MAX_CQE - srq) / 512);
    }

    #[test]
    fn the_completion_queue_grows_by_doubling_up_to_the_device_limit() {
        let b = CqBudget::new(1000, 3000);
        assert_eq!(b.room(1000), Room::Fits);
        assert_eq!(b.room(1001), Room::Grow(2000), "doubled");
        assert_eq!(
            b.room(2500),
            Room::Grow(2500),
            "what is needed, past double"
        );
        assert_eq!(b.room(2999), Room::Grow(2999));
        assert_eq!(b.room(3000), Room::Grow(3000));
        assert_eq!(b.room(3001), Room::Full(3001));
        let near = CqBudget::new(2000, 3000);
        assert_eq!(
            near.room(2001),
            Room::Grow(3000),
            "doubling stops at the limit"
        );
    }

    /// Records of requests of `parts` native entries each, numbered from 1.
    fn recs(parts: &[u32]) -> Vec<Posted<usize>> {
        let mut ids = WrIds::default();
        (0..parts.len())
            .map(|i| Posted {
                seq: ids.send(),
                entries: parts[i],
                broken: false,
                own: false,
                item: i,
            })
            .collect()
    }

    /// What the completion path gives back for a completion carrying `wr_id` (as `on_send_wc` does).
    fn complete(q: &mut SendQueue<usize>, b: &mut CqBudget, wr_id: u64, failed: bool) {
        b.give(q.retire_each(wr_id, failed, |_, _| {}));
    }

    #[test]
    fn an_emulated_write_whose_write_fails_keeps_a_slot_until_its_flushed_send_completes() {
        let mut b = CqBudget::new(100, 100);
        let mut q = SendQueue::default();
        // A send, then an emulated write-with-immediate (the write, then the send of the immediate).
        assert!(q.keep(recs(&[1, 2]), Cut::ALL, &mut b).is_empty());
        assert_eq!(b.used(), 3);
        // The connection fails: the first send and the write complete flushed, the write under its request's
        // identifier tagged as a first part...
        complete(&mut q, &mut b, 1, true);
        complete(&mut q, &mut b, 2 | crate::queue::PART_TAG, true);
        assert_eq!(
            b.used(),
            1,
            "the immediate's send is still to complete: its room stays taken"
        );
        assert_eq!(q.entries(), 1);
        // ...then the immediate's send, flushed, under the write's identifier.
        complete(&mut q, &mut b, 2, true);
        assert_eq!((b.used(), q.entries()), (0, 0));
        // Nothing more is given back for another completion naming it.
        complete(&mut q, &mut b, 2, true);
        assert_eq!(b.used(), 0);
    }

    #[test]
    fn an_emulated_write_that_succeeds_gives_both_entries_back_with_its_one_completion() {
        let mut b = CqBudget::new(100, 100);
        let mut q = SendQueue::default();
        q.keep(recs(&[2, 2]), Cut::ALL, &mut b);
        assert_eq!(b.used(), 4);
        // Only the second request's send is signalled: its completion retires both.
        complete(&mut q, &mut b, 2, false);
        assert_eq!((b.used(), q.entries()), (0, 0));
    }

    #[test]
    fn a_released_endpoint_gives_back_the_room_of_completions_still_to_come() {
        let mut b = CqBudget::new(100, 100);
        let mut q = SendQueue::default();
        q.keep(recs(&[2, 1, 1]), Cut::ALL, &mut b);
        // The failed completion under the request's own identifier is the immediate's send's (its write went
        // through, unsignalled): nothing follows it, and nothing is kept for it. What is left on the device (the
        // last request) is given back when the endpoint is released (as `release_ep` does).
        complete(&mut q, &mut b, 1, true);
        complete(&mut q, &mut b, 2, true);
        assert_eq!(b.used(), 1);
        b.give(q.entries());
        assert_eq!(b.used(), 0);
    }

    #[test]
    fn a_chain_refused_part_way_charges_only_what_reached_the_device() {
        let mut b = CqBudget::new(100, 100);
        let mut q = SendQueue::default();
        // A send, an emulated write-with-immediate, a read, a send; the device refused the third native: the
        // write went, the immediate's send did not.
        let refused = q.keep(recs(&[1, 2, 1, 1]), cut([1, 2, 1, 1], 2), &mut b);
        assert_eq!(refused, vec![2, 3]);
        assert_eq!((b.used(), q.entries()), (3, 3));
        // Its queue pair goes to error: the send and the write complete flushed, and nothing follows the write
        // (its send never reached the device).
        complete(&mut q, &mut b, 1, true);
        complete(&mut q, &mut b, 2, true);
        assert_eq!((b.used(), q.entries()), (0, 0));
    }

    #[test]
    fn completed_requests_give_their_room_back() {
        let mut b = CqBudget::new(100, 100);
        b.reserve_shared(40);
        b.take(60);
        assert_eq!(b.room(1), Room::Full(101));
        b.give(10);
        assert_eq!(b.room(10), Room::Fits);
        assert_eq!(b.room_for_shared(11), Room::Full(101));
        assert_eq!(b.used(), 90);
    }
}

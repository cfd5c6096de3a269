//! The operations handed to the protocol, by identifier: their event-queue tickets, in a slab.
//!
//! Every send, receive and shutdown takes an entry when it starts and gives it back when it completes. A hash map
//! keyed by an ever-growing number paid a hash, a probe and, as removed keys piled up, rehashes; a slot index is
//! found with none of that. An identifier carries its slot's generation beside the index, so a report for an
//! operation that already completed (a persistent send's read notice that crossed its completion) finds nothing
//! rather than the slot's next operation.
//!
//! It also counts the operations that move data or an end-of-stream out (sends and shutdowns; receives wait for
//! the peer): while any is kept, the protocol has work of its own to finish, which the progress thread picks up
//! soon after the application stops waiting (see [`crate::progress`], rule 3).

use crate::event::{EventKind, Ticket};

/// An operation's ticket and the reads of a persistent send not yet reported (see `Engine::drain_done`).
pub(super) type Entry = (Ticket, usize);

struct Slot {
    generation: u32,
    entry: Option<Entry>,
}

/// See the module documentation.
#[derive(Default)]
pub(super) struct Ops {
    slots: Vec<Slot>,
    free: Vec<u32>,
    /// Entries kept for outgoing operations (see the module documentation).
    outgoing: usize,
}

/// Whether an operation's ticket is for one that moves something out (not a receive).
fn outgoing(entry: &Entry) -> bool {
    entry.0.counted().1 != EventKind::Recv
}

impl Ops {
    /// Keeps `entry`; returns its identifier.
    pub(super) fn insert(&mut self, entry: Entry) -> u64 {
        let index = match self.free.pop() {
            Some(i) => i,
            None => {
                self.slots.push(Slot {
                    generation: 0,
                    entry: None,
                });
                u32::try_from(self.slots.len() - 1).expect("fewer than 2^32 operations at once")
            }
        };
        self.outgoing += usize::from(outgoing(&entry));
        let slot = &mut self.slots[index as usize];
        slot.entry = Some(entry);
        (u64::from(slot.generation) << 32) | u64::from(index)
    }

    fn slot(&mut self, id: u64) -> Option<&mut Slot> {
        let generation = (id >> 32) as u32;
        self.slots
            .get_mut((id & 0xffff_ffff) as usize)
            .filter(|s| s.generation == generation && s.entry.is_some())
    }

    /// Takes the entry of operation `id` out, if it is still kept.
    pub(super) fn remove(&mut self, id: u64) -> Option<Entry> {
        let slot = self.slot(id)?;
        let entry = slot.entry.take();
        slot.generation = slot.generation.wrapping_add(1);
        self.free.push((id & 0xffff_ffff) as u32);
        self.outgoing -= usize::from(entry.as_ref().is_some_and(outgoing));
        entry
    }

    /// Whether an outgoing operation (a send or a shutdown) is kept: started and not yet complete.
    pub(super) fn any_outgoing(&self) -> bool {
        self.outgoing > 0
    }

    /// The ticket of operation `id` and its unreported reads, if it is still kept.
    pub(super) fn get_mut(&mut self, id: u64) -> Option<(&Ticket, &mut usize)> {
        // The ticket is lent shared: the outgoing count follows the kind it was inserted with.
        self.slot(id)?.entry.as_mut().map(|(t, n)| (&*t, n))
    }

    /// Operations kept.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.slots.len() - self.free.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::EventKind;
    use crate::ids::SocketId;

    fn ticket(context: u64) -> Ticket {
        ticket_of(EventKind::Recv, context)
    }

    fn ticket_of(kind: EventKind, context: u64) -> Ticket {
        Ticket::hooked(kind, context, SocketId(1), |_| ())
    }

    #[test]
    fn a_report_for_a_completed_operation_does_not_reach_the_next_one_in_its_slot() {
        let mut ops = Ops::default();
        let first = ops.insert((ticket(1), 0));
        assert!(ops.get_mut(first).is_some());
        assert!(ops.remove(first).is_some());
        let second = ops.insert((ticket(2), 0));
        assert_ne!(first, second, "a reused slot hands out a new identifier");
        assert!(ops.get_mut(first).is_none());
        assert!(ops.remove(first).is_none());
        assert!(ops.get_mut(second).is_some());
        assert_eq!(ops.len(), 1);
        assert!(ops.remove(second).is_some());
        assert_eq!(ops.len(), 0);
    }

    #[test]
    fn sends_and_shutdowns_count_as_outgoing_until_they_complete_and_receives_never() {
        let mut ops = Ops::default();
        let recv = ops.insert((ticket(1), 0));
        assert!(!ops.any_outgoing(), "a receive waits for the peer");
        let send = ops.insert((ticket_of(EventKind::Send, 2), 0));
        let shut = ops.insert((ticket_of(EventKind::Shutdown, 3), 0));
        assert!(ops.any_outgoing());
        assert!(ops.remove(send).is_some());
        assert!(ops.remove(send).is_none(), "a second report finds nothing");
        assert!(ops.any_outgoing(), "the shutdown is still kept");
        assert!(ops.remove(shut).is_some());
        assert!(!ops.any_outgoing());
        assert!(ops.remove(recv).is_some());
        assert!(!ops.any_outgoing());
    }
}

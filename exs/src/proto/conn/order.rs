//! The order of a connection's sends while a send handed over in parts runs (a stream sendfile, which reads its
//! file as it goes and hands each chunk over when an earlier one has completed).
//!
//! Seed 001 delivers a stream's bytes in the order the application's sends were made. A send handed over in parts
//! is one send to the application: every byte of it goes before any send made after it started, and after every
//! send made before. So while such a send is held ([`SendOrder::hold`]), a later send (the application's, or the
//! parts of a second held send) waits here, its memory leased and its ticket kept, until the holds that started
//! before it have let go; a part of a held send goes at once unless a hold that started before that one still
//! stands. What waits is bounded by the event queues' depth (each waiting send holds a reserved event).

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};

/// A send handed over in parts ([`SendOrder::hold`]): its number in the connection's order of sends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct HoldId(u64);

/// A send (`T`: what it needs to start) waiting for the holds before it.
#[derive(Debug)]
struct Waiting<T> {
    send: T,
    at: u64,
    part_of: Option<HoldId>,
}

/// The sends of one connection in the order they were made, as far as a hold makes it matter.
#[derive(Debug)]
pub(crate) struct SendOrder<T> {
    /// The next number in the order of sends and holds.
    next: u64,
    /// The holds standing, in the order they began.
    holds: VecDeque<HoldId>,
    /// Sends waiting for a hold before them, in the order they were made.
    waiting: VecDeque<Waiting<T>>,
}

/// Where the next connection's numbers start: each connection numbers from its own multiple of 2^32, so that a
/// [`HoldId`] names one connection's hold (a sendfile names its socket by number, which a later socket may take).
static NEXT_BASE: AtomicU64 = AtomicU64::new(0);

impl<T> Default for SendOrder<T> {
    fn default() -> Self {
        SendOrder {
            next: NEXT_BASE.fetch_add(1 << 32, Ordering::Relaxed),
            holds: VecDeque::new(),
            waiting: VecDeque::new(),
        }
    }
}

impl<T> SendOrder<T> {
    /// A send handed over in parts begins: sends made from now on wait for it.
    pub(crate) fn hold(&mut self) -> HoldId {
        let id = HoldId(self.take_number());
        self.holds.push_back(id);
        id
    }

    /// Whether `id` still stands.
    pub(crate) fn holds(&self, id: HoldId) -> bool {
        self.holds.contains(&id)
    }

    /// Whether no hold stands and no send waits: an end of stream may follow the sends already started.
    pub(crate) fn is_idle(&self) -> bool {
        self.holds.is_empty() && self.waiting.is_empty()
    }

    /// A send is made (`part_of`: a part of that held send): returned to go now, or kept to wait.
    pub(crate) fn take(&mut self, send: T, part_of: Option<HoldId>) -> Option<T> {
        let w = Waiting {
            send,
            at: self.take_number(),
            part_of,
        };
        if self.may_go(&w) {
            return Some(w.send);
        }
        self.waiting.push_back(w);
        None
    }

    /// `id` lets go (its last part was handed over, or it gave up): returns the sends that may go now, in the
    /// order they were made.
    pub(crate) fn release(&mut self, id: HoldId) -> Vec<T> {
        self.holds.retain(|h| *h != id);
        let mut go = Vec::new();
        let mut kept = VecDeque::with_capacity(self.waiting.len());
        while let Some(w) = self.waiting.pop_front() {
            if self.may_go(&w) {
                go.push(w.send);
            } else {
                kept.push_back(w);
            }
        }
        self.waiting = kept;
        go
    }

    /// The connection failed: no hold stands any more; returns the waiting sends, to fail them.
    pub(crate) fn fail(&mut self) -> Vec<T> {
        self.holds.clear();
        self.waiting.drain(..).map(|w| w.send).collect()
    }

    /// Whether no hold began before `w`'s place in the order: where it was made, or for a part of a held send,
    /// where that send began (its parts go ahead of the sends made after it began, and wait for the holds before
    /// it).
    fn may_go(&self, w: &Waiting<T>) -> bool {
        self.holds.front().is_none_or(|h| h.0 >= place(w))
    }

    fn take_number(&mut self) -> u64 {
        let n = self.next;
        self.next += 1;
        n
    }
}

/// A send's place in the order: where it was made, or for a part of a held send, where that send began.
fn place<T>(w: &Waiting<T>) -> u64 {
    w.part_of.map_or(w.at, |h| h.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Sends made while a held send runs wait for it, in order; its own parts go at once; a second held send and
    /// the sends made after it wait for the first, then for the second; a send made before any hold goes.
    #[test]
    fn sends_made_after_a_hold_began_wait_for_all_of_it_in_order() {
        let mut o = SendOrder::default();
        assert_eq!(o.take("before", None), Some("before"));
        let file1 = o.hold();
        assert_eq!(o.take("file1 part 1", Some(file1)), Some("file1 part 1"));
        assert_eq!(o.take("app 1", None), None);
        let file2 = o.hold();
        assert_eq!(o.take("file2 part 1", Some(file2)), None);
        assert_eq!(o.take("app 2", None), None);
        assert_eq!(o.take("file1 part 2", Some(file1)), Some("file1 part 2"));
        assert!(!o.is_idle());
        assert_eq!(o.release(file1), ["app 1", "file2 part 1"]);
        assert!(!o.holds(file1) && o.holds(file2));
        assert_eq!(o.take("file2 part 2", Some(file2)), Some("file2 part 2"));
        assert_eq!(o.take("app 3", None), None);
        assert_eq!(o.release(file2), ["app 2", "app 3"]);
        assert!(o.is_idle());
        assert_eq!(o.take("after", None), Some("after"));
    }

    /// A held send that lets go before one that began earlier (it gave up): what waits for the earlier one still
    /// waits; failing the connection returns every waiting send and ends every hold.
    #[test]
    fn a_later_hold_letting_go_first_frees_nothing_the_earlier_one_holds() {
        let mut o = SendOrder::default();
        let a = o.hold();
        let b = o.hold();
        assert_eq!(o.take("b part", Some(b)), None);
        assert_eq!(o.take("app", None), None);
        assert!(o.release(b).is_empty());
        assert_eq!(o.fail(), ["b part", "app"]);
        assert!(!o.holds(a) && o.is_idle());
    }

    /// Two connections' holds never share a number: a sendfile's late call cannot end or use another connection's
    /// hold.
    #[test]
    fn holds_of_two_connections_have_different_numbers() {
        let (mut one, mut two) = (SendOrder::<()>::default(), SendOrder::<()>::default());
        let (a, b) = (one.hold(), two.hold());
        assert_ne!(a, b);
        assert!(one.holds(a) && !one.holds(b) && two.holds(b) && !two.holds(a));
    }
}

//! The leases held on one buffer.

use std::ops::Range;

use crate::LeaseKind;

#[derive(Debug)]
pub(crate) struct Entry {
    pub(crate) id: u64,
    pub(crate) start: usize,
    pub(crate) end: usize,
    pub(crate) kind: LeaseKind,
    /// A borrow that hands out references to the bytes.
    pub(crate) refs: bool,
}

impl Entry {
    pub(crate) fn overlaps(&self, range: &Range<usize>) -> bool {
        overlap(&(self.start..self.end), range)
    }
}

/// The leases held on one buffer, in the order they were taken (the slots of a receive ring stay at the front;
/// the leases of a long copy come and go at the end, where giving one back looks first), and how many are of
/// the racy kinds, so that a copy next to none of them does not look at the others.
///
/// One list, looked through whole: a table per slot of a buffer cut into equal slots (a connection's control
/// receives) was tried and cost more than it saved at the few dozen leases such a buffer holds, and so was a list
/// kept in the order of the leases' starts and searched by halves (moving the entries behind each one taken and
/// given back cost more than looking through them all).
#[derive(Debug, Default)]
pub(crate) struct Table {
    entries: Vec<Entry>,
    shared: usize,
    /// Long accesses in progress that found no racy lease over their range and so copy without atomics, by
    /// token: a trusted key, the one lease that may come over held ones, waits until none overlaps it.
    plain: Vec<(u64, Range<usize>)>,
    /// The ranges of trusted keys waiting for plain accesses to end, by token: accesses that begin meanwhile
    /// are atomic, so that the wait ends.
    waiting: Vec<(u64, Range<usize>)>,
    next_token: u64,
}

impl Table {
    pub(crate) fn len(&self) -> usize {
        self.entries.len()
    }

    /// The leases that overlap `range`.
    pub(crate) fn overlapping<'a>(
        &'a self,
        range: &'a Range<usize>,
    ) -> impl Iterator<Item = &'a Entry> + 'a {
        self.entries.iter().filter(move |e| e.overlaps(range))
    }

    pub(crate) fn push(&mut self, e: Entry) {
        self.shared += usize::from(e.kind.shared());
        self.entries.push(e);
    }

    /// Removes lease `id`, looking from the most recent.
    pub(crate) fn remove(&mut self, id: u64) -> Option<Entry> {
        let i = self.entries.iter().rposition(|e| e.id == id)?;
        let e = self.entries.swap_remove(i);
        self.shared -= usize::from(e.kind.shared());
        Some(e)
    }

    /// Whether an access of `range` must be atomic: a lease of a racy kind overlaps it, or a trusted key waits to
    /// come over it.
    pub(crate) fn racy(&self, range: &Range<usize>) -> bool {
        (self.shared > 0 && self.overlapping(range).any(|e| e.kind.shared()))
            || any_overlaps(&self.waiting, range)
    }

    /// Records a plain access of `range` in progress; the token ends it.
    pub(crate) fn begin_plain(&mut self, range: Range<usize>) -> u64 {
        self.next_token += 1;
        self.plain.push((self.next_token, range));
        self.next_token
    }

    /// Ends the plain access `token`. Returns whether a trusted key waits for one to end.
    pub(crate) fn end_plain(&mut self, token: u64) -> bool {
        take(&mut self.plain, token);
        !self.waiting.is_empty()
    }

    /// Whether a plain access in progress overlaps `range`.
    pub(crate) fn plain_overlaps(&self, range: &Range<usize>) -> bool {
        any_overlaps(&self.plain, range)
    }

    /// Records a trusted key over `range` waiting for plain accesses to end; the token ends the wait.
    pub(crate) fn begin_wait(&mut self, range: Range<usize>) -> u64 {
        self.next_token += 1;
        self.waiting.push((self.next_token, range));
        self.next_token
    }

    pub(crate) fn end_wait(&mut self, token: u64) {
        take(&mut self.waiting, token);
    }

    /// Whether a trusted key waits for a plain access to end.
    #[cfg(test)]
    pub(crate) fn key_waits(&self) -> bool {
        !self.waiting.is_empty()
    }
}

/// Whether two ranges share a byte: an empty range shares none (an empty lease, from `split_at(0)` or of an empty
/// range, refused the borrows and leases around it).
fn overlap(a: &Range<usize>, b: &Range<usize>) -> bool {
    a.start < a.end && b.start < b.end && a.start < b.end && b.start < a.end
}

fn any_overlaps(ranges: &[(u64, Range<usize>)], range: &Range<usize>) -> bool {
    ranges.iter().any(|(_, r)| overlap(r, range))
}

fn take(ranges: &mut Vec<(u64, Range<usize>)>, token: u64) {
    if let Some(i) = ranges.iter().position(|(t, _)| *t == token) {
        ranges.swap_remove(i);
    }
}

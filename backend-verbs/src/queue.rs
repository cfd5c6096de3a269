//! The bookkeeping of work requests, kept apart from ibverbs so it can be tested without a device: the
//! identifiers the device carries, the send-queue records of an endpoint, where a failed chain stopped, and which
//! requests are signalled.
//!
//! ## Identifiers
//! Every work request the device carries has a `wr_id` no other request of the transport ever had or will have:
//! sends (and window binds) take the next value of one 62-bit counter of the transport, receives the next value
//! of another, tagged with [`RECV_TAG`]. A queue pair's number can be reused by rdma_cm once it is destroyed, and
//! completions of the destroyed one may still sit in the shared completion queue, so the number alone does not
//! say whose a completion is. The identifier does: a completion names one of the records of the endpoint that
//! now has the number, or none of them (a late completion of the endpoint that had it before), and
//! [`SendQueue::retire`] retires records only for a completion that names one of them.
//!
//! ## Reads complete out of order on iWARP
//! A reliable connection completes its send queue in order on InfiniBand and RoCE, so a signalled completion
//! also completes the unsignalled requests before it. iWARP devices need not: siw completes a send or write once
//! it has handed it to TCP, and an RDMA read when its response has arrived, so a send posted after a read may
//! complete first. Were the read retired with it, its sink registration and lease would go while the response is
//! still on its way (siw then refuses the response with a TERMINATE, or the receive reports bytes that have not
//! arrived). So reads are always signalled and [`Posted::own`]: only their own completion retires them.

use std::collections::VecDeque;

use crate::cq::CqBudget;

/// Marks the identifier of a receive (the other identifiers are sends and window binds).
pub const RECV_TAG: u64 = 1 << 63;

/// Every this many unsignalled send-queue requests, one is signalled (plus the last of every batch).
pub const SIGNAL_EVERY: u32 = 16;

/// Marks the identifier of a native request that is not its request's last (the write of an emulated
/// write-with-immediate; the request's own identifier goes on its last native). A completion of one frees its own
/// entry and retires the requests before it, but not its request: the immediate's send is still to come (a failed
/// one retires it, see [`SendQueue::retire_each`]). Send identifiers stay below it (2^62 requests take 146 years
/// at 10^9 a second).
pub const PART_TAG: u64 = 1 << 62;

/// The identifier and the signalling of native request `part` (of `parts`) of request `seq`: the last one is
/// signalled when the signalling period says so or `last_of_batch`; an earlier one only when `must`. `must` also
/// signals the last one: a device that sends an unsignalled request of a page or more from the application's own
/// pages, and completes it once TCP has them queued, not sent (siw), must signal those, so that their completion
/// means the bytes were copied (review finding; [`crate::settings::DeviceLimits::sends_unsignalled_from_user_pages`]).
pub fn native_signal(
    seq: u64,
    part: usize,
    parts: usize,
    must: bool,
    last_of_batch: bool,
    signal: &mut Signaler,
) -> (u64, bool) {
    if part + 1 == parts {
        (seq, signal.next(last_of_batch || must))
    } else {
        (seq | PART_TAG, must)
    }
}

/// The identifiers of a transport's work requests: each used once, never again (see the module documentation).
#[derive(Debug)]
pub struct WrIds {
    next_send: u64,
    next_recv: u64,
}

impl Default for WrIds {
    fn default() -> Self {
        WrIds {
            next_send: 1,
            next_recv: 1,
        }
    }
}

impl WrIds {
    /// The identifier of a new send-queue request (send, write, read, window bind).
    pub fn send(&mut self) -> u64 {
        let id = self.next_send;
        // 2^62 requests at 10^9 per second take 146 years: the counter never reaches the tags.
        self.next_send += 1;
        debug_assert!(id & (RECV_TAG | PART_TAG) == 0);
        id
    }

    /// The identifier of a new receive.
    pub fn recv(&mut self) -> u64 {
        let id = self.next_recv;
        self.next_recv += 1;
        debug_assert!(id & RECV_TAG == 0);
        RECV_TAG | id
    }

    /// Whether an identifier is a receive's.
    pub fn is_recv(wr_id: u64) -> bool {
        wr_id & RECV_TAG != 0
    }
}

/// One send-queue request of an endpoint, on the device until a completion retires it.
#[derive(Debug)]
pub struct Posted<T> {
    /// Its identifier (as the device carries it).
    pub seq: u64,
    /// Native requests it took on the send queue (an emulated write-with-immediate takes two).
    pub entries: u32,
    /// Only part of it reached the device: it completes with an error whatever the device says.
    pub broken: bool,
    /// Retired only by its own completion (an RDMA read: always signalled; see the module documentation).
    pub own: bool,
    /// What the backend keeps of it (the operation and its leases).
    pub item: T,
}

/// The requests an endpoint has on its send queue, in posting order, and how many native entries they take.
#[derive(Debug)]
pub struct SendQueue<T> {
    recs: VecDeque<Posted<T>>,
    /// Requests retired by a failed completion that may be their first native's, with how many of their natives
    /// may still complete (flushed, under the same identifier): those entries are still on the device.
    echoes: Vec<(u64, u32)>,
    entries: u32,
}

impl<T> Default for SendQueue<T> {
    fn default() -> Self {
        SendQueue {
            recs: VecDeque::new(),
            echoes: Vec::new(),
            entries: 0,
        }
    }
}

/// The natives of `rec` that may still complete after a failed completion of its first native (the write of an
/// emulated write-with-immediate, under [`PART_TAG`]): the others complete too, flushed. A completion under the
/// request's own identifier is its last native's, after which nothing more comes. A request that reached the
/// device in part ([`Posted::broken`]) has only its first native there.
fn later_parts<T>(rec: &Posted<T>, failed: bool) -> u32 {
    if failed && !rec.broken {
        rec.entries.saturating_sub(1)
    } else {
        0
    }
}

impl<T> SendQueue<T> {
    /// Records a request that reached the device. Identifiers grow with posting order.
    pub fn push(&mut self, rec: Posted<T>) {
        debug_assert!(self.recs.back().is_none_or(|b| b.seq < rec.seq));
        self.entries += rec.entries;
        self.recs.push_back(rec);
    }

    /// Native entries the recorded requests take on the send queue (the device holds no more than this).
    pub fn entries(&self) -> u32 {
        self.entries
    }

    /// What the records on the device keep, oldest first.
    pub fn items(&self) -> impl Iterator<Item = &T> + '_ {
        self.recs.iter().map(|r| &r.item)
    }

    /// Requests recorded.
    #[cfg(test)]
    #[allow(clippy::len_without_is_empty)]
    pub fn len(&self) -> usize {
        self.recs.len()
    }

    /// The records a completion carrying `wr_id` retires, oldest first, each with whether it is the one the
    /// completion names: that one and every earlier one (a reliable connection completes in order; the earlier
    /// ones were unsignalled), except earlier records that only their own completion retires ([`Posted::own`]:
    /// reads, which stay). A completion that names none of the records retires nothing: it belongs to a queue pair
    /// destroyed before this one got its number, or to a request an earlier completion already retired (the second
    /// part of an emulated write-with-immediate flushed after its first part failed).
    ///
    /// Each retired record goes to `f` as it leaves the queue (a completion retires one request, or a few with the
    /// unsignalled ones before it: nothing is gathered or allocated per completion). Returns the native entries
    /// that left the device: those of the retired records, less what may still complete of the named one when the
    /// completion `failed` ([`later_parts`]), plus one when the completion is such a later part.
    pub fn retire_each(&mut self, wr_id: u64, failed: bool, f: impl FnMut(Posted<T>, bool)) -> u32 {
        if wr_id & PART_TAG != 0 {
            let seq = wr_id & !PART_TAG;
            return if failed {
                // A failed first native: the request is retired with the error, and its later natives complete
                // flushed (echoes).
                self.retire_named(seq, true, true, f)
            } else {
                self.first_part_done(seq, f)
            };
        }
        if let Some(i) = self.echoes.iter().position(|&(seq, _)| seq == wr_id) {
            self.echoes[i].1 -= 1;
            if self.echoes[i].1 == 0 {
                self.echoes.swap_remove(i);
            }
            self.entries -= 1;
            return 1;
        }
        // Under the request's own identifier: its last native (or its only one).
        self.retire_named(wr_id, failed, false, f)
    }

    /// Retires request `wr_id` and the requests before it (reads excepted); `first`: the completion is its first
    /// native's, so that its later natives may still complete ([`later_parts`]).
    fn retire_named(
        &mut self,
        wr_id: u64,
        failed: bool,
        first: bool,
        mut f: impl FnMut(Posted<T>, bool),
    ) -> u32 {
        if self.recs.binary_search_by_key(&wr_id, |r| r.seq).is_err() {
            return 0;
        }
        let mut freed = 0;
        let mut waiting = Vec::new();
        while let Some(rec) = self.recs.pop_front() {
            let named = rec.seq == wr_id;
            if rec.own && !named {
                waiting.push(rec);
                continue;
            }
            let later = if named && first {
                later_parts(&rec, failed)
            } else {
                0
            };
            if later > 0 {
                self.echoes.push((rec.seq, later));
            }
            self.entries -= rec.entries - later;
            freed += rec.entries - later;
            f(rec, named);
            if named {
                break;
            }
        }
        // The reads still waiting go back in front, in order: the queue stays sorted by identifier.
        for rec in waiting.into_iter().rev() {
            self.recs.push_front(rec);
        }
        freed
    }

    /// The first native of request `seq` completed (signalled, successfully, under [`PART_TAG`]): the requests
    /// before it are retired (reads excepted, as ever), its own entry freed, and the request kept for its last
    /// native's completion, unless that never reached the device ([`Posted::broken`]). Returns the entries freed.
    fn first_part_done(&mut self, seq: u64, mut f: impl FnMut(Posted<T>, bool)) -> u32 {
        if self.recs.binary_search_by_key(&seq, |r| r.seq).is_err() {
            return 0;
        }
        let mut freed = 0;
        let mut waiting = Vec::new();
        while let Some(mut rec) = self.recs.pop_front() {
            if rec.seq != seq {
                if rec.own {
                    waiting.push(rec);
                } else {
                    self.entries -= rec.entries;
                    freed += rec.entries;
                    f(rec, false);
                }
                continue;
            }
            if rec.broken || rec.entries <= 1 {
                self.entries -= rec.entries;
                freed += rec.entries;
                f(rec, true);
            } else {
                rec.entries -= 1;
                self.entries -= 1;
                freed += 1;
                self.recs.push_front(rec);
            }
            break;
        }
        for rec in waiting.into_iter().rev() {
            self.recs.push_front(rec);
        }
        freed
    }

    /// Records the requests of a chain that reached the device, as far as `cut` says (a request it cuts through is
    /// kept, [`Posted::broken`]), each taking its entries from `budget`; returns the items of the others, in order.
    pub fn keep(
        &mut self,
        recs: impl IntoIterator<Item = Posted<T>>,
        cut: Cut,
        budget: &mut CqBudget,
    ) -> Vec<T> {
        let mut refused = Vec::new();
        for (i, mut r) in recs.into_iter().enumerate() {
            if i < cut.posted || (i == cut.posted && cut.partial) {
                r.broken |= i == cut.posted;
                budget.take(r.entries);
                self.push(r);
            } else {
                refused.push(r.item);
            }
        }
        refused
    }

    /// [`SendQueue::retire_each`], gathered.
    #[cfg(test)]
    pub fn retire(&mut self, wr_id: u64) -> Vec<(Posted<T>, bool)> {
        let mut out = Vec::new();
        self.retire_each(wr_id, false, |rec, named| out.push((rec, named)));
        out
    }

    /// Everything recorded, oldest first (for a queue pair that is gone).
    #[cfg(test)]
    pub fn drain(&mut self) -> impl Iterator<Item = Posted<T>> + '_ {
        self.entries = 0;
        self.echoes.clear();
        self.recs.drain(..)
    }
}

/// Decides which send-queue requests are signalled: the last of every batch and every [`SIGNAL_EVERY`]-th, so
/// the queue never fills with requests whose entries only a later completion frees.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Signaler {
    /// Unsignalled requests since the last signalled one.
    pub unsignaled: u32,
}

impl Signaler {
    /// Whether the next request (the last of its batch or not) is signalled; counts it.
    pub fn next(&mut self, last_of_batch: bool) -> bool {
        self.unsignaled += 1;
        if last_of_batch || self.unsignaled >= SIGNAL_EVERY {
            self.unsignaled = 0;
            true
        } else {
            false
        }
    }
}

/// Where a chain of native requests that the device refused at index `bad` stopped, in terms of the caller's
/// requests (`parts[i]`: native requests of request `i`, in chain order).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Cut {
    /// Requests that reached the device whole (the first `posted`).
    pub posted: usize,
    /// Whether the next request reached it in part (its first natives were posted, the rest not).
    pub partial: bool,
}

impl Cut {
    /// A chain the device took whole.
    pub const ALL: Cut = Cut {
        posted: usize::MAX,
        partial: false,
    };
}

/// See [`Cut`]. Everything before the refused native was posted; nothing from it on was.
pub fn cut(parts: impl IntoIterator<Item = usize>, bad: usize) -> Cut {
    let mut start = 0;
    for (i, n) in parts.into_iter().enumerate() {
        if bad < start + n {
            return Cut {
                posted: i,
                partial: bad > start,
            };
        }
        start += n;
    }
    // `bad` is past the chain: everything was posted (a provider that reports an error after posting all).
    Cut::ALL
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(ids: &mut WrIds, item: &'static str) -> Posted<&'static str> {
        Posted {
            seq: ids.send(),
            entries: 1,
            broken: false,
            own: false,
            item,
        }
    }

    /// A review found it: siw sends an unsignalled request of a page or more from the application's pages and
    /// completes it once TCP has them queued, so a later completion did not mean they were free. On such a
    /// device every native of a page or more is signalled, the write of an emulated write-with-immediate too, under
    /// its request's identifier tagged as a first part.
    #[test]
    fn natives_of_a_page_are_signalled_where_the_device_sends_from_user_pages() {
        let mut signal = Signaler::default();
        // Mid-batch, an emulated write-with-immediate of a page: its write is signalled (tagged), its send goes by
        // the period.
        assert_eq!(
            native_signal(7, 0, 2, true, false, &mut signal),
            (7 | PART_TAG, true)
        );
        assert_eq!(
            native_signal(7, 1, 2, false, false, &mut signal),
            (7, false)
        );
        // A send of a page, mid-batch: signalled.
        assert_eq!(native_signal(8, 0, 1, true, false, &mut signal), (8, true));
        assert_eq!(
            signal.unsignaled, 0,
            "a signalled request restarts the period"
        );
        // Elsewhere (must false) as before: only the last of a request, by the period.
        assert_eq!(
            native_signal(9, 0, 2, false, false, &mut signal),
            (9 | PART_TAG, false)
        );
        assert_eq!(native_signal(9, 1, 2, false, true, &mut signal), (9, true));
    }

    /// The completion of a first part (tagged) frees its own entry and retires the requests before it, and keeps
    /// its request for its last part's completion; a failed one retires the request with its error, its send's
    /// flush still counted (an echo).
    #[test]
    fn a_first_parts_completion_keeps_its_request_for_the_last() {
        let mut ids = WrIds::default();
        let mut q = SendQueue::default();
        let a = rec(&mut ids, "a");
        let mut b = rec(&mut ids, "b");
        b.entries = 2;
        let (a_seq, b_seq) = (a.seq, b.seq);
        q.push(a);
        q.push(b);
        assert_eq!(q.entries(), 3);
        let mut got = Vec::new();
        let freed = q.retire_each(b_seq | PART_TAG, false, |r, named| {
            got.push((r.item, named))
        });
        assert_eq!((freed, q.entries()), (2, 1));
        assert_eq!(
            got,
            [("a", false)],
            "the request before it is retired, not b"
        );
        got.clear();
        assert_eq!(
            q.retire_each(b_seq, false, |r, named| got.push((r.item, named))),
            1
        );
        assert_eq!(got, [("b", true)]);
        assert_eq!(q.entries(), 0);
        assert_eq!(q.retire_each(a_seq | PART_TAG, false, |_, _| {}), 0, "gone");

        // Failed: retired at once with the error; the flushed send's completion frees the last entry.
        let mut c = rec(&mut ids, "c");
        c.entries = 2;
        let c_seq = c.seq;
        q.push(c);
        got.clear();
        assert_eq!(
            q.retire_each(c_seq | PART_TAG, true, |r, named| got.push((r.item, named))),
            1
        );
        assert_eq!(got, [("c", true)]);
        assert_eq!(q.entries(), 1, "the send's flush is still to come");
        assert_eq!(
            q.retire_each(c_seq, true, |_, _| panic!("retired twice")),
            1
        );
        assert_eq!(q.entries(), 0);
    }

    #[test]
    fn identifiers_are_never_reused_and_receives_are_tagged() {
        let mut ids = WrIds::default();
        let sends: Vec<u64> = (0..1000).map(|_| ids.send()).collect();
        let recvs: Vec<u64> = (0..1000).map(|_| ids.recv()).collect();
        assert!(sends.windows(2).all(|w| w[0] < w[1]), "sends grow");
        assert!(sends.iter().all(|&s| !WrIds::is_recv(s) && s != 0));
        assert!(recvs.iter().all(|&r| WrIds::is_recv(r)));
        let mut all: Vec<u64> = sends.iter().chain(&recvs).copied().collect();
        all.sort_unstable();
        all.dedup();
        assert_eq!(all.len(), 2000, "no identifier is given twice");
    }

    /// Issue 15: a queue pair destroyed without draining leaves completions in the shared completion queue; when
    /// its number goes to a new endpoint, those completions must not retire the new endpoint's requests (their
    /// leases would be dropped while the device still reads or writes the memory).
    #[test]
    fn a_late_completion_of_a_released_endpoint_retires_nothing_of_the_next_one() {
        let mut ids = WrIds::default();
        // Endpoint A posts 40 requests; the device completes the signalled 16th (seq 16), then A is released
        // (its queue dropped) with completions up to its 40th still in the completion queue.
        let mut a = SendQueue::default();
        for _ in 0..40 {
            a.push(rec(&mut ids, "a"));
        }
        assert_eq!(a.retire(16).len(), 16);
        let late: Vec<u64> = a.drain().map(|r| r.seq).collect();
        assert_eq!(late.len(), 24);
        // Endpoint B gets A's queue-pair number and posts its own requests.
        let mut b = SendQueue::default();
        for _ in 0..8 {
            b.push(rec(&mut ids, "b"));
        }
        // Every late completion of A, whatever its identifier, retires nothing of B.
        for &w in late.iter().chain(&[1, 16, 40]) {
            assert_eq!(
                b.retire(w).len(),
                0,
                "A's completion {w} retired B's requests"
            );
        }
        assert_eq!(b.len(), 8);
        assert_eq!(b.entries(), 8);
        // B's own signalled completion retires B's requests up to it, naming exactly one.
        let seq4 = 40 + 4;
        let got: Vec<(&str, bool)> = b
            .retire(seq4)
            .into_iter()
            .map(|(r, n)| (r.item, n))
            .collect();
        assert_eq!(
            got,
            vec![("b", false), ("b", false), ("b", false), ("b", true)]
        );
        assert_eq!(b.len(), 4);
        assert_eq!(b.entries(), 4);
        // A repeated completion (the flushed second part of a request already retired) retires nothing more.
        assert!(b.retire(seq4).is_empty());
        assert_eq!(b.len(), 4);
    }

    /// iWARP (siw): a send posted after an RDMA read completes before the read's response has arrived. The read
    /// must stay, its sink and lease with it, until its own completion; the queue stays in order for the next one.
    #[test]
    fn a_read_is_retired_only_by_its_own_completion() {
        let mut ids = WrIds::default();
        let mut q = SendQueue::default();
        let mut push = |q: &mut SendQueue<&'static str>, item, own| {
            let seq = ids.send();
            q.push(Posted {
                seq,
                entries: 1,
                broken: false,
                own,
                item,
            });
            seq
        };
        let s1 = push(&mut q, "send 1", false);
        let read = push(&mut q, "read", true);
        let _s2 = push(&mut q, "send 2", false);
        let s3 = push(&mut q, "send 3 (signalled)", false);
        let s4 = push(&mut q, "send 4", false);
        // The signalled send completes first: the sends before it go, the read stays.
        let got: Vec<&str> = q.retire(s3).into_iter().map(|(r, _)| r.item).collect();
        assert_eq!(got, vec!["send 1", "send 2", "send 3 (signalled)"]);
        assert_eq!(
            (q.len(), q.entries()),
            (2, 2),
            "the read and send 4 are still on the device"
        );
        // A repeated or late completion of a send already retired retires nothing, the read included.
        assert!(q.retire(s1).is_empty());
        // The read's own completion retires the read alone (send 4 is after it).
        let got: Vec<(&str, bool)> = q
            .retire(read)
            .into_iter()
            .map(|(r, n)| (r.item, n))
            .collect();
        assert_eq!(got, vec![("read", true)]);
        assert_eq!(q.retire(s4).len(), 1);
        assert_eq!(q.entries(), 0);
    }

    #[test]
    fn entries_follow_the_records() {
        let mut ids = WrIds::default();
        let mut q = SendQueue::default();
        for parts in [2, 1, 2, 1] {
            q.push(Posted {
                seq: ids.send(),
                entries: parts,
                broken: false,
                own: false,
                item: (),
            });
        }
        assert_eq!(q.entries(), 6);
        assert_eq!(q.retire(2).len(), 2);
        assert_eq!(q.entries(), 3);
        assert_eq!(q.drain().count(), 2);
        assert_eq!(q.entries(), 0);
    }

    /// Issue 15: a chain refused part-way: the requests before the refused native are on the device (their
    /// records and leases must stay), the one it cuts through is on it in part, the rest never reached it.
    #[test]
    fn a_chain_refused_part_way_keeps_the_posted_prefix() {
        // Native requests per caller's request: a send, an emulated write-with-immediate (two), a read, a send.
        let parts = [1, 2, 1, 1];
        assert_eq!(
            cut(parts, 0),
            Cut {
                posted: 0,
                partial: false
            }
        );
        assert_eq!(
            cut(parts, 1),
            Cut {
                posted: 1,
                partial: false
            }
        );
        // The write went, its immediate did not.
        assert_eq!(
            cut(parts, 2),
            Cut {
                posted: 1,
                partial: true
            }
        );
        assert_eq!(
            cut(parts, 3),
            Cut {
                posted: 2,
                partial: false
            }
        );
        assert_eq!(
            cut(parts, 4),
            Cut {
                posted: 3,
                partial: false
            }
        );
        assert_eq!(cut(parts, 5).posted, usize::MAX);
    }

    #[test]
    fn every_sixteenth_and_the_last_of_a_batch_are_signalled() {
        let mut s = Signaler::default();
        let flags: Vec<bool> = (0..40).map(|i| s.next(i == 39)).collect();
        let signalled: Vec<usize> = (0..40).filter(|&i| flags[i]).collect();
        assert_eq!(signalled, vec![15, 31, 39]);
        assert_eq!(s.unsignaled, 0);
        assert!(!s.next(false));
        assert_eq!(s.unsignaled, 1);
    }
}

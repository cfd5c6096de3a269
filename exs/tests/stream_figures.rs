//! The four case studies of seed 001 (Figures 4-7), rebuilt from their captions on the simulated fabric with a
//! scripted order of events. The figures themselves are lost; each test states the caption it rebuilds and
//! asserts the advertisements accepted and rejected, the phases, and the bytes delivered.
//!
//! The simulator steps one delivery at a time and lets every host process it before the next one, so a test can
//! stop the world right after the receiver has seen exactly one transfer.
#![cfg(feature = "sim")] // the simulated fabric: `cargo test -p exs --features sim`

mod common;

use common::*;
use exs::sim::SimConfig;
use exs::stats::StreamTrace;
use exs::{MemoryRegion, MsgFlags, SockType, SocketOptions};

struct Fig {
    p: Pair,
    /// Everything recorded so far, per side.
    tx: Vec<StreamTrace>,
    rx: Vec<StreamTrace>,
    /// The client's bytes, in order, and what the server received.
    sent: Vec<u8>,
    got: Vec<u8>,
    dst: MemoryRegion,
    next_slot: usize,
}

const SLOT: usize = 1 << 16;

/// The sender's indirect transfer I<seq> (seed 001's notation): `len` bytes into the stream buffer in `phase`.
fn indirect(seq: u64, len: u64, phase: u32) -> StreamTrace {
    StreamTrace::Indirect { seq, len, phase }
}

/// The sender's direct transfer D<seq> into the advertisement of `advert_seq`.
fn direct(seq: u64, len: u64, phase: u32, advert_seq: u64) -> StreamTrace {
    StreamTrace::Direct {
        seq,
        len,
        phase,
        advert_seq,
    }
}

/// The sender's rejection of the advertisement (`seq`, `phase`), judged at `sender_seq`, leaving it in
/// `sender_phase`.
fn rejected(seq: u64, phase: u32, sender_seq: u64, sender_phase: u32) -> StreamTrace {
    StreamTrace::Rejected {
        seq,
        phase,
        sender_seq,
        sender_phase,
    }
}

impl Fig {
    fn new(ring: u32) -> Fig {
        // The figures start with each side's stream buffer known to the other, and each send travels as soon as
        // it is made (the seed's figures know no coalescing: a send behind one in flight would join it).
        let opts = SocketOptions::default()
            .with_trace(true)
            .with_stream_buffer_size(ring)
            .with_stream_buffer_eager(true)
            .with_coalesce(false);
        let p = pair_with(
            SockType::Stream,
            SimConfig {
                jitter: std::time::Duration::ZERO,
                ..SimConfig::default()
            },
            opts,
        );
        p.world.run_until_idle(10_000);
        let dst = MemoryRegion::alloc(&p.b, 64 * SLOT).unwrap();
        Fig {
            p,
            tx: Vec::new(),
            rx: Vec::new(),
            sent: Vec::new(),
            got: Vec::new(),
            dst,
            next_slot: 0,
        }
    }

    /// Client-to-server direction only: the client's sender decisions, the server's receiver decisions.
    fn collect(&mut self) {
        let sender = |t: &StreamTrace| {
            matches!(
                t,
                StreamTrace::Direct { .. }
                    | StreamTrace::Indirect { .. }
                    | StreamTrace::Accepted { .. }
                    | StreamTrace::Rejected { .. }
            )
        };
        self.tx
            .extend(self.p.client.stream_trace().into_iter().filter(sender));
        self.rx.extend(
            self.p
                .server
                .stream_trace()
                .into_iter()
                .filter(|t| !sender(t)),
        );
    }

    /// The client sends `n` bytes (one send).
    fn send(&mut self, n: usize) {
        let data = pattern(n, self.sent.len() as u64 + 1);
        self.sent.extend_from_slice(&data);
        let src = MemoryRegion::from_vec(&self.p.a, data).unwrap();
        self.p
            .client
            .send(&self.p.eq_a, &src.all(), MsgFlags::NONE, n as u64)
            .unwrap();
        self.collect();
    }

    /// The server posts a receive of `n` bytes.
    fn recv(&mut self, n: usize) {
        let slot = self.next_slot;
        self.next_slot += 1;
        self.p
            .server
            .recv(
                &self.p.eq_b,
                &self.dst.slice(slot * SLOT..slot * SLOT + n),
                MsgFlags::NONE,
                slot as u64,
            )
            .unwrap();
        self.collect();
    }

    /// One step of the world (a delivery, or one round of processing).
    fn step(&mut self) -> bool {
        let r = self.p.world.drive();
        self.collect();
        r
    }

    /// Steps until `cond` holds on the recorded traces.
    fn until(&mut self, what: &str, cond: impl Fn(&Fig) -> bool) {
        for _ in 0..10_000 {
            if cond(self) {
                return;
            }
            assert!(
                self.step(),
                "the world went idle before: {what}\nclient: {:?}\nserver: {:?}",
                self.tx,
                self.rx
            );
        }
        panic!("never happened: {what}");
    }

    fn settle(&mut self) {
        while self.step() {}
    }

    /// Takes the completed receives' bytes, in completion order.
    fn harvest(&mut self) {
        let mut evs = Vec::new();
        self.p.eq_b.poll(&mut evs, 1000);
        for ev in evs {
            assert!(ev.is_ok(), "{ev:?}");
            if ev.kind != exs::EventKind::Recv {
                continue;
            }
            let slot = ev.context as usize;
            let mut bytes = vec![0u8; ev.bytes];
            self.dst.read(slot * SLOT, &mut bytes).unwrap();
            self.got.extend_from_slice(&bytes);
        }
        let mut sends = Vec::new();
        self.p.eq_a.poll(&mut sends, 1000);
        assert!(sends.iter().all(|e| e.is_ok()), "{sends:?}");
    }

    fn check_stream(&mut self) {
        self.harvest();
        assert_bytes_eq(&self.got, &self.sent[..self.got.len()], "the stream so far");
    }

    fn server_phase(&self) -> u32 {
        self.rx
            .iter()
            .rev()
            .find_map(|t| match t {
                StreamTrace::ReceiverPhase { phase } => Some(*phase),
                _ => None,
            })
            .unwrap_or(0)
    }

    /// The sender's indirect transfers so far: (sequence number, length).
    fn indirects(&self) -> Vec<(u64, u64)> {
        self.tx
            .iter()
            .filter_map(|t| match t {
                StreamTrace::Indirect { seq, len, .. } => Some((*seq, *len)),
                _ => None,
            })
            .collect()
    }

    /// Steps until the receiver has filled every receive it advertised before the sender went indirect and moved
    /// back to an even phase (2).
    fn until_receiver_resynchronised(&mut self) {
        self.until("the receiver filled the rejected receives", |f| {
            f.server_phase() == 2
        });
    }

    /// After the world settled: the sender accepted the advertisement at `seq` in phase 2, and every byte sent
    /// arrived in order.
    fn assert_resynchronised_at(&mut self, seq: u64) {
        assert!(
            self.tx.contains(&StreamTrace::Accepted { seq, phase: 2 }),
            "{:?}",
            self.tx
        );
        self.check_stream();
        assert_eq!(self.got.len(), self.sent.len());
    }

    /// Steps until the sender has rejected `n` advertisements in all.
    fn until_rejected(&mut self, n: usize) {
        self.until("advertisements rejected", |f| {
            f.tx.iter()
                .filter(|t| matches!(t, StreamTrace::Rejected { .. }))
                .count()
                == n
        });
    }

    fn adverts_sent(&self) -> Vec<(u64, u32)> {
        self.rx
            .iter()
            .filter_map(|t| match t {
                StreamTrace::AdvertSent { seq, phase, .. } => Some((*seq, *phase)),
                _ => None,
            })
            .collect()
    }
}

/// Figure 4: "the receiver is forbidden to send an advertisement A6 after receiving indirect transfer I3 until
/// all outstanding advertisements have been satisfied ... In this case, the receiver must wait for advertisement
/// A5 to be satisfied via an indirect transfer. The sender increments its phase after sending an indirect transfer
/// and does not accept advertisements with a phase less than its current phase."
#[test]
fn figure4_receiver_waits_for_outstanding_adverts() {
    let mut f = Fig::new(1 << 16);
    // The receiver advertises A4 and A5 (phase 0) while the sender, not having seen them, sends I3.
    f.recv(100);
    f.recv(100);
    assert_eq!(
        f.adverts_sent(),
        vec![(0, 0), (1, 0)],
        "A4, A5: estimated seq 0 and 1 in phase 0"
    );
    f.send(100);
    assert_eq!(
        f.tx,
        [indirect(0, 100, 1)],
        "I3 moves the sender to phase 1"
    );
    // The receiver gets I3: phase 1; I3 satisfies A4's receive; A5 is still outstanding.
    f.until("the receiver processed I3", |f| {
        f.rx.iter().any(|t| {
            matches!(
                t,
                StreamTrace::RecvCompleted {
                    bytes: 100,
                    advertised: true
                }
            )
        })
    });
    assert_eq!(f.server_phase(), 1);
    // A new receive (A6's) is posted: the receiver must stay passive.
    f.recv(100);
    f.settle();
    assert_eq!(
        f.adverts_sent().len(),
        2,
        "no advertisement while A5 is outstanding: {:?}",
        f.rx
    );
    // The sender rejects A4 and A5: their phase 0 is below its phase 1 (and the phase does not change).
    let judged: Vec<_> =
        f.tx.iter()
            .filter(|t| matches!(t, StreamTrace::Rejected { .. }))
            .copied()
            .collect();
    assert_eq!(judged, [rejected(0, 0, 100, 1), rejected(1, 0, 100, 1)]);
    // More data: it must go indirect (no acceptable advertisement) and it satisfies A5's receive ...
    f.send(150);
    f.settle();
    // ... at which point the receiver moves to phase 2 (A6's receive took the rest from the stream buffer).
    assert_eq!(f.server_phase(), 2);
    // Now a receive is advertised in phase 2, with the exact sequence number, and the sender accepts it.
    f.recv(100);
    let (seq, phase) = *f.adverts_sent().last().unwrap();
    assert_eq!((seq, phase), (250, 2));
    f.settle();
    f.send(60);
    f.settle();
    assert!(
        f.tx.contains(&StreamTrace::Accepted { seq: 250, phase: 2 }),
        "{:?}",
        f.tx
    );
    assert!(f.tx.contains(&direct(250, 60, 2, 250)), "{:?}", f.tx);
    f.check_stream();
    assert_eq!(f.got.len(), 310);
}

/// Brings both sides to the same even phase `target` (each round: an indirect transfer, then resynchronise).
fn sync_to(f: &mut Fig, target: u32) {
    while f.server_phase() < target {
        f.send(10);
        f.settle();
        f.recv(10);
        f.settle();
        f.recv(100);
        f.settle();
        f.send(5);
        f.settle();
    }
    f.check_stream();
}

/// Figure 5: "advertisement A4 should be rejected since it was satisfied by indirect transfer I3. Advertisement A5
/// should be accepted since at that point the sender has caught up with the receiver ... we receive advertisement
/// A5 with a phase 6 which is greater than the current phase at the sender 5. We only accept the advertisement if
/// the sequence numbers match."
#[test]
fn figure5_stale_advert_rejected_next_accepted() {
    let mut f = Fig::new(1 << 16);
    sync_to(&mut f, 4);
    assert_eq!(f.server_phase(), 4);
    f.tx.clear();
    f.rx.clear();
    // A4 (phase 4) is advertised; the sender, before seeing it, sends I3 and moves to phase 5.
    f.recv(100);
    let (a4_seq, a4_phase) = *f.adverts_sent().last().unwrap();
    assert_eq!(a4_phase, 4);
    f.send(100);
    assert!(
        matches!(f.tx.last(), Some(StreamTrace::Indirect { phase: 5, .. })),
        "{:?}",
        f.tx
    );
    // The receiver gets I3: A4's receive is satisfied by it; all flushed: phase 5, then 6.
    f.until("the receiver reached phase 6", |f| f.server_phase() == 6);
    // A5 is advertised in phase 6 with the sender's current sequence number.
    f.recv(100);
    let (a5_seq, a5_phase) = *f.adverts_sent().last().unwrap();
    assert_eq!((a5_seq, a5_phase), (a4_seq + 100, 6));
    f.settle();
    f.send(40);
    f.settle();
    assert!(
        f.tx.contains(&rejected(a4_seq, 4, a4_seq + 100, 5)),
        "A4 rejected: {:?}",
        f.tx
    );
    assert!(
        f.tx.contains(&StreamTrace::Accepted {
            seq: a5_seq,
            phase: 6
        }),
        "A5 accepted: {:?}",
        f.tx
    );
    assert!(f.tx.contains(&direct(a5_seq, 40, 6, a5_seq)));
    f.check_stream();
}

/// Figure 6: "another tricky case similar to Figure 5, in which multiple advertisements are matched by indirect
/// WWI messages. Here, we simply follow the same process and we wind up matching the correct advertisement."
#[test]
fn figure6_multiple_adverts_matched_by_indirect() {
    let mut f = Fig::new(1 << 16);
    // Three receives advertised (phase 0) ...
    for _ in 0..3 {
        f.recv(100);
    }
    assert_eq!(f.adverts_sent(), vec![(0, 0), (1, 0), (2, 0)]);
    // ... while the sender, having seen none, sends two indirect transfers of 150 bytes.
    f.send(150);
    f.send(150);
    assert_eq!(f.tx, [indirect(0, 150, 1), indirect(150, 150, 1)]);
    f.settle();
    // All three advertised receives were satisfied by indirect data (100 + 100 + 100) and 0 bytes remain.
    let done: Vec<_> =
        f.rx.iter()
            .filter(|t| matches!(t, StreamTrace::RecvCompleted { .. }))
            .copied()
            .collect();
    assert_eq!(done.len(), 3, "{:?}", f.rx);
    assert_eq!(
        f.server_phase(),
        2,
        "all advertisements flushed by indirect transfers"
    );
    // The next receive gets the rest of the stream buffer (without an advertisement) ...
    f.recv(100);
    assert_eq!(
        f.adverts_sent().len(),
        3,
        "a receive that the stream buffer feeds is not advertised"
    );
    // ... and the one after is advertised with the exact sequence number: 300.
    f.recv(100);
    assert_eq!(*f.adverts_sent().last().unwrap(), (300, 2));
    f.settle();
    f.send(70);
    f.settle();
    for s in [0, 1, 2] {
        assert!(f.tx.contains(&rejected(s, 0, 300, 1)), "{:?}", f.tx);
    }
    assert!(
        f.tx.contains(&StreamTrace::Accepted { seq: 300, phase: 2 }),
        "the correct advertisement: {:?}",
        f.tx
    );
    assert!(f.tx.contains(&direct(300, 70, 2, 300)));
    f.check_stream();
    assert_eq!(f.got.len(), 370);
}

/// Figure 7: "a very small stream buffer of 200 bytes, but send and receive 100 byte messages ... when the sender
/// gets ahead after sending D202, the sender can send a 100 byte indirect transfer (I302), a 98 byte indirect
/// transfer (I402), and a 2 byte indirect transfer (I500) in sequence before filling the stream buffer and being
/// unable to send. This means that the sequence number at the sender is now 502. This is due to the initial 2 byte
/// message that starts the pumpexs application ... we instead increment the phase as soon as we reject an
/// advertisement to be larger than that in the advertisement, so that any future advertisements in that sequence
/// will be rejected. In this case, the sender's phase is incremented from 3 to 5 since it rejected advertisement A4
/// with phase number 4."
#[test]
fn figure7_small_stream_buffer_phase_jump() {
    let mut f = Fig::new(200);
    figure7_opening(&mut f);
    // The client now sends 100-byte messages: D2, D102, D202 use the three advertisements ...
    for _ in 0..3 {
        f.send(100);
    }
    assert_eq!(
        f.tx[..3],
        [
            direct(2, 100, 2, 2),
            direct(102, 100, 2, 3),
            direct(202, 100, 2, 4),
        ]
    );
    // ... then, with no advertisement left, I302 (100), and the next message splits at the end of the 200-byte
    // stream buffer: I402 (98) and I500 (2). The buffer is full; the sender is at seq 502 and must wait.
    f.send(100);
    f.send(100);
    f.send(100);
    assert_eq!(
        f.tx[3..],
        [
            indirect(302, 100, 3),
            indirect(402, 98, 3),
            indirect(500, 2, 3),
        ]
    );
    assert!(
        f.p.client.stats().unwrap().stream.space_stalls > 0,
        "the sender waits for stream-buffer space"
    );
    figure7_phase_jump(&mut f);
    // Everything arrives, in order, once the receiver has receives for it.
    for _ in 0..4 {
        f.recv(100);
    }
    f.settle();
    f.check_stream();
    assert_eq!(
        f.got.len(),
        f.sent.len(),
        "all {} bytes delivered",
        f.sent.len()
    );
}

/// Figure 7's start: pumpexs's "go" and "ok", and the server's three receives advertised (A1-A3) in phase 2, A1
/// accepted by the client. Leaves the client's trace empty.
fn figure7_opening(f: &mut Fig) {
    // pumpexs start: the client sends "go" (2 bytes) before the server has posted anything: indirect, phase 1.
    f.send(2);
    assert_eq!(f.tx, vec![indirect(0, 2, 1)]);
    f.settle();
    // The server receives "go", then posts receives for its buffers (3 x 100) and replies "ok".
    f.recv(100);
    for _ in 0..3 {
        f.recv(100);
    }
    let ok_buf = MemoryRegion::from_vec(&f.p.b, b"ok".to_vec()).unwrap();
    let ok_in = MemoryRegion::alloc(&f.p.a, 2).unwrap();
    f.p.client
        .recv(&f.p.eq_a, &ok_in.all(), MsgFlags::WAITALL, 99)
        .unwrap();
    f.p.server
        .send(&f.p.eq_b, &ok_buf.all(), MsgFlags::NONE, 99)
        .unwrap();
    f.settle();
    assert_eq!(
        f.adverts_sent(),
        vec![(2, 2), (3, 2), (4, 2)],
        "A1-A3 in phase 2"
    );
    assert_eq!(ok_in.to_vec().unwrap(), b"ok");
    // The client (phase 1 after "go", seq 2) accepts A1: higher phase, matching sequence number.
    assert_eq!(
        f.tx,
        vec![
            indirect(0, 2, 1),
            StreamTrace::Accepted { seq: 2, phase: 2 }
        ]
    );
    f.tx.clear();
}

/// Figure 7's phase jump, with the sender stalled at seq 502 in phase 3: the receiver catches up, advertises in
/// phase 4, and the sender rejects the whole batch.
fn figure7_phase_jump(f: &mut Fig) {
    // The receiver catches up after the first RDMA write (I302): no advertisement is outstanding, so it moves
    // through phase 3 to phase 4; the application posts three receives; the first takes I302 from the stream
    // buffer, the other two are advertised in phase 4 with estimated sequence numbers.
    f.until("the receiver processed I302", |f| f.server_phase() == 4);
    for _ in 0..3 {
        f.recv(100);
    }
    let adverts = f.adverts_sent();
    let phase4: Vec<_> = adverts.iter().filter(|a| a.1 == 4).copied().collect();
    assert_eq!(phase4, vec![(402, 4), (403, 4)]);
    f.settle();
    // The sender (phase 3, seq 502 or beyond) rejects the first phase-4 advertisement and jumps to phase 5, so
    // the rest of that batch is rejected whatever its sequence number.
    let first =
        f.tx.iter()
            .position(|t| matches!(t, StreamTrace::Rejected { phase: 4, .. }))
            .expect("a phase-4 advert rejected");
    assert_eq!(f.tx[first], rejected(402, 4, 502, 5));
    assert!(
        f.tx[first + 1..].contains(&rejected(403, 4, 502, 5)),
        "{:?}",
        f.tx
    );
    assert!(
        !f.tx
            .iter()
            .any(|t| matches!(t, StreamTrace::Accepted { phase: 4, .. })),
        "no phase-4 advert accepted"
    );
}

/// The accidental match of Figure 7's caption: a later advertisement of a rejected batch whose estimated sequence
/// number happens to equal the sender's must still be rejected (its phase is now below the sender's).
#[test]
fn figure7_matching_seq_in_a_rejected_batch_is_not_accepted() {
    let mut f = Fig::new(200);
    f.send(2);
    f.settle();
    f.recv(100);
    f.settle();
    for _ in 0..3 {
        f.recv(100);
    }
    f.settle();
    for _ in 0..3 {
        f.send(100);
    }
    // I302 (100 bytes), then a 1-byte message: the sender's seq is 403, which is exactly the estimate of the second
    // receive advertised after I302.
    f.send(100);
    f.send(1);
    f.until("the receiver processed I302", |f| f.server_phase() == 4);
    for _ in 0..3 {
        f.recv(100);
    }
    let phase4: Vec<_> = f.adverts_sent().into_iter().filter(|a| a.1 == 4).collect();
    assert_eq!(phase4, vec![(402, 4), (403, 4)]);
    f.settle();
    assert!(f.tx.contains(&rejected(402, 4, 403, 5)), "{:?}", f.tx);
    assert!(
        f.tx.contains(&rejected(403, 4, 403, 5)),
        "seq 403 matches but the phase does not: {:?}",
        f.tx
    );
    f.recv(100);
    f.settle();
    f.check_stream();
    assert_eq!(f.got.len(), f.sent.len());
}

/// Beyond the figures: a sender that rejects advertisements of large receives (64 KiB or more) goes on indirectly
/// only until the receiver can have filled them, then waits for the receiver's next advertisement. The rejected
/// receives of the phase the sender left start where its first indirect transfer did (the direct transfers before
/// it filled the receives advertised before them), not at the receiver's estimates, which lag by the receives
/// queued ahead. Here the indirect bytes already fill the three rejected receives, so the two sends made after the
/// rejections wait, and go direct into the receiver's next advertisement. Before the fix the end of the rejected
/// receives was chained from the sender's own position (`exs pump --type stream --size 1M --depth 8` on libfabric
/// tcp: seven more 1 MiB transfers went indirect after every rejection, the receiver's next advertisement, exact,
/// was stale on arrival, and the stream stayed indirect for good: 3 advertisements accepted against 2,672
/// rejected in two seconds).
#[test]
fn rejected_large_receives_already_filled_hold_the_sender_until_the_next_advert() {
    const BIG: usize = 64 << 10;
    let big = BIG as u64;
    let mut f = Fig::new(512 << 10);
    for _ in 0..3 {
        f.recv(BIG);
    }
    // Before the three advertisements arrive: three indirect transfers, the sender in phase 1.
    for _ in 0..3 {
        f.send(BIG);
    }
    let before = vec![(0, big), (big, big), (2 * big, big)];
    assert_eq!(f.indirects(), before);
    f.until_rejected(3);
    f.send(BIG);
    f.send(BIG);
    assert_eq!(
        f.indirects(),
        before,
        "sends made after the rejections went indirect: {:?}",
        f.tx
    );
    // The receiver fills the three rejected receives (phase 1, then 2), then advertises its fourth at the
    // sender's exact position: accepted (long before the hold's time limit), and both waiting sends go direct.
    f.until_receiver_resynchronised();
    f.recv(BIG);
    f.recv(BIG);
    f.settle();
    assert_eq!(f.indirects(), before, "{:?}", f.tx);
    let resync = 3 * big;
    assert!(f.tx.contains(&direct(resync, big, 2, resync)), "{:?}", f.tx);
    assert!(
        f.tx.contains(&direct(resync + big, big, 2, resync + 1)),
        "{:?}",
        f.tx
    );
    f.assert_resynchronised_at(resync);
}

/// The receives the sender rejects after leaving an even phase start where its first indirect transfer did, not at
/// the receiver's estimates: here a 60 KiB receive was filled directly before the sender went indirect, and the
/// three large receives advertised behind it (at estimates 1, 2 and 3: the first had not completed) are filled from
/// byte 61,440 on. Two sends went indirect before the rejections; the third fills the last rejected receive whole
/// (chained from the estimates, the hold would have ended 61,439 bytes short of it), and the receiver's next
/// advertisement is accepted.
#[test]
fn rejected_receives_of_the_phase_left_start_where_the_first_indirect_transfer_did() {
    const BIG: usize = 64 << 10;
    const FIRST: usize = 60 << 10;
    let (big, first) = (BIG as u64, FIRST as u64);
    let mut f = Fig::new(512 << 10);
    f.recv(FIRST);
    f.settle();
    for _ in 0..3 {
        f.recv(BIG);
    }
    // Before the three large advertisements arrive: one direct transfer, then two indirect ones.
    for n in [FIRST, BIG, BIG] {
        f.send(n);
    }
    assert!(f.tx.contains(&direct(0, first, 0, 0)), "{:?}", f.tx);
    f.until_rejected(3);
    f.send(BIG);
    let want = vec![(first, big), (first + big, big), (first + 2 * big, big)];
    assert_eq!(f.indirects(), want, "{:?}", f.tx);
    f.until_receiver_resynchronised();
    f.recv(BIG);
    f.send(BIG);
    f.settle();
    let resync = first + 3 * big;
    assert_eq!(f.indirects(), want, "{:?}", f.tx);
    f.assert_resynchronised_at(resync);
}

/// A small receive rejected behind a large one is filled before the receiver can advertise again, so the sender's
/// hold covers it too: the next send fills it indirectly (100 bytes) and waits with the rest, which goes direct
/// into the receiver's next advertisement. Before, only large receives were chained: the hold ended at the large
/// one, the small one was never filled, and both sides waited for the hold's time limit.
#[test]
fn a_small_receive_rejected_behind_a_large_one_is_inside_the_hold() {
    const BIG: usize = 64 << 10;
    let big = BIG as u64;
    let mut f = Fig::new(512 << 10);
    f.recv(BIG);
    f.recv(100);
    f.send(BIG);
    f.until_rejected(2);
    f.send(BIG);
    assert_eq!(f.indirects(), vec![(0, big), (big, 100)], "{:?}", f.tx);
    f.until_receiver_resynchronised();
    f.recv(BIG);
    f.settle();
    let resync = big + 100;
    assert!(
        f.tx.contains(&direct(resync, big - 100, 2, resync)),
        "{:?}",
        f.tx
    );
    f.assert_resynchronised_at(resync);
}

/// The start both hold tests share: eight large sends go indirect before the receiver's one advertisement (a
/// 64 KiB receive) arrives, the sender rejects it, and two more sends wait behind the hold.
fn eight_indirect_then_two_held() -> Fig {
    let mut f = Fig::new(512 << 10);
    f.recv(HOLD_SEND);
    for _ in 0..8 {
        f.send(HOLD_SEND);
    }
    assert_eq!(f.indirects().len(), 8, "{:?}", f.tx);
    f.until_rejected(1);
    f.send(HOLD_SEND);
    f.send(HOLD_SEND);
    f
}

/// The size of every send and receive of the hold tests: large enough to make a rejection hold the sender.
const HOLD_SEND: usize = 64 << 10;

/// The receiver's application posts `n` receives of [`HOLD_SEND`] bytes, one every `ms` of virtual time.
fn recv_every(f: &mut Fig, n: usize, ms: u64) {
    for _ in 0..n {
        f.p.world.run_for(std::time::Duration::from_millis(ms));
        f.collect();
        f.recv(HOLD_SEND);
    }
}

/// A receiver that takes longer than the hold's time limit to drain the stream buffer, but keeps draining it, holds
/// the sender until it advertises again: each window update (the buffer consumed further) starts the limit again.
/// Here eight large sends went indirect before the receiver's one advertisement arrived, the receiver's
/// application posts a receive every 4 ms (each filled from the buffer), and the two sends made after the
/// rejection wait 32 ms, past the limit, and go direct into the receiver's next two advertisements. Before, the
/// limit ended the hold while the receiver was still draining: the two sends went indirect and made the next
/// advertisement stale on arrival (`exs pump --type stream --size 1M --depth 32` on libfabric tcp: 32 MiB written
/// indirect before the first advertisements came, the hold ended while the receiver copied them out, and the
/// stream stayed indirect for another 32 MiB or, in some runs, for good).
#[test]
fn a_receiver_still_draining_the_stream_buffer_keeps_the_sender_holding() {
    let big = HOLD_SEND as u64;
    let mut f = eight_indirect_then_two_held();
    recv_every(&mut f, 8, 4);
    f.recv(HOLD_SEND);
    f.settle();
    assert_eq!(
        f.indirects().len(),
        8,
        "sends made after the rejection went indirect: {:?}",
        f.tx
    );
    let resync = 8 * big;
    let accepted =
        |t: &StreamTrace| matches!(t, StreamTrace::Accepted { seq, .. } if *seq == resync);
    let direct_at = |at: u64| move |t: &StreamTrace| matches!(t, StreamTrace::Direct { seq, len, .. } if *seq == at && *len == big);
    assert!(f.tx.iter().any(accepted), "{:?}", f.tx);
    assert!(f.tx.iter().any(direct_at(resync)), "{:?}", f.tx);
    assert!(f.tx.iter().any(direct_at(resync + big)), "{:?}", f.tx);
    f.check_stream();
    assert_eq!(f.got.len(), f.sent.len());
}

/// The other side of the hold above: a receiver that drains part of the stream buffer and then stops reading holds
/// the sender only until the limit after its last progress. Its two receives empty a quarter of the buffer (a
/// window update the sender counts), then it posts nothing: the two held sends go indirect within the limit
/// (20 ms) and the time the receiver may defer its update (10 ms).
#[test]
fn a_receiver_that_stops_draining_ends_the_hold() {
    let mut f = eight_indirect_then_two_held();
    recv_every(&mut f, 2, 4);
    f.p.world.run_for(std::time::Duration::from_millis(20));
    f.collect();
    assert_eq!(f.indirects().len(), 8, "the hold ended early: {:?}", f.tx);
    f.p.world.run_for(std::time::Duration::from_millis(30));
    f.collect();
    assert!(
        f.indirects().len() > 8,
        "the held sends never went: {:?}",
        f.tx
    );
}

//! Phases across the 32-bit wrap (seed 001's phases count without end; ours wrap on both sides).

use std::cell::Cell;

use super::{later_phase, next_phase};
use crate::sim::{SimConfig, World};
use crate::testing::PairSpec;
use crate::{MemoryRegion, MsgFlags, SockType};

thread_local! {
    /// The phase streams made on this thread start in (see `first_phase`).
    pub(super) static FIRST_PHASE: Cell<u32> = const { Cell::new(0) };
}

#[test]
fn phases_compare_as_serial_numbers_across_the_wrap() {
    assert!(later_phase(1, 0) && later_phase(0, u32::MAX) && later_phase(2, u32::MAX - 1));
    assert!(!later_phase(u32::MAX, 0) && !later_phase(5, 5) && !later_phase(3, 4));
    assert_eq!(next_phase(u32::MAX), 0);
    // Parity survives the wrap: an odd phase's next is even.
    assert_eq!(next_phase(u32::MAX) % 2, 0);
}

/// A stream whose phases wrap keeps its direct transfers: six rounds of an indirect transfer (the receive posted
/// after the send) and a direct one (the receive posted and advertised first), from eight increments before the
/// wrap. The receiver's increment overflowed (a panic in debug builds), and with wrapping alone the sender would
/// reject every advertisement after the wrap (the advertisement's phase 0 is not "higher" than 2^32 - 1).
#[test]
fn a_stream_whose_phases_wrap_keeps_its_direct_transfers() {
    FIRST_PHASE.with(|p| p.set(u32::MAX - 7));
    let world = World::new(SimConfig::default());
    let (a, b) = (world.host(), world.host());
    let p = PairSpec::new(SockType::Stream)
        .connect(&a, &b, world.addr(1, 7000))
        .unwrap();
    FIRST_PHASE.with(|p| p.set(0));
    let src = MemoryRegion::from_vec(&p.a, vec![7u8; 65536]).unwrap();
    let dst = MemoryRegion::alloc(&p.b, 65536).unwrap();
    let wait = |eq: &crate::EventQueue| {
        let e = eq.next(Some(std::time::Duration::from_secs(60))).unwrap();
        assert!(e.is_ok() && e.bytes == 65536, "{e:?}");
    };
    let direct = || p.client.stats().unwrap().stream.direct_sent;
    for round in 0..6 {
        // Indirect: nothing advertised when the send goes.
        p.client
            .send(&p.eq_a, &src.all(), MsgFlags::NONE, 1)
            .unwrap();
        wait(&p.eq_a);
        p.server
            .recv(&p.eq_b, &dst.all(), MsgFlags::NONE, 2)
            .unwrap();
        wait(&p.eq_b);
        // Direct: the receive is advertised before the send.
        let before = direct();
        p.server
            .recv(&p.eq_b, &dst.all(), MsgFlags::NONE, 3)
            .unwrap();
        world.run_until_idle(100_000);
        p.client
            .send(&p.eq_a, &src.all(), MsgFlags::NONE, 4)
            .unwrap();
        wait(&p.eq_a);
        wait(&p.eq_b);
        assert_eq!(
            direct(),
            before + 1,
            "round {round}: the send did not go direct"
        );
    }
}

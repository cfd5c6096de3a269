//! Remote keys live exactly as long as the operation that needs them (least exposure), and registered memory
//! outlives every work request and key that names it.
#![cfg(feature = "sim")] // the simulated fabric: `cargo test -p exs --features sim`

mod common;

use common::*;
use exs::{MemoryRegion, MsgFlags, SockType};

#[test]
fn a_send_is_exposed_until_acknowledged_then_its_key_is_revoked() {
    let p = pair(SockType::SeqPacket);
    let src = p.client_region(pattern(10_000, 1));
    p.client
        .send(&p.eq_a, &src.all(), MsgFlags::NONE, 1)
        .unwrap();
    p.world.run_until_idle(1000);
    assert_eq!(
        p.world.live_keys(),
        1,
        "the advert's key is live while the send waits for a receive"
    );
    assert_eq!(src.leases(), 1);
    let dst = p.server_region(10_000);
    p.server
        .recv(&p.eq_b, &dst.all(), MsgFlags::NONE, 2)
        .unwrap();
    assert!(wait(&p.eq_a).is_ok());
    assert_eq!(p.world.live_keys(), 0, "acknowledged: the key is gone");
    assert_eq!(src.leases(), 0);
}

#[test]
fn immediate_sends_expose_nothing() {
    let p = pair(SockType::SeqPacket);
    let src = p.client_region(pattern(100, 1));
    p.client
        .send(&p.eq_a, &src.all(), MsgFlags::NONE, 1)
        .unwrap();
    p.world.run_until_idle(1000);
    assert_eq!(p.world.live_keys(), 0);
}

#[test]
fn message_mode_receives_are_never_exposed_for_remote_write() {
    let p = pair(SockType::SeqPacket);
    let dst = p.server_region(10_000);
    p.server
        .recv(&p.eq_b, &dst.all(), MsgFlags::NONE, 1)
        .unwrap();
    p.world.run_until_idle(1000);
    assert_eq!(
        p.world.live_keys(),
        0,
        "the receiver pulls: its buffers need no remote key"
    );
}

/// Dropping every handle of a region with a pending operation does not free memory under the device: the
/// operation completes and the bytes land where they should.
#[test]
fn dropping_a_region_with_a_pending_receive_keeps_the_memory_alive() {
    let p = pair(SockType::SeqPacket);
    let dst = p.server_region(5000);
    p.server
        .recv(&p.eq_b, &dst.slice(0..5000), MsgFlags::NONE, 1)
        .unwrap();
    let probe = dst.clone();
    drop(dst);
    let src = p.client_region(pattern(5000, 3));
    p.client
        .send(&p.eq_a, &src.all(), MsgFlags::NONE, 2)
        .unwrap();
    let r = wait(&p.eq_b);
    assert_eq!(r.bytes, 5000);
    assert_bytes_eq(&probe.to_vec().unwrap(), &pattern(5000, 3), "landed");
}

#[test]
fn dropping_a_sent_region_keeps_it_readable_by_the_peer() {
    let p = pair(SockType::SeqPacket);
    let src = p.client_region(pattern(70_000, 4));
    p.client
        .send(&p.eq_a, &src.all(), MsgFlags::NONE, 1)
        .unwrap();
    drop(src);
    let dst = p.server_region(70_000);
    p.server
        .recv(&p.eq_b, &dst.all(), MsgFlags::NONE, 2)
        .unwrap();
    assert!(wait(&p.eq_b).is_ok());
    assert!(wait(&p.eq_a).is_ok());
    assert_bytes_eq(
        &dst.to_vec().unwrap(),
        &pattern(70_000, 4),
        "pulled after the sender dropped its handle",
    );
}

#[test]
fn the_same_buffer_can_be_sent_twice_at_once() {
    let p = pair(SockType::SeqPacket);
    let src = p.client_region(pattern(3000, 5));
    p.client
        .send(&p.eq_a, &src.all(), MsgFlags::NONE, 1)
        .unwrap();
    p.client
        .send(&p.eq_a, &src.all(), MsgFlags::NONE, 2)
        .unwrap();
    let dst = MemoryRegion::alloc(&p.b, 6000).unwrap();
    p.server
        .recv(&p.eq_b, &dst.slice(0..3000), MsgFlags::NONE, 1)
        .unwrap();
    p.server
        .recv(&p.eq_b, &dst.slice(3000..6000), MsgFlags::NONE, 2)
        .unwrap();
    assert_eq!(p.eq_b.wait_all(None).unwrap().len(), 2);
    let got = dst.to_vec().unwrap();
    assert_bytes_eq(&got[..3000], &got[3000..], "both copies");
}

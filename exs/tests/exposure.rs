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

/// The UNH-EXS policy for trusted peers (seed 002, section 4: a region is registered once and its key is what the
/// peer uses): contexts with `ExposurePolicy::TrustedPeers`, keepalive off (virtual time runs idle).
fn trusted_pair(ty: SockType) -> Pair {
    let mut opts = exs::ContextOptions::default();
    opts.exposure = exs::ExposurePolicy::TrustedPeers;
    opts.keepalive = None;
    pair_ctx_opts(
        ty,
        opts,
        exs::SocketOptions::default().with_small_packet_max_size(0),
    )
}

#[test]
fn trusted_peers_get_one_key_per_region_and_connection_for_every_send() {
    let p = trusted_pair(SockType::SeqPacket);
    let sent = pattern(100_000, 7);
    let src = p.client_region(sent.clone());
    let dst = p.server_region(100_000);
    for i in 0..10 {
        let r = i * 10_000..(i + 1) * 10_000;
        p.server
            .recv(&p.eq_b, &dst.slice(r.clone()), MsgFlags::NONE, i as u64)
            .unwrap();
        p.client
            .send(&p.eq_a, &src.slice(r), MsgFlags::NONE, i as u64)
            .unwrap();
        assert_eq!(wait(&p.eq_b).bytes, 10_000);
        assert!(wait(&p.eq_a).status.is_ok());
    }
    assert_bytes_eq(
        &dst.to_vec().unwrap(),
        &sent,
        "ten sends from one region, each at its own address",
    );
    let stats = p.a.stats();
    assert_eq!(
        stats.exposures, 1,
        "one key for the region on this connection: {stats:?}"
    );
    assert_eq!(stats.trusted_keys, 1);
    assert_eq!(
        p.world.live_keys(),
        1,
        "the key outlives the operations (UNH-EXS)"
    );
    // While the peer may read any byte, the application copies but does not borrow.
    assert!(src.with_slice(0..10, |_| ()).is_err());
    src.write(0, b"new").unwrap();
    // Deregistration revokes it: the key is not counted as a use.
    src.deregister().unwrap();
    assert_eq!(p.world.live_keys(), 0, "deregistered: the key is gone");
    assert_eq!(p.a.stats().trusted_keys, 0);
}

#[test]
fn a_trusted_region_with_an_operation_pending_is_not_deregistered() {
    let p = trusted_pair(SockType::SeqPacket);
    let src = p.client_region(pattern(10_000, 3));
    p.client
        .send(&p.eq_a, &src.all(), MsgFlags::NONE, 1)
        .unwrap();
    p.world.run_until_idle(1000);
    assert_eq!(
        src.deregister(),
        Err(exs::MemoryError::InUse { leases: 1 }),
        "the send in flight is a use; the trusted key is not"
    );
    let dst = p.server_region(10_000);
    p.server
        .recv(&p.eq_b, &dst.all(), MsgFlags::NONE, 2)
        .unwrap();
    assert_eq!(wait(&p.eq_b).bytes, 10_000);
    assert!(wait(&p.eq_a).status.is_ok());
    src.deregister().unwrap();
    assert_eq!(p.world.live_keys(), 0);
}

#[test]
fn a_trusted_key_is_revoked_when_its_connection_goes() {
    let p = trusted_pair(SockType::SeqPacket);
    let src = p.client_region(pattern(10_000, 4));
    let dst = p.server_region(10_000);
    p.server
        .recv(&p.eq_b, &dst.all(), MsgFlags::NONE, 1)
        .unwrap();
    p.client
        .send(&p.eq_a, &src.all(), MsgFlags::NONE, 2)
        .unwrap();
    assert_eq!(wait(&p.eq_b).bytes, 10_000);
    assert!(wait(&p.eq_a).status.is_ok());
    assert_eq!(p.world.live_keys(), 1);
    p.client.abort().unwrap();
    p.world.run_until_idle(10_000);
    assert_eq!(
        p.world.live_keys(),
        0,
        "the connection went: so did its key"
    );
    assert_eq!(p.a.stats().trusted_keys, 0);
    assert_eq!(src.leases(), 0);
    src.deregister().unwrap();
}

#[test]
fn trusted_stream_receives_share_one_write_key() {
    let p = trusted_pair(SockType::Stream);
    let sent = pattern(256 << 10, 9);
    let src = p.client_region(sent.clone());
    let dst = p.server_region(256 << 10);
    for i in 0..4 {
        let r = i * (64 << 10)..(i + 1) * (64 << 10);
        p.server
            .recv(&p.eq_b, &dst.slice(r.clone()), MsgFlags::WAITALL, i as u64)
            .unwrap();
        p.client
            .send(&p.eq_a, &src.slice(r), MsgFlags::NONE, i as u64)
            .unwrap();
        assert_eq!(wait(&p.eq_b).bytes, 64 << 10);
        assert!(wait(&p.eq_a).status.is_ok());
    }
    assert_bytes_eq(
        &dst.to_vec().unwrap(),
        &sent,
        "stream through one trusted key",
    );
    assert_eq!(p.b.stats().trusted_keys, 1, "{:?}", p.b.stats());
}

/// Review finding: under the trusted policy, dropping the last handle of a region revoked its whole-region key
/// at once, with a stream receive still posted on it and advertised to the peer: the peer's write into it met a
/// revoked key and the connection broke (as a stream's read half dropped while its receives are posted does).
/// The key now goes with the last operation that uses it. More receives than can be advertised at once: those
/// advertised after the drop use the key too (every posted receive is keyed before the drop, so no new
/// whole-region key is made for the dropped region).
#[test]
fn a_trusted_key_outlives_the_region_handle_while_a_receive_uses_it() {
    let p = trusted_pair(SockType::Stream);
    // More receives than the peer lets us advertise at once (16): the last ones are advertised after the drop.
    const N: usize = 24;
    const PIECE: usize = 4096;
    let dst = p.server_region(N * PIECE);
    for i in 0..N {
        p.server
            .recv(
                &p.eq_b,
                &dst.slice(i * PIECE..(i + 1) * PIECE),
                MsgFlags::WAITALL,
                i as u64,
            )
            .unwrap();
    }
    // The first receives are advertised with the region's key before its last handle goes.
    p.world.run_for(std::time::Duration::from_millis(50));
    assert_eq!(p.b.stats().trusted_keys, 1, "{:?}", p.b.stats());
    drop(dst);
    let src = p.client_region(pattern(N * PIECE, 5));
    p.client
        .send(&p.eq_a, &src.all(), MsgFlags::NONE, 2)
        .unwrap();
    for _ in 0..N {
        let r = wait(&p.eq_b);
        assert!(r.is_ok() && r.bytes == PIECE, "{r:?}");
    }
    assert!(wait(&p.eq_a).is_ok());
    let direct = p.client.stats().unwrap().stream.direct_sent;
    assert!(
        direct as usize > 16,
        "the receives after the drop went direct: {direct}"
    );
    // No key of the dropped region stays in the map; the connection goes on.
    assert_eq!(p.b.stats().trusted_keys, 0, "{:?}", p.b.stats());
    let again = p.server_region(PIECE);
    p.server
        .recv(&p.eq_b, &again.all(), MsgFlags::WAITALL, 99)
        .unwrap();
    p.client
        .send(&p.eq_a, &src.slice(..PIECE), MsgFlags::NONE, 4)
        .unwrap();
    assert_eq!(wait(&p.eq_b).bytes, PIECE);
    assert_bytes_eq(&again.to_vec().unwrap(), &pattern(PIECE, 5), "after");
}

/// Issue 27: a region used once under the trusted policy and then dropped without `deregister` kept its key, its
/// registration and its memory until the connection ended (200 dropped 1 MiB regions left 200 keys and 209 MB).
/// Dropping the last handle revokes the key, so the memory (held by the key's lease) goes too.
#[test]
fn dropped_trusted_regions_leave_no_key_and_no_memory() {
    let p = trusted_pair(SockType::SeqPacket);
    let dst = p.server_region(4096);
    for i in 0..200u64 {
        let src = p.client_region(pattern(1 << 20, i));
        p.server
            .recv(&p.eq_b, &dst.all(), MsgFlags::NONE, i)
            .unwrap();
        p.client
            .send(&p.eq_a, &src.slice(..4096), MsgFlags::NONE, i)
            .unwrap();
        assert_eq!(wait(&p.eq_b).bytes, 4096);
        assert!(wait(&p.eq_a).status.is_ok());
        drop(src);
    }
    // No key holds a lease of the regions any more: their memory went with their last handle.
    assert_eq!(p.a.stats().trusted_keys, 0, "dropped regions keep keys");
    assert_eq!(p.world.live_keys(), 0);
}

/// A trusted-policy send whose region is borrowed (`with_slice`) when its connection's key for the region must be
/// made: the key is refused, and the send says the buffer is busy (the caller's), not that the transport was handed
/// an invalid argument; nothing of it is left behind, and the same send goes once the borrow ends.
#[test]
fn a_trusted_key_refused_beside_a_borrow_says_the_buffer_is_busy() {
    let p = trusted_pair(SockType::SeqPacket);
    let src = p.client_region(pattern(10_000, 5));
    let refused = src
        .with_slice(0..10, |_| {
            p.client.send(&p.eq_a, &src.all(), MsgFlags::NONE, 1)
        })
        .unwrap();
    let e = refused.expect_err("the region's key cannot be made while its bytes are borrowed");
    assert!(
        matches!(e, exs::SendError::Buffer(exs::BufferError::Busy(_))),
        "{e:?}"
    );
    assert_eq!(e.blame(), exs::Blame::Local, "{e}");
    assert_eq!(
        std::io::Error::from(e).kind(),
        std::io::ErrorKind::ResourceBusy
    );
    assert_eq!(src.leases(), 0, "the refused send holds nothing");
    assert_eq!(p.world.live_keys(), 0);
    let dst = p.server_region(10_000);
    p.server
        .recv(&p.eq_b, &dst.all(), MsgFlags::NONE, 2)
        .unwrap();
    p.client
        .send(&p.eq_a, &src.all(), MsgFlags::NONE, 3)
        .unwrap();
    assert_eq!(wait(&p.eq_b).bytes, 10_000);
    assert!(wait(&p.eq_a).status.is_ok());
    assert_bytes_eq(
        &dst.to_vec().unwrap(),
        &pattern(10_000, 5),
        "sent after the borrow",
    );
}

/// The receive side of the same refusal: a trusted-policy stream receive advertises its buffer under the
/// connection's key for the whole region, which cannot be made while any of the region is borrowed, even bytes
/// beside the receive's (whose own lease the borrow allows). The receive says the buffer is busy, holds nothing,
/// and the same receive, posted once the borrow ends, gets the peer's bytes.
#[test]
fn a_trusted_stream_receive_refused_beside_a_borrow_says_the_buffer_is_busy() {
    let p = trusted_pair(SockType::Stream);
    let dst = p.server_region(10_100);
    let refused = dst
        .with_slice(0..100, |_| {
            p.server
                .recv(&p.eq_b, &dst.slice(100..10_100), MsgFlags::WAITALL, 1)
        })
        .unwrap();
    let e = refused.expect_err("the region's key cannot be made while its bytes are borrowed");
    assert!(
        matches!(e, exs::RecvError::Buffer(exs::BufferError::Busy(_))),
        "{e:?}"
    );
    assert_eq!(e.blame(), exs::Blame::Local, "{e}");
    assert_eq!(
        std::io::Error::from(e).kind(),
        std::io::ErrorKind::ResourceBusy
    );
    assert_eq!(dst.leases(), 0, "the refused receive holds nothing");
    assert_eq!(p.world.live_keys(), 0);
    p.server
        .recv(&p.eq_b, &dst.slice(100..10_100), MsgFlags::WAITALL, 2)
        .unwrap();
    let src = p.client_region(pattern(10_000, 6));
    p.client
        .send(&p.eq_a, &src.all(), MsgFlags::NONE, 3)
        .unwrap();
    let got = wait(&p.eq_b);
    assert_eq!((got.context, got.bytes), (2, 10_000), "{got:?}");
    assert!(wait(&p.eq_a).status.is_ok());
    assert_bytes_eq(
        &dst.to_vec().unwrap()[100..],
        &pattern(10_000, 6),
        "received after the borrow",
    );
}

/// A stream receive that what the stream buffer already holds completes at once is never advertised, so it is
/// given no key (least exposure, and no registration per read while the writer is ahead); one that must wait
/// for more bytes (MSG_WAITALL beyond what is held) is exposed as before.
#[test]
fn a_stream_receive_the_stream_buffer_fills_at_once_gets_no_key() {
    let p = pair(SockType::Stream);
    let sent = pattern(1000, 4);
    let src = p.client_region(sent.clone());
    let dst = p.server_region(4000);
    // The first receive waits for bytes: it is advertised, with a key.
    p.server
        .recv(&p.eq_b, &dst.slice(0..10), MsgFlags::NONE, 1)
        .unwrap();
    p.client
        .send(&p.eq_a, &src.all(), MsgFlags::NONE, 1)
        .unwrap();
    assert_eq!(wait(&p.eq_b).bytes, 10);
    assert!(wait(&p.eq_a).status.is_ok());
    p.world.run_until_idle(1000);
    let keys = p.b.stats().exposures;
    assert!(
        keys >= 1,
        "the waiting receive had a key: {:?}",
        p.b.stats()
    );
    // The rest is in the stream buffer: a receive of part of it completes at once, with no key.
    p.server
        .recv(&p.eq_b, &dst.slice(10..500), MsgFlags::NONE, 2)
        .unwrap();
    assert_eq!(wait(&p.eq_b).bytes, 490);
    assert_eq!(p.b.stats().exposures, keys, "{:?}", p.b.stats());
    // A MSG_WAITALL receive of more than the buffer holds waits for the writer, so it is exposed.
    p.server
        .recv(&p.eq_b, &dst.slice(500..1500), MsgFlags::WAITALL, 3)
        .unwrap();
    p.world.run_until_idle(1000);
    assert_eq!(p.b.stats().exposures, keys + 1, "{:?}", p.b.stats());
    p.client
        .send(&p.eq_a, &src.slice(0..500), MsgFlags::NONE, 2)
        .unwrap();
    assert_eq!(wait(&p.eq_b).bytes, 1000);
    let got = dst.to_vec().unwrap();
    assert_bytes_eq(&got[..1000], &sent, "the first send, through both receives");
    assert_bytes_eq(&got[1000..1500], &sent[..500], "the second send");
}

/// A device that can make no key when a stream receive's turn to be advertised comes (out of registrations or
/// memory windows): that receive completes with the transport's error, as its post failed when receives were keyed
/// as they were posted; the connection stays up, no byte is lost, and the next receive is advertised once keys can
/// be made again.
#[test]
fn a_stream_receive_the_device_makes_no_key_for_fails_with_its_error_and_the_stream_goes_on() {
    let p = pair(SockType::Stream);
    let sent = pattern(2000, 6);
    let src = p.client_region(sent.clone());
    let dst = p.server_region(2000);
    p.server
        .recv(&p.eq_b, &dst.slice(0..1000), MsgFlags::WAITALL, 1)
        .unwrap();
    p.client
        .send(&p.eq_a, &src.slice(0..1000), MsgFlags::NONE, 1)
        .unwrap();
    assert_eq!(wait(&p.eq_b).bytes, 1000);
    assert!(wait(&p.eq_a).status.is_ok());
    // No key now: the next receive fails when its turn to be advertised comes.
    p.world.refuse_keys(1, true);
    let keys = p.b.stats().exposures;
    p.server
        .recv(&p.eq_b, &dst.slice(1000..2000), MsgFlags::WAITALL, 2)
        .unwrap();
    let ev = wait(&p.eq_b);
    assert_eq!((ev.context, ev.bytes), (2, 0), "{ev:?}");
    let err = ev.status.expect_err("no key, no receive");
    assert_eq!(err.io_kind(), std::io::ErrorKind::OutOfMemory, "{err}");
    assert_eq!(p.b.stats().keys_refused, 1, "{:?}", p.b.stats());
    assert_eq!(p.b.stats().exposures, keys, "no key was made");
    assert_eq!(dst.leases(), 0, "the failed receive holds no lease");
    // Keys again: the same receive posted again is advertised and the bytes go straight into it.
    p.world.refuse_keys(1, false);
    let direct = p.client.stats().unwrap().stream.direct_bytes;
    p.server
        .recv(&p.eq_b, &dst.slice(1000..2000), MsgFlags::WAITALL, 3)
        .unwrap();
    p.world.run_until_idle(1000);
    p.client
        .send(&p.eq_a, &src.slice(1000..2000), MsgFlags::NONE, 2)
        .unwrap();
    let ev = wait(&p.eq_b);
    assert_eq!((ev.context, ev.bytes), (3, 1000), "{ev:?}");
    assert!(wait(&p.eq_a).status.is_ok());
    assert_eq!(p.b.stats().exposures, keys + 1, "{:?}", p.b.stats());
    assert_eq!(p.client.stats().unwrap().stream.direct_bytes, direct + 1000);
    assert_bytes_eq(&dst.to_vec().unwrap(), &sent, "every byte, in order");
    assert_eq!(p.b.stats().violations, 0);
}

/// The region handed back while something still holds its buffer, under the trusted policy (its whole-region key
/// counted apart): it was deregistered, and then refused, and the next send on it failed. It stays registered
/// now, and is handed back once nothing holds it.
#[test]
fn a_trusted_region_refused_back_because_its_buffer_is_held_stays_registered() {
    let p = trusted_pair(SockType::SeqPacket);
    let theirs = exs_dma::DmaBuf::from_vec(pattern(10_000, 4));
    let held = std::sync::Arc::clone(&theirs);
    let src = MemoryRegion::from_dma_buf(&p.a, theirs).unwrap();
    let dst = p.server_region(10_000);
    let send = |ctx: u64| {
        p.client
            .send(&p.eq_a, &src.all(), MsgFlags::NONE, ctx)
            .unwrap();
        p.server
            .recv(&p.eq_b, &dst.all(), MsgFlags::NONE, ctx)
            .unwrap();
        assert_eq!(wait(&p.eq_b).bytes, 10_000);
        assert!(wait(&p.eq_a).status.is_ok());
    };
    // A send leaves the region's trusted key on the connection.
    send(1);
    let (src, e) = src.into_dma_buf().unwrap_err();
    assert_eq!(e, exs::MemoryError::InUse { leases: 0 });
    let send = |ctx: u64| {
        p.client
            .send(&p.eq_a, &src.all(), MsgFlags::NONE, ctx)
            .expect("still registered after the refusal");
        p.server
            .recv(&p.eq_b, &dst.all(), MsgFlags::NONE, ctx)
            .unwrap();
        assert_eq!(wait(&p.eq_b).bytes, 10_000);
        assert!(wait(&p.eq_a).status.is_ok());
    };
    send(2);
    drop(held);
    src.into_dma_buf().unwrap();
}

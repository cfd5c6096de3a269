//! Persistent sends and receives, and offsets (seed 002, sections 4.2-4.4), on the simulated fabric.
#![cfg(feature = "sim")] // the simulated fabric: `cargo test -p exs --features sim`

mod common;

use common::*;
use exs::sim::{SimConfig, World};
use exs::{
    EventKind, EventQueue, MemoryRegion, MsgFlags, OpError, RecvError, SendError, SockType,
    StateError, Violation,
};

/// A pair whose client sent `len` bytes of pattern `seed` with `flags` (a persistent send, context 1 unless
/// `ctx` says otherwise), and a region of the same size on the server to receive it: (pair, sent, receive).
fn persistent_send(
    flags: MsgFlags,
    len: usize,
    seed: u64,
    ctx: u64,
) -> (Pair, MemoryRegion, MemoryRegion) {
    let p = pair(SockType::SeqPacket);
    let src = p.client_region(pattern(len, seed));
    p.client.send(&p.eq_a, &src.all(), flags, ctx).unwrap();
    let dst = p.server_region(len);
    (p, src, dst)
}

/// Seed 002, 4.2: "the other side of the EXS socket can repeatedly receive this same memory block ... without
/// subsequent corresponding exs_sends", and "the sender incurs no CPU overhead whatsoever": after the one send,
/// the sender's engine handles no completion while the receiver pulls, and sees every update of the memory.
#[test]
fn a_persistent_send_is_read_by_every_receive_with_nothing_on_the_sender() {
    let p = pair(SockType::SeqPacket);
    let src = p.client_region(pattern(4096, 1));
    p.client
        .send(&p.eq_a, &src.all(), MsgFlags::PERSISTENT, 1)
        .unwrap();
    let dst = p.server_region(4096);
    // The first receive brings the advert in.
    p.server
        .recv(&p.eq_b, &dst.all(), MsgFlags::NONE, 2)
        .unwrap();
    let r = wait(&p.eq_b);
    assert!(r.is_ok() && r.bytes == 4096, "{r:?}");
    assert_bytes_eq(&dst.to_vec().unwrap(), &pattern(4096, 1), "first read");
    let before = p.a.stats();
    for round in 2..12u64 {
        // The sender updates its memory while the send stays persistent.
        src.write(0, &pattern(4096, round)).unwrap();
        p.server
            .recv(&p.eq_b, &dst.all(), MsgFlags::NONE, round)
            .unwrap();
        let r = wait(&p.eq_b);
        assert!(r.is_ok() && r.bytes == 4096, "{r:?}");
        assert_bytes_eq(
            &dst.to_vec().unwrap(),
            &pattern(4096, round),
            "read of the updated memory",
        );
    }
    let after = p.a.stats();
    assert_eq!(
        after.completions, before.completions,
        "the sender's side handled something per read"
    );
    assert_eq!(
        after.posted, before.posted,
        "the sender posted something per read"
    );
    assert_eq!(
        p.eq_a.len(),
        0,
        "the persistent send does not complete per read"
    );
    assert_eq!(p.server.stats().unwrap().message.persistent_reads, 11);
}

/// The variant for the double-buffered transaction exchange: an event each time the peer has read it.
#[test]
fn a_notifying_persistent_send_reports_each_read() {
    let (p, _src, dst) = persistent_send(MsgFlags::PERSISTENT | MsgFlags::NOTIFY, 1000, 3, 7);
    for i in 0..5 {
        p.server
            .recv(&p.eq_b, &dst.all(), MsgFlags::NONE, i)
            .unwrap();
        assert!(wait(&p.eq_b).is_ok());
        let n = wait(&p.eq_a);
        assert_eq!(
            (n.kind, n.context, n.bytes),
            (EventKind::ReadNotify, 7, 1),
            "{n:?}"
        );
    }
}

/// Ending a persistent send: receives after it wait for the next message; the send completes once the peer let
/// go, and only then is its key revoked.
#[test]
fn ending_a_persistent_send_completes_it_and_the_next_send_is_received() {
    let (p, _src, dst) = persistent_send(MsgFlags::PERSISTENT, 3000, 4, 1);
    p.server
        .recv(&p.eq_b, &dst.all(), MsgFlags::NONE, 1)
        .unwrap();
    assert!(wait(&p.eq_b).is_ok());
    let keys = p.world.live_keys();
    p.client.end_persistent().unwrap();
    let e = wait(&p.eq_a);
    assert_eq!(
        (e.kind, e.status.clone(), e.bytes),
        (EventKind::Send, Ok(()), 3000),
        "{e:?}"
    );
    assert!(
        p.world.live_keys() < keys,
        "the key outlived the persistent send"
    );
    assert_eq!(
        p.client.end_persistent(),
        Err(StateError::Persistent(
            "no persistent send or receive to end on this socket"
        ))
    );
    // A normal message now goes through as usual.
    let (s, r, got) = p.transfer(&pattern(500, 9), 3000);
    assert!(s.is_ok() && r.is_ok());
    assert_bytes_eq(
        &got,
        &pattern(500, 9),
        "the message after the persistent send",
    );
}

/// Seed 002, 4.3: "the same exs_rcv will be used to satisfy all subsequent exs_sends", with no completion on
/// the receiver; the sends complete when written.
#[test]
fn a_persistent_receive_takes_every_later_send_in_place() {
    let p = pair(SockType::SeqPacket);
    let dst = p.server_region(8192);
    p.server
        .recv(&p.eq_b, &dst.all(), MsgFlags::PERSISTENT, 1)
        .unwrap();
    p.world.run_until_idle(10_000);
    for round in 0..5u64 {
        let data = pattern(8192, 100 + round);
        let src = p.client_region(data.clone());
        p.client
            .send(&p.eq_a, &src.all(), MsgFlags::NONE, round)
            .unwrap();
        let e = wait(&p.eq_a);
        assert!(e.is_ok() && e.bytes == 8192, "{e:?}");
        assert_bytes_eq(
            &dst.to_vec().unwrap(),
            &data,
            "the persistent receive after a send",
        );
    }
    assert_eq!(p.eq_b.len(), 0, "the receiver gets no completion per send");
    assert_eq!(p.client.stats().unwrap().message.persistent_writes, 5);
    // Too big for the persistent receive: refused at once, nothing written.
    let big = p.client_region(vec![0; 9000]);
    let e = p
        .client
        .send(&p.eq_a, &big.all(), MsgFlags::NONE, 9)
        .unwrap_err();
    assert_eq!(
        e,
        SendError::State(StateError::OffsetOutOfRange {
            offset: 0,
            len: 9000,
            size: 8192
        })
    );
    // Ending it: the receive completes once the peer confirmed it writes no more.
    p.server.end_persistent().unwrap();
    let r = wait(&p.eq_b);
    assert_eq!(
        (r.kind, r.status.clone(), r.bytes),
        (EventKind::Recv, Ok(()), 8192),
        "{r:?}"
    );
}

/// Seed 002, 4.4: `exs_send_offset` writes a subpart of the peer's persistent receive; `exs_recv_offset` reads a
/// subpart of the peer's persistent send. Out of range is an error, never a wild write.
#[test]
fn offsets_move_subparts_of_persistent_memory() {
    // send_offset into a persistent receive.
    let p = pair(SockType::SeqPacket);
    let dst = p.server_region(4096);
    dst.write(0, &[0xAA; 4096]).unwrap();
    p.server
        .recv(&p.eq_b, &dst.all(), MsgFlags::PERSISTENT, 1)
        .unwrap();
    p.world.run_until_idle(10_000);
    let src = p.client_region(pattern(100, 5));
    p.client
        .send_offset(&p.eq_a, &src.all(), 1000, MsgFlags::NONE, 2)
        .unwrap();
    assert!(wait(&p.eq_a).is_ok());
    let got = dst.to_vec().unwrap();
    assert_bytes_eq(&got[1000..1100], &pattern(100, 5), "the written subpart");
    assert!(
        got[..1000].iter().chain(&got[1100..]).all(|&b| b == 0xAA),
        "bytes outside the subpart changed"
    );
    let e = p
        .client
        .send_offset(&p.eq_a, &src.all(), 4000, MsgFlags::NONE, 3)
        .unwrap_err();
    assert_eq!(
        e,
        SendError::State(StateError::OffsetOutOfRange {
            offset: 4000,
            len: 100,
            size: 4096
        })
    );
    let e = p
        .client
        .send_offset(&p.eq_a, &src.all(), u64::MAX - 10, MsgFlags::NONE, 3)
        .unwrap_err();
    assert!(
        matches!(e, SendError::State(StateError::OffsetOutOfRange { .. })),
        "{e:?}"
    );

    // recv_offset from a persistent send.
    let p = pair(SockType::SeqPacket);
    let src = p.client_region(pattern(4096, 6));
    p.client
        .send(&p.eq_a, &src.all(), MsgFlags::PERSISTENT, 1)
        .unwrap();
    let whole = p.server_region(4096);
    p.server
        .recv(&p.eq_b, &whole.all(), MsgFlags::NONE, 1)
        .unwrap();
    assert!(wait(&p.eq_b).is_ok());
    let part = p.server_region(256);
    p.server
        .recv_offset(&p.eq_b, &part.all(), 3000, MsgFlags::NONE, 2)
        .unwrap();
    let r = wait(&p.eq_b);
    assert!(r.is_ok() && r.bytes == 256, "{r:?}");
    assert_bytes_eq(
        &part.to_vec().unwrap(),
        &pattern(4096, 6)[3000..3256],
        "the read subpart",
    );
    let e = p
        .server
        .recv_offset(&p.eq_b, &part.all(), 3900, MsgFlags::NONE, 3)
        .unwrap_err();
    assert_eq!(
        e,
        RecvError::State(StateError::OffsetOutOfRange {
            offset: 3900,
            len: 256,
            size: 4096
        })
    );
}

/// Seed 002, 4.3: "both sides of an EXS socket connection cannot be persistent".
/// Review finding: a send into the peer's persistent receive is one RDMA write, whatever its length; one longer
/// than the transport's largest message failed in the device and ended the connection. It is refused, saying to
/// send it in parts at offsets, and the parts arrive.
#[test]
fn a_write_into_persistent_memory_beyond_the_largest_message_is_refused_and_parts_at_offsets_arrive(
) {
    let mut cfg = SimConfig::default();
    cfg.caps.max_message = 4096;
    let p = pair_with(SockType::SeqPacket, cfg, exs::SocketOptions::default());
    let dst = p.server_region(8192);
    p.server
        .recv(&p.eq_b, &dst.all(), MsgFlags::PERSISTENT, 1)
        .unwrap();
    p.world.run_until_idle(10_000);
    let data = pattern(8192, 7);
    let src = p.client_region(data.clone());
    let e = p
        .client
        .send(&p.eq_a, &src.all(), MsgFlags::NONE, 2)
        .unwrap_err();
    assert!(
        matches!(e, SendError::State(StateError::Persistent(why)) if why.contains("send_offset")),
        "{e:?}"
    );
    for (i, off) in [0usize, 4096].into_iter().enumerate() {
        p.client
            .send_offset(
                &p.eq_a,
                &src.slice(off..off + 4096),
                off as u64,
                MsgFlags::NONE,
                i as u64,
            )
            .unwrap();
        assert!(wait(&p.eq_a).is_ok());
    }
    assert_bytes_eq(
        &dst.to_vec().unwrap(),
        &data,
        "the parts written at their offsets",
    );
}

#[test]
fn only_one_side_of_a_connection_can_be_persistent() {
    let p = pair(SockType::SeqPacket);
    let src = p.client_region(pattern(100, 1));
    p.client
        .send(&p.eq_a, &src.all(), MsgFlags::PERSISTENT, 1)
        .unwrap();
    let dst = p.server_region(100);
    p.server
        .recv(&p.eq_b, &dst.all(), MsgFlags::NONE, 1)
        .unwrap();
    assert!(wait(&p.eq_b).is_ok());
    // The server now knows the client is persistent: it may not be persistent too.
    let mine = p.server_region(100);
    let e = p
        .server
        .recv(&p.eq_b, &mine.all(), MsgFlags::PERSISTENT, 2)
        .unwrap_err();
    assert!(
        matches!(e, RecvError::State(StateError::Persistent(_))),
        "{e:?}"
    );
    let e = p
        .server
        .send(&p.eq_b, &mine.all(), MsgFlags::PERSISTENT, 3)
        .unwrap_err();
    assert!(
        matches!(e, SendError::State(StateError::Persistent(_))),
        "{e:?}"
    );
    assert_eq!(
        std::io::Error::from(e).kind(),
        std::io::ErrorKind::InvalidInput
    );
    // NOTIFY without PERSISTENT is meaningless.
    let e = p
        .client
        .send(&p.eq_a, &src.all(), MsgFlags::NOTIFY, 4)
        .unwrap_err();
    assert!(
        matches!(e, SendError::State(StateError::Persistent(_))),
        "{e:?}"
    );
}

/// Seed 002, 4.3-4.4: offsets and persistence exist on message sockets only.
#[test]
fn persistence_and_offsets_exist_on_message_sockets_only() {
    let s = pair(SockType::Stream);
    let b = s.client_region(vec![1; 10]);
    let e = s
        .client
        .send(&s.eq_a, &b.all(), MsgFlags::PERSISTENT, 1)
        .unwrap_err();
    assert!(
        matches!(e, SendError::State(StateError::Persistent(_))),
        "{e:?}"
    );
    let e = s
        .client
        .send_offset(&s.eq_a, &b.all(), 0, MsgFlags::NONE, 1)
        .unwrap_err();
    assert!(
        matches!(e, SendError::State(StateError::Persistent(_))),
        "{e:?}"
    );
}

/// Seed 002, 4.4: without a persistent peer, offsets have nothing to address.
#[test]
fn offsets_need_a_persistent_peer() {
    let q = pair(SockType::SeqPacket);
    let b = q.client_region(vec![1; 10]);
    let e = q
        .client
        .send_offset(&q.eq_a, &b.all(), 0, MsgFlags::NONE, 1)
        .unwrap_err();
    assert!(
        matches!(e, SendError::State(StateError::Persistent(_))),
        "{e:?}"
    );
    let e = q
        .client
        .recv_offset(&q.eq_a, &b.all(), 0, MsgFlags::NONE, 1)
        .unwrap_err();
    assert!(
        matches!(e, RecvError::State(StateError::Persistent(_))),
        "{e:?}"
    );
}

/// Closing ends everything persistent: a graceful close ends the persistent send as `end_persistent` does (it
/// completes `Ok`: the peer had it), keys are revoked, the peer's waiting receives see end-of-stream.
#[test]
fn close_ends_persistent_operations_and_revokes_their_keys() {
    let p = pair(SockType::SeqPacket);
    let src = p.client_region(pattern(2048, 1));
    p.client
        .send(&p.eq_a, &src.all(), MsgFlags::PERSISTENT, 1)
        .unwrap();
    let dst = p.server_region(2048);
    p.server
        .recv(&p.eq_b, &dst.all(), MsgFlags::NONE, 1)
        .unwrap();
    assert!(wait(&p.eq_b).is_ok());
    p.client.close().unwrap();
    let e = wait(&p.eq_a);
    assert_eq!((e.status, e.bytes), (Ok(()), 2048));
    p.server
        .recv(&p.eq_b, &dst.all(), MsgFlags::NONE, 2)
        .unwrap();
    let r = wait(&p.eq_b);
    assert!(r.flags.eof || r.status.is_err(), "{r:?}");
    p.world.run_until_idle(100_000);
    assert_eq!(p.world.live_keys(), 0, "keys outlived the connection");
    assert!(src.deregister().is_ok());
}

/// A crafted peer that claims persistence while we are persistent breaks seed 002 4.3: a violation.
#[test]
fn a_peer_persistent_while_we_are_is_a_violation() {
    use exs::testing::{handshake, RawPeer};
    use exs::wire::{Advert, AdvertFlags, Body, Message, WireSockType};
    let world = World::threaded(SimConfig::default());
    let ctx = world.host();
    let eq = EventQueue::new(16).unwrap();
    let l = exs::Socket::new(&ctx, SockType::SeqPacket).unwrap();
    l.bind(world.addr(0, 7000)).unwrap();
    let addr = l.listen(4).unwrap();
    l.accept(&eq, 1).unwrap();
    let mut raw = RawPeer::connect(
        Box::new(world.raw_host()),
        addr,
        &handshake(WireSockType::SeqPacket).encode(),
    )
    .unwrap();
    let mut ev = eq.next(Some(std::time::Duration::from_secs(10))).unwrap();
    let s = ev.take_accepted().unwrap();
    let buf = MemoryRegion::alloc(&ctx, 4096).unwrap();
    s.send(&eq, &buf.all(), MsgFlags::PERSISTENT, 2).unwrap();
    let m = Message::new(Body::Advert(Advert {
        seq: 0,
        flags: AdvertFlags(AdvertFlags::PERSISTENT_RECV),
        len: 4096,
        addr: 0x1000,
        rkey: 9,
    }));
    raw.send_bytes(&m.to_vec(), None).unwrap();
    let e = eq.next(Some(std::time::Duration::from_secs(10))).unwrap();
    assert!(
        matches!(
            e.status,
            Err(OpError::PeerMisbehaved(Violation::Persistent(_)))
        ),
        "{e:?}"
    );
}

/// A pair whose client sent a 64 KiB message (context 1), then a persistent send of 3000 bytes (context 2), both
/// adverts delivered and nothing received yet; the message's bytes and a receive buffer on the server for it.
fn message_then_persistent_send(seed: u64) -> (Pair, Vec<u8>, MemoryRegion) {
    let p = pair(SockType::SeqPacket);
    let want = pattern(65536, seed);
    let msg = p.client_region(want.clone());
    let ps = p.client_region(pattern(3000, seed + 1));
    p.client
        .send(&p.eq_a, &msg.all(), MsgFlags::NONE, 1)
        .unwrap();
    p.client
        .send(&p.eq_a, &ps.all(), MsgFlags::PERSISTENT, 2)
        .unwrap();
    p.world.run_until_idle(100_000);
    let dst = p.server_region(65536);
    (p, want, dst)
}

/// The server's receive got the message, and both of the client's sends completed (the persistent one unread),
/// then a new message goes through.
fn message_received_and_both_sends_done(p: &Pair, want: &[u8], dst: &MemoryRegion) {
    let r = wait(&p.eq_b);
    assert!(r.is_ok() && r.bytes == 65536, "{r:?}");
    assert_bytes_eq(&dst.to_vec().unwrap(), want, "the message");
    let mut sent = [wait(&p.eq_a), wait(&p.eq_a)];
    sent.sort_by_key(|e| e.context);
    for (e, (ctx, bytes)) in sent.iter().zip([(1, 65536), (2, 3000)]) {
        assert_eq!(
            (e.kind, e.context, e.status.clone(), e.bytes),
            (EventKind::Send, ctx, Ok(()), bytes),
            "{e:?}"
        );
    }
    let (s, r, got) = p.transfer(&pattern(500, 9), 3000);
    assert!(s.is_ok() && r.is_ok(), "{s:?} {r:?}");
    assert_bytes_eq(
        &got,
        &pattern(500, 9),
        "the message after the persistent send",
    );
}

/// Both sends of a client that sent a message, then a persistent send, and ended the persistent send before the
/// server received anything, complete: the server reads the message, lets the persistent send go unread, and the
/// connection carries on. (The server took the end of a persistent send that was not yet at the head of its
/// adverts for a violation and closed the connection.)
#[test]
fn ending_a_persistent_send_behind_an_unread_message_lets_it_go_unread() {
    let (p, want, dst) = message_then_persistent_send(1);
    p.client.end_persistent().unwrap();
    p.world.run_until_idle(100_000);
    p.server
        .recv(&p.eq_b, &dst.all(), MsgFlags::NONE, 10)
        .unwrap();
    message_received_and_both_sends_done(&p, &want, &dst);
}

/// A second persistent send while the first is active, or ended but not yet confirmed by the peer, is refused
/// locally and says why; once the first completed, a new one starts and the peer reads it. (The second went out,
/// and the peer took it for a violation and closed the connection.)
#[test]
fn a_second_persistent_send_waits_for_the_first_to_complete() {
    let p = pair(SockType::SeqPacket);
    let first = p.client_region(pattern(2000, 1));
    let second = p.client_region(pattern(2000, 2));
    p.client
        .send(&p.eq_a, &first.all(), MsgFlags::PERSISTENT, 1)
        .unwrap();
    let refused = |p: &Pair| {
        let e = p
            .client
            .send(&p.eq_a, &second.all(), MsgFlags::PERSISTENT, 2)
            .unwrap_err();
        assert!(
            matches!(e, SendError::State(StateError::Persistent(_))),
            "{e:?}"
        );
    };
    refused(&p);
    p.world.run_until_idle(100_000);
    p.client.end_persistent().unwrap();
    refused(&p);
    let e = wait(&p.eq_a);
    assert_eq!((e.context, e.status.clone()), (1, Ok(())), "{e:?}");
    p.client
        .send(&p.eq_a, &second.all(), MsgFlags::PERSISTENT, 2)
        .unwrap();
    let dst = p.server_region(2000);
    p.server
        .recv(&p.eq_b, &dst.all(), MsgFlags::NONE, 10)
        .unwrap();
    let r = wait(&p.eq_b);
    assert!(r.is_ok() && r.bytes == 2000, "{r:?}");
    assert_bytes_eq(
        &dst.to_vec().unwrap(),
        &pattern(2000, 2),
        "the second persistent send",
    );
}

/// A persistent send ended while the peer reads the message before it: the read delivers the message, and both
/// sends complete, the message's no sooner than the receiver has it.
#[test]
fn a_persistent_send_ended_while_the_message_before_it_is_read_completes_both() {
    let (p, want, dst) = message_then_persistent_send(3);
    // The read of the message starts, and the end of the persistent send is on its way, at the same time.
    p.server
        .recv(&p.eq_b, &dst.all(), MsgFlags::NONE, 10)
        .unwrap();
    p.client.end_persistent().unwrap();
    while p.eq_a.is_empty() && p.world.drive() {}
    assert_eq!(
        p.eq_b.len(),
        1,
        "the sender got a completion before the receiver had read the message"
    );
    message_received_and_both_sends_done(&p, &want, &dst);
}

/// The connection carries on: a message goes through.
fn carries_on(p: &Pair) {
    let (s, r, got) = p.transfer(&pattern(500, 9), 3000);
    assert!(s.is_ok() && r.is_ok(), "{s:?} {r:?}");
    assert_bytes_eq(&got, &pattern(500, 9), "a message after it");
}

/// Events of `eq` until one of `kind` (at most 16).
fn until_kind(eq: &EventQueue, kind: EventKind) -> Vec<exs::Event> {
    let mut seen = Vec::new();
    for _ in 0..16 {
        let e = wait(eq);
        let last = e.kind == kind;
        seen.push(e);
        if last {
            return seen;
        }
    }
    panic!("no {kind:?} event among {seen:?}");
}

/// A notifying persistent send ended while the peer's read of it was in flight: the peer's read notification
/// carried the acknowledgment of the ended send, which was taken first and retired it, and the notification then
/// named an unknown advert, a violation that closed the connection. Now the notification comes first, and the
/// send completes.
#[test]
fn a_read_notification_crossing_the_end_of_its_send_keeps_the_connection() {
    let (p, _src, dst) = persistent_send(MsgFlags::PERSISTENT | MsgFlags::NOTIFY, 1000, 3, 7);
    p.world.run_until_idle(100_000);
    // The read starts at once; the end crosses it.
    p.server
        .recv(&p.eq_b, &dst.all(), MsgFlags::NONE, 1)
        .unwrap();
    p.client.end_persistent().unwrap();
    let r = wait(&p.eq_b);
    assert!(r.is_ok() && r.bytes == 1000, "{r:?}");
    let seen = until_kind(&p.eq_a, EventKind::Send);
    assert!(seen.iter().all(|e| e.is_ok()), "{seen:?}");
    carries_on(&p);
}

/// A persistent receive ended while its advert still waited at the peer behind an unread message: the peer
/// looked for it only among persistent sends and in the persistent receive it had taken, found nothing, and
/// closed the connection for a violation (the message was lost). Now the peer lets it go when it reaches the
/// head, confirming the end, and the message is read.
#[test]
fn ending_a_persistent_receive_behind_an_unread_message_lets_it_go() {
    let p = pair(SockType::SeqPacket);
    let want = pattern(2000, 4);
    let msg = p.client_region(want.clone());
    p.client
        .send(&p.eq_a, &msg.all(), MsgFlags::NONE, 1)
        .unwrap();
    let mine = p.client_region(vec![0; 4096]);
    p.client
        .recv(&p.eq_a, &mine.all(), MsgFlags::PERSISTENT, 2)
        .unwrap();
    p.world.run_until_idle(100_000);
    p.client.end_persistent().unwrap();
    p.world.run_until_idle(100_000);
    let dst = p.server_region(2000);
    p.server
        .recv(&p.eq_b, &dst.all(), MsgFlags::NONE, 10)
        .unwrap();
    let r = wait(&p.eq_b);
    assert!(r.is_ok() && r.bytes == 2000, "{r:?}");
    assert_bytes_eq(&dst.to_vec().unwrap(), &want, "the message");
    let mut done = [wait(&p.eq_a), wait(&p.eq_a)];
    done.sort_by_key(|e| e.context);
    assert_eq!(
        (done[0].kind, done[0].status.clone()),
        (EventKind::Send, Ok(()))
    );
    assert_eq!(
        (done[1].kind, done[1].status.clone()),
        (EventKind::Recv, Ok(())),
        "the persistent receive ends when the peer confirms"
    );
    carries_on(&p);
}

/// The server closes gracefully with a send the client has not received yet, while the client ends its
/// persistent send: the close had let go of the client's adverts, the end then named an unknown advert, and the
/// violation turned the graceful close abortive (the server's send failed). Now the end is let go, and the send
/// is delivered.
#[test]
fn a_persistent_end_crossing_a_graceful_close_keeps_it_graceful() {
    let p = pair(SockType::SeqPacket);
    let ps = p.client_region(pattern(3000, 5));
    p.client
        .send(&p.eq_a, &ps.all(), MsgFlags::PERSISTENT, 1)
        .unwrap();
    let want = pattern(700, 6);
    let reply = p.server_region(700);
    reply.write(0, &want).unwrap();
    p.server
        .send(&p.eq_b, &reply.all(), MsgFlags::NONE, 2)
        .unwrap();
    p.world.run_until_idle(100_000);
    p.server.close().unwrap();
    p.client.end_persistent().unwrap();
    let dst = p.client_region(vec![0; 700]);
    p.client
        .recv(&p.eq_a, &dst.all(), MsgFlags::NONE, 3)
        .unwrap();
    let s = until_kind(&p.eq_b, EventKind::Send);
    assert_eq!(
        s.last().map(|e| e.status.clone()),
        Some(Ok(())),
        "the server's send: {s:?}"
    );
    let mut got = [wait(&p.eq_a), wait(&p.eq_a)];
    got.sort_by_key(|e| e.context);
    assert_eq!((got[1].context, got[1].status.clone()), (3, Ok(())));
    assert_bytes_eq(&dst.to_vec().unwrap(), &want, "the server's message");
    // The persistent send ends with the server's close, never with a violation.
    assert!(
        matches!(got[0].status, Ok(()) | Err(OpError::PeerClosed)),
        "{:?}",
        got[0]
    );
}

/// A persistent receive whose advert waited for a credit when its socket closed: its receive ended (cancelled),
/// but the advert still went out once a credit came back, and the peer got a key to write into memory nobody
/// would read. Now it never leaves.
#[test]
fn a_persistent_receive_closed_before_its_advert_left_is_never_advertised() {
    let p = pair(SockType::SeqPacket);
    let msg = p.client_region(pattern(100, 8));
    // Every advert credit taken by messages the server has not received.
    let mut sent = 0u64;
    while p.client.stats().unwrap().message.credit_waits == 0 {
        p.client
            .send(&p.eq_a, &msg.all(), MsgFlags::NONE, 100 + sent)
            .unwrap();
        sent += 1;
        assert!(sent <= 256, "no credit wait after {sent} sends");
    }
    p.world.run_until_idle(100_000);
    let mine = p.client_region(vec![0; 4096]);
    p.client
        .recv(&p.eq_a, &mine.all(), MsgFlags::PERSISTENT, 2)
        .unwrap();
    p.client.close().unwrap();
    // The server takes every message: the credits come back.
    let dst = p.server_region(100);
    let mut adverts = 0;
    for i in 0..sent {
        p.server
            .recv(&p.eq_b, &dst.all(), MsgFlags::NONE, i)
            .unwrap();
        assert!(wait(&p.eq_b).is_ok());
    }
    // Until the connection is gone (the client's close), what reached the server.
    while let Some(s) = p.server.stats() {
        adverts = s.message.adverts_received;
        if !p.world.drive() {
            break;
        }
    }
    assert_eq!(
        adverts, sent,
        "an advert besides the messages' reached the server after the close"
    );
}

/// `EventFlags::eor` (recvmsg's `MSG_EOR`): a receive of a whole message says so, a read of a range of the
/// peer's persistent send (`recv_offset`) does not.
#[test]
fn a_whole_message_says_eor_and_a_range_of_a_persistent_send_does_not() {
    let (p, _src, dst) = persistent_send(MsgFlags::PERSISTENT, 2000, 9, 1);
    p.server
        .recv(&p.eq_b, &dst.all(), MsgFlags::NONE, 2)
        .unwrap();
    let whole = wait(&p.eq_b);
    assert!(whole.is_ok() && whole.flags.eor, "{whole:?}");
    p.server
        .recv_offset(&p.eq_b, &dst.slice(..100), 500, MsgFlags::NONE, 3)
        .unwrap();
    let part = wait(&p.eq_b);
    assert!(
        part.is_ok() && part.bytes == 100 && !part.flags.eor,
        "{part:?}"
    );
}

/// Regression (review): the peer's persistent receive counted as the peer being persistent only once its advert
/// reached the head of our queue; with a message before it still unread, our side could start a persistent send,
/// which the peer took for a violation (both sides persistent) and closed the connection. It is refused here now.
#[test]
fn a_persistent_send_is_refused_while_the_peers_persistent_receive_waits_behind_a_message() {
    let p = pair(SockType::SeqPacket);
    let msg = p.client_region(pattern(100, 1));
    p.client
        .send(&p.eq_a, &msg.all(), MsgFlags::NONE, 1)
        .unwrap();
    let mine = p.client_region(vec![0; 4096]);
    p.client
        .recv(&p.eq_a, &mine.all(), MsgFlags::PERSISTENT, 2)
        .unwrap();
    p.world.run_until_idle(100_000);
    let src = p.server_region(1000);
    let e = p
        .server
        .send(&p.eq_b, &src.all(), MsgFlags::PERSISTENT, 3)
        .unwrap_err();
    assert!(
        matches!(e, SendError::State(StateError::Persistent(_))),
        "{e:?}"
    );
    // The connection carries on: the server reads the message.
    let dst = p.server_region(100);
    p.server
        .recv(&p.eq_b, &dst.all(), MsgFlags::NONE, 4)
        .unwrap();
    let r = wait(&p.eq_b);
    assert!(r.is_ok() && r.bytes == 100, "{r:?}");
}

/// A manual world with a fixed latency and no jitter (deliveries in the order they were posted), a seqpacket
/// socket accepted from a raw peer that drives the world while it waits, and the socket's queue.
fn raw_accepted(
    port: u16,
) -> (
    World,
    exs::testing::RawPeer,
    exs::Socket,
    EventQueue,
    exs::Context,
) {
    use exs::testing::{handshake, RawPeer};
    use exs::wire::WireSockType;
    let world = World::new(SimConfig {
        latency: std::time::Duration::from_micros(100),
        jitter: std::time::Duration::ZERO,
        ..SimConfig::default()
    });
    let ctx = world.host();
    let eq = EventQueue::new(16).unwrap();
    let l = exs::Socket::new(&ctx, SockType::SeqPacket).unwrap();
    l.bind(world.addr(0, port)).unwrap();
    let addr = l.listen(4).unwrap();
    l.accept(&eq, 1).unwrap();
    let w = world.clone();
    let raw = RawPeer::connect_with(
        Box::new(world.raw_host()),
        addr,
        &handshake(WireSockType::SeqPacket).encode(),
        Box::new(move || {
            w.drive();
        }),
    )
    .unwrap();
    let mut ev = eq.next(Some(std::time::Duration::from_secs(10))).unwrap();
    let s = ev.take_accepted().unwrap();
    (world, raw, s, eq, ctx)
}

/// The raw peer's first advert (`flags`, 4096 bytes at `at`), which then arrives.
fn first_advert(
    world: &World,
    raw: &mut exs::testing::RawPeer,
    flags: u32,
    at: exs::transport::RemoteRef,
) {
    use exs::wire::{Advert, AdvertFlags, Body, Message};
    raw.send_msg(&Message::new(Body::Advert(Advert {
        seq: 0,
        flags: AdvertFlags(flags),
        len: 4096,
        addr: at.addr,
        rkey: at.key,
    })))
    .unwrap();
    world.run_for(std::time::Duration::from_millis(1));
}

/// [`first_advert`], then its end (on its way).
fn advert_then_end(
    world: &World,
    raw: &mut exs::testing::RawPeer,
    flags: u32,
    at: exs::transport::RemoteRef,
) {
    use exs::wire::{Body, Message};
    first_advert(world, raw, flags, at);
    raw.send_msg(&Message::new(Body::PersistentEnd {
        seq: 0,
        echo: false,
    }))
    .unwrap();
}

/// Review finding: the peer ended its persistent send while a receive's read of it was in flight, and shut down
/// writing; a receive made behind it waited for ever (end-of-stream went only to receives beyond the queued
/// adverts, and the ended send counted as one though it would never take a receive).
#[test]
fn a_receive_behind_an_ended_persistent_send_sees_the_end_of_a_half_closed_peer() {
    use exs::wire::{AdvertFlags, Body, CloseReason, Message};
    let (world, mut raw, s, eq, ctx) = raw_accepted(7001);
    let data = pattern(4096, 5);
    let exposed = raw.expose(&data).unwrap();
    // The end and the half close leave half a latency before the first receive's read: they arrive while it is
    // in flight, and the second receive comes after them.
    advert_then_end(&world, &mut raw, AdvertFlags::PERSISTENT, exposed.remote());
    raw.send_msg(&Message::new(Body::Close(CloseReason::ShutdownWrite)))
        .unwrap();
    world.run_for(std::time::Duration::from_micros(50));
    let first = MemoryRegion::alloc(&ctx, 4096).unwrap();
    let second = MemoryRegion::alloc(&ctx, 4096).unwrap();
    s.recv(&eq, &first.all(), MsgFlags::NONE, 2).unwrap();
    world.run_for(std::time::Duration::from_micros(60));
    s.recv(&eq, &second.all(), MsgFlags::NONE, 3).unwrap();
    let a = eq.next(Some(std::time::Duration::from_secs(10))).unwrap();
    assert!(
        a.is_ok() && a.context == 2 && a.bytes == 4096 && !a.flags.eof,
        "{a:?}"
    );
    assert_bytes_eq(&first.to_vec().unwrap(), &data, "the persistent send");
    let b = eq.next(Some(std::time::Duration::from_secs(10)));
    assert!(
        matches!(&b, Ok(e) if e.is_ok() && e.context == 3 && e.flags.eof),
        "the receive behind the ended send: {b:?}"
    );
    drop(exposed);
}

/// Review finding: once the peer had ended its persistent receive (our write into it still in flight), a small
/// send, planned as immediate data, failed with `PersistentEnded`: it was still taken for a write into that
/// receive. It now goes as a message.
#[test]
fn a_small_send_after_the_peer_ended_its_persistent_receive_goes_as_a_message() {
    use exs::wire::{AdvertFlags, Body, Message};
    use std::time::Duration;
    let (world, mut raw, s, eq, ctx) = raw_accepted(7002);
    let sink = raw.expose_writable(4096).unwrap();
    // The end leaves half a latency before our first send's write: it arrives while that write is in flight.
    advert_then_end(
        &world,
        &mut raw,
        AdvertFlags::PERSISTENT_RECV,
        sink.remote(),
    );
    world.run_for(Duration::from_micros(50));
    let src = MemoryRegion::from_vec(&ctx, pattern(100, 8)).unwrap();
    s.send(&eq, &src.all(), MsgFlags::NONE, 1).unwrap();
    world.run_for(Duration::from_micros(60));
    let second = MemoryRegion::from_vec(&ctx, pattern(100, 9)).unwrap();
    s.send(&eq, &second.all(), MsgFlags::NONE, 2).unwrap();
    let advert = |p: &exs::testing::RawPeer| {
        p.received.iter().find_map(|m| match m {
            Ok(Message {
                body: Body::Advert(a),
                ..
            }) if a.flags.has(AdvertFlags::IMMEDIATE) => Some(*a),
            _ => None,
        })
    };
    raw.pump(Duration::from_secs(10), |p| advert(p).is_some());
    let mut evs = Vec::new();
    eq.poll(&mut evs, 16);
    assert!(evs.iter().all(|e| e.is_ok()), "no send failed: {evs:?}");
    let a = advert(&raw).expect("the second send as an immediate advert");
    assert_eq!(a.len, 100);
    drop(sink);
}

/// Review finding (of the bound on queued control messages): the read notifications of a notifying persistent
/// send our application reads counted against the bound, so a peer busy for a few milliseconds (returning no
/// credits meanwhile, while its device served the reads) had its connection closed for a violation after 4,096
/// reads. They are made at our application's pace and do not count.
#[test]
fn reading_a_notifying_persistent_send_while_its_owner_is_busy_is_no_violation() {
    let p = pair(SockType::SeqPacket);
    let src = MemoryRegion::from_vec(&p.b, pattern(64, 1)).unwrap();
    p.server
        .send(
            &p.eq_b,
            &src.all(),
            MsgFlags::PERSISTENT | MsgFlags::NOTIFY,
            1,
        )
        .unwrap();
    let dst = MemoryRegion::alloc(&p.a, 64).unwrap();
    p.client
        .recv(&p.eq_a, &dst.all(), MsgFlags::NONE, 0)
        .unwrap();
    assert!(wait(&p.eq_a).is_ok());
    // The owner's host takes nothing in and returns no credit while 5,000 reads of its memory complete.
    p.world.stall(1, true);
    for i in 1..=5000u64 {
        p.client
            .recv(&p.eq_a, &dst.all(), MsgFlags::NONE, i)
            .unwrap();
        let r = wait(&p.eq_a);
        assert!(r.is_ok() && r.bytes == 64, "read {i}: {r:?}");
    }
    assert!(
        p.client.stats().unwrap().link.ctrl_queued > 4096,
        "the notifications wait for credits"
    );
    p.world.stall(1, false);
    p.world.run_for(std::time::Duration::from_millis(10));
    assert_eq!(p.client.error().unwrap(), None);
    assert_eq!(p.a.stats().violations, 0);
}

/// Noticed by a review: after the peer shut down writing, a receive made while an earlier one was still reading
/// the peer's last message saw end-of-stream before that one completed, so an application that closes on
/// end-of-stream could lose the message. End-of-stream now waits for the reads before it.
#[test]
fn end_of_stream_after_a_half_close_comes_after_the_message_still_being_read() {
    use exs::wire::{Body, CloseReason, Message};
    use std::time::Duration;
    let (world, mut raw, s, eq, ctx) = raw_accepted(7003);
    let data = pattern(4096, 6);
    let exposed = raw.expose(&data).unwrap();
    first_advert(&world, &mut raw, 0, exposed.remote());
    // The half close leaves half a latency before the first receive's read: it arrives while that read is in
    // flight, and the second receive comes after it.
    raw.send_msg(&Message::new(Body::Close(CloseReason::ShutdownWrite)))
        .unwrap();
    world.run_for(Duration::from_micros(50));
    let first = MemoryRegion::alloc(&ctx, 4096).unwrap();
    let second = MemoryRegion::alloc(&ctx, 4096).unwrap();
    s.recv(&eq, &first.all(), MsgFlags::NONE, 2).unwrap();
    world.run_for(Duration::from_micros(60));
    s.recv(&eq, &second.all(), MsgFlags::NONE, 3).unwrap();
    let a = eq.next(Some(Duration::from_secs(10))).unwrap();
    assert!(
        a.is_ok() && a.context == 2 && a.bytes == 4096 && !a.flags.eof,
        "the message first: {a:?}"
    );
    assert_bytes_eq(&first.to_vec().unwrap(), &data, "the last message");
    let b = eq.next(Some(Duration::from_secs(10))).unwrap();
    assert!(b.is_ok() && b.context == 3 && b.flags.eof, "{b:?}");
    drop(exposed);
}

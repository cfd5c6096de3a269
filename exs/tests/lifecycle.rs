//! Connection lifecycle on the simulated fabric: connect outcomes, close, peer close, failures. The tests log
//! through `test-log`: `RUST_LOG=exs=debug cargo test -p exs --features sim --test lifecycle -- --nocapture`.
#![cfg(feature = "sim")] // the simulated fabric: `cargo test -p exs --features sim`

mod common;

use std::time::Duration;

use common::*;
use exs::sim::{SimConfig, World};
use exs::{
    Blame, EventKind, EventQueue, MemoryRegion, MsgFlags, OpError, SockType, Socket, SocketOptions,
    StateError,
};

#[test_log::test]
fn connect_to_a_port_nobody_listens_on_is_refused() {
    let world = World::new(SimConfig::default());
    let a = world.host();
    let _b = world.host();
    let eq = EventQueue::new(8).unwrap();
    let s = Socket::new(&a, SockType::SeqPacket).unwrap();
    s.connect(&eq, world.addr(1, 4242), 7).unwrap();
    let ev = wait(&eq);
    assert_eq!((ev.kind, ev.context), (EventKind::Connect, 7));
    assert_eq!(ev.status, Err(OpError::Refused));
    assert_eq!(ev.status.unwrap_err().blame(), Blame::Peer);
}

#[test_log::test]
fn connect_to_an_unknown_host_is_unreachable() {
    let world = World::new(SimConfig::default());
    let a = world.host();
    let eq = EventQueue::new(8).unwrap();
    let s = Socket::new(&a, SockType::SeqPacket).unwrap();
    s.connect(&eq, "192.0.2.99:1".parse().unwrap(), 1).unwrap();
    assert_eq!(wait(&eq).status, Err(OpError::Unreachable));
}

/// A host that does not answer makes the connect time out, distinguishable from a refusal.
#[test_log::test]
fn connect_to_a_silent_host_times_out() {
    let world = World::new(SimConfig::default());
    let a = world.host_with({
        let mut o = exs::ContextOptions::default();
        o.connect_timeout = Duration::from_millis(50);
        o
    });
    let b = world.host();
    let eq_b = EventQueue::new(8).unwrap();
    let l = Socket::new(&b, SockType::SeqPacket).unwrap();
    l.bind(world.addr(1, 80)).unwrap();
    l.listen(1).unwrap();
    world.silence(1);
    let eq = EventQueue::new(8).unwrap();
    let s = Socket::new(&a, SockType::SeqPacket).unwrap();
    s.connect(&eq, world.addr(1, 80), 1).unwrap();
    let ev = wait(&eq);
    assert_eq!(ev.status, Err(OpError::TimedOut));
    assert!(world.elapsed() >= Duration::from_millis(50));
    let _ = eq_b;
}

#[test_log::test]
fn a_stream_client_is_refused_by_a_seqpacket_listener() {
    let world = World::new(SimConfig::default());
    let a = world.host();
    let b = world.host();
    let eq_b = EventQueue::new(8).unwrap();
    let l = Socket::new(&b, SockType::SeqPacket).unwrap();
    l.bind(world.addr(1, 80)).unwrap();
    let addr = l.listen(1).unwrap();
    l.accept(&eq_b, 0).unwrap();
    let eq = EventQueue::new(8).unwrap();
    let s = Socket::new(&a, SockType::Stream).unwrap();
    match s.connect(&eq, addr, 1) {
        Ok(()) => assert_eq!(wait(&eq).status, Err(OpError::Refused)),
        Err(e) => panic!("connect refused synchronously: {e}"),
    }
    assert_eq!(eq_b.len(), 0, "the listener accepted nothing");
}

#[test_log::test]
fn listener_binds_port_zero_to_a_real_port_and_reports_addresses() {
    let world = World::new(SimConfig::default());
    let _a = world.host();
    let b = world.host();
    let l = Socket::new(&b, SockType::SeqPacket).unwrap();
    l.bind(world.addr(1, 0)).unwrap();
    let addr = l.listen(1).unwrap();
    assert_ne!(addr.port(), 0);
    assert_eq!(l.local_addr().unwrap(), Some(addr));
    let p = pair(SockType::SeqPacket);
    let c_local = p.client.local_addr().unwrap().unwrap();
    assert_eq!(p.server.peer_addr().unwrap(), Some(c_local));
    assert_eq!(
        p.client.peer_addr().unwrap(),
        p.server.local_addr().unwrap()
    );
    assert_eq!(p.client.peer_addr().unwrap().unwrap().port(), 7000);
}

/// Like TCP's, the listener sets connections up itself (issue 27): they are established before any accept and wait
/// for one.
#[test_log::test]
fn connections_wait_established_in_the_backlog_until_accepted() {
    let world = World::new(SimConfig::default());
    let a = world.host();
    let b = world.host();
    let (eq_a, eq_b) = (EventQueue::new(64).unwrap(), EventQueue::new(64).unwrap());
    let l = Socket::new(&b, SockType::SeqPacket).unwrap();
    l.bind(world.addr(1, 5)).unwrap();
    let addr = l.listen(4).unwrap();
    let clients: Vec<Socket> = (0..3)
        .map(|i| {
            let s = Socket::new(&a, SockType::SeqPacket).unwrap();
            s.connect(&eq_a, addr, i).unwrap();
            s
        })
        .collect();
    world.run_for(Duration::from_millis(100));
    let connected = eq_a.wait_all(None).unwrap();
    assert_eq!(connected.len(), 3, "up before any accept");
    assert!(connected.iter().all(|e| e.is_ok()));
    assert_eq!(eq_b.len(), 0, "nobody accepted yet");
    for i in 0..3 {
        l.accept(&eq_b, i).unwrap();
    }
    let mut accepted = eq_b.wait_all(None).unwrap();
    assert_eq!(accepted.len(), 3);
    assert!(accepted
        .iter_mut()
        .all(|e| e.is_ok() && e.take_accepted().is_some()));
    drop(clients);
}

#[test_log::test]
fn a_full_backlog_refuses_further_requests() {
    let world = World::new(SimConfig::default());
    let a = world.host();
    let b = world.host();
    let eq_a = EventQueue::new(64).unwrap();
    let l = Socket::new(&b, SockType::SeqPacket).unwrap();
    l.bind(world.addr(1, 5)).unwrap();
    let addr = l.listen(2).unwrap();
    let socks: Vec<Socket> = (0..4)
        .map(|i| {
            let s = Socket::new(&a, SockType::SeqPacket).unwrap();
            s.connect(&eq_a, addr, i).unwrap();
            s
        })
        .collect();
    world.run_for(Duration::from_millis(100));
    let evs = eq_a
        .wait_all(Some(Duration::from_millis(1)))
        .unwrap_or_default();
    assert_eq!(
        evs.iter()
            .filter(|e| e.status == Err(OpError::Refused))
            .count(),
        2,
        "{evs:?}"
    );
    drop(socks);
}

/// "Closing a socket completes every pending operation with a cancelled status": `abort()` does (a graceful
/// `close()` lets the sends finish: conformance `seqpacket_close_is_graceful_with_pending_operations`). A send
/// whose message left is `Aborted`, never `Cancelled` (the peer may have it).
#[test_log::test]
fn abort_completes_every_pending_operation() {
    let p = pair(SockType::SeqPacket);
    let buf = MemoryRegion::alloc(&p.a, 4 * 1000).unwrap();
    for i in 0..4 {
        p.client
            .recv(
                &p.eq_a,
                &buf.slice(i * 1000..(i + 1) * 1000),
                MsgFlags::NONE,
                i as u64,
            )
            .unwrap();
    }
    let out = p.client_region(pattern(3000, 1));
    for i in 0..3 {
        p.client
            .send(
                &p.eq_a,
                &out.slice(i * 1000..(i + 1) * 1000),
                MsgFlags::NONE,
                10 + i as u64,
            )
            .unwrap();
    }
    p.client.abort().unwrap();
    let evs = p.eq_a.wait_all(None).unwrap();
    assert_eq!(evs.len(), 7);
    assert!(
        evs.iter().all(|e| match e.kind {
            EventKind::Recv => e.status == Err(OpError::Cancelled),
            _ => e.status == Err(OpError::Aborted),
        }),
        "{evs:?}"
    );
    assert!(evs
        .iter()
        .all(|e| e.status.as_ref().unwrap_err().blame() == Blame::Local));
    // An event means the operation's buffer is free: no lease or remote key survives it.
    assert_eq!((buf.leases(), out.leases()), (0, 0));
    out.write(0, b"reusable").unwrap();
    assert_eq!(p.world.live_keys(), 0);
}

/// The peer's close: our pending receives end with end-of-stream, our unread sends fail with PeerClosed, and
/// later receives report end-of-stream at once.
#[test_log::test]
fn peer_close_gives_end_of_stream_and_fails_unread_sends() {
    let p = pair(SockType::SeqPacket);
    let buf = p.server_region(100);
    p.server
        .recv(&p.eq_b, &buf.all(), MsgFlags::NONE, 1)
        .unwrap();
    let out = MemoryRegion::from_vec(&p.b, pattern(5000, 1)).unwrap();
    p.server
        .send(&p.eq_b, &out.all(), MsgFlags::NONE, 2)
        .unwrap();
    p.world.run_until_idle(100_000);
    p.client.close().unwrap();
    let evs = p.eq_b.wait_all(None).unwrap();
    let recv = evs.iter().find(|e| e.kind == EventKind::Recv).unwrap();
    assert_eq!(
        (&recv.status, recv.bytes, recv.flags.eof),
        (&Ok(()), 0, true)
    );
    let send = evs.iter().find(|e| e.kind == EventKind::Send).unwrap();
    assert_eq!(send.status, Err(OpError::PeerClosed));
    p.server
        .recv(&p.eq_b, &buf.all(), MsgFlags::NONE, 3)
        .unwrap();
    let later = wait(&p.eq_b);
    assert!(later.flags.eof && later.is_ok());
    match p.server.send(&p.eq_b, &out.all(), MsgFlags::NONE, 4) {
        Err(exs::SendError::State(StateError::ConnectionDown(OpError::PeerClosed))) => {}
        other => panic!("send after the peer closed: {other:?}"),
    }
}

#[test_log::test]
fn messages_sent_before_close_are_still_delivered_when_already_read() {
    let p = pair(SockType::SeqPacket);
    let data = pattern(300, 3);
    let (s, r, got) = p.transfer(&data, 300);
    assert!(s.is_ok() && r.is_ok());
    p.client.close().unwrap();
    p.world.run_until_idle(100_000);
    assert_bytes_eq(&got, &data, "delivered before close");
}

/// A connection that breaks under the transport (both ends go to error) fails pending operations with
/// ConnectionReset on both sides, and frees every buffer.
#[test_log::test]
fn broken_connection_fails_pending_operations_on_both_sides() {
    let p = pair(SockType::SeqPacket);
    let dst = p.server_region(1 << 20);
    let src = p.client_region(pattern(1 << 20, 1));
    p.server
        .recv(&p.eq_b, &dst.all(), MsgFlags::NONE, 1)
        .unwrap();
    let extra = p.server_region(10);
    p.server
        .recv(&p.eq_b, &extra.all(), MsgFlags::NONE, 2)
        .unwrap();
    p.client
        .send(&p.eq_a, &src.all(), MsgFlags::NONE, 3)
        .unwrap();
    // Let the advert arrive and the read start, then break the link before the read is answered.
    while p.server.stats().unwrap().link.reads == 0 {
        assert!(p.world.drive());
    }
    p.world.break_connections(0);
    let a = p.eq_a.wait_all(None).unwrap();
    let b = p.eq_b.wait_all(None).unwrap();
    assert!(
        a.iter().all(|e| e.status == Err(OpError::ConnectionReset)),
        "{a:?}"
    );
    assert!(
        b.iter().all(|e| e.status == Err(OpError::ConnectionReset)),
        "{b:?}"
    );
    assert_eq!(b.len(), 2);
    assert_eq!((src.leases(), dst.leases(), extra.leases()), (0, 0, 0));
    assert_eq!(
        p.world.live_keys(),
        0,
        "no remote key survives a dead connection"
    );
}

/// Regression (soak on libfabric tcp): a message whose read failed when the connection broke was reported as
/// failed, and the small message behind it, whose bytes had come inline, completed as if nothing was missing. A
/// receive that succeeds must mean every message before it arrived: once a read fails, every receive behind it
/// fails too.
#[test_log::test]
fn no_message_completes_after_an_earlier_one_failed_mid_read() {
    // Both adverts must arrive while the first read is still going: with coalescing the second advert would wait
    // for the first's send completion, and the read could finish before it lands.
    let p = pair_with(
        SockType::SeqPacket,
        SimConfig::default(),
        SocketOptions::default().with_coalesce(false),
    );
    let big = p.server_region(1 << 20);
    let small = p.server_region(64);
    p.server
        .recv(&p.eq_b, &big.all(), MsgFlags::NONE, 0)
        .unwrap();
    p.server
        .recv(&p.eq_b, &small.all(), MsgFlags::NONE, 1)
        .unwrap();
    let src = p.client_region(pattern(1 << 20, 1));
    let inline = p.client_region(pattern(16, 2));
    p.client
        .send(&p.eq_a, &src.all(), MsgFlags::NONE, 2)
        .unwrap();
    p.client
        .send(&p.eq_a, &inline.all(), MsgFlags::NONE, 3)
        .unwrap();
    // Both adverts arrive (the second with its bytes inline) and the first read starts; then the link breaks.
    while p.server.stats().unwrap().link.reads == 0
        || p.server.stats().unwrap().message.adverts_received < 2
    {
        assert!(p.world.drive());
    }
    p.world.break_connections(0);
    let b = p.eq_b.wait_all(None).unwrap();
    assert_eq!(b.len(), 2, "{b:?}");
    assert!(
        b.iter().all(|e| e.status == Err(OpError::ConnectionReset)),
        "a receive completed after the one before it failed: {b:?}"
    );
}

/// A peer process killed mid-transfer: every pending operation completes with an error within the detection
/// delay, and the listener keeps accepting.
#[test_log::test]
fn killed_peer_fails_pending_operations_and_the_listener_keeps_accepting() {
    let world = World::new(SimConfig {
        detect_delay: Duration::from_millis(5),
        ..SimConfig::default()
    });
    let server_ctx = world.host();
    let client_ctx = world.host();
    let other_ctx = world.host();
    let (eq_s, eq_c, eq_o) = (
        EventQueue::new(64).unwrap(),
        EventQueue::new(64).unwrap(),
        EventQueue::new(64).unwrap(),
    );
    let l = Socket::new(&server_ctx, SockType::SeqPacket).unwrap();
    l.bind(world.addr(0, 80)).unwrap();
    let addr = l.listen(8).unwrap();
    l.accept(&eq_s, 0).unwrap();
    let c = Socket::new(&client_ctx, SockType::SeqPacket).unwrap();
    c.connect(&eq_c, addr, 0).unwrap();
    assert!(wait(&eq_c).is_ok());
    let s = wait(&eq_s).take_accepted().unwrap();
    let buf = MemoryRegion::alloc(&server_ctx, 1 << 16).unwrap();
    for i in 0..4u64 {
        s.recv(
            &eq_s,
            &buf.slice(i as usize * 100..(i as usize + 1) * 100),
            MsgFlags::NONE,
            i,
        )
        .unwrap();
    }
    let out = MemoryRegion::alloc(&server_ctx, 1 << 16).unwrap();
    s.send(&eq_s, &out.all(), MsgFlags::NONE, 9).unwrap();
    world.run_until_idle(1000);
    let before = world.elapsed();
    world.kill(1);
    let evs = eq_s.wait_all(None).unwrap();
    assert_eq!(evs.len(), 5);
    assert!(
        evs.iter()
            .all(|e| e.status == Err(OpError::ConnectionReset)),
        "{evs:?}"
    );
    assert!(
        world.elapsed() - before <= Duration::from_millis(6),
        "detected in {:?}",
        world.elapsed() - before
    );
    assert_eq!((buf.leases(), out.leases()), (0, 0));
    // The listener still accepts.
    l.accept(&eq_s, 1).unwrap();
    let o = Socket::new(&other_ctx, SockType::SeqPacket).unwrap();
    o.connect(&eq_o, addr, 1).unwrap();
    assert!(wait(&eq_o).is_ok());
    assert!(wait(&eq_s).take_accepted().is_some());
}

/// A sender whose peer stops answering learns it from its own work requests (retries exhausted).
#[test_log::test]
fn silent_peer_is_detected_by_the_next_work_request() {
    let p = pair(SockType::SeqPacket);
    let src = p.client_region(pattern(100, 1));
    p.world.silence(1);
    p.client
        .send(&p.eq_a, &src.all(), MsgFlags::NONE, 1)
        .unwrap();
    let ev = wait(&p.eq_a);
    assert_eq!(ev.status, Err(OpError::ConnectionReset));
}

#[test_log::test]
fn dropping_every_handle_closes_the_socket() {
    let p = pair(SockType::SeqPacket);
    let buf = p.server_region(10);
    p.server
        .recv(&p.eq_b, &buf.all(), MsgFlags::NONE, 1)
        .unwrap();
    drop(p.conn.client);
    let ev = wait(&p.conn.eq_b);
    assert!(ev.flags.eof, "{ev:?}");
}

/// An accepted connection reaches the application through its event (`Event::take_accepted`); one that nobody
/// takes, because the event was dropped after its dequeue or with its queue before, is closed as a dropped socket
/// is: the client sees end-of-stream.
#[test_log::test]
fn an_accepted_connection_nobody_takes_is_closed_with_its_event() {
    for drop_queue in [false, true] {
        let world = World::new(SimConfig::default());
        let (server_ctx, client_ctx) = (world.host(), world.host());
        let (eq_s, eq_c) = (EventQueue::new(8).unwrap(), EventQueue::new(8).unwrap());
        let l = Socket::new(&server_ctx, SockType::SeqPacket).unwrap();
        l.bind(world.addr(0, 80)).unwrap();
        let addr = l.listen(8).unwrap();
        l.accept(&eq_s, 0).unwrap();
        let c = Socket::new(&client_ctx, SockType::SeqPacket).unwrap();
        c.connect(&eq_c, addr, 0).unwrap();
        assert!(wait(&eq_c).is_ok());
        if drop_queue {
            // Wait for the accept event to be queued, then drop the queue with it undequeued.
            while eq_s.is_empty() {
                world.run_for(Duration::from_millis(1));
            }
            drop(eq_s);
        } else {
            let ev = wait(&eq_s);
            assert_eq!(ev.kind, EventKind::Accept, "{ev:?}");
            drop(ev);
        }
        let buf = MemoryRegion::alloc(&client_ctx, 16).unwrap();
        c.recv(&eq_c, &buf.all(), MsgFlags::NONE, 1).unwrap();
        let ev = wait(&eq_c);
        assert!(
            ev.flags.eof || ev.status.is_err(),
            "dropping the queue: {drop_queue}: the client learns the server end closed: {ev:?}"
        );
    }
}

#[test_log::test]
fn closing_a_listener_cancels_its_pending_accepts() {
    let world = World::new(SimConfig::default());
    let b = world.host();
    let eq = EventQueue::new(8).unwrap();
    let l = Socket::new(&b, SockType::SeqPacket).unwrap();
    l.bind(world.addr(0, 1)).unwrap();
    l.listen(1).unwrap();
    l.accept(&eq, 1).unwrap();
    l.accept(&eq, 2).unwrap();
    l.close().unwrap();
    let evs = eq.wait_all(None).unwrap();
    assert_eq!(evs.len(), 2);
    assert!(evs.iter().all(|e| e.status == Err(OpError::Cancelled)));
}

#[test_log::test]
fn closing_a_connecting_socket_cancels_the_connect() {
    let world = World::new(SimConfig::default());
    let a = world.host();
    let b = world.host();
    let l = Socket::new(&b, SockType::SeqPacket).unwrap();
    l.bind(world.addr(1, 1)).unwrap();
    let addr = l.listen(1).unwrap();
    let eq = EventQueue::new(8).unwrap();
    let s = Socket::new(&a, SockType::SeqPacket).unwrap();
    s.connect(&eq, addr, 1).unwrap();
    s.close().unwrap();
    assert_eq!(wait(&eq).status, Err(OpError::Cancelled));
    world.run_until_idle(10_000);
}

/// One-way traffic is acknowledged at once: a sender with one message in flight is not slowed down by the
/// delayed acknowledgment meant for request/response traffic.
#[test_log::test]
fn one_way_messages_are_acknowledged_without_delay() {
    let p = pair(SockType::SeqPacket);
    let src = p.client_region(pattern(10_000, 1));
    let dst = p.server_region(10_000);
    for i in 0..100 {
        p.server
            .recv(
                &p.eq_b,
                &dst.slice(i * 100..(i + 1) * 100),
                MsgFlags::NONE,
                i as u64,
            )
            .unwrap();
    }
    let start = p.world.elapsed();
    for i in 0..100 {
        p.client
            .send(
                &p.eq_a,
                &src.slice(i * 100..(i + 1) * 100),
                MsgFlags::NONE,
                i as u64,
            )
            .unwrap();
        assert!(wait(&p.eq_a).is_ok());
    }
    let per_message = (p.world.elapsed() - start) / 100;
    assert!(
        per_message < Duration::from_micros(100),
        "{per_message:?} per message (the delay is 200 us)"
    );
}

/// A connection whose application only waits (a pending receive, nothing to send) to a peer that vanished:
/// with keepalive the probe finds it within one interval plus the transport's retries; without, nothing ever
/// moves on that connection.
#[test_log::test]
fn keepalive_finds_a_silent_peer_while_the_application_only_waits() {
    for keepalive in [Some(Duration::from_secs(1)), None] {
        let world = World::new(SimConfig::default());
        let a = world.host_with({
            let mut o = exs::ContextOptions::default();
            o.keepalive = keepalive;
            o
        });
        let b = world.host();
        let (eq_a, eq_b) = (EventQueue::new(8).unwrap(), EventQueue::new(8).unwrap());
        let l = Socket::new(&b, SockType::SeqPacket).unwrap();
        l.bind(world.addr(1, 7000)).unwrap();
        let addr = l.listen(4).unwrap();
        l.accept(&eq_b, 1).unwrap();
        let c = Socket::new(&a, SockType::SeqPacket).unwrap();
        c.connect(&eq_a, addr, 2).unwrap();
        assert!(wait(&eq_a).is_ok());
        let mut acc = wait(&eq_b);
        let _server = acc.take_accepted().expect("accepted");
        world.silence(1);
        let dst = MemoryRegion::alloc(&a, 16).unwrap();
        c.recv(&eq_a, &dst.all(), MsgFlags::NONE, 3).unwrap();
        let start = world.elapsed();
        let mut evs = Vec::new();
        while world.elapsed() < start + Duration::from_secs(5) && evs.is_empty() {
            world.run_for(Duration::from_millis(50));
            eq_a.poll(&mut evs, 8);
        }
        match keepalive {
            Some(k) => {
                assert_eq!(evs.len(), 1, "the pending receive did not fail: {evs:?}");
                assert_eq!(evs[0].status, Err(OpError::ConnectionReset));
                let err = c
                    .error()
                    .unwrap()
                    .expect("the socket reports why it went down");
                assert_eq!(err, OpError::ConnectionReset);
                let took = world.elapsed() - start;
                assert!(
                    took >= k,
                    "found after {took:?}, before the first probe was due"
                );
            }
            None => {
                assert!(
                    evs.is_empty(),
                    "without keepalive an idle connection cannot notice: {evs:?}"
                );
                assert_eq!(c.error().unwrap(), None);
            }
        }
    }
}

/// Regression (soak, made frequent by coalescing): a receiver that closes while its RDMA read of an advert is
/// under way sends "stop receiving" with the acknowledgments it has; the read then finishes, and its final CLOSE
/// acknowledges it too. The sender had already failed (and forgotten) every send from its oldest unacknowledged
/// one on, the one being read and the one behind it, and took the late acknowledgment for one it did not know: a
/// protocol violation between two exs peers.
#[test_log::test]
fn a_late_acknowledgment_after_the_peer_stopped_receiving_is_no_violation() {
    let p = pair(SockType::SeqPacket);
    // Two sends; both adverts arrive before the receiver has a receive.
    let src = p.client_region(pattern(2 << 20, 1));
    for i in 0..2 {
        p.client
            .send(
                &p.eq_a,
                &src.slice(i << 20..(i + 1) << 20),
                MsgFlags::NONE,
                i as u64,
            )
            .unwrap();
    }
    while p.server.stats().unwrap().message.adverts_received < 2 {
        assert!(p.world.drive());
    }
    // The receive starts the first read; the close comes before it has finished.
    let big = p.server_region(1 << 20);
    p.server
        .recv(&p.eq_b, &big.all(), MsgFlags::NONE, 0)
        .unwrap();
    assert_eq!(p.server.stats().unwrap().link.reads, 1);
    p.server.close().unwrap();
    let sent = p.eq_a.wait_all(None).unwrap();
    assert_eq!(sent.len(), 2, "{sent:?}");
    assert_eq!(
        (p.a.stats().violations, p.b.stats().violations),
        (0, 0),
        "the sends ended with {sent:?}"
    );
}

/// Settings too long to count mean never, not a panic (`Instant + Duration::MAX` failed the engine's round): a
/// request and its reply on message sockets, where the acknowledgment delay applies, then a graceful close.
#[test_log::test]
fn context_durations_too_long_to_count_mean_never_on_message_sockets() {
    let mut opts = exs::ContextOptions::default();
    opts.linger = Duration::MAX;
    opts.connect_timeout = Duration::MAX;
    opts.ack_delay = Duration::MAX;
    opts.keepalive = Some(Duration::MAX);
    let p = pair_ctx_opts(SockType::SeqPacket, opts, SocketOptions::default());
    let request = pattern(100, 5);
    let (s, r, got) = p.transfer(&request, 100);
    assert!(s.is_ok() && r.is_ok(), "{s:?} {r:?}");
    assert_bytes_eq(&got, &request, "request");
    let reply = pattern(200, 6);
    let src = MemoryRegion::from_vec(&p.b, reply.clone()).unwrap();
    let dst = p.client_region(vec![0; 200]);
    p.client
        .recv(&p.eq_a, &dst.all(), MsgFlags::NONE, 7)
        .unwrap();
    p.server
        .send(&p.eq_b, &src.all(), MsgFlags::NONE, 8)
        .unwrap();
    let (got_reply, sent) = (wait(&p.eq_a), wait(&p.eq_b));
    assert!(got_reply.is_ok() && sent.is_ok(), "{got_reply:?} {sent:?}");
    assert_bytes_eq(&dst.to_vec().unwrap(), &reply, "reply");
    let handshake = p.client.stats().unwrap().handshake.expect("timed");
    assert!(handshake < Duration::from_secs(60), "{handshake:?}");
    // The close is graceful and needs no timer: the server's next receive reports the end at once.
    p.client.close().unwrap();
    p.world.run_until_idle(100_000);
    let buf = p.server_region(10);
    p.server
        .recv(&p.eq_b, &buf.all(), MsgFlags::NONE, 9)
        .unwrap();
    let end = wait(&p.eq_b);
    assert!(end.is_ok() && end.flags.eof, "{end:?}");
}

/// A review found it: `abort` on a socket with no connection to tear down (fresh, listening, down) marked it
/// closed and then closed it as `close` would, which refused a socket already marked closed: `abort` failed with
/// `InvalidSocket`, and the socket stayed for the context's life (a listener's port taken for good).
#[test_log::test]
fn abort_of_a_listener_a_fresh_or_a_down_socket_closes_it() {
    let world = World::new(SimConfig::default());
    let a = world.host();
    let fresh = Socket::new(&a, SockType::Stream).unwrap();
    fresh.abort().expect("abort of a fresh socket");
    let listener = Socket::new(&a, SockType::Stream).unwrap();
    listener.bind(world.addr(0, 4711)).unwrap();
    listener.listen(4).unwrap();
    listener.abort().expect("abort of a listener");
    let again = Socket::new(&a, SockType::Stream).unwrap();
    again
        .bind(world.addr(0, 4711))
        .expect("the aborted listener's port is free again");
    again.listen(4).unwrap();
    // A connection the peer closed: down, its receiving state kept for reading; abort lets it go.
    let p = pair(SockType::Stream);
    p.client.close().unwrap();
    p.world.run_until_idle(100_000);
    let before = p.b.stats().connection_bytes;
    assert!(before > 0, "the server's connection is kept for reading");
    p.server
        .abort()
        .expect("abort of a connection the peer closed");
    p.world.run_until_idle(100_000);
    assert_eq!(
        p.b.stats().connection_bytes,
        0,
        "the down connection's memory went with it"
    );
}

/// A review found it: the control buffers of a connection that failed before it came up (refused here) stayed in
/// the context's count of control-buffer bytes, which grew with every failed connect.
#[test_log::test]
fn refused_connects_leave_no_control_buffer_bytes_counted() {
    let world = World::new(SimConfig::default());
    let a = world.host();
    let _b = world.host();
    let eq = EventQueue::new(8).unwrap();
    for i in 0..3 {
        let s = Socket::new(&a, SockType::SeqPacket).unwrap();
        s.connect(&eq, world.addr(1, 4243), i).unwrap();
        assert_eq!(wait(&eq).status, Err(OpError::Refused));
    }
    assert_eq!(a.stats().ctrl_recv_bytes, 0);
}

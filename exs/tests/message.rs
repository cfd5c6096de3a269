//! Message mode (SOCK_SEQPACKET) on the simulated fabric: seed 002, section 3 and 4.1.
#![cfg(feature = "sim")] // the simulated fabric: `cargo test -p exs --features sim`

mod common;

use common::*;
use exs::sim::{RnrPolicy, SimConfig};
use exs::{EventKind, MemoryRegion, MsgFlags, SockType, SocketOptions};

fn assert_delivered(len: usize, cap: usize) {
    let p = pair(SockType::SeqPacket);
    let data = pattern(len, len as u64);
    let (s, r, got) = p.transfer(&data, cap);
    assert_eq!(
        (s.kind, &s.status, s.bytes),
        (EventKind::Send, &Ok(()), len),
        "send event"
    );
    assert_eq!(
        (r.kind, &r.status, r.bytes),
        (EventKind::Recv, &Ok(()), len),
        "recv event"
    );
    assert!(!r.flags.truncated && !r.flags.eof);
    assert_bytes_eq(&got, &data, "content");
    assert_eq!(p.world.stats().rnr, 0);
}

#[test]
fn zero_byte_message_is_delivered_as_a_message() {
    assert_delivered(0, 16);
}

#[test]
fn one_byte_message() {
    assert_delivered(1, 1);
}

#[test]
fn four_kib_message() {
    assert_delivered(4096, 4096);
}

#[test]
fn sixty_four_kib_message() {
    assert_delivered(65536, 65536);
}

#[test]
fn one_mib_message() {
    assert_delivered(1 << 20, 1 << 20);
}

#[test]
fn sixteen_mib_message() {
    assert_delivered(16 << 20, 16 << 20);
}

#[test]
fn message_into_larger_buffer_reports_its_own_length() {
    assert_delivered(3000, 1 << 16);
}

/// Seed 002, 4.1: a send of at most small_packet_max_size bytes travels inside the advertisement; one byte more
/// is pulled with an RDMA read.
#[test]
fn immediate_threshold_at_and_around_the_boundary() {
    for (len, immediate) in [(511, true), (512, true), (513, false)] {
        let p = pair(SockType::SeqPacket);
        let data = pattern(len, 7);
        let (s, r, got) = p.transfer(&data, 1024);
        assert!(s.is_ok() && r.is_ok());
        assert_bytes_eq(&got, &data, "immediate boundary");
        let cs = p.client.stats().unwrap();
        let ss = p.server.stats().unwrap();
        assert_eq!(cs.message.immediate_sent, u64::from(immediate), "len {len}");
        assert_eq!(
            ss.link.reads,
            u64::from(!immediate),
            "len {len}: reads at the receiver"
        );
    }
}

#[test]
fn immediate_threshold_follows_the_option() {
    for small in [0u32, 64, 4096] {
        let p = pair_with(
            SockType::SeqPacket,
            SimConfig::default(),
            SocketOptions::default().with_small_packet_max_size(small),
        );
        for len in [
            small.saturating_sub(1) as usize,
            small as usize,
            small as usize + 1,
        ] {
            let data = pattern(len, 3);
            let (_, r, got) = p.transfer(&data, 8192);
            assert_eq!(r.bytes, len);
            assert_bytes_eq(&got, &data, "content");
        }
        let st = p.client.stats().unwrap();
        // len = small-1 (0 when small is 0) and len = small are immediate; small+1 is not.
        assert_eq!(
            st.message.immediate_sent, 2,
            "small_packet_max_size {small}"
        );
    }
}

/// The immediate-data threshold is clamped to what the peer's control buffers hold: a receiver with a small
/// threshold gets large "immediate" sends as reads.
#[test]
fn immediate_threshold_is_clamped_to_the_peer_buffers() {
    let p = pair_opts(
        SockType::SeqPacket,
        SimConfig::default(),
        SocketOptions::default().with_small_packet_max_size(8192),
        SocketOptions::default().with_small_packet_max_size(64),
    );
    let data = pattern(4000, 9);
    let (_, r, got) = p.transfer(&data, 4096);
    assert_eq!(r.bytes, 4000);
    assert_bytes_eq(&got, &data, "content");
    assert_eq!(p.client.stats().unwrap().message.immediate_sent, 0);
}

/// Credits are the minimum of what the sender wants and the receiver grants.
#[test]
fn credits_negotiate_to_the_minimum_of_both_sides() {
    let p = pair_opts(
        SockType::SeqPacket,
        SimConfig::default(),
        SocketOptions::default().with_send_credits(32),
        SocketOptions::default().with_recv_credits(3),
    );
    let src = p.client_region(pattern(8 * 100, 2));
    for i in 0..8 {
        p.client
            .send(
                &p.eq_a,
                &src.slice(i * 100..(i + 1) * 100),
                MsgFlags::NONE,
                i as u64,
            )
            .unwrap();
    }
    p.world.run_until_idle(10_000);
    assert_eq!(p.client.stats().unwrap().message.adverts_sent, 3);
}

#[test]
fn sixty_four_outstanding_sends_and_recvs_complete_in_order() {
    let p = pair_with(
        SockType::SeqPacket,
        SimConfig::default(),
        SocketOptions::default()
            .with_send_credits(64)
            .with_recv_credits(64),
    );
    let sizes: Vec<usize> = (0..64)
        .map(|i| [0, 1, 100, 512, 513, 4096, 70_000][i % 7])
        .collect();
    let total: usize = sizes.iter().sum();
    let src = p.client_region(pattern(total, 5));
    let dst = p.server_region(64 * 70_000);
    for i in 0..64 {
        p.server
            .recv(
                &p.eq_b,
                &dst.slice(i * 70_000..(i + 1) * 70_000),
                MsgFlags::NONE,
                i as u64,
            )
            .unwrap();
    }
    let mut off = 0;
    for (i, &n) in sizes.iter().enumerate() {
        p.client
            .send(&p.eq_a, &src.slice(off..off + n), MsgFlags::NONE, i as u64)
            .unwrap();
        off += n;
    }
    let recvs = p.eq_b.wait_all(None).unwrap();
    let sends = p.eq_a.wait_all(None).unwrap();
    assert_eq!(recvs.len(), 64);
    assert_eq!(
        recvs.iter().map(|e| e.context).collect::<Vec<_>>(),
        (0..64).collect::<Vec<_>>()
    );
    assert_eq!(
        sends.iter().map(|e| e.context).collect::<Vec<_>>(),
        (0..64).collect::<Vec<_>>()
    );
    let all = src.to_vec().unwrap();
    let got = dst.to_vec().unwrap();
    let mut off = 0;
    for (i, &n) in sizes.iter().enumerate() {
        assert_eq!(recvs[i].bytes, n);
        assert_bytes_eq(
            &got[i * 70_000..i * 70_000 + n],
            &all[off..off + n],
            "message",
        );
        off += n;
    }
}

/// Recvmsg's MSG_TRUNC: a message longer than the receive buffer fills it, the rest is discarded, the event says
/// so, and the sender's send completes normally with its full length.
#[test]
fn long_message_into_short_buffer_is_truncated_and_flagged() {
    for len in [300, 5000] {
        let p = pair(SockType::SeqPacket);
        let data = pattern(len, 11);
        let (s, r, got) = p.transfer(&data, 100);
        assert_eq!((&s.status, s.bytes), (&Ok(()), len));
        assert_eq!(
            (&r.status, r.bytes, r.flags.truncated),
            (&Ok(()), 100, true)
        );
        assert_bytes_eq(&got, &data[..100], "truncated prefix");
        assert_eq!(p.server.stats().unwrap().message.truncated, 1);
    }
}

#[test]
fn truncated_message_does_not_disturb_the_next() {
    let p = pair(SockType::SeqPacket);
    let (_, r1, _) = p.transfer(&pattern(1000, 1), 10);
    assert!(r1.flags.truncated);
    let data = pattern(700, 2);
    let (_, r2, got) = p.transfer(&data, 700);
    assert!(!r2.flags.truncated);
    assert_bytes_eq(&got, &data, "content");
}

#[test]
fn zero_length_receive_buffer_takes_a_message_truncated() {
    let p = pair(SockType::SeqPacket);
    let src = p.client_region(pattern(50, 1));
    let dst = p.server_region(16);
    p.server
        .recv(&p.eq_b, &dst.slice(0..0), MsgFlags::NONE, 1)
        .unwrap();
    p.client
        .send(&p.eq_a, &src.all(), MsgFlags::NONE, 2)
        .unwrap();
    let r = wait(&p.eq_b);
    assert_eq!((r.bytes, r.flags.truncated), (0, true));
    assert!(wait(&p.eq_a).is_ok());
}

#[test]
fn messages_flow_both_ways_at_once() {
    let p = pair(SockType::SeqPacket);
    let a_src = p.client_region(pattern(10 * 3000, 1));
    let b_src = MemoryRegion::from_vec(&p.b, pattern(10 * 3000, 2)).unwrap();
    let a_dst = MemoryRegion::alloc(&p.a, 10 * 3000).unwrap();
    let b_dst = p.server_region(10 * 3000);
    for i in 0..10 {
        let r = i * 3000..(i + 1) * 3000;
        p.server
            .recv(
                &p.eq_b,
                &b_dst.slice(r.clone()),
                MsgFlags::NONE,
                100 + i as u64,
            )
            .unwrap();
        p.client
            .recv(
                &p.eq_a,
                &a_dst.slice(r.clone()),
                MsgFlags::NONE,
                100 + i as u64,
            )
            .unwrap();
        p.client
            .send(&p.eq_a, &a_src.slice(r.clone()), MsgFlags::NONE, i as u64)
            .unwrap();
        p.server
            .send(&p.eq_b, &b_src.slice(r), MsgFlags::NONE, i as u64)
            .unwrap();
    }
    assert_eq!(
        p.eq_a
            .wait_all(None)
            .unwrap()
            .iter()
            .filter(|e| e.is_ok())
            .count(),
        20
    );
    assert_eq!(
        p.eq_b
            .wait_all(None)
            .unwrap()
            .iter()
            .filter(|e| e.is_ok())
            .count(),
        20
    );
    assert_bytes_eq(&b_dst.to_vec().unwrap(), &a_src.to_vec().unwrap(), "b_dst");
    assert_bytes_eq(&a_dst.to_vec().unwrap(), &b_src.to_vec().unwrap(), "a_dst");
}

/// Acknowledgments ride on control messages going the other way instead of costing a message each.
#[test]
fn acknowledgments_piggyback_on_reverse_traffic() {
    let p = pair(SockType::SeqPacket);
    let a = p.client_region(pattern(100, 1));
    let b = MemoryRegion::from_vec(&p.b, pattern(100, 2)).unwrap();
    let a_in = MemoryRegion::alloc(&p.a, 100).unwrap();
    let b_in = p.server_region(100);
    // A ping-pong: each side's reply advert carries the acknowledgment of the message it answers.
    for i in 0..20 {
        p.server
            .recv(&p.eq_b, &b_in.all(), MsgFlags::NONE, i)
            .unwrap();
        p.client.send(&p.eq_a, &a.all(), MsgFlags::NONE, i).unwrap();
        assert_eq!(wait(&p.eq_b).kind, EventKind::Recv);
        p.client
            .recv(&p.eq_a, &a_in.all(), MsgFlags::NONE, i)
            .unwrap();
        p.server.send(&p.eq_b, &b.all(), MsgFlags::NONE, i).unwrap();
        p.eq_a.wait_all(None).unwrap();
        p.eq_b.wait_all(None).unwrap();
    }
    let st = p.server.stats().unwrap();
    // 20 adverts, and fewer explicit ACK-only messages than messages acknowledged.
    assert_eq!(st.message.adverts_sent, 20);
    assert!(
        st.link.ctrl_sent < 40,
        "server sent {} control messages for 20 replies",
        st.link.ctrl_sent
    );
}

/// Reads larger than the transport's largest message are split, and the pieces land in order.
#[test]
fn reads_are_chunked_at_the_transports_message_limit() {
    let mut cfg = SimConfig::default();
    cfg.caps.max_message = 4096;
    let p = pair_with(SockType::SeqPacket, cfg, exs::SocketOptions::default());
    let data = pattern(100_000, 4);
    let (_, r, got) = p.transfer(&data, 100_000);
    assert_eq!(r.bytes, 100_000);
    assert_bytes_eq(&got, &data, "content");
    assert_eq!(p.server.stats().unwrap().link.reads, 25);
}

/// A send queue of 4 entries and a read depth of 1 still carry 64 messages.
#[test]
fn tiny_send_queue_and_read_depth_still_deliver_everything() {
    let mut cfg = SimConfig::default();
    cfg.caps.max_send_wr = 4;
    cfg.caps.max_read_depth = 1;
    cfg.caps.max_message = 1000;
    let p = pair_with(
        SockType::SeqPacket,
        cfg,
        SocketOptions::default()
            .with_send_credits(32)
            .with_recv_credits(32),
    );
    let src = p.client_region(pattern(64 * 3000, 8));
    let dst = p.server_region(64 * 3000);
    for i in 0..64 {
        p.server
            .recv(
                &p.eq_b,
                &dst.slice(i * 3000..(i + 1) * 3000),
                MsgFlags::NONE,
                i as u64,
            )
            .unwrap();
        p.client
            .send(
                &p.eq_a,
                &src.slice(i * 3000..(i + 1) * 3000),
                MsgFlags::NONE,
                i as u64,
            )
            .unwrap();
    }
    assert!(p.eq_b.wait_all(None).unwrap().iter().all(|e| e.is_ok()));
    assert!(p.eq_a.wait_all(None).unwrap().iter().all(|e| e.is_ok()));
    assert_bytes_eq(&dst.to_vec().unwrap(), &src.to_vec().unwrap(), "dst");
}

/// Offset-addressed providers (libfabric with mr_mode without FI_MR_VIRT_ADDR) address remote memory from 0.
#[test]
fn offset_addressing_transport_works() {
    let cfg = SimConfig {
        offset_addressing: true,
        ..SimConfig::default()
    };
    let p = pair_with(SockType::SeqPacket, cfg, exs::SocketOptions::default());
    let data = pattern(50_000, 12);
    let (_, r, got) = p.transfer(&data, 50_000);
    assert_eq!(r.bytes, 50_000);
    assert_bytes_eq(&got, &data, "content");
}

/// The control link never overruns the peer's receive buffers: with the smallest window and receiver-not-ready
/// fatal, a long one-way burst and a two-way exchange finish with no RNR, one message per buffer (the window is
/// the bottleneck) and several per buffer (coalescing).
#[test]
fn smallest_control_window_never_overruns_the_peer() {
    smallest_window_exchange(false);
    smallest_window_exchange(true);
}

fn smallest_window_exchange(coalesce: bool) {
    let cfg = SimConfig {
        rnr: RnrPolicy::Fail,
        ..SimConfig::default()
    };
    let opts = SocketOptions::default()
        .with_control_window(4)
        .with_send_credits(8)
        .with_recv_credits(8)
        .with_coalesce(coalesce);
    let p = pair_with(SockType::SeqPacket, cfg, opts);
    let src = p.client_region(pattern(200 * 64, 1));
    let back = MemoryRegion::from_vec(&p.b, pattern(200 * 64, 2)).unwrap();
    let dst = p.server_region(200 * 64);
    let back_dst = MemoryRegion::alloc(&p.a, 200 * 64).unwrap();
    for i in 0..200 {
        let r = i * 64..(i + 1) * 64;
        p.server
            .recv(&p.eq_b, &dst.slice(r.clone()), MsgFlags::NONE, i as u64)
            .unwrap();
        p.client
            .recv(
                &p.eq_a,
                &back_dst.slice(r.clone()),
                MsgFlags::NONE,
                i as u64,
            )
            .unwrap();
        p.client
            .send(&p.eq_a, &src.slice(r.clone()), MsgFlags::NONE, i as u64)
            .unwrap();
        p.server
            .send(&p.eq_b, &back.slice(r), MsgFlags::NONE, i as u64)
            .unwrap();
    }
    assert!(p.eq_a.wait_all(None).unwrap().iter().all(|e| e.is_ok()));
    assert!(p.eq_b.wait_all(None).unwrap().iter().all(|e| e.is_ok()));
    assert_eq!(p.world.stats().rnr, 0);
    assert_bytes_eq(&dst.to_vec().unwrap(), &src.to_vec().unwrap(), "dst");
    assert_bytes_eq(
        &back_dst.to_vec().unwrap(),
        &back.to_vec().unwrap(),
        "back_dst",
    );
    let link = p.client.stats().unwrap().link;
    if coalesce {
        assert!(link.packets > 0, "messages shared buffers: {link:?}");
    } else {
        assert!(link.credit_stalls > 0, "the window was the bottleneck");
    }
}

/// Libfabric providers whose write-with-immediate does not consume a receive (no FI_RX_CQ_DATA) are fine too.
#[test]
fn transports_where_immediate_writes_do_not_consume_receives() {
    let mut cfg = SimConfig::default();
    cfg.caps.imm_consumes_recv = false;
    let p = pair_with(SockType::SeqPacket, cfg, exs::SocketOptions::default());
    let data = pattern(9000, 3);
    let (_, _, got) = p.transfer(&data, 9000);
    assert_bytes_eq(&got, &data, "content");
}

/// Different seeds interleave deliveries of several connections differently; every connection still gets its
/// messages in order and intact.
#[test]
fn many_connections_interleave_under_seeded_jitter() {
    for seed in 1..=8 {
        let cfg = SimConfig {
            seed,
            jitter: std::time::Duration::from_micros(50),
            ..SimConfig::default()
        };
        let world = exs::sim::World::new(cfg);
        let a = world.host();
        let b = world.host();
        let eq_a = exs::EventQueue::new(4096).unwrap();
        let eq_b = exs::EventQueue::new(4096).unwrap();
        let l = exs::Socket::new(&b, SockType::SeqPacket).unwrap();
        l.bind(world.addr(1, 9)).unwrap();
        let addr = l.listen(16).unwrap();
        let mut clients = Vec::new();
        for c in 0..4u64 {
            l.accept(&eq_b, c).unwrap();
            let s = exs::Socket::new(&a, SockType::SeqPacket).unwrap();
            s.connect(&eq_a, addr, c).unwrap();
            clients.push(s);
        }
        let mut accepted: Vec<exs::Socket> = eq_b
            .wait_all(None)
            .unwrap()
            .into_iter()
            .map(|mut e| e.take_accepted().unwrap())
            .collect();
        assert!(eq_a.wait_all(None).unwrap().iter().all(|e| e.is_ok()));
        // Jitter reorders the connection requests: pair each client with the server socket whose peer it is.
        let servers: Vec<exs::Socket> = clients
            .iter()
            .map(|c| {
                let me = c.local_addr().unwrap();
                let i = accepted
                    .iter()
                    .position(|s| s.peer_addr().unwrap() == me)
                    .expect("accepted");
                accepted.remove(i)
            })
            .collect();
        let src = MemoryRegion::from_vec(&a, pattern(4 * 20 * 1500, seed)).unwrap();
        let dst = MemoryRegion::alloc(&b, 4 * 20 * 1500).unwrap();
        for (ci, (c, s)) in clients.iter().zip(&servers).enumerate() {
            for m in 0..20 {
                let off = (ci * 20 + m) * 1500;
                s.recv(
                    &eq_b,
                    &dst.slice(off..off + 1500),
                    MsgFlags::NONE,
                    off as u64,
                )
                .unwrap();
                c.send(
                    &eq_a,
                    &src.slice(off..off + 1500),
                    MsgFlags::NONE,
                    off as u64,
                )
                .unwrap();
            }
        }
        let evs = eq_b.wait_all(None).unwrap();
        assert!(evs.iter().all(|e| e.is_ok() && e.bytes == 1500));
        eq_a.wait_all(None).unwrap();
        assert_bytes_eq(&dst.to_vec().unwrap(), &src.to_vec().unwrap(), "dst");
    }
}

/// The same transfer in a world where every context has its own progress thread.
#[test]
fn threaded_world_moves_messages() {
    let world = exs::sim::World::threaded(SimConfig::default());
    let a = world.host();
    let b = world.host();
    let eq_a = exs::EventQueue::new(256).unwrap();
    let eq_b = exs::EventQueue::new(256).unwrap();
    let l = exs::Socket::new(&b, SockType::SeqPacket).unwrap();
    l.bind(world.addr(1, 1)).unwrap();
    let addr = l.listen(4).unwrap();
    l.accept(&eq_b, 0).unwrap();
    let c = exs::Socket::new(&a, SockType::SeqPacket).unwrap();
    c.connect(&eq_a, addr, 0).unwrap();
    assert!(wait(&eq_a).is_ok());
    let s = wait(&eq_b).take_accepted().unwrap();
    let src = MemoryRegion::from_vec(&a, pattern(100 * 10_000, 1)).unwrap();
    let dst = MemoryRegion::alloc(&b, 100 * 10_000).unwrap();
    for i in 0..100 {
        s.recv(
            &eq_b,
            &dst.slice(i * 10_000..(i + 1) * 10_000),
            MsgFlags::NONE,
            i as u64,
        )
        .unwrap();
    }
    for i in 0..100 {
        loop {
            match c.send(
                &eq_a,
                &src.slice(i * 10_000..(i + 1) * 10_000),
                MsgFlags::NONE,
                i as u64,
            ) {
                Ok(()) => break,
                Err(exs::SendError::Queue(_)) => {
                    wait(&eq_a);
                }
                Err(e) => panic!("{e}"),
            }
        }
    }
    let evs = eq_b
        .wait_all(Some(std::time::Duration::from_secs(30)))
        .unwrap();
    assert_eq!(evs.len(), 100);
    assert!(evs.iter().all(|e| e.is_ok()));
    eq_a.wait_all(Some(std::time::Duration::from_secs(30)))
        .unwrap();
    assert_bytes_eq(&dst.to_vec().unwrap(), &src.to_vec().unwrap(), "dst");
}

/// Regression (found by the two-process conformance test): an immediate message that arrives before any receive
/// is posted is stored; the receive posted later must complete at once.
#[test]
fn immediate_message_arriving_before_the_receive_completes_when_it_is_posted() {
    let p = pair(SockType::SeqPacket);
    let src = p.client_region(pattern(10, 1));
    p.client
        .send(&p.eq_a, &src.all(), MsgFlags::NONE, 1)
        .unwrap();
    p.world.run_until_idle(1000);
    assert_eq!(
        p.server.stats().unwrap().message.adverts_received,
        1,
        "the advert is waiting at the receiver"
    );
    let dst = p.server_region(10);
    p.server
        .recv(&p.eq_b, &dst.all(), MsgFlags::NONE, 2)
        .unwrap();
    let r = wait(&p.eq_b);
    assert_eq!((r.bytes, &r.status), (10, &Ok(())));
    assert!(wait(&p.eq_a).is_ok());
    assert_bytes_eq(&dst.to_vec().unwrap(), &pattern(10, 1), "immediate data");
}

/// Regression (found by the property test once adverts could arrive first): a message into a zero-length buffer
/// needs no read; when its advert came before the receive, the receive must still complete.
#[test]
fn advert_arriving_before_a_zero_length_receive_completes_it_truncated() {
    let p = pair_with(
        SockType::SeqPacket,
        SimConfig::default(),
        SocketOptions::default().with_small_packet_max_size(0),
    );
    let src = p.client_region(pattern(2048, 1));
    p.client
        .send(&p.eq_a, &src.all(), MsgFlags::NONE, 1)
        .unwrap();
    p.world.run_until_idle(1000);
    let dst = p.server_region(10);
    p.server
        .recv(&p.eq_b, &dst.slice(0..0), MsgFlags::NONE, 2)
        .unwrap();
    let r = wait(&p.eq_b);
    assert_eq!((r.bytes, r.flags.truncated, &r.status), (0, true, &Ok(())));
    assert!(wait(&p.eq_a).is_ok());
}

/// Seed 002, 4.1: immediate data travels inside the advertisement, so once that message has left the send is
/// done (its buffer is free), like TCP's `send`; it does not wait for the receiver to take it and acknowledge.
#[test]
fn an_immediate_send_completes_once_its_message_left_not_at_the_acknowledgment() {
    let p = pair_with(
        SockType::SeqPacket,
        SimConfig::default(),
        SocketOptions::default().with_small_packet_max_size(64),
    );
    let data = pattern(48, 9);
    let src = p.client_region(data.clone());
    p.client
        .send(&p.eq_a, &src.all(), MsgFlags::NONE, 1)
        .unwrap();
    // No receive is posted at the server: nothing can be acknowledged yet.
    let s = wait(&p.eq_a);
    assert_eq!((s.kind, s.bytes), (EventKind::Send, 48), "{s:?}");
    assert!(s.is_ok(), "{s:?}");
    let st = p.client.stats().unwrap();
    assert_eq!(st.message.immediate_sent, 1);
    let dst = p.server_region(64);
    p.server
        .recv(&p.eq_b, &dst.all(), MsgFlags::NONE, 2)
        .unwrap();
    let r = wait(&p.eq_b);
    assert_eq!(r.bytes, 48);
    assert_eq!(&dst.to_vec().unwrap()[..48], &data[..]);
}

/// Issue 12: small immediate sends made while a control send is in flight leave together, several per send and
/// per peer buffer; every message arrives whole and in order. Without coalescing each takes its own buffer.
#[test]
fn a_burst_of_small_sends_shares_buffers_and_arrives_in_order() {
    for coalesce in [true, false] {
        let p = pair_with(
            SockType::SeqPacket,
            SimConfig::default(),
            SocketOptions::default().with_coalesce(coalesce),
        );
        let n = 100;
        let src = p.client_region(pattern(64 * n, 4));
        let dst = p.server_region(64 * n);
        for i in 0..n {
            let r = i * 64..(i + 1) * 64;
            p.server
                .recv(&p.eq_b, &dst.slice(r.clone()), MsgFlags::NONE, i as u64)
                .unwrap();
            p.client
                .send(&p.eq_a, &src.slice(r), MsgFlags::NONE, i as u64)
                .unwrap();
        }
        let got = p.eq_b.wait_all(None).unwrap();
        assert_eq!(got.len(), n);
        for (i, e) in got.iter().enumerate() {
            assert!(e.is_ok() && e.bytes == 64 && e.context == i as u64, "{e:?}");
        }
        assert!(p.eq_a.wait_all(None).unwrap().iter().all(|e| e.is_ok()));
        assert_bytes_eq(&dst.to_vec().unwrap(), &src.to_vec().unwrap(), "burst");
        let link = p.client.stats().unwrap().link;
        let buffers = link.ctrl_sends();
        if coalesce {
            assert!(link.packets > 0 && buffers * 2 < n as u64, "{link:?}");
        } else {
            assert_eq!(link.packets, 0);
            assert!(buffers >= n as u64, "{link:?}");
        }
    }
}

/// The bound on a connection's queued control messages counts only those waiting: a connection that sends many
/// more than the bound over its life, each advert and acknowledgment leaving as credits come back, keeps going.
#[test]
fn more_control_messages_than_a_connection_may_queue_go_through_over_its_life() {
    let p = pair(SockType::SeqPacket);
    for i in 0..5000u64 {
        let data = pattern(64, i);
        let (s, r, got) = p.transfer(&data, 64);
        assert!(s.is_ok() && r.is_ok(), "message {i}: {s:?} {r:?}");
        assert_eq!(got, data, "message {i}");
    }
    let link = p.client.stats().unwrap().link;
    assert!(link.ctrl_sent >= 5000, "{link:?}");
    assert_eq!(link.ctrl_queued, 0, "{link:?}");
}

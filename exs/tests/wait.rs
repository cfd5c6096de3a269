//! Seed 004 (US 7,577,712), the adaptive completion wait, against real protocol completions.
#![cfg(feature = "sim")] // the simulated fabric: `cargo test -p exs --features sim`

mod common;

use std::time::Duration;

use common::*;
use exs::sim::{SimConfig, World};
use exs::{EventQueue, MemoryRegion, MsgFlags, SockType, Socket, WaitMode};

fn threaded_pair() -> (World, Socket, Socket, exs::Context, exs::Context) {
    let world = World::threaded(SimConfig::default());
    let a = world.host();
    let b = world.host();
    let (eq_a, eq_b) = (EventQueue::new(16).unwrap(), EventQueue::new(16).unwrap());
    let l = Socket::new(&b, SockType::SeqPacket).unwrap();
    l.set_options(l.options().unwrap().with_recv_credits(64))
        .unwrap();
    l.bind(world.addr(1, 1)).unwrap();
    let addr = l.listen(1).unwrap();
    l.accept(&eq_b, 0).unwrap();
    let c = Socket::new(&a, SockType::SeqPacket).unwrap();
    c.set_options(c.options().unwrap().with_send_credits(64))
        .unwrap();
    c.connect(&eq_a, addr, 0).unwrap();
    assert!(wait(&eq_a).is_ok());
    let s = wait(&eq_b).take_accepted().unwrap();
    (world, c, s, a, b)
}

/// "Usually a process will not need to block more than once": waiting for a batch of 32 sends sleeps once.
#[test]
fn adaptive_wait_sleeps_once_for_a_batch_of_completions() {
    let (_world, c, s, a, b) = threaded_pair();
    let src = MemoryRegion::from_vec(&a, pattern(32 * 4096, 1)).unwrap();
    let dst = MemoryRegion::alloc(&b, 32 * 4096).unwrap();
    let rq = EventQueue::new(64).unwrap();
    for i in 0..32 {
        s.recv(
            &rq,
            &dst.slice(i * 4096..(i + 1) * 4096),
            MsgFlags::NONE,
            i as u64,
        )
        .unwrap();
    }
    let sq = EventQueue::new(64).unwrap();
    for i in 0..32 {
        c.send(
            &sq,
            &src.slice(i * 4096..(i + 1) * 4096),
            MsgFlags::NONE,
            i as u64,
        )
        .unwrap();
    }
    let evs = sq.wait_all(Some(Duration::from_secs(20))).unwrap();
    assert_eq!(evs.len(), 32);
    let st = sq.stats();
    assert!(
        st.blocks <= 1,
        "slept {} times for one batch: {st:?}",
        st.blocks
    );
    assert!(st.wakeups <= 1, "{st:?}");
    assert_eq!(
        rq.wait_all(Some(Duration::from_secs(20))).unwrap().len(),
        32
    );
    assert_bytes_eq(&dst.to_vec().unwrap(), &src.to_vec().unwrap(), "batch");
}

/// Completions that trickle in (the receiver posts one receive per millisecond): the adaptive wait still sleeps
/// once for the batch, while waking on every event (the behaviour the patent improves on) sleeps per event.
#[test]
fn trickling_completions_adaptive_sleeps_once_block_mode_per_event() {
    for mode in [WaitMode::Adaptive { spin: 0 }, WaitMode::Block] {
        let (_world, c, s, a, b) = threaded_pair();
        let src = MemoryRegion::from_vec(&a, pattern(16 * 4096, 1)).unwrap();
        let dst = MemoryRegion::alloc(&b, 16 * 4096).unwrap();
        let sq = EventQueue::with_mode(64, mode).unwrap();
        for i in 0..16 {
            c.send(
                &sq,
                &src.slice(i * 4096..(i + 1) * 4096),
                MsgFlags::NONE,
                i as u64,
            )
            .unwrap();
        }
        let poster = std::thread::spawn(move || {
            let rq = EventQueue::new(64).unwrap();
            for i in 0..16 {
                std::thread::sleep(Duration::from_millis(1));
                s.recv(
                    &rq,
                    &dst.slice(i * 4096..(i + 1) * 4096),
                    MsgFlags::NONE,
                    i as u64,
                )
                .unwrap();
            }
            rq.wait_all(Some(Duration::from_secs(20))).unwrap().len()
        });
        let mut out = Vec::new();
        while out.len() < 16 {
            let missing = 16 - out.len();
            sq.dequeue(&mut out, missing, missing, Some(Duration::from_secs(20)))
                .unwrap();
        }
        assert_eq!(poster.join().unwrap(), 16);
        let st = sq.stats();
        match mode {
            WaitMode::Adaptive { .. } => assert_eq!(st.blocks, 1, "adaptive: {st:?}"),
            _ => assert!(st.blocks >= 8, "block mode should sleep per event: {st:?}"),
        }
    }
}

/// In the manual simulator, waiting drives the world: one "block" per batch, and a wait that can never be
/// satisfied reports a stall instead of hanging.
#[test]
fn manual_world_drives_while_waiting_and_reports_stalls() {
    let p = pair(SockType::SeqPacket);
    let dst = p.server_region(16 * 100);
    let src = p.client_region(pattern(16 * 100, 2));
    for i in 0..16 {
        p.server
            .recv(
                &p.eq_b,
                &dst.slice(i * 100..(i + 1) * 100),
                MsgFlags::NONE,
                i as u64,
            )
            .unwrap();
        p.client
            .send(
                &p.eq_a,
                &src.slice(i * 100..(i + 1) * 100),
                MsgFlags::NONE,
                i as u64,
            )
            .unwrap();
    }
    let before = p.eq_b.stats().blocks;
    assert_eq!(p.eq_b.wait_all(None).unwrap().len(), 16);
    assert_eq!(p.eq_b.stats().blocks - before, 1);
    // Nothing is coming for this receive: the simulator says so instead of hanging.
    p.server
        .recv(&p.eq_b, &dst.slice(0..10), MsgFlags::NONE, 99)
        .unwrap();
    match p.eq_b.next(None) {
        Err(exs::DequeueError::Stalled {
            waiting: 1,
            outstanding: 1,
        }) => {}
        other => panic!("{other:?}"),
    }
}

#[test]
fn busy_poll_mode_completes_without_sleeping() {
    let (_world, c, s, a, b) = threaded_pair();
    let src = MemoryRegion::from_vec(&a, pattern(8 * 1000, 1)).unwrap();
    let dst = MemoryRegion::alloc(&b, 8 * 1000).unwrap();
    let rq = EventQueue::with_mode(64, WaitMode::BusyPoll).unwrap();
    let sq = EventQueue::with_mode(64, WaitMode::BusyPoll).unwrap();
    for i in 0..8 {
        s.recv(
            &rq,
            &dst.slice(i * 1000..(i + 1) * 1000),
            MsgFlags::NONE,
            i as u64,
        )
        .unwrap();
        c.send(
            &sq,
            &src.slice(i * 1000..(i + 1) * 1000),
            MsgFlags::NONE,
            i as u64,
        )
        .unwrap();
    }
    assert_eq!(sq.wait_all(Some(Duration::from_secs(20))).unwrap().len(), 8);
    assert_eq!(rq.wait_all(Some(Duration::from_secs(20))).unwrap().len(), 8);
    assert_eq!((sq.stats().blocks, rq.stats().blocks), (0, 0));
}

/// The descriptor exists from the queue's creation (taking it cannot fail) but is kept in sync only once taken:
/// taken after events arrived, it is readable at once; once they are dequeued it is not.
#[test]
fn a_queue_descriptor_taken_after_events_arrived_is_readable_at_once() {
    use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
    use std::os::fd::AsFd;
    let p = pair_threaded(SockType::SeqPacket, exs::SocketOptions::default());
    let dst = p.server_region(100);
    p.server
        .recv(&p.eq_b, &dst.all(), MsgFlags::NONE, 1)
        .unwrap();
    let src = p.client_region(pattern(100, 3));
    p.client
        .send(&p.eq_a, &src.all(), MsgFlags::NONE, 2)
        .unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while p.eq_b.is_empty() {
        assert!(
            std::time::Instant::now() < deadline,
            "the receive never completed"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    let readable = || {
        let mut fds = [PollFd::new(p.eq_b.as_fd(), PollFlags::POLLIN)];
        poll(&mut fds, PollTimeout::ZERO).unwrap() == 1
    };
    assert!(
        readable(),
        "events were queued before the descriptor was taken"
    );
    assert!(wait(&p.eq_b).is_ok());
    assert!(!readable(), "nothing queued any more");
}

/// Issue 16: an event queue is a descriptor for epoll, mio or tokio: readable exactly while events are queued,
/// with progress made by the context's progress thread while the application sleeps in `poll(2)`.
#[test]
fn the_queue_descriptor_is_readable_exactly_while_events_are_queued() {
    use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
    use std::os::fd::AsFd;
    let p = pair_threaded(SockType::SeqPacket, exs::SocketOptions::default());
    let readable = |ms: u16| {
        let mut fds = [PollFd::new(p.eq_b.as_fd(), PollFlags::POLLIN)];
        poll(&mut fds, PollTimeout::from(ms)).unwrap() == 1
    };
    assert!(!readable(0), "an empty queue is not readable");
    let dst = p.server_region(100);
    p.server
        .recv(&p.eq_b, &dst.all(), MsgFlags::NONE, 1)
        .unwrap();
    assert!(!readable(20), "nothing arrived yet");
    let src = p.client_region(pattern(100, 3));
    p.client
        .send(&p.eq_a, &src.all(), MsgFlags::NONE, 2)
        .unwrap();
    assert!(
        readable(10_000),
        "the receive completed while this thread slept in poll(2)"
    );
    assert!(
        readable(0),
        "level-triggered: still readable until dequeued"
    );
    let mut evs = Vec::new();
    assert_eq!(p.eq_b.poll(&mut evs, 8), 1);
    assert!(evs[0].is_ok());
    assert!(!readable(0), "empty again");
}

/// The adaptive wait's spin on a real exchange (threaded simulated contexts): with a spin long enough for any
/// round trip here (a second at most, an eighth of it at least, whatever the load on the machine), the client's
/// waits are answered by spinning, driving the contexts itself, not by sleeping and being woken; with the spin
/// turned off, every wait that found nothing sleeps. (How long the default spin lasts is learned from the
/// machine's round trips: `adaptive_spin_follows_recent_waits` tests that without timing.)
#[test]
fn a_fast_ping_pong_is_answered_by_spinning_unless_the_spin_is_off() {
    for spin in [true, false] {
        let (_world, c, s, a, b) = threaded_pair();
        let out = MemoryRegion::from_vec(&a, pattern(32, 3)).unwrap();
        let back = MemoryRegion::alloc(&a, 32).unwrap();
        let sbuf = MemoryRegion::alloc(&b, 32).unwrap();
        let (cq, sq) = (EventQueue::new(16).unwrap(), EventQueue::new(16).unwrap());
        cq.set_adaptive_spin(if spin {
            Duration::from_secs(1)
        } else {
            Duration::ZERO
        });
        let echo = std::thread::spawn(move || {
            for _ in 0..200 {
                s.recv(&sq, &sbuf.all(), MsgFlags::NONE, 1).unwrap();
                let r = wait(&sq);
                assert!(r.is_ok(), "{r:?}");
                s.send(&sq, &sbuf.slice(..r.bytes), MsgFlags::NONE, 2)
                    .unwrap();
                assert!(wait(&sq).is_ok());
            }
        });
        for _ in 0..200 {
            c.recv(&cq, &back.all(), MsgFlags::NONE, 1).unwrap();
            c.send(&cq, &out.all(), MsgFlags::NONE, 2).unwrap();
            let mut evs = Vec::new();
            cq.dequeue(&mut evs, 2, 2, Some(Duration::from_secs(20)))
                .unwrap();
            assert!(evs.iter().all(|e| e.is_ok()), "{evs:?}");
        }
        echo.join().unwrap();
        let st = cq.stats();
        if spin {
            assert!(
                st.spun > 0,
                "no wait of 200 round trips was answered by spinning: {st:?}"
            );
        } else {
            assert_eq!(st.spun, 0, "{st:?}");
            assert!(st.blocks > 0, "{st:?}");
        }
    }
}

/// A dequeue drives the contexts attached to its queue, and a socket attaches its context to the queue of each
/// call; it remembers only the last queue it attached to (attaching takes a lock and reference counts), so a
/// socket going back and forth between two queues must attach again at every change. Here each send's
/// completion is dequeued first, from the queue the send named, with nothing else driving the world.
#[test]
fn a_socket_going_back_and_forth_between_queues_is_driven_from_each() {
    let p = pair(SockType::SeqPacket);
    let queues = [EventQueue::new(8).unwrap(), EventQueue::new(8).unwrap()];
    let src = p.client_region(vec![7; 8]);
    let dst = p.server_region(8);
    for round in 0..4u64 {
        let q = &queues[round as usize % 2];
        p.server
            .recv(&p.eq_b, &dst.all(), MsgFlags::NONE, round)
            .unwrap();
        p.client.send(q, &src.all(), MsgFlags::NONE, round).unwrap();
        let sent = q.next(Some(Duration::from_secs(10))).unwrap();
        assert!(
            sent.is_ok() && sent.context == round,
            "round {round}: {sent:?}"
        );
        assert!(wait(&p.eq_b).is_ok());
    }
}

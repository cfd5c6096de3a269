//! Who makes progress (issue 12): API calls wake nobody, the waiting thread leads, the progress thread is the
//! fallback while the application computes. Counted, never timed.
#![cfg(feature = "sim")] // the simulated fabric: `cargo test -p exs --features sim`

mod common;

use std::time::{Duration, Instant};

use common::{pair, pair_threaded, pattern, wait, Pair};
use exs::sim::{SimConfig, World};
use exs::{
    EventKind, EventQueue, MemoryRegion, MsgFlags, SockType, Socket, SocketOptions, WaitMode,
};

const ROUND_TRIPS: usize = 300;

/// A blocking ping-pong of [`ROUND_TRIPS`] 32-byte messages on the pair's own queues (see
/// `exs::testing::Pair::ping_pong_on`).
fn ping_pong<S>(p: &Pair, snap: impl Fn(&exs::testing::Pair) -> S) -> (S, S) {
    p.ping_pong_on(&p.eq_a, &p.eq_b, ROUND_TRIPS, snap).unwrap()
}

/// A threaded pair for busy polling, and a busy-polling queue for each side.
fn busy_pair() -> (Pair, EventQueue, EventQueue) {
    let p = pair_threaded(
        SockType::SeqPacket,
        SocketOptions::default().with_small_packet_max_size(64),
    );
    let q = || EventQueue::with_mode(64, WaitMode::BusyPoll).unwrap();
    (p, q(), q())
}

/// Posting work is a system-call-free step: no call writes an eventfd to wake the progress thread.
#[test]
fn api_calls_wake_no_thread() {
    let p = pair_threaded(SockType::SeqPacket, exs::SocketOptions::default());
    // Let the progress threads settle (they lead while nobody waits).
    std::thread::sleep(Duration::from_millis(50));
    let before = p.b.progress_stats();
    let bufs: Vec<MemoryRegion> = (0..50).map(|_| p.server_region(64)).collect();
    for (i, b) in bufs.iter().enumerate() {
        p.server
            .recv(&p.eq_b, &b.all(), MsgFlags::NONE, i as u64)
            .unwrap();
    }
    let after = p.b.progress_stats();
    assert_eq!(
        after.timer_kicks, before.timer_kicks,
        "{before:?} -> {after:?}"
    );
    // The old design wrote the context's eventfd once per call: a wake-up per receive posted here.
    assert!(
        after.thread_wakeups - before.thread_wakeups <= 2,
        "posting 50 receives woke the progress thread: {before:?} -> {after:?}"
    );
}

/// A blocking dequeue runs the protocol itself and sleeps on the transport's descriptor; the progress thread
/// stands aside, so a ping-pong costs far fewer progress-thread wake-ups than round trips.
#[test]
fn the_waiting_thread_leads_and_the_progress_thread_stands_aside() {
    let p = pair_threaded(
        SockType::SeqPacket,
        SocketOptions::default().with_small_packet_max_size(64),
    );
    let ((a0, b0), (a1, b1)) = ping_pong(&p, |p| (p.a.progress_stats(), p.b.progress_stats()));
    let leads = a1.app_leads - a0.app_leads + b1.app_leads - b0.app_leads;
    let wakeups = a1.thread_wakeups - a0.thread_wakeups + b1.thread_wakeups - b0.thread_wakeups;
    assert!(leads > 0, "no application thread led: {a1:?} {b1:?}");
    assert!(
        a1.app_sleeps + b1.app_sleeps > 0,
        "no application thread slept on the transport: {a1:?} {b1:?}"
    );
    // The old design woke a progress thread at least once per operation, several times per round trip.
    assert!(
        (wakeups as usize) < ROUND_TRIPS,
        "{wakeups} progress-thread wake-ups for {ROUND_TRIPS} round trips: {a1:?} {b1:?}"
    );
}

/// A blocking ping-pong of `ROUND_TRIPS` on the simulated fabric, where arming and reading the connection channel
/// are calls the software providers pay for with system calls: the arms and the connection-event reads of both
/// sides, the messages, and both sides' counters after it.
fn blocking_ping_pong_counts() -> (u64, u64, u64, String) {
    let p = pair_threaded(
        SockType::SeqPacket,
        SocketOptions::default().with_small_packet_max_size(64),
    );
    let ((a0, b0), (a1, b1)) = ping_pong(&p, |p| (p.a.stats(), p.b.stats()));
    let arms = a1.arms - a0.arms + b1.arms - b0.arms;
    let cm = a1.cm_polls - a0.cm_polls + b1.cm_polls - b0.cm_polls;
    let msgs = 2 * ROUND_TRIPS as u64;
    eprintln!(
        "per message: {:.2} arms, {:.2} connection-event reads",
        arms as f64 / msgs as f64,
        cm as f64 / msgs as f64
    );
    (arms, cm, msgs, format!("{a1:?} {b1:?}"))
}

/// Issue 12, the system calls of a blocking ping-pong: a wake-up that brings the awaited events does not arm the
/// transport again (a leader arms once per sleep, not once per round), and rounds that handle completions look
/// at connection events only now and then.
#[test]
fn a_blocking_ping_pong_arms_once_per_sleep_and_rarely_reads_connection_events() {
    let (arms, cm, msgs, stats) = blocking_ping_pong_counts();
    // Before, every round read the channel, and every wake-up armed again before it looked at its queue: enough
    // of each per message to break both bounds below.
    assert!(arms > 0, "nobody slept: {stats}");
    assert!(arms <= 2 * msgs, "{arms} arms for {msgs} messages");
    assert!(
        cm * 2 <= 3 * msgs,
        "{cm} connection-event reads for {msgs} messages"
    );
}

/// Connection events in a blocking ping-pong where a successful arm also says the event channel is empty
/// (`Transport::arm_covers_cm`, as libfabric's `fi_trywait` and the simulated fabric): the round before each sleep,
/// which finds no completions, no longer reads the channel; it is read after an arm that fails, and every few
/// rounds. Before, that round read it once per message or so (a system call each on software providers).
#[test]
fn a_blocking_ping_pong_reads_connection_events_only_after_a_failed_arm_or_every_few_rounds() {
    let (_, cm, msgs, stats) = blocking_ping_pong_counts();
    assert!(
        cm * 5 <= 2 * msgs,
        "{cm} connection-event reads for {msgs} messages: {stats}"
    );
}

/// Issue 12, context switches of a busy ping-pong: while application threads busy-poll, the progress threads
/// sleep (they check back every `MAX_BACKOFF` whether the polling has ended) and run no rounds. They used to check
/// back every millisecond and run a round (two context switches per wake-up). Bounded by the time the ping-pong
/// took, not timed: before, at least one wake-up per context and millisecond.
#[test]
fn a_busy_ping_pong_leaves_the_progress_threads_asleep() {
    let (p, qa, qb) = busy_pair();
    // Let both progress threads notice the pollers once they start (they check back every MAX_BACKOFF).
    std::thread::sleep(Duration::from_millis(30));
    let ((a0, b0, t0), (a1, b1, t1)) = p
        .ping_pong_on(&qa, &qb, ROUND_TRIPS, |p| {
            (p.a.progress_stats(), p.b.progress_stats(), Instant::now())
        })
        .unwrap();
    let wakeups = a1.thread_wakeups - a0.thread_wakeups + b1.thread_wakeups - b0.thread_wakeups;
    let ms = (t1 - t0).as_millis() as u64;
    eprintln!("{wakeups} progress-thread wake-ups in {ms} ms of busy ping-pong");
    // Two contexts, one check-back per `MAX_BACKOFF` each (a poller between two dequeues still counts as
    // polling), with room for twice that per context, where the old code checked back every millisecond.
    assert!(
        wakeups <= 4 * (ms / 8 + 1) + 8,
        "{wakeups} wake-ups in {ms} ms: {a1:?} {b1:?}"
    );
}

/// A busy poller stands in for the progress thread, connection events included: a connection request and its
/// establishment reach applications that only ever busy-poll (the progress threads run no rounds meanwhile).
#[test]
fn a_busy_poller_handles_connection_events_itself() {
    let world = World::threaded(SimConfig::default());
    let (a, b) = (world.host(), world.host());
    let (qa, qb) = (
        EventQueue::with_mode(16, WaitMode::BusyPoll).unwrap(),
        EventQueue::with_mode(16, WaitMode::BusyPoll).unwrap(),
    );
    let l = Socket::new(&b, SockType::SeqPacket).unwrap();
    l.bind(world.addr(1, 1)).unwrap();
    let addr = l.listen(1).unwrap();
    l.accept(&qb, 7).unwrap();
    let server = {
        let qb = qb.clone();
        std::thread::spawn(move || qb.next(Some(Duration::from_secs(30))))
    };
    // The server polls before the request exists, so its progress thread stands aside when it comes.
    std::thread::sleep(Duration::from_millis(30));
    let c = Socket::new(&a, SockType::SeqPacket).unwrap();
    c.connect(&qa, addr, 8).unwrap();
    let ev = qa.next(Some(Duration::from_secs(30))).unwrap();
    assert_eq!((ev.kind, ev.context), (EventKind::Connect, 8), "{ev:?}");
    assert!(ev.is_ok(), "{ev:?}");
    let mut ev = server.join().unwrap().unwrap();
    assert_eq!((ev.kind, ev.context), (EventKind::Accept, 7), "{ev:?}");
    assert!(ev.take_accepted().is_some(), "{ev:?}");
}

/// While the receiving application computes (no dequeue), its progress thread still answers the peer: a normal
/// send (advert, RDMA read by the receiver, acknowledgment) completes at the sender.
#[test]
fn the_progress_thread_answers_while_the_application_computes() {
    let p = pair_threaded(
        SockType::SeqPacket,
        SocketOptions::default().with_small_packet_max_size(0),
    );
    let data = pattern(64 * 1024, 3);
    let src = p.client_region(data.clone());
    let dst = p.server_region(data.len());
    p.server
        .recv(&p.eq_b, &dst.all(), MsgFlags::NONE, 1)
        .unwrap();
    // Let the server's progress thread take the lead (nobody waits on the server side from here on).
    std::thread::sleep(Duration::from_millis(20));
    p.client
        .send(&p.eq_a, &src.all(), MsgFlags::NONE, 2)
        .unwrap();
    let s = wait(&p.eq_a);
    assert_eq!((s.kind, s.bytes), (EventKind::Send, data.len()), "{s:?}");
    assert!(s.is_ok(), "{s:?}");
    assert!(p.b.progress_stats().thread_wakeups > 0);
    let r = wait(&p.eq_b);
    assert_eq!(r.bytes, data.len());
    assert_eq!(dst.to_vec().unwrap(), data);
}

/// Two threads wait on one queue, one of them for several events: each returns once its own count is there
/// (a leader lets go, the follower leads next).
#[test]
fn two_threads_waiting_on_one_queue_both_get_their_events() {
    let p = pair_threaded(
        SockType::SeqPacket,
        SocketOptions::default().with_small_packet_max_size(64),
    );
    let src = p.client_region(pattern(16, 1));
    let bufs: Vec<MemoryRegion> = (0..3).map(|_| p.server_region(16)).collect();
    for (i, b) in bufs.iter().enumerate() {
        p.server
            .recv(&p.eq_b, &b.all(), MsgFlags::NONE, i as u64)
            .unwrap();
    }
    let one = {
        let eq = p.eq_b.clone();
        std::thread::spawn(move || {
            let mut v = Vec::new();
            eq.dequeue(&mut v, 1, 1, Some(Duration::from_secs(30)))
                .map(|_| v.len())
        })
    };
    let two = {
        let eq = p.eq_b.clone();
        std::thread::spawn(move || {
            let mut v = Vec::new();
            eq.dequeue(&mut v, 2, 2, Some(Duration::from_secs(30)))
                .map(|_| v.len())
        })
    };
    std::thread::sleep(Duration::from_millis(20));
    for i in 0..3 {
        p.client
            .send(&p.eq_a, &src.all(), MsgFlags::NONE, i)
            .unwrap();
    }
    assert_eq!(one.join().unwrap(), Ok(1));
    assert_eq!(two.join().unwrap(), Ok(2));
    for _ in 0..3 {
        assert!(wait(&p.eq_a).is_ok());
    }
}

/// A busy poller that works between its dequeues (for less than the progress thread's check-back) still counts as
/// polling: the progress thread does not take the transport in the gaps. It used to: a check-back that fell between
/// two dequeues stood by, then led, arming the transport so that completions woke it, and ran rounds under the
/// engine lock the poller wanted back (on Soft-RoCE under emulation, context switches every round trip).
#[test]
fn a_busy_poller_that_works_between_dequeues_keeps_the_progress_thread_out() {
    let (p, qa, qb) = busy_pair();
    let rounds = 40;
    let out = p.client_region(pattern(32, 3));
    let back = p.client_region(vec![0; 32]);
    let echo = p.echo(&qb, rounds).unwrap();
    // The first round trip makes both sides pollers; counted from the second.
    let mut before = None;
    let t0 = Instant::now();
    // Gaps between two dequeues that a loaded machine stretched to near the linger's length (the progress thread
    // may rightly take over in those).
    let (mut long_gaps, mut last_end) = (0u64, None::<Instant>);
    for i in 0..rounds {
        if i == 1 {
            before = Some((p.a.stats().arms, p.a.progress_stats(), Instant::now()));
        }
        p.client.recv(&qa, &back.all(), MsgFlags::NONE, 1).unwrap();
        p.client.send(&qa, &out.all(), MsgFlags::NONE, 2).unwrap();
        // The poller is out from the end of one dequeue to the start of the next, calls included (a loaded
        // machine may stop the thread inside them too).
        if let Some(end) = last_end.filter(|_| i > 1) {
            if end.elapsed() >= Duration::from_millis(7) {
                long_gaps += 1;
            }
        }
        let mut evs = Vec::new();
        qa.dequeue(&mut evs, 2, 2, Some(Duration::from_secs(30)))
            .unwrap();
        assert!(evs.iter().all(|e| e.is_ok()), "{evs:?}");
        last_end = Some(Instant::now());
        // The application's own work between two round trips: longer than the progress thread's standby, well
        // within the poller's linger.
        std::thread::sleep(Duration::from_millis(3));
    }
    echo.join().unwrap().unwrap();
    assert_eq!(back.to_vec().unwrap(), pattern(32, 3));
    let (arms0, s0, t1) = before.unwrap();
    let (arms, s) = (p.a.stats().arms - arms0, p.a.progress_stats());
    let ms = t1.elapsed().as_millis() as u64;
    eprintln!(
        "{arms} arms, {} progress-thread wake-ups in {ms} ms, {long_gaps} long gaps ({:?} in all)",
        s.thread_wakeups - s0.thread_wakeups,
        t0.elapsed()
    );
    // Before, the progress thread led in most gaps; now only where a gap outlasted the linger (once or twice a gap,
    // and once more at the end).
    assert!(
        arms <= 2 * long_gaps + 1,
        "the progress thread led between dequeues {arms} times ({long_gaps} long gaps): {s:?}"
    );
    // A check-back each time the poller has been out of its dequeues for the linger's length: bounded loosely
    // (the count that matters is the arms above).
    assert!(
        s.thread_wakeups - s0.thread_wakeups <= ms / 4 + 2 + 4 * long_gaps,
        "{s0:?} -> {s:?} in {ms} ms ({long_gaps} long gaps)"
    );
}

/// A busy poller that only takes what is queued (no minimum, or no time to wait) still drives its context: it keeps
/// the progress thread back, so every busy dequeue runs a round itself. Before, such dequeues marked the context as
/// busy-polled without a round, and a message sent to it never arrived.
#[test]
fn a_busy_poller_that_only_takes_what_is_queued_still_gets_its_events() {
    let (p, qa, _) = busy_pair();
    let back = p.client_region(vec![0; 32]);
    p.client.recv(&qa, &back.all(), MsgFlags::NONE, 1).unwrap();
    let out = p.server_region(32);
    out.write(0, &pattern(32, 5)).unwrap();
    // Let the client's progress thread see the poller before the message comes.
    let mut evs = Vec::new();
    for _ in 0..20 {
        qa.dequeue(&mut evs, 0, 1, Some(Duration::ZERO)).unwrap();
        std::thread::sleep(Duration::from_millis(1));
    }
    p.server
        .send(&p.eq_b, &out.all(), MsgFlags::NONE, 2)
        .unwrap();
    let t0 = Instant::now();
    let mut i = 0u32;
    while evs.is_empty() {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "the receive never completed: {:?}",
            p.a.progress_stats()
        );
        // No minimum, then a minimum with no time to wait: both only take what is there.
        let _ = if i % 2 == 0 {
            qa.dequeue(&mut evs, 0, 1, Some(Duration::ZERO))
        } else {
            qa.dequeue(&mut evs, 1, 1, Some(Duration::ZERO))
        };
        i += 1;
        std::thread::sleep(Duration::from_millis(1));
    }
    assert!(evs[0].is_ok(), "{evs:?}");
    assert_eq!(back.to_vec().unwrap(), pattern(32, 5));
}

/// A delayed acknowledgment's timer is left where it is when the acknowledgment leaves with a message (moving the
/// ordered timers at every message cost a busy round trip more than anything else the engine does with time), and
/// put right before anyone sleeps on it: a thread about to sleep, and a manual world advancing its clock, see
/// the connection's next real deadline (here its keepalive check), not the acknowledgment that already left.
#[test]
fn an_acknowledgment_sent_with_a_reply_leaves_no_timer_for_a_sleeper() {
    let p = pair(SockType::SeqPacket);
    let ping = p.client_region(pattern(32, 1));
    let inbox = p.server_region(32);
    let reply = p.server_region(32);
    let back = p.client_region(vec![0; 32]);
    // The server's deadline once the ping is in, and once its reply (carrying the acknowledgment) has come back.
    let round = || {
        p.server
            .recv(&p.eq_b, &inbox.all(), MsgFlags::NONE, 1)
            .unwrap();
        p.client
            .recv(&p.eq_a, &back.all(), MsgFlags::NONE, 3)
            .unwrap();
        p.client
            .send(&p.eq_a, &ping.all(), MsgFlags::NONE, 2)
            .unwrap();
        assert_eq!(wait(&p.eq_b).kind, EventKind::Recv);
        let acking = p.b.next_deadline();
        p.server
            .send(&p.eq_b, &reply.all(), MsgFlags::NONE, 4)
            .unwrap();
        let mut kinds = vec![wait(&p.eq_a).kind, wait(&p.eq_a).kind];
        kinds.sort_by_key(|k| format!("{k:?}"));
        assert_eq!(kinds, [EventKind::Recv, EventKind::Send]);
        assert_eq!(wait(&p.eq_b).kind, EventKind::Send);
        (acking, p.b.next_deadline())
    };
    // The first ping is acknowledged at once (the server is not answering yet); the second one's acknowledgment
    // waits for the reply.
    round();
    let (acking, next) = round();
    let acking = acking.expect("the acknowledgment is delayed");
    assert!(
        next.is_none_or(|d| d > acking + Duration::from_secs(1)),
        "the server's next deadline {:?} after the acknowledgment's",
        next.map(|d| d.saturating_duration_since(acking))
    );
}

/// Review finding: a round run by a thread that does not lead the context (a busy or spinning dequeue) set
/// timers nobody was told of: a delayed acknowledgment (request/response traffic: it waits for a reply to carry
/// it) waited for the thread asleep as the leader to wake at its own time, unless the progress thread, checking
/// back after the busy poll, ran it first (here it does: the send completes either way, and the test pins the
/// wake-up, which without the fix never comes). Such a round now wakes the sleeper when it sets a timer earlier
/// than the sleeper's wake-up. The leader may take the request itself (the transport wakes it too), and then
/// nobody needs waking: the scene is played until the busy poller's round took it, five times at most.
#[test]
fn a_timer_set_by_a_busy_pollers_round_wakes_the_thread_asleep_as_leader() {
    let kicked = (0..5).any(|_| busy_round_sets_a_timer_beside_a_sleeping_leader() > 0);
    assert!(kicked, "the sleeping leader was never woken for the timer");
}

/// One scene of [`a_timer_set_by_a_busy_pollers_round_wakes_the_thread_asleep_as_leader`]: the server
/// context's timer wake-ups of its sleeping leader.
fn busy_round_sets_a_timer_beside_a_sleeping_leader() -> u64 {
    let p = pair_threaded(SockType::SeqPacket, SocketOptions::default());
    // The server answers once: its acknowledgments then wait for a reply to carry them.
    let answer = MemoryRegion::from_vec(&p.b, pattern(64, 1)).unwrap();
    let got = p.client_region(vec![0; 64]);
    p.client
        .recv(&p.eq_a, &got.all(), MsgFlags::NONE, 1)
        .unwrap();
    p.server
        .send(&p.eq_b, &answer.all(), MsgFlags::NONE, 2)
        .unwrap();
    assert!(wait(&p.eq_a).is_ok());
    assert!(wait(&p.eq_b).is_ok());
    // A thread sleeps as the server context's leader, on a receive that takes the second message, not the first.
    let busy = EventQueue::with_mode(8, WaitMode::BusyPoll).unwrap();
    let lead = EventQueue::new(8).unwrap();
    let (first, second) = (p.server_region(64), p.server_region(64));
    p.server
        .recv(&busy, &first.all(), MsgFlags::NONE, 3)
        .unwrap();
    p.server
        .recv(&lead, &second.all(), MsgFlags::NONE, 4)
        .unwrap();
    let leader = std::thread::spawn(move || {
        let mut evs = Vec::new();
        let _ = lead.dequeue(&mut evs, 1, 1, Some(Duration::from_secs(8)));
    });
    std::thread::sleep(Duration::from_millis(200));
    let kicks = p.b.progress_stats().timer_kicks;
    // The request: taken by a busy-polling dequeue, whose round delays the acknowledgment.
    let request = p.client_region(pattern(64, 2));
    p.client
        .send(&p.eq_a, &request.all(), MsgFlags::NONE, 5)
        .unwrap();
    let mut evs = Vec::new();
    busy.dequeue(&mut evs, 1, 1, Some(Duration::from_secs(10)))
        .unwrap();
    assert!(evs.first().is_some_and(|e| e.is_ok()), "{evs:?}");
    // The send completes once the acknowledgment comes.
    let mut sent = Vec::new();
    let r = p
        .eq_a
        .dequeue(&mut sent, 1, 1, Some(Duration::from_secs(8)));
    assert!(
        r.is_ok() && sent.first().is_some_and(|e| e.is_ok()),
        "the request's send: {r:?} {sent:?}"
    );
    let kicked = p.b.progress_stats().timer_kicks - kicks;
    // The leader's receive: the last message.
    p.client
        .send(&p.eq_a, &request.all(), MsgFlags::NONE, 6)
        .unwrap();
    leader.join().unwrap();
    kicked
}

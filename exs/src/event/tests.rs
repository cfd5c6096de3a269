use super::*;
use std::thread;

fn sid() -> SocketId {
    SocketId(1)
}

#[test]
fn depth_bounds_outstanding_plus_queued() {
    let q = EventQueue::new(2).unwrap();
    let a = q.reserve(EventKind::Send, 1, sid()).unwrap();
    let _b = q.reserve(EventKind::Send, 2, sid()).unwrap();
    assert_eq!(
        q.reserve(EventKind::Send, 3, sid()).unwrap_err(),
        QueueFull { depth: 2 }
    );
    a.complete(Ok(()), 5, EventFlags::default());
    // Completed but not dequeued still counts.
    assert!(q.reserve(EventKind::Send, 3, sid()).is_err());
    let e = q.next(Some(Duration::ZERO)).unwrap();
    assert_eq!((e.kind, e.bytes, e.context), (EventKind::Send, 5, 1));
    q.reserve(EventKind::Send, 3, sid()).unwrap();
}

#[test]
fn dropped_ticket_completes_as_cancelled() {
    let q = EventQueue::new(4).unwrap();
    drop(q.reserve(EventKind::Recv, 9, sid()).unwrap());
    let e = q.next(Some(Duration::ZERO)).unwrap();
    assert_eq!(e.status, Err(OpError::Cancelled));
    assert_eq!(e.context, 9);
    assert_eq!(q.outstanding(), 0);
}

#[test]
fn timeout_with_nothing_is_an_error_and_partial_is_returned() {
    let q = EventQueue::new(4).unwrap();
    let mut out = Vec::new();
    assert_eq!(
        q.dequeue(&mut out, 1, 4, Some(Duration::from_millis(5))),
        Err(DequeueError::TimedOut)
    );
    q.reserve(EventKind::Send, 1, sid())
        .unwrap()
        .complete(Ok(()), 0, EventFlags::default());
    assert_eq!(
        q.dequeue(&mut out, 2, 4, Some(Duration::from_millis(5))),
        Ok(1)
    );
    assert_eq!(
        q.dequeue(&mut out, 3, 2, None),
        Err(DequeueError::Invalid("min must not exceed max"))
    );
    assert!(q.dequeue(&mut out, 0, 0, None).is_err());
}

/// The adaptive completion wait: a batch of n completions costs one sleep and one wake-up, not n.
#[test]
fn adaptive_wait_blocks_once_per_batch() {
    let q = EventQueue::new(64).unwrap();
    let tickets: Vec<_> = (0..32)
        .map(|i| q.reserve(EventKind::Send, i, sid()).unwrap())
        .collect();
    let producer = thread::spawn(move || {
        thread::sleep(Duration::from_millis(20));
        for t in tickets {
            t.complete(Ok(()), 1, EventFlags::default());
        }
    });
    let events = q.wait_all(Some(Duration::from_secs(10))).unwrap();
    producer.join().unwrap();
    assert_eq!(events.len(), 32);
    let s = q.stats();
    assert_eq!(s.blocks, 1, "{s:?}");
    assert_eq!(s.wakeups, 1, "{s:?}");
    assert_eq!(
        events.iter().map(|e| e.context).collect::<Vec<_>>(),
        (0..32).collect::<Vec<_>>()
    );
}

#[test]
fn adaptive_wait_does_not_block_when_events_are_there() {
    let q = EventQueue::new(8).unwrap();
    for i in 0..3 {
        q.reserve(EventKind::Recv, i, sid())
            .unwrap()
            .complete(Ok(()), 0, EventFlags::default());
    }
    let mut out = Vec::new();
    assert_eq!(q.dequeue(&mut out, 3, 8, None), Ok(3));
    assert_eq!(q.stats().blocks, 0);
}

#[test]
fn block_mode_wakes_per_event() {
    let q = EventQueue::with_mode(64, WaitMode::Block).unwrap();
    let tickets: Vec<_> = (0..8)
        .map(|i| q.reserve(EventKind::Send, i, sid()).unwrap())
        .collect();
    let producer = thread::spawn(move || {
        for t in tickets {
            thread::sleep(Duration::from_millis(3));
            t.complete(Ok(()), 1, EventFlags::default());
        }
    });
    let mut out = Vec::new();
    while out.len() < 8 {
        q.dequeue(&mut out, 1, 8, Some(Duration::from_secs(10)))
            .unwrap();
    }
    producer.join().unwrap();
    assert!(
        q.stats().blocks >= 2,
        "block mode should sleep per event: {:?}",
        q.stats()
    );
}

#[test]
fn busy_poll_never_sleeps() {
    let q = EventQueue::with_mode(8, WaitMode::BusyPoll).unwrap();
    let t = q.reserve(EventKind::Send, 0, sid()).unwrap();
    let producer = thread::spawn(move || {
        thread::sleep(Duration::from_millis(10));
        t.complete(Ok(()), 1, EventFlags::default());
    });
    q.next(Some(Duration::from_secs(10))).unwrap();
    producer.join().unwrap();
    assert_eq!(q.stats().blocks, 0);
    assert!(q.stats().empty_polls > 0);
}

/// Issue 15 regression: two threads wait on one queue for different counts; one times out first. The other
/// must still wake when its one event arrives (a single shared "waiting for" count used to be reset by the
/// timed-out waiter, so the other slept its whole timeout).
#[test]
fn a_timed_out_waiter_does_not_silence_another() {
    let q = EventQueue::new(8).unwrap();
    let t = q.reserve(EventKind::Recv, 7, sid()).unwrap();
    let _more: Vec<_> = (0..4)
        .map(|i| q.reserve(EventKind::Recv, 10 + i, sid()).unwrap())
        .collect();
    let patient = {
        let q = q.clone();
        thread::spawn(move || {
            let started = Instant::now();
            let mut v = Vec::new();
            let r = q.dequeue(&mut v, 1, 1, Some(Duration::from_secs(30)));
            (r, started.elapsed())
        })
    };
    let hasty = {
        let q = q.clone();
        thread::spawn(move || {
            let mut v = Vec::new();
            q.dequeue(&mut v, 5, 5, Some(Duration::from_millis(20)))
        })
    };
    assert_eq!(hasty.join().unwrap(), Err(DequeueError::TimedOut));
    t.complete(Ok(()), 3, EventFlags::default());
    let (r, waited) = patient.join().unwrap();
    assert_eq!(r, Ok(1));
    assert!(
        waited < Duration::from_secs(20),
        "the patient waiter slept through its event: {waited:?}"
    );
}

#[test]
fn spin_count_polls_before_blocking() {
    let q = EventQueue::with_mode(8, WaitMode::Adaptive { spin: 50 }).unwrap();
    let mut out = Vec::new();
    let _ = q.dequeue(&mut out, 1, 1, Some(Duration::from_millis(300)));
    assert!(q.stats().empty_polls >= 51, "{:?}", q.stats());
    assert_eq!(q.stats().blocks, 1);
}

/// A review found it: the spin count of `WaitMode::Adaptive` ran every poll whatever the dequeue's timeout (a
/// million polls under a zero timeout). It stops at the timeout.
#[test]
fn a_spin_count_does_not_outlast_the_timeout() {
    let q = EventQueue::with_mode(8, WaitMode::Adaptive { spin: 1 << 30 }).unwrap();
    let mut out = Vec::new();
    let started = Instant::now();
    let r = q.dequeue(&mut out, 1, 1, Some(Duration::from_millis(20)));
    assert_eq!(r, Err(DequeueError::TimedOut));
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "took {:?}",
        started.elapsed()
    );
}

/// A review found it: a dequeue waiting for more events than the queue can hold slept for ever (they can never all
/// be there at once), and the events it left filled the queue for every other caller. It is refused.
#[test]
fn a_dequeue_for_more_than_the_queue_holds_is_refused() {
    let q = EventQueue::new(4).unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    let waiter = q.clone();
    thread::spawn(move || {
        let mut out = Vec::new();
        let _ = tx.send(waiter.dequeue(&mut out, 5, 8, None));
    });
    let r = rx
        .recv_timeout(Duration::from_secs(20))
        .expect("the dequeue returned");
    assert!(matches!(r, Err(DequeueError::Invalid(_))), "{r:?}");
    let mut out = Vec::new();
    assert_eq!(q.dequeue(&mut out, 0, 8, Some(Duration::ZERO)), Ok(0));
}

/// The learned spin: a fresh queue spins as long as is ever worth it; short waits keep it spinning for about
/// twice what they took; a long wait (an idle peer) turns spinning off at once, and while it is off one wait in
/// `PROBE_EVERY` still spins.
#[test]
fn adaptive_spin_follows_recent_waits() {
    use super::wait::{SpinEstimate, Wait, ADAPTIVE_SPIN_MAX};
    let us = Duration::from_micros;
    let e = SpinEstimate::new();
    assert_eq!(e.budget(), Some(ADAPTIVE_SPIN_MAX));
    for _ in 0..8 {
        e.record(Wait::Spun(us(10)));
    }
    assert_eq!(e.budget(), Some(us(20)));
    e.record(Wait::Slept(Duration::from_secs(3)));
    assert_eq!(e.budget(), None, "after a long wait");
    let probes: Vec<_> = (0..SpinEstimate::PROBE_EVERY)
        .filter_map(|_| e.budget())
        .collect();
    assert_eq!(
        probes,
        [ADAPTIVE_SPIN_MAX],
        "one probe in PROBE_EVERY waits"
    );
    e.record(Wait::TimedOut);
    assert_eq!(e.budget(), None, "a wait that timed out is a long one");
    e.set_max(Duration::ZERO);
    assert!(
        (0..2 * SpinEstimate::PROBE_EVERY).all(|_| e.budget().is_none()),
        "turned off"
    );
}

/// A queue whose waits slept (a sleep and a wake-up take longer than the longest spin) is not stuck there: the
/// probe that spinning answers turns spinning back on, though the sleeping waits around it were long. The samples:
/// sleeping waits half again as long as the longest spin, replies that come within it.
#[test]
fn a_probe_that_spinning_answers_turns_spinning_back_on() {
    use super::wait::{SpinEstimate, Wait, ADAPTIVE_SPIN_MAX};
    let us = Duration::from_micros;
    let slept = ADAPTIVE_SPIN_MAX * 3 / 2;
    let e = SpinEstimate::new();
    for _ in 0..4 {
        e.record(Wait::Slept(slept));
    }
    let mut waits = 0;
    while e.budget().is_none() {
        e.record(Wait::Slept(slept));
        waits += 1;
        assert!(waits <= SpinEstimate::PROBE_EVERY, "no probe");
    }
    let twice = (us(30) * 2).min(ADAPTIVE_SPIN_MAX);
    e.record(Wait::Spun(us(30)));
    assert_eq!(
        e.budget(),
        Some(twice),
        "spinning again after one answered probe"
    );
    e.record(Wait::Spun(us(30)));
    assert_eq!(e.budget(), Some(twice));
}

/// Two threads that answer each other and have both slept: each one's request waits for the other's wake-up, so
/// each one's wait is as long as the other's wake-up and work. With a longest spin shorter than that, no spin
/// catches a request, not even the probes, and they sleep in turns for good; the longest spin is twice a wake-up
/// so that a probe ends it. The model's wake-up is more than half the longest spin: within a few probes, both
/// spin again. A model of the exchange, no clock.
#[test]
fn two_waiters_that_answer_each_other_do_not_sleep_in_turns() {
    use super::wait::{SpinEstimate, Wait};
    let us = Duration::from_micros;
    let (wake, work) = (us(60), us(5));
    let sides = [SpinEstimate::new(), SpinEstimate::new()];
    // Both start out asleep: their last waits were a wake-up and the work after it, and their own sleep.
    for e in &sides {
        for _ in 0..4 {
            e.record(Wait::Slept(wake + work + wake));
        }
    }
    let mut peer_slept = true;
    let mut spun = Vec::new();
    for turn in 0..40 * SpinEstimate::PROBE_EVERY as usize {
        let e = &sides[turn % 2];
        // The request came when the other side sent it: at once, or after it woke.
        let came = if peer_slept { wake + work } else { work };
        let slept = e.budget().is_none_or(|b| came > b);
        e.record(if slept {
            Wait::Slept(came + wake)
        } else {
            Wait::Spun(came)
        });
        spun.push(!slept);
        peer_slept = slept;
    }
    let last = &spun[spun.len() - 4 * SpinEstimate::PROBE_EVERY as usize..];
    assert!(
        last.iter().all(|&s| s),
        "the waiters still sleep in turns: {} of the last {} waits slept",
        last.iter().filter(|&&s| !s).count(),
        last.len()
    );
}

/// A queue no context reports to has nothing to drive while spinning: it sleeps at once, as the patent's main
/// embodiment does.
#[test]
fn a_queue_without_contexts_does_not_spin() {
    let q = EventQueue::new(8).unwrap();
    let mut out = Vec::new();
    let _ = q.dequeue(&mut out, 1, 1, Some(Duration::from_millis(1)));
    let st = q.stats();
    assert_eq!((st.blocks, st.spun, st.empty_polls), (1, 0, 2), "{st:?}");
}

/// A context as busy polling sees it: counts the polls that start and the ones that end lingering.
#[derive(Default)]
struct CountingPoller {
    started: std::sync::atomic::AtomicUsize,
    ended_lingering: std::sync::atomic::AtomicUsize,
}

impl Poller for CountingPoller {
    fn set_busy(&self, on: bool, lingers: bool) {
        use std::sync::atomic::Ordering::SeqCst;
        match (on, lingers) {
            (true, _) => self.started.fetch_add(1, SeqCst),
            (false, true) => self.ended_lingering.fetch_add(1, SeqCst),
            (false, false) => 0,
        };
    }
    fn poll_progress(&self) -> bool {
        false
    }
    fn try_lead(&self, _: Arc<dyn crate::progress::Follower>) -> bool {
        false
    }
    fn prepare_sleep(&self, _: &dyn Fn() -> bool) -> Option<Option<Instant>> {
        None
    }
    fn sleep_fds(&self) -> [std::os::fd::BorrowedFd<'_>; 2] {
        unreachable!("a busy poller never sleeps")
    }
    fn woke(&self, _: bool) {}
    fn release(&self) {}
    fn count_sleep(&self) {}
}

/// A busy dequeue that finds its events already queued (a progress thread that led before the polling began
/// queued them) still tells the contexts that a thread busy-polls them: otherwise that thread would keep leading
/// and queueing every event first, and the poller would never be seen.
#[test]
fn a_busy_dequeue_that_finds_its_events_waiting_still_counts_as_polling() {
    use std::sync::atomic::Ordering::SeqCst;
    let q = EventQueue::with_mode(8, WaitMode::BusyPoll).unwrap();
    let poller = Arc::new(CountingPoller::default());
    let dynp: Arc<dyn Poller> = poller.clone();
    q.add_poller(&dynp);
    for i in 0..3 {
        q.reserve(EventKind::Send, i, sid())
            .unwrap()
            .complete(Ok(()), 1, EventFlags::default());
    }
    for _ in 0..3 {
        q.next(Some(Duration::from_secs(10))).unwrap();
    }
    assert_eq!(poller.started.load(SeqCst), 3);
    assert_eq!(poller.ended_lingering.load(SeqCst), 3);
}

fn wake_fd() -> Arc<EventFd> {
    Arc::new(
        EventFd::from_value_and_flags(0, EfdFlags::EFD_NONBLOCK | EfdFlags::EFD_CLOEXEC).unwrap(),
    )
}

fn complete_one(eq: &EventQueue) {
    eq.reserve(EventKind::Recv, 1, sid())
        .unwrap()
        .complete(Ok(()), 0, Default::default());
}

/// Regression (review): two threads leading two contexts that report to one queue. A completion woke the first
/// leader (taking its registration on the queue), the second registered, and the first, waking, cleared the
/// registration: the second's. The second then slept with nobody to wake it for events of the first context. A
/// leader now clears only its own registration.
#[test]
fn a_waking_leader_leaves_another_leaders_registration() {
    let eq = EventQueue::new(4).unwrap();
    let (a, b) = (wake_fd(), wake_fd());
    let first = eq.inner.lock().sleepers.register(1, &a);
    // A completion wakes the first leader: its registration goes.
    complete_one(&eq);
    let mut s = eq.inner.lock();
    assert!(s.sleepers.tokens().is_empty());
    let second = s.sleepers.register(2, &b);
    // The first leader comes round.
    s.sleepers.unregister(first);
    assert_eq!(
        s.sleepers.tokens(),
        [second],
        "the second leader's registration stays"
    );
    s.sleepers.unregister(second);
    assert!(s.sleepers.tokens().is_empty());
}

/// Regression: two leaders of one queue shared its one wake-up descriptor. A completion woke the first; the
/// second registered and a completion woke it too; then the first, waking, read the descriptor and so took the
/// second's wake-up, which slept on until its transports or its timeout woke it, with its events queued. Each
/// sleeping thread now has its own descriptor, and reads only that one.
#[test]
fn a_waking_leader_does_not_take_another_leaders_wake_up() {
    let eq = EventQueue::new(4).unwrap();
    let (a, b) = (wake_fd(), wake_fd());
    let first = eq.inner.lock().sleepers.register(1, &a);
    complete_one(&eq);
    let second = eq.inner.lock().sleepers.register(2, &b);
    complete_one(&eq);
    // The first leader wakes and reads its descriptor.
    eq.woke_leading(first, &a, true);
    assert!(
        b.read().is_ok(),
        "the second leader's wake-up is still there"
    );
    eq.woke_leading(second, &b, false);
    assert!(a.read().is_err(), "the first leader read its own wake-up");
}

/// Two leaders sleep on one queue at once, each woken when its own count of events has arrived; before, only one
/// could register and the other looked again every `STANDBY`.
#[test]
fn two_leaders_of_one_queue_each_wake_at_their_own_count() {
    let eq = EventQueue::new(4).unwrap();
    let (a, b) = (wake_fd(), wake_fd());
    let first = eq.inner.lock().sleepers.register(1, &a);
    let second = eq.inner.lock().sleepers.register(2, &b);
    complete_one(&eq);
    assert!(
        a.read().is_ok(),
        "one event wakes the leader waiting for one"
    );
    assert!(b.read().is_err(), "but not the one waiting for two");
    assert_eq!(eq.inner.lock().sleepers.tokens(), [second]);
    complete_one(&eq);
    assert!(b.read().is_ok(), "the second event wakes it");
    eq.woke_leading(first, &a, false);
    eq.woke_leading(second, &b, false);
    assert!(eq.inner.lock().sleepers.tokens().is_empty());
}

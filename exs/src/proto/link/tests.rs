//! Unit tests of the control link: identifiers, discarding, coalescing.
use super::*;

#[test]
fn wr_ids_round_trip() {
    for k in [
        WrKind::Recv(0),
        WrKind::Ctrl(7),
        WrKind::Data(u32::MAX),
        WrKind::Pool(3),
    ] {
        assert_eq!(wr_kind(wr_id(k)), Some(k));
    }
    assert_eq!(wr_kind(1 << 40), None);
}

#[derive(Debug)]
struct TestReg(Arc<DmaBuf>);

impl Registration for TestReg {
    fn local_key(&self) -> u64 {
        1
    }
    fn buf(&self) -> &Arc<DmaBuf> {
        &self.0
    }
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

fn slots(count: u32) -> Slots {
    let buf = DmaBuf::new(count as usize * 128);
    Slots {
        reg: Arc::new(TestReg(Arc::clone(&buf))),
        buf,
        size: 128,
        count,
    }
}

fn slots_of(count: u32, size: usize) -> Slots {
    let buf = DmaBuf::new(count as usize * size);
    Slots {
        reg: Arc::new(TestReg(Arc::clone(&buf))),
        buf,
        size,
        count,
    }
}

/// A started link that coalesces, with 1 KiB pack buffers and peer buffers.
fn coalescing() -> Link {
    let mut link = Link::new(
        Ok(slots(8)),
        slots(8),
        Some(slots_of(PACK_SLOTS, 1024)),
        16,
        4,
        true,
    );
    link.start(8, 1024);
    link
}

/// A small control message (not a window update: those queued back to back fold into one).
fn notice(seq: u64) -> Body {
    Body::ReadNotify { seq: seq as u32 }
}

/// The messages one send carries, decoded as the peer would.
fn carried(wr: &WorkRequest) -> Vec<Message> {
    let Op::Send { sges, .. } = &wr.op else {
        panic!("not a send: {wr:?}")
    };
    let mut bytes = Vec::new();
    for sge in sges {
        let mut b = vec![0u8; sge.len()];
        sge.lease().read(0, &mut b).unwrap();
        bytes.extend_from_slice(&b);
    }
    crate::wire::frames(&bytes)
        .map(|r| r.unwrap().1.msg)
        .collect()
}

fn ctrl_slot(wr: &WorkRequest) -> u32 {
    match wr_kind(wr.wr_id) {
        Some(WrKind::Ctrl(s)) => s,
        other => panic!("not a control send: {other:?}"),
    }
}

/// Issue 12: a lone message goes at once; messages queued while it is in flight wait for its completion and
/// then leave in one send, which consumes one peer buffer.
#[test]
fn messages_queued_behind_one_in_flight_leave_together() {
    let mut link = coalescing();
    let mut out = Vec::new();
    link.push_ctrl(notice(1), None, None);
    link.flush(&mut out, &mut ());
    assert_eq!(out.len(), 1, "a lone message is not held");
    assert_eq!(carried(&out[0]), [Message::new(notice(1))]);
    let first = ctrl_slot(&out[0]);
    out.clear();
    for i in 2..5 {
        link.push_ctrl(notice(i), None, None);
    }
    link.flush(&mut out, &mut ());
    assert!(out.is_empty(), "held behind the send in flight: {out:?}");
    link.on_ctrl_done(first, &mut |_| {});
    link.flush(&mut out, &mut ());
    assert_eq!(out.len(), 1, "{out:?}");
    assert_eq!(
        carried(&out[0]),
        (2..5).map(|i| Message::new(notice(i))).collect::<Vec<_>>()
    );
    assert_eq!(link.tx_credits(), 6, "two sends, two peer buffers");
    assert_eq!((link.stats.packets, link.stats.packed), (1, 3));
    assert_eq!(link.stats.ctrl_sent, 4);
}

/// A message too large to share a buffer with another as large goes at once, even behind one in flight
/// (holding it could only delay it).
#[test]
fn a_message_too_large_to_share_a_buffer_is_not_held() {
    let mut link = coalescing();
    let mut out = Vec::new();
    link.push_ctrl(notice(1), None, None);
    link.flush(&mut out, &mut ());
    assert_eq!(out.len(), 1);
    let data = DmaBuf::new(600);
    let reg: Arc<dyn Registration> = Arc::new(TestReg(Arc::clone(&data)));
    let inline = Sge::of(&reg, 0..600, LeaseKind::DeviceRead).unwrap();
    let advert = Body::Advert(crate::wire::Advert {
        seq: 0,
        flags: crate::wire::AdvertFlags(crate::wire::AdvertFlags::IMMEDIATE),
        len: 600,
        addr: 0,
        rkey: 0,
    });
    link.push_ctrl(advert, Some(inline), Some(0));
    link.flush(&mut out, &mut ());
    assert_eq!(out.len(), 2, "{out:?}");
    assert_eq!(link.stats.packets, 0);
}

/// Nothing follows a CLOSE in a buffer, and nothing is posted after a final one.
#[test]
fn nothing_is_packed_after_a_close() {
    let mut link = coalescing();
    let mut out = Vec::new();
    link.push_ctrl(notice(1), None, None);
    link.flush(&mut out, &mut ());
    let first = ctrl_slot(&out[0]);
    out.clear();
    link.push_ctrl(notice(2), None, None);
    link.push_ctrl(Body::Close(CloseReason::Close), None, None);
    link.push_ctrl(notice(3), None, None);
    link.flush(&mut out, &mut ());
    assert!(out.is_empty());
    link.on_ctrl_done(first, &mut |_| {});
    link.flush(&mut out, &mut ());
    assert_eq!(out.len(), 1, "{out:?}");
    assert_eq!(
        carried(&out[0]),
        [
            Message::new(notice(2)),
            Message::new(Body::Close(CloseReason::Close))
        ]
    );
    assert!(link.is_closed());
}

/// The notifications of every message a pack carried come back when its send completes.
#[test]
fn a_pack_reports_each_message_it_carried() {
    let mut link = coalescing();
    let mut out = Vec::new();
    link.push_ctrl(notice(1), None, Some(7));
    link.flush(&mut out, &mut ());
    let first = ctrl_slot(&out[0]);
    out.clear();
    link.push_ctrl(notice(2), None, Some(8));
    link.push_ctrl(notice(3), None, Some(9));
    let mut told = Vec::new();
    link.on_ctrl_done(first, &mut |s| told.push(s));
    link.flush(&mut out, &mut ());
    let pack = ctrl_slot(&out[0]);
    link.on_ctrl_done(pack, &mut |s| told.push(s));
    assert_eq!(told, [7, 8, 9]);
    assert!(link.sends_drained(16));
}

fn queued_write(link: &mut Link) {
    let remote = RemoteRef { addr: 0, key: 7 };
    link.push_write(
        DataOp::Write {
            local: Vec::new(),
            remote,
            imm: Some(1),
        },
        0,
    );
}

/// Regression (soak): a write queued in the same progress round as the disconnect was posted on the released
/// endpoint once the round flushed. After [`Link::discard`] (the endpoint is gone) nothing is posted.
#[test]
fn a_discarded_link_posts_nothing() {
    let mut link = Link::new(Ok(slots(4)), slots(4), None, 16, 4, true);
    link.start(4, 128);
    queued_write(&mut link);
    let mut out = Vec::new();
    link.flush(&mut out, &mut ());
    assert_eq!(out.len(), 1, "a live link posts the write");
    queued_write(&mut link);
    link.push_ctrl(Body::Credit, None, None);
    link.discard();
    out.clear();
    link.flush(&mut out, &mut ());
    assert!(out.is_empty(), "{out:?}");
    assert!(link.is_idle());
}

/// A link whose peer granted 4 credits, with five writes queued: three go (a write needs two credits left), and
/// two wait for credits.
fn starved() -> Link {
    let mut link = Link::new(Ok(slots(4)), slots(4), None, 16, 4, true);
    link.start(4, 128);
    let mut out = Vec::new();
    for _ in 0..5 {
        queued_write(&mut link);
    }
    link.flush(&mut out, &mut ());
    assert!(
        link.tx_credits() < 2 && !link.is_idle(),
        "writes wait for credits"
    );
    link
}

/// The keepalive closes a connection whose peer returns no credits only after two whole intervals through which
/// messages waited: the check that first finds them waiting does not count the interval before it (messages that
/// began to wait just before a check closed the connection one interval later), and a credit in between starts
/// the count again.
#[test]
fn credits_withheld_only_after_two_whole_intervals_of_waiting() {
    let mut link = starved();
    let first = link.keepalive();
    assert!(
        first.is_ok(),
        "the first check that finds them waiting: {first:?}"
    );
    let second = link.keepalive();
    assert!(second.is_ok(), "one whole interval: {second:?}");
    assert_eq!(link.keepalive(), Err(Violation::CreditsWithheld));
    let mut link = starved();
    link.keepalive().unwrap();
    link.keepalive().unwrap();
    // Credits come back and a write takes them (the keepalive's probe takes one first): the messages behind still
    // wait, but the count starts again.
    link.credits_returned(2).unwrap();
    link.flush(&mut Vec::new(), &mut ());
    let after = link.keepalive();
    assert!(after.is_ok(), "a credit came back meanwhile: {after:?}");
    let next = link.keepalive();
    assert!(next.is_ok(), "{next:?}");
    assert_eq!(link.keepalive(), Err(Violation::CreditsWithheld));
}

/// A review found it: a peer that returned one credit per interval, which our urgent messages took (an
/// acknowledgment it asked for), reset the starvation count every time, while the normal queue (its messages
/// need two credits) never moved and grew with every message the peer made us queue. Only a queue that moves
/// restarts the count.
#[test]
fn a_peer_returning_one_credit_at_a_time_cannot_hold_the_normal_queue() {
    let mut link = starved();
    let mut verdict = Ok(false);
    for _ in 0..3 {
        // The peer's messages make us owe it credits, which an urgent CREDIT returns.
        while !link.has_queued(Kind::Credit) {
            link.consumed().unwrap();
        }
        link.credits_returned(1).unwrap();
        let mut out = Vec::new();
        link.flush(&mut out, &mut ());
        assert_eq!(out.len(), 1, "the urgent message takes the one credit");
        assert!(link.tx_credits() < 2, "the normal queue still waits");
        verdict = link.keepalive();
    }
    assert_eq!(verdict, Err(Violation::CreditsWithheld));
}

/// A peer has at most its window of messages we have not returned a credit for: one more is an overrun, and a
/// credit message of ours that leaves makes room again.
#[test]
fn a_message_past_the_unreturned_window_is_an_overrun() {
    let mut link = Link::new(Ok(slots(4)), slots(4), None, 16, 4, true);
    link.start(4, 128);
    for _ in 0..4 {
        link.consumed().unwrap();
    }
    assert_eq!(link.consumed(), Err(Violation::CreditOverrun { window: 4 }));
    let mut out = Vec::new();
    link.flush(&mut out, &mut ());
    assert!(!out.is_empty(), "a credit message returns what is owed");
    link.consumed().unwrap();
}

/// Review finding: window updates queued behind messages that wait for credits piled up, one per report, for as
/// long as a peer that returns none kept making room in the stream buffer. A report queued right behind another
/// now replaces it (both say the total consumed), so the last one says everything.
#[test]
fn a_window_update_behind_another_still_queued_replaces_it() {
    let mut link = starved();
    let before = link.stats().ctrl_queued;
    for consumed in 1..=100u64 {
        link.push_ctrl(Body::StreamWindow { consumed }, None, None);
    }
    assert_eq!(link.stats().ctrl_queued, before + 1, "one queued report");
    assert_eq!(link.stats.windows_merged, 99);
    let last = link.normal.back();
    assert!(
        matches!(
            last,
            Some(Outgoing::Ctrl {
                body: Body::StreamWindow { consumed: 100 },
                ..
            })
        ),
        "{last:?}"
    );
    // Behind another message, a report queues anew: it must not overtake what went in between.
    link.push_ctrl(Body::ReadNotify { seq: 1 }, None, None);
    link.push_ctrl(Body::StreamWindow { consumed: 101 }, None, None);
    assert_eq!(link.stats().ctrl_queued, before + 3);
}

/// Whatever a peer that returns no credits makes us queue, a connection holds at most `CTRL_BACKLOG_MAX` stream
/// advertisements and window updates: one more closes it. Messages our own application makes at its pace (read
/// notifications of a persistent send it reads, say, while an honest peer is busy) do not count.
#[test]
fn a_connection_holds_a_bounded_backlog_of_control_messages() {
    let mut link = starved();
    for seq in 0..2 * CTRL_BACKLOG_MAX as u64 {
        link.push_ctrl(notice(seq), None, None);
    }
    assert_eq!(
        link.check_backlog(),
        Ok(()),
        "read notifications do not count"
    );
    let advert = |seq| {
        Body::StreamAdvert(crate::wire::StreamAdvert {
            addr: 0,
            rkey: 1,
            len: 100,
            seq,
            phase: 0,
            waitall: false,
            consumed: 0,
        })
    };
    for seq in 0..CTRL_BACKLOG_MAX as u64 {
        link.push_ctrl(advert(seq), None, None);
        link.flush(&mut Vec::new(), &mut ());
    }
    assert_eq!(link.check_backlog(), Ok(()));
    link.push_ctrl(advert(0), None, None);
    assert_eq!(
        link.check_backlog(),
        Err(Violation::ControlBacklog {
            queued: CTRL_BACKLOG_MAX + 1
        })
    );
    assert_eq!(link.stats().ctrl_queued, 3 * CTRL_BACKLOG_MAX as u64 + 1);
    // The echoes of persistent receives the peer opens and ends count too.
    link.discard();
    for seq in 0..=CTRL_BACKLOG_MAX as u32 {
        link.push_ctrl(Body::PersistentEnd { seq, echo: true }, None, None);
    }
    assert_eq!(
        link.check_backlog(),
        Err(Violation::ControlBacklog {
            queued: CTRL_BACKLOG_MAX + 1
        })
    );
    // A link whose endpoint is gone holds none.
    link.discard();
    assert_eq!(link.stats().ctrl_queued, 0);
    assert_eq!(link.check_backlog(), Ok(()));
}

//! Property: whatever the sizes, credits, windows, transport limits and interleaving, message mode delivers every
//! message once, in order, intact (or truncated exactly as the receive buffer dictates), without overrunning a
//! receive queue and without deadlock.

#[path = "../../exs/tests/common/mod.rs"]
mod common;

use std::time::Duration;

use common::*;
use exs::sim::{RnrPolicy, SimConfig};
use exs::{Event, MsgFlags, SockType, SocketOptions};
use proptest::prelude::*;

#[derive(Debug, Clone)]
struct Case {
    seed: u64,
    msgs: Vec<(usize, usize)>, // (message length, receive buffer length)
    send_credits: u16,
    recv_credits: u16,
    window: u16,
    small: u32,
    max_message: u64,
    max_send_wr: u32,
    read_depth: u32,
    recvs_first: bool,
    /// Let the adverts arrive before the receives are posted.
    settle: bool,
}

fn case() -> impl Strategy<Value = Case> {
    let size = prop_oneof![0usize..64, 64usize..2048, 2048usize..70_000];
    (
        any::<u64>(),
        proptest::collection::vec((size.clone(), size), 1..40),
        1u16..20,
        1u16..20,
        prop_oneof![Just(0u16), 4u16..40],
        prop_oneof![Just(0u32), 1u32..1024],
        prop_oneof![Just(1u64 << 31), 512u64..8192],
        2u32..64,
        1u32..8,
        (any::<bool>(), any::<bool>()),
    )
        .prop_map(
            |(
                seed,
                msgs,
                send_credits,
                recv_credits,
                window,
                small,
                max_message,
                max_send_wr,
                read_depth,
                (recvs_first, settle),
            )| Case {
                seed,
                msgs,
                send_credits,
                recv_credits,
                window,
                small,
                max_message,
                max_send_wr,
                read_depth,
                recvs_first,
                settle,
            },
        )
}

/// The pair a case runs on: its simulated fabric's limits and its socket options.
fn case_pair(c: &Case) -> Pair {
    let mut cfg = SimConfig {
        seed: c.seed,
        rnr: RnrPolicy::Fail,
        jitter: Duration::from_micros(20),
        ..SimConfig::default()
    };
    cfg.caps.max_message = c.max_message;
    cfg.caps.max_send_wr = c.max_send_wr;
    cfg.caps.max_read_depth = c.read_depth;
    let opts = SocketOptions::default()
        .with_send_credits(c.send_credits)
        .with_recv_credits(c.recv_credits)
        .with_control_window(c.window)
        .with_small_packet_max_size(c.small);
    pair_with(SockType::SeqPacket, cfg, opts)
}

fn run(c: &Case) {
    let p = case_pair(c);
    let total_src: usize = c.msgs.iter().map(|m| m.0).sum::<usize>().max(1);
    let total_dst: usize = c.msgs.iter().map(|m| m.1).sum::<usize>().max(1);
    let src = p.client_region(pattern(total_src, c.seed));
    let dst = p.server_region(total_dst);
    let post_recvs = || {
        let mut off = 0;
        for (i, &(_, cap)) in c.msgs.iter().enumerate() {
            p.server
                .recv(
                    &p.eq_b,
                    &dst.slice(off..off + cap),
                    MsgFlags::NONE,
                    i as u64,
                )
                .unwrap();
            off += cap;
        }
    };
    if c.recvs_first {
        post_recvs();
    }
    let mut off = 0;
    for (i, &(len, _)) in c.msgs.iter().enumerate() {
        p.client
            .send(
                &p.eq_a,
                &src.slice(off..off + len),
                MsgFlags::NONE,
                i as u64,
            )
            .unwrap();
        off += len;
    }
    if !c.recvs_first {
        if c.settle {
            p.world.run_for(Duration::from_millis(1));
        }
        post_recvs();
    }
    let recvs = p.eq_b.wait_all(None).expect("no deadlock on the receiver");
    let sends = p.eq_a.wait_all(None).expect("no deadlock on the sender");
    assert_eq!(p.world.stats().rnr, 0, "a receive queue was overrun");
    assert_eq!(
        recvs.iter().map(|e| e.context).collect::<Vec<_>>(),
        (0..c.msgs.len() as u64).collect::<Vec<_>>()
    );
    assert_eq!(
        sends.iter().map(|e| e.context).collect::<Vec<_>>(),
        (0..c.msgs.len() as u64).collect::<Vec<_>>()
    );
    check_delivered(
        c,
        &sends,
        &recvs,
        &src.to_vec().unwrap(),
        &dst.to_vec().unwrap(),
    );
    assert_eq!(p.world.live_keys(), 0);
    assert_eq!((src.leases(), dst.leases()), (0, 0));
}

/// Every send completed with its length, every receive with what fits of its message (truncated where it did
/// not), the bytes in place.
fn check_delivered(c: &Case, sends: &[Event], recvs: &[Event], all_src: &[u8], all_dst: &[u8]) {
    let (mut so, mut d) = (0, 0);
    for (i, &(len, cap)) in c.msgs.iter().enumerate() {
        let n = len.min(cap);
        assert_eq!(sends[i].status, Ok(()));
        assert_eq!(sends[i].bytes, len);
        assert_eq!(recvs[i].status, Ok(()));
        assert_eq!(
            (recvs[i].bytes, recvs[i].flags.truncated),
            (n, len > cap),
            "message {i}"
        );
        assert_bytes_eq(&all_dst[d..d + n], &all_src[so..so + n], "message content");
        so += len;
        d += cap;
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: std::env::var("EXS_PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(96), ..ProptestConfig::default() })]
    #[test]
    fn message_mode_delivers_everything_in_order(c in case()) {
        run(&c);
    }
}

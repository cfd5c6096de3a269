//! The libfabric backend on the tcp provider over loopback: connect, move messages, tear down.

use std::time::Duration;

use exs::{EventQueue, MemoryRegion, MsgFlags, SockType, Socket, WaitMode};
use exs_backend_fabric::{providers, CqWait, FabricConfig, FabricTransport};

fn context(cfg: &FabricConfig) -> Result<exs::Context, exs::TransportError> {
    exs::Context::new(Box::new(FabricTransport::open(cfg)?))
}

#[test]
fn tcp_provider_moves_messages_over_loopback() {
    moves_messages(&FabricConfig::default(), WaitMode::default());
}

/// Queues opened without a wait object signal no descriptor of the transport's; busy polling finds the
/// completions, and a thread that sleeps on the context (blocking, adaptive) still gets them by polling at the
/// transport's interval instead of hanging.
#[test]
fn completion_queues_without_a_wait_object_serve_busy_and_sleeping_waits() {
    let cfg = FabricConfig {
        cq_wait: CqWait::None,
        ..FabricConfig::default()
    };
    // With no endpoint there is nothing to poll: the transport asks for no polling interval (an idle context
    // sleeps until its event queue signals), whatever its queues.
    for c in [&cfg, &FabricConfig::default()] {
        let t = FabricTransport::open(c).expect("open tcp");
        assert_eq!(exs_transport::Transport::poll_interval(&t), None);
    }
    for mode in [WaitMode::BusyPoll, WaitMode::Block, WaitMode::default()] {
        moves_messages(&cfg, mode);
    }
}

/// Connects two contexts over loopback, moves messages of several sizes (content checked) and closes, every
/// queue waiting in `mode`.
fn moves_messages(cfg: &FabricConfig, mode: WaitMode) {
    let a = context(cfg).expect("open tcp");
    let b = context(cfg).expect("open tcp");
    let q = || EventQueue::with_mode(64, mode).unwrap();
    let (eq_a, eq_b) = (q(), q());
    let l = Socket::new(&b, SockType::SeqPacket).unwrap();
    l.bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let addr = l.listen(4).unwrap();
    assert_ne!(addr.port(), 0);
    l.accept(&eq_b, 1).unwrap();
    let c = Socket::new(&a, SockType::SeqPacket).unwrap();
    c.connect(&eq_a, addr, 2).unwrap();
    let t = Some(Duration::from_secs(20));
    let ev = eq_a.next(t).unwrap();
    assert!(ev.is_ok(), "{ev:?}");
    let mut ev = eq_b.next(t).unwrap();
    assert!(ev.is_ok(), "{ev:?}");
    let s = ev.take_accepted().unwrap();
    for len in [0usize, 1, 512, 513, 100_000, 4 << 20] {
        let src =
            MemoryRegion::from_vec(&a, (0..len.max(1)).map(|i| (i * 7 + len) as u8).collect())
                .unwrap();
        let dst = MemoryRegion::alloc(&b, len.max(1)).unwrap();
        s.recv(&eq_b, &dst.slice(..len), MsgFlags::NONE, 3).unwrap();
        c.send(&eq_a, &src.slice(..len), MsgFlags::NONE, 4).unwrap();
        let r = eq_b.next(t).unwrap();
        let w = eq_a.next(t).unwrap();
        assert!(r.is_ok() && w.is_ok(), "{mode:?}: {r:?} {w:?}");
        assert_eq!(r.bytes, len);
        assert!(
            dst.to_vec().unwrap()[..len] == src.to_vec().unwrap()[..len],
            "{mode:?}: content of {len} bytes"
        );
    }
    // A message sent once the receiver has gone to sleep on its queue: it wakes for it (on a transport whose
    // completions signal nothing, by polling at the transport's interval).
    let src = MemoryRegion::from_vec(&a, vec![0x5a; 64]).unwrap();
    let dst = MemoryRegion::alloc(&b, 64).unwrap();
    s.recv(&eq_b, &dst.all(), MsgFlags::NONE, 6).unwrap();
    std::thread::scope(|scope| {
        scope.spawn(|| {
            std::thread::sleep(Duration::from_millis(50));
            c.send(&eq_a, &src.all(), MsgFlags::NONE, 7).unwrap();
        });
        let r = eq_b.next(t).unwrap();
        assert!(r.is_ok() && r.bytes == 64, "{mode:?}: {r:?}");
    });
    assert!(eq_a.next(t).unwrap().is_ok());
    assert_eq!(dst.to_vec().unwrap(), vec![0x5a; 64], "{mode:?}");
    c.close().unwrap();
    let eof = {
        let buf = MemoryRegion::alloc(&b, 8).unwrap();
        s.recv(&eq_b, &buf.all(), MsgFlags::NONE, 5).unwrap();
        eq_b.next(t).unwrap()
    };
    assert!(eof.flags.eof, "{mode:?}: {eof:?}");
}

#[test]
fn unknown_provider_error_lists_the_available_ones() {
    let e = exs_backend_fabric::FabricTransport::open(&FabricConfig::provider("nosuchprov"))
        .unwrap_err();
    match e {
        exs::TransportError::NotFound { wanted, available } => {
            assert_eq!(wanted, "libfabric provider nosuchprov (EXS_PROVIDER)");
            assert!(available.iter().any(|p| p == "tcp"), "{available:?}");
            assert_eq!(available, providers());
        }
        other => panic!("{other:?}"),
    }
}

//! Connection-management paths of the transport, driven through the trait with no engine (tcp over loopback).

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use exs_transport::{CmEvent, ConnectFailure, EndpointId, Transport};

use crate::{FabricConfig, FabricTransport};

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd")
        .expect("/proc/self/fd")
        .count()
}

/// Issue 15: connection requests published in the event queue but not yet read when their listener closes. They
/// must be refused (fi_reject, which closes their sockets) and their info freed, once; before, the listener's
/// passive endpoint was closed under them, and reading them later found a freed object, dropped the info and
/// leaked every such connection's socket (and left its peer waiting).
#[test]
fn a_listener_closed_with_requests_waiting_refuses_them_and_leaks_no_socket() {
    const N: u32 = 48;
    let cfg = FabricConfig::default();
    let mut server = FabricTransport::open(&cfg).expect("open tcp");
    let mut client = FabricTransport::open(&cfg).expect("open tcp");
    let base = open_fds();
    for round in 0..3 {
        let any: SocketAddr = "127.0.0.1:0".parse().expect("address");
        let (l, addr) = server.listen(any, 1024).expect("listen");
        for i in 1..=N {
            client
                .connect(EndpointId(i), addr, b"request", Vec::new())
                .expect("connect");
        }
        // The server hands out some of the requests; more are published in its event queue by the reads that
        // returned those (a read makes progress on every connection, and returns one event).
        let deadline = Instant::now() + Duration::from_secs(20);
        let mut handed = 0;
        while handed < N / 2 {
            assert!(
                Instant::now() < deadline,
                "round {round}: only {handed} requests arrived"
            );
            while client.poll_cm().is_some() {}
            match server.poll_cm() {
                Some(CmEvent::ConnectRequest { listener, .. }) => {
                    assert_eq!(listener, l);
                    handed += 1;
                }
                Some(other) => panic!("round {round}: server event {other:?}"),
                None => std::thread::sleep(Duration::from_millis(1)),
            }
        }
        server.close_listener(l);
        // Every connect ends refused: the requests handed out, those waiting in the queue, and those the
        // listener had not read yet (closing its socket resets them).
        let mut ended = std::collections::HashSet::new();
        while ended.len() < N as usize {
            assert!(
                Instant::now() < deadline,
                "round {round}: {} of {N} connects never ended (their requests were neither accepted nor \
                 refused)",
                N as usize - ended.len()
            );
            match server.poll_cm() {
                None => {}
                Some(CmEvent::ConnectRequest { .. }) => {
                    panic!("round {round}: a request of a closed listener reached the engine")
                }
                Some(other) => panic!("round {round}: server event {other:?}"),
            }
            match client.poll_cm() {
                Some(CmEvent::ConnectFailed { ep, reason }) => {
                    assert!(
                        matches!(
                            reason,
                            ConnectFailure::Refused(_) | ConnectFailure::Other(_)
                        ),
                        "{reason:?}"
                    );
                    assert!(ended.insert(ep), "{ep:?} ended twice");
                    client.release(ep);
                }
                Some(CmEvent::Disconnected { ep }) => {
                    assert!(ended.insert(ep), "{ep:?} ended twice");
                    client.release(ep);
                }
                Some(other) => panic!("round {round}: client event {other:?}"),
                None => std::thread::sleep(Duration::from_millis(1)),
            }
        }
    }
    // Sockets close as their requests are refused; give the provider a moment to finish.
    let deadline = Instant::now() + Duration::from_secs(5);
    while open_fds() > base && Instant::now() < deadline {
        while server.poll_cm().is_some() {}
        while client.poll_cm().is_some() {}
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(
        open_fds(),
        base,
        "descriptors left after {} refused connects",
        3 * N
    );
}

/// A provider or domain name with a NUL byte is refused as invalid (not as a missing provider), on the error path
/// that used to leak the hints allocated for it (they are now owned, and freed, before the name is converted).
#[test]
fn a_name_with_a_nul_is_refused_as_invalid() {
    for cfg in [
        FabricConfig {
            provider: "tc\0p".into(),
            ..FabricConfig::default()
        },
        FabricConfig {
            domain: Some("lo\0".into()),
            ..FabricConfig::default()
        },
    ] {
        match FabricTransport::open(&cfg) {
            Err(exs_transport::TransportError::Invalid(why)) => {
                assert!(why.contains("NUL"), "{why}")
            }
            Err(e) => panic!("{cfg:?}: {e}"),
            Ok(_) => panic!("{cfg:?} was accepted"),
        }
    }
}

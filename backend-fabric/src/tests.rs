//! Connection-management paths of the transport, driven through the trait with no engine (tcp over loopback).

use std::net::SocketAddr;
use std::os::fd::AsFd;
use std::time::{Duration, Instant};

use exs_transport::{CmEvent, ConnectFailure, EndpointId, ListenerId, Transport};

use crate::{FabricConfig, FabricTransport};

/// Tests that count the process's descriptors, or open transports (which take descriptors), run one at a time: the
/// unit tests of the other modules that open one take it too.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

pub(crate) fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

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
    let _serial = serial();
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
        let deadline = Instant::now() + Duration::from_secs(20);
        hand_out_requests(&mut server, &mut client, l, N / 2, round, deadline);
        server.close_listener(l);
        every_connect_ends_refused(&mut server, &mut client, N, round, deadline);
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

/// The server hands out `n` connection requests of listener `l`; more are published in its event queue by the
/// reads that returned those (a read makes progress on every connection, and returns one event).
fn hand_out_requests(
    server: &mut FabricTransport,
    client: &mut FabricTransport,
    l: ListenerId,
    n: u32,
    round: u32,
    deadline: Instant,
) {
    let mut handed = 0;
    while handed < n {
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
}

/// After the listener closed, every one of the client's `n` connects ends refused, once: the requests handed out,
/// those waiting in the queue, and those the listener had not read yet (closing its socket resets them). None of
/// them reaches the server's engine.
fn every_connect_ends_refused(
    server: &mut FabricTransport,
    client: &mut FabricTransport,
    n: u32,
    round: u32,
    deadline: Instant,
) {
    let mut ended = std::collections::HashSet::new();
    while ended.len() < n as usize {
        assert!(
            Instant::now() < deadline,
            "round {round}: {} of {n} connects never ended (their requests were neither accepted nor \
             refused)",
            n as usize - ended.len()
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

/// A receive work request on a fresh 64-byte buffer of its own.
fn recv_wr(t: &mut FabricTransport, id: u64) -> exs_transport::WorkRequest {
    let buf = exs_dma::DmaBuf::new(64);
    let reg = t.register(&buf).expect("register");
    let lease = buf
        .lease(0..64, exs_dma::LeaseKind::DeviceWrite)
        .expect("lease");
    let sge = exs_transport::Sge::new(lease, reg).expect("sge");
    exs_transport::WorkRequest {
        wr_id: id,
        op: exs_transport::Op::Recv { sge },
    }
}

/// An 8-byte send work request.
fn send_wr(t: &mut FabricTransport, id: u64) -> exs_transport::WorkRequest {
    let buf = exs_dma::DmaBuf::new(8);
    let reg = t.register(&buf).expect("register");
    let lease = buf
        .lease(0..8, exs_dma::LeaseKind::DeviceRead)
        .expect("lease");
    let sge = exs_transport::Sge::new(lease, reg).expect("sge");
    exs_transport::WorkRequest {
        wr_id: id,
        op: exs_transport::Op::Send {
            sges: vec![sge],
            imm: None,
        },
    }
}

/// Polls `t` until a receive completes on `ep` (other completions are dropped); the polls it took.
fn await_recv(t: &mut FabricTransport, ep: EndpointId) -> u64 {
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut out = Vec::new();
    let mut polls = 0;
    loop {
        assert!(Instant::now() < deadline, "no receive on {ep:?}");
        out.clear();
        t.poll(&mut out, 64);
        polls += 1;
        if out.iter().any(|c| {
            c.ep == ep && matches!(c.op, exs_transport::Completed::Recv { .. }) && c.status.is_ok()
        }) {
            return polls;
        }
    }
}

/// On libfabric every connection has a completion queue of its own, and a poll used to read all of them (one
/// operation cost grew with the connections held, idle or not). A ping-pong beside many idle
/// connections must read no more queues per poll than are hot (this one) or have signalled.
#[test]
fn a_poll_beside_idle_connections_reads_only_queues_that_have_work() {
    let _serial = serial();
    const IDLE: u32 = 100;
    let cfg = FabricConfig::default();
    let mut server = FabricTransport::open(&cfg).expect("open tcp");
    let mut client = FabricTransport::open(&cfg).expect("open tcp");
    connect_pairs(&mut server, &mut client, IDLE + 1);
    // Idle now: polls retire the quiet queues (arming them, so their next completion signals).
    let mut out = Vec::new();
    for _ in 0..2 * crate::ready::QUIET {
        client.poll(&mut out, 64);
        server.poll(&mut out, 64);
    }
    let _ = (client.arm(), server.arm());
    assert!(
        client.hot_queues() <= 1 && server.hot_queues() <= 1,
        "queues still read in every poll after idling: client {}, server {}",
        client.hot_queues(),
        server.hot_queues()
    );
    // The first connection each side accepted/connected is the busy one (the server numbers in accept order).
    let (c0, s0) = (client.ready_stats(), server.ready_stats());
    ping_pong(&mut server, &mut client, EndpointId(1), 200);
    for (side, t, s0) in [("client", &client, c0), ("server", &server, s0)] {
        let s = t.ready_stats();
        let (reads, polls) = (s.cq_reads - s0.cq_reads, s.polls - s0.polls);
        eprintln!(
            "{side}: {polls} polls, {reads} queue reads, {} consults",
            s.consults - s0.consults
        );
        // The busy queue once per poll, plus what a consultation of the epoll set finds (every 16th poll).
        assert!(
            reads <= polls + polls / 8 + 4,
            "{side}: {reads} queue reads in {polls} polls beside {IDLE} idle connections"
        );
    }
}

/// A quiet queue, armed, wakes a thread sleeping on the transport's descriptor when a message comes, with either
/// wait object: with `FI_WAIT_POLLFD` the queue's own descriptors (its signal, and the socket that joined it when
/// the connection came up) are what the transport's epoll set holds for it. Between messages nothing signals.
#[test]
fn an_armed_quiet_queue_wakes_a_sleeper_when_a_message_comes() {
    let _serial = serial();
    for wait in [crate::CqWait::PollFd, crate::CqWait::Fd] {
        let (mut server, mut client) = connected(wait, 2);
        let ep = EndpointId(1);
        for round in 0..3 {
            let mut out = Vec::new();
            for _ in 0..2 * crate::ready::QUIET {
                client.poll(&mut out, 64);
                server.poll(&mut out, 64);
            }
            assert!(
                client.arm().expect("arm"),
                "{wait:?}: nothing pending, the client arms"
            );
            let fd = client.wait_fd().expect("a descriptor to sleep on");
            let readable = |ms: u16| {
                let mut p = [nix::poll::PollFd::new(
                    fd.as_fd(),
                    nix::poll::PollFlags::POLLIN,
                )];
                nix::poll::poll(&mut p, nix::poll::PollTimeout::from(ms)).expect("poll") > 0
            };
            assert!(
                !readable(50),
                "{wait:?}, round {round}: the client's descriptor is readable with nothing to read"
            );
            let wr = send_wr(&mut server, 7);
            server.post(ep, wr).expect("send");
            // The server's send goes out as its queue is read.
            let mut woke = false;
            for _ in 0..400 {
                server.poll(&mut out, 64);
                if readable(5) {
                    woke = true;
                    break;
                }
            }
            assert!(
                woke,
                "{wait:?}, round {round}: a message came and the sleeper was not woken"
            );
            await_recv(&mut client, ep);
            let wr = recv_wr(&mut client, 50 + round);
            client.post(ep, wr).expect("repost");
        }
    }
}

/// A queue armed while hot goes on being read; a read that takes in a peer's RDMA read request makes no
/// completion but queues a response bigger than the socket takes, so the provider now waits for the socket to
/// drain (`POLLOUT`). The queue then goes quiet: before it leaves the hot set it must be armed again, its entries in
/// the epoll set brought up to date, or a thread that sleeps is never woken to send the rest, and the read never
/// completes (it stalled `exs pump --size 16M --wait block`; the bench README has the figures).
#[test]
fn a_read_response_bigger_than_the_socket_wakes_the_side_that_serves_it() {
    let _serial = serial();
    for wait in [crate::CqWait::PollFd, crate::CqWait::Fd] {
        let (mut server, mut client) = connected(wait, 1);
        let ep = EndpointId(1);
        let (exposed, read) = big_read(&mut server, &mut client, ep);
        let mut out = Vec::new();
        for _ in 0..2 * crate::ready::QUIET {
            client.poll(&mut out, 64);
            server.poll(&mut out, 64);
        }
        let wr = recv_wr(&mut server, 99);
        server.post(ep, wr).expect("recv");
        assert!(server.arm().expect("arm"), "{wait:?}: the server arms");
        server.poll(&mut out, 64);
        client
            .post(ep, exs_transport::WorkRequest { wr_id: 1, op: read })
            .expect("read");
        for _ in 0..20 {
            client.poll(&mut out, 64);
        }
        std::thread::sleep(Duration::from_millis(20));
        // The server takes the request in, then goes quiet and arms: it would sleep now.
        for _ in 0..3 * crate::ready::QUIET + 2 {
            server.poll(&mut out, 64);
        }
        let _ = server.arm().expect("arm");
        let fd = server.wait_fd().expect("a descriptor to sleep on");
        let readable = || {
            let mut p = [nix::poll::PollFd::new(
                fd.as_fd(),
                nix::poll::PollFlags::POLLIN,
            )];
            nix::poll::poll(&mut p, nix::poll::PollTimeout::ZERO).expect("poll") > 0
        };
        let t0 = Instant::now();
        let (mut woke, mut done) = (false, false);
        while t0.elapsed() < Duration::from_secs(5) && !woke && !done {
            out.clear();
            client.poll(&mut out, 64);
            done = out
                .iter()
                .any(|c| matches!(c.op, exs_transport::Completed::Read));
            woke = readable();
            std::thread::sleep(Duration::from_millis(1));
        }
        assert!(
            woke || done,
            "{wait:?}: the server, asleep with a read response to send, was never woken"
        );
        drop(exposed);
    }
}

/// What the pollfd wait objects rest on (see `crate::wait`): the tcp provider moves a queue's data only in that
/// queue's own progress, never in a read of the event queue, so reading connection events cannot change what an
/// armed queue waits on behind the transport's back. A peer's RDMA read of 32 MiB gets no answer while the
/// serving side only reads its event queue; the first read of its completion queue sends it.
#[test]
fn reading_connection_events_moves_no_queues_data() {
    let _serial = serial();
    let (mut server, mut client) = connected(crate::CqWait::default(), 1);
    let ep = EndpointId(1);
    let (exposed, read) = big_read(&mut server, &mut client, ep);
    client
        .post(ep, exs_transport::WorkRequest { wr_id: 1, op: read })
        .expect("read");
    let mut out = Vec::new();
    let completed = |out: &Vec<exs_transport::Completion>| {
        out.iter()
            .any(|c| matches!(c.op, exs_transport::Completed::Read))
    };
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_millis(300) {
        assert!(server.poll_cm().is_none(), "no connection event is due");
        client.poll(&mut out, 64);
        assert!(
            !completed(&out),
            "the peer's read was answered while the server only read its event queue"
        );
    }
    let t0 = Instant::now();
    while !completed(&out) {
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "the read never completed"
        );
        server.poll(&mut out, 64);
        client.poll(&mut out, 64);
    }
    drop(exposed);
}

/// Two transports whose queues wait with `wait`, `n` connections between them (see [`connect_pairs`]).
fn connected(wait: crate::CqWait, n: u32) -> (FabricTransport, FabricTransport) {
    let cfg = FabricConfig {
        cq_wait: wait,
        ..FabricConfig::default()
    };
    let mut server = FabricTransport::open(&cfg).expect("open tcp");
    let mut client = FabricTransport::open(&cfg).expect("open tcp");
    connect_pairs(&mut server, &mut client, n);
    (server, client)
}

/// 32 MiB of `server`'s memory exposed on `ep` for reading, and the client's read of all of it (more than a socket
/// takes at once: its response keeps the serving side sending).
fn big_read(
    server: &mut FabricTransport,
    client: &mut FabricTransport,
    ep: EndpointId,
) -> (Box<dyn exs_transport::Exposure>, exs_transport::Op) {
    const N: usize = 32 << 20;
    let sbuf = exs_dma::DmaBuf::new(N);
    let sreg = server.register(&sbuf).expect("register");
    let slease = sbuf
        .lease(0..N, exs_dma::LeaseKind::DeviceRead)
        .expect("lease");
    let exposed = server
        .expose(ep, &sreg, slease, exs_transport::RemoteAccess::Read)
        .expect("expose");
    let cbuf = exs_dma::DmaBuf::new(N);
    let creg = client.register(&cbuf).expect("register");
    let clease = cbuf
        .lease(0..N, exs_dma::LeaseKind::DeviceWrite)
        .expect("lease");
    let local = exs_transport::Sge::new(clease, creg).expect("sge");
    let read = exs_transport::Op::Read {
        local,
        remote: exposed.remote(),
    };
    (exposed, read)
}

/// A poll that finds completions leaves its consultation of the epoll set to a later poll (the caller is about to
/// act on what it found), but not for ever: while one connection's queue holds more completions than the polls
/// take, the set is still consulted every twice the interval; the other connection's queue, signalled, is read
/// although the busy queue fills every poll (each poll starts one queue further along the polled set).
#[test]
fn polls_that_find_completions_still_consult_the_epoll_set_and_read_the_other_queues() {
    use crate::ready::{CONSULT_EVERY, QUIET};
    let _serial = serial();
    const POLLS: u64 = 4 * CONSULT_EVERY;
    let cfg = FabricConfig::default();
    let mut server = FabricTransport::open(&cfg).expect("open tcp");
    let mut client = FabricTransport::open(&cfg).expect("open tcp");
    connect_pairs(&mut server, &mut client, 2);
    let mut out = Vec::new();
    // Idle: the queues go quiet (armed, out of the polled set); an arming that fails keeps one a while longer.
    for _ in 0..8 {
        for _ in 0..2 * QUIET {
            client.poll(&mut out, 64);
            server.poll(&mut out, 64);
        }
        let _ = (client.arm(), server.arm());
        if server.hot_queues() == 0 {
            break;
        }
    }
    assert_eq!(
        server.hot_queues(),
        0,
        "the server's queues did not go quiet"
    );
    let (busy, other) = (EndpointId(1), EndpointId(2));
    let sends = POLLS + 8;
    for i in 0..sends {
        let wr = recv_wr(&mut server, 100 + i);
        server.post(busy, wr).expect("receive");
        let wr = send_wr(&mut client, 1000 + i);
        client.post(busy, wr).expect("send");
    }
    let wr = send_wr(&mut client, 5000);
    client.post(other, wr).expect("send");
    // The client's provider pushes the bytes out as it completes the sends.
    let (mut sent, until) = (0, Instant::now() + Duration::from_secs(5));
    while sent <= sends && Instant::now() < until {
        out.clear();
        client.poll(&mut out, 64);
        sent += out.iter().filter(|c| c.status.is_ok()).count() as u64;
    }
    out.clear();
    server.poll(&mut out, 1);
    let s0 = server.ready_stats();
    let mut other_found = false;
    for i in 0..POLLS {
        out.clear();
        server.poll(&mut out, 1);
        other_found |= out.iter().any(|c| c.ep == other && c.status.is_ok());
        assert!(
            other_found || out.iter().any(|c| c.ep == busy && c.status.is_ok()),
            "poll {i} took no completion: {out:?}"
        );
    }
    let consults = server.ready_stats().consults - s0.consults;
    assert!(
        other_found,
        "the other connection's message not read in {POLLS} polls beside a busy queue"
    );
    assert_eq!(
        consults,
        POLLS / (2 * CONSULT_EVERY),
        "consultations in {POLLS} polls that each found a completion"
    );
}

/// Connects `n` endpoints of `client` (1..=n) to a listener of `server`, which accepts them in order (numbering
/// its own 1..=n), each side with four receives posted; returns when every end is up.
fn connect_pairs(server: &mut FabricTransport, client: &mut FabricTransport, n: u32) {
    let (_l, addr) = server
        .listen("127.0.0.1:0".parse().expect("address"), 1024)
        .expect("listen");
    for i in 1..=n {
        let recvs = (0..4).map(|k| recv_wr(client, k)).collect();
        client
            .connect(EndpointId(i), addr, b"x", recvs)
            .expect("connect");
    }
    let (mut up, mut accepted) = (0, 0);
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut out = Vec::new();
    while up < 2 * n {
        assert!(Instant::now() < deadline, "{up} connection ends up");
        while let Some(ev) = server.poll_cm() {
            match ev {
                CmEvent::ConnectRequest { request, .. } => {
                    accepted += 1;
                    let recvs = (0..4).map(|k| recv_wr(server, k)).collect();
                    server
                        .accept(request, EndpointId(accepted), b"y", recvs)
                        .expect("accept");
                }
                CmEvent::Established { .. } => up += 1,
                other => panic!("server: {other:?}"),
            }
        }
        while let Some(ev) = client.poll_cm() {
            match ev {
                CmEvent::Established { .. } => up += 1,
                other => panic!("client: {other:?}"),
            }
        }
        client.poll(&mut out, 64);
        server.poll(&mut out, 64);
    }
}

/// `pings` round trips on endpoint `ep` of both sides: each side reposts a receive before the other sends to it.
fn ping_pong(
    server: &mut FabricTransport,
    client: &mut FabricTransport,
    ep: EndpointId,
    pings: u64,
) {
    for i in 0..pings {
        let wr = recv_wr(server, 100 + i);
        server.post(ep, wr).expect("repost");
        let wr = send_wr(client, 1000 + i);
        client.post(ep, wr).expect("ping");
        await_recv(server, ep);
        let wr = recv_wr(client, 100 + i);
        client.post(ep, wr).expect("repost");
        let wr = send_wr(server, 1000 + i);
        server.post(ep, wr).expect("pong");
        await_recv(client, ep);
    }
}

/// Regression: a test process crashed once inside libfabric's `fi_dupinfo` with several threads opening transports
/// and connecting at once (`fi_getinfo` reads provider tables a provider fills lazily); those calls are now
/// serialised. Many threads open, listen and connect at once, repeatedly.
#[test]
fn transports_open_listen_and_connect_from_many_threads_at_once() {
    let _serial = serial();
    let threads: Vec<_> = (0..8)
        .map(|_| {
            std::thread::spawn(|| {
                for _ in 0..10 {
                    let mut t = FabricTransport::open(&FabricConfig::default()).expect("open tcp");
                    let (_l, addr) = t
                        .listen("127.0.0.1:0".parse().expect("address"), 16)
                        .expect("listen");
                    t.connect(EndpointId(1), addr, b"x", Vec::new())
                        .expect("connect");
                }
            })
        })
        .collect();
    for t in threads {
        t.join().expect("a thread opening transports panicked");
    }
}

/// Review: a message longer than the receive it landed in (64 bytes, posted by `connected`) completed with
/// `WcError::Other("Truncation error")`; it is the local length error every backend names (`FI_ETRUNC`, verbs'
/// `IBV_WC_LOC_LEN_ERR`).
#[test]
fn a_message_longer_than_its_receive_is_a_local_length_error() {
    let _serial = serial();
    let (mut server, mut client) = connected(crate::CqWait::default(), 1);
    let ep = EndpointId(1);
    let buf = exs_dma::DmaBuf::new(256);
    let reg = client.register(&buf).expect("register");
    let lease = buf
        .lease(0..256, exs_dma::LeaseKind::DeviceRead)
        .expect("lease");
    let sge = exs_transport::Sge::new(lease, reg).expect("sge");
    let send = exs_transport::WorkRequest {
        wr_id: 6,
        op: exs_transport::Op::Send {
            sges: vec![sge],
            imm: None,
        },
    };
    client.post(ep, send).expect("send");
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut out = Vec::new();
    let status = loop {
        assert!(Instant::now() < deadline, "the receive never completed");
        out.clear();
        client.poll(&mut out, 16);
        out.clear();
        server.poll(&mut out, 16);
        // The message lands in the first receive posted on the endpoint (the connection's own, then ours).
        if let Some(c) = out.first() {
            break c.status.clone();
        }
    };
    assert_eq!(status, Err(exs_transport::WcError::LocalLength));
}

/// A review found it: a send with immediate data posted only its first buffer (`fi_senddata` takes one) and
/// completed as if all had gone. It is refused, whole.
#[test]
fn a_send_with_immediate_data_over_two_buffers_is_refused_whole() {
    let _serial = serial();
    let (_server, mut client) = connected(crate::CqWait::default(), 1);
    let two = |t: &mut FabricTransport| {
        let mut wr = send_wr(t, 7);
        let exs_transport::Op::Send { sges, .. } = &mut wr.op else {
            unreachable!("a send")
        };
        let second = send_wr(t, 8);
        let exs_transport::Op::Send { sges: more, .. } = second.op else {
            unreachable!("a send")
        };
        sges.extend(more);
        wr
    };
    let mut wr = two(&mut client);
    if let exs_transport::Op::Send { imm, .. } = &mut wr.op {
        *imm = Some(5);
    }
    let refused = client
        .post(EndpointId(1), wr)
        .expect_err("two buffers with immediate data");
    assert!(
        matches!(refused.error, exs_transport::TransportError::Invalid(_)),
        "{:?}",
        refused.error
    );
    assert!(
        matches!(&refused.wr.op, exs_transport::Op::Send { sges, imm: Some(5) } if sges.len() == 2),
        "the request comes back whole"
    );
}

/// Review finding: while a listener closes, the event queue is read for its late requests for 20 ms at most. The
/// bound held only once one of them had come: a peer that kept the queue full of requests for another listener
/// held the closing one's reads, and so the engine, for as long as it kept them coming.
#[test]
fn a_flood_of_requests_for_another_listener_does_not_hold_a_closing_listener() {
    let peer: SocketAddr = "127.0.0.1:9".parse().expect("address");
    let (mut read, mut kept) = (0u64, 0u64);
    crate::connection::settle(
        ListenerId(1),
        || {
            read += 1;
            assert!(read < 50_000_000, "the reads never stopped");
            Some(CmEvent::ConnectRequest {
                listener: ListenerId(2),
                request: exs_transport::RequestId(read),
                peer,
                private: Vec::new(),
            })
        },
        |_| kept += 1,
    );
    assert!(kept > 0, "nothing read");
    assert_eq!(kept, read, "an event read was not kept");
}

/// A connect asks `fi_getinfo` on the transport's domain, then on any. When both fail, the first's words (which
/// name the configured domain) were dropped and only the second's reached the user.
#[test]
fn a_connect_whose_address_no_domain_takes_reports_both_lookups() {
    use exs_transport::TransportError;
    let first = crate::call::err("fi_getinfo", -99); // EADDRNOTAVAIL
    let second = crate::call::err("fi_getinfo", -61);
    let TransportError::Os { call, message, .. } = crate::call::both_failed("lo", first, second)
    else {
        panic!("an OS error stays one");
    };
    assert_eq!((call.call.as_str(), call.code), ("fi_getinfo", -61));
    assert!(
        message.contains("on any domain")
            && message.contains("on domain lo: ")
            && message.contains("address"),
        "{message}"
    );
    let other = TransportError::Invalid("x".into());
    assert_eq!(
        crate::call::both_failed("lo", crate::call::err("fi_getinfo", -61), other.clone()),
        other
    );
}

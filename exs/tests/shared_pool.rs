//! The shared receive pool (seed 003) on the simulated fabric: receive memory that does not grow with the number
//! of connections, per-connection order, an empty pool that delays instead of failing, growth at the low
//! watermark, and buffers flushed back when their connection goes down.
#![cfg(feature = "sim")] // the simulated fabric: `cargo test -p exs --features sim`

mod common;

use common::*;
use exs::sim::{SimConfig, World};
use exs::{
    Context, ContextOptions, EventKind, EventQueue, MemoryRegion, MsgFlags, SharedRecv, SockType,
    Socket, SocketOptions,
};

/// `n` connections from host 0 (`client`) to a listener on host 1 (`server`); returns (client, server) sockets.
struct Many {
    world: World,
    client: Context,
    server: Context,
    eq_c: EventQueue,
    eq_s: EventQueue,
    conns: Vec<(Socket, Socket)>,
    _listener: Socket,
}

fn many(n: usize, ty: SockType, cfg: SimConfig, server_pool: SharedRecv) -> Many {
    many_opts(n, ty, cfg, server_pool, SocketOptions::default())
}

/// [`many`], with options for the client sockets.
fn many_opts(
    n: usize,
    ty: SockType,
    cfg: SimConfig,
    server_pool: SharedRecv,
    client_opts: SocketOptions,
) -> Many {
    let world = World::new(cfg);
    let client = world.host_with({
        let mut o = ContextOptions::default();
        o.shared_recv.enabled = Some(false);
        o
    });
    let server = world.host_with({
        let mut o = ContextOptions::default();
        o.shared_recv = server_pool;
        o
    });
    let eq_c = EventQueue::new(8192).unwrap();
    let eq_s = EventQueue::new(8192).unwrap();
    let listener = Socket::new(&server, ty).unwrap();
    listener.bind(world.addr(1, 7000)).unwrap();
    let addr = listener.listen(4096).unwrap();
    let mut conns = Vec::new();
    for i in 0..n {
        listener.accept(&eq_s, i as u64).unwrap();
        let c = Socket::new(&client, ty).unwrap();
        c.set_options(client_opts).unwrap();
        c.connect(&eq_c, addr, i as u64).unwrap();
        let ev = wait(&eq_c);
        assert_eq!(ev.kind, EventKind::Connect);
        ev.status
            .clone()
            .unwrap_or_else(|e| panic!("connect {i}: {e}"));
        let mut ev = wait(&eq_s);
        assert_eq!(ev.kind, EventKind::Accept);
        let s = ev.take_accepted().expect("accepted socket");
        conns.push((c, s));
    }
    Many {
        world,
        client,
        server,
        eq_c,
        eq_s,
        conns,
        _listener: listener,
    }
}

fn pool_on() -> SharedRecv {
    let mut o = SharedRecv::default();
    o.enabled = Some(true);
    o
}

/// Sends `per` messages on every connection at once (sizes cycle through immediate and read-sized ones) while the
/// server is stalled (busy elsewhere, so arriving messages hold pool buffers), then lets it run and receives them
/// all, checking each connection's messages arrive in its order with their bytes.
fn exchange(m: &Many, per: usize) {
    let sizes = [1usize, 200, 512, 3000, 70_000];
    let mut expect = Vec::new();
    let mut dsts = Vec::new();
    for (ci, (_, s)) in m.conns.iter().enumerate() {
        for k in 0..per {
            let dst = MemoryRegion::alloc(&m.server, 70_000).unwrap();
            s.recv(&m.eq_s, &dst.all(), MsgFlags::NONE, (ci * per + k) as u64)
                .unwrap();
            dsts.push(dst);
        }
    }
    let mut srcs = Vec::new();
    for k in 0..per {
        for (ci, (c, _)) in m.conns.iter().enumerate() {
            let n = sizes[(ci + k) % sizes.len()];
            let data = pattern(n, (ci * 1000 + k) as u64);
            let src = MemoryRegion::from_vec(&m.client, data.clone()).unwrap();
            c.send(&m.eq_c, &src.all(), MsgFlags::NONE, (ci * per + k) as u64)
                .unwrap();
            srcs.push(src);
            expect.push(((ci * per + k) as u64, data));
        }
    }
    m.world.stall(1, true);
    m.world.run_for(std::time::Duration::from_millis(2));
    m.world.stall(1, false);
    let recvs = m
        .eq_s
        .wait_all(Some(std::time::Duration::from_secs(600)))
        .unwrap();
    assert_eq!(recvs.len(), m.conns.len() * per);
    let sends = m
        .eq_c
        .wait_all(Some(std::time::Duration::from_secs(600)))
        .unwrap();
    assert!(sends.iter().all(|e| e.is_ok()), "a send failed");
    for ev in &recvs {
        assert!(ev.is_ok(), "{ev:?}");
        // Receive k of connection ci was posted k-th on that connection, so it holds the k-th message sent on it.
        let (_, want) = expect.iter().find(|(ctx, _)| *ctx == ev.context).unwrap();
        assert_eq!(ev.bytes, want.len(), "receive {}", ev.context);
        let got = dsts[ev.context as usize].to_vec().unwrap();
        assert_bytes_eq(&got[..ev.bytes], want, "message through the shared pool");
    }
}

#[test]
fn receive_memory_per_connection_with_and_without_the_shared_pool() {
    let n = 200;
    let with = many(
        n,
        SockType::SeqPacket,
        SimConfig::default().with_shared_recv(4096),
        pool_on(),
    );
    let without = many(
        n,
        SockType::SeqPacket,
        SimConfig::default().with_shared_recv(4096),
        {
            let mut o = SharedRecv::default();
            o.enabled = Some(false);
            o
        },
    );
    let sw = with.server.stats();
    let so = without.server.stats();
    let pool = sw.pool.expect("the server uses the pool");
    assert_eq!(sw.ctrl_recv_bytes, 0, "no connection owns receive buffers");
    let pool_bytes = u64::from(pool.slots) * pool.slot_size as u64;
    assert!(so.pool.is_none());
    let per_with = pool_bytes / n as u64;
    let per_without = so.ctrl_recv_bytes / n as u64;
    eprintln!(
        "receive memory for {n} connections: {pool_bytes} bytes with the shared pool ({per_with} per connection), \
         {} without ({per_without} per connection)",
        so.ctrl_recv_bytes
    );
    assert!(per_with * 10 < per_without, "{per_with} vs {per_without}");
    exchange(&with, 2);
    exchange(&without, 2);
}

/// Issue: "one listener accepting 1,000 connections on the simulated fabric", with the shared pool.
#[test]
fn one_listener_accepts_a_thousand_connections() {
    let m = many(
        1000,
        SockType::SeqPacket,
        SimConfig::default().with_shared_recv(4096),
        pool_on(),
    );
    let st = m.server.stats();
    let pool = st.pool.unwrap();
    eprintln!(
        "1000 connections: {} bytes of receive memory in the pool, {} of the connections' own",
        u64::from(pool.slots) * pool.slot_size as u64,
        st.ctrl_recv_bytes
    );
    assert_eq!(st.ctrl_recv_bytes, 0);
    exchange(&m, 1);
}

/// Seed 003: "The posted Recv DTOs will complete in the order of Send postings to the other endpoint of each
/// connection ... There is no ordering among different connections."
#[test]
fn per_connection_order_is_kept_through_the_shared_pool() {
    let m = many(
        8,
        SockType::SeqPacket,
        SimConfig::default().with_shared_recv(4096),
        pool_on(),
    );
    exchange(&m, 40);
    let pool = m.server.stats().pool.unwrap();
    // Every buffer the clients sent came through the pool (several messages share one when coalesced).
    let buffers: u64 = m
        .conns
        .iter()
        .map(|(c, _)| c.stats().unwrap().link.ctrl_sends())
        .sum();
    assert!(buffers > 0);
    assert_eq!(pool.received, buffers, "{pool:?}");
    assert_eq!(
        pool.posted, pool.slots,
        "every buffer is back in the pool: {pool:?}"
    );
}

/// More messages in flight than the pool has buffers: senders wait (receiver-not-ready retry), nothing is lost.
#[test]
fn an_empty_pool_delays_senders_and_loses_nothing() {
    let small = {
        let mut o = SharedRecv::default();
        o.enabled = Some(true);
        o.chunk_slots = 8;
        o.max_slots = 8;
        o.low_watermark = 0;
        o
    };
    let m = many(
        20,
        SockType::SeqPacket,
        SimConfig::default().with_shared_recv(4096),
        small,
    );
    exchange(&m, 10);
    let pool = m.server.stats().pool.unwrap();
    assert_eq!(pool.slots, 8, "the pool never grew");
    assert!(
        m.world.stats().rnr > 0,
        "the pool never ran empty: the test proves nothing"
    );
    assert_eq!(pool.posted, 8);
}

/// `dat_srq_set_lw`: below the low watermark the pool adds a chunk.
#[test]
fn the_pool_grows_below_its_low_watermark() {
    let growing = {
        let mut o = SharedRecv::default();
        o.enabled = Some(true);
        o.chunk_slots = 8;
        o.max_slots = 64;
        o.low_watermark = 4;
        o
    };
    let m = many(
        20,
        SockType::SeqPacket,
        SimConfig::default().with_shared_recv(4096),
        growing,
    );
    exchange(&m, 10);
    let pool = m.server.stats().pool.unwrap();
    assert!(pool.grown > 0 && pool.slots > 8, "{pool:?}");
    assert!(pool.slots <= 64, "{pool:?}");
    assert!(pool.low_mark < 4, "{pool:?}");
}

/// Seed 003: buffers a connection holds when it goes down are flushed; they go back to the pool, and the other
/// connections keep working.
#[test]
fn buffers_of_a_connection_that_goes_down_return_to_the_pool() {
    let small = {
        let mut o = SharedRecv::default();
        o.enabled = Some(true);
        o.chunk_slots = 8;
        o.max_slots = 8;
        o.low_watermark = 0;
        o
    };
    // One message per buffer, so that the flood takes every buffer.
    let m = many_opts(
        6,
        SockType::SeqPacket,
        SimConfig::default().with_shared_recv(4096),
        small,
        SocketOptions::default().with_coalesce(false),
    );
    // Connection 0 floods the stalled server, so its messages hold every pool buffer and wait for more; then the
    // connection breaks.
    let (c0, _s0) = &m.conns[0];
    let src = MemoryRegion::from_vec(&m.client, pattern(100, 1)).unwrap();
    m.world.stall(1, true);
    for i in 0..12 {
        c0.send(&m.eq_c, &src.all(), MsgFlags::NONE, 1000 + i)
            .unwrap();
    }
    m.world.run_for(std::time::Duration::from_millis(5));
    assert!(m.world.stats().rnr > 0, "the flood did not empty the pool");
    let local = c0.local_addr().unwrap().unwrap();
    m.world.break_connection(0, local);
    m.world.stall(1, false);
    let evs = m
        .eq_c
        .wait_all(Some(std::time::Duration::from_secs(60)))
        .unwrap();
    assert_eq!(evs.len(), 12);
    m.world.run_for(std::time::Duration::from_millis(5));
    let pool = m.server.stats().pool.unwrap();
    assert_eq!(
        pool.posted, pool.slots,
        "buffers leaked from the pool: {pool:?}"
    );
    // The others are unaffected.
    let rest = Many {
        conns: m.conns[1..]
            .iter()
            .map(|(a, b)| (a.clone(), b.clone()))
            .collect(),
        ..m
    };
    exchange(&rest, 3);
}

/// Stream sockets over the pool: writes-with-immediate consume pool buffers too.
#[test]
fn stream_sockets_over_the_shared_pool() {
    let m = many(
        4,
        SockType::Stream,
        SimConfig::default().with_shared_recv(4096),
        pool_on(),
    );
    let data: Vec<Vec<u8>> = (0..4).map(|i| pattern(300_000, i)).collect();
    let mut dsts = Vec::new();
    for (i, (c, s)) in m.conns.iter().enumerate() {
        let src = MemoryRegion::from_vec(&m.client, data[i].clone()).unwrap();
        for k in 0..6 {
            c.send(
                &m.eq_c,
                &src.slice(k * 50_000..(k + 1) * 50_000),
                MsgFlags::NONE,
                i as u64,
            )
            .unwrap();
        }
        let dst = MemoryRegion::alloc(&m.server, 300_000).unwrap();
        s.recv(&m.eq_s, &dst.all(), MsgFlags::WAITALL, i as u64)
            .unwrap();
        dsts.push((dst, src));
    }
    let evs = m
        .eq_s
        .wait_all(Some(std::time::Duration::from_secs(60)))
        .unwrap();
    for ev in evs {
        assert!(ev.is_ok() && ev.bytes == 300_000, "{ev:?}");
        let got = dsts[ev.context as usize].0.to_vec().unwrap();
        assert_bytes_eq(&got, &data[ev.context as usize], "stream through the pool");
    }
    assert!(m.server.stats().pool.unwrap().received > 0);
}

/// Devices without receiver-not-ready retry (iWARP): a message that finds the shared queue empty ends its
/// connection, as `cargo xtask test --suite siw` saw on siw under load.
fn no_rnr_retry() -> SimConfig {
    SimConfig::default()
        .with_shared_recv(4096)
        .without_rnr_retry()
}

/// Regression (siw in the guest, under load: `stream_receives_filled_from_the_stream_buffer_get_no_key` and
/// `listener_accepts_many_connections` failed with a connection reset, the sender's request with
/// `IBV_WC_LOC_QP_OP_ERR`): the pool started at one chunk of 32 buffers and grew only when the engine ran, while
/// every connection promised its peer a window of its own; a burst beyond the buffers posted ended the connection.
/// Now the pool holds a buffer for every credit it promised before the promise is made.
#[test]
fn a_pool_without_rnr_retry_covers_every_credit_it_promised() {
    let n = 20;
    let m = many_opts(
        n,
        SockType::SeqPacket,
        no_rnr_retry(),
        pool_on(),
        SocketOptions::default().with_coalesce(false),
    );
    // Ten messages per connection arrive while the server takes nothing in: two hundred, beyond one chunk.
    exchange(&m, 10);
    assert_eq!(m.world.stats().rnr, 0, "a message found the pool empty");
    let pool = m.server.stats().pool.unwrap();
    let windows: u32 = m
        .conns
        .iter()
        .map(|(_, s)| s.stats().unwrap().window_in)
        .sum();
    assert_eq!(pool.promised, windows, "{pool:?}");
    // And a margin of one batch of completions (`POOL_MARGIN`).
    assert!(pool.slots >= windows + 64, "{pool:?}");
}

/// Without receiver-not-ready retry a pool must hold every promised buffer, and a peer past its
/// credits could take buffers promised to others: unless the application requires the pool, each connection posts
/// receives of its own, and the peer of a connection gets what it was promised.
#[test]
fn a_device_without_rnr_retry_gives_connections_receives_of_their_own_by_default() {
    let m = many(
        4,
        SockType::SeqPacket,
        no_rnr_retry(),
        SharedRecv::default(),
    );
    let st = m.server.stats();
    assert!(st.pool.is_none(), "{st:?}");
    assert!(st.ctrl_recv_bytes > 0, "{st:?}");
    exchange(&m, 10);
    assert_eq!(m.world.stats().rnr, 0);
}

/// The same for a stream whose writer runs ahead of a stalled reader: a thousand small writes, each a write with
/// immediate data that takes a pool buffer, against a window larger than the pool's first chunk.
#[test]
fn a_stream_writer_ahead_of_a_stalled_reader_on_a_pool_without_rnr_retry() {
    let m = many_opts(
        1,
        SockType::Stream,
        no_rnr_retry(),
        pool_on(),
        SocketOptions::default().with_coalesce(false),
    );
    let (c, s) = &m.conns[0];
    // A first write sets the reader's stream buffer up, so that the writes below go out at once.
    let first = MemoryRegion::from_vec(&m.client, vec![7; 64]).unwrap();
    c.send(&m.eq_c, &first.all(), MsgFlags::NONE, 0).unwrap();
    let got = MemoryRegion::alloc(&m.server, 64).unwrap();
    s.recv(&m.eq_s, &got.all(), MsgFlags::WAITALL, 0).unwrap();
    assert!(wait(&m.eq_s).is_ok());
    assert!(wait(&m.eq_c).is_ok());
    let sent = pattern(64 * 1000, 9);
    let src = MemoryRegion::from_vec(&m.client, sent.clone()).unwrap();
    m.world.stall(1, true);
    for i in 0..1000 {
        c.send(
            &m.eq_c,
            &src.slice(i * 64..(i + 1) * 64),
            MsgFlags::NONE,
            i as u64,
        )
        .unwrap();
    }
    m.world.run_for(std::time::Duration::from_millis(5));
    m.world.stall(1, false);
    let dst = MemoryRegion::alloc(&m.server, sent.len()).unwrap();
    s.recv(&m.eq_s, &dst.all(), MsgFlags::WAITALL, 0).unwrap();
    let ev = wait(&m.eq_s);
    assert!(ev.is_ok() && ev.bytes == sent.len(), "{ev:?}");
    assert_bytes_eq(&dst.to_vec().unwrap(), &sent, "the stream through the pool");
    assert_eq!(m.world.stats().rnr, 0, "a write found the pool empty");
}

/// Where the pool covers its promises, a connection it cannot cover (it may not grow enough) is refused, saying
/// what to change; once a connection's endpoint is gone, its promise is too and another connection fits.
#[test]
fn a_connection_a_pool_without_rnr_retry_cannot_cover_is_refused() {
    let world = World::new(no_rnr_retry());
    let mut small = pool_on();
    small.chunk_slots = 32;
    small.max_slots = 128;
    let (a, _b, l, addr) = pool_client(&world, small);
    let (eq_a, eq_b) = (EventQueue::new(64).unwrap(), EventQueue::new(64).unwrap());
    let first = connect_one(&a, &l, addr, &eq_a, &eq_b);
    let w = first.0.stats().unwrap().window_in;
    let mut conns = vec![first];
    // A margin of 64 beyond the promises (`POOL_MARGIN`).
    while a.stats().pool.unwrap().promised + w + 64 <= 128 {
        conns.push(connect_one(&a, &l, addr, &eq_a, &eq_b));
    }
    let c = Socket::new(&a, SockType::SeqPacket).unwrap();
    let err = c.connect(&eq_a, addr, 0).unwrap_err();
    let io: std::io::Error = err.into();
    assert!(io.to_string().contains("shared_recv.max_slots"), "{io}");
    let pool = a.stats().pool.unwrap();
    assert_eq!(pool.promised, w * conns.len() as u32, "{pool:?}");
    let (gone, peer) = conns.pop().unwrap();
    gone.close().unwrap();
    drop(peer);
    world.run_for(std::time::Duration::from_millis(50));
    assert_eq!(a.stats().pool.unwrap().promised, w * conns.len() as u32);
    conns.push(connect_one(&a, &l, addr, &eq_a, &eq_b));
    let dsts: Vec<MemoryRegion> = (0..8)
        .map(|_| MemoryRegion::alloc(&a, 300).unwrap())
        .collect();
    let (c, s) = conns.last().unwrap();
    deliver((&world, &a, &_b), s, c, (&eq_a, &eq_b), &dsts);
}

#[test]
fn requiring_a_pool_where_the_transport_has_none_fails_clearly() {
    let world = World::new(SimConfig::default());
    let a = world.host_with({
        let mut o = ContextOptions::default();
        o.shared_recv = pool_on();
        o
    });
    let _b = world.host();
    let eq = EventQueue::new(8).unwrap();
    let s = Socket::new(&a, SockType::SeqPacket).unwrap();
    let err = s.connect(&eq, world.addr(1, 7000), 0).unwrap_err();
    let io: std::io::Error = err.into();
    assert_eq!(io.kind(), std::io::ErrorKind::Unsupported, "{io}");
    assert!(io.to_string().contains("shared receive queue"), "{io}");
}

/// A raw peer connected to a listener of a threaded world's host (its own receive slots, or the shared pool),
/// whose handshake grants us four control-buffer credits; the accepted socket and the listener's queue. The
/// context lingers 200 ms (a connection closed for a violation waits that long at most for its sends).
fn raw_peer_granting_four(
    pool: bool,
    keepalive: Option<std::time::Duration>,
) -> (World, Context, EventQueue, Socket, exs::testing::RawPeer) {
    use exs::testing::{handshake, RawPeer};
    use exs::wire::WireSockType;
    // Devices that retry a receiver-not-ready for ever: only our side's checks can stop a peer's flood.
    let mut cfg = SimConfig::default().with_shared_recv(4096);
    cfg.rnr = exs::sim::RnrPolicy::Wait;
    let world = World::threaded(cfg);
    let ctx = world.host_with({
        let mut o = ContextOptions::default();
        o.shared_recv.enabled = Some(pool);
        o.keepalive = keepalive;
        o.linger = std::time::Duration::from_millis(200);
        o
    });
    let eq = EventQueue::new(64).unwrap();
    let l = Socket::new(&ctx, SockType::SeqPacket).unwrap();
    l.bind(world.addr(0, 7000)).unwrap();
    let addr = l.listen(4).unwrap();
    l.accept(&eq, 1).unwrap();
    let mut hs = handshake(WireSockType::SeqPacket);
    hs.ctrl_window = 4;
    let raw = RawPeer::connect(Box::new(world.raw_host()), addr, &hs.encode()).unwrap();
    let mut ev = eq.next(Some(std::time::Duration::from_secs(10))).unwrap();
    let s = ev.take_accepted().unwrap();
    (world, ctx, eq, s, raw)
}

/// A peer that sends past its control-buffer credits while it returns none of ours is closed for an overrun, with
/// the shared pool (nothing else stops it taking buffers meant for every connection) and with the connection's
/// own receive slots (where its extra messages waited for each repost while our credit messages could not leave).
/// Before, it went on for as long as it liked.
#[test]
fn a_peer_sending_past_its_credits_while_withholding_ours_is_closed() {
    use exs::wire::{Body, Message};
    use exs::{OpError, Violation};
    use std::time::Duration;
    for pool in [true, false] {
        // Four of our messages fit the peer's window, and it returns no credit: we can give back a few windows'
        // worth of credits at most.
        let (_world, ctx, eq, s, mut raw) = raw_peer_granting_four(pool, None);
        let buf = MemoryRegion::alloc(&ctx, 64).unwrap();
        s.recv(&eq, &buf.all(), MsgFlags::NONE, 2).unwrap();
        let window = usize::from(raw.peer.ctrl_window);
        let credit = Message::new(Body::Credit).to_vec();
        // Each message once the one before was delivered.
        for _ in 0..8 * window {
            let delivered = raw
                .send_bytes(&credit, None)
                .map_err(|_| ())
                .and_then(|id| raw.wait_done(id).map_err(|_| ()));
            if delivered.is_err() {
                break;
            }
        }
        let e = eq.next(Some(Duration::from_secs(10))).unwrap();
        assert!(
            matches!(
                e.status,
                Err(OpError::PeerMisbehaved(Violation::CreditOverrun { .. }))
            ),
            "pool {pool}: {e:?}"
        );
    }
}

/// A peer that takes our messages but never returns a control-buffer credit is closed after two keepalive
/// intervals with messages waiting: our keepalive probe needs a credit too, so the connection (and a receive
/// waiting on it) stayed for ever. (How the intervals are counted: the link's unit test
/// `credits_withheld_only_after_two_whole_intervals_of_waiting`.)
#[test]
fn a_peer_that_returns_no_credits_is_closed_after_two_keepalives() {
    use exs::{OpError, Violation};
    use std::time::{Duration, Instant};
    let keepalive = Duration::from_millis(200);
    let (_world, ctx, eq, s, mut raw) = raw_peer_granting_four(false, Some(keepalive));
    let buf = MemoryRegion::from_vec(&ctx, vec![5u8; 64]).unwrap();
    let start = Instant::now();
    for i in 0..8 {
        s.send(&eq, &buf.all(), MsgFlags::NONE, 10 + i).unwrap();
    }
    // The raw peer receives (and reposts its buffers) but returns nothing.
    raw.pump(Duration::from_millis(50), |_| false);
    let into = MemoryRegion::alloc(&ctx, 64).unwrap();
    s.recv(&eq, &into.all(), MsgFlags::NONE, 99).unwrap();
    let mut failed = None;
    while let Ok(e) = eq.next(Some(Duration::from_secs(10))) {
        if let Err(err) = e.status {
            failed = Some(err);
            break;
        }
    }
    assert_eq!(
        failed,
        Some(OpError::PeerMisbehaved(Violation::CreditsWithheld)),
        "the receive did not fail for the withheld credits"
    );
    assert!(
        start.elapsed() >= 2 * keepalive,
        "closed before two keepalive intervals of waiting passed: {:?}",
        start.elapsed()
    );
    assert!(!raw.received.is_empty(), "nothing reached the peer");
}

/// A context on host 0 of `world` with `pool` as its shared receive pool, a plain one on host 1 listening, and
/// the listener's queue.
fn pool_client(
    world: &World,
    pool: SharedRecv,
) -> (Context, Context, Socket, std::net::SocketAddr) {
    let a = world.host_with({
        let mut o = ContextOptions::default();
        o.shared_recv = pool;
        o
    });
    let b = world.host_with({
        let mut o = ContextOptions::default();
        o.shared_recv.enabled = Some(false);
        o
    });
    let l = Socket::new(&b, SockType::SeqPacket).unwrap();
    l.bind(world.addr(1, 7000)).unwrap();
    let addr = l.listen(16).unwrap();
    (a, b, l, addr)
}

/// Connects a socket of `a` to `addr`, accepted on `l`: (client, server).
fn connect_one(
    a: &Context,
    l: &Socket,
    addr: std::net::SocketAddr,
    eq_a: &EventQueue,
    eq_b: &EventQueue,
) -> (Socket, Socket) {
    l.accept(eq_b, 0).unwrap();
    let c = Socket::new(a, SockType::SeqPacket).unwrap();
    c.connect(eq_a, addr, 0).unwrap();
    let ev = wait(eq_a);
    assert!(ev.kind == EventKind::Connect && ev.is_ok(), "{ev:?}");
    let mut ev = wait(eq_b);
    let s = ev.take_accepted().expect("accepted socket");
    (c, s)
}

/// `n` messages from `from` to `to`, each received into a buffer of `dsts` posted first (while `stalled` host 0
/// takes nothing in, then runs again), checked in order.
fn deliver(
    m: (&World, &Context, &Context),
    from: &Socket,
    to: &Socket,
    eqs: (&EventQueue, &EventQueue),
    dsts: &[MemoryRegion],
) {
    let (world, a, b) = m;
    let _ = a;
    for (i, d) in dsts.iter().enumerate() {
        to.recv(eqs.0, &d.all(), MsgFlags::NONE, i as u64).unwrap();
    }
    let srcs: Vec<MemoryRegion> = (0..dsts.len())
        .map(|i| MemoryRegion::from_vec(b, pattern(300, i as u64)).unwrap())
        .collect();
    for (i, s) in srcs.iter().enumerate() {
        from.send(eqs.1, &s.all(), MsgFlags::NONE, i as u64)
            .unwrap();
    }
    world.stall(0, true);
    world.run_for(std::time::Duration::from_millis(2));
    world.stall(0, false);
    for _ in 0..dsts.len() {
        let ev = wait(eqs.0);
        assert!(ev.is_ok() && ev.bytes == 300, "{ev:?}");
        let got = dsts[ev.context as usize].to_vec().unwrap();
        assert_bytes_eq(
            &got[..300],
            &pattern(300, ev.context),
            "a message through the pool",
        );
    }
    let sends = eqs
        .1
        .wait_all(Some(std::time::Duration::from_secs(60)))
        .unwrap();
    assert!(sends.iter().all(|e| e.is_ok()), "{sends:?}");
}

/// Review finding: when the first chunk of a context's shared pool could not be registered (the locked-memory
/// limit), the context fell back to each connection posting its own receives while the transport's shared queue
/// stayed and took every later connection's messages (verbs refuses a connection's own receives once it exists;
/// here its messages never arrived). The pool now stays: the connection that found no memory fails, and a later
/// one grows the pool and works.
#[test]
fn a_pool_whose_first_chunk_could_not_be_registered_serves_later_connections() {
    let world = World::new(SimConfig::default().with_shared_recv(4096));
    // A watermark of 0: the pool never grows by it, so the connection that comes later must find it filled.
    let never_grows = {
        let mut o = SharedRecv::default();
        o.low_watermark = 0;
        o
    };
    let (a, b, l, addr) = pool_client(&world, never_grows);
    let (eq_a, eq_b) = (EventQueue::new(64).unwrap(), EventQueue::new(64).unwrap());
    world.refuse_registrations(0, true);
    let first = Socket::new(&a, SockType::SeqPacket).unwrap();
    let refused = first.connect(&eq_a, addr, 0);
    assert!(
        refused.is_err(),
        "a connection with no memory for its receives: {refused:?}"
    );
    world.refuse_registrations(0, false);
    let (c, s) = connect_one(&a, &l, addr, &eq_a, &eq_b);
    let dsts: Vec<MemoryRegion> = (0..4)
        .map(|_| MemoryRegion::alloc(&a, 300).unwrap())
        .collect();
    deliver((&world, &a, &b), &s, &c, (&eq_a, &eq_b), &dsts);
    assert!(a.stats().pool.unwrap().slots > 0, "{:?}", a.stats().pool);
}

/// Review finding: a growth of the shared pool that failed dropped the pool; the next connection asked the
/// transport for a second shared queue and failed, as did every one after it. A failed growth now leaves the
/// pool as it was, and it grows once memory can be registered again.
#[test]
fn a_pool_that_could_not_grow_stays_and_later_connections_come_up() {
    let world = World::new(SimConfig::default().with_shared_recv(4096));
    let growing = {
        let mut o = pool_on();
        o.chunk_slots = 8;
        o.max_slots = 64;
        o.low_watermark = 4;
        o
    };
    let (a, b, l, addr) = pool_client(&world, growing);
    let (eq_a, eq_b) = (EventQueue::new(64).unwrap(), EventQueue::new(64).unwrap());
    let (c, s) = connect_one(&a, &l, addr, &eq_a, &eq_b);
    let dsts: Vec<MemoryRegion> = (0..12)
        .map(|_| MemoryRegion::alloc(&a, 300).unwrap())
        .collect();
    world.refuse_registrations(0, true);
    // Twelve messages on eight buffers while the client takes nothing in: the pool runs dry and tries to grow.
    deliver((&world, &a, &b), &s, &c, (&eq_a, &eq_b), &dsts);
    let pool = a.stats().pool.expect("the pool is still there");
    assert_eq!((pool.slots, pool.grown), (8, 0), "{pool:?}");
    // A growth that failed is tried again only after a while, not at every burst that drains the pool.
    let tried = a.stats().registrations;
    for _ in 0..10 {
        deliver((&world, &a, &b), &s, &c, (&eq_a, &eq_b), &dsts);
    }
    let again = a.stats().registrations - tried;
    assert!(again <= 2, "{again} registrations tried in ten more bursts");
    world.refuse_registrations(0, false);
    // Past the wait after the last failure, the next batch below the watermark grows the pool.
    world.run_for(std::time::Duration::from_millis(200));
    let (c2, s2) = connect_one(&a, &l, addr, &eq_a, &eq_b);
    deliver((&world, &a, &b), &s2, &c2, (&eq_a, &eq_b), &dsts);
    let pool = a.stats().pool.unwrap();
    assert!(pool.slots > 8 && pool.grown > 0, "{pool:?}");
    drop((c, s));
}

/// Review finding: a message longer than the shared pool's buffers failed its pool receive with a length error,
/// which the engine took for a flush: it put the buffer back and told nobody. On verbs the queue pair is then in
/// error and rdma_cm says nothing (the simulator's `quiet_length_errors`), so the connection stayed up and a
/// receive on it waited for good. The error now ends the connection, as on its own receive slots.
#[test]
fn a_message_longer_than_the_pools_buffers_ends_its_connection() {
    use exs::OpError;
    use std::time::Duration;
    let (world, ctx, eq, s, mut raw) = raw_peer_granting_four(true, None);
    world.quiet_length_errors(0, true);
    let buf = MemoryRegion::alloc(&ctx, 64).unwrap();
    s.recv(&eq, &buf.all(), MsgFlags::NONE, 2).unwrap();
    let too_long = vec![0u8; usize::from(raw.peer.slot_size) + 1];
    let id = raw.send_bytes(&too_long, None).unwrap();
    assert!(raw.wait_done(id).is_err(), "the long message was taken");
    let e = eq
        .next(Some(Duration::from_secs(10)))
        .expect("the receive never ended");
    // The peer's doing, said so (it read as a transport failure of ours, "invalid argument").
    assert!(
        matches!(
            e.status,
            Err(OpError::PeerMisbehaved(exs::Violation::MessageTooLong))
        ),
        "{e:?}"
    );
    let pool = ctx.stats().pool.expect("the pool serves the context");
    assert_eq!(pool.failed, 1, "counted as failed, not flushed: {pool:?}");
}

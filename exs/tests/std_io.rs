//! Issue 16: `exs::Stream` and `exs::Listener`, the `std::net`-shaped blocking API, on the simulated fabric.
#![cfg(feature = "sim")] // the simulated fabric: `cargo test -p exs --features sim`

use std::io::{ErrorKind, Read, Write};
use std::net::Shutdown;
use std::time::Duration;

use exs::sim::{SimConfig, World};
use exs::{Listener, Stream};

fn pattern(len: usize) -> Vec<u8> {
    exs::testing::pattern(len, 26)
}

/// A threaded world whose server accepts one stream on `port` and reads it to its end: the world (kept alive by
/// the caller), the client's context, the address to connect to, and the reader returning every byte it read.
fn sink(
    port: u16,
) -> (
    World,
    exs::Context,
    std::net::SocketAddr,
    std::thread::JoinHandle<Vec<u8>>,
) {
    let world = World::threaded(SimConfig::default());
    let (server, client) = (world.host(), world.host());
    let listener = Listener::bind_in(&server, world.addr(0, port)).unwrap();
    let addr = listener.local_addr().unwrap();
    let reader = std::thread::spawn(move || {
        let mut all = Vec::new();
        listener.accept().unwrap().0.read_to_end(&mut all).unwrap();
        all
    });
    (world, client, addr, reader)
}

/// A threaded world and a stream connected to a listener on `port` of its first host: (world, client, server).
fn connected(port: u16) -> (World, Stream, Stream) {
    let world = World::threaded(SimConfig::default());
    let (server, client) = (world.host(), world.host());
    let listener = Listener::bind_in(&server, world.addr(0, port)).unwrap();
    // As TCP's, a connect completes when the listener has set the connection up, before its accept.
    let accepting = std::thread::spawn(move || listener.accept().unwrap());
    let c = Stream::connect_in(&client, world.addr(0, port)).unwrap();
    let (s, _) = accepting.join().unwrap();
    (world, c, s)
}

#[test]
fn a_stream_echoes_a_mebibyte_then_reads_end_of_stream() {
    let world = World::threaded(SimConfig::default());
    let (server, client) = (world.host(), world.host());
    let listener = Listener::bind_in(&server, world.addr(0, 9100)).unwrap();
    let addr = listener.local_addr().unwrap();
    let echo = std::thread::spawn(move || {
        let (mut s, peer) = listener.accept().unwrap();
        assert_eq!(s.peer_addr().unwrap(), peer);
        let mut buf = vec![0u8; 100_000];
        loop {
            let n = s.read(&mut buf).unwrap();
            if n == 0 {
                break;
            }
            s.write_all(&buf[..n]).unwrap();
        }
        s.shutdown(Shutdown::Write).unwrap();
    });
    let mut c = Stream::connect_in(&client, addr).unwrap();
    assert_eq!(c.peer_addr().unwrap(), addr);
    let data = pattern(1 << 20);
    c.write_all(&data).unwrap();
    c.shutdown(Shutdown::Write).unwrap();
    let mut back = Vec::new();
    c.read_to_end(&mut back).unwrap();
    assert!(back == data, "echoed bytes differ");
    echo.join().unwrap();
}

/// Issue 26: `read_to_end` appends every byte after what the vector held (it copies straight out of the receive
/// buffer instead of zeroing the vector's spare room first), and `read_to_string` refuses bytes that are not UTF-8
/// and leaves the string as it was, as std's do.
#[test]
fn read_to_end_appends_and_read_to_string_refuses_bytes_that_are_not_utf8() {
    let world = World::threaded(SimConfig::default());
    let (server, client) = (world.host(), world.host());
    let listener = Listener::bind_in(&server, world.addr(0, 9110)).unwrap();
    let addr = listener.local_addr().unwrap();
    let data = pattern(300_000);
    let sent = data.clone();
    let writer = std::thread::spawn(move || {
        for bytes in [&sent[..], &[0xff, 0xfe][..]] {
            let (mut s, _) = listener.accept().unwrap();
            s.write_all(bytes).unwrap();
            s.shutdown(Shutdown::Write).unwrap();
        }
    });
    let mut all = b"before".to_vec();
    let n = Stream::connect_in(&client, addr)
        .unwrap()
        .read_to_end(&mut all)
        .unwrap();
    assert_eq!(n, data.len());
    assert!(
        all[..6] == *b"before" && all[6..] == data[..],
        "bytes differ"
    );
    let mut text = String::from("kept");
    let e = Stream::connect_in(&client, addr)
        .unwrap()
        .read_to_string(&mut text)
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidData);
    assert_eq!(text, "kept");
    writer.join().unwrap();
}

/// Issue 26: a vectored write takes every slice at once (gathered into the send ring), where `Write`'s default
/// would take only the first: a header and its body leave together, in order.
#[test]
fn a_vectored_write_takes_every_slice_in_order() {
    use std::io::IoSlice;
    let (_world, client, addr, reader) = sink(9120);
    let (head, body, tail) = (
        b"header: 1\r\n\r\n".to_vec(),
        pattern(70_000),
        b"end".to_vec(),
    );
    let mut c = Stream::connect_in(&client, addr).unwrap();
    let bufs = [
        IoSlice::new(&head),
        IoSlice::new(&[]),
        IoSlice::new(&body),
        IoSlice::new(&tail),
    ];
    let n = c.write_vectored(&bufs).unwrap();
    assert_eq!(n, head.len() + body.len() + tail.len(), "every slice taken");
    c.shutdown(Shutdown::Write).unwrap();
    let want = [head, body, tail].concat();
    assert!(reader.join().unwrap() == want, "bytes differ");
}

/// Issue 26 (review of the read path): under the trusted-peers exposure policy a long-lived key covers the whole
/// receive buffer; reads copy out beside it (a borrow of the buffer would be refused, and every read failed).
#[test]
fn streams_read_and_write_under_the_trusted_peers_exposure_policy() {
    let world = World::threaded(SimConfig::default());
    let opts = || {
        let mut o = exs::ContextOptions::default();
        o.exposure = exs::ExposurePolicy::TrustedPeers;
        o.keepalive = None;
        o
    };
    let (server, client) = (world.host_with(opts()), world.host_with(opts()));
    let listener = Listener::bind_in(&server, world.addr(0, 9130)).unwrap();
    let addr = listener.local_addr().unwrap();
    let echo = std::thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        let mut all = Vec::new();
        s.read_to_end(&mut all).unwrap();
        s.write_all(&all).unwrap();
    });
    let data = pattern(3 << 20);
    let mut c = Stream::connect_in(&client, addr).unwrap();
    c.write_all(&data).unwrap();
    c.shutdown(Shutdown::Write).unwrap();
    let mut back = vec![0u8; data.len()];
    c.read_exact(&mut back).unwrap();
    assert!(back == data, "echoed bytes differ");
    echo.join().unwrap();
}

/// Issue 26: a vectored write whose slices straddle the send pieces (made small here) resumes each slice
/// where the last piece stopped.
#[test]
fn a_vectored_write_across_small_send_pieces_keeps_every_byte_in_order() {
    use std::io::IoSlice;
    let (_world, client, addr, reader) = sink(9140);
    let mut cfg = exs::StreamConfig::default();
    cfg.send_piece = 1000;
    let mut c = Stream::connect_with(&client, addr, &cfg).unwrap();
    let parts = [pattern(2_500), pattern(1), Vec::new(), pattern(7_321)];
    let want = parts.concat();
    let mut sent = 0;
    while sent < want.len() {
        // The slices not yet taken, the first cut where the last write stopped.
        let (mut skip, mut bufs) = (sent, Vec::new());
        for p in &parts {
            if skip >= p.len() {
                skip -= p.len();
                continue;
            }
            bufs.push(IoSlice::new(&p[skip..]));
            skip = 0;
        }
        sent += c.write_vectored(&bufs).unwrap();
    }
    c.shutdown(Shutdown::Write).unwrap();
    assert!(reader.join().unwrap() == want, "bytes differ");
}

#[test]
fn a_read_that_waits_too_long_fails_with_would_block_and_the_next_one_gets_the_bytes() {
    let (_world, mut c, mut s) = connected(9101);
    c.set_read_timeout(Some(Duration::from_millis(50))).unwrap();
    let mut buf = [0u8; 10];
    let e = c.read(&mut buf).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::WouldBlock, "{e}");
    s.write_all(b"late").unwrap();
    c.set_read_timeout(None).unwrap();
    let n = c.read(&mut buf).unwrap();
    assert_eq!(&buf[..n], b"late");
    assert!(c.set_read_timeout(Some(Duration::ZERO)).is_err());
}

/// A review found it: a read waiting for data in one thread, with no timeout, held the reader's lock, and a read
/// with a timeout in another thread waited for that lock past its timeout, for ever while no data came (std's
/// gives `WouldBlock` at the timeout). Now the wait for the other reader counts against the timeout.
#[test]
fn a_read_timeout_holds_while_another_thread_waits_to_read() {
    let (_world, c, mut s) = connected(9106);
    let other = c.try_clone().unwrap();
    let waiting = std::thread::spawn(move || {
        let mut buf = [0u8; 4];
        (&other).read(&mut buf).map(|n| buf[..n].to_vec())
    });
    // Let it take its turn and wait.
    std::thread::sleep(Duration::from_millis(200));
    c.set_read_timeout(Some(Duration::from_millis(300)))
        .unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    let timed = std::thread::spawn(move || {
        let mut buf = [0u8; 4];
        let r = (&c).read(&mut buf).map_err(|e| e.kind());
        let _ = tx.send(r);
        c
    });
    let r = rx.recv_timeout(Duration::from_secs(20));
    // Let both readers go, whatever happened.
    s.write_all(b"data").unwrap();
    assert_eq!(
        r.expect("the read with a timeout returned"),
        Err(ErrorKind::WouldBlock)
    );
    assert_eq!(waiting.join().unwrap().unwrap(), b"data");
    timed.join().unwrap();
}

#[test]
fn connecting_where_nobody_listens_is_refused() {
    let world = World::threaded(SimConfig::default());
    let (_server, client) = (world.host(), world.host());
    let e = Stream::connect_in(&client, world.addr(0, 9102)).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::ConnectionRefused, "{e}");
}

/// `TcpListener::set_nonblocking`'s shape: a non-blocking accept with no connection come fails with `WouldBlock`
/// at once; the connection that comes is returned by a later call, and works.
#[test]
fn a_non_blocking_accept_says_would_block_until_a_connection_comes() {
    let world = World::threaded(SimConfig::default());
    let (server, client) = (world.host(), world.host());
    let listener = Listener::bind_in(&server, world.addr(0, 9194)).unwrap();
    listener.set_nonblocking(true).unwrap();
    let t = std::time::Instant::now();
    for _ in 0..3 {
        let e = listener.accept().map(|_| ()).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::WouldBlock, "{e}");
    }
    assert!(t.elapsed() < Duration::from_secs(5), "the accepts waited");
    let mut c = Stream::connect_in(&client, listener.local_addr().unwrap()).unwrap();
    let (mut s, _) = loop {
        match listener.accept() {
            Ok(got) => break got,
            Err(e) if e.kind() == ErrorKind::WouldBlock => {
                assert!(
                    t.elapsed() < Duration::from_secs(20),
                    "no connection accepted"
                );
                std::thread::sleep(Duration::from_millis(2));
            }
            Err(e) => panic!("accept: {e}"),
        }
    };
    c.write_all(b"hello").unwrap();
    let mut got = [0u8; 5];
    s.read_exact(&mut got).unwrap();
    assert_eq!(&got, b"hello");
    listener.set_nonblocking(false).unwrap();
    drop(c);
}

/// Issue 26: code written for `std::net` ports by renaming. `Listener::bind` and `Stream::connect` (no context)
/// run on the process's default context (the simulator when it is the only backend compiled in, else libfabric
/// tcp on loopback).
#[test]
fn listener_bind_and_stream_connect_run_on_the_default_context() {
    let listener = Listener::bind("0.0.0.0:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let echo = std::thread::spawn(move || {
        let (mut s, peer) = listener.accept().unwrap();
        assert_eq!(s.peer_addr().unwrap(), peer);
        let mut buf = [0u8; 5];
        s.read_exact(&mut buf).unwrap();
        s.write_all(&buf).unwrap();
    });
    let mut c = Stream::connect(addr).unwrap();
    assert_eq!(c.peer_addr().unwrap(), addr);
    let local = c.local_addr().unwrap();
    assert!(
        local.ip() == addr.ip() || addr.ip().is_unspecified(),
        "{local} for a listener on {addr}"
    );
    c.write_all(b"hello").unwrap();
    let mut back = [0u8; 5];
    c.read_exact(&mut back).unwrap();
    assert_eq!(&back, b"hello");
    echo.join().unwrap();
    let ctx = exs::default_context().unwrap();
    assert_eq!(
        ctx.id(),
        exs::default_context().unwrap().id(),
        "one default context per process"
    );
}

/// A stream connect from a context whose own connect timeout is `context_timeout` to a peer that takes the
/// connection request and never answers it (a raw transport listening, with no exs engine behind it), the call
/// asking for `timeout`: its error and how long it took.
fn connect_to_a_silent_peer(
    port: u16,
    context_timeout: Duration,
    timeout: Duration,
) -> (std::io::Error, Duration) {
    use exs::Transport as _;
    let world = World::threaded(SimConfig::default());
    let mut opts = exs::ContextOptions::default();
    opts.connect_timeout = context_timeout;
    let client = world.host_with(opts);
    let mut silent = world.raw_host();
    let (_, addr) = silent.listen(world.addr(1, port), 8).unwrap();
    let mut cfg = exs::StreamConfig::default();
    cfg.connect_timeout = Some(timeout);
    let t = std::time::Instant::now();
    let e = Stream::connect_with(&client, addr, &cfg).unwrap_err();
    let took = t.elapsed();
    drop(silent);
    (e, took)
}

/// Issue 26: `connect_timeout` bounds a connection attempt (as `TcpStream::connect_timeout`): a peer that takes
/// the connection request and never answers it holds the attempt, which ends `TimedOut` after the timeout, not
/// the context's 10 s. (A listener of ours answers by itself, before its application accepts, as TCP's does.)
#[test]
fn a_connection_nobody_answers_ends_after_its_connect_timeout() {
    let (e, took) =
        connect_to_a_silent_peer(9103, Duration::from_secs(10), Duration::from_millis(200));
    assert_eq!(e.kind(), ErrorKind::TimedOut, "{e}");
    assert!(took < Duration::from_secs(5), "{took:?}");
}

/// A connect timeout longer than the context's was cut at the context's: the engine timed every attempt out
/// after the context's `connect_timeout`, whatever the call asked for.
#[test]
fn a_connect_timeout_longer_than_the_contexts_is_waited_out() {
    let (e, took) =
        connect_to_a_silent_peer(9105, Duration::from_millis(100), Duration::from_millis(800));
    assert_eq!(e.kind(), ErrorKind::TimedOut, "{e}");
    assert!(
        took >= Duration::from_millis(800),
        "gave up after {took:?}, at the context's 100 ms"
    );
}

/// Issue 26: `set_nodelay` is TCP_NODELAY: coalescing of small writes off, at any time after connect.
#[test]
fn set_nodelay_turns_the_coalescing_of_small_writes_off_after_connect() {
    let (_world, c, s) = connected(9104);
    assert!(
        !c.nodelay().unwrap(),
        "coalescing is on by default, as Nagle is"
    );
    c.set_nodelay(true).unwrap();
    assert!(c.nodelay().unwrap());
    assert!(!c.socket().options().unwrap().coalesce);
    // Small writes still arrive, each at once.
    for i in 0..100u8 {
        (&c).write_all(&[i]).unwrap();
    }
    let mut got = [0u8; 100];
    (&s).read_exact(&mut got).unwrap();
    assert!(got.iter().enumerate().all(|(i, &b)| b == i as u8));
    c.set_nodelay(false).unwrap();
    assert!(!c.nodelay().unwrap());
}

#[test]
fn connection_stats_count_the_bytes_each_way_and_the_handshake() {
    let world = World::threaded(SimConfig::default());
    let (server, client) = (world.host(), world.host());
    let listener = Listener::bind_in(&server, world.addr(0, 9120)).unwrap();
    let addr = listener.local_addr().unwrap();
    let len = 300_000;
    let echo = std::thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        let mut buf = vec![0u8; len];
        s.read_exact(&mut buf).unwrap();
        s.write_all(&buf).unwrap();
        s
    });
    let mut c = Stream::connect_in(&client, addr).unwrap();
    let data = pattern(len);
    c.write_all(&data[..1000]).unwrap();
    c.write_all(&data[1000..]).unwrap();
    let mut back = vec![0u8; len];
    c.read_exact(&mut back).unwrap();
    let s = echo.join().unwrap();
    // A send completes once the peer has the bytes; its event may trail the echo by a round of progress.
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    let stats = loop {
        let st = c.socket().stats().expect("connected");
        if st.bytes_sent == len as u64 || std::time::Instant::now() > deadline {
            break st;
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    assert_eq!(
        (stats.bytes_sent, stats.bytes_received),
        (len as u64, len as u64),
        "{stats}"
    );
    assert!(
        stats.handshake.is_some_and(|d| d > Duration::ZERO),
        "{stats}"
    );
    let theirs = s.socket().stats().expect("connected");
    assert_eq!(theirs.bytes_received, len as u64, "{theirs}");
    assert!(theirs.handshake.is_some(), "{theirs}");
    let text = stats.to_string();
    assert!(
        text.starts_with(&format!(
            "connection bytes_sent {len} bytes_received {len} handshake_us "
        )),
        "{text}"
    );
}

#[test]
fn timeouts_and_durations_too_long_to_count_mean_never_not_a_panic() {
    let world = World::threaded(SimConfig::default());
    let mut opts = exs::ContextOptions::default();
    opts.linger = Duration::MAX;
    opts.connect_timeout = Duration::MAX;
    opts.ack_delay = Duration::MAX;
    opts.keepalive = Some(Duration::MAX);
    let (server, client) = (world.host_with(opts.clone()), world.host_with(opts));
    let listener = Listener::bind_in(&server, world.addr(0, 9131)).unwrap();
    let accepting = std::thread::spawn(move || listener.accept().unwrap());
    let mut cfg = exs::StreamConfig::default();
    cfg.connect_timeout = Some(Duration::MAX);
    let mut c = Stream::connect_with(&client, world.addr(0, 9131), &cfg).unwrap();
    let (mut s, _) = accepting.join().unwrap();
    c.set_read_timeout(Some(Duration::MAX)).unwrap();
    c.set_write_timeout(Some(Duration::MAX)).unwrap();
    assert_eq!(c.read_timeout().unwrap(), Some(Duration::MAX));
    s.set_read_timeout(Some(Duration::MAX)).unwrap();
    let want = pattern(300_000);
    let echo = std::thread::spawn(move || {
        let mut got = vec![0u8; 300_000];
        s.read_exact(&mut got).unwrap();
        s.write_all(&got).unwrap();
        s.shutdown(Shutdown::Write).unwrap();
        let mut rest = Vec::new();
        s.read_to_end(&mut rest).unwrap();
        rest.len()
    });
    c.write_all(&want).unwrap();
    let mut back = vec![0u8; want.len()];
    c.read_exact(&mut back).unwrap();
    assert!(back == want, "the echo differs");
    c.shutdown(Shutdown::Write).unwrap();
    assert_eq!(c.read(&mut back).unwrap(), 0, "end of stream");
    assert_eq!(echo.join().unwrap(), 0);
    drop(c);
}

/// A blocking write waiting for room in the send ring while another thread flushes the same stream finishes:
/// the flush took the completions the writer waited for, and the writer waited for events that never came (here
/// its write timeout ended it with `WouldBlock`, the ring empty).
#[test]
fn a_write_waiting_for_room_beside_flushes_from_another_thread_finishes() {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    let (_world, client, addr, reader) = sink(9150);
    let mut cfg = exs::StreamConfig::default();
    (cfg.send_buffer, cfg.send_piece) = (64 << 10, 16 << 10);
    let c = Arc::new(Stream::connect_with(&client, addr, &cfg).unwrap());
    c.set_write_timeout(Some(Duration::from_secs(20))).unwrap();
    let done = Arc::new(AtomicBool::new(false));
    let flusher = {
        let (c, done) = (c.clone(), done.clone());
        std::thread::spawn(move || {
            while !done.load(Ordering::Relaxed) {
                (&*c).flush().unwrap();
            }
        })
    };
    let data = pattern(8 << 20);
    let wrote = (&*c).write_all(&data);
    done.store(true, Ordering::Relaxed);
    flusher.join().unwrap();
    wrote.unwrap();
    c.shutdown(Shutdown::Write).unwrap();
    assert!(reader.join().unwrap() == data, "bytes differ");
}

/// A stream configured with more receives than its buffer has bytes, or with as many as `usize` counts, posts at
/// most 256 of at least a byte each in the buffer size asked for, and carries bytes as any other: the count
/// overflowed the queue's size (a panic in debug builds), or made a buffer of the count's size.
#[test]
fn a_receive_count_past_the_buffer_or_past_counting_is_capped() {
    for (pieces, buffer) in [(usize::MAX, 1 << 20), (5000, 1000)] {
        let world = World::threaded(SimConfig::default());
        let (server, client) = (world.host(), world.host());
        let mut cfg = exs::StreamConfig::default();
        (cfg.recv_pieces, cfg.recv_buffer) = (pieces, buffer);
        let listener = Listener::bind_with(&server, world.addr(0, 9160), &cfg).unwrap();
        let addr = listener.local_addr().unwrap();
        let reader = std::thread::spawn(move || {
            let mut all = Vec::new();
            listener.accept().unwrap().0.read_to_end(&mut all).unwrap();
            all
        });
        let mut c = Stream::connect_in(&client, addr).unwrap();
        let data = pattern(300_000);
        c.write_all(&data).unwrap();
        c.shutdown(Shutdown::Write).unwrap();
        assert!(reader.join().unwrap() == data, "bytes differ");
    }
}

/// A non-blocking read while another thread's blocking read waits returns `WouldBlock` at once, as with
/// `TcpStream`: it waited for the other read to let go of the stream's reading side (here until the bytes came).
#[test]
fn a_non_blocking_read_beside_a_blocking_one_does_not_wait_for_it() {
    use std::sync::Arc;
    let (_world, c, mut s) = connected(9170);
    let c = Arc::new(c);
    let blocked = {
        let c = c.clone();
        std::thread::spawn(move || {
            let mut buf = [0u8; 16];
            (&*c).read(&mut buf).map(|n| buf[..n].to_vec())
        })
    };
    // The bytes come two seconds later, from another thread (a read that waited for the blocking one gets its
    // turn only then).
    let writer = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_secs(2));
        s.write_all(b"now").unwrap();
        s
    });
    std::thread::sleep(Duration::from_millis(100));
    c.set_nonblocking(true).unwrap();
    let started = std::time::Instant::now();
    let e = (&*c).read(&mut [0u8; 16]).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::WouldBlock, "{e}");
    assert!(
        started.elapsed() < Duration::from_secs(1),
        "the non-blocking read waited {:?}",
        started.elapsed()
    );
    assert_eq!(blocked.join().unwrap().unwrap(), b"now");
    drop(writer.join().unwrap());
}

/// A read cancelled by a local close failed with `Interrupted`, which std's `read_to_end` (and `read_exact`)
/// retry: the reader spun for ever. `Cancelled` is `ConnectionAborted` now.
#[test]
fn a_read_to_end_whose_socket_is_closed_under_it_fails_instead_of_spinning() {
    let (_world, c, _s) = connected(9180);
    let mut reader = c.try_clone().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut all = Vec::new();
        let _ = tx.send(reader.read_to_end(&mut all));
    });
    std::thread::sleep(Duration::from_millis(200));
    c.socket().close().unwrap();
    let r = rx
        .recv_timeout(Duration::from_secs(10))
        .expect("read_to_end returns after the close");
    let e = r.expect_err("a read cut by a close is an error");
    assert_eq!(e.kind(), ErrorKind::ConnectionAborted, "{e}");
}

/// Dropping a stream closes it gracefully, the bytes written still delivered; but when that drop let the last
/// handle of its context go, the context shut every connection down at once: the peer read `ConnectionReset`
/// after a mebibyte of three.
#[test]
fn a_stream_dropped_with_the_last_handle_of_its_context_still_delivers_what_it_wrote() {
    // A link slow enough that the bytes are still on their way when the stream goes.
    let world = World::threaded(SimConfig {
        latency: Duration::from_millis(2),
        ..SimConfig::default()
    });
    let (server, client) = (world.host(), world.host());
    let listener = Listener::bind_in(&server, world.addr(0, 9190)).unwrap();
    let reading = std::thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        let mut all = Vec::new();
        s.read_to_end(&mut all).map(|_| all)
    });
    let mut c = Stream::connect_in(&client, world.addr(0, 9190)).unwrap();
    drop(client);
    let data = pattern(3 << 20);
    c.write_all(&data).unwrap();
    drop(c);
    let got = reading
        .join()
        .unwrap()
        .expect("the server reads to the end of the stream");
    assert_eq!(got.len(), data.len());
    assert!(got == data, "every byte, in order");
}

/// A peer's write that failed on its way in (libfabric tcp reports a reset mid-write with the write's immediate and
/// an error status) was taken as delivered: the stream moved past bytes that never arrived, and the reader read
/// whatever its buffer held there. Now the connection ends, and every byte read is one the peer sent.
#[test]
fn a_write_that_fails_on_its_way_in_is_never_read_as_data() {
    let (world, c, s) = connected(9192);
    // The server is the world's first host: the first write into it fails part-way.
    world.fail_next_incoming_write(0);
    let data = pattern(4 << 20);
    let writer = std::thread::spawn(move || {
        let mut c = c;
        let _ = c.write_all(&data);
        data
    });
    let mut got = Vec::new();
    let end = (&s).read_to_end(&mut got);
    let data = writer.join().unwrap();
    assert!(
        got == data[..got.len()],
        "{} bytes read, the first wrong one at {:?}",
        got.len(),
        got.iter().zip(&data).position(|(a, b)| a != b)
    );
    assert!(
        end.is_err() || got.len() == data.len(),
        "the stream ended early without an error: {end:?}, {} of {} bytes",
        got.len(),
        data.len()
    );
}

/// A threaded world whose first host listens on `port` behind a listener threads can share: (world, the second
/// host's context, the listener, its address).
fn shared_listener(
    port: u16,
) -> (
    World,
    exs::Context,
    std::sync::Arc<Listener>,
    std::net::SocketAddr,
) {
    let world = World::threaded(SimConfig::default());
    let (server, client) = (world.host(), world.host());
    let listener = std::sync::Arc::new(Listener::bind_in(&server, world.addr(0, port)).unwrap());
    let addr = listener.local_addr().unwrap();
    (world, client, listener, addr)
}

/// Regression (review): every `Listener::accept` posted an accept on the listener's queue of 64, so with 64
/// threads waiting the 65th failed at once with `WouldBlock`, which a blocking `TcpListener` never returns. Now
/// threads beyond the queue's depth wait for the posted accepts' connections, and each thread gets one.
#[test]
fn threads_accepting_at_once_beyond_the_queue_depth_each_get_a_connection() {
    const N: u8 = 70;
    let (_world, client, listener, addr) = shared_listener(9190);
    let accepting: Vec<_> = (0..N)
        .map(|_| {
            let l = listener.clone();
            std::thread::spawn(move || {
                let (mut s, _) = l.accept()?;
                let mut got = Vec::new();
                s.read_to_end(&mut got)?;
                Ok::<_, std::io::Error>(got)
            })
        })
        .collect();
    // Every thread waits before the first connection comes.
    std::thread::sleep(Duration::from_millis(300));
    for i in 0..N {
        let mut c = Stream::connect_in(&client, addr).unwrap();
        c.write_all(&[i; 100]).unwrap();
        c.shutdown(Shutdown::Write).unwrap();
    }
    let mut got: Vec<u8> = accepting
        .into_iter()
        .map(|t| {
            let v = t.join().unwrap().expect("an accept failed");
            assert_eq!(v.len(), 100);
            v[0]
        })
        .collect();
    got.sort_unstable();
    assert_eq!(got, (0..N).collect::<Vec<_>>());
}

/// Threads beyond the accepts a listener keeps posted waited for those accepts' events; when the context failed,
/// the posted ones ended with errors and the others waited for ever. Now each of them fails too.
#[test]
fn threads_accepting_beyond_the_queue_depth_all_fail_when_the_context_does() {
    const N: usize = 70;
    let (world, client, listener, addr) = shared_listener(9191);
    let (done_tx, done_rx) = std::sync::mpsc::channel();
    for _ in 0..N {
        let (l, done) = (listener.clone(), done_tx.clone());
        std::thread::spawn(move || {
            let _ = done.send(l.accept().map(|_| ()));
        });
    }
    std::thread::sleep(Duration::from_millis(300));
    // The server's progress thread panics at its next poll: the context fails, and every operation with it.
    world.panic_on_next_poll(0);
    // A connection request wakes it (the connect's own outcome does not matter).
    let mut cfg = exs::StreamConfig::default();
    cfg.connect_timeout = Some(Duration::from_millis(200));
    let _ = Stream::connect_with(&client, addr, &cfg);
    for i in 0..N {
        let r = done_rx
            .recv_timeout(Duration::from_secs(20))
            .unwrap_or_else(|_| panic!("{} of {N} accepts still wait", N - i));
        assert!(r.is_err(), "an accept succeeded on a failed context");
    }
}

/// A review found it: a send that failed was reported by one write, and the writes after it were taken again (the
/// peer had closed, its final close not yet come). Once a write has failed, every later write, flush and shutdown
/// fails, as a TCP socket's after `EPIPE`.
#[test]
fn a_write_failure_stays_reported_by_every_later_write_and_flush() {
    let (_world, mut c, s) = connected(9187);
    // The peer stops receiving and keeps the connection: its close lingers for the bytes it still sends us, which
    // we do not read.
    let mut peer = s.try_clone().unwrap();
    std::thread::spawn(move || {
        let _ = peer.write_all(&vec![1u8; 8 << 20]);
    });
    std::thread::sleep(Duration::from_millis(300));
    s.socket().close().unwrap();
    let chunk = vec![7u8; 4096];
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    let first = loop {
        match c.write(&chunk).and_then(|_| c.flush()) {
            Err(e) => break e,
            Ok(()) => assert!(
                std::time::Instant::now() < deadline,
                "writes were taken for 20 s after the peer closed"
            ),
        }
    };
    for _ in 0..3 {
        let again = c.write(&chunk).expect_err("a write after a failed one");
        assert_eq!(again.kind(), first.kind(), "{again} after {first}");
        let flushed = c.flush().expect_err("a flush after a failed write");
        assert_eq!(flushed.kind(), first.kind(), "{flushed} after {first}");
    }
}

/// Review finding: a write of nothing returned `Ok(0)` before any check, so it hid a shutdown and a broken
/// connection; as TCP's (`send` of 0 bytes), it now fails as a write of bytes would: `BrokenPipe` after
/// `shutdown(Write)`, the connection's error once it is down.
#[test]
fn a_write_of_nothing_reports_a_shutdown_or_a_broken_connection() {
    let (_world, mut c, _s) = connected(7460);
    assert_eq!(c.write(&[]).unwrap(), 0, "an open stream takes nothing");
    c.shutdown(Shutdown::Write).unwrap();
    let e = c.write(&[]).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::BrokenPipe, "{e}");

    let (world2, mut c2, _s2) = connected(7461);
    world2.break_connections(0);
    let until = std::time::Instant::now() + Duration::from_secs(10);
    let e = loop {
        match c2.write(&[]) {
            Ok(0) if std::time::Instant::now() < until => {
                std::thread::sleep(Duration::from_millis(5))
            }
            Ok(n) => panic!("a write of nothing returned {n}, or never saw the connection go"),
            Err(e) => break e,
        }
    };
    let again = c2.write(b"x").unwrap_err();
    assert_eq!(e.kind(), again.kind(), "{e} / {again}");
}

//! Issue 16: `exs::tokio` on the simulated fabric (feature `tokio`).
#![cfg(all(feature = "tokio", feature = "sim"))]

use tokio::io::{AsyncReadExt, AsyncWriteExt};

use exs::sim::{SimConfig, World};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn async_streams_echo_a_mebibyte_then_end_of_stream() {
    let world = World::threaded(SimConfig::default());
    let (server, client) = (world.host(), world.host());
    let listener = exs::tokio::Listener::bind_in(&server, world.addr(0, 9300))
        .await
        .unwrap();
    let addr = listener.local_addr().unwrap();
    let echo = tokio::spawn(async move {
        let (mut s, _) = listener.accept().await.unwrap();
        let (mut buf, mut total) = (vec![0u8; 64 * 1024], 0);
        loop {
            let n = s.read(&mut buf).await.unwrap();
            if n == 0 {
                break;
            }
            total += n;
            s.write_all(&buf[..n]).await.unwrap();
        }
        s.shutdown().await.unwrap();
        total
    });
    let mut c = exs::tokio::Stream::connect_in(&client, addr).await.unwrap();
    let data: Vec<u8> = (0..1 << 20)
        .map(|i: u32| (i * 13 + i / 509) as u8)
        .collect();
    let (mut back, mut sent) = (Vec::new(), 0);
    let mut buf = vec![0u8; 64 * 1024];
    // Write and read interleaved (the echo cannot buffer everything).
    while back.len() < data.len() {
        if sent < data.len() {
            let n = c
                .write(&data[sent..(sent + 200_000).min(data.len())])
                .await
                .unwrap();
            sent += n;
        }
        let n = c.read(&mut buf).await.unwrap();
        back.extend_from_slice(&buf[..n]);
    }
    assert!(back == data, "echoed bytes differ");
    c.shutdown().await.unwrap();
    let mut rest = Vec::new();
    c.read_to_end(&mut rest).await.unwrap();
    assert!(rest.is_empty());
    assert_eq!(echo.await.unwrap(), data.len());
}

#[tokio::test(flavor = "current_thread")]
async fn next_async_waits_for_an_event_without_blocking_the_runtime() {
    let world = World::threaded(SimConfig::default());
    let (server, client) = (world.host(), world.host());
    let l = exs::Socket::new(&server, exs::SockType::SeqPacket).unwrap();
    l.bind(world.addr(0, 9301)).unwrap();
    let addr = l.listen(4).unwrap();
    let eq = exs::EventQueue::new(8).unwrap();
    l.accept(&eq, 7).unwrap();
    let ticker = tokio::spawn(async {
        // Runs on the same (only) runtime thread while the queue is awaited.
        tokio::task::yield_now().await;
        1
    });
    let c = exs::Socket::new(&client, exs::SockType::SeqPacket).unwrap();
    let ceq = exs::EventQueue::new(8).unwrap();
    c.connect(&ceq, addr, 1).unwrap();
    let ev = eq.next_async().await.unwrap();
    assert_eq!(ev.context, 7);
    assert!(ev.is_ok(), "{ev:?}");
    assert_eq!(ticker.await.unwrap(), 1);
    assert!(ceq.next_async().await.unwrap().is_ok());
}

/// Counts wake-ups.
struct Counter(std::sync::atomic::AtomicUsize);

impl std::task::Wake for Counter {
    fn wake(self: std::sync::Arc<Self>) {
        self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    }
}

/// A current-thread runtime and two connected streams on a threaded simulated world (returned to keep it alive).
fn connected(
    port: u16,
) -> (
    tokio::runtime::Runtime,
    World,
    exs::tokio::Stream,
    exs::tokio::Stream,
) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let world = World::threaded(SimConfig::default());
    let (server, client) = (world.host(), world.host());
    let (a, b) = rt.block_on(async {
        let listener = exs::tokio::Listener::bind_in(&server, world.addr(0, port))
            .await
            .unwrap();
        let addr = listener.local_addr().unwrap();
        let accept = tokio::spawn(async move { listener.accept().await.unwrap().0 });
        let a = exs::tokio::Stream::connect_in(&client, addr).await.unwrap();
        (a, accept.await.unwrap())
    });
    (rt, world, a, b)
}

/// Polls `a`'s read with `wr` (pending), lets `b` send `msg` while `a`'s task is not polled, polls `other`
/// (another step of the same task, as hyper polls read then write or flush), runs the reactor, and checks that the
/// read's waker was woken and the read has the bytes.
fn reader_woken_beside(
    rt: &tokio::runtime::Runtime,
    a: &mut exs::tokio::Stream,
    b: &mut exs::tokio::Stream,
    msg: &[u8],
    mut other: impl FnMut(&mut exs::tokio::Stream),
) {
    use std::pin::Pin;
    use std::sync::atomic::Ordering;
    use std::sync::Arc;
    use std::task::{Context, Poll, Waker};
    use tokio::io::{AsyncRead, ReadBuf};

    rt.block_on(async move {
        let w_read = Arc::new(Counter(Default::default()));
        let wr = Waker::from(w_read.clone());
        let mut buf = [0u8; 64];
        let mut rb = ReadBuf::new(&mut buf);
        assert!(Pin::new(&mut *a)
            .poll_read(&mut Context::from_waker(&wr), &mut rb)
            .is_pending());
        b.write_all(msg).await.unwrap();
        std::thread::sleep(std::time::Duration::from_millis(300));
        other(a);
        // The reactor runs while this task sleeps: it must wake the read.
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        assert!(
            w_read.0.load(Ordering::SeqCst) > 0,
            "the read's bytes arrived and the read was never woken"
        );
        match Pin::new(&mut *a).poll_read(&mut Context::from_waker(&wr), &mut rb) {
            Poll::Ready(Ok(())) => assert_eq!(rb.filled(), msg),
            other => panic!("the read after the wake-up: {other:?}"),
        }
    });
}

/// Regression (the hyper example hung mid-body on libfabric tcp, about one run in ten): a task that polls read,
/// then a write that waits (the peer reads nothing), as hyper's connection task does. When both directions shared
/// one queue, the write's step took the read's completion and the reactor never reported it. Each direction now
/// has its own queue: the write takes nothing of the read's, and the read is woken.
#[test]
fn a_read_beside_a_waiting_write_is_woken_by_its_bytes() {
    use std::pin::Pin;
    use std::task::{Context, Waker};
    use tokio::io::AsyncWrite;

    let (rt, _world, mut a, mut b) = connected(9310);
    // a's writes fill b's receives, its stream buffer and a's send ring: b reads nothing.
    let chunk = vec![7u8; 256 << 10];
    let wf = Waker::from(std::sync::Arc::new(Counter(Default::default())));
    let mut waited = 0;
    for _ in 0..400 {
        if Pin::new(&mut a)
            .poll_write(&mut Context::from_waker(&wf), &chunk)
            .is_pending()
        {
            waited += 1;
            if waited == 3 {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(100));
        } else {
            waited = 0;
        }
    }
    assert_eq!(waited, 3, "a's writes never waited for b");
    reader_woken_beside(&rt, &mut a, &mut b, b"0123456789", |a| {
        assert!(Pin::new(a)
            .poll_write(&mut Context::from_waker(&wf), &chunk)
            .is_pending());
    });
    drop((a, b));
}

/// Regression (the hyper example hung under load, first request): hyper's server polled read (pending, a
/// receive posted), then flush with nothing to flush, which took the request's completion from the shared queue
/// and woke nobody. With a queue per direction the flush takes nothing of the read's.
#[test]
fn a_read_beside_a_flush_is_woken_by_its_bytes() {
    use std::pin::Pin;
    use std::task::{Context, Poll, Waker};
    use tokio::io::AsyncWrite;

    let (rt, _world, mut a, mut b) = connected(9311);
    let wf = Waker::from(std::sync::Arc::new(Counter(Default::default())));
    reader_woken_beside(&rt, &mut a, &mut b, b"GET / HTTP/1.1", |a| {
        assert!(matches!(
            Pin::new(a).poll_flush(&mut Context::from_waker(&wf)),
            Poll::Ready(Ok(()))
        ));
    });
    drop((a, b));
}

/// After the peer's reset, one read fails with `ConnectionReset` and the reads after it return end-of-stream, as
/// TCP's do (every read returned the error: a loop that logs errors and reads on until end-of-stream never ended;
/// review finding).
#[test]
fn a_reset_is_read_once_then_end_of_stream() {
    let (rt, _world, mut a, b) = connected(9313);
    b.socket().abort().unwrap();
    rt.block_on(async {
        let mut buf = [0u8; 8];
        let e = a.read(&mut buf).await.unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::ConnectionReset, "{e}");
        for i in 0..2 {
            assert_eq!(
                a.read(&mut buf).await.unwrap(),
                0,
                "read {i} after the reset"
            );
        }
    });
    drop((a, b));
}

/// Issue 26: `exs::tokio::Listener::bind` and `Stream::connect` take what `tokio::net` takes (names resolved by
/// `tokio::net::lookup_host`, strings included) and run on the process's default context.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokio_listener_bind_and_stream_connect_run_on_the_default_context() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = exs::tokio::Listener::bind("0.0.0.0:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let echo = tokio::spawn(async move {
        let (s, _) = listener.accept().await.unwrap();
        let (mut r, mut w) = s.into_split();
        tokio::io::copy(&mut r, &mut w).await.unwrap();
    });
    let mut c = exs::tokio::Stream::connect(addr.to_string()).await.unwrap();
    assert_eq!(c.peer_addr().unwrap(), addr);
    c.set_nodelay(true).unwrap();
    let (mut r, mut w) = c.split();
    // The borrowed halves know both addresses, as tokio's do (a review found them missing).
    assert_eq!(
        (r.peer_addr().unwrap(), w.peer_addr().unwrap()),
        (addr, addr)
    );
    assert_eq!(r.local_addr().unwrap(), w.local_addr().unwrap());
    w.write_all(b"over the default context").await.unwrap();
    w.shutdown().await.unwrap();
    let mut back = Vec::new();
    r.read_to_end(&mut back).await.unwrap();
    assert_eq!(back, b"over the default context");
    echo.await.unwrap();
}

/// Tasks waiting in `accept` on one listener at once each get a connection (as with tokio's `TcpListener`): two
/// of them waited on a single posted accept, and the task that did not get its connection waited for ever; and
/// more of them than the listener's queue holds events (64) wait for a turn instead of failing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tasks_accepting_at_once_each_get_a_connection() {
    for (n, port) in [(2u8, 9310), (66, 9311)] {
        accepting_at_once(n, port).await;
    }
}

async fn accepting_at_once(n: u8, port: u16) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let world = World::threaded(SimConfig::default());
    let (server, client) = (world.host(), world.host());
    let listener = std::sync::Arc::new(
        exs::tokio::Listener::bind_in(&server, world.addr(0, port))
            .await
            .unwrap(),
    );
    let addr = listener.local_addr().unwrap();
    let accepting: Vec<_> = (0..n)
        .map(|_| {
            let l = listener.clone();
            tokio::spawn(async move {
                let (mut s, _) = l.accept().await.unwrap();
                let mut got = Vec::new();
                s.read_to_end(&mut got).await.unwrap();
                got
            })
        })
        .collect();
    // Every task waits before the first connection comes.
    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    for i in 0..n {
        let connect = exs::tokio::Stream::connect_in(&client, addr);
        let mut c = tokio::time::timeout(std::time::Duration::from_secs(20), connect)
            .await
            .expect("a connection was left waiting for an accept")
            .unwrap();
        c.write_all(&[i; 100]).await.unwrap();
        c.shutdown().await.unwrap();
    }
    let mut got = Vec::new();
    for t in accepting {
        let v = tokio::time::timeout(std::time::Duration::from_secs(20), t)
            .await
            .expect("an accepting task was left waiting")
            .unwrap();
        got.push(v);
    }
    got.sort();
    let want: Vec<Vec<u8>> = (0..n).map(|i| vec![i; 100]).collect();
    assert!(got == want, "{n} tasks: the connections' bytes differ");
}

/// A review found it: tasks beyond the accepts the listener keeps posted (its queue's 64) waited for the events of
/// those accepts, and one more was posted for them as each returned; when the context failed, the posted ones
/// ended with errors, the posts for the others failed unseen, and those tasks waited for ever (the blocking
/// listener had the fix). Now each of them fails too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tasks_accepting_beyond_the_queue_depth_all_fail_when_the_context_does() {
    const N: usize = 70;
    let world = World::threaded(SimConfig::default());
    let (server, client) = (world.host(), world.host());
    let listener = std::sync::Arc::new(
        exs::tokio::Listener::bind_in(&server, world.addr(0, 9312))
            .await
            .unwrap(),
    );
    let addr = listener.local_addr().unwrap();
    let accepting: Vec<_> = (0..N)
        .map(|_| {
            let l = listener.clone();
            tokio::spawn(async move { l.accept().await.map(|_| ()) })
        })
        .collect();
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    // The server's progress thread panics at its next poll: the context fails, and every operation with it.
    world.panic_on_next_poll(0);
    // A connection request wakes it (the connect's own outcome does not matter).
    let mut cfg = exs::StreamConfig::default();
    cfg.connect_timeout = Some(std::time::Duration::from_millis(200));
    let _ =
        tokio::task::spawn_blocking(move || exs::Stream::connect_with(&client, addr, &cfg)).await;
    for (i, t) in accepting.into_iter().enumerate() {
        let r = tokio::time::timeout(std::time::Duration::from_secs(20), t)
            .await
            .unwrap_or_else(|_| panic!("accept {i} of {N} still waits"))
            .unwrap();
        assert!(r.is_err(), "an accept succeeded on a failed context");
    }
}

/// Issue 26: a read hands its bytes to the `ReadBuf` as they are copied out of the receive buffer: the rest of a
/// fresh (uninitialised) buffer is not zeroed first, as `initialize_unfilled` would (all of it, on every fresh
/// buffer: a whole `read_to_end` vector's capacity).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_into_a_fresh_buffer_initialises_only_the_bytes_it_returns() {
    use std::mem::MaybeUninit;
    use std::pin::Pin;
    use tokio::io::{AsyncRead, ReadBuf};

    let world = World::threaded(SimConfig::default());
    let (server, client) = (world.host(), world.host());
    let listener = exs::tokio::Listener::bind_in(&server, world.addr(0, 9310))
        .await
        .unwrap();
    let addr = listener.local_addr().unwrap();
    let writer = tokio::spawn(async move {
        let (mut s, _) = listener.accept().await.unwrap();
        s.write_all(b"twelve bytes").await.unwrap();
        s.shutdown().await.unwrap();
    });
    let mut c = exs::tokio::Stream::connect_in(&client, addr).await.unwrap();
    let mut storage = vec![MaybeUninit::<u8>::uninit(); 1 << 20];
    let mut got = Vec::new();
    loop {
        let mut rb = ReadBuf::uninit(&mut storage);
        std::future::poll_fn(|cx| Pin::new(&mut c).poll_read(cx, &mut rb))
            .await
            .unwrap();
        let n = rb.filled().len();
        assert_eq!(rb.initialized().len(), n, "only the bytes read are written");
        if n == 0 {
            break;
        }
        got.extend_from_slice(rb.filled());
    }
    assert_eq!(got, b"twelve bytes");
    writer.await.unwrap();
}

/// Issue 26: tokio streams write vectored (hyper then sends a header and its body without first copying them into
/// one buffer of its own), every slice at once and in order; the owned write half too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_vectored_write_takes_every_slice_in_order() {
    use std::io::IoSlice;
    use tokio::io::AsyncWrite;

    let world = World::threaded(SimConfig::default());
    let (server, client) = (world.host(), world.host());
    let listener = exs::tokio::Listener::bind_in(&server, world.addr(0, 9320))
        .await
        .unwrap();
    let addr = listener.local_addr().unwrap();
    let reader = tokio::spawn(async move {
        let (mut s, _) = listener.accept().await.unwrap();
        let mut all = Vec::new();
        s.read_to_end(&mut all).await.unwrap();
        all
    });
    let c = exs::tokio::Stream::connect_in(&client, addr).await.unwrap();
    assert!(c.is_write_vectored());
    let (_r, mut w) = c.into_split();
    assert!(w.is_write_vectored());
    let (head, body) = (b"HTTP/1.1 200 OK\r\n\r\n".to_vec(), vec![7u8; 100_000]);
    let n = w
        .write_vectored(&[IoSlice::new(&head), IoSlice::new(&body)])
        .await
        .unwrap();
    assert_eq!(n, head.len() + body.len(), "every slice taken");
    w.shutdown().await.unwrap();
    assert!(
        reader.await.unwrap() == [head, body].concat(),
        "bytes differ"
    );
}

/// A threaded simulated world with a listener on `port` and one connection through it: the world, the client's
/// context, the listener, the client's stream and the accepted one.
async fn leading_pair(
    port: u16,
) -> (
    World,
    exs::Context,
    exs::tokio::Listener,
    exs::tokio::Stream,
    exs::tokio::Stream,
) {
    let world = World::threaded(SimConfig::default());
    let (server, client) = (world.host(), world.host());
    let (listener, a, peer) = through(&server, &client, world.addr(0, port)).await;
    (world, client, listener, a, peer)
}

/// A listener of `server` at `at`, and one connection through it from `client`: the listener, the client's stream
/// and the accepted one.
async fn through(
    server: &exs::Context,
    client: &exs::Context,
    at: std::net::SocketAddr,
) -> (exs::tokio::Listener, exs::tokio::Stream, exs::tokio::Stream) {
    let listener = exs::tokio::Listener::bind_in(server, at).await.unwrap();
    let addr = listener.local_addr().unwrap();
    let a = exs::tokio::Stream::connect_in(client, addr).await.unwrap();
    let peer = listener.accept().await.unwrap().0;
    (listener, a, peer)
}

/// A task that waits on a stream leads the stream's context (it runs the protocol and sleeps on the transport
/// through its reactor). A task that stops polling while it leads (here its read is dropped by a timeout, the
/// stream kept) must not stop the context: the progress thread takes the lead from it once the transport has
/// signalled and the task has not run, and another stream's bytes on the same context still arrive.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_dropped_while_it_leads_does_not_stop_its_context() {
    use std::time::{Duration, Instant};

    let (_world, client, listener, mut a, _a_peer) = leading_pair(9320).await;
    let addr = listener.local_addr().unwrap();
    let mut b = exs::tokio::Stream::connect_in(&client, addr).await.unwrap();
    let mut b_peer = listener.accept().await.unwrap().0;
    // Nothing comes on a: its read waits, and leads the client's context once the progress thread hands it over.
    let (leads, t0) = (client.progress_stats().task_leads, Instant::now());
    let mut buf = [0u8; 16];
    while client.progress_stats().task_leads == leads {
        let r = tokio::time::timeout(Duration::from_millis(20), a.read(&mut buf)).await;
        assert!(
            r.is_err(),
            "a read of a stream nobody writes to returned {r:?}"
        );
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "a's read never led its context"
        );
    }
    // a's read is gone and a is kept, unpolled; b's bytes come through the same context, after b's read has had
    // its spin (which drives the context itself) and sleeps.
    let writer = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(200)).await;
        b_peer.write_all(b"hello").await.unwrap();
        b_peer
    });
    let mut got = [0u8; 5];
    tokio::time::timeout(Duration::from_secs(10), b.read_exact(&mut got))
        .await
        .expect("b's bytes never came: the context stood still behind a's dropped read")
        .unwrap();
    assert_eq!(&got, b"hello");
    assert!(client.progress_stats().task_steals >= 1);
    drop((a, writer.await.unwrap()));
}

/// Rule 3 of `exs::progress` (an idle connection costs the progress thread nothing) holds while a task leads: a
/// read that waits half a second on a quiet stream leaves the progress thread asleep after a few looks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_read_that_leads_leaves_the_progress_thread_asleep() {
    use std::time::Duration;

    let (_world, client, _listener, mut a, _peer) = leading_pair(9330).await;
    let mut buf = [0u8; 16];
    // The first wait takes the lead (after a hand-over from the progress thread) and settles.
    let r = tokio::time::timeout(Duration::from_millis(100), a.read(&mut buf)).await;
    assert!(
        r.is_err(),
        "a read of a stream nobody writes to returned {r:?}"
    );
    let before = client.progress_stats();
    let r = tokio::time::timeout(Duration::from_millis(500), a.read(&mut buf)).await;
    assert!(
        r.is_err(),
        "a read of a stream nobody writes to returned {r:?}"
    );
    let after = client.progress_stats();
    assert!(after.task_leads >= 1, "the read never led: {after:?}");
    assert!(
        after.thread_wakeups - before.thread_wakeups <= 4,
        "the progress thread woke {} times in half a second of an idle read",
        after.thread_wakeups - before.thread_wakeups
    );
}

/// Two tasks wait on two streams of one context: one leads, the other follows (it waits on its queue). When the
/// leader's read ends and it lets go, the follower is woken to lead in its place, not left to the progress
/// thread: both tasks have led by the time the second one's bytes arrive.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_follower_leads_when_the_leader_lets_go() {
    use std::time::Duration;

    let (_world, client, listener, a, mut a_peer) = leading_pair(9340).await;
    let addr = listener.local_addr().unwrap();
    let b = exs::tokio::Stream::connect_in(&client, addr).await.unwrap();
    let mut b_peer = listener.accept().await.unwrap().0;
    let leads = client.progress_stats().task_leads;
    // Each read in a task of its own; the first waits (and leads) before the second starts.
    let read5 = |mut s: exs::tokio::Stream| {
        tokio::spawn(async move {
            let mut got = [0u8; 5];
            s.read_exact(&mut got).await.unwrap();
            (s, got)
        })
    };
    let first = read5(a);
    tokio::time::sleep(Duration::from_millis(50)).await;
    let second = read5(b);
    tokio::time::sleep(Duration::from_millis(50)).await;
    let _a = delivered(&mut a_peer, b"first", first).await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    let _b = delivered(&mut b_peer, b"again", second).await;
    let led = client.progress_stats().task_leads - leads;
    assert!(led >= 2, "only {led} of the two waiting tasks led");
}

/// Writes `msg` on `peer` and checks that the reading task `read` gets it (within 10 s); returns its stream.
async fn delivered(
    peer: &mut exs::tokio::Stream,
    msg: &[u8; 5],
    read: tokio::task::JoinHandle<(exs::tokio::Stream, [u8; 5])>,
) -> exs::tokio::Stream {
    peer.write_all(msg).await.unwrap();
    let (s, got) = tokio::time::timeout(std::time::Duration::from_secs(10), read)
        .await
        .expect("the read never ended")
        .unwrap();
    assert_eq!(&got, msg);
    s
}

/// A connection whose peer wrote and closed before the application took its accept (here after an `accept`
/// future was dropped, which leaves its accept posted) is accepted with its bytes and end of stream to read, as
/// TCP's is: the accept failed with `NotConnected`, the connection's live address being gone, and its bytes with it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_whose_peer_already_wrote_and_closed_is_accepted_with_its_bytes() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let world = World::threaded(SimConfig::default());
    let (server, client) = (world.host(), world.host());
    let listener = exs::tokio::Listener::bind_in(&server, world.addr(0, 9399))
        .await
        .unwrap();
    let addr = listener.local_addr().unwrap();
    let posted = tokio::time::timeout(std::time::Duration::from_millis(20), listener.accept());
    assert!(posted.await.is_err(), "nobody has connected yet");
    let c_local = {
        let mut c = exs::tokio::Stream::connect_in(&client, addr).await.unwrap();
        c.write_all(&[7; 100]).await.unwrap();
        c.shutdown().await.unwrap();
        c.local_addr().unwrap()
    };
    // The client's stream is closed: its connection goes down while the accept waits to be taken.
    tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    let (mut s, peer) = listener.accept().await.unwrap();
    assert_eq!(peer, c_local);
    let mut got = Vec::new();
    s.read_to_end(&mut got).await.unwrap();
    assert_eq!(got, vec![7u8; 100]);
}

/// Regression (review): a connect with a timeout wrapped its wait in `tokio::time::timeout`, which panics on a
/// runtime built without the time driver ("timers are disabled"). The engine times the connect out itself now,
/// so such a runtime gets `TimedOut`.
#[test]
fn a_connect_timeout_needs_no_tokio_timer() {
    use exs::Transport as _;
    let world = World::threaded(SimConfig::default());
    let client = world.host();
    let mut silent = world.raw_host();
    let (_, addr) = silent.listen(world.addr(1, 9395), 8).unwrap();
    let mut cfg = exs::StreamConfig::default();
    cfg.connect_timeout = Some(std::time::Duration::from_millis(200));
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .build()
        .unwrap();
    let e = rt
        .block_on(exs::tokio::Stream::connect_with(&client, addr, &cfg))
        .unwrap_err();
    assert_eq!(e.kind(), std::io::ErrorKind::TimedOut, "{e}");
    drop(silent);
}

/// A current-thread runtime, with its IO and time drivers.
fn current_thread() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

/// Review: a context's reactor descriptors (the transport's, the leader's wake-up, its timer) went into the reactor
/// of the runtime whose task led it first, and a task of another runtime that led later slept on them: while the
/// first runtime was not driven (its `block_on` had returned), nothing woke the second's task but the progress
/// thread taking the lead from it, a few milliseconds later, about once per wait (102 takings for 200 round trips).
/// Now a leader of another runtime makes a set in its own reactor. Runtime A leads the client's context and is kept
/// without being driven; runtime B then runs 200 one-byte round trips on another stream of that context.
#[test]
fn a_task_of_another_runtime_that_leads_sleeps_on_its_own_reactor() {
    let world = World::threaded(SimConfig::default());
    let (server_a, client, server_b) = (world.host(), world.host(), world.host());
    let rt_a = current_thread();
    let (a, a_peer) = rt_a.block_on(async {
        let (_l, mut a, a_peer) = through(&server_a, &client, world.addr(0, 9500)).await;
        let leads = client.progress_stats().task_leads;
        let mut buf = [0u8; 8];
        while client.progress_stats().task_leads == leads {
            let r =
                tokio::time::timeout(std::time::Duration::from_millis(20), a.read(&mut buf)).await;
            assert!(r.is_err(), "nothing was sent");
        }
        (a, a_peer)
    });
    let before = client.progress_stats().task_steals;
    current_thread().block_on(async {
        let (_l, mut b, mut b_peer) = through(&server_b, &client, world.addr(2, 9501)).await;
        let echo = tokio::spawn(async move {
            let mut x = [0u8; 1];
            while b_peer.read_exact(&mut x).await.is_ok() {
                b_peer.write_all(&x).await.unwrap();
            }
        });
        let mut x = [7u8; 1];
        for _ in 0..200 {
            b.write_all(&x).await.unwrap();
            b.read_exact(&mut x).await.unwrap();
        }
        drop(b);
        let _ = echo.await;
    });
    let steals = client.progress_stats().task_steals - before;
    assert!(
        steals < 20,
        "the progress thread took the lead from runtime B's task {steals} times in 200 round trips"
    );
    drop((a, a_peer));
    drop(rt_a);
}

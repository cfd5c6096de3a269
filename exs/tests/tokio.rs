//! Issue 16: `exs::tokio` on the simulated fabric (feature `tokio`).
#![cfg(all(feature = "tokio", feature = "sim"))]

use tokio::io::{AsyncReadExt, AsyncWriteExt};

use exs::sim::{SimConfig, World};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn async_streams_echo_a_mebibyte_then_end_of_stream() {
    let world = World::threaded(SimConfig::default());
    let (server, client) = (world.host(), world.host());
    let listener = exs::tokio::Listener::bind_in(&server, world.addr(0, 9300)).unwrap();
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
    let eq = exs::EventQueue::new(8);
    l.accept(&eq, 7).unwrap();
    let ticker = tokio::spawn(async {
        // Runs on the same (only) runtime thread while the queue is awaited.
        tokio::task::yield_now().await;
        1
    });
    let c = exs::Socket::new(&client, exs::SockType::SeqPacket).unwrap();
    let ceq = exs::EventQueue::new(8);
    c.connect(addr, &ceq, 1).unwrap();
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
        let listener = exs::tokio::Listener::bind_in(&server, world.addr(0, port)).unwrap();
        let addr = listener.local_addr().unwrap();
        let accept = tokio::spawn(async move { listener.accept().await.unwrap().0 });
        let a = exs::tokio::Stream::connect_in(&client, addr).await.unwrap();
        (a, accept.await.unwrap())
    });
    (rt, world, a, b)
}

/// Regression (the hyper example hung mid-body on libfabric tcp, about one run in ten): a task that polls read
/// then flush, as hyper's connection task does. The flush takes the read's completion from the queue (its step
/// absorbs every queued event), which turns the queue's descriptor back to not readable, so the reactor may never
/// report the edge the completion made. The flush must then wake its task, or the reader is never polled again.
#[test]
fn a_read_absorbed_while_flushing_wakes_the_reader() {
    use std::pin::Pin;
    use std::sync::Arc;
    use std::task::{Context, Poll, Waker};
    use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

    let (rt, _world, mut a, mut b) = connected(9310);
    rt.block_on(async move {
        let (w_read, w_flush) = (
            Arc::new(Counter(Default::default())),
            Arc::new(Counter(Default::default())),
        );
        let (wr, wf) = (Waker::from(w_read.clone()), Waker::from(w_flush.clone()));
        // A send that stays in flight: b reads nothing, so a's writes fill b's stream buffer.
        let chunk = vec![7u8; 256 << 10];
        let mut waited = 0;
        for _ in 0..200 {
            if Pin::new(&mut a)
                .poll_write(&mut Context::from_waker(&wf), &chunk)
                .is_pending()
            {
                // Pending: the previous send is in flight. Still pending after a pause: b's buffer is full.
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
        // a waits to read.
        let mut buf = [0u8; 64];
        let mut rb = ReadBuf::new(&mut buf);
        assert!(Pin::new(&mut a)
            .poll_read(&mut Context::from_waker(&wr), &mut rb)
            .is_pending());
        // b sends ten bytes; they complete a's receive while a's task is not polled (the progress threads run).
        b.write_all(b"0123456789").await.unwrap();
        b.flush().await.unwrap();
        std::thread::sleep(std::time::Duration::from_millis(300));
        // Before the reactor runs, a's task polls its flush (the send is still in flight): it takes the read's
        // completion and must wake the task.
        let before = w_flush.0.load(std::sync::atomic::Ordering::SeqCst);
        assert!(Pin::new(&mut a)
            .poll_flush(&mut Context::from_waker(&wf))
            .is_pending());
        assert!(
            w_flush.0.load(std::sync::atomic::Ordering::SeqCst) > before,
            "the flush took the read's completion and woke nobody"
        );
        // Polled again, as the wake-up makes it, the read has its bytes.
        match Pin::new(&mut a).poll_read(&mut Context::from_waker(&wr), &mut rb) {
            Poll::Ready(Ok(())) => assert_eq!(rb.filled(), b"0123456789"),
            other => panic!("the read after the wake-up: {other:?}"),
        }
        drop((a, b));
    });
}

/// Regression (the hyper example hung under load, first request): hyper's server polled read (pending, a
/// receive posted), then flush with nothing to flush. The request's bytes had arrived in between; the flush took
/// their completion and returned ready at once, without waking the task, and the queue's descriptor was no
/// longer readable: the read was never polled again. A step that takes the other direction's events wakes the
/// task, finished or not.
#[test]
fn a_read_absorbed_by_a_finished_flush_wakes_the_reader() {
    use std::pin::Pin;
    use std::sync::Arc;
    use std::task::{Context, Poll, Waker};
    use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

    let (rt, _world, mut a, mut b) = connected(9311);
    rt.block_on(async move {
        let woken = Arc::new(Counter(Default::default()));
        let waker = Waker::from(woken.clone());
        let mut cx = Context::from_waker(&waker);
        // a waits to read; nothing of a's is in flight.
        let mut buf = [0u8; 64];
        let mut rb = ReadBuf::new(&mut buf);
        assert!(Pin::new(&mut a).poll_read(&mut cx, &mut rb).is_pending());
        // b's request arrives while a's task is not polled (the progress threads run).
        b.write_all(b"GET / HTTP/1.1").await.unwrap();
        b.flush().await.unwrap();
        std::thread::sleep(std::time::Duration::from_millis(300));
        // Before the reactor runs, a's task polls flush: nothing to flush, ready at once; it took the read's
        // completion and must wake the task.
        let before = woken.0.load(std::sync::atomic::Ordering::SeqCst);
        assert!(matches!(
            Pin::new(&mut a).poll_flush(&mut cx),
            Poll::Ready(Ok(()))
        ));
        assert!(
            woken.0.load(std::sync::atomic::Ordering::SeqCst) > before,
            "the flush took the read's completion and woke nobody"
        );
        match Pin::new(&mut a).poll_read(&mut cx, &mut rb) {
            Poll::Ready(Ok(())) => assert_eq!(rb.filled(), b"GET / HTTP/1.1"),
            other => panic!("the read after the wake-up: {other:?}"),
        }
        drop((a, b));
    });
}

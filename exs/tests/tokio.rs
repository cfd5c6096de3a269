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
    let data: Vec<u8> = (0..1 << 20).map(|i: u32| (i * 13 + i / 509) as u8).collect();
    let (mut back, mut sent) = (Vec::new(), 0);
    let mut buf = vec![0u8; 64 * 1024];
    // Write and read interleaved (the echo cannot buffer everything).
    while back.len() < data.len() {
        if sent < data.len() {
            let n = c.write(&data[sent..(sent + 200_000).min(data.len())]).await.unwrap();
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

//! `exs::Stream` and `exs::tokio::Stream` with TCP's semantics (issue 26), on every backend.

use std::io::{ErrorKind, Read, Write};
use std::net::Shutdown;
use std::time::{Duration, Instant};

use crate::util::*;
use crate::{ensure, Backend, Case, Net, Requires};

pub fn cases() -> Vec<Case> {
    let c = |name, run| Case {
        name,
        run,
        requires: Requires::Nothing,
    };
    vec![
        c(
            "a_stream_whose_peer_closed_reads_its_bytes_then_end_of_stream_after_a_failed_write",
            end_after_failed_write,
        ),
        c(
            "shutdown_write_and_flush_return_while_the_peer_reads_nothing",
            shutdown_unbounded,
        ),
        c(
            "a_read_after_shutdown_read_returns_end_of_stream",
            read_after_shutdown,
        ),
        c(
            "shutdown_read_wakes_a_blocked_reader",
            shutdown_wakes_reader,
        ),
        c(
            "shutdown_write_wakes_a_writer_blocked_on_a_full_send_ring",
            shutdown_wakes_writer,
        ),
        c(
            "shutdown_write_after_the_peers_reset_says_not_connected_and_after_its_close_succeeds",
            shutdown_after_reset,
        ),
        c(
            "a_streams_addresses_stay_after_the_peer_closes_and_only_the_local_one_after_a_reset",
            addresses_after_close,
        ),
        c(
            "clones_of_a_stream_read_and_write_in_two_threads",
            clones_both_ways,
        ),
        c(
            "a_dropped_tokio_read_future_loses_no_bytes",
            dropped_read_future,
        ),
        c(
            "owned_halves_of_a_tokio_stream_echo_both_ways_and_the_write_half_ends_the_stream",
            owned_halves,
        ),
    ]
}

fn s(e: impl std::fmt::Display) -> String {
    e.to_string()
}

/// A connected pair of `exs::Stream`s: (client, server), and their contexts (a context whose last handle is
/// dropped tears its connections down at once).
fn streams(net: &dyn Net) -> Result<(exs::Stream, exs::Stream, Hosts), String> {
    let (server, client) = (net.host(), net.host());
    let l = exs::Listener::bind_in(&server, net.listen_addr(0)).map_err(s)?;
    let addr = l.local_addr().map_err(s)?;
    // Accepts without blocking, for at most WAIT: when the connect fails, the thread (and the listener and
    // context it holds) does not wait for ever.
    l.set_nonblocking(true).map_err(s)?;
    let accept = std::thread::spawn(move || {
        let t = Instant::now();
        loop {
            match l.accept() {
                Err(e) if e.kind() == ErrorKind::WouldBlock && t.elapsed() < WAIT => {
                    std::thread::sleep(Duration::from_millis(1))
                }
                r => return r.map(|(s, _)| s),
            }
        }
    });
    let c = exs::Stream::connect_in(&client, addr).map_err(s)?;
    let srv = accept.join().map_err(|_| "accept panicked")?.map_err(s)?;
    Ok((c, srv, (client, server)))
}

/// The contexts of a pair, kept for the test's length.
type Hosts = (exs::Context, exs::Context);

/// Reads until end-of-stream, waiting at most [`WAIT`] for each read.
fn read_all(st: &exs::Stream) -> Result<Vec<u8>, String> {
    st.set_read_timeout(Some(WAIT)).map_err(s)?;
    let mut got = Vec::new();
    (&*st)
        .read_to_end(&mut got)
        .map_err(|e| format!("reading after {} bytes: {e}", got.len()))?;
    Ok(got)
}

/// Issue 26, "a lost end-of-stream": `Core::absorb_queued` stopped at the first failed event of a batch, so when
/// a send failed (the peer closed) in the same batch as the receive's end-of-stream, the read returned the send's
/// `BrokenPipe` and every later read waited for ever. The peer writes, then closes while this side's writes are
/// in flight: a write fails, and reads return the peer's bytes, then end-of-stream (never the write's error, never
/// a wait), as TCP's do.
fn end_after_failed_write(b: &dyn Backend) -> Result<(), String> {
    let net = b.net();
    let (mut a, mut p, _hosts) = streams(&*net)?;
    let from_peer = pattern(300_000, 5);
    p.write_all(&from_peer).map_err(s)?;
    // The peer reads nothing and closes: a's writes end with an error.
    let writes = std::thread::spawn(move || {
        let chunk = vec![1u8; 64 << 10];
        let t = Instant::now();
        loop {
            if let Err(e) = a.write_all(&chunk).and_then(|()| a.flush()) {
                return Ok((a, e));
            }
            if t.elapsed() > WAIT {
                return Err("no write failed after the peer closed".to_string());
            }
        }
    });
    std::thread::sleep(Duration::from_millis(200));
    drop(p);
    let (a, e) = writes.join().map_err(|_| "the writer panicked")??;
    ensure!(
        matches!(
            e.kind(),
            ErrorKind::BrokenPipe | ErrorKind::ConnectionReset | ErrorKind::ConnectionAborted
        ),
        "the write after the peer closed: {e}"
    );
    let got = read_all(&a)?;
    same(&got, &from_peer, "the peer's bytes before its close")?;
    let mut more = [0u8; 16];
    ensure!(
        (&a).read(&mut more).map_err(s)? == 0,
        "a read after end-of-stream"
    );
    Ok(())
}

/// Issue 26, "an unbounded shutdown": `shutdown(Write)` and `flush` waited for the bytes written to leave, so a
/// peer that never read held the caller for ever. Now they return at once, as TCP's do; the peer, once it
/// reads, gets every byte, then end-of-stream.
fn shutdown_unbounded(b: &dyn Backend) -> Result<(), String> {
    let net = b.net();
    let (a, p, _hosts) = streams(&*net)?;
    // Fill everything between the two: the peer's receives, its stream buffer and a's send ring.
    let sent = fill_until_writes_wait(&a)?;
    let t = Instant::now();
    (&a).flush().map_err(s)?;
    a.shutdown(Shutdown::Write).map_err(s)?;
    let took = t.elapsed();
    ensure!(
        took < Duration::from_secs(2),
        "flush and shutdown(Write) waited {took:?} for a peer that reads nothing"
    );
    ensure!(
        (&a).write(b"x").map(|_| ()).map_err(|e| e.kind()) == Err(ErrorKind::BrokenPipe),
        "a write after shutdown(Write) must fail with BrokenPipe"
    );
    let got = read_all(&p)?;
    same(&got, &sent, "bytes written before shutdown(Write)")
}

/// Issue 26, "data after shutdown(Read)": a read after `shutdown(Read)` returned bytes of a receive posted
/// before it. It returns end-of-stream, whatever has arrived.
fn read_after_shutdown(b: &dyn Backend) -> Result<(), String> {
    let net = b.net();
    let (a, mut p, _hosts) = streams(&*net)?;
    p.write_all(&pattern(50_000, 9)).map_err(s)?;
    // Let the bytes arrive in a's posted receives.
    let mut first = [0u8; 1];
    a.set_read_timeout(Some(WAIT)).map_err(s)?;
    ensure!((&a).read(&mut first).map_err(s)? == 1, "the first byte");
    a.shutdown(Shutdown::Read).map_err(s)?;
    let mut buf = [0u8; 1000];
    ensure!(
        (&a).read(&mut buf).map_err(s)? == 0,
        "a read after shutdown(Read) returned bytes"
    );
    // The writing side is unaffected.
    (&a).write_all(b"still writing").map_err(s)?;
    a.shutdown(Shutdown::Write).map_err(s)?;
    let got = read_all(&p)?;
    same(
        &got,
        b"still writing",
        "bytes after the other side's shutdown(Read)",
    )
}

/// `shutdown(Read)` from another thread ends a read that waits (the stream is shared with `try_clone`).
fn shutdown_wakes_reader(b: &dyn Backend) -> Result<(), String> {
    let net = b.net();
    let (a, _p, _hosts) = streams(&*net)?;
    let a2 = a.try_clone().map_err(s)?;
    let reader = std::thread::spawn(move || {
        let mut buf = [0u8; 10];
        let t = Instant::now();
        let n = (&a2).read(&mut buf);
        (n.map_err(s), t.elapsed())
    });
    std::thread::sleep(Duration::from_millis(200));
    a.shutdown(Shutdown::Read).map_err(s)?;
    let (n, took) = reader.join().map_err(|_| "the reader panicked")?;
    ensure!(n? == 0, "the blocked read returned bytes");
    ensure!(took < WAIT, "the blocked read was not woken");
    Ok(())
}

/// Review: `shutdown(Write)` from one thread left a writer blocked in another (its send ring full, the peer
/// reading nothing) asleep until its write timeout, or for ever without one; TCP's wakes it with `EPIPE`. The
/// blocked write fails with `BrokenPipe` at once.
fn shutdown_wakes_writer(b: &dyn Backend) -> Result<(), String> {
    let net = b.net();
    let (a, _p, _hosts) = streams(&*net)?;
    fill_until_writes_wait(&a)?;
    // Long enough that only the shutdown can end the next write before it.
    a.set_write_timeout(Some(Duration::from_secs(20)))
        .map_err(s)?;
    let a2 = a.try_clone().map_err(s)?;
    let writer = std::thread::spawn(move || {
        let t = Instant::now();
        let r = (&a2).write(&pattern(100_000, 7));
        (r.map_err(|e| e.kind()), t.elapsed())
    });
    std::thread::sleep(Duration::from_millis(300));
    a.shutdown(Shutdown::Write).map_err(s)?;
    let (r, took) = writer.join().map_err(|_| "the writer panicked")?;
    ensure!(
        r == Err(ErrorKind::BrokenPipe),
        "the blocked write ended with {r:?} after {took:?}, not BrokenPipe at the shutdown"
    );
    Ok(())
}

/// Review: `shutdown(Write)` on a connection the peer had reset returned `Ok` (and the next write failed);
/// TCP's says `ENOTCONN`. After the peer's graceful close it succeeds, as TCP's does in CLOSE_WAIT.
fn shutdown_after_reset(b: &dyn Backend) -> Result<(), String> {
    let net = b.net();
    let (a, p, _hosts) = streams(&*net)?;
    p.socket().abort().map_err(s)?;
    a.set_read_timeout(Some(WAIT)).map_err(s)?;
    read_says_reset(&a)?;
    let mut one = [0u8; 1];
    for i in 0..2 {
        let r = a.shutdown(Shutdown::Write).map_err(|e| e.kind());
        ensure!(
            r == Err(ErrorKind::NotConnected),
            "shutdown(Write) {i} after the peer's reset: {r:?}"
        );
    }
    let net2 = b.net();
    let (c, p2, _hosts2) = streams(&*net2)?;
    drop(p2);
    c.set_read_timeout(Some(WAIT)).map_err(s)?;
    ensure!(
        (&c).read(&mut one).map_err(s)? == 0,
        "end-of-stream after the peer's close"
    );
    c.shutdown(Shutdown::Write)
        .map_err(|e| format!("shutdown(Write) after the peer's close: {e}"))
}

/// A read of `a`, whose peer reset the connection, fails with `ConnectionReset`; the reads after it return
/// end-of-stream, as TCP's do (a review found the error returned by every read: a loop that logs errors and reads
/// on until end-of-stream never ended).
fn read_says_reset(a: &exs::Stream) -> Result<(), String> {
    let mut one = [0u8; 1];
    let e = (&*a)
        .read(&mut one)
        .err()
        .ok_or("a read after the peer's reset returned")?;
    ensure!(
        e.kind() == ErrorKind::ConnectionReset,
        "the read after the peer's reset: {e}"
    );
    for i in 0..2 {
        let r = (&*a).read(&mut one);
        ensure!(
            matches!(r, Ok(0)),
            "read {i} after the reset was reported: {r:?}"
        );
    }
    Ok(())
}

/// Writes to `a` until a write waits for room (the peer reads nothing): its receives, its stream buffer and
/// `a`'s send ring are full. Returns the bytes written.
fn fill_until_writes_wait(a: &exs::Stream) -> Result<Vec<u8>, String> {
    a.set_write_timeout(Some(Duration::from_millis(300)))
        .map_err(s)?;
    let mut sent = Vec::new();
    let mut i = 0u64;
    loop {
        let chunk = pattern(100_000, i);
        match (&*a).write(&chunk) {
            Ok(n) => sent.extend_from_slice(&chunk[..n]),
            Err(e) if e.kind() == ErrorKind::WouldBlock => return Ok(sent),
            Err(e) => return Err(format!("write: {e}")),
        }
        i += 1;
        ensure!(sent.len() < 1 << 30, "the writes never waited");
    }
}

/// Review: `peer_addr` and `local_addr` failed with `NotConnected` as soon as the peer's close came in, while its
/// bytes were still to be read (TCP's `getpeername` and `getsockname` work in CLOSE_WAIT), and `local_addr` after
/// any disconnect (a connecting socket is bound by its endpoint alone, released with the connection). Now both
/// stay until this side closes; after a reset, `peer_addr` is `NotConnected` and `local_addr` stays, as TCP's.
fn addresses_after_close(b: &dyn Backend) -> Result<(), String> {
    // A block per way the connection ends, each with its own pair, dropped before the next (in the emulated
    // guests a case holding three pairs at once left less of the device to its neighbour), and naming itself in
    // its failure.
    addresses_after_the_peers_close(b).map_err(|e| format!("the peer closes: {e}"))?;
    addresses_after_a_reset(b).map_err(|e| format!("the peer resets: {e}"))?;
    addresses_after_a_shutdown_and_a_reset(b)
        .map_err(|e| format!("the peer shuts its sending side down, then resets: {e}"))
}

/// Both addresses stay while the peer's last bytes are read after its close, and after its end-of-stream.
fn addresses_after_the_peers_close(b: &dyn Backend) -> Result<(), String> {
    let net = b.net();
    let (a, mut p, _hosts) = streams(&*net)?;
    let (peer, local) = (a.peer_addr().map_err(s)?, a.local_addr().map_err(s)?);
    ensure!(
        peer == p.local_addr().map_err(s)? && local == p.peer_addr().map_err(s)?,
        "the two ends' addresses disagree: {peer} {local}"
    );
    p.write_all(b"last words").map_err(s)?;
    drop(p);
    let mut first = [0u8; 4];
    a.set_read_timeout(Some(WAIT)).map_err(s)?;
    (&a).read_exact(&mut first).map_err(s)?;
    // The peer's close has come in (its bytes before it still to be read): the state TCP calls CLOSE_WAIT.
    let t = Instant::now();
    while !matches!(a.socket().error(), Ok(Some(exs::OpError::PeerClosed))) {
        ensure!(
            t.elapsed() < WAIT,
            "the peer's close never came: {:?}",
            a.socket().error()
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    let after = |what: &str| -> Result<(), String> {
        let (pa, la) = (a.peer_addr(), a.local_addr());
        ensure!(
            pa.as_ref().ok() == Some(&peer) && la.as_ref().ok() == Some(&local),
            "{what}: peer_addr {pa:?}, local_addr {la:?}"
        );
        Ok(())
    };
    after("after the peer's close")?;
    let rest = read_all(&a)?;
    same(&rest, b" words", "the bytes after the first read")?;
    after("after end-of-stream")
}

/// The peer resets: its address goes, this side's stays.
fn addresses_after_a_reset(b: &dyn Backend) -> Result<(), String> {
    let net = b.net();
    let (c, p, _hosts) = streams(&*net)?;
    let local = c.local_addr().map_err(s)?;
    p.socket().abort().map_err(s)?;
    c.set_read_timeout(Some(WAIT)).map_err(s)?;
    read_says_reset(&c)?;
    ensure!(
        c.peer_addr().map_err(|e| e.kind()) == Err(ErrorKind::NotConnected),
        "peer_addr after a reset: {:?}",
        c.peer_addr()
    );
    ensure!(
        c.local_addr().map_err(s)? == local,
        "local_addr after a reset"
    );
    Ok(())
}

/// The peer shuts its sending side down, then resets: the reset ends the peer's address as well.
fn addresses_after_a_shutdown_and_a_reset(b: &dyn Backend) -> Result<(), String> {
    let net = b.net();
    let (c, p, _hosts) = streams(&*net)?;
    p.shutdown(Shutdown::Write).map_err(s)?;
    c.set_read_timeout(Some(WAIT)).map_err(s)?;
    let mut one = [0u8; 1];
    ensure!(
        (&c).read(&mut one).map_err(s)? == 0,
        "end-of-stream after the peer's shutdown"
    );
    ensure!(
        c.peer_addr().is_ok(),
        "peer_addr after the peer's shutdown(Write)"
    );
    p.socket().abort().map_err(s)?;
    let t = Instant::now();
    while c.peer_addr().is_ok() {
        ensure!(t.elapsed() < WAIT, "peer_addr stayed after the reset");
        std::thread::sleep(Duration::from_millis(5));
    }
    Ok(())
}

/// `try_clone` and `Read`/`Write` on `&Stream`: one thread writes 4 MiB while another reads 4 MiB from the
/// peer, through handles of one stream.
fn clones_both_ways(b: &dyn Backend) -> Result<(), String> {
    let net = b.net();
    let (a, p, _hosts) = streams(&*net)?;
    let (to_p, to_a) = (pattern(4 << 20, 1), pattern(4 << 20, 2));
    let peer = {
        let to_a = to_a.clone();
        std::thread::spawn(move || -> Result<Vec<u8>, String> {
            let w = p.try_clone().map_err(s)?;
            let writer = std::thread::spawn(move || {
                (&w).write_all(&to_a)
                    .and_then(|()| w.shutdown(Shutdown::Write))
            });
            let got = read_all(&p)?;
            writer
                .join()
                .map_err(|_| "peer writer panicked")?
                .map_err(s)?;
            Ok(got)
        })
    };
    let w = a.try_clone().map_err(s)?;
    let data = to_p.clone();
    let writer = std::thread::spawn(move || {
        (&w).write_all(&data)
            .and_then(|()| w.shutdown(Shutdown::Write))
    });
    let got = read_all(&a)?;
    writer.join().map_err(|_| "writer panicked")?.map_err(s)?;
    same(&got, &to_a, "bytes from the peer")?;
    let theirs = peer.join().map_err(|_| "peer panicked")??;
    same(&theirs, &to_p, "bytes to the peer")
}

fn runtime() -> Result<tokio::runtime::Runtime, String> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(s)
}

/// A connected pair of `exs::tokio::Stream`s: (client, server).
async fn tokio_streams(
    net: &dyn Net,
) -> Result<(exs::tokio::Stream, exs::tokio::Stream, Hosts), String> {
    let (server, client) = (net.host(), net.host());
    let l = exs::tokio::Listener::bind_in(&server, net.listen_addr(0))
        .await
        .map_err(s)?;
    let addr = l.local_addr().map_err(s)?;
    let accept = tokio::spawn(async move { l.accept().await.map(|(s, _)| s) });
    let c = exs::tokio::Stream::connect_in(&client, addr)
        .await
        .map_err(s)?;
    let srv = accept.await.map_err(s)?.map_err(s)?;
    Ok((c, srv, (client, server)))
}

/// Issue 26: a read future dropped before it finished (a `timeout` around it ran out) takes no bytes with it.
/// The peer writes 1 MiB in pieces with pauses; the reader reads under a timeout shorter than the pauses, so
/// many reads are dropped while waiting: every byte arrives, in order.
fn dropped_read_future(b: &dyn Backend) -> Result<(), String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let net = b.net();
    let rt = runtime()?;
    rt.block_on(async {
        let (mut a, mut p, _hosts) = tokio_streams(&*net).await?;
        let data = pattern(1 << 20, 17);
        let sent = data.clone();
        let writer = tokio::spawn(async move {
            for piece in sent.chunks(100_000) {
                p.write_all(piece).await?;
                tokio::time::sleep(Duration::from_millis(30)).await;
            }
            p.shutdown().await
        });
        let (mut got, mut dropped) = (Vec::new(), 0);
        let mut buf = vec![0u8; 70_000];
        let deadline = Instant::now() + WAIT;
        loop {
            ensure!(Instant::now() < deadline, "reading took too long");
            match tokio::time::timeout(Duration::from_millis(5), a.read(&mut buf)).await {
                Err(_) => dropped += 1,
                Ok(Ok(0)) => break,
                Ok(Ok(n)) => got.extend_from_slice(&buf[..n]),
                Ok(Err(e)) => return Err(format!("read: {e}")),
            }
        }
        writer.await.map_err(s)?.map_err(s)?;
        ensure!(dropped > 0, "no read was dropped while waiting");
        same(
            &got,
            &data,
            "bytes read with dropped read futures in between",
        )
    })
}

/// `into_split`: a task per half on each side, 4 MiB each way at once; dropping a write half ends the peer's
/// reads (as tokio's `OwnedWriteHalf` does); `reunite` gives the stream back.
fn owned_halves(b: &dyn Backend) -> Result<(), String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let net = b.net();
    let rt = runtime()?;
    rt.block_on(async {
        let (a, p, _hosts) = tokio_streams(&*net).await?;
        let (ra, wa) = a.into_split();
        let (rp, wp) = p.into_split();
        ensure!(
            ra.peer_addr().map_err(s)? == wp.local_addr().map_err(s)?,
            "the halves' addresses"
        );
        let (to_p, to_a) = (pattern(4 << 20, 3), pattern(4 << 20, 4));
        let write = |mut w: exs::tokio::OwnedWriteHalf, data: Vec<u8>| {
            tokio::spawn(async move { w.write_all(&data).await })
        };
        let read = |mut r: exs::tokio::OwnedReadHalf| {
            tokio::spawn(async move {
                let mut got = Vec::new();
                r.read_to_end(&mut got).await.map(|_| (r, got))
            })
        };
        let (w1, w2) = (write(wa, to_p.clone()), write(wp, to_a.clone()));
        let (r1, r2) = (read(ra), read(rp));
        w1.await.map_err(s)?.map_err(s)?;
        w2.await.map_err(s)?.map_err(s)?;
        let (_, got_a) = r1.await.map_err(s)?.map_err(s)?;
        let (_, got_p) = r2.await.map_err(s)?.map_err(s)?;
        same(&got_a, &to_a, "bytes to a")?;
        same(&got_p, &to_p, "bytes to the peer")
    })?;
    // reunite: the halves of one stream join, those of two do not.
    let net = b.net();
    rt.block_on(async {
        let (a, p, _hosts) = tokio_streams(&*net).await?;
        let (ra, wa) = a.into_split();
        let (rp, wp) = p.into_split();
        let err = ra
            .reunite(wp)
            .err()
            .ok_or("halves of two streams reunited")?;
        let (ra, wp) = (err.0, err.1);
        ra.reunite(wa).map_err(s)?;
        rp.reunite(wp).map_err(s)?;
        Ok(())
    })
}

//! SOCK_STREAM close with traffic both ways (issue 26): a graceful close delivers every send already started.

use exs::{EventKind, EventQueue, MemoryRegion, MsgFlags, SockType, Socket};

use crate::util::*;
use crate::{ensure, Backend, Case, Requires};

pub fn cases() -> Vec<Case> {
    let c = |name, run| Case {
        name,
        run,
        requires: Requires::Nothing,
    };
    vec![
        c(
            "a_graceful_close_completes_every_started_send_with_traffic_both_ways",
            close_both_ways,
        ),
        c(
            "both_sides_closing_with_traffic_both_ways_complete_every_send_delivered",
            both_close,
        ),
        c(
            "bytes_a_stream_holds_when_the_peer_resets_are_read_then_the_reset",
            bytes_before_a_reset,
        ),
    ]
}

const TOTAL: usize = 4 << 20;

/// Random send sizes (1 byte to 256 KiB) that add up to [`TOTAL`].
fn random_sizes(seed: u64) -> Vec<usize> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut left = TOTAL;
    let mut v = Vec::new();
    while left > 0 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let n = ((x % (256 << 10)) as usize + 1).min(left);
        v.push(n);
        left -= n;
    }
    v
}

/// Posts every send of `data` in random sizes on `sock`; returns how many.
fn send_all(
    sock: &Socket,
    eq: &EventQueue,
    src: &MemoryRegion,
    seed: u64,
) -> Result<usize, String> {
    let mut at = 0;
    let sizes = random_sizes(seed);
    for (i, n) in sizes.iter().enumerate() {
        sock.send(eq, &src.slice(at..at + n), MsgFlags::NONE, i as u64)
            .map_err(|e| format!("send {i}: {e}"))?;
        at += n;
    }
    Ok(sizes.len())
}

/// Reads with receives of random sizes until end-of-stream; returns the bytes.
fn read_to_eof(sock: &Socket, ctx: &exs::Context) -> Result<Vec<u8>, String> {
    let eq = EventQueue::new(8).unwrap();
    let buf = MemoryRegion::alloc(ctx, 300_000).map_err(|e| e.to_string())?;
    let mut got = Vec::new();
    let mut x = 7u64;
    loop {
        x = x
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        let want = ((x >> 33) as usize % 300_000) + 1;
        sock.recv(&eq, &buf.slice(..want), MsgFlags::NONE, 0)
            .map_err(|e| format!("receive after {} bytes: {e}", got.len()))?;
        let ev = next(&eq)?;
        ensure!(
            ev.kind == EventKind::Recv && ev.is_ok(),
            "receive after {} bytes: {ev:?}",
            got.len()
        );
        if ev.flags.eof {
            return Ok(got);
        }
        let mut b = vec![0u8; ev.bytes];
        buf.read(0, &mut b).map_err(|e| e.to_string())?;
        got.extend_from_slice(&b);
    }
}

/// Every send event on `eq` (`n` of them) is Ok with all its bytes.
fn sends_ok(eq: &EventQueue, n: usize, who: &str) -> Result<(), String> {
    let mut evs = Vec::new();
    while evs.len() < n {
        evs.push(next(eq)?);
    }
    let bad: Vec<_> = evs.iter().filter(|e| !e.is_ok()).collect();
    ensure!(
        bad.is_empty(),
        "{who}: {} of {n} sends started before the close failed, first {:?}",
        bad.len(),
        bad[0]
    );
    Ok(())
}

/// The client posts 4 MiB of sends of random sizes, the server 4 MiB the other way, and the client closes at
/// once, while its sends are in flight and the server's arrive. The server reads to end-of-stream: it gets every
/// byte the client sent, and every one of the client's sends completes Ok (TCP delivers every byte written
/// before `close`). The server's sends to the closed side may fail; they are not checked.
fn close_both_ways(b: &dyn Backend) -> Result<(), String> {
    let net = b.net();
    let p = pair(&*net, SockType::Stream, exs::SocketOptions::default())?;
    let (a_data, b_data) = (pattern(TOTAL, 31), pattern(TOTAL, 32));
    let (a_src, b_src) = (
        p.region_a(a_data.clone())?,
        MemoryRegion::from_vec(&p.b, b_data).map_err(|e| e.to_string())?,
    );
    let server = p.server.clone();
    let b_ctx = p.b.clone();
    let reader = std::thread::spawn(move || read_to_eof(&server, &b_ctx));
    let b_eq = EventQueue::new(4096).unwrap();
    send_all(&p.server, &b_eq, &b_src, 2)?;
    let n = send_all(&p.client, &p.eq_a, &a_src, 1)?;
    p.client.close().map_err(|e| e.to_string())?;
    let got = reader.join().map_err(|_| "the reader panicked")??;
    same(&got, &a_data, "bytes sent before the close")?;
    sends_ok(&p.eq_a, n, "client")
}

/// Both sides send 4 MiB of random sizes and read the other's to end-of-stream; each closes once it has read
/// everything, whatever its own sends are doing. Every send completes Ok on both sides: the one that closes first
/// still delivers its started sends, and the other's CLOSE, which can arrive before the completions of writes
/// that already reached it, must not end them.
fn both_close(b: &dyn Backend) -> Result<(), String> {
    let net = b.net();
    let p = pair(&*net, SockType::Stream, exs::SocketOptions::default())?;
    let (a_data, b_data) = (pattern(TOTAL, 41), pattern(TOTAL, 42));
    let (a_src, b_src) = (
        p.region_a(a_data.clone())?,
        MemoryRegion::from_vec(&p.b, b_data.clone()).map_err(|e| e.to_string())?,
    );
    let side = |sock: Socket, ctx: exs::Context, src: MemoryRegion, seed: u64, want: Vec<u8>| {
        std::thread::spawn(move || -> Result<(), String> {
            let eq = EventQueue::new(4096).unwrap();
            let n = send_all(&sock, &eq, &src, seed)?;
            // Read until everything the other side sends has come, then close (no end-of-stream needed).
            let rq = EventQueue::new(8).unwrap();
            let buf = MemoryRegion::alloc(&ctx, 200_000).map_err(|e| e.to_string())?;
            let mut got = Vec::new();
            while got.len() < want.len() {
                sock.recv(&rq, &buf.all(), MsgFlags::NONE, 0)
                    .map_err(|e| e.to_string())?;
                let ev = next(&rq)?;
                ensure!(ev.is_ok() && ev.bytes > 0, "receive: {ev:?}");
                let mut v = vec![0u8; ev.bytes];
                buf.read(0, &mut v).map_err(|e| e.to_string())?;
                got.extend_from_slice(&v);
            }
            same(&got, &want, "bytes received")?;
            sock.close().map_err(|e| e.to_string())?;
            sends_ok(&eq, n, "a side that closed")
        })
    };
    let ta = side(p.client.clone(), p.a.clone(), a_src, 3, b_data);
    let tb = side(p.server.clone(), p.b.clone(), b_src, 4, a_data);
    let ra = ta.join().map_err(|_| "client thread panicked")?;
    let rb = tb.join().map_err(|_| "server thread panicked")?;
    ra.map_err(|e| format!("client: {e}"))?;
    rb.map_err(|e| format!("server: {e}"))
}

/// Review: on a reset, the bytes a stream receiver already held in its stream buffer were thrown away with the
/// connection: only those already in posted receives were read, then the reset. TCP delivers what it acknowledged
/// before a reset, and the peer's sends had completed (the bytes were in this side's memory). Now receives read
/// what the stream buffer holds, then fail with the reset. Here one send of 3,000 bytes lands in the stream
/// buffer (no receive posted); a receive of 100 bytes shows it arrived; the sender resets, and once this side has
/// seen the reset the rest is read, then every later receive fails with the reset (in its event, or refused).
fn bytes_before_a_reset(b: &dyn Backend) -> Result<(), String> {
    let net = b.net();
    let p = pair(&*net, SockType::Stream, exs::SocketOptions::default())?;
    let data = pattern(3000, 31);
    let src = p.region_a(data.clone())?;
    p.client
        .send(&p.eq_a, &src.all(), MsgFlags::NONE, 1)
        .map_err(e)?;
    let ev = next(&p.eq_a)?;
    ensure!(ev.is_ok() && ev.bytes == data.len(), "the send: {ev:?}");
    let buf = p.region_b(100)?;
    p.server
        .recv(&p.eq_b, &buf.all(), MsgFlags::NONE, 2)
        .map_err(e)?;
    let r = next(&p.eq_b)?;
    ensure!(r.is_ok() && r.bytes == 100, "the first receive: {r:?}");
    let mut got = vec![0u8; 100];
    buf.read(0, &mut got).map_err(e)?;
    p.client.abort().map_err(e)?;
    let seen = std::time::Instant::now();
    while p.server.error().map_err(e)?.is_none() {
        ensure!(seen.elapsed() < WAIT, "the reset never reached the server");
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    let rest = p.region_b(1 << 20)?;
    let reset = |what: &str| format!("{what}: not the reset");
    let mut failures = 0;
    while failures < 2 {
        if let Err(err) = p.server.recv(&p.eq_b, &rest.all(), MsgFlags::NONE, 3) {
            ensure!(
                err.to_string().contains("reset"),
                "{}: {err}",
                reset("a receive refused")
            );
            failures += 1;
            continue;
        }
        let r = next(&p.eq_b)?;
        match &r.status {
            Ok(()) => {
                ensure!(
                    r.bytes > 0,
                    "a clean end of stream after {} bytes",
                    got.len()
                );
                let mut b = vec![0u8; r.bytes];
                rest.read(0, &mut b).map_err(e)?;
                got.extend_from_slice(&b);
            }
            Err(err) => {
                ensure!(
                    matches!(err, exs::OpError::ConnectionReset),
                    "{}: {err:?}",
                    reset("a receive's event")
                );
                failures += 1;
            }
        }
    }
    same(&got, &data, "the bytes read before the reset")
}

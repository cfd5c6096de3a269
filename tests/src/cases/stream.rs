//! SOCK_STREAM end to end (seed 001): sizes, MSG_WAITALL, direct and indirect transfers mixed.

use exs::{EventKind, MemoryRegion, MsgFlags, SockType, SocketOptions};

use crate::util::*;
use crate::{ensure, Backend, Case, Requires};

pub fn cases() -> Vec<Case> {
    let c = |name, run| Case {
        name,
        run,
        requires: Requires::Nothing,
    };
    vec![
        c("stream_sizes_1b_to_16mib", sizes),
        c("stream_waitall", waitall),
        c("stream_mixed_direct_and_indirect", mixed),
        c("stream_small_buffer_many_small_writes", small_writes),
        c("stream_close_delivers_then_eof", close_eof),
        c(
            "stream_close_is_graceful_and_nothing_follows_its_close",
            graceful_close,
        ),
        c("std_io_stream_transfer_then_end_of_stream", std_io_transfer),
        c("http_over_exs_streams_with_hyper", http),
        c(
            "direct_transfers_resume_after_the_sender_blocked_on_a_full_buffer",
            resume_one,
        ),
        c(
            "direct_transfers_resume_after_a_block_with_several_receives",
            resume_several,
        ),
        c(
            "direct_transfers_resume_after_a_block_with_waitall",
            resume_waitall,
        ),
        c(
            "direct_transfers_resume_after_a_block_in_both_directions",
            resume_both_ways,
        ),
        c(
            "stream_receives_filled_from_the_stream_buffer_get_no_key",
            keys_only_when_advertised,
        ),
    ]
}

/// Seed 001 with the writer ahead: a reader that keeps eight 64-byte receives posted (as `exs pump` does) behind
/// bytes already in its stream buffer fills them by copy before their turn to be advertised, so they get no key:
/// every key the reader made is for an advertised receive or for its stream buffer.
fn keys_only_when_advertised(b: &dyn Backend) -> Result<(), String> {
    const MSG: usize = 64;
    const DEPTH: usize = 8;
    const COUNT: usize = 1000;
    let net = b.net();
    let p = pair(&*net, SockType::Stream, SocketOptions::default())?;
    let sent = pattern(MSG * COUNT, 3);
    let src = p.region_a(sent.clone())?;
    for i in 0..COUNT {
        p.client
            .send(
                &p.eq_a,
                &src.slice(i * MSG..(i + 1) * MSG),
                MsgFlags::NONE,
                i as u64,
            )
            .map_err(|e| e.to_string())?;
    }
    std::thread::sleep(std::time::Duration::from_millis(50));
    let dst = p.region_b(MSG * DEPTH)?;
    let mut slots = std::collections::VecDeque::new();
    let (mut got, mut posted) = (Vec::with_capacity(sent.len()), 0usize);
    while got.len() < sent.len() {
        while slots.len() < DEPTH {
            let slot = posted % DEPTH;
            p.server
                .recv(
                    &p.eq_b,
                    &dst.slice(slot * MSG..(slot + 1) * MSG),
                    MsgFlags::NONE,
                    0,
                )
                .map_err(|e| e.to_string())?;
            slots.push_back(slot);
            posted += 1;
        }
        let ev = next(&p.eq_b)?;
        ensure!(ev.is_ok() && ev.bytes >= 1, "stream receive: {ev:?}");
        let slot = slots
            .pop_front()
            .ok_or("a completion with no receive posted")?;
        let mut bytes = vec![0; ev.bytes];
        dst.read(slot * MSG, &mut bytes)
            .map_err(|e| e.to_string())?;
        got.extend_from_slice(&bytes);
    }
    same(
        &got,
        &sent,
        "the stream, through receives filled from the buffer",
    )?;
    let adverts = p.server.stats().ok_or("stats")?.stream.adverts_sent;
    let keys = p.b.stats().exposures;
    ensure!(
        (adverts as usize) < posted / 2,
        "most receives were filled from the stream buffer, not advertised: {adverts} adverts, {posted} receives"
    );
    ensure!(
        keys == adverts + 1,
        "{keys} keys: one per advertised receive ({adverts}) and one for the stream buffer ({posted} receives)"
    );
    Ok(())
}

fn sizes(b: &dyn Backend) -> Result<(), String> {
    let net = b.net();
    let p = pair(&*net, SockType::Stream, exs::SocketOptions::default())?;
    for (i, len) in [1usize, 100, 4096, 65_536, 1 << 20, 16 << 20]
        .into_iter()
        .enumerate()
    {
        let data = pattern(len, i as u64);
        let src = p.region_a(data.clone())?;
        p.client
            .send(&p.eq_a, &src.all(), MsgFlags::NONE, i as u64)
            .map_err(|e| e.to_string())?;
        let got = read_stream(&p, len, 1 << 20, MsgFlags::NONE)?;
        same(&got, &data, &format!("{len}-byte stream"))?;
        let ev = next(&p.eq_a)?;
        ensure!(ev.is_ok() && ev.bytes == len, "send: {ev:?}");
    }
    Ok(())
}

fn waitall(b: &dyn Backend) -> Result<(), String> {
    let net = b.net();
    let p = pair(&*net, SockType::Stream, exs::SocketOptions::default())?;
    let data = pattern(300_000, 7);
    let src = p.region_a(data.clone())?;
    // Many small sends, read back in exactly 10,000-byte MSG_WAITALL pieces.
    for (i, c) in (0..300_000).step_by(3000).enumerate() {
        p.client
            .send(&p.eq_a, &src.slice(c..c + 3000), MsgFlags::NONE, i as u64)
            .map_err(|e| e.to_string())?;
    }
    let got = read_stream(&p, 300_000, 10_000, MsgFlags::WAITALL)?;
    same(&got, &data, "MSG_WAITALL stream")?;
    ensure!(all(&p.eq_a)?.iter().all(|e| e.is_ok()), "a send failed");
    Ok(())
}

fn mixed(b: &dyn Backend) -> Result<(), String> {
    let net = b.net();
    let p = pair(
        &*net,
        SockType::Stream,
        SocketOptions::default().with_stream_buffer_size(64 * 1024),
    )?;
    // Phase A: receives posted first (direct); phase B: sends first (indirect); alternate.
    let mut sent = Vec::new();
    let mut got = Vec::new();
    let dst = p.region_b(8 * 100_000)?;
    for round in 0..6u64 {
        let data = pattern(100_000, round);
        let src = p.region_a(data.clone())?;
        sent.extend_from_slice(&data);
        if round % 2 == 0 {
            p.server
                .recv(&p.eq_b, &dst.slice(0..100_000), MsgFlags::WAITALL, round)
                .map_err(|e| e.to_string())?;
            std::thread::sleep(std::time::Duration::from_millis(5));
            p.client
                .send(&p.eq_a, &src.all(), MsgFlags::NONE, round)
                .map_err(|e| e.to_string())?;
            let ev = next(&p.eq_b)?;
            ensure!(ev.is_ok() && ev.bytes == 100_000, "receive: {ev:?}");
            let mut b = vec![0u8; 100_000];
            dst.read(0, &mut b).map_err(|e| e.to_string())?;
            got.extend_from_slice(&b);
        } else {
            p.client
                .send(&p.eq_a, &src.all(), MsgFlags::NONE, round)
                .map_err(|e| e.to_string())?;
            got.extend(read_stream(&p, 100_000, 7000, MsgFlags::NONE)?);
        }
        ensure!(next(&p.eq_a)?.is_ok(), "send of round {round}");
    }
    same(&got, &sent, "mixed stream")?;
    let st = p.client.stats().ok_or("stats")?.stream;
    ensure!(
        st.direct_sent > 0 && st.indirect_sent > 0,
        "expected both kinds of transfer: {st:?}"
    );
    Ok(())
}

fn small_writes(b: &dyn Backend) -> Result<(), String> {
    let net = b.net();
    let p = pair(
        &*net,
        SockType::Stream,
        SocketOptions::default().with_stream_buffer_size(4096),
    )?;
    let data = pattern(20_000, 3);
    let src = p.region_a(data.clone())?;
    for i in 0..1000 {
        p.client
            .send(
                &p.eq_a,
                &src.slice(i * 20..(i + 1) * 20),
                MsgFlags::NONE,
                i as u64,
            )
            .map_err(|e| e.to_string())?;
    }
    let got = read_stream(&p, 20_000, 1500, MsgFlags::NONE)?;
    same(&got, &data, "1000 small writes through a 4 KiB buffer")?;
    ensure!(all(&p.eq_a)?.len() == 1000, "not every send completed");
    let st = p.client.stats().ok_or("stats")?.stream;
    ensure!(
        st.direct_sent + st.indirect_sent < 1000,
        "small writes were not packed: {st:?}"
    );
    Ok(())
}

fn close_eof(b: &dyn Backend) -> Result<(), String> {
    let net = b.net();
    let p = pair(&*net, SockType::Stream, exs::SocketOptions::default())?;
    let data = pattern(50_000, 11);
    let src = p.region_a(data.clone())?;
    p.client
        .send(&p.eq_a, &src.all(), MsgFlags::NONE, 1)
        .map_err(|e| e.to_string())?;
    ensure!(next(&p.eq_a)?.is_ok(), "send");
    p.client.close().map_err(|e| e.to_string())?;
    std::thread::sleep(std::time::Duration::from_millis(20));
    let got = read_stream(&p, 50_000, 30_000, MsgFlags::NONE)?;
    same(&got, &data, "data before the close")?;
    let buf = MemoryRegion::alloc(&p.b, 10).map_err(|e| e.to_string())?;
    p.server
        .recv(&p.eq_b, &buf.all(), MsgFlags::NONE, 2)
        .map_err(|e| e.to_string())?;
    let ev = next(&p.eq_b)?;
    ensure!(
        ev.is_ok() && ev.flags.eof && ev.bytes == 0,
        "end of stream: {ev:?}"
    );
    Ok(())
}

// -----------------------------------------------------------------------------------------------------------------
// Issue 14: direct transfers resume after the sender blocked on a full stream buffer (seed 001 Figure 5 while the
// sender is flow-controlled).

/// How the receiver takes the rest once the sender is blocked.
#[derive(Clone, Copy, Debug)]
enum Resume {
    /// One receive larger than what remains, reposted until everything arrived.
    One,
    /// Eight receives of a quarter of the total each, posted at once, reposted as they complete.
    Several,
    /// One MSG_WAITALL receive of everything left.
    WaitAll,
}

const RESUME_RING: u32 = 64 * 1024;
const RESUME_TOTAL: usize = 2 << 20;

fn resume_one(b: &dyn Backend) -> Result<(), String> {
    resume(b, Resume::One, false)
}
fn resume_several(b: &dyn Backend) -> Result<(), String> {
    resume(b, Resume::Several, false)
}
fn resume_waitall(b: &dyn Backend) -> Result<(), String> {
    resume(b, Resume::WaitAll, false)
}
fn resume_both_ways(b: &dyn Backend) -> Result<(), String> {
    resume(b, Resume::One, true)
}

/// Waits until `sock` has written a full stream buffer and stalls for space; returns the bytes it wrote indirectly.
fn wait_blocked(sock: &exs::Socket) -> Result<u64, String> {
    let until = std::time::Instant::now() + std::time::Duration::from_secs(20);
    loop {
        let st = sock.stats().ok_or("stats")?.stream;
        if st.indirect_bytes >= u64::from(RESUME_RING) && st.space_stalls > 0 {
            // Let anything in flight land: the sender is blocked when its count stops moving.
            std::thread::sleep(std::time::Duration::from_millis(30));
            let again = sock.stats().ok_or("stats")?.stream;
            if again.indirect_bytes == st.indirect_bytes {
                return Ok(st.indirect_bytes);
            }
        }
        ensure!(
            std::time::Instant::now() < until,
            "the sender never filled the stream buffer: {st:?}"
        );
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
}

/// Receives `total` bytes on `sock` as `how` says; send completions on the same queue are counted, not kept.
fn receive_resumed(
    ctx: &exs::Context,
    sock: &exs::Socket,
    eq: &exs::EventQueue,
    total: usize,
    how: Resume,
) -> Result<(Vec<u8>, usize), String> {
    let buf = MemoryRegion::alloc(ctx, 8 * total).map_err(|e| e.to_string())?;
    let mut got = Vec::with_capacity(total);
    let mut sends_done = 0;
    // Receives in flight: (offset in buf, length), in posting order.
    let mut posted = std::collections::VecDeque::new();
    let mut next_slot = 0usize;
    let mut claimed = 0usize;
    while got.len() < total {
        let want = match how {
            Resume::One | Resume::WaitAll => 1,
            Resume::Several => 8,
        };
        while posted.len() < want && claimed < total {
            let left = total - claimed;
            let (len, flags) = match how {
                Resume::One => (total, MsgFlags::NONE),
                Resume::Several => (total.div_ceil(4), MsgFlags::NONE),
                Resume::WaitAll => (left, MsgFlags::WAITALL),
            };
            let at = (next_slot % 8) * total;
            next_slot += 1;
            sock.recv(eq, &buf.slice(at..at + len), flags, 7)
                .map_err(|e| e.to_string())?;
            posted.push_back((at, len));
            // A non-WAITALL receive may take as little as one byte: claim conservatively.
            claimed += if flags.contains(MsgFlags::WAITALL) {
                len
            } else {
                1
            };
        }
        let ev = next(eq)?;
        if ev.kind == EventKind::Send {
            ensure!(ev.is_ok(), "send: {ev:?}");
            sends_done += 1;
            continue;
        }
        ensure!(
            ev.kind == EventKind::Recv && ev.is_ok() && ev.bytes >= 1,
            "receive: {ev:?}"
        );
        let (at, len) = posted
            .pop_front()
            .ok_or("a receive event with none posted")?;
        ensure!(ev.bytes <= len, "receive of {len} returned {}", ev.bytes);
        let mut b = vec![0u8; ev.bytes];
        buf.read(at, &mut b).map_err(|e| e.to_string())?;
        got.extend_from_slice(&b);
        claimed = got.len() + posted.len();
    }
    // Receives posted beyond the end stay posted; the pair is torn down after.
    Ok((got, sends_done))
}

fn resume(b: &dyn Backend, how: Resume, both_ways: bool) -> Result<(), String> {
    let net = b.net();
    let p = pair(
        &*net,
        SockType::Stream,
        SocketOptions::default().with_stream_buffer_size(RESUME_RING),
    )?;
    let data_a = pattern(RESUME_TOTAL, 41);
    let data_b = pattern(RESUME_TOTAL, 42);
    let src_a = p.region_a(data_a.clone())?;
    p.client
        .send(&p.eq_a, &src_a.all(), MsgFlags::NONE, 1)
        .map_err(|e| e.to_string())?;
    let src_b = MemoryRegion::from_vec(&p.b, data_b.clone()).map_err(|e| e.to_string())?;
    if both_ways {
        p.server
            .send(&p.eq_b, &src_b.all(), MsgFlags::NONE, 1)
            .map_err(|e| e.to_string())?;
    }
    let ring_a = wait_blocked(&p.client)?;
    let ring_b = if both_ways {
        wait_blocked(&p.server)?
    } else {
        0
    };
    let before_a = p.client.stats().ok_or("stats")?.stream;
    let before_b = p.server.stats().ok_or("stats")?.stream;
    let (got_b, got_a) = std::thread::scope(|s| {
        let at_b = s.spawn(|| receive_resumed(&p.b, &p.server, &p.eq_b, RESUME_TOTAL, how));
        let at_a = both_ways
            .then(|| s.spawn(|| receive_resumed(&p.a, &p.client, &p.eq_a, RESUME_TOTAL, how)));
        (
            at_b.join().expect("receiver thread"),
            at_a.map(|h| h.join().expect("receiver thread")),
        )
    });
    let (got_b, sends_b) = got_b?;
    same(&got_b, &data_a, "client to server")?;
    let mut report = Vec::new();
    let mut check = |who: &str,
                     sock: &exs::Socket,
                     before: exs::stats::StreamStats,
                     ring: u64|
     -> Result<(), String> {
        let after = sock.stats().ok_or("stats")?.stream;
        let remaining = RESUME_TOTAL as u64 - ring;
        let direct = after.direct_bytes - before.direct_bytes;
        report.push(format!(
            "{who}: {direct} of the {remaining} bytes left after the block went direct ({:.0}%), {} adverts rejected",
            100.0 * direct as f64 / remaining as f64,
            after.adverts_rejected
        ));
        ensure!(
            direct * 10 >= remaining * 9,
            "{how:?}: only {direct} of the {remaining} bytes sent after the sender blocked went direct: {after:?}"
        );
        Ok(())
    };
    check("client", &p.client, before_a, ring_a)?;
    if let Some(r) = got_a {
        let (got_a, sends_a) = r?;
        same(&got_a, &data_b, "server to client")?;
        check("server", &p.server, before_b, ring_b)?;
        ensure!(sends_a + sends_b <= 2, "too many send events");
    }
    eprintln!(
        "direct share after the block, {how:?} (both ways: {both_ways}): {}",
        report.join("; ")
    );
    Ok(())
}

/// Issue 14: `close()` right after many small sends, with a small stream buffer and few link credits so that
/// writes queue behind each other: every send completes `Ok`, the peer gets every byte and then end-of-stream, and
/// nothing arrives after the CLOSE (the receiver treats stream data after end-of-stream as a violation, which
/// would fail the reads here).
fn graceful_close(b: &dyn Backend) -> Result<(), String> {
    let net = b.net();
    let p = pair(
        &*net,
        SockType::Stream,
        SocketOptions::default()
            .with_stream_buffer_size(4096)
            .with_control_window(4),
    )?;
    const N: usize = 300;
    let data = pattern(N * 1000, 21);
    let src = p.region_a(data.clone())?;
    for i in 0..N {
        p.client
            .send(
                &p.eq_a,
                &src.slice(i * 1000..(i + 1) * 1000),
                MsgFlags::NONE,
                i as u64,
            )
            .map_err(|e| e.to_string())?;
    }
    p.client.close().map_err(|e| e.to_string())?;
    let got = read_stream(&p, N * 1000, 7000, MsgFlags::NONE)?;
    same(&got, &data, "bytes sent before a graceful close")?;
    let buf = MemoryRegion::alloc(&p.b, 10).map_err(|e| e.to_string())?;
    p.server
        .recv(&p.eq_b, &buf.all(), MsgFlags::NONE, 2)
        .map_err(|e| e.to_string())?;
    let ev = next(&p.eq_b)?;
    ensure!(
        ev.is_ok() && ev.flags.eof && ev.bytes == 0,
        "end of stream after the last byte: {ev:?}"
    );
    let sends = all(&p.eq_a)?;
    ensure!(
        sends.len() == N && sends.iter().all(|e| e.is_ok() && e.bytes == 1000),
        "every send before the close completes Ok: {:?}",
        sends.iter().find(|e| !e.is_ok())
    );
    ensure!(
        p.server
            .error()
            .map_err(|e| e.to_string())?
            .is_none_or(|e| e == exs::OpError::PeerClosed),
        "the receiving side saw a violation: {:?}",
        p.server.error()
    );
    Ok(())
}

/// Issue 16: `exs::Listener` and `exs::Stream` (`std::io::Read`/`Write`): 4 MiB one way, counted by the
/// listener's side with `io::copy`, then end-of-stream both ways.
fn std_io_transfer(b: &dyn Backend) -> Result<(), String> {
    use std::io::{Read, Write};
    let net = b.net();
    let (server, client) = (net.host(), net.host());
    let listener =
        exs::Listener::bind_in(&server, net.listen_addr(0)).map_err(|e| e.to_string())?;
    let addr = listener.local_addr().map_err(|e| e.to_string())?;
    let echo = std::thread::spawn(move || -> Result<u64, String> {
        let (mut s, _) = listener.accept().map_err(|e| e.to_string())?;
        let n = std::io::copy(&mut s, &mut std::io::sink()).map_err(|e| e.to_string())?;
        Ok(n)
    });
    let mut c = exs::Stream::connect_in(&client, addr).map_err(|e| e.to_string())?;
    let data = pattern(4 << 20, 77);
    c.write_all(&data).map_err(|e| e.to_string())?;
    c.shutdown(std::net::Shutdown::Write)
        .map_err(|e| e.to_string())?;
    let n = echo.join().map_err(|_| "the echo thread panicked")??;
    ensure!(
        n == data.len() as u64,
        "the listener's side read {n} bytes of {}",
        data.len()
    );
    let mut rest = Vec::new();
    c.read_to_end(&mut rest).map_err(|e| e.to_string())?;
    ensure!(rest.is_empty(), "bytes after the peer's end");
    Ok(())
}

/// The HTTP example, run on this backend.
#[allow(dead_code)]
#[path = "../../../exs/examples/http.rs"]
mod http_example;

/// Issue 16: HTTP/1.1 with hyper over `exs::tokio` streams: a 16 MiB body (many times round every stream buffer),
/// every byte checked (the example `exs/examples/http.rs`). Its speed beside hyper over TCP is the bench's
/// (`streams-http` rows), not this case's.
fn http(b: &dyn Backend) -> Result<(), String> {
    const LEN: usize = 16 << 20;
    let net = b.net();
    let (server, client) = (net.host(), net.host());
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    rt.block_on(http_example::fetch(
        &server,
        &client,
        net.listen_addr(0),
        LEN,
    ))
    .map_err(|e| format!("GET over exs: {e}"))?;
    Ok(())
}

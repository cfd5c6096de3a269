//! SOCK_STREAM end to end (seed 001): sizes, MSG_WAITALL, direct and indirect transfers mixed.

use exs::{EventKind, MemoryRegion, MsgFlags, SockType, SocketOption};

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
    ]
}

/// Reads `total` bytes with receives of up to `chunk` bytes; returns them.
fn read_stream(p: &Pair, total: usize, chunk: usize, flags: MsgFlags) -> Result<Vec<u8>, String> {
    let buf = p.region_b(chunk)?;
    let mut got = Vec::with_capacity(total);
    while got.len() < total {
        let want = chunk.min(total - got.len());
        p.server
            .recv(&p.eq_b, &buf.slice(0..want), flags, 0)
            .map_err(|e| e.to_string())?;
        let ev = next(&p.eq_b)?;
        ensure!(
            ev.kind == EventKind::Recv && ev.is_ok() && ev.bytes >= 1,
            "stream receive: {ev:?}"
        );
        if flags.contains(MsgFlags::WAITALL) {
            ensure!(
                ev.bytes == want,
                "MSG_WAITALL returned {} of {want}",
                ev.bytes
            );
        }
        let mut b = vec![0u8; ev.bytes];
        buf.read(0, &mut b).map_err(|e| e.to_string())?;
        got.extend_from_slice(&b);
    }
    Ok(got)
}

fn sizes(b: &dyn Backend) -> Result<(), String> {
    let net = b.net();
    let p = pair(&*net, SockType::Stream, &[])?;
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
    let p = pair(&*net, SockType::Stream, &[])?;
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
        &[SocketOption::StreamBufferSize(64 * 1024)],
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
        &[SocketOption::StreamBufferSize(4096)],
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
    let p = pair(&*net, SockType::Stream, &[])?;
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

//! The UNH-EXS extensions and the rest of the ES-API, end to end: persistent sends and receives, offsets,
//! shutdown, abortive close, poll, sendfile.

use std::io::Write;
use std::time::Duration;

use exs::{EventKind, EventQueue, MsgFlags, OpError, Readiness, SendError, SockType, StateError};

use crate::util::*;
use crate::{ensure, Backend, Case, Requires};

pub fn cases() -> Vec<Case> {
    let c = |name, run| Case {
        name,
        run,
        requires: Requires::Nothing,
    };
    vec![
        c("persistent_send_read_repeatedly", persistent_send),
        c("persistent_send_with_read_notifications", persistent_notify),
        c("persistent_receive_overwritten_in_place", persistent_recv),
        c("offsets_into_persistent_memory", offsets),
        c("shutdown_write_then_end_of_stream", shutdown),
        c("abortive_close_resets_the_peer", abort),
        c("poll_readiness", poll),
        c("sendfile_range", sendfile),
        c("stream_sendfile_in_bounded_chunks", sendfile_chunks),
        c(
            "a_close_during_a_stream_sendfile_delivers_the_whole_file",
            close_during_sendfile,
        ),
        c(
            "a_write_shutdown_during_a_stream_sendfile_ends_the_stream_after_the_file",
            shutdown_during_sendfile,
        ),
        c(
            "a_stream_sendfile_cut_short_after_a_close_resets_the_peer",
            sendfile_cut_short_after_close,
        ),
        c(
            "sends_made_during_a_stream_sendfile_go_after_the_whole_file",
            sends_during_sendfile,
        ),
        c(
            "a_stream_sendfile_cut_short_with_a_send_waiting_resets_the_peer",
            sendfile_cut_short_with_a_send_waiting,
        ),
        c(
            "a_send_waiting_behind_a_sendfile_fails_when_the_connection_goes_down",
            send_waiting_when_the_connection_goes_down,
        ),
        c(
            "dropping_a_socket_whose_sendfile_stalls_closes_it_within_the_linger_time",
            drop_during_stalled_sendfile,
        ),
        c(
            "a_stream_sendfile_that_gives_up_part_way_resets_the_peer_whatever_follows",
            sendfile_gives_up_then_send,
        ),
        c(
            "a_stream_sendfile_past_the_end_of_its_file_is_refused_and_sends_nothing",
            stream_sendfile_past_the_end,
        ),
    ]
}

fn persistent_send(b: &dyn Backend) -> Result<(), String> {
    let net = b.net();
    let p = pair(&*net, SockType::SeqPacket, exs::SocketOptions::default())?;
    let src = p.region_a(pattern(64 << 10, 1))?;
    p.client
        .send(&p.eq_a, &src.all(), MsgFlags::PERSISTENT, 1)
        .map_err(e)?;
    let dst = p.region_b(64 << 10)?;
    for round in 1..8u64 {
        if round > 1 {
            src.write(0, &pattern(64 << 10, round)).map_err(e)?;
        }
        p.server
            .recv(&p.eq_b, &dst.all(), MsgFlags::NONE, round)
            .map_err(e)?;
        let r = next(&p.eq_b)?;
        ensure!(r.is_ok() && r.bytes == 64 << 10, "read {round}: {r:?}");
        same(
            &dst.to_vec().map_err(e)?,
            &pattern(64 << 10, round),
            "persistent memory as read",
        )?;
    }
    ensure!(p.eq_a.is_empty(), "the persistent send completed per read");
    p.client.end_persistent().map_err(e)?;
    let s = next(&p.eq_a)?;
    ensure!(
        s.kind == EventKind::Send && s.is_ok(),
        "end of the persistent send: {s:?}"
    );
    Ok(())
}

fn persistent_notify(b: &dyn Backend) -> Result<(), String> {
    let net = b.net();
    let p = pair(&*net, SockType::SeqPacket, exs::SocketOptions::default())?;
    let src = p.region_a(pattern(4096, 2))?;
    p.client
        .send(
            &p.eq_a,
            &src.all(),
            MsgFlags::PERSISTENT | MsgFlags::NOTIFY,
            5,
        )
        .map_err(e)?;
    let dst = p.region_b(4096)?;
    for i in 0..4 {
        p.server
            .recv(&p.eq_b, &dst.all(), MsgFlags::NONE, i)
            .map_err(e)?;
        ensure!(next(&p.eq_b)?.is_ok(), "read {i}");
        let n = next(&p.eq_a)?;
        ensure!(
            n.kind == EventKind::ReadNotify && n.context == 5 && n.bytes == 1,
            "notification {i}: {n:?}"
        );
    }
    Ok(())
}

fn persistent_recv(b: &dyn Backend) -> Result<(), String> {
    let net = b.net();
    let p = pair(&*net, SockType::SeqPacket, exs::SocketOptions::default())?;
    let dst = p.region_b(32 << 10)?;
    p.server
        .recv(&p.eq_b, &dst.all(), MsgFlags::PERSISTENT, 1)
        .map_err(e)?;
    // The client learns of the persistent receive asynchronously: its sends become writes once it has.
    let probe = p.region_a(vec![0; 1])?;
    let deadline = std::time::Instant::now() + WAIT;
    loop {
        match p
            .client
            .send_offset(&p.eq_a, &probe.all(), 0, MsgFlags::NONE, 0)
        {
            Ok(()) => break,
            Err(SendError::State(StateError::Persistent(_))) => {
                ensure!(
                    std::time::Instant::now() < deadline,
                    "the persistent receive never arrived"
                );
                std::thread::sleep(Duration::from_millis(1));
            }
            Err(x) => return Err(x.to_string()),
        }
    }
    ensure!(next(&p.eq_a)?.is_ok(), "probe write");
    for round in 0..4u64 {
        let data = pattern(32 << 10, 10 + round);
        let src = p.region_a(data.clone())?;
        p.client
            .send(&p.eq_a, &src.all(), MsgFlags::NONE, round)
            .map_err(e)?;
        let s = next(&p.eq_a)?;
        ensure!(
            s.is_ok() && s.bytes == 32 << 10,
            "send {round} into the persistent receive: {s:?}"
        );
        same(
            &dst.to_vec().map_err(e)?,
            &data,
            "persistent receive after a send",
        )?;
    }
    ensure!(
        p.eq_b.is_empty(),
        "the persistent receive completed per send"
    );
    p.server.end_persistent().map_err(e)?;
    let r = next(&p.eq_b)?;
    ensure!(
        r.kind == EventKind::Recv && r.is_ok(),
        "end of the persistent receive: {r:?}"
    );
    Ok(())
}

fn offsets(b: &dyn Backend) -> Result<(), String> {
    let net = b.net();
    let p = pair(&*net, SockType::SeqPacket, exs::SocketOptions::default())?;
    let src = p.region_a(pattern(1 << 20, 3))?;
    p.client
        .send(&p.eq_a, &src.all(), MsgFlags::PERSISTENT, 1)
        .map_err(e)?;
    let first = p.region_b(16)?;
    p.server
        .recv(&p.eq_b, &first.all(), MsgFlags::NONE, 1)
        .map_err(e)?;
    ensure!(next(&p.eq_b)?.is_ok(), "first read");
    let part = p.region_b(4096)?;
    for off in [0u64, 12_345, (1 << 20) - 4096] {
        p.server
            .recv_offset(&p.eq_b, &part.all(), off, MsgFlags::NONE, off)
            .map_err(e)?;
        let r = next(&p.eq_b)?;
        ensure!(r.is_ok() && r.bytes == 4096, "recv_offset {off}: {r:?}");
        let o = off as usize;
        same(
            &part.to_vec().map_err(e)?,
            &pattern(1 << 20, 3)[o..o + 4096],
            "subpart",
        )?;
    }
    let bad = p
        .server
        .recv_offset(&p.eq_b, &part.all(), (1 << 20) - 100, MsgFlags::NONE, 9);
    ensure!(
        matches!(
            bad,
            Err(exs::RecvError::State(StateError::OffsetOutOfRange { .. }))
        ),
        "out of range: {bad:?}"
    );
    Ok(())
}

fn shutdown(b: &dyn Backend) -> Result<(), String> {
    for ty in [SockType::SeqPacket, SockType::Stream] {
        let net = b.net();
        let p = pair(&*net, ty, exs::SocketOptions::default())?;
        let data = pattern(300_000, 4);
        let src = p.region_a(data.clone())?;
        p.client
            .send(&p.eq_a, &src.all(), MsgFlags::NONE, 1)
            .map_err(e)?;
        p.client.shutdown(&p.eq_a, 2).map_err(e)?;
        let dst = p.region_b(300_000)?;
        p.server
            .recv(&p.eq_b, &dst.all(), MsgFlags::WAITALL, 1)
            .map_err(e)?;
        let r = next(&p.eq_b)?;
        ensure!(
            r.is_ok() && r.bytes == 300_000,
            "{ty:?}: data before the shutdown: {r:?}"
        );
        same(&dst.to_vec().map_err(e)?, &data, "data before the shutdown")?;
        p.server
            .recv(&p.eq_b, &dst.all(), MsgFlags::NONE, 2)
            .map_err(e)?;
        let r = next(&p.eq_b)?;
        ensure!(
            r.is_ok() && r.flags.eof,
            "{ty:?}: end-of-stream after the shutdown: {r:?}"
        );
        let evs = all(&p.eq_a)?;
        ensure!(
            evs.len() == 2 && evs.iter().all(|x| x.is_ok()) && evs[1].kind == EventKind::Shutdown,
            "{ty:?}: {evs:?}"
        );
        // The other direction still works.
        let back = p.region_b(1000)?;
        let got = p.region_a(vec![0; 1000])?;
        p.client
            .recv(&p.eq_a, &got.all(), MsgFlags::WAITALL, 3)
            .map_err(e)?;
        p.server
            .send(&p.eq_b, &back.all(), MsgFlags::NONE, 4)
            .map_err(e)?;
        let r = next(&p.eq_a)?;
        ensure!(
            r.is_ok() && r.bytes == 1000,
            "{ty:?}: reply after the half close: {r:?}"
        );
    }
    Ok(())
}

fn abort(b: &dyn Backend) -> Result<(), String> {
    let net = b.net();
    let p = pair(&*net, SockType::SeqPacket, exs::SocketOptions::default())?;
    let dst = p.region_b(100)?;
    p.server
        .recv(&p.eq_b, &dst.all(), MsgFlags::NONE, 1)
        .map_err(e)?;
    let mine = p.region_a(vec![0; 100])?;
    p.client
        .recv(&p.eq_a, &mine.all(), MsgFlags::NONE, 2)
        .map_err(e)?;
    p.client.abort().map_err(e)?;
    let a = next(&p.eq_a)?;
    ensure!(
        a.status == Err(OpError::Cancelled),
        "our pending receive after abort: {a:?}"
    );
    let r = next(&p.eq_b)?;
    ensure!(
        r.status.is_err() && !r.flags.eof,
        "the peer's pending receive after our abort: {r:?}"
    );
    Ok(())
}

fn poll(b: &dyn Backend) -> Result<(), String> {
    let net = b.net();
    let p = pair(&*net, SockType::Stream, exs::SocketOptions::default())?;
    let eq = EventQueue::new(8).unwrap();
    p.client
        .poll(
            &eq,
            Readiness {
                writable: true,
                ..Readiness::default()
            },
            1,
        )
        .map_err(e)?;
    let w = next(&eq)?;
    ensure!(
        w.kind == EventKind::Poll && w.readiness.writable,
        "writable: {w:?}"
    );
    p.server
        .poll(
            &eq,
            Readiness {
                readable: true,
                ..Readiness::default()
            },
            2,
        )
        .map_err(e)?;
    std::thread::sleep(Duration::from_millis(20));
    ensure!(eq.is_empty(), "readable before any data");
    let src = p.region_a(vec![7; 64])?;
    p.client
        .send(&p.eq_a, &src.all(), MsgFlags::NONE, 3)
        .map_err(e)?;
    let r = next(&eq)?;
    ensure!(
        r.context == 2 && r.readiness.readable,
        "readable after data: {r:?}"
    );
    p.server
        .poll(
            &eq,
            Readiness {
                readable: false,
                ..Readiness::default()
            },
            4,
        )
        .map_err(e)?;
    p.client.close().map_err(e)?;
    let h = next(&eq)?;
    ensure!(
        h.context == 4 && h.readiness.hangup,
        "hang-up after the peer closed: {h:?}"
    );
    Ok(())
}

fn sendfile(b: &dyn Backend) -> Result<(), String> {
    let data = pattern(1 << 20, 6);
    let mut f = tempfile::tempfile().map_err(e)?;
    f.write_all(&data).map_err(e)?;
    let net = b.net();
    let p = pair(&*net, SockType::Stream, exs::SocketOptions::default())?;
    p.client
        .sendfile(&p.eq_a, &f, 4096, 900_000, 7)
        .map_err(e)?;
    let dst = p.region_b(900_000)?;
    p.server
        .recv(&p.eq_b, &dst.all(), MsgFlags::WAITALL, 1)
        .map_err(e)?;
    let s = next(&p.eq_a)?;
    ensure!(
        s.kind == EventKind::SendFile && s.is_ok() && s.bytes == 900_000,
        "{s:?}"
    );
    let r = next(&p.eq_b)?;
    ensure!(r.is_ok() && r.bytes == 900_000, "{r:?}");
    same(
        &dst.to_vec().map_err(e)?,
        &data[4096..904_096],
        "file range",
    )
}

/// Issue 15: a stream sendfile larger than its buffers (`exs::SENDFILE_CHUNK * SENDFILE_DEPTH`) goes in chunks: the call
/// returns at once (the receiver below runs on the same thread), every byte arrives in order, and one `SendFile`
/// event reports the total.
fn sendfile_chunks(b: &dyn Backend) -> Result<(), String> {
    let len = exs::SENDFILE_CHUNK * (exs::SENDFILE_DEPTH + 2) + 12_345;
    let data = pattern(len + 100, 8);
    let mut f = tempfile::tempfile().map_err(e)?;
    f.write_all(&data).map_err(e)?;
    let net = b.net();
    let p = pair(&*net, SockType::Stream, exs::SocketOptions::default())?;
    p.client.sendfile(&p.eq_a, &f, 100, len, 9).map_err(e)?;
    let got = {
        let buf = p.region_b(1 << 20)?;
        let mut got = Vec::with_capacity(len);
        while got.len() < len {
            p.server
                .recv(&p.eq_b, &buf.all(), MsgFlags::NONE, 1)
                .map_err(e)?;
            let r = next(&p.eq_b)?;
            ensure!(r.is_ok() && r.bytes > 0, "{r:?}");
            let mut b = vec![0u8; r.bytes];
            buf.read(0, &mut b).map_err(e)?;
            got.extend_from_slice(&b);
        }
        got
    };
    same(&got, &data[100..100 + len], "file sent in chunks")?;
    let s = next(&p.eq_a)?;
    ensure!(
        s.kind == EventKind::SendFile && s.is_ok() && s.bytes == len && s.context == 9,
        "one SendFile event with the total: {s:?}"
    );
    ensure!(
        p.eq_a.is_empty(),
        "no event of the chunks reaches the user's queue"
    );
    Ok(())
}

/// Issue 26 (a graceful close delivers every send already started): a stream sendfile longer than its buffers still
/// has chunks to read when the application closes the socket right after starting it. The peer gets the whole
/// file, then a clean end of stream, and the sendfile completes with every byte; before, the close's end of stream
/// followed the chunks already posted, so the peer saw a clean end after part of the file.
fn close_during_sendfile(b: &dyn Backend) -> Result<(), String> {
    sendfile_then_end(b, false)
}

/// The same for a write shutdown: its end of stream comes after the whole file, and the shutdown completes after
/// it; the other direction still works.
fn shutdown_during_sendfile(b: &dyn Backend) -> Result<(), String> {
    sendfile_then_end(b, true)
}

fn sendfile_then_end(b: &dyn Backend, shutdown: bool) -> Result<(), String> {
    let len = exs::SENDFILE_CHUNK * (exs::SENDFILE_DEPTH + 1) + 777;
    let data = pattern(len, 10);
    let mut f = tempfile::tempfile().map_err(e)?;
    f.write_all(&data).map_err(e)?;
    let net = b.net();
    let p = pair(&*net, SockType::Stream, exs::SocketOptions::default())?;
    p.client.sendfile(&p.eq_a, &f, 0, len, 5).map_err(e)?;
    if shutdown {
        p.client.shutdown(&p.eq_a, 6).map_err(e)?;
    } else {
        p.client.close().map_err(e)?;
    }
    let buf = p.region_b(1 << 20)?;
    let mut got = Vec::with_capacity(len);
    loop {
        p.server
            .recv(&p.eq_b, &buf.all(), MsgFlags::NONE, 1)
            .map_err(e)?;
        let r = next(&p.eq_b)?;
        ensure!(r.is_ok(), "after {} bytes: {r:?}", got.len());
        if r.flags.eof || r.bytes == 0 {
            break;
        }
        let mut b = vec![0u8; r.bytes];
        buf.read(0, &mut b).map_err(e)?;
        got.extend_from_slice(&b);
        ensure!(got.len() <= len, "more than the file: {} bytes", got.len());
    }
    ensure!(
        got.len() == len,
        "end of stream after {} of the file's {len} bytes",
        got.len()
    );
    same(&got, &data, "the file, before the end of stream")?;
    let evs = all(&p.eq_a)?;
    let file = evs.iter().find(|x| x.kind == EventKind::SendFile);
    ensure!(
        file.is_some_and(|s| s.is_ok() && s.bytes == len),
        "the sendfile completes with every byte: {evs:?}"
    );
    if shutdown {
        ensure!(
            evs.iter()
                .any(|x| x.kind == EventKind::Shutdown && x.is_ok()),
            "the shutdown completes: {evs:?}"
        );
        let back = p.region_b(1000)?;
        let into = p.region_a(vec![0; 1000])?;
        p.client
            .recv(&p.eq_a, &into.all(), MsgFlags::WAITALL, 7)
            .map_err(e)?;
        p.server
            .send(&p.eq_b, &back.all(), MsgFlags::NONE, 8)
            .map_err(e)?;
        let r = next(&p.eq_a)?;
        ensure!(
            r.is_ok() && r.bytes == 1000,
            "reply after the half close: {r:?}"
        );
    }
    Ok(())
}

/// A close waits for a stream sendfile to post its whole file; if the sendfile then gives up part way (here the file
/// shrinks under it, so a chunk cannot be read), the close's clean end of stream would tell the peer it had the
/// whole file: the connection is reset instead, and the peer's read fails.
fn sendfile_cut_short_after_close(b: &dyn Backend) -> Result<(), String> {
    sendfile_cut_short(b, false)
}

/// The same with a send made after the sendfile waiting instead of a close: that send's bytes would follow part of
/// the file, and the peer could not tell. The connection is reset instead; the sendfile and the send fail. Before,
/// the peer read the file's first chunks and then the send's bytes, and the send completed.
fn sendfile_cut_short_with_a_send_waiting(b: &dyn Backend) -> Result<(), String> {
    sendfile_cut_short(b, true)
}

/// A stream sendfile, then a send (`send_after`) or a close, then the file shrinks: the peer reads part of the file
/// and then an error (or a read refused, the connection being down), never a clean end or the send's bytes.
fn sendfile_cut_short(b: &dyn Backend, send_after: bool) -> Result<(), String> {
    let len = exs::SENDFILE_CHUNK * (exs::SENDFILE_DEPTH + 3);
    let data = pattern(len, 11);
    let mut f = tempfile::tempfile().map_err(e)?;
    f.write_all(&data).map_err(e)?;
    let net = b.net();
    let p = pair(&*net, SockType::Stream, exs::SocketOptions::default())?;
    p.client.sendfile(&p.eq_a, &f, 0, len, 5).map_err(e)?;
    let tail = p.region_a(pattern(3000, 17))?;
    if send_after {
        p.client
            .send(&p.eq_a, &tail.all(), MsgFlags::NONE, 6)
            .map_err(e)?;
    } else {
        p.client.close().map_err(e)?;
    }
    // The chunks read so far are those the call posted (the peer has taken nothing yet).
    f.set_len((exs::SENDFILE_CHUNK * exs::SENDFILE_DEPTH + 10) as u64)
        .map_err(e)?;
    let buf = p.region_b(1 << 20)?;
    read_until_reset(&p.server, &p.eq_b, &buf, &data)?;
    let evs = all(&p.eq_a)?;
    let failed = |ctx, kind| {
        evs.iter()
            .any(|x| x.context == ctx && x.kind == kind && !x.is_ok() && x.bytes < len)
    };
    ensure!(
        failed(5, EventKind::SendFile) && (!send_after || failed(6, EventKind::Send)),
        "the sendfile (and the send after it) report that it gave up: {evs:?}"
    );
    Ok(())
}

/// Sends made on a stream socket while a sendfile runs (the application's, and a second sendfile) go after the whole
/// file, in the order they were made: here a file longer than the sendfile's buffers, a send, a second file, a send.
/// Before, the chunks a sendfile posted as earlier ones completed went after the sends made meanwhile, and the two
/// files' chunks between each other's.
fn sends_during_sendfile(b: &dyn Backend) -> Result<(), String> {
    let lens = [
        exs::SENDFILE_CHUNK * (exs::SENDFILE_DEPTH + 1) + 777,
        exs::SENDFILE_CHUNK * 2 + 99,
    ];
    let files = [pattern(lens[0], 12), pattern(lens[1], 13)];
    let tails = [pattern(3000, 14), pattern(5000, 15)];
    let net = b.net();
    let p = pair(&*net, SockType::Stream, exs::SocketOptions::default())?;
    let mut want = Vec::new();
    for i in 0..2 {
        let mut f = tempfile::tempfile().map_err(e)?;
        f.write_all(&files[i]).map_err(e)?;
        let tail = p.region_a(tails[i].clone())?;
        let ctx = 2 * i as u64;
        p.client.sendfile(&p.eq_a, &f, 0, lens[i], ctx).map_err(e)?;
        p.client
            .send(&p.eq_a, &tail.all(), MsgFlags::NONE, ctx + 1)
            .map_err(e)?;
        want.extend_from_slice(&files[i]);
        want.extend_from_slice(&tails[i]);
    }
    let got = read_stream(&p, want.len(), 1 << 20, MsgFlags::NONE)?;
    same(
        &got,
        &want,
        "the files and the sends, in the order they were made",
    )?;
    let mut evs = all(&p.eq_a)?;
    evs.sort_by_key(|x| x.context);
    let done: Vec<_> = evs
        .iter()
        .map(|x| (x.context, x.kind, x.is_ok(), x.bytes))
        .collect();
    ensure!(
        done == [
            (0, EventKind::SendFile, true, lens[0]),
            (1, EventKind::Send, true, tails[0].len()),
            (2, EventKind::SendFile, true, lens[1]),
            (3, EventKind::Send, true, tails[1].len()),
        ],
        "every send and sendfile completes whole: {evs:?}"
    );
    Ok(())
}

/// A send waits behind a stream sendfile when the connection goes down under both (the peer shuts its writing
/// down, so the stream stays readable, then resets it): the send's event comes, failed, without the application
/// closing the socket. Before, the sendfile's end started the waiting send on the connection that was gone, and its
/// event never came.
fn send_waiting_when_the_connection_goes_down(b: &dyn Backend) -> Result<(), String> {
    let len = exs::SENDFILE_CHUNK * 40;
    let mut f = tempfile::tempfile().map_err(e)?;
    f.write_all(&pattern(len, 18)).map_err(e)?;
    let net = b.net();
    let p = pair(&*net, SockType::Stream, exs::SocketOptions::default())?;
    p.client.sendfile(&p.eq_a, &f, 0, len, 5).map_err(e)?;
    let tail = p.region_a(pattern(3000, 19))?;
    p.client
        .send(&p.eq_a, &tail.all(), MsgFlags::NONE, 6)
        .map_err(e)?;
    p.server.shutdown(&p.eq_b, 1).map_err(e)?;
    let eq = EventQueue::new(4).map_err(e)?;
    let readable = Readiness {
        readable: true,
        ..Readiness::default()
    };
    p.client.poll(&eq, readable, 7).map_err(e)?;
    next(&eq)?;
    p.server.abort().map_err(e)?;
    let evs = [next(&p.eq_a)?, next(&p.eq_a)?];
    ensure!(
        evs.iter().any(|x| x.context == 5 && !x.is_ok())
            && evs.iter().any(|x| x.context == 6 && !x.is_ok()),
        "the sendfile and the send waiting behind it fail: {evs:?}"
    );
    Ok(())
}

/// The application drops its last handle of a stream socket whose sendfile cannot finish (the peer takes nothing):
/// the socket closes as `close` does, so within the linger time the sendfile fails and the peer sees the connection
/// reset, never a clean end. Before, the sendfile's own handle kept the socket, and its connection, open for as long
/// as the peer did not read.
fn drop_during_stalled_sendfile(b: &dyn Backend) -> Result<(), String> {
    let len = exs::SENDFILE_CHUNK * 64;
    let f = tempfile::tempfile().map_err(e)?;
    f.set_len(len as u64).map_err(e)?;
    let net = b.net();
    let mut opts = exs::ContextOptions::default();
    opts.linger = Duration::from_millis(300);
    let (server, client) = (net.host(), net.host_with(opts));
    let p = exs::testing::PairSpec {
        depth: 64,
        patience: WAIT,
        ..exs::testing::PairSpec::new(SockType::Stream)
    }
    .connect(&client, &server, net.listen_addr(0))?;
    p.client.sendfile(&p.eq_a, &f, 0, len, 5).map_err(e)?;
    let exs::testing::Pair {
        client: sock,
        server: peer,
        eq_a,
        eq_b,
        ..
    } = p;
    drop(sock);
    let ev = next(&eq_a)?;
    ensure!(
        ev.kind == EventKind::SendFile && !ev.is_ok() && ev.bytes < len,
        "the sendfile fails part way: {ev:?}"
    );
    let buf = exs::MemoryRegion::alloc(&server, 1 << 20).map_err(e)?;
    read_until_reset(&peer, &eq_b, &buf, &vec![0; len])?;
    Ok(())
}

/// A stream sendfile that gives up part way while nothing waits behind it yet: here a second sendfile whose file
/// shrinks after the call (a chunk it reads later is past the new end) queued behind a first, then a send the
/// application makes before it could know. Whatever followed part of the second file would tell the peer it had
/// the whole, so the connection is reset at once: the peer reads part of the two files, then an error, never the
/// send's bytes or a clean end. Before, the give-up reset only when a close or a send already waited, and this send
/// went out after the first chunk of the second file.
fn sendfile_gives_up_then_send(b: &dyn Backend) -> Result<(), String> {
    let lens = [
        exs::SENDFILE_CHUNK * (exs::SENDFILE_DEPTH + 1),
        exs::SENDFILE_CHUNK * (exs::SENDFILE_DEPTH + 2) + 10,
    ];
    let files = [pattern(lens[0], 20), pattern(lens[1], 21)];
    let net = b.net();
    let p = pair(&*net, SockType::Stream, exs::SocketOptions::default())?;
    let mut handles = Vec::new();
    for (i, data) in files.iter().enumerate() {
        let mut f = tempfile::tempfile().map_err(e)?;
        f.write_all(data).map_err(e)?;
        p.client
            .sendfile(&p.eq_a, &f, 0, lens[i], i as u64)
            .map_err(e)?;
        handles.push(f);
    }
    // The second file loses its last two chunks before they are read (it waits behind the first file).
    handles[1]
        .set_len((exs::SENDFILE_CHUNK * exs::SENDFILE_DEPTH + 10) as u64)
        .map_err(e)?;
    let tail = p.region_a(pattern(3000, 22))?;
    let sent = p
        .client
        .send(&p.eq_a, &tail.all(), MsgFlags::NONE, 2)
        .is_ok();
    let both = [files[0].as_slice(), files[1].as_slice()].concat();
    let buf = p.region_b(1 << 20)?;
    read_until_reset(&p.server, &p.eq_b, &buf, &both)?;
    let evs = all(&p.eq_a)?;
    ensure!(
        evs.iter().any(|x| x.context == 1
            && x.kind == EventKind::SendFile
            && matches!(x.status, Err(exs::OpError::File(_)))),
        "the second sendfile reports that it gave up, with the read's error: {evs:?}"
    );
    ensure!(
        !sent || evs.iter().any(|x| x.context == 2 && !x.is_ok()),
        "the send after it fails: {evs:?}"
    );
    Ok(())
}

/// Review: a SOCK_STREAM sendfile read its range as it went, so a range past the end of a file was found only at
/// the chunk past the end: for a file of more than a chunk the call succeeded and the connection was reset once part
/// of the file had gone; within the first chunks the call failed. Now it is refused at the call, as on
/// SOCK_SEQPACKET, whatever the file's size, and nothing of it goes: the connection carries on.
fn stream_sendfile_past_the_end(b: &dyn Backend) -> Result<(), String> {
    let net = b.net();
    let p = pair(&*net, SockType::Stream, exs::SocketOptions::default())?;
    for (len, count) in [
        (100_000, 200_000),
        (3 * exs::SENDFILE_CHUNK, 4 * exs::SENDFILE_CHUNK),
    ] {
        let mut f = tempfile::tempfile().map_err(e)?;
        f.write_all(&pattern(len, 23)).map_err(e)?;
        match p.client.sendfile(&p.eq_a, &f, 0, count, 5) {
            Err(exs::SendError::File(fe)) if fe.kind == std::io::ErrorKind::UnexpectedEof => {}
            other => return Err(format!("{count} bytes of a {len}-byte file: {other:?}")),
        }
    }
    let tail = pattern(3000, 24);
    let r = p.region_a(tail.clone())?;
    p.client
        .send(&p.eq_a, &r.all(), MsgFlags::NONE, 6)
        .map_err(e)?;
    let got = read_stream(&p, tail.len(), 1 << 20, MsgFlags::NONE)?;
    same(&got, &tail, "the send after the refused sendfiles, alone")?;
    let ev = next(&p.eq_a)?;
    ensure!(
        ev.context == 6 && ev.is_ok(),
        "the only event is the send's: {ev:?}"
    );
    Ok(())
}

/// Reads on `peer` until the connection is reset: a read that fails, or one refused because the connection is down.
/// What it reads must be the start of `sent` and not the whole of it, and no read may see a clean end of stream.
/// Returns the bytes read.
fn read_until_reset(
    peer: &exs::Socket,
    eq: &EventQueue,
    buf: &exs::MemoryRegion,
    sent: &[u8],
) -> Result<usize, String> {
    let mut got = Vec::new();
    loop {
        if let Err(err) = peer.recv(eq, &buf.all(), MsgFlags::NONE, 1) {
            ensure!(
                matches!(err, exs::RecvError::State(StateError::ConnectionDown(_))),
                "a read after {} bytes refused for another reason: {err}",
                got.len()
            );
            return Ok(got.len());
        }
        let r = next(eq)?;
        if !r.is_ok() {
            return Ok(got.len());
        }
        ensure!(
            !r.flags.eof && r.bytes > 0,
            "the peer saw a clean end of stream after {} of {} bytes: {r:?}",
            got.len(),
            sent.len()
        );
        let mut b = vec![0u8; r.bytes];
        buf.read(0, &mut b).map_err(e)?;
        got.extend_from_slice(&b);
        ensure!(
            got.len() < sent.len(),
            "{} bytes read: all that was sent, or more",
            got.len()
        );
        same(
            &got,
            &sent[..got.len()],
            "the start of what was sent, nothing after it",
        )?;
    }
}

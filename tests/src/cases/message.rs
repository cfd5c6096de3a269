//! Message mode (SOCK_SEQPACKET) end to end.

use exs::{EventKind, MemoryRegion, MsgFlags, OpError, SockType, Socket, SocketOptions};

use crate::util::*;
use crate::{ensure, Backend, Case, Requires};

pub fn cases() -> Vec<Case> {
    let c = |name, run| Case {
        name,
        run,
        requires: Requires::Nothing,
    };
    vec![
        c("seqpacket_connect_and_accept", connect_and_accept),
        c("seqpacket_sizes_1b_to_16mib", sizes),
        c("seqpacket_zero_length_message", zero_length),
        c("seqpacket_immediate_data_boundary", immediate_boundary),
        c("seqpacket_credits_under_pressure", credits_under_pressure),
        c(
            "seqpacket_immediate_credits_under_pressure",
            immediate_credits_under_pressure,
        ),
        c("seqpacket_64_outstanding_each_way", many_outstanding),
        c("seqpacket_truncation", truncation),
        c("seqpacket_both_directions", both_directions),
        c(
            "seqpacket_close_is_graceful_with_pending_operations",
            close_with_pending,
        ),
        c(
            "seqpacket_abort_with_pending_operations",
            abort_with_pending,
        ),
        c(
            "a_close_from_both_sides_with_sends_pending_ends_them_at_once",
            both_close,
        ),
        c("connect_refused", refused),
    ]
}

fn connect_and_accept(b: &dyn Backend) -> Result<(), String> {
    let net = b.net();
    let p = pair(&*net, SockType::SeqPacket, exs::SocketOptions::default())?;
    let c_local = p
        .client
        .local_addr()
        .map_err(|e| e.to_string())?
        .ok_or("client has no local address")?;
    let c_peer = p
        .client
        .peer_addr()
        .map_err(|e| e.to_string())?
        .ok_or("client has no peer address")?;
    let s_peer = p
        .server
        .peer_addr()
        .map_err(|e| e.to_string())?
        .ok_or("server has no peer address")?;
    let l_addr = p
        .listener
        .local_addr()
        .map_err(|e| e.to_string())?
        .ok_or("listener has no address")?;
    ensure!(
        c_peer == l_addr,
        "client's peer {c_peer} is not the listener {l_addr}"
    );
    ensure!(
        s_peer == c_local,
        "server's peer {s_peer} is not the client {c_local}"
    );
    Ok(())
}

fn one(p: &Pair, len: usize, cap: usize, seed: u64) -> Result<(), String> {
    let data = pattern(len.max(1), seed);
    let src = p.region_a(data.clone())?;
    let dst = p.region_b(cap)?;
    p.server
        .recv(&p.eq_b, &dst.slice(..cap), MsgFlags::NONE, seed)
        .map_err(|e| e.to_string())?;
    p.client
        .send(&p.eq_a, &src.slice(..len), MsgFlags::NONE, seed)
        .map_err(|e| e.to_string())?;
    let r = next(&p.eq_b)?;
    let s = next(&p.eq_a)?;
    ensure!(
        s.kind == EventKind::Send && s.is_ok() && s.bytes == len,
        "send of {len}: {s:?}"
    );
    ensure!(
        r.kind == EventKind::Recv && r.is_ok(),
        "recv of {len}: {r:?}"
    );
    let n = len.min(cap);
    ensure!(
        r.bytes == n && r.flags.truncated == (len > cap),
        "recv of {len} into {cap}: {r:?}"
    );
    let got = dst.to_vec().map_err(|e| e.to_string())?;
    same(&got[..n], &data[..n], &format!("{len}-byte message"))
}

fn sizes(b: &dyn Backend) -> Result<(), String> {
    let net = b.net();
    let p = pair(&*net, SockType::SeqPacket, exs::SocketOptions::default())?;
    for (i, len) in [1usize, 100, 4096, 65_536, 1 << 20, 16 << 20]
        .into_iter()
        .enumerate()
    {
        one(&p, len, len, i as u64)?;
    }
    Ok(())
}

fn zero_length(b: &dyn Backend) -> Result<(), String> {
    let net = b.net();
    let p = pair(&*net, SockType::SeqPacket, exs::SocketOptions::default())?;
    one(&p, 0, 10, 1)
}

fn immediate_boundary(b: &dyn Backend) -> Result<(), String> {
    let net = b.net();
    let p = pair(
        &*net,
        SockType::SeqPacket,
        SocketOptions::default().with_small_packet_max_size(256),
    )?;
    for (i, len) in [255usize, 256, 257].into_iter().enumerate() {
        one(&p, len, 1024, 10 + i as u64)?;
    }
    let st = p.client.stats().ok_or("no stats")?;
    ensure!(
        st.message.immediate_sent == 2,
        "immediate sends: {} (expected 2)",
        st.message.immediate_sent
    );
    Ok(())
}

/// Seed 002, 3.2, with two credits and fifty sends before any receive: the sender advertises two, queues the
/// rest, and recovers in order as acknowledgments return credits (the protocol tests' credit case, on every
/// backend).
fn credits_under_pressure(b: &dyn Backend) -> Result<(), String> {
    credits_pressed(b, 0)
}

/// Immediate sends complete once their message has left (seed 002, 4.1: the data travels in the advert), yet
/// credits still bound how many leave before the receiver takes them: at most `SendCredits` complete early.
fn immediate_credits_under_pressure(b: &dyn Backend) -> Result<(), String> {
    credits_pressed(b, 4096)
}

fn credits_pressed(b: &dyn Backend, small: u32) -> Result<(), String> {
    let net = b.net();
    let opts = SocketOptions::default()
        .with_send_credits(2)
        .with_recv_credits(2)
        .with_control_window(4)
        .with_small_packet_max_size(small);
    let p = pair(&*net, SockType::SeqPacket, opts)?;
    let n = 50;
    let src = p.region_a(pattern(n * 3000, 3))?;
    for i in 0..n {
        p.client
            .send(
                &p.eq_a,
                &src.slice(i * 3000..(i + 1) * 3000),
                MsgFlags::NONE,
                i as u64,
            )
            .map_err(|e| e.to_string())?;
    }
    // Seed 002, 3.2: no advertisement without a credit; the rest queue (never dropped) until acknowledgments
    // return credits.
    let st = p.client.stats().ok_or("no connection counters")?.message;
    ensure!(
        st.adverts_sent == 2 && st.credit_waits > 0,
        "two credits: two adverts, the rest waiting ({st:?})"
    );
    std::thread::sleep(std::time::Duration::from_millis(50));
    let early = p.eq_a.len();
    if small == 0 {
        ensure!(early == 0, "sends completed before any receive was posted");
    } else {
        ensure!(
            early <= 2,
            "{early} immediate sends completed with 2 credits and no receive posted"
        );
    }
    let dst = p.region_b(n * 3000)?;
    for i in 0..n {
        p.server
            .recv(
                &p.eq_b,
                &dst.slice(i * 3000..(i + 1) * 3000),
                MsgFlags::NONE,
                i as u64,
            )
            .map_err(|e| e.to_string())?;
    }
    let r = all(&p.eq_b)?;
    let s = all(&p.eq_a)?;
    ensure!(
        r.iter().map(|e| e.context).eq(0..n as u64),
        "receives out of order"
    );
    ensure!(
        s.iter().map(|e| e.context).eq(0..n as u64),
        "sends out of order"
    );
    ensure!(
        r.iter().chain(&s).all(|e| e.is_ok() && e.bytes == 3000),
        "a transfer failed"
    );
    let adverts = p
        .client
        .stats()
        .ok_or("no connection counters")?
        .message
        .adverts_sent;
    ensure!(adverts == n as u64, "one advert per message: {adverts}");
    same_regions(&dst, &src, "50 messages")
}

fn many_outstanding(b: &dyn Backend) -> Result<(), String> {
    let net = b.net();
    let opts = SocketOptions::default()
        .with_send_credits(64)
        .with_recv_credits(64);
    let p = pair(&*net, SockType::SeqPacket, opts)?;
    let sz = 10_000;
    let a_out = p.region_a(pattern(64 * sz, 1))?;
    let b_out =
        exs::MemoryRegion::from_vec(&p.b, pattern(64 * sz, 2)).map_err(|e| e.to_string())?;
    let a_in = exs::MemoryRegion::alloc(&p.a, 64 * sz).map_err(|e| e.to_string())?;
    let b_in = p.region_b(64 * sz)?;
    for i in 0..64 {
        let r = i * sz..(i + 1) * sz;
        p.server
            .recv(&p.eq_b, &b_in.slice(r.clone()), MsgFlags::NONE, i as u64)
            .map_err(|e| e.to_string())?;
        p.client
            .recv(&p.eq_a, &a_in.slice(r.clone()), MsgFlags::NONE, i as u64)
            .map_err(|e| e.to_string())?;
    }
    for i in 0..64 {
        let r = i * sz..(i + 1) * sz;
        p.client
            .send(
                &p.eq_a,
                &a_out.slice(r.clone()),
                MsgFlags::NONE,
                100 + i as u64,
            )
            .map_err(|e| e.to_string())?;
        p.server
            .send(&p.eq_b, &b_out.slice(r), MsgFlags::NONE, 100 + i as u64)
            .map_err(|e| e.to_string())?;
    }
    let ea = all(&p.eq_a)?;
    let eb = all(&p.eq_b)?;
    for (side, evs) in [("client", &ea), ("server", &eb)] {
        // Which operations ended, and which did not within the wait (a failure said only "None" once).
        let ended = |kind: EventKind| {
            let mut c: Vec<u64> = evs
                .iter()
                .filter(|e| e.kind == kind)
                .map(|e| e.context)
                .collect();
            c.sort_unstable();
            c
        };
        ensure!(
            evs.len() == 128 && evs.iter().all(|e| e.is_ok()),
            "{side}: {} of 128 events; the first failure: {:?}; receives ended: {:?}; sends ended: {:?}",
            evs.len(),
            evs.iter().find(|e| !e.is_ok()),
            ended(EventKind::Recv),
            ended(EventKind::Send)
        );
        let recvs: Vec<u64> = evs
            .iter()
            .filter(|e| e.kind == EventKind::Recv)
            .map(|e| e.context)
            .collect();
        let sends: Vec<u64> = evs
            .iter()
            .filter(|e| e.kind == EventKind::Send)
            .map(|e| e.context)
            .collect();
        ensure!(
            recvs == (0..64).collect::<Vec<_>>(),
            "receives completed out of order"
        );
        ensure!(
            sends == (100..164).collect::<Vec<_>>(),
            "sends completed out of order"
        );
    }
    same_regions(&b_in, &a_out, "a to b")?;
    same_regions(&a_in, &b_out, "b to a")
}

fn truncation(b: &dyn Backend) -> Result<(), String> {
    let net = b.net();
    let p = pair(&*net, SockType::SeqPacket, exs::SocketOptions::default())?;
    one(&p, 10_000, 1000, 5)?;
    one(&p, 300, 100, 6)?;
    one(&p, 500, 500, 7)
}

fn both_directions(b: &dyn Backend) -> Result<(), String> {
    let net = b.net();
    let p = pair(&*net, SockType::SeqPacket, exs::SocketOptions::default())?;
    let sz = 100_000;
    let a_out = p.region_a(pattern(10 * sz, 1))?;
    let b_out =
        exs::MemoryRegion::from_vec(&p.b, pattern(10 * sz, 2)).map_err(|e| e.to_string())?;
    let a_in = exs::MemoryRegion::alloc(&p.a, 10 * sz).map_err(|e| e.to_string())?;
    let b_in = p.region_b(10 * sz)?;
    for i in 0..10 {
        let r = i * sz..(i + 1) * sz;
        p.server
            .recv(&p.eq_b, &b_in.slice(r.clone()), MsgFlags::NONE, i as u64)
            .map_err(|e| e.to_string())?;
        p.client
            .recv(&p.eq_a, &a_in.slice(r.clone()), MsgFlags::NONE, i as u64)
            .map_err(|e| e.to_string())?;
        p.client
            .send(&p.eq_a, &a_out.slice(r.clone()), MsgFlags::NONE, i as u64)
            .map_err(|e| e.to_string())?;
        p.server
            .send(&p.eq_b, &b_out.slice(r), MsgFlags::NONE, i as u64)
            .map_err(|e| e.to_string())?;
    }
    ensure!(
        all(&p.eq_a)?.iter().all(|e| e.is_ok()),
        "a transfer failed on a"
    );
    ensure!(
        all(&p.eq_b)?.iter().all(|e| e.is_ok()),
        "a transfer failed on b"
    );
    same_regions(&b_in, &a_out, "a to b")?;
    same_regions(&a_in, &b_out, "b to a")
}

/// Four receives and three 50,000-byte sends pending (their adverts reached the peer, which posts nothing yet).
fn pending_ops(p: &Pair) -> Result<(exs::MemoryRegion, exs::MemoryRegion), String> {
    let ins = exs::MemoryRegion::alloc(&p.a, 4 * 1000).map_err(|e| e.to_string())?;
    for i in 0..4 {
        p.client
            .recv(
                &p.eq_a,
                &ins.slice(i * 1000..(i + 1) * 1000),
                MsgFlags::NONE,
                i as u64,
            )
            .map_err(|e| e.to_string())?;
    }
    let outs = p.region_a(pattern(3 * 50_000, 1))?;
    for i in 0..3 {
        p.client
            .send(
                &p.eq_a,
                &outs.slice(i * 50_000..(i + 1) * 50_000),
                MsgFlags::NONE,
                10 + i as u64,
            )
            .map_err(|e| e.to_string())?;
    }
    // Let the adverts reach the peer (which posts no receive), so that close also has to retire exposed keys.
    std::thread::sleep(std::time::Duration::from_millis(20));
    ensure!(p.eq_a.is_empty(), "an operation completed before the close");
    Ok((ins, outs))
}

/// Issue 14: close is graceful, like TCP's: the receives are cancelled at once, the sends already posted are
/// delivered and complete `Ok` once the peer takes them, then the peer sees end-of-stream.
fn close_with_pending(b: &dyn Backend) -> Result<(), String> {
    let net = b.net();
    let p = pair(&*net, SockType::SeqPacket, exs::SocketOptions::default())?;
    let (ins, _outs) = pending_ops(&p)?;
    p.client.close().map_err(|e| e.to_string())?;
    let mut evs = Vec::new();
    for _ in 0..4 {
        evs.push(next(&p.eq_a)?);
    }
    ensure!(
        evs.iter()
            .all(|e| e.kind == EventKind::Recv && e.status == Err(OpError::Cancelled)),
        "the receives end first, cancelled: {evs:?}"
    );
    let peer_buf = p.region_b(3 * 50_000 + 100)?;
    for i in 0..3 {
        p.server
            .recv(
                &p.eq_b,
                &peer_buf.slice(i * 50_000..(i + 1) * 50_000),
                MsgFlags::NONE,
                i as u64,
            )
            .map_err(|e| e.to_string())?;
        let ev = next(&p.eq_b)?;
        ensure!(
            ev.is_ok() && ev.bytes == 50_000,
            "message {i} after the close: {ev:?}"
        );
    }
    let mut got = vec![0u8; 3 * 50_000];
    peer_buf.read(0, &mut got).map_err(|e| e.to_string())?;
    same(
        &got,
        &pattern(3 * 50_000, 1),
        "messages sent before the close",
    )?;
    let sends = all(&p.eq_a)?;
    ensure!(
        sends.len() == 3
            && sends
                .iter()
                .all(|e| e.kind == EventKind::Send && e.is_ok() && e.bytes == 50_000),
        "sends posted before a graceful close complete Ok: {sends:?}"
    );
    p.server
        .recv(
            &p.eq_b,
            &peer_buf.slice(3 * 50_000..3 * 50_000 + 100),
            MsgFlags::NONE,
            99,
        )
        .map_err(|e| e.to_string())?;
    let peer = next(&p.eq_b)?;
    ensure!(
        peer.is_ok() && peer.flags.eof && peer.bytes == 0,
        "peer receive after the messages: {peer:?}"
    );
    ensure!(
        ins.deregister().is_ok(),
        "receive buffers still leased after close"
    );
    Ok(())
}

/// `abort()` stays abortive: every pending operation ends at once; sends whose adverts left are `Aborted` (the
/// peer may have part of them), never `Cancelled`.
fn abort_with_pending(b: &dyn Backend) -> Result<(), String> {
    let net = b.net();
    let p = pair(&*net, SockType::SeqPacket, exs::SocketOptions::default())?;
    let (ins, _outs) = pending_ops(&p)?;
    p.client.abort().map_err(|e| e.to_string())?;
    let evs = all(&p.eq_a)?;
    ensure!(evs.len() == 7, "{} events after abort", evs.len());
    ensure!(
        evs.iter().all(|e| match e.kind {
            EventKind::Recv => e.status == Err(OpError::Cancelled),
            _ => e.status == Err(OpError::Aborted),
        }),
        "receives cancelled, started sends aborted: {evs:?}"
    );
    // The peer sees a reset: its receive is refused (the connection is down) or ends in error or end-of-stream.
    let peer_buf = p.region_b(100)?;
    if p.server
        .recv(&p.eq_b, &peer_buf.all(), MsgFlags::NONE, 99)
        .is_ok()
    {
        let peer = next(&p.eq_b)?;
        ensure!(
            peer.flags.eof || !peer.is_ok(),
            "the peer's receive ends after an abort: {peer:?}"
        );
    }
    ensure!(
        ins.deregister().is_ok(),
        "receive buffers still leased after abort"
    );
    Ok(())
}

/// Issue 14: both sides close at once, each with sends the other never received. A graceful close cancels its
/// receives and tells the peer (CLOSE StopReceiving), whose sends then end `PeerClosed` at once; without it each
/// side waited for the other's receives until the linger time ran out (`Aborted`).
fn both_close(b: &dyn Backend) -> Result<(), String> {
    let net = b.net();
    let p = pair(&*net, SockType::SeqPacket, exs::SocketOptions::default())?;
    let a = p.region_a(pattern(3 * 50_000, 1))?;
    let b_src = MemoryRegion::from_vec(&p.b, pattern(3 * 50_000, 2)).map_err(|e| e.to_string())?;
    for i in 0..3 {
        p.client
            .send(
                &p.eq_a,
                &a.slice(i * 50_000..(i + 1) * 50_000),
                MsgFlags::NONE,
                i as u64,
            )
            .map_err(|e| e.to_string())?;
        p.server
            .send(
                &p.eq_b,
                &b_src.slice(i * 50_000..(i + 1) * 50_000),
                MsgFlags::NONE,
                i as u64,
            )
            .map_err(|e| e.to_string())?;
    }
    std::thread::sleep(std::time::Duration::from_millis(20));
    p.client.close().map_err(|e| e.to_string())?;
    p.server.close().map_err(|e| e.to_string())?;
    for (eq, who) in [(&p.eq_a, "client"), (&p.eq_b, "server")] {
        let evs = all(eq)?;
        ensure!(
            evs.len() == 3 && evs.iter().all(|e| e.status == Err(OpError::PeerClosed)),
            "{who}'s sends end PeerClosed (the peer stopped receiving), not at the linger time: {evs:?}"
        );
    }
    Ok(())
}

fn refused(b: &dyn Backend) -> Result<(), String> {
    let net = b.net();
    let server_host = net.host();
    let client_host = net.host();
    // Find a port nobody listens on: listen, note the port, close the listener.
    let l = Socket::new(&server_host, SockType::SeqPacket).map_err(|e| e.to_string())?;
    l.bind(net.listen_addr(0)).map_err(|e| e.to_string())?;
    let addr = l.listen(1).map_err(|e| e.to_string())?;
    l.close().map_err(|e| e.to_string())?;
    std::thread::sleep(std::time::Duration::from_millis(20));
    let eq = exs::EventQueue::new(4).unwrap();
    let s = Socket::new(&client_host, SockType::SeqPacket).map_err(|e| e.to_string())?;
    s.connect(&eq, addr, 1).map_err(|e| e.to_string())?;
    let ev = next(&eq)?;
    ensure!(
        ev.status == Err(OpError::Refused),
        "connect to a closed port: {:?} (want Refused, not a timeout)",
        ev.status
    );
    Ok(())
}

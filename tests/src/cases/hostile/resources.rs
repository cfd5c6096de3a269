//! Hostile peers against what the victim holds: a remote key kept past its send, an accept held by requests whose
//! senders vanish, stream buffers asked for by many peers at once.

use super::*;

/// Least exposure: once a send is acknowledged, its remote key no longer reads anything.
pub(super) fn stale_key_after_ack(b: &dyn Backend) -> Result<(), String> {
    let v = victim(b, SockType::SeqPacket)?;
    let (mut raw, s) = v.accept_good()?;
    let data = pattern(8000, 4);
    let src = MemoryRegion::from_vec(&v.ctx, data.clone()).map_err(|e| e.to_string())?;
    s.send(&v.eq, &src.all(), MsgFlags::NONE, 9)
        .map_err(|e| e.to_string())?;
    raw.pump(Duration::from_secs(20), |p| {
        p.received.iter().any(|m| {
            matches!(
                m,
                Ok(Message {
                    body: Body::Advert(_),
                    ..
                })
            )
        })
    });
    let advert = raw
        .received
        .iter()
        .find_map(|m| match m {
            Ok(Message {
                body: Body::Advert(a),
                ..
            }) => Some(*a),
            _ => None,
        })
        .ok_or("the victim's send never advertised")?;
    let remote = exs::transport::RemoteRef {
        addr: advert.addr,
        key: advert.rkey,
    };
    let ev = v.pull_and_ack(&mut raw, remote, &data)?;
    ensure!(
        ev.kind == EventKind::Send && ev.is_ok(),
        "the acknowledged send: {ev:?}"
    );
    let id = raw.read(remote, 8000)?;
    match raw.wait_done(id) {
        Ok(()) => Err("the remote key still reads the send buffer after the acknowledgment".into()),
        Err(e) => {
            eprintln!("HOSTILE {}: read with a revoked key: refused ({e})", v.name);
            let canary = src.to_vec().map_err(|e| e.to_string())?;
            same(&canary, &data, "the send buffer")?;
            drop(raw);
            // The victim may or may not have seen the connection die (the failed read breaks the raw side's
            // queue pair on verbs); either way it must keep serving others.
            let deadline = Instant::now() + Duration::from_secs(10);
            while s.error().map_err(|e| e.to_string())?.is_none() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(5));
            }
            healthy_without_violation(&v)
        }
    }
}

fn healthy_without_violation(v: &Victim) -> Result<(), String> {
    let client = v.net.host();
    let eq = EventQueue::new(16).unwrap();
    v.listener.accept(&v.eq, 2).map_err(|e| e.to_string())?;
    let c = Socket::new(&client, v.ty).map_err(|e| e.to_string())?;
    c.connect(&eq, v.addr, 0).map_err(|e| e.to_string())?;
    next(&eq)?
        .status
        .map_err(|e| format!("a new connection: {e}"))?;
    loop {
        let mut ev = next(&v.eq)?;
        if let Some(s) = ev.take_accepted() {
            let dst = MemoryRegion::alloc(&v.ctx, 10).map_err(|e| e.to_string())?;
            let src = MemoryRegion::from_vec(&client, b"0123456789".to_vec())
                .map_err(|e| e.to_string())?;
            s.recv(&v.eq, &dst.all(), MsgFlags::NONE, 3)
                .map_err(|e| e.to_string())?;
            c.send(&eq, &src.all(), MsgFlags::NONE, 4)
                .map_err(|e| e.to_string())?;
            let r = next(&v.eq)?;
            ensure!(
                r.is_ok() && r.bytes == 10,
                "transfer on a new connection: {r:?}"
            );
            return Ok(());
        }
    }
}

/// Issue 27: connection requests whose senders vanish before the connection is up used to be handed to the
/// application's pending accept, which then waited the connect timeout and failed (`TimedOut`), while honest clients
/// queued behind them (three such requests a few seconds apart denied service to a server). Now the listener sets
/// connections up by itself and an accept takes only an established one: with three vanishing requests ahead of
/// it, an honest client is accepted at once, and the accept never fails.
pub(super) fn vanishing_requests(b: &dyn Backend) -> Result<(), String> {
    let v = victim(b, SockType::SeqPacket)?;
    v.listener.accept(&v.eq, 1).map_err(|e| e.to_string())?;
    let hs = good_handshake(SockType::SeqPacket).encode();
    for _ in 0..3 {
        v.net.vanishing_request(v.addr, &hs)?;
    }
    let t0 = Instant::now();
    let client = v.net.host();
    let eq = EventQueue::new(16).unwrap();
    let c = Socket::new(&client, SockType::SeqPacket).map_err(|e| e.to_string())?;
    c.connect(&eq, v.addr, 0).map_err(|e| e.to_string())?;
    next(&eq)?
        .status
        .map_err(|e| format!("the honest client's connect: {e}"))?;
    let honest = c.local_addr().map_err(|e| e.to_string())?;
    // Every accept ends with an established connection; the honest one among them.
    for i in 0..4 {
        let mut ev = next(&v.eq)?;
        let s = ev
            .take_accepted()
            .ok_or_else(|| format!("accept {i} ended without a connection: {:?}", ev.status))?;
        // A vanishing peer may have come up before it vanished (an established connection is the application's,
        // as with TCP); it is down by now, or soon.
        if s.peer_addr().ok().flatten() == honest {
            eprintln!(
                "HOSTILE {}: honest client accepted {:.1?} after its connect began, behind 3 vanishing requests \
                 ({} dropped before accept so far)",
                v.name,
                t0.elapsed(),
                v.ctx.stats().dropped_before_accept
            );
            return Ok(());
        }
        v.listener.accept(&v.eq, 2).map_err(|e| e.to_string())?;
    }
    Err("four accepts and none was the honest client".into())
}

/// Issue 27: one 16-byte STREAM_RING_WANTED made an accepted stream connection allocate, register and expose its
/// whole 1 MiB stream buffer, with no bound across connections (64 connections took a server from 3.4 MB to 70.5
/// MB; at the connection cap, 16 GiB of pinned memory). Now stream buffers are charged to the context's memory
/// budget: past half of it only connections whose application reads get one, past all of it none (their peers
/// send directly into advertised receives). 64 crafted peers each ask for a buffer; the victim holds no more
/// than its budget, and an honest client that the server reads from still moves its data.
pub(super) fn ring_requests_within_budget(b: &dyn Backend) -> Result<(), String> {
    const BUDGET: u64 = 8 << 20;
    let mut opts = exs::ContextOptions::default();
    opts.memory_budget = BUDGET;
    let v = victim_with(b, SockType::Stream, opts)?;
    let mut peers = Vec::new();
    for _ in 0..64 {
        let (raw, s) = v.accept_good()?;
        peers.push((raw, s));
    }
    for (raw, _) in &mut peers {
        raw.send_msg(&Message::new(Body::StreamRingWanted))?;
    }
    // Let every request arrive and be handled.
    std::thread::sleep(Duration::from_millis(300));
    let held = v.ctx.stats().connection_bytes;
    let rings = v.ctx.stats().rings_refused;
    eprintln!(
        "HOSTILE {}: 64 connections asked for their stream buffers: {held} bytes of device-visible memory held \
         (budget {BUDGET}; each buffer is 1 MiB)",
        v.name
    );
    ensure!(
        held <= BUDGET,
        "the connections hold {held} bytes, beyond the {BUDGET}-byte budget"
    );
    ensure!(
        rings == 0,
        "nobody read, yet {rings} buffers were refused (they should wait)"
    );
    drop(peers);
    v.healthy("stream buffer requests", false)
}

/// A review found it: a connection in a listener's backlog, not accepted by any application, got the stream buffer
/// its peer asked for (the budget's pressure rule spares only connections that read; a tools server's budget was
/// large enough that the peers of a whole backlog held a 64 MiB buffer each). Such a connection gets none until
/// it is accepted; then it gets it without waiting for a receive.
pub(super) fn ring_requests_before_accept_wait(b: &dyn Backend) -> Result<(), String> {
    let v = victim(b, SockType::Stream)?;
    let private = good_handshake(SockType::Stream).encode();
    let mut peers = Vec::new();
    for _ in 0..8 {
        peers.push(RawPeer::connect(v.net.raw()?, v.addr, &private)?);
    }
    for raw in &mut peers {
        raw.send_msg(&Message::new(Body::StreamRingWanted))?;
    }
    let ring = exs::SocketOptions::default().stream_buffer_size as u64;
    // Let every request arrive and be handled.
    std::thread::sleep(Duration::from_millis(300));
    for raw in &mut peers {
        raw.pump(Duration::from_millis(5), |_| false);
    }
    let held = v.ctx.stats().connection_bytes;
    eprintln!(
        "HOSTILE {}: 8 connections not accepted asked for their stream buffers: {held} bytes held",
        v.name
    );
    ensure!(
        held < ring,
        "connections nobody accepted hold {held} bytes: a stream buffer ({ring} bytes) was given"
    );
    v.listener.accept(&v.eq, 1).map_err(|e| e.to_string())?;
    let mut ev = next(&v.eq)?;
    let _s = ev
        .take_accepted()
        .ok_or_else(|| format!("the accept: {ev:?}"))?;
    let deadline = Instant::now() + Duration::from_secs(20);
    while v.ctx.stats().connection_bytes < held + ring {
        for raw in &mut peers {
            raw.pump(Duration::from_millis(5), |_| false);
        }
        ensure!(
            Instant::now() < deadline,
            "the accepted connection never got the stream buffer its peer asked for"
        );
    }
    // The other seven are taken too, so that the health check's accept gets its own connection.
    let mut taken = Vec::new();
    for _ in 1..8 {
        v.listener
            .accept(&v.eq, 1)
            .map_err(|e| format!("accepting the others: {e}"))?;
        taken.push(next(&v.eq)?.take_accepted());
    }
    drop((peers, taken));
    v.healthy("stream buffer requests before accept", false)
}

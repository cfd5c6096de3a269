//! Many connections on one listener, with receive memory reported per connection.

use exs::{Event, EventKind, EventQueue, MemoryRegion, MsgFlags, SockType, Socket};

use crate::util::*;
use crate::{ensure, Backend, Case, Requires};

pub fn cases() -> Vec<Case> {
    vec![Case {
        name: "listener_accepts_many_connections",
        run: many_connections,
        requires: Requires::Nothing,
    }]
}

/// How many connections (`EXS_CONFORMANCE_CONNS`, default 100).
fn count() -> usize {
    std::env::var("EXS_CONFORMANCE_CONNS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(100)
}

/// One listener accepts `count()` connections; a message goes each way on every one of them. Where the transport
/// has a shared receive queue, the server's connections own no receive buffers (seed 003).
fn many_connections(b: &dyn Backend) -> Result<(), String> {
    let n = count();
    let net = b.net();
    let server = net.host();
    let client = net.host();
    let eq_s = EventQueue::new(4 * n + 16);
    let eq_c = EventQueue::new(4 * n + 16);
    let l = Socket::new(&server, SockType::SeqPacket).map_err(|e| e.to_string())?;
    l.bind(net.listen_addr(0)).map_err(|e| e.to_string())?;
    let addr = l.listen(n as u32).map_err(|e| e.to_string())?;
    let mut clients = Vec::new();
    for i in 0..n {
        l.accept(&eq_s, i as u64).map_err(|e| e.to_string())?;
        let c = Socket::new(&client, SockType::SeqPacket).map_err(|e| e.to_string())?;
        c.connect(addr, &eq_c, i as u64)
            .map_err(|e| format!("connect {i}: {e}"))?;
        clients.push(c);
    }
    let mut servers = vec![None; n];
    for _ in 0..n {
        let ev = next(&eq_c)?;
        ensure!(
            ev.kind == EventKind::Connect && ev.is_ok(),
            "connect: {ev:?}"
        );
    }
    for _ in 0..n {
        let mut ev = next(&eq_s)?;
        ensure!(ev.kind == EventKind::Accept && ev.is_ok(), "accept: {ev:?}");
        servers[ev.context as usize] = ev.accepted.take();
    }
    let servers: Vec<Socket> = servers
        .into_iter()
        .map(|s| s.ok_or("a connection was not accepted"))
        .collect::<Result<_, _>>()?;
    // Accepts complete in arrival order, not connect order: pair each accepted socket with its client by address.
    let mut pairs = Vec::new();
    for c in &clients {
        let local = c.local_addr().map_err(|e| e.to_string())?;
        let s = servers
            .iter()
            .find(|s| s.peer_addr().ok().flatten() == local)
            .ok_or("no accepted socket has this client's address")?;
        pairs.push((c, s));
    }
    let stats = server.stats();
    let caps = server.capabilities();
    let (bytes, how) = match stats.pool {
        Some(p) => (
            u64::from(p.slots) * p.slot_size as u64 + stats.ctrl_recv_bytes,
            "shared receive pool",
        ),
        None => (
            stats.ctrl_recv_bytes,
            "receive buffers of its own per connection",
        ),
    };
    eprintln!(
        "MEMORY {}: {n} connections, {bytes} bytes of control receive memory, {} per connection ({how})",
        b.name(),
        bytes / n as u64
    );
    if caps.max_shared_recv > 0 {
        ensure!(
            stats.pool.is_some() && stats.ctrl_recv_bytes == 0,
            "{} has a shared receive queue but the connections own receive buffers: {stats:?}",
            caps.name
        );
    }
    let dst = MemoryRegion::alloc(&server, 1000 * n).map_err(|e| e.to_string())?;
    let src = MemoryRegion::from_vec(&client, pattern(1000 * n, 77)).map_err(|e| e.to_string())?;
    let forth: Vec<_> = pairs.iter().map(|&(c, s)| (c, s)).collect();
    let (r, s) = one_message_each(&forth, (&eq_c, &eq_s), &src, &dst, 1000)?;
    ensure!(
        r.len() == n && s.len() == n,
        "{} receives and {} sends completed of {n}",
        r.len(),
        s.len()
    );
    ensure!(
        r.iter().chain(&s).all(|e| e.is_ok() && e.bytes == 1000),
        "a transfer failed"
    );
    same_regions(&dst, &src, "messages on many connections")?;
    // And back, server to client, on every connection.
    let back = MemoryRegion::alloc(&client, 8 * n).map_err(|e| e.to_string())?;
    let out = MemoryRegion::from_vec(
        &server,
        (0..n as u64).flat_map(|i| i.to_le_bytes()).collect(),
    )
    .map_err(|e| e.to_string())?;
    let backward: Vec<_> = pairs.iter().map(|&(c, s)| (s, c)).collect();
    let (r, s) = one_message_each(&backward, (&eq_s, &eq_c), &out, &back, 8)?;
    ensure!(
        r.iter().chain(&s).all(|e| e.is_ok()) && r.len() == n,
        "replies failed"
    );
    same_regions(&back, &out, "replies on many connections")
}

/// Sends chunk `i` of `src` from `links[i].0` into chunk `i` of `dst` at `links[i].1`, on every link at once; returns
/// the receive and the send events (`eqs`: the senders' queue, the receivers' queue).
fn one_message_each(
    links: &[(&Socket, &Socket)],
    (eq_tx, eq_rx): (&EventQueue, &EventQueue),
    src: &MemoryRegion,
    dst: &MemoryRegion,
    chunk: usize,
) -> Result<(Vec<Event>, Vec<Event>), String> {
    for (i, (tx, rx)) in links.iter().enumerate() {
        let r = i * chunk..(i + 1) * chunk;
        rx.recv(eq_rx, &dst.slice(r.clone()), MsgFlags::NONE, i as u64)
            .map_err(|e| e.to_string())?;
        tx.send(eq_tx, &src.slice(r), MsgFlags::NONE, i as u64)
            .map_err(|e| e.to_string())?;
    }
    Ok((all(eq_rx)?, all(eq_tx)?))
}

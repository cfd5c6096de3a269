//! Hosts in separate processes: a real two-process transfer, and a peer killed mid-transfer.

use std::time::{Duration, Instant};

use exs::{Context, Event, EventKind, EventQueue, MemoryRegion, MsgFlags, SockType, Socket};

use crate::child::{checksum, link_bytes, peer_host, spawn_on, PeerHost};
use crate::util::*;
use crate::{ensure, Backend, Case, Requires};

pub fn cases() -> Vec<Case> {
    vec![
        Case {
            name: "two_processes_transfer",
            run: two_processes,
            requires: Requires::Processes,
        },
        Case {
            name: "peer_process_killed_mid_transfer",
            run: killed_peer,
            requires: Requires::Processes,
        },
        Case {
            name: "two_hosts_over_a_link",
            run: two_hosts,
            requires: Requires::PeerHost,
        },
        Case {
            name: "peer_host_killed_mid_transfer",
            run: killed_peer_host,
            requires: Requires::PeerHost,
        },
        Case {
            name: "fork_and_exec_mid_transfer_leave_the_parent_s_transfers_intact",
            run: fork_mid_transfer,
            requires: Requires::Nothing,
        },
    ]
}

/// Issue 15 (fork safety): while a transfer is in flight the program forks and execs children (as a program
/// running a helper does), then writes new bytes into registered memory and sends them. Had the children
/// inherited the registered pages copy-on-write, the parent's write would have moved it to fresh pages while the
/// device kept the old ones, and the peer would get stale bytes. Every byte is checked.
fn fork_mid_transfer(b: &dyn Backend) -> Result<(), String> {
    const HALF: usize = 8 << 20;
    let net = b.net();
    let p = pair(&*net, SockType::Stream, exs::SocketOptions::default())?;
    let src = MemoryRegion::alloc(&p.a, 2 * HALF).map_err(|e| e.to_string())?;
    src.write(0, &pattern(HALF, 31))
        .map_err(|e| e.to_string())?;
    src.write(HALF, &pattern(HALF, 32))
        .map_err(|e| e.to_string())?;
    let dst = p.region_b(2 * HALF)?;
    p.server
        .recv(&p.eq_b, &dst.all(), MsgFlags::WAITALL, 1)
        .map_err(|e| e.to_string())?;
    p.client
        .send(&p.eq_a, &src.slice(..HALF), MsgFlags::NONE, 1)
        .map_err(|e| e.to_string())?;
    for _ in 0..3 {
        let st = std::process::Command::new("true")
            .status()
            .map_err(|e| format!("fork and exec: {e}"))?;
        ensure!(st.success(), "the child failed: {st}");
    }
    // Pages of the second half, registered and not in flight: the parent writes them after the forks.
    let fresh = pattern(HALF, 33);
    src.write(HALF, &fresh).map_err(|e| e.to_string())?;
    p.client
        .send(&p.eq_a, &src.slice(HALF..), MsgFlags::NONE, 2)
        .map_err(|e| e.to_string())?;
    let r = next(&p.eq_b)?;
    ensure!(r.is_ok() && r.bytes == 2 * HALF, "receive: {r:?}");
    let got = dst.to_vec().map_err(|e| e.to_string())?;
    same(
        &got[..HALF],
        &pattern(HALF, 31),
        "bytes in flight during the forks",
    )?;
    same(&got[HALF..], &fresh, "bytes written after the forks")?;
    for _ in 0..2 {
        ensure!(next(&p.eq_a)?.is_ok(), "send");
    }
    Ok(())
}

fn two_processes(b: &dyn Backend) -> Result<(), String> {
    echo_exchange(b, None).map(drop)
}

/// The same exchange with a peer on the far side of a network link (two rxe devices on a veth pair, say); with
/// `EXS_PEER_LINK`, the link's counters must show at least the payload crossing it.
fn two_hosts(b: &dyn Backend) -> Result<(), String> {
    let peer = peer_host()?;
    let before = peer.link.as_deref().map(link_bytes).transpose()?;
    let payload = echo_exchange(b, Some(&peer))?;
    if let (Some(link), Some(before)) = (peer.link.as_deref(), before) {
        let crossed = link_bytes(link)? - before;
        ensure!(
            crossed >= payload as u64,
            "only {crossed} bytes crossed {link} for {payload} bytes of payload"
        );
        eprintln!(
            "{}: {payload} bytes of payload, {crossed} bytes crossed {link}",
            b.name()
        );
    }
    Ok(())
}

/// Sends messages of several sizes to an echo-server child and checks the checksums it reports back; returns
/// the payload bytes sent.
fn echo_exchange(b: &dyn Backend, peer: Option<&PeerHost>) -> Result<usize, String> {
    let child = spawn_on(peer, "echo-server", b.name(), None, true)?;
    let line = child.line.clone().unwrap_or_default();
    let addr = line
        .strip_prefix("LISTEN ")
        .ok_or_else(|| format!("child said {line:?}"))?
        .parse()
        .map_err(|e| format!("{e}"))?;
    let net = b.net();
    let ctx = net.host();
    let eq = EventQueue::new(64).unwrap();
    let s = Socket::new(&ctx, SockType::SeqPacket).map_err(|e| e.to_string())?;
    s.connect(&eq, addr, 0).map_err(|e| e.to_string())?;
    next(&eq)?
        .status
        .map_err(|e| format!("connect to the child: {e}"))?;
    let sizes = [1usize, 1000, 70_000, 1 << 20, 8 << 20];
    let mut sums = Vec::new();
    for (i, &n) in sizes.iter().enumerate() {
        let data = pattern(n, 100 + i as u64);
        sums.push(checksum(&data));
        let buf = MemoryRegion::from_vec(&ctx, data).map_err(|e| e.to_string())?;
        s.send(&eq, &buf.all(), MsgFlags::NONE, i as u64)
            .map_err(|e| e.to_string())?;
        let ev = next(&eq).map_err(|e| format!("send of {n} bytes to the child: {e}"))?;
        ensure!(ev.is_ok() && ev.bytes == n, "send {i}: {ev:?}");
    }
    let end = MemoryRegion::alloc(&ctx, 1).map_err(|e| e.to_string())?;
    s.send(&eq, &end.slice(0..0), MsgFlags::NONE, 99)
        .map_err(|e| e.to_string())?;
    let reply = MemoryRegion::alloc(&ctx, 8 * sizes.len()).map_err(|e| e.to_string())?;
    s.recv(&eq, &reply.all(), MsgFlags::NONE, 100)
        .map_err(|e| e.to_string())?;
    let evs = eq.wait_all(Some(WAIT)).map_err(|e| e.to_string())?;
    ensure!(evs.iter().all(|e| e.is_ok()), "{evs:?}");
    let got: Vec<u64> = reply
        .to_vec()
        .map_err(|e| e.to_string())?
        .chunks(8)
        .map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes")))
        .collect();
    ensure!(
        got == sums,
        "the other process received different bytes: {got:x?} vs {sums:x?}"
    );
    s.close().map_err(|e| e.to_string())?;
    let mut child = child;
    let deadline = Instant::now() + WAIT;
    loop {
        if let Some(ok) = child.try_wait()? {
            ensure!(ok, "the child failed");
            return Ok(sizes.iter().sum());
        }
        ensure!(
            Instant::now() < deadline,
            "child did not exit after the close"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn killed_peer(b: &dyn Backend) -> Result<(), String> {
    killed_peer_on(b, None)
}

/// A peer killed on the far side of a link (with `EXS_PEER_AGENT`, on another machine with its own kernel: the
/// dead process's kernel, not ours, tears its connection down).
fn killed_peer_host(b: &dyn Backend) -> Result<(), String> {
    killed_peer_on(b, Some(&peer_host()?))
}

/// How many children are killed, at most, before the case gives up on catching the big read in flight.
const KILL_TRIES: u64 = 3;

fn killed_peer_on(b: &dyn Backend, peer: Option<&PeerHost>) -> Result<(), String> {
    let net = b.net();
    let ctx = net.host();
    let eq = EventQueue::new(256).unwrap();
    let l = Socket::new(&ctx, SockType::SeqPacket).map_err(|e| e.to_string())?;
    l.bind(net.listen_addr(0)).map_err(|e| e.to_string())?;
    let addr = l.listen(4).map_err(|e| e.to_string())?;
    let w = Ours {
        b,
        peer,
        ctx: &ctx,
        eq: &eq,
    };
    for attempt in 1..=KILL_TRIES {
        if kill_mid_read(&w, &l, addr, attempt)? {
            break;
        }
        ensure!(
            attempt < KILL_TRIES,
            "in {KILL_TRIES} tries the 128 MiB read finished before the kill landed: no read was cut by the kill"
        );
        eprintln!(
            "{}: RACE LOST (try {attempt} of {KILL_TRIES}): the 128 MiB read finished before the kill landed; \
             killing another child",
            b.name()
        );
    }
    // The listener keeps accepting.
    l.accept(&eq, 100).map_err(|e| e.to_string())?;
    let _second = spawn_on(peer, "sender", b.name(), Some(addr), false)?;
    let s2 = next(&eq)?.take_accepted().ok_or("second accept failed")?;
    let buf2 = MemoryRegion::alloc(&ctx, 1 << 20).map_err(|e| e.to_string())?;
    s2.recv(&eq, &buf2.all(), MsgFlags::NONE, 20)
        .map_err(|e| e.to_string())?;
    let ev = next(&eq)?;
    ensure!(
        ev.is_ok() && ev.bytes == 1 << 20,
        "receive from the second child: {ev:?}"
    );
    same(
        &buf2.to_vec().map_err(|e| e.to_string())?,
        &pattern(1 << 20, 9),
        "second child's data",
    )
}

/// Our side of the case: the backend, where the peer runs, our context and queue.
struct Ours<'a> {
    b: &'a dyn Backend,
    peer: Option<&'a PeerHost>,
    ctx: &'a Context,
    eq: &'a EventQueue,
}

/// A child sends two messages, then a 128 MiB one; it is killed once our read of the big one has started. Returns
/// whether the kill cut the read: on a loaded machine the read can finish, every byte in, before the kill lands, a
/// correct outcome that leaves the read in flight untested (the caller tries again).
fn kill_mid_read(
    w: &Ours,
    l: &Socket,
    addr: std::net::SocketAddr,
    attempt: u64,
) -> Result<bool, String> {
    let (ctx, eq) = (w.ctx, w.eq);
    l.accept(eq, attempt).map_err(|e| e.to_string())?;
    let child = spawn_on(w.peer, "sender-then-big", w.b.name(), Some(addr), false)?;
    let mut accepted = next(eq)?;
    ensure!(
        accepted.context == attempt,
        "try {attempt}: an event of an earlier try: {accepted:?}"
    );
    let s = accepted.take_accepted().ok_or("accept failed")?;
    // Data flows: receive two messages.
    let buf = MemoryRegion::alloc(ctx, 132 << 20).map_err(|e| e.to_string())?;
    for i in 0..2 {
        s.recv(
            eq,
            &buf.slice(i << 20..(i + 1) << 20),
            MsgFlags::NONE,
            i as u64,
        )
        .map_err(|e| e.to_string())?;
        let ev = next(eq)?;
        ensure!(
            ev.is_ok() && ev.bytes == 1 << 20,
            "receive {i} from the child: {ev:?}"
        );
    }
    let out = post_pending(&s, eq, ctx, &buf)?;
    let deadline = Instant::now() + WAIT;
    while s.stats().map_or(0, |st| st.link.reads) < 3 {
        ensure!(
            Instant::now() < deadline,
            "the read of the big message never started"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    let mut child = child;
    child.kill()?;
    let killed = Instant::now();
    let evs = eq
        .wait_all(Some(Duration::from_secs(30)))
        .map_err(|e| format!("after the kill: {e}"))?;
    let detect = killed.elapsed();
    let cut = all_ended(&evs)?;
    if cut {
        eprintln!(
            "{}: peer killed mid-transfer; {} pending operations ended within {detect:?}",
            w.b.name(),
            evs.len()
        );
    }
    ensure!(
        buf.deregister().is_ok() && out.deregister().is_ok(),
        "buffers still leased after the peer died"
    );
    Ok(cut)
}

/// Our operations left pending when the peer dies: the 128 MiB receive whose read is in flight (into `buf` from 4
/// MiB on), receives the child will never fill, and sends it never reads (from the region returned).
fn post_pending(
    s: &Socket,
    eq: &EventQueue,
    ctx: &Context,
    buf: &MemoryRegion,
) -> Result<MemoryRegion, String> {
    s.recv(eq, &buf.slice(4 << 20..132 << 20), MsgFlags::NONE, 2)
        .map_err(|e| e.to_string())?;
    for i in 2..4 {
        s.recv(
            eq,
            &buf.slice(i << 20..(i + 1) << 20),
            MsgFlags::NONE,
            1 + i as u64,
        )
        .map_err(|e| e.to_string())?;
    }
    let out = MemoryRegion::from_vec(ctx, pattern(2 << 20, 1)).map_err(|e| e.to_string())?;
    for i in 0..2 {
        s.send(
            eq,
            &out.slice(i << 20..(i + 1) << 20),
            MsgFlags::NONE,
            10 + i as u64,
        )
        .map_err(|e| e.to_string())?;
    }
    Ok(out)
}

/// The five pending operations each ended after the peer died: nothing more was sent, so a receive ends with an
/// error or end-of-stream, never with data, and a send with an error. The one exception is the big receive (2),
/// which may have finished whole before the kill landed: returns whether it was cut.
fn all_ended(evs: &[Event]) -> Result<bool, String> {
    ensure!(
        evs.len() == 5,
        "{} events for 5 pending operations: {evs:?}",
        evs.len()
    );
    let mut cut = true;
    for e in evs {
        let big_won =
            e.kind == EventKind::Recv && e.context == 2 && e.is_ok() && e.bytes == 128 << 20;
        cut &= !big_won;
        let ended = match e.kind {
            EventKind::Recv => big_won || e.status.is_err() || (e.flags.eof && e.bytes == 0),
            EventKind::Send => e.status.is_err(),
            _ => false,
        };
        ensure!(
            ended,
            "a pending operation did not fail after the peer died: {e:?}"
        );
    }
    Ok(cut)
}

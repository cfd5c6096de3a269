//! Who sends first. MPA (iWARP's framing over TCP) lets the passive side send only once the active side's first
//! message arrived; peer-to-peer mode (RFC 6581, iw_cxgb4's default) has the drivers exchange a ready-to-receive
//! message instead. exs's handshake travels in the connection's private data, so the first message after it may
//! come from either side: each case has one side send first while the other only waits, small (inside an advert or
//! a stream write) and large (pulled by an RDMA read or written into the peer's buffer), then the other answers.

use exs::{EventKind, MemoryRegion, MsgFlags, SockType};

use crate::util::*;
use crate::{ensure, Backend, Case, Requires};

pub fn cases() -> Vec<Case> {
    let c = |name, run| Case {
        name,
        run,
        requires: Requires::Nothing,
    };
    vec![
        c("the_accepting_side_sends_first_on_seqpacket", |b| {
            first(b, SockType::SeqPacket, false)
        }),
        c("the_accepting_side_sends_first_on_a_stream", |b| {
            first(b, SockType::Stream, false)
        }),
        c("the_connecting_side_sends_first_on_seqpacket", |b| {
            first(b, SockType::SeqPacket, true)
        }),
        c("the_connecting_side_sends_first_on_a_stream", |b| {
            first(b, SockType::Stream, true)
        }),
    ]
}

/// Sizes of the first messages: one inside an advert or a small write, one pulled by a read or written direct.
const SIZES: [usize; 2] = [100, 256 << 10];

fn first(b: &dyn Backend, ty: SockType, connecting_first: bool) -> Result<(), String> {
    let net = b.net();
    let p = pair(&*net, ty, exs::SocketOptions::default())?;
    // (sender socket, its context, its queue), then the receiver's.
    let a = (&p.client, &p.a, &p.eq_a);
    let s = (&p.server, &p.b, &p.eq_b);
    let (first, second) = if connecting_first { (a, s) } else { (s, a) };
    let who = if connecting_first {
        "connecting"
    } else {
        "accepting"
    };
    for (i, &len) in SIZES.iter().enumerate() {
        exchange(
            first,
            second,
            len,
            i as u64,
            &format!("{ty:?}: the {who} side's first {len} bytes"),
        )?;
    }
    // Then the other side answers.
    exchange(
        second,
        first,
        4096,
        9,
        &format!("{ty:?}: the answer to the {who} side"),
    )
}

type Side<'a> = (&'a exs::Socket, &'a exs::Context, &'a exs::EventQueue);

/// `from` sends `len` bytes, `to` receives them all (a stream may deliver them in pieces).
fn exchange(from: Side, to: Side, len: usize, seed: u64, what: &str) -> Result<(), String> {
    let data = pattern(len, seed);
    let src = MemoryRegion::from_vec(from.1, data.clone()).map_err(|e| e.to_string())?;
    let dst = MemoryRegion::alloc(to.1, len).map_err(|e| e.to_string())?;
    from.0
        .send(from.2, &src.all(), MsgFlags::NONE, seed)
        .map_err(|e| format!("{what}: send: {e}"))?;
    let mut got = 0;
    while got < len {
        to.0.recv(to.2, &dst.slice(got..len), MsgFlags::NONE, seed)
            .map_err(|e| format!("{what}: recv: {e}"))?;
        let ev = next(to.2).map_err(|e| format!("{what}: {e}"))?;
        ensure!(
            ev.kind == EventKind::Recv && ev.is_ok() && ev.bytes > 0,
            "{what}: receive ended with {ev:?}"
        );
        got += ev.bytes;
    }
    let ev = next(from.2).map_err(|e| format!("{what}: {e}"))?;
    ensure!(
        ev.kind == EventKind::Send && ev.is_ok() && ev.bytes == len,
        "{what}: send ended with {ev:?}"
    );
    same(&dst.to_vec().map_err(|e| e.to_string())?, &data, what)
}

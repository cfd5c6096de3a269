//! Remote keys are good on one connection only (issue 13): a crafted peer holding two connections to one
//! context learns keys on connection A and tries them on connection B. Every attempt must fail, the victim's
//! memory must compare equal byte for byte, and connection A must be intact. (That a key stops working once its
//! operation completed is `hostile_stale_key_after_ack_is_refused`.)

use std::time::Duration;

use exs::testing::RawPeer;
use exs::transport::RemoteRef;
use exs::wire::{Advert, AdvertFlags, Body, Message};
use exs::{MemoryRegion, MsgFlags, SockType, Socket};

use super::hostile::{victim_with, Victim};
use crate::util::*;
use crate::{ensure, Backend, Case, Requires};

pub fn cases() -> Vec<Case> {
    vec![
        Case {
            name: "a_key_from_one_connection_is_refused_on_another",
            run: key_refused_on_another_connection,
            requires: Requires::BoundKeys,
        },
        Case {
            name: "a_trusted_key_from_one_connection_is_refused_on_another",
            run: trusted_key_refused_on_another_connection,
            requires: Requires::BoundKeys,
        },
        Case {
            name: "a_trusted_key_reaches_its_region_until_deregistered",
            run: trusted_key_until_deregistered,
            requires: Requires::Nothing,
        },
        Case {
            name: "a_trusted_key_stops_working_when_its_region_is_dropped",
            run: trusted_key_until_dropped,
            requires: Requires::Nothing,
        },
    ]
}

/// The first advert the raw peer received that `pick` accepts.
fn advert(raw: &mut RawPeer, what: &str, pick: impl Fn(&Advert) -> bool) -> Result<Advert, String> {
    let find = |p: &RawPeer| {
        p.received.iter().find_map(|m| match m {
            Ok(Message {
                body: Body::Advert(a),
                ..
            }) if pick(a) => Some(*a),
            _ => None,
        })
    };
    raw.pump(Duration::from_secs(20), |p| find(p).is_some());
    find(raw).ok_or_else(|| format!("the victim never advertised {what}"))
}

/// Tries `remote` from a fresh connection B (read, or write of "EVIL"): it must fail.
fn attempt(
    v: &Victim,
    what: &str,
    remote: RemoteRef,
    len: usize,
    write: bool,
) -> Result<(), String> {
    let (mut b, b_sock) = v.accept_good()?;
    let id = if write {
        b.write(remote, &b"EVIL".repeat(len.div_ceil(4))[..len], None)?
    } else {
        b.read(remote, len)?
    };
    match b.wait_done(id) {
        Ok(()) => Err(format!(
            "{what}: connection B {} with connection A's key {:#x}",
            if write { "wrote" } else { "read" },
            remote.key
        )),
        Err(e) => {
            eprintln!(
                "KEYS {}: {what} on another connection: refused ({e})",
                v.name
            );
            drop(b);
            let _ = b_sock.abort();
            Ok(())
        }
    }
}

/// Takes the events of the aborted connections' operations, so the victim's queue is clean for `healthy`.
fn drain(v: &Victim) {
    while v.eq.outstanding() > 0 || !v.eq.is_empty() {
        if v.eq.next(Some(Duration::from_secs(5))).is_err() {
            return;
        }
    }
}

fn still_up(s: &Socket, what: &str) -> Result<(), String> {
    match s.error().map_err(|e| e.to_string())? {
        None => Ok(()),
        Some(e) => Err(format!("{what}: connection A went down: {e}")),
    }
}

fn key_refused_on_another_connection(b: &dyn Backend) -> Result<(), String> {
    keys_stay_on_their_connection(b, exs::ContextOptions::default())
}

/// The same attack on a context with the UNH-EXS policy for trusted peers: its keys name whole regions and live
/// as long as the region, yet still only on the connection they were given to.
fn trusted_key_refused_on_another_connection(b: &dyn Backend) -> Result<(), String> {
    keys_stay_on_their_connection(b, trusted())
}

fn trusted() -> exs::ContextOptions {
    let mut opts = exs::ContextOptions::default();
    opts.exposure = exs::ExposurePolicy::TrustedPeers;
    opts
}

fn keys_stay_on_their_connection(b: &dyn Backend, opts: exs::ContextOptions) -> Result<(), String> {
    message_keys_stay(b, opts.clone())?;
    stream_keys_stay(b, opts)
}

/// Message mode: a send in flight (readable), a persistent send (readable), a persistent receive (writable).
fn message_keys_stay(b: &dyn Backend, opts: exs::ContextOptions) -> Result<(), String> {
    let v = victim_with(b, SockType::SeqPacket, opts)?;
    let (mut a, a_sock) = v.accept_good()?;
    let sent = pattern(8000, 11);
    let src = MemoryRegion::from_vec(&v.ctx, sent.clone()).map_err(|e| e.to_string())?;
    a_sock
        .set_options(a_sock.options().unwrap().with_small_packet_max_size(0))
        .ok();
    a_sock
        .send(&v.eq, &src.all(), MsgFlags::NONE, 1)
        .map_err(|e| e.to_string())?;
    let ad = advert(&mut a, "a send", |ad| ad.flags.0 == 0 && ad.len == 8000)?;
    let key = RemoteRef {
        addr: ad.addr,
        key: ad.rkey,
    };
    attempt(&v, "the key of a send in flight", key, 8000, false)?;
    // Connection A still reads it with the same key: the key is good where it was given.
    let id = a.read(key, 8000)?;
    a.wait_done(id)
        .map_err(|e| format!("connection A reading its own advertised send: {e}"))?;
    same(
        &a.read_back(8000),
        &sent,
        "the send read on its own connection",
    )?;
    still_up(&a_sock, "after the send's key was tried elsewhere")?;

    let psend = MemoryRegion::from_vec(&v.ctx, pattern(4096, 12)).map_err(|e| e.to_string())?;
    a_sock
        .send(&v.eq, &psend.all(), MsgFlags::PERSISTENT, 2)
        .map_err(|e| e.to_string())?;
    let ad = advert(&mut a, "a persistent send", |ad| {
        ad.flags.0 & AdvertFlags::PERSISTENT != 0
    })?;
    let key = RemoteRef {
        addr: ad.addr,
        key: ad.rkey,
    };
    attempt(&v, "the key of a persistent send", key, 4096, false)?;

    persistent_recv_key_stays(&v)?;
    drop(a);
    let _ = a_sock.abort();
    let _ = psend;
    std::thread::sleep(Duration::from_millis(50));
    same(
        &src.to_vec().map_err(|e| e.to_string())?,
        &sent,
        "the send buffer",
    )?;
    drain(&v);
    v.healthy("cross-connection keys (message mode)", false)
}

/// A persistent receive's key, on a second connection of `v` (the one-side-persistent rule: the first holds a
/// persistent send), tried on a connection it was not given to: the buffer is not written.
fn persistent_recv_key_stays(v: &Victim) -> Result<(), String> {
    let before = pattern(4096, 13);
    let precv = MemoryRegion::from_vec(&v.ctx, before.clone()).map_err(|e| e.to_string())?;
    let (mut a2, a2_sock) = v.accept_good()?;
    a2_sock
        .recv(&v.eq, &precv.all(), MsgFlags::PERSISTENT, 3)
        .map_err(|e| e.to_string())?;
    let ad = advert(&mut a2, "a persistent receive", |ad| {
        ad.flags.0 & AdvertFlags::PERSISTENT_RECV != 0
    })?;
    let key = RemoteRef {
        addr: ad.addr,
        key: ad.rkey,
    };
    attempt(v, "the key of a persistent receive", key, 4096, true)?;
    still_up(
        &a2_sock,
        "after the persistent receive's key was tried elsewhere",
    )?;
    a2_sock.end_persistent().map_err(|e| e.to_string())?;
    drop(a2);
    let _ = a2_sock.abort();
    std::thread::sleep(Duration::from_millis(50));
    same(
        &precv.to_vec().map_err(|e| e.to_string())?,
        &before,
        "the persistent receive buffer",
    )
}

/// Stream mode: the intermediate stream buffer (allocated when the peer asks for it; its key follows the
/// handshake) and an advertised receive.
fn stream_keys_stay(b: &dyn Backend, opts: exs::ContextOptions) -> Result<(), String> {
    let v = victim_with(b, SockType::Stream, opts)?;
    let (mut a, a_sock) = v.accept_good()?;
    ensure!(
        a.peer.stream_len > 0,
        "the stream handshake carried no stream buffer"
    );
    let ring = stream_ring_key(&mut a)?;
    attempt(&v, "the key of the stream buffer", ring, 64, true)?;
    let before = pattern(64 << 10, 14);
    let dst = MemoryRegion::from_vec(&v.ctx, before.clone()).map_err(|e| e.to_string())?;
    a_sock
        .recv(&v.eq, &dst.all(), MsgFlags::NONE, 5)
        .map_err(|e| e.to_string())?;
    let ad = advert_stream(&mut a)?;
    attempt(
        &v,
        "the key of an advertised stream receive",
        ad,
        4096,
        true,
    )?;
    still_up(&a_sock, "after the stream keys were tried elsewhere")?;
    drop(a);
    let _ = a_sock.abort();
    let ev = next(&v.eq)?;
    ensure!(
        ev.bytes == 0,
        "the stream receive got {} bytes: {ev:?}",
        ev.bytes
    );
    same(
        &dst.to_vec().map_err(|e| e.to_string())?,
        &before,
        "the stream receive buffer",
    )?;
    drain(&v);
    v.healthy("cross-connection keys (stream mode)", false)
}

/// The key of the victim's stream buffer: from the handshake, or, where the buffer is allocated on demand, asked
/// for (its key follows in STREAM_RING).
fn stream_ring_key(a: &mut RawPeer) -> Result<RemoteRef, String> {
    if a.peer.stream_rkey != 0 || a.peer.stream_addr != 0 {
        return Ok(RemoteRef {
            addr: a.peer.stream_addr,
            key: a.peer.stream_rkey,
        });
    }
    a.ask_stream_ring()
}

/// The first stream advert (a receive buffer for direct transfers) the raw peer received.
fn advert_stream(raw: &mut RawPeer) -> Result<RemoteRef, String> {
    let find = |p: &RawPeer| {
        p.received.iter().find_map(|m| match m {
            Ok(Message {
                body: Body::StreamAdvert(a),
                ..
            }) => Some(RemoteRef {
                addr: a.addr,
                key: a.rkey,
            }),
            _ => None,
        })
    };
    raw.pump(Duration::from_secs(20), |p| find(p).is_some());
    find(raw).ok_or_else(|| "the victim never advertised its stream receive".into())
}

/// The trade-off of the trusted policy, pinned: the key of one send reaches the rest of its region (UNH-EXS gives
/// the registration's key), on its own connection, after the send completed, until the region is deregistered.
fn trusted_key_until_deregistered(b: &dyn Backend) -> Result<(), String> {
    trusted_key_until(b, false)
}

/// Issue 27: a region used once and then dropped without `deregister` kept its whole-region key, its memory and its
/// registration until the connection ended, and the peer could still read it (on libfabric the peer read fresh
/// bytes after the drop). Dropping the last handle now revokes the key like deregistering does.
fn trusted_key_until_dropped(b: &dyn Backend) -> Result<(), String> {
    trusted_key_until(b, true)
}

/// A trusted key reads its whole region after its send completed, and stops working once the region is
/// deregistered (or, with `drop`, once its last handle is dropped).
fn trusted_key_until(b: &dyn Backend, drop_it: bool) -> Result<(), String> {
    let v = victim_with(b, SockType::SeqPacket, trusted())?;
    let (mut raw, s) = v.accept_good()?;
    s.set_options(s.options().unwrap().with_small_packet_max_size(0))
        .ok();
    let data = pattern(64 << 10, 21);
    let src = MemoryRegion::from_vec(&v.ctx, data.clone()).map_err(|e| e.to_string())?;
    s.send(&v.eq, &src.slice(0..8000), MsgFlags::NONE, 9)
        .map_err(|e| e.to_string())?;
    let ad = advert(&mut raw, "a send", |ad| ad.len == 8000)?;
    let remote = RemoteRef {
        addr: ad.addr,
        key: ad.rkey,
    };
    let ev = v.pull_and_ack(&mut raw, remote, &data[..8000])?;
    ensure!(ev.is_ok(), "the acknowledged send: {ev:?}");
    // The send is done; its key still reads the region, beyond the send's range.
    let beyond = RemoteRef {
        addr: ad.addr + 32_768,
        key: ad.rkey,
    };
    let id = raw.read(beyond, 4096)?;
    raw.wait_done(id).map_err(|e| {
        format!("the trusted key, after its send, 32 KiB further into the region: {e}")
    })?;
    same(
        &raw.read_back(4096),
        &data[32_768..32_768 + 4096],
        "the region beyond the send",
    )?;
    eprintln!(
        "KEYS {}: trusted key read the region after its send completed",
        v.name
    );
    // Deregistered (or dropped): the key is revoked at once, the connection stays up.
    let how = if drop_it { "dropped" } else { "deregistered" };
    if drop_it {
        drop(src);
    } else {
        src.deregister()
            .map_err(|e| format!("deregistering the region: {e}"))?;
    }
    let id = raw.read(beyond, 4096)?;
    ensure!(
        raw.wait_done(id).is_err(),
        "the trusted key still read the region after it was {how}"
    );
    ensure!(
        v.ctx.stats().trusted_keys == 0,
        "{} trusted keys left after the region was {how}",
        v.ctx.stats().trusted_keys
    );
    eprintln!(
        "KEYS {}: trusted key refused once the region was {how}",
        v.name
    );
    drop(raw);
    let _ = s.abort();
    drain(&v);
    v.healthy("trusted keys", false)
}

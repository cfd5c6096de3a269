//! Fuzz harnesses, shared by the cargo-fuzz targets in `fuzz/` (libFuzzer, nightly) and by the bounded property
//! tests in `props/tests/fuzz_props.rs` (stable, run by `cargo xtask test`). Each takes arbitrary bytes and panics
//! only when exs breaks a promise.
//!
//! * [`wire`]: the decoders never panic, and whatever decodes encodes back to the same meaning.
//! * [`peer`]: the protocol state machine of one exs connection, driven by an arbitrary sequence of events from a
//!   crafted peer (raw bytes, well-formed messages with arbitrary fields, immediates, disconnects) interleaved with
//!   local sends, receives and closes, on a deterministic simulated world. Promises checked: no panic, no hang, the
//!   connection either stays usable or goes down with an error (a violation, a reset, or the peer's close), memory
//!   outside what exs exposed is never touched, and the context keeps serving a new, well-behaved connection.

use std::net::SocketAddr;
use std::time::Duration;

use crate::event::EventQueue;
use crate::memory::MemoryRegion;
use crate::options::{MsgFlags, SockType};
use crate::sim::{SimConfig, World};
use crate::socket::Socket;
use crate::testing::{handshake, RawPeer};
use crate::wire::{
    Advert, AdvertFlags, Body, CloseReason, Handshake, Imm, Message, OffsetWritten, StreamAdvert,
    WireSockType,
};
use crate::{Context, ContextOptions, OpError};

/// Reads fields off the fuzz input; past the end it yields zeros.
struct Input<'a> {
    data: &'a [u8],
    at: usize,
}

impl Input<'_> {
    fn u8(&mut self) -> u8 {
        let v = self.data.get(self.at).copied().unwrap_or(0);
        self.at += 1;
        v
    }
    fn u16(&mut self) -> u16 {
        u16::from_le_bytes([self.u8(), self.u8()])
    }
    fn u32(&mut self) -> u32 {
        u32::from_le_bytes([self.u8(), self.u8(), self.u8(), self.u8()])
    }
    fn u64(&mut self) -> u64 {
        u64::from(self.u32()) | (u64::from(self.u32()) << 32)
    }
    fn bytes(&mut self, n: usize) -> &[u8] {
        let start = self.at.min(self.data.len());
        let end = (self.at + n).min(self.data.len());
        self.at += n;
        &self.data[start..end]
    }
    fn done(&self) -> bool {
        self.at >= self.data.len()
    }
}

/// Decoders: no panic on any input; a decoded message or handshake round-trips.
pub fn wire(data: &[u8]) {
    if let Ok((m, at)) = Message::decode(data) {
        let mut again = m.to_vec();
        again.extend_from_slice(&data[at..]);
        let (m2, _) = Message::decode(&again).expect("a decoded message re-encodes to valid bytes");
        assert_eq!(m, m2, "message round trip");
    }
    // A buffer of several messages (coalescing): each one found re-encodes to its own header and body.
    for (at, f) in crate::wire::frames(data).map_while(Result::ok) {
        let mut again = vec![0u8; f.msg.encoded_len()];
        f.msg.encode_framed(&mut again, f.more);
        assert_eq!(
            &again[..],
            &data[at..at + f.inline_at],
            "framed message round trip"
        );
    }
    if let Ok(h) = Handshake::decode(data) {
        assert_eq!(
            Handshake::decode(&h.encode()),
            Ok(h),
            "handshake round trip"
        );
    }
    if data.len() >= 4 {
        let v = u32::from_le_bytes(data[..4].try_into().expect("4 bytes"));
        let imm = Imm::decode(v);
        assert_eq!(Imm::decode(imm.encode()), imm, "immediate round trip");
    }
}

/// A well-formed message whose fields come from the input.
fn message(inp: &mut Input<'_>) -> Vec<u8> {
    let body = match inp.u8() % 12 {
        0 => Body::Advert(Advert {
            seq: u32::from(inp.u8() % 20),
            // Every flag and every combination of them (persistent sends and receives, notifications, and the
            // combinations the protocol refuses).
            flags: AdvertFlags(u32::from(inp.u8() & 0x0f)),
            len: match inp.u8() % 4 {
                0 => u64::from(inp.u8()),
                1 => u64::from(inp.u16()),
                2 => u64::from(inp.u32()),
                _ => inp.u64(),
            },
            addr: inp.u64(),
            rkey: inp.u64(),
        }),
        1 => Body::Ack,
        2 => Body::Credit,
        3 => Body::Close(match inp.u8() % 4 {
            0 => CloseReason::Close,
            1 => CloseReason::ShutdownWrite,
            2 => CloseReason::StopReceiving,
            _ => CloseReason::Violation,
        }),
        4 => Body::StreamAdvert(StreamAdvert {
            addr: inp.u64(),
            rkey: inp.u64(),
            len: u64::from(inp.u32()),
            seq: u64::from(inp.u16()),
            // Small phases, and any (those near the 32-bit wrap too).
            phase: match inp.u8() % 4 {
                0 => inp.u32(),
                _ => u32::from(inp.u8()),
            },
            waitall: inp.u8() & 1 == 1,
            consumed: u64::from(inp.u16()),
        }),
        5 => Body::StreamWindow {
            consumed: u64::from(inp.u32()),
        },
        6 => Body::ReadNotify {
            seq: u32::from(inp.u8()),
        },
        7 => Body::StreamRingWanted,
        8 => Body::StreamRing {
            addr: inp.u64(),
            rkey: inp.u64() | 1,
        },
        9 => Body::PersistentEnd {
            seq: u32::from(inp.u8() % 20),
            echo: inp.u8() & 1 == 1,
        },
        10 => Body::OffsetWritten(OffsetWritten {
            offset: inp.u64(),
            len: inp.u64(),
        }),
        _ => Body::Ack,
    };
    let ack = (inp.u8() & 1 == 1 || matches!(body, Body::Ack)).then(|| u32::from(inp.u8() % 8));
    let m = Message {
        credits: u16::from(inp.u8() % 8),
        ack,
        body,
    };
    let mut v = m.to_vec();
    // Immediate data to match the advert's length when it is small; otherwise the length lies.
    let n = m.inline_len().min(600);
    v.extend_from_slice(inp.bytes(n));
    v
}

/// The connection under attack, and how the attack ended.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct PeerOutcome {
    /// The connection went down with a protocol violation.
    pub violation: bool,
    /// It went down otherwise (reset, the peer's close).
    pub down: bool,
    /// Events the crafted peer sent.
    pub events: usize,
}

/// See the module documentation.
pub fn peer(data: &[u8]) -> PeerOutcome {
    let mut inp = Input { data, at: 0 };
    let victim = Victim::new(&mut inp);
    let hs = hostile_handshake(victim.ty, &mut inp);
    let mut outcome = PeerOutcome::default();
    let Some((mut raw, sock)) = victim.admit(&hs) else {
        outcome.violation = true; // refused at the handshake
        return outcome;
    };
    let buffers = MemoryRegion::alloc(&victim.ctx, 1 << 20).expect("buffers");
    let mut out = 0usize;
    while !inp.done() && outcome.events < 64 {
        outcome.events += 1;
        victim.step(&mut inp, &mut raw, &sock, &buffers, &mut out);
        raw.pump(Duration::ZERO, |_| false);
    }
    // Let everything settle (bounded: a hang is a failure).
    victim.world.run_for(Duration::from_secs(3));
    match sock.error() {
        Ok(Some(OpError::PeerMisbehaved(_))) => outcome.violation = true,
        Ok(Some(_)) => outcome.down = true,
        Ok(None) | Err(_) => {}
    }
    assert_eq!(
        victim.canary.to_vec().expect("canary readable"),
        victim.canary_bytes,
        "memory exs never exposed was written"
    );
    drop(raw);
    victim.serves_a_new_peer();
    outcome
}

/// The exs side under attack: a context on a simulated world, listening, with memory it never exposed (the canary).
/// Fields drop in declaration order: memory and sockets before their context, the context before its world.
struct Victim {
    canary: MemoryRegion,
    canary_bytes: Vec<u8>,
    addr: SocketAddr,
    listener: Socket,
    eq: EventQueue,
    ty: SockType,
    ctx: Context,
    world: World,
}

impl Victim {
    /// The socket type and the world's seed come from the input.
    fn new(inp: &mut Input<'_>) -> Victim {
        let ty = if inp.u8() & 1 == 0 {
            SockType::SeqPacket
        } else {
            SockType::Stream
        };
        let world = World::new(SimConfig {
            seed: u64::from(inp.u16()),
            ..SimConfig::default()
        });
        let ctx = quiet_host(&world);
        let eq = EventQueue::new(1024).unwrap();
        let listener = Socket::new(&ctx, ty).expect("socket");
        listener.bind(world.addr(0, 7000)).expect("bind");
        let addr = listener.listen(8).expect("listen");
        let canary_bytes: Vec<u8> = (0..4096u32).map(|i| (i * 7) as u8).collect();
        let canary = MemoryRegion::from_vec(&ctx, canary_bytes.clone()).expect("canary");
        listener.accept(&eq, 1).expect("accept");
        Victim {
            canary,
            canary_bytes,
            addr,
            listener,
            eq,
            ty,
            ctx,
            world,
        }
    }

    /// The crafted peer connects with `hs`; `None` when the victim refused the handshake (naming the violation).
    fn admit(&self, hs: &Handshake) -> Option<(RawPeer, Socket)> {
        let w2 = self.world.clone();
        let tick = Box::new(move || {
            w2.drive();
        });
        let raw = RawPeer::connect_with(
            Box::new(self.world.raw_host()),
            self.addr,
            &hs.encode(),
            tick,
        )
        .ok()?;
        let mut ev = self
            .eq
            .next(Some(Duration::from_secs(5)))
            .expect("accept event");
        let Some(sock) = ev.take_accepted() else {
            assert!(
                matches!(ev.status, Err(crate::OpError::PeerMisbehaved(_))),
                "a refused handshake names the violation: {ev:?}"
            );
            return None;
        };
        Some((raw, sock))
    }

    /// One event of the attack, chosen by the input: raw bytes, a bare immediate or a well-formed message from
    /// the peer, a local receive, send or close, some progress, or a read of whatever the peer names.
    fn step(
        &self,
        inp: &mut Input<'_>,
        raw: &mut RawPeer,
        sock: &Socket,
        buffers: &MemoryRegion,
        out: &mut usize,
    ) {
        match inp.u8() % 10 {
            0 => {
                let n = usize::from(inp.u8());
                let bytes = inp.bytes(n).to_vec();
                let _ = raw.send_bytes(&bytes, None);
            }
            1 => {
                let imm = inp.u32();
                let _ = raw.send_bytes(&[], Some(imm));
            }
            2..=4 => {
                let m = message(inp);
                let _ = raw.send_bytes(&m, None);
            }
            5 => {
                let n = usize::from(inp.u16()) % 65536 + 1;
                let at = (*out % 8) * 65536;
                *out += 1;
                let _ = sock.recv(&self.eq, &buffers.slice(at..at + n), MsgFlags::NONE, 10);
            }
            6 => {
                let n = usize::from(inp.u16()) % 65536 + 1;
                let at = 8 * 65536 + (*out % 8) * 65536;
                *out += 1;
                let _ = sock.send(&self.eq, &buffers.slice(at..at + n), MsgFlags::NONE, 11);
            }
            7 => {
                for _ in 0..inp.u8() % 16 {
                    self.world.drive();
                }
            }
            8 => {
                let _ = raw.read(
                    crate::transport::RemoteRef {
                        addr: inp.u64(),
                        key: inp.u64(),
                    },
                    usize::from(inp.u16()) % 8192 + 1,
                );
            }
            _ => {
                if inp.u8() % 16 == 0 {
                    let _ = sock.close();
                }
            }
        }
    }

    /// After the attack the context still accepts a well-behaved peer and carries its data.
    fn serves_a_new_peer(&self) {
        let client = quiet_host(&self.world);
        let ceq = EventQueue::new(8).unwrap();
        self.listener
            .accept(&self.eq, 2)
            .expect("accept after the attack");
        let c = Socket::new(&client, self.ty).expect("socket");
        c.connect(&ceq, self.addr, 3)
            .expect("connect after the attack");
        let ce = ceq
            .next(Some(Duration::from_secs(30)))
            .expect("connect event");
        assert!(ce.is_ok(), "a new connection after the attack: {ce:?}");
        let fresh = loop {
            let mut e = self
                .eq
                .next(Some(Duration::from_secs(30)))
                .expect("the new connection is accepted");
            if let Some(s) = e.take_accepted() {
                break s;
            }
        };
        let src = MemoryRegion::from_vec(&client, b"after the storm".to_vec()).expect("src");
        let dst = MemoryRegion::alloc(&self.ctx, 15).expect("dst");
        let feq = EventQueue::new(4).unwrap();
        fresh
            .recv(&feq, &dst.all(), MsgFlags::WAITALL, 4)
            .expect("recv on the new connection");
        c.send(&ceq, &src.all(), MsgFlags::NONE, 5)
            .expect("send on the new connection");
        let r = feq
            .next(Some(Duration::from_secs(30)))
            .expect("receive after the attack");
        assert!(
            r.is_ok() && r.bytes == 15,
            "transfer after the attack: {r:?}"
        );
        assert_eq!(dst.to_vec().expect("dst"), b"after the storm");
    }
}

/// A context whose connections send no keepalives (the harness controls every packet the peer sees).
fn quiet_host(world: &World) -> Context {
    world.host_with(ContextOptions {
        keepalive: None,
        ..ContextOptions::default()
    })
}

/// The crafted peer's handshake: valid for `ty`, or (one time in four) with every field from the input (issue 15:
/// a hostile handshake is refused cleanly or the connection works).
fn hostile_handshake(ty: SockType, inp: &mut Input<'_>) -> Handshake {
    let mut hs = handshake(match ty {
        SockType::SeqPacket => WireSockType::SeqPacket,
        SockType::Stream => WireSockType::Stream,
    });
    hs.stream_len = 4096;
    hs.stream_addr = 0x10_000;
    hs.stream_rkey = 1;
    if inp.u8() % 4 == 0 {
        hs.ctrl_window = inp.u16();
        hs.slot_size = inp.u16();
        hs.send_credits = inp.u16();
        hs.recv_credits = inp.u16();
        hs.small_max = inp.u32();
        hs.stream_len = inp.u32();
        hs.stream_addr = inp.u64();
        hs.stream_rkey = inp.u64();
        hs.native_imm = inp.u8() & 1 == 0;
    }
    hs
}

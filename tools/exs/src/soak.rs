//! `exs soak`: a bounded soak. Connection after connection (random socket type), random message sizes, receive
//! sizes, flags and depths, and random closes from either side with operations pending; every byte that a
//! receive reports is checked against what was sent. Any corrupted byte, lost message, or operation that never
//! completes fails the run.

use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context as _, Result};
use exs::{Context, Event, EventQueue, MemoryRegion, MsgFlags, SockType, Socket};

use crate::backend::{BackendArgs, Opened};
use crate::size::fmt_bytes;

#[derive(Clone, Debug, clap::Args)]
pub struct SoakArgs {
    /// How long to run, in seconds.
    #[arg(long, default_value_t = 60, value_parser = crate::cli::count_in(1..=crate::cli::MAX_SOAK_SECONDS),
          help = format!("How long to run, in seconds, 1 to {}", crate::cli::MAX_SOAK_SECONDS))]
    pub seconds: u64,
    /// Seed of every random choice (the run is reproducible up to timing).
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// The summary as one JSON object on stdout instead of the `SOAK` line.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub backend: BackendArgs,
}

/// xorshift64*: small, fast, good enough to pick sizes.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
    /// Sizes skewed small: mostly under 1 KiB, sometimes up to 4 MiB.
    fn size(&mut self) -> usize {
        match self.below(10) {
            0..=4 => self.below(1024) as usize,
            5..=7 => self.below(128 << 10) as usize,
            _ => self.below(4 << 20) as usize,
        }
    }
}

/// Byte `k` of the stream (or message) named by `id`.
fn byte(id: u64, k: u64) -> u8 {
    let x = (id ^ k.wrapping_mul(0x9E37_79B9_7F4A_7C15)).wrapping_mul(0xD6E8_FEB8_6659_FD93);
    (x >> 56) as u8
}

fn fill(buf: &MemoryRegion, at: usize, len: usize, id: u64, from: u64) -> Result<()> {
    let v: Vec<u8> = (0..len as u64).map(|k| byte(id, from + k)).collect();
    Ok(buf.write(at, &v)?)
}

#[derive(Default, Debug, serde::Serialize)]
struct Totals {
    connections: u64,
    messages: u64,
    bytes: u64,
    closes_with_pending: u64,
    failed_ops: u64,
    corrupted: u64,
}

const SLOTS: usize = 8;
const SLOT: usize = 4 << 20;

pub fn run(a: SoakArgs) -> Result<()> {
    let opened = Opened::open(&a.backend)?;
    let server = opened.host()?;
    let client = opened.host()?;
    let mut rng = Rng(a.seed.max(1).wrapping_mul(0x9E37_79B9_7F4A_7C15));
    let send_buf =
        MemoryRegion::alloc(&client, SLOTS * SLOT).context("registering the send buffer")?;
    let recv_buf =
        MemoryRegion::alloc(&server, SLOTS * SLOT).context("registering the receive buffer")?;
    let deadline = Instant::now() + Duration::from_secs(a.seconds);
    let start = Instant::now();
    let mut t = Totals::default();
    let mut last_report = Instant::now();
    while Instant::now() < deadline {
        let ty = if rng.below(2) == 0 {
            SockType::SeqPacket
        } else {
            SockType::Stream
        };
        one_connection(
            &opened, &server, &client, &send_buf, &recv_buf, ty, &mut rng, &mut t,
        )
        .with_context(|| format!("connection {} ({ty:?})", t.connections))?;
        if last_report.elapsed() > Duration::from_secs(10) {
            eprintln!("soak: {:?} elapsed: {t:?}", start.elapsed().as_secs());
            last_report = Instant::now();
        }
    }
    if a.json {
        let mut v = serde_json::to_value(&t)?;
        let m = v.as_object_mut().expect("an object");
        m.insert("tool".into(), "exs-soak".into());
        m.insert("backend".into(), opened.label().into());
        m.insert("secs".into(), start.elapsed().as_secs().into());
        m.insert("seed".into(), a.seed.into());
        println!("{v}");
    } else {
        println!(
        "SOAK {}: {} s, {} connections, {} messages, {} verified ({} bytes), {} closes with operations pending, \
         {} operations ended by a close, {} corrupted bytes",
        opened.label(),
        start.elapsed().as_secs(),
        t.connections,
        t.messages,
        fmt_bytes(t.bytes),
        t.bytes,
        t.closes_with_pending,
        t.failed_ops,
        t.corrupted
        );
    }
    if t.corrupted > 0 {
        bail!("{} corrupted bytes", t.corrupted);
    }
    // Both ends are exs: neither may ever see the other break the protocol, whatever the closes raced with.
    let violations = server.stats().violations + client.stats().violations;
    if violations > 0 {
        bail!("{violations} protocol violations between two exs peers");
    }
    Ok(())
}

fn wait(eq: &EventQueue, what: &str) -> Result<Event> {
    eq.next(Some(Duration::from_secs(60)))
        .with_context(|| format!("{what}: no event within 60 s"))
}

#[allow(clippy::too_many_arguments)]
fn one_connection(
    opened: &Opened,
    server: &Context,
    client: &Context,
    send_buf: &MemoryRegion,
    recv_buf: &MemoryRegion,
    ty: SockType,
    rng: &mut Rng,
    t: &mut Totals,
) -> Result<()> {
    let id = rng.next();
    let (eq_s, eq_c) = (EventQueue::new(64)?, EventQueue::new(64)?);
    let l = Socket::new(server, ty)?;
    l.bind(opened.listen_addr(0)).context("bind")?;
    let addr = l.listen(1).context("listen")?;
    l.accept(&eq_s, 0).context("accept")?;
    let c = Socket::new(client, ty)?;
    c.connect(&eq_c, addr, 0).context("connect")?;
    wait(&eq_c, "connect")?.status.context("connect")?;
    let mut acc = wait(&eq_s, "accept")?;
    let s = acc
        .take_accepted()
        .ok_or_else(|| anyhow!("accept failed: {:?}", acc.status))?;
    drop(l);
    t.connections += 1;
    let batches = 1 + rng.below(12);
    // Close mid-way (from either side, with operations pending) in a quarter of the connections.
    let close_at = (rng.below(4) == 0).then(|| rng.below(batches));
    let mut sent: u64 = 0; // stream: bytes sent so far
    let mut got: u64 = 0; // stream: bytes received; seqpacket: messages received
    let mut msgs_sent = Vec::new(); // seqpacket: (id, len) in order
    let mut closed = false;
    for batch in 0..batches {
        // A batch: up to SLOTS sends in flight, then receives until all of it arrived, then the send events.
        let k = 1 + rng.below(SLOTS as u64) as usize;
        let batch_start = sent;
        for slot in 0..k {
            let mut len = rng.size().min(SLOT);
            if ty == SockType::Stream && len == 0 {
                len = 1;
            }
            let msg_id = id ^ (msgs_sent.len() as u64).wrapping_mul(0x1000_0000_01b3);
            match ty {
                SockType::Stream => fill(send_buf, slot * SLOT, len, id, sent)?,
                SockType::SeqPacket => fill(send_buf, slot * SLOT, len, msg_id, 0)?,
            }
            c.send(
                &eq_c,
                &send_buf.slice(slot * SLOT..slot * SLOT + len),
                MsgFlags::NONE,
                slot as u64,
            )
            .context("send")?;
            match ty {
                SockType::Stream => sent += len as u64,
                SockType::SeqPacket => {
                    msgs_sent.push((msg_id, len));
                    sent += 1;
                }
            }
        }
        // A graceful close by the sender with its sends in flight: they are delivered, then end-of-stream.
        let mut graceful = false;
        if close_at == Some(batch) {
            t.closes_with_pending += 1;
            closed = true;
            if rng.below(3) == 0 {
                c.close().context("close")?;
                graceful = true;
            } else {
                // Post a few receives, then the receiver closes (its pending receives are cancelled, the
                // sender's sends fail), or the sender aborts, with everything in flight.
                for slot in 0..rng.below(3) as usize {
                    let _ = s.recv(
                        &eq_s,
                        &recv_buf.slice(slot * SLOT..slot * SLOT + SLOT),
                        MsgFlags::NONE,
                        slot as u64,
                    );
                }
                if rng.below(2) == 0 {
                    c.abort()
                } else {
                    s.close()
                }
                .context("close or abort")?;
                break;
            }
        }
        // Receive the batch: seqpacket one receive per message (sometimes too small: truncation); stream pieces
        // of random size, sometimes MSG_WAITALL.
        let mut slot = 0usize;
        while got < sent {
            let left = (sent - got) as usize;
            let (cap, flags) = match ty {
                SockType::SeqPacket => {
                    let len = msgs_sent[got as usize].1;
                    let cap = if rng.below(8) == 0 {
                        rng.below(len as u64 + 1) as usize
                    } else {
                        len
                    };
                    (cap.clamp(1, SLOT), MsgFlags::NONE)
                }
                SockType::Stream => {
                    let cap = rng.size().clamp(1, SLOT);
                    if rng.below(3) == 0 && cap <= left {
                        (cap, MsgFlags::WAITALL)
                    } else {
                        (cap, MsgFlags::NONE)
                    }
                }
            };
            s.recv(
                &eq_s,
                &recv_buf.slice(slot * SLOT..slot * SLOT + cap),
                flags,
                slot as u64,
            )
            .context("recv")?;
            let r = wait(&eq_s, "receive")?;
            if !r.is_ok() {
                bail!("a receive failed on an open connection: {r:?}");
            }
            check(recv_buf, &r, ty, id, &mut got, &msgs_sent, t)?;
            slot = (slot + 1) % SLOTS;
        }
        for _ in 0..k {
            let e = wait(&eq_c, "send")?;
            if !e.is_ok() {
                bail!(
                    "a send failed {}: {e:?}",
                    if graceful {
                        "before a graceful close"
                    } else {
                        "on an open connection"
                    }
                );
            }
        }
        let _ = batch_start;
        if graceful {
            s.recv(&eq_s, &recv_buf.slice(0..SLOT), MsgFlags::NONE, 0)
                .context("receive after the peer's close")?;
            let r = wait(&eq_s, "end of stream")?;
            if !(r.is_ok() && r.flags.eof && r.bytes == 0) {
                bail!("after a graceful close, end-of-stream: {r:?}");
            }
            break;
        }
    }
    if !closed {
        let _ = c.close();
    }
    // Whatever was pending ends now, with data that checks out or with an error; nothing hangs.
    for (eq, what) in [(&eq_s, "server"), (&eq_c, "client")] {
        let evs = eq
            .wait_all(Some(Duration::from_secs(60)))
            .with_context(|| format!("{what} after close"))?;
        for e in evs {
            // A zero-length seqpacket message is a message (regression: skipping it made the soak compare the
            // next one against it); end-of-stream is not.
            if e.is_ok() && e.kind == exs::EventKind::Recv && !e.flags.eof {
                check(recv_buf, &e, ty, id, &mut got, &msgs_sent, t)?;
            } else if !e.is_ok() {
                t.failed_ops += 1;
            }
        }
    }
    let _ = s.close();
    Ok(())
}

fn check(
    recv_buf: &MemoryRegion,
    r: &Event,
    ty: SockType,
    id: u64,
    got: &mut u64,
    msgs_sent: &[(u64, usize)],
    t: &mut Totals,
) -> Result<()> {
    if !r.is_ok() {
        t.failed_ops += 1;
        return Ok(());
    }
    let at = r.context as usize * SLOT;
    let mut v = vec![0u8; r.bytes];
    recv_buf.read(at, &mut v)?;
    match ty {
        SockType::Stream => {
            let bad = v
                .iter()
                .enumerate()
                .filter(|(k, b)| **b != byte(id, *got + *k as u64))
                .count();
            t.corrupted += bad as u64;
            *got += r.bytes as u64;
        }
        SockType::SeqPacket => {
            let Some(&(msg_id, len)) = msgs_sent.get(*got as usize) else {
                bail!("a message arrived that was never sent: {r:?}");
            };
            if r.bytes > len || r.flags.truncated != (r.bytes < len) {
                bail!("message {got} of {len} bytes arrived as {r:?}");
            }
            let bad = v
                .iter()
                .enumerate()
                .filter(|(k, b)| **b != byte(msg_id, *k as u64))
                .count();
            t.corrupted += bad as u64;
            *got += 1;
        }
    }
    t.messages += 1;
    t.bytes += r.bytes as u64;
    Ok(())
}

//! `exs soak`: a bounded soak. Connection after connection (random socket type), random message sizes, receive
//! sizes, flags and depths, and random closes from either side with operations pending; every byte that a
//! receive reports is checked against what was sent. Any corrupted byte, lost message, or operation that never
//! completes fails the run.

use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context as _, Result};
use exs::{Context, Event, EventQueue, MemoryRegion, MsgFlags, SockType, Socket};

use crate::backend::{BackendArgs, Opened};
use crate::out::outln;
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
    let bufs = Buffers {
        send: MemoryRegion::alloc(&client, SLOTS * SLOT).context("registering the send buffer")?,
        recv: MemoryRegion::alloc(&server, SLOTS * SLOT)
            .context("registering the receive buffer")?,
    };
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
        one_connection(&opened, (&server, &client), &bufs, ty, &mut rng, &mut t)
            .with_context(|| format!("connection {} ({ty:?})", t.connections))?;
        if last_report.elapsed() > Duration::from_secs(10) {
            crate::log::note(format_args!(
                "soak: {:?} elapsed: {t:?}",
                start.elapsed().as_secs()
            ));
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
        outln!("{v}");
    } else {
        outln!(
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

/// The two buffers every connection of the soak sends from and receives into, `SLOTS` slots of `SLOT` bytes each.
struct Buffers {
    send: MemoryRegion,
    recv: MemoryRegion,
}

/// How a connection was closed in the middle of a batch.
enum MidClose {
    /// The sender closed gracefully with its sends in flight: they are delivered, then end-of-stream.
    Graceful,
    /// The receiver closed or the sender aborted with operations pending: the connection's batches end.
    Cut,
}

/// One connection of the soak: its sockets and queues, and what was sent and received on it.
struct Soaked<'a> {
    ty: SockType,
    /// Names the stream (or, mixed with the message's number, each message) for [`byte`].
    id: u64,
    bufs: &'a Buffers,
    c: Socket,
    s: Socket,
    eq_c: EventQueue,
    eq_s: EventQueue,
    /// Stream: bytes sent so far; seqpacket: messages sent.
    sent: u64,
    /// Stream: bytes received; seqpacket: messages received.
    got: u64,
    /// Seqpacket: (id, len) of each message sent, in order.
    msgs_sent: Vec<(u64, usize)>,
}

fn one_connection(
    opened: &Opened,
    (server, client): (&Context, &Context),
    bufs: &Buffers,
    ty: SockType,
    rng: &mut Rng,
    t: &mut Totals,
) -> Result<()> {
    let mut k = Soaked::open(opened, (server, client), bufs, ty, rng.next())?;
    t.connections += 1;
    let batches = 1 + rng.below(12);
    // Close mid-way (from either side, with operations pending) in a quarter of the connections.
    let close_at = (rng.below(4) == 0).then(|| rng.below(batches));
    let mut closed = false;
    for batch in 0..batches {
        // A batch: up to SLOTS sends in flight, then receives until all of it arrived, then the send events.
        let n = 1 + rng.below(SLOTS as u64) as usize;
        k.send_batch(n, rng)?;
        let mut graceful = false;
        if close_at == Some(batch) {
            t.closes_with_pending += 1;
            closed = true;
            match k.close_mid_way(rng)? {
                MidClose::Graceful => graceful = true,
                MidClose::Cut => break,
            }
        }
        k.receive_batch(rng, t)?;
        k.wait_sends(n, graceful)?;
        if graceful {
            k.expect_end_of_stream()?;
            break;
        }
    }
    if !closed {
        let _ = k.c.close();
    }
    k.drain(t)
}

impl<'a> Soaked<'a> {
    /// A connection of type `ty` from `client` to a listener of `server` (closed once it accepted).
    fn open(
        opened: &Opened,
        (server, client): (&Context, &Context),
        bufs: &'a Buffers,
        ty: SockType,
        id: u64,
    ) -> Result<Soaked<'a>> {
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
        Ok(Soaked {
            ty,
            id,
            bufs,
            c,
            s,
            eq_c,
            eq_s,
            sent: 0,
            got: 0,
            msgs_sent: Vec::new(),
        })
    }

    /// Posts `n` sends of random sizes, one per slot, each filled with its bytes of the stream (or message).
    fn send_batch(&mut self, n: usize, rng: &mut Rng) -> Result<()> {
        for slot in 0..n {
            let mut len = rng.size().min(SLOT);
            if self.ty == SockType::Stream && len == 0 {
                len = 1;
            }
            let msg_id = self.id ^ (self.msgs_sent.len() as u64).wrapping_mul(0x1000_0000_01b3);
            match self.ty {
                SockType::Stream => fill(&self.bufs.send, slot * SLOT, len, self.id, self.sent)?,
                SockType::SeqPacket => fill(&self.bufs.send, slot * SLOT, len, msg_id, 0)?,
            }
            self.c
                .send(
                    &self.eq_c,
                    &self.bufs.send.slice(slot * SLOT..slot * SLOT + len),
                    MsgFlags::NONE,
                    slot as u64,
                )
                .context("send")?;
            match self.ty {
                SockType::Stream => self.sent += len as u64,
                SockType::SeqPacket => {
                    self.msgs_sent.push((msg_id, len));
                    self.sent += 1;
                }
            }
        }
        Ok(())
    }

    /// Closes with the batch in flight: a third of the time the sender gracefully; otherwise, after posting a few
    /// receives, the receiver closes (its pending receives are cancelled, the sender's sends fail) or the sender
    /// aborts.
    fn close_mid_way(&mut self, rng: &mut Rng) -> Result<MidClose> {
        if rng.below(3) == 0 {
            self.c.close().context("close")?;
            return Ok(MidClose::Graceful);
        }
        for slot in 0..rng.below(3) as usize {
            let _ = self.s.recv(
                &self.eq_s,
                &self.bufs.recv.slice(slot * SLOT..slot * SLOT + SLOT),
                MsgFlags::NONE,
                slot as u64,
            );
        }
        if rng.below(2) == 0 {
            self.c.abort()
        } else {
            self.s.close()
        }
        .context("close or abort")?;
        Ok(MidClose::Cut)
    }

    /// Receives until everything sent arrived: seqpacket one receive per message (sometimes too small:
    /// truncation); stream pieces of random size, sometimes MSG_WAITALL. Every byte is checked.
    fn receive_batch(&mut self, rng: &mut Rng, t: &mut Totals) -> Result<()> {
        let mut slot = 0usize;
        while self.got < self.sent {
            let (cap, flags) = self.next_receive(rng);
            self.s
                .recv(
                    &self.eq_s,
                    &self.bufs.recv.slice(slot * SLOT..slot * SLOT + cap),
                    flags,
                    slot as u64,
                )
                .context("recv")?;
            let r = wait(&self.eq_s, "receive")?;
            if !r.is_ok() {
                bail!("a receive failed on an open connection: {r:?}");
            }
            self.check(&r, t)?;
            slot = (slot + 1) % SLOTS;
        }
        Ok(())
    }

    /// The size and flags of the next receive.
    fn next_receive(&self, rng: &mut Rng) -> (usize, MsgFlags) {
        let left = (self.sent - self.got) as usize;
        match self.ty {
            SockType::SeqPacket => {
                let len = self.msgs_sent[self.got as usize].1;
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
        }
    }

    /// The events of the batch's `n` sends: each must have succeeded (`graceful`: the sender closed behind them).
    fn wait_sends(&self, n: usize, graceful: bool) -> Result<()> {
        for _ in 0..n {
            let e = wait(&self.eq_c, "send")?;
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
        Ok(())
    }

    /// After the sender's graceful close, a receive reports end-of-stream.
    fn expect_end_of_stream(&self) -> Result<()> {
        self.s
            .recv(
                &self.eq_s,
                &self.bufs.recv.slice(0..SLOT),
                MsgFlags::NONE,
                0,
            )
            .context("receive after the peer's close")?;
        let r = wait(&self.eq_s, "end of stream")?;
        if !(r.is_ok() && r.flags.eof && r.bytes == 0) {
            bail!("after a graceful close, end-of-stream: {r:?}");
        }
        Ok(())
    }

    /// Whatever was pending ends now, with data that checks out or with an error; nothing hangs.
    fn drain(&mut self, t: &mut Totals) -> Result<()> {
        let within = Some(Duration::from_secs(60));
        let server = self.eq_s.wait_all(within).context("server after close")?;
        self.take_ended(server, t)?;
        let client = self.eq_c.wait_all(within).context("client after close")?;
        self.take_ended(client, t)?;
        let _ = self.s.close();
        Ok(())
    }

    /// Counts the operations that ended with an error and checks the receives that brought data.
    fn take_ended(&mut self, evs: Vec<Event>, t: &mut Totals) -> Result<()> {
        for e in evs {
            // A zero-length seqpacket message is a message (regression: skipping it made the soak compare the
            // next one against it); end-of-stream is not.
            if e.is_ok() && e.kind == exs::EventKind::Recv && !e.flags.eof {
                self.check(&e, t)?;
            } else if !e.is_ok() {
                t.failed_ops += 1;
            }
        }
        Ok(())
    }

    /// Checks a completed receive's bytes against what was sent: a stream's next bytes, or the next message
    /// whole (or truncated, as its receive's size says); a failed receive is counted.
    fn check(&mut self, r: &Event, t: &mut Totals) -> Result<()> {
        if !r.is_ok() {
            t.failed_ops += 1;
            return Ok(());
        }
        let at = r.context as usize * SLOT;
        let mut v = vec![0u8; r.bytes];
        self.bufs.recv.read(at, &mut v)?;
        let got = self.got;
        match self.ty {
            SockType::Stream => {
                let bad = v
                    .iter()
                    .enumerate()
                    .filter(|(k, b)| **b != byte(self.id, got + *k as u64))
                    .count();
                t.corrupted += bad as u64;
                self.got += r.bytes as u64;
            }
            SockType::SeqPacket => {
                let Some(&(msg_id, len)) = self.msgs_sent.get(got as usize) else {
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
                self.got += 1;
            }
        }
        t.messages += 1;
        t.bytes += r.bytes as u64;
        Ok(())
    }
}

//! `exs pump` (the paper's pumpexs, seed 002 section 5): blast messages from a client to a server and report the
//! throughput and each side's CPU use (user + system time over wall time), for message sizes, depths (transfers
//! in flight), send modes (normal, immediate, persistent) and socket types. The server runs in its own process
//! (`exs pump --server`, here or on another host) where the backend allows it, so each side's CPU is its own.

use std::io::Write;
use std::net::SocketAddr;
use std::time::Instant;

use anyhow::{bail, Context as _, Result};
use exs::{EventQueue, MemoryRegion, MsgFlags, Socket, SocketOptions};
use serde::{Deserialize, Serialize};

use crate::backend::{BackendArgs, Opened};
use crate::cli::{self, check_in, MAX_DEPTH, MAX_MESSAGE};
use crate::control::{self, Host, Limits, Params as _, Peer, PeerArgs, Service, Watch};
use crate::opts::{PumpMode, Type, Wait};
use crate::out::outln;
use crate::size::fmt_bytes;
use crate::usage::Usage;
use crate::util::PATIENCE;

#[derive(Clone, Debug, clap::Args)]
pub struct PumpArgs {
    /// Message sizes (comma-separated; K, M suffixes binary).
    #[arg(long, conflicts_with = "server",
          value_delimiter = ',', default_value = "1,1K,64K,1M", value_parser = cli::size_in(1..=MAX_MESSAGE),
          help = cli::help_range("Message sizes (comma-separated; K, M suffixes binary)", 1, MAX_MESSAGE))]
    pub size: Vec<u64>,
    /// Transfers in flight (comma-separated), e.g. 1,2,4,8.
    #[arg(long, conflicts_with = "server", value_delimiter = ',', default_value = "8", value_parser = cli::depth(),
          help = format!("Transfers in flight (comma-separated, e.g. 1,2,4,8), 1 to {MAX_DEPTH}"))]
    pub depth: Vec<usize>,
    /// How to send.
    #[arg(long, conflicts_with = "server", value_enum, default_value_t = PumpMode::Default)]
    pub mode: PumpMode,
    /// Socket type.
    #[arg(long = "type", conflicts_with = "server", value_enum, default_value_t = Type::Seqpacket)]
    pub sock_type: Type,
    /// Seconds per point.
    #[arg(long, conflicts_with = "server", default_value = "2", value_parser = cli::seconds,
          help = format!("Seconds per point (more than 0, at most {})", cli::MAX_SECONDS))]
    pub seconds: f64,
    /// Event-queue wait mode (both sides).
    #[arg(long, conflicts_with = "server", value_enum, default_value_t = Wait::Adaptive)]
    pub wait: Wait,
    /// One JSON object per point on stdout instead of a table (server: one per test served).
    #[arg(long)]
    pub json: bool,
    /// One control message per send and per peer buffer (no coalescing; the default sends messages queued behind
    /// one in flight together).
    #[arg(long, conflicts_with = "server")]
    pub no_coalesce: bool,
    #[command(flatten)]
    pub backend: BackendArgs,
    #[command(flatten)]
    pub peer: PeerArgs,
}

/// One point's parameters, sent by the client to the server.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Point {
    pub size: u64,
    pub depth: usize,
    pub mode: PumpMode,
    #[serde(rename = "type")]
    pub sock_type: Type,
    pub seconds: f64,
    pub wait: Wait,
    /// `--no-coalesce`.
    #[serde(default)]
    pub no_coalesce: bool,
}

impl control::Params for Point {
    /// What both sides refuse; the server also refuses what its limits do not allow.
    fn check(&self, limits: &Limits) -> Result<(), String> {
        check_in("--size", self.size, &(1..=MAX_MESSAGE))?;
        if !(1..=MAX_DEPTH).contains(&(self.depth as u64)) {
            return Err(format!("--depth {}: from 1 to {MAX_DEPTH}", self.depth));
        }
        limits.seconds(self.seconds)?;
        limits.wait(self.wait)?;
        if matches!(self.mode, PumpMode::Immediate | PumpMode::Persistent)
            && self.sock_type == Type::Stream
        {
            return Err("--mode immediate and persistent exist on seqpacket sockets only".into());
        }
        if self.mode == PumpMode::Immediate && self.size > exs::SocketOptions::MAX_SMALL as u64 {
            return Err(format!(
                "{} cannot go as immediate data (at most {} bytes)",
                cli::fmt_size(self.size),
                exs::SocketOptions::MAX_SMALL
            ));
        }
        limits.memory(self.server_memory(limits), "--size x --depth")
    }
}

impl Point {
    /// The buffers the server registers: its receives, a stream's ring, and the connection's control buffers
    /// (which, with the ring, the server's memory budget holds: its --max-memory).
    fn server_memory(&self, limits: &Limits) -> u64 {
        let (ring, ty) = match self.sock_type {
            Type::Stream => (self.stream_ring() as u64, exs::SockType::Stream),
            Type::Seqpacket => (0, exs::SockType::SeqPacket),
        };
        let control = exs::Context::connection_memory(ty, &self.options_on(limits.socket_base(ty)));
        (self.size * self.depth as u64).saturating_add(ring + control)
    }

    /// A stream's ring: two depths' worth, within the library's range.
    fn stream_ring(&self) -> u32 {
        (self.size * self.depth as u64 * 2).clamp(256 << 10, 64 << 20) as u32
    }

    /// Socket options a point needs on both sides (of a checked point: the depth fits the credits), over `base`, a
    /// new socket's own: `--mode default` keeps the threshold the transport chose for it (review finding: the
    /// library's default replaced the transport's, in the very mode that says the transport decides).
    fn options_on(&self, base: SocketOptions) -> SocketOptions {
        let depth = u16::try_from(self.depth).unwrap_or(u16::MAX);
        // Deeper runs need more advertisement credits; shallower ones keep the default window (credits bound the
        // messages between the two applications, not the transfers one application has in flight).
        let credits = depth.max(exs::SocketOptions::default().send_credits);
        let mut v = base.with_send_credits(credits).with_recv_credits(credits);
        match self.mode {
            PumpMode::Immediate => v = v.with_small_packet_max_size(self.size as u32),
            PumpMode::Normal => v = v.with_small_packet_max_size(0),
            _ => {}
        }
        if self.no_coalesce {
            v = v.with_coalesce(false);
        }
        if self.sock_type == Type::Stream {
            v = v.with_stream_buffer_size(self.stream_ring());
        }
        v
    }
}

/// CPU seconds (user + system) this process has used.
pub fn cpu_seconds() -> f64 {
    use nix::sys::resource::{getrusage, UsageWho};
    match getrusage(UsageWho::RUSAGE_SELF) {
        Ok(u) => {
            let t = |tv: nix::sys::time::TimeVal| tv.tv_sec() as f64 + tv.tv_usec() as f64 / 1e6;
            t(u.user_time()) + t(u.system_time())
        }
        Err(_) => 0.0,
    }
}

/// What one side measured.
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize)]
pub struct Side {
    pub bytes: u64,
    pub msgs: u64,
    pub secs: f64,
    /// CPU, context switches and progress wake-ups while it ran.
    pub usage: Usage,
    /// Whether `usage` is the whole process's (a side in its own process) or one thread's.
    pub whole: bool,
    /// Stream mode: bytes sent directly (client) / copied out of the stream buffer (server).
    pub direct: u64,
    pub copied: u64,
}

impl Side {
    fn cpu(&self) -> f64 {
        if self.secs > 0.0 {
            self.usage.cpu / self.secs
        } else {
            0.0
        }
    }
}

/// The server side of `exs pump`.
pub struct Server;

impl Service for Server {
    const TOOL: &'static str = "pump";
    type Params = Point;
    type Report = Side;

    fn serve(
        &self,
        host: &Host,
        p: &Point,
        announce: &mut dyn FnMut(SocketAddr) -> Result<()>,
        watch: &Watch,
    ) -> Result<Side> {
        serve(host, p, announce, watch)
    }
}

/// The server of one point: accepts one connection and receives until the client closes (persistent mode:
/// reads for the point's duration, then closes).
fn serve(
    host: &Host,
    p: &Point,
    announce: &mut dyn FnMut(SocketAddr) -> Result<()>,
    watch: &Watch,
) -> Result<Side> {
    let ctx = &host.ctx;
    let eq = EventQueue::with_mode(p.depth * 2 + 8, p.wait.mode())?;
    let (_listener, s) = crate::util::accept_one(
        ctx,
        p.sock_type.sock(),
        &|base| p.options_on(base),
        host.listen,
        announce,
        watch,
        0,
    )?;
    let (size, depth) = (p.size as usize, p.depth);
    let buf = MemoryRegion::from_dma_buf(ctx, crate::util::filled_buffer(size * depth)?)
        .context("registering the receive buffers")?;
    for i in 0..depth {
        s.recv(
            &eq,
            &buf.slice(i * size..(i + 1) * size),
            MsgFlags::NONE,
            i as u64,
        )
        .context("receive")?;
    }
    let persistent = p.mode == PumpMode::Persistent;
    let whole = host.whole;
    let mut side = Side {
        whole,
        ..Side::default()
    };
    let mut meter = Meter::new(size, persistent);
    let stop = cli::duration(p.seconds);
    loop {
        let ev = crate::util::wait_watching(&eq, watch, "the client's messages")?;
        if !ev.is_ok() || ev.flags.eof {
            break; // the client closed: the point is over
        }
        let since_first = meter.add(ev.bytes as u64, || Usage::now(ctx, whole));
        if persistent && since_first.is_some_and(|d| d >= stop) {
            break;
        }
        let i = ev.context as usize;
        s.recv(
            &eq,
            &buf.slice(i * size..(i + 1) * size),
            MsgFlags::NONE,
            ev.context,
        )
        .context("receive")?;
    }
    meter.finish(&mut side, Usage::now(ctx, whole));
    side.copied = s.stats().map_or(0, |c| c.stream.copied_bytes);
    let _ = s.close();
    Ok(side)
}

/// Messages below this size read the clock only every [`CLOCK_EVERY`] (a reading per message was a measurable part
/// of a 4 KiB message's cost).
const SMALL: usize = 64 << 10;
/// See [`SMALL`].
const CLOCK_EVERY: u64 = 32;

/// What the receiving side of a point counts: the bytes and messages that came by the last reading of the clock,
/// the first message only starting it. Small messages read it only every [`CLOCK_EVERY`] messages after the first
/// [`CLOCK_EVERY`] (a short run still has a rate).
struct Meter {
    every: u64,
    /// The first message's time and the resources used by then.
    start: Option<(Instant, Usage)>,
    /// The last reading of the clock.
    last: Instant,
    bytes: u64,
    msgs: u64,
    counted: (u64, u64),
}

impl Meter {
    fn new(size: usize, persistent: bool) -> Meter {
        Meter {
            every: if size < SMALL && !persistent {
                CLOCK_EVERY
            } else {
                1
            },
            start: None,
            last: Instant::now(),
            bytes: 0,
            msgs: 0,
            counted: (0, 0),
        }
    }

    /// A message of `bytes` came; the time since the first one if the clock was read (`usage`: the resources used
    /// so far, taken at the first).
    fn add(&mut self, bytes: u64, usage: impl FnOnce() -> Usage) -> Option<std::time::Duration> {
        self.bytes += bytes;
        self.msgs += 1;
        if self.msgs > CLOCK_EVERY && self.msgs % self.every != 0 {
            return None;
        }
        let now = Instant::now();
        let (t0, _) = *self.start.get_or_insert_with(|| (now, usage()));
        self.last = now;
        self.counted = (self.bytes, self.msgs);
        Some(now - t0)
    }

    /// Fills `side` in (`usage`: the resources used by now).
    fn finish(self, side: &mut Side, usage: Usage) {
        let Some((t0, u0)) = self.start else {
            return;
        };
        let (bytes, msgs) = self.counted;
        side.secs = (self.last - t0).as_secs_f64();
        side.usage = usage.since(u0);
        // The first message only starts the clock.
        side.bytes = bytes.saturating_sub(bytes / msgs.max(1));
        side.msgs = msgs.saturating_sub(1);
    }
}

/// The client of one point: blasts for the point's duration (persistent: one send, then waits for the server
/// to hang up), then closes. Returns what it measured.
fn blast(
    ctx: &exs::Context,
    (addr, token): (SocketAddr, u64),
    p: &Point,
    whole: bool,
) -> Result<Side> {
    let eq = EventQueue::with_mode(p.depth * 2 + 8, p.wait.mode())?;
    let s = Socket::new(ctx, p.sock_type.sock()).context("creating a socket")?;
    let opts = p.options_on(s.options()?);
    s.set_options(opts)
        .with_context(|| format!("setting {opts:?}"))?;
    crate::util::connect_to_test(ctx, &s, &eq, addr, token)?;
    let (size, depth) = (p.size as usize, p.depth);
    let buf = MemoryRegion::from_dma_buf(ctx, crate::util::filled_buffer(size * depth)?)
        .context("registering the send buffers")?;
    let (t0, u0) = (Instant::now(), Usage::now(ctx, whole));
    let mut side = Side {
        whole,
        ..Side::default()
    };
    if p.mode == PumpMode::Persistent {
        s.send(&eq, &buf.slice(0..size), MsgFlags::PERSISTENT, 0)
            .context("persistent send")?;
        // Wait (blocked, spending nothing) until the server hangs up.
        let probe = MemoryRegion::alloc(ctx, 1)?;
        s.recv(&eq, &probe.all(), MsgFlags::NONE, 1)
            .context("receive")?;
        let _ = eq.next(Some(cli::duration(p.seconds) + PATIENCE));
    } else {
        let stop = cli::duration(p.seconds);
        for i in 0..depth {
            s.send(
                &eq,
                &buf.slice(i * size..(i + 1) * size),
                MsgFlags::NONE,
                i as u64,
            )
            .context("send")?;
        }
        let mut outstanding = depth;
        while outstanding > 0 {
            let ev = eq.next(Some(PATIENCE)).context("sending")?;
            outstanding -= 1;
            ev.status.clone().context("send")?;
            side.bytes += ev.bytes as u64;
            side.msgs += 1;
            if t0.elapsed() < stop {
                let i = ev.context as usize;
                s.send(
                    &eq,
                    &buf.slice(i * size..(i + 1) * size),
                    MsgFlags::NONE,
                    ev.context,
                )
                .context("send")?;
                outstanding += 1;
            }
        }
    }
    side.secs = t0.elapsed().as_secs_f64();
    side.usage = Usage::now(ctx, whole).since(u0);
    side.direct = s.stats().map_or(0, |c| c.stream.direct_bytes);
    let _ = s.close();
    Ok(side)
}

/// One measured point, as reported.
#[derive(Clone, Debug)]
pub struct Measured {
    pub point: Point,
    pub client: Side,
    pub server: Side,
}

impl Measured {
    pub fn throughput(&self) -> f64 {
        if self.server.secs > 0.0 {
            self.server.bytes as f64 / self.server.secs
        } else {
            0.0
        }
    }

    pub fn json(&self, backend: &str, server_backend: &str) -> serde_json::Value {
        let p = &self.point;
        let mut v = serde_json::json!({
            "tool": "exs-pump",
            "backend": backend,
            "server_backend": server_backend,
            "size": p.size,
            "depth": p.depth,
            "mode": p.mode.to_string(),
            "type": p.sock_type.to_string(),
            "wait": p.wait.to_string(),
            "bytes_per_sec": self.throughput(),
            "bytes": self.server.bytes,
            "msgs": self.server.msgs,
            "secs": self.server.secs,
            "cpu_client": self.client.cpu(),
            "cpu_server": self.server.cpu(),
        });
        let map = v.as_object_mut().expect("an object");
        let msgs = self.server.msgs.max(self.client.msgs);
        self.client.usage.per_msg_json("client_", msgs, map);
        self.server.usage.per_msg_json("server_", msgs, map);
        let switches = self
            .client
            .usage
            .switches(self.client.whole)
            .saturating_add(self.server.usage.switches(self.server.whole));
        map.insert(
            "ctx_switches_per_msg".into(),
            (switches as f64 / msgs.max(1) as f64).into(),
        );
        // Issue 13: memory registered on the data path, both sides, per message (0: registered once, exposed
        // by window binds or per-connection keys).
        let regs =
            (self.client.usage.registrations).saturating_add(self.server.usage.registrations);
        map.insert(
            "registrations_per_msg".into(),
            (regs as f64 / msgs.max(1) as f64).into(),
        );
        if p.sock_type == Type::Stream && self.client.bytes > 0 {
            // Issue 14: the share of bytes written straight into posted receives, and copies per byte received
            // (each indirect byte is copied once, out of the stream buffer; over the whole run, warm-up included).
            let sent = self.client.bytes as f64;
            map.insert(
                "direct_share".into(),
                (self.client.direct as f64 / sent).into(),
            );
            map.insert(
                "copies_per_byte".into(),
                (self.server.copied as f64 / sent).into(),
            );
        }
        v
    }
}

/// Runs one point: the server measures its side, this client its own.
fn point(peer: &mut Peer, ctx: &exs::Context, whole: bool, p: &Point) -> Result<Measured> {
    let target = peer.start(p)?;
    let client = match blast(ctx, target, p, whole) {
        Ok(c) => c,
        Err(e) => return Err(peer.explain(e)),
    };
    let server: Side = peer.finish()?;
    timed(&server, p)?;
    Ok(Measured {
        point: p.clone(),
        client,
        server,
    })
}

/// Refuses a point whose server got fewer than two messages: the first only starts the clock, so there is no
/// rate to report (review finding: it printed a rate of nothing and the run exited 0).
fn timed(server: &Side, p: &Point) -> Result<()> {
    if server.msgs == 0 {
        bail!(
            "{} at depth {}: the server got fewer than two messages in {} s, too few to time; give more --seconds \
             or a smaller --size",
            cli::fmt_size(p.size),
            p.depth,
            p.seconds
        );
    }
    Ok(())
}

/// The points of a run, checked as the server will (with the widest limits), and notes of sizes skipped
/// because they cannot go as immediate data. Its errors are usage errors.
pub fn points(a: &PumpArgs) -> Result<(Vec<Point>, Vec<String>), String> {
    let (mut points, mut skipped) = (Vec::new(), Vec::new());
    for &size in &a.size {
        for &depth in &a.depth {
            let p = Point {
                size,
                depth,
                mode: a.mode,
                sock_type: a.sock_type,
                seconds: a.seconds,
                wait: a.wait,
                no_coalesce: a.no_coalesce,
            };
            match p.check(&Limits::widest()) {
                Ok(()) => points.push(p),
                // The default sizes go past the immediate limit: say which are left out, and why.
                Err(e)
                    if p.mode == PumpMode::Immediate
                        && p.sock_type == Type::Seqpacket
                        && size > exs::SocketOptions::MAX_SMALL as u64 =>
                {
                    if !skipped.contains(&e) {
                        skipped.push(e);
                    }
                }
                Err(e) => return Err(e),
            }
        }
    }
    if points.is_empty() {
        return Err(format!(
            "no --size fits immediate data (at most {} bytes)",
            exs::SocketOptions::MAX_SMALL
        ));
    }
    Ok((points, skipped))
}

pub fn run(a: PumpArgs) -> Result<()> {
    if a.peer.server {
        return control::serve(Server, &a.backend, &a.peer, a.json);
    }
    let (points, skipped) = points(&a).map_err(anyhow::Error::msg)?;
    for note in skipped {
        crate::log::note(format_args!("pump: {note}; skipped"));
    }
    let opened = Opened::open(&a.backend)?;
    // This side first: a missing provider or device is reported here, with what exists.
    let ctx = opened.host()?;
    let whole = opened.processes();
    let mut peer = Peer::open(Server, &a.peer, &a.backend, &opened)?;
    if !a.json {
        outln!(
            "{:>10} {:>5} {:>10} {:>9} {:>12} {:>12} {:>11} {:>11}",
            "size",
            "depth",
            "mode",
            "type",
            "MB/s",
            "msgs/s",
            "cpu client",
            "cpu server"
        );
    }
    let bar = crate::progress::points(points.len());
    bar.set_prefix("pump");
    for p in &points {
        // Nobody reads the results any more (`| head -1`): the next point would be measured for nothing.
        if crate::out::gone() {
            break;
        }
        bar.set_message(format!(
            "{} depth {}, {:.1} s",
            fmt_bytes(p.size),
            p.depth,
            p.seconds
        ));
        let m = point(&mut peer, &ctx, whole, p)?;
        bar.inc(1);
        let j = m.json(&opened.label(), &peer.server_backend);
        bar.suspend(|| {
            if a.json {
                outln!("{j}");
            } else {
                outln!(
                    "{:>10} {:>5} {:>10} {:>9} {:>12.1} {:>12.0} {:>10.0}% {:>10.0}%",
                    fmt_bytes(p.size),
                    p.depth,
                    p.mode,
                    p.sock_type,
                    m.throughput() / 1e6,
                    m.server.msgs as f64 / m.server.secs.max(1e-9),
                    m.client.cpu() * 100.0,
                    m.server.cpu() * 100.0
                );
            }
            let _ = std::io::stdout().flush();
        });
    }
    bar.finish_and_clear();
    peer.close()
}

#[cfg(test)]
mod tests {
    use super::{Meter, Side, CLOCK_EVERY};
    use crate::usage::Usage;

    /// Review finding: `--mode default`, whose help says the transport's immediate-data threshold decides, set
    /// the library's default over the transport's (higher on libfabric tcp). The point's options are now laid
    /// over the socket's own.
    #[test]
    fn the_default_mode_keeps_the_transports_threshold() {
        use crate::opts::PumpMode;
        let point = |mode| super::Point {
            size: 1024,
            depth: 8,
            mode,
            sock_type: crate::opts::Type::Seqpacket,
            seconds: 1.0,
            wait: crate::opts::Wait::Adaptive,
            no_coalesce: false,
        };
        let transports = exs::SocketOptions::default().with_small_packet_max_size(4096);
        let t = |mode| point(mode).options_on(transports).small_packet_max_size;
        assert_eq!(t(PumpMode::Default), 4096);
        assert_eq!(t(PumpMode::Normal), 0);
        assert_eq!(t(PumpMode::Immediate), 1024);
    }

    /// Review finding: the server counted a test's connection memory over the library's default threshold, but
    /// its connections take the transport's (higher on libfabric tcp), whose control buffers are larger.
    #[test]
    fn the_servers_memory_check_counts_its_transports_threshold() {
        let p = super::Point {
            size: 64,
            depth: 64,
            mode: crate::opts::PumpMode::Default,
            sock_type: crate::opts::Type::Seqpacket,
            seconds: 1.0,
            wait: crate::opts::Wait::Adaptive,
            no_coalesce: false,
        };
        let client = crate::control::Limits::widest();
        let server = crate::control::Limits {
            transport_threshold: Some(4096),
            ..crate::control::Limits::widest()
        };
        assert!(
            p.server_memory(&server) > 2 * p.server_memory(&client),
            "the larger control buffers count"
        );
    }

    /// Review finding: a point whose server got one message (the first only starts the clock) printed a rate of
    /// nothing and the run exited 0; it is an error that says why.
    #[test]
    fn a_point_with_one_message_is_too_short_to_time() {
        let p = super::Point {
            size: 16 << 20,
            depth: 1,
            mode: crate::opts::PumpMode::Default,
            sock_type: crate::opts::Type::Seqpacket,
            seconds: 0.01,
            wait: crate::opts::Wait::Adaptive,
            no_coalesce: false,
        };
        let e = super::timed(&run(16 << 20, false, 1), &p).unwrap_err();
        assert!(e.to_string().contains("too few to time"), "{e}");
        assert!(super::timed(&run(16 << 20, false, 2), &p).is_ok());
    }

    fn run(size: usize, persistent: bool, msgs: u64) -> Side {
        let mut meter = Meter::new(size, persistent);
        for _ in 0..msgs {
            meter.add(size as u64, Usage::default);
            std::thread::sleep(std::time::Duration::from_micros(50));
        }
        let mut side = Side::default();
        meter.finish(&mut side, Usage::default());
        side
    }

    /// Small messages read the clock on each of the first `CLOCK_EVERY` and then every `CLOCK_EVERY`: a short run
    /// still has a rate, and a long one counts the messages up to the last reading (the first only starts the
    /// clock); large messages and persistent runs read it on every message.
    #[test]
    fn the_pump_server_counts_what_came_by_its_last_clock_reading() {
        let short = run(4096, false, 5);
        assert_eq!((short.msgs, short.bytes), (4, 4 * 4096));
        assert!(short.secs > 0.0);
        let long = run(4096, false, 2 * CLOCK_EVERY + 7);
        assert_eq!(long.msgs, 2 * CLOCK_EVERY - 1);
        assert_eq!(long.bytes, (2 * CLOCK_EVERY - 1) * 4096);
        let large = run(1 << 20, false, CLOCK_EVERY + 3);
        assert_eq!(large.msgs, CLOCK_EVERY + 2);
        let persistent = run(4096, true, CLOCK_EVERY + 3);
        assert_eq!(persistent.msgs, CLOCK_EVERY + 2);
        assert_eq!(run(4096, false, 0).msgs, 0);
    }
}

//! `exs ping`: one-way latency as half the round trip of a message echoed by the server, averaged over many
//! pings (seed 002, Figure 10), for normal sends (advert + RDMA read), immediate sends (data in the advert), and
//! persistent sends (each receive is one RDMA read of the peer's persistent memory: reported as the time per
//! read, which is a full round trip, like `ib_read_lat`). The echo side is `exs ping --server`, here or on
//! another host.

use std::io::Write;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _, Result};
use clap::builder::RangedU64ValueParser;
use exs::{EventQueue, MemoryRegion, MsgFlags, SockType, Socket, SocketOptions, WaitMode};
use serde::{Deserialize, Serialize};

use crate::backend::{BackendArgs, Opened};
use crate::cli::{self, check_in, MAX_COUNT, MAX_MESSAGE};
use crate::control::{self, Host, Limits, Params as _, Peer, PeerArgs, Service, Watch};
use crate::opts::{PingMode, Wait};
use crate::out::outln;
use crate::usage::Usage;

#[derive(Clone, Debug, clap::Args)]
pub struct PingArgs {
    /// Payload sizes (comma-separated).
    #[arg(long, conflicts_with = "server",
          value_delimiter = ',', default_value = "1,10,100,1K", value_parser = cli::size_in(0..=MAX_MESSAGE),
          help = cli::help_range("Payload sizes (comma-separated; K, M suffixes binary)", 0, MAX_MESSAGE))]
    pub size: Vec<u64>,
    /// How to send.
    #[arg(long, conflicts_with = "server", value_enum, default_value_t = PingMode::Immediate)]
    pub mode: PingMode,
    /// Pings per size (after 10% warm-up).
    #[arg(long, conflicts_with = "server", default_value_t = 2000, value_parser = cli::count_in(1..=MAX_COUNT),
          help = format!("Pings per size, counted after a warm-up of a tenth more, 1 to {MAX_COUNT}"))]
    pub count: u64,
    /// Event-queue wait mode (both sides; in persistent mode on verbs the server, which has nothing to do, sleeps).
    #[arg(long, conflicts_with = "server", value_enum, default_value_t = Wait::Busy)]
    pub wait: Wait,
    /// One JSON object per size on stdout (server: one per test served).
    #[arg(long)]
    pub json: bool,
    /// Idle connections (of the same socket type) that both sides hold open on the same contexts while the ping
    /// runs: what one operation costs must not grow with connections that do nothing.
    #[arg(long, conflicts_with = "server",
          default_value_t = 0, value_parser = RangedU64ValueParser::<u32>::new().range(0..=cli::max_idle()),
          help = format!("Idle connections both sides hold open beside the ping (what one operation costs must \
                          not grow with connections that do nothing), 0 to {}", cli::max_idle()))]
    pub idle: u32,
    #[command(flatten)]
    pub backend: BackendArgs,
    #[command(flatten)]
    pub peer: PeerArgs,
}

/// One size's parameters, sent by the client to the server.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Point {
    pub size: u64,
    pub mode: PingMode,
    pub wait: Wait,
    /// Pings counted (the warm-up comes on top: [`rounds`]).
    pub count: u64,
    /// Idle connections held beside the ping (opened after it, closed before it ends).
    #[serde(default)]
    pub idle: u32,
}

/// The warm-up pings and all the pings of a test of `count`.
pub fn rounds(count: u64) -> (u64, u64) {
    let warm = count / 10 + 1;
    (warm, warm + count)
}

impl control::Params for Point {
    fn check(&self, limits: &Limits) -> Result<(), String> {
        check_in("--size", self.size, &(0..=MAX_MESSAGE))?;
        if self.mode == PingMode::Immediate && self.size > exs::SocketOptions::MAX_SMALL as u64 {
            return Err(format!(
                "{} cannot go as immediate data (at most {} bytes)",
                cli::fmt_size(self.size),
                exs::SocketOptions::MAX_SMALL
            ));
        }
        limits.count(self.count)?;
        limits.idle(self.idle)?;
        limits.wait(self.wait)?;
        limits.memory(self.size, "--size")?;
        // The connections' control buffers, the ping's and the idle ones' (a review found them uncounted: a
        // server's budget was 64 GiB, and `--idle` at 32 KiB pings about 1 MiB a connection).
        let base = limits.socket_base(SockType::SeqPacket);
        let per = exs::Context::connection_memory(SockType::SeqPacket, &self.options_on(base));
        limits.memory(
            per.saturating_mul(u64::from(self.idle) + 1),
            "--idle with --size (each connection's control buffers)",
        )
    }
}

impl Point {
    /// The options of the test's connection, over `base`, a new socket's own: a persistent ping keeps the
    /// threshold the transport chose (review finding: the library's default replaced it).
    fn options_on(&self, base: SocketOptions) -> SocketOptions {
        let o = base;
        let o = match self.mode {
            PingMode::Immediate => o.with_small_packet_max_size(self.size as u32),
            PingMode::Normal => o.with_small_packet_max_size(0),
            PingMode::Persistent => o,
        };
        if self.idle > 0 {
            // The idle connections' requests queue while the server's accepts are on their way; never less than
            // the default (review finding: `--idle 1` had a backlog of 2, which two strangers' connections beside
            // those whose tokens were being read filled, and the client's own was refused).
            let backlog = self.idle.saturating_add(1).max(o.backlog).min(65535);
            return o.with_backlog(backlog);
        }
        o
    }
}

/// What the echo side reports: its usage over all its pings (warm-up included), and how many.
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize)]
pub struct Echoed {
    pub usage: Usage,
    pub pings: u64,
    /// What the idle connections cost the server, if there were any.
    #[serde(default)]
    pub idle: Option<crate::idle::IdleCost>,
}

/// The echo side of `exs ping`.
pub struct Server;

impl Service for Server {
    const TOOL: &'static str = "ping";
    type Params = Point;
    type Report = Echoed;

    fn serve(
        &self,
        host: &Host,
        p: &Point,
        announce: &mut dyn FnMut(SocketAddr) -> Result<()>,
        watch: &Watch,
    ) -> Result<Echoed> {
        echo(host, p, announce, watch)
    }
}

/// Returns every message (normal, immediate), or keeps one persistent send up (persistent) until the client
/// closes.
fn echo(
    host: &Host,
    p: &Point,
    announce: &mut dyn FnMut(SocketAddr) -> Result<()>,
    watch: &Watch,
) -> Result<Echoed> {
    let ctx = &host.ctx;
    let size = p.size as usize;
    // Persistent: the client reads this side's memory. Where the device serves the reads, this side has nothing
    // to do but wait for the hang-up, so it sleeps whatever the wait mode (a busy poller would only take a CPU from
    // the reads' own work: rxe's and siw's are kernel code); a software provider serves them in this process.
    let wait = match p.mode {
        PingMode::Persistent if host.device_serves_peers => WaitMode::Block,
        _ => p.wait.mode(),
    };
    let eq = EventQueue::with_mode(16, wait)?;
    let whole = host.whole;
    let before = crate::idle::Before::now(ctx);
    let (mut admission, s) = crate::util::accept_one(
        ctx,
        SockType::SeqPacket,
        &|base| p.options_on(base),
        host.listen,
        announce,
        watch,
        p.idle as usize,
    )?;
    // The client opens its idle connections once the ping connection is up; they stay until it ends.
    let _idle = crate::idle::accept(&mut admission, p.idle as usize, watch)?;
    let idle = (p.idle > 0).then(|| before.cost(ctx, p.idle as usize));
    let buf = MemoryRegion::alloc(ctx, size.max(1)).context("registering the echo buffer")?;
    if p.mode == PingMode::Persistent {
        s.send(&eq, &buf.all(), MsgFlags::PERSISTENT, 0)
            .context("persistent send")?;
        let probe = MemoryRegion::alloc(ctx, 1)?;
        s.recv(&eq, &probe.all(), MsgFlags::NONE, 1)
            .context("receive")?;
        let u0 = Usage::now(ctx, whole);
        // Until the client hangs up (or goes away altogether, or the time is up).
        while eq.next(Some(Duration::from_secs(1))).is_err() {
            watch.check("the client to finish reading")?;
        }
        return Ok(Echoed {
            usage: Usage::now(ctx, whole).since(u0),
            pings: 0,
            idle,
        });
    }
    // Counted from the first message on (the connection's set-up is not a round trip).
    let mut start = None;
    let mut pings = 0u64;
    let (_, all) = rounds(p.count);
    loop {
        s.recv(&eq, &buf.all(), MsgFlags::NONE, 1)
            .context("receive")?;
        let r = crate::util::wait_watching(&eq, watch, "a ping")?;
        let u0 = *start.get_or_insert_with(|| Usage::now(ctx, whole));
        if !r.is_ok() || r.flags.eof {
            return Ok(Echoed {
                usage: Usage::now(ctx, whole).since(u0),
                pings,
                idle,
            });
        }
        if pings == all {
            bail!("the client sent more than the {all} pings it asked for");
        }
        s.send(&eq, &buf.slice(..r.bytes), MsgFlags::NONE, 2)
            .context("echo")?;
        let e = crate::util::wait_watching(&eq, watch, "an echo to complete")?;
        pings += 1;
        if !e.is_ok() {
            return Ok(Echoed {
                usage: Usage::now(ctx, whole).since(u0),
                pings,
                idle,
            });
        }
    }
}

/// Measured latency of one size.
#[derive(Clone, Debug)]
pub struct Latency {
    /// One-way (normal, immediate) or per-read (persistent) microseconds: mean, median, p99.
    pub mean_us: f64,
    pub median_us: f64,
    pub p99_us: f64,
    /// The pinging side over the counted pings.
    pub client: Usage,
    /// The echoing side over all its pings (warm-up included), and how many.
    pub server: Echoed,
    /// Whether each side's usage is its whole process's.
    pub whole: bool,
    /// What the client's idle connections cost it, and how long closing them took.
    pub idle: Option<IdleHeld>,
}

/// What the pinging side's idle connections cost it, and the seconds closing them took.
pub type IdleHeld = (crate::idle::IdleCost, f64);

impl Latency {
    /// Context switches per round trip, both sides.
    pub fn switches_per_rt(&self, count: u64) -> f64 {
        self.client.switches(self.whole) as f64 / count.max(1) as f64
            + self.server.usage.switches(self.whole) as f64 / self.server_msgs(count) as f64
    }

    /// What the echoing side's usage is divided by: its pings, or for persistent reads (the server sends no
    /// message; it only exposes memory) the reads the client made of it while the server measured, warm-up
    /// included (review finding: divided by the measured reads alone, it read a tenth high).
    fn server_msgs(&self, count: u64) -> u64 {
        match self.server.pings {
            0 => rounds(count).1.max(1),
            n => n,
        }
    }
}

fn pinger(
    ctx: &exs::Context,
    (addr, token): (SocketAddr, u64),
    p: &Point,
    whole: bool,
) -> Result<(Vec<f64>, Usage, Option<IdleHeld>)> {
    let size = p.size as usize;
    let persistent = p.mode == PingMode::Persistent;
    let eq = EventQueue::with_mode(16, p.wait.mode())?;
    let s = Socket::new(ctx, SockType::SeqPacket).context("creating a socket")?;
    let opts = p.options_on(s.options()?);
    s.set_options(opts)
        .with_context(|| format!("setting {opts:?}"))?;
    crate::util::connect_to_test(ctx, &s, &eq, addr, token)?;
    let idle = (p.idle > 0)
        .then(|| -> Result<_> {
            let before = crate::idle::Before::now(ctx);
            let socks =
                crate::idle::connect(ctx, SockType::SeqPacket, addr, p.idle as usize, token)?;
            Ok((before, before.cost(ctx, socks.len()), socks))
        })
        .transpose()?;
    let out = MemoryRegion::from_vec(ctx, vec![0x42; size.max(1)])?;
    let back = MemoryRegion::alloc(ctx, size.max(1))?;
    let (warm, all) = rounds(p.count);
    let mut samples = Vec::with_capacity(p.count as usize);
    let mut u0 = Usage::default();
    let want = if persistent { 1 } else { 2 };
    let mut evs = Vec::new();
    let mut window = crate::util::PerfWindow::from_env()?;
    window.enable()?;
    for i in 0..all {
        if i == warm {
            u0 = Usage::now(ctx, whole);
        }
        let t0 = Instant::now();
        s.recv(&eq, &back.slice(..size.max(1)), MsgFlags::NONE, 1)
            .context("receive")?;
        if !persistent {
            s.send(&eq, &out.slice(..size), MsgFlags::NONE, 2)
                .context("send")?;
        }
        evs.clear();
        eq.dequeue(&mut evs, want, want, Some(Duration::from_secs(30)))
            .with_context(|| format!("ping {i}"))?;
        for ev in &evs {
            ev.status.clone().with_context(|| format!("ping {i}"))?;
            if ev.flags.eof {
                bail!("ping {i}: the server closed the connection");
            }
        }
        if evs.len() < want {
            bail!("ping {i}: no answer within 30 s");
        }
        let dt = t0.elapsed().as_secs_f64() * 1e6;
        if i >= warm {
            samples.push(if persistent { dt } else { dt / 2.0 });
        }
    }
    window.disable()?;
    let usage = Usage::now(ctx, whole).since(u0);
    let _ = s.close();
    let idle = match idle {
        Some((before, cost, socks)) => Some((cost, crate::idle::close(ctx, socks, &before)?)),
        None => None,
    };
    Ok((samples, usage, idle))
}

/// One size against the server.
fn measure(peer: &mut Peer, ctx: &exs::Context, whole: bool, p: &Point) -> Result<Latency> {
    let target = peer.start(p)?;
    let (mut samples, client, idle) = match pinger(ctx, target, p, whole) {
        Ok(r) => r,
        Err(e) => return Err(peer.explain(e)),
    };
    let server: Echoed = peer.finish()?;
    samples.sort_by(f64::total_cmp);
    let n = samples.len().max(1);
    Ok(Latency {
        mean_us: samples.iter().sum::<f64>() / n as f64,
        median_us: samples.get(n / 2).copied().unwrap_or(0.0),
        p99_us: samples.get(n * 99 / 100).copied().unwrap_or(0.0),
        client,
        server,
        whole,
        idle,
    })
}

/// One size's JSON line: latency, and per round trip (both sides) context switches and progress wake-ups.
pub fn ping_json(l: &Latency, backend: &str, server_backend: &str, p: &Point) -> serde_json::Value {
    let count = p.count;
    let mut v = serde_json::json!({"tool": "exs-ping", "backend": backend, "server_backend": server_backend,
        "size": p.size, "mode": p.mode.to_string(), "wait": p.wait.to_string(), "count": count,
        "mean_us": l.mean_us, "median_us": l.median_us, "p99_us": l.p99_us,
        "ctx_switches_per_rt": l.switches_per_rt(count),
        "cpu_client_s": l.client.cpu, "cpu_server_s": l.server.usage.cpu, "server_pings": l.server.pings});
    let map = v.as_object_mut().expect("an object");
    l.client.per_msg_json("client_", count, map);
    l.server
        .usage
        .per_msg_json("server_", l.server_msgs(count), map);
    if let Some((c, close_secs)) = &l.idle {
        map.insert("idle".into(), c.n.into());
        map.insert("idle_open_secs".into(), c.open_secs.into());
        map.insert("idle_close_secs".into(), (*close_secs).into());
        map.insert(
            "client_idle_engine_bytes_per_conn".into(),
            c.engine_bytes_per_conn.into(),
        );
        map.insert(
            "client_idle_rss_bytes_per_conn".into(),
            c.rss_bytes_per_conn.into(),
        );
    }
    if let Some(c) = &l.server.idle {
        map.insert(
            "server_idle_engine_bytes_per_conn".into(),
            c.engine_bytes_per_conn.into(),
        );
        map.insert(
            "server_idle_rss_bytes_per_conn".into(),
            c.rss_bytes_per_conn.into(),
        );
    }
    v
}

/// The sizes of a run, checked as the server will (with the widest limits), and notes of sizes skipped because
/// they cannot go as immediate data. Its errors are usage errors.
pub fn points(a: &PingArgs) -> Result<(Vec<Point>, Vec<String>), String> {
    let (mut points, mut skipped) = (Vec::new(), Vec::new());
    for &size in &a.size {
        let p = Point {
            size,
            mode: a.mode,
            wait: a.wait,
            count: a.count,
            idle: a.idle,
        };
        match p.check(&Limits::widest()) {
            Ok(()) => points.push(p),
            Err(e)
                if p.mode == PingMode::Immediate && size > exs::SocketOptions::MAX_SMALL as u64 =>
            {
                skipped.push(e)
            }
            Err(e) => return Err(e),
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

pub fn run(a: PingArgs) -> Result<()> {
    if a.peer.server {
        return control::serve(Server, &a.backend, &a.peer, a.json);
    }
    let (points, skipped) = points(&a).map_err(anyhow::Error::msg)?;
    for note in skipped {
        crate::log::note(format_args!("ping: {note}; skipped"));
    }
    let opened = Opened::open(&a.backend)?;
    let count = a.count;
    let ctx = opened.host()?;
    let whole = opened.processes();
    let mut peer = Peer::open(Server, &a.peer, &a.backend, &opened)?;
    if !a.json {
        outln!(
            "{:>8} {:>10} {:>10} {:>10} {:>10}",
            "size",
            "mode",
            "mean us",
            "median us",
            "p99 us"
        );
    }
    let bar = crate::progress::points(points.len());
    bar.set_prefix("ping");
    for p in &points {
        // Nobody reads the results any more (`| head -1`): the next point would be measured for nothing.
        if crate::out::gone() {
            break;
        }
        bar.set_message(format!("{} B, {count} pings", p.size));
        let l = measure(&mut peer, &ctx, whole, p)?;
        bar.inc(1);
        bar.suspend(|| {
            if a.json {
                outln!(
                    "{}",
                    ping_json(&l, &opened.label(), &peer.server_backend, p)
                );
            } else {
                outln!(
                    "{:>8} {:>10} {:>10.2} {:>10.2} {:>10.2}",
                    p.size,
                    p.mode,
                    l.mean_us,
                    l.median_us,
                    l.p99_us
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
    use super::*;

    /// Review finding: a persistent ping's server measures over every read, warm-up included, but its figures
    /// per read were divided by the measured reads alone.
    #[test]
    fn a_persistent_servers_usage_is_per_read_it_served() {
        let l = Latency {
            mean_us: 0.0,
            median_us: 0.0,
            p99_us: 0.0,
            client: Usage::default(),
            server: Echoed::default(),
            whole: true,
            idle: None,
        };
        assert_eq!(
            l.server_msgs(100),
            111,
            "100 measured reads and 11 of warm-up"
        );
        let echoed = Latency {
            server: Echoed {
                pings: 42,
                ..Echoed::default()
            },
            ..l
        };
        assert_eq!(echoed.server_msgs(100), 42, "an echo server counts its own");
    }
}

//! `exs ping`: one-way latency as half the round trip of a message echoed by the server, averaged over many
//! pings (seed 002, Figure 10), for normal sends (advert + RDMA read), immediate sends (data in the advert), and
//! persistent sends (each receive is one RDMA read of the peer's persistent memory: reported as the time per
//! read, which is a full round trip, like `ib_read_lat`).

use std::io::Write;
use std::process::Command;
use std::time::{Duration, Instant};

use exs::{EventQueue, MemoryRegion, MsgFlags, SockType, Socket, SocketOption};

use crate::usage::Usage;
use crate::backend::{BackendArgs, Opened};
use crate::pump::wait_mode;

#[derive(Clone, Debug, clap::Args)]
pub struct PingArgs {
    #[command(flatten)]
    pub backend: BackendArgs,
    /// Payload sizes (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "1,10,100,1K", value_parser = crate::util::parse_size)]
    pub size: Vec<u64>,
    /// normal, immediate or persistent.
    #[arg(long, default_value = "immediate")]
    pub mode: String,
    /// Pings per size (after 10% warm-up).
    #[arg(long, default_value_t = 2000)]
    pub count: usize,
    /// Event-queue wait mode: adaptive, block, busy.
    #[arg(long, default_value = "busy")]
    pub wait: String,
    /// One JSON object per size on stdout.
    #[arg(long)]
    pub json: bool,
}

#[derive(Clone, Debug, clap::Args)]
pub struct PingServerArgs {
    #[command(flatten)]
    pub backend: BackendArgs,
    #[arg(long, value_parser = crate::util::parse_size)]
    pub ping_size: u64,
    #[arg(long)]
    pub ping_mode: String,
    #[arg(long)]
    pub ping_wait: String,
}

fn options(mode: &str, size: u64) -> Vec<SocketOption> {
    match mode {
        "immediate" => vec![SocketOption::SmallPacketMaxSize(size as u32)],
        "normal" => vec![SocketOption::SmallPacketMaxSize(0)],
        _ => vec![],
    }
}

/// The echo side: returns every message (normal, immediate), or keeps one persistent send up (persistent).
pub fn server(a: PingServerArgs) -> Result<(), String> {
    let opened = Opened::open(&a.backend)?;
    let ctx = opened.host()?;
    let (usage, pings) = echo(
        &opened,
        &ctx,
        a.ping_size as usize,
        &a.ping_mode,
        &a.ping_wait,
        &mut |addr| {
            println!("LISTEN {addr}");
            let _ = std::io::stdout().flush();
        },
    )?;
    println!("USAGE {} {pings}", usage.to_fields());
    Ok(())
}

fn echo(
    opened: &Opened,
    ctx: &exs::Context,
    size: usize,
    mode: &str,
    wait: &str,
    announce: &mut dyn FnMut(std::net::SocketAddr),
) -> Result<(Usage, u64), String> {
    let eq = EventQueue::with_mode(16, wait_mode(wait)?);
    let whole = opened.processes();
    let (_listener, s) = crate::util::accept_one(
        ctx,
        SockType::SeqPacket,
        options(mode, size as u64),
        opened.listen_addr(0),
        &eq,
        announce,
    )?;
    let buf = MemoryRegion::alloc(ctx, size.max(1)).map_err(|e| e.to_string())?;
    if mode == "persistent" {
        s.send(&eq, &buf.all(), MsgFlags::PERSISTENT, 0)
            .map_err(|e| e.to_string())?;
        let probe = MemoryRegion::alloc(ctx, 1).map_err(|e| e.to_string())?;
        s.recv(&eq, &probe.all(), MsgFlags::NONE, 1)
            .map_err(|e| e.to_string())?;
        let u0 = Usage::now(ctx, whole);
        let _ = eq.next(None);
        return Ok((Usage::now(ctx, whole).since(u0), 0));
    }
    // Counted from the first message on (the connection's set-up is not a round trip).
    let mut start = None;
    let mut pings = 0u64;
    loop {
        s.recv(&eq, &buf.all(), MsgFlags::NONE, 1)
            .map_err(|e| e.to_string())?;
        let r = eq.next(None).map_err(|e| e.to_string())?;
        let u0 = *start.get_or_insert_with(|| Usage::now(ctx, whole));
        if !r.is_ok() || r.flags.eof {
            return Ok((Usage::now(ctx, whole).since(u0), pings));
        }
        s.send(&eq, &buf.slice(..r.bytes), MsgFlags::NONE, 2)
            .map_err(|e| e.to_string())?;
        let e = eq.next(None).map_err(|e| e.to_string())?;
        pings += 1;
        if !e.is_ok() {
            return Ok((Usage::now(ctx, whole).since(u0), pings));
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
    pub server: Usage,
    pub server_pings: u64,
    /// Whether each side's usage is its whole process's.
    pub whole: bool,
}

impl Latency {
    /// Context switches per round trip, both sides.
    pub fn switches_per_rt(&self, count: usize) -> f64 {
        self.client.switches(self.whole) as f64 / count.max(1) as f64
            + self.server.switches(self.whole) as f64 / self.server_pings.max(1) as f64
    }
}

fn pinger(
    ctx: &exs::Context,
    addr: std::net::SocketAddr,
    size: usize,
    mode: &str,
    wait: &str,
    count: usize,
    whole: bool,
) -> Result<(Vec<f64>, Usage), String> {
    let eq = EventQueue::with_mode(16, wait_mode(wait)?);
    let s = Socket::new(ctx, SockType::SeqPacket).map_err(|e| e.to_string())?;
    for o in options(mode, size as u64) {
        s.set_option(o).map_err(|e| e.to_string())?;
    }
    s.connect(addr, &eq, 0).map_err(|e| e.to_string())?;
    eq.next(Some(Duration::from_secs(60)))
        .map_err(|e| e.to_string())?
        .status
        .map_err(|e| format!("connect: {e}"))?;
    let out = MemoryRegion::from_vec(ctx, vec![0x42; size.max(1)]).map_err(|e| e.to_string())?;
    let back = MemoryRegion::alloc(ctx, size.max(1)).map_err(|e| e.to_string())?;
    let warm = count / 10 + 1;
    let mut samples = Vec::with_capacity(count);
    let mut u0 = Usage::default();
    for i in 0..warm + count {
        if i == warm {
            u0 = Usage::now(ctx, whole);
        }
        let t0 = Instant::now();
        s.recv(&eq, &back.slice(..size.max(1)), MsgFlags::NONE, 1)
            .map_err(|e| e.to_string())?;
        if mode != "persistent" {
            s.send(&eq, &out.slice(..size), MsgFlags::NONE, 2)
                .map_err(|e| e.to_string())?;
        }
        let want = if mode == "persistent" { 1 } else { 2 };
        let mut evs = Vec::new();
        eq.dequeue(&mut evs, want, want, Some(Duration::from_secs(30)))
            .map_err(|e| e.to_string())?;
        if evs.len() < want || evs.iter().any(|e| !e.is_ok()) {
            return Err(format!("ping {i}: {evs:?}"));
        }
        let dt = t0.elapsed().as_secs_f64() * 1e6;
        if i >= warm {
            samples.push(if mode == "persistent" { dt } else { dt / 2.0 });
        }
    }
    let usage = Usage::now(ctx, whole).since(u0);
    let _ = s.close();
    Ok((samples, usage))
}

pub fn measure(
    opened: &Opened,
    backend: &BackendArgs,
    size: usize,
    mode: &str,
    wait: &str,
    count: usize,
) -> Result<Latency, String> {
    // In the simulator the server must be host 0 (whose address `listen_addr(0)` is): create it first.
    let sctx = if opened.processes() {
        None
    } else {
        Some(opened.host()?)
    };
    let ctx = opened.host()?;
    let whole = opened.processes();
    let ((mut samples, client), (server, server_pings)) = if opened.processes() {
        let exe = std::env::current_exe().map_err(|e| e.to_string())?;
        let (mut child, addr, mut out) = crate::util::spawn_listening(
            Command::new(exe)
                .arg("ping-server")
                .args(backend.to_args())
                .args([
                    "--ping-size",
                    &size.to_string(),
                    "--ping-mode",
                    mode,
                    "--ping-wait",
                    wait,
                ]),
        )?;
        let r = pinger(&ctx, addr, size, mode, wait, count, whole);
        let mut line = String::new();
        let _ = std::io::BufRead::read_line(&mut out, &mut line);
        let _ = child.wait();
        let server = line
            .trim()
            .strip_prefix("USAGE ")
            .and_then(|l| {
                let mut it = l.split_whitespace();
                Some((Usage::parse(&mut it)?, it.next()?.parse().ok()?))
            })
            .ok_or_else(|| format!("the echo server reported {line:?}"))?;
        (r?, server)
    } else {
        let sctx = sctx.expect("created above");
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::scope(|scope| {
            let h = scope.spawn(|| {
                echo(opened, &sctx, size, mode, wait, &mut |a| {
                    let _ = tx.send(a);
                })
            });
            let addr = rx.recv().map_err(|_| "server thread failed".to_string())?;
            let r = pinger(&ctx, addr, size, mode, wait, count, whole)?;
            let server = h
                .join()
                .map_err(|_| "server thread panicked".to_string())??;
            Ok::<_, String>((r, server))
        })?
    };
    samples.sort_by(f64::total_cmp);
    let n = samples.len().max(1);
    Ok(Latency {
        mean_us: samples.iter().sum::<f64>() / n as f64,
        median_us: samples.get(n / 2).copied().unwrap_or(0.0),
        p99_us: samples.get(n * 99 / 100).copied().unwrap_or(0.0),
        client,
        server,
        server_pings,
        whole,
    })
}

/// One size's JSON line: latency, and per round trip (both sides) context switches and progress wake-ups.
pub fn ping_json(l: &Latency, backend: &str, size: u64, mode: &str, wait: &str, count: usize) -> serde_json::Value {
    let mut v = serde_json::json!({"tool": "exs-ping", "backend": backend, "size": size, "mode": mode,
        "wait": wait, "mean_us": l.mean_us, "median_us": l.median_us, "p99_us": l.p99_us,
        "ctx_switches_per_rt": l.switches_per_rt(count)});
    let map = v.as_object_mut().expect("an object");
    l.client.per_msg_json("client_", count as u64, map);
    l.server.per_msg_json("server_", l.server_pings, map);
    v
}

pub fn run(a: PingArgs) -> Result<(), String> {
    let opened = Opened::open(&a.backend)?;
    wait_mode(&a.wait)?;
    if !["normal", "immediate", "persistent"].contains(&a.mode.as_str()) {
        return Err(format!(
            "--mode {:?}: use normal, immediate or persistent",
            a.mode
        ));
    }
    if !a.json {
        println!(
            "{:>8} {:>10} {:>10} {:>10} {:>10}",
            "size", "mode", "mean us", "median us", "p99 us"
        );
    }
    for &size in &a.size {
        if a.mode == "immediate" && size > exs::SocketOptions::MAX_SMALL as u64 {
            eprintln!("ping: {size} B cannot go as immediate data; skipped");
            continue;
        }
        let l = measure(
            &opened,
            &a.backend,
            size as usize,
            &a.mode,
            &a.wait,
            a.count.max(10),
        )?;
        if a.json {
            println!(
                "{}",
                ping_json(&l, &opened.label(), size, &a.mode, &a.wait, a.count.max(10))
            );
        } else {
            println!(
                "{:>8} {:>10} {:>10.2} {:>10.2} {:>10.2}",
                size, a.mode, l.mean_us, l.median_us, l.p99_us
            );
        }
    }
    Ok(())
}

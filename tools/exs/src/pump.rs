//! `exs pump` (the paper's pumpexs, seed 002 section 5): blast messages from a client to a server and report the
//! throughput and each side's CPU use (user + system time over wall time), for message sizes, depths (transfers
//! in flight), send modes (normal, immediate, persistent) and socket types. The server runs in its own process
//! (`exs pump-server`) where the backend allows it, so each side's CPU is its own.

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use exs::{EventQueue, MemoryRegion, MsgFlags, SockType, Socket, SocketOption, WaitMode};

use crate::usage::Usage;
use crate::backend::{BackendArgs, Opened};

#[derive(Clone, Debug, clap::Args)]
pub struct PumpArgs {
    #[command(flatten)]
    pub backend: BackendArgs,
    /// Message sizes (comma-separated; K, M suffixes binary), 1 B to 16 MiB.
    #[arg(long, value_delimiter = ',', default_value = "1,1K,64K,1M", value_parser = crate::util::parse_size)]
    pub size: Vec<u64>,
    /// Transfers in flight (comma-separated), e.g. 1,2,4,8.
    #[arg(long, value_delimiter = ',', default_value = "8")]
    pub depth: Vec<usize>,
    /// default (the transport's immediate-data threshold decides), normal (adverts and RDMA reads; streams:
    /// writes), immediate (data inside the advert), persistent (one persistent send the server keeps reading).
    #[arg(long, default_value = "default")]
    pub mode: String,
    /// seqpacket or stream.
    #[arg(long = "type", default_value = "seqpacket")]
    pub sock_type: String,
    /// Seconds per point.
    #[arg(long, default_value_t = 2.0)]
    pub seconds: f64,
    /// Event-queue wait mode: adaptive (seed 004), block, busy.
    #[arg(long, default_value = "adaptive")]
    pub wait: String,
    /// One JSON object per point on stdout instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// One point's parameters, shared by client and server.
#[derive(Clone, Debug, clap::Args)]
pub struct Point {
    #[arg(long, value_parser = crate::util::parse_size)]
    pub point_size: u64,
    #[arg(long)]
    pub point_depth: usize,
    #[arg(long)]
    pub point_mode: String,
    #[arg(long)]
    pub point_type: String,
    #[arg(long)]
    pub point_seconds: f64,
    #[arg(long)]
    pub point_wait: String,
}

#[derive(Clone, Debug, clap::Args)]
pub struct PumpServerArgs {
    #[command(flatten)]
    pub backend: BackendArgs,
    #[command(flatten)]
    pub point: Point,
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

pub fn wait_mode(s: &str) -> Result<WaitMode, String> {
    match s {
        "adaptive" => Ok(WaitMode::Adaptive { spin: 0 }),
        "block" => Ok(WaitMode::Block),
        "busy" => Ok(WaitMode::BusyPoll),
        other => Err(format!("--wait {other:?}: use adaptive, block or busy")),
    }
}

pub fn sock_type(s: &str) -> Result<SockType, String> {
    match s {
        "seqpacket" => Ok(SockType::SeqPacket),
        "stream" => Ok(SockType::Stream),
        other => Err(format!("--type {other:?}: use seqpacket or stream")),
    }
}

/// Socket options a point needs on both sides.
fn options(p: &Point) -> Vec<SocketOption> {
    let depth = (p.point_depth as u16).clamp(1, 256);
    let mut v = vec![
        SocketOption::SendCredits(depth.max(2)),
        SocketOption::RecvCredits(depth.max(2)),
    ];
    match p.point_mode.as_str() {
        "immediate" => v.push(SocketOption::SmallPacketMaxSize(p.point_size as u32)),
        "normal" => v.push(SocketOption::SmallPacketMaxSize(0)),
        _ => {}
    }
    if p.point_type == "stream" {
        let ring = (p.point_size * p.point_depth as u64 * 2).clamp(256 << 10, 64 << 20) as u32;
        v.push(SocketOption::StreamBufferSize(ring));
    }
    v
}

/// What one side measured.
#[derive(Clone, Copy, Debug, Default)]
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
    fn to_line(self) -> String {
        format!(
            "RESULT {} {} {:.6} {} {} {}",
            self.bytes,
            self.msgs,
            self.secs,
            self.usage.to_fields(),
            self.direct,
            self.copied
        )
    }
    fn parse(l: &str) -> Option<Side> {
        let mut it = l.strip_prefix("RESULT ")?.split_whitespace();
        Some(Side {
            bytes: it.next()?.parse().ok()?,
            msgs: it.next()?.parse().ok()?,
            secs: it.next()?.parse().ok()?,
            usage: Usage::parse(&mut it)?,
            whole: true,
            direct: it.next()?.parse().ok()?,
            copied: it.next()?.parse().ok()?,
        })
    }
}

/// The server of one point: accepts one connection and receives until the client closes (persistent mode:
/// reads for the point's duration, then closes). Prints `LISTEN addr`, then `RESULT bytes msgs secs cpu`.
pub fn server(a: PumpServerArgs) -> Result<(), String> {
    let opened = Opened::open(&a.backend)?;
    let ctx = opened.host()?;
    let side = serve(&opened, &ctx, &a.point, &mut |addr| {
        println!("LISTEN {addr}");
        let _ = std::io::stdout().flush();
    })?;
    println!("{}", side.to_line());
    Ok(())
}

fn serve(
    opened: &Opened,
    ctx: &exs::Context,
    p: &Point,
    announce: &mut dyn FnMut(std::net::SocketAddr),
) -> Result<Side, String> {
    let ty = sock_type(&p.point_type)?;
    let eq = EventQueue::with_mode(p.point_depth * 2 + 8, wait_mode(&p.point_wait)?);
    let (_listener, s) =
        crate::util::accept_one(ctx, ty, options(p), opened.listen_addr(0), &eq, announce)?;
    let size = p.point_size.max(1) as usize;
    let depth = p.point_depth.max(1);
    let buf = MemoryRegion::alloc(ctx, size * depth).map_err(|e| e.to_string())?;
    for i in 0..depth {
        s.recv(
            &eq,
            &buf.slice(i * size..(i + 1) * size),
            MsgFlags::NONE,
            i as u64,
        )
        .map_err(|e| e.to_string())?;
    }
    let persistent = p.point_mode == "persistent";
    let whole = opened.processes();
    let mut side = Side {
        whole,
        ..Side::default()
    };
    let mut start: Option<(Instant, Usage)> = None;
    let mut last = Instant::now();
    let stop = Duration::from_secs_f64(p.point_seconds);
    loop {
        let ev = eq
            .next(Some(Duration::from_secs(60)))
            .map_err(|e| format!("receive: {e}"))?;
        if !ev.is_ok() || ev.flags.eof {
            break; // the client closed: the point is over
        }
        let now = Instant::now();
        let (t0, _) = *start.get_or_insert_with(|| (now, Usage::now(ctx, whole)));
        side.bytes += ev.bytes as u64;
        side.msgs += 1;
        last = now;
        if persistent && now - t0 >= stop {
            break;
        }
        let i = ev.context as usize;
        s.recv(
            &eq,
            &buf.slice(i * size..(i + 1) * size),
            MsgFlags::NONE,
            ev.context,
        )
        .map_err(|e| e.to_string())?;
    }
    if let Some((t0, u0)) = start {
        side.secs = (last - t0).as_secs_f64();
        side.usage = Usage::now(ctx, whole).since(u0);
        // The first message only starts the clock.
        side.bytes = side.bytes.saturating_sub(side.bytes / side.msgs.max(1));
        side.msgs = side.msgs.saturating_sub(1);
    }
    side.copied = s.stats().map_or(0, |c| c.stream.copied_bytes);
    let _ = s.close();
    Ok(side)
}

/// The client of one point: blasts for the point's duration (persistent: one send, then waits for the server
/// to hang up), then closes. Returns what it measured.
fn blast(
    ctx: &exs::Context,
    addr: std::net::SocketAddr,
    p: &Point,
    whole: bool,
) -> Result<Side, String> {
    let ty = sock_type(&p.point_type)?;
    let eq = EventQueue::with_mode(p.point_depth * 2 + 8, wait_mode(&p.point_wait)?);
    let s = Socket::new(ctx, ty).map_err(|e| e.to_string())?;
    for o in options(p) {
        s.set_option(o).map_err(|e| e.to_string())?;
    }
    s.connect(addr, &eq, 0).map_err(|e| e.to_string())?;
    eq.next(Some(Duration::from_secs(60)))
        .map_err(|e| e.to_string())?
        .status
        .map_err(|e| format!("connect: {e}"))?;
    let size = p.point_size.max(1) as usize;
    let depth = p.point_depth.max(1);
    let buf = MemoryRegion::from_vec(ctx, vec![0x5A; size * depth]).map_err(|e| e.to_string())?;
    let (t0, u0) = (Instant::now(), Usage::now(ctx, whole));
    let mut side = Side {
        whole,
        ..Side::default()
    };
    if p.point_mode == "persistent" {
        s.send(&eq, &buf.slice(0..size), MsgFlags::PERSISTENT, 0)
            .map_err(|e| e.to_string())?;
        // Wait (blocked, spending nothing) until the server hangs up.
        let probe = MemoryRegion::alloc(ctx, 1).map_err(|e| e.to_string())?;
        s.recv(&eq, &probe.all(), MsgFlags::NONE, 1)
            .map_err(|e| e.to_string())?;
        let _ = eq.next(Some(Duration::from_secs_f64(p.point_seconds + 60.0)));
    } else {
        let stop = Duration::from_secs_f64(p.point_seconds);
        for i in 0..depth {
            s.send(
                &eq,
                &buf.slice(i * size..(i + 1) * size),
                MsgFlags::NONE,
                i as u64,
            )
            .map_err(|e| e.to_string())?;
        }
        let mut outstanding = depth;
        while outstanding > 0 {
            let ev = eq
                .next(Some(Duration::from_secs(60)))
                .map_err(|e| format!("send: {e}"))?;
            outstanding -= 1;
            ev.status.clone().map_err(|e| format!("send: {e}"))?;
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
                .map_err(|e| e.to_string())?;
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
    pub size: u64,
    pub depth: usize,
    pub mode: String,
    pub sock_type: String,
    pub wait: String,
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

    pub fn json(&self, backend: &str) -> serde_json::Value {
        let mut v = serde_json::json!({
            "tool": "exs-pump",
            "backend": backend,
            "size": self.size,
            "depth": self.depth,
            "mode": self.mode,
            "type": self.sock_type,
            "wait": self.wait,
            "bytes_per_sec": self.throughput(),
            "msgs": self.server.msgs,
            "secs": self.server.secs,
            "cpu_client": if self.client.secs > 0.0 { self.client.usage.cpu / self.client.secs } else { 0.0 },
            "cpu_server": if self.server.secs > 0.0 { self.server.usage.cpu / self.server.secs } else { 0.0 },
        });
        let map = v.as_object_mut().expect("an object");
        let msgs = self.server.msgs.max(self.client.msgs);
        self.client.usage.per_msg_json("client_", msgs, map);
        self.server.usage.per_msg_json("server_", msgs, map);
        let switches = self.client.usage.switches(self.client.whole) + self.server.usage.switches(self.server.whole);
        map.insert("ctx_switches_per_msg".into(), (switches as f64 / msgs.max(1) as f64).into());
        // Issue 13: memory registered on the data path, both sides, per message (0: registered once, exposed
        // by window binds or per-connection keys).
        let regs = self.client.usage.registrations + self.server.usage.registrations;
        map.insert("registrations_per_msg".into(), (regs as f64 / msgs.max(1) as f64).into());
        if self.sock_type == "stream" && self.client.bytes > 0 {
            // Issue 14: the share of bytes written straight into posted receives, and copies per byte received
            // (each indirect byte is copied once, out of the stream buffer; over the whole run, warm-up included).
            let sent = self.client.bytes as f64;
            map.insert("direct_share".into(), (self.client.direct as f64 / sent).into());
            map.insert("copies_per_byte".into(), (self.server.copied as f64 / sent).into());
        }
        v
    }
}

/// Runs one point: the server in its own process (or thread, for the simulator), the client here.
pub fn point(opened: &Opened, backend: &BackendArgs, p: &Point) -> Result<Measured, String> {
    // In the simulator the server must be host 0 (whose address `listen_addr(0)` is): create it first.
    let sctx = if opened.processes() {
        None
    } else {
        Some(opened.host()?)
    };
    let ctx = opened.host()?;
    let server = if opened.processes() {
        let exe = std::env::current_exe().map_err(|e| e.to_string())?;
        let mut cmd = Command::new(exe);
        cmd.arg("pump-server").args(backend.to_args()).args([
            "--point-size",
            &p.point_size.to_string(),
            "--point-depth",
            &p.point_depth.to_string(),
            "--point-mode",
            &p.point_mode,
            "--point-type",
            &p.point_type,
            "--point-seconds",
            &p.point_seconds.to_string(),
            "--point-wait",
            &p.point_wait,
        ]);
        let mut child = cmd
            .stdout(Stdio::piped())
            .stdin(Stdio::null())
            .spawn()
            .map_err(|e| format!("spawn server: {e}"))?;
        let mut out = BufReader::new(child.stdout.take().expect("piped"));
        let mut line = String::new();
        out.read_line(&mut line).map_err(|e| e.to_string())?;
        let addr = line
            .trim()
            .strip_prefix("LISTEN ")
            .ok_or_else(|| format!("server said {line:?}"))?;
        let addr = addr.parse().map_err(|e| format!("{e}"))?;
        let client = blast(&ctx, addr, p, opened.processes())?;
        let mut result = String::new();
        out.read_line(&mut result).map_err(|e| e.to_string())?;
        let _ = child.wait();
        let server =
            Side::parse(result.trim()).ok_or_else(|| format!("server reported {result:?}"))?;
        (client, server)
    } else {
        let listen_ctx = sctx.expect("created above");
        let pp = p.clone();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::scope(|scope| {
            let h = scope.spawn(|| {
                serve(opened, &listen_ctx, &pp, &mut |a| {
                    let _ = tx.send(a);
                })
            });
            let addr = rx.recv().map_err(|_| "server thread failed".to_string())?;
            let client = blast(&ctx, addr, p, opened.processes())?;
            let server = h
                .join()
                .map_err(|_| "server thread panicked".to_string())??;
            Ok::<_, String>((client, server))
        })?
    };
    Ok(Measured {
        size: p.point_size,
        depth: p.point_depth,
        mode: p.point_mode.clone(),
        sock_type: p.point_type.clone(),
        wait: p.point_wait.clone(),
        client: server.0,
        server: server.1,
    })
}

pub fn run(a: PumpArgs) -> Result<(), String> {
    let opened = Opened::open(&a.backend)?;
    sock_type(&a.sock_type)?;
    wait_mode(&a.wait)?;
    if !["default", "normal", "immediate", "persistent"].contains(&a.mode.as_str()) {
        return Err(format!(
            "--mode {:?}: use default, normal, immediate or persistent",
            a.mode
        ));
    }
    if !["default", "normal"].contains(&a.mode.as_str()) && a.sock_type == "stream" {
        return Err("immediate and persistent sends exist on seqpacket sockets".into());
    }
    if !a.json {
        println!(
            "{:>10} {:>5} {:>10} {:>9} {:>12} {:>12} {:>11} {:>11}",
            "size", "depth", "mode", "type", "MB/s", "msgs/s", "cpu client", "cpu server"
        );
    }
    let points = a.size.len() * a.depth.len();
    let mut done = 0;
    let show_progress = std::io::IsTerminal::is_terminal(&std::io::stderr());
    for &size in &a.size {
        if size == 0 || size > 16 << 20 {
            return Err(format!("--size {size}: 1 byte to 16 MiB"));
        }
        if a.mode == "immediate" && size > exs::SocketOptions::MAX_SMALL as u64 {
            eprintln!(
                "pump: {size} B cannot go as immediate data (at most {} B); skipped",
                exs::SocketOptions::MAX_SMALL
            );
            done += a.depth.len();
            continue;
        }
        for &depth in &a.depth {
            let p = Point {
                point_size: size,
                point_depth: depth.clamp(1, 64),
                point_mode: a.mode.clone(),
                point_type: a.sock_type.clone(),
                point_seconds: a.seconds,
                point_wait: a.wait.clone(),
            };
            done += 1;
            if show_progress {
                // Progress on the terminal only: results go to stdout, one line per point.
                eprint!(
                    "\rpump: point {done}/{points}: {} depth {depth}, {:.1} s...",
                    crate::util::fmt_bytes(size),
                    a.seconds
                );
            }
            let m = point(&opened, &a.backend, &p)?;
            if show_progress {
                eprint!("\r\x1b[K");
            }
            if a.json {
                println!("{}", m.json(&opened.label()));
            } else {
                let j = m.json(&opened.label());
                println!(
                    "{:>10} {:>5} {:>10} {:>9} {:>12.1} {:>12.0} {:>10.0}% {:>10.0}%",
                    crate::util::fmt_bytes(size),
                    depth,
                    a.mode,
                    a.sock_type,
                    m.throughput() / 1e6,
                    m.server.msgs as f64 / m.server.secs.max(1e-9),
                    j["cpu_client"].as_f64().unwrap_or(0.0) * 100.0,
                    j["cpu_server"].as_f64().unwrap_or(0.0) * 100.0
                );
            }
            let _ = std::io::stdout().flush();
        }
    }
    Ok(())
}

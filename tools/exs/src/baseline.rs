//! Baselines measured by the same binary as exs, so ratios come from one run on one machine:
//!
//! * `exs rawpump`: a raw RDMA loop through the backend's own transport (our libfabric FFI or rdma-core verbs),
//!   with no exs protocol: the server exposes a buffer and hands its key over in the connection's private data;
//!   the client keeps `depth` RDMA writes (or reads) of `size` bytes in flight.
//! * `exs tcppump`, `exs tcpping`: plain TCP through `std::net`, with and without Nagle.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::{AsFd, BorrowedFd};
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context as _, Result};
use exs::transport::{
    CmEvent, ConnectFailure, EndpointId, Op, Registration, RemoteAccess, RemoteRef, Sge, Transport,
    WorkRequest,
};
use exs_dma::{DmaBuf, LeaseKind};

use crate::backend::{BackendArgs, Opened};
use crate::cli::{self, MAX_COUNT, MAX_DEPTH, MAX_MESSAGE};
use crate::opts::RawOp;
use crate::out::outln;
use crate::pump::cpu_seconds;
use crate::size::fmt_bytes;
use crate::util::{filled_buffer, fmt_rate};

#[derive(Clone, Debug, clap::Args)]
pub struct RawArgs {
    /// Transfer size.
    #[arg(long, value_parser = cli::size_in(1..=MAX_MESSAGE), default_value = "1M",
          help = cli::help_range("Transfer size (K, M suffixes binary)", 1, MAX_MESSAGE))]
    pub size: u64,
    /// Transfers in flight.
    #[arg(long, default_value_t = 8, value_parser = cli::depth(),
          help = format!("Transfers in flight, 1 to {MAX_DEPTH}"))]
    pub depth: usize,
    /// The RDMA operation.
    #[arg(long, value_enum, default_value_t = RawOp::Write)]
    pub op: RawOp,
    /// Seconds to run.
    #[arg(long, default_value = "2", value_parser = cli::seconds,
          help = format!("Seconds to run (more than 0, at most {})", cli::MAX_SECONDS))]
    pub seconds: f64,
    /// One JSON object on stdout instead of a line of text.
    #[arg(long)]
    pub json: bool,
    /// Internal: run as the passive side.
    #[arg(long, hide = true)]
    pub serve: bool,
    #[command(flatten)]
    pub backend: BackendArgs,
}

fn transport(opened: &Opened) -> Result<Box<dyn Transport>> {
    opened.raw_transport()
}

/// Sleeps on `fd`, the transport's wait descriptor, armed first, until something may have happened (at most
/// `max`, and at most the transport's poll interval where completions signal nothing: `--cq-no-wait`).
pub(crate) fn wait(t: &mut dyn Transport, fd: Option<BorrowedFd<'_>>, max: Duration) {
    let max = t.poll_interval().map_or(max, |i| max.min(i));
    if !matches!(t.arm(), Ok(true)) {
        return; // something is pending already
    }
    if let Some(fd) = fd {
        let mut fds = [nix::poll::PollFd::new(fd, nix::poll::PollFlags::POLLIN)];
        let ms = u16::try_from(max.as_millis()).unwrap_or(u16::MAX);
        let _ = nix::poll::poll(&mut fds, nix::poll::PollTimeout::from(ms));
    }
}

/// Waits for the next connection event (or 30 s), progressing the completion queue meanwhile (software
/// providers make progress only when polled).
pub(crate) fn next_cm(t: &mut dyn Transport) -> Result<CmEvent> {
    next_cm_within(t, Duration::from_secs(30))
}

/// [`next_cm`] within `limit`.
pub(crate) fn next_cm_within(t: &mut dyn Transport, limit: Duration) -> Result<CmEvent> {
    let deadline = Instant::now() + limit;
    let fd = t.wait_fd();
    let mut out = Vec::new();
    loop {
        t.poll(&mut out, 64);
        out.clear();
        if let Some(ev) = t.poll_cm() {
            return Ok(ev);
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            bail!("no connection event within {} s", limit.as_secs_f64());
        }
        wait(
            t,
            fd.as_ref().map(|f| f.as_fd()),
            left.min(Duration::from_millis(100)),
        );
    }
}

/// The passive side: exposes a buffer for remote write and read, accepts one connection with the buffer's
/// address and key as private data, and sleeps on the transport until the peer disconnects (on RDMA hardware it
/// does nothing at all; software providers need their queues polled to move data).
fn serve(opened: &Opened, size: usize, depth: usize, read: bool) -> Result<()> {
    let mut t = transport(opened)?;
    let buf = filled_buffer(size * depth)?;
    let reg = t.register(&buf).context("registering the buffer")?;
    let (kind, access) = if read {
        (LeaseKind::DeviceReadShared, RemoteAccess::Read)
    } else {
        (LeaseKind::DeviceWriteShared, RemoteAccess::Write)
    };
    let lease = buf.lease(0..size * depth, kind)?;
    // Exposed to the one connection it will accept (endpoint 1), before the handshake carries the key.
    let exposure = t
        .expose(EndpointId(1), &reg, lease, access)
        .context("exposing the buffer")?;
    let token = crate::helper::token()?;
    let (_, addr) = t.listen(opened.listen_addr(0), 1).context("listen")?;
    crate::out::announce(addr)?;
    let request = crate::helper::accept_request(&mut *t, token)?;
    let w = exposure.remote();
    let mut private = Vec::new();
    for v in [w.addr, w.key, w.addr, w.key] {
        private.extend_from_slice(&v.to_le_bytes());
    }
    t.accept(request, EndpointId(1), &private, Vec::new())
        .context("accept")?;
    loop {
        match next_cm(&mut *t) {
            Ok(CmEvent::Disconnected { .. }) => break,
            // The client is in: later requests are strangers'.
            Ok(CmEvent::ConnectRequest { request, .. }) => t.reject(request),
            Ok(_) => {}
            Err(_) => {} // keep waiting: the client decides when the run ends
        }
    }
    t.release(EndpointId(1));
    drop(exposure);
    Ok(())
}

/// What the active side measured.
#[derive(Debug, Clone, Copy)]
pub struct RawResult {
    pub bytes_per_sec: f64,
    pub cpu: f64,
}

fn blast(opened: &Opened, helper: &Helper, a: &RawArgs) -> Result<RawResult> {
    let mut t = transport(opened)?;
    let size = a.size as usize;
    let depth = a.depth;
    let buf = filled_buffer(size * depth)?;
    let reg = t.register(&buf).context("registering the buffer")?;
    let private = connect_raw(&mut *t, helper)?;
    let read = a.op == RawOp::Read;
    let slots = Slots {
        buf: &buf,
        reg,
        remote: server_buffer(&private, read)?,
        size,
        read,
    };
    let (t0, c0) = (Instant::now(), cpu_seconds());
    for slot in 0..depth {
        slots.post(&mut *t, slot, a.op)?;
    }
    let stop = cli::duration(a.seconds);
    let mut done = 0u64;
    let mut outstanding = depth;
    let mut out = Vec::with_capacity(64);
    while outstanding > 0 {
        out.clear();
        t.poll(&mut out, 64);
        for c in out.drain(..) {
            c.status.with_context(|| format!("RDMA {}", a.op))?;
            outstanding -= 1;
            done += 1;
            if t0.elapsed() < stop {
                slots.post(&mut *t, c.wr_id as usize, a.op)?;
                outstanding += 1;
            }
        }
    }
    let secs = t0.elapsed().as_secs_f64();
    let cpu = cpu_seconds() - c0;
    t.disconnect(EndpointId(1));
    let _ = next_cm(&mut *t);
    t.release(EndpointId(1));
    Ok(RawResult {
        bytes_per_sec: done as f64 * size as f64 / secs,
        cpu: cpu / secs,
    })
}

/// Connects endpoint 1 to the raw helper server, with its token; the private data of its accept.
fn connect_raw(t: &mut dyn Transport, helper: &Helper) -> Result<Vec<u8>> {
    let addr = helper.addr;
    t.connect(
        EndpointId(1),
        addr,
        &crate::helper::private(helper.token),
        Vec::new(),
    )
    .with_context(|| format!("connecting to {addr}"))?;
    match next_cm(t)? {
        CmEvent::Established { private, .. } => Ok(private),
        CmEvent::ConnectFailed { reason, .. } => bail!(
            "connecting to {addr}: {}",
            match reason {
                ConnectFailure::Refused(_) => "refused".to_string(),
                ConnectFailure::Unreachable => "unreachable".into(),
                ConnectFailure::TimedOut => "no answer".into(),
                ConnectFailure::NotAPeer(why) => format!("not an exs peer ({why})"),
                ConnectFailure::Other(why) => why.to_string(),
            }
        ),
        _ => bail!("connecting to {addr}: the connection was not established"),
    }
}

/// The server's buffer from its accept's private data: the one it writes into (`read`: the one it reads from).
fn server_buffer(private: &[u8], read: bool) -> Result<RemoteRef> {
    if private.len() < 32 {
        bail!("the raw server sent no key");
    }
    let word =
        |i: usize| u64::from_le_bytes(private[i * 8..i * 8 + 8].try_into().expect("8 bytes"));
    let first = if read { 2 } else { 0 };
    Ok(RemoteRef {
        addr: word(first),
        key: word(first + 1),
    })
}

/// The active side's buffer, cut in one slot per transfer in flight, against the server's.
struct Slots<'a> {
    buf: &'a Arc<DmaBuf>,
    reg: Arc<dyn Registration>,
    remote: RemoteRef,
    size: usize,
    read: bool,
}

impl Slots<'_> {
    /// Posts the transfer of slot `slot` (its id is the slot's number).
    fn post(&self, t: &mut dyn Transport, slot: usize, what: RawOp) -> Result<()> {
        let kind = if self.read {
            LeaseKind::DeviceWrite
        } else {
            LeaseKind::DeviceRead
        };
        let lease = self
            .buf
            .lease(slot * self.size..(slot + 1) * self.size, kind)?;
        let sge = Sge::new(lease, Arc::clone(&self.reg))?;
        let remote = RemoteRef {
            addr: self.remote.addr + (slot * self.size) as u64,
            key: self.remote.key,
        };
        let op = if self.read {
            Op::Read { local: sge, remote }
        } else {
            Op::Write {
                local: vec![sge],
                remote,
                imm: None,
            }
        };
        t.post(
            EndpointId(1),
            WorkRequest {
                wr_id: slot as u64,
                op,
            },
        )
        .map_err(|e| anyhow!("posting RDMA {what}: {}", e.error))
    }
}

/// The raw baselines run their server as a second process: the sim backend, one process's simulated network,
/// cannot connect the two (review finding: they failed with a refusal, or a 30 s wait, that did not say why).
pub fn refuse_sim(opened: &Opened, tool: &str) -> Result<()> {
    if !opened.processes() {
        bail!(
            "the sim backend lives inside one process: `exs {tool}` runs its server in a second process, which it \
             cannot reach; use --backend fabric or verbs"
        );
    }
    Ok(())
}

pub fn run_raw(a: RawArgs) -> Result<()> {
    let opened = Opened::open(&a.backend)?;
    refuse_sim(&opened, "rawpump")?;
    if a.serve {
        return serve(&opened, a.size as usize, a.depth, a.op == RawOp::Read);
    }
    let mut helper = spawn_server(
        "rawpump",
        &a.backend,
        &[
            "--size",
            &a.size.to_string(),
            "--depth",
            &a.depth.to_string(),
            "--op",
            &a.op.to_string(),
        ],
    )?;
    let r = blast(&opened, &helper, &a);
    crate::util::reap(&mut helper.child);
    let r = r?;
    if a.json {
        outln!(
            "{}",
            serde_json::json!({"tool": "raw-rma", "backend": opened.label(), "op": a.op.to_string(), "size": a.size,
                "depth": a.depth, "bytes_per_sec": r.bytes_per_sec, "cpu_client": r.cpu})
        );
    } else {
        outln!(
            "raw RDMA {} ({}): {} x {} in flight: {}, cpu {:.0}%",
            a.op,
            opened.label(),
            fmt_bytes(a.size),
            a.depth,
            fmt_rate(r.bytes_per_sec),
            r.cpu * 100.0
        );
    }
    Ok(())
}

#[derive(Clone, Debug, clap::Args)]
pub struct TcppumpArgs {
    /// Write size.
    #[arg(long, value_parser = cli::size_in(1..=MAX_MESSAGE), default_value = "1M",
          help = cli::help_range("Write size (K, M suffixes binary)", 1, MAX_MESSAGE))]
    pub size: u64,
    /// Seconds to run.
    #[arg(long, default_value = "2", value_parser = cli::seconds,
          help = format!("Seconds to run (more than 0, at most {})", cli::MAX_SECONDS))]
    pub seconds: f64,
    /// Disable Nagle's algorithm (TCP_NODELAY).
    #[arg(long)]
    pub nodelay: bool,
    /// One JSON object on stdout instead of a line of text.
    #[arg(long)]
    pub json: bool,
    /// Internal: run as the sink.
    #[arg(long, hide = true)]
    pub serve: bool,
}

#[derive(Clone, Debug, clap::Args)]
pub struct TcppingArgs {
    /// Message size (each way).
    #[arg(long, value_parser = cli::size_in(1..=MAX_MESSAGE), default_value = "8",
          help = cli::help_range("Message size, each way (K, M suffixes binary)", 1, MAX_MESSAGE))]
    pub size: u64,
    /// Round trips.
    #[arg(long, default_value_t = 2000, value_parser = cli::count_in(1..=MAX_COUNT),
          help = format!("Round trips, counted after a warm-up of a tenth more, 1 to {MAX_COUNT}"))]
    pub count: u64,
    /// Disable Nagle's algorithm (TCP_NODELAY).
    #[arg(long)]
    pub nodelay: bool,
    /// One JSON object on stdout instead of a line of text.
    #[arg(long)]
    pub json: bool,
    /// Internal: run as the echo side.
    #[arg(long, hide = true)]
    pub serve: bool,
}

/// A helper server started for one run: its process, the address it listens on, and the token its client
/// connects with ([`crate::helper`]).
pub(crate) struct Helper {
    pub child: std::process::Child,
    pub addr: SocketAddr,
    pub token: u64,
}

/// Starts this program as a helper server (`cmd` with `--serve`), its token in its environment.
fn spawn_helper(cmd: &mut Command) -> Result<Helper> {
    let token = crate::helper::give(cmd)?;
    let (child, addr, _out) = crate::util::spawn_listening(cmd.arg("--serve"))?;
    Ok(Helper { child, addr, token })
}

/// Starts this program as the passive side of a raw baseline (`sub --serve` with the backend's flags and
/// `args`).
pub(crate) fn spawn_server(sub: &str, backend: &BackendArgs, args: &[&str]) -> Result<Helper> {
    let exe = std::env::current_exe().context("finding this program, to start its server")?;
    spawn_helper(
        Command::new(exe)
            .arg(sub)
            .args(backend.to_args())
            .args(args),
    )
}

/// Mean and median of one-way times (sorted here).
pub(crate) fn mean_median(samples: &mut [f64]) -> (f64, f64) {
    samples.sort_by(f64::total_cmp);
    let n = samples.len().max(1);
    (
        samples.iter().sum::<f64>() / n as f64,
        samples.get(n / 2).copied().unwrap_or(0.0),
    )
}

/// Starts this program as the sink (`tcppump`) or echo (`tcpping`) side of a TCP baseline.
fn spawn_tcp(kind: &str, size: u64, nodelay: bool) -> Result<Helper> {
    let exe = std::env::current_exe().context("finding this program, to start its server")?;
    let mut cmd = Command::new(exe);
    cmd.args([kind, "--size", &size.to_string()]);
    if nodelay {
        cmd.arg("--nodelay");
    }
    spawn_helper(&mut cmd)
}

/// Connects to a TCP helper and sends its token first.
fn tcp_connect(h: &mut Helper) -> Result<TcpStream> {
    let addr = h.addr;
    TcpStream::connect(addr)
        .and_then(|mut s| s.write_all(&h.token.to_le_bytes()).map(|()| s))
        .inspect_err(|_| crate::util::reap(&mut h.child))
        .with_context(|| format!("TCP connect to {addr}"))
}

/// The sink (`echo` false) or echo side: one connection on loopback, its client's (the first to send this
/// helper's token), until the client closes it.
fn tcp_serve(size: u64, nodelay: bool, echo: bool) -> Result<()> {
    let token = crate::helper::token()?;
    let l = TcpListener::bind("127.0.0.1:0").context("TCP listener")?;
    crate::out::announce(l.local_addr()?)?;
    let watch = crate::control::Watch::with_token(token);
    let mut s = crate::tcp_admit::accept_client(l, Some(token), &watch)?;
    s.set_nodelay(nodelay)?;
    let mut buf = vec![0u8; size as usize];
    loop {
        if echo {
            if s.read_exact(&mut buf).is_err() || s.write_all(&buf).is_err() {
                return Ok(());
            }
        } else if s.read(&mut buf).context("TCP read")? == 0 {
            return Ok(());
        }
    }
}

pub fn run_tcppump(a: TcppumpArgs) -> Result<()> {
    if a.serve {
        return tcp_serve(a.size, a.nodelay, false);
    }
    let mut helper = spawn_tcp("tcppump", a.size, a.nodelay)?;
    let mut s = tcp_connect(&mut helper)?;
    s.set_nodelay(a.nodelay)?;
    let buf = vec![0x5Au8; a.size as usize];
    let (t0, c0) = (Instant::now(), cpu_seconds());
    let stop = cli::duration(a.seconds);
    let mut bytes = 0u64;
    while t0.elapsed() < stop {
        s.write_all(&buf).context("TCP write")?;
        bytes += buf.len() as u64;
    }
    drop(s);
    let _ = helper.child.wait();
    let secs = t0.elapsed().as_secs_f64();
    let tool = if a.nodelay {
        "tcp-nodelay"
    } else {
        "tcp-nagle"
    };
    let (rate, cpu) = (bytes as f64 / secs, (cpu_seconds() - c0) / secs);
    if a.json {
        outln!(
            "{}",
            serde_json::json!({"tool": tool, "size": a.size, "bytes_per_sec": rate, "cpu_client": cpu})
        );
    } else {
        outln!(
            "{tool}: {} writes: {}, cpu {:.0}%",
            fmt_bytes(a.size),
            fmt_rate(rate),
            cpu * 100.0
        );
    }
    Ok(())
}

pub fn run_tcpping(a: TcppingArgs) -> Result<()> {
    if a.serve {
        return tcp_serve(a.size, a.nodelay, true);
    }
    let mut helper = spawn_tcp("tcpping", a.size, a.nodelay)?;
    let mut s = tcp_connect(&mut helper)?;
    s.set_nodelay(a.nodelay)?;
    let mut buf = vec![0x5Au8; a.size as usize];
    let warm = a.count / 10;
    let mut samples = Vec::with_capacity(a.count as usize);
    for i in 0..warm + a.count {
        let t0 = Instant::now();
        s.write_all(&buf).context("TCP write")?;
        s.read_exact(&mut buf).context("TCP read")?;
        if i >= warm {
            samples.push(t0.elapsed().as_secs_f64() * 1e6 / 2.0);
        }
    }
    drop(s);
    let _ = helper.child.wait();
    let tool = if a.nodelay {
        "tcp-nodelay"
    } else {
        "tcp-nagle"
    };
    let (mean, median) = mean_median(&mut samples);
    if a.json {
        outln!(
            "{}",
            serde_json::json!({"tool": tool, "size": a.size, "mean_us": mean, "median_us": median})
        );
    } else {
        outln!(
            "{tool}: {} B one-way: mean {mean:.2} us, median {median:.2} us",
            a.size
        );
    }
    Ok(())
}

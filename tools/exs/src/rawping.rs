//! `exs rawping`: the transport's own ping-pong, with no exs protocol. Two processes, one connection; each message
//! is one two-sided send into a receive the other side posted ahead, answered by one of the same size. Waiting blocks on the
//! transport's wait descriptor (`--wait block`, armed first, as the engine does) or polls (`--wait busy`). What
//! `exs ping` costs above this is exs's own; what this costs above `exs tcpping` is the transport's.

use std::os::fd::{AsFd, OwnedFd};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context as _, Result};
use exs::transport::{
    CmEvent, Completion, EndpointId, Op, Registration, Sge, Transport, WcError, WorkRequest,
};
use exs_dma::{DmaBuf, LeaseKind};

use crate::backend::{BackendArgs, Opened};
use crate::baseline::{mean_median, next_cm, spawn_server, wait, Helper};
use crate::cli::{self, MAX_COUNT};
use crate::opts::RawWait;
use crate::out::outln;

/// Receives each side keeps posted ahead.
const RECVS: usize = 4;

#[derive(Clone, Debug, clap::Args)]
pub struct RawpingArgs {
    /// Message size (each way).
    #[arg(long, value_parser = cli::size_in(1..=4096), default_value = "8",
          help = cli::help_range("Message size, each way (K suffix binary)", 1, 4096))]
    pub size: u64,
    /// Round trips.
    #[arg(long, default_value_t = 2000, value_parser = cli::count_in(1..=MAX_COUNT),
          help = format!("Round trips, counted after a warm-up of a tenth more, 1 to {MAX_COUNT}"))]
    pub count: u64,
    /// How each side waits for a completion.
    #[arg(long, value_enum, default_value_t = RawWait::Block)]
    pub wait: RawWait,
    /// One JSON object on stdout instead of a line of text.
    #[arg(long)]
    pub json: bool,
    /// Internal: run as the echo side.
    #[arg(long, hide = true)]
    pub serve: bool,
    #[command(flatten)]
    pub backend: BackendArgs,
}

/// One side's connection: its transport, a buffer cut into `RECVS` receive slots and one send slot.
struct Side {
    t: Box<dyn Transport>,
    buf: Arc<DmaBuf>,
    reg: Arc<dyn Registration>,
    size: usize,
    busy: bool,
    /// The transport's wait descriptor, taken once.
    fd: Option<OwnedFd>,
    /// When a busy side last looked at connection events.
    looked: Instant,
}

const EP: EndpointId = EndpointId(1);
/// A busy side looks at connection events at most this often (see `Side::next_recv`).
const CM_LOOK_EVERY: Duration = Duration::from_millis(1);
const SEND: u64 = u64::MAX;

impl Side {
    fn new(opened: &Opened, size: usize, busy: bool) -> Result<Side> {
        let mut t = opened.raw_transport()?;
        let buf = DmaBuf::new(size * (RECVS + 1));
        let reg = t.register(&buf).context("registering the buffer")?;
        let fd = t.wait_fd();
        Ok(Side {
            t,
            buf,
            reg,
            size,
            busy,
            fd,
            looked: Instant::now(),
        })
    }

    fn sge(&self, slot: usize, kind: LeaseKind) -> Result<Sge> {
        let lease = self
            .buf
            .lease(slot * self.size..(slot + 1) * self.size, kind)?;
        Ok(Sge::new(lease, Arc::clone(&self.reg))?)
    }

    fn post(&mut self, wr_id: u64, op: Op) -> Result<()> {
        self.t
            .post(EP, WorkRequest { wr_id, op })
            .map_err(|e| anyhow!("posting: {}", e.error))
    }

    fn post_recv(&mut self, slot: usize) -> Result<()> {
        let sge = self.sge(slot, LeaseKind::DeviceWrite)?;
        self.post(slot as u64, Op::Recv { sge })
    }

    fn send(&mut self) -> Result<()> {
        let sge = self.sge(RECVS, LeaseKind::DeviceRead)?;
        self.post(
            SEND,
            Op::Send {
                sges: vec![sge],
                imm: None,
            },
        )
    }

    /// Sleeps on the transport's wait descriptor (armed first, as the engine does) until something may have
    /// happened, at most a second.
    fn sleep(&mut self) {
        let fd = self.fd.as_ref().map(|f| f.as_fd());
        wait(&mut *self.t, fd, Duration::from_secs(1));
    }

    /// Waits for the next messages (taking send completions on the way) and posts their slots again: how many
    /// arrived, or `None` once the peer disconnected. Connection events (the disconnect) are read only when polls
    /// find nothing: after a wake-up that brought no completion, or busy, at most once a millisecond (every 64th
    /// empty poll reads the clock), as the engine's busy rounds do: a look is a system call on rdma_cm, and on an
    /// emulated CPU 64 empty polls took less than a round trip, so the transport's own ping paid a call per
    /// round trip that exs did not.
    fn next_recv(&mut self, out: &mut Vec<Completion>) -> Result<Option<usize>> {
        let mut empty = 0u32;
        loop {
            out.clear();
            if self.t.poll(out, 8) == 0 {
                empty += 1;
                let look = if self.busy {
                    empty % 64 == 0 && self.looked.elapsed() >= CM_LOOK_EVERY
                } else {
                    empty > 1
                };
                if look {
                    self.looked = Instant::now();
                }
                if look {
                    match self.t.poll_cm() {
                        Some(CmEvent::Disconnected { .. }) => return Ok(None),
                        // The client is in: later requests are strangers'.
                        Some(CmEvent::ConnectRequest { request, .. }) => self.t.reject(request),
                        _ => {}
                    }
                }
                if !self.busy {
                    self.sleep();
                }
                continue;
            }
            let mut got = Vec::new();
            for c in out.drain(..) {
                if c.status == Err(WcError::Flushed) {
                    return Ok(None); // the connection went down
                }
                c.status.map_err(|e| {
                    anyhow!(
                        "a raw {} failed: {e:?}",
                        if c.wr_id == SEND { "send" } else { "receive" }
                    )
                })?;
                if c.wr_id != SEND {
                    got.push(c.wr_id as usize);
                }
            }
            for &slot in &got {
                self.post_recv(slot)?;
            }
            if !got.is_empty() {
                return Ok(Some(got.len()));
            }
        }
    }
}

/// The echo side: accepts one connection and answers every message until the peer disconnects.
fn serve(opened: &Opened, a: &RawpingArgs) -> Result<()> {
    let mut s = Side::new(opened, a.size as usize, a.wait == RawWait::Busy)?;
    let token = crate::helper::token()?;
    let (_, addr) = s.t.listen(opened.listen_addr(0), 1).context("listen")?;
    crate::out::announce(addr)?;
    let request = crate::helper::accept_request(&mut *s.t, token)?;
    s.t.accept(request, EP, &[], Vec::new()).context("accept")?;
    for slot in 0..RECVS {
        s.post_recv(slot)?;
    }
    let mut out = Vec::with_capacity(8);
    while let Some(n) = s.next_recv(&mut out)? {
        for _ in 0..n {
            s.send()?;
        }
    }
    s.t.release(EP);
    Ok(())
}

/// The client: one-way times (half of each round trip) in microseconds, warm-up excluded.
fn ping(opened: &Opened, helper: &Helper, a: &RawpingArgs) -> Result<Vec<f64>> {
    let mut s = Side::new(opened, a.size as usize, a.wait == RawWait::Busy)?;
    let addr = helper.addr;
    s.t.connect(EP, addr, &crate::helper::private(helper.token), Vec::new())
        .with_context(|| format!("connecting to {addr}"))?;
    match next_cm(&mut *s.t)? {
        CmEvent::Established { .. } => {}
        other => bail!("connecting to {addr}: {other:?}"),
    }
    for slot in 0..RECVS {
        s.post_recv(slot)?;
    }
    let warm = a.count / 10;
    let mut samples = Vec::with_capacity(a.count as usize);
    let mut out = Vec::with_capacity(8);
    for i in 0..warm + a.count {
        let t0 = Instant::now();
        s.send()?;
        if s.next_recv(&mut out)?.is_none() {
            bail!("the echo side went away after {i} round trips");
        }
        if i >= warm {
            samples.push(t0.elapsed().as_secs_f64() * 1e6 / 2.0);
        }
    }
    s.t.disconnect(EP);
    let _ = next_cm(&mut *s.t);
    s.t.release(EP);
    Ok(samples)
}

pub fn run(a: RawpingArgs) -> Result<()> {
    let opened = Opened::open(&a.backend)?;
    crate::baseline::refuse_sim(&opened, "rawping")?;
    if a.serve {
        return serve(&opened, &a);
    }
    let mut helper = spawn_server(
        "rawping",
        &a.backend,
        &["--size", &a.size.to_string(), "--wait", &a.wait.to_string()],
    )?;
    let r = ping(&opened, &helper, &a);
    let child = &mut helper.child;
    // The echo side ends when it sees the disconnect; it is not waited for longer than that should take.
    let end = Instant::now() + Duration::from_secs(5);
    while matches!(child.try_wait(), Ok(None)) && Instant::now() < end {
        std::thread::sleep(Duration::from_millis(10));
    }
    let _ = child.kill();
    let _ = child.wait();
    let (mean, median) = mean_median(&mut r?);
    if a.json {
        outln!(
            "{}",
            serde_json::json!({"tool": "raw-ping", "backend": opened.label(), "wait": a.wait.to_string(),
                "size": a.size, "mean_us": mean, "median_us": median})
        );
    } else {
        outln!(
            "raw ping ({}, {} waits): {} B one-way: mean {mean:.2} us, median {median:.2} us",
            opened.label(),
            a.wait,
            a.size
        );
    }
    Ok(())
}

//! Idle connections beside a measurement (`exs ping --idle N`): a server holds many connections of which few are
//! busy, so what one operation costs must not grow with the connections that do nothing. The client opens `N`
//! connections (of the ping's socket type) to the server's listener (many in flight at once), the server accepts them, and both
//! keep them open, silent, while the ping runs over one more connection; then the client closes them.

use std::time::{Duration, Instant};

use anyhow::{bail, Context as _, Result};
use exs::{EventQueue, MemoryRegion, MsgFlags, SockType, Socket};
use serde::{Deserialize, Serialize};

/// Connects (or accepts) this many at once.
const IN_FLIGHT: usize = 64;
/// How long one connection may take to come up.
const PATIENCE: Duration = Duration::from_secs(60);

/// What holding `n` idle connections cost one side.
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize)]
pub struct IdleCost {
    /// Idle connections held.
    pub n: u64,
    /// Seconds to open them all (connect, or accept).
    pub open_secs: f64,
    /// Device-visible memory the context's connections hold with them open (`EngineStats::connection_bytes`),
    /// per idle connection, beyond what it held before.
    pub engine_bytes_per_conn: f64,
    /// Resident memory of the process, per idle connection, beyond what it held before (includes the provider's
    /// own per-connection memory).
    pub rss_bytes_per_conn: f64,
}

/// The process's resident memory in bytes (`/proc/self/statm`), or 0 where it cannot be read.
pub fn rss_bytes() -> u64 {
    let Ok(s) = std::fs::read_to_string("/proc/self/statm") else {
        return 0;
    };
    let pages: u64 = s
        .split_whitespace()
        .nth(1)
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    pages * page_size()
}

/// The kernel's page size, what `/proc/self/statm` counts in (review finding: taken as 4 KiB, it read a
/// sixteenth of the truth on 64 KiB-page kernels).
fn page_size() -> u64 {
    match exs_dma::page_size() {
        0 => 4096,
        n => n as u64,
    }
}

/// Memory snapshot before the idle connections open.
#[derive(Clone, Copy, Debug)]
pub struct Before {
    engine: u64,
    rss: u64,
    at: Instant,
}

impl Before {
    pub fn now(ctx: &exs::Context) -> Before {
        Before {
            engine: ctx.stats().connection_bytes,
            rss: rss_bytes(),
            at: Instant::now(),
        }
    }

    /// The cost of `n` connections opened since this snapshot.
    pub fn cost(&self, ctx: &exs::Context, n: usize) -> IdleCost {
        let per = |now: u64, then: u64| now.saturating_sub(then) as f64 / n.max(1) as f64;
        IdleCost {
            n: n as u64,
            open_secs: self.at.elapsed().as_secs_f64(),
            engine_bytes_per_conn: per(ctx.stats().connection_bytes, self.engine),
            rss_bytes_per_conn: per(rss_bytes(), self.rss),
        }
    }
}

/// Descriptors a connection may hold (libfabric tcp: the socket and its completion queue's two signal pairs, or
/// its epoll set and one pair with `FI_WAIT_FD`); the rest of the process needs a few hundred.
const FDS_PER_CONN: u64 = 5;

/// Makes room for `n` connections' descriptors: the soft limit goes up to the hard one, and (as root) the hard one
/// up to the kernel's `nr_open` when that is not enough. Says so when it cannot.
pub fn make_room_for(n: usize) {
    use nix::sys::resource::{getrlimit, setrlimit, Resource};
    let want = (n as u64).saturating_mul(FDS_PER_CONN) + 512;
    let Ok((soft, hard)) = getrlimit(Resource::RLIMIT_NOFILE) else {
        return;
    };
    if soft >= want {
        return;
    }
    let nr_open = std::fs::read_to_string("/proc/sys/fs/nr_open")
        .ok()
        .and_then(|s| s.trim().parse::<u64>().ok())
        .unwrap_or(hard);
    let target = want.min(nr_open.max(hard));
    if setrlimit(Resource::RLIMIT_NOFILE, target, target.max(hard)).is_err() {
        let _ = setrlimit(Resource::RLIMIT_NOFILE, hard, hard);
    }
    let now = getrlimit(Resource::RLIMIT_NOFILE).map_or(soft, |l| l.0);
    if now < want {
        // Through the log's queue: a server's standard error may be a closed pipe, or one nobody reads.
        crate::log::note(format_args!(
            "exs: {n} connections may need {want} file descriptors; the limit is {now} (raise it with `ulimit -n`)"
        ));
    }
}

/// Opens `n` idle connections of type `ty` to `addr` (a listener of that type), [`IN_FLIGHT`] at a time, each
/// sending the idle connections' token (from the test's `token`) first, as the test's own connection sent its own
/// (the server takes only connections that do, each for its role: see [`crate::admit`]).
pub fn connect(
    ctx: &exs::Context,
    ty: SockType,
    addr: std::net::SocketAddr,
    n: usize,
    token: u64,
) -> Result<Vec<Socket>> {
    /// Marks a token send's event (the others are connects), beside the connection's number.
    const TOLD: u64 = 1 << 63;
    make_room_for(n);
    let eq = EventQueue::new(2 * IN_FLIGHT)?;
    let token = crate::admit::Role::Idle.token(token);
    let t = MemoryRegion::from_vec(ctx, token.to_le_bytes().to_vec())?;
    let mut socks: Vec<Socket> = Vec::with_capacity(n);
    let (mut up, mut told) = (0, 0);
    while told < n {
        while socks.len() < n && socks.len() - told < IN_FLIGHT {
            let s = Socket::new(ctx, ty).context("creating an idle socket")?;
            s.connect(&eq, addr, socks.len() as u64)
                .with_context(|| format!("connecting idle connection {}", socks.len()))?;
            socks.push(s);
        }
        let ev = eq
            .next(Some(PATIENCE))
            .with_context(|| format!("{up} of {n} idle connections up, then no answer"))?;
        let i = (ev.context & !TOLD) as usize;
        if ev.context & TOLD != 0 {
            ev.status
                .with_context(|| format!("sending the test's token on idle connection {i}"))?;
            told += 1;
        } else {
            ev.status
                .with_context(|| format!("idle connection {i} failed after {up} of {n}"))?;
            up += 1;
            socks[i]
                .send(&eq, &t.all(), MsgFlags::NONE, TOLD | i as u64)
                .with_context(|| format!("sending the test's token on idle connection {i}"))?;
        }
    }
    Ok(socks)
}

/// Accepts the client's `n` idle connections on the test's listener (whose descriptors `accept_one` made room for),
/// giving up once the client has gone or the test's time is up (a client that opens them slowly cannot hold the
/// server). With a token (`watch`'s), only connections that send the idle connections' one first count, as for the
/// test's own connection; the others are closed.
pub fn accept(
    admission: &mut crate::admit::Admission,
    n: usize,
    watch: &crate::control::Watch,
) -> Result<Vec<Socket>> {
    admission.take(
        crate::admit::Role::Idle,
        n,
        watch,
        "the client's idle connections",
    )
}

/// Closes every idle connection; the seconds it took until the context's connections held no more memory than
/// `baseline` (what they held before the idle ones opened).
pub fn close(ctx: &exs::Context, socks: Vec<Socket>, baseline: &Before) -> Result<f64> {
    let t0 = Instant::now();
    for s in &socks {
        s.close().context("closing an idle connection")?;
    }
    drop(socks);
    // The connections go once each close has run its course (CLOSE, the peer's answer, the disconnect).
    let deadline = t0 + PATIENCE;
    while ctx.stats().connection_bytes > baseline.engine {
        if Instant::now() > deadline {
            bail!(
                "idle connections still held {} s after closing them",
                PATIENCE.as_secs()
            );
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    Ok(t0.elapsed().as_secs_f64())
}

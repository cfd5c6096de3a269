//! Rates for humans, and what every server side shares (sizes: [`crate::size`]).

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Child, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context as _, Result};

use crate::control::Watch;

/// A page-aligned buffer of `len` bytes (more than 0), every byte written with `0x5A`: what a benchmark sends
/// from and receives into. A buffer never written reads as the kernel's zero page, one physical page behind every
/// page of it, so a software transport that copies out of it (libfabric tcp) reads from the cache, not from
/// memory, and one first written during a run maps its pages then; a `Vec` starts a few bytes past a page boundary.
/// The raw baselines and `exs pump` both use these on both sides, so that they move the same kind of bytes.
pub fn filled_buffer(len: usize) -> anyhow::Result<std::sync::Arc<exs_dma::DmaBuf>> {
    const PIECE: usize = 64 << 10;
    // Refused, not a panic, when the memory is not there (a server's size is the client's, within its limit).
    let buf = exs_dma::DmaBuf::try_new(len)
        .ok_or_else(|| anyhow::anyhow!("could not allocate a buffer of {len} bytes"))?;
    let pattern = [0x5Au8; PIECE];
    for at in (0..len).step_by(PIECE) {
        let n = PIECE.min(len - at);
        buf.write_at(at, &pattern[..n])
            .expect("a new buffer has no lease and the range is inside it");
    }
    Ok(buf)
}

/// Bytes per second as GB/s and Gb/s (decimal, as network rates are quoted).
pub fn fmt_rate(bytes_per_sec: f64) -> String {
    format!(
        "{:.2} GB/s ({:.1} Gb/s)",
        bytes_per_sec / 1e9,
        bytes_per_sec * 8.0 / 1e9
    )
}

/// How long a server waits for the client's exs connection (or a client for anything).
pub const PATIENCE: Duration = Duration::from_secs(60);

/// How long a server waits for a connection's token (see [`accept_one`]; the demo's TCP server too): the client
/// sends it as soon as it is connected.
pub const TOKEN_PATIENCE: Duration = Duration::from_secs(5);

/// Whether the eight bytes a connection sent first are `token`'s (little-endian), and if not, why not.
pub fn check_token(got: &[u8], token: u64) -> Result<()> {
    if got != token.to_le_bytes() {
        bail!("not this test's token");
    }
    Ok(())
}

/// The server side of every tool: listens on `listen` with `options`, tells the caller the bound address, and
/// accepts one connection within [`PATIENCE`], giving up as soon as `watch` sees the client go. Returns the
/// listener's admission (kept while the connection is served: it keeps the listener open, and admits the client's
/// `idle` idle connections) and the accepted socket.
///
/// Anyone may connect to the listener, and first: with a token (`watch`'s), only a connection whose first eight
/// bytes are the token is the client's; the others are closed ([`crate::admit::Admission`] reads the tokens of the
/// connections that came side by side, until the test's time is up).
pub fn accept_one(
    ctx: &exs::Context,
    ty: exs::SockType,
    options: &dyn Fn(exs::SocketOptions) -> exs::SocketOptions,
    listen: SocketAddr,
    announce: &mut dyn FnMut(SocketAddr) -> Result<()>,
    watch: &Watch,
    idle: usize,
) -> Result<(crate::admit::Admission, exs::Socket)> {
    // The listener sets connections up by itself, before any accept: the descriptors for the idle ones must be
    // there from the start.
    if idle > 0 {
        crate::idle::make_room_for(idle);
    }
    let l = exs::Socket::new(ctx, ty).context("creating the listening socket")?;
    // Over the socket's own: the transport's immediate-data threshold stays unless the test sets one.
    let options = options(l.options()?);
    l.set_options(options)
        .with_context(|| format!("setting {options:?}"))?;
    l.bind(listen)
        .with_context(|| format!("binding {listen}"))?;
    let bound = l
        .listen(0)
        .with_context(|| format!("listening on {listen}"))?;
    announce(bound)?;
    let mut admission = crate::admit::Admission::new(l, watch.token(), idle)?;
    let s = admission
        .take(
            crate::admit::Role::Own,
            1,
            watch,
            "the client's exs connection",
        )?
        .pop()
        .ok_or_else(|| anyhow!("no client's exs connection"))?;
    Ok((admission, s))
}

/// The client's exs connection to a test's listener at `addr` (events on `eq`), then `token` sent first on it
/// (see [`accept_one`]).
pub fn connect_to_test(
    ctx: &exs::Context,
    s: &exs::Socket,
    eq: &exs::EventQueue,
    addr: SocketAddr,
    token: u64,
) -> Result<()> {
    s.connect(eq, addr, 0)
        .with_context(|| format!("connecting to the server's exs listener at {addr}"))?;
    eq.next(Some(PATIENCE))
        .with_context(|| format!("connecting to {addr}: no answer"))?
        .status
        .with_context(|| format!("connecting to the server's exs listener at {addr}"))?;
    // The client's side of `accept_one`'s check, before anything else on the connection.
    let bytes = exs::MemoryRegion::from_vec(ctx, token.to_le_bytes().to_vec())?;
    s.send(eq, &bytes.all(), exs::MsgFlags::NONE, 0)
        .context("sending the test's token")?;
    eq.next(Some(PATIENCE))
        .context("sending the test's token: no answer")?
        .status
        .context("sending the test's token")?;
    Ok(())
}

/// The next event within [`PATIENCE`], looking every second whether the client is still there, and refusing to
/// go on once the test has run past the server's time limit (checked after every event: a client that keeps
/// sending cannot keep a test alive).
pub fn wait_watching(eq: &exs::EventQueue, watch: &Watch, what: &str) -> Result<exs::Event> {
    // One buffer per thread, empty between calls: a `Vec` made per event was an allocation on the measured path
    // of every ping.
    thread_local! {
        static ONE: std::cell::RefCell<Vec<exs::Event>> = const { std::cell::RefCell::new(Vec::new()) };
    }
    ONE.with_borrow_mut(|one| {
        let r = dequeue_watching(eq, one, 1, watch, what);
        // Empty again whatever happened: an event taken before the time limit's error goes with that error.
        let ev = one.pop();
        one.clear();
        r?;
        ev.ok_or_else(|| anyhow!("no {what}"))
    })
}

/// Like [`wait_watching`], for a batch: at least one event, at most `max`, appended to `out`.
pub fn dequeue_watching(
    eq: &exs::EventQueue,
    out: &mut Vec<exs::Event>,
    max: usize,
    watch: &Watch,
    what: &str,
) -> Result<()> {
    // The patience is counted from the first wait that ended without an event (one wait, a second, before it): a
    // clock reading per event would be on the measured path of every ping (the server's limit, `in_time`, takes
    // one).
    let mut deadline = None;
    loop {
        match eq.dequeue(out, 1, max, Some(Duration::from_secs(1))) {
            Ok(n) if n > 0 => return watch.in_time(what),
            Ok(_) | Err(exs::DequeueError::TimedOut) => {}
            Err(e) => return Err(e).with_context(|| format!("waiting for {what}")),
        }
        let now = Instant::now();
        if now >= *deadline.get_or_insert(now + PATIENCE.saturating_sub(Duration::from_secs(1))) {
            bail!("no {what} within {} s", PATIENCE.as_secs());
        }
        watch.check(what)?;
    }
}

/// Stops a helper process this one started and collects it: on an early return it would otherwise wait in its
/// `accept` for ever.
pub fn reap(child: &mut Child) {
    let _ = child.kill();
    let _ = child.wait();
}

/// Starts a helper process (a server side) and reads the `LISTEN <addr>` line it prints first; returns the child,
/// the address, and the rest of its standard output.
pub fn spawn_listening(cmd: &mut Command) -> Result<(Child, SocketAddr, BufReader<ChildStdout>)> {
    let mut child = cmd
        .stdout(Stdio::piped())
        .stdin(Stdio::null())
        .spawn()
        .with_context(|| format!("starting {:?}", cmd.get_program()))?;
    let mut out = BufReader::new(child.stdout.take().expect("piped"));
    let mut line = String::new();
    out.read_line(&mut line)
        .context("reading the server process's address")?;
    let addr = match line.trim().strip_prefix("LISTEN ") {
        Some(a) => match a.parse() {
            Ok(addr) => addr,
            Err(e) => {
                reap(&mut child);
                return Err(anyhow::Error::new(e))
                    .with_context(|| format!("the server process's address {a:?}"));
            }
        },
        None => {
            let st = child.wait().ok();
            bail!(
                "the server process did not start (it said {:?}{})",
                line.trim(),
                st.map(|s| format!(", {s}")).unwrap_or_default()
            );
        }
    };
    Ok((child, addr, out))
}

/// The part of a run that `perf stat` counts, when the bench asks (`EXS_PERF_CONTROL` names `perf stat --control`'s
/// fifo and perf starts with its events off, `-D -1`): what is measured (a ping-pong) is counted, not the set-up and
/// tear-down around it (thousands of idle connections opened and closed, which cost more system calls than the
/// ping-pong and vary by more from run to run). Without the variable, nothing happens.
pub struct PerfWindow(Option<std::fs::File>);

impl PerfWindow {
    pub fn from_env() -> Result<PerfWindow> {
        PerfWindow::open(std::env::var_os("EXS_PERF_CONTROL").as_deref())
    }

    /// The window on perf's control fifo at `path` (none: a window that says nothing). Fails at once, rather than
    /// waiting, when nobody reads the fifo (no perf).
    pub fn open(path: Option<&std::ffi::OsStr>) -> Result<PerfWindow> {
        use std::os::unix::fs::OpenOptionsExt as _;
        let Some(path) = path else {
            return Ok(PerfWindow(None));
        };
        let f = std::fs::OpenOptions::new()
            .write(true)
            .custom_flags(nix::fcntl::OFlag::O_NONBLOCK.bits())
            .open(path)
            .with_context(|| {
                format!("opening perf's control fifo {path:?} (EXS_PERF_CONTROL): is perf stat --control reading it?")
            })?;
        Ok(PerfWindow(Some(f)))
    }

    /// Counting starts.
    pub fn enable(&mut self) -> Result<()> {
        self.say("enable\n")
    }

    /// Counting stops.
    pub fn disable(&mut self) -> Result<()> {
        self.say("disable\n")
    }

    fn say(&mut self, cmd: &str) -> Result<()> {
        use std::io::Write as _;
        if let Some(f) = &mut self.0 {
            f.write_all(cmd.as_bytes())
                .context("writing to perf's control fifo")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::{filled_buffer, PerfWindow};
    use std::io::Read as _;
    use std::os::unix::fs::OpenOptionsExt as _;

    /// The buffers the benchmarks send from are written to their last byte, whatever their length against the
    /// piece the pattern is written in (a page left unwritten would be the kernel's zero page again).
    #[test]
    fn a_benchmark_buffer_is_written_to_its_last_byte() {
        for len in [
            1,
            (64 << 10) - 1,
            64 << 10,
            (64 << 10) + 1,
            3 * (64 << 10) + 5,
        ] {
            let buf = filled_buffer(len).unwrap();
            assert_eq!(buf.len(), len);
            let mut back = vec![0u8; len];
            buf.read_at(0, &mut back).expect("in bounds, no lease");
            assert!(back.iter().all(|&b| b == 0x5A), "length {len}");
        }
    }

    /// `exs ping` under the bench's `perf stat -D -1 --control` tells perf, through its fifo, when the ping-pong
    /// starts and ends; with nobody reading the fifo it fails at once instead of waiting for a reader; with no
    /// fifo named it says nothing.
    #[test]
    fn the_perf_window_says_enable_then_disable_to_the_fifo_and_never_waits_for_a_reader() {
        let path = std::env::temp_dir().join(format!("exs-perf-window-{}", std::process::id()));
        let _ = std::fs::remove_file(&path);
        nix::unistd::mkfifo(&path, nix::sys::stat::Mode::S_IRWXU).unwrap();
        assert!(
            PerfWindow::open(Some(path.as_os_str())).is_err(),
            "no reader yet"
        );
        let mut reader = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(nix::fcntl::OFlag::O_NONBLOCK.bits())
            .open(&path)
            .unwrap();
        let mut w = PerfWindow::open(Some(path.as_os_str())).unwrap();
        w.enable().unwrap();
        w.disable().unwrap();
        drop(w);
        let mut said = String::new();
        reader.read_to_string(&mut said).unwrap();
        assert_eq!(said, "enable\ndisable\n");
        std::fs::remove_file(&path).unwrap();
        let mut none = PerfWindow::open(None).unwrap();
        none.enable().unwrap();
        assert!(none.0.is_none());
    }
}

//! Sizes and rates for humans, and what every server side shares.

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Child, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context as _, Result};

use crate::control::Watch;

/// Parses `4096`, `64K`, `1M`, `1G`, `1GiB` (binary units).
pub fn parse_size(s: &str) -> Result<u64> {
    let t = s.trim().trim_end_matches("iB").trim_end_matches('B');
    let (num, mul) = match t.chars().last() {
        Some('K' | 'k') => (&t[..t.len() - 1], 1u64 << 10),
        Some('M' | 'm') => (&t[..t.len() - 1], 1 << 20),
        Some('G' | 'g') => (&t[..t.len() - 1], 1 << 30),
        Some('T' | 't') => (&t[..t.len() - 1], 1 << 40),
        _ => (t, 1),
    };
    let n: u64 = num
        .trim()
        .parse()
        .map_err(|_| anyhow!("not a size: {s:?} (use 4096, 64K, 1M, 1G)"))?;
    n.checked_mul(mul)
        .ok_or_else(|| anyhow!("size too large: {s}"))
}

pub fn fmt_bytes(n: u64) -> String {
    const U: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = n as f64;
    let mut i = 0;
    while v >= 1024.0 && i < U.len() - 1 {
        v /= 1024.0;
        i += 1;
    }
    if i == 0 {
        format!("{n} B")
    } else {
        format!("{v:.2} {}", U[i])
    }
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

/// The server side of every tool: listens on `listen` with `options`, tells the caller the bound address, and
/// accepts one connection within [`PATIENCE`], giving up as soon as `watch` sees the client go. Returns the
/// listener (kept open while the connection is served) and the accepted socket.
pub fn accept_one(
    ctx: &exs::Context,
    ty: exs::SockType,
    options: exs::SocketOptions,
    listen: SocketAddr,
    eq: &exs::EventQueue,
    announce: &mut dyn FnMut(SocketAddr) -> Result<()>,
    watch: &Watch,
) -> Result<(exs::Socket, exs::Socket)> {
    let l = exs::Socket::new(ctx, ty).context("creating the listening socket")?;
    l.set_options(options)
        .with_context(|| format!("setting {options:?}"))?;
    l.bind(listen)
        .with_context(|| format!("binding {listen}"))?;
    let bound = l
        .listen(0)
        .with_context(|| format!("listening on {listen}"))?;
    announce(bound)?;
    l.accept(eq, 0).context("accept")?;
    let mut ev = wait_watching(eq, watch, "the client's exs connection")?;
    ev.status
        .clone()
        .context("accepting the client's exs connection")?;
    let s = ev
        .take_accepted()
        .ok_or_else(|| anyhow!("accepting the client's exs connection: no connection"))?;
    Ok((l, s))
}

/// The next event within [`PATIENCE`], looking every second whether the client is still there, and refusing to
/// go on once the test has run past the server's time limit (checked after every event: a client that keeps
/// sending cannot keep a test alive).
pub fn wait_watching(eq: &exs::EventQueue, watch: &Watch, what: &str) -> Result<exs::Event> {
    let mut one = Vec::with_capacity(1);
    dequeue_watching(eq, &mut one, 1, watch, what)?;
    one.pop().ok_or_else(|| anyhow!("no {what}"))
}

/// Like [`wait_watching`], for a batch: at least one event, at most `max`, appended to `out`.
pub fn dequeue_watching(
    eq: &exs::EventQueue,
    out: &mut Vec<exs::Event>,
    max: usize,
    watch: &Watch,
    what: &str,
) -> Result<()> {
    let deadline = Instant::now() + PATIENCE;
    loop {
        match eq.dequeue(out, 1, max, Some(Duration::from_secs(1))) {
            Ok(n) if n > 0 => return watch.in_time(what),
            Ok(_) | Err(exs::DequeueError::TimedOut) => {}
            Err(e) => return Err(e).with_context(|| format!("waiting for {what}")),
        }
        if Instant::now() >= deadline {
            bail!("no {what} within {} s", PATIENCE.as_secs());
        }
        watch.check(what)?;
    }
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
        Some(a) => a
            .parse()
            .with_context(|| format!("the server process's address {a:?}"))?,
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_with_binary_units() {
        assert_eq!(parse_size("4096").unwrap(), 4096);
        assert_eq!(parse_size("64K").unwrap(), 65536);
        assert_eq!(parse_size("1G").unwrap(), 1 << 30);
        assert_eq!(parse_size("1GiB").unwrap(), 1 << 30);
        assert_eq!(parse_size("16MB").unwrap(), 16 << 20);
        assert!(parse_size("lots").is_err());
        assert!(parse_size("99999999999T").is_err());
        assert_eq!(fmt_bytes(1 << 30), "1.00 GiB");
    }
}

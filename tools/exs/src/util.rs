//! Sizes and rates for humans.

/// Parses `4096`, `64K`, `1M`, `1G`, `1GiB` (binary units).
pub fn parse_size(s: &str) -> Result<u64, String> {
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
        .map_err(|_| format!("not a size: {s:?} (use 4096, 64K, 1M, 1G)"))?;
    n.checked_mul(mul)
        .ok_or_else(|| format!("size too large: {s}"))
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

/// The server side of every tool: listens on `listen` with `options`, tells the caller the bound address, and
/// accepts one connection within a minute. Returns the listener (kept open while the connection is served) and the
/// accepted socket.
pub fn accept_one(
    ctx: &exs::Context,
    ty: exs::SockType,
    options: Vec<exs::SocketOption>,
    listen: std::net::SocketAddr,
    eq: &exs::EventQueue,
    announce: impl FnOnce(std::net::SocketAddr),
) -> Result<(exs::Socket, exs::Socket), String> {
    let l = exs::Socket::new(ctx, ty).map_err(|e| e.to_string())?;
    for o in options {
        l.set_option(o).map_err(|e| e.to_string())?;
    }
    l.bind(listen).map_err(|e| e.to_string())?;
    announce(l.listen(1).map_err(|e| e.to_string())?);
    l.accept(eq, 0).map_err(|e| e.to_string())?;
    let ev = eq
        .next(Some(std::time::Duration::from_secs(60)))
        .map_err(|e| format!("accept: {e}"))?;
    let s = ev
        .accepted
        .ok_or_else(|| format!("accept failed: {:?}", ev.status))?;
    Ok((l, s))
}

/// Starts a helper process (a server side) and reads the `LISTEN <addr>` line it prints first; returns the child,
/// the address, and the rest of its standard output.
pub fn spawn_listening(
    cmd: &mut std::process::Command,
) -> Result<
    (
        std::process::Child,
        std::net::SocketAddr,
        std::io::BufReader<std::process::ChildStdout>,
    ),
    String,
> {
    use std::io::BufRead;
    let mut child = cmd
        .stdout(std::process::Stdio::piped())
        .stdin(std::process::Stdio::null())
        .spawn()
        .map_err(|e| format!("starting {:?}: {e}", cmd.get_program()))?;
    let mut out = std::io::BufReader::new(child.stdout.take().expect("piped"));
    let mut line = String::new();
    out.read_line(&mut line).map_err(|e| e.to_string())?;
    let addr = line
        .trim()
        .strip_prefix("LISTEN ")
        .ok_or_else(|| format!("the server process said {line:?}"))?
        .parse()
        .map_err(|e| format!("the server process's address: {e}"))?;
    Ok((child, addr, out))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_with_binary_units() {
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("64K"), Ok(65536));
        assert_eq!(parse_size("1G"), Ok(1 << 30));
        assert_eq!(parse_size("1GiB"), Ok(1 << 30));
        assert_eq!(parse_size("16MB"), Ok(16 << 20));
        assert!(parse_size("lots").is_err());
        assert!(parse_size("99999999999T").is_err());
        assert_eq!(fmt_bytes(1 << 30), "1.00 GiB");
    }
}

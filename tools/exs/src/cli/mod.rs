//! What the command line accepts: every numeric option's range, as clap value parsers, so that a value out of
//! range is a usage error (exit status 2, like every other) and never coerced, clamped or left to panic later. The
//! server checks a client's parameters against the same ranges (and its operator's caps, `control::Limits`).

use std::ops::RangeInclusive;
use std::time::Duration;

use clap::builder::{RangedU64ValueParser, TypedValueParser};

use crate::size::parse_size;

/// The largest message `exs pump`, `exs ping`, `exs rawpump` and the TCP baselines send.
pub const MAX_MESSAGE: u64 = 16 << 20;
/// The most transfers in flight (`--depth`): the credits a point asks for stay within the socket options' range.
pub const MAX_DEPTH: u64 = 64;
/// The longest run one option asks for, in seconds (a day, as iperf3's `-t`).
pub const MAX_SECONDS: f64 = 86_400.0;
/// The longest soak, in seconds (a week).
pub const MAX_SOAK_SECONDS: u64 = 7 * 86_400;
/// The most pings per size: every sample is kept (8 bytes each) for the median and p99.
pub const MAX_COUNT: u64 = 10_000_000;
/// The largest `exs demo --chunk`: the server keeps eight of them registered.
pub const MAX_CHUNK: u64 = 256 << 20;
/// The most bytes one `exs demo` transfer moves (a pebibyte: far beyond any run, far below overflow).
pub const MAX_TRANSFER: u64 = 1 << 50;
/// The most buffer memory a server may be allowed to register for one test (`--max-memory`).
pub const MAX_MEMORY: u64 = 4 << 30;

/// The most idle connections `exs ping --idle` holds beside its own: what one context accepts, less the ping's.
pub fn max_idle() -> u64 {
    exs::ContextOptions::default()
        .max_connections
        .saturating_sub(1) as u64
}

/// `--seconds`: a positive, finite number of seconds up to [`MAX_SECONDS`] (fractions allowed).
pub fn seconds(s: &str) -> Result<f64, String> {
    let v: f64 = s
        .trim()
        .parse()
        .map_err(|_| "not a number of seconds (e.g. 2 or 0.5)".to_string())?;
    if check_seconds(v, MAX_SECONDS).is_err() {
        return Err(format!("must be more than 0 and at most {MAX_SECONDS}"));
    }
    Ok(v)
}

/// Refuses what is not a positive, finite number of seconds up to `max` (and so always a valid `Duration`).
pub fn check_seconds(v: f64, max: f64) -> Result<(), String> {
    if !(v.is_finite() && v > 0.0 && v <= max) {
        let v = if v.abs() < 1e9 {
            v.to_string()
        } else {
            format!("{v:e}")
        };
        return Err(format!(
            "--seconds {v}: must be more than 0 and at most {max}"
        ));
    }
    Ok(())
}

/// A duration checked by [`check_seconds`].
pub fn duration(secs: f64) -> Duration {
    Duration::try_from_secs_f64(secs).unwrap_or(Duration::ZERO)
}

/// A size with binary suffixes (`4096`, `64K`, `1M`, `1G`) within `range`.
pub fn size_in(range: RangeInclusive<u64>) -> impl TypedValueParser<Value = u64> {
    move |s: &str| -> Result<u64, String> {
        let v = parse_size(s).map_err(|e| e.to_string())?;
        if !range.contains(&v) {
            return Err(format!(
                "must be from {} to {}",
                fmt_size(*range.start()),
                fmt_size(*range.end())
            ));
        }
        Ok(v)
    }
}

/// Refuses a size outside `range`, naming the flag (if any) and the range in binary units.
pub fn check_in(flag: &str, v: u64, range: &RangeInclusive<u64>) -> Result<(), String> {
    if !range.contains(&v) {
        let flag = if flag.is_empty() {
            String::new()
        } else {
            format!("{flag} ")
        };
        return Err(format!(
            "{flag}{}: from {} to {}",
            fmt_size(v),
            fmt_size(*range.start()),
            fmt_size(*range.end())
        ));
    }
    Ok(())
}

/// A whole number within `range` (clap's own message when not).
pub fn count_in(range: RangeInclusive<u64>) -> RangedU64ValueParser<u64> {
    RangedU64ValueParser::new().range(range)
}

/// `--depth`: transfers in flight, 1 to [`MAX_DEPTH`].
pub fn depth() -> RangedU64ValueParser<usize> {
    RangedU64ValueParser::new().range(1..=MAX_DEPTH)
}

/// `--client HOST[:PORT]`: a host name or address with an optional port (resolved when the client connects).
pub fn target(s: &str) -> Result<String, String> {
    let t = s.trim();
    if t.parse::<std::net::SocketAddr>().is_ok()
        || t.trim_matches(['[', ']'])
            .parse::<std::net::IpAddr>()
            .is_ok()
    {
        return Ok(t.to_string());
    }
    let (host, port) = match t.rsplit_once(':') {
        Some((h, p)) => (h, Some(p)),
        None => (t, None),
    };
    if host.is_empty() || host.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return Err(format!("not a host name or address: {host:?}"));
    }
    if let Some(p) = port {
        p.parse::<u16>()
            .map_err(|_| format!("{p:?} is not a port (0 to 65535)"))?;
    }
    Ok(t.to_string())
}

/// A size in the largest binary unit that divides it: `16 MiB`, `32 KiB`, `1000 B`.
pub fn fmt_size(n: u64) -> String {
    const U: [&str; 6] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
    let (mut v, mut i) = (n, 0);
    while v >= 1024 && v % 1024 == 0 && i < U.len() - 1 {
        v /= 1024;
        i += 1;
    }
    format!("{v} {}", U[i])
}

/// Help text of an option with a range.
pub fn help_range(what: &str, lo: u64, hi: u64) -> String {
    format!("{what}, {} to {}", fmt_size(lo), fmt_size(hi))
}

/// A usage error of subcommand `sub` found after parsing (values that conflict with each other): clap's format,
/// with the subcommand's usage, and clap's exit status (2).
pub fn usage_error(sub: &str, msg: impl std::fmt::Display) -> clap::Error {
    use clap::CommandFactory;
    let mut cmd = crate::Cli::command();
    cmd.build();
    match cmd.find_subcommand_mut(sub) {
        Some(c) => c.error(clap::error::ErrorKind::ArgumentConflict, msg),
        None => cmd.error(clap::error::ErrorKind::ArgumentConflict, msg),
    }
}

#[cfg(test)]
mod tests;

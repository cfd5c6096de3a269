//! What a server lets one client ask for. Users run `exs pump|ping|demo --server` on shared hosts (as
//! `iperf3 -s`): every parameter a client sends is checked against the tool's own ranges ([`crate::cli`]) and
//! against these caps, which the server's operator sets on its command line. A client asking for more is refused
//! with a message that names the cap.

use std::time::Instant;

use crate::cli::{self, fmt_size, MAX_COUNT, MAX_MEMORY, MAX_SECONDS, MAX_TRANSFER};
use crate::opts::Wait;

/// What a test may take beyond `--max-seconds` unless `--max-grace` says otherwise: its connection's set-up and
/// close.
pub const GRACE_SECONDS: f64 = 10.0;

/// The caps of one server (`--max-seconds`, `--max-grace`, `--max-bytes`, `--max-count`, `--max-idle`,
/// `--max-memory`, `--max-session`, `--no-busy-wait`).
#[derive(Clone, Debug, clap::Args)]
#[command(
    next_help_heading = "Server limits (with --server: a client that asks for more is refused)"
)]
pub struct Limits {
    /// The longest test, in seconds: the most a pump client may ask for, and the wall time any test may take
    /// (plus `--max-grace` to connect and close).
    #[arg(long, value_name = "SECS", default_value = "300", value_parser = cli::seconds, requires = "server",
          help = format!("The longest test, in seconds (more than 0, at most {MAX_SECONDS}): the most a pump client \
                          may ask for, and the wall time any test may take (plus --max-grace to connect and close)"))]
    pub max_seconds: f64,
    /// The time a test may take beyond `--max-seconds` to set up and close its connection, in seconds.
    #[arg(long, value_name = "SECS", default_value_t = GRACE_SECONDS, value_parser = cli::seconds, requires = "server",
          help = format!("The time a test may take beyond --max-seconds to set up and close its connection, in \
                          seconds (more than 0, at most {MAX_SECONDS})"))]
    pub max_grace: f64,
    /// The most bytes one `exs demo` transfer may move (K, M, G, T suffixes binary).
    #[arg(long, value_name = "SIZE", default_value = "64G", value_parser = cli::size_in(1..=MAX_TRANSFER),
          requires = "server",
          help = cli::help_range("The most bytes one exs demo transfer may move (K, M, G, T suffixes binary)", 1,
                                 MAX_TRANSFER))]
    pub max_bytes: u64,
    /// The most pings one `exs ping` test may ask for.
    #[arg(long, value_name = "N", default_value = "1000000", value_parser = cli::count_in(1..=MAX_COUNT),
          requires = "server", help = format!("The most pings one exs ping test may ask for, 1 to {MAX_COUNT}"))]
    pub max_count: u64,
    /// The most idle connections one `exs ping --idle` test may make the server hold.
    #[arg(long, value_name = "N", default_value = "100", value_parser = cli::count_in(0..=cli::max_idle()),
          requires = "server",
          help = format!("The most idle connections one exs ping --idle test may make the server hold, 0 to {}",
                         cli::max_idle()))]
    pub max_idle: u64,
    /// The most buffer memory one test may make the server register (pinned, on RDMA hardware): pump's
    /// size x depth, demo's eight chunks, ping's message; and, apart, what its connections hold (their control
    /// buffers, a stream's buffer: `exs ping --idle` makes many), which is the server's context's memory budget.
    #[arg(long, value_name = "SIZE", default_value = "256M", value_parser = cli::size_in(1..=MAX_MEMORY),
          requires = "server",
          help = cli::help_range("The most buffer memory one test may make the server register (pinned on RDMA \
                                  hardware), and, apart, what its connections hold (the server's memory budget)",
                                 1, MAX_MEMORY))]
    pub max_memory: u64,
    /// The longest one client may keep the server, in seconds: a test it asks for past that ends its session
    /// (a test already running runs to its end), so that a client sending a short test every few seconds cannot
    /// hold the server for ever, every other client told "busy".
    #[arg(long, value_name = "SECS", default_value = "3600", value_parser = cli::seconds, requires = "server",
          help = format!("The longest one client may keep the server, in seconds (more than 0, at most \
                          {MAX_SECONDS}): a test it asks for past that ends its session"))]
    pub max_session: f64,
    /// Refuses tests that ask this server to poll without sleeping (`--wait busy`, `exs ping`'s default): each
    /// holds one of its cores for its whole length.
    #[arg(long, requires = "server")]
    pub no_busy_wait: bool,
    /// The immediate-data threshold the server's transport gives a new seqpacket socket, set by the server from
    /// its context (`None` in a client's checks): the control buffers a connection registers grow with it.
    #[arg(skip)]
    pub transport_threshold: Option<u32>,
}

impl Limits {
    /// As wide as the command line allows (the grace at its default: the test's own time is what is widened): the
    /// server a client starts for itself on this host.
    pub fn widest() -> Limits {
        Limits {
            max_seconds: MAX_SECONDS,
            max_grace: GRACE_SECONDS,
            max_bytes: MAX_TRANSFER,
            max_count: MAX_COUNT,
            max_idle: cli::max_idle(),
            max_memory: MAX_MEMORY,
            max_session: MAX_SECONDS,
            no_busy_wait: false,
            transport_threshold: None,
        }
    }

    /// A new socket's options on the server, which a test's are laid over: for counting what its connections
    /// register (review finding: counted over the library's defaults, a seqpacket connection on a transport with
    /// a higher threshold, as libfabric tcp's, registers several times what was counted).
    pub fn socket_base(&self, ty: exs::SockType) -> exs::SocketOptions {
        let base = exs::SocketOptions::default();
        match (ty, self.transport_threshold) {
            (exs::SockType::SeqPacket, Some(t)) => base.with_small_packet_max_size(t),
            _ => base,
        }
    }

    /// The same caps as command-line arguments, for a server process.
    pub fn to_args(&self) -> Vec<String> {
        let mut args = vec![
            "--max-seconds".into(),
            self.max_seconds.to_string(),
            "--max-grace".into(),
            self.max_grace.to_string(),
            "--max-bytes".into(),
            self.max_bytes.to_string(),
            "--max-count".into(),
            self.max_count.to_string(),
            "--max-idle".into(),
            self.max_idle.to_string(),
            "--max-memory".into(),
            self.max_memory.to_string(),
            "--max-session".into(),
            self.max_session.to_string(),
        ];
        if self.no_busy_wait {
            args.push("--no-busy-wait".into());
        }
        args
    }

    /// When a test that starts now must have ended, whatever its client does.
    pub fn deadline(&self) -> Instant {
        Instant::now() + cli::duration(self.max_seconds) + cli::duration(self.max_grace)
    }

    /// When a session that starts now takes no more tests.
    pub fn session_end(&self) -> Instant {
        Instant::now() + cli::duration(self.max_session)
    }

    /// Refuses a test longer than `--max-seconds` (or not a valid duration at all).
    pub fn seconds(&self, secs: f64) -> Result<(), String> {
        cli::check_seconds(secs, MAX_SECONDS)?;
        if secs > self.max_seconds {
            return Err(format!(
                "--seconds {secs}: this server allows at most {} (its --max-seconds)",
                self.max_seconds
            ));
        }
        Ok(())
    }

    /// Refuses a transfer of more than `--max-bytes`.
    pub fn bytes(&self, bytes: u64) -> Result<(), String> {
        cli::check_in("--size", bytes, &(1..=MAX_TRANSFER))?;
        if bytes > self.max_bytes {
            return Err(format!(
                "--size {}: this server allows at most {} per transfer (its --max-bytes)",
                fmt_size(bytes),
                fmt_size(self.max_bytes)
            ));
        }
        Ok(())
    }

    /// Refuses more pings than `--max-count`.
    pub fn count(&self, count: u64) -> Result<(), String> {
        if !(1..=MAX_COUNT).contains(&count) {
            return Err(format!("--count {count}: from 1 to {MAX_COUNT}"));
        }
        if count > self.max_count {
            return Err(format!(
                "--count {count}: this server allows at most {} pings per test (its --max-count)",
                self.max_count
            ));
        }
        Ok(())
    }

    /// Refuses a busy-polling wait where `--no-busy-wait` says so.
    pub fn wait(&self, wait: Wait) -> Result<(), String> {
        if self.no_busy_wait && wait == Wait::Busy {
            return Err(
                "--wait busy: this server does not poll without sleeping (its --no-busy-wait); \
                        ask for --wait adaptive or block"
                    .into(),
            );
        }
        Ok(())
    }

    /// Refuses more idle connections than `--max-idle`.
    pub fn idle(&self, n: u32) -> Result<(), String> {
        if u64::from(n) > cli::max_idle() {
            return Err(format!("--idle {n}: from 0 to {}", cli::max_idle()));
        }
        if u64::from(n) > self.max_idle {
            return Err(format!(
                "--idle {n}: this server holds at most {} idle connections per test (its --max-idle)",
                self.max_idle
            ));
        }
        Ok(())
    }

    /// The memory budget of the server's context (`exs::ContextOptions::memory_budget`): the control and stream
    /// buffers of a test's connections, idle ones included, fit in `--max-memory` (the tests' checks count them),
    /// and the context holds twice that, so that the connections of the test before, which go once their close
    /// has run its course (up to the linger time), do not refuse the next one's. One test runs at a time. A
    /// connection beyond it is refused (its peer sees a refusal).
    pub fn engine_budget(&self) -> u64 {
        self.max_memory.saturating_mul(2)
    }

    /// Refuses a test whose buffers on the server would exceed `--max-memory` (`what` says which parameters).
    pub fn memory(&self, bytes: u64, what: &str) -> Result<(), String> {
        if bytes > self.max_memory {
            return Err(format!(
                "{what} needs {} of buffers on the server, which allows {} per test (its --max-memory)",
                fmt_size(bytes),
                fmt_size(self.max_memory)
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_widest_caps_are_what_the_command_line_accepts() {
        use clap::Parser;
        #[derive(Parser)]
        struct T {
            #[arg(long)]
            server: bool,
            #[command(flatten)]
            limits: Limits,
        }
        let args = [
            vec!["t".to_string(), "--server".into()],
            Limits::widest().to_args(),
        ]
        .concat();
        let t = T::try_parse_from(args).unwrap();
        assert_eq!(t.limits.max_bytes, MAX_TRANSFER);
        assert_eq!(t.limits.max_seconds, MAX_SECONDS);
        assert_eq!(t.limits.max_grace, GRACE_SECONDS);
        let d = T::try_parse_from(["t", "--server"]).unwrap().limits;
        assert_eq!(
            (d.max_seconds, d.max_grace, d.max_count, d.max_idle),
            (300.0, GRACE_SECONDS, 1_000_000, 100)
        );
        assert_eq!((d.max_bytes, d.max_memory), (64 << 30, 256 << 20));
        assert_eq!(d.max_session, 3600.0);
        assert_eq!(t.limits.max_session, MAX_SECONDS);
        assert!(
            T::try_parse_from(["t", "--max-seconds", "5"]).is_err(),
            "only a server has limits"
        );
    }

    #[test]
    fn caps_name_themselves_in_refusals() {
        let l = Limits {
            max_seconds: 10.0,
            max_grace: 1.0,
            max_bytes: 1 << 20,
            max_count: 100,
            max_idle: 10,
            max_memory: 1 << 20,
            max_session: 60.0,
            no_busy_wait: true,
            transport_threshold: None,
        };
        assert!(l.seconds(10.0).is_ok());
        assert!(l.seconds(10.5).unwrap_err().contains("--max-seconds"));
        assert!(l.seconds(1e30).is_err());
        assert!(l.seconds(f64::NAN).is_err());
        assert!(l.bytes(2 << 20).unwrap_err().contains("--max-bytes"));
        assert!(l.bytes(0).is_err());
        assert!(l.count(101).unwrap_err().contains("--max-count"));
        assert!(l.count(0).is_err());
        assert!(l.idle(10).is_ok());
        assert!(l.idle(11).unwrap_err().contains("--max-idle"));
        assert!(l.idle(u32::MAX).is_err());
        assert!(l.memory(2 << 20, "x").unwrap_err().contains("--max-memory"));
        assert!(l.wait(Wait::Busy).unwrap_err().contains("--no-busy-wait"));
        assert!(l.wait(Wait::Adaptive).is_ok() && l.wait(Wait::Block).is_ok());
        assert!(Limits::widest().wait(Wait::Busy).is_ok());
    }
}

//! `exs`: the command-line tool of the exs project.

mod admit;
mod backend;
mod baseline;
mod cli;
mod control;
mod demo;
mod helper;
mod idle;
mod log;
mod opts;
mod out;
mod ping;
mod progress;
mod pump;
mod rawping;
mod size;
mod soak;
mod tcp_admit;
mod usage;
mod util;

use anyhow::Result;
use clap::{Parser, Subcommand};
use out::outln;

#[derive(Parser)]
#[command(
    name = "exs",
    version,
    about = "Extended Sockets over RDMA: demo, pump, ping, soak, info",
    after_help = "pump, ping and demo run both sides on this host, or a server (--server) on one host and a client \
                  (--client HOST) on another: control connection on TCP port 18515 (--port). Logs: EXS_LOG or \
                  RUST_LOG (e.g. EXS_LOG=exs=debug), default warn, on stderr."
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Move data client to server through exs and through plain TCP; verify checksums; compare throughput.
    Demo(demo::DemoArgs),
    /// Blast messages client to server (pumpexs): throughput and each side's CPU.
    Pump(pump::PumpArgs),
    /// One-way latency: half the round trip of an echoed message (persistent: time per read).
    Ping(ping::PingArgs),
    /// Baseline: a raw RDMA write/read loop through the backend's transport, no exs protocol.
    Rawpump(baseline::RawArgs),
    /// Baseline: the transport's own ping-pong (two-sided sends, no exs protocol), blocking or busy.
    Rawping(rawping::RawpingArgs),
    /// Baseline: plain TCP throughput (std::net), with or without Nagle.
    Tcppump(baseline::TcppumpArgs),
    /// Baseline: plain TCP one-way latency (half the round trip).
    Tcpping(baseline::TcppingArgs),
    /// A bounded soak: random sizes, flags and closes, every received byte checked.
    Soak(soak::SoakArgs),
    /// Backends compiled in, libfabric providers, and what a backend can do.
    Info(InfoArgs),
}

#[derive(Clone, Debug, clap::Args)]
struct InfoArgs {
    /// One JSON object on stdout instead of text.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    backend: backend::BackendArgs,
}

fn info(a: InfoArgs) -> Result<()> {
    #[allow(unused_mut)]
    let mut providers: Vec<String> = Vec::new();
    #[cfg(feature = "fabric")]
    providers.extend(exs_backend_fabric::providers());
    #[cfg(feature = "verbs")]
    let devices = backend::rdma_devices();
    #[cfg(not(feature = "verbs"))]
    let devices = String::from("none");
    let opened = backend::Opened::open(&a.backend)?;
    let ctx = opened.host()?;
    let c = ctx.capabilities();
    let verbs = backend::verbs_settings(&opened)?;
    // The settings the tool's contexts open with.
    let opts = backend::context_options()?;
    if a.json {
        let mut v = serde_json::json!({"tool": "exs-info", "compiled": backend::compiled(),
            "fabric_providers": providers, "rdma_devices": devices, "backend": opened.label(),
            "name": c.name, "max_message": c.max_message, "max_inline": c.max_inline, "max_sge": c.max_sge,
            "max_send_wr": c.max_send_wr, "max_recv_wr": c.max_recv_wr, "max_read_depth": c.max_read_depth,
            "native_write_imm": c.native_write_imm, "imm_consumes_recv": c.imm_consumes_recv,
            "max_shared_recv": c.max_shared_recv, "rnr_retry": c.rnr_retry,
            "backend_kind": ctx.backend().map(|k| k.to_string()),
            "settings": {"max_connections": opts.max_connections, "connect_timeout_ms": opts.connect_timeout.as_millis() as u64,
                "linger_ms": opts.linger.as_millis() as u64, "memory_budget": opts.memory_budget,
                "keepalive_ms": opts.keepalive.map(|d| d.as_millis() as u64),
                "ack_delay_us": opts.ack_delay.as_micros() as u64, "exposure": format!("{:?}", opts.exposure)},
            "connection_stats": exs::stats::ConnStats::default().entries().iter().map(|(n, _)| *n).collect::<Vec<_>>()});
        if let Some((json, _)) = verbs {
            v["verbs"] = json;
        }
        outln!("{v}");
        return Ok(());
    }
    outln!("backends compiled in: {}", backend::compiled().join(", "));
    #[cfg(feature = "fabric")]
    outln!(
        "libfabric providers with MSG endpoints: {}",
        providers.join(", ")
    );
    #[cfg(feature = "verbs")]
    outln!("RDMA devices: {devices}");
    outln!(
        "{} (backend {}; contexts: at most {} connections, memory budget {} MiB, connect timeout {:?})",
        c.name,
        ctx.backend().map_or_else(|| "unknown".into(), |k| k.to_string()),
        opts.max_connections,
        opts.memory_budget >> 20,
        opts.connect_timeout
    );
    outln!(
        "  max message {} bytes, inline {} bytes, scatter/gather {}",
        c.max_message,
        c.max_inline,
        c.max_sge
    );
    outln!(
        "  send queue {}, receive queue {}, read depth {}",
        c.max_send_wr,
        c.max_recv_wr,
        c.max_read_depth
    );
    outln!(
        "  write-with-immediate: {}, consumes a receive: {}",
        if c.native_write_imm {
            "native"
        } else {
            "emulated (write + send)"
        },
        c.imm_consumes_recv
    );
    outln!(
        "  shared receive queue: {}",
        if c.max_shared_recv > 0 {
            format!("{} buffers", c.max_shared_recv)
        } else {
            "none (each connection posts its own receives)".into()
        }
    );
    if c.max_shared_recv > 0 {
        outln!(
            "  a message that finds no receive posted: {}",
            if c.rnr_retry {
                "waits for one (receiver-not-ready retry; connections share the receive pool)"
            } else {
                "ends its connection (no receiver-not-ready retry: connections post receives of their own)"
            }
        );
    }
    if let Some((_, text)) = verbs {
        out::line(format_args!("{}", text.trim_end_matches('\n')));
    }
    Ok(())
}

/// Logs to stderr: `EXS_LOG`, else `RUST_LOG` (tracing-subscriber's filter syntax, e.g. `exs=debug`), else warn.
fn init_logging() {
    use tracing_subscriber::EnvFilter;
    let spec = ["EXS_LOG", "RUST_LOG"]
        .iter()
        .find_map(|k| std::env::var(k).ok().filter(|v| !v.trim().is_empty()));
    let filter = match spec.as_deref().map(EnvFilter::try_new) {
        Some(Ok(f)) => f,
        Some(Err(e)) => {
            crate::log::note(format_args!(
                "exs: ignoring the log filter {:?}: {e}",
                spec.unwrap_or_default()
            ));
            EnvFilter::new("warn")
        }
        None => EnvFilter::new("warn"),
    };
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        // Through a queue: a stalled reader of standard error costs lines, not a server's progress (`log`).
        .with_writer(log::Stderr)
        // A line that cannot be written is lost, not reported with `eprintln!`, which panics when standard error
        // is a closed pipe (a server whose log reader went away died at the first stranger it logged).
        .log_internal_errors(false)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
}

impl Cmd {
    /// What clap cannot check alone: values that conflict with each other (a usage error, like clap's own).
    fn validate(&self) -> Result<(), (&'static str, String)> {
        match self {
            Cmd::Pump(a) if !a.peer.server => pump::points(a).map(|_| ()).map_err(|e| ("pump", e)),
            Cmd::Ping(a) if !a.peer.server => ping::points(a).map(|_| ()).map_err(|e| ("ping", e)),
            _ => Ok(()),
        }
    }
}

fn main() {
    let cli = Cli::parse();
    if let Err((sub, msg)) = cli.cmd.validate() {
        cli::usage_error(sub, msg).exit();
    }
    init_logging();
    // A panic's message goes through the log's queue, after the lines queued before it, and the hook waits at
    // most a second for it to go out. This runs for panics that exs catches in its progress rounds too, where the
    // thread goes on: the standard hook's direct write to a standard error nobody reads held that thread for good
    // (review finding). A panic of the log's own writer thread goes to the standard hook. A server's reports are
    // left to the flush at exit.
    let previous = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        if !log::panic_to_log(info, std::time::Duration::from_secs(1)) {
            previous(info);
        }
    }));
    let r = match cli.cmd {
        Cmd::Demo(a) => demo::run(a),
        Cmd::Info(a) => info(a),
        Cmd::Soak(a) => soak::run(a),
        Cmd::Pump(a) => pump::run(a),
        Cmd::Ping(a) => ping::run(a),
        Cmd::Rawpump(a) => baseline::run_raw(a),
        Cmd::Rawping(a) => rawping::run(a),
        Cmd::Tcppump(a) => baseline::run_tcppump(a),
        Cmd::Tcpping(a) => baseline::run_tcpping(a),
    };
    // At most 2 s in all for the log before exiting, however stalled standard error is.
    let end = std::time::Instant::now() + std::time::Duration::from_secs(2);
    let left = || end.saturating_duration_since(std::time::Instant::now());
    if let Err(e) = &r {
        // The whole chain, outermost first: what was being done, then why. Not `eprintln!`, which panics (exit
        // status 101, not 1) when standard error is a closed pipe.
        log::note_patiently(format_args!("exs: error: {e:#}"), left());
    }
    // What is queued goes out first, unless standard error's reader stopped for good.
    log::flush(left());
    if r.is_err() || out::failed() {
        std::process::exit(1);
    }
}

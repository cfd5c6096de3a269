//! `exs`: the command-line tool of the exs project.

mod backend;
mod baseline;
mod demo;
mod ping;
mod progress;
mod pump;
mod soak;
mod usage;
mod util;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "exs",
    about = "Extended Sockets over RDMA: demo, pump, ping, soak, info"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Move data client to server through exs and through plain TCP; verify checksums; compare throughput.
    Demo(demo::DemoArgs),
    /// The server side of `exs demo` (started by it).
    #[command(hide = true)]
    DemoServer(demo::ServerArgs),
    /// Blast messages client to server (pumpexs): throughput and each side's CPU.
    Pump(pump::PumpArgs),
    #[command(hide = true)]
    PumpServer(pump::PumpServerArgs),
    /// One-way latency: half the round trip of an echoed message (persistent: time per read).
    Ping(ping::PingArgs),
    #[command(hide = true)]
    PingServer(ping::PingServerArgs),
    /// Baseline: a raw RDMA write/read loop through the backend's transport, no exs protocol.
    Rawpump(baseline::RawArgs),
    /// Baseline: plain TCP throughput (std::net), with or without Nagle.
    Tcppump(baseline::TcpArgs),
    /// Baseline: plain TCP one-way latency (half the round trip).
    Tcpping(baseline::TcpArgs),
    /// A bounded soak: random sizes, flags and closes, every received byte checked.
    Soak(soak::SoakArgs),
    /// Backends compiled in, libfabric providers, and what a backend can do.
    Info(backend::BackendArgs),
}

fn info(a: backend::BackendArgs) -> Result<(), String> {
    println!("backends compiled in: {}", backend::compiled().join(", "));
    #[cfg(feature = "fabric")]
    println!(
        "libfabric providers with MSG endpoints: {}",
        exs_backend_fabric::providers().join(", ")
    );
    #[cfg(feature = "verbs")]
    println!("RDMA devices: {}", backend::rdma_devices());
    let opened = backend::Opened::open(&a)?;
    let ctx = opened.host()?;
    let c = ctx.capabilities();
    println!("{}:", c.name);
    println!(
        "  max message {} bytes, inline {} bytes, scatter/gather {}",
        c.max_message, c.max_inline, c.max_sge
    );
    println!(
        "  send queue {}, receive queue {}, read depth {}",
        c.max_send_wr, c.max_recv_wr, c.max_read_depth
    );
    println!(
        "  write-with-immediate: {}, consumes a receive: {}",
        if c.native_write_imm {
            "native"
        } else {
            "emulated (write + send)"
        },
        c.imm_consumes_recv
    );
    println!(
        "  shared receive queue: {}",
        if c.max_shared_recv > 0 {
            format!("{} buffers", c.max_shared_recv)
        } else {
            "none (each connection posts its own receives)".into()
        }
    );
    Ok(())
}

fn main() {
    let cli = Cli::parse();
    let r = match cli.cmd {
        Cmd::Demo(a) => demo::run(a),
        Cmd::DemoServer(a) => demo::server(a),
        Cmd::Info(a) => info(a),
        Cmd::Soak(a) => soak::run(a),
        Cmd::Pump(a) => pump::run(a),
        Cmd::PumpServer(a) => pump::server(a),
        Cmd::Ping(a) => ping::run(a),
        Cmd::Rawpump(a) => baseline::run_raw(a),
        Cmd::Tcppump(a) => baseline::run_tcppump(a),
        Cmd::Tcpping(a) => baseline::run_tcpping(a),
        Cmd::PingServer(a) => ping::server(a),
    };
    if let Err(e) = r {
        eprintln!("exs: error: {e}");
        std::process::exit(1);
    }
}

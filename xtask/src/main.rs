//! `cargo xtask`: install what the project needs, run its tests, benchmarks and demo.

mod bench;
mod capi;
mod demo;
mod outside;
mod package;
mod runner;
mod rxe;
mod siw;
mod soak;
mod sys;
mod test;
mod test_siw;
mod twohosts;
mod vm;
mod vmcmd;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "cargo xtask", about = "exs project automation")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Build everything and run every test: the workspace, then the conformance suite per backend.
    Test(test::TestArgs),
    /// The ES-API for C: lays out DIR/include/exs.h, DIR/lib/libexs.so, libexs.a and lib/pkgconfig/exs.pc
    /// (--prefix DIR, default target/c).
    C(capi::CArgs),
    /// The main job: move 1 GiB through exs with a progress bar, verify it, and compare with plain TCP.
    /// Flags go to `exs demo` (--backend, --size, --provider, --chunk, --depth).
    Demo {
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// Benchmarks beside the peers (--quick: a subset, about ten minutes): CSV, SVG plots, bench/<suite>.md.
    Bench(bench::BenchArgs),
    /// The public crates packaged, with every file their builds read; then a crate outside the workspace that depends
    /// on the packaged `exs` alone builds and runs the examples, and a first program with each backend feature alone
    /// and all together (part of `test`).
    Outside,
    /// The bounded soak on sim and libfabric tcp: random sizes, flags and closes, every byte checked.
    Soak(soak::SoakArgs),
    /// Soft-RoCE on this machine (kernels with rdma_rxe): up [--link], down, status.
    Rxe(rxe::RxeArgs),
    /// Runs a command inside the throw-away QEMU guest with Soft-RoCE (rxe0 on 192.168.77.1; `--siw`: siw0). With
    /// `--hosts 2`: two guests, each with its own kernel and rxe0 (siw0) on eth0, joined by a virtual link (10.77.0.1
    /// and 10.77.0.2);
    /// the arguments are two shell lines, the first run in guest 0 and the second in guest 1 (`retry CMD` retries
    /// a client until the server is up); without them, `exs pump` and `ib_write_bw` server in guest 0, client in 1.
    Vm {
        /// Guests: 1, or 2 joined by a link.
        #[arg(long, default_value_t = 1)]
        hosts: usize,
        /// soft-iWARP (siw0, built for the guest's kernel) instead of Soft-RoCE (rxe0).
        #[arg(long)]
        siw: bool,
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
}

fn main() {
    let cli = Cli::parse();
    let r = match cli.cmd {
        Cmd::Test(a) => test::run(a),
        Cmd::C(a) => capi::run(a),
        Cmd::Demo { args } => demo::run(args),
        Cmd::Vm {
            hosts: 2,
            siw,
            args,
        } => vmcmd::run_pair_command(args, siw),
        Cmd::Vm {
            hosts: 1,
            siw,
            args,
        } if !args.is_empty() => vmcmd::run_command(args, siw),
        Cmd::Vm { hosts, .. } => Err(format!(
            "cargo xtask vm: --hosts {hosts} with {} (one guest takes a command; two take two shell lines or none)",
            if hosts == 1 { "no command" } else { "an unsupported count" }
        )),
        Cmd::Rxe(a) => rxe::run(a),
        Cmd::Soak(a) => soak::run(a),
        Cmd::Outside => package::stage(&mut test::debug_build())
            .and_then(|line| Ok(format!("{line}\n{}", outside::run()?)))
            .and_then(|lines| Ok(format!("{lines}\n{}", outside::features::run()?)))
            .map(|lines| println!("{lines}")),
        Cmd::Bench(a) => bench::run(a),
    };
    if let Err(e) = r {
        eprintln!("xtask: error: {e}");
        std::process::exit(1);
    }
}

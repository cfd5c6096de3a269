//! `cargo xtask`: install what the project needs, run its tests, benchmarks and demo.

mod sys;
mod test;

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
}

fn main() {
    let cli = Cli::parse();
    let r = match cli.cmd {
        Cmd::Test(a) => test::run(a),
    };
    if let Err(e) = r {
        eprintln!("xtask: error: {e}");
        std::process::exit(1);
    }
}

//! `cargo xtask soak --minutes N`: the bounded soak (`exs soak`) on the simulated fabric and on libfabric tcp,
//! half the time each, in a release build.

use std::process::Command;

use clap::Args;

use crate::sys::{self, Result};

#[derive(Args)]
pub struct SoakArgs {
    /// Total minutes (split between the backends).
    #[arg(long, default_value_t = 10.0)]
    pub minutes: f64,
    /// Seed of the random choices.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
}

/// Runs `exs soak` for `seconds` on each backend with the given binary; returns the SOAK summary lines.
pub fn soak_with(exe: &std::path::Path, seconds: u64, seed: u64) -> Result<Vec<String>> {
    let mut lines = Vec::new();
    for backend in ["sim", "fabric"] {
        let out = sys::output(Command::new(exe).args([
            "soak",
            "--backend",
            backend,
            "--seconds",
            &seconds.to_string(),
            "--seed",
            &seed.to_string(),
        ]))?;
        print!("{out}");
        lines.extend(
            out.lines()
                .filter(|l| l.starts_with("SOAK"))
                .map(str::to_string),
        );
    }
    Ok(lines)
}

pub fn run(a: SoakArgs) -> Result<()> {
    sys::ensure_packages(sys::BUILD_PACKAGES)?;
    sys::run(sys::cargo().args(["build", "--release", "-p", "exs-tools"]))?;
    let exe = sys::root().join("target/release/exs");
    let seconds = ((a.minutes * 60.0) / 2.0).max(1.0) as u64;
    for l in soak_with(&exe, seconds, a.seed)? {
        eprintln!("{l}");
    }
    Ok(())
}

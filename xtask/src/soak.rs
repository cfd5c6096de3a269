//! `cargo xtask soak --minutes N`: the bounded soak (`exs soak`) on the simulated fabric and on libfabric tcp, both
//! at once for N minutes, in a release build.

use std::process::{Command, Stdio};

use clap::Args;

use crate::sys::{self, Result};

#[derive(Args)]
pub struct SoakArgs {
    /// Minutes (the two backends soak at the same time).
    #[arg(long, default_value_t = 10.0)]
    pub minutes: f64,
    /// Seed of the random choices.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
}

/// Runs `exs soak` for `seconds` on each backend with the given binary, both at once (each is bounded in time, not in
/// work: run one after the other they held a two-core machine twice as long for the same coverage per second);
/// returns the SOAK summary lines.
pub fn soak_with(exe: &std::path::Path, seconds: u64, seed: u64) -> Result<Vec<String>> {
    let children: Vec<_> = ["sim", "fabric"]
        .iter()
        .map(|backend| {
            let mut cmd = Command::new(exe);
            cmd.args([
                "soak",
                "--backend",
                backend,
                "--seconds",
                &seconds.to_string(),
                "--seed",
                &seed.to_string(),
            ]);
            let shown = sys::show(&cmd);
            let child = cmd
                .stdout(Stdio::piped())
                .stderr(Stdio::inherit())
                .spawn()
                .map_err(|e| format!("cannot run {shown}: {e}"));
            (shown, child)
        })
        .collect();
    let mut lines = Vec::new();
    for (shown, child) in children {
        let out = child?
            .wait_with_output()
            .map_err(|e| format!("{shown}: {e}"))?;
        let text = String::from_utf8_lossy(&out.stdout);
        print!("{text}");
        if !out.status.success() {
            return Err(format!("command failed ({}): {shown}", out.status));
        }
        lines.extend(
            text.lines()
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
    let seconds = (a.minutes * 60.0).max(1.0) as u64;
    for l in soak_with(&exe, seconds, a.seed)? {
        eprintln!("{l}");
    }
    Ok(())
}

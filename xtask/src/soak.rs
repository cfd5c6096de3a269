//! `cargo xtask soak --minutes N`: the bounded soak (`exs soak`) on the simulated fabric and on libfabric tcp, both
//! at once for N minutes, in a release build.

use std::io::{BufRead, BufReader};
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
/// work: run one after the other they held the machine twice as long); returns the SOAK summary lines. Every child
/// is waited for, and every failure reported; each child's progress lines on stderr carry its backend.
pub fn soak_with(exe: &std::path::Path, seconds: u64, seed: u64) -> Result<Vec<String>> {
    let mut running = Vec::new();
    for backend in ["sim", "fabric"] {
        let mut cmd = Command::new(exe);
        cmd.args(["soak", "--backend", backend])
            .args([
                "--seconds",
                &seconds.to_string(),
                "--seed",
                &seed.to_string(),
            ])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let shown = sys::show(&cmd);
        match cmd.spawn() {
            Ok(mut child) => {
                let err = child.stderr.take().map(|e| {
                    std::thread::spawn(move || {
                        for l in BufReader::new(e).lines().map_while(|l| l.ok()) {
                            eprintln!("[{backend}] {l}");
                        }
                    })
                });
                running.push((shown, child, err));
            }
            Err(e) => {
                for (_, mut child, _) in running {
                    let _ = child.kill();
                    let _ = child.wait();
                }
                return Err(format!("cannot run {shown}: {e}"));
            }
        }
    }
    let mut lines = Vec::new();
    let mut failed = Vec::new();
    for (shown, child, err) in running {
        let out = child.wait_with_output();
        if let Some(t) = err {
            let _ = t.join();
        }
        match out {
            Err(e) => failed.push(format!("{shown}: {e}")),
            Ok(out) => {
                let text = String::from_utf8_lossy(&out.stdout);
                print!("{text}");
                if !out.status.success() {
                    failed.push(format!("command failed ({}): {shown}", out.status));
                }
                lines.extend(
                    text.lines()
                        .filter(|l| l.starts_with("SOAK"))
                        .map(str::to_string),
                );
            }
        }
    }
    if failed.is_empty() {
        Ok(lines)
    } else {
        Err(failed.join("; "))
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Both children are waited for and both failures reported (the first one's no longer hides the second's).
    #[test]
    fn every_failed_soak_is_reported() {
        let e = soak_with(std::path::Path::new("false"), 1, 1).unwrap_err();
        assert!(
            e.contains("--backend sim") && e.contains("--backend fabric"),
            "{e}"
        );
    }

    #[test]
    fn a_soak_that_cannot_start_is_an_error() {
        let e = soak_with(std::path::Path::new("/nonexistent/exs"), 1, 1).unwrap_err();
        assert!(e.starts_with("cannot run"), "{e}");
    }
}

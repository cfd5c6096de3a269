//! `cargo xtask demo`: sets up what it needs, then runs `exs demo` (1 GiB through exs beside plain TCP).

use crate::sys::{self, Result};

pub fn run(args: Vec<String>) -> Result<()> {
    sys::ensure_packages(sys::BUILD_PACKAGES)?;
    let mut cmd = std::process::Command::new(sys::dist_exs()?);
    cmd.arg("demo").args(&args);
    sys::run(&mut cmd)
}

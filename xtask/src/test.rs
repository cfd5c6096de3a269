//! `cargo xtask test`.

use clap::Args;

use crate::sys::{self, Result};

#[derive(Args)]
pub struct TestArgs {
    /// Do not try to install missing system packages.
    #[arg(long)]
    pub no_install: bool,
}

pub fn run(args: TestArgs) -> Result<()> {
    if !args.no_install {
        sys::ensure_packages(sys::BUILD_PACKAGES)?;
    }
    sys::run(sys::cargo().args(["build", "--workspace", "--all-targets"]))?;
    sys::run(sys::cargo().args(["test", "--workspace"]))?;
    eprintln!("xtask: all tests passed");
    Ok(())
}

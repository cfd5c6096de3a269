//! Running commands and installing the system packages the project needs (Debian/Ubuntu).

use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};

pub type Result<T> = std::result::Result<T, String>;

/// The workspace root (the parent of xtask/).
pub fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask lives in the workspace")
        .to_path_buf()
}

/// Runs a command, inheriting stdio; fails with a message naming it.
pub fn run(cmd: &mut Command) -> Result<()> {
    let status = status(cmd)?;
    if !status.success() {
        return Err(format!("command failed ({status}): {}", show(cmd)));
    }
    Ok(())
}

pub fn status(cmd: &mut Command) -> Result<ExitStatus> {
    eprintln!("+ {}", show(cmd));
    cmd.status()
        .map_err(|e| format!("cannot run {}: {e}", show(cmd)))
}

/// Runs a command and captures stdout (stderr passes through).
pub fn output(cmd: &mut Command) -> Result<String> {
    let out = cmd
        .stderr(Stdio::inherit())
        .output()
        .map_err(|e| format!("cannot run {}: {e}", show(cmd)))?;
    if !out.status.success() {
        return Err(format!("command failed ({}): {}", out.status, show(cmd)));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

pub fn show(cmd: &Command) -> String {
    let mut s = cmd.get_program().to_string_lossy().into_owned();
    for a in cmd.get_args() {
        s.push(' ');
        s.push_str(&a.to_string_lossy());
    }
    s
}

pub fn have(program: &str) -> bool {
    Command::new("sh")
        .args(["-c", &format!("command -v {program} >/dev/null 2>&1")])
        .status()
        .map(|s| s.success())
        .unwrap_or(false)
}

pub fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
        .unwrap_or(false)
}

fn dpkg_installed(pkg: &str) -> bool {
    Command::new("dpkg-query")
        .args(["-W", "-f=${Status}", pkg])
        .stderr(Stdio::null())
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).contains("install ok installed"))
        .unwrap_or(false)
}

/// Makes sure the Debian packages are installed: installs them when root (non-interactively), or prints the exact
/// command and fails when not.
pub fn ensure_packages(pkgs: &[&str]) -> Result<()> {
    if !have("dpkg-query") {
        let missing = pkgs.join(" ");
        eprintln!("xtask: not a Debian/Ubuntu system; make sure these (or their equivalents) are installed: {missing}");
        return Ok(());
    }
    let missing: Vec<&str> = pkgs
        .iter()
        .copied()
        .filter(|p| !dpkg_installed(p))
        .collect();
    if missing.is_empty() {
        return Ok(());
    }
    let cmd = format!(
        "apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends {}",
        missing.join(" ")
    );
    if !is_root() {
        return Err(format!(
            "missing system packages: {}\nrun as root:\n  {cmd}",
            missing.join(" ")
        ));
    }
    eprintln!("xtask: installing {}", missing.join(" "));
    run(Command::new("sh")
        .args(["-c", &cmd])
        .env("DEBIAN_FRONTEND", "noninteractive"))
}

/// Packages every build needs: rdma-core and libfabric headers, pkg-config, clang for bindgen.
pub const BUILD_PACKAGES: &[&str] = &[
    "pkg-config",
    "libfabric-dev",
    "librdmacm-dev",
    "libibverbs-dev",
    "clang",
    "libclang-dev",
];

/// The profile of what we ship and measure (see `[profile.dist]` in the workspace manifest).
pub const DIST: &str = "dist";

/// Where the `dist` profile's binaries land.
pub fn dist_dir() -> PathBuf {
    root().join("target").join(DIST)
}

/// Builds the `exs` tool as we ship it (the `dist` profile) and returns its path.
pub fn dist_exs() -> Result<PathBuf> {
    run(cargo().args(["build", "--profile", DIST, "-p", "exs-tools"]))?;
    Ok(dist_dir().join("exs"))
}

pub fn cargo() -> Command {
    let mut c = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    c.current_dir(root());
    c
}

/// A build outside the workspace's profiles (a crate of its own in `target/`)
/// gets cargo's default dev profile: full debug information for every dependency, which the workspace builds
/// without (`[profile.dev.package."*"]`), so none of the workspace build's dependencies would be reused. Without
/// debug information, those whose features match are (the stage times of `cargo xtask test` show the saving).
pub const REUSE_DEPS: (&str, &str) = ("CARGO_PROFILE_DEV_DEBUG", "false");

/// `cargo` for a crate of its own at `dir`, building into the workspace's `target/` ([`REUSE_DEPS`]).
pub fn cargo_outside(dir: &std::path::Path) -> Command {
    let mut c = cargo();
    c.current_dir(dir)
        .env("CARGO_TARGET_DIR", root().join("target"))
        .env(REUSE_DEPS.0, REUSE_DEPS.1);
    c
}

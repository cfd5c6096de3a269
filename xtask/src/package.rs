//! The publishable crates: `cargo package` for each (in dependency order, against cargo's local overlay of the
//! workspace's own crates), and the declared `rust-version` checked against the compiler that builds them.

use std::time::Instant;

use crate::sys::{self, Result};

/// A crate of the workspace meant for users.
pub struct Public {
    pub name: String,
    pub version: String,
    /// The declared `rust-version`.
    pub rust_version: Option<String>,
}

/// The workspace's crates meant for users: those without `publish = false` (cargo metadata says `null`, any
/// registry).
pub fn public_crates() -> Result<Vec<Public>> {
    let out = sys::output(sys::cargo().args(["metadata", "--no-deps", "--format-version", "1"]))?;
    let v: serde_json::Value =
        serde_json::from_str(&out).map_err(|e| format!("cargo metadata: {e}"))?;
    let crates: Vec<_> = v["packages"]
        .as_array()
        .ok_or("cargo metadata lists no packages")?
        .iter()
        .filter(|p| p["publish"].is_null())
        .filter_map(|p| {
            Some(Public {
                name: p["name"].as_str()?.to_string(),
                version: p["version"].as_str()?.to_string(),
                rust_version: p["rust_version"].as_str().map(str::to_string),
            })
        })
        .collect();
    if crates.is_empty() {
        return Err("no crate of the workspace is publishable".into());
    }
    Ok(crates)
}

/// `cargo doc` of every public crate with every feature, warnings denied (broken and private intra-doc links are
/// warnings by default, so `-D warnings` denies them too).
pub fn doc_command() -> Result<std::process::Command> {
    let mut cmd = sys::cargo();
    cmd.args(["doc", "--no-deps", "--all-features"]);
    for c in public_crates()? {
        cmd.args(["-p", &c.name]);
    }
    cmd.env("RUSTDOCFLAGS", "-D warnings");
    Ok(cmd)
}

/// `major.minor[.patch]` as numbers, for comparing.
fn version(s: &str) -> Option<(u64, u64, u64)> {
    let mut it = s.split('.').map(|p| p.parse::<u64>().ok());
    Some((it.next()??, it.next()??, it.next().flatten().unwrap_or(0)))
}

/// The compiler's version, from `rustc --version` ("rustc 1.95.0 (... )").
fn rustc_version() -> Result<String> {
    let rustc = std::env::var("RUSTC").unwrap_or_else(|_| "rustc".into());
    let out = sys::output(std::process::Command::new(rustc).arg("--version"))?;
    out.split_whitespace()
        .nth(1)
        .map(|v| v.split('-').next().unwrap_or(v).to_string())
        .ok_or_else(|| format!("cannot read rustc's version from {out:?}"))
}

/// Every public crate declares a `rust-version`, and none is newer than the compiler this test builds with: the
/// declared version is the one CI builds (no older toolchain is installed to prove an older claim).
fn check_rust_versions(crates: &[Public], rustc: &str) -> Result<String> {
    let have = version(rustc).ok_or_else(|| format!("rustc version {rustc:?}"))?;
    let mut declared = Vec::new();
    for Public {
        name, rust_version, ..
    } in crates
    {
        let rv = rust_version
            .as_deref()
            .ok_or_else(|| format!("{name} declares no rust-version"))?;
        let want = version(rv).ok_or_else(|| format!("{name}: rust-version {rv:?}"))?;
        if want > have {
            return Err(format!(
                "{name} declares rust-version {rv}, newer than the compiler in use ({rustc})"
            ));
        }
        if !declared.contains(&rv) {
            declared.push(rv);
        }
    }
    Ok(declared.join(", "))
}

/// Cargo verifies each packaged crate against a local registry of the others (`target/package/tmp-registry`), and
/// extracts their sources under `$CARGO_HOME/registry/src/<that registry's hash>/NAME-VERSION`, reusing an
/// extraction that is already there. The hash comes from the overlay's path, the same for every clone at the same
/// place: a second clean clone at one path was verified against the first one's sources (its tool crate failed
/// to build against an exs without this clone's API). So the extractions of our own crates go first; cargo
/// extracts them again from the `.crate` files it just made.
fn forget_stale_overlay_sources(crates: &[Public]) -> Result<()> {
    let home = std::env::var_os("CARGO_HOME")
        .map(std::path::PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| std::path::Path::new(&h).join(".cargo")))
        .ok_or("neither CARGO_HOME nor HOME is set")?;
    let Ok(registries) = std::fs::read_dir(home.join("registry/src")) else {
        return Ok(()); // nothing extracted yet
    };
    for registry in registries.flatten() {
        for c in crates {
            let dir = registry.path().join(format!("{}-{}", c.name, c.version));
            if dir.is_dir() {
                std::fs::remove_dir_all(&dir)
                    .map_err(|e| format!("removing {}: {e}", dir.display()))?;
            }
        }
    }
    Ok(())
}

/// Packages every public crate (`cargo package`, which also builds each packaged crate on its own, with the
/// dependencies as they would come from the registry). `--offline`: the workspace build before this stage fetched
/// every dependency, and CI may have no network; `--allow-dirty` so that the stage runs on a work in progress.
/// Returns the summary line.
pub fn stage() -> Result<String> {
    let crates = public_crates()?;
    let rustc = rustc_version()?;
    let declared = check_rust_versions(&crates, &rustc)?;
    forget_stale_overlay_sources(&crates)?;
    let start = Instant::now();
    let mut cmd = sys::cargo();
    cmd.args(["package", "--offline", "--allow-dirty"]);
    // Cargo verifies each package as a workspace of its own, without the workspace's profiles.
    cmd.env(sys::REUSE_DEPS.0, sys::REUSE_DEPS.1);
    for c in &crates {
        cmd.args(["-p", &c.name]);
    }
    sys::run(&mut cmd)?;
    Ok(format!(
        "cargo package ({}): packaged and built in {:.0?}; rust-version {declared} (rustc {rustc})",
        crates
            .iter()
            .map(|c| c.name.as_str())
            .collect::<Vec<_>>()
            .join(", "),
        start.elapsed()
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn public(rust_version: Option<&str>) -> Public {
        Public {
            name: "a".into(),
            version: "0.1.0".into(),
            rust_version: rust_version.map(str::to_string),
        }
    }

    #[test]
    fn a_rust_version_newer_than_the_compiler_is_refused() {
        let crates = vec![public(Some("1.96"))];
        assert!(check_rust_versions(&crates, "1.95.0").is_err());
        let crates = vec![public(Some("1.95"))];
        assert_eq!(check_rust_versions(&crates, "1.95.0").unwrap(), "1.95");
        assert_eq!(check_rust_versions(&crates, "1.100.1").unwrap(), "1.95");
    }

    #[test]
    fn a_public_crate_without_a_rust_version_is_refused() {
        let crates = vec![public(None)];
        assert!(check_rust_versions(&crates, "1.95.0").is_err());
    }
}

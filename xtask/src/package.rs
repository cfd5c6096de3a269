//! The publishable crates: `cargo package` for each, unpacked as a registry would serve them; every file a crate's
//! build reads is in its package; the declared `rust-version` is checked against the compiler that builds them. The
//! crates outside the workspace (`outside.rs`, `outside/features.rs`) build `exs` and its backends from these
//! packages.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use crate::sys::{self, Result};

/// A crate of the workspace meant for users.
pub struct Public {
    pub name: String,
    pub version: String,
    /// The directory of its manifest.
    pub dir: PathBuf,
    /// Cargo's package id (as in `cargo metadata` and build messages).
    pub id: String,
    /// The declared `rust-version`.
    pub rust_version: Option<String>,
}

impl Public {
    /// `NAME-VERSION`: the package's file stem, and its top directory.
    fn stem(&self) -> String {
        format!("{}-{}", self.name, self.version)
    }

    /// The `.crate` file `cargo package` writes.
    fn crate_file(&self) -> PathBuf {
        sys::root().join(format!("target/package/{}.crate", self.stem()))
    }
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
                dir: Path::new(p["manifest_path"].as_str()?)
                    .parent()?
                    .to_path_buf(),
                id: p["id"].as_str()?.to_string(),
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

/// Where [`unpack`] puts the packages: one directory per crate, `NAME-VERSION`, as a registry would serve them.
pub fn unpacked_dir() -> PathBuf {
    sys::root().join("target/package/unpacked")
}

/// Packages every public crate without building it (`cargo package --no-verify`: the builds that follow use the
/// packages themselves) and unpacks each `.crate` under [`unpacked_dir`]. `--offline`: the workspace build fetched
/// every dependency, and CI may have no network; `--allow-dirty` so that a work in progress packages too.
fn unpack() -> Result<Vec<Public>> {
    let crates = public_crates()?;
    let mut cmd = sys::cargo();
    cmd.args(["package", "--offline", "--allow-dirty", "--no-verify"]);
    for c in &crates {
        cmd.args(["-p", &c.name]);
    }
    sys::run(&mut cmd)?;
    let dir = unpacked_dir();
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    for c in &crates {
        unpack_one(c, &dir)?;
    }
    remove_stale(&dir, &crates)?;
    Ok(crates)
}

/// Removes what `dir` holds of packages that are not among `crates` (their versions before a version bump, or
/// crates no longer public), so that nothing builds from them by mistake and they do not pile up.
fn remove_stale(dir: &Path, crates: &[Public]) -> Result<()> {
    let current: Vec<String> = crates.iter().map(Public::stem).collect();
    let entries = std::fs::read_dir(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    for entry in entries {
        let path = entry.map_err(|e| format!("{}: {e}", dir.display()))?.path();
        let name = path.file_name().unwrap_or_default().to_string_lossy();
        if current
            .iter()
            .any(|c| *name == **c || *name == format!("{c}.crate"))
        {
            continue;
        }
        let r = match path.is_dir() {
            true => std::fs::remove_dir_all(&path),
            false => std::fs::remove_file(&path),
        };
        r.map_err(|e| format!("{}: {e}", path.display()))?;
    }
    Ok(())
}

/// Unpacks one crate's `.crate` under `dir`, unless the same `.crate` is unpacked there already. Its files get the
/// time of unpacking (`tar -m`): cargo stamps every file in a `.crate` with one fixed time, and a build that
/// compares times would take a changed source for the one it built before.
fn unpack_one(c: &Public, dir: &Path) -> Result<()> {
    let file = c.crate_file();
    let kept = dir.join(format!("{}.crate", c.stem()));
    let unpacked = dir.join(c.stem());
    let read = |p: &Path| std::fs::read(p).map_err(|e| format!("{}: {e}", p.display()));
    if unpacked.is_dir() && kept.is_file() && read(&kept)? == read(&file)? {
        return Ok(());
    }
    // The copy goes first: an unpacking that fails part way must not pass for done next time.
    let gone = |r: std::io::Result<()>, p: &Path| match r {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(format!("{}: {e}", p.display())),
        _ => Ok(()),
    };
    gone(std::fs::remove_file(&kept), &kept)?;
    gone(std::fs::remove_dir_all(&unpacked), &unpacked)?;
    sys::run(
        Command::new("tar")
            .arg("-xzmf")
            .arg(&file)
            .arg("-C")
            .arg(dir),
    )?;
    std::fs::copy(&file, &kept).map_err(|e| format!("{}: {e}", kept.display()))?;
    Ok(())
}

/// A user's dependency on the packaged `exs` (`extra` inside its braces, as `, features = [...]`), then a
/// `[patch.crates-io]` table serving `patched` (exs's dependencies among our crates, which its packaged manifest
/// names by version) from their packages. The package stage ([`stage`]) unpacks them first.
pub fn exs_from_packages(extra: &str, patched: &[&str]) -> Result<(String, String)> {
    let crates = public_crates()?;
    let path = |name: &str| -> Result<String> {
        let c = crates
            .iter()
            .find(|c| c.name == name)
            .ok_or_else(|| format!("{name} is not a public crate of the workspace"))?;
        let dir = unpacked_dir().join(c.stem());
        match dir.is_dir() {
            true => Ok(format!("{:?}", dir.display().to_string())),
            false => Err(format!(
                "{} is not unpacked (the package stage unpacks it)",
                dir.display()
            )),
        }
    };
    let dependency = format!("exs = {{ path = {}{extra} }}\n", path("exs")?);
    let mut patch = String::from("[patch.crates-io]\n");
    for name in patched {
        patch.push_str(&format!("{name} = {{ path = {} }}\n", path(name)?));
    }
    Ok((dependency, patch))
}

/// The files of the public crates' builds, from the debug build (`build`: that build's cargo command, run again
/// with nothing to do).
#[derive(Default)]
struct Reads {
    /// (crate, file) that the crate's library or build script read (the compiler's dependency lists for them), or
    /// that its build script named (`rerun-if-changed`): each must be in that crate's package.
    own: BTreeSet<(String, PathBuf)>,
    /// What each binary read (the list cargo writes beside it, which names its dependencies' files too).
    bins: Vec<(String, BTreeSet<PathBuf>)>,
}

fn files_read(build: &mut Command, crates: &[Public]) -> Result<Reads> {
    let out = sys::output(build.arg("--message-format=json"))?;
    let root = sys::root();
    let mut reads = Reads::default();
    for v in out
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
    {
        let Some(c) = crates.iter().find(|c| v["package_id"] == c.id.as_str()) else {
            continue;
        };
        let kinds: Vec<&str> = v["target"]["kind"]
            .as_array()
            .map(|k| k.iter().filter_map(|k| k.as_str()).collect())
            .unwrap_or_default();
        let files: Vec<PathBuf> = v["filenames"]
            .as_array()
            .map(|f| {
                f.iter()
                    .filter_map(|f| f.as_str())
                    .map(PathBuf::from)
                    .collect()
            })
            .unwrap_or_default();
        let listed = |lists: Vec<PathBuf>| -> Result<BTreeSet<PathBuf>> {
            let mut read = BTreeSet::new();
            for list in lists {
                let text = std::fs::read_to_string(&list)
                    .map_err(|e| format!("{}: {e}", list.display()))?;
                read.extend(
                    dep_list_files(&text)
                        .into_iter()
                        .map(|p| normalize(&root.join(p))),
                );
            }
            Ok(read)
        };
        let own = match v["reason"].as_str() {
            Some("compiler-artifact") if v["profile"]["test"] == true => BTreeSet::new(),
            // The build script's own dependency list, beside its executable.
            Some("compiler-artifact") if kinds.contains(&"custom-build") => listed(
                files
                    .iter()
                    .map(|f| dep_lists_in(f.parent().unwrap_or(&root)))
                    .collect::<Result<Vec<_>>>()?
                    .concat(),
            )?,
            Some("compiler-artifact") if kinds.contains(&"bin") => {
                let read = listed(files.iter().map(|f| f.with_extension("d")).collect())?;
                reads.bins.push((c.name.clone(), read));
                BTreeSet::new()
            }
            // deps/libNAME-HASH.rmeta: its list is deps/NAME-HASH.d.
            Some("compiler-artifact") if kinds.contains(&"lib") => listed(
                files
                    .iter()
                    .filter(|f| f.extension() == Some("rmeta".as_ref()))
                    .map(|f| {
                        let stem = f.file_stem().and_then(|s| s.to_str()).unwrap_or_default();
                        f.with_file_name(format!("{}.d", stem.strip_prefix("lib").unwrap_or(stem)))
                    })
                    .collect(),
            )?,
            Some("build-script-executed") => rerun_if_changed(&v, c)?,
            _ => BTreeSet::new(),
        };
        reads
            .own
            .extend(own.into_iter().map(|p| (c.name.clone(), p)));
    }
    Ok(reads)
}

/// The files a build script named in its output (`rerun-if-changed`), relative to its crate's directory.
fn rerun_if_changed(v: &serde_json::Value, c: &Public) -> Result<BTreeSet<PathBuf>> {
    let output = Path::new(v["out_dir"].as_str().unwrap_or_default()).with_file_name("output");
    let text =
        std::fs::read_to_string(&output).map_err(|e| format!("{}: {e}", output.display()))?;
    Ok(text
        .lines()
        .filter_map(|l| {
            l.strip_prefix("cargo:rerun-if-changed=")
                .or_else(|| l.strip_prefix("cargo::rerun-if-changed="))
        })
        .map(|p| normalize(&c.dir.join(p)))
        .collect())
}

/// The dependency lists (`*.d`) in a build script's directory.
fn dep_lists_in(dir: &Path) -> Result<Vec<PathBuf>> {
    let entries = std::fs::read_dir(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    Ok(entries
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension() == Some("d".as_ref()))
        .collect())
}

/// The files a dependency list (`target: file file ...`, one rule per line; `\ ` escapes a space) names; lines
/// starting with `#` are the compiler's notes (`# env-dep:NAME=VALUE`), not files.
fn dep_list_files(text: &str) -> Vec<String> {
    let mut files = Vec::new();
    for line in text.lines().filter(|l| !l.starts_with('#')) {
        let Some((_, deps)) = line.split_once(": ") else {
            continue;
        };
        let mut cur = String::new();
        let mut chars = deps.chars().peekable();
        while let Some(ch) = chars.next() {
            match ch {
                '\\' if chars.peek() == Some(&' ') => cur.push(chars.next().unwrap_or(' ')),
                ' ' => files.extend((!cur.is_empty()).then(|| std::mem::take(&mut cur))),
                _ => cur.push(ch),
            }
        }
        files.extend((!cur.is_empty()).then_some(cur));
    }
    files
}

/// Every file of the workspace that a public crate's library or build script read is in that crate's package; so is
/// every file a binary read that none of its dependencies' libraries did. A file elsewhere in the workspace, or left
/// out of the package, would break a build from the registry. Files outside the workspace (the toolchain's, the
/// registry's, system headers) are not ours to ship. Returns how many files were checked.
fn check_files_packaged(crates: &[Public], reads: &Reads) -> Result<usize> {
    let root = sys::root();
    let target = root.join("target");
    let mut packaged = BTreeSet::new();
    for c in crates {
        let listing = sys::output(Command::new("tar").arg("-tzf").arg(c.crate_file()))?;
        let prefix = format!("{}/", c.stem());
        packaged.extend(
            listing
                .lines()
                .filter_map(|l| l.strip_prefix(&prefix))
                .map(|f| c.dir.join(f)),
        );
    }
    let of_libraries: BTreeSet<&PathBuf> = reads.own.iter().map(|(_, p)| p).collect();
    let bins = reads.bins.iter().flat_map(|(c, read)| {
        read.iter()
            .filter(|p| !of_libraries.contains(p))
            .map(move |p| (c, p))
    });
    let mut missing = BTreeSet::new();
    let mut checked = BTreeSet::new();
    for (reader, p) in reads.own.iter().map(|(c, p)| (c, p)).chain(bins) {
        if !p.starts_with(&root) || p.starts_with(&target) {
            continue;
        }
        checked.insert(p);
        let c = crates
            .iter()
            .find(|c| c.name == *reader)
            .ok_or("a reader that is not a public crate")?;
        if !p.starts_with(&c.dir) {
            missing.insert(format!(
                "{} (read by {reader}'s build) is outside {reader}'s directory",
                p.display()
            ));
        } else if !packaged.contains(p) {
            missing.insert(format!(
                "{} (read by {reader}'s build) is not in {reader}'s package",
                p.display()
            ));
        }
    }
    match missing.is_empty() {
        true => Ok(checked.len()),
        false => Err(missing.into_iter().collect::<Vec<_>>().join("; ")),
    }
}

/// `a/b/../c` as `a/c` (dependency lists and build scripts may name files through `..`).
fn normalize(p: &Path) -> PathBuf {
    let mut out = PathBuf::new();
    for c in p.components() {
        match c {
            std::path::Component::ParentDir => {
                out.pop();
            }
            std::path::Component::CurDir => {}
            c => out.push(c),
        }
    }
    out
}

/// Packages every public crate and unpacks it ([`unpack`]); checks that every file each one's build reads is in its
/// package ([`check_files_packaged`]; `build` is the debug build's cargo command) and the declared rust-versions.
/// The packages are built by the stages after this one: `exs` and its backends by the crates outside the workspace.
/// Returns the summary line.
pub fn stage(build: &mut Command) -> Result<String> {
    let start = Instant::now();
    let crates = unpack()?;
    let rustc = rustc_version()?;
    let declared = check_rust_versions(&crates, &rustc)?;
    let reads = files_read(build, &crates)?;
    let checked = check_files_packaged(&crates, &reads)?;
    Ok(format!(
        "cargo package ({}): packaged in {:.0?}, the {checked} files their builds read all packaged; rust-version \
         {declared} (rustc {rustc})",
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

    #[test]
    fn unpacked_packages_of_other_versions_are_removed() {
        let dir = std::env::temp_dir().join(format!("exs-xtask-stale-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        for d in ["a-0.1.0/src", "a-0.0.9/src", "gone-1.0.0"] {
            std::fs::create_dir_all(dir.join(d)).unwrap();
        }
        for f in ["a-0.1.0.crate", "a-0.0.9.crate", "gone-1.0.0.crate"] {
            std::fs::write(dir.join(f), b"x").unwrap();
        }
        remove_stale(&dir, &[public(None)]).unwrap();
        let mut left: Vec<String> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        left.sort();
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(left, ["a-0.1.0", "a-0.1.0.crate"]);
    }

    fn public(rust_version: Option<&str>) -> Public {
        Public {
            name: "a".into(),
            version: "0.1.0".into(),
            dir: PathBuf::from("/w/a"),
            id: "path+file:///w/a#0.1.0".into(),
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

    #[test]
    fn a_dependency_list_names_every_file_of_every_rule() {
        let text = "/t/deps/exs-1.d: exs/src/lib.rs exs/src/a\\ b.rs\n\n/t/deps/libexs-1.rmeta: exs/src/lib.rs\n";
        assert_eq!(
            dep_list_files(text),
            ["exs/src/lib.rs", "exs/src/a b.rs", "exs/src/lib.rs"]
        );
        assert_eq!(
            normalize(Path::new("/w/exs/src/../../README.md")),
            Path::new("/w/README.md")
        );
    }
}

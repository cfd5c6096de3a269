//! soft-iWARP for the guest: Debian builds no kernel with `CONFIG_RDMA_SIW` (not even as a module), but the
//! driver builds out of tree from Debian's own packages: `drivers/infiniband/sw/siw` out of `linux-source-X.Y`,
//! compiled against `linux-headers-<guest kernel>` (same ABI, so the same symbol versions as the guest's
//! `ib_core`). The modules are cached beside the guest image under `target/vm/siw-<kernel>/`; a new kernel
//! version is a new directory, so they are rebuilt when the kernel changes.
//!
//! siw has no module parameters for the MPA connection setup: peer-to-peer mode and the kind of ready-to-receive
//! message (RTR) are constants in its source. Two builds are kept: [`Variant::Stock`] (as upstream: no
//! peer-to-peer) and [`Variant::P2pReadRtr`], which asks for peer-to-peer mode with an RDMA read as the RTR, the
//! way Chelsio's `iw_cxgb4` connects by default (`peer2peer=1`, read RTR).

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::sys::{self, Result};

/// A build of siw.ko.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Variant {
    /// Upstream's settings: MPA v2 without peer-to-peer mode; the passive side may send as soon as it accepted.
    Stock,
    /// MPA peer-to-peer mode with an RDMA read as the ready-to-receive message (iw_cxgb4's default): the active
    /// side's driver sends a zero-length read before anything else, and the passive side reports the connection
    /// established only once that arrived.
    P2pReadRtr,
}

impl Variant {
    pub const ALL: [Variant; 2] = [Variant::Stock, Variant::P2pReadRtr];

    pub fn name(self) -> &'static str {
        match self {
            Variant::Stock => "stock",
            Variant::P2pReadRtr => "p2p-read-rtr",
        }
    }

    /// Source edits: (file, upstream text, replacement). Each must match exactly once, or the build stops (a
    /// kernel whose siw source moved on needs these looked at again).
    fn edits(self) -> &'static [(&'static str, &'static str, &'static str)] {
        match self {
            Variant::Stock => &[],
            Variant::P2pReadRtr => &[
                (
                    "siw_main.c",
                    "const bool peer_to_peer;",
                    "const bool peer_to_peer = true;",
                ),
                (
                    "siw_cm.c",
                    "static __be16 rtr_type = MPA_V2_RDMA_READ_RTR | MPA_V2_RDMA_WRITE_RTR;",
                    "static __be16 rtr_type = MPA_V2_RDMA_READ_RTR;",
                ),
            ],
        }
    }
}

/// Bumped when the way the modules are built changes, so that cached builds are not reused.
const RECIPE: u32 = 1;

/// The built modules, by variant.
pub struct Modules {
    dir: PathBuf,
}

impl Modules {
    /// The path of a variant's `siw.ko`.
    pub fn path(&self, v: Variant) -> PathBuf {
        self.dir.join(v.name()).join("siw.ko")
    }
}

/// `6.1.0-56-amd64` -> `6.1`: the `linux-source-X.Y` package of that kernel.
pub fn source_series(kver: &str) -> Option<String> {
    let mut it = kver.split(['.', '-']);
    let (major, minor) = (it.next()?, it.next()?);
    (major.chars().all(|c| c.is_ascii_digit()) && minor.chars().all(|c| c.is_ascii_digit()))
        .then(|| format!("{major}.{minor}"))
}

/// Builds (or reuses) every variant of siw.ko for kernel `kver`, under `vm_dir`.
pub fn prepare(vm_dir: &Path, kver: &str) -> Result<Modules> {
    let dir = vm_dir.join(format!("siw-{kver}-r{RECIPE}"));
    let m = Modules { dir: dir.clone() };
    if Variant::ALL.iter().all(|v| m.path(*v).exists()) {
        return Ok(m);
    }
    let series = source_series(kver)
        .ok_or_else(|| format!("cannot tell the source series of kernel {kver}"))?;
    let headers = format!("linux-headers-{kver}");
    sys::ensure_packages(&["make", "xz-utils", &headers])?;
    let src = dir.join("src");
    if !src.join("siw_main.c").exists() {
        extract_source(vm_dir, &series, &src)?;
    }
    for v in Variant::ALL {
        if m.path(v).exists() {
            continue;
        }
        let build = dir.join(v.name());
        let _ = fs::remove_dir_all(&build);
        fs::create_dir_all(&build).map_err(|e| e.to_string())?;
        for e in fs::read_dir(&src).map_err(|e| e.to_string())?.flatten() {
            fs::copy(e.path(), build.join(e.file_name())).map_err(|e| e.to_string())?;
        }
        for (file, from, to) in v.edits() {
            let p = build.join(file);
            let text = fs::read_to_string(&p).map_err(|e| format!("{}: {e}", p.display()))?;
            if text.matches(from).count() != 1 {
                return Err(format!(
                    "siw source of {kver}: {file} no longer has exactly one `{from}` (the {} build needs it)",
                    v.name()
                ));
            }
            fs::write(&p, text.replace(from, to)).map_err(|e| e.to_string())?;
        }
        eprintln!("xtask: building siw.ko ({}) for {kver}", v.name());
        sys::run(
            Command::new("make")
                .arg("-C")
                .arg(format!("/usr/src/{headers}"))
                .arg(format!("M={}", build.display()))
                .args(["CONFIG_RDMA_SIW=m", "-j2", "modules"]),
        )?;
        let info = sys::output(
            Command::new("modinfo")
                .args(["-F", "vermagic"])
                .arg(m.path(v)),
        )?;
        if info.split_whitespace().next() != Some(kver) {
            return Err(format!(
                "siw.ko was built for {:?}, not {kver}",
                info.trim()
            ));
        }
    }
    Ok(m)
}

/// Unpacks `drivers/infiniband/sw/siw` of `linux-source-<series>` (downloaded, never installed) into `out`.
fn extract_source(vm_dir: &Path, series: &str, out: &Path) -> Result<()> {
    let pkg = format!("linux-source-{series}");
    let debs = vm_dir.join("debs");
    fs::create_dir_all(&debs).map_err(|e| e.to_string())?;
    let find = || {
        fs::read_dir(&debs).ok().and_then(|rd| {
            rd.flatten().map(|e| e.path()).find(|p| {
                p.file_name()
                    .is_some_and(|n| n.to_string_lossy().starts_with(&format!("{pkg}_")))
            })
        })
    };
    let deb = match find() {
        Some(d) => d,
        None => {
            eprintln!("xtask: fetching {pkg} for the siw driver's source (nothing is installed)");
            sys::run(
                Command::new("apt-get")
                    .args(["download", "-q", &pkg])
                    .current_dir(&debs),
            )?;
            find().ok_or("apt-get download left no linux-source package")?
        }
    };
    let tmp = out.with_extension("tmp");
    let _ = fs::remove_dir_all(&tmp);
    fs::create_dir_all(&tmp).map_err(|e| e.to_string())?;
    let inner = format!("linux-source-{series}/drivers/infiniband/sw/siw");
    // The package holds one tarball of the whole tree; only the driver's directory is unpacked.
    let script = format!(
        "dpkg-deb --fsys-tarfile '{}' | tar -xO ./usr/src/linux-source-{series}.tar.xz | tar -xJ -C '{}' {inner}",
        deb.display(),
        tmp.display()
    );
    sys::run(Command::new("sh").args(["-c", &script]))?;
    let _ = fs::remove_dir_all(out);
    fs::rename(tmp.join(&inner), out).map_err(|e| e.to_string())?;
    let _ = fs::remove_dir_all(&tmp);
    Ok(())
}

/// Shell lines that load a siw build in the guest (its dependencies are in the initramfs' module list) and wait
/// for the driver to be registered. Any siw loaded before is unloaded first (its devices must be gone).
pub fn load_lines(ko: &Path) -> String {
    format!(
        "if [ -d /sys/module/siw ]; then rmmod siw || exit 90; fi\n\
         insmod {} || {{ echo 'exs-vm: insmod siw.ko failed' >&2; exit 90; }}\n",
        ko.display()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_source_series_of_a_debian_kernel() {
        assert_eq!(source_series("6.1.0-56-amd64").as_deref(), Some("6.1"));
        assert_eq!(source_series("6.12.9-amd64").as_deref(), Some("6.12"));
        assert_eq!(source_series("amd64"), None);
    }
}

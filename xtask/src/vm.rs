//! A throw-away QEMU guest with Soft-RoCE or soft-iWARP, for hosts whose kernel has no RDMA.
//!
//! The guest runs Debian's own kernel (downloaded and extracted, never installed) with a busybox initramfs that
//! loads the RDMA module closure, mounts the host root read-only over 9p under a tmpfs overlay, chroots into it
//! (so host-built binaries and rdma-core tools run unchanged), runs a script, writes its stdout, stderr and exit
//! code to a writable 9p share, and powers off. Everything is cached under `target/vm/`.
//!
//! The host root is mounted with `cache=loose`: the guest keeps what it read in its page cache. Without it every
//! start of a program read the whole binary over 9p again, seconds each for the conformance executable under an
//! emulated CPU, and a guest stage starts dozens of programs. Nothing on the host changes what a guest reads while
//! it runs (the results go to their own share, uncached).

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::sys::{self, Result};

/// Host packages the VM needs (qemu, busybox for /init, kmod for depmod/modprobe, rdma-core tools in the chroot).
pub const VM_PACKAGES: &[&str] = &[
    "qemu-system-x86",
    "busybox-static",
    "kmod",
    "iproute2",
    "rdma-core",
    "ibverbs-providers",
    "ibverbs-utils",
    "rdmacm-utils",
    "perftest",
];

/// Modules to load in the guest (their dependencies are resolved with modprobe --show-depends).
const MODULES: &[&str] = &[
    "crc32_generic",
    "rdma_rxe",
    "rdma_ucm",
    "ib_uverbs",
    "ib_umad",
    "9p",
    "9pnet_virtio",
    "overlay",
    "dummy",
    "veth",
    "virtio_pci",
    "virtio_net",
    // siw's dependencies (siw.ko itself is built out of tree and loaded from the host's tree: see `siw`); it asks
    // the crypto API for crc32c, which a guest without modprobe cannot load on demand.
    "libcrc32c",
    "crc32c_generic",
];

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Accel {
    Kvm,
    Tcg,
}

pub struct Vm {
    dir: PathBuf,
    kernel: PathBuf,
    initrd: PathBuf,
    pub kver: String,
    pub accel: Accel,
}

pub struct Outcome {
    pub rc: Option<i32>,
    pub console: String,
}

/// How one guest of a run is set up: its name (for output), and the virtual network card joining it to the other
/// guest of a pair (a QEMU `-netdev` argument), if any.
#[derive(Clone, Debug, Default)]
pub struct Guest {
    pub name: String,
    pub netdev: Option<String>,
    pub mac: Option<String>,
}

/// The two guests of a pair: their link addresses (eth0, joined by a TCP stream between the two QEMUs that
/// carries their Ethernet frames, so no kernel sees both ends).
pub const PAIR_ADDRS: [&str; 2] = ["10.77.0.1", "10.77.0.2"];

/// The software RDMA device a guest gets on its interface.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum GuestDevice {
    /// Soft-RoCE, `rxe0` (the module is in the initramfs).
    Rxe,
    /// soft-iWARP, `siw0`, from this build of siw.ko (see [`crate::siw`]).
    Siw(PathBuf),
}

impl GuestDevice {
    /// The device's name in the guest.
    pub fn name(&self) -> &'static str {
        match self {
            GuestDevice::Rxe => "rxe0",
            GuestDevice::Siw(_) => "siw0",
        }
    }

    /// Shell lines that put the device on `netdev` (loading siw.ko first; siw pins memory against the locked-memory
    /// limit even for root, so the guest's shell lifts it).
    pub fn setup(&self, netdev: &str) -> String {
        match self {
            GuestDevice::Rxe => format!("rdma link add rxe0 type rxe netdev {netdev} || exit 90\n"),
            GuestDevice::Siw(ko) => format!(
                "ulimit -l unlimited\n{}rdma link add siw0 type siw netdev {netdev} || exit 90\n",
                crate::siw::load_lines(ko)
            ),
        }
    }
}

/// Shell lines that bring up the link and the device on it in guest `i` of a pair.
pub fn pair_setup(i: usize, dev: &GuestDevice) -> String {
    format!(
        "ip link set lo up\n\
         ip link set eth0 up || {{ echo 'exs-vm: no eth0' >&2; exit 90; }}\n\
         ip addr add {}/24 dev eth0\n{}",
        PAIR_ADDRS[i],
        dev.setup("eth0")
    )
}

/// Waits until something listens on TCP `port` on this host (read from /proc/net/tcp: a probe connection would
/// be taken for the peer by a QEMU that accepts one).
fn wait_listening(port: u16, timeout: Duration) -> Result<()> {
    let start = Instant::now();
    let needle = format!(":{port:04X} ");
    loop {
        let table = fs::read_to_string("/proc/net/tcp").unwrap_or_default();
        // local_address rem_address st: LISTEN is 0A.
        if table.lines().any(|l| {
            let w: Vec<&str> = l.split_whitespace().collect();
            w.len() > 3 && format!("{} ", w[1]).ends_with(&needle) && w[3] == "0A"
        }) {
            return Ok(());
        }
        if start.elapsed() > timeout {
            return Err(format!(
                "the first guest's QEMU never listened on port {port}"
            ));
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Runs guests, each in its own results directory: unique names even within one process.
static RUNS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

fn kernel_package() -> Result<String> {
    let deps = sys::output(Command::new("apt-cache").args(["depends", "linux-image-amd64"]))?;
    deps.lines()
        .filter_map(|l| l.trim().strip_prefix("Depends: "))
        .find(|p| {
            p.starts_with("linux-image-") && p.chars().nth(12).is_some_and(|c| c.is_ascii_digit())
        })
        .map(str::to_string)
        .ok_or_else(|| {
            "apt-cache does not name a versioned linux-image package (run apt-get update)"
                .to_string()
        })
}

/// Writes a `newc` cpio archive (the initramfs format) of (path, mode, contents) entries.
fn cpio(entries: &[(String, u32, Vec<u8>)]) -> Vec<u8> {
    let mut out = Vec::new();
    let mut push = |name: &str, mode: u32, data: &[u8], ino: u32| {
        let namesize = name.len() + 1;
        let header = format!(
            "070701{ino:08x}{mode:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{namesize:08x}{:08x}",
            0,
            0,
            1,
            0,
            data.len(),
            0,
            0,
            0,
            0,
            0
        );
        out.extend_from_slice(header.as_bytes());
        out.extend_from_slice(name.as_bytes());
        out.push(0);
        while out.len() % 4 != 0 {
            out.push(0);
        }
        out.extend_from_slice(data);
        while out.len() % 4 != 0 {
            out.push(0);
        }
    };
    for (i, (name, mode, data)) in entries.iter().enumerate() {
        push(name, *mode, data, i as u32 + 1);
    }
    push("TRAILER!!!", 0, &[], 0);
    out
}

const INIT: &str = r#"#!/bin/busybox sh
/bin/busybox --install -s /bin
mkdir -p /proc /sys /dev /host /newroot /overlay
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
for m in $(cat /modules.list); do insmod /lib/modules/$m 2>/dev/null || echo "exs-vm: insmod $m failed"; done
RESULTS=$(sed -n 's/.*exs.results=\([^ ]*\).*/\1/p' /proc/cmdline)
mount -t 9p -o trans=virtio,version=9p2000.L,msize=512000,cache=loose,ro hostroot /host || echo "exs-vm: cannot mount the host root"
mount -t tmpfs -o size=2g tmpfs /overlay
mkdir -p /overlay/upper /overlay/work
mount -t overlay overlay -o lowerdir=/host,upperdir=/overlay/upper,workdir=/overlay/work /newroot || echo "exs-vm: overlay failed"
mount -t proc proc /newroot/proc
mount -t sysfs sys /newroot/sys
mount -t devtmpfs dev /newroot/dev
mount -t tmpfs tmpfs /newroot/run
mkdir -p /newroot$RESULTS
mount -t 9p -o trans=virtio,version=9p2000.L,msize=512000 results /newroot$RESULTS || echo "exs-vm: cannot mount results"
echo "exs-vm: running $RESULTS/run.sh"
chroot /newroot /bin/sh $RESULTS/run.sh > /newroot$RESULTS/stdout 2> /newroot$RESULTS/stderr
echo $? > /newroot$RESULTS/rc
sync
echo "exs-vm: done rc=$(cat /newroot$RESULTS/rc)"
poweroff -f
"#;

/// How long the KVM probe waits for a guest that runs `true`. A guest under KVM boots this kernel and its initramfs
/// in a few seconds; where /dev/kvm exists but cannot run it (a nested VM without the CPU's support) the guest prints
/// nothing and the probe waits all of it, once per clean clone (the answer is kept in `target/vm/accel`). A guest
/// that printed its boot but did not finish in time is taken as a slow KVM, not as none.
const KVM_PROBE: Duration = Duration::from_secs(12);

impl Vm {
    /// Where the guest's kernel, initramfs and out-of-tree modules are cached.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Prepares (or reuses) the kernel and initramfs under `target/vm/`.
    pub fn prepare() -> Result<Vm> {
        sys::ensure_packages(VM_PACKAGES)?;
        let dir = sys::root().join("target/vm");
        fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
        let pkg = match kernel_package() {
            Ok(p) => p,
            Err(_) => {
                // A fresh machine has no package lists yet.
                sys::run(Command::new("apt-get").args(["update", "-q"]))?;
                kernel_package()?
            }
        };
        let kver = pkg.trim_start_matches("linux-image-").to_string();
        let root = dir.join(format!("kernel-{kver}"));
        let kernel = root.join(format!("boot/vmlinuz-{kver}"));
        if !kernel.exists() {
            eprintln!("xtask: fetching {pkg} (its vmlinuz and modules; nothing is installed)");
            let debs = dir.join("debs");
            fs::create_dir_all(&debs).map_err(|e| e.to_string())?;
            sys::run(
                Command::new("apt-get")
                    .args(["download", "-q", &pkg])
                    .current_dir(&debs),
            )?;
            let deb = fs::read_dir(&debs)
                .map_err(|e| e.to_string())?
                .filter_map(|e| e.ok())
                .map(|e| e.path())
                .find(|p| {
                    p.file_name()
                        .is_some_and(|n| n.to_string_lossy().starts_with(&format!("{pkg}_")))
                })
                .ok_or("apt-get download left no package")?;
            sys::run(Command::new("dpkg-deb").arg("-x").arg(&deb).arg(&root))?;
            sys::run(Command::new("depmod").arg("-b").arg(&root).arg(&kver))?;
        }
        // The file name carries a hash of what goes in, so a changed /init or module list builds a new one.
        let recipe = format!("{INIT}{}", MODULES.join(","));
        let hash = recipe.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
            (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
        });
        let initrd = dir.join(format!("initrd-{kver}-{:08x}.cpio", hash as u32));
        if !initrd.exists() {
            Self::build_initrd(&root, &kver, &initrd)?;
        }
        let mut vm = Vm {
            dir,
            kernel,
            initrd,
            kver,
            accel: Accel::Tcg,
        };
        vm.accel = vm.probe_accel();
        Ok(vm)
    }

    fn build_initrd(root: &Path, kver: &str, out: &Path) -> Result<()> {
        let mut mods: Vec<String> = Vec::new();
        for m in MODULES {
            let deps = sys::output(Command::new("modprobe").arg("-d").arg(root).args([
                "-S",
                kver,
                "--show-depends",
                m,
            ]))?;
            for l in deps.lines() {
                if let Some(path) = l.strip_prefix("insmod ") {
                    let path = path
                        .split_whitespace()
                        .next()
                        .unwrap_or_default()
                        .to_string();
                    if !mods.contains(&path) {
                        mods.push(path);
                    }
                }
            }
        }
        let mut entries: Vec<(String, u32, Vec<u8>)> = vec![
            ("bin".into(), 0o040755, Vec::new()),
            ("lib".into(), 0o040755, Vec::new()),
            ("lib/modules".into(), 0o040755, Vec::new()),
        ];
        let busybox =
            fs::read("/bin/busybox").map_err(|e| format!("/bin/busybox (busybox-static): {e}"))?;
        entries.push(("bin/busybox".into(), 0o100755, busybox));
        entries.push(("init".into(), 0o100755, INIT.as_bytes().to_vec()));
        let mut list = String::new();
        for m in &mods {
            let name = Path::new(m)
                .file_name()
                .ok_or("bad module path")?
                .to_string_lossy()
                .into_owned();
            let data = fs::read(m).map_err(|e| format!("{m}: {e}"))?;
            entries.push((format!("lib/modules/{name}"), 0o100644, data));
            list.push_str(&name);
            list.push('\n');
        }
        entries.push(("modules.list".into(), 0o100644, list.into_bytes()));
        fs::write(out, cpio(&entries)).map_err(|e| e.to_string())?;
        eprintln!(
            "xtask: initramfs with {} modules: {}",
            mods.len(),
            out.display()
        );
        Ok(())
    }

    /// KVM when it actually boots this kernel (probed once, within [`KVM_PROBE`]), software emulation otherwise.
    fn probe_accel(&self) -> Accel {
        if let Ok(v) = std::env::var("EXS_VM_ACCEL") {
            return if v == "kvm" { Accel::Kvm } else { Accel::Tcg };
        }
        let cache = self.dir.join("accel");
        if let Ok(v) = fs::read_to_string(&cache) {
            return if v.trim() == "kvm" {
                Accel::Kvm
            } else {
                Accel::Tcg
            };
        }
        let mut accel = Accel::Tcg;
        if Path::new("/dev/kvm").exists() {
            let probe = Vm {
                dir: self.dir.clone(),
                kernel: self.kernel.clone(),
                initrd: self.initrd.clone(),
                kver: self.kver.clone(),
                accel: Accel::Kvm,
            };
            match probe.run("true", KVM_PROBE) {
                Ok(o) if o.rc == Some(0) => accel = Accel::Kvm,
                // Slow, but booting: KVM it is (the answer is kept, and emulation would cost every later run).
                Ok(o) if o.rc.is_none() && !o.console.trim().is_empty() => accel = Accel::Kvm,
                _ => eprintln!(
                    "xtask: KVM does not boot the guest here; using software emulation (TCG)"
                ),
            }
        } else {
            eprintln!("xtask: no /dev/kvm; using software emulation (TCG)");
        }
        let _ = fs::write(&cache, if accel == Accel::Kvm { "kvm" } else { "tcg" });
        accel
    }

    /// Runs `script` (sh) in a fresh guest, with a hard timeout.
    pub fn run(&self, script: &str, timeout: Duration) -> Result<Outcome> {
        self.run_streaming(script, timeout, &mut |_, _| {})
    }

    /// [`Vm::run`], handing each line of the script's output to `line` as it appears (`true`: stderr).
    pub fn run_streaming(
        &self,
        script: &str,
        timeout: Duration,
        line: &mut dyn FnMut(&str, bool),
    ) -> Result<Outcome> {
        self.run_guest(&Guest::default(), script, timeout, line)
    }

    /// Two guests at once, joined by a virtual link (eth0: [`PAIR_ADDRS`]), each with its own kernel and its own
    /// device `dev` on that link: `scripts[i]` runs in guest `i` after [`pair_setup`]. Lines reach `line` with the
    /// guest's index.
    pub fn run_pair(
        &self,
        dev: &GuestDevice,
        scripts: [&str; 2],
        timeout: Duration,
        line: &mut dyn FnMut(usize, &str, bool),
    ) -> Result<[Outcome; 2]> {
        // The link is a TCP stream between the two QEMUs (guest 0 listens, guest 1 connects once it does): a
        // UDP tunnel drops bursts (an RDMA read of 1 MiB is a thousand packets) and rxe then retransmits.
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|s| s.local_addr())
            .map(|a| a.port())
            .map_err(|e| format!("a free port for the guests' link: {e}"))?;
        let (tx, rx) = std::sync::mpsc::channel::<(usize, String, bool)>();
        let outcomes = std::thread::scope(|scope| {
            let handles: Vec<_> = (0..2)
                .map(|i| {
                    let tx = tx.clone();
                    let guest = Guest {
                        name: format!("guest{i}"),
                        netdev: Some(format!(
                            "socket,id=link,{}=127.0.0.1:{port}",
                            if i == 0 { "listen" } else { "connect" }
                        )),
                        mac: Some(format!("52:54:00:77:00:0{}", i + 1)),
                    };
                    let script = format!("{}{}", pair_setup(i, dev), scripts[i]);
                    scope.spawn(move || {
                        if i == 1 {
                            wait_listening(port, Duration::from_secs(60))?;
                        }
                        self.run_guest(&guest, &script, timeout, &mut |l, e| {
                            let _ = tx.send((i, l.to_string(), e));
                        })
                    })
                })
                .collect();
            drop(tx);
            for (i, l, e) in rx {
                line(i, &l, e);
            }
            handles
                .into_iter()
                .map(|h| {
                    h.join()
                        .unwrap_or_else(|_| Err("a guest thread panicked".into()))
                })
                .collect::<Vec<_>>()
        });
        let mut it = outcomes.into_iter();
        let a = it.next().ok_or("no first guest")??;
        let b = it.next().ok_or("no second guest")??;
        Ok([a, b])
    }

    /// One guest: `script` with the guest's devices.
    pub fn run_guest(
        &self,
        guest: &Guest,
        script: &str,
        timeout: Duration,
        line: &mut dyn FnMut(&str, bool),
    ) -> Result<Outcome> {
        let results = self.dir.join(format!(
            "run-{}-{}",
            std::process::id(),
            RUNS.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        ));
        let _ = fs::remove_dir_all(&results);
        fs::create_dir_all(&results).map_err(|e| e.to_string())?;
        fs::write(results.join("run.sh"), script).map_err(|e| e.to_string())?;
        let console = results.join("console.log");
        let mut cmd = Command::new("qemu-system-x86_64");
        match self.accel {
            Accel::Kvm => cmd.args(["-accel", "kvm", "-cpu", "max"]),
            Accel::Tcg => cmd.args(["-accel", "tcg,thread=multi", "-cpu", "max"]),
        };
        cmd.args([
            "-m",
            "2048",
            "-smp",
            "2",
            "-nodefaults",
            "-display",
            "none",
            "-no-reboot",
        ]);
        cmd.arg("-serial")
            .arg(format!("file:{}", console.display()));
        cmd.arg("-kernel")
            .arg(&self.kernel)
            .arg("-initrd")
            .arg(&self.initrd);
        cmd.arg("-append").arg(format!(
            // no_timer_check: under an emulated CPU on a busy host the kernel's check of the IO-APIC timer can
            // fail and panic the boot ("IO-APIC + timer doesn't work!"); the timer works. clocksource=tsc
            // tsc=reliable: the kernel otherwise distrusts the emulated TSC and reads the HPET, an emulated device,
            // so every clock read became a system call and a device access (a busy exs ping read the clock about
            // a hundred times per round trip; perftest reads the TSC itself).
            "console=ttyS0 panic=-1 quiet no_timer_check clocksource=tsc tsc=reliable exs.results={}",
            results.display()
        ));
        cmd.args([
            "-virtfs",
            "local,path=/,mount_tag=hostroot,security_model=none,readonly=on,multidevs=remap",
        ]);
        cmd.arg("-virtfs").arg(format!(
            "local,path={},mount_tag=results,security_model=none",
            results.display()
        ));
        if let Some(netdev) = &guest.netdev {
            cmd.arg("-netdev").arg(netdev);
            let mut dev = "virtio-net-pci,netdev=link".to_string();
            if let Some(mac) = &guest.mac {
                dev.push_str(&format!(",mac={mac}"));
            }
            cmd.arg("-device").arg(dev);
        }
        cmd.stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        let start = Instant::now();
        let mut child = cmd
            .spawn()
            .map_err(|e| format!("cannot start qemu-system-x86_64: {e}"))?;
        let mut tails = [
            Tail::new(results.join("stdout"), false),
            Tail::new(results.join("stderr"), true),
        ];
        let status = loop {
            for t in &mut tails {
                t.poll(line);
            }
            if let Some(st) = child.try_wait().map_err(|e| e.to_string())? {
                for t in &mut tails {
                    t.poll(line);
                    t.finish(line);
                }
                break Some(st);
            }
            if start.elapsed() > timeout {
                let _ = child.kill();
                let _ = child.wait();
                break None;
            }
            std::thread::sleep(Duration::from_millis(100));
        };
        let read = |n: &str| fs::read_to_string(results.join(n)).unwrap_or_default();
        let out = Outcome {
            rc: read("rc").trim().parse().ok(),
            console: read("console.log"),
        };
        if status.is_none() {
            eprintln!(
                "xtask: the VM{} did not finish within {timeout:?}; console tail:\n{}",
                if guest.name.is_empty() {
                    String::new()
                } else {
                    format!(" {}", guest.name)
                },
                tail(&out.console, 20)
            );
        }
        let _ = fs::remove_dir_all(&results);
        Ok(out)
    }
}

/// Follows a file the guest writes over 9p, line by line.
struct Tail {
    path: PathBuf,
    stderr: bool,
    offset: u64,
    partial: String,
}

impl Tail {
    fn new(path: PathBuf, stderr: bool) -> Self {
        Tail {
            path,
            stderr,
            offset: 0,
            partial: String::new(),
        }
    }

    fn poll(&mut self, line: &mut dyn FnMut(&str, bool)) {
        use std::io::{Read, Seek, SeekFrom};
        let Ok(mut f) = fs::File::open(&self.path) else {
            return;
        };
        if f.seek(SeekFrom::Start(self.offset)).is_err() {
            return;
        }
        let mut buf = Vec::new();
        if let Ok(n) = f.read_to_end(&mut buf) {
            self.offset += n as u64;
            self.partial.push_str(&String::from_utf8_lossy(&buf));
            while let Some(i) = self.partial.find('\n') {
                let l: String = self.partial.drain(..=i).collect();
                line(l.trim_end_matches('\n'), self.stderr);
            }
        }
    }

    fn finish(&mut self, line: &mut dyn FnMut(&str, bool)) {
        if !self.partial.is_empty() {
            line(&std::mem::take(&mut self.partial), self.stderr);
        }
    }
}

pub fn tail(s: &str, n: usize) -> String {
    let lines: Vec<&str> = s.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// Shell function for the client side of a pair: retries a command (a client whose server is not up yet) for up
/// to a minute.
pub const RETRY: &str = "retry() { i=0; while [ $i -lt 60 ]; do \"$@\"; rc=$?; [ $rc -eq 0 ] && return 0; [ $rc -eq 127 ] && return 127; i=$((i+1)); sleep 1; done; return 1; }\n";

pub fn shell_quote(s: &str) -> String {
    if s.chars()
        .all(|c| c.is_ascii_alphanumeric() || "-_./=:,@".contains(c))
    {
        s.to_string()
    } else {
        format!("'{}'", s.replace('\'', "'\\''"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpio_newc_layout() {
        let a = cpio(&[("init".into(), 0o100755, b"#!x".to_vec())]);
        assert!(a.starts_with(b"070701"));
        assert_eq!(a.len() % 4, 0);
        let s = String::from_utf8_lossy(&a);
        assert!(s.contains("init\0"));
        assert!(s.contains("TRAILER!!!"));
        // filesize field of the first entry: 3 bytes.
        assert_eq!(&a[54..62], b"00000003");
    }

    #[test]
    fn quoting() {
        assert_eq!(shell_quote("abc"), "abc");
        assert_eq!(shell_quote("a b"), "'a b'");
        assert_eq!(shell_quote("it's"), "'it'\\''s'");
    }
}

//! Software RDMA devices: Soft-RoCE (`rdma_rxe`) and soft-iWARP (`siw`).
//!
//! Finds them in sysfs, provisions one on a network interface (`rdma link add NAME type rxe|siw netdev IF`, loading
//! the kernel module first), removes exactly what it added, and tells the verbs backend which device, port and GID
//! index serve an IP address (RoCE v2 uses the IPv4-mapped GID `::ffff:a.b.c.d`; rdma_cm resolves it by itself,
//! raw verbs need the index). An iWARP device's GID is its interface's MAC address, not an IP address: siw's
//! interface is found by that MAC, and its addresses are the interface's.
//!
//! No unsafe code: sysfs is read as files, interface addresses come from `getifaddrs` (nix), and provisioning runs
//! the `rdma` and `modprobe` tools.

use std::fs;
use std::net::{IpAddr, Ipv6Addr};
use std::path::{Path, PathBuf};
use std::process::Command;

/// Kind of RDMA device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// Soft-RoCE (RoCE v2 over UDP, in the kernel).
    Rxe,
    /// Soft-iWARP (iWARP over TCP, in the kernel).
    Siw,
    /// A hardware adapter (or another driver).
    Hardware,
}

impl Kind {
    /// The `rdma link add ... type` name and the kernel module.
    pub fn link_type(self) -> Option<(&'static str, &'static str)> {
        match self {
            Kind::Rxe => Some(("rxe", "rdma_rxe")),
            Kind::Siw => Some(("siw", "siw")),
            Kind::Hardware => None,
        }
    }
}

/// One GID table entry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Gid {
    /// Index in the port's table.
    pub index: u32,
    /// The GID.
    pub gid: Ipv6Addr,
    /// `RoCE v2`, `IB/RoCE v1`, ...
    pub kind: String,
}

impl Gid {
    /// The IPv4 address of an IPv4-mapped GID, or the IPv6 address otherwise.
    pub fn ip(&self) -> IpAddr {
        match self.gid.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => IpAddr::V6(self.gid),
        }
    }
}

/// An RDMA device found in sysfs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Device {
    /// Device name (`rxe0`, `mlx5_0`, ...).
    pub name: String,
    /// What it is.
    pub kind: Kind,
    /// The network interface underneath (software devices and RoCE).
    pub netdev: Option<String>,
    /// Port 1 state (`4: ACTIVE`).
    pub state: String,
    /// Port 1 GIDs in use.
    pub gids: Vec<Gid>,
    /// The addresses of `netdev` (an iWARP device's GIDs carry none).
    pub addrs: Vec<IpAddr>,
}

impl Device {
    /// The GID index that carries `ip` (RoCE v2 preferred).
    pub fn gid_index_for(&self, ip: IpAddr) -> Option<u32> {
        let mut best = None;
        for g in &self.gids {
            if g.ip() == ip {
                if g.kind.contains("v2") {
                    return Some(g.index);
                }
                best.get_or_insert(g.index);
            }
        }
        best
    }

    /// Whether port 1 is active.
    pub fn active(&self) -> bool {
        self.state.contains("ACTIVE")
    }

    /// The IP addresses that reach this device: its GIDs' (RoCE) and its interface's, GIDs first.
    pub fn ips(&self) -> Vec<IpAddr> {
        let mut v: Vec<IpAddr> = self.gids.iter().map(Gid::ip).collect();
        for a in &self.addrs {
            if !v.contains(a) {
                v.push(*a);
            }
        }
        v
    }

    /// Whether `ip` reaches this device (see [`Device::ips`]).
    pub fn serves(&self, ip: IpAddr) -> bool {
        self.ips().contains(&ip)
    }
}

/// Errors of provisioning.
#[derive(Debug, thiserror::Error)]
pub enum SoftRoceError {
    /// The kernel has no such module (no RDMA in this kernel, or the module is not built).
    #[error("the kernel cannot load {module}: {detail}")]
    NoKernelSupport {
        module: &'static str,
        detail: String,
    },
    /// A tool failed.
    #[error("{command} failed: {detail}")]
    Command { command: String, detail: String },
    /// Hardware devices are not provisioned here.
    #[error("{0:?} devices are not provisioned by software")]
    NotSoftware(Kind),
}

fn read(p: &Path) -> Option<String> {
    fs::read_to_string(p).ok().map(|s| s.trim().to_string())
}

/// The sysfs root (overridable for tests).
fn sysfs_root() -> PathBuf {
    std::env::var_os("EXS_SYSFS_INFINIBAND")
        .map(PathBuf::from)
        .unwrap_or_else(|| "/sys/class/infiniband".into())
}

/// Every RDMA device in sysfs.
pub fn devices() -> Vec<Device> {
    devices_in(&sysfs_root())
}

/// Every RDMA device under a sysfs-like directory (`.../infiniband`, with the interfaces in `.../net` beside it).
pub fn devices_in(root: &Path) -> Vec<Device> {
    let Ok(entries) = fs::read_dir(root) else {
        return Vec::new();
    };
    let net = root.parent().map(|p| p.join("net")).unwrap_or_default();
    let mut v: Vec<Device> = entries
        .filter_map(|e| e.ok())
        .filter_map(|e| device(&e.path(), &net))
        .collect();
    v.sort_by(|a, b| a.name.cmp(&b.name));
    v
}

/// The interface under `net` whose MAC address is `mac` (lower-case, colon-separated).
fn netdev_by_mac(net: &Path, mac: &str) -> Option<String> {
    fs::read_dir(net).ok()?.flatten().find_map(|e| {
        let name = e.file_name().to_string_lossy().into_owned();
        (read(&e.path().join("address")).as_deref() == Some(mac)).then_some(name)
    })
}

/// The MAC address an iWARP GID carries in its first six bytes (siw: its interface's).
fn gid_mac(gid: &Ipv6Addr) -> String {
    let o = gid.octets();
    o[..6]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect::<Vec<_>>()
        .join(":")
}

/// The addresses of interface `name`.
fn interface_addrs(name: &str) -> Vec<IpAddr> {
    let Ok(addrs) = nix::ifaddrs::getifaddrs() else {
        return Vec::new();
    };
    addrs
        .filter(|a| a.interface_name == name)
        .filter_map(|a| {
            let s = a.address?;
            if let Some(v4) = s.as_sockaddr_in() {
                return Some(IpAddr::V4(v4.ip()));
            }
            s.as_sockaddr_in6().map(|v6| IpAddr::V6(v6.ip()))
        })
        .collect()
}

fn device(dir: &Path, net: &Path) -> Option<Device> {
    let name = dir.file_name()?.to_string_lossy().into_owned();
    let node_type = read(&dir.join("node_type")).unwrap_or_default();
    let parent = read(&dir.join("parent"));
    let virtual_dev = fs::canonicalize(dir)
        .map(|p| p.to_string_lossy().contains("/virtual/"))
        .unwrap_or(false)
        || parent.is_some();
    let kind = match (virtual_dev, node_type.contains("RNIC")) {
        (true, false) => Kind::Rxe,
        (true, true) => Kind::Siw,
        (false, _) => Kind::Hardware,
    };
    let port = dir.join("ports/1");
    let state = read(&port.join("state")).unwrap_or_default();
    let mut gids = Vec::new();
    let mut raw_gids = Vec::new();
    if let Ok(es) = fs::read_dir(port.join("gids")) {
        for e in es.flatten() {
            let Ok(index) = e.file_name().to_string_lossy().parse::<u32>() else {
                continue;
            };
            let Some(text) = read(&e.path()) else {
                continue;
            };
            let Ok(gid) = text.parse::<Ipv6Addr>() else {
                continue;
            };
            if gid.is_unspecified() {
                continue;
            }
            raw_gids.push(gid);
            if kind == Kind::Siw {
                // iWARP: the GID is the interface's MAC, no address.
                continue;
            }
            let kind = read(&port.join(format!("gid_attrs/types/{index}"))).unwrap_or_default();
            gids.push(Gid { index, gid, kind });
        }
    }
    gids.sort_by_key(|g| g.index);
    let netdev = parent
        .or_else(|| read(&port.join("gid_attrs/ndevs/0")))
        .or_else(|| {
            raw_gids
                .iter()
                .find_map(|g| netdev_by_mac(net, &gid_mac(g)))
                .filter(|_| kind == Kind::Siw)
        });
    let addrs = netdev.as_deref().map(interface_addrs).unwrap_or_default();
    Some(Device {
        name,
        kind,
        netdev,
        state,
        gids,
        addrs,
    })
}

/// The device that `ip` reaches (its GID table, or its interface, carries it).
pub fn device_for_ip(ip: IpAddr) -> Option<Device> {
    devices().into_iter().find(|d| d.serves(ip))
}

/// Whether the running kernel can provide `kind` (module loaded or loadable).
pub fn kernel_supports(kind: Kind) -> Result<(), SoftRoceError> {
    let Some((_, module)) = kind.link_type() else {
        return Err(SoftRoceError::NotSoftware(kind));
    };
    if Path::new("/sys/module").join(module).exists() {
        return Ok(());
    }
    let out = Command::new("modprobe").arg(module).output();
    match out {
        Ok(o) if o.status.success() => Ok(()),
        Ok(o) => Err(SoftRoceError::NoKernelSupport {
            module,
            detail: String::from_utf8_lossy(&o.stderr).trim().into(),
        }),
        Err(e) => Err(SoftRoceError::NoKernelSupport {
            module,
            detail: format!("cannot run modprobe: {e}"),
        }),
    }
}

/// A software device this process added; dropping it removes the device.
#[derive(Debug)]
pub struct Provisioned {
    /// The device name.
    pub name: String,
    /// The interface it sits on.
    pub netdev: String,
    keep: bool,
}

impl Provisioned {
    /// Leaves the device in place when dropped (for `cargo xtask rxe up`).
    pub fn keep(mut self) -> String {
        self.keep = true;
        self.name.clone()
    }
}

impl Drop for Provisioned {
    fn drop(&mut self) {
        if !self.keep {
            let _ = remove(&self.name);
        }
    }
}

fn run(args: &[&str]) -> Result<String, SoftRoceError> {
    let out = Command::new(args[0])
        .args(&args[1..])
        .output()
        .map_err(|e| SoftRoceError::Command {
            command: args.join(" "),
            detail: e.to_string(),
        })?;
    if !out.status.success() {
        return Err(SoftRoceError::Command {
            command: args.join(" "),
            detail: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        });
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Adds a software device `name` of `kind` on `netdev` (loading the module if needed).
pub fn provision(kind: Kind, name: &str, netdev: &str) -> Result<Provisioned, SoftRoceError> {
    let (ty, _) = kind.link_type().ok_or(SoftRoceError::NotSoftware(kind))?;
    kernel_supports(kind)?;
    run(&["rdma", "link", "add", name, "type", ty, "netdev", netdev])?;
    Ok(Provisioned {
        name: name.into(),
        netdev: netdev.into(),
        keep: false,
    })
}

/// Removes a software device by name.
pub fn remove(name: &str) -> Result<(), SoftRoceError> {
    run(&["rdma", "link", "delete", name]).map(|_| ())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fake sysfs tree shaped like the one an rxe device on dummy0 shows (captured in the VM).
    fn fake_rxe(root: &Path) {
        let d = root.join("rxe0");
        fs::create_dir_all(d.join("ports/1/gids")).unwrap();
        fs::create_dir_all(d.join("ports/1/gid_attrs/types")).unwrap();
        fs::write(d.join("node_type"), "1: CA\n").unwrap();
        fs::write(d.join("parent"), "dummy0\n").unwrap();
        fs::write(d.join("ports/1/state"), "4: ACTIVE\n").unwrap();
        fs::write(
            d.join("ports/1/gids/0"),
            "fe80:0000:0000:0000:1066:02ff:fed3:439d\n",
        )
        .unwrap();
        fs::write(
            d.join("ports/1/gids/1"),
            "0000:0000:0000:0000:0000:ffff:c0a8:4d01\n",
        )
        .unwrap();
        fs::write(
            d.join("ports/1/gids/2"),
            "0000:0000:0000:0000:0000:0000:0000:0000\n",
        )
        .unwrap();
        fs::write(d.join("ports/1/gid_attrs/types/0"), "RoCE v2\n").unwrap();
        fs::write(d.join("ports/1/gid_attrs/types/1"), "RoCE v2\n").unwrap();
        // siw (captured in the guest): no parent, and its GID is its interface's MAC address. Like every software
        // device, /sys/class/infiniband/siw0 is a link into /sys/devices/virtual/infiniband/ (a hardware iWARP
        // adapter is an RNIC too, under its PCI device): the link is what tells siw from an adapter.
        let real = root
            .parent()
            .unwrap()
            .join("devices/virtual/infiniband/siw0");
        fs::create_dir_all(real.join("ports/1/gids")).unwrap();
        std::os::unix::fs::symlink(&real, root.join("siw0")).unwrap();
        let s = root.join("siw0");
        fs::write(s.join("node_type"), "4: RNIC\n").unwrap();
        fs::write(s.join("ports/1/state"), "4: ACTIVE\n").unwrap();
        fs::write(
            s.join("ports/1/gids/0"),
            "5254:0077:0001:0000:0000:0000:0000:0000\n",
        )
        .unwrap();
        let net = root.parent().unwrap().join("net");
        for (ifname, mac) in [
            ("dummy0", "12:66:02:d3:43:9d"),
            ("eth0", "52:54:00:77:00:01"),
        ] {
            fs::create_dir_all(net.join(ifname)).unwrap();
            fs::write(net.join(ifname).join("address"), format!("{mac}\n")).unwrap();
        }
    }

    #[test]
    fn finds_devices_kinds_and_the_gid_index_of_an_ipv4_address() {
        let top = std::env::temp_dir().join(format!("exs-sysfs-{}", std::process::id()));
        let _ = fs::remove_dir_all(&top);
        let dir = top.join("infiniband");
        fake_rxe(&dir);
        let devs = devices_in(&dir);
        assert_eq!(devs.len(), 2);
        let rxe = &devs[0];
        assert_eq!(
            (rxe.name.as_str(), rxe.kind, rxe.netdev.as_deref()),
            ("rxe0", Kind::Rxe, Some("dummy0"))
        );
        assert!(rxe.active());
        assert_eq!(rxe.gids.len(), 2, "the unused entry is skipped");
        assert_eq!(rxe.gid_index_for("192.168.77.1".parse().unwrap()), Some(1));
        assert_eq!(rxe.gid_index_for("192.168.77.2".parse().unwrap()), None);
        let siw = &devs[1];
        assert_eq!(siw.kind, Kind::Siw);
        assert!(siw.gids.is_empty(), "an iWARP GID carries no address");
        assert_eq!(
            siw.netdev.as_deref(),
            Some("eth0"),
            "siw's interface is the one with its GID's MAC"
        );
        fs::remove_dir_all(&top).unwrap();
    }

    #[test]
    fn hardware_is_not_provisioned() {
        assert!(matches!(
            provision(Kind::Hardware, "x", "eth0"),
            Err(SoftRoceError::NotSoftware(Kind::Hardware))
        ));
    }
}

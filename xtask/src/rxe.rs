//! `cargo xtask rxe up|down|status`: Soft-RoCE (or, with `--siw`, soft-iWARP) on this machine, for kernels that
//! have `rdma_rxe` (`siw`).
//!
//! `up` puts `exs_rxe0` on a dummy interface `exs0` (192.168.77.1/24: rxe on `lo` breaks rdma_cm). `up --link` also
//! builds two hosts joined by a link: `exs_rxe1` on `exs-veth0` (192.168.78.1) and `exs_rxe2` on `exs-veth1`
//! (192.168.78.2), the two ends of a veth pair. `up --siw` does the same with siw devices: `exs_siw0` on a dummy
//! interface of its own (`exs1`, 192.168.79.1, so it can live beside `exs_rxe0`), and with `--link` `exs_siw1` and
//! `exs_siw2` on the same veth pair as the rxe devices (one kind at a time there: `down` first); siw carries iWARP
//! over the kernel's TCP, so the link's routing applies to it as well.
//!
//! Both ends live in one network namespace: rxe before Linux 6.13 has its UDP socket in the initial namespace
//! only, so a device inside another namespace never receives. Traffic between two local addresses would normally
//! short-cut through `lo`; policy routing sends it across the pair instead: the `local` table moves from rule
//! preference 0 to 200, rules 10/11 route locally-sent packets for each end out of the other end's interface,
//! and `accept_local` lets each end accept packets whose source is the other (local) address. `down` removes the
//! devices and interfaces and restores the rules. The same code runs inside the QEMU guest of `cargo xtask test`,
//! so the native and the emulated setups cannot drift apart.

use std::net::IpAddr;
use std::process::Command;
use std::time::{Duration, Instant};

use clap::{Args, Subcommand};
use exs_backend_softroce::{devices, kernel_supports, provision, Kind};

use crate::sys::{self, Result};

#[derive(Args)]
pub struct RxeArgs {
    #[command(subcommand)]
    cmd: RxeCmd,
}

#[derive(Subcommand)]
enum RxeCmd {
    /// Adds exs_rxe0 on a dummy interface (192.168.77.1); with --link, also two devices across a veth pair.
    Up {
        /// Also build the two-host link (veth pair, policy routing across it, exs_rxe1 and exs_rxe2).
        #[arg(long)]
        link: bool,
        /// soft-iWARP devices (exs_siw0, 1, 2) instead of Soft-RoCE, on the same interfaces.
        #[arg(long)]
        siw: bool,
    },
    /// Removes everything `up` added.
    Down,
    /// Lists the RDMA devices, their kind, state, interface and addresses.
    Status,
}

/// The single device: on a dummy interface.
pub const DUMMY: (&str, &str, &str) = ("exs_rxe0", "exs0", "192.168.77.1");
/// The single siw device: on a dummy interface of its own, so that it can live beside `exs_rxe0` (rdma_cm picks
/// the device by the interface that carries the address; two devices on one interface would be a coin toss).
pub const SIW_DUMMY: (&str, &str, &str) = ("exs_siw0", "exs1", "192.168.79.1");
/// The near end of the link.
pub const NEAR: (&str, &str, &str) = ("exs_rxe1", "exs-veth0", "192.168.78.1");
/// The far end of the link.
pub const FAR: (&str, &str, &str) = ("exs_rxe2", "exs-veth1", "192.168.78.2");
/// Where the `local` routing table's rule moves to while the link is up.
const LOCAL_PREF: &str = "200";

fn sysctl(key: &str, value: &str) -> Result<()> {
    let path = format!("/proc/sys/{}", key.replace('.', "/"));
    std::fs::write(&path, value).map_err(|e| format!("{path}: {e}"))
}

pub fn run(args: RxeArgs) -> Result<()> {
    match args.cmd {
        RxeCmd::Up { link, siw } => up(link, if siw { Kind::Siw } else { Kind::Rxe }),
        RxeCmd::Down => {
            down();
            Ok(())
        }
        RxeCmd::Status => {
            status();
            Ok(())
        }
    }
}

fn ip(args: &[&str]) -> Result<()> {
    sys::run(Command::new("ip").args(args))
}

fn link_exists(name: &str) -> bool {
    std::path::Path::new("/sys/class/net").join(name).exists()
}

/// The name of the device of `kind` in `slot` ([`DUMMY`], [`NEAR`], [`FAR`] name the rxe ones).
pub fn device_name(kind: Kind, slot: (&str, &str, &str)) -> String {
    match kind {
        Kind::Siw => slot.0.replace("rxe", "siw"),
        _ => slot.0.to_string(),
    }
}

/// Waits until device `dev` is active and reached by `addr` (rxe: the kernel fills its GID table asynchronously;
/// siw: its interface's address).
fn wait_ready(dev: &str, addr: &str) -> Result<()> {
    let want: IpAddr = addr.parse().map_err(|e| format!("{addr}: {e}"))?;
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if devices()
            .iter()
            .any(|d| d.name == dev && d.active() && d.serves(want))
        {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err(format!(
                "{dev} did not become active and reachable at {addr} within 20 s"
            ));
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Brings the devices up (idempotent: what exists is kept).
pub fn up(link: bool, kind: Kind) -> Result<()> {
    kernel_supports(kind).map_err(|e| match kind {
        Kind::Siw => format!("{e}\nthis kernel has no soft-iWARP (Debian builds none); `cargo xtask test --suite siw` builds it for a QEMU guest"),
        _ => format!("{e}\nthis kernel has no Soft-RoCE; `cargo xtask test` runs the RDMA tests in a QEMU guest instead"),
    })?;
    let have = |name: &str| devices().iter().any(|d| d.name == name);
    let single = if kind == Kind::Siw { SIW_DUMMY } else { DUMMY };
    let (dev, netdev, addr) = single;
    if !link_exists(netdev) {
        ip(&["link", "add", netdev, "type", "dummy"])?;
        ip(&["addr", "add", &format!("{addr}/24"), "dev", netdev])?;
    }
    ip(&["link", "set", netdev, "up"])?;
    if !have(dev) {
        provision(kind, dev, netdev)
            .map_err(|e| e.to_string())?
            .keep();
    }
    wait_ready(dev, addr)?;
    if link {
        let (_, near_if, near_addr) = NEAR;
        let (_, far_if, far_addr) = FAR;
        let (near_dev, far_dev) = (&device_name(kind, NEAR), &device_name(kind, FAR));
        if !link_exists(near_if) {
            ip(&[
                "link", "add", near_if, "type", "veth", "peer", "name", far_if,
            ])?;
            ip(&["addr", "add", &format!("{near_addr}/24"), "dev", near_if])?;
            ip(&["addr", "add", &format!("{far_addr}/24"), "dev", far_if])?;
        }
        for i in ["all", "default", near_if, far_if] {
            sysctl(&format!("net.ipv4.conf.{i}.accept_local"), "1")?;
            sysctl(&format!("net.ipv4.conf.{i}.rp_filter"), "0")?;
        }
        ip(&["link", "set", near_if, "up"])?;
        ip(&["link", "set", far_if, "up"])?;
        let rules = sys::output(Command::new("ip").args(["rule", "show"]))?;
        if !rules
            .lines()
            .any(|l| l.starts_with(&format!("{LOCAL_PREF}:")))
        {
            ip(&["rule", "add", "pref", LOCAL_PREF, "lookup", "local"])?;
        }
        if rules
            .lines()
            .any(|l| l.starts_with("0:") && l.contains("lookup local"))
        {
            ip(&["rule", "del", "pref", "0", "lookup", "local"])?;
        }
        for (pref, table, to, dev, src) in [
            ("10", "100", far_addr, near_if, near_addr),
            ("11", "101", near_addr, far_if, far_addr),
        ] {
            if !rules.lines().any(|l| l.starts_with(&format!("{pref}:"))) {
                ip(&[
                    "rule", "add", "pref", pref, "to", to, "iif", "lo", "lookup", table,
                ])?;
            }
            ip(&[
                "route", "replace", to, "dev", dev, "src", src, "table", table,
            ])?;
        }
        if !have(near_dev) {
            provision(kind, near_dev, near_if)
                .map_err(|e| e.to_string())?
                .keep();
        }
        if !have(far_dev) {
            provision(kind, far_dev, far_if)
                .map_err(|e| e.to_string())?
                .keep();
        }
        wait_ready(near_dev, near_addr)?;
        wait_ready(far_dev, far_addr)?;
    }
    status();
    Ok(())
}

/// Removes what `up` added (rxe and siw devices); reports but does not stop on what is already gone.
pub fn down() {
    for slot in [DUMMY, NEAR, FAR] {
        for kind in [Kind::Rxe, Kind::Siw] {
            let dev = device_name(
                kind,
                if kind == Kind::Siw && slot == DUMMY {
                    SIW_DUMMY
                } else {
                    slot
                },
            );
            if devices().iter().any(|d| d.name == dev) {
                if let Err(e) = exs_backend_softroce::remove(&dev) {
                    eprintln!("xtask: {e}");
                }
            }
        }
    }
    for netdev in [DUMMY.1, SIW_DUMMY.1, NEAR.1] {
        if link_exists(netdev) {
            let _ = ip(&["link", "delete", netdev]);
        }
    }
    // Restore the routing rules: `local` first again, the link's rules gone.
    if let Ok(rules) = sys::output(Command::new("ip").args(["rule", "show"])) {
        if !rules.lines().any(|l| l.starts_with("0:")) {
            let _ = ip(&["rule", "add", "pref", "0", "lookup", "local"]);
        }
        for pref in ["10", "11", LOCAL_PREF] {
            if rules.lines().any(|l| l.starts_with(&format!("{pref}:"))) {
                let _ = ip(&["rule", "del", "pref", pref]);
            }
        }
    }
    for table in ["100", "101"] {
        let _ = sys::output(Command::new("ip").args(["route", "flush", "table", table]));
    }
}

/// Prints every RDMA device.
pub fn status() {
    let devs = devices();
    if devs.is_empty() {
        println!("no RDMA devices");
    }
    for d in devs {
        let mut addrs: Vec<String> = d
            .gids
            .iter()
            .map(|g| format!("{} ({})", g.ip(), g.kind))
            .collect();
        addrs.extend(
            d.addrs
                .iter()
                .filter(|a| !d.gids.iter().any(|g| g.ip() == **a))
                .map(|a| format!("{a} (interface)")),
        );
        println!(
            "{:<10} {:<9} {:<10} netdev {:<10} {}",
            d.name,
            format!("{:?}", d.kind),
            d.state.split(':').nth(1).unwrap_or(&d.state).trim(),
            d.netdev.as_deref().unwrap_or("-"),
            addrs.join(", ")
        );
    }
}

//! `cargo xtask rxe up|down|status`: Soft-RoCE on this machine, for kernels that have `rdma_rxe`.
//!
//! `up` puts `exs_rxe0` on a dummy interface `exs0` (192.168.77.1/24: rxe on `lo` breaks rdma_cm, see
//! field-facts.md). `up --link` also builds two hosts joined by a link: `exs_rxe1` on `exs-veth0` (192.168.78.1)
//! and `exs_rxe2` on `exs-veth1` (192.168.78.2), the two ends of a veth pair.
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
    },
    /// Removes everything `up` added.
    Down,
    /// Lists the RDMA devices, their kind, state, interface and addresses.
    Status,
}

/// The single device: on a dummy interface.
pub const DUMMY: (&str, &str, &str) = ("exs_rxe0", "exs0", "192.168.77.1");
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
        RxeCmd::Up { link } => up(link),
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

/// Waits until `addr` shows up in the GID table of device `dev` (the kernel fills it asynchronously).
fn wait_for_gid(dev: &str, addr: &str) -> Result<()> {
    let want: IpAddr = addr.parse().map_err(|e| format!("{addr}: {e}"))?;
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if devices()
            .iter()
            .any(|d| d.name == dev && d.active() && d.gid_index_for(want).is_some())
        {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err(format!(
                "{dev} did not become active with {addr} in its GID table within 20 s"
            ));
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Brings the devices up (idempotent: what exists is kept).
pub fn up(link: bool) -> Result<()> {
    kernel_supports(Kind::Rxe).map_err(|e| {
        format!("{e}\nthis kernel has no Soft-RoCE; `cargo xtask test` runs the RDMA tests in a QEMU guest instead")
    })?;
    let have = |name: &str| devices().iter().any(|d| d.name == name);
    let (dev, netdev, addr) = DUMMY;
    if !link_exists(netdev) {
        ip(&["link", "add", netdev, "type", "dummy"])?;
        ip(&["addr", "add", &format!("{addr}/24"), "dev", netdev])?;
    }
    ip(&["link", "set", netdev, "up"])?;
    if !have(dev) {
        provision(Kind::Rxe, dev, netdev)
            .map_err(|e| e.to_string())?
            .keep();
    }
    wait_for_gid(dev, addr)?;
    if link {
        let (near_dev, near_if, near_addr) = NEAR;
        let (far_dev, far_if, far_addr) = FAR;
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
            provision(Kind::Rxe, near_dev, near_if)
                .map_err(|e| e.to_string())?
                .keep();
        }
        if !have(far_dev) {
            provision(Kind::Rxe, far_dev, far_if)
                .map_err(|e| e.to_string())?
                .keep();
        }
        wait_for_gid(near_dev, near_addr)?;
        wait_for_gid(far_dev, far_addr)?;
    }
    status();
    Ok(())
}

/// Removes what `up` added; reports but does not stop on what is already gone.
pub fn down() {
    for (dev, _, _) in [DUMMY, NEAR, FAR] {
        if devices().iter().any(|d| d.name == dev) {
            if let Err(e) = exs_backend_softroce::remove(dev) {
                eprintln!("xtask: {e}");
            }
        }
    }
    for netdev in [DUMMY.1, NEAR.1] {
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
        let addrs: Vec<String> = d
            .gids
            .iter()
            .map(|g| format!("{} ({})", g.ip(), g.kind))
            .collect();
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

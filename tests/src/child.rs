//! Child processes for the tests that need hosts in separate processes. The test binary re-executes itself with
//! `EXS_CONFORMANCE_ROLE` set; [`run_if_child`] runs the role instead of the tests.

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use exs::{EventQueue, MemoryRegion, MsgFlags, SockType, Socket};

use crate::backends;

const ROLE: &str = "EXS_CONFORMANCE_ROLE";
const BACKEND: &str = "EXS_CONFORMANCE_BACKEND";
const TARGET: &str = "EXS_CONFORMANCE_TARGET";

/// FNV-1a, to compare contents across processes.
pub fn checksum(b: &[u8]) -> u64 {
    b.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &x| {
        (h ^ u64::from(x)).wrapping_mul(0x100_0000_01b3)
    })
}

/// A child process running one role; killed on drop if still running.
#[derive(Debug)]
pub struct ChildProc {
    pub child: Child,
    pub line: Option<String>,
}

impl Drop for ChildProc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A second host across a network link: the address of the link's far end on this machine, and the interface
/// at the near end (whose byte counters show that the traffic really crossed the link).
#[derive(Clone, Debug)]
pub struct PeerHost {
    pub addr: std::net::IpAddr,
    pub link: Option<String>,
}

/// The peer host named by `EXS_PEER_ADDR` (and `EXS_PEER_LINK`, the near-end interface).
pub fn peer_host() -> Result<PeerHost, String> {
    let addr =
        std::env::var("EXS_PEER_ADDR").map_err(|_| "EXS_PEER_ADDR is not set".to_string())?;
    let addr = addr
        .parse()
        .map_err(|e| format!("EXS_PEER_ADDR={addr}: {e}"))?;
    let link = std::env::var("EXS_PEER_LINK").ok();
    if let Some(l) = &link {
        if !std::path::Path::new("/sys/class/net").join(l).exists() {
            return Err(format!("EXS_PEER_LINK={l}: no such interface"));
        }
    }
    Ok(PeerHost { addr, link })
}

/// Bytes sent plus received on an interface.
pub fn link_bytes(link: &str) -> Result<u64, String> {
    let read = |f: &str| -> Result<u64, String> {
        let p = format!("/sys/class/net/{link}/statistics/{f}");
        std::fs::read_to_string(&p)
            .map_err(|e| format!("{p}: {e}"))?
            .trim()
            .parse()
            .map_err(|e| format!("{p}: {e}"))
    };
    Ok(read("tx_bytes")? + read("rx_bytes")?)
}

/// Starts this binary as a child in `role`. If the role prints a first line (a listening address), it is read
/// (with a timeout) into `line`.
pub fn spawn(
    role: &str,
    backend: &str,
    target: Option<SocketAddr>,
    read_line: bool,
) -> Result<ChildProc, String> {
    spawn_on(None, role, backend, target, read_line)
}

/// [`spawn`], as `peer` when given: with every backend's local address set to the far end of the link.
pub fn spawn_on(
    peer: Option<&PeerHost>,
    role: &str,
    backend: &str,
    target: Option<SocketAddr>,
    read_line: bool,
) -> Result<ChildProc, String> {
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let mut cmd = Command::new(exe);
    if let Some(p) = peer {
        let a = p.addr.to_string();
        cmd.env("EXS_VERBS_ADDR", &a)
            .env("EXS_SOFTROCE_ADDR", &a)
            .env("EXS_FABRIC_ADDR", &a);
    }
    cmd.env(ROLE, role)
        .env(BACKEND, backend)
        .stdin(Stdio::null())
        .stderr(Stdio::inherit());
    if let Some(t) = target {
        cmd.env(TARGET, t.to_string());
    }
    cmd.stdout(if read_line {
        Stdio::piped()
    } else {
        Stdio::null()
    });
    let mut child = cmd.spawn().map_err(|e| format!("spawning a child: {e}"))?;
    let mut line = None;
    if read_line {
        let out = child.stdout.take().ok_or("no child stdout")?;
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut l = String::new();
            let _ = BufReader::new(out).read_line(&mut l);
            let _ = tx.send(l);
        });
        match rx.recv_timeout(Duration::from_secs(60)) {
            Ok(l) if !l.is_empty() => line = Some(l.trim().to_string()),
            _ => {
                let _ = child.kill();
                return Err(format!("child {role} did not report an address"));
            }
        }
    }
    Ok(ChildProc { child, line })
}

/// Runs the role named in the environment, if any, and returns its exit code.
pub fn run_if_child() -> Option<i32> {
    let role = std::env::var(ROLE).ok()?;
    let backend = std::env::var(BACKEND).ok()?;
    let result = match backends::by_name(&backend) {
        None => Err(format!("backend {backend} is not compiled in")),
        Some(b) => match role.as_str() {
            "echo-server" => echo_server(&*b),
            "sender" => sender(&*b, None),
            "sender-then-big" => sender(&*b, Some(128 << 20)),
            other => Err(format!("unknown role {other}")),
        },
    };
    match result {
        Ok(()) => Some(0),
        Err(e) => {
            eprintln!("child {role}: {e}");
            Some(1)
        }
    }
}

/// Accepts one connection, receives messages until a zero-length one, replies with the checksums of what it got,
/// then waits for the peer to close.
fn echo_server(b: &dyn crate::Backend) -> Result<(), String> {
    let net = b.net();
    let ctx = net.host();
    let eq = EventQueue::new(64);
    let l = Socket::new(&ctx, SockType::SeqPacket).map_err(|e| e.to_string())?;
    l.bind(net.listen_addr(0)).map_err(|e| e.to_string())?;
    let addr = l.listen(1).map_err(|e| e.to_string())?;
    println!("LISTEN {addr}");
    l.accept(&eq, 0).map_err(|e| e.to_string())?;
    let s = crate::util::next(&eq)?.accepted.ok_or("accept failed")?;
    let buf = MemoryRegion::alloc(&ctx, 16 << 20).map_err(|e| e.to_string())?;
    let mut sums = Vec::new();
    loop {
        s.recv(&eq, &buf.all(), MsgFlags::NONE, 1)
            .map_err(|e| e.to_string())?;
        let ev = crate::util::next(&eq)?;
        ev.status.clone().map_err(|e| format!("recv: {e}"))?;
        if ev.bytes == 0 {
            break;
        }
        let data = buf.to_vec().map_err(|e| e.to_string())?;
        sums.push(checksum(&data[..ev.bytes]));
    }
    let reply: Vec<u8> = sums.iter().flat_map(|s| s.to_le_bytes()).collect();
    let out = MemoryRegion::from_vec(&ctx, reply).map_err(|e| e.to_string())?;
    s.send(&eq, &out.all(), MsgFlags::NONE, 2)
        .map_err(|e| e.to_string())?;
    let ev = crate::util::next(&eq)?;
    ev.status.map_err(|e| format!("reply: {e}"))?;
    s.recv(&eq, &buf.all(), MsgFlags::NONE, 3)
        .map_err(|e| e.to_string())?;
    let ev = crate::util::next(&eq)?;
    if !ev.flags.eof {
        return Err(format!("expected end-of-stream, got {ev:?}"));
    }
    Ok(())
}

/// Connects to the target and sends 1 MiB messages until killed; with `big`, sends two, then one message of
/// `big` bytes, then waits to be killed.
fn sender(b: &dyn crate::Backend, big: Option<usize>) -> Result<(), String> {
    let target: SocketAddr = std::env::var(TARGET)
        .map_err(|_| "no target".to_string())?
        .parse()
        .map_err(|e| format!("{e}"))?;
    let net = b.net();
    let ctx = net.host();
    let eq = EventQueue::new(64);
    let s = Socket::new(&ctx, SockType::SeqPacket).map_err(|e| e.to_string())?;
    s.connect(target, &eq, 0).map_err(|e| e.to_string())?;
    crate::util::next(&eq)?
        .status
        .map_err(|e| format!("connect: {e}"))?;
    let buf = MemoryRegion::from_vec(&ctx, crate::util::pattern(1 << 20, 9))
        .map_err(|e| e.to_string())?;
    let mut sent = 0;
    loop {
        if big.is_some() && sent == 2 {
            break;
        }
        s.send(&eq, &buf.all(), MsgFlags::NONE, 1)
            .map_err(|e| e.to_string())?;
        let ev = crate::util::next(&eq)?;
        ev.status.map_err(|e| format!("send: {e}"))?;
        sent += 1;
    }
    let huge = MemoryRegion::alloc(&ctx, big.unwrap_or(1)).map_err(|e| e.to_string())?;
    s.send(&eq, &huge.all(), MsgFlags::NONE, 2)
        .map_err(|e| e.to_string())?;
    loop {
        std::thread::sleep(Duration::from_secs(1));
    }
}

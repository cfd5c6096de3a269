//! Child processes for the tests that need hosts in separate processes. The test binary re-executes itself with
//! `EXS_CONFORMANCE_ROLE` set; [`run_if_child`] runs the role instead of the tests.

use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
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

/// A child process running one role, on this host or, through the peer host's agent, on another; killed on
/// drop if still running.
#[derive(Debug)]
pub struct ChildProc {
    proc: Proc,
    /// The first line the role printed (a listening address), when asked for.
    pub line: Option<String>,
}

#[derive(Debug)]
enum Proc {
    Local(Child),
    /// A child of the agent on the peer host (`EXS_PEER_AGENT`), driven over a TCP connection.
    Remote(BufReader<TcpStream>),
}

impl ChildProc {
    /// Kills it (SIGKILL).
    pub fn kill(&mut self) -> Result<(), String> {
        match &mut self.proc {
            Proc::Local(c) => c.kill().map_err(|e| format!("kill: {e}")),
            Proc::Remote(agent) => agent_call(agent, "KILL").map(drop),
        }
    }

    /// `Some(success)` once it exited.
    pub fn try_wait(&mut self) -> Result<Option<bool>, String> {
        match &mut self.proc {
            Proc::Local(c) => Ok(c
                .try_wait()
                .map_err(|e| e.to_string())?
                .map(|st| st.success())),
            Proc::Remote(agent) => {
                let r = agent_call(agent, "WAIT")?;
                Ok(r.strip_prefix("EXITED ").map(|code| code.trim() == "0"))
            }
        }
    }
}

impl Drop for ChildProc {
    fn drop(&mut self) {
        match &mut self.proc {
            Proc::Local(c) => {
                let _ = c.kill();
                let _ = c.wait();
            }
            // The agent kills its child when the connection closes.
            Proc::Remote(_) => {}
        }
    }
}

/// One request to the agent, one line of answer: `OK ...`, `RUNNING`, `EXITED code`, or `ERR why`.
fn agent_call(agent: &mut BufReader<TcpStream>, req: &str) -> Result<String, String> {
    agent
        .get_mut()
        .write_all(format!("{req}\n").as_bytes())
        .map_err(|e| format!("the peer host's agent: {e}"))?;
    let mut l = String::new();
    agent
        .read_line(&mut l)
        .map_err(|e| format!("the peer host's agent: {e}"))?;
    let l = l.trim_end().to_string();
    match l.strip_prefix("ERR ") {
        Some(why) => Err(format!("the peer host's agent: {why}")),
        None if l.is_empty() => Err("the peer host's agent closed the connection".into()),
        None => Ok(l),
    }
}

/// A second host across a network link: the address of the link's far end on this machine, and the interface
/// at the near end (whose byte counters show that the traffic really crossed the link).
#[derive(Clone, Debug)]
pub struct PeerHost {
    pub addr: std::net::IpAddr,
    pub link: Option<String>,
}

/// The peer host named by `EXS_PEER_ADDR` (and `EXS_PEER_LINK`, the near-end interface). With `EXS_PEER_AGENT`
/// (`HOST:PORT`), its processes run on another machine, started and killed by the agent there
/// (`EXS_CONFORMANCE_ROLE=agent`); otherwise they are children here using the far end's address.
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
    if let (Some(_), Ok(agent)) = (peer, std::env::var("EXS_PEER_AGENT")) {
        return spawn_remote(&agent, role, backend, target, read_line);
    }
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
    Ok(ChildProc {
        proc: Proc::Local(child),
        line,
    })
}

/// [`spawn_on`] through the agent at `agent` on the peer host.
fn spawn_remote(
    agent: &str,
    role: &str,
    backend: &str,
    target: Option<SocketAddr>,
    read_line: bool,
) -> Result<ChildProc, String> {
    // The other machine may still be starting its agent: try for a minute.
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    let stream = loop {
        match TcpStream::connect(agent) {
            Ok(s) => break s,
            Err(e) if std::time::Instant::now() > deadline => {
                return Err(format!("the peer host's agent at {agent}: {e}"))
            }
            Err(_) => std::thread::sleep(Duration::from_millis(500)),
        }
    };
    stream
        .set_read_timeout(Some(Duration::from_secs(120)))
        .map_err(|e| e.to_string())?;
    let mut agent = BufReader::new(stream);
    let target = target.map_or_else(|| "-".to_string(), |t| t.to_string());
    let r = agent_call(
        &mut agent,
        &format!("SPAWN {role} {backend} {target} {}", u8::from(read_line)),
    )?;
    let line = r
        .strip_prefix("OK")
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .map(String::from);
    if read_line && line.is_none() {
        return Err(format!(
            "child {role} on the peer host did not report an address"
        ));
    }
    Ok(ChildProc {
        proc: Proc::Remote(agent),
        line,
    })
}

/// The agent of a peer host (`EXS_CONFORMANCE_ROLE=agent`, listening on `EXS_CONFORMANCE_AGENT`, `HOST:PORT`):
/// per connection, starts one role as a child here (`SPAWN role backend target|- read_line`), reports its first
/// line, kills it (`KILL`) or reports whether it exited (`WAIT`), and kills it when the connection closes. `QUIT`
/// ends the agent. Only for test machines: it runs what the suite asks.
fn agent() -> Result<(), String> {
    let addr =
        std::env::var("EXS_CONFORMANCE_AGENT").map_err(|_| "EXS_CONFORMANCE_AGENT is not set")?;
    let l = TcpListener::bind(&addr).map_err(|e| format!("agent on {addr}: {e}"))?;
    eprintln!("agent: listening on {addr}");
    for conn in l.incoming() {
        let conn = conn.map_err(|e| e.to_string())?;
        // A connection per child, each served on its own thread (a test may hold one child while it starts another).
        std::thread::spawn(move || serve_agent_connection(conn));
    }
    Ok(())
}

fn serve_agent_connection(conn: TcpStream) {
    let Ok(read_half) = conn.try_clone() else {
        return;
    };
    let mut r = BufReader::new(read_half);
    let mut w = conn;
    let mut child: Option<ChildProc> = None;
    let mut req = String::new();
    loop {
        req.clear();
        if r.read_line(&mut req).unwrap_or(0) == 0 {
            return; // the connection closed: `child` is killed as it drops
        }
        let words: Vec<&str> = req.split_whitespace().collect();
        let answer = match words.as_slice() {
            ["QUIT"] => {
                let _ = w.write_all(b"OK\n");
                drop(child.take());
                eprintln!("agent: done");
                std::process::exit(0);
            }
            ["SPAWN", role, backend, target, read_line] => {
                let target = match *target {
                    "-" => Ok(None),
                    t => t.parse().map(Some).map_err(|e| format!("target {t}: {e}")),
                };
                match target.and_then(|t| spawn(role, backend, t, *read_line == "1")) {
                    Ok(c) => {
                        let a = format!("OK {}", c.line.clone().unwrap_or_default());
                        eprintln!("agent: started {role} on {backend}");
                        child = Some(c);
                        a
                    }
                    Err(e) => format!("ERR {e}"),
                }
            }
            ["KILL"] => match child.as_mut().map(|c| c.kill()) {
                Some(Ok(())) => "OK".to_string(),
                Some(Err(e)) => format!("ERR {e}"),
                None => "ERR no child".to_string(),
            },
            ["WAIT"] => match child.as_mut().map(|c| c.try_wait()) {
                Some(Ok(None)) => "RUNNING".to_string(),
                Some(Ok(Some(ok))) => format!("EXITED {}", if ok { 0 } else { 1 }),
                Some(Err(e)) => format!("ERR {e}"),
                None => "ERR no child".to_string(),
            },
            _ => format!("ERR unknown request {:?}", req.trim()),
        };
        if w.write_all(format!("{answer}\n").as_bytes()).is_err() {
            return;
        }
    }
}

/// Ends the agent at `EXS_PEER_AGENT` (`EXS_CONFORMANCE_ROLE=agent-quit`).
fn agent_quit() -> Result<(), String> {
    let addr = std::env::var("EXS_PEER_AGENT").map_err(|_| "EXS_PEER_AGENT is not set")?;
    let stream = TcpStream::connect(&addr).map_err(|e| format!("the agent at {addr}: {e}"))?;
    agent_call(&mut BufReader::new(stream), "QUIT").map(drop)
}

/// Runs the role named in the environment, if any, and returns its exit code.
pub fn run_if_child() -> Option<i32> {
    let role = std::env::var(ROLE).ok()?;
    let result = match role.as_str() {
        "agent" => agent(),
        "agent-quit" => agent_quit(),
        _ => child_role(&role),
    };
    match result {
        Ok(()) => Some(0),
        Err(e) => {
            eprintln!("child {role}: {e}");
            Some(1)
        }
    }
}

fn child_role(role: &str) -> Result<(), String> {
    let backend = std::env::var(BACKEND).map_err(|_| format!("{BACKEND} is not set"))?;
    match backends::by_name(&backend) {
        None => Err(format!("backend {backend} is not compiled in")),
        Some(b) => match role {
            "echo-server" => echo_server(&*b),
            "sender" => sender(&*b, None),
            "sender-then-big" => sender(&*b, Some(128 << 20)),
            other => Err(format!("unknown role {other}")),
        },
    }
}

/// Accepts one connection, receives messages until a zero-length one, replies with the checksums of what it got,
/// then waits for the peer to close.
fn echo_server(b: &dyn crate::Backend) -> Result<(), String> {
    let net = b.net();
    let ctx = net.host();
    let eq = EventQueue::new(64).unwrap();
    let l = Socket::new(&ctx, SockType::SeqPacket).map_err(|e| e.to_string())?;
    l.bind(net.listen_addr(0)).map_err(|e| e.to_string())?;
    let addr = l.listen(1).map_err(|e| e.to_string())?;
    println!("LISTEN {addr}");
    l.accept(&eq, 0).map_err(|e| e.to_string())?;
    let s = crate::util::next(&eq)?
        .take_accepted()
        .ok_or("accept failed")?;
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
    let eq = EventQueue::new(64).unwrap();
    let s = Socket::new(&ctx, SockType::SeqPacket).map_err(|e| e.to_string())?;
    s.connect(&eq, target, 0).map_err(|e| e.to_string())?;
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

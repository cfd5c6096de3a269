//! The client's end of the control connection: a server on another host (`--client HOST[:PORT]`), or one it
//! starts on this host for itself (a process, or a thread on the simulator) with the widest limits.

use std::io::ErrorKind;
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::process::{Child, Command};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context as _, Result};
use serde::{de::DeserializeOwned, Serialize};

use super::server::Server;
use super::{
    refuse_sim, shorten, Channel, Host, Limits, Msg, PeerArgs, Service, DEFAULT_PORT, VERSION,
};
use crate::backend::{BackendArgs, Opened};

/// How long a client waits for the server's answer (it answers at once, or right after a test).
const SERVER_SILENCE: Duration = Duration::from_secs(90);

/// A server's message, named for an error that did not expect it.
fn kind(m: &Msg) -> &'static str {
    match m {
        Msg::Hello { .. } => "a hello",
        Msg::Welcome { .. } => "a welcome",
        Msg::Point { .. } => "a test's parameters",
        Msg::Listening { .. } => "its listener",
        Msg::Done { .. } => "its measurements",
        Msg::Error { .. } => "an error",
    }
}

/// Resolves `HOST`, `HOST:PORT`, `[V6]:PORT` or a bare IPv6 address.
fn resolve(target: &str, port: u16) -> Result<Vec<SocketAddr>> {
    if let Ok(a) = target.parse::<SocketAddr>() {
        return Ok(vec![a]);
    }
    if let Ok(ip) = target.trim_matches(['[', ']']).parse::<IpAddr>() {
        return Ok(vec![SocketAddr::new(ip, port)]);
    }
    let (host, port) = match target.rsplit_once(':') {
        Some((h, p)) => (
            h,
            p.parse()
                .with_context(|| format!("--client {target:?}: {p:?} is not a port"))?,
        ),
        None => (target, port),
    };
    let v: Vec<SocketAddr> = (host, port)
        .to_socket_addrs()
        .with_context(|| format!("--client {target:?}: cannot resolve {host:?}"))?
        .collect();
    if v.is_empty() {
        bail!("--client {target:?}: {host:?} has no address");
    }
    Ok(v)
}

fn connect(addrs: &[SocketAddr], tool: &str) -> Result<TcpStream> {
    let mut last = None;
    for a in addrs {
        match TcpStream::connect_timeout(a, Duration::from_secs(10)) {
            Ok(s) => return Ok(s),
            Err(e) => {
                let why = match e.kind() {
                    ErrorKind::ConnectionRefused => format!(
                        "no server is running there (start one on that host with `exs {tool} --server --addr {}{}`: \
                         without --addr a server listens on 127.0.0.1 only)",
                        a.ip(),
                        if a.port() == DEFAULT_PORT { String::new() } else { format!(" --port {}", a.port()) }
                    ),
                    ErrorKind::TimedOut | ErrorKind::WouldBlock => {
                        "no answer within 10 s (host down, or a firewall?)".into()
                    }
                    _ => "connection failed".into(),
                };
                last = Some(
                    anyhow!(e).context(format!("cannot reach an exs {tool} server at {a}: {why}")),
                );
            }
        }
    }
    Err(last.unwrap_or_else(|| anyhow!("no address to connect to")))
}

/// The client's end: a server on another host, or one it started on this host.
pub struct Peer {
    ch: Option<Channel>,
    /// The server's backend, as it names it.
    pub server_backend: String,
    child: Option<Child>,
    thread: Option<JoinHandle<Result<()>>>,
}

impl Peer {
    /// Connects to `--client HOST[:PORT]`, or starts a server on this host (a process; a thread on the simulator)
    /// and connects to it.
    pub fn open<S: Service>(
        svc: S,
        peer: &PeerArgs,
        backend: &BackendArgs,
        opened: &Opened,
    ) -> Result<Peer> {
        let mut token = None;
        let (stream, who, child, thread) = match &peer.client {
            Some(target) => {
                refuse_sim(opened, S::TOOL)?;
                let addrs = resolve(target, peer.port)?;
                let s = connect(&addrs, S::TOOL)?;
                let who = format!("the server at {}", s.peer_addr()?);
                (s, who, None, None)
            }
            None if opened.processes() => {
                let exe =
                    std::env::current_exe().context("finding this program, to start its server")?;
                let mut cmd = Command::new(exe);
                cmd.args([S::TOOL, "--server", "--once", "--announce", "--port", "0"])
                    .args(backend.to_args())
                    .args(Limits::widest().to_args());
                let t = super::new_token()?;
                cmd.env(super::server::CLIENT_TOKEN_VAR, t.to_string());
                token = Some(t);
                let (mut child, addr, _out) = crate::util::spawn_listening(&mut cmd)?;
                let s = connect(&[addr], S::TOOL).inspect_err(|_| crate::util::reap(&mut child))?;
                (
                    s,
                    format!("the server process (at {addr})"),
                    Some(child),
                    None,
                )
            }
            None => {
                let listener = TcpListener::bind((IpAddr::from([127, 0, 0, 1]), 0))
                    .context("listening for the server thread's control connection")?;
                let addr = listener.local_addr()?;
                let (opened, backend) = (opened.clone(), backend.clone());
                let t = std::thread::Builder::new()
                    .name(format!("exs-{}-server", S::TOOL))
                    .spawn(move || {
                        let limits = Limits::widest();
                        let host = Host::open(&opened, &backend, &limits)?;
                        Server::new(svc, host, limits, false, false).run(&listener, true)
                    })?;
                let s = connect(&[addr], S::TOOL)?;
                (s, "the server thread".into(), None, Some(t))
            }
        };
        let mut p = Peer {
            ch: Some(Channel::new(stream, who)?),
            server_backend: String::new(),
            child,
            thread,
        };
        let ch = p.ch();
        ch.send(&Msg::Hello {
            version: VERSION,
            tool: S::TOOL.into(),
            backend: opened.label(),
            token,
        })?;
        match ch.expect("its welcome", SERVER_SILENCE)? {
            Msg::Welcome {
                version,
                tool,
                backend,
            } if version == VERSION && tool == S::TOOL => {
                p.server_backend = backend;
            }
            other => bail!("{} answered the hello with {}", ch.who, kind(&other)),
        }
        Ok(p)
    }

    fn ch(&mut self) -> &mut Channel {
        self.ch.as_mut().expect("open until closed")
    }

    /// Starts one test on the server: sends every parameter, returns where its listener is and the token the
    /// data connection sends first.
    pub fn start(&mut self, params: &impl Serialize) -> Result<(SocketAddr, u64)> {
        let params = serde_json::to_value(params)?;
        let ch = self.ch();
        ch.send(&Msg::Point { params })?;
        match ch.expect("its listener", SERVER_SILENCE)? {
            // A server listening on any address is reached where its control connection was.
            Msg::Listening { addr, token } if addr.ip().is_unspecified() => {
                Ok((SocketAddr::new(ch.peer.ip(), addr.port()), token))
            }
            Msg::Listening { addr, token } => Ok((addr, token)),
            other => bail!(
                "{} answered a test's parameters with {}",
                ch.who,
                kind(&other)
            ),
        }
    }

    /// The server's own measurements of the test started last.
    pub fn finish<T: DeserializeOwned>(&mut self) -> Result<T> {
        let ch = self.ch();
        match ch.expect("its measurements", SERVER_SILENCE)? {
            Msg::Done { result } => serde_json::from_value(result)
                .with_context(|| format!("{}'s measurements (not the same exs version?)", ch.who)),
            other => bail!(
                "{} sent {} instead of its measurements",
                ch.who,
                kind(&other)
            ),
        }
    }

    /// This side's error in a test, with the server's account of it when it sent one (within a second or two).
    pub fn explain(&mut self, e: anyhow::Error) -> anyhow::Error {
        let ch = self.ch();
        let deadline = Instant::now() + Duration::from_secs(2);
        while Instant::now() < deadline {
            match ch.recv(deadline.saturating_duration_since(Instant::now())) {
                Ok(Some(Msg::Error { message })) => {
                    return e.context(format!("{}: {}", ch.who, shorten(&message, 2000)))
                }
                Ok(Some(_)) => continue,
                Ok(None) => {
                    return e.context(format!(
                        "{} closed the control connection (the server stopped or was killed)",
                        ch.who
                    ))
                }
                Err(_) => break,
            }
        }
        e
    }

    /// Ends the session: closes the control connection and waits for a server this side started.
    pub fn close(mut self) -> Result<()> {
        drop(self.ch.take());
        if let Some(mut c) = self.child.take() {
            let st = c.wait().context("waiting for the server process")?;
            if !st.success() {
                bail!("the server process exited with {st}");
            }
        }
        if let Some(t) = self.thread.take() {
            t.join()
                .map_err(|_| anyhow!("the server thread panicked"))??;
        }
        Ok(())
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        drop(self.ch.take());
        if let Some(mut c) = self.child.take() {
            // It notices the closed control connection within a second or so; leave nothing behind.
            let deadline = Instant::now() + Duration::from_secs(3);
            while Instant::now() < deadline {
                if let Ok(Some(_)) = c.try_wait() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn client_targets_resolve_with_and_without_a_port() {
        assert_eq!(
            resolve("10.0.0.5", 18515).unwrap(),
            vec!["10.0.0.5:18515".parse().unwrap()]
        );
        assert_eq!(
            resolve("10.0.0.5:7", 18515).unwrap(),
            vec!["10.0.0.5:7".parse().unwrap()]
        );
        assert_eq!(
            resolve("[::1]:9", 1).unwrap(),
            vec!["[::1]:9".parse().unwrap()]
        );
        assert_eq!(resolve("::1", 5).unwrap(), vec!["[::1]:5".parse().unwrap()]);
        assert!(resolve("localhost:x", 1).is_err());
        assert!(!resolve("localhost", 3).unwrap().is_empty());
    }
}

//! Server and client (issue 17): `exs pump|ping|demo --server` serves clients until killed (or one, `--once`);
//! `--client HOST[:PORT]` runs the tests against it from another host. Like perftest and iperf3, the two talk over
//! a small TCP control connection (default port [`DEFAULT_PORT`], perftest's), one JSON object per line:
//!
//! ```text
//! client -> server  {"msg":"hello","version":1,"tool":"pump","backend":"exs (fabric/tcp)"}
//! server -> client  {"msg":"welcome","version":1,"tool":"pump","backend":"exs (fabric/tcp)"}
//! client -> server  {"msg":"point","params":{...every parameter of one test...}}
//! server -> client  {"msg":"listening","addr":"10.0.0.5:40123"}      its exs (or TCP) listener for this test
//!                   ... the test runs over exs ...
//! server -> client  {"msg":"done","result":{...the server's own measurements...}}
//!                   (or {"msg":"error","message":"..."} at any point)
//! ```
//!
//! The client drives every parameter; the server needs none but its backend flags. Without `--server` or
//! `--client` the tool runs both sides on this host through the same path: it starts itself as `--server --once`
//! on a free port (a thread instead of a process for the simulator, which cannot cross processes).

use std::io::{BufRead, BufReader, ErrorKind, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::os::fd::AsFd;
use std::process::{Child, Command};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context as _, Result};
use serde::{de::DeserializeOwned, Deserialize, Serialize};
use serde_json::Value;

use crate::backend::{BackendArgs, Opened};

/// The control port servers listen on and clients connect to unless told otherwise (perftest's).
pub const DEFAULT_PORT: u16 = 18515;
/// The control protocol's version: client and server must speak the same.
const VERSION: u32 = 1;
/// How long a server waits for a client's next message (between tests, the client does nothing long).
const CLIENT_SILENCE: Duration = Duration::from_secs(600);
/// How long a client waits for the server's answer (it answers at once, or right after a test).
const SERVER_SILENCE: Duration = Duration::from_secs(90);

/// Where the test's two sides run.
#[derive(Clone, Debug, clap::Args)]
#[command(next_help_heading = "Two hosts (default: both sides on this one)")]
pub struct PeerArgs {
    /// Serve clients (`--client` on another host) until killed: control connections on --addr:--port, each
    /// test's exs listener on --addr at a port it tells the client. The client sends every test parameter; the
    /// server takes only its own backend flags.
    #[arg(short = 's', long, conflicts_with = "client")]
    pub server: bool,
    /// Run the tests against a server on another host (started there with --server): HOST or HOST:PORT.
    #[arg(short = 'c', long, value_name = "HOST[:PORT]")]
    pub client: Option<String>,
    /// Control port: the one a server listens on, and the client's when HOST has none.
    #[arg(short = 'p', long, default_value_t = DEFAULT_PORT)]
    pub port: u16,
    /// With --server: exit after one client; the exit status says whether its tests went well.
    #[arg(long, requires = "server")]
    pub once: bool,
    /// Internal (one-host mode): print `LISTEN <addr>` on stdout once listening, and nothing else.
    #[arg(long, hide = true, requires = "server")]
    pub announce: bool,
}

/// One line of the control connection.
#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "msg", rename_all = "snake_case")]
pub enum Msg {
    Hello {
        version: u32,
        tool: String,
        backend: String,
    },
    Welcome {
        version: u32,
        tool: String,
        backend: String,
    },
    Point {
        params: Value,
    },
    Listening {
        addr: SocketAddr,
    },
    Done {
        result: Value,
    },
    Error {
        message: String,
    },
}

fn send_on(w: &mut TcpStream, m: &Msg) -> Result<()> {
    let mut line = serde_json::to_string(m)?;
    line.push('\n');
    w.write_all(line.as_bytes())?;
    Ok(())
}

/// A control connection, either end.
pub struct Channel {
    reader: BufReader<TcpStream>,
    writer: TcpStream,
    peer: SocketAddr,
    /// Who is at the other end, for messages: `the server at 10.0.0.5:18515`.
    who: String,
    silence: Duration,
}

impl Channel {
    /// A channel that gives up on a peer silent for `silence` while this side waits for a message.
    fn new(stream: TcpStream, who: String, silence: Duration) -> Result<Channel> {
        stream.set_nodelay(true)?;
        stream.set_read_timeout(Some(silence))?;
        let peer = stream.peer_addr()?;
        let writer = stream.try_clone()?;
        Ok(Channel {
            reader: BufReader::new(stream),
            writer,
            peer,
            who,
            silence,
        })
    }

    pub fn send(&mut self, m: &Msg) -> Result<()> {
        send_on(&mut self.writer, m).with_context(|| format!("writing to {}", self.who))
    }

    /// The next message; `None` once the peer closed the connection.
    pub fn recv(&mut self) -> Result<Option<Msg>> {
        let mut line = String::new();
        let n = match self.reader.read_line(&mut line) {
            Ok(n) => n,
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => bail!(
                "{} sent nothing for {} s (a server serves one client at a time: busy with another?)",
                self.who,
                self.silence.as_secs()
            ),
            Err(e) => return Err(e).with_context(|| format!("reading from {}", self.who)),
        };
        if n == 0 {
            return Ok(None);
        }
        serde_json::from_str(line.trim())
            .map(Some)
            .with_context(|| {
                format!(
                    "{} sent {:?}: not an exs control message (another program on that port?)",
                    self.who,
                    line.trim()
                )
            })
    }

    /// The next message, which must come: the peer's error is an error here, and so is a close.
    pub fn expect(&mut self, waiting_for: &str) -> Result<Msg> {
        match self.recv()? {
            None => bail!(
                "{} closed the control connection while this side waited for {waiting_for}",
                self.who
            ),
            Some(Msg::Error { message }) => bail!("{}: {message}", self.who),
            Some(m) => Ok(m),
        }
    }

    /// Something that tells, without blocking, whether the peer has gone.
    pub fn watch(&self) -> Result<Watch> {
        Ok(Watch(Some(self.writer.try_clone()?)))
    }
}

/// Sees whether the other end of a control connection closed it (a server gives up waiting on a client that went).
pub struct Watch(Option<TcpStream>);

impl Watch {
    /// A watch that never sees anyone go.
    #[cfg(test)]
    pub fn never() -> Watch {
        Watch(None)
    }

    pub fn gone(&self) -> bool {
        use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
        let Some(s) = &self.0 else { return false };
        let mut fds = [PollFd::new(s.as_fd(), PollFlags::POLLIN)];
        match poll(&mut fds, PollTimeout::ZERO) {
            // Readable: data (the peer is there) or end of file / an error (gone).
            Ok(n) if n > 0 => matches!(s.peek(&mut [0u8; 1]), Ok(0) | Err(_)),
            _ => false,
        }
    }
}

/// What a server side runs each test on: its backend, one context, and where it listens.
pub struct Host {
    pub ctx: exs::Context,
    /// The backend, as reports name it: `exs (fabric/tcp)`.
    pub label: String,
    /// The exs listeners' address (port 0: any).
    pub listen: SocketAddr,
    /// Where plain-TCP tests listen (port 0: any).
    pub tcp_ip: IpAddr,
    /// Whether the server has its process to itself (CPU and switches: the whole process's, not one thread's).
    pub whole: bool,
}

impl Host {
    fn open(opened: &Opened, backend: &BackendArgs) -> Result<Host> {
        let (ctx, listen) = opened.host_listening()?;
        Ok(Host {
            ctx,
            label: opened.label(),
            listen,
            tcp_ip: backend.addr,
            whole: opened.processes(),
        })
    }
}

/// The server side of one tool.
pub trait Service: Send + Sync + 'static {
    /// The subcommand: `pump`, `ping`, `demo`.
    const TOOL: &'static str;
    /// One test's parameters, as the client sends them.
    type Params: Params;
    /// This side's measurements of one test.
    type Report: Serialize;
    /// Runs one test with the client's checked parameters: calls `announce` with the listener's address once the
    /// client may connect, gives up if `watch` sees the client go, and returns this side's measurements.
    fn serve(
        &self,
        host: &Host,
        params: &Self::Params,
        announce: &mut dyn FnMut(SocketAddr) -> Result<()>,
        watch: &Watch,
    ) -> Result<Self::Report>;
}

/// A test's parameters: chosen by the client, checked on both sides.
pub trait Params: DeserializeOwned {
    /// Refuses values the test cannot run with.
    fn check(&self) -> Result<()>;
}

/// Parses and checks a test's parameters on the server, runs the test, and returns the report as JSON.
fn serve_params<S: Service>(
    svc: &S,
    host: &Host,
    params: Value,
    announce: &mut dyn FnMut(SocketAddr) -> Result<()>,
    watch: &Watch,
) -> Result<Value> {
    let p: S::Params = serde_json::from_value(params)
        .context("parameter mismatch: the client's test parameters are not this server's (use the same exs on both hosts)")?;
    p.check()?;
    Ok(serde_json::to_value(svc.serve(host, &p, announce, watch)?)?)
}

fn refuse_sim(opened: &Opened, tool: &str) -> Result<()> {
    if !opened.processes() {
        bail!(
            "the sim backend lives inside one process: --server and --client need --backend fabric or verbs \
             (without them, `exs {tool} --backend sim` runs both sides in this process)"
        );
    }
    Ok(())
}

/// `exs TOOL --server`: serves clients one after the other, until killed (or one, with `--once`).
pub fn serve<S: Service>(svc: S, backend: &BackendArgs, peer: &PeerArgs, json: bool) -> Result<()> {
    let opened = Opened::open(backend)?;
    refuse_sim(&opened, S::TOOL)?;
    let at = SocketAddr::new(backend.addr, peer.port);
    let listener = TcpListener::bind(at).with_context(|| {
        format!(
            "listening for clients on {at} (TCP): another server there? (--port chooses another)"
        )
    })?;
    let host = Host::open(&opened, backend)?;
    let bound = listener.local_addr()?;
    if peer.announce {
        println!("LISTEN {bound}");
        std::io::stdout().flush()?;
    } else {
        eprintln!(
            "exs {tool}: serving on {bound} with {} {}; run `exs {tool} --client {} ...` on the other host",
            opened.label(),
            if peer.once { "for one client" } else { "until killed" },
            if peer.port == DEFAULT_PORT { bound.ip().to_string() } else { bound.to_string() },
            tool = S::TOOL
        );
    }
    run_server(&svc, &host, &listener, peer.once, !peer.announce, json)
}

fn run_server<S: Service>(
    svc: &S,
    host: &Host,
    listener: &TcpListener,
    once: bool,
    chatty: bool,
    json: bool,
) -> Result<()> {
    loop {
        let (stream, from) = listener
            .accept()
            .context("accepting a client's control connection")?;
        let r = session(svc, host, stream, from, json);
        if once {
            return r.map(|_| ());
        }
        match r {
            Ok(n) if chatty => eprintln!("exs {}: client {from}: {n} tests done", S::TOOL),
            Ok(_) => {}
            Err(e) => eprintln!("exs {}: client {from}: {e:#}", S::TOOL),
        }
    }
}

/// One client: its hello, then its tests until it closes the connection. Returns how many tests ran.
fn session<S: Service>(
    svc: &S,
    host: &Host,
    stream: TcpStream,
    from: SocketAddr,
    json: bool,
) -> Result<usize> {
    let mut ch = Channel::new(stream, format!("the client at {from}"), CLIENT_SILENCE)?;
    match ch.recv()? {
        Some(Msg::Hello {
            version,
            tool,
            backend,
        }) => {
            let refusal = if version != VERSION {
                Some(format!(
                    "version mismatch: the client speaks control version {version}, this server {VERSION} \
                     (use the same exs on both hosts)"
                ))
            } else if tool != S::TOOL {
                Some(format!(
                    "this is an `exs {}` server, not `exs {tool}`: start `exs {tool} --server` there",
                    S::TOOL
                ))
            } else {
                None
            };
            if let Some(message) = refusal {
                let _ = ch.send(&Msg::Error {
                    message: message.clone(),
                });
                bail!(message);
            }
            tracing::info!(%from, client_backend = %backend, "client connected");
            ch.send(&Msg::Welcome {
                version: VERSION,
                tool: S::TOOL.into(),
                backend: host.label.clone(),
            })?;
        }
        None => bail!("the client closed the connection before its hello"),
        Some(other) => bail!("expected a hello, got {other:?}"),
    }
    let mut n = 0;
    loop {
        match ch.recv()? {
            None => return Ok(n),
            Some(Msg::Point { params }) => {
                let watch = ch.watch()?;
                let mut tx = ch.writer.try_clone()?;
                tracing::info!(%from, %params, "test");
                let r = serve_params(
                    svc,
                    host,
                    params.clone(),
                    &mut |addr| send_on(&mut tx, &Msg::Listening { addr }),
                    &watch,
                );
                match r {
                    Ok(result) => {
                        if json {
                            let line = serde_json::json!({"tool": format!("exs-{}-server", S::TOOL),
                                "client": from.to_string(), "params": params, "result": result});
                            println!("{line}");
                        }
                        ch.send(&Msg::Done { result })?;
                    }
                    Err(e) => {
                        let _ = ch.send(&Msg::Error {
                            message: format!("{e:#}"),
                        });
                        return Err(e);
                    }
                }
                n += 1;
            }
            Some(other) => bail!("expected a test's parameters, got {other:?}"),
        }
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
                        "no server is running there (start one on that host with `exs {tool} --server{}`)",
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
                    .args(backend.to_args());
                let (child, addr, _out) = crate::util::spawn_listening(&mut cmd)?;
                let s = connect(&[addr], S::TOOL)?;
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
                        let host = Host::open(&opened, &backend)?;
                        run_server(&svc, &host, &listener, true, false, false)
                    })?;
                let s = connect(&[addr], S::TOOL)?;
                (s, "the server thread".into(), None, Some(t))
            }
        };
        let mut p = Peer {
            ch: Some(Channel::new(stream, who, SERVER_SILENCE)?),
            server_backend: String::new(),
            child,
            thread,
        };
        let ch = p.ch();
        ch.send(&Msg::Hello {
            version: VERSION,
            tool: S::TOOL.into(),
            backend: opened.label(),
        })?;
        match ch.expect("its welcome")? {
            Msg::Welcome {
                version,
                tool,
                backend,
            } if version == VERSION && tool == S::TOOL => {
                p.server_backend = backend;
            }
            other => bail!("{} answered the hello with {other:?}", ch.who),
        }
        Ok(p)
    }

    fn ch(&mut self) -> &mut Channel {
        self.ch.as_mut().expect("open until closed")
    }

    /// Starts one test on the server: sends every parameter, returns where its listener is.
    pub fn start(&mut self, params: &impl Serialize) -> Result<SocketAddr> {
        let params = serde_json::to_value(params)?;
        let ch = self.ch();
        ch.send(&Msg::Point { params })?;
        match ch.expect("its listener")? {
            // A server listening on any address is reached where its control connection was.
            Msg::Listening { addr } if addr.ip().is_unspecified() => {
                Ok(SocketAddr::new(ch.peer.ip(), addr.port()))
            }
            Msg::Listening { addr } => Ok(addr),
            other => bail!("{} answered a test's parameters with {other:?}", ch.who),
        }
    }

    /// The server's own measurements of the test started last.
    pub fn finish<T: DeserializeOwned>(&mut self) -> Result<T> {
        let ch = self.ch();
        match ch.expect("its measurements")? {
            Msg::Done { result } => serde_json::from_value(result)
                .with_context(|| format!("{}'s measurements (not the same exs version?)", ch.who)),
            other => bail!("{} sent {other:?} instead of its measurements", ch.who),
        }
    }

    /// This side's error in a test, with the server's account of it when it sent one (within a second or two).
    pub fn explain(&mut self, e: anyhow::Error) -> anyhow::Error {
        let ch = self.ch();
        let _ = ch.writer.set_read_timeout(Some(Duration::from_secs(2)));
        let deadline = Instant::now() + Duration::from_secs(2);
        while Instant::now() < deadline {
            match ch.recv() {
                Ok(Some(Msg::Error { message })) => {
                    return e.context(format!("{}: {message}", ch.who))
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

    #[test]
    fn messages_are_json_lines_tagged_by_kind() {
        let m = serde_json::to_string(&Msg::Listening {
            addr: "1.2.3.4:5".parse().unwrap(),
        })
        .unwrap();
        assert_eq!(m, r#"{"msg":"listening","addr":"1.2.3.4:5"}"#);
        assert!(matches!(
            serde_json::from_str(r#"{"msg":"error","message":"x"}"#).unwrap(),
            Msg::Error { .. }
        ));
    }

    #[test]
    fn a_watch_sees_the_peer_close() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let c = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (s, _) = l.accept().unwrap();
        let ch = Channel::new(s, "test".into(), CLIENT_SILENCE).unwrap();
        let w = ch.watch().unwrap();
        assert!(!w.gone());
        drop(c);
        let t = Instant::now();
        while !w.gone() {
            assert!(
                t.elapsed() < Duration::from_secs(5),
                "the close was never seen"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        assert!(!Watch::never().gone());
    }
}

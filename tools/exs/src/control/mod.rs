//! Server and client (issue 17): `exs pump|ping|demo --server` serves clients until killed (or one, `--once`);
//! `--client HOST[:PORT]` runs the tests against it from another host. Like perftest and iperf3, the two talk over
//! a small TCP control connection (default port [`DEFAULT_PORT`], perftest's), one JSON object per line:
//!
//! ```text
//! client -> server  {"msg":"hello","version":3,"tool":"pump","backend":"exs (fabric/tcp)"}
//! server -> client  {"msg":"welcome","version":3,"tool":"pump","backend":"exs (fabric/tcp)"}
//! client -> server  {"msg":"point","params":{...every parameter of one test...}}
//! server -> client  {"msg":"listening","addr":"10.0.0.5:40123","token":8529...}
//!                   its exs (or TCP) listener for this test, and the test's token
//!                   ... the client connects and sends the token's 8 bytes (little-endian) first; the server
//!                   takes only a connection that does (anyone may connect to its listener first) ...
//!                   ... the test runs over exs ...
//! server -> client  {"msg":"done","result":{...the server's own measurements...}}
//!                   (or {"msg":"error","message":"..."} at any point)
//! ```
//!
//! The client drives every parameter; the server checks each against the tool's ranges and its operator's caps
//! ([`Limits`]) before it runs anything. Users run these servers on shared hosts, so a client gets little: lines
//! of at most [`line::MAX_LINE`] bytes, a few seconds for its hello, one test at a time (others are told "busy"
//! at once), and a wall-clock limit on every test (`server`).
//!
//! Without `--server` or `--client` the tool runs both sides on this host through the same path: it starts itself
//! as `--server --once` on a free port (a thread instead of a process for the simulator, which cannot cross
//! processes), with the widest limits.

mod client;
mod limits;
mod line;
mod server;

use std::io::{BufReader, Write};
use std::net::{IpAddr, SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _, Result};
use serde::{de::DeserializeOwned, Deserialize, Serialize};
use serde_json::Value;

use crate::backend::{BackendArgs, Opened};

pub use client::Peer;
pub use limits::Limits;
pub use line::{excerpt, shorten};
pub use server::serve;

/// The control port servers listen on and clients connect to unless told otherwise (perftest's).
pub const DEFAULT_PORT: u16 = 18515;
/// The control protocol's version: client and server must speak the same. 2: `exs ping` sends its count, and
/// the server enforces limits; 3: the test's token, sent first on the data connection; 4: on each idle connection
/// of `exs ping --idle` too.
const VERSION: u32 = 4;
/// How long one side waits for the other to finish writing a line it has begun to send.
const WRITE_PATIENCE: Duration = Duration::from_secs(10);

/// Where the test's two sides run.
#[derive(Clone, Debug, clap::Args)]
#[command(next_help_heading = "Two hosts (default: both sides on this one)")]
pub struct PeerArgs {
    /// Serve clients (`--client` on another host) until killed, one at a time: control connections on
    /// --addr:--port, each test's exs listener on --addr at a port it tells the client. The client sends every
    /// test parameter; the server checks them against its limits (below).
    #[arg(short = 's', long, conflicts_with = "client")]
    pub server: bool,
    /// Run the tests against a server on another host (started there with --server): HOST or HOST:PORT.
    #[arg(short = 'c', long, value_name = "HOST[:PORT]", value_parser = crate::cli::target)]
    pub client: Option<String>,
    /// Control port: the one a server listens on, and the client's when HOST has none.
    #[arg(short = 'p', long, default_value_t = DEFAULT_PORT)]
    pub port: u16,
    /// With --server: exit after one client's tests; the exit status says whether they went well.
    #[arg(long, requires = "server")]
    pub once: bool,
    /// Internal (one-host mode): print `LISTEN <addr>` on stdout once listening, and nothing else.
    #[arg(long, hide = true, requires = "server")]
    pub announce: bool,
    #[command(flatten)]
    pub limits: Limits,
}

/// One line of the control connection, as sent, and as a client reads the server's.
#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "msg", rename_all = "snake_case")]
pub enum Msg {
    Hello {
        version: u32,
        tool: String,
        backend: String,
        /// The token of a server this client started for itself (in its environment); none for another's.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        token: Option<u64>,
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
        /// What the client's data connection sends first, so that the server serves that connection and no other.
        token: u64,
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
    /// The last line read.
    line: Vec<u8>,
}

impl Channel {
    fn new(stream: TcpStream, who: String) -> Result<Channel> {
        stream.set_nodelay(true)?;
        // A peer that stops reading cannot hold this side in a write for ever.
        stream.set_write_timeout(Some(WRITE_PATIENCE))?;
        let peer = stream.peer_addr()?;
        let writer = stream.try_clone()?;
        Ok(Channel {
            reader: BufReader::new(stream),
            writer,
            peer,
            who,
            line: Vec::new(),
        })
    }

    pub fn send(&mut self, m: &Msg) -> Result<()> {
        send_on(&mut self.writer, m).with_context(|| format!("writing to {}", self.who))
    }

    /// Reads the next line into `self.line` within `wait`; `false` once the peer closed the connection.
    fn next_line(&mut self, wait: Duration) -> Result<bool> {
        match line::read_line(
            &mut self.reader,
            &mut self.line,
            line::MAX_LINE,
            Instant::now() + wait,
        ) {
            Ok(more) => Ok(more),
            Err(line::LineError::Silent) => {
                bail!("{} sent nothing for {} s", self.who, wait.as_secs())
            }
            Err(e @ line::LineError::TooLong(_)) => {
                bail!("{} sent {e}: not an exs peer?", self.who)
            }
            Err(line::LineError::Io(e)) => {
                Err(e).with_context(|| format!("reading from {}", self.who))
            }
        }
    }

    /// The server's next message (a client's end), within `wait`; `None` once the server closed the connection.
    pub fn recv(&mut self, wait: Duration) -> Result<Option<Msg>> {
        if !self.next_line(wait)? {
            return Ok(None);
        }
        serde_json::from_slice(&self.line).map(Some).map_err(|e| {
            anyhow::anyhow!(
                "{} sent {}: not an exs control message (another program on that port?): {}",
                self.who,
                excerpt(&self.line),
                shorten(&e.to_string(), 120)
            )
        })
    }

    /// The next message, which must come within `wait`: the peer's error is an error here, and so is a close.
    pub fn expect(&mut self, waiting_for: &str, wait: Duration) -> Result<Msg> {
        match self.recv(wait)? {
            None => bail!(
                "{} closed the control connection while this side waited for {waiting_for}",
                self.who
            ),
            Some(Msg::Error { message }) => bail!("{}: {}", self.who, shorten(&message, 2000)),
            Some(m) => Ok(m),
        }
    }

    /// Something that tells, without blocking, whether the peer has gone, or the test's time is up.
    fn watch(&self, limits: &limits::Limits) -> Result<Watch> {
        self.watch_until(limits.deadline(), limits.max_seconds, limits.max_grace)
    }

    /// [`Channel::watch`] with the deadline given, and the limits it came from (for the message).
    fn watch_until(&self, deadline: Instant, max_seconds: f64, max_grace: f64) -> Result<Watch> {
        use nix::sys::epoll::{Epoll, EpollCreateFlags, EpollEvent, EpollFlags};
        let peer = self.writer.try_clone()?;
        let hangup = Epoll::new(EpollCreateFlags::EPOLL_CLOEXEC)?;
        hangup.add(
            &peer,
            EpollEvent::new(EpollFlags::EPOLLIN | EpollFlags::EPOLLRDHUP, 0),
        )?;
        Ok(Watch {
            peer: Some(peer),
            deadline: Some((deadline, max_seconds, max_grace)),
            token: Some(new_token()?),
            hangup: Some(hangup),
        })
    }
}

/// A test's token: eight bytes of the kernel's randomness, which whoever connects to the test's listener cannot
/// guess.
pub(crate) fn new_token() -> Result<u64> {
    use std::io::Read;
    let mut b = [0u8; 8];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut b))
        .context("reading /dev/urandom for a test's token")?;
    Ok(u64::from_le_bytes(b))
}

/// Sees whether the other end of a control connection closed it (a server gives up waiting on a client that
/// went), and whether the test has run past the server's limit.
pub struct Watch {
    peer: Option<TcpStream>,
    /// When the test must have ended, and the server's `--max-seconds` and `--max-grace` (for the message).
    deadline: Option<(Instant, f64, f64)>,
    /// What the client's data connection must send first (see [`Msg::Listening`]).
    token: Option<u64>,
    /// Hears `peer` readable or hung up (level-triggered), for [`Watch::gone`].
    hangup: Option<nix::sys::epoll::Epoll>,
}

impl Watch {
    /// A watch that never sees anyone go, and no deadline.
    #[cfg(test)]
    pub fn never() -> Watch {
        Watch {
            peer: None,
            deadline: None,
            token: None,
            hangup: None,
        }
    }

    /// A watch with a token and nothing else: a helper server's, whose client sends `token` first
    /// ([`crate::helper`]); no deadline, and no control connection to see go.
    pub fn with_token(token: u64) -> Watch {
        Watch {
            peer: None,
            deadline: None,
            token: Some(token),
            hangup: None,
        }
    }

    /// The test's token, which the client's data connection sends first; `None`: any connection is the client's.
    pub fn token(&self) -> Option<u64> {
        self.token
    }

    pub fn gone(&self) -> bool {
        use nix::sys::epoll::{EpollEvent, EpollFlags, EpollTimeout};
        let (Some(s), Some(ep)) = (&self.peer, &self.hangup) else {
            return false;
        };
        let mut ev = [EpollEvent::empty()];
        match ep.wait(&mut ev, EpollTimeout::ZERO) {
            Ok(1) => {
                // The peer's close shows as EPOLLRDHUP even behind bytes it sent first: a peek alone saw such a
                // byte and took the client for present until the test's limit (review finding).
                let ended = EpollFlags::EPOLLRDHUP | EpollFlags::EPOLLHUP | EpollFlags::EPOLLERR;
                ev[0].events().intersects(ended)
                    // Readable: data (the peer is there) or end of file / an error (gone).
                    || matches!(s.peek(&mut [0u8; 1]), Ok(0) | Err(_))
            }
            _ => false,
        }
    }

    /// An error once the test has run past the server's limit (cheap: no system call).
    pub fn in_time(&self, what: &str) -> Result<()> {
        if let Some((at, max, grace)) = self.deadline {
            if Instant::now() >= at {
                bail!(
                    "stopped while waiting for {what}: the test ran past this server's limit of {max} s \
                     (its --max-seconds) plus {grace} s to connect and close (its --max-grace)"
                );
            }
        }
        Ok(())
    }

    /// An error once the client has gone or the test's time is up.
    pub fn check(&self, what: &str) -> Result<()> {
        self.in_time(what)?;
        if self.gone() {
            bail!("the client closed its control connection while this side waited for {what}");
        }
        Ok(())
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
    /// Whether the peer's one-sided operations on this host's memory are served without this process (verbs: the
    /// device, or rxe's and siw's kernel code), rather than by its progress (libfabric's software providers, the
    /// simulator).
    pub device_serves_peers: bool,
}

impl Host {
    /// The server's context, whose connections may hold what `limits` let one test make them hold.
    fn open(opened: &Opened, backend: &BackendArgs, limits: &Limits) -> Result<Host> {
        let (ctx, listen) = opened.host_within(limits.engine_budget())?;
        Ok(Host {
            ctx,
            label: opened.label(),
            listen,
            tcp_ip: backend.addr,
            whole: opened.processes(),
            device_serves_peers: opened.device_serves_peers(),
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
    /// client may connect, gives up if `watch` sees the client go or the time run out, and returns this side's
    /// measurements.
    fn serve(
        &self,
        host: &Host,
        params: &Self::Params,
        announce: &mut dyn FnMut(SocketAddr) -> Result<()>,
        watch: &Watch,
    ) -> Result<Self::Report>;
}

/// A test's parameters: chosen by the client, checked on both sides, parsed by the server straight from the
/// client's line into this type.
pub trait Params: DeserializeOwned + Serialize + std::fmt::Debug {
    /// Refuses values the test cannot run with, or that ask for more than `limits` allow.
    fn check(&self, limits: &Limits) -> Result<(), String>;
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    #[test]
    fn messages_are_json_lines_tagged_by_kind() {
        let m = serde_json::to_string(&Msg::Listening {
            addr: "1.2.3.4:5".parse().unwrap(),
            token: 7,
        })
        .unwrap();
        assert_eq!(m, r#"{"msg":"listening","addr":"1.2.3.4:5","token":7}"#);
        assert!(matches!(
            serde_json::from_str(r#"{"msg":"error","message":"x"}"#).unwrap(),
            Msg::Error { .. }
        ));
    }

    #[test]
    fn a_watch_sees_the_peer_close_and_the_time_run_out() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let c = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (s, _) = l.accept().unwrap();
        let ch = Channel::new(s, "test".into()).unwrap();
        let w = ch
            .watch_until(Instant::now() + Duration::from_secs(60), 1.0, 10.0)
            .unwrap();
        assert!(!w.gone());
        assert!(w.check("x").is_ok());
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
        let late = ch.watch_until(Instant::now(), 7.0, 2.5).unwrap();
        let e = late.in_time("the pings").unwrap_err().to_string();
        assert!(
            e.contains("limit of 7 s")
                && e.contains("--max-seconds")
                && e.contains("plus 2.5 s")
                && e.contains("--max-grace"),
            "{e}"
        );
    }
}

//! `exs TOOL --server`: serves one client's tests at a time, like iperf3 (two tests at once would measure each
//! other: the same CPUs, the same link). Every connection gets a thread for its hello (at most
//! [`MAX_CONNECTIONS`] at once, the rest are refused at once), so a silent or slow client never holds the door:
//! the first client to say hello gets the server, and any other that says hello meanwhile is told "busy" (after
//! [`BUSY_WAIT`], in case the running session is ending) and let go. One host holds at most [`MAX_PER_HOST`] of the
//! connections, so that silent connections from one host cannot shut every other out. A welcomed client has
//! [`IDLE`] between tests, each test ends within the server's `--max-seconds` (plus its `--max-grace`) whatever the
//! client does, and a test asked for past the server's `--max-session` ends the session. The log never holds the
//! server up: its lines go through a queue (a stalled reader of standard error costs lines, `crate::log`), and
//! lines about connections refused, gone before their hello or that ran no test are at most [`STRANGER_LINES`] at
//! once and one a second after, the rest counted (the count goes with the next such line, or on a line of its own
//! a second after the first left out, if none came).

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsFd;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context as _, Result};
use serde::Deserialize;

use super::{
    excerpt, refuse_sim, send_on, shorten, Channel, Host, Limits, Msg, Params, PeerArgs, Service,
    DEFAULT_PORT, VERSION,
};
use crate::backend::{BackendArgs, Opened};
use crate::log::note;

/// How long a client has, once connected, to send its hello.
pub const HANDSHAKE: Duration = Duration::from_secs(5);
/// How long a welcomed client may stay silent between its tests (it sends the next as soon as it has summed up
/// the last: sorting a long ping run's samples takes a few seconds in a debug build).
pub const IDLE: Duration = Duration::from_secs(30);
/// Connections handled at once (saying hello, being told "busy", or running tests). When all are taken, the one
/// that has waited longest without saying hello is let go for a newcomer; with none such, more are refused at once.
pub const MAX_CONNECTIONS: usize = 32;
/// Connections one host may have at once (a quarter of [`MAX_CONNECTIONS`]).
pub const MAX_PER_HOST: usize = MAX_CONNECTIONS / 4;
/// How long a client that says hello while another's session ends waits for it before it is told "busy".
const BUSY_WAIT: Duration = Duration::from_secs(1);
/// Lines about connections refused, gone before their hello, or whose session ran no test, that the log takes at
/// once; after that, one a second, and the rest are counted (a stranger connecting in a loop, with or without a
/// hello, must not fill the log).
const STRANGER_LINES: u64 = 16;

/// What the count of strangers' lines held back says.
const LEFT_OUT: &str =
    "lines about connections refused, gone before their hello or that ran no test, not logged";
/// What a client hears while another's tests run.
const BUSY: &str =
    "busy: this server runs one client's tests at a time (tests that share a host measure each \
                    other) and is running another's; try again when it is done";

/// The variable that hands the server a client starts for itself on this host (`--once`) its client's token
/// (readable by its own user only, unlike its command line).
pub(crate) const CLIENT_TOKEN_VAR: &str = "EXS_CLIENT_TOKEN";

/// `exs TOOL --server`: serves clients until killed (or one, with `--once`).
pub fn serve<S: Service>(svc: S, backend: &BackendArgs, peer: &PeerArgs, json: bool) -> Result<()> {
    let opened = Opened::open(backend)?;
    refuse_sim(&opened, S::TOOL)?;
    let at = SocketAddr::new(backend.addr, peer.port);
    let listener = TcpListener::bind(at).with_context(|| {
        format!(
            "listening for clients on {at} (TCP): another server there? (--port chooses another)"
        )
    })?;
    let host = Host::open(&opened, backend, &peer.limits)?;
    let bound = listener.local_addr()?;
    if peer.announce {
        crate::out::announce(bound)?;
    } else {
        let l = &peer.limits;
        note(format_args!(
            "exs {tool}: serving on {bound} with {} {}; run `exs {tool} --client {} ...` {} \
             (limits per test: {} s and {} s to connect and close, {} per transfer, {} pings, {} idle connections, \
             {} of buffers; {} s per client)",
            opened.label(),
            if peer.once { "for one client" } else { "until killed" },
            if peer.port == DEFAULT_PORT { bound.ip().to_string() } else { bound.to_string() },
            // Review finding: the default address is loopback, and the note sent the user to another host.
            if bound.ip().is_loopback() {
                "on this host (a loopback address: give --addr an address of this host to serve others)"
            } else {
                "on the other host"
            },
            l.max_seconds,
            l.max_grace,
            crate::cli::fmt_size(l.max_bytes),
            l.max_count,
            l.max_idle,
            crate::cli::fmt_size(l.max_memory),
            l.max_session,
            tool = S::TOOL
        ));
    }
    let mut server = Server::new(svc, host, peer.limits.clone(), !peer.announce, json);
    // The server a client starts for itself on this host (the one-host mode, always `--once`) serves that client
    // only: the token came in its environment, as a helper's does, and must come back in the hello (review
    // finding: anyone who reached its port first got a server with the widest limits, and the client was told it
    // was busy).
    if let (true, Some(v)) = (peer.once, std::env::var_os(CLIENT_TOKEN_VAR)) {
        let token = v.to_str().and_then(|v| v.parse().ok()).ok_or_else(|| {
            anyhow!("{CLIENT_TOKEN_VAR}: not a token: {v:?} (the one-host client sets it for its server)")
        })?;
        Arc::get_mut(&mut server)
            .expect("not shared yet")
            .client_token = Some(token);
    }
    server.run(&listener, peer.once)
}

/// One server: its service, host and limits, and who holds it.
pub struct Server<S> {
    svc: S,
    host: Host,
    limits: Limits,
    /// Logs each client's end on stderr.
    chatty: bool,
    /// Prints a JSON line per test served.
    json: bool,
    /// The token a client's hello must carry (a server its client started: see [`serve`]).
    client_token: Option<u64>,
    /// Whether a client's tests are running (the one slot), and its release.
    testing: Mutex<bool>,
    freed: Condvar,
    connections: AtomicUsize,
    /// Connections per client host (none of a host that has none).
    per_host: Mutex<HashMap<IpAddr, usize>>,
    /// Connections that have not said hello yet, oldest first, by number: the oldest is let go when every place
    /// is taken (see [`Server::admit`]).
    unwelcomed: Mutex<std::collections::VecDeque<(u64, TcpStream)>>,
    next_conn: std::sync::atomic::AtomicU64,
    /// What the log may still take about strangers ([`STRANGER_LINES`]).
    stranger_lines: Mutex<Quota>,
    /// Wakes the accepting thread to time the count of lines held back (a clone of its wake-up socket, set when it
    /// starts; it must not block).
    count_waker: std::sync::OnceLock<UnixStream>,
}

/// Lines the log may take now, refilled at one a second up to [`STRANGER_LINES`], and those held back since the
/// last one written.
struct Quota {
    left: u64,
    refilled: Instant,
    held_back: u64,
    /// When the first of those held back was.
    held_since: Option<Instant>,
}

impl Quota {
    fn new() -> Quota {
        Quota {
            left: STRANGER_LINES,
            refilled: Instant::now(),
            held_back: 0,
            held_since: None,
        }
    }

    /// Whether a line may go out now; if so, with how many were held back before it.
    fn take(&mut self) -> Option<u64> {
        let secs = self.refilled.elapsed().as_secs();
        if secs > 0 {
            self.left = (self.left + secs).min(STRANGER_LINES);
            self.refilled += Duration::from_secs(secs);
        }
        if self.left == 0 {
            self.held_back += 1;
            self.held_since.get_or_insert_with(Instant::now);
            return None;
        }
        self.left -= 1;
        self.held_since = None;
        Some(std::mem::take(&mut self.held_back))
    }

    /// How long until the count of lines held back is overdue: [`COUNT_AFTER`] after the first of them.
    fn count_due_in(&self) -> Option<Duration> {
        self.held_since
            .map(|t| (t + COUNT_AFTER).saturating_duration_since(Instant::now()))
    }

    /// The count of lines held back, once overdue or if `now` (taken: it is written once).
    fn overdue(&mut self, now: bool) -> Option<u64> {
        if self.count_due_in()? > Duration::ZERO && !now {
            return None;
        }
        self.held_since = None;
        Some(std::mem::take(&mut self.held_back))
    }
}

/// How long a count of lines held back waits for a line to carry it before it is written on its own (strangers
/// that stopped coming).
const COUNT_AFTER: Duration = Duration::from_secs(1);

/// The server, held by one client's session; freed when the session ends, however it ends.
struct Slot<'a>(&'a Mutex<bool>, &'a Condvar);

impl Drop for Slot<'_> {
    fn drop(&mut self) {
        *self.0.lock().unwrap_or_else(|p| p.into_inner()) = false;
        self.1.notify_one();
    }
}

/// Counts a connection (and its host's) for as long as its thread runs.
struct Counted<S: Service>(Arc<Server<S>>, IpAddr);

impl<S: Service> Drop for Counted<S> {
    fn drop(&mut self) {
        self.0.connections.fetch_sub(1, Ordering::AcqRel);
        self.0.uncount_host(self.1);
    }
}

/// How the one welcomed client's session tells a `--once` server it ended (even by a panic).
struct Finish {
    tx: mpsc::Sender<Result<usize>>,
    wake: UnixStream,
    result: Option<Result<usize>>,
}

impl Drop for Finish {
    fn drop(&mut self) {
        let r = self
            .result
            .take()
            .unwrap_or_else(|| Err(anyhow!("the client's session ended abnormally")));
        let _ = self.tx.send(r);
        let _ = self.wake.write_all(&[1]);
    }
}

impl<S: Service> Server<S> {
    pub fn new(svc: S, host: Host, mut limits: Limits, chatty: bool, json: bool) -> Arc<Server<S>> {
        let threshold = host.ctx.capabilities().immediate_default;
        limits.transport_threshold = Some(threshold.min(exs::SocketOptions::MAX_SMALL));
        Arc::new(Server {
            svc,
            host,
            limits,
            chatty,
            json,
            client_token: None,
            testing: Mutex::new(false),
            freed: Condvar::new(),
            connections: AtomicUsize::new(0),
            per_host: Mutex::new(HashMap::new()),
            unwelcomed: Mutex::new(std::collections::VecDeque::new()),
            next_conn: std::sync::atomic::AtomicU64::new(0),
            stranger_lines: Mutex::new(Quota::new()),
            count_waker: std::sync::OnceLock::new(),
        })
    }

    /// Lists a connection as waiting for its hello; its number.
    fn await_hello(&self, stream: &TcpStream) -> Option<u64> {
        let copy = stream.try_clone().ok()?;
        let id = self.next_conn.fetch_add(1, Ordering::Relaxed);
        self.unwelcomed
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push_back((id, copy));
        Some(id)
    }

    /// The connection's hello came (or its wait ended): it is no longer one to let go.
    fn said_hello(&self, id: Option<u64>) {
        if let Some(id) = id {
            self.unwelcomed
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .retain(|(i, _)| *i != id);
        }
    }

    /// Shuts the oldest connection still waiting for its hello down (its session then ends); whether there was one.
    fn let_go_oldest_silent(&self) -> bool {
        let oldest = self
            .unwelcomed
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .pop_front();
        match oldest {
            Some((_, s)) => {
                let _ = s.shutdown(std::net::Shutdown::Both);
                true
            }
            None => false,
        }
    }

    /// Counts a connection of `ip`'s, unless that host has [`MAX_PER_HOST`] already.
    fn count_host(&self, ip: IpAddr) -> bool {
        let mut m = self.per_host.lock().unwrap_or_else(|p| p.into_inner());
        let n = m.entry(ip).or_insert(0);
        if *n >= MAX_PER_HOST {
            return false;
        }
        *n += 1;
        true
    }

    fn uncount_host(&self, ip: IpAddr) {
        let mut m = self.per_host.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(n) = m.get_mut(&ip) {
            *n -= 1;
            if *n == 0 {
                m.remove(&ip);
            }
        }
    }

    /// Accepts clients until killed; with `once`, returns how the first welcomed client's tests went.
    pub fn run(self: Arc<Self>, listener: &TcpListener, once: bool) -> Result<()> {
        // The accept loop sleeps in poll(2) with no timeout (a periodic wake-up would count in the server's
        // measured context switches) but while a count of strangers' lines is pending; a --once session that ends,
        // or the first stranger's line left out, wakes it through this pair.
        let (wake_tx, wake_rx) = UnixStream::pair().context("a wake-up socket pair")?;
        // Nonblocking: a wake-up that finds the socket full is not needed (the accepting thread has bytes to read).
        wake_tx.set_nonblocking(true)?;
        let _ = self.count_waker.set(wake_tx.try_clone()?);
        let (tx, rx) = mpsc::channel::<Result<usize>>();
        listener.set_nonblocking(true)?;
        loop {
            let count_due_in = self.quota().count_due_in();
            wait_readable(listener, &wake_rx, count_due_in)?;
            self.log_overdue_count(false);
            if let Ok(r) = rx.try_recv() {
                // A --once server goes: a count still pending is written now.
                self.log_overdue_count(true);
                return r.map(|_| ());
            }
            match listener.accept() {
                Ok((stream, from)) => {
                    let finish = match once.then(|| wake_tx.try_clone()) {
                        None => None,
                        Some(Ok(wake)) => Some((tx.clone(), wake)),
                        Some(Err(e)) => {
                            // Out of descriptors: this connection goes, the server stays.
                            self.log(from, &format!("dropped: {e}"));
                            continue;
                        }
                    };
                    self.admit(stream, from, finish);
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                Err(e) => {
                    // E.g. out of descriptors under a flood: wait a little rather than stop serving.
                    note(format_args!("exs {}: accepting a connection: {e}", S::TOOL));
                    std::thread::sleep(Duration::from_millis(100));
                }
            }
        }
    }

    fn admit(
        self: &Arc<Self>,
        stream: TcpStream,
        from: SocketAddr,
        finish: Option<(mpsc::Sender<Result<usize>>, UnixStream)>,
    ) {
        if !self.count_host(from.ip()) {
            refuse_at_once(
                stream,
                &format!("too many connections from your host at once (this server takes {MAX_PER_HOST}); try again later"),
            );
            self.log_stranger(from, "refused: too many connections from its host at once");
            return;
        }
        // Every place taken: the connection that has waited longest without a hello goes, so that silent
        // connections from a few hosts (each within its own count) cannot keep every other client out. Its thread
        // ends at once and gives its place back; until then the count runs one over.
        if self.connections.fetch_add(1, Ordering::AcqRel) >= MAX_CONNECTIONS
            && !self.let_go_oldest_silent()
        {
            self.connections.fetch_sub(1, Ordering::AcqRel);
            self.uncount_host(from.ip());
            refuse_at_once(stream, "too many connections at once; try again later");
            self.log_stranger(from, "refused: too many connections at once");
            return;
        }
        // Listed here, by the one thread that accepts, not by its session's thread: a newcomer that finds every
        // place taken must find every silent connection counted so far listed, however late their threads start.
        let waiting = self.await_hello(&stream);
        let counted = Counted(Arc::clone(self), from.ip());
        let spawned = std::thread::Builder::new()
            .name(format!("exs-{}-client", S::TOOL))
            .spawn(move || {
                let srv = &counted.0;
                srv.session(stream, from, finish, waiting)
            });
        if let Err(e) = spawned {
            self.said_hello(waiting);
            self.log(from, &format!("dropped: no thread for it ({e})"));
        }
    }

    fn log(&self, from: SocketAddr, what: &str) {
        if self.chatty {
            note(format_args!("exs {}: client {from}: {what}", S::TOOL));
        }
    }

    /// [`Server::log`] for a connection refused, gone before its hello, or whose session ran no test, within
    /// [`STRANGER_LINES`].
    fn log_stranger(&self, from: SocketAddr, what: &str) {
        if !self.chatty {
            return;
        }
        let (quota, first_held) = {
            let mut q = self.quota();
            let pending = q.held_since.is_some();
            let quota = q.take();
            (quota, !pending && q.held_since.is_some())
        };
        match quota {
            // The accepting thread times the count from the first line held back.
            None if first_held => {
                if let Some(w) = self.count_waker.get() {
                    let _ = (&*w).write(&[1]);
                }
            }
            None => {}
            Some(0) => self.log(from, what),
            Some(n) => self.log(from, &format!("{what} (and {n} {LEFT_OUT} before it)")),
        }
    }

    /// The count of strangers' lines held back, written on its own once no line has carried it for
    /// [`COUNT_AFTER`] (or `now`, before the server goes).
    fn log_overdue_count(&self, now: bool) {
        let overdue = self.quota().overdue(now);
        if let (Some(n), true) = (overdue, self.chatty) {
            note(format_args!("exs {}: {n} {LEFT_OUT}", S::TOOL));
        }
    }

    fn quota(&self) -> std::sync::MutexGuard<'_, Quota> {
        self.stranger_lines
            .lock()
            .unwrap_or_else(|p| p.into_inner())
    }

    /// One connection: its hello, then (if it gets the server) its tests until it closes the connection.
    fn session(
        &self,
        stream: TcpStream,
        from: SocketAddr,
        finish: Option<(mpsc::Sender<Result<usize>>, UnixStream)>,
        waiting: Option<u64>,
    ) {
        // Its address starts every line of the log about it.
        let ch = Channel::new(stream, "the client".into());
        let greeted = ch.map(|mut ch| {
            let g = self.greet(&mut ch, from, waiting);
            (ch, g)
        });
        // Off the list of silent connections however the hello went (its copy of the stream goes with it).
        self.said_hello(waiting);
        let (mut ch, greeted) = match greeted {
            Ok(x) => x,
            Err(e) => return self.log_stranger(from, &format!("{e:#}")),
        };
        let slot = match greeted {
            Ok(slot) => slot,
            Err(e) => {
                let _ = ch.send(&Msg::Error {
                    message: format!("{e:#}"),
                });
                return self.log_stranger(from, &format!("{e:#}"));
            }
        };
        let mut finish = finish.map(|(tx, wake)| Finish {
            tx,
            wake,
            result: None,
        });
        let mut n = 0;
        let r = self.tests(&mut ch, from, &mut n);
        if finish.is_some() {
            // A --once server exits now: the slot stays taken, so that a client waiting for it is told "busy"
            // rather than welcomed by a process about to go.
            std::mem::forget(slot);
        } else {
            // Free before the last word: a client that hears it and comes back at once finds the server free.
            drop(slot);
        }
        if let Err(e) = &r {
            let _ = ch.send(&Msg::Error {
                message: format!("{e:#}"),
            });
        }
        drop(ch);
        let line = match &r {
            Ok(()) => format!("done ({n} tests)"),
            Err(e) => format!("{e:#}"),
        };
        match &mut finish {
            Some(f) => f.result = Some(r.map(|()| n)),
            // Anyone may say hello: a session that ran no test is logged as a stranger is.
            None if n == 0 => self.log_stranger(from, &line),
            None => self.log(from, &line),
        }
    }

    /// Reads the client's hello within [`HANDSHAKE`], checks it, and takes the server for the client (or says
    /// why not). `waiting`: the connection's place among those not heard from yet.
    fn greet(&self, ch: &mut Channel, from: SocketAddr, waiting: Option<u64>) -> Result<Slot<'_>> {
        #[derive(Deserialize)]
        struct Hello {
            version: u32,
            tool: String,
            backend: String,
            #[serde(default)]
            token: Option<u64>,
        }
        let h: Hello = match recv::<Hello>(ch, "hello", HANDSHAKE)? {
            Some(h) => h,
            None => bail!("closed the connection before its hello"),
        };
        // Heard from: no longer one to let go for a newcomer. It may wait in `claim` for a second; let go meanwhile,
        // it would keep its place until then, and a burst of hellos could push the server past its connections.
        self.said_hello(waiting);
        tracing::debug!(%from, "hello received");
        if h.version != VERSION {
            bail!(
                "version mismatch: the client speaks control version {}, this server {VERSION} (use the same \
                 exs on both hosts)",
                h.version
            );
        }
        if h.tool != S::TOOL {
            bail!(
                "this is an `exs {}` server, not `exs {}`: start `exs {1} --server` there",
                S::TOOL,
                shorten(&h.tool, 40)
            );
        }
        if self.client_token.is_some() && h.token != self.client_token {
            bail!("not the client that started this server (its hello has no token, or another)");
        }
        let slot = self.claim().ok_or_else(|| anyhow!(BUSY))?;
        tracing::info!(%from, client_backend = %shorten(&h.backend, 80), "client connected");
        ch.send(&Msg::Welcome {
            version: VERSION,
            tool: S::TOOL.into(),
            backend: self.host.label.clone(),
        })?;
        Ok(slot)
    }

    /// Takes the server for one client; waits [`BUSY_WAIT`] for a session that is ending (a client that starts
    /// as another leaves is served, not told "busy").
    fn claim(&self) -> Option<Slot<'_>> {
        let held = self.testing.lock().unwrap_or_else(|p| p.into_inner());
        let (mut held, _) = self
            .freed
            .wait_timeout_while(held, BUSY_WAIT, |held| *held)
            .unwrap_or_else(|p| p.into_inner());
        if *held {
            return None;
        }
        *held = true;
        Some(Slot(&self.testing, &self.freed))
    }

    /// Runs the client's tests until it closes the connection, counting them in `n`.
    fn tests(&self, ch: &mut Channel, from: SocketAddr, n: &mut usize) -> Result<()> {
        #[derive(Deserialize)]
        #[serde(bound = "P: Params")]
        struct Point<P> {
            params: P,
        }
        let end = self.limits.session_end();
        while let Some(Point::<S::Params> { params }) = recv(ch, "point", IDLE)? {
            if std::time::Instant::now() >= end {
                bail!(
                    "the session ran past this server's limit of {} s per client (its --max-session) after {n} \
                     tests; connect again for more",
                    self.limits.max_session
                );
            }
            params.check(&self.limits).map_err(|why| anyhow!(why))?;
            let watch = ch.watch(&self.limits)?;
            let mut tx = ch.writer.try_clone()?;
            tracing::info!(%from, ?params, "test");
            let report = self.svc.serve(
                &self.host,
                &params,
                &mut |addr| {
                    let token = watch.token().unwrap_or_default();
                    send_on(&mut tx, &Msg::Listening { addr, token })
                },
                &watch,
            )?;
            let result = serde_json::to_value(report)?;
            if self.json {
                let line = serde_json::json!({"tool": format!("exs-{}-server", S::TOOL),
                    "client": from.to_string(), "params": params, "result": result});
                // A reader that went away (`| head`) or stopped reading costs reports, never the session.
                crate::log::report(format_args!("{line}"));
            }
            ch.send(&Msg::Done { result })?;
            *n += 1;
        }
        Ok(())
    }
}

/// The client's next message, which must be of `kind`, parsed straight into `T` (no intermediate tree of
/// values); `None` once the client closed the connection.
fn recv<T: serde::de::DeserializeOwned>(
    ch: &mut Channel,
    kind: &str,
    wait: Duration,
) -> Result<Option<T>> {
    #[derive(Deserialize)]
    struct Kind<'a> {
        #[serde(borrow)]
        msg: std::borrow::Cow<'a, str>,
    }
    if !ch
        .next_line(wait)
        .with_context(|| format!("waiting for a {kind}"))?
    {
        return Ok(None);
    }
    let line = &ch.line;
    let k: Kind = serde_json::from_slice(line).map_err(|e| {
        anyhow!(
            "sent {}: not an exs control message ({})",
            excerpt(line),
            shorten(&e.to_string(), 120)
        )
    })?;
    if k.msg != kind {
        bail!(
            "sent a {:?} message where a {kind} belongs",
            shorten(&k.msg, 40)
        );
    }
    serde_json::from_slice(line).map(Some).map_err(|e| {
        anyhow!(
            "sent a {kind} this server cannot use ({}): use the same exs on both hosts",
            shorten(&e.to_string(), 200)
        )
    })
}

/// Tells a connection the server cannot take it, and lets it go without waiting for it.
fn refuse_at_once(mut stream: TcpStream, why: &str) {
    let _ = stream.set_nonblocking(true);
    let _ = send_on(
        &mut stream,
        &Msg::Error {
            message: why.into(),
        },
    );
    let _ = stream.shutdown(std::net::Shutdown::Write);
}

/// Sleeps until the listener has a connection, the wake-up socket has a byte, or `timeout` is over.
fn wait_readable(
    listener: &TcpListener,
    wake: &UnixStream,
    timeout: Option<Duration>,
) -> Result<()> {
    use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
    let mut fds = [
        PollFd::new(listener.as_fd(), PollFlags::POLLIN),
        PollFd::new(wake.as_fd(), PollFlags::POLLIN),
    ];
    loop {
        let timeout = match timeout {
            // Rounded up: a timeout rounded down to 0 would spin until the count is due.
            Some(t) => PollTimeout::try_from(t.as_millis().saturating_add(1).min(60_000) as u32)
                .unwrap_or(PollTimeout::MAX),
            None => PollTimeout::NONE,
        };
        match poll(&mut fds, timeout) {
            Ok(_) => break,
            Err(nix::errno::Errno::EINTR) => continue,
            Err(e) => return Err(e).context("waiting for clients"),
        }
    }
    if fds[1].revents().is_some_and(|r| !r.is_empty()) {
        let _ = (&*wake).read(&mut [0u8; 16]);
    }
    Ok(())
}

//! Issue 15: connection attempts that fail leave nothing behind. A refused request ends with its socket
//! (libfabric tcp) or its rdma_cm id (verbs): nothing this process holds on the listener's port grows with the
//! number of refused connects.
//!
//! What is counted is what this process holds on the port of the test's listener: descriptors of TCP sockets
//! with that port at either end (`ss`'s sockets on the port, or `/proc/net/tcp*` without it, against
//! `/proc/self/fd`), and rdma_cm ids with it (`rdma resource show cm_id`, where the tool and a device are there).
//! Counting by port keeps the count exact while other tests of the suite open and close descriptors in the same
//! process.

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use exs::transport::CmEvent;
use exs::{Context, EventQueue, OpError, SockType, Socket};

use crate::util::*;
use crate::{ensure, Backend, Case, Net, Requires};

pub fn cases() -> Vec<Case> {
    vec![
        Case {
            name: "refused_connects_leave_no_sockets_or_ids",
            run: refused_connects,
            requires: Requires::Nothing,
        },
        Case {
            name: "a_closed_listener_refuses_the_requests_waiting_for_it",
            run: closed_listener_with_requests_waiting,
            requires: Requires::Nothing,
        },
    ]
}

/// How many connects are refused (`EXS_CONFORMANCE_REFUSED`; 10,000 where connections are cheap to make, 400 on
/// a device in an emulated guest).
fn refused_count(b: &dyn Backend) -> usize {
    std::env::var("EXS_CONFORMANCE_REFUSED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| {
            if matches!(b.name(), "sim" | "fabric") {
                10_000
            } else {
                400
            }
        })
}

/// What this process holds on one port.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Held {
    /// Descriptors of TCP sockets with the port at either end.
    sockets: usize,
    /// rdma_cm ids of this process with the port at either end (`None`: not countable here).
    cm_ids: Option<usize>,
}

impl Held {
    fn total(&self) -> usize {
        self.sockets + self.cm_ids.unwrap_or(0)
    }
}

fn port_of(hex_addr: &str) -> Option<u16> {
    u16::from_str_radix(hex_addr.rsplit(':').next()?, 16).ok()
}

/// Descriptors of this process that are TCP sockets with `port` at either end.
fn sockets_on(port: u16) -> usize {
    let inodes = socket_inodes_ss(port).unwrap_or_else(|| socket_inodes_proc(port));
    let Ok(fds) = std::fs::read_dir("/proc/self/fd") else {
        return 0;
    };
    fds.filter_map(|f| std::fs::read_link(f.ok()?.path()).ok())
        .filter(|target| inodes.contains(target.to_string_lossy().as_ref()))
        .count()
}

/// The inodes (as `/proc/self/fd` names them, `socket:[N]`) of the TCP sockets with `port` at either end and not
/// in TIME_WAIT, from `ss` (iproute2), whose filter runs in the kernel; `None` without the tool or when it fails.
/// Reading the whole `/proc/net/tcp` after every batch of connects took most of these cases' time: their refused
/// connects leave thousands of sockets in TIME_WAIT, which the kernel formats on every read.
fn socket_inodes_ss(port: u16) -> Option<HashSet<String>> {
    let filter = format!("( sport = :{port} or dport = :{port} )");
    let out = std::process::Command::new("ss")
        .args(["-Htane", "exclude", "time-wait", &filter])
        .stderr(std::process::Stdio::null())
        .output()
        .ok()?;
    if !out.status.success() {
        return None;
    }
    // LISTEN 0 128 127.0.0.1:47111 0.0.0.0:* ino:6803887 sk:1 cgroup:/ <->
    Some(
        String::from_utf8_lossy(&out.stdout)
            .split_ascii_whitespace()
            .filter_map(|w| w.strip_prefix("ino:"))
            .map(|inode| format!("socket:[{inode}]"))
            .collect(),
    )
}

/// [`socket_inodes_ss`] from `/proc/net/tcp` and `/proc/net/tcp6`.
fn socket_inodes_proc(port: u16) -> HashSet<String> {
    let mut inodes = HashSet::new();
    for table in ["/proc/net/tcp", "/proc/net/tcp6"] {
        let Ok(text) = std::fs::read_to_string(table) else {
            continue;
        };
        for line in text.lines().skip(1) {
            // sl local_address rem_address st tx_queue:rx_queue tr:tm->when retrnsmt uid timeout inode ...
            let mut cols = line.split_ascii_whitespace().skip(1);
            let (Some(local), Some(remote), Some(state)) = (cols.next(), cols.next(), cols.next())
            else {
                continue;
            };
            // A socket in TIME_WAIT (06) has no descriptor.
            if state == "06" || (port_of(local) != Some(port) && port_of(remote) != Some(port)) {
                continue;
            }
            if let Some(inode) = cols.nth(5) {
                inodes.insert(format!("socket:[{inode}]"));
            }
        }
    }
    inodes
}

/// rdma_cm ids with `port` at either end, from `rdma resource show cm_id` (iproute2); `None` when the tool or an
/// RDMA device is not there. Every id on the port is the test's: the port is its listener's (the tool names the
/// thread that made an id, not its process, so ids are not told apart by process).
fn cm_ids_on(port: u16) -> Option<usize> {
    let out = std::process::Command::new("rdma")
        .args(["resource", "show", "cm_id"])
        .stderr(std::process::Stdio::null())
        .output()
        .ok()?;
    if !out.status.success() {
        return None;
    }
    // link rxe0/1 cm-idn 0 state LISTEN ps TCP pid 144 comm x src-addr 192.168.77.1:7471 dst-addr 0.0.0.0:0
    let text = String::from_utf8_lossy(&out.stdout);
    let suffix = format!(":{port}");
    Some(
        text.lines()
            .filter(|line| {
                let t: Vec<&str> = line.split_whitespace().collect();
                t.windows(2)
                    .any(|w| (w[0] == "src-addr" || w[0] == "dst-addr") && w[1].ends_with(&suffix))
            })
            .count(),
    )
}

fn held(port: u16) -> Held {
    Held {
        sockets: sockets_on(port),
        cm_ids: cm_ids_on(port),
    }
}

/// Waits (a few seconds at most) until what is held on `port` is at most `most`, and returns it.
fn settle(port: u16, most: usize) -> Held {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let h = held(port);
        if h.total() <= most || Instant::now() > deadline {
            return h;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Connects started and not yet ended, by context value.
struct Connects {
    eq: EventQueue,
    live: HashMap<u64, Socket>,
    next: u64,
    ended: usize,
}

impl Connects {
    fn new() -> Self {
        Connects {
            eq: EventQueue::new(1024).unwrap(),
            live: HashMap::new(),
            next: 0,
            ended: 0,
        }
    }

    /// Starts a connect to `addr`; one refused at once counts as ended.
    fn start(&mut self, ctx: &exs::Context, addr: SocketAddr) -> Result<(), String> {
        let s = Socket::new(ctx, SockType::SeqPacket).map_err(|e| e.to_string())?;
        self.next += 1;
        match s.connect(&self.eq, addr, self.next) {
            Ok(()) => {
                self.live.insert(self.next, s);
            }
            Err(_) => {
                self.ended += 1;
                let _ = s.close();
            }
        }
        Ok(())
    }

    /// Waits for the next connect to end; it must end refused (not accepted; not timed out, since a request left
    /// unanswered times out, unless `may_time_out`).
    fn end_one(&mut self, what: &str, may_time_out: bool) -> Result<(), String> {
        let ev = next(&self.eq)?;
        let s = self
            .live
            .remove(&ev.context)
            .ok_or_else(|| format!("{what}: an event of no connect: {ev:?}"))?;
        let _ = s.close();
        self.ended += 1;
        match ev.status {
            Ok(()) => Err(format!("{what}: a connect succeeded")),
            Err(OpError::TimedOut) if !may_time_out => Err(format!(
                "{what}: a connect timed out: its request was neither accepted nor refused"
            )),
            Err(_) => Ok(()),
        }
    }
}

/// Connects to a port whose listener was closed, then to a listener whose backlog is full and which never
/// accepts: every one is refused, and what the process holds on the port stays flat (the listener, the backlog
/// and the connects in flight), then goes to nothing once the listener closes.
fn refused_connects(b: &dyn Backend) -> Result<(), String> {
    let n = refused_count(b);
    let net = b.net();
    let server = net.host();
    let client = net.host();
    let memory = |s: &exs::Context, c: &exs::Context| {
        (s.stats().connection_bytes, c.stats().connection_bytes)
    };
    let mem_before = memory(&server, &client);
    connects_to_a_closed_listener(&*net, &server, &client, n / 2)?;
    let most = connects_to_a_full_backlog(&*net, &server, &client, n / 2)?;
    // The connections that waited in the backlog were closed last: each gives its memory back once its
    // disconnect has gone through, which nothing on the port shows on the simulator (it has no sockets there).
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut mem_after = memory(&server, &client);
    while mem_after != mem_before && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
        mem_after = memory(&server, &client);
    }
    ensure!(
        mem_after == mem_before,
        "device memory held by connections (server, client) went from {mem_before:?} to {mem_after:?}"
    );
    eprintln!(
        "LEAKS {}: {n} refused connects; most held on a port along the way {most:?}; connection memory {mem_after:?} \
         before and after",
        b.name()
    );
    Ok(())
}

/// Connects started at a time, at most, before their ends are taken.
const CONNECT_BATCH: usize = 64;

/// `count` connects from `client` to a port of `server` whose listener was closed: each is refused, and nothing
/// is held on the port afterwards.
fn connects_to_a_closed_listener(
    net: &dyn Net,
    server: &Context,
    client: &Context,
    count: usize,
) -> Result<(), String> {
    let l = Socket::new(server, SockType::SeqPacket).map_err(|e| e.to_string())?;
    l.bind(net.listen_addr(0)).map_err(|e| e.to_string())?;
    let closed = l.listen(16).map_err(|e| format!("listen: {e}"))?;
    l.close().map_err(|e| e.to_string())?;
    let start = settle(closed.port(), 0);
    ensure!(
        start.total() == 0,
        "a closed listener still holds its port: {start:?}"
    );
    let mut c = Connects::new();
    let mut most = start;
    for i in 0..count {
        c.start(client, closed)?;
        if c.live.len() >= CONNECT_BATCH || i + 1 == count {
            while !c.live.is_empty() {
                c.end_one("connect to a closed listener", false)?;
            }
            let h = held(closed.port());
            if h.total() > most.total() {
                most = h;
            }
        }
    }
    let after = settle(closed.port(), 0);
    ensure!(
        after.total() == 0,
        "{count} connects to a closed listener left {after:?} on its port (at most {most:?} along the way)"
    );
    Ok(())
}

/// `count` connects from `client` to a listener of `server` whose backlog is full and which never accepts:
/// `BACKLOG` connections wait in it, established (as TCP's accept queue holds them), the others are refused, and
/// what is held on the port stays bounded, then goes once the listener closes. Returns the most held on the way.
fn connects_to_a_full_backlog(
    net: &dyn Net,
    server: &Context,
    client: &Context,
    count: usize,
) -> Result<Held, String> {
    const BACKLOG: usize = 4;
    let l = Socket::new(server, SockType::SeqPacket).map_err(|e| e.to_string())?;
    l.bind(net.listen_addr(0)).map_err(|e| e.to_string())?;
    let addr = l
        .listen(BACKLOG as u32)
        .map_err(|e| format!("listen: {e}"))?;
    let port = addr.port();
    let listening = settle(port, 1);
    // The listener, and per waiting connect its request and the connecting side: all that may be held.
    let bound = listening.total() + 2 * BACKLOG;
    let mut c = Connects::new();
    let mut waiting = Vec::new();
    for _ in 0..BACKLOG {
        c.start(client, addr)?;
        let ev = next(&c.eq)?;
        let s = c
            .live
            .remove(&ev.context)
            .ok_or_else(|| format!("an event of no connect: {ev:?}"))?;
        ensure!(ev.is_ok(), "a connect within the backlog: {ev:?}");
        waiting.push(s);
    }
    let mut most = listening;
    let mut issued = 0;
    while issued < count {
        let batch = CONNECT_BATCH.min(count - issued);
        for _ in 0..batch {
            c.start(client, addr)?;
        }
        issued += batch;
        while !c.live.is_empty() {
            c.end_one("connect to a listener with a full backlog", false)?;
        }
        let h = settle(port, bound);
        if h.total() > most.total() {
            most = h;
        }
        ensure!(
            h.total() <= bound,
            "after {} refused connects the process holds {h:?} on the listener's port (the listener held \
             {listening:?}; {BACKLOG} connects wait in its backlog)",
            c.ended
        );
    }
    // Closing the listener ends the connections waiting in its backlog (nobody accepted them).
    l.close().map_err(|e| e.to_string())?;
    for s in waiting {
        let _ = s.close();
    }
    let after = settle(port, 0);
    ensure!(
        after.total() == 0,
        "{count} refused connects left {after:?} on the port (at most {most:?} along the way)"
    );
    Ok(most)
}

/// A listener closed while connection requests wait in its transport's event queue, not yet read: they end
/// refused (their peers see a refusal, not a timeout) and nothing of them is kept. Driven through a bare transport
/// as the engine drives it: the requests read are rejected, before the listener closes and after. Where the kernel
/// drops requests caught in flight by the close ([`Backend::closing_listener_drops_requests`], iWARP), their
/// connects may time out instead, loudly: no more of them than requests the test never read.
fn closed_listener_with_requests_waiting(b: &dyn Backend) -> Result<(), String> {
    const N: usize = 48;
    let net = b.net();
    // The bare transport is the first host (its address is `listen_addr(0)`).
    let mut raw = net.raw()?;
    let client = net.host();
    for round in 0..3 {
        let (l, addr) = raw
            .listen(net.listen_addr(0), 1024)
            .map_err(|e| format!("listen: {e}"))?;
        let mut c = Connects::new();
        for _ in 0..N {
            c.start(&client, addr)?;
        }
        // Read half of the requests, rejecting each; more are queued by then.
        let deadline = Instant::now() + WAIT;
        reject_requests(&mut *raw, l, N / 2, deadline)
            .map_err(|e| format!("round {round}: {e}"))?;
        raw.close_listener(l);
        // Every connect ends refused, soon: keep the transport going meanwhile.
        let ends = all_refused(&mut *raw, &mut c, N, deadline)
            .map_err(|e| format!("round {round}: {e}"))?;
        ends.judge(b, round, N / 2, N)?;
        let after = settle(addr.port(), 0);
        ensure!(
            after.total() == 0,
            "round {round}: a listener closed with requests waiting left {after:?} on its port"
        );
    }
    Ok(())
}

/// How the connects of one round of [`closed_listener_with_requests_waiting`] ended, beyond refused.
#[derive(Debug, Default)]
struct Ends {
    /// Requests handed out after the listener closed, and rejected by the test.
    rejected_after: usize,
    /// Connects that timed out: their requests were neither accepted nor refused.
    timed_out: usize,
    /// The first connect that succeeded, if one did.
    accepted: bool,
    /// The longest a connect took to end, from the listener's close.
    slowest: Duration,
}

impl Ends {
    /// Fails unless every connect was refused; where the backend's kernel may drop requests in flight, timeouts
    /// are allowed (said loudly), at most as many as the requests the test never read. (Which connect a request
    /// was is not known here: a connect that never got up has no address of its own to match the request's peer
    /// with, so a rejected request's timeout in place of an unread one would pass.)
    fn judge(
        &self,
        b: &dyn Backend,
        round: usize,
        rejected: usize,
        n: usize,
    ) -> Result<(), String> {
        ensure!(!self.accepted, "round {round}: a connect succeeded");
        if self.timed_out == 0 {
            return Ok(());
        }
        let read = rejected + self.rejected_after;
        let Some(why) = b.closing_listener_drops_requests() else {
            return Err(format!(
                "round {round}: {} connects timed out (the slowest ended {:?} after the close): a request waiting \
                 when its listener closed was neither accepted nor refused",
                self.timed_out, self.slowest
            ));
        };
        let unread = n.saturating_sub(read);
        ensure!(
            self.timed_out <= unread,
            "round {round}: {} connects timed out, but only {unread} requests were never read: a rejected \
             request's connect timed out",
            self.timed_out
        );
        eprintln!(
            "DROPPED {}: round {round}: {} of {unread} unread requests timed out instead of being refused: {why}",
            b.name(),
            self.timed_out
        );
        Ok(())
    }
}

/// Reads `n` connection requests for listener `l` from `raw`, rejecting each.
fn reject_requests(
    raw: &mut dyn exs::Transport,
    l: exs::transport::ListenerId,
    n: usize,
    deadline: Instant,
) -> Result<(), String> {
    let mut read = 0;
    while read < n {
        ensure!(
            Instant::now() < deadline,
            "only {read} connection requests arrived"
        );
        match raw.poll_cm() {
            Some(CmEvent::ConnectRequest {
                listener, request, ..
            }) => {
                ensure!(listener == l, "a request for another listener");
                raw.reject(request);
                read += 1;
            }
            Some(other) => return Err(format!("listener event {other:?}")),
            None => std::thread::sleep(Duration::from_millis(1)),
        }
    }
    Ok(())
}

/// Waits for all `n` connects of `c` to end, rejecting whatever requests `raw` still hands out meanwhile, and
/// says how they ended beyond refused.
fn all_refused(
    raw: &mut dyn exs::Transport,
    c: &mut Connects,
    n: usize,
    deadline: Instant,
) -> Result<Ends, String> {
    let closed = Instant::now();
    let mut ends = Ends::default();
    let mut ended = 0;
    while ended < n {
        while let Some(ev) = raw.poll_cm() {
            // A transport may still hand out a request of the closed listener (the simulator does): the engine
            // rejects those, and so does this test.
            if let CmEvent::ConnectRequest { request, .. } = ev {
                raw.reject(request);
                ends.rejected_after += 1;
            }
        }
        let Ok(ev) = c.eq.next(Some(Duration::from_millis(5))) else {
            ensure!(
                Instant::now() < deadline,
                "{} of {n} connects never ended",
                n - ended
            );
            continue;
        };
        ended += 1;
        ends.slowest = ends.slowest.max(closed.elapsed());
        if let Some(s) = c.live.remove(&ev.context) {
            let _ = s.close();
        }
        match ev.status {
            Ok(()) => ends.accepted = true,
            Err(OpError::TimedOut) => ends.timed_out += 1,
            Err(_) => {}
        }
    }
    Ok(ends)
}

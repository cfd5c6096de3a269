//! The cases. Most of their time is spent waiting for a server's limits (a silent client let go after 5 s, a
//! session's time limit), not computing.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::time::{Duration, Instant};

use crate::common::{exs, free_port, honest, honest_with, Reader, Server};
use proptest::prelude::*;
use serde_json::{json, Value};

/// A control connection driven by hand.
struct Raw {
    r: BufReader<TcpStream>,
    w: TcpStream,
}

impl Raw {
    fn connect(server: &Server) -> Raw {
        let w = TcpStream::connect(("127.0.0.1", server.port)).unwrap();
        w.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        Raw {
            r: BufReader::new(w.try_clone().unwrap()),
            w,
        }
    }

    /// Sends bytes; a server that already hung up is not an error here.
    fn send(&mut self, bytes: &[u8]) {
        let _ = self.w.write_all(bytes);
    }

    fn line(&mut self, v: &Value) {
        self.send(format!("{v}\n").as_bytes());
    }

    /// The server's next message; `None` once it closed the connection.
    fn reply(&mut self) -> Option<Value> {
        let mut l = String::new();
        match self.r.read_line(&mut l) {
            Ok(0) | Err(_) => None,
            Ok(_) => Some(serde_json::from_str(&l).unwrap_or_else(|e| panic!("{l:?}: {e}"))),
        }
    }

    /// Says hello as a `tool` client of this version; returns the answer.
    fn hello(&mut self, tool: &str) -> Value {
        self.say_hello(tool);
        self.reply().expect("an answer to the hello")
    }

    /// Says hello as a `tool` client of this version, and reads nothing.
    fn say_hello(&mut self, tool: &str) {
        self.line(&json!({"msg": "hello", "version": 4, "tool": tool, "backend": "raw test"}));
    }
}

fn message(v: &Value) -> &str {
    assert_eq!(v["msg"], "error", "{v}");
    v["message"].as_str().unwrap()
}

/// An honest client's test goes through within `limit`, tried again every `pause` (the server is let go by
/// whoever held it).
fn served_within(tool: &str, server: &Server, limit: Duration, pause: Duration) {
    let t = Instant::now();
    loop {
        let out = honest(tool, server);
        if out.status.success() {
            return;
        }
        assert!(
            t.elapsed() < limit,
            "the server was still held after {:?}: {}",
            t.elapsed(),
            String::from_utf8_lossy(&out.stderr)
        );
        std::thread::sleep(pause);
    }
}

/// An honest client's test goes through (the server is up and free).
fn served(tool: &str, server: &Server) {
    let out = honest(tool, server);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn a_client_line_longer_than_the_limit_is_refused() {
    let mut server = Server::start("pump", free_port(), &[]);
    served("pump", &server);
    let before = server.status_kb("VmHWM");
    for hello_first in [false, true] {
        let mut raw = Raw::connect(&server);
        if hello_first {
            assert_eq!(raw.hello("pump")["msg"], "welcome");
        }
        // 64 MiB and no newline: the server must stop reading at its bound, not hold the line.
        let mut w = raw.w.try_clone().unwrap();
        let writer = std::thread::spawn(move || {
            let chunk = vec![b'a'; 1 << 20];
            for _ in 0..64 {
                if w.write_all(&chunk).is_err() {
                    break;
                }
            }
        });
        let m = raw.reply().expect("a refusal");
        assert!(message(&m).contains("longer than 64 KiB"), "{m}");
        assert!(m.to_string().len() < 600, "a short excerpt: {m}");
        writer.join().unwrap();
    }
    let after = server.status_kb("VmHWM");
    assert!(
        after < before + 16 * 1024,
        "peak RSS grew from {before} kB to {after} kB"
    );
    assert!(server.alive());
    served("pump", &server);
}

#[test]
fn a_parse_error_logs_a_short_excerpt_of_the_line() {
    let mut server = Server::start("ping", free_port(), &[]);
    let mut raw = Raw::connect(&server);
    let mut junk = b"{\"msg\": \"hello\", ".to_vec();
    junk.extend(std::iter::repeat_n(b'x', 60 << 10));
    junk.push(b'\n');
    raw.send(&junk);
    let m = raw.reply().expect("a refusal");
    assert!(message(&m).contains("not an exs control message"), "{m}");
    let line = server
        .wait_for_log("not an exs control message", Duration::from_secs(10))
        .expect("the server logs the refusal");
    assert!(line.len() < 600, "{} bytes logged: {line}", line.len());
    assert!(server.log().iter().map(String::len).sum::<usize>() < 4096);
    // A hello whose tool name is long: the refusal quotes a little of it.
    let mut raw = Raw::connect(&server);
    let m = raw.hello(&"p".repeat(50_000));
    assert!(message(&m).len() < 300, "{m}");
    assert!(server.alive());
}

#[test]
fn a_client_asking_for_1e30_seconds_is_refused_and_the_server_stays_up() {
    let mut server = Server::start("pump", free_port(), &[]);
    let mut raw = Raw::connect(&server);
    assert_eq!(raw.hello("pump")["msg"], "welcome");
    raw.line(
        &json!({"msg": "point", "params": {"size": 1024, "depth": 8, "mode": "default",
        "type": "seqpacket", "seconds": 1e30, "wait": "adaptive"}}),
    );
    let m = raw.reply().expect("a refusal");
    assert!(message(&m).contains("--seconds 1e30"), "{m}");
    assert!(raw.reply().is_none(), "the session ends");
    assert!(server.alive());
    served("pump", &server);
}

#[test]
fn every_parameter_is_range_checked_against_the_servers_limits() {
    let caps = [
        "--max-seconds",
        "5",
        "--max-bytes",
        "1M",
        "--max-count",
        "100",
        "--max-idle",
        "10",
        "--max-memory",
        "4M",
    ];
    let pump = |f: Value| {
        let mut p = json!({"size": 1024, "depth": 8, "mode": "default", "type": "seqpacket",
            "seconds": 1.0, "wait": "adaptive"});
        p.as_object_mut()
            .unwrap()
            .extend(f.as_object().unwrap().clone());
        p
    };
    let ping = |f: Value| {
        let mut p = json!({"size": 8, "mode": "normal", "wait": "block", "count": 10});
        p.as_object_mut()
            .unwrap()
            .extend(f.as_object().unwrap().clone());
        p
    };
    let demo = |f: Value| {
        let mut p = json!({"transport": "exs", "size": 1024, "chunk": 1024});
        p.as_object_mut()
            .unwrap()
            .extend(f.as_object().unwrap().clone());
        p
    };
    let cases: Vec<(&str, Value, &str)> = vec![
        ("pump", pump(json!({"seconds": 6.0})), "--max-seconds"),
        ("pump", pump(json!({"seconds": 0.0})), "--seconds"),
        ("pump", pump(json!({"seconds": -1.0})), "--seconds"),
        ("pump", pump(json!({"size": 0})), "--size"),
        ("pump", pump(json!({"size": 1u64 << 40})), "--size"),
        ("pump", pump(json!({"depth": 0})), "--depth"),
        ("pump", pump(json!({"depth": 100000})), "--depth"),
        (
            "pump",
            pump(json!({"size": 1 << 20, "depth": 8})),
            "--max-memory",
        ),
        (
            "pump",
            pump(json!({"mode": "immediate", "size": 1 << 20})),
            "immediate",
        ),
        (
            "pump",
            pump(json!({"mode": "persistent", "type": "stream"})),
            "seqpacket",
        ),
        ("pump", pump(json!({"depth": -1})), "cannot use"),
        ("pump", pump(json!({"extra": 1})), "cannot use"),
        ("ping", ping(json!({"count": 0})), "--count"),
        ("ping", ping(json!({"count": 101})), "--max-count"),
        ("ping", ping(json!({"idle": 11})), "--max-idle"),
        ("ping", ping(json!({"idle": 4_000_000_000u32})), "--idle"),
        ("ping", ping(json!({"size": 17u64 << 20})), "--size"),
        ("ping", ping(json!({"size": 8u64 << 20})), "--max-memory"),
        (
            "ping",
            ping(json!({"idle": 10, "size": 32768, "mode": "immediate"})),
            "--idle with --size",
        ),
        ("demo", demo(json!({"size": 1u64 << 63})), "--size"),
        ("demo", demo(json!({"size": 2 << 20})), "--max-bytes"),
        ("demo", demo(json!({"size": 0})), "--size"),
        ("demo", demo(json!({"chunk": 0})), "--chunk"),
        ("demo", demo(json!({"chunk": 1 << 20})), "--max-memory"),
    ];
    for tool in ["pump", "ping", "demo"] {
        let mut server = Server::start(tool, free_port(), &caps);
        for (_, params, want) in cases.iter().filter(|c| c.0 == tool) {
            let mut raw = Raw::connect(&server);
            assert_eq!(raw.hello(tool)["msg"], "welcome");
            raw.line(&json!({"msg": "point", "params": params}));
            let m = raw.reply().expect("an answer");
            assert!(message(&m).contains(want), "{params}: {want:?} not in {m}");
        }
        assert!(server.alive());
        served(tool, &server);
    }
}

/// A client could have the server poll without sleeping for a whole test, a core held; an operator can refuse it.
#[test]
fn a_server_with_no_busy_wait_refuses_busy_polling_and_serves_the_other_waits() {
    for (tool, params) in [
        (
            "ping",
            json!({"size": 8, "mode": "normal", "wait": "busy", "count": 10}),
        ),
        (
            "pump",
            json!({"size": 1024, "depth": 8, "mode": "default", "type": "seqpacket", "seconds": 0.2,
                   "wait": "busy"}),
        ),
    ] {
        let mut server = Server::start(tool, free_port(), &["--no-busy-wait"]);
        let mut raw = Raw::connect(&server);
        assert_eq!(raw.hello(tool)["msg"], "welcome");
        raw.line(&json!({"msg": "point", "params": params}));
        let m = raw.reply().expect("an answer");
        assert!(message(&m).contains("--no-busy-wait"), "{params}: {m}");
        drop(raw);
        assert!(server.alive());
        let out = honest_with(tool, &server, &["--wait", "adaptive"]);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

#[test]
fn a_silent_connection_does_not_keep_an_honest_client_waiting() {
    let server = Server::start("ping", free_port(), &[]);
    let silent: Vec<TcpStream> = (0..3)
        .map(|_| TcpStream::connect(("127.0.0.1", server.port)).unwrap())
        .collect();
    let t = Instant::now();
    served("ping", &server);
    let took = t.elapsed();
    eprintln!("an honest client beside three silent connections: served in {took:?}");
    // Served while the silent ones were still within their few seconds for a hello: the server had not
    // dropped any of them first.
    server
        .wait_for_log("done (1 tests)", Duration::from_secs(10))
        .expect("the server logs the honest client's end");
    let log = server.log();
    let done = log.iter().position(|l| l.contains("done (1 tests)"));
    let dropped = log.iter().position(|l| l.contains("sent nothing"));
    assert!(done.is_some(), "{log:?}");
    assert!(dropped.is_none() || dropped > done, "{log:?}");
    // And then they are let go.
    let line = server
        .wait_for_log("sent nothing for 5 s", Duration::from_secs(30))
        .expect("a silent connection is dropped after its handshake time");
    assert!(line.contains("waiting for a hello"), "{line}");
    drop(silent);
}

#[test]
fn a_second_client_is_told_busy_at_once() {
    let server = Server::start("ping", free_port(), &[]);
    let mut holder = Raw::connect(&server);
    assert_eq!(holder.hello("ping")["msg"], "welcome");
    let out = honest("ping", &server);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(err.contains("busy"), "{err}");
    // The holder still has the server (it was not dropped to make room), and once it goes, the next is served.
    holder.w.shutdown(Shutdown::Write).unwrap();
    assert!(holder.reply().is_none());
    served_within(
        "ping",
        &server,
        Duration::from_secs(10),
        Duration::from_millis(100),
    );
}

#[test]
fn a_test_ends_at_the_servers_time_limit() {
    let mut server = Server::start(
        "ping",
        free_port(),
        &[
            "--max-seconds",
            "1",
            "--max-grace",
            "1",
            "--max-count",
            "10000000",
        ],
    );
    let target = server.target();
    // A persistent ping reads the server's memory until the client has done its count: far more than the 2 s
    // the server allows.
    let t = Instant::now();
    let out = exs(&[
        "ping",
        "-c",
        &target,
        "--mode",
        "persistent",
        "--size",
        "8",
        "--count",
        "10000000",
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains("--max-seconds") && err.contains("--max-grace"),
        "the client hears why: {err}"
    );
    eprintln!("stopped after {:?}", t.elapsed());
    assert!(server.alive());
    served("ping", &server);
}

/// One demo test over TCP, driven by hand on a welcomed connection: 1 byte sent, its 8-byte checksum read. The
/// data connection is returned open.
fn demo_tcp_test(c: &mut Raw) -> TcpStream {
    let l = listening(c, json!({"transport": "tcp", "size": 1, "chunk": 1}));
    tcp_client_test(&l)
}

/// Asks for a test with `params`; returns the server's `listening` message (the test's address and token).
fn listening(c: &mut Raw, params: Value) -> Value {
    c.line(&json!({"msg": "point", "params": params}));
    let l = c.reply().expect("the test's address");
    assert_eq!(l["msg"], "listening", "{l}");
    l
}

/// The token of a test's `listening` message, which the client's data connection sends first.
fn token(listening: &Value) -> u64 {
    listening["token"].as_u64().expect("a token")
}

/// Anyone may connect to a test's listener, and first: the server served the first connection, so a stranger
/// that connected before the client took its test (and held it until the test's time was up). A connection
/// whose first eight bytes are not the test's token is now closed, and the client's served.
#[test]
fn a_stranger_connecting_first_to_a_tests_tcp_listener_is_not_served() {
    let mut server = Server::start("demo", free_port(), &[]);
    let mut c = Raw::connect(&server);
    assert_eq!(c.hello("demo")["msg"], "welcome");
    let l = listening(&mut c, json!({"transport": "tcp", "size": 1, "chunk": 1}));
    let addr = l["addr"].as_str().unwrap();
    let mut stranger = TcpStream::connect(addr).unwrap();
    stranger
        .set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    stranger
        .write_all(&token(&l).wrapping_add(1).to_le_bytes())
        .unwrap();
    stranger.write_all(&[7]).unwrap();
    let mut client = TcpStream::connect(addr).unwrap();
    client
        .set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    client.write_all(&token(&l).to_le_bytes()).unwrap();
    client.write_all(&[7]).unwrap();
    client
        .read_exact(&mut [0u8; 8])
        .expect("the client's checksum");
    assert!(
        matches!(stranger.read(&mut [0u8; 8]), Ok(0) | Err(_)),
        "the stranger is closed, unanswered"
    );
    drop(client);
    let done = c.reply().expect("the server's word on the test");
    assert_eq!(done["msg"], "done", "{done}");
    assert!(server.alive());
}

/// A review found it: the TCP demo read its connections' tokens one after the other, each for up to five seconds,
/// so silent strangers queued ahead of the client held it back by five seconds each (twelve outlasted its write
/// timeout). They are now read side by side, and the listener closes once the client's connection is in.
#[test]
fn silent_strangers_queued_ahead_on_a_tcp_demo_listener_do_not_delay_the_client() {
    let (mut server, mut c, l) = tcp_demo(&[], 1);
    let addr = l["addr"].as_str().unwrap();
    let strangers: Vec<TcpStream> = (0..8).map(|_| TcpStream::connect(addr).unwrap()).collect();
    // The server has accepted them before the client connects.
    std::thread::sleep(Duration::from_millis(200));
    let started = Instant::now();
    let client = tcp_client_test(&l);
    assert!(
        started.elapsed() < Duration::from_secs(20),
        "the client was served after {:?} (eight strangers at five seconds each: 40 s)",
        started.elapsed()
    );
    drop(client);
    let done = c.reply().expect("the server's word on the test");
    assert_eq!(done["msg"], "done", "{done}");
    assert!(
        TcpStream::connect(addr).is_err(),
        "the test's listener is closed once the client is in"
    );
    drop(strangers);
    assert!(server.alive());
}

/// A review found it: a client that wrote a byte on its control connection during a test and then closed it was
/// taken for present (a peek saw the byte), and held the server until the test's limit. Its close is seen at once.
#[test]
fn a_client_that_sends_a_byte_mid_test_then_closes_frees_the_server_at_once() {
    let (mut server, mut c, _l) = tcp_demo(&[], 1);
    c.send(b"x");
    drop(c);
    served_within(
        "demo",
        &server,
        Duration::from_secs(20),
        Duration::from_millis(200),
    );
    assert!(server.alive());
}

/// A review found it: every connection closed on a test's TCP listener was logged, so a stranger connecting and
/// closing in a loop filled the server's log. The first few are logged, the rest counted in one line.
#[test]
fn strangers_on_a_tcp_demo_listener_are_logged_a_bounded_number_of_times() {
    let (mut server, mut c, l) = tcp_demo(&[], 1);
    let addr = l["addr"].as_str().unwrap();
    for _ in 0..40 {
        let mut s = TcpStream::connect(addr).unwrap();
        s.write_all(&token(&l).wrapping_add(1).to_le_bytes())
            .unwrap();
        let _ = s.read(&mut [0u8; 1]);
    }
    drop(tcp_client_test(&l));
    assert_eq!(c.reply().expect("the test's end")["msg"], "done");
    let line = server
        .wait_for_log(
            "more connections to the test's TCP listener closed",
            Duration::from_secs(10),
        )
        .expect("the rest are counted in one line");
    assert!(line.contains("32 more"), "{line}");
    let each = server
        .log()
        .iter()
        .filter(|l| l.contains("a connection to a test's TCP listener closed"))
        .count();
    assert_eq!(each, 8, "the first eight are logged one by one");
    assert!(server.alive());
}

/// An `exs ping` test on a fresh server (8-byte immediate pings, one of them), and a context of this process's
/// own on libfabric tcp: the server, the control connection, the test's `listening` message, the context, a queue
/// for it, and a connection made on it to the test's listener (`context`: its connect's).
struct ExsPingTest {
    server: Server,
    c: Raw,
    l: Value,
    ctx: exs::Context,
    eq: exs::EventQueue,
}

impl ExsPingTest {
    fn start() -> ExsPingTest {
        Self::start_with(&[])
    }

    /// With the server's limits `caps`.
    fn start_with(caps: &[&str]) -> ExsPingTest {
        Self::start_asking(caps, json!({}))
    }

    /// With the server's limits `caps`, asking for the test's parameters with `more` (`idle`, say).
    fn start_asking(caps: &[&str], more: Value) -> ExsPingTest {
        Self::start_on(Server::start("ping", free_port(), caps), more)
    }

    /// On `server` (an `exs ping` server), asking for the test's parameters with `more`.
    fn start_on(server: Server, more: Value) -> ExsPingTest {
        use exs::{fabric::FabricConfig, Backend, Context, EventQueue};
        let mut c = Raw::connect(&server);
        assert_eq!(c.hello("ping")["msg"], "welcome");
        let mut params = json!({"size": 8, "mode": "immediate", "wait": "block", "count": 1});
        params
            .as_object_mut()
            .unwrap()
            .extend(more.as_object().unwrap().clone());
        let l = listening(&mut c, params);
        let ctx = Context::open(&Backend::Fabric(FabricConfig::default())).unwrap();
        let eq = EventQueue::new(16).unwrap();
        ExsPingTest {
            server,
            c,
            l,
            ctx,
            eq,
        }
    }

    fn connect(&self, context: u64) -> exs::Socket {
        let (s, ev) = self.try_connect(context);
        assert!(ev.is_ok(), "{ev:?}");
        s
    }

    /// `n` connections to the test's listener made at once (contexts from `first` on), and their connects' events.
    fn connect_many(&self, n: u64, first: u64) -> Vec<(exs::Socket, exs::Event)> {
        let addr: std::net::SocketAddr = self.l["addr"].as_str().unwrap().parse().unwrap();
        let eq = exs::EventQueue::new(n as usize).unwrap();
        let socks: Vec<exs::Socket> = (0..n)
            .map(|i| {
                let s = exs::Socket::new(&self.ctx, exs::SockType::SeqPacket).unwrap();
                s.connect(&eq, addr, first + i).unwrap();
                s
            })
            .collect();
        let mut evs: Vec<Option<exs::Event>> = (0..n).map(|_| None).collect();
        for _ in 0..n {
            let ev = eq.next(Some(Duration::from_secs(30))).unwrap();
            let i = (ev.context - first) as usize;
            evs[i] = Some(ev);
        }
        socks
            .into_iter()
            .zip(evs.into_iter().map(Option::unwrap))
            .collect()
    }

    /// A connection to the test's listener, and its connect's event.
    fn try_connect(&self, context: u64) -> (exs::Socket, exs::Event) {
        let addr: std::net::SocketAddr = self.l["addr"].as_str().unwrap().parse().unwrap();
        let s = exs::Socket::new(&self.ctx, exs::SockType::SeqPacket).unwrap();
        s.connect(&self.eq, addr, context).unwrap();
        let ev = self.eq.next(Some(Duration::from_secs(30))).unwrap();
        (s, ev)
    }

    /// Sends the test's token on `s` (the client's own connection), and waits for the send to end.
    fn tell_token(&self, s: &exs::Socket) {
        self.tell(s, token(&self.l));
    }

    /// Sends the idle connections' token on `s` (the test's, with bits 0x1D1E flipped: the client's idle
    /// connections' own, so that they cannot be taken for the client's ping connection).
    fn tell_idle_token(&self, s: &exs::Socket) {
        self.tell(s, token(&self.l) ^ 0x1D1E);
    }

    /// Sends `token` on `s`, and waits for the send to end.
    fn tell(&self, s: &exs::Socket, token: u64) {
        let token = exs::MemoryRegion::from_vec(&self.ctx, token.to_le_bytes().to_vec()).unwrap();
        s.send(&self.eq, &token.all(), exs::MsgFlags::NONE, 7)
            .unwrap();
        let ev = self.eq.next(Some(Duration::from_secs(30))).unwrap();
        assert!(ev.context == 7 && ev.is_ok(), "{ev:?}");
    }

    /// Sends the token and one ping on `client`, and checks the echo.
    fn ping(&self, client: &exs::Socket) {
        self.tell_token(client);
        self.echo(client);
    }

    /// Sends one ping on `client` (its token sent), and checks the echo.
    fn echo(&self, client: &exs::Socket) {
        use exs::{MemoryRegion, MsgFlags};
        let ping = MemoryRegion::from_vec(&self.ctx, vec![9u8; 8]).unwrap();
        let echo = MemoryRegion::alloc(&self.ctx, 8).unwrap();
        client
            .recv(&self.eq, &echo.all(), MsgFlags::NONE, 3)
            .unwrap();
        client
            .send(&self.eq, &ping.all(), MsgFlags::NONE, 5)
            .unwrap();
        let mut echoed = false;
        while !echoed {
            let ev = self
                .eq
                .next(Some(Duration::from_secs(30)))
                .expect("the echo");
            assert!(ev.is_ok(), "{ev:?}");
            echoed = ev.context == 3;
        }
        assert_eq!(echo.to_vec().unwrap(), vec![9u8; 8]);
    }

    /// Checks that `stranger`'s connection was closed: a receive on it ends.
    fn closed(&self, stranger: &exs::Socket) {
        use exs::{MemoryRegion, MsgFlags};
        let nothing = MemoryRegion::alloc(&self.ctx, 8).unwrap();
        stranger
            .recv(&self.eq, &nothing.all(), MsgFlags::NONE, 6)
            .unwrap();
        loop {
            let ev = self
                .eq
                .next(Some(Duration::from_secs(30)))
                .expect("the stranger's end");
            if ev.context == 6 {
                assert!(ev.flags.eof || !ev.is_ok(), "{ev:?}");
                return;
            }
        }
    }

    /// The server's word on the test, once the client's connection is gone: done, and the server alive.
    fn done(mut self) {
        let done = self.c.reply().expect("the server's word on the test");
        assert_eq!(done["msg"], "done", "{done}");
        assert!(self.server.alive());
    }
}

/// The same on a test's exs listener (`exs ping`'s): a stranger that connects first and sends nothing is closed
/// within seconds, and the client's connection, which sends the token, gets its echo.
#[test]
fn a_stranger_connecting_first_to_a_tests_exs_listener_is_not_served() {
    let t = ExsPingTest::start();
    let stranger = t.connect(1);
    let client = t.connect(2);
    t.ping(&client);
    t.closed(&stranger);
    drop(client);
    drop(stranger);
    t.done();
}

/// A review found it: the server read the tokens of the connections to a test's exs listener one after the other,
/// five seconds each, so a stranger holding a few silent connections queued ahead of the client's made it wait
/// for all of them (eight: forty seconds, with the client's connection up and its token sent). The tokens are now
/// read side by side: the client is served at once, and the strangers are closed once their time is up.
#[test]
fn silent_strangers_queued_ahead_on_a_tests_exs_listener_do_not_delay_the_client() {
    let t = ExsPingTest::start();
    let strangers: Vec<exs::Socket> = (0..8).map(|i| t.connect(10 + i)).collect();
    let started = Instant::now();
    let client = t.connect(2);
    t.ping(&client);
    assert!(
        started.elapsed() < Duration::from_secs(20),
        "the client was served after {:?} (eight strangers at five seconds each: 40 s)",
        started.elapsed()
    );
    for s in &strangers {
        t.closed(s);
    }
    drop(client);
    drop(strangers);
    t.done();
}

/// A review found it: the idle connections of `exs ping --idle` were accepted without a token, so a stranger's
/// connections to the test's listener were taken (and held for the test's time) in place of the client's. They
/// now send the token too: strangers are closed once their time for it is up, while the client's idle connections
/// stay, and the ping goes on.
#[test]
fn strangers_among_a_pings_idle_connections_are_not_taken_for_them() {
    let t = ExsPingTest::start_asking(&[], json!({"idle": 4}));
    let client = t.connect(2);
    t.tell_token(&client);
    let strangers: Vec<exs::Socket> = (0..3).map(|i| t.connect(10 + i)).collect();
    let idle: Vec<exs::Socket> = (0..4).map(|i| t.connect(20 + i)).collect();
    for s in &idle {
        t.tell_idle_token(s);
    }
    t.echo(&client);
    for s in &strangers {
        t.closed(s);
    }
    for s in &idle {
        assert_eq!(
            s.error().unwrap(),
            None,
            "an idle connection of the client's failed"
        );
    }
    drop((client, strangers, idle));
    t.done();
}

/// A review found it: while the server waited for a ping's idle connections, every further connection that sent
/// the client's own token was kept until the test ended (five minutes by default), however many came: one
/// connection each, past `--max-idle`, bounded only by the memory budget and the process's descriptors. Those
/// beyond the test's count are closed at once, and the ping goes on.
#[test]
fn connections_beyond_the_tests_count_are_closed_not_kept_for_the_test() {
    let t = ExsPingTest::start_asking(&[], json!({"idle": 1}));
    let client = t.connect(2);
    t.tell_token(&client);
    let extra: Vec<exs::Socket> = (0..3).map(|i| t.connect(10 + i)).collect();
    for s in &extra {
        t.tell_token(s);
    }
    for s in &extra {
        t.closed(s);
    }
    let idle = t.connect(20);
    t.tell_idle_token(&idle);
    t.echo(&client);
    assert_eq!(
        idle.error().unwrap(),
        None,
        "the client's idle connection failed"
    );
    drop((client, extra, idle));
    t.done();
}

/// A review found it: the server a client starts for itself on this host (`exs ping` without `--client`) took the
/// first hello, whoever sent it, with the widest limits, and the client that started it was told it was busy.
/// Started with a token in its environment, it welcomes only a hello that carries it.
#[test]
fn a_server_started_with_a_token_welcomes_only_the_hello_that_carries_it() {
    let server = Server::start_with(
        "ping",
        free_port(),
        &["--once"],
        crate::common::Reader::Keeps,
        &[("EXS_CLIENT_TOKEN", "81985529216486895")],
    );
    let hello = |token: Option<u64>| {
        let mut c = Raw::connect(&server);
        let mut h = json!({"msg": "hello", "version": 4, "tool": "ping", "backend": "raw test"});
        if let Some(t) = token {
            h["token"] = json!(t);
        }
        c.line(&h);
        (c.reply(), c)
    };
    for stranger in [None, Some(81985529216486894)] {
        let (answer, _c) = hello(stranger);
        let answer = answer.expect("an answer");
        assert_eq!(answer["msg"], "error", "{answer}");
        assert!(message(&answer).contains("not the client"), "{answer}");
    }
    let (answer, _c) = hello(Some(81985529216486895));
    assert_eq!(answer.expect("a welcome")["msg"], "welcome");
}

/// A server whose log reader went away (its standard error a closed pipe) logs each stranger it closes, and
/// goes on: the connection with a wrong token is closed, and the client's served.
#[test]
fn a_stranger_logged_by_a_server_whose_log_reader_went_away_does_not_stop_it() {
    let t = ExsPingTest::start_on(
        Server::start_logging("ping", free_port(), &[], false),
        json!({}),
    );
    let stranger = t.connect(1);
    t.tell(&stranger, token(&t.l).wrapping_add(1));
    t.closed(&stranger);
    let client = t.connect(2);
    t.ping(&client);
    drop((client, stranger));
    t.done();
}

/// A review found it: with every slot for a token taken by silent strangers, two connections could be accepted
/// for the last free one, and the server's session panicked. More strangers than slots only make the client wait
/// for theirs to run out.
///
/// With idle connections asked for too: the listener's backlog was then the idle connections' number and one
/// (review finding: with `--idle 1`, two strangers' connections queued beside those whose tokens were being read
/// filled it, and the client's own was refused); it is never less than the default.
#[test]
fn more_silent_strangers_than_token_slots_only_delay_the_client() {
    let t = ExsPingTest::start_asking(&[], json!({"idle": 1}));
    let strangers: Vec<exs::Socket> = t
        .connect_many(70, 100)
        .into_iter()
        .map(|(s, ev)| {
            assert!(ev.is_ok(), "{ev:?}");
            s
        })
        .collect();
    let client = t.connect(2);
    t.tell_token(&client);
    let idle = t.connect(3);
    t.tell_idle_token(&idle);
    t.echo(&client);
    drop((client, idle, strangers));
    t.done();
}

/// A review found it: the client opens its idle connections once its own connection's token is sent, so an idle
/// one can be admitted before the server has read the own one's token; it was then closed as one too many, or
/// (the same token on both) taken for the ping connection while the client pinged on the other. Each role has its
/// token, and what comes early is kept for its role.
#[test]
fn idle_connections_admitted_before_the_clients_own_are_kept_and_not_taken_for_it() {
    let t = ExsPingTest::start_asking(&[], json!({"idle": 2}));
    let client = t.connect(2);
    let idle: Vec<exs::Socket> = (0..2).map(|i| t.connect(20 + i)).collect();
    for s in &idle {
        t.tell_idle_token(s);
    }
    // Let the server admit them first.
    std::thread::sleep(Duration::from_millis(300));
    t.tell_token(&client);
    t.echo(&client);
    for s in &idle {
        assert_eq!(
            s.error().unwrap(),
            None,
            "an idle connection of the client's failed"
        );
    }
    drop((client, idle));
    t.done();
}

/// A review found it: a server's context had a 64 GiB memory budget (so that `exs ping --idle` could hold
/// thousands of connections), so anyone connecting to a test's listener made it register each connection's control
/// buffers, bounded by nothing of the server's own. Its context's budget is now its `--max-memory`: connections
/// beyond it are refused, and the client's, once the strangers' are closed, is served.
#[test]
fn connections_to_a_tests_exs_listener_are_bounded_by_the_servers_max_memory() {
    let t = ExsPingTest::start_with(&["--max-memory", "64K"]);
    // At once, so that they are all held while the next come (each for its five seconds to send a token).
    let tried = t.connect_many(24, 10);
    let refused = tried.iter().filter(|(_, ev)| !ev.is_ok()).count();
    assert!(
        refused > 0 && refused < tried.len(),
        "{refused} of {} connections refused",
        tried.len()
    );
    for (_, ev) in tried.iter().filter(|(_, ev)| !ev.is_ok()) {
        assert_eq!(ev.status, Err(exs::OpError::Refused), "{ev:?}");
    }
    // The strangers' connections are closed once their time for a token is up; the client's fits then.
    for (s, _) in tried.iter().filter(|(_, ev)| ev.is_ok()) {
        t.closed(s);
    }
    drop(tried);
    let until = Instant::now() + Duration::from_secs(30);
    let client = loop {
        let (s, ev) = t.try_connect(2);
        if ev.is_ok() {
            break s;
        }
        assert!(
            Instant::now() < until,
            "the client was never let in: {ev:?}"
        );
        std::thread::sleep(Duration::from_millis(200));
    };
    t.ping(&client);
    drop(client);
    t.done();
}

/// A demo client that read its TCP test's checksum and kept the data connection open held the server for 60 s,
/// whatever its `--max-seconds` (the wait for the close looked at neither the limit nor the client).
#[test]
fn a_demo_client_that_keeps_its_tcp_connection_open_is_let_go_at_the_limit() {
    let server = Server::start(
        "demo",
        free_port(),
        &["--max-seconds", "2", "--max-grace", "1"],
    );
    let mut c = Raw::connect(&server);
    assert_eq!(c.hello("demo")["msg"], "welcome");
    let data = demo_tcp_test(&mut c);
    let t = Instant::now();
    let done = c.reply().expect("the server's word on the test");
    let took = t.elapsed();
    assert_eq!(done["msg"], "done", "{done}");
    assert!(
        took < Duration::from_secs(10),
        "the server waited {took:?} for the close"
    );
    drop(data);
}

/// A client that keeps sending short tests held the server for ever, every other client told "busy".
#[test]
fn a_session_ends_at_the_servers_session_limit() {
    // Long enough for the first test to start within it on a loaded machine.
    let server = Server::start("demo", free_port(), &["--max-session", "3"]);
    let mut c = Raw::connect(&server);
    assert_eq!(c.hello("demo")["msg"], "welcome");
    drop(demo_tcp_test(&mut c));
    assert_eq!(c.reply().expect("done")["msg"], "done");
    std::thread::sleep(Duration::from_millis(3500));
    c.line(&json!({"msg": "point", "params": {"transport": "tcp", "size": 1, "chunk": 1}}));
    let m = c.reply().expect("the session's end");
    assert!(message(&m).contains("--max-session"), "{m}");
    assert!(c.reply().is_none(), "the server let the client go");
    served("demo", &server);
}

/// A TCP connection from `ip` to `port` on 127.0.0.1 (any of 127.0.0.0/8 reaches it).
fn tcp_from(ip: &str, port: u16) -> nix::Result<TcpStream> {
    use nix::sys::socket::{bind, connect, socket, AddressFamily, SockFlag, SockType, SockaddrIn};
    use std::os::fd::{AsRawFd, FromRawFd, IntoRawFd};
    let fd = socket(
        AddressFamily::Inet,
        SockType::Stream,
        SockFlag::empty(),
        None,
    )?;
    let from: std::net::SocketAddrV4 = format!("{ip}:0").parse().unwrap();
    bind(fd.as_raw_fd(), &SockaddrIn::from(from))?;
    let to: std::net::SocketAddrV4 = format!("127.0.0.1:{port}").parse().unwrap();
    connect(fd.as_raw_fd(), &SockaddrIn::from(to))?;
    // SAFETY: `fd` is a connected TCP socket this function owns; its ownership moves to the stream.
    Ok(unsafe { TcpStream::from_raw_fd(fd.into_raw_fd()) })
}

/// A control connection from `ip`.
fn connect_from(ip: &str, server: &Server) -> Raw {
    let w = tcp_from(ip, server.port).unwrap();
    w.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    Raw {
        r: BufReader::new(w.try_clone().unwrap()),
        w,
    }
}

/// Silent connections from one host took every place the server has, and every other host was refused.
#[test]
fn silent_connections_from_one_host_leave_room_for_the_others() {
    let server = Server::start("ping", free_port(), &[]);
    // Counted in the order they come, by the one thread that accepts: the ninth after the eight.
    let silent: Vec<Raw> = (0..8).map(|_| connect_from("127.0.0.3", &server)).collect();
    let mut ninth = connect_from("127.0.0.3", &server);
    let m = ninth.reply().expect("a refusal");
    assert!(message(&m).contains("from your host"), "{m}");
    let mut other = connect_from("127.0.0.2", &server);
    assert_eq!(other.hello("ping")["msg"], "welcome");
    drop(silent);
}

/// Review: silent connections from four hosts, each within its own count, took every place the server has, and
/// every other client was refused for as long as they kept coming back. Now a newcomer lets the oldest connection
/// that has not said hello go.
#[test]
fn silent_connections_from_a_few_hosts_do_not_keep_a_client_out() {
    let server = Server::start("ping", free_port(), &[]);
    let silent: Vec<Raw> = (11..15)
        .flat_map(|h| (0..8).map(move |_| h))
        .map(|h| connect_from(&format!("127.0.0.{h}"), &server))
        .collect();
    assert_eq!(silent.len(), 32);
    let mut other = connect_from("127.0.0.2", &server);
    assert_eq!(other.hello("ping")["msg"], "welcome");
    drop(silent);
}

/// Review: a server whose standard error went away (a log read through a pipe whose reader exited) stopped at
/// its next log line: `eprintln!` panics on a broken pipe, and refusals are logged by the thread that accepts.
/// Now log lines that cannot be written are dropped, and the server goes on serving.
#[test]
fn a_server_whose_log_reader_went_away_keeps_serving() {
    let mut server = Server::start_logging("ping", free_port(), &[], false);
    // The ninth connection from one host is refused and logged on the accepting thread.
    let silent: Vec<Raw> = (0..8).map(|_| connect_from("127.0.0.5", &server)).collect();
    let mut ninth = connect_from("127.0.0.5", &server);
    let m = ninth.reply().expect("a refusal");
    assert!(message(&m).contains("from your host"), "{m}");
    drop(silent);
    std::thread::sleep(Duration::from_millis(300));
    assert!(
        server.alive(),
        "the server stopped at a log line it could not write"
    );
    served("ping", &server);
}

/// Review: a hello sent while another client's tests ran waited a second (in case that session was ending) before
/// it was told "busy", and all that time its connection was still listed as silent. A newcomer finding every place
/// taken let such a connection go, unanswered, and took a place its thread still held: a burst of hellos pushed
/// the server past its connections. Now a connection is off that list once its hello is in.
#[test]
fn hellos_waiting_on_a_busy_server_are_told_busy_and_not_let_go_for_newcomers() {
    // The hellos must all be in before the first is answered (a second after it came): on a machine too slow for
    // that the scenario is tried again, at most three times.
    for _ in 0..3 {
        let server = Server::start_with(
            "ping",
            free_port(),
            &[],
            Reader::Keeps,
            &[("EXS_LOG", "debug")],
        );
        let mut holder = connect_from("127.0.0.2", &server);
        assert_eq!(holder.hello("ping")["msg"], "welcome");
        // The other 31 places, each saying hello (hosts within their counts of 8).
        let mut waiting: Vec<Raw> = (0..31)
            .map(|i| connect_from(&format!("127.0.0.{}", 21 + i / 8), &server))
            .collect();
        let said = Instant::now();
        for w in &mut waiting {
            w.say_hello("ping");
        }
        let heard = |log: Vec<String>| log.iter().filter(|l| l.contains("hello received")).count();
        while heard(server.log()) < 32 && said.elapsed() < Duration::from_secs(10) {
            std::thread::sleep(Duration::from_millis(10));
        }
        if said.elapsed() > Duration::from_millis(600) {
            continue; // the first could be answered, and gone, before the newcomer comes
        }
        let mut newcomer = connect_from("127.0.0.30", &server);
        let m = newcomer.reply().expect("a refusal");
        assert!(message(&m).contains("too many connections at once"), "{m}");
        for (i, w) in waiting.iter_mut().enumerate() {
            let m = w
                .reply()
                .unwrap_or_else(|| panic!("hello {i} was let go unanswered"));
            assert!(message(&m).contains("busy"), "{m}");
        }
        return;
    }
    panic!("three times, the server took more than 600 ms to read 31 hellos");
}

/// Review: the server wrote its log on the threads that accept and serve. With its standard error a pipe that
/// nobody read, the pipe filled and the next line stopped that thread for good: a session, or the accepting
/// itself. Now lines go through a queue to a thread of their own, and lines that find it full are counted.
#[test]
fn a_server_whose_log_nobody_reads_keeps_serving() {
    use std::os::fd::AsRawFd;
    let mut server = Server::start_with(
        "ping",
        free_port(),
        &[],
        Reader::Stalls,
        &[("EXS_LOG", "debug")],
    );
    let log = server
        .take_stalled_log()
        .expect("the held end of the server's log");
    let pipe = log.get_ref().as_raw_fd();
    // The smallest pipe the kernel makes (a page, or what it holds already), so that a few clients' lines fill it.
    let room = 4096.max(bytes_in_pipe(pipe));
    let size = nix::fcntl::fcntl(pipe, nix::fcntl::FcntlArg::F_SETPIPE_SZ(room)).unwrap();
    let mut unread = 0;
    let mut full = false;
    for i in 0..40 {
        let out = honest("ping", &server);
        assert!(
            out.status.success(),
            "client {i}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        unread = bytes_in_pipe(pipe);
        if full {
            break; // one client served with the pipe full before it
        }
        // Full: a line longer than the room left waits.
        full = unread as usize + 512 > size as usize;
    }
    assert!(
        full,
        "forty clients' log lines did not fill a {size}-byte pipe ({unread} bytes in it)"
    );
    // A client with a hundred idle connections: thousands of lines, far more than the queue holds.
    let target = server.target();
    let out = exs(&[
        "ping", "-c", &target, "--size", "8", "--count", "20", "--mode", "normal", "--idle", "100",
        "--json",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // Read from now on, the log says how many lines it dropped, once one goes out after them.
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in log.lines().map_while(Result::ok) {
            if line.contains("log lines dropped") && tx.send(line).is_err() {
                return;
            }
        }
    });
    let start = Instant::now();
    let dropped = loop {
        served("ping", &server);
        match rx.recv_timeout(Duration::from_secs(2)) {
            Ok(line) => break line,
            Err(_) if start.elapsed() < Duration::from_secs(60) => {}
            Err(_) => panic!("no line counting the dropped ones"),
        }
    };
    assert!(dropped.starts_with("exs: "), "{dropped}");
}

/// Review: a `--json` server wrote each test's report to standard output on the session's thread. With its
/// standard output a pipe that nobody read, the pipe filled and the next report held that session, and its client,
/// for good. Now reports go through a queue to a thread of their own; those that find it full are counted in the
/// log (standard output carries JSON only).
#[test]
fn a_json_server_whose_reports_nobody_reads_keeps_serving() {
    use std::os::fd::AsRawFd;
    let server = Server::start_reporting_unread("ping", free_port(), &[]);
    let pipe = server
        .unread_output()
        .expect("the held end of the server's standard output")
        .as_raw_fd();
    // The smallest pipe the kernel makes, so that a few reports fill it.
    let room = 4096.max(bytes_in_pipe(pipe));
    let size = nix::fcntl::fcntl(pipe, nix::fcntl::FcntlArg::F_SETPIPE_SZ(room)).unwrap();
    // Clients until the log counts reports dropped: past the pipe, the report being written and the queue's
    // sixteen. Every one is served.
    let mut dropped = None;
    for _ in 0..100 {
        served("ping", &server);
        dropped = server
            .log()
            .into_iter()
            .find(|l| l.contains("report lines dropped"));
        if dropped.is_some() {
            break;
        }
    }
    // The count goes out through the log's own thread: the last client may be the one that made it.
    let dropped = dropped
        .or_else(|| server.wait_for_log("report lines dropped", Duration::from_secs(5)))
        .unwrap_or_else(|| {
            panic!(
                "after a hundred clients, no log line counting reports dropped ({} bytes in the {size}-byte pipe)",
                bytes_in_pipe(pipe)
            )
        });
    assert!(dropped.contains("exs: "), "{dropped}");
}

/// Review: the baselines' helper servers (`exs tcpping --serve`, started by `exs tcpping` for its own run) took
/// the first connection to their listener, whoever made it: a stranger that connected first took the client's place
/// and held the helper. Now the client sends the token the helper was started with (`EXS_HELPER_TOKEN`) first, and
/// strangers (silent, or with other bytes) are refused beside it.
#[test]
fn a_tcp_baseline_helper_takes_its_client_not_the_first_stranger() {
    let token: u64 = 0x0123_4567_89ab_cdef;
    let mut helper = std::process::Command::new(crate::common::EXE)
        .args(["tcpping", "--serve", "--size", "8"])
        .env("EXS_HELPER_TOKEN", token.to_string())
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = BufReader::new(helper.stdout.take().unwrap());
    let mut line = String::new();
    out.read_line(&mut line).unwrap();
    let addr = line
        .trim()
        .strip_prefix("LISTEN ")
        .unwrap_or_else(|| panic!("the helper's first line: {line:?}"))
        .to_string();
    let silent = TcpStream::connect(&addr).unwrap();
    let mut wrong = TcpStream::connect(&addr).unwrap();
    wrong.write_all(&(token ^ 1).to_le_bytes()).unwrap();
    let mut client = TcpStream::connect(&addr).unwrap();
    client
        .set_read_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    client.write_all(&token.to_le_bytes()).unwrap();
    client.write_all(b"8 bytes!").unwrap();
    let mut echo = [0u8; 8];
    let read = client.read_exact(&mut echo);
    let _ = helper.kill();
    let _ = helper.wait();
    read.expect("the echo of the client's message, behind two strangers");
    assert_eq!(&echo, b"8 bytes!");
    drop(silent);
}

/// Bytes waiting in a pipe (FIONREAD).
fn bytes_in_pipe(pipe: std::os::fd::RawFd) -> i32 {
    nix::ioctl_read_bad!(fionread, nix::libc::FIONREAD, nix::libc::c_int);
    let mut n: nix::libc::c_int = 0;
    // SAFETY: FIONREAD on a pipe descriptor this process holds (the server's log) writes one int, to `n`.
    unsafe { fionread(pipe, &mut n) }.unwrap();
    n
}

/// Review: the server logged every connection refused or gone before its hello, so a stranger connecting in a loop
/// filled the log. Now at most a burst of such lines goes out, then one a second, and the next says how many were
/// left out.
#[test]
fn strangers_connecting_in_a_loop_are_logged_a_bounded_number_of_times() {
    let server = Server::start("ping", free_port(), &[]);
    for i in 0..200 {
        drop(tcp_from(&format!("127.0.0.{}", 40 + i % 50), server.port).unwrap());
    }
    // Each connection's line comes once its thread sees it gone.
    std::thread::sleep(Duration::from_millis(500));
    let noted = |log: &[String]| log.iter().filter(|l| l.contains(": client ")).count();
    let logged = noted(&server.log());
    assert!(
        (1..=20).contains(&logged),
        "{logged} lines about 200 strangers"
    );
    // With no stranger after them, the count of those left out comes on a line of its own, a second after the
    // first was left out (before, it waited for the next stranger's line, and with none never came).
    let l = server
        .wait_for_log("not logged", Duration::from_secs(10))
        .expect("a line counting the strangers left out");
    assert!(
        l.contains("about connections refused, gone before their hello"),
        "{l}"
    );
    let t = Instant::now();
    while strangers_accounted(&server.log()) < 200 && t.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(
        strangers_accounted(&server.log()),
        200,
        "every stranger is logged or counted: {:#?}",
        server.log()
    );
    // A second later the log takes another stranger's line.
    std::thread::sleep(Duration::from_millis(1100));
    drop(tcp_from("127.0.0.99", server.port).unwrap());
    server
        .wait_for_log("127.0.0.99", Duration::from_secs(10))
        .expect("a line about the next stranger");
    served("ping", &server);
}

/// Strangers a server's log accounts for: a line about each one logged, plus the counts of those left out (in
/// `(and N lines ... not logged)` after a stranger's line, or on a line of their own).
fn strangers_accounted(log: &[String]) -> usize {
    let first_number = |t: &str| {
        t.split_whitespace()
            .find_map(|w| w.parse::<usize>().ok())
            .unwrap_or(0)
    };
    log.iter()
        .map(|l| {
            // Before the honest client, every client line is about a stranger (whatever it says: one let go for
            // a newcomer may be gone before its thread asks its address).
            let one = l.contains(": client ");
            let left_out = match (l.contains("not logged"), l.find("(and ")) {
                (false, _) => 0,
                (true, Some(i)) => first_number(&l[i + 5..]),
                (true, None) => first_number(l),
            };
            usize::from(one) + left_out
        })
        .sum()
}

/// Lines a careless or hostile client might send: noise, near-JSON, messages of every kind with fields of every
/// type, and long ones.
fn line() -> impl Strategy<Value = Vec<u8>> {
    let field = prop_oneof![
        any::<i64>().prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        any::<f64>()
            .prop_filter("JSON numbers are finite", |f| f.is_finite())
            .prop_map(Value::from),
        "[ -~]{0,20}".prop_map(Value::from),
        Just(json!(null)),
        Just(json!([[[[[[1]]]]]])),
        Just(json!({"a": {"b": [1, 2, {"c": "d"}]}})),
        prop::sample::select(vec![
            "default",
            "immediate",
            "persistent",
            "stream",
            "busy",
            "exs",
            "tcp"
        ])
        .prop_map(Value::from),
    ];
    let keys = prop::sample::select(vec![
        "size",
        "depth",
        "mode",
        "type",
        "seconds",
        "wait",
        "no_coalesce",
        "count",
        "transport",
        "chunk",
        "version",
        "tool",
        "backend",
        "params",
        "msg",
        "other",
    ]);
    let object = prop::collection::btree_map(keys, field, 0..8)
        .prop_map(|m| Value::Object(m.into_iter().map(|(k, v)| (k.to_string(), v)).collect()));
    let kinds = prop::sample::select(vec![
        "hello",
        "point",
        "welcome",
        "done",
        "error",
        "listening",
        "",
        "HELLO",
    ]);
    let message = (kinds, object.clone(), object).prop_map(|(k, o, params)| {
        let mut o = o.as_object().unwrap().clone();
        o.insert("msg".into(), k.into());
        if k == "point" {
            o.insert("params".into(), params);
        }
        format!("{}\n", Value::Object(o)).into_bytes()
    });
    prop_oneof![
        4 => message,
        2 => prop::collection::vec(any::<u8>(), 0..300),
        1 => (1usize..200_000).prop_map(|n| vec![b'['; n]),
        1 => (1usize..200_000).prop_map(|n| vec![b'z'; n]),
    ]
}

/// One server for every case, owned by the test (not a static, which is never dropped: its process outlived the
/// test run), and ended with it.
#[test]
fn the_server_answers_or_refuses_any_line_and_stays_up() {
    use proptest::test_runner::{Config, TestRunner};
    let server = std::cell::RefCell::new(Server::start("pump", free_port(), &[]));
    let mut runner = TestRunner::new(Config {
        cases: 200,
        ..Config::default()
    });
    let cases = (any::<bool>(), prop::collection::vec(line(), 1..4));
    let outcome = runner.run(&cases, |(hello, lines)| {
        let mut server = server.borrow_mut();
        let mut raw = Raw::connect(&server);
        if hello {
            let m = raw.hello("pump");
            prop_assert!(
                m["msg"] == "welcome" || message(&m).contains("busy"),
                "{}",
                m
            );
        }
        for l in &lines {
            raw.send(l);
        }
        let _ = raw.w.shutdown(Shutdown::Write);
        // Every answer is a control message; a test that starts is abandoned at once (the server sees the
        // client go).
        while let Some(m) = raw.reply() {
            let kind = m["msg"].as_str().unwrap_or_default().to_string();
            prop_assert!(
                ["error", "welcome", "listening"].contains(&kind.as_str()),
                "{}",
                m
            );
            if kind == "listening" {
                break;
            }
            if kind == "error" {
                prop_assert!(m.to_string().len() < 1000, "{}", m);
            }
        }
        prop_assert!(server.alive(), "the server exited");
        prop_assert!(!server.log().iter().any(|l| l.contains("panicked")));
        Ok(())
    });
    if let Err(e) = outcome {
        panic!("{e}");
    }
}

#[test]
fn after_arbitrary_lines_an_honest_client_is_served() {
    // The property test above shares one server; this one checks the same on a fresh one after a burst of
    // junk from many connections at once: 40, from 8 hosts (5 each, under the per-host cap), past the server's
    // 32 at once.
    let mut server = Server::start("pump", free_port(), &[]);
    let junk: Vec<std::thread::JoinHandle<()>> = (0..40)
        .map(|i| {
            let port = server.port;
            std::thread::spawn(move || {
                if let Ok(mut s) = tcp_from(&format!("127.0.0.{}", 10 + i % 8), port) {
                    let _ = s.write_all(&vec![b'{'; 1000 * i]);
                    let _ = s.shutdown(Shutdown::Write);
                    let _ = std::io::copy(&mut s, &mut std::io::sink());
                }
            })
        })
        .collect();
    for j in junk {
        j.join().unwrap();
    }
    assert!(server.alive());
    served_within(
        "pump",
        &server,
        Duration::from_secs(20),
        Duration::from_millis(200),
    );
}

/// A demo server whose tests may last two seconds (`--max-seconds 1`, `--max-grace 1`), a welcomed client, and
/// its TCP test of `size` bytes in one chunk: (server, client, the test's `listening` message).
fn tcp_demo_within_two_seconds(size: u64) -> (Server, Raw, Value) {
    tcp_demo(&["--max-seconds", "1", "--max-grace", "1"], size)
}

/// A demo server started with `args`, a welcomed control connection, and its `listening` message for a TCP test
/// of `size` bytes in one chunk.
fn tcp_demo(args: &[&str], size: u64) -> (Server, Raw, Value) {
    let server = Server::start("demo", free_port(), args);
    let mut c = Raw::connect(&server);
    assert_eq!(c.hello("demo")["msg"], "welcome");
    let l = listening(
        &mut c,
        json!({"transport": "tcp", "size": size, "chunk": size}),
    );
    (server, c, l)
}

/// The client's side of a one-byte TCP demo test to `l`'s listener: its token, the byte, the checksum read back.
/// The data connection is returned open.
fn tcp_client_test(l: &Value) -> TcpStream {
    let mut data = TcpStream::connect(l["addr"].as_str().unwrap()).unwrap();
    data.set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    data.write_all(&token(l).to_le_bytes()).unwrap();
    data.write_all(&[7]).unwrap();
    data.read_exact(&mut [0u8; 8])
        .expect("the client's checksum");
    data
}

/// A review found it: a TCP demo client that sent a byte a second (each read of the server's then returned,
/// never timing out) held the server for as long as its chunk took, whatever the server's `--max-seconds`.
#[test]
fn a_tcp_demo_client_that_trickles_its_data_is_stopped_at_the_tests_limit() {
    let (mut server, mut c, l) = tcp_demo_within_two_seconds(1 << 20);
    let mut data = TcpStream::connect(l["addr"].as_str().unwrap()).unwrap();
    data.write_all(&token(&l).to_le_bytes()).unwrap();
    let t = Instant::now();
    let trickle = std::thread::spawn(move || {
        while t.elapsed() < Duration::from_secs(30) && data.write_all(&[7]).is_ok() {
            std::thread::sleep(Duration::from_millis(300));
        }
    });
    let done = c.reply().expect("the server's word on the test");
    assert_eq!(done["msg"], "error", "{done}");
    assert!(
        t.elapsed() < Duration::from_secs(20),
        "the test ended after {:?}",
        t.elapsed()
    );
    drop(c);
    let _ = trickle.join();
    assert!(server.alive());
}

/// A review found it: connections queued on a TCP demo test's listener that never send the token were taken one
/// after the other (each given its few seconds for the token), and the loop looked at the test's limit only when
/// none was queued: a stranger that kept one queued held the server past every limit.
#[test]
fn tokenless_connections_queued_on_a_tcp_demo_listener_end_at_the_tests_limit() {
    let (mut server, mut c, l) = tcp_demo_within_two_seconds(1);
    let addr = l["addr"].as_str().unwrap().to_string();
    let t = Instant::now();
    // Twenty strangers, queued at once, each silent.
    let strangers: Vec<TcpStream> = (0..20)
        .map(|_| TcpStream::connect(&addr).unwrap())
        .collect();
    let done = c.reply().expect("the server's word on the test");
    assert_eq!(done["msg"], "error", "{done}");
    assert!(
        t.elapsed() < Duration::from_secs(20),
        "the test ended after {:?} (twenty strangers at five seconds each: 100 s)",
        t.elapsed()
    );
    drop(strangers);
    assert!(server.alive());
}

//! Issue 29: each connection's protocol work runs inside a tracing span naming the connection, its peer and its
//! backend. This binary installs a global subscriber, so it holds this one test only.
#![cfg(feature = "sim")]

use std::io::{Read, Write};
use std::sync::{Arc, Mutex};

use exs::sim::{SimConfig, World};
use exs::{Listener, Stream};

#[derive(Clone, Default)]
struct Log(Arc<Mutex<Vec<u8>>>);

impl Write for Log {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[test]
fn a_connection_logs_inside_its_span_with_id_peer_and_backend() {
    let log = Log::default();
    let writer = log.clone();
    tracing_subscriber::fmt()
        .with_env_filter("exs=debug")
        .with_ansi(false)
        .with_writer(move || writer.clone())
        .init();
    let world = World::threaded(SimConfig::default());
    let (server, client) = (world.host(), world.host());
    let listener = Listener::bind_in(&server, world.addr(0, 9300)).unwrap();
    let addr = listener.local_addr().unwrap();
    let echo = std::thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        let mut buf = [0u8; 5];
        s.read_exact(&mut buf).unwrap();
        s.write_all(&buf).unwrap();
    });
    let mut c = Stream::connect_in(&client, addr).unwrap();
    c.write_all(b"hello").unwrap();
    let mut back = [0u8; 5];
    c.read_exact(&mut back).unwrap();
    echo.join().unwrap();
    let text = String::from_utf8_lossy(&log.0.lock().unwrap()).into_owned();
    let up: Vec<&str> = text
        .lines()
        .filter(|l| l.contains("connection up"))
        .collect();
    assert_eq!(up.len(), 2, "both ends log their connection once:\n{text}");
    let client_span = format!("peer=Some({addr}) backend=sim");
    assert!(
        up.iter()
            .any(|l| l.contains("exs_conn{id=") && l.contains(&client_span)),
        "the connecting side's span names its peer and backend:\n{text}"
    );
}

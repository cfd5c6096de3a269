//! Helpers for the conformance tests: connected pairs, test bytes, checks that return errors instead of
//! printing megabytes.

use std::time::Duration;

use exs::{Context, Event, EventKind, EventQueue, MemoryRegion, SockType, Socket, SocketOptions};

use crate::Net;

/// How long any single wait may take before the test fails (no test hangs).
pub const WAIT: Duration = Duration::from_secs(60);

/// Returns `Err(format!(..))` from the test when the condition fails.
#[macro_export]
macro_rules! ensure {
    ($cond:expr, $($fmt:tt)+) => {
        if !$cond {
            return Err(format!($($fmt)+));
        }
    };
}

pub use exs::testing::pattern;

/// Compares byte strings, naming the first difference.
/// [`same`] on the whole contents of two registered regions.
pub fn same_regions(got: &MemoryRegion, want: &MemoryRegion, what: &str) -> Result<(), String> {
    same(
        &got.to_vec().map_err(|e| e.to_string())?,
        &want.to_vec().map_err(|e| e.to_string())?,
        what,
    )
}

pub fn same(got: &[u8], want: &[u8], what: &str) -> Result<(), String> {
    if got.len() != want.len() {
        return Err(format!(
            "{what}: {} bytes, expected {}",
            got.len(),
            want.len()
        ));
    }
    match got.iter().zip(want).position(|(a, b)| a != b) {
        None => Ok(()),
        Some(i) => Err(format!(
            "{what}: first difference at byte {i} of {}",
            got.len()
        )),
    }
}

/// Waits for one event.
pub fn next(eq: &EventQueue) -> Result<Event, String> {
    eq.next(Some(WAIT))
        .map_err(|e| format!("waiting for an event: {e}"))
}

/// Waits for every outstanding operation of a queue.
pub fn all(eq: &EventQueue) -> Result<Vec<Event>, String> {
    eq.wait_all(Some(WAIT))
        .map_err(|e| format!("waiting for all events: {e}"))
}

/// A connected pair: `client` on context `a`, `server` (accepted) on context `b`.
#[derive(Debug)]
pub struct Pair {
    pub a: Context,
    pub b: Context,
    pub client: Socket,
    pub server: Socket,
    pub listener: Socket,
    pub eq_a: EventQueue,
    pub eq_b: EventQueue,
}

pub fn pair(net: &dyn Net, ty: SockType, opts: SocketOptions) -> Result<Pair, String> {
    let b = net.host();
    let a = net.host();
    let eq_a = EventQueue::new(4096).unwrap();
    let eq_b = EventQueue::new(4096).unwrap();
    let listener = Socket::new(&b, ty).map_err(|e| e.to_string())?;
    listener.set_options(opts).map_err(|e| e.to_string())?;
    listener
        .bind(net.listen_addr(0))
        .map_err(|e| e.to_string())?;
    let addr = listener.listen(16).map_err(|e| format!("listen: {e}"))?;
    listener.accept(&eq_b, 1).map_err(|e| e.to_string())?;
    let client = Socket::new(&a, ty).map_err(|e| e.to_string())?;
    client.set_options(opts).map_err(|e| e.to_string())?;
    client
        .connect(&eq_a, addr, 2)
        .map_err(|e| format!("connect: {e}"))?;
    let c = next(&eq_a)?;
    ensure!(
        c.kind == EventKind::Connect && c.is_ok(),
        "connect event: {c:?}"
    );
    let mut s = next(&eq_b)?;
    ensure!(
        s.kind == EventKind::Accept && s.is_ok(),
        "accept event: {s:?}"
    );
    let server = s.take_accepted().ok_or("accept event without a socket")?;
    Ok(Pair {
        a,
        b,
        client,
        server,
        listener,
        eq_a,
        eq_b,
    })
}

impl Pair {
    pub fn region_a(&self, bytes: Vec<u8>) -> Result<MemoryRegion, String> {
        MemoryRegion::from_vec(&self.a, bytes).map_err(|e| e.to_string())
    }
    pub fn region_b(&self, len: usize) -> Result<MemoryRegion, String> {
        MemoryRegion::alloc(&self.b, len.max(1)).map_err(|e| e.to_string())
    }
}

//! Helpers for the conformance tests: connected pairs, test bytes, checks that return errors instead of
//! printing megabytes.

use std::time::Duration;

use exs::{Event, EventKind, EventQueue, MemoryRegion, MsgFlags, SockType, SocketOptions};

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

/// An error as the cases report it (`.map_err(e)`).
pub fn e<E: std::fmt::Display>(x: E) -> String {
    x.to_string()
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

/// A connected pair: `client` on context `a`, `server` (accepted) on context `b` (exs's own fixture).
pub use exs::testing::Pair;

/// Connects a pair on two fresh hosts of `net`, both ends with `opts`.
pub fn pair(net: &dyn Net, ty: SockType, opts: SocketOptions) -> Result<Pair, String> {
    let b = net.host();
    let a = net.host();
    let spec = exs::testing::PairSpec {
        depth: 4096,
        patience: WAIT,
        ..exs::testing::PairSpec::new(ty).options(opts)
    };
    spec.connect(&a, &b, net.listen_addr(0))
}

/// Reads `total` bytes on the pair's server side, with receives of up to `chunk` bytes; returns them.
pub fn read_stream(
    p: &Pair,
    total: usize,
    chunk: usize,
    flags: MsgFlags,
) -> Result<Vec<u8>, String> {
    let buf = p.region_b(chunk)?;
    let mut got = Vec::with_capacity(total);
    while got.len() < total {
        let want = chunk.min(total - got.len());
        p.server
            .recv(&p.eq_b, &buf.slice(0..want), flags, 0)
            .map_err(e)?;
        let ev = next(&p.eq_b)?;
        ensure!(
            ev.kind == EventKind::Recv && ev.is_ok() && ev.bytes >= 1,
            "stream receive: {ev:?}"
        );
        if flags.contains(MsgFlags::WAITALL) {
            ensure!(
                ev.bytes == want,
                "MSG_WAITALL returned {} of {want}",
                ev.bytes
            );
        }
        let mut b = vec![0u8; ev.bytes];
        buf.read(0, &mut b).map_err(e)?;
        got.extend_from_slice(&b);
    }
    Ok(got)
}

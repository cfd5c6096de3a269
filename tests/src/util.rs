//! Helpers for the conformance tests: connected pairs, test bytes, checks that return errors instead of
//! printing megabytes.

use std::time::Duration;

use exs::{Event, EventQueue, MemoryRegion, SockType, SocketOptions};

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

//! How much a context logs about what peers do to it: refused connection requests, protocol violations, failed
//! connections. Each is a warning, but a stranger can cause them as fast as it can connect: a few are logged at
//! once, then one a second, and those held back are counted on the next line logged (a server's log must not grow
//! with what a hostile client sends it). The engine's counters ([`EngineStats`](super::EngineStats)) count every
//! one of them.

use std::time::{Duration, Instant};

/// Lines logged at once before the pace applies.
const BURST: u32 = 10;
/// One more line may be logged per this much time.
const PACE: Duration = Duration::from_secs(1);

/// Logs a warning about a peer through the engine's [`PeerLog`], with `held_back`: how many were held back since
/// the last one logged.
macro_rules! peer_warn {
    ($log:expr, $($arg:tt)+) => {
        if let Some(held_back) = $log.admit(std::time::Instant::now()) {
            tracing::warn!(held_back, $($arg)+);
        }
    };
}
pub(super) use peer_warn;

#[derive(Debug)]
pub(super) struct PeerLog {
    tokens: u32,
    refilled: Instant,
    held: u64,
}

impl PeerLog {
    pub(super) fn new(now: Instant) -> PeerLog {
        PeerLog {
            tokens: BURST,
            refilled: now,
            held: 0,
        }
    }

    /// Whether a line may be logged at `now`: `Some(n)` with the `n` lines held back since the last one logged,
    /// or `None` (held back, counted).
    pub(super) fn admit(&mut self, now: Instant) -> Option<u64> {
        let paces = now.saturating_duration_since(self.refilled).as_nanos() / PACE.as_nanos();
        if paces >= u128::from(BURST) {
            self.tokens = BURST;
            self.refilled = now;
        } else if paces > 0 {
            let paces = paces as u32; // below BURST
            self.tokens = (self.tokens + paces).min(BURST);
            self.refilled += PACE * paces;
        }
        if self.tokens == 0 {
            self.held += 1;
            return None;
        }
        self.tokens -= 1;
        Some(std::mem::take(&mut self.held))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A tool's server logged every refused connection request and violation at warn level: a stranger sending
    /// bad handshakes in a loop grew the server's log without bound (review finding). A burst, then one a
    /// second, the rest counted.
    #[test]
    fn warnings_about_peers_come_in_a_burst_then_one_a_second_with_a_count_of_those_held_back() {
        let t0 = Instant::now();
        let mut log = PeerLog::new(t0);
        let logged = (0..1000).filter(|_| log.admit(t0).is_some()).count();
        assert_eq!(logged, BURST as usize);
        assert_eq!(log.admit(t0 + PACE / 2), None);
        assert_eq!(log.admit(t0 + PACE), Some(1000 - u64::from(BURST) + 1));
        assert_eq!(log.admit(t0 + PACE), None);
        // After a long quiet time, a whole burst again, not more.
        let later = t0 + PACE * 1000;
        let logged = (0..100).filter(|_| log.admit(later).is_some()).count();
        assert_eq!(logged, BURST as usize);
    }
}

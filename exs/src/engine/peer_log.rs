//! How much a context logs about what peers do to it: refused connection requests and protocol violations (one
//! pace), failed connections (another, so that a stranger's bad requests do not hide them). Each is a warning,
//! but a stranger can cause them as fast as it can connect: a few are logged at once, then one a second, and those
//! held back are counted on the next line logged, or on a line of their own at the first progress round once the
//! pace allows one (an idle context with no round to run tells it at its next activity) (a server's
//! log must not grow with what a hostile client sends it). The engine's counters
//! ([`EngineStats`](super::EngineStats)) count the violations and refused requests one by one.

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
        if !self.take_token(now) {
            self.held += 1;
            return None;
        }
        Some(std::mem::take(&mut self.held))
    }

    /// Refills the tokens the time since the last refill earned, then takes one if there is one.
    fn take_token(&mut self, now: Instant) -> bool {
        let paces = now.saturating_duration_since(self.refilled).as_nanos() / PACE.as_nanos();
        if paces >= u128::from(BURST) {
            self.tokens = BURST;
            self.refilled = now;
        } else if paces > 0 {
            let paces = paces as u32; // below BURST
            self.tokens = (self.tokens + paces).min(BURST);
            self.refilled += PACE * paces;
        }
        let took = self.tokens > 0;
        self.tokens -= u32::from(took);
        took
    }

    /// Whether lines were held back since the last one logged (cheap: the engine asks every round).
    pub(super) fn holds(&self) -> bool {
        self.held > 0
    }

    /// The count of lines held back, once the pace allows a line for it (`None` before, or with none held).
    pub(super) fn overdue(&mut self, now: Instant) -> Option<u64> {
        // A line of its own, taken from the pace like any other.
        if self.held == 0 || !self.take_token(now) {
            return None;
        }
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

    /// A review found it: the count of lines held back went out only with the next line logged, so the end of a
    /// flood was never told. It goes on a line of its own once the pace allows one.
    #[test]
    fn the_count_held_back_at_the_end_of_a_flood_is_told_once_the_pace_allows() {
        let t0 = Instant::now();
        let mut log = PeerLog::new(t0);
        let held = (0..25).filter(|_| log.admit(t0).is_none()).count() as u64;
        assert!(log.holds());
        assert_eq!(log.overdue(t0), None, "not before the pace allows a line");
        assert_eq!(log.overdue(t0 + PACE), Some(held));
        assert!(!log.holds());
        assert_eq!(log.overdue(t0 + PACE * 5), None, "told once");
    }
}

//! The engine's timers: at most one deadline per socket and kind, kept in order, so that neither a progress round
//! nor an API call looks at any timer but the earliest (what one operation costs must not grow with the
//! connections a context holds, most of them idle with a keepalive timer each).
//!
//! The protocol's own timings (a delayed acknowledgment, a held window update, a stream sender's hold for an
//! advertisement, the keepalive probe) are the connection's: it says when it next needs attention
//! ([`crate::proto::conn::Conn::poll_timeout`], as quinn-proto's `Connection::poll_timeout`), and the engine keeps
//! its two parts here: [`TimerKind::Proto`] for what the messages set and clear (a delayed acknowledgment),
//! [`TimerKind::Keepalive`] for the keepalive check, which the messages leave where it is (one deadline for both
//! moved the ordered set twice per message). The others belong to the connection's life around the protocol:
//! connecting, lingering after a close, a listener's waiting requests.

use std::collections::BTreeSet;
use std::time::Instant;

use rustc_hash::FxHashMap;

use crate::ids::SocketId;

/// What a timer is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) enum TimerKind {
    /// A close waits for its sends at most this long.
    Linger,
    /// A connect or an accept must finish by then.
    ConnectTimeout,
    /// The connection's protocol needs attention soon ([`crate::proto::conn::Conn::handle_timeout`]: a delayed
    /// acknowledgment or window update, a stream sender's hold).
    Proto,
    /// The connection's keepalive check is due (also [`crate::proto::conn::Conn::handle_timeout`]).
    Keepalive,
}

/// Deadlines in order, at most one per socket and kind.
#[derive(Debug, Default)]
pub(crate) struct Timers {
    order: BTreeSet<(Instant, SocketId, TimerKind)>,
    by_key: FxHashMap<(SocketId, TimerKind), Instant>,
}

impl Timers {
    /// Sets (or moves) the timer of `sid` and `kind` to `at`; `None` cancels it.
    pub(crate) fn set(&mut self, sid: SocketId, kind: TimerKind, at: Option<Instant>) {
        let old = match at {
            Some(at) => self.by_key.insert((sid, kind), at),
            None => self.by_key.remove(&(sid, kind)),
        };
        if old == at {
            return;
        }
        if let Some(old) = old {
            self.order.remove(&(old, sid, kind));
        }
        if let Some(at) = at {
            self.order.insert((at, sid, kind));
        }
    }

    /// Sets the timer of `sid` and `kind` to `at`, unless it is set to go earlier already.
    pub(crate) fn set_earliest(&mut self, sid: SocketId, kind: TimerKind, at: Instant) {
        if self.get(sid, kind).is_none_or(|old| at < old) {
            self.set(sid, kind, Some(at));
        }
    }

    /// The timer of `sid` and `kind`, if set.
    pub(crate) fn get(&self, sid: SocketId, kind: TimerKind) -> Option<Instant> {
        self.by_key.get(&(sid, kind)).copied()
    }

    /// Cancels every timer of a socket that is going away.
    pub(crate) fn forget(&mut self, sid: SocketId) {
        for kind in [
            TimerKind::Linger,
            TimerKind::ConnectTimeout,
            TimerKind::Proto,
            TimerKind::Keepalive,
        ] {
            self.set(sid, kind, None);
        }
    }

    /// The earliest deadline.
    pub(crate) fn next(&self) -> Option<Instant> {
        self.order.first().map(|t| t.0)
    }

    /// Takes out the earliest timer if it is due at `now`.
    pub(crate) fn pop_due(&mut self, now: Instant) -> Option<(SocketId, TimerKind)> {
        let &(at, sid, kind) = self.order.first()?;
        if at > now {
            return None;
        }
        self.order.pop_first();
        self.by_key.remove(&(sid, kind));
        Some((sid, kind))
    }

    /// Timers set.
    pub(crate) fn len(&self) -> usize {
        self.by_key.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn timers_fire_in_order_once_each_and_a_moved_timer_fires_at_its_new_time() {
        let t0 = Instant::now();
        let ms = |n| t0 + Duration::from_millis(n);
        let (a, b, c) = (SocketId(1), SocketId(2), SocketId(3));
        let mut t = Timers::default();
        t.set(a, TimerKind::Proto, Some(ms(30)));
        t.set(b, TimerKind::Proto, Some(ms(10)));
        t.set(c, TimerKind::Linger, Some(ms(20)));
        // Moved later: the old deadline is gone.
        t.set(b, TimerKind::Proto, Some(ms(40)));
        assert_eq!(t.len(), 3);
        assert_eq!(t.next(), Some(ms(20)));
        assert_eq!(t.pop_due(ms(15)), None);
        assert_eq!(t.pop_due(ms(35)), Some((c, TimerKind::Linger)));
        assert_eq!(t.pop_due(ms(35)), Some((a, TimerKind::Proto)));
        assert_eq!(t.pop_due(ms(35)), None);
        assert_eq!(t.get(b, TimerKind::Proto), Some(ms(40)));
        t.forget(b);
        assert_eq!((t.next(), t.len()), (None, 0));
    }

    #[test]
    fn a_socket_has_one_timer_of_each_kind() {
        let t0 = Instant::now();
        let s = SocketId(7);
        let mut t = Timers::default();
        for i in 0..100 {
            t.set(s, TimerKind::Proto, Some(t0 + Duration::from_millis(i)));
        }
        t.set(s, TimerKind::ConnectTimeout, Some(t0));
        assert_eq!(t.len(), 2);
        t.set(s, TimerKind::Proto, None);
        assert_eq!(t.len(), 1);
        assert_eq!(t.pop_due(t0), Some((s, TimerKind::ConnectTimeout)));
        assert_eq!(t.len(), 0);
    }
}

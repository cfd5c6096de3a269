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
//!
//! A connection's near timer is moved earlier at once and left where it is otherwise ([`Armed`]): a delayed
//! acknowledgment is set by one message and cleared by the next, and moving the ordered set for both cost a busy
//! round trip more than anything else the engine does with time. A timer left behind fires early and does nothing
//! (the connection checks its own deadlines, and its flush arms the next one); before a thread sleeps, stale
//! timers at the front are put right (`Engine::settle_timers`), so none of them wakes it.

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

/// What one connection's [`TimerKind::Proto`] and [`TimerKind::Keepalive`] timers are set to, kept with the
/// socket so that a flush which changes neither looks nothing up.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Armed {
    near: Option<Instant>,
    keepalive: Option<Instant>,
    /// The connection's near deadline at the last arming (what the timer serves, perhaps from earlier).
    wanted: Option<Instant>,
}

/// Deadlines in order, at most one per socket and kind.
#[derive(Debug, Default)]
pub(crate) struct Timers {
    order: BTreeSet<(Instant, SocketId, TimerKind)>,
    by_key: FxHashMap<(SocketId, TimerKind), Instant>,
    /// The earliest deadline set since [`Timers::take_armed`] last looked.
    armed: Option<Instant>,
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
            self.armed = Some(self.armed.map_or(at, |a| a.min(at)));
        }
    }

    /// The earliest deadline set since the last look: a sleeping thread must wake for it if it comes before the
    /// thread's own wake-up time (the earliest timer cannot tell: it may be a stale one, [`Timers::arm`]).
    pub(crate) fn take_armed(&mut self) -> Option<Instant> {
        self.armed.take()
    }

    /// Whether a deadline was set since [`Timers::take_armed`] last looked.
    pub(crate) fn armed(&self) -> bool {
        self.armed.is_some()
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

    /// Arms a connection's timers for its deadlines (`near`: [`TimerKind::Proto`], and the keepalive check). The
    /// near one moves when it must come earlier; a later or cleared near deadline leaves it where it is, to fire
    /// early and do nothing (or to be put right before anyone sleeps on it: [`Timers::set_near`]), and a later one
    /// is reported by [`Timers::take_armed`] at the time of the timer that serves it. The keepalive follows its
    /// deadline both ways (it moves only when it comes due).
    pub(crate) fn arm(
        &mut self,
        sid: SocketId,
        armed: &mut Armed,
        near: Option<Instant>,
        keepalive: Option<Instant>,
    ) {
        let new = near != armed.wanted;
        armed.wanted = near;
        match (near, armed.near) {
            (Some(at), old) if old.is_none_or(|old| at < old) => {
                self.set(sid, TimerKind::Proto, Some(at));
                armed.near = Some(at);
            }
            // A new deadline left behind: the earlier timer serves it (it fires, finds nothing due and the flush
            // arms the real one), so a sleeper must wake for it as for one set now.
            (Some(_), Some(old)) if new => {
                self.armed = Some(self.armed.map_or(old, |a| a.min(old)))
            }
            _ => {}
        }
        if keepalive != armed.keepalive {
            self.set(sid, TimerKind::Keepalive, keepalive);
            armed.keepalive = keepalive;
        }
    }

    /// A connection's timer of `kind` fired (it is no longer set).
    pub(crate) fn fired(armed: &mut Armed, kind: TimerKind) {
        match kind {
            TimerKind::Proto => armed.near = None,
            TimerKind::Keepalive => armed.keepalive = None,
            TimerKind::Linger | TimerKind::ConnectTimeout => {}
        }
    }

    /// Sets a connection's [`TimerKind::Proto`] timer to exactly `near` (how [`Engine::settle_timers`] puts a
    /// stale one right).
    ///
    /// [`Engine::settle_timers`]: crate::engine::Engine::settle_timers
    pub(crate) fn set_near(&mut self, sid: SocketId, armed: &mut Armed, near: Option<Instant>) {
        self.set(sid, TimerKind::Proto, near);
        armed.near = near;
        armed.wanted = near;
    }

    /// The earliest deadline (perhaps a connection's stale one: `Engine::settle_timers`).
    pub(crate) fn next(&self) -> Option<Instant> {
        self.order.first().map(|t| t.0)
    }

    /// The earliest timer.
    pub(crate) fn first(&self) -> Option<(Instant, SocketId, TimerKind)> {
        self.order.first().copied()
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

    /// Milliseconds from now as instants, empty timers, and a connection's record of its own.
    fn connection() -> (impl Fn(u64) -> Instant, Timers, Armed) {
        let t0 = Instant::now();
        (
            move |n| t0 + Duration::from_millis(n),
            Timers::default(),
            Armed::default(),
        )
    }

    #[test]
    fn a_connection_timer_moves_earlier_at_once_and_is_left_behind_otherwise() {
        let (ms, mut t, mut armed) = connection();
        let s = SocketId(3);
        t.arm(s, &mut armed, Some(ms(20)), Some(ms(1000)));
        assert_eq!(t.take_armed(), Some(ms(20)));
        assert_eq!(t.take_armed(), None, "reported once");
        // Cleared, then later: the timer stays where it was (it will fire early and find nothing to do).
        t.arm(s, &mut armed, None, Some(ms(1000)));
        t.arm(s, &mut armed, Some(ms(50)), Some(ms(1000)));
        assert_eq!(t.get(s, TimerKind::Proto), Some(ms(20)));
        t.take_armed();
        // Earlier: moved at once.
        t.arm(s, &mut armed, Some(ms(10)), Some(ms(1000)));
        assert_eq!(t.get(s, TimerKind::Proto), Some(ms(10)));
        assert_eq!(t.take_armed(), Some(ms(10)));
        // Once fired, the next deadline is armed whatever it is.
        assert_eq!(t.pop_due(ms(10)), Some((s, TimerKind::Proto)));
        Timers::fired(&mut armed, TimerKind::Proto);
        t.arm(s, &mut armed, Some(ms(60)), Some(ms(1000)));
        assert_eq!(t.get(s, TimerKind::Proto), Some(ms(60)));
        // Put right exactly (before a sleep).
        t.set_near(s, &mut armed, None);
        assert_eq!(t.get(s, TimerKind::Proto), None);
        // The keepalive follows its deadline both ways.
        t.arm(s, &mut armed, None, Some(ms(500)));
        assert_eq!(t.get(s, TimerKind::Keepalive), Some(ms(500)));
        t.arm(s, &mut armed, None, Some(ms(2000)));
        assert_eq!(t.get(s, TimerKind::Keepalive), Some(ms(2000)));
        assert_eq!(t.len(), 1);
    }

    /// A review found that a call whose deadline was left behind an earlier (stale) timer reported nothing, so a
    /// progress thread asleep until later was not woken for it: the deadline waited for the thread's own wake-up.
    #[test]
    fn a_deadline_left_behind_is_reported_at_the_timer_that_serves_it() {
        let (ms, mut t, mut armed) = connection();
        let s = SocketId(4);
        t.arm(s, &mut armed, Some(ms(20)), None);
        t.arm(s, &mut armed, None, None);
        assert_eq!(t.take_armed(), Some(ms(20)));
        assert_eq!(t.take_armed(), None, "a cleared deadline reports nothing");
        t.arm(s, &mut armed, Some(ms(50)), None);
        assert_eq!(t.take_armed(), Some(ms(20)), "served by the timer at 20 ms");
        // The same deadline again (another flush of the connection) is nothing new: it was reported.
        t.arm(s, &mut armed, Some(ms(50)), None);
        assert_eq!(t.take_armed(), None);
    }
}

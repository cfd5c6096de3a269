//! Rounds of progress: completions, connection events and timers, each round bounded, and a panic in one failing
//! the context (see [`Engine::progress`]).

use std::time::{Duration, Instant};

use super::*;

impl Engine {
    /// Handles every pending event once. Returns whether anything happened.
    ///
    /// Completions go first. Connection-management events arrive on another channel, so a completion can be
    /// seen before the `Established` that brings its connection up (it waits in `early`), and a `Disconnected`
    /// can be seen while messages that arrived before it (a CLOSE) still sit in the completion queue: the queue
    /// is drained once more before a disconnect is acted on.
    /// One round of progress. A panic in it is a bug (no peer input may cause one: issue 15): the context then
    /// fails as a whole (see [`Engine::fail_context`]) rather than stopping silently with its operations pending.
    pub(crate) fn progress(&mut self) -> bool {
        self.guarded("a progress round", Engine::progress_round)
    }

    /// One round for a busy poller (completions and timers; connection events when [`Engine::cm_busy_due`] says so).
    pub(crate) fn progress_busy(&mut self) -> bool {
        self.guarded("a busy-poll round", Engine::progress_busy_round)
    }

    fn guarded(&mut self, what: &str, round: fn(&mut Engine) -> bool) -> bool {
        if self.failed.is_some() {
            self.discard_reports();
            return false;
        }
        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| round(self))) {
            Ok(did) => did,
            Err(panic) => {
                let msg = panic
                    .downcast_ref::<&str>()
                    .map(|s| s.to_string())
                    .or_else(|| panic.downcast_ref::<String>().cloned())
                    .unwrap_or_else(|| "a panic".into());
                self.fail_context(format!("{what} panicked: {msg}"));
                true
            }
        }
    }

    /// On a failed context nothing runs, but what the transport still reports (the flushed work of the connections
    /// it released, their connection events) is taken and dropped: left there, it kept every arm failing, and each
    /// thread that would have slept on the context spun instead, for the context's life.
    fn discard_reports(&mut self) {
        if self.discard_panicked {
            // The transport itself panicked: looking again would only panic again. Its reports then stay, and a
            // thread that would sleep on this failed context spins instead: the lesser harm.
            return;
        }
        let mut batch = std::mem::take(&mut self.completions);
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            for _ in 0..ROUND_BATCHES {
                batch.clear();
                if self.transport.poll(&mut batch, 64) == 0 {
                    break;
                }
            }
            for _ in 0..64 {
                if self.transport.poll_cm().is_none() {
                    break;
                }
            }
        }));
        self.discard_panicked = r.is_err();
        batch.clear();
        self.completions = batch;
    }

    /// After a panic nothing in the engine can be trusted: every pending operation fails with
    /// `OpError::ContextFailed`, every connection is disconnected and every listener closed (their endpoints are
    /// released with the context), and every later call on a socket of this context fails
    /// (`StateError::ConnectionDown` of the same). Best effort: a second panic here leaves the rest to the context's drop.
    fn fail_context(&mut self, why: String) {
        tracing::error!(%why, "the context failed; every operation ends with an error");
        let err = failed_error(&why);
        self.failed = Some(why);
        let ids: Vec<SocketId> = self.sockets.keys().copied().collect();
        let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            for sid in ids {
                let Some(s) = self.sockets.get_mut(&sid) else {
                    continue;
                };
                s.down.get_or_insert_with(|| err.clone());
                if let Some(t) = s.ticket.take() {
                    t.complete(Err(err.clone()), 0, EventFlags::default());
                }
                for (t, _) in s.polls.drain(..) {
                    t.complete(Err(err.clone()), 0, EventFlags::default());
                }
                if let Some(l) = s.listening.take() {
                    for t in l.accepts {
                        t.complete(Err(err.clone()), 0, EventFlags::default());
                    }
                    self.listeners.remove(&l.listener);
                    self.transport.close_listener(l.listener);
                }
                if let Some(conn) = s.conn.as_mut() {
                    conn.fail(err.clone());
                }
                self.disconnect(sid);
            }
            // The failures queued so far become events first: a second panic in the releases below must not keep
            // them back.
            self.drain_done();
            // Every connection goes now, as at the context's shutdown: their operations whose memory the transport
            // still had (a stream's receives, sends with writes in flight) end when their endpoint is released,
            // and on a failed context no later round acts on a disconnection (`discard_reports` drops them), so
            // they waited for the context's drop (review finding; test
            // `a_stream_receive_and_a_send_in_flight_end_when_the_context_fails`).
            self.disconnect_every_endpoint();
            self.drain_done();
        }));
        // No round runs a timer any more (`guarded`): none is left to come due.
        self.timers = Timers::default();
    }

    fn progress_round(&mut self) -> bool {
        let mut did = self.poll_completions();
        // Connection events cost a system call per look on software providers (libfabric's `fi_eq_read` polls its
        // own epoll set). A round that handled completions looks only every CM_EVERY rounds: an event that waits
        // meanwhile makes arming fail (or the wait descriptor readable), so no thread sleeps on it, and the next
        // round without completions takes it (issue 12: fewer system calls per message in a blocking ping-pong).
        // Where a successful arm says the event channel was empty too (`Transport::arm_covers_cm`), rounds without
        // completions skip it as well until an arm fails: the round before a blocking waiter's sleep, which finds
        // nothing, no longer looks, and an event that arrives wakes the sleeper, fails its next arm and is taken
        // by the round after that.
        let skip = did || self.cm_quiet;
        if skip && self.cm_skipped < CM_EVERY {
            self.cm_skipped += 1;
        } else {
            self.cm_skipped = 0;
            did |= self.poll_cm_events();
        }
        did | self.finish_round()
    }

    /// The end of every round: the timers that are due and the flushes, at one reading of the clock, and the
    /// reports the protocol made turned into events. Whether a timer ran.
    fn finish_round(&mut self) -> bool {
        let now = self.clock.now();
        let did = self.run_timers(now);
        if !self.pool_posts.is_empty() {
            // Pool buffers handed back outside a batch of completions (those a connection took before it was up,
            // handled when it came up) go back before the credits for them leave, next.
            self.flush_pool();
        }
        self.flush_dirty_at(Some(now));
        self.drain_done();
        if self.peer_log.holds() || self.fail_log.holds() {
            self.tell_held_back();
        }
        did
    }

    /// Logs how many warnings about peers were held back, once their pace allows (see [`super::peer_log`]).
    fn tell_held_back(&mut self) {
        let now = std::time::Instant::now();
        if let Some(n) = self.peer_log.overdue(now) {
            tracing::warn!(
                held_back = n,
                "more connection requests refused and violations than logged"
            );
        }
        if let Some(n) = self.fail_log.overdue(now) {
            tracing::warn!(held_back = n, "more connections failed than logged");
        }
    }

    /// Handles every waiting connection event; whether there was one.
    fn poll_cm_events(&mut self) -> bool {
        let mut did = false;
        let mut disconnected = Vec::new();
        self.stats.cm_polls += 1;
        while let Some(ev) = self.transport.poll_cm() {
            self.stats.cm_events += 1;
            did = true;
            match ev {
                CmEvent::Disconnected { ep } => disconnected.push(ep),
                other => self.on_cm(other),
            }
        }
        if !disconnected.is_empty() {
            // What arrived before the disconnection (a CLOSE, a stream's last write) is still in the completion
            // queue, possibly behind more than a round's worth of other connections' completions: they are all
            // taken first, up to DISCONNECT_DRAIN rounds (review finding: one round of 256 was taken, and what lay
            // behind was dropped with the endpoint, a graceful end read as a reset).
            for _ in 0..DISCONNECT_DRAIN {
                if !self.poll_completions() {
                    break;
                }
            }
            for ep in disconnected {
                self.on_disconnected(ep);
            }
        }
        did
    }

    /// Progress for a thread that busy-polls: completions, timers and posting, and the connection-management
    /// channel (a system call per look on software providers) when [`Engine::cm_busy_due`] says so.
    fn progress_busy_round(&mut self) -> bool {
        let mut did = self.poll_completions();
        // The progress thread stands back while a poller polls (see `progress::stand_back_for_busy_pollers`):
        // connection events are the poller's too.
        self.cm_skipped = self.cm_skipped.saturating_add(1);
        if self.cm_skipped % CM_BUSY_CLOCK == 0 {
            let now = Instant::now();
            if self.cm_busy_due(now) {
                self.cm_skipped = 0;
                self.cm_busy_looked = Some(now);
                did |= self.poll_cm_events();
            }
        }
        did | self.finish_round()
    }

    /// Whether a busy-poll round looks at connection events now (asked every [`CM_BUSY_CLOCK`] rounds): after
    /// [`CM_BUSY_EVERY`] rounds if [`CM_BUSY_INTERVAL`] has passed since the last look (where rounds are slow, an
    /// emulated CPU, the count alone came round often), and at the next asking once [`CM_BUSY_MAX_GAP`] has passed
    /// (a poller that finds its data in a round or two and then works between its dequeues runs few rounds, and
    /// nobody else looks meanwhile).
    fn cm_busy_due(&self, now: Instant) -> bool {
        let Some(last) = self.cm_busy_looked else {
            return true;
        };
        let since = now.saturating_duration_since(last);
        (self.cm_skipped >= CM_BUSY_EVERY && since >= CM_BUSY_INTERVAL) || since >= CM_BUSY_MAX_GAP
    }

    /// Handles up to [`ROUND_BATCHES`] batches of completions. Bounded (issue 15: a peer flooding one connection
    /// kept the engine locked, and connection events and timers unhandled, for as long as it sent): the round's
    /// caller handles connection events and timers, lets the lock go, and comes back (arming the completion queue
    /// reports that completions remain).
    pub(super) fn poll_completions(&mut self) -> bool {
        let mut did = false;
        for _ in 0..ROUND_BATCHES {
            let mut batch = std::mem::take(&mut self.completions);
            let n = self.transport.poll(&mut batch, COMPLETION_BATCH);
            if n == 0 {
                // Nothing came (a busy poller's usual round): nothing to hand on, no pool buffer taken.
                self.completions = batch;
                break;
            }
            for c in batch.drain(..) {
                self.stats.completions += 1;
                self.on_completion(c);
            }
            self.completions = batch;
            self.flush_pool();
            did |= n > 0;
            // Fewer than asked: the queue is drained (polling it again would only cost another call).
            if n < COMPLETION_BATCH {
                break;
            }
        }
        did
    }

    /// Runs the timers that are due (the earliest first; none of the others is looked at).
    fn run_timers(&mut self, now: Instant) -> bool {
        let mut did = false;
        while let Some((sid, kind)) = self.timers.pop_due(now) {
            did = true;
            self.on_timer(sid, kind, now);
        }
        did
    }
}

/// Completions taken from the transport at a time (the shared pool's buffers a batch took go back after it).
pub(super) const COMPLETION_BATCH: usize = 64;

/// A progress round that handled completions looks at connection events only every this many rounds (see
/// `Engine::progress_round`).
const CM_EVERY: u32 = 8;

/// A busy-poll round looks at connection events every this many rounds (see `Engine::progress_busy_round`).
const CM_BUSY_EVERY: u32 = 256;

/// The least time between two looks at connection events that the round count brings on (see
/// `Engine::cm_busy_due`).
const CM_BUSY_INTERVAL: Duration = Duration::from_millis(1);

/// Past this time since the last look at connection events, a busy poller looks at the next clock reading (every
/// [`CM_BUSY_CLOCK`] rounds), however few rounds it runs (see `Engine::cm_busy_due`).
const CM_BUSY_MAX_GAP: Duration = Duration::from_millis(8);

/// A busy-poll round reads the clock for [`Engine::cm_busy_due`] every this many rounds.
const CM_BUSY_CLOCK: u32 = 16;

/// Batches of completions one progress round handles at most (see `Engine::poll_completions`).
const ROUND_BATCHES: usize = 4;

/// Rounds of completions taken before a disconnection is acted on, at most (16 of [`ROUND_BATCHES`] batches of 64:
/// 4,096 completions; the lock is held meanwhile, so not without bound).
const DISCONNECT_DRAIN: usize = 16;

//! Which connections to a test's exs listener are the client's: with a token, those whose first eight bytes are
//! the test's token (the test's own connection, [`crate::util::accept_one`], and the idle connections of
//! [`crate::idle`]). Anyone may connect to the listener, and first; the tokens of the connections that came are
//! read side by side, each within [`TOKEN_PATIENCE`], so that strangers which connect and stay silent cost the
//! client at most one such wait, not one each (a review found the tokens read one connection after the other: a
//! stranger holding ten connections queued made the client wait fifty seconds, past its own patience).

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context as _, Result};
use exs::{Event, EventQueue, MemoryRegion, MsgFlags, Readiness, Socket};

use crate::control::Watch;
use crate::util::{check_token, PATIENCE, TOKEN_PATIENCE};

/// Connections whose tokens are read at once; beyond them, the next waits in the listener's backlog.
pub const CANDIDATES: usize = 64;

/// The context of the listener's readiness poll, and of its accept, on the admission queue (a candidate's
/// receive has its number, counted from 0).
const READY: u64 = u64::MAX;
const ACCEPTED: u64 = u64::MAX - 1;

/// A connection whose token is being read (into its slot of the admission's token buffer).
struct Candidate {
    s: Socket,
    slot: usize,
    until: Instant,
}

/// What a connection of the client's is for: the test's own, or one of `exs ping --idle`'s idle connections.
/// Each sends its own token (see [`Role::token`]), so that one cannot be taken for the other: the client opens its
/// idle connections once its own token is sent, and one of them may be admitted before the own one's token is
/// read (review finding).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    Own,
    Idle,
}

impl Role {
    const ALL: [Role; 2] = [Role::Own, Role::Idle];

    /// The token a connection of this role sends first, from the test's.
    pub fn token(self, test: u64) -> u64 {
        match self {
            Role::Own => test,
            Role::Idle => test ^ 0x1D1E,
        }
    }
}

/// A test's listener and the connections it admitted, for as long as the test runs: the client's connections that
/// came and were not asked for yet stay here, by role, for the next [`Admission::take`].
///
/// Accepts are made only when the listener is readable, so none is left posted between two takes (it would take
/// the next connection to a queue nobody reads).
pub struct Admission {
    listener: Socket,
    token: Option<u64>,
    aq: EventQueue,
    cands: HashMap<u64, Candidate>,
    /// The tokens' buffer, 8 bytes a candidate (registered once, not once a connection: `exs ping --idle` admits
    /// thousands), its free slots, and the slots of receives still posted, by candidate number (a receive of a
    /// candidate closed when its time was up keeps its slot until its cancellation comes).
    tokens: MemoryRegion,
    free: Vec<usize>,
    reading: HashMap<u64, usize>,
    /// Connections admitted and not taken yet: the test's own and the idle ones (without a token, all are here as
    /// the test's own).
    admitted: [VecDeque<Socket>; 2],
    /// Connections of each role the test will still take: once none, what is left (strangers) is closed, and the
    /// listener ([`Admission::finish`]).
    expected: [usize; 2],
    /// Connections closed so far (see [`LOGGED`]).
    refused: u64,
    next_id: u64,
    polling: bool,
}

impl Admission {
    /// Admits connections of `listener` that send `token` first (its own role's: see [`Role::token`]), or,
    /// without one, every connection; the test takes one of its own and `idle` idle ones.
    pub fn new(listener: Socket, token: Option<u64>, idle: usize) -> Result<Admission> {
        let tokens = MemoryRegion::alloc(listener.context(), 8 * CANDIDATES)?;
        Ok(Admission {
            listener,
            token,
            aq: EventQueue::new(2 * CANDIDATES + 2)?,
            cands: HashMap::new(),
            tokens,
            free: (0..CANDIDATES).rev().collect(),
            reading: HashMap::new(),
            admitted: [VecDeque::new(), VecDeque::new()],
            expected: [1, idle],
            refused: 0,
            next_id: 0,
            polling: false,
        })
    }

    /// The next `n` connections of `role` admitted (`what`: what they are, for messages); the others that came
    /// meanwhile are closed (a wrong token, or none within [`TOKEN_PATIENCE`]), or kept for their role. Gives up
    /// when no connection came for [`PATIENCE`], or as soon as `watch` says so.
    pub fn take(&mut self, role: Role, n: usize, watch: &Watch, what: &str) -> Result<Vec<Socket>> {
        let r = if self.token.is_some() {
            role as usize
        } else {
            0
        };
        let mut quiet_since = Instant::now();
        while self.admitted[r].len() < n {
            if !self.polling && !self.free.is_empty() {
                self.listener
                    .poll(&self.aq, readable(), READY)
                    .context("waiting for connections")?;
                self.polling = true;
            }
            match self.aq.next(Some(self.wait())) {
                Ok(ev) => {
                    quiet_since = Instant::now();
                    self.on_event(ev)?;
                    // Whatever else is queued before any candidate's time is judged: a token that came in time
                    // must not be taken for a late one because its event waited behind others (review finding).
                    let mut more = Vec::new();
                    while self.aq.poll(&mut more, CANDIDATES) > 0 {
                        for ev in more.drain(..) {
                            self.on_event(ev)?;
                        }
                    }
                }
                Err(exs::DequeueError::TimedOut) => {}
                Err(e) => return Err(e).with_context(|| format!("waiting for {what}")),
            }
            let now = Instant::now();
            let refused = &mut self.refused;
            self.cands.retain(|_, c| {
                let keep = now < c.until;
                if !keep {
                    refuse(
                        &c.s,
                        &anyhow!("no token within {TOKEN_PATIENCE:?}"),
                        refused,
                    );
                }
                keep
            });
            if self.admitted[r].len() >= n {
                break;
            }
            if self.cands.is_empty() && now.duration_since(quiet_since) >= PATIENCE {
                bail!(
                    "no {what} within {} s ({} of {n} came)",
                    PATIENCE.as_secs(),
                    self.admitted[r].len()
                );
            }
            watch.check(what)?;
        }
        let taken: Vec<Socket> = self.admitted[r].drain(..n).collect();
        let before = self.expected;
        self.expected[role as usize] = self.expected[role as usize].saturating_sub(n);
        if self.expected == [0, 0] && before != [0, 0] {
            self.finish();
        }
        Ok(taken)
    }

    /// Every connection of the client's came: the others are strangers', and so is whatever still comes. The
    /// listener closes (the connections it holds, not accepted, with it: review finding, they kept their memory
    /// for the test's time); the test's connections stay.
    fn finish(&mut self) {
        for c in std::mem::take(&mut self.cands).into_values() {
            refuse(
                &c.s,
                &anyhow!("the test has all its connections"),
                &mut self.refused,
            );
        }
        for s in self.admitted.iter_mut().flat_map(|q| q.drain(..)) {
            refuse(
                &s,
                &anyhow!("one more than the test's connections"),
                &mut self.refused,
            );
        }
        if self.refused > LOGGED {
            tracing::warn!(
                "{} more connections to the test's listener closed",
                self.refused - LOGGED
            );
        }
        if let Err(e) = self.listener.close() {
            tracing::warn!("closing a test's listener: {e}");
        }
    }

    /// How long to wait for the next event: until the first candidate's time is up, and at most a second (to look
    /// at the watch).
    fn wait(&self) -> Duration {
        let now = Instant::now();
        self.cands
            .values()
            .map(|c| c.until.saturating_duration_since(now))
            .min()
            .unwrap_or(Duration::MAX)
            .min(Duration::from_secs(1))
    }

    /// Keeps `s` for the test's next take of queue `r`, or closes it when the queue already holds every
    /// connection the test will still take from it (without a token, queue 0 holds both roles'). A client that
    /// kept connecting with its own token while the server waited for its idle connections held one connection
    /// each, past `--max-idle`, until the test ended (review finding).
    fn admit(&mut self, r: usize, s: Socket) {
        let room = if self.token.is_some() {
            self.expected[r]
        } else {
            self.expected.iter().sum()
        };
        if self.admitted[r].len() < room {
            self.admitted[r].push_back(s);
        } else {
            refuse(
                &s,
                &anyhow!("one more than the test's connections"),
                &mut self.refused,
            );
        }
    }

    fn on_event(&mut self, ev: Event) -> Result<()> {
        match ev.context {
            READY => {
                // Still `polling` until the accept's event is taken: a second readiness poll meanwhile could
                // accept a second connection for the one free slot (review finding: the server panicked).
                ev.status.clone().context("waiting for connections")?;
                if !ev.readiness.readable {
                    bail!("the test's listener failed ({:?})", ev.readiness);
                }
                self.listener.accept(&self.aq, ACCEPTED).context("accept")?;
            }
            ACCEPTED => {
                self.polling = false;
                let s = accepted(ev)?;
                if self.token.is_none() {
                    self.admit(0, s);
                    return Ok(());
                }
                // A readiness poll is posted only with a slot free.
                let slot = self.free.pop().expect("a free slot");
                let id = self.next_id;
                let into = self.tokens.slice(8 * slot..8 * slot + 8);
                match s.recv(&self.aq, &into, MsgFlags::WAITALL, id) {
                    Ok(()) => {
                        let until = Instant::now() + TOKEN_PATIENCE;
                        self.cands.insert(id, Candidate { s, slot, until });
                        self.reading.insert(id, slot);
                        self.next_id += 1;
                    }
                    Err(e) => {
                        self.free.push(slot);
                        refuse(
                            &s,
                            &anyhow!(e).context("receiving the token"),
                            &mut self.refused,
                        );
                    }
                }
            }
            id => {
                // A receive of a candidate closed meanwhile (its time was up) is not one of them any more.
                if let (Some(c), Some(token)) = (self.cands.remove(&id), self.token) {
                    match read_token(&self.tokens, &c, &ev, token) {
                        Ok(role) => self.admit(role as usize, c.s),
                        Err(why) => refuse(&c.s, &why, &mut self.refused),
                    }
                }
                // Its receive has ended: the slot is free.
                if let Some(slot) = self.reading.remove(&id) {
                    self.free.push(slot);
                }
            }
        }
        Ok(())
    }
}

/// Interest in readability alone (a listener: a connection waits for an accept).
fn readable() -> Readiness {
    Readiness {
        readable: true,
        ..Readiness::default()
    }
}

/// The socket an accept's event carries, or why there is none.
fn accepted(mut ev: Event) -> Result<Socket> {
    ev.status
        .clone()
        .context("accepting the client's exs connection")?;
    ev.take_accepted()
        .ok_or_else(|| anyhow!("accepting the client's exs connection: no connection"))
}

/// The role whose token (from the test's `token`) the receive `ev` ended with in `c`'s buffer, or why none.
fn read_token(tokens: &MemoryRegion, c: &Candidate, ev: &Event, token: u64) -> Result<Role> {
    ev.status.clone().context("receiving the token")?;
    let mut got = [0u8; 8];
    tokens.read(8 * c.slot, &mut got)?;
    let got = &got[..ev.bytes.min(8)];
    Role::ALL
        .into_iter()
        .find(|r| check_token(got, r.token(token)).is_ok())
        .ok_or_else(|| anyhow!("not this test's token"))
}

/// Connections closed per test that the log names one by one; the rest are counted (a stranger sending wrong
/// tokens as fast as it connects must not fill the server's log).
pub const LOGGED: u64 = 8;

/// Closes a connection that is not the client's, saying why in the log (the first [`LOGGED`] of a test).
fn refuse(s: &Socket, why: &anyhow::Error, refused: &mut u64) {
    *refused += 1;
    if *refused <= LOGGED {
        let from = format!("{:?}", s.peer_addr().ok().flatten());
        tracing::warn!(%from, "a connection to a test's listener closed: {why:#}");
    }
    let _ = s.close();
}

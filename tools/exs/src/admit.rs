//! Which connections to a test's exs listener are the client's: those whose first eight bytes are the test's token
//! (see [`crate::util::accept_one`], and the idle connections of [`crate::idle`]). Anyone may connect to the listener, and first; the tokens of the connections
//! that came are read side by side, each within [`TOKEN_PATIENCE`], so that strangers which connect and stay
//! silent cost the client at most one such wait, not one each (a review found the tokens read one connection after
//! the other: a stranger holding ten connections queued made the client wait fifty seconds, past its own patience).

use std::collections::HashMap;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context as _, Result};
use exs::{Event, EventKind, EventQueue, MemoryRegion, MsgFlags, Readiness, Socket};

use crate::control::Watch;
use crate::util::{check_token, PATIENCE, TOKEN_PATIENCE};

/// Connections whose tokens are read at once; beyond them, the next waits in the listener's backlog.
pub const CANDIDATES: usize = 64;

/// The context of the listener's readiness poll, and of its accept, on the admission queue (a candidate's
/// receive has its number, counted from 0).
const READY: u64 = u64::MAX;
const ACCEPTED: u64 = u64::MAX - 1;

/// A connection whose token is being read.
struct Candidate {
    s: Socket,
    got: MemoryRegion,
    until: Instant,
}

/// Accepts connections on `l` until one sends `token` first; closes the others (a wrong token, none within
/// [`TOKEN_PATIENCE`], or still unread when the client's came). Gives up when no connection came for
/// [`PATIENCE`], or as soon as `watch` says so.
pub fn by_token(l: &Socket, token: u64, watch: &Watch) -> Result<Socket> {
    let mut won = admit(l, token, 1, watch, "the client's exs connection")?;
    won.pop()
        .ok_or_else(|| anyhow!("no client's exs connection"))
}

/// [`by_token`] for `n` connections (`what`: what they are, for messages): the client's idle connections.
///
/// Accepts are made only when the listener is readable, so none is left posted once the last is found (it would
/// take the next connection, one of the client's, to a queue nobody reads).
pub fn admit(l: &Socket, token: u64, n: usize, watch: &Watch, what: &str) -> Result<Vec<Socket>> {
    let aq = EventQueue::new(2 * CANDIDATES + 2)?;
    let mut cands: HashMap<u64, Candidate> = HashMap::new();
    let mut won = Vec::with_capacity(n);
    let mut next_id = 0u64;
    let mut polling = false;
    let mut quiet_since = Instant::now();
    while won.len() < n {
        if !polling && cands.len() < CANDIDATES {
            l.poll(&aq, readable(), READY)
                .context("waiting for connections")?;
            polling = true;
        }
        let now = Instant::now();
        let wait = cands
            .values()
            .map(|c| c.until.saturating_duration_since(now))
            .min()
            .unwrap_or(Duration::MAX)
            .min(Duration::from_secs(1));
        match aq.next(Some(wait)) {
            Ok(ev) => {
                quiet_since = Instant::now();
                match ev.context {
                    READY => {
                        polling = false;
                        ev.status.clone().context("waiting for connections")?;
                        if !ev.readiness.readable {
                            bail!("the test's listener failed ({:?})", ev.readiness);
                        }
                        l.accept(&aq, ACCEPTED).context("accept")?;
                    }
                    ACCEPTED => {
                        let s = accepted(ev)?;
                        let got = MemoryRegion::alloc(l.context(), 8)?;
                        match s.recv(&aq, &got.all(), MsgFlags::WAITALL, next_id) {
                            Ok(()) => {
                                let until = Instant::now() + TOKEN_PATIENCE;
                                cands.insert(next_id, Candidate { s, got, until });
                                next_id += 1;
                            }
                            Err(e) => refuse(&s, &anyhow!(e).context("receiving the token")),
                        }
                    }
                    id => {
                        if let Some(c) = cands.remove(&id) {
                            match read_token(&c, &ev, token) {
                                Ok(()) => won.push(c.s),
                                Err(why) => refuse(&c.s, &why),
                            }
                        }
                    }
                }
            }
            Err(exs::DequeueError::TimedOut) => {}
            Err(e) => return Err(e).with_context(|| format!("waiting for {what}")),
        }
        let now = Instant::now();
        cands.retain(|_, c| {
            let keep = now < c.until;
            if !keep {
                refuse(&c.s, &anyhow!("no token within {TOKEN_PATIENCE:?}"));
            }
            keep
        });
        if won.len() < n && cands.is_empty() && now.duration_since(quiet_since) >= PATIENCE {
            bail!(
                "no {what} within {} s ({} of {n} came)",
                PATIENCE.as_secs(),
                won.len()
            );
        }
        if won.len() < n {
            watch.check(what)?;
        }
    }
    for c in cands.into_values() {
        refuse(&c.s, &anyhow!("the test had all the connections it wanted"));
    }
    Ok(won)
}

/// The socket an accept's event carries, or why there is none.
fn accepted(mut ev: Event) -> Result<Socket> {
    debug_assert_eq!(ev.kind, EventKind::Accept);
    ev.status
        .clone()
        .context("accepting the client's exs connection")?;
    ev.take_accepted()
        .ok_or_else(|| anyhow!("accepting the client's exs connection: no connection"))
}

/// Whether the receive `ev` ended with `token` in `c`'s buffer.
fn read_token(c: &Candidate, ev: &Event, token: u64) -> Result<()> {
    ev.status.clone().context("receiving the token")?;
    check_token(&c.got.to_vec()?[..ev.bytes.min(8)], token)
}

/// Interest in readability alone (a listener: a connection waits for an accept).
fn readable() -> Readiness {
    Readiness {
        readable: true,
        ..Readiness::default()
    }
}

/// Closes a connection that is not the client's, saying why in the log.
fn refuse(s: &Socket, why: &anyhow::Error) {
    let from = format!("{:?}", s.peer_addr().ok().flatten());
    tracing::warn!(%from, "a connection to a test's listener closed: {why:#}");
    let _ = s.close();
}

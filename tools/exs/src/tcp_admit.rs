//! Taking the client's connection on a test's TCP listener (the demo's TCP side), as [`crate::admit`] takes it on
//! an exs listener: anyone may connect first, and the client's connection sends the test's token first. The
//! connections are read side by side, each within [`TOKEN_PATIENCE`], so that strangers which connect and stay
//! silent cost the client nothing (read one after the other, each held the client back by the whole patience:
//! twelve of them outlasted its write timeout). At most [`CANDIDATES`] are read at once (the others wait in the
//! listener's backlog), the first [`LOGGED`] closed connections of a test are logged and the rest counted, and the
//! listener closes as soon as the client's connection is in.

use std::collections::VecDeque;
use std::io::{ErrorKind, Read};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context as _, Result};

use crate::admit::{CANDIDATES, LOGGED};
use crate::control::Watch;
use crate::util::{check_token, PATIENCE, TOKEN_PATIENCE};

/// A connection whose token is being read.
struct Candidate {
    st: TcpStream,
    from: SocketAddr,
    got: [u8; 8],
    at: usize,
    until: Instant,
}

/// What reading a candidate's token came to.
enum Read8 {
    /// Not all of it yet.
    Waiting,
    /// The test's token: the client's connection.
    Client,
    /// Closed, or a wrong token.
    Refused(anyhow::Error),
}

impl Candidate {
    fn read(&mut self, token: u64) -> Read8 {
        loop {
            match self.st.read(&mut self.got[self.at..]) {
                Ok(0) => return Read8::Refused(anyhow!("closed before its token")),
                Ok(n) => {
                    self.at += n;
                    if self.at == self.got.len() {
                        return match check_token(&self.got, token) {
                            Ok(()) => Read8::Client,
                            Err(e) => Read8::Refused(e),
                        };
                    }
                }
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) if e.kind() == ErrorKind::WouldBlock => {
                    return if Instant::now() >= self.until {
                        Read8::Refused(anyhow!("no token within {TOKEN_PATIENCE:?}"))
                    } else {
                        Read8::Waiting
                    };
                }
                Err(e) => return Read8::Refused(anyhow!(e).context("reading its token")),
            }
        }
    }
}

/// The connections closed so far in one test (or by one helper server: [`crate::helper`]); the first
/// [`LOGGED`] are logged one by one, the rest counted once it is dropped.
pub(crate) struct Refused {
    n: u64,
    /// Whose listener, for the log ("test's TCP listener").
    listener: &'static str,
}

impl Refused {
    pub(crate) fn new(listener: &'static str) -> Refused {
        Refused { n: 0, listener }
    }

    pub(crate) fn close(&mut self, from: SocketAddr, why: &anyhow::Error) {
        self.n += 1;
        if self.n <= LOGGED {
            tracing::warn!(%from, "a connection to a {} closed: {why:#}", self.listener);
        }
    }
}

impl Drop for Refused {
    fn drop(&mut self) {
        if self.n > LOGGED {
            tracing::warn!(
                "{} more connections to the {} closed",
                self.n - LOGGED,
                self.listener
            );
        }
    }
}

/// Takes the client's connection on `l` (the first whose first eight bytes are `token`; with no token, the first
/// connection), within [`PATIENCE`] and the test's limits, and closes `l`. The connection comes back blocking.
pub fn accept_client(l: TcpListener, token: Option<u64>, watch: &Watch) -> Result<TcpStream> {
    l.set_nonblocking(true)?;
    let mut refused = Refused::new("test's TCP listener");
    let mut cands = VecDeque::new();
    let taken = take_client(&l, token, watch, &mut cands, &mut refused);
    // Whatever is still being read is closed, and counted, however the wait ended.
    let why = if taken.is_ok() {
        "the test has its connection"
    } else {
        "the test ended before its connection"
    };
    for c in cands.drain(..) {
        refused.close(c.from, &anyhow!(why));
    }
    taken
}

/// The loop of [`accept_client`]. At most [`CANDIDATES`] connections are read at once: beyond them, connections
/// wait in the listener's backlog (closing the oldest to make room could close the client's, its token unread).
fn take_client(
    l: &TcpListener,
    token: Option<u64>,
    watch: &Watch,
    cands: &mut VecDeque<Candidate>,
    refused: &mut Refused,
) -> Result<TcpStream> {
    let deadline = Instant::now() + PATIENCE;
    loop {
        // At every turn: connections that never send the token kept the loop from the client's leaving and
        // every limit (test `tokenless_connections_queued_on_a_tcp_demo_listener_end_at_the_tests_limit`).
        watch.check("its TCP connection")?;
        if Instant::now() > deadline {
            bail!(
                "no TCP connection from the client within {} s",
                PATIENCE.as_secs()
            );
        }
        let mut busy = false;
        while cands.len() < CANDIDATES {
            match l.accept() {
                Ok((st, from)) => {
                    busy = true;
                    if token.is_none() {
                        st.set_nonblocking(false)?;
                        return Ok(st);
                    }
                    if let Err(e) = st.set_nonblocking(true) {
                        refused.close(from, &anyhow!(e));
                        continue;
                    }
                    let until = Instant::now() + TOKEN_PATIENCE;
                    cands.push_back(Candidate {
                        st,
                        from,
                        got: [0; 8],
                        at: 0,
                        until,
                    });
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => return Err(e).context("TCP accept"),
            }
        }
        let token = token.unwrap_or_default();
        let mut i = 0;
        while i < cands.len() {
            match cands[i].read(token) {
                Read8::Waiting => i += 1,
                Read8::Client => {
                    let c = cands.remove(i).expect("in range");
                    c.st.set_nonblocking(false)?;
                    return Ok(c.st);
                }
                Read8::Refused(why) => {
                    busy = true;
                    let c = cands.remove(i).expect("in range");
                    refused.close(c.from, &why);
                }
            }
        }
        if !busy {
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

//! A ping-pong over a [`Pair`]: the client sends and waits for the echo, the server echoes from a thread of its
//! own. What the counting tests of progress and waiting run (in this crate's tests and in the conformance suite).

use std::thread::JoinHandle;
use std::time::Duration;

use super::{pattern, Pair};
use crate::event::{Event, EventQueue};
use crate::memory::MemoryRegion;
use crate::options::MsgFlags;

/// The bytes of each ping.
const PING: usize = 32;
/// The longest one wait of the ping-pong may take (an emulated CPU included) before it counts as a failure.
const PATIENCE: Duration = Duration::from_secs(60);

fn one(eq: &EventQueue) -> Result<Event, String> {
    let ev = eq
        .next(Some(PATIENCE))
        .map_err(|e| format!("waiting for an event: {e}"))?;
    if !ev.is_ok() {
        return Err(format!("a failed event: {ev:?}"));
    }
    Ok(ev)
}

impl Pair {
    /// The server side of a ping-pong: echoes `rounds` messages of up to 32 bytes on `eq`, from a thread of its
    /// own; the thread says how it ended.
    pub fn echo(
        &self,
        eq: &EventQueue,
        rounds: usize,
    ) -> Result<JoinHandle<Result<(), String>>, String> {
        let (server, eq) = (self.server.clone(), eq.clone());
        let buf = self.region_b(PING)?;
        Ok(std::thread::spawn(move || {
            for _ in 0..rounds {
                server
                    .recv(&eq, &buf.all(), MsgFlags::NONE, 1)
                    .map_err(|e| format!("echo receive: {e}"))?;
                let got = one(&eq)?;
                server
                    .send(&eq, &buf.slice(..got.bytes), MsgFlags::NONE, 2)
                    .map_err(|e| format!("echo send: {e}"))?;
                one(&eq)?;
            }
            Ok(())
        }))
    }

    /// A blocking ping-pong of `rounds` 32-byte messages, the client waiting on `eq_a`, the server echoing on
    /// `eq_b` ([`Pair::echo`]). The adaptive wait's learned spin is off on both queues, so every wait that finds
    /// nothing leads its context and sleeps (a busy-polling queue polls as it always does). `snap` is taken just
    /// before the first ping and after the last echo came back whole.
    pub fn ping_pong_on<S>(
        &self,
        eq_a: &EventQueue,
        eq_b: &EventQueue,
        rounds: usize,
        snap: impl Fn(&Pair) -> S,
    ) -> Result<(S, S), String> {
        eq_a.set_adaptive_spin(Duration::ZERO);
        eq_b.set_adaptive_spin(Duration::ZERO);
        let want = pattern(PING, 7);
        let out = self.region_a(want.clone())?;
        let back = self.region_a(vec![0; PING])?;
        let echo = self.echo(eq_b, rounds)?;
        let before = snap(self);
        for _ in 0..rounds {
            self.client
                .recv(eq_a, &back.all(), MsgFlags::NONE, 1)
                .map_err(|e| format!("ping receive: {e}"))?;
            self.client
                .send(eq_a, &out.all(), MsgFlags::NONE, 2)
                .map_err(|e| format!("ping send: {e}"))?;
            let mut evs = Vec::new();
            eq_a.dequeue(&mut evs, 2, 2, Some(PATIENCE))
                .map_err(|e| format!("waiting for the echo: {e}"))?;
            if let Some(bad) = evs.iter().find(|e| !e.is_ok()) {
                return Err(format!("a failed event: {bad:?}"));
            }
        }
        echo.join().map_err(|_| "the echo thread panicked")??;
        let got = read(&back)?;
        if got != want {
            return Err("the last echo came back different".into());
        }
        Ok((before, snap(self)))
    }
}

fn read(r: &MemoryRegion) -> Result<Vec<u8>, String> {
    r.to_vec().map_err(|e| e.to_string())
}

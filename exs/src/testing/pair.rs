//! [`Pair`]: two connected sockets, the fixture of this crate's tests and of the conformance suite.

use std::net::SocketAddr;
use std::time::Duration;

use crate::context::Context;
use crate::event::{Event, EventKind, EventQueue};
use crate::memory::MemoryRegion;
use crate::options::{SockType, SocketOptions};
use crate::socket::Socket;

/// A connected pair: `client` on context `a`, `server` (accepted through `listener`) on context `b`, each side
/// with its own queue.
#[derive(Debug)]
pub struct Pair {
    /// The client's context.
    pub a: Context,
    /// The server's context.
    pub b: Context,
    /// The connecting socket, on `a`.
    pub client: Socket,
    /// The accepted socket, on `b`.
    pub server: Socket,
    /// The listener `server` came from (kept open).
    pub listener: Socket,
    /// The client's queue.
    pub eq_a: EventQueue,
    /// The server's queue.
    pub eq_b: EventQueue,
}

/// How to connect a [`Pair`].
#[derive(Clone, Copy, Debug)]
pub struct PairSpec {
    /// The socket type of both ends.
    pub ty: SockType,
    /// The client's options, set before it connects.
    pub client: SocketOptions,
    /// The listener's options (the accepted socket inherits them).
    pub server: SocketOptions,
    /// Each queue's depth.
    pub depth: usize,
    /// How long the connect and the accept may take.
    pub patience: Duration,
}

impl PairSpec {
    /// Both ends of type `ty` with default options, queues of 1,024, a minute of patience.
    pub fn new(ty: SockType) -> PairSpec {
        PairSpec {
            ty,
            client: SocketOptions::default(),
            server: SocketOptions::default(),
            depth: 1024,
            patience: Duration::from_secs(60),
        }
    }

    /// The same options on both ends.
    pub fn options(self, opts: SocketOptions) -> PairSpec {
        PairSpec {
            client: opts,
            server: opts,
            ..self
        }
    }

    /// Listens on `at` on context `b`, connects from context `a`, and waits for both ends.
    pub fn connect(self, a: &Context, b: &Context, at: SocketAddr) -> Result<Pair, String> {
        let eq_a = said(EventQueue::new(self.depth), "client queue")?;
        let eq_b = said(EventQueue::new(self.depth), "server queue")?;
        let listener = said(Socket::new(b, self.ty), "listener")?;
        said(listener.set_options(self.server), "listener options")?;
        said(listener.bind(at), "bind")?;
        let addr = said(listener.listen(16), "listen")?;
        said(listener.accept(&eq_b, 100), "accept")?;
        let client = said(Socket::new(a, self.ty), "client")?;
        said(client.set_options(self.client), "client options")?;
        said(client.connect(&eq_a, addr, 200), "connect")?;
        let connected = self.next(&eq_a, "connect")?;
        check(&connected, EventKind::Connect, 200)?;
        let mut accepted = self.next(&eq_b, "accept")?;
        check(&accepted, EventKind::Accept, 100)?;
        let server = accepted
            .take_accepted()
            .ok_or_else(|| format!("an accept event without its socket: {accepted:?}"))?;
        Ok(Pair {
            a: a.clone(),
            b: b.clone(),
            client,
            server,
            listener,
            eq_a,
            eq_b,
        })
    }

    fn next(&self, eq: &EventQueue, what: &str) -> Result<Event, String> {
        eq.next(Some(self.patience))
            .map_err(|e| format!("waiting for the {what}: {e}"))
    }
}

/// A failed step, said with what it was.
fn said<T, E: std::fmt::Display>(r: Result<T, E>, what: &str) -> Result<T, String> {
    r.map_err(|e| format!("{what}: {e}"))
}

fn check(ev: &Event, kind: EventKind, context: u64) -> Result<(), String> {
    if (ev.kind, ev.context) != (kind, context) || !ev.is_ok() {
        return Err(format!("expected a successful {kind:?}, got {ev:?}"));
    }
    Ok(())
}

impl Pair {
    /// Registers `bytes` on the client's context.
    pub fn region_a(&self, bytes: Vec<u8>) -> Result<MemoryRegion, String> {
        MemoryRegion::from_vec(&self.a, bytes).map_err(|e| e.to_string())
    }

    /// Allocates `len` bytes (at least one) on the server's context.
    pub fn region_b(&self, len: usize) -> Result<MemoryRegion, String> {
        MemoryRegion::alloc(&self.b, len.max(1)).map_err(|e| e.to_string())
    }
}

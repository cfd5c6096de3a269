//! Helpers shared by the protocol tests: a connected pair of sockets on a simulated world. The property tests of
//! `props/` include this file by path, so it uses exs and the standard library only (none of exs's other test
//! dependencies, which that crate does not have).
#![allow(dead_code)]

use std::time::Duration;

use exs::sim::{SimConfig, World};
use exs::{Context, Event, EventQueue, MemoryRegion, MsgFlags, SockType, SocketOptions};

pub use exs::testing::pattern;

/// A connected pair (`exs::testing::Pair`, the conformance suite's fixture too) on a simulated world, which lives
/// as long as the pair.
pub struct Pair {
    pub world: World,
    pub conn: exs::testing::Pair,
}

impl std::ops::Deref for Pair {
    type Target = exs::testing::Pair;
    fn deref(&self) -> &exs::testing::Pair {
        &self.conn
    }
}

pub fn pair(ty: SockType) -> Pair {
    pair_with(ty, SimConfig::default(), exs::SocketOptions::default())
}

pub fn pair_with(ty: SockType, cfg: SimConfig, opts: SocketOptions) -> Pair {
    pair_opts(ty, cfg, opts, opts)
}

/// A connected pair: `client` on host 0 (context `a`), `server` accepted on host 1 (context `b`).
pub fn pair_opts(
    ty: SockType,
    cfg: SimConfig,
    client_opts: SocketOptions,
    server_opts: SocketOptions,
) -> Pair {
    pair_in(World::new(cfg), ty, client_opts, server_opts)
}

/// A connected pair on a threaded world: each context has its progress thread, and waiting threads lead.
pub fn pair_threaded(ty: SockType, opts: SocketOptions) -> Pair {
    pair_in(World::threaded(SimConfig::default()), ty, opts, opts)
}

/// A connected pair in `world`.
pub fn pair_in(
    world: World,
    ty: SockType,
    client_opts: SocketOptions,
    server_opts: SocketOptions,
) -> Pair {
    let a = world.host();
    let b = world.host();
    pair_hosts(world, a, b, ty, client_opts, server_opts)
}

/// A connected pair whose contexts both use `opts` (manual progress, virtual time: the world sets those).
pub fn pair_ctx_opts(ty: SockType, opts: exs::ContextOptions, sock: SocketOptions) -> Pair {
    let world = World::new(SimConfig::default());
    let a = world.host_with(opts.clone());
    let b = world.host_with(opts);
    pair_hosts(world, a, b, ty, sock, sock)
}

/// A connected pair between hosts 0 (`a`, the client) and 1 (`b`) of `world`.
pub fn pair_hosts(
    world: World,
    a: Context,
    b: Context,
    ty: SockType,
    client_opts: SocketOptions,
    server_opts: SocketOptions,
) -> Pair {
    let spec = exs::testing::PairSpec {
        client: client_opts,
        server: server_opts,
        ..exs::testing::PairSpec::new(ty)
    };
    let conn = spec.connect(&a, &b, world.addr(1, 7000)).unwrap();
    Pair { world, conn }
}

impl Pair {
    /// Registers `bytes` on the client's context.
    pub fn client_region(&self, bytes: Vec<u8>) -> MemoryRegion {
        self.region_a(bytes).unwrap()
    }

    /// Allocates `len` bytes (at least one) on the server's context.
    pub fn server_region(&self, len: usize) -> MemoryRegion {
        self.region_b(len).unwrap()
    }

    /// Sends `data` from client to server into a buffer of `cap` bytes; returns (send event, recv event, bytes).
    pub fn transfer(&self, data: &[u8], cap: usize) -> (Event, Event, Vec<u8>) {
        let src = self.client_region(if data.is_empty() {
            vec![0]
        } else {
            data.to_vec()
        });
        let dst = self.server_region(cap.max(1));
        self.server
            .recv(&self.eq_b, &dst.slice(..cap), MsgFlags::NONE, 1)
            .unwrap();
        self.client
            .send(&self.eq_a, &src.slice(..data.len()), MsgFlags::NONE, 2)
            .unwrap();
        let r = self.eq_b.next(None).unwrap();
        let s = self.eq_a.next(None).unwrap();
        let got = dst.to_vec().unwrap()[..r.bytes].to_vec();
        (s, r, got)
    }
}

pub fn wait(eq: &EventQueue) -> Event {
    eq.next(Some(Duration::from_secs(60))).unwrap()
}

/// Compares two byte strings, reporting the first difference instead of printing them.
#[track_caller]
pub fn assert_bytes_eq(got: &[u8], want: &[u8], what: &str) {
    if got.len() != want.len() {
        panic!("{what}: length {} != expected {}", got.len(), want.len());
    }
    if let Some(i) = got.iter().zip(want).position(|(a, b)| a != b) {
        let end = (i + 8).min(got.len());
        panic!(
            "{what}: first difference at byte {i}: got {:?}, want {:?}",
            &got[i..end],
            &want[i..end]
        );
    }
}

//! The engine's counters: a context's ([`EngineStats`]) and a connection's ([`ConnStats`]). The crate's
//! `stats` module gathers them with the others for the public API.

use crate::proto::link::LinkStats;
use crate::proto::message::MessageStats;
use crate::proto::pool::PoolStats;
use crate::proto::stream::StreamStats;

/// Counters of one context.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct EngineStats {
    /// Completions handled.
    pub completions: u64,
    /// Connection-management events handled.
    pub cm_events: u64,
    /// Work requests posted.
    pub posted: u64,
    /// Connections brought down because the peer broke the protocol.
    pub violations: u64,
    /// Connections established.
    pub connections: u64,
    /// Bytes of control receive buffers currently registered for connections (their own, not the pool's).
    pub ctrl_recv_bytes: u64,
    /// The shared receive pool (seed 003), when the context uses one.
    pub pool: Option<PoolStats>,
    /// Memory registrations the context made (memory regions, control and stream buffers, pool chunks).
    pub registrations: u64,
    /// Remote keys handed out (each bound to one connection): one per send the peer reads and per advertised
    /// stream receive (a stream receive filled from the stream buffer before it is advertised has none), or under
    /// the trusted policy one per region, connection and access.
    pub exposures: u64,
    /// Stream receives the device could make no key for when their turn to be advertised came (out of
    /// registrations or memory windows): each completed with the transport's error.
    pub keys_refused: u64,
    /// Whole-region keys of the trusted policy valid now ([`crate::ExposurePolicy::TrustedPeers`]).
    pub trusted_keys: u64,
    /// Connection requests refused because the context held `ContextOptions::max_connections` already.
    pub refused_over_limit: u64,
    /// Connection requests refused because the listener's backlog (connections being set up, and established
    /// ones not yet accepted) was full.
    pub refused_backlog_full: u64,
    /// Incoming connections that failed, went silent or broke the handshake before they were established, and
    /// requests refused for a bad handshake: ended inside, never handed to an `accept`.
    pub dropped_before_accept: u64,
    /// Device-visible memory the connections hold now: control send and receive slots and stream buffers
    /// (these only once the peer needed one and the application reads). The shared pool is counted in `pool`.
    /// What [`crate::ContextOptions::memory_budget`] bounds.
    pub connection_bytes: u64,
    /// Stream buffers a peer asked for that the memory budget could not hold (the connection went on with direct
    /// transfers only).
    pub rings_refused: u64,
    /// Times the transport was armed before a sleep (a system call or several on software providers).
    pub arms: u64,
    /// Times the connection-event channel was read (a system call on software providers).
    pub cm_polls: u64,
    /// Timers set now (at most one of each kind per socket; a round looks only at the earliest), counting a
    /// connection's acknowledgment timer left behind to fire early.
    pub timers: u64,
}

/// Counters of one connection (for tests and tools).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ConnStats {
    /// Control link.
    pub link: LinkStats,
    /// Message mode.
    pub message: MessageStats,
    /// Stream mode.
    pub stream: StreamStats,
    /// Control receive buffers posted for the peer.
    pub window_in: u32,
    /// Bytes of each.
    pub slot_size: usize,
    /// Bytes of the sends (and sendfiles) that completed.
    pub bytes_sent: u64,
    /// Bytes of the receives that completed.
    pub bytes_received: u64,
    /// A round-trip estimate: how long the connection handshake took, from the connect (or, accepting, from the
    /// request's arrival) to the connection being up. It includes the peer's own handling of the handshake, so it
    /// is an upper bound of the network's round trip.
    pub handshake: Option<std::time::Duration>,
}

//! The shared receive pool: control receive buffers for every connection of a context (seed 003).
//!
//! Without it, each connection posts `W` receive buffers of its own, so receive memory grows with the number of
//! connections. With it, the context posts buffers to one shared receive queue that every connection draws from
//! (`dat_srq_post_recv`: "posts the receive buffer that can be used for the incoming message ... by any connected
//! EP that uses SRQ"), and a connection owns no receive memory at all.
//!
//! Rules of seed 003 this module and the engine keep:
//! * **Any endpoint may dequeue any buffer**, so every buffer has the one slot size of the context ("Consumers
//!   should post a buffer large enough to handle incoming message on any of these Endpoint connections").
//! * **Order per connection only**: "The posted Recv DTOs will complete in the order of Send postings to the other
//!   endpoint of each connection ... There is no ordering among different connections." The engine hands each
//!   completion to the connection that dequeued it, in completion-queue order, and nothing else.
//! * **Flush back**: "All the buffers that the Endpoint has not completed by the time of transition into
//!   Disconnected state ... will be flushed." A flushed buffer, or one whose connection is gone, goes straight
//!   back to the pool.
//! * **Low watermark** (`dat_srq_set_lw`): when the buffers still posted fall below the watermark, the pool grows
//!   by another chunk, up to its maximum.
//!
//! Flow control is unchanged: each connection still promises its peer `W` buffers through link credits, so one
//! peer cannot take more than `W` buffers at once. Where the transport retries a message that finds no receive
//! (receiver-not-ready with infinite retry on InfiniBand/RoCE), the promises of all connections together may
//! exceed the pool: a burst that empties it is a delay rather than an error, while the progress engine reposts
//! each buffer as soon as its message is processed.
//!
//! iWARP has no such retry: a message that finds the queue empty ends its connection (seed 002, 3.2: "or the RDMA
//! hardware will cause a fatal error"). There the pool is off unless the application requires it, and then it
//! **covers its promises**: before a connection promises its window, the pool grows to hold a buffer for every
//! credit of every connection on it, plus a margin ([`RecvPool::cover_promises`]); a connection the pool cannot
//! cover is refused. Buffers a round took go back before any credit leaves (`Engine::finish_round`); the margin is
//! room for those of connections already gone (their promise released, their completions not yet read). Receive
//! memory then grows with the connections, as with receives of their own (less of it only where those hold several
//! coalesced messages a buffer, SOCK_SEQPACKET's), and the guarantee holds for peers that
//! keep to their credits: a peer that sends past them takes buffers promised to others (it is closed for the
//! overrun once its count shows it), where receives of a connection's own would end only its connection.

use std::collections::HashMap;
use std::sync::Arc;

use exs_dma::DmaBuf;

use crate::error::Violation;
use crate::proto::link::{wr_id, Slots, WrKind};
use crate::transport::{EndpointId, Registration, WorkRequest};

/// Counters of the pool.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct PoolStats {
    /// Buffers the pool owns.
    pub slots: u32,
    /// Bytes of one buffer.
    pub slot_size: usize,
    /// Buffers posted to the shared queue now.
    pub posted: u32,
    /// Lowest number of posted buffers seen.
    pub low_mark: u32,
    /// Times the pool grew.
    pub grown: u32,
    /// Messages received through the pool.
    pub received: u64,
    /// Buffers that came back flushed (their connection went down first).
    pub flushed: u64,
    /// Receives that failed otherwise (a message longer than the pool's buffers, a device's error); each closes
    /// its connection.
    pub failed: u64,
    /// Buffers promised to the peers of the connections on the pool, where the pool covers its promises (a
    /// transport without receiver-not-ready retry, iWARP); 0 elsewhere.
    pub promised: u32,
    /// Buffers the transport refused to take back (a failed repost): the pool counts them gone.
    pub lost: u32,
}

/// See the module documentation.
#[derive(Debug)]
pub(crate) struct RecvPool {
    chunks: Vec<Slots>,
    chunk_slots: u32,
    max_slots: u32,
    low_watermark: u32,
    /// Fewest buffers posted since the pool last grew.
    dip: u32,
    /// The first chunk is posted (the low mark counts from there).
    started: bool,
    /// Where the pool covers its promises: the buffers it holds beyond them.
    cover: Option<u32>,
    /// The window each connection promised its peer, while the pool covers its promises.
    promises: HashMap<EndpointId, u32>,
    stats: PoolStats,
}

impl RecvPool {
    /// A pool of `slot_size`-byte buffers that grows by `chunk` up to `max_slots` (the engine creates the shared
    /// queue, then allocates, registers and posts each chunk this pool asks for: [`RecvPool::next_chunk`]).
    pub(crate) fn new(slot_size: usize, chunk: u32, max_slots: u32, low_watermark: u32) -> Self {
        let chunk = chunk.max(1);
        let max_slots = max_slots.max(chunk);
        RecvPool {
            chunks: Vec::new(),
            chunk_slots: chunk,
            max_slots,
            low_watermark: low_watermark.min(chunk),
            dip: 0,
            started: false,
            cover: None,
            promises: HashMap::new(),
            stats: PoolStats {
                slot_size,
                ..PoolStats::default()
            },
        }
    }

    /// Makes the pool cover its promises with `margin` buffers beyond them (see the module documentation).
    pub(crate) fn cover_promises(&mut self, margin: u32) {
        self.cover = Some(margin);
    }

    /// Buffers the pool lacks before a connection may promise its peer `window` more, where it covers its
    /// promises: 0 when it holds enough. Lost buffers do not count.
    pub(crate) fn shortfall(&self, window: u32) -> u32 {
        self.cover.map_or(0, |margin| {
            let usable = self.stats.slots.saturating_sub(self.stats.lost);
            (self.stats.promised + window + margin).saturating_sub(usable)
        })
    }

    /// `n` buffers could not go back to the shared queue: gone for good.
    pub(crate) fn lost(&mut self, n: u32) {
        self.stats.lost += n;
    }

    /// Endpoint `ep` promised its peer `window` buffers (counted where the pool covers its promises; call after
    /// [`RecvPool::shortfall`] says 0).
    pub(crate) fn promise(&mut self, ep: EndpointId, window: u32) {
        if self.cover.is_some() {
            let old = self.promises.insert(ep, window).unwrap_or(0);
            self.stats.promised = self.stats.promised - old + window;
        }
    }

    /// Endpoint `ep` is gone: its peer sends nothing more.
    pub(crate) fn release_promise(&mut self, ep: EndpointId) {
        if let Some(w) = self.promises.remove(&ep) {
            self.stats.promised -= w;
        }
    }

    /// Bytes of the next chunk, when the pool may still grow.
    pub(crate) fn next_chunk(&self) -> Option<usize> {
        let n = self.chunk_slots.min(self.max_slots - self.stats.slots);
        (n > 0).then(|| self.stats.slot_size * n as usize)
    }

    /// Takes a chunk the engine allocated and registered (of [`RecvPool::next_chunk`]'s size); returns its
    /// receives, to post on the shared queue and then report with [`RecvPool::reposted`].
    pub(crate) fn add_chunk(
        &mut self,
        buf: Arc<DmaBuf>,
        reg: Arc<dyn Registration>,
    ) -> Result<Vec<WorkRequest>, Violation> {
        let base = self.stats.slots;
        let n = (buf.len() / self.stats.slot_size.max(1)) as u32;
        let slots = Slots {
            buf,
            reg,
            size: self.stats.slot_size,
            count: n,
        };
        let wrs = (0..n)
            .map(|i| slots.recv_wr(i, wr_id(WrKind::Pool(base + i))))
            .collect::<Result<Vec<_>, Violation>>()?;
        self.chunks.push(slots);
        self.stats.slots += n;
        if base > 0 {
            self.stats.grown += 1;
            tracing::debug!(slots = self.stats.slots, "shared receive pool grew");
        }
        Ok(wrs)
    }

    /// The chunk holding pool slot `id`, and the slot's index inside it.
    pub(crate) fn slot(&self, id: u32) -> Result<(&Slots, u32), Violation> {
        let c = (id / self.chunk_slots) as usize;
        let chunk = self
            .chunks
            .get(c)
            .ok_or_else(|| Violation::BadRange(format!("completion for unknown pool slot {id}")))?;
        Ok((chunk, id % self.chunk_slots))
    }

    /// A buffer left the shared queue (its completion arrived, with `status`).
    pub(crate) fn taken(&mut self, status: &Result<(), crate::transport::WcError>) {
        self.stats.posted = self.stats.posted.saturating_sub(1);
        self.stats.low_mark = self.stats.low_mark.min(self.stats.posted);
        self.dip = self.dip.min(self.stats.posted);
        match status {
            Ok(()) => self.stats.received += 1,
            Err(crate::transport::WcError::Flushed) => self.stats.flushed += 1,
            Err(_) => self.stats.failed += 1,
        }
    }

    /// The receive that goes back to the shared queue for slot `id` (counted by [`RecvPool::reposted`] once the
    /// transport took it).
    pub(crate) fn repost(&mut self, id: u32) -> Result<WorkRequest, Violation> {
        let (chunk, i) = self.slot(id)?;
        chunk.recv_wr(i, wr_id(WrKind::Pool(id)))
    }

    /// `n` buffers went back to the shared queue.
    pub(crate) fn reposted(&mut self, n: usize) {
        self.stats.posted += n as u32;
        self.dip = self.stats.posted;
        if !self.started {
            self.started = true;
            self.stats.low_mark = self.stats.posted;
        }
    }

    /// Whether the pool should grow: the posted buffers fell below the low watermark at some point since it last
    /// grew (checked after each batch of completions, before the batch's buffers are reposted), or it covers its
    /// promises and holds fewer than they and its margin need (lost buffers made up for); and it may.
    pub(crate) fn wants_growth(&self) -> bool {
        // Where the pool covers its promises, lost buffers are made up for as well.
        (self.dip < self.low_watermark || self.shortfall(0) > 0)
            && self.stats.slots < self.max_slots
    }

    pub(crate) fn stats(&self) -> PoolStats {
        self.stats
    }
}

//! SOCK_STREAM: the dynamic stream protocol of seed 001.
//!
//! Data moves by RDMA write-with-immediate ("WWI"), either **directly** into a receive buffer the peer advertised
//! (zero copy, seed 001 Figure 1) or **indirectly** into the peer's intermediate stream buffer, from which the
//! receiver copies into its receives (Figure 2). The 32-bit immediate says which, and how many bytes ([`Imm`]).
//!
//! ## Sequence numbers and phases (seed 001)
//! Sequence numbers count bytes. The sender's `seq` is the number of bytes it has sent. The receiver cannot know
//! how many bytes a receive will get (1 <= m <= n), so each advertisement carries an *estimated* next-expected
//! sequence number: "the estimate is incremented by 1 after each advertisement is sent. When any exs recv()
//! operation completes, if an advertisement was sent for the operation ... we add the difference". With
//! MSG_WAITALL, m = n is known, so the estimate uses it. A receive is never advertised while the stream buffer
//! holds bytes it will take, so the first advertisement after the two sides resynchronise carries the exact
//! number.
//!
//! The phase rules, each cited where it is implemented:
//! * "During an even numbered phase, direct transfers are always allowed."
//! * "When the sender sends an indirect transfer, it increments its phase to an odd number. Similarly, when the
//!   receiver receives an indirect transfer, it also increments its phase if it was previously even."
//! * "During an odd phase, the receiver will remain passive until it has flushed all previous advertisements (by
//!   receiving indirect transfers), at which point it will increment its phase and send a new advertisement."
//! * "During an odd phase, an advertisement can only be accepted by the sender if the advertisement has a higher
//!   phase number than the current phase number at the sender, and the sequence number of the advertisement
//!   matches the sender's current sequence number."
//! * "Once the sender accepts an advertisement, the sender increments its phase back to even. However, if an
//!   advertisement with a higher phase number is rejected, the sender increments its phase to the first odd number
//!   beyond the advertisement's phase."
//!
//! Phases count without end in the seed; ours are 32-bit, wrap on both sides alike (parity is kept: 2^32 is even)
//! and compare as serial numbers ([`later_phase`]): a long-lived connection that went indirect two billion times
//! (hours of small request/response flushes) keeps its direct transfers.
//!
//! Together they ensure that "when a direct transfer responding to advertisement A arrives at the receiver, the
//! exs recv() operation corresponding to advertisement A is at the head of the exs recv() queue"; the receiver
//! checks it and treats anything else as a protocol violation.
//!
//! ## Stream-buffer space
//! The sender tracks the bytes it wrote into the peer's stream buffer (`tail`) and the bytes the receiver
//! reported consumed; it never writes more than the difference allows. The receiver reports consumption in every
//! advertisement and in STREAM_WINDOW messages, sent when the sender's view of the buffer is at least half full.
//! A sender blocked on space therefore always gets an update as soon as anything is consumed.
//!
//! ## Packing small writes
//! Queued sends are gathered into one write (up to the transport's scatter/gather limit), so a burst of small
//! writes costs one network operation per batch, not per write. With coalescing on (the default), a batch smaller
//! than a full write waits while an earlier write is in flight, so that the sends behind it join it (issue 12; like
//! TCP's autocorking: nothing waits longer than one write's completion, and a lone send never waits).
//!
//! A batch of at most [`SMALL_VIA_RING`] bytes goes through the stream buffer even when an advertisement is there
//! (one copy of a few bytes costs less than an advertisement per write). With coalescing on, a receiver that sees
//! its advertisements passed over by [`QUIET_AFTER_FLUSHES`] small writes with no large transfer between stops
//! advertising (MSG_WAITALL receives excepted) until a large transfer (more than [`SMALL_VIA_RING`], or half its
//! buffer or more) comes: each advertisement would be flushed by the next small write and sent again, so a
//! request/response stream would carry two control messages per round trip beside its data.

use std::collections::VecDeque;
use std::sync::Arc;

use exs_dma::DmaBuf;

use crate::error::{OpError, Violation};
use crate::options::{MsgFlags, SocketOptions};
use crate::proto::limits::Limits;
use crate::proto::link::{DataOp, Link};
use crate::proto::op::EventFlags;
use crate::proto::op::OpToken;
use crate::transport::{Exposure, Registration, RemoteRef, Sge, WcError};
use crate::wire::{Body, CloseReason, Handshake, Imm, StreamAdvert};

/// Counters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct StreamStats {
    /// Direct transfers sent (zero copy into an advertised receive).
    pub direct_sent: u64,
    /// Bytes sent directly.
    pub direct_bytes: u64,
    /// Indirect transfers sent (into the peer's stream buffer).
    pub indirect_sent: u64,
    /// Bytes sent indirectly.
    pub indirect_bytes: u64,
    /// Sends packed together with others into one transfer.
    pub packed_sends: u64,
    /// Advertisements sent.
    pub adverts_sent: u64,
    /// Peer advertisements accepted in an odd phase (resynchronisation).
    pub adverts_accepted: u64,
    /// Peer advertisements rejected.
    pub adverts_rejected: u64,
    /// Window updates sent.
    pub window_updates: u64,
    /// Times the sender waited for stream-buffer space.
    pub space_stalls: u64,
    /// Times the sender's queued sends were looked at and held for the receiver's next advertisement rather than
    /// sent through the stream buffer (each flush of the connection while it waits counts; large receives: see
    /// `StreamProto::waits_for_advert` and `resync_room`).
    pub advert_waits: u64,
    /// Receiver: bytes copied out of the stream buffer into receives (once each; direct bytes are not copied).
    pub copied_bytes: u64,
}

/// One protocol decision, recorded when tracing is on (tests rebuild the seed's figures from these).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum StreamTrace {
    /// Receiver: advertisement number `id` sent.
    AdvertSent {
        /// The advertisement's number (1, 2, 3, ... on this connection).
        id: u32,
        /// The estimated sequence number of the first byte the advertised receive will get.
        seq: u64,
        /// Bytes advertised (the room left in the receive).
        len: u64,
        /// The receiver's phase, carried by the advertisement.
        phase: u32,
    },
    /// Receiver: its phase changed.
    ReceiverPhase {
        /// The new phase (odd after an indirect transfer arrived in an even phase, even once resynchronised).
        phase: u32,
    },
    /// Receiver: a receive completed (`advertised`: an advertisement had been sent for it).
    RecvCompleted {
        /// Bytes the receive got.
        bytes: u64,
        /// An advertisement had been sent for it (its estimate is then corrected by the difference).
        advertised: bool,
    },
    /// Sender: a peer advertisement was accepted in an odd phase.
    Accepted {
        /// The advertisement's sequence number (equal to the sender's).
        seq: u64,
        /// The advertisement's phase, which becomes the sender's.
        phase: u32,
    },
    /// Sender: a peer advertisement was rejected; `sender_seq` is the sender's position when it judged it,
    /// `sender_phase` its phase afterwards.
    Rejected {
        /// The advertisement's sequence number.
        seq: u64,
        /// The advertisement's phase.
        phase: u32,
        /// The sender's sequence number (bytes sent) when it judged the advertisement.
        sender_seq: u64,
        /// The sender's phase after the rejection.
        sender_phase: u32,
    },
    /// Sender: a direct transfer (into the advertisement of `advert_seq`).
    Direct {
        /// Sequence number of the transfer's first byte (bytes sent before it).
        seq: u64,
        /// Bytes transferred.
        len: u64,
        /// The sender's phase (even: the advertisement's).
        phase: u32,
        /// Sequence number of the advertisement the bytes went into.
        advert_seq: u64,
    },
    /// Sender: an indirect transfer.
    Indirect {
        /// Sequence number of the transfer's first byte (bytes sent before it).
        seq: u64,
        /// Bytes transferred into the peer's stream buffer.
        len: u64,
        /// The sender's phase after the transfer (odd).
        phase: u32,
    },
}

/// Our intermediate stream buffer's size. The buffer itself is allocated, registered and exposed only when the
/// peer first asks for it (STREAM_RING_WANTED), so an idle connection holds none (they were allocated at connect:
/// a server's idle connections held a full stream buffer each).
#[derive(Debug, Clone, Copy)]
pub(crate) struct StreamSetup {
    pub len: usize,
}

/// Our stream buffer once allocated: the memory, its registration, and the peer's key to it.
#[derive(Debug)]
struct LocalRing {
    /// The peer writes indirect transfers here; we copy out of `buf`. Dropped before `buf` and `_reg`.
    _exposure: Box<dyn Exposure>,
    buf: Arc<DmaBuf>,
    _reg: Arc<dyn Registration>,
    /// What it costs the context's memory budget.
    _charge: crate::budget::Charge,
}

/// A stream receive's memory (seed 001). A receive is exposed for the peer's direct transfers only when it is
/// advertised: one filled from the stream buffer before its turn to be advertised (the writer ahead of the
/// reader, receives queued deep) never has a key, so it costs no registration and exposes nothing. The protocol
/// asks for the key ([`StreamProto::take_recv_to_key`]) and the engine makes it as the context's exposure
/// policy says ([`StreamProto::give_recv_key`]).
#[derive(Debug)]
pub(crate) enum StreamRecvMemory {
    /// Exposed for the peer's direct transfers: it may be advertised.
    Keyed(Box<dyn Exposure>),
    /// Leased for our copies out of the stream buffer, no key yet. `keyable`: it may be given one to be
    /// advertised (not once the peer has closed: it writes nothing more).
    Unkeyed { sge: Sge, keyable: bool },
    /// With the engine for its key, between [`StreamProto::take_recv_to_key`] and
    /// [`StreamProto::give_recv_key`] (no other call comes in between).
    Keying,
}

impl StreamRecvMemory {
    fn len(&self) -> usize {
        match self {
            StreamRecvMemory::Keyed(e) => e.len(),
            StreamRecvMemory::Unkeyed { sge, .. } => sge.len(),
            StreamRecvMemory::Keying => 0,
        }
    }

    /// Copies `len` bytes of `src` from `src_offset` into the receive at `offset`.
    fn fill_from(
        &mut self,
        offset: usize,
        src: &DmaBuf,
        src_offset: usize,
        len: usize,
    ) -> Result<(), String> {
        match self {
            StreamRecvMemory::Keyed(e) => e
                .fill_from(offset, src, src_offset, len)
                .map_err(|e| e.to_string()),
            StreamRecvMemory::Unkeyed { sge, .. } => sge
                .fill_from(offset, src, src_offset, len)
                .map_err(|e| e.to_string()),
            StreamRecvMemory::Keying => Err("a receive being keyed was filled".into()),
        }
    }
}

#[derive(Debug)]
struct RecvOp {
    ticket: OpToken,
    mem: StreamRecvMemory,
    len: usize,
    filled: usize,
    waitall: bool,
    /// Set when advertised: bytes this receive was counted for in `src_seqno` (filled then + estimate).
    counted: Option<u64>,
}

#[derive(Debug)]
struct SendOp {
    id: u32,
    ticket: Option<OpToken>,
    rest: Option<Sge>,
    len: usize,
    in_flight: u32,
    failed: Option<OpError>,
}

#[derive(Debug)]
struct PeerAdvert {
    remote: RemoteRef,
    len: u64,
    used: u64,
    seq: u64,
    phase: u32,
    waitall: bool,
}

#[derive(Debug)]
struct Rx {
    /// Our stream buffer, once the peer asked for it; the peer cannot write before it has the key.
    ring: Option<LocalRing>,
    /// The peer asked for the stream buffer (the engine allocates it; see [`StreamProto::ring_needed`]).
    ring_wanted: bool,
    /// Our application reads (a receive, or a poll for readability): the buffer serves data now (see
    /// [`StreamProto::ring_needed`]).
    reading: bool,
    /// The memory budget could not hold it; asked again at the next receive.
    ring_refused: bool,
    ring_len: u64,
    /// Bytes copied out of the stream buffer (cumulative).
    head: u64,
    /// Bytes written into it by the peer (cumulative).
    tail: u64,
    /// `head` as last reported to the peer.
    reported: u64,
    recvs: VecDeque<RecvOp>,
    phase: u32,
    /// Estimated sequence number of the first byte of the next receive to advertise.
    src_seqno: u64,
    /// Advertised receives not yet completed.
    outstanding: usize,
    next_advert: u32,
    eof: bool,
    /// The connection went down without the peer's close (a reset): once the bytes the stream buffer holds have
    /// been read, receives fail with this error rather than see end-of-stream.
    reset: Option<OpError>,
    /// Our receiving side ended ([`StreamProto::fail_receives`]): whatever the peer still writes is dropped.
    closed: bool,
    /// Receives that failed before the endpoint was released (the peer may still write an exposed one): their
    /// events wait for the release.
    retired: Vec<(StreamRecvMemory, OpToken, OpError)>,
    /// The next receive to advertise has no key yet: the engine is asked for one (see [`StreamRecvMemory`]).
    key_wanted: bool,
    /// The hold of a window update expired while `key_wanted` (see `decide_window`).
    window_forced: bool,
    /// Window updates may wait for the acknowledgment delay (an advertisement in the meantime carries them).
    defer_windows: bool,
    /// A window update is due and waits (see `maybe_window`).
    window_deferred: bool,
    /// The peer sends small writes through the stream buffer (see `small_via_ring`): it sent a small indirect
    /// transfer though our advertisements were outstanding, or a small direct one while we held space back (it
    /// fell back on the receive for want of space), and no large transfer since (see `on_write_imm`). Space is
    /// then neither held back for advertisements nor delayed, and one advertisement at a time is outstanding (a
    /// sender with more to send uses it for a large direct transfer, which ends this); after
    /// [`QUIET_AFTER_FLUSHES`] small flushes, with coalescing on, only MSG_WAITALL receives are advertised, until a
    /// large transfer through the buffer.
    ring_chosen: bool,
    /// Small indirect transfers that flushed an outstanding advertisement since the last large transfer (see
    /// `advertise`).
    small_flushes: u32,
}

#[derive(Debug)]
struct Tx {
    sends: VecDeque<SendOp>,
    adverts: VecDeque<PeerAdvert>,
    /// Transfers in flight, in posting order, with the sends they carry and their bytes if direct into a receive
    /// of [`RESYNC_MIN`] bytes or more (else 0).
    writes: VecDeque<(u32, Vec<u32>, u64)>,
    /// Bytes of the direct transfers into receives of [`RESYNC_MIN`] bytes or more in flight.
    direct_in_flight: u64,
    phase: u32,
    seq: u64,
    /// The peer's stream buffer: from the handshake, or from its STREAM_RING message (indirect transfers wait
    /// for it).
    ring: Option<RemoteRef>,
    /// STREAM_RING_WANTED has been sent.
    ring_requested: bool,
    ring_len: u64,
    tail: u64,
    consumed: u64,
    /// A large advertisement was rejected: indirect transfers go on only up to this sequence number, where the
    /// receiver's rejected advertisements are filled, then wait for its next one (see `resync_room`). It may be
    /// behind `seq` (the indirect bytes sent already fill them): the sender then waits at once.
    resync_hold: Option<u64>,
    /// Where the receives rejected since the last resynchronisation end, small ones included (see
    /// `chain_rejected`).
    resync_chain: Option<u64>,
    /// The receiver consumed more of the stream buffer while the sender held: the hold's time limit starts again
    /// (see `StreamProto::take_resync_progress`).
    resync_progress: bool,
    /// The consumption that last counted as progress during the hold (or where the hold began).
    resync_mark: u64,
    /// Where the first indirect transfer of the current odd phase began: the receives advertised in the even phase
    /// before it and not used by a direct transfer are filled from here on (see `chain_rejected`).
    odd_from: u64,
    next_id: u32,
    next_tag: u32,
}

/// Stream-mode state of one connection. See the module documentation.
#[derive(Debug)]
pub(crate) struct StreamProto {
    rx: Rx,
    tx: Tx,
    /// Peer advertisements that may wait here: the advert credits we granted (`recv_credits`).
    max_adverts_in: usize,
    /// Our receives that may be advertised and not yet completed: the peer's `recv_credits`.
    max_adverts_out: usize,
    max_chunk: usize,
    max_sge: usize,
    /// Small batches wait for the write in flight (see "Packing small writes").
    coalesce: bool,
    trace: Option<Vec<StreamTrace>>,
    stats: StreamStats,
}

/// A batch of queued sends this large goes at once even while a write is in flight (see "Packing small writes").
const CORK_BYTES: usize = 16 << 10;

/// Queued sends of at most this many bytes in all go through the stream buffer even when an advertisement is
/// there (see `small_via_ring`).
const SMALL_VIA_RING: usize = 16 << 10;

/// Receives of at least this many bytes are worth waiting for: a sender that finds no advertisement waits while
/// this much of its direct transfers into receives this large is in flight (`StreamProto::waits_for_advert`),
/// and one that rejected an
/// advertisement this large pauses its indirect transfers until the receiver can advertise again
/// (`StreamProto::resync_room`). The copy into and out of the stream buffer that a direct transfer saves is worth
/// a pause of a round trip; smaller receives are filled from the buffer (see
/// `bulk_sends_into_small_receives_are_not_a_write_per_receive`).
const RESYNC_MIN: u64 = 64 << 10;

/// The longest a sender that rejected a large advertisement waits for the next one, or for the receiver's next
/// progress through the stream buffer (see `StreamProto::resync_room` and `StreamProto::take_resync_progress`):
/// long enough for a receiver on a loaded machine to fill its rejected receives from the stream buffer and
/// advertise again, and longer than the [`WINDOW_HOLD`] by which a receiver may defer reporting that progress;
/// short enough that a receiver that stopped reading holds the sender's queued bytes out of its buffer only
/// briefly.
pub(crate) const RESYNC_HOLD: std::time::Duration = WINDOW_HOLD.saturating_mul(2);

/// With coalescing on, this many small writes that passed over an advertisement (each flushed it), with no large
/// transfer between, stop the advertisements until a large transfer: a request/response stream, not a header
/// before each bulk body.
const QUIET_AFTER_FLUSHES: u32 = 4;

/// The peer's stream buffer, `len` bytes at `addr`, must not wrap around the address space (issue 15: a handshake
/// whose address plus length overflowed made a later write's address overflow).
fn ring_fits(addr: u64, len: u64) -> Result<(), String> {
    match addr.checked_add(len) {
        Some(_) => Ok(()),
        None => Err(format!(
            "stream buffer of {len} bytes at {addr:#x} overflows the address space"
        )),
    }
}

/// How long space consumed in an even phase waits for the application's next receive, so that its advertisement
/// reaches a blocked sender before the space does (see `StreamProto::maybe_window`). Long enough for an
/// application to repost on a loaded machine; it only ever delays a sender whose receiver has read what it had
/// and posted nothing since.
pub(crate) const WINDOW_HOLD: std::time::Duration = std::time::Duration::from_millis(10);

/// The peer's stream buffer as its handshake describes it must be usable: large enough, and every address we will
/// write at (its start plus an offset below its length) must exist.
pub(crate) fn check_peer_ring(peer: &Handshake) -> Result<(), Violation> {
    if peer.stream_len < 64 {
        return Err(Violation::Handshake(format!(
            "stream buffer of {} bytes is too small",
            peer.stream_len
        )));
    }
    ring_fits(peer.stream_addr, u64::from(peer.stream_len)).map_err(Violation::Handshake)
}

impl StreamProto {
    pub(crate) fn new(
        setup: StreamSetup,
        peer: &Handshake,
        opts: &SocketOptions,
        limits: Limits,
        defer_windows: bool,
    ) -> Result<Self, Violation> {
        check_peer_ring(peer)?;
        Ok(StreamProto {
            rx: Rx {
                ring: None,
                ring_wanted: false,
                reading: false,
                ring_refused: false,
                ring_len: setup.len as u64,
                head: 0,
                tail: 0,
                reported: 0,
                recvs: VecDeque::new(),
                phase: first_phase(),
                src_seqno: 0,
                outstanding: 0,
                next_advert: 1,
                eof: false,
                reset: None,
                closed: false,
                retired: Vec::new(),
                key_wanted: false,
                window_forced: false,
                defer_windows,
                window_deferred: false,
                ring_chosen: false,
                small_flushes: 0,
            },
            tx: Tx {
                sends: VecDeque::new(),
                adverts: VecDeque::new(),
                writes: VecDeque::new(),
                direct_in_flight: 0,
                phase: first_phase(),
                seq: 0,
                // Address and key 0: they follow in a STREAM_RING message (keys bound after connect).
                ring: (peer.stream_addr != 0 || peer.stream_rkey != 0).then_some(RemoteRef {
                    addr: peer.stream_addr,
                    key: peer.stream_rkey,
                }),
                ring_requested: false,
                ring_len: u64::from(peer.stream_len),
                tail: 0,
                consumed: 0,
                resync_hold: None,
                resync_chain: None,
                resync_progress: false,
                resync_mark: 0,
                odd_from: 0,
                next_id: 0,
                next_tag: 0,
            },
            max_adverts_in: usize::from(opts.recv_credits.max(1)),
            max_adverts_out: usize::from(peer.recv_credits.max(1)),
            max_chunk: (limits.max_message.min(u64::from(Imm::MAX_LEN))) as usize,
            max_sge: 4,
            coalesce: opts.coalesce,
            trace: opts.trace.then(Vec::new),
            stats: StreamStats::default(),
        })
    }

    pub(crate) fn set_max_sge(&mut self, n: u32) {
        self.max_sge = (n as usize).clamp(1, 16);
    }

    /// Turns the gathering of small writes behind the write in flight on or off (see "Packing small writes").
    pub(crate) fn set_coalesce(&mut self, on: bool) {
        self.coalesce = on;
    }

    /// Starts recording transfers (what was recorded before is kept), or stops and drops the records.
    pub(crate) fn set_trace(&mut self, on: bool) {
        match (on, &self.trace) {
            (true, None) => self.trace = Some(Vec::new()),
            (false, Some(_)) => self.trace = None,
            _ => {}
        }
    }

    pub(crate) fn stats(&self) -> StreamStats {
        self.stats
    }

    /// The length of stream buffer to allocate, register and expose (seed 001: the peer writes it at any time,
    /// so the lease is of the shared device-write kind), once the peer asked for it and until it is set.
    ///
    /// Issue 27: a peer's STREAM_RING_WANTED (16 bytes) used to make every connection allocate and pin its whole
    /// buffer, with nothing bounding them all. The engine now charges it to the context's memory budget, and under
    /// pressure gives it only to connections whose application reads ([`StreamProto::is_reading`]; before that
    /// the peer's data would only wait in it). Without it the peer sends directly into the receives we advertise
    /// (seed 001), as it does whenever it has an advertisement.
    pub(crate) fn ring_needed(&self) -> Option<usize> {
        let rx = &self.rx;
        (rx.ring_wanted && !rx.ring_refused && rx.ring.is_none() && !rx.eof && !rx.closed)
            .then_some(rx.ring_len as usize)
    }

    /// Whether our application reads on this connection (see [`StreamProto::reading`]).
    pub(crate) fn is_reading(&self) -> bool {
        self.rx.reading
    }

    /// The memory budget could not hold the stream buffer: the connection goes on without it until our next
    /// receive.
    pub(crate) fn ring_refused(&mut self) {
        self.rx.ring_refused = true;
    }

    /// Our stream buffer is allocated and exposed: its address and key go to the peer (STREAM_RING).
    pub(crate) fn set_local_ring(
        &mut self,
        exposure: Box<dyn Exposure>,
        buf: Arc<DmaBuf>,
        reg: Arc<dyn Registration>,
        charge: crate::budget::Charge,
        link: &mut Link,
    ) {
        let r = exposure.remote();
        self.rx.ring = Some(LocalRing {
            _exposure: exposure,
            buf,
            _reg: reg,
            _charge: charge,
        });
        link.push_ctrl(
            Body::StreamRing {
                addr: r.addr,
                rkey: r.key,
            },
            None,
            None,
        );
    }

    /// The peer asks for our stream buffer (once; a repeated request changes nothing).
    pub(crate) fn on_ring_wanted(&mut self) {
        self.rx.ring_wanted = true;
    }

    /// Our application reads (a receive, or a poll for readability): a stream buffer the peer asked for now serves
    /// data; one the memory budget refused is asked for again.
    pub(crate) fn reading(&mut self) {
        self.rx.reading = true;
        self.rx.ring_refused = false;
    }

    /// The socket wants its stream buffer at once (`SocketOptions::stream_buffer_eager`): as if the peer had asked
    /// and the application were reading.
    pub(crate) fn want_ring_now(&mut self) {
        self.rx.ring_wanted = true;
        self.rx.reading = true;
    }

    /// The peer's STREAM_RING: its stream buffer's address and key, once (only when the handshake carried none).
    pub(crate) fn on_ring(
        &mut self,
        addr: u64,
        rkey: u64,
        link: &mut Link,
    ) -> Result<(), Violation> {
        if self.tx.ring.is_some() {
            return Err(Violation::Stream(
                "a second stream buffer key (STREAM_RING)".into(),
            ));
        }
        ring_fits(addr, self.tx.ring_len).map_err(Violation::Stream)?;
        self.tx.ring = Some(RemoteRef { addr, key: rkey });
        self.pump(link)
    }

    /// The recorded protocol decisions (tracing on), oldest first.
    pub(crate) fn take_trace(&mut self) -> Vec<StreamTrace> {
        self.trace.as_mut().map(std::mem::take).unwrap_or_default()
    }

    fn record(&mut self, t: StreamTrace) {
        if let Some(v) = &mut self.trace {
            v.push(t);
        }
    }

    /// Whether a receive would find data (or end-of-stream) at once.
    pub(crate) fn readable(&self) -> bool {
        self.rx.tail > self.rx.head || self.rx.eof
    }

    /// A send would move bytes at once: room in the peer's stream buffer, or an advertised receive. A fresh
    /// connection is writable: the first send asks for the peer's stream buffer, which is empty.
    pub(crate) fn writable(&self) -> bool {
        let space = match self.tx.ring {
            Some(_) => self.tx.ring_len > self.tx.tail - self.tx.consumed,
            None => !self.tx.ring_requested,
        };
        space || !self.tx.adverts.is_empty()
    }

    /// Every send has been handed to the link (nothing waits for space or an advert).
    pub(crate) fn sends_posted(&self) -> bool {
        self.tx.sends.iter().all(|s| s.rest.is_none())
    }

    /// Every send has completed.
    pub(crate) fn sends_done(&self) -> bool {
        self.tx.sends.is_empty()
    }

    // -----------------------------------------------------------------------------------------------------------
    // Sender

    // -----------------------------------------------------------------------------------------------------------
    // Receiver

    /// The peer closed, or shut down its sending side.
    pub(crate) fn on_peer_close(&mut self, reason: CloseReason) {
        self.rx.eof = true;
        // Everything the peer sent arrived before its CLOSE (one ordered connection); what is in the stream
        // buffer is still delivered to receives that are already posted or come later.
        let _ = self.drain();
        if self.rx.tail == self.rx.head {
            self.finish_eof();
        }
        if reason != CloseReason::ShutdownWrite {
            self.fail_sends(OpError::PeerClosed);
        }
    }

    /// The connection went down without the peer's close (`err`: a reset, a timeout, a failure). As TCP delivers
    /// the bytes it acknowledged before a reset, what the stream buffer holds goes to the receives posted and to
    /// later ones (the engine keeps the connection's receiving state for them); then receives fail with `err`.
    /// Called before [`StreamProto::drop_all`] fails what is left. After the peer's close, its end-of-stream
    /// stands.
    pub(crate) fn on_reset(&mut self, err: OpError) {
        if self.rx.eof {
            return;
        }
        self.rx.eof = true;
        self.rx.reset = Some(err);
        let _ = self.drain();
        if self.rx.tail == self.rx.head {
            self.finish_eof();
        }
    }

    /// Whether the stream buffer holds bytes no receive has taken yet.
    pub(crate) fn holds_unread(&self) -> bool {
        self.rx.tail > self.rx.head
    }

    /// Fails the sends not yet done. A send part of which was handed to the transport may have reached the peer:
    /// it is never reported `Cancelled` (issue 14), but `Aborted`.
    fn fail_sends(&mut self, err: OpError) {
        self.end_resync();
        for s in self.tx.sends.iter_mut() {
            let started = s.in_flight > 0 || s.rest.as_ref().is_none_or(|r| r.len() < s.len);
            s.rest = None;
            s.failed
                .get_or_insert_with(|| err.clone().once_started(started));
        }
        self.complete_sends();
    }

    /// Fails the sends that still have bytes to send (the peer stopped receiving); those wholly written complete
    /// as their writes do (the bytes are in the peer's memory).
    pub(crate) fn fail_pending_sends(&mut self, err: OpError) {
        for s in self.tx.sends.iter_mut().filter(|s| s.rest.is_some()) {
            let started = s.in_flight > 0 || s.rest.as_ref().is_some_and(|r| r.len() < s.len);
            s.rest = None;
            s.failed
                .get_or_insert_with(|| err.clone().once_started(started));
        }
        self.complete_sends();
    }

    /// Fails the receives; they report when the endpoint is released (the peer may still write an exposed one).
    pub(crate) fn fail_receives(&mut self, err: OpError) {
        self.rx.closed = true;
        for r in self.rx.recvs.drain(..) {
            self.rx.retired.push((r.mem, r.ticket, err.clone()));
        }
    }

    /// Fails every operation; the receives report when the endpoint is released.
    pub(crate) fn fail(&mut self, err: OpError) {
        self.fail_sends(err.clone());
        self.fail_receives(err);
    }

    /// The endpoint was released: every work request is back; complete everything left.
    pub(crate) fn drop_all(&mut self, err: OpError) {
        for s in self.tx.sends.iter_mut() {
            s.in_flight = 0;
        }
        self.tx.writes.clear();
        self.tx.direct_in_flight = 0;
        self.fail(err);
        for (mem, ticket, e) in self.rx.retired.drain(..) {
            drop(mem);
            let eof = e == OpError::PeerClosed;
            if eof {
                ticket.complete_eof();
            } else {
                ticket.complete(Err(e), 0, EventFlags::default());
            }
        }
    }
}

/// The next phase (seed 001's increments), wrapping at 2^32 on both sides alike.
pub(crate) fn next_phase(phase: u32) -> u32 {
    phase.wrapping_add(1)
}

/// Whether phase `a` is later than `b` (seed 001's "higher phase number"), in serial-number arithmetic (RFC
/// 1982): `a` is less than 2^31 increments ahead of `b`. Phases on a connection are never that far apart.
pub(crate) fn later_phase(a: u32, b: u32) -> bool {
    a != b && a.wrapping_sub(b) < 1 << 31
}

/// The phase both sides start in: 0 (seed 001). A unit test starts its connections near the wrap.
fn first_phase() -> u32 {
    #[cfg(all(test, feature = "sim"))]
    return tests::FIRST_PHASE.with(|p| p.get());
    #[cfg(not(all(test, feature = "sim")))]
    0
}

mod recv;
mod send;
#[cfg(all(test, feature = "sim"))]
mod tests;

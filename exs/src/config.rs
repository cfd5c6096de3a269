//! How a context is set up: its options, its clock and how it makes progress (below the context and its engine,
//! which both read them).

use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::transport::TransportError;

/// A source of time. Real time normally; virtual time in the simulator.
pub trait Clock: Send + Sync + fmt::Debug {
    /// Now.
    fn now(&self) -> Instant;

    /// Whether this clock is real time itself ([`SystemClock`]): its instants need no translation into real
    /// time, which costs a reading of each clock (on every received message's path).
    fn is_real_time(&self) -> bool {
        false
    }
}

/// The time, read from a clock the first time it is asked for, then the same: most flushes start no timer and
/// need no time at all (a clock reading costs tens of nanoseconds, on every message's path).
pub(crate) struct LazyNow<'a> {
    at: Option<Instant>,
    clock: &'a dyn Clock,
}

impl<'a> LazyNow<'a> {
    /// `at` if already read (a round reads the clock once for all it does), else `clock` when first asked.
    pub(crate) fn new(at: Option<Instant>, clock: &'a dyn Clock) -> Self {
        LazyNow { at, clock }
    }

    pub(crate) fn get(&mut self) -> Instant {
        *self.at.get_or_insert_with(|| self.clock.now())
    }

    /// The time if it was read.
    pub(crate) fn at(&self) -> Option<Instant> {
        self.at
    }
}

/// `d`, or a century if longer: a setting too long to count (`Duration::MAX` for "never") still adds to an
/// `Instant` without the panic of `Instant + Duration::MAX`, and a century never comes. It also fits in the progress
/// thread's nanosecond stamps.
pub(crate) fn countable(d: Duration) -> Duration {
    d.min(CENTURY)
}

const CENTURY: Duration = Duration::from_secs(100 * 365 * 24 * 3600);

/// The end of a wait of `timeout` from `start`; `None` (no end) for none, and for one too long to count.
pub(crate) fn deadline(start: Instant, timeout: Option<Duration>) -> Option<Instant> {
    timeout.and_then(|t| start.checked_add(t))
}

/// The real clock.
#[derive(Debug, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> Instant {
        Instant::now()
    }

    fn is_real_time(&self) -> bool {
        true
    }
}

/// How a context makes progress.
#[derive(Clone)]
#[non_exhaustive]
pub enum Progress {
    /// One background thread sleeping on the transport's wait descriptor (the default).
    Thread,
    /// No thread: `dequeue` calls the driver (the simulated fabric's manual mode).
    Manual(Arc<dyn ManualDriver>),
}

impl fmt::Debug for Progress {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Progress::Thread => f.write_str("Thread"),
            Progress::Manual(_) => f.write_str("Manual"),
        }
    }
}

/// Drives a manually progressed world (implemented by the simulator).
pub trait ManualDriver: Send + Sync {
    /// Makes progress; returns false when nothing more can happen.
    fn drive(&self) -> bool;
}

/// Settings of a context. It will grow: start from `ContextOptions::default()` and set fields.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct ContextOptions {
    /// How progress is made.
    pub progress: Progress,
    /// Time source.
    pub clock: Arc<dyn Clock>,
    /// How long a graceful close may take to deliver the sends already posted and its CLOSE before the connection
    /// is torn down anyway (default 10 s).
    pub linger: Duration,
    /// How long a connect may take before it fails with a timeout (default 10 s; more than zero).
    pub connect_timeout: Duration,
    /// Request/response traffic: how long an acknowledgment may wait for a reply to carry it (zero: never wait).
    /// One-way traffic is always acknowledged at once.
    pub ack_delay: Duration,
    /// The shared receive pool (the shared receive queue design).
    pub shared_recv: SharedRecv,
    /// Keepalive: a connection that posted nothing for this long sends a probe, so a peer that vanished (host
    /// down, cable pulled) is detected by the transport's retries even when the application is only waiting.
    /// `None`: idle connections never probe. A peer *process* that dies is detected without it (its kernel
    /// tears the connection down). A probe needs a control-buffer credit like any message: a peer whose device
    /// answers but whose side of the protocol returns no credits for two whole intervals while messages wait for
    /// them is closed (`Violation::CreditsWithheld`; a peer process stopped that long, in a debugger or by
    /// SIGSTOP, too: a longer keepalive, or `None`, keeps such connections). Default `Some(10 s)`; zero is
    /// refused.
    pub keepalive: Option<Duration>,
    /// Connections the context holds at most (open, connecting, being accepted or closing). Requests beyond it are
    /// refused (the peer sees `Refused`), and a `connect` fails with `TransportError::Resource`. Default 16,384.
    pub max_connections: usize,
    /// How memory is exposed to peers: a key per operation (the default), or UNH-EXS's key per region and
    /// connection for peers that trust each other ([`crate::ExposurePolicy`]).
    pub exposure: crate::ExposurePolicy,
    /// Bytes of device-visible memory (registered, pinned on hardware) the context's connections may hold in
    /// all: their control buffers and their stream buffers. A connection whose control buffers do not fit is
    /// refused (incoming: the peer sees a refusal; outgoing: `connect` fails with `TransportError::Resource`); a
    /// stream buffer that does not fit is not allocated, and the connection goes on with direct transfers into
    /// the receives it advertises, retrying at its next receive. Memory regions the application allocates are its
    /// own and not counted. Default 1 GiB (like the kernel's own cap on TCP buffers on a machine of a few tens of
    /// GiB): about a thousand stream connections moving data at once with the default 1 MiB stream buffer (others
    /// move theirs directly into the receives they advertise), twenty thousand idle ones, or two thousand
    /// SOCK_SEQPACKET connections on libfabric (each posts its own receive buffers there; on verbs they share the
    /// context's pool).
    pub memory_budget: u64,
}

/// Settings of the shared receive pool: control receive buffers shared by every connection of a context, so receive
/// memory does not grow with the number of connections (the shared receive queue design; `proto::pool` in the source).
/// iWARP has no receiver-not-ready retry: there the pool is off unless required, and a required pool holds a buffer
/// for every credit its connections promised (it grows with them, and a connection beyond `max_slots` is refused).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct SharedRecv {
    /// `None` (default): use the pool when the transport has a shared receive queue and retries a message that finds
    /// no receive posted (`Capabilities::rnr_retry`; not iWARP). `Some(true)`: require it
    /// (connections fail with `Unsupported` where there is none). `Some(false)`: each connection posts its own.
    pub enabled: Option<bool>,
    /// Buffers posted at first, and added each time the pool grows. Default 32: a chunk is one registered buffer,
    /// and every lease taken on it (a receive reposted, a message read) looks at the receives it holds, so a
    /// small chunk keeps what a message costs flat; the pool grows chunk by chunk as connections need it. 0 is
    /// taken as 1.
    pub chunk_slots: u32,
    /// Most buffers the pool grows to (also capped by the transport's queue depth; default 16,384). Below one
    /// chunk it is taken as one chunk.
    pub max_slots: u32,
    /// When fewer buffers than this are posted, the pool grows by a chunk. Above one chunk it is taken as one
    /// chunk.
    pub low_watermark: u32,
    /// Largest immediate payload a pool buffer holds (fixes the context's one slot size; a socket's
    /// `small_packet_max_size` above it is limited to it).
    pub small_packet_max_size: u32,
}

impl Default for SharedRecv {
    fn default() -> Self {
        SharedRecv {
            enabled: None,
            chunk_slots: 32,
            max_slots: 16384,
            low_watermark: 32,
            small_packet_max_size: crate::options::SocketOptions::default().small_packet_max_size,
        }
    }
}

impl ContextOptions {
    /// Refuses settings that mean nothing useful: a keepalive of zero (a probe in every round, and ordinary
    /// back-pressure taken for a peer withholding credits; `None` turns probes off) and a connect timeout of zero
    /// (every connect would fail at once).
    pub(crate) fn check(&self) -> Result<(), TransportError> {
        if self.keepalive == Some(Duration::ZERO) {
            return Err(TransportError::Invalid(
                "ContextOptions::keepalive of zero: give an interval, or None to send no probes"
                    .into(),
            ));
        }
        if self.connect_timeout.is_zero() {
            return Err(TransportError::Invalid(
                "ContextOptions::connect_timeout of zero: every connect would time out at once"
                    .into(),
            ));
        }
        Ok(())
    }
}

impl Default for ContextOptions {
    fn default() -> Self {
        ContextOptions {
            progress: Progress::Thread,
            clock: Arc::new(SystemClock),
            linger: Duration::from_secs(10),
            connect_timeout: Duration::from_secs(10),
            ack_delay: Duration::from_micros(200),
            shared_recv: SharedRecv::default(),
            keepalive: Some(Duration::from_secs(10)),
            max_connections: 16_384,
            exposure: crate::ExposurePolicy::PerOperation,
            memory_budget: 1 << 30,
        }
    }
}

//! A context: one transport (device), its engine, and how it makes progress.
//!
//! ## Progress without a thread per socket
//! The protocol must move (answer adverts, issue reads, send acknowledgments and credits) while the application is
//! blocked in a dequeue or busy elsewhere. A context has **one** progress thread, whatever the number of sockets.
//! It sleeps in `poll(2)` on the transport's wait descriptor (armed first, then polled once more so no
//! notification is lost) and on an eventfd used to stop it; it never spins. An idle connection, and a
//! persistent sender whose peer pulls with RDMA reads, cost it nothing: hardware serves the reads without any
//! completion on the sender.
//!
//! API calls post their work requests directly (posting does not block), so the thread only handles completions.
//!
//! The simulated fabric can instead run in manual mode: no thread, and `dequeue` drives the simulated world until
//! the events it waits for exist, deterministically.

use std::fmt;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use exs_dma::DmaBuf;
use nix::poll::{PollFd, PollFlags};
use nix::sys::eventfd::{EfdFlags, EventFd};
use nix::sys::time::TimeSpec;

use crate::engine::Engine;
use crate::error::MemoryError;
use crate::event::{Driver, EventQueue};
use crate::transport::{Capabilities, Registration, Transport, TransportError};

static NEXT_CONTEXT: AtomicU64 = AtomicU64::new(1);

/// A source of time. Real time normally; virtual time in the simulator.
pub trait Clock: Send + Sync + fmt::Debug {
    /// Now.
    fn now(&self) -> Instant;
}

/// The real clock.
#[derive(Debug, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> Instant {
        Instant::now()
    }
}

/// How a context makes progress.
#[derive(Clone)]
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

struct ManualAdapter(Arc<dyn ManualDriver>);

impl Driver for ManualAdapter {
    fn drive(&self) -> bool {
        self.0.drive()
    }
}

/// Settings of a context.
#[derive(Clone, Debug)]
pub struct ContextOptions {
    /// How progress is made.
    pub progress: Progress,
    /// Time source.
    pub clock: Arc<dyn Clock>,
    /// How long a closing connection waits for its CLOSE to leave before disconnecting anyway.
    pub linger: Duration,
    /// How long a connect may take before it fails with a timeout.
    pub connect_timeout: Duration,
    /// Request/response traffic: how long an acknowledgment may wait for a reply to carry it (zero: never wait).
    /// One-way traffic is always acknowledged at once.
    pub ack_delay: Duration,
    /// The shared receive pool (seed 003).
    pub shared_recv: SharedRecv,
    /// Keepalive: a connection that posted nothing for this long sends a probe, so a peer that vanished (host
    /// down, cable pulled) is detected by the transport's retries even when the application is only waiting.
    /// `None`: idle connections never probe. A peer *process* that dies is detected without it (its kernel
    /// tears the connection down).
    pub keepalive: Option<Duration>,
}

/// Settings of the shared receive pool: control receive buffers shared by every connection of a context, so
/// receive memory does not grow with the number of connections (see [`crate::proto::pool`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SharedRecv {
    /// `None` (default): use the pool when the transport has a shared receive queue. `Some(true)`: require it
    /// (connections fail with `Unsupported` where there is none). `Some(false)`: each connection posts its own.
    pub enabled: Option<bool>,
    /// Buffers posted at first, and added each time the pool grows.
    pub chunk_slots: u32,
    /// Most buffers the pool grows to (also capped by the transport's queue depth).
    pub max_slots: u32,
    /// When fewer buffers than this are posted, the pool grows by a chunk.
    pub low_watermark: u32,
    /// Largest immediate payload a pool buffer holds (fixes the context's one slot size; a socket's
    /// `small_packet_max_size` above it is limited to it).
    pub small_packet_max_size: u32,
}

impl Default for SharedRecv {
    fn default() -> Self {
        SharedRecv {
            enabled: None,
            chunk_slots: 256,
            max_slots: 16384,
            low_watermark: 32,
            small_packet_max_size: crate::options::SocketOptions::default().small_packet_max_size,
        }
    }
}

impl Default for ContextOptions {
    fn default() -> Self {
        ContextOptions {
            progress: Progress::Thread,
            clock: Arc::new(SystemClock),
            linger: Duration::from_secs(1),
            connect_timeout: Duration::from_secs(10),
            ack_delay: Duration::from_micros(200),
            shared_recv: SharedRecv::default(),
            keepalive: Some(Duration::from_secs(10)),
        }
    }
}

pub(crate) struct Shared {
    pub(crate) engine: Mutex<Engine>,
    wake: EventFd,
    stop: AtomicBool,
    /// Application threads busy-polling this context right now.
    busy: std::sync::atomic::AtomicUsize,
    wait_fd: Option<OwnedFd>,
    driver: Option<Arc<dyn Driver>>,
}

impl crate::event::Poller for Shared {
    fn set_busy(&self, on: bool) {
        // No wake-up either way (a system call per dequeue is what busy polling avoids): an armed progress
        // thread notices at its next wake-up and stops arming; a standing-back one re-arms within a millisecond.
        if on {
            self.busy.fetch_add(1, Ordering::SeqCst);
        } else {
            self.busy.fetch_sub(1, Ordering::SeqCst);
        }
    }

    fn poll_progress(&self) -> bool {
        // Never wait for the progress thread: if it holds the engine, it is making the progress.
        let Ok(mut e) = self.engine.try_lock() else {
            return false;
        };
        let mut any = false;
        while e.progress_busy() {
            any = true;
        }
        any
    }
}

impl Shared {
    pub(crate) fn lock(&self) -> MutexGuard<'_, Engine> {
        self.engine.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Wakes the progress thread (a timer may have moved earlier).
    pub(crate) fn kick(&self) {
        let _ = self.wake.write(1);
    }
}

pub(crate) struct CtxInner {
    id: u64,
    shared: Arc<Shared>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl Drop for CtxInner {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        self.shared.kick();
        if let Some(t) = self.thread.lock().unwrap_or_else(|p| p.into_inner()).take() {
            let _ = t.join();
        }
        // Close every connection so peers learn we are gone, and let the transport release its endpoints.
        self.shared.lock().shutdown();
    }
}

/// One RDMA device (transport) with its sockets and progress (the scope of ES-API `exs_init`).
/// Cheap to clone (a handle). Sockets and memory regions keep it alive.
#[derive(Clone)]
pub struct Context {
    inner: Arc<CtxInner>,
}

impl fmt::Debug for Context {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Context")
            .field("id", &self.inner.id)
            .finish()
    }
}

impl Context {
    /// Creates a context over a transport with default options (a progress thread).
    pub fn new(transport: Box<dyn Transport>) -> Result<Context, TransportError> {
        Self::with_options(transport, ContextOptions::default())
    }

    /// Creates a context with options.
    pub fn with_options(
        transport: Box<dyn Transport>,
        opts: ContextOptions,
    ) -> Result<Context, TransportError> {
        let id = NEXT_CONTEXT.fetch_add(1, Ordering::Relaxed);
        let wake = EventFd::from_value_and_flags(0, EfdFlags::EFD_NONBLOCK | EfdFlags::EFD_CLOEXEC)
            .map_err(|e| TransportError::os("eventfd", e.into()))?;
        let wait_fd = transport.wait_fd();
        let driver: Option<Arc<dyn Driver>> = match &opts.progress {
            Progress::Thread => None,
            Progress::Manual(d) => Some(Arc::new(ManualAdapter(Arc::clone(d)))),
        };
        if matches!(opts.progress, Progress::Thread) && wait_fd.is_none() {
            return Err(TransportError::Unsupported(
                "this transport has no wait descriptor; use manual progress".into(),
            ));
        }
        let inner = Arc::new_cyclic(|weak: &Weak<CtxInner>| {
            let engine = Engine::new(transport, id, weak.clone(), &opts);
            CtxInner {
                id,
                shared: Arc::new(Shared {
                    engine: Mutex::new(engine),
                    wake,
                    stop: AtomicBool::new(false),
                    busy: std::sync::atomic::AtomicUsize::new(0),
                    wait_fd,
                    driver,
                }),
                thread: Mutex::new(None),
            }
        });
        if matches!(opts.progress, Progress::Thread) {
            let shared = Arc::clone(&inner.shared);
            let handle = std::thread::Builder::new()
                .name(format!("exs-progress-{id}"))
                .spawn(move || progress_thread(shared))
                .map_err(|e| TransportError::os("spawn progress thread", e))?;
            *inner.thread.lock().unwrap_or_else(|p| p.into_inner()) = Some(handle);
        }
        Ok(Context { inner })
    }

    pub(crate) fn from_inner(inner: Arc<CtxInner>) -> Context {
        Context { inner }
    }

    /// A handle that does not keep the context alive.
    pub(crate) fn downgrade(&self) -> Weak<CtxInner> {
        Arc::downgrade(&self.inner)
    }

    /// A process-unique identifier.
    pub fn id(&self) -> u64 {
        self.inner.id
    }

    /// What the transport can do.
    pub fn capabilities(&self) -> Capabilities {
        self.shared().lock().capabilities().clone()
    }

    /// Statistics of the engine.
    pub fn stats(&self) -> crate::engine::EngineStats {
        self.shared().lock().stats()
    }

    /// Makes whatever progress is possible now, without blocking (for manual progress and tests).
    pub fn progress(&self) -> bool {
        let mut e = self.shared().lock();
        let mut any = false;
        while e.progress() {
            any = true;
        }
        any
    }

    /// The earliest pending timer (manual progress uses it to advance virtual time).
    pub fn next_deadline(&self) -> Option<Instant> {
        self.shared().lock().next_deadline()
    }

    pub(crate) fn shared(&self) -> &Arc<Shared> {
        &self.inner.shared
    }

    pub(crate) fn register(&self, buf: &Arc<DmaBuf>) -> Result<Arc<dyn Registration>, MemoryError> {
        Ok(self.shared().lock().register(buf)?)
    }

    /// Lets `eq` drive this context when it waits (manual progress only).
    pub(crate) fn attach(&self, eq: &EventQueue) {
        match &self.inner.shared.driver {
            Some(d) => eq.add_driver(d),
            None => {
                let p: Arc<dyn crate::event::Poller> = self.inner.shared.clone();
                eq.add_poller(&p);
            }
        }
    }
}

fn progress_thread(shared: Arc<Shared>) {
    let wait_fd = shared
        .wait_fd
        .as_ref()
        .expect("thread mode has a wait descriptor");
    loop {
        if shared.stop.load(Ordering::SeqCst) {
            return;
        }
        if shared.busy.load(Ordering::SeqCst) > 0 {
            // An application thread is busy-polling this context: it handles completions. Stay out of its way
            // (no arming, so no completion-channel wake-ups): handle connection events and timers every
            // millisecond, or at once when woken.
            {
                let mut e = shared.lock();
                while e.progress() {}
            }
            let mut fds = [PollFd::new(shared.wake.as_fd(), PollFlags::POLLIN)];
            let _ = nix::poll::ppoll(
                &mut fds,
                Some(TimeSpec::from_duration(Duration::from_millis(1))),
                None,
            );
            if fds[0]
                .revents()
                .is_some_and(|r| r.contains(PollFlags::POLLIN))
            {
                let _ = shared.wake.read();
            }
            continue;
        }
        let timeout = {
            let mut e = shared.lock();
            while e.progress() {}
            match e.arm() {
                Ok(true) => {}
                // Events slipped in between the last poll and arming: poll again before sleeping.
                Ok(false) => continue,
                Err(err) => {
                    tracing::error!(%err, "arming the completion queue failed; retrying");
                    drop(e);
                    std::thread::sleep(Duration::from_millis(10));
                    continue;
                }
            }
            e.next_deadline()
                .map(|d| d.saturating_duration_since(e.now()))
        };
        let timeout = timeout.map(|t| TimeSpec::from_duration(t.min(Duration::from_secs(60))));
        let mut fds = [
            PollFd::new(wait_fd.as_fd(), PollFlags::POLLIN),
            PollFd::new(shared.wake.as_fd(), PollFlags::POLLIN),
        ];
        match nix::poll::ppoll(&mut fds, timeout, None) {
            Ok(_) | Err(nix::errno::Errno::EINTR) => {}
            Err(err) => {
                tracing::error!(%err, "poll on the transport failed");
                std::thread::sleep(Duration::from_millis(10));
            }
        }
        if fds[1]
            .revents()
            .is_some_and(|r| r.contains(PollFlags::POLLIN))
        {
            let _ = shared.wake.read();
        }
    }
}

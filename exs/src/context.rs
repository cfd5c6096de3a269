//! A context: one transport (device), its engine, and how it makes progress.
//!
//! ## Progress without a thread per socket, and without a wake-up per call
//! The protocol must move (answer adverts, issue reads, send acknowledgments and credits) while the application is
//! blocked in a dequeue or busy elsewhere. API calls post their work requests directly (posting does not block)
//! and wake nobody. A thread that waits in a dequeue runs the protocol itself and sleeps on the transport's wait
//! descriptor (the rules are in the crate's internal `progress` module, its counters in [`ProgressStats`]); a
//! context's **one** progress thread, whatever the number of sockets, does the same only while no application
//! thread waits. An idle connection, and a persistent sender whose peer pulls with RDMA reads, cost it nothing:
//! hardware serves the reads without any completion on the sender.
//!
//! The simulated fabric can instead run in manual mode: no thread, and `dequeue` drives the simulated world until
//! the events it waits for exist, deterministically.

use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::thread::JoinHandle;
use std::time::Instant;

use exs_dma::DmaBuf;

use crate::config::{ContextOptions, ManualDriver, Progress};
use crate::engine::Engine;
use crate::error::MemoryError;
use crate::event::{EventQueue, Owner};
use crate::ids::SocketId;
use crate::progress::{Driver, Lead, Poller, ProgressStats, Shared};
use crate::transport::{Capabilities, Registrar, Registration, Transport, TransportError};

static NEXT_CONTEXT: AtomicU64 = AtomicU64::new(1);

struct ManualAdapter(Arc<dyn ManualDriver>);

impl Driver for ManualAdapter {
    fn drive(&self) -> bool {
        self.0.drive()
    }
}

pub(crate) struct CtxInner {
    id: u64,
    shared: Arc<Shared>,
    thread: Mutex<Option<JoinHandle<()>>>,
    /// Registers memory regions outside the engine's lock, where the transport allows it.
    registrar: Option<Arc<dyn Registrar>>,
    /// Registrations made through `registrar` (counted in [`crate::engine::EngineStats::registrations`]).
    registered: AtomicU64,
}

/// The engine hands accepted connections to the application through their events, naming their context as an
/// [`Owner`]; one nobody takes is closed like a dropped socket.
impl Owner for CtxInner {
    fn abandon(self: Arc<Self>, sid: SocketId) {
        Context::from_inner(self).close_unheld(sid);
    }
}

impl Drop for CtxInner {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        self.shared.lead.wake_all();
        let thread = self.thread.lock().unwrap_or_else(|p| p.into_inner()).take();
        let shared = Arc::clone(&self.shared);
        // Not under the engine lock, and the progress thread never joins itself (the last handle can go on it,
        // from an event it completed): it sees `stop` and ends.
        crate::lock::run_unlocked(move || {
            if let Some(t) = thread {
                if t.thread().id() != std::thread::current().id() {
                    let _ = t.join();
                }
            }
            // Connections the application closed may still be closing gracefully (a stream dropped just before
            // the last handle of its context: its bytes on their way). They finish in the background, as TCP's
            // do after `close`, within the linger time; then every connection is closed so peers learn we are
            // gone, and the transport releases its endpoints.
            let lingering = shared.driver.is_none() && shared.lock().lingering();
            if lingering {
                let bg = Arc::clone(&shared);
                let spawned = std::thread::Builder::new()
                    .name("exs-linger".into())
                    .spawn(move || linger_then_shut_down(&bg));
                if spawned.is_ok() {
                    return;
                }
            }
            shared.lock().shutdown();
        });
    }
}

/// Drives a context nobody holds any more until its closing connections are through (or their linger time ran
/// out), then shuts it down: the progress thread's last job, done by a thread of its own (the progress thread
/// has stopped, and the context's last handle may have gone on an application thread that must not wait).
fn linger_then_shut_down(shared: &Shared) {
    // Each closing connection's own linger timer ends it by then (in the engine's clock); this bounds the thread
    // in real time whatever that clock does.
    let give_up = Instant::now() + shared.lock().linger();
    loop {
        let (did, lingering) = {
            let mut e = shared.lock();
            let did = e.progress();
            (did, e.lingering())
        };
        if !lingering || Instant::now() >= give_up {
            break;
        }
        if !did {
            // Nothing moved: the peer's acknowledgments or disconnect are on their way. A look every millisecond
            // costs little for the linger time at most (10 s by default) that this lasts.
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
    }
    shared.lock().shutdown();
}

/// One RDMA device (transport) with its sockets and progress (the scope of ES-API `exs_init`).
/// Cheap to clone (a handle). Sockets and memory regions keep it alive. When its last handle goes, the
/// connections still closing gracefully (closed or dropped sockets whose bytes are on their way) finish in the
/// background, on a thread of their own, within the linger time ([`ContextOptions::linger`]), as TCP's do after
/// `close`; then every connection is closed and the transport's resources are released (up to the linger time
/// after the last handle went). A process that exits meanwhile cuts them (no kernel carries them on as it does
/// TCP's). Contexts whose progress is driven by hand (the simulator's manual mode) close everything at once.
///
/// A context comes from [`Context::from_env`] (the backend the environment names), from [`Context::open`] (a
/// [`Backend`](crate::Backend) chosen in code), or from [`Context::new`] over any [`Transport`].
///
/// ```
/// # #[cfg(feature = "fabric")] {
/// use exs::{fabric::FabricConfig, Backend, Context};
///
/// // libfabric's tcp provider: no RDMA device needed.
/// let ctx = Context::open(&Backend::Fabric(FabricConfig::default()))?;
/// let caps = ctx.capabilities();
/// println!("{}: messages up to {} bytes", caps.name, caps.max_message);
/// # }
/// # Ok::<(), exs::TransportError>(())
/// ```
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
        opts.check()?;
        let id = NEXT_CONTEXT.fetch_add(1, Ordering::Relaxed);
        let lead = Lead::new()?;
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
        let registrar = transport.registrar();
        let inner = Arc::new_cyclic(|weak: &Weak<CtxInner>| {
            let owner: Weak<dyn Owner> = weak.clone();
            let engine = Engine::new(transport, id, owner, &opts);
            CtxInner {
                id,
                shared: Arc::new(Shared {
                    engine: Mutex::new(engine),
                    lead,
                    stop: AtomicBool::new(false),
                    busy: std::sync::atomic::AtomicUsize::new(0),
                    lingering: std::sync::atomic::AtomicUsize::new(0),
                    wait_fd,
                    driver,
                }),
                thread: Mutex::new(None),
                registrar,
                registered: AtomicU64::new(0),
            }
        });
        if matches!(opts.progress, Progress::Thread) {
            let shared = Arc::clone(&inner.shared);
            let handle = std::thread::Builder::new()
                .name(format!("exs-progress-{id}"))
                .spawn(move || crate::progress::thread(shared))
                .map_err(|e| TransportError::os("spawn progress thread", e))?;
            *inner.thread.lock().unwrap_or_else(|p| p.into_inner()) = Some(handle);
        }
        Ok(Context { inner })
    }

    /// Bytes of device-visible memory one `ty` connection with `opts` charges to its context's
    /// [`ContextOptions::memory_budget`] for its control buffers where it posts receives of its own (on libfabric,
    /// always): what a server that admits connections from others sizes its budget with. Where the context's shared
    /// receive pool serves the connection (seed 003, [`crate::SharedRecv`]), its receive buffers are the pool's,
    /// and its buffers for coalesced messages have the pool's slot size ([`crate::SharedRecv::small_packet_max_size`]
    /// rather than the connection's): usually less in all, more only when the pool's slots are the larger. A
    /// stream connection's stream buffer ([`crate::SocketOptions::stream_buffer_size`]) comes on top, once its peer
    /// needs one.
    pub fn connection_memory(ty: crate::SockType, opts: &crate::SocketOptions) -> u64 {
        crate::proto::conn::layout::Layout::new(ty, opts, None).bytes() as u64
    }

    pub(crate) fn from_inner(inner: Arc<CtxInner>) -> Context {
        Context { inner }
    }

    /// A handle that does not keep the context alive (as [`std::sync::Arc::downgrade`]): for whatever drives
    /// contexts it does not own, such as the simulated fabric's manual progress.
    pub fn downgrade(&self) -> WeakContext {
        WeakContext(Arc::downgrade(&self.inner))
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
        let mut stats = self.shared().lock().stats();
        stats.registrations += self.inner.registered.load(Ordering::Relaxed);
        stats
    }

    /// Counters of who made progress: the progress thread's wake-ups, application threads leading.
    pub fn progress_stats(&self) -> ProgressStats {
        self.shared().lead.stats()
    }

    /// Makes whatever progress is possible now, without blocking (for manual progress and tests).
    pub fn progress(&self) -> bool {
        let shared = self.shared();
        let mut e = shared.lock();
        shared.reporting_timers(&mut e, |e| {
            let mut any = false;
            while e.progress() {
                any = true;
            }
            any
        })
    }

    /// The earliest pending timer that has something to do (manual progress uses it to advance virtual time).
    /// Puts right first the connection timers left earlier than their connection's deadline (they would fire and
    /// find nothing due).
    pub fn next_deadline(&self) -> Option<Instant> {
        let mut e = self.shared().lock();
        e.settle_timers();
        e.next_deadline()
    }

    pub(crate) fn shared(&self) -> &Arc<Shared> {
        &self.inner.shared
    }

    /// Closes socket `sid` that nobody holds any more (its last handle, or an accepted connection nobody took).
    /// A handle can go under this thread's engine lock (an event holding it, in a queue dropped by a ticket the
    /// engine completed): the close runs once the lock is let go (issue 15).
    pub(crate) fn close_unheld(&self, sid: SocketId) {
        let ctx = self.clone();
        crate::lock::run_unlocked(move || {
            let _ = ctx.shared().call(|e| e.close(sid));
        });
    }

    pub(crate) fn register(&self, buf: &Arc<DmaBuf>) -> Result<Arc<dyn Registration>, MemoryError> {
        let Some(r) = &self.inner.registrar else {
            return Ok(self.shared().lock().register(buf)?);
        };
        // Without the engine's lock: the device pins the pages meanwhile, a while for a large buffer. Counted as
        // the engine counts its own, attempts that fail included.
        self.inner.registered.fetch_add(1, Ordering::Relaxed);
        Ok(r.register(buf)?)
    }

    /// Lets `eq` drive this context when it waits (manual progress only).
    pub(crate) fn attach(&self, eq: &EventQueue) {
        match &self.inner.shared.driver {
            Some(d) => eq.add_driver(d),
            None => {
                let p: Arc<dyn Poller> = self.inner.shared.clone();
                eq.add_poller(&p);
            }
        }
    }
}

/// A [`Context`] that is not kept alive by this handle ([`Context::downgrade`]).
#[derive(Clone)]
pub struct WeakContext(Weak<CtxInner>);

impl WeakContext {
    /// The context, if some handle still keeps it alive.
    pub fn upgrade(&self) -> Option<Context> {
        self.0.upgrade().map(|inner| Context { inner })
    }

    /// Whether the context is gone.
    pub fn is_gone(&self) -> bool {
        self.0.strong_count() == 0
    }
}

impl fmt::Debug for WeakContext {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.upgrade() {
            Some(c) => f.debug_tuple("WeakContext").field(&c.id()).finish(),
            None => f.write_str("WeakContext(gone)"),
        }
    }
}

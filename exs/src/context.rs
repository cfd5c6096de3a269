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
use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::thread::JoinHandle;
use std::time::Instant;

use exs_dma::DmaBuf;

use crate::config::{ContextOptions, ManualDriver, Progress};
use crate::engine::Engine;
use crate::error::MemoryError;
use crate::event::{Driver, EventQueue};
use crate::lock::EngineGuard;
use crate::progress::{Lead, ProgressStats};
use crate::transport::{Capabilities, Registration, Transport, TransportError};

static NEXT_CONTEXT: AtomicU64 = AtomicU64::new(1);

struct ManualAdapter(Arc<dyn ManualDriver>);

impl Driver for ManualAdapter {
    fn drive(&self) -> bool {
        self.0.drive()
    }
}

pub(crate) struct Shared {
    pub(crate) engine: Mutex<Engine>,
    /// Who leads (sleeps on the transport) and when each sleeper wakes: see [`crate::progress`].
    pub(crate) lead: Lead,
    stop: AtomicBool,
    /// Application threads busy-polling this context right now.
    busy: std::sync::atomic::AtomicUsize,
    pub(crate) wait_fd: Option<OwnedFd>,
    driver: Option<Arc<dyn Driver>>,
}

impl crate::event::Poller for Shared {
    fn set_busy(&self, on: bool) {
        // No wake-up either way (a system call per dequeue is what busy polling avoids): a leading progress
        // thread notices at its next wake-up and stops arming; a standing-back one
        // (see `progress::stand_back_for_busy_pollers`) checks back within `progress::MAX_BACKOFF`.
        if on {
            self.busy.fetch_add(1, Ordering::SeqCst);
        } else {
            self.lead.busy_poll_ended();
            self.busy.fetch_sub(1, Ordering::SeqCst);
        }
    }

    fn poll_progress(&self) -> bool {
        // Never wait for another thread: if it holds the engine, it is making the progress.
        let Some(mut e) = EngineGuard::try_lock(&self.engine) else {
            return false;
        };
        // One round: the caller polls again if what it waits for is not there yet (another round here would
        // cost a transport poll, a system call on software providers).
        e.progress_busy()
    }

    fn try_lead(&self, follower: &Arc<crate::event::EqInner>) -> bool {
        self.wait_fd.is_some() && self.lead.try_lead_app(follower)
    }

    fn prepare_sleep(&self, satisfied: &dyn Fn() -> bool) -> Option<Option<Instant>> {
        let mut e = self.lock();
        crate::progress::prepare_sleep(&self.lead, &mut e, satisfied)
    }

    fn sleep_fds(&self) -> [std::os::fd::BorrowedFd<'_>; 2] {
        [
            self.wait_fd
                .as_ref()
                .expect("a leader has a wait descriptor")
                .as_fd(),
            self.lead.leader_wake_fd(),
        ]
    }

    fn woke(&self, kicked: bool) {
        self.lead.woke(kicked);
    }

    fn release(&self) {
        self.lead.release_app();
    }

    fn count_sleep(&self) {
        self.lead.count_app_sleep();
    }
}

impl Shared {
    pub(crate) fn lock(&self) -> EngineGuard<'_> {
        EngineGuard::lock(&self.engine)
    }

    /// Runs an API call on the engine. Posting needs no wake-up; only a call that moved the earliest timer
    /// earlier than the current sleeper's wake-up time wakes it (see [`crate::progress`], rule 1).
    pub(crate) fn call<T>(&self, f: impl FnOnce(&mut Engine) -> T) -> T {
        let mut e = self.lock();
        let before = e.next_deadline();
        let r = f(&mut e);
        e.drain_done();
        let after = e.next_deadline();
        if after.is_some_and(|a| before.is_none_or(|b| a < b)) {
            if let Some(d) = e.next_deadline_real() {
                self.lead.after_call(d);
            }
        }
        r
    }

    pub(crate) fn stopping(&self) -> bool {
        self.stop.load(Ordering::SeqCst)
    }

    pub(crate) fn busy_polled(&self) -> bool {
        self.busy.load(Ordering::SeqCst) > 0
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
            // Close every connection so peers learn we are gone, and let the transport release its endpoints.
            shared.lock().shutdown();
        });
    }
}

/// One RDMA device (transport) with its sockets and progress (the scope of ES-API `exs_init`).
/// Cheap to clone (a handle). Sockets and memory regions keep it alive.
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
        let inner = Arc::new_cyclic(|weak: &Weak<CtxInner>| {
            let engine = Engine::new(transport, id, weak.clone(), &opts);
            CtxInner {
                id,
                shared: Arc::new(Shared {
                    engine: Mutex::new(engine),
                    lead,
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
                .spawn(move || crate::progress::thread(shared))
                .map_err(|e| TransportError::os("spawn progress thread", e))?;
            *inner.thread.lock().unwrap_or_else(|p| p.into_inner()) = Some(handle);
        }
        Ok(Context { inner })
    }

    pub(crate) fn from_inner(inner: Arc<CtxInner>) -> Context {
        Context { inner }
    }

    /// A handle that does not keep the context alive.
    #[cfg(feature = "sim")]
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

    /// Counters of who made progress: the progress thread's wake-ups, application threads leading.
    pub fn progress_stats(&self) -> ProgressStats {
        self.shared().lead.stats()
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

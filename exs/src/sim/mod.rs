//! The simulated fabric: a deterministic in-process [`Transport`] for protocol tests (feature `sim`).
//!
//! It is a model of an RDMA network, not a mock of the protocol: work requests really move bytes between leased
//! buffers; remote keys and bounds are checked the way hardware checks them (a bad key or range is a remote access
//! error and breaks the connection); per-connection order is kept; a send that finds no posted receive is a
//! receiver-not-ready error (by default fatal, so a credit bug cannot hide behind retries).
//!
//! Two modes:
//! * **Manual** ([`World::new`]): no threads. Deliveries wait in a queue with a virtual delivery time (latency plus
//!   seeded jitter, which interleaves connections differently per seed); [`World::drive`] makes one step:
//!   progress every context, else deliver the next message, else fire the next timer. Waiting in
//!   [`EventQueue::dequeue`](crate::EventQueue::dequeue) drives the world, and reports a deadlock instead of
//!   hanging when nothing can happen any more.
//! * **Threaded** ([`World::threaded`]): each context has its progress thread; deliveries happen at post time.
//!
//! Faults: latency and jitter, [`World::break_connection`] (both ends go to error and flush),
//! [`World::kill`] (a host vanishes; its peers see a disconnect after a detection delay), and
//! [`World::silence`] (a host stops answering without a word: only a peer that sends finds out, by retry
//! exhaustion).

pub mod fuzz;
mod net;
mod transport;

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::os::fd::{AsFd, OwnedFd};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};

use exs_dma::{DmaBuf, Lease};
use nix::sys::eventfd::{EfdFlags, EventFd};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::config::{Clock, ContextOptions, ManualDriver, Progress};
use crate::context::{Context, WeakContext};
use crate::transport::{
    Capabilities, CmEvent, Completed, Completion, ConnectFailure, EndpointId, Exposure, ListenerId,
    Op, PostError, Registrar, Registration, RemoteAccess, RemoteRef, RequestId, Sge, Transport,
    TransportError, WcError, WorkRequest,
};

use net::*;
pub use transport::SimTransport;
use transport::*;

/// What to do when a send or write-with-immediate finds no posted receive.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RnrPolicy {
    /// Fail the connection with a receiver-not-ready error (catches credit bugs).
    Fail,
    /// Wait until a receive is posted (RC hardware with infinite RNR retry).
    Wait,
}

/// Settings of a simulated world.
#[derive(Clone, Debug)]
pub struct SimConfig {
    /// Seed of every random choice (jitter, keys).
    pub seed: u64,
    /// One-way latency.
    pub latency: Duration,
    /// Added uniformly at random to each delivery (never reorders one connection).
    pub jitter: Duration,
    /// Capabilities every simulated device reports.
    pub caps: Capabilities,
    /// Remote addresses are offsets into the exposed range (libfabric's offset mode) instead of virtual addresses.
    pub offset_addressing: bool,
    /// Receiver-not-ready handling.
    pub rnr: RnrPolicy,
    /// How long peers of a killed host take to see the disconnect.
    pub detect_delay: Duration,
}

impl Default for SimConfig {
    fn default() -> Self {
        SimConfig {
            seed: 1,
            latency: Duration::from_micros(5),
            jitter: Duration::from_micros(5),
            caps: Capabilities {
                name: "sim".into(),
                max_inline: 64,
                max_message: 1 << 31,
                native_write_imm: true,
                imm_consumes_recv: true,
                max_send_wr: 256,
                max_recv_wr: 4096,
                max_sge: 4,
                max_read_depth: 16,
                max_private_data: 56,
                // Off by default, so that the receive-not-ready check below catches credit bugs on per-connection
                // queues; [`SimConfig::with_shared_recv`] turns it on.
                max_shared_recv: 0,
                // Sends that find the shared queue empty wait (RC hardware); [`SimConfig::without_rnr_retry`]
                // makes them end the connection, as on iWARP. Per-connection queues follow [`SimConfig::rnr`].
                rnr_retry: true,
                immediate_default: crate::options::SocketOptions::default().small_packet_max_size,
                keys_after_connect: false,
            },
            offset_addressing: false,
            rnr: RnrPolicy::Fail,
            detect_delay: Duration::from_millis(1),
        }
    }
}

impl SimConfig {
    /// Devices with a shared receive queue of `depth` buffers (seed 003). Sends that find it empty wait, as RC
    /// hardware retries on receiver-not-ready: with a pool smaller than the sum of all connections' windows, an
    /// empty pool is a delay, not an error (unless [`SimConfig::without_rnr_retry`]).
    pub fn with_shared_recv(mut self, depth: u32) -> Self {
        self.caps.max_shared_recv = depth;
        self
    }

    /// Devices without receiver-not-ready retry, as iWARP's: a message that finds the shared receive queue empty
    /// ends its connection (the sender's request fails, both ends go to error), and the capabilities say so.
    pub fn without_rnr_retry(mut self) -> Self {
        self.caps.rnr_retry = false;
        self
    }
}

/// Counters of the simulated network.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NetStats {
    /// Work requests delivered.
    pub delivered: u64,
    /// Bytes moved by sends, writes and reads.
    pub bytes: u64,
    /// Sends that found no posted receive.
    pub rnr: u64,
    /// Remote accesses refused (bad key, range or permission).
    pub access_errors: u64,
    /// Steps taken by `drive`.
    pub steps: u64,
}

/// The virtual clock of a manual world.
#[derive(Debug)]
struct SimClock {
    net: Weak<Mutex<Net>>,
    base: Instant,
}

impl Clock for SimClock {
    fn now(&self) -> Instant {
        match self.net.upgrade() {
            Some(net) => self.base + lock(&net).now,
            None => self.base,
        }
    }
}

/// Drives a manual world. It holds its contexts weakly: a context holds the driver, and the application decides
/// how long a context lives.
struct WorldDriver {
    net: Weak<Mutex<Net>>,
    contexts: Mutex<Vec<(HostId, WeakContext)>>,
}

impl WorldDriver {
    /// The live contexts of hosts that are not stalled.
    fn live(&self, net: &Mutex<Net>) -> Vec<Context> {
        let stalled: Vec<bool> = lock(net).hosts.iter().map(|h| h.stalled).collect();
        let mut v = self.contexts.lock().unwrap_or_else(|p| p.into_inner());
        v.retain(|(_, w)| !w.is_gone());
        v.iter()
            .filter(|(h, _)| !stalled.get(*h).copied().unwrap_or(false))
            .filter_map(|(_, w)| w.upgrade())
            .collect()
    }
}

impl ManualDriver for WorldDriver {
    fn drive(&self) -> bool {
        let Some(net) = self.net.upgrade() else {
            return false;
        };
        step(&net, self)
    }
}

/// One step of a manual world: progress every context; if none had anything to do, deliver the next message;
/// if nothing is in flight, advance virtual time to the next timer. Nothing due after `limit` happens.
fn step(net: &Arc<Mutex<Net>>, driver: &WorldDriver) -> bool {
    step_until(net, driver, Duration::MAX)
}

fn step_until(net: &Arc<Mutex<Net>>, driver: &WorldDriver, limit: Duration) -> bool {
    let ctxs = driver.live(net);
    lock(net).stats.steps += 1;
    let mut any = false;
    for c in &ctxs {
        any |= c.progress();
    }
    if any {
        return true;
    }
    let mut n = lock(net);
    if let Some(i) = n.next_due().filter(|&i| n.queue[i].at <= limit) {
        let d = n.queue.swap_remove(i);
        n.now = n.now.max(d.at);
        n.deliver(d);
        return true;
    }
    let base = n.base;
    let now = n.now;
    drop(n);
    let next_timer = ctxs.iter().filter_map(Context::next_deadline).min();
    if let Some(t) = next_timer.filter(|t| t.saturating_duration_since(base) <= limit) {
        let mut n = lock(net);
        let at = t.saturating_duration_since(base);
        n.now = n.now.max(at).max(now + Duration::from_nanos(1));
        return true;
    }
    false
}

/// A simulated network of hosts. See the module documentation.
#[derive(Clone)]
pub struct World {
    net: Arc<Mutex<Net>>,
    driver: Arc<WorldDriver>,
    threaded: bool,
}

impl fmt::Debug for World {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("World")
            .field("threaded", &self.threaded)
            .finish()
    }
}

impl World {
    /// A manual (deterministic, threadless) world.
    pub fn new(cfg: SimConfig) -> World {
        Self::build(cfg, false)
    }

    /// A world whose contexts have progress threads; deliveries happen at post time.
    pub fn threaded(cfg: SimConfig) -> World {
        Self::build(cfg, true)
    }

    fn build(cfg: SimConfig, threaded: bool) -> World {
        let rng = ChaCha8Rng::seed_from_u64(cfg.seed);
        let net = Arc::new(Mutex::new(Net {
            cfg,
            immediate: threaded,
            rng,
            now: Duration::ZERO,
            base: Instant::now(),
            hosts: Vec::new(),
            queue: Vec::new(),
            seq: 0,
            keys: HashMap::new(),
            next_key: 0,
            stats: NetStats::default(),
            srq_retry: false,
        }));
        let driver = Arc::new(WorldDriver {
            net: Arc::downgrade(&net),
            contexts: Mutex::new(Vec::new()),
        });
        World {
            net,
            driver,
            threaded,
        }
    }

    /// Adds a host with the next address (10.0.0.1, 10.0.0.2, ...) and returns its context.
    pub fn host(&self) -> Context {
        self.host_with(ContextOptions {
            // Periodic timers would keep a manual world from ever running idle; tests that want keepalive set it.
            keepalive: None,
            ..ContextOptions::default()
        })
    }

    /// Adds a host with context options (the progress mode and clock are set by the world).
    pub fn host_with(&self, mut opts: ContextOptions) -> Context {
        let transport = self.new_transport();
        let (host, base) = (transport.host, lock(&self.net).base);
        if !self.threaded {
            opts.progress = Progress::Manual(self.driver.clone());
            opts.clock = Arc::new(SimClock {
                net: Arc::downgrade(&self.net),
                base,
            });
        }
        let ctx = Context::with_options(Box::new(transport), opts).expect("simulated context");
        if !self.threaded {
            self.driver
                .contexts
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push((host, ctx.downgrade()));
        }
        ctx
    }

    /// Adds a host with no exs engine on it: its raw transport, for tests that play a crafted (hostile) peer
    /// through the [`Transport`] trait directly.
    pub fn raw_host(&self) -> SimTransport {
        self.new_transport()
    }

    fn new_transport(&self) -> SimTransport {
        let (host, caps, notify) = {
            let mut net = lock(&self.net);
            let id = net.hosts.len();
            let ip = IpAddr::V4(Ipv4Addr::new(10, 0, (id / 250) as u8, (id % 250) as u8 + 1));
            let notify = if self.threaded {
                Some(Arc::new(
                    EventFd::from_value_and_flags(
                        0,
                        EfdFlags::EFD_NONBLOCK | EfdFlags::EFD_CLOEXEC,
                    )
                    .expect("eventfd"),
                ))
            } else {
                None
            };
            net.hosts.push(Host {
                ip,
                alive: true,
                stalled: false,
                answering: true,
                panic_next_poll: false,
                panic_next_arm: false,
                refuse_keys: false,
                refuse_registrations: false,
                keep_deregistered: Arc::default(),
                fail_next_incoming_write: false,
                fail_next_accept: false,
                quiet_length_errors: false,
                cq: VecDeque::new(),
                cm: VecDeque::new(),
                notify: notify.clone(),
                armed: false,
                eps: HashMap::new(),
                srq: None,
                srq_waiting: VecDeque::new(),
                listeners: HashMap::new(),
                requests: HashMap::new(),
                next_listener: 1,
                next_request: 1,
                next_port: 40000,
            });
            (id, net.cfg.caps.clone(), notify)
        };
        SimTransport {
            net: Arc::clone(&self.net),
            host,
            caps,
            notify,
        }
    }

    /// Stops (or resumes) the progress of host `host` in a manual world, as a receiver busy elsewhere: messages
    /// keep arriving and consuming its receive buffers, nothing is processed or reposted.
    pub fn stall(&self, host: usize, stalled: bool) {
        lock(&self.net).hosts[host].stalled = stalled;
    }

    /// The address of host `i` (in creation order).
    pub fn addr(&self, host: usize, port: u16) -> SocketAddr {
        SocketAddr::new(lock(&self.net).hosts[host].ip, port)
    }

    /// One step (manual worlds). Returns false when nothing can happen any more.
    pub fn drive(&self) -> bool {
        step(&self.net, &self.driver)
    }

    /// Steps until nothing can happen any more, or `max_steps`. Returns the steps taken.
    pub fn run_until_idle(&self, max_steps: u64) -> u64 {
        let mut n = 0;
        while n < max_steps && self.drive() {
            n += 1;
        }
        n
    }

    /// Steps for `d` of virtual time: everything due before then happens, and the clock ends at the limit even
    /// when nothing was due (time passes for an idle world too). Returns the steps taken.
    pub fn run_for(&self, d: Duration) -> u64 {
        let limit = self.elapsed().saturating_add(d);
        let mut n = 0;
        while step_until(&self.net, &self.driver, limit) {
            n += 1;
        }
        if !self.threaded {
            let mut net = lock(&self.net);
            net.now = net.now.max(limit);
        }
        n
    }

    /// Counters.
    pub fn stats(&self) -> NetStats {
        lock(&self.net).stats
    }

    /// Virtual time elapsed.
    pub fn elapsed(&self) -> Duration {
        lock(&self.net).now
    }

    /// Deliveries in flight.
    pub fn in_flight(&self) -> usize {
        lock(&self.net).queue.len()
    }

    /// Endpoints host `host`'s transport holds now (connected, connecting or being accepted).
    pub fn endpoints(&self, host: usize) -> usize {
        lock(&self.net).hosts[host].eps.len()
    }

    /// Remote keys currently valid on all hosts.
    pub fn live_keys(&self) -> usize {
        lock(&self.net).keys.len()
    }

    /// Breaks every connection of host `host` (both ends go to error and flush).
    pub fn break_connections(&self, host: usize) {
        let mut net = lock(&self.net);
        let eps: Vec<EndpointId> = net.hosts[host].eps.keys().copied().collect();
        for ep in eps {
            net.break_ep(host, ep);
        }
    }

    /// Breaks one connection, named by the local address of its endpoint on `host`.
    pub fn break_connection(&self, host: usize, local: SocketAddr) {
        let mut net = lock(&self.net);
        let ep = net.hosts[host]
            .eps
            .iter()
            .find(|(_, e)| e.local == local)
            .map(|(id, _)| *id);
        if let Some(ep) = ep {
            net.break_ep(host, ep);
        }
    }

    /// Fault schedule: the next completion poll of `host`'s context panics, as a bug in protocol code would (the
    /// context must then fail every operation instead of hanging).
    pub fn panic_on_next_poll(&self, host: usize) {
        lock(&self.net).hosts[host].panic_next_poll = true;
    }

    /// Fault schedule: the next arming of `host`'s completion queue panics, as a bug in a transport would, outside
    /// a progress round: in the thread about to sleep as the context's leader.
    pub fn panic_on_next_arm(&self, host: usize) {
        lock(&self.net).hosts[host].panic_next_arm = true;
    }

    /// Fault schedule: `host`'s device makes no remote keys while `refused` (out of registrations or memory
    /// windows): every exposure fails with [`crate::transport::TransportError::Resource`].
    pub fn refuse_keys(&self, host: usize, refused: bool) {
        lock(&self.net).hosts[host].refuse_keys = refused;
    }

    /// Fault schedule: `host`'s device registers no memory while `refused` (the locked-memory limit reached):
    /// every registration fails with [`crate::transport::TransportError::Resource`].
    pub fn refuse_registrations(&self, host: usize, refused: bool) {
        lock(&self.net).hosts[host].refuse_registrations = refused;
    }

    /// Fault schedule: while `kept`, undoing a registration of `host`'s device fails, and the device keeps the
    /// memory for good (as the verbs and libfabric backends keep a buffer whose `ibv_dereg_mr` or `fi_close`
    /// failed: the device may still reach it).
    pub fn keep_deregistered_memory(&self, host: usize, kept: bool) {
        let k = Arc::clone(&lock(&self.net).hosts[host].keep_deregistered);
        k.on.store(kept, std::sync::atomic::Ordering::SeqCst);
    }

    /// Fault schedule: the next write-with-immediate into `host` fails on its way in, as a connection reset mid-
    /// transfer does on libfabric tcp: nothing of it lands, and `host` gets its immediate with an error status
    /// (then the connection breaks).
    pub fn fail_next_incoming_write(&self, host: usize) {
        lock(&self.net).hosts[host].fail_next_incoming_write = true;
    }

    /// Fault schedule: the next accept of `host`'s device fails before it takes its connection request, as an
    /// accept does on libfabric and verbs when the device refuses the connection's first receives or the
    /// transport has failed: the request is still the device's, for the engine to refuse.
    pub fn fail_next_accept(&self, host: usize) {
        lock(&self.net).hosts[host].fail_next_accept = true;
    }

    /// Fault schedule: while `quiet`, a message longer than the receive it lands in on `host` puts the connection
    /// in error with no connection event at `host`, as on a verbs queue pair (rdma_cm says nothing until one side
    /// disconnects); otherwise the connection breaks with `Disconnected` on both sides.
    pub fn quiet_length_errors(&self, host: usize, quiet: bool) {
        lock(&self.net).hosts[host].quiet_length_errors = quiet;
    }

    /// The host a raw transport of [`World::raw_host`] plays (for [`World::kill`] and friends).
    pub fn host_of(&self, t: &SimTransport) -> usize {
        t.host
    }

    /// The host vanishes (process killed): its endpoints disappear and its peers see a disconnect after the
    /// detection delay; its remote keys stop answering.
    pub fn kill(&self, host: usize) {
        let mut net = lock(&self.net);
        net.hosts[host].alive = false;
        let delay = net.cfg.detect_delay;
        let peers: Vec<(Addr, EndpointId)> = net.hosts[host]
            .eps
            .iter()
            .filter_map(|(id, e)| e.peer.map(|p| (p, *id)))
            .collect();
        let eps: Vec<Ep> = net.hosts[host].eps.drain().map(|(_, e)| e).collect();
        net.hosts[host].listeners.clear();
        net.queue.retain(|d| d.from.0 != host);
        for ((ph, pep), _) in peers {
            let at = net.now.saturating_add(delay);
            net.seq += 1;
            let seq = net.seq;
            let d = Delivery {
                at,
                seq,
                from: (host, EndpointId(0)),
                to: (ph, pep),
                payload: Payload::Disconnect,
            };
            if net.immediate {
                net.deliver(d);
            } else {
                net.queue.push(d);
            }
        }
        drop(net);
        drop(eps);
    }

    /// The host stops answering without a word (cable pulled, machine frozen): peers only find out when a work
    /// request of theirs times out.
    pub fn silence(&self, host: usize) {
        lock(&self.net).hosts[host].answering = false;
    }
}

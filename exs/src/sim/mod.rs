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

use crate::context::{Clock, Context, ContextOptions, ManualDriver, Progress};
use crate::transport::{
    Capabilities, CmEvent, Completed, Completion, ConnectFailure, EndpointId, Exposure, ListenerId,
    Op, PostError, Registration, RemoteAccess, RemoteRef, RequestId, Sge, Transport,
    TransportError, WcError, WorkRequest,
};

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
    /// empty pool is a delay, not an error.
    pub fn with_shared_recv(mut self, depth: u32) -> Self {
        self.caps.max_shared_recv = depth;
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

type HostId = usize;
type Addr = (HostId, EndpointId);

#[derive(Debug)]
enum Payload {
    Wr(WorkRequest),
    ConnectRequest {
        listen: SocketAddr,
        private: Vec<u8>,
        from_addr: SocketAddr,
    },
    Accept {
        private: Vec<u8>,
        acceptor: Addr,
        acceptor_addr: SocketAddr,
    },
    Rtu,
    Reject,
    Disconnect,
    Unreachable,
}

#[derive(Debug)]
struct Delivery {
    at: Duration,
    seq: u64,
    from: Addr,
    to: Addr,
    payload: Payload,
}

#[derive(Debug)]
struct Ep {
    peer: Option<Addr>,
    recvs: VecDeque<WorkRequest>,
    up: bool,
    local: SocketAddr,
    remote: Option<SocketAddr>,
    /// Latest delivery time scheduled from this endpoint (keeps one connection in order).
    last_at: Duration,
    /// Sends waiting for a receive (RNR policy Wait).
    waiting: VecDeque<Delivery>,
    /// Takes its receives from the host's shared receive queue.
    shared: bool,
}

#[derive(Debug)]
struct KeyEntry {
    lease: Lease,
    access: RemoteAccess,
    base: u64,
    /// The one endpoint whose peer may use the key (a memory window bound to a queue pair).
    owner: Addr,
}

struct Host {
    ip: IpAddr,
    alive: bool,
    /// Fault schedule: the next completion poll panics (see [`World::panic_on_next_poll`]).
    panic_next_poll: bool,
    /// The driver of a manual world skips this host's progress.
    stalled: bool,
    answering: bool,
    cq: VecDeque<Completion>,
    cm: VecDeque<CmEvent>,
    notify: Option<Arc<EventFd>>,
    armed: bool,
    eps: HashMap<EndpointId, Ep>,
    /// The shared receive queue, once created.
    srq: Option<VecDeque<WorkRequest>>,
    /// Deliveries to endpoints on the shared queue that found it empty, in arrival order.
    srq_waiting: VecDeque<Delivery>,
    listeners: HashMap<ListenerId, SocketAddr>,
    /// Pending requests: requester, its address, and the listener address it asked for.
    requests: HashMap<RequestId, (Addr, SocketAddr, SocketAddr)>,
    next_listener: u32,
    next_request: u64,
    next_port: u16,
}

impl Host {
    fn push_cq(&mut self, c: Completion) {
        self.cq.push_back(c);
        self.signal();
    }

    fn push_cm(&mut self, e: CmEvent) {
        self.cm.push_back(e);
        self.signal();
    }

    fn signal(&mut self) {
        if self.armed {
            self.armed = false;
            if let Some(n) = &self.notify {
                let _ = n.write(1);
            }
        }
    }
}

struct Net {
    cfg: SimConfig,
    immediate: bool,
    rng: ChaCha8Rng,
    now: Duration,
    base: Instant,
    hosts: Vec<Host>,
    queue: Vec<Delivery>,
    seq: u64,
    keys: HashMap<u64, KeyEntry>,
    next_key: u64,
    stats: NetStats,
    /// Delivering what waited for the shared receive queue (it goes before newer arrivals).
    srq_retry: bool,
}

impl Net {
    fn schedule(&mut self, from: Addr, to: Addr, payload: Payload) {
        let jitter = if self.cfg.jitter.is_zero() {
            Duration::ZERO
        } else {
            Duration::from_nanos(self.rng.gen_range(0..=self.cfg.jitter.as_nanos() as u64))
        };
        let mut at = self.now + self.cfg.latency + jitter;
        if let Some(ep) = self.hosts[from.0].eps.get_mut(&from.1) {
            at = at.max(ep.last_at);
            ep.last_at = at;
        }
        self.seq += 1;
        let d = Delivery {
            at,
            seq: self.seq,
            from,
            to,
            payload,
        };
        if self.immediate {
            self.deliver(d);
        } else {
            self.queue.push(d);
        }
    }

    fn next_due(&self) -> Option<usize> {
        self.queue
            .iter()
            .enumerate()
            .min_by_key(|(_, d)| (d.at, d.seq))
            .map(|(i, _)| i)
    }

    fn complete(
        &mut self,
        host: HostId,
        ep: EndpointId,
        wr_id: u64,
        op: Completed,
        status: Result<(), WcError>,
    ) {
        if self.hosts[host].alive {
            self.hosts[host].push_cq(Completion {
                ep,
                wr_id,
                op,
                status,
            });
        }
    }

    fn completed_kind(op: &Op) -> Completed {
        match op {
            Op::Send { .. } => Completed::Send,
            Op::Write { .. } => Completed::Write,
            Op::Read { .. } => Completed::Read,
            Op::Recv { .. } => Completed::Recv { len: 0, imm: None },
        }
    }

    fn deliver(&mut self, d: Delivery) {
        let (th, tep) = d.to;
        match d.payload {
            Payload::Wr(wr) => self.deliver_wr(d.from, d.to, wr, d.at, d.seq),
            Payload::ConnectRequest {
                listen,
                private,
                from_addr,
            } => {
                let host = &mut self.hosts[th];
                let listener = host
                    .listeners
                    .iter()
                    .find(|(_, a)| **a == listen)
                    .map(|(l, _)| *l);
                match listener {
                    Some(listener) if host.alive && host.answering => {
                        let request = RequestId(host.next_request);
                        host.next_request += 1;
                        host.requests.insert(request, (d.from, from_addr, listen));
                        host.push_cm(CmEvent::ConnectRequest {
                            listener,
                            request,
                            peer: from_addr,
                            private,
                        });
                    }
                    Some(_) => {} // a silent host does not answer: the connect times out
                    None => self.schedule(d.to, d.from, Payload::Reject),
                }
            }
            Payload::Accept {
                private,
                acceptor,
                acceptor_addr,
            } => {
                let me = &mut self.hosts[th];
                if let Some(ep) = me.eps.get_mut(&tep) {
                    ep.peer = Some(acceptor);
                    ep.up = true;
                    ep.remote = Some(acceptor_addr);
                    me.push_cm(CmEvent::Established { ep: tep, private });
                    self.schedule(d.to, acceptor, Payload::Rtu);
                }
            }
            Payload::Rtu => {
                let me = &mut self.hosts[th];
                if let Some(ep) = me.eps.get_mut(&tep) {
                    ep.up = true;
                    me.push_cm(CmEvent::Established {
                        ep: tep,
                        private: Vec::new(),
                    });
                }
            }
            Payload::Reject => {
                let me = &mut self.hosts[th];
                if me.eps.contains_key(&tep) {
                    me.push_cm(CmEvent::ConnectFailed {
                        ep: tep,
                        reason: ConnectFailure::Refused(Vec::new()),
                    });
                }
            }
            Payload::Unreachable => {
                let me = &mut self.hosts[th];
                if me.eps.contains_key(&tep) {
                    me.push_cm(CmEvent::ConnectFailed {
                        ep: tep,
                        reason: ConnectFailure::Unreachable,
                    });
                }
            }
            Payload::Disconnect => self.go_down(th, tep),
        }
    }

    /// An endpoint goes to error: its receives and its undelivered work requests are flushed, then it reports
    /// `Disconnected`.
    fn go_down(&mut self, host: HostId, ep: EndpointId) {
        let Some(e) = self.hosts[host].eps.get_mut(&ep) else {
            return;
        };
        let was_up = e.up || e.peer.is_some();
        e.up = false;
        e.peer = None;
        let recvs: Vec<_> = e.recvs.drain(..).collect();
        let mut waiting: Vec<_> = e.waiting.drain(..).collect();
        let srq_waiting = std::mem::take(&mut self.hosts[host].srq_waiting);
        let (mine, others): (Vec<_>, Vec<_>) =
            srq_waiting.into_iter().partition(|d| d.to == (host, ep));
        self.hosts[host].srq_waiting = others.into();
        waiting.extend(mine);
        for wr in recvs {
            self.complete(
                host,
                ep,
                wr.wr_id,
                Completed::Recv { len: 0, imm: None },
                Err(WcError::Flushed),
            );
        }
        for w in waiting {
            self.fail_delivery(w, WcError::Flushed);
        }
        let mine: Vec<usize> = (0..self.queue.len())
            .rev()
            .filter(|&i| self.queue[i].from == (host, ep))
            .collect();
        for i in mine {
            let d = self.queue.remove(i);
            self.fail_delivery(d, WcError::Flushed);
        }
        if was_up || self.hosts[host].alive {
            self.hosts[host].push_cm(CmEvent::Disconnected { ep });
        }
    }

    fn fail_delivery(&mut self, d: Delivery, err: WcError) {
        if let Payload::Wr(wr) = d.payload {
            let kind = Self::completed_kind(&wr.op);
            self.complete(d.from.0, d.from.1, wr.wr_id, kind, Err(err));
        }
    }

    /// Breaks a connection from `host`'s side: both ends go to error.
    fn break_ep(&mut self, host: HostId, ep: EndpointId) {
        let peer = self.hosts[host].eps.get(&ep).and_then(|e| e.peer);
        self.go_down(host, ep);
        if let Some((ph, pep)) = peer {
            self.go_down(ph, pep);
        }
    }

    fn deliver_wr(&mut self, from: Addr, to: Addr, mut wr: WorkRequest, at: Duration, seq: u64) {
        let (fh, fep) = from;
        let (th, tep) = to;
        let kind = Self::completed_kind(&wr.op);
        let target_up = self.hosts[th].alive
            && self.hosts[th].answering
            && self.hosts[th]
                .eps
                .get(&tep)
                .is_some_and(|e| e.up && e.peer == Some(from));
        if !target_up {
            let err = if self.hosts[th].alive && self.hosts[th].answering {
                WcError::Flushed
            } else {
                WcError::RetryExceeded
            };
            self.complete(fh, fep, wr.wr_id, kind, Err(err));
            return;
        }
        match &mut wr.op {
            Op::Send { sges, imm } => {
                let imm = *imm;
                let Some(mut recv) = self.take_recv(th, tep) else {
                    return self.rnr(Delivery {
                        at,
                        seq,
                        from,
                        to,
                        payload: Payload::Wr(wr),
                    });
                };
                let Op::Recv { sge: target } = &mut recv.op else {
                    unreachable!("receive queue holds receives")
                };
                let total: usize = sges.iter().map(Sge::len).sum();
                if total > target.len() {
                    self.complete(
                        th,
                        tep,
                        recv.wr_id,
                        Completed::Recv { len: 0, imm },
                        Err(WcError::LocalLength),
                    );
                    self.complete(
                        fh,
                        fep,
                        wr.wr_id,
                        kind,
                        Err(WcError::Other("remote invalid request".into())),
                    );
                    self.break_ep(th, tep);
                    return;
                }
                let mut at_off = 0;
                for s in sges.iter() {
                    s.lease()
                        .copy_to(0, target.lease_mut(), at_off, s.len())
                        .expect("lengths checked");
                    at_off += s.len();
                }
                self.stats.bytes += total as u64;
                self.stats.delivered += 1;
                let len = total as u32;
                drop(recv.op);
                self.complete(th, tep, recv.wr_id, Completed::Recv { len, imm }, Ok(()));
                self.complete(fh, fep, wr.wr_id, kind, Ok(()));
            }
            Op::Write { local, remote, imm } => {
                let imm = *imm;
                let n: usize = local.iter().map(Sge::len).sum();
                if let Err(e) = self.remote_access(*remote, n, RemoteAccess::Write, to) {
                    self.stats.access_errors += 1;
                    tracing::debug!("sim: remote write refused: {e}");
                    self.complete(fh, fep, wr.wr_id, kind, Err(WcError::RemoteAccess));
                    self.break_ep(fh, fep);
                    return;
                }
                let recv = match imm {
                    Some(_) if self.cfg.caps.imm_consumes_recv => match self.take_recv(th, tep) {
                        Some(r) => Some(r),
                        None => {
                            return self.rnr(Delivery {
                                at,
                                seq,
                                from,
                                to,
                                payload: Payload::Wr(wr),
                            })
                        }
                    },
                    _ => None,
                };
                let entry = self.keys.get_mut(&remote.key).expect("checked");
                let mut off = (remote.addr - entry.base) as usize;
                for s in local.iter() {
                    s.lease()
                        .copy_to(0, &mut entry.lease, off, s.len())
                        .expect("bounds checked");
                    off += s.len();
                }
                self.stats.bytes += n as u64;
                self.stats.delivered += 1;
                match (imm, recv) {
                    (Some(imm), Some(r)) => self.complete(
                        th,
                        tep,
                        r.wr_id,
                        Completed::Recv {
                            len: n as u32,
                            imm: Some(imm),
                        },
                        Ok(()),
                    ),
                    (Some(imm), None) => {
                        self.complete(th, tep, 0, Completed::RemoteWrite { imm }, Ok(()));
                    }
                    _ => {}
                }
                self.complete(fh, fep, wr.wr_id, kind, Ok(()));
            }
            Op::Read { local, remote } => {
                let n = local.len();
                if let Err(e) = self.remote_access(*remote, n, RemoteAccess::Read, to) {
                    self.stats.access_errors += 1;
                    tracing::debug!("sim: remote read refused: {e}");
                    self.complete(fh, fep, wr.wr_id, kind, Err(WcError::RemoteAccess));
                    self.break_ep(fh, fep);
                    return;
                }
                let entry = self.keys.get(&remote.key).expect("checked");
                let off = (remote.addr - entry.base) as usize;
                entry
                    .lease
                    .copy_to(off, local.lease_mut(), 0, n)
                    .expect("bounds checked");
                self.stats.bytes += n as u64;
                self.stats.delivered += 1;
                self.complete(fh, fep, wr.wr_id, kind, Ok(()));
            }
            Op::Recv { .. } => unreachable!("receives are not delivered"),
        }
    }

    fn remote_access(
        &self,
        r: RemoteRef,
        len: usize,
        access: RemoteAccess,
        at: Addr,
    ) -> Result<(), String> {
        let e = self
            .keys
            .get(&r.key)
            .ok_or_else(|| format!("unknown key {:#x}", r.key))?;
        if e.owner != at {
            // A key works only on the connection it was given to (a window bound to its queue pair).
            return Err(format!("key {:#x} belongs to another connection", r.key));
        }
        if e.access != access {
            return Err(format!("key {:#x} does not allow {access:?}", r.key));
        }
        let start = r
            .addr
            .checked_sub(e.base)
            .ok_or("address below the exposed range")?;
        let end = start.checked_add(len as u64).ok_or("range overflows")?;
        if end > e.lease.len() as u64 {
            return Err(format!(
                "range {start}..{end} beyond the exposed {} bytes",
                e.lease.len()
            ));
        }
        Ok(())
    }

    fn take_recv(&mut self, host: HostId, ep: EndpointId) -> Option<WorkRequest> {
        let h = &mut self.hosts[host];
        let e = h.eps.get_mut(&ep)?;
        if e.shared {
            // Seed 003: any endpoint on the shared queue dequeues the next buffer; deliveries that waited for
            // the queue go first.
            if !h.srq_waiting.is_empty() && !self.srq_retry {
                return None;
            }
            return h.srq.as_mut()?.pop_front();
        }
        e.recvs.pop_front()
    }

    fn rnr(&mut self, d: Delivery) {
        self.stats.rnr += 1;
        let (th, tep) = d.to;
        if self.hosts[th].eps.get(&tep).is_some_and(|e| e.shared) {
            if self.srq_retry {
                self.hosts[th].srq_waiting.push_front(d);
            } else {
                self.hosts[th].srq_waiting.push_back(d);
            }
            return;
        }
        match self.cfg.rnr {
            RnrPolicy::Fail => {
                let (fh, fep) = d.from;
                tracing::warn!(
                    "sim: receiver not ready on {:?}: the sender overran the receive queue",
                    d.to
                );
                self.fail_delivery(d, WcError::RnrRetryExceeded);
                self.break_ep(fh, fep);
            }
            RnrPolicy::Wait => {
                let (th, tep) = d.to;
                if let Some(ep) = self.hosts[th].eps.get_mut(&tep) {
                    ep.waiting.push_back(d);
                }
            }
        }
    }

    /// Receives were posted to the shared queue: deliver what waited for them, in order.
    fn retry_srq(&mut self, host: HostId) {
        loop {
            let h = &mut self.hosts[host];
            if h.srq.as_ref().is_none_or(|q| q.is_empty()) {
                return;
            }
            let Some(d) = h.srq_waiting.pop_front() else {
                return;
            };
            self.srq_retry = true;
            self.deliver(d);
            self.srq_retry = false;
        }
    }

    /// A receive was posted: retry sends that waited for one.
    fn retry_waiting(&mut self, host: HostId, ep: EndpointId) {
        while let Some(e) = self.hosts[host].eps.get_mut(&ep) {
            if e.recvs.is_empty() {
                return;
            }
            let Some(d) = e.waiting.pop_front() else {
                return;
            };
            self.deliver(d);
        }
    }
}

/// A registration on a simulated device.
#[derive(Debug)]
struct SimRegistration {
    buf: Arc<DmaBuf>,
    lkey: u64,
}

impl Registration for SimRegistration {
    fn local_key(&self) -> u64 {
        self.lkey
    }
    fn buf(&self) -> &Arc<DmaBuf> {
        &self.buf
    }
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

/// A remote key on a simulated device; dropping it revokes the key.
struct SimExposure {
    net: Weak<Mutex<Net>>,
    key: u64,
    remote: RemoteRef,
    len: usize,
}

impl fmt::Debug for SimExposure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SimExposure")
            .field("key", &self.key)
            .field("len", &self.len)
            .finish()
    }
}

impl Exposure for SimExposure {
    fn remote(&self) -> RemoteRef {
        self.remote
    }
    fn read(&self, offset: usize, dst: &mut [u8]) -> Result<(), TransportError> {
        let net = self.net.upgrade().ok_or(TransportError::NoEndpoint)?;
        let n = lock(&net);
        let e = n.keys.get(&self.key).ok_or(TransportError::NoEndpoint)?;
        e.lease
            .read(offset, dst)
            .map_err(|e| TransportError::Invalid(e.to_string()))
    }
    fn write(&mut self, offset: usize, src: &[u8]) -> Result<(), TransportError> {
        let net = self.net.upgrade().ok_or(TransportError::NoEndpoint)?;
        let mut n = lock(&net);
        let e = n
            .keys
            .get_mut(&self.key)
            .ok_or(TransportError::NoEndpoint)?;
        e.lease
            .write(offset, src)
            .map_err(|e| TransportError::Invalid(e.to_string()))
    }
    fn fill_from(
        &mut self,
        offset: usize,
        src: &DmaBuf,
        src_offset: usize,
        len: usize,
    ) -> Result<(), TransportError> {
        let net = self.net.upgrade().ok_or(TransportError::NoEndpoint)?;
        let mut n = lock(&net);
        let e = n
            .keys
            .get_mut(&self.key)
            .ok_or(TransportError::NoEndpoint)?;
        src.copy_into(src_offset, &mut e.lease, offset, len)
            .map_err(|e| TransportError::Invalid(e.to_string()))
    }
    fn len(&self) -> usize {
        self.len
    }
}

impl Drop for SimExposure {
    fn drop(&mut self) {
        if let Some(net) = self.net.upgrade() {
            let entry = lock(&net).keys.remove(&self.key);
            drop(entry); // the lease goes back after the net lock is released
        }
    }
}

fn lock(net: &Mutex<Net>) -> MutexGuard<'_, Net> {
    net.lock().unwrap_or_else(|p| p.into_inner())
}

/// One simulated device (host).
pub struct SimTransport {
    net: Arc<Mutex<Net>>,
    host: HostId,
    caps: Capabilities,
    notify: Option<Arc<EventFd>>,
}

impl fmt::Debug for SimTransport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SimTransport")
            .field("host", &self.host)
            .finish()
    }
}

impl SimTransport {
    fn net(&self) -> MutexGuard<'_, Net> {
        lock(&self.net)
    }

    fn new_ep(net: &mut Net, host: HostId, ep: EndpointId, recvs: Vec<WorkRequest>) -> SocketAddr {
        let h = &mut net.hosts[host];
        let port = h.next_port;
        h.next_port = h.next_port.wrapping_add(1).max(40000);
        let local = SocketAddr::new(h.ip, port);
        h.eps.insert(
            ep,
            Ep {
                peer: None,
                recvs: recvs.into_iter().collect(),
                up: false,
                local,
                remote: None,
                last_at: Duration::ZERO,
                waiting: VecDeque::new(),
                shared: h.srq.is_some(),
            },
        );
        local
    }
}

impl Transport for SimTransport {
    fn capabilities(&self) -> &Capabilities {
        &self.caps
    }

    fn register(&mut self, buf: &Arc<DmaBuf>) -> Result<Arc<dyn Registration>, TransportError> {
        let mut net = self.net();
        net.next_key += 1;
        let lkey = net.next_key;
        Ok(Arc::new(SimRegistration {
            buf: Arc::clone(buf),
            lkey,
        }))
    }

    fn expose(
        &mut self,
        ep: EndpointId,
        reg: &Arc<dyn Registration>,
        lease: Lease,
        access: RemoteAccess,
    ) -> Result<Box<dyn Exposure>, TransportError> {
        crate::transport::check_exposure(reg, &lease, access)?;
        let mut net = self.net();
        if net.cfg.caps.keys_after_connect
            && !net.hosts[self.host].eps.get(&ep).is_some_and(|e| e.up)
        {
            // Modelling memory windows: a bind needs the connected queue pair.
            return Err(TransportError::Invalid(
                "exposure before the connection is up (keys bind to a connected endpoint)".into(),
            ));
        }
        // Keys are random, as hardware keys are not guessable in sequence.
        let key = loop {
            let k: u64 = net.rng.gen();
            if k != 0 && !net.keys.contains_key(&k) {
                break k;
            }
        };
        let base = if net.cfg.offset_addressing {
            0
        } else {
            lease.addr()
        };
        let len = lease.len();
        net.keys.insert(
            key,
            KeyEntry {
                lease,
                access,
                base,
                owner: (self.host, ep),
            },
        );
        Ok(Box::new(SimExposure {
            net: Arc::downgrade(&self.net),
            key,
            remote: RemoteRef { addr: base, key },
            len,
        }))
    }

    fn listen(
        &mut self,
        addr: SocketAddr,
        _backlog: u32,
    ) -> Result<(ListenerId, SocketAddr), TransportError> {
        let mut net = self.net();
        let h = &mut net.hosts[self.host];
        let ip = if addr.ip().is_unspecified() {
            h.ip
        } else {
            addr.ip()
        };
        if ip != h.ip {
            return Err(TransportError::AddrNotAvailable(format!(
                "{ip} is not this host's address ({})",
                h.ip
            )));
        }
        let port = if addr.port() == 0 {
            let p = h.next_port;
            h.next_port = h.next_port.wrapping_add(1).max(40000);
            p
        } else {
            addr.port()
        };
        let bound = SocketAddr::new(ip, port);
        if h.listeners.values().any(|a| *a == bound) {
            return Err(TransportError::AddrInUse(bound));
        }
        let id = ListenerId(h.next_listener);
        h.next_listener += 1;
        h.listeners.insert(id, bound);
        Ok((id, bound))
    }

    fn close_listener(&mut self, listener: ListenerId) {
        self.net().hosts[self.host].listeners.remove(&listener);
    }

    fn connect(
        &mut self,
        ep: EndpointId,
        addr: SocketAddr,
        private: &[u8],
        recvs: Vec<WorkRequest>,
    ) -> Result<(), TransportError> {
        if private.len() > self.caps.max_private_data {
            return Err(TransportError::Invalid(format!(
                "{} bytes of private data",
                private.len()
            )));
        }
        let mut net = self.net();
        let local = Self::new_ep(&mut net, self.host, ep, recvs);
        let target = net.hosts.iter().position(|h| h.ip == addr.ip());
        match target {
            Some(t) => net.schedule(
                (self.host, ep),
                (t, EndpointId(0)),
                Payload::ConnectRequest {
                    listen: addr,
                    private: private.to_vec(),
                    from_addr: local,
                },
            ),
            None => net.schedule((self.host, ep), (self.host, ep), Payload::Unreachable),
        }
        Ok(())
    }

    fn accept(
        &mut self,
        request: RequestId,
        ep: EndpointId,
        private: &[u8],
        recvs: Vec<WorkRequest>,
    ) -> Result<(), TransportError> {
        let mut net = self.net();
        let Some((from, from_addr, listen)) = net.hosts[self.host].requests.remove(&request) else {
            return Err(TransportError::Invalid("unknown connection request".into()));
        };
        Self::new_ep(&mut net, self.host, ep, recvs);
        // An accepted connection has the listener's address as its local address, as with TCP.
        let local = listen;
        let e = net.hosts[self.host]
            .eps
            .get_mut(&ep)
            .expect("just inserted");
        e.local = local;
        e.peer = Some(from);
        e.remote = Some(from_addr);
        net.schedule(
            (self.host, ep),
            from,
            Payload::Accept {
                private: private.to_vec(),
                acceptor: (self.host, ep),
                acceptor_addr: local,
            },
        );
        Ok(())
    }

    fn reject(&mut self, request: RequestId) {
        let mut net = self.net();
        if let Some((from, _, _)) = net.hosts[self.host].requests.remove(&request) {
            net.schedule((self.host, EndpointId(0)), from, Payload::Reject);
        }
    }

    fn post(&mut self, ep: EndpointId, wr: WorkRequest) -> Result<(), PostError> {
        let mut net = self.net();
        let host = self.host;
        let Some(e) = net.hosts[host].eps.get_mut(&ep) else {
            return Err(PostError {
                error: TransportError::NoEndpoint,
                wr,
            });
        };
        match wr.op {
            Op::Recv { .. } => {
                e.recvs.push_back(wr);
                net.retry_waiting(host, ep);
            }
            _ => {
                let Some(peer) = e.peer.filter(|_| e.up) else {
                    // Posting on a connection in error completes with a flush, as hardware does.
                    let kind = Net::completed_kind(&wr.op);
                    net.complete(host, ep, wr.wr_id, kind, Err(WcError::Flushed));
                    return Ok(());
                };
                net.schedule((host, ep), peer, Payload::Wr(wr));
            }
        }
        Ok(())
    }

    fn create_shared_recv(&mut self, depth: u32) -> Result<(), TransportError> {
        if self.caps.max_shared_recv == 0 {
            return Err(TransportError::Unsupported(
                "this simulated device has no shared receive queue".into(),
            ));
        }
        if depth > self.caps.max_shared_recv {
            return Err(TransportError::Resource(format!(
                "shared receive queue of {depth} (at most {})",
                self.caps.max_shared_recv
            )));
        }
        let mut net = self.net();
        let h = &mut net.hosts[self.host];
        if h.srq.is_some() {
            return Err(TransportError::Invalid(
                "the shared receive queue exists".into(),
            ));
        }
        h.srq = Some(VecDeque::new());
        Ok(())
    }

    fn post_shared_recv(&mut self, wrs: &mut Vec<WorkRequest>) -> Result<(), TransportError> {
        let mut net = self.net();
        let host = self.host;
        let depth = net.cfg.caps.max_shared_recv as usize;
        let Some(q) = net.hosts[host].srq.as_mut() else {
            wrs.clear();
            return Err(TransportError::Invalid("no shared receive queue".into()));
        };
        if wrs.iter().any(|w| !matches!(w.op, Op::Recv { .. })) {
            wrs.clear();
            return Err(TransportError::Invalid(
                "only receives go to the shared receive queue".into(),
            ));
        }
        if q.len() + wrs.len() > depth {
            wrs.clear();
            return Err(TransportError::Resource("shared receive queue full".into()));
        }
        q.extend(wrs.drain(..));
        net.retry_srq(host);
        Ok(())
    }

    fn disconnect(&mut self, ep: EndpointId) {
        let mut net = self.net();
        let host = self.host;
        let peer = net.hosts[host].eps.get(&ep).and_then(|e| e.peer);
        net.go_down(host, ep);
        if let Some(p) = peer {
            net.schedule((host, ep), p, Payload::Disconnect);
        }
    }

    fn release(&mut self, ep: EndpointId) {
        let mut net = self.net();
        let host = self.host;
        let removed = net.hosts[host].eps.remove(&ep);
        let queued: Vec<Delivery> = {
            let mut keep = Vec::new();
            let mut gone = Vec::new();
            for d in net.queue.drain(..) {
                if d.from == (host, ep) && matches!(d.payload, Payload::Wr(_)) {
                    gone.push(d);
                } else {
                    keep.push(d);
                }
            }
            net.queue = keep;
            gone
        };
        drop(net);
        // Work requests (and their leases) go back only now that nothing can deliver them.
        drop(removed);
        drop(queued);
    }

    fn poll(&mut self, out: &mut Vec<Completion>, max: usize) -> usize {
        let mut net = self.net();
        let h = &mut net.hosts[self.host];
        if std::mem::take(&mut h.panic_next_poll) {
            drop(net);
            panic!("fault injected by World::panic_on_next_poll");
        }
        let n = h.cq.len().min(max);
        out.extend(h.cq.drain(..n));
        n
    }

    fn poll_cm(&mut self) -> Option<CmEvent> {
        self.net().hosts[self.host].cm.pop_front()
    }

    fn arm(&mut self) -> Result<bool, TransportError> {
        let mut net = self.net();
        let h = &mut net.hosts[self.host];
        if let Some(n) = &h.notify {
            let _ = n.read();
        }
        if !h.cq.is_empty() || !h.cm.is_empty() {
            return Ok(false);
        }
        h.armed = true;
        Ok(true)
    }

    fn wait_fd(&self) -> Option<OwnedFd> {
        self.notify
            .as_ref()
            .and_then(|n| n.as_fd().try_clone_to_owned().ok())
    }

    fn local_addr(&self, ep: EndpointId) -> Option<SocketAddr> {
        self.net().hosts[self.host].eps.get(&ep).map(|e| e.local)
    }

    fn peer_addr(&self, ep: EndpointId) -> Option<SocketAddr> {
        self.net().hosts[self.host]
            .eps
            .get(&ep)
            .and_then(|e| e.remote)
    }
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
    contexts: Mutex<Vec<(HostId, Weak<crate::context::CtxInner>)>>,
}

impl WorldDriver {
    /// The live contexts of hosts that are not stalled.
    fn live(&self, net: &Mutex<Net>) -> Vec<Context> {
        let stalled: Vec<bool> = lock(net).hosts.iter().map(|h| h.stalled).collect();
        let mut v = self.contexts.lock().unwrap_or_else(|p| p.into_inner());
        v.retain(|(_, w)| w.strong_count() > 0);
        v.iter()
            .filter(|(h, _)| !stalled.get(*h).copied().unwrap_or(false))
            .filter_map(|(_, w)| w.upgrade())
            .map(Context::from_inner)
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
        let limit = self.elapsed() + d;
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
            let at = net.now + delay;
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

//! The network model: hosts, endpoints, remote keys and the delivery queue; how each work request moves bytes,
//! checks keys and bounds, and completes on both sides.

use super::*;

pub(super) type HostId = usize;
pub(super) type Addr = (HostId, EndpointId);

#[derive(Debug)]
pub(super) enum Payload {
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
pub(super) struct Delivery {
    pub(super) at: Duration,
    pub(super) seq: u64,
    pub(super) from: Addr,
    pub(super) to: Addr,
    pub(super) payload: Payload,
}

#[derive(Debug)]
pub(super) struct Ep {
    pub(super) peer: Option<Addr>,
    pub(super) recvs: VecDeque<WorkRequest>,
    pub(super) up: bool,
    pub(super) local: SocketAddr,
    pub(super) remote: Option<SocketAddr>,
    /// Latest delivery time scheduled from this endpoint (keeps one connection in order).
    pub(super) last_at: Duration,
    /// Sends waiting for a receive (RNR policy Wait).
    pub(super) waiting: VecDeque<Delivery>,
    /// Takes its receives from the host's shared receive queue.
    pub(super) shared: bool,
}

#[derive(Debug)]
pub(super) struct KeyEntry {
    pub(super) lease: Lease,
    pub(super) access: RemoteAccess,
    pub(super) base: u64,
    /// The one endpoint whose peer may use the key (a memory window bound to a queue pair).
    pub(super) owner: Addr,
}

pub(super) struct Host {
    pub(super) ip: IpAddr,
    pub(super) alive: bool,
    /// Fault schedule: the next completion poll panics (see [`World::panic_on_next_poll`]).
    pub(super) panic_next_poll: bool,
    /// Fault schedule: the next arming panics (see [`World::panic_on_next_arm`]).
    pub(super) panic_next_arm: bool,
    /// Fault schedule: the device makes no remote keys (see [`World::refuse_keys`]).
    pub(super) refuse_keys: bool,
    /// Fault schedule: the device registers no memory (see [`World::refuse_registrations`]).
    pub(super) refuse_registrations: bool,
    /// Fault schedule: undoing a registration fails, and the device keeps its memory for good (see
    /// [`World::keep_deregistered_memory`]); what it kept.
    pub(super) keep_deregistered: Arc<KeptMemory>,
    /// Fault schedule: the next write-with-immediate into this host fails on its way in (see
    /// [`World::fail_next_incoming_write`]).
    pub(super) fail_next_incoming_write: bool,
    /// The next accept fails before it takes its request ([`World::fail_next_accept`]).
    pub(super) fail_next_accept: bool,
    /// A message longer than its receive puts the connection in error here without a connection event, as a
    /// verbs queue pair ([`World::quiet_length_errors`]).
    pub(super) quiet_length_errors: bool,
    /// The driver of a manual world skips this host's progress.
    pub(super) stalled: bool,
    pub(super) answering: bool,
    pub(super) cq: VecDeque<Completion>,
    pub(super) cm: VecDeque<CmEvent>,
    pub(super) notify: Option<Arc<EventFd>>,
    pub(super) armed: bool,
    pub(super) eps: HashMap<EndpointId, Ep>,
    /// The shared receive queue, once created.
    pub(super) srq: Option<VecDeque<WorkRequest>>,
    /// Deliveries to endpoints on the shared queue that found it empty, in arrival order.
    pub(super) srq_waiting: VecDeque<Delivery>,
    pub(super) listeners: HashMap<ListenerId, SocketAddr>,
    /// Pending requests: requester, its address, and the listener address it asked for.
    pub(super) requests: HashMap<RequestId, (Addr, SocketAddr, SocketAddr)>,
    pub(super) next_listener: u32,
    pub(super) next_request: u64,
    pub(super) next_port: u16,
}

impl Host {
    pub(super) fn push_cq(&mut self, c: Completion) {
        self.cq.push_back(c);
        self.signal();
    }

    pub(super) fn push_cm(&mut self, e: CmEvent) {
        self.cm.push_back(e);
        self.signal();
    }

    pub(super) fn signal(&mut self) {
        if self.armed {
            self.armed = false;
            if let Some(n) = &self.notify {
                let _ = n.write(1);
            }
        }
    }
}

pub(super) struct Net {
    pub(super) cfg: SimConfig,
    pub(super) immediate: bool,
    pub(super) rng: ChaCha8Rng,
    pub(super) now: Duration,
    pub(super) base: Instant,
    pub(super) hosts: Vec<Host>,
    pub(super) queue: Vec<Delivery>,
    pub(super) seq: u64,
    pub(super) keys: HashMap<u64, KeyEntry>,
    pub(super) next_key: u64,
    pub(super) stats: NetStats,
    /// Delivering what waited for the shared receive queue (it goes before newer arrivals).
    pub(super) srq_retry: bool,
}

impl Net {
    pub(super) fn schedule(&mut self, from: Addr, to: Addr, payload: Payload) {
        let jitter = if self.cfg.jitter.is_zero() {
            Duration::ZERO
        } else {
            Duration::from_nanos(self.rng.gen_range(0..=self.cfg.jitter.as_nanos() as u64))
        };
        let mut at = self
            .now
            .saturating_add(self.cfg.latency)
            .saturating_add(jitter);
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

    pub(super) fn next_due(&self) -> Option<usize> {
        self.queue
            .iter()
            .enumerate()
            .min_by_key(|(_, d)| (d.at, d.seq))
            .map(|(i, _)| i)
    }

    pub(super) fn complete(
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

    pub(super) fn completed_kind(op: &Op) -> Completed {
        match op {
            Op::Send { .. } => Completed::Send,
            Op::Write { .. } => Completed::Write,
            Op::Read { .. } => Completed::Read,
            Op::Recv { .. } => Completed::Recv { len: 0, imm: None },
        }
    }

    pub(super) fn deliver(&mut self, d: Delivery) {
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
    pub(super) fn go_down(&mut self, host: HostId, ep: EndpointId) {
        self.go_down_telling(host, ep, true);
    }

    /// [`Net::go_down`], with the connection event `Disconnected` only if `tell`.
    fn go_down_telling(&mut self, host: HostId, ep: EndpointId, tell: bool) {
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
        if tell && (was_up || self.hosts[host].alive) {
            self.hosts[host].push_cm(CmEvent::Disconnected { ep });
        }
    }

    pub(super) fn fail_delivery(&mut self, d: Delivery, err: WcError) {
        if let Payload::Wr(wr) = d.payload {
            let kind = Self::completed_kind(&wr.op);
            self.complete(d.from.0, d.from.1, wr.wr_id, kind, Err(err));
        }
    }

    /// Breaks a connection from `host`'s side: both ends go to error.
    pub(super) fn break_ep(&mut self, host: HostId, ep: EndpointId) {
        let peer = self.hosts[host].eps.get(&ep).and_then(|e| e.peer);
        self.go_down(host, ep);
        if let Some((ph, pep)) = peer {
            self.go_down(ph, pep);
        }
    }

    pub(super) fn deliver_wr(
        &mut self,
        from: Addr,
        to: Addr,
        wr: WorkRequest,
        at: Duration,
        seq: u64,
    ) {
        let arrival = Arrival { from, to, at, seq };
        if let Err(err) = self.target_ready(from, to) {
            let kind = Self::completed_kind(&wr.op);
            self.complete(from.0, from.1, wr.wr_id, kind, Err(err));
            return;
        }
        match &wr.op {
            Op::Send { .. } => self.deliver_send(arrival, wr),
            Op::Write { .. } => self.deliver_write(arrival, wr),
            Op::Read { .. } => self.deliver_read(arrival, wr),
            Op::Recv { .. } => unreachable!("receives are not delivered"),
        }
    }

    /// Whether `to` is up and connected to `from`; if not, the error the sender's work request completes with: a
    /// flush when the target host answers, a retry timeout when it is down or silent.
    fn target_ready(&self, from: Addr, (th, tep): Addr) -> Result<(), WcError> {
        let host = &self.hosts[th];
        let answering = host.alive && host.answering;
        let connected = host
            .eps
            .get(&tep)
            .is_some_and(|e| e.up && e.peer == Some(from));
        match (answering, connected) {
            (true, true) => Ok(()),
            (true, false) => Err(WcError::Flushed),
            (false, _) => Err(WcError::RetryExceeded),
        }
    }

    /// A send consumes the target's next receive, which must hold all of it; without a receive it waits (RNR).
    fn deliver_send(&mut self, a: Arrival, wr: WorkRequest) {
        let ((fh, fep), (th, tep)) = (a.from, a.to);
        let Op::Send { sges, imm } = &wr.op else {
            unreachable!("deliver_send takes sends")
        };
        let imm = *imm;
        let Some(mut recv) = self.take_recv(th, tep) else {
            return self.rnr(a.delivery(wr));
        };
        let Op::Recv { sge: target } = &mut recv.op else {
            unreachable!("receive queue holds receives")
        };
        let total: usize = sges.iter().map(Sge::len).sum();
        if total > target.len() {
            return self.overrun_recv(a, wr.wr_id, recv.wr_id, imm);
        }
        gather(sges, 0, |src, at| {
            target.fill_from_lease(at, src, 0, src.len())
        });
        self.count_delivered(total);
        let len = total as u32;
        drop(recv.op);
        self.complete(th, tep, recv.wr_id, Completed::Recv { len, imm }, Ok(()));
        self.complete(fh, fep, wr.wr_id, Completed::Send, Ok(()));
    }

    /// A send longer than the receive it landed in: the receive fails with a length error, the send with a
    /// remote invalid request, and the connection breaks (as a queue pair goes to error).
    fn overrun_recv(&mut self, a: Arrival, send_id: u64, recv_id: u64, imm: Option<u32>) {
        let ((fh, fep), (th, tep)) = (a.from, a.to);
        self.complete(
            th,
            tep,
            recv_id,
            Completed::Recv { len: 0, imm },
            Err(WcError::LocalLength),
        );
        self.complete(
            fh,
            fep,
            send_id,
            Completed::Send,
            Err(WcError::Other("remote invalid request".into())),
        );
        if self.hosts[th].quiet_length_errors {
            // Both queue pairs in error, and no event says so at the target (the sender's side is the peer's).
            self.go_down_telling(th, tep, false);
            self.go_down(fh, fep);
        } else {
            self.break_ep(th, tep);
        }
    }

    /// A write lands in the exposed memory its key names; with an immediate it also completes at the target,
    /// consuming a receive where the provider does so (and waiting for one, RNR, when none is posted).
    fn deliver_write(&mut self, a: Arrival, wr: WorkRequest) {
        let ((fh, fep), (th, tep)) = (a.from, a.to);
        let Op::Write { local, remote, imm } = &wr.op else {
            unreachable!("deliver_write takes writes")
        };
        let (remote, imm) = (*remote, *imm);
        let n: usize = local.iter().map(Sge::len).sum();
        if !self.remote_allowed(
            a,
            wr.wr_id,
            Completed::Write,
            remote,
            n,
            RemoteAccess::Write,
        ) {
            return;
        }
        if let Some(imm) =
            imm.filter(|_| std::mem::take(&mut self.hosts[th].fail_next_incoming_write))
        {
            let cut = || Err(WcError::Other("connection reset mid-write".into()));
            self.complete(th, tep, 0, Completed::RemoteWrite { imm }, cut());
            self.complete(fh, fep, wr.wr_id, Completed::Write, cut());
            self.break_ep(th, tep);
            return;
        }
        let recv = match imm {
            Some(_) if self.cfg.caps.imm_consumes_recv => match self.take_recv(th, tep) {
                Some(r) => Some(r),
                None => return self.rnr(a.delivery(wr)),
            },
            _ => None,
        };
        let entry = self.keys.get_mut(&remote.key).expect("checked");
        let off = (remote.addr - entry.base) as usize;
        gather(local, off, |src, at| {
            src.copy_to(0, &mut entry.lease, at, src.len())
        });
        self.count_delivered(n);
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
        self.complete(fh, fep, wr.wr_id, Completed::Write, Ok(()));
    }

    /// A read copies from the exposed memory its key names into the local sink.
    fn deliver_read(&mut self, a: Arrival, mut wr: WorkRequest) {
        let Op::Read { local, remote } = &mut wr.op else {
            unreachable!("deliver_read takes reads")
        };
        let n = local.len();
        if !self.remote_allowed(a, wr.wr_id, Completed::Read, *remote, n, RemoteAccess::Read) {
            return;
        }
        let entry = self.keys.get(&remote.key).expect("checked");
        let off = (remote.addr - entry.base) as usize;
        local
            .fill_from_lease(0, &entry.lease, off, n)
            .expect("bounds checked");
        self.count_delivered(n);
        self.complete(a.from.0, a.from.1, wr.wr_id, Completed::Read, Ok(()));
    }

    /// Checks a one-sided access against its key ([`Net::remote_access`]); a refused one fails the initiator's
    /// work request with a remote access error and breaks its connection.
    fn remote_allowed(
        &mut self,
        a: Arrival,
        wr_id: u64,
        kind: Completed,
        remote: RemoteRef,
        n: usize,
        access: RemoteAccess,
    ) -> bool {
        let Err(e) = self.remote_access(remote, n, access, a.to) else {
            return true;
        };
        self.stats.access_errors += 1;
        tracing::debug!("sim: remote {} refused: {e}", access_word(access));
        let (fh, fep) = a.from;
        self.complete(fh, fep, wr_id, kind, Err(WcError::RemoteAccess));
        self.break_ep(fh, fep);
        false
    }

    fn count_delivered(&mut self, bytes: usize) {
        self.stats.bytes += bytes as u64;
        self.stats.delivered += 1;
    }

    pub(super) fn remote_access(
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

    pub(super) fn take_recv(&mut self, host: HostId, ep: EndpointId) -> Option<WorkRequest> {
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

    pub(super) fn rnr(&mut self, d: Delivery) {
        self.stats.rnr += 1;
        let (th, tep) = d.to;
        if self.hosts[th].eps.get(&tep).is_some_and(|e| e.shared) {
            if !self.cfg.caps.rnr_retry {
                // iWARP: the receiver terminates the connection (DDP's "no buffer").
                tracing::warn!(
                    "sim: the shared receive queue of {:?} was empty for a message",
                    d.to
                );
                let (fh, fep) = d.from;
                self.fail_delivery(d, WcError::Other("local QP operation error".into()));
                self.break_ep(fh, fep);
                return;
            }
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
    pub(super) fn retry_srq(&mut self, host: HostId) {
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
    pub(super) fn retry_waiting(&mut self, host: HostId, ep: EndpointId) {
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

/// Where and when a work request arrives (what it needs to wait for a receive, RNR, as a [`Delivery`]).
#[derive(Clone, Copy)]
struct Arrival {
    from: Addr,
    to: Addr,
    at: Duration,
    seq: u64,
}

impl Arrival {
    fn delivery(self, wr: WorkRequest) -> Delivery {
        Delivery {
            at: self.at,
            seq: self.seq,
            from: self.from,
            to: self.to,
            payload: Payload::Wr(wr),
        }
    }
}

/// Copies the entries `sges`, in order, to `at` onward of a sink: `fill(src, at)` copies one entry's lease there.
fn gather(
    sges: &[Sge],
    mut at: usize,
    mut fill: impl FnMut(&Lease, usize) -> Result<(), exs_dma::DmaError>,
) {
    for s in sges {
        fill(s.lease(), at).expect("lengths and bounds checked");
        at += s.len();
    }
}

fn access_word(access: RemoteAccess) -> &'static str {
    match access {
        RemoteAccess::Read => "read",
        RemoteAccess::Write => "write",
    }
}

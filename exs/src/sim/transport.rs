//! [`SimTransport`]: one host's [`Transport`] over the shared network model, with its registrations and
//! exposures.

use super::*;

/// A registration on a simulated device.
#[derive(Debug)]
pub(super) struct SimRegistration {
    pub(super) buf: Arc<DmaBuf>,
    pub(super) lkey: u64,
    /// The device's fault schedule for undoing it (its own, not the network's lock: a registration may go
    /// while that is held).
    pub(super) keep: Arc<KeptMemory>,
}

/// What a simulated device keeps of registrations it failed to undo ([`World::keep_deregistered_memory`]).
#[derive(Debug, Default)]
pub(super) struct KeptMemory {
    pub(super) on: std::sync::atomic::AtomicBool,
    kept: Mutex<Vec<Arc<DmaBuf>>>,
}

impl Drop for SimRegistration {
    fn drop(&mut self) {
        if self.keep.on.load(std::sync::atomic::Ordering::SeqCst) {
            self.buf.keep_for_good();
            self.keep
                .kept
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push(Arc::clone(&self.buf));
        }
    }
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

/// A registration of `host`'s simulated device (keys are numbered network-wide).
fn register(
    net: &Mutex<Net>,
    host: HostId,
    buf: &Arc<DmaBuf>,
) -> Result<Arc<dyn Registration>, TransportError> {
    let mut net = lock(net);
    if net.hosts[host].refuse_registrations {
        return Err(TransportError::Resource(
            "no registration: refused by the fault schedule".into(),
        ));
    }
    net.next_key += 1;
    let lkey = net.next_key;
    Ok(Arc::new(SimRegistration {
        buf: Arc::clone(buf),
        lkey,
        keep: Arc::clone(&net.hosts[host].keep_deregistered),
    }))
}

/// Registers memory of one simulated host outside its context's engine (see `Transport::registrar`).
#[derive(Debug)]
struct SimRegistrar {
    net: Weak<Mutex<Net>>,
    host: HostId,
}

impl Registrar for SimRegistrar {
    fn register(&self, buf: &Arc<DmaBuf>) -> Result<Arc<dyn Registration>, TransportError> {
        let net = self
            .net
            .upgrade()
            .ok_or_else(|| TransportError::Resource("the simulated network is gone".into()))?;
        register(&net, self.host, buf)
    }
}

/// A remote key on a simulated device; dropping it revokes the key.
pub(super) struct SimExposure {
    pub(super) net: Weak<Mutex<Net>>,
    pub(super) key: u64,
    pub(super) remote: RemoteRef,
    pub(super) len: usize,
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

pub(super) fn lock(net: &Mutex<Net>) -> MutexGuard<'_, Net> {
    net.lock().unwrap_or_else(|p| p.into_inner())
}

/// One simulated device (host).
pub struct SimTransport {
    pub(super) net: Arc<Mutex<Net>>,
    pub(super) host: HostId,
    pub(super) caps: Capabilities,
    pub(super) notify: Option<Arc<EventFd>>,
}

impl fmt::Debug for SimTransport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SimTransport")
            .field("host", &self.host)
            .finish()
    }
}

impl SimTransport {
    pub(super) fn net(&self) -> MutexGuard<'_, Net> {
        lock(&self.net)
    }

    pub(super) fn new_ep(
        net: &mut Net,
        host: HostId,
        ep: EndpointId,
        recvs: Vec<WorkRequest>,
    ) -> SocketAddr {
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
        register(&self.net, self.host, buf)
    }

    fn registrar(&self) -> Option<Arc<dyn Registrar>> {
        Some(Arc::new(SimRegistrar {
            net: Arc::downgrade(&self.net),
            host: self.host,
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
        if net.hosts[self.host].refuse_keys {
            return Err(TransportError::Resource(
                "no remote key: refused by the fault schedule".into(),
            ));
        }
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
        recvs.iter().try_for_each(|w| w.op.check_leases())?;
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
        recvs.iter().try_for_each(|w| w.op.check_leases())?;
        let mut net = self.net();
        if std::mem::take(&mut net.hosts[self.host].fail_next_accept) {
            return Err(TransportError::Resource(
                "the simulated device failed this accept".into(),
            ));
        }
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
        if let Err(error) = wr.op.check_leases() {
            return Err(PostError { error, wr });
        }
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
        if let Err(e) = wrs.iter().try_for_each(|w| w.op.check_leases()) {
            wrs.clear();
            return Err(e);
        }
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
        if std::mem::take(&mut h.panic_next_arm) {
            drop(net);
            panic!("fault injected by World::panic_on_next_arm");
        }
        if let Some(n) = &h.notify {
            let _ = n.read();
        }
        if !h.cq.is_empty() || !h.cm.is_empty() {
            return Ok(false);
        }
        h.armed = true;
        Ok(true)
    }

    fn arm_covers_cm(&self) -> bool {
        // `arm` fails while a connection event is queued.
        true
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

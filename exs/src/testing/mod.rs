//! Test utilities: a raw peer, a transport driven directly through the [`Transport`] trait with no exs engine,
//! so a test or a fuzz target can play a crafted or hostile peer (any handshake, any bytes, any RDMA access)
//! against a real exs socket, on every backend.
//!
//! Not for applications: a raw peer speaks no protocol unless its user does. Beside it, [`Pair`](crate::testing::Pair): two connected
//! exs sockets, the fixture of this crate's tests and of the conformance suite.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::transport::{
    CmEvent, Completed, Completion, EndpointId, Exposure, Op, Registration, RemoteAccess,
    RemoteRef, Sge, Transport, WcError, WorkRequest,
};
use crate::wire::{Handshake, Message, WireSockType};
use exs_dma::{DmaBuf, LeaseKind};

mod pair;
mod pingpong;

pub use pair::{Pair, PairSpec};

/// What a raw peer does while it waits: sleep a little (real transports), or drive a manual simulated world.
pub type Tick = Box<dyn FnMut() + Send>;

fn sleep_tick() -> Tick {
    Box::new(|| std::thread::sleep(Duration::from_micros(200)))
}

const SLOTS: usize = 64;
const SLOT: usize = 4096;
const RECV_TAG: u64 = 1 << 40;

/// A connected raw endpoint.
pub struct RawPeer {
    t: Box<dyn Transport>,
    tick: Tick,
    ep: EndpointId,
    rx: Arc<DmaBuf>,
    rx_reg: Arc<dyn Registration>,
    tx: Arc<DmaBuf>,
    tx_reg: Arc<dyn Registration>,
    next_wr: u64,
    /// The acceptor's handshake.
    pub peer: Handshake,
    /// Control messages received from the exs side, decoded (undecodable ones as errors).
    pub received: Vec<Result<Message, String>>,
    /// Completions of our own work requests, by id.
    pub done: Vec<Completion>,
    /// The exs side disconnected.
    pub disconnected: bool,
}

/// A handshake like the one exs sends, for `ty`, with room for everything.
pub fn handshake(ty: WireSockType) -> Handshake {
    Handshake {
        sock_type: ty,
        ctrl_window: SLOTS as u16,
        slot_size: SLOT as u16,
        send_credits: 16,
        recv_credits: 16,
        small_max: 512,
        stream_len: 0,
        stream_addr: 0,
        stream_rkey: 0,
        native_imm: true,
    }
}

impl RawPeer {
    /// Connects to `addr` with `private` as connection private data. `Err` carries how the connect ended.
    pub fn connect(
        t: Box<dyn Transport>,
        addr: SocketAddr,
        private: &[u8],
    ) -> Result<RawPeer, String> {
        Self::connect_with(t, addr, private, sleep_tick())
    }

    /// [`RawPeer::connect`], calling `tick` whenever it waits (a manual world passes its `drive`).
    pub fn connect_with(
        mut t: Box<dyn Transport>,
        addr: SocketAddr,
        private: &[u8],
        mut tick: Tick,
    ) -> Result<RawPeer, String> {
        let rx = DmaBuf::new(SLOTS * SLOT);
        let rx_reg = t.register(&rx).map_err(|e| e.to_string())?;
        let tx = DmaBuf::new(1 << 20);
        let tx_reg = t.register(&tx).map_err(|e| e.to_string())?;
        let ep = EndpointId(1);
        let recvs = (0..SLOTS)
            .map(|i| recv_wr(&rx, &rx_reg, i))
            .collect::<Result<Vec<_>, _>>()?;
        t.connect(ep, addr, private, recvs)
            .map_err(|e| e.to_string())?;
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            while let Some(ev) = t.poll_cm() {
                match ev {
                    CmEvent::Established { private, .. } => {
                        let peer = Handshake::decode(&private)
                            .map_err(|e| format!("the exs side's handshake: {e}"))?;
                        return Ok(RawPeer {
                            t,
                            tick,
                            ep,
                            rx,
                            rx_reg,
                            tx,
                            tx_reg,
                            next_wr: 1,
                            peer,
                            received: Vec::new(),
                            done: Vec::new(),
                            disconnected: false,
                        });
                    }
                    CmEvent::ConnectFailed { reason, .. } => {
                        return Err(format!("connect failed: {reason:?}"))
                    }
                    CmEvent::Disconnected { .. } => {
                        return Err("disconnected while connecting".into())
                    }
                    CmEvent::ConnectRequest { .. } => {}
                }
            }
            if Instant::now() > deadline {
                return Err("connect timed out".into());
            }
            tick();
        }
    }

    fn id(&mut self) -> u64 {
        self.next_wr += 1;
        self.next_wr
    }

    /// Sends `bytes` as one message (optionally with an immediate value).
    pub fn send_bytes(&mut self, bytes: &[u8], imm: Option<u32>) -> Result<u64, String> {
        let off = (self.next_wr as usize % 64) * 4096;
        self.tx.write_at(off, bytes).map_err(|e| e.to_string())?;
        let sges = if bytes.is_empty() {
            Vec::new()
        } else {
            vec![self.sge(off..off + bytes.len(), LeaseKind::DeviceRead)?]
        };
        let id = self.id();
        self.post(WorkRequest {
            wr_id: id,
            op: Op::Send { sges, imm },
        })?;
        Ok(id)
    }

    /// Sends a control message.
    pub fn send_msg(&mut self, m: &Message) -> Result<u64, String> {
        self.send_bytes(&m.to_vec(), None)
    }

    /// RDMA-reads `len` bytes at `remote` into our buffer; returns the id.
    pub fn read(&mut self, remote: RemoteRef, len: usize) -> Result<u64, String> {
        let local = self.sge(512 << 10..(512 << 10) + len, LeaseKind::DeviceWrite)?;
        let id = self.id();
        self.post(WorkRequest {
            wr_id: id,
            op: Op::Read { local, remote },
        })?;
        Ok(id)
    }

    /// Posts a receive, or with `remote` an RDMA read from it, into our buffer leased as `kind` (its last 4 KiB):
    /// the transport must refuse a kind the device may not write. Returns the id.
    pub fn post_sink_leased(
        &mut self,
        kind: LeaseKind,
        remote: Option<RemoteRef>,
    ) -> Result<u64, String> {
        let end = self.tx.len();
        let sge = self.sge(end - 4096..end, kind)?;
        let id = self.id();
        let op = match remote {
            Some(remote) => Op::Read { local: sge, remote },
            None => Op::Recv { sge },
        };
        self.post(WorkRequest { wr_id: id, op })?;
        Ok(id)
    }

    /// RDMA-writes `data` to `remote` (with an immediate value if given); returns the id.
    pub fn write(
        &mut self,
        remote: RemoteRef,
        data: &[u8],
        imm: Option<u32>,
    ) -> Result<u64, String> {
        let off = 256 << 10;
        self.tx.write_at(off, data).map_err(|e| e.to_string())?;
        let local = vec![self.sge(off..off + data.len(), LeaseKind::DeviceRead)?];
        let id = self.id();
        self.post(WorkRequest {
            wr_id: id,
            op: Op::Write { local, remote, imm },
        })?;
        Ok(id)
    }

    /// Exposes `data` for the exs side to read; the exposure must be kept alive while it may read.
    pub fn expose(&mut self, data: &[u8]) -> Result<Box<dyn Exposure>, String> {
        let off = 768 << 10;
        self.tx.write_at(off, data).map_err(|e| e.to_string())?;
        let lease = self
            .tx
            .lease(off..off + data.len(), LeaseKind::DeviceRead)
            .map_err(|e| e.to_string())?;
        self.t
            .expose(self.ep, &self.tx_reg, lease, RemoteAccess::Read)
            .map_err(|e| e.to_string())
    }

    /// Asks the exs side for its stream buffer (STREAM_RING_WANTED) and waits for its address and key
    /// (STREAM_RING).
    pub fn ask_stream_ring(&mut self) -> Result<RemoteRef, String> {
        self.send_msg(&Message::new(crate::wire::Body::StreamRingWanted))?;
        let find = |p: &RawPeer| {
            p.received.iter().find_map(|m| match m {
                Ok(Message {
                    body: crate::wire::Body::StreamRing { addr, rkey },
                    ..
                }) => Some(RemoteRef {
                    addr: *addr,
                    key: *rkey,
                }),
                _ => None,
            })
        };
        self.pump(Duration::from_secs(20), |p| find(p).is_some());
        find(self).ok_or_else(|| "the stream buffer's key never arrived (STREAM_RING)".into())
    }

    /// Exposes `len` bytes (at most 128 KiB) for the exs side to write into (a persistent receive's memory); the
    /// exposure must be kept alive while it may write.
    pub fn expose_writable(&mut self, len: usize) -> Result<Box<dyn Exposure>, String> {
        let off = 896 << 10;
        let lease = self
            .tx
            .lease(off..off + len, LeaseKind::DeviceWrite)
            .map_err(|e| e.to_string())?;
        self.t
            .expose(self.ep, &self.tx_reg, lease, RemoteAccess::Write)
            .map_err(|e| e.to_string())
    }

    /// Bytes last read by [`RawPeer::read`].
    pub fn read_back(&self, len: usize) -> Vec<u8> {
        let mut v = vec![0u8; len];
        let _ = self.tx.read_at(512 << 10, &mut v);
        v
    }

    fn sge(&self, r: std::ops::Range<usize>, kind: LeaseKind) -> Result<Sge, String> {
        let lease = self.tx.lease(r, kind).map_err(|e| e.to_string())?;
        Sge::new(lease, Arc::clone(&self.tx_reg)).map_err(|e| e.to_string())
    }

    fn post(&mut self, wr: WorkRequest) -> Result<(), String> {
        self.t.post(self.ep, wr).map_err(|e| e.error.to_string())
    }

    /// Processes completions and connection events for `d` (or until `until` holds).
    pub fn pump(&mut self, d: Duration, until: impl Fn(&RawPeer) -> bool) {
        let deadline = Instant::now().checked_add(d);
        let mut out = Vec::new();
        loop {
            out.clear();
            self.t.poll(&mut out, 64);
            for c in out.drain(..) {
                match c.op {
                    Completed::Recv { len, .. } if c.wr_id & RECV_TAG != 0 => {
                        let slot = (c.wr_id & !RECV_TAG) as usize;
                        if c.status.is_ok() {
                            let mut b = vec![0u8; len as usize];
                            let _ = self.rx.read_at(slot * SLOT, &mut b);
                            // A buffer may hold several messages (coalescing: `wire::FLAG_MORE`).
                            for r in crate::wire::frames(&b) {
                                self.received
                                    .push(r.map(|(_, f)| f.msg).map_err(|e| e.to_string()));
                            }
                            if let Ok(wr) = recv_wr(&self.rx, &self.rx_reg, slot) {
                                let _ = self.t.post(self.ep, wr);
                            }
                        }
                    }
                    _ => self.done.push(c),
                }
            }
            while let Some(ev) = self.t.poll_cm() {
                if matches!(ev, CmEvent::Disconnected { .. }) {
                    self.disconnected = true;
                }
            }
            if until(self) || deadline.is_some_and(|d| Instant::now() > d) {
                return;
            }
            (self.tick)();
        }
    }

    /// Waits for the completion of work request `id`.
    pub fn wait_done(&mut self, id: u64) -> Result<(), WcError> {
        self.pump(Duration::from_secs(30), |p| {
            p.done.iter().any(|c| c.wr_id == id)
        });
        match self.done.iter().find(|c| c.wr_id == id) {
            Some(c) => c.status.clone(),
            None => Err(WcError::Other("no completion within 30 s".into())),
        }
    }

    /// Waits until the exs side has disconnected us; true if it did.
    pub fn wait_disconnect(&mut self, d: Duration) -> bool {
        self.pump(d, |p| p.disconnected);
        self.disconnected
    }
}

impl std::fmt::Debug for RawPeer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RawPeer")
            .field("ep", &self.ep)
            .field("disconnected", &self.disconnected)
            .finish()
    }
}

impl Drop for RawPeer {
    fn drop(&mut self) {
        self.t.disconnect(self.ep);
        self.pump(Duration::from_millis(200), |p| p.disconnected);
        self.t.release(self.ep);
    }
}

fn recv_wr(
    rx: &Arc<DmaBuf>,
    reg: &Arc<dyn Registration>,
    slot: usize,
) -> Result<WorkRequest, String> {
    let lease = rx
        .lease(slot * SLOT..(slot + 1) * SLOT, LeaseKind::DeviceWrite)
        .map_err(|e| e.to_string())?;
    Ok(WorkRequest {
        wr_id: RECV_TAG | slot as u64,
        op: Op::Recv {
            sge: Sge::new(lease, Arc::clone(reg)).map_err(|e| e.to_string())?,
        },
    })
}

/// Deterministic test bytes: every byte depends on its position and the seed, so that a lost, repeated or
/// misplaced chunk shows when the received bytes are compared (the helper every test of this workspace uses).
pub fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        })
        .collect()
}

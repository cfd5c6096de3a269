//! Message mode (SOCK_SEQPACKET): the data path of seed 002, section 3.
//!
//! * **Advertisement** (3.1): "an exs_send \[becomes\] an RDMA send operation that sends a short advertisement
//!   containing the size and the starting address of the data block to be sent, and a memory registration handle
//!   that gives the receiving side permission to transfer the block of data directly from the sender's registered
//!   memory." The send's range is exposed for remote read for exactly as long as the advert is outstanding.
//! * **Receiver-driven read** (3.1): "exs_recv attempts to match it with a previously received advertisement ...
//!   and waits if necessary until such an advertisement is received. When a match is found, the receiving side
//!   issues an RDMA read_request." Receives match advertisements in order, one to one.
//! * **Acknowledgment** (3.2): the receiver "must also send a short unsolicited acknowledgment message back to the
//!   sender at the completion of a data transfer"; it completes the send and returns its credit. Transfers complete
//!   in order, so the acknowledgment is a cumulative count, and it rides on any control message going back.
//! * **Credits** (3.2): "send_credits is the number of advertisements it is allowed to send ... recv_credits is the
//!   number of advertisements it is prepared to receive"; negotiated at connect; "sending an advertisement requires
//!   that the sender have an unused send_credit; if not, it must wait". Sends queue; nothing is dropped.
//! * **Immediate data** (4.1): a send of at most `small_packet_max_size` bytes travels inside the advertisement
//!   (gathered from the user's registered buffer, no copy at the sender) and is copied out at the receiver.
//! * A message longer than the matched receive buffer is truncated, and the receive event says so (MSG_TRUNC).

use std::collections::VecDeque;

use exs_dma::LeaseKind;

use crate::error::{OpError, Violation};
use crate::proto::link::{AckSource, DataOp, Link};
use crate::proto::op::EventFlags;
use crate::proto::op::OpToken;
use crate::transport::{Exposure, RemoteRef, Sge, WcError};
use crate::wire::{Advert, AdvertFlags, Body, Kind};

/// How a send's data reaches the peer, decided before it enters the protocol.
#[derive(Debug)]
pub(crate) enum SendData {
    /// Immediate data (seed 002, 4.1): the user's range, leased for the device to read, gathered into the advert;
    /// or, when the peer has a persistent receive, written into it.
    Inline(Sge),
    /// The user's range exposed for remote read (seed 002, 3.1).
    Exposed(Box<dyn Exposure>),
    /// The advert of our persistent receive (its exposure stays with the receive).
    PersistentRecv,
}

/// A send waiting for an advert credit.
#[derive(Debug)]
pub(crate) struct SendReq {
    /// `None` for the advert of a persistent receive (its ticket stays with the receive).
    pub ticket: Option<OpToken>,
    pub len: usize,
    pub data: SendData,
    /// Persistent send (seed 002, 4.2), with read notifications if `true`.
    pub persistent: Option<bool>,
    /// Offset into the peer's persistent receive (seed 002, 4.4).
    pub offset: u64,
}

/// A receive waiting for an advertisement: the user's range leased for the device to write.
#[derive(Debug)]
pub(crate) struct RecvReq {
    pub ticket: OpToken,
    pub sge: Sge,
    /// Offset into the peer's persistent send (seed 002, 4.4).
    pub offset: Option<u64>,
}

/// Our persistent receive (seed 002, 4.3): the peer writes into it at will; it ends with PERSISTENT_END.
#[derive(Debug)]
struct OwnPersistentRecv {
    seq: u32,
    len: usize,
    ticket: Option<OpToken>,
    exposure: Option<Box<dyn Exposure>>,
    ending: bool,
}

/// The peer's persistent receive: where our sends go, by RDMA write.
#[derive(Debug, Clone, Copy)]
struct PeerPersistentRecv {
    seq: u32,
    addr: u64,
    key: u64,
    len: u64,
    ending: bool,
}

/// A send written straight into the peer's persistent receive.
#[derive(Debug)]
struct PersistentWrite {
    tag: u32,
    ticket: Option<OpToken>,
    len: usize,
    done: bool,
    failed: Option<OpError>,
}

/// Tags of persistent writes (reads use advert sequence numbers).
const WRITE_TAG: u32 = 1 << 31;

#[derive(Debug)]
struct Outstanding {
    seq: u32,
    ticket: Option<OpToken>,
    len: usize,
    /// Held until acknowledged (remote read access to the send's range).
    exposure: Option<Box<dyn Exposure>>,
    /// Immediate data whose send has not completed locally: its lease is still with the transport.
    inline_in_flight: bool,
    /// The data travels inside the advertisement (seed 002, 4.1).
    immediate: bool,
    acked: bool,
    failed: Option<OpError>,
    /// A persistent send: with notifications, the reads not yet reported (the queue was full).
    persistent: Option<PersistentSend>,
}

#[derive(Debug, Clone, Copy)]
struct PersistentSend {
    notify: bool,
    /// Reads notified so far (reported to the engine, which folds them while the queue is full).
    reads: usize,
    ending: bool,
}

#[derive(Debug)]
struct PeerAdvert {
    advert: Advert,
    /// Immediate data copied out of the control buffer because no receive was waiting.
    inline: Option<Vec<u8>>,
    /// A persistent send its owner ended: no new reads.
    ending: bool,
}

#[derive(Debug)]
struct Transfer {
    seq: u32,
    ticket: Option<OpToken>,
    bytes: usize,
    truncated: bool,
    reads_in_flight: u32,
    failed: Option<OpError>,
    /// A read of the peer's persistent send: it does not consume the advert.
    persistent: bool,
}

/// Counters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct MessageStats {
    /// Adverts sent.
    pub adverts_sent: u64,
    /// Of which with immediate data.
    pub immediate_sent: u64,
    /// Adverts received.
    pub adverts_received: u64,
    /// Times a send waited for an advert credit.
    pub credit_waits: u64,
    /// Receives truncated.
    pub truncated: u64,
    /// Reads of the peer's persistent send.
    pub persistent_reads: u64,
    /// Sends written into the peer's persistent receive.
    pub persistent_writes: u64,
}

/// Message-mode state of one connection. See the module documentation.
#[derive(Debug)]
pub(crate) struct MessageProto {
    /// Largest send that goes as immediate data.
    small_max: usize,
    max_message: u64,
    /// Seed 002 send_credits: adverts we may still send.
    credits: u32,
    /// Seed 002 recv_credits granted to the peer.
    recv_window: u32,
    next_seq: u32,
    queue: VecDeque<SendReq>,
    unacked: VecDeque<Outstanding>,
    recvs: VecDeque<RecvReq>,
    adverts: VecDeque<PeerAdvert>,
    transfers: VecDeque<Transfer>,
    /// Next advert sequence number expected from the peer.
    expected_seq: u32,
    /// Cumulative count of the peer's adverts whose transfer finished: the acknowledgment value.
    done_seq: u32,
    /// Acknowledgment value last sent.
    acked_seq: u32,
    peer_closed: bool,
    /// The peer stopped receiving (CLOSE StopReceiving) when this was our oldest unacknowledged advert: every
    /// send from there on was failed.
    stopped_from: Option<u32>,
    /// Sends that failed before the peer acknowledged them, with their exposure. The peer may still be
    /// reading, so revoking the key now would turn our close into a remote-access error at the peer; and the
    /// send's event must not come while its buffer is still exposed. Both happen when the endpoint is released
    /// ([`MessageProto::drop_all`]): key first, then the event.
    retired: Vec<(Box<dyn Exposure>, OpToken, OpError)>,
    /// Whether acknowledgments may wait for a message going the other way (delayed acks enabled).
    delay_acks: bool,
    /// Our adverts sent before the last acknowledgment left: more than that means request/response traffic.
    ack_marker: u64,
    own_precv: Option<OwnPersistentRecv>,
    peer_precv: Option<PeerPersistentRecv>,
    writes: VecDeque<PersistentWrite>,
    next_write: u32,
    pub stats: MessageStats,
}

impl MessageProto {
    /// `send_credits`: our adverts outstanding at once; `recv_credits`: the peer's. `small_max` is already
    /// clamped to what the peer's control buffers hold.
    pub(crate) fn new(
        send_credits: u32,
        recv_credits: u32,
        small_max: usize,
        max_message: u64,
        delay_acks: bool,
    ) -> Self {
        MessageProto {
            small_max,
            max_message: max_message.max(1),
            credits: send_credits.max(1),
            recv_window: recv_credits.max(1),
            next_seq: 0,
            queue: VecDeque::new(),
            unacked: VecDeque::new(),
            recvs: VecDeque::new(),
            adverts: VecDeque::new(),
            transfers: VecDeque::new(),
            expected_seq: 0,
            done_seq: 0,
            acked_seq: 0,
            peer_closed: false,
            stopped_from: None,
            retired: Vec::new(),
            delay_acks,
            ack_marker: 0,
            own_precv: None,
            peer_precv: None,
            writes: VecDeque::new(),
            next_write: 0,
            stats: MessageStats::default(),
        }
    }

    /// Whether a send of `len` bytes goes as immediate data (seed 002, 4.1: "not exceeding that limit").
    pub(crate) fn is_immediate(&self, len: usize) -> bool {
        len <= self.small_max || self.writes_to_peer()
    }

    /// Whether sends go by RDMA write into the peer's persistent receive (seed 002, 4.3).
    pub(crate) fn writes_to_peer(&self) -> bool {
        self.peer_precv.is_some_and(|p| !p.ending)
    }

    /// Size of the peer's active persistent receive.
    pub(crate) fn peer_precv_len(&self) -> Option<u64> {
        self.peer_precv.filter(|p| !p.ending).map(|p| p.len)
    }

    /// Size of the peer's active persistent send, when it is at the head of its adverts.
    pub(crate) fn peer_psend_len(&self) -> Option<u64> {
        self.adverts
            .front()
            .filter(|a| a.advert.flags.has(AdvertFlags::PERSISTENT) && !a.ending)
            .map(|a| a.advert.len)
    }

    /// Whether this side has a persistent operation active (ours), and whether the peer has.
    fn persistence(&self) -> (bool, bool) {
        let ours = self.own_precv.is_some()
            || self.unacked.iter().any(|o| o.persistent.is_some())
            || self.queue.iter().any(|q| q.persistent.is_some());
        let theirs = self.peer_precv.is_some()
            || self
                .adverts
                .iter()
                .any(|a| a.advert.flags.has(AdvertFlags::PERSISTENT));
        (ours, theirs)
    }

    /// Seed 002, 4.3: "both sides of an EXS socket connection cannot be persistent, since one of the sides must be
    /// an active (non-persistent) driver of the passive (persistent) side." Checked before a persistent operation.
    pub(crate) fn may_be_persistent(&self) -> Result<(), &'static str> {
        if self.persistence().1 {
            return Err(
                "the peer is already persistent on this connection; one side must stay active",
            );
        }
        Ok(())
    }

    /// A receive would complete at once: an advert is waiting, or the peer shut its side down.
    pub(crate) fn readable(&self) -> bool {
        !self.adverts.is_empty() || self.peer_closed
    }

    /// A send would start at once: an advert credit, or the peer's persistent receive.
    pub(crate) fn writable(&self) -> bool {
        self.credits > 0 || self.writes_to_peer()
    }

    /// Every send has been handed to the link (none waits for a credit).
    pub(crate) fn sends_posted(&self) -> bool {
        self.queue.is_empty()
    }

    /// Every send has completed (non-persistent ones; a persistent send lasts until ended).
    pub(crate) fn sends_done(&self) -> bool {
        self.unacked.iter().all(|o| o.persistent.is_some()) && self.writes.is_empty()
    }

    /// Every send has completed, persistent ones included.
    pub(crate) fn sends_done_all(&self) -> bool {
        self.unacked.is_empty() && self.writes.is_empty() && self.queue.is_empty()
    }

    pub(crate) fn send(&mut self, req: SendReq, link: &mut Link) {
        if req.persistent.is_none() {
            if let (Some(p), SendData::Inline(_)) = (self.peer_precv, &req.data) {
                return self.write_to_peer(req, p, link);
            }
        }
        if req.offset > 0 {
            // An offset send needs the peer's persistent receive, which ended since the engine checked.
            if let Some(t) = req.ticket {
                t.complete(Err(OpError::PersistentEnded), 0, EventFlags::default());
            }
            return;
        }
        self.queue.push_back(req);
        self.pump(link);
    }

    /// Seed 002, 4.3: "the same exs_rcv will be used to satisfy all subsequent exs_sends": the send becomes an
    /// RDMA write into the peer's persistent receive (at `offset`), complete when the write is.
    fn write_to_peer(&mut self, req: SendReq, p: PeerPersistentRecv, link: &mut Link) {
        let SendData::Inline(sge) = req.data else {
            unreachable!("checked by the caller")
        };
        let Some(ticket) = req.ticket else { return };
        if p.ending || req.offset.saturating_add(req.len as u64) > p.len {
            // The engine checked the range against the receive it saw; it ended since.
            ticket.complete(Err(OpError::PersistentEnded), 0, EventFlags::default());
            return;
        }
        let tag = WRITE_TAG | (self.next_write & !WRITE_TAG);
        self.next_write = self.next_write.wrapping_add(1);
        self.stats.persistent_writes += 1;
        if req.len == 0 {
            drop(sge);
            ticket.complete(Ok(()), 0, EventFlags::default());
            return;
        }
        link.push_write(
            DataOp::Write {
                local: vec![sge],
                remote: RemoteRef {
                    addr: p.addr + req.offset,
                    key: p.key,
                },
                imm: None,
            },
            tag,
        );
        self.writes.push_back(PersistentWrite {
            tag,
            ticket: Some(ticket),
            len: req.len,
            done: false,
            failed: None,
        });
    }

    /// An RDMA write into the peer's persistent receive finished.
    pub(crate) fn on_write_done(&mut self, tag: u32, status: Result<(), WcError>, link: &mut Link) {
        if let Some(w) = self.writes.iter_mut().find(|w| w.tag == tag && !w.done) {
            w.done = true;
            if let Err(e) = status {
                w.failed = Some(e.into());
            }
        }
        while self.writes.front().is_some_and(|w| w.done) {
            let mut w = self.writes.pop_front().expect("checked");
            if let Some(t) = w.ticket.take() {
                match w.failed.take() {
                    None => t.complete(Ok(()), w.len, EventFlags::default()),
                    Some(e) => t.complete(Err(e), 0, EventFlags::default()),
                }
            }
        }
        self.finish_peer_precv(link);
    }

    /// The peer ended its persistent receive: once our writes into it are done, confirm.
    fn finish_peer_precv(&mut self, link: &mut Link) {
        if let Some(p) = self.peer_precv {
            if p.ending && self.writes.is_empty() {
                self.peer_precv = None;
                link.push_ctrl(
                    Body::PersistentEnd {
                        seq: p.seq,
                        echo: true,
                    },
                    None,
                    None,
                );
            }
        }
    }

    /// Posts our persistent receive (seed 002, 4.3): its buffer is exposed for remote write and advertised; the
    /// operation completes only when it ends ([`MessageProto::end_persistent`]) or the connection does.
    pub(crate) fn recv_persistent(
        &mut self,
        ticket: OpToken,
        exposure: Box<dyn Exposure>,
        link: &mut Link,
    ) -> Result<(), (OpToken, &'static str)> {
        if self.own_precv.is_some() {
            return Err((
                ticket,
                "a persistent receive is already active on this socket",
            ));
        }
        if let Err(why) = self.may_be_persistent() {
            return Err((ticket, why));
        }
        let len = exposure.len();
        self.own_precv = Some(OwnPersistentRecv {
            seq: u32::MAX, // set when the advert goes out
            len,
            ticket: Some(ticket),
            exposure: Some(exposure),
            ending: false,
        });
        // The advert is queued like a send: it takes an advert credit, in order with our other adverts.
        self.queue.push_back(SendReq {
            ticket: None,
            len,
            data: SendData::PersistentRecv,
            persistent: None,
            offset: 0,
        });
        self.pump(link);
        Ok(())
    }

    /// Sends adverts while credits last (seed 002, 3.2).
    fn pump(&mut self, link: &mut Link) {
        while self.credits > 0 {
            let Some(req) = self.queue.pop_front() else {
                return;
            };
            let seq = self.next_seq;
            self.next_seq = self.next_seq.wrapping_add(1);
            self.credits -= 1;
            self.stats.adverts_sent += 1;
            let persistent = req.persistent.map(|notify| PersistentSend {
                notify,
                reads: 0,
                ending: false,
            });
            let (advert, inline, exposure) = match req.data {
                SendData::PersistentRecv => {
                    let Some(own) = self.own_precv.as_mut() else {
                        continue; // ended (connection failed) before its advert went out
                    };
                    own.seq = seq;
                    let r = own
                        .exposure
                        .as_ref()
                        .map(|e| e.remote())
                        .unwrap_or(RemoteRef { addr: 0, key: 0 });
                    (
                        Advert {
                            seq,
                            flags: AdvertFlags(AdvertFlags::PERSISTENT_RECV),
                            len: own.len as u64,
                            addr: r.addr,
                            rkey: r.key,
                        },
                        None,
                        None,
                    )
                }
                SendData::Inline(sge) => {
                    self.stats.immediate_sent += 1;
                    let flags = AdvertFlags(AdvertFlags::IMMEDIATE);
                    (
                        Advert {
                            seq,
                            flags,
                            len: req.len as u64,
                            addr: 0,
                            rkey: 0,
                        },
                        Some(sge),
                        None,
                    )
                }
                SendData::Exposed(exp) => {
                    let r = exp.remote();
                    let flags = match persistent {
                        None => 0,
                        Some(p) if p.notify => AdvertFlags::PERSISTENT | AdvertFlags::NOTIFY,
                        Some(_) => AdvertFlags::PERSISTENT,
                    };
                    (
                        Advert {
                            seq,
                            flags: AdvertFlags(flags),
                            len: req.len as u64,
                            addr: r.addr,
                            rkey: r.key,
                        },
                        None,
                        Some(exp),
                    )
                }
            };
            let inline_in_flight = inline.is_some();
            link.push_ctrl(
                Body::Advert(advert),
                inline,
                inline_in_flight.then_some(seq),
            );
            self.unacked.push_back(Outstanding {
                seq,
                ticket: req.ticket,
                len: req.len,
                exposure,
                inline_in_flight,
                immediate: inline_in_flight,
                acked: false,
                failed: None,
                persistent,
            });
        }
        if !self.queue.is_empty() {
            self.stats.credit_waits += 1;
        }
    }

    pub(crate) fn recv(&mut self, req: RecvReq, link: &mut Link) {
        if self.peer_closed && self.adverts.is_empty() {
            // End of stream: nothing more will come.
            req.ticket.complete_eof();
            return;
        }
        self.recvs.push_back(req);
        self.match_adverts(link);
    }

    /// An advertisement arrived. `inline` reads its immediate data out of the control buffer.
    pub(crate) fn on_advert(
        &mut self,
        advert: Advert,
        inline: &mut dyn FnMut(&mut Sge) -> Result<(), Violation>,
        inline_copy: &mut dyn FnMut() -> Result<Vec<u8>, Violation>,
        link: &mut Link,
    ) -> Result<(), Violation> {
        if advert.seq != self.expected_seq {
            return Err(Violation::AdvertOutOfOrder {
                expected: self.expected_seq,
                got: advert.seq,
            });
        }
        // Seed 002, 3.2: the peer may have at most recv_credits adverts we have not acknowledged.
        let unacked = self.expected_seq.wrapping_sub(self.acked_seq);
        if unacked >= self.recv_window {
            return Err(Violation::AdvertOverrun {
                seq: advert.seq,
                credits: self.recv_window,
            });
        }
        let flags = advert.flags;
        let persistent =
            flags.has(AdvertFlags::PERSISTENT) || flags.has(AdvertFlags::PERSISTENT_RECV);
        if persistent {
            // Seed 002, 4.3: one side must stay active.
            if self.persistence().0 {
                return Err(Violation::Persistent(
                    "a persistent advertisement while our side is persistent".into(),
                ));
            }
            if flags.has(AdvertFlags::IMMEDIATE)
                || (flags.has(AdvertFlags::PERSISTENT) && flags.has(AdvertFlags::PERSISTENT_RECV))
            {
                return Err(Violation::Persistent(format!(
                    "advert {} has incompatible flags {:#x}",
                    advert.seq, flags.0
                )));
            }
            let dup = if flags.has(AdvertFlags::PERSISTENT) {
                self.adverts
                    .iter()
                    .any(|a| a.advert.flags.has(AdvertFlags::PERSISTENT))
            } else {
                self.peer_precv.is_some()
                    || self
                        .adverts
                        .iter()
                        .any(|a| a.advert.flags.has(AdvertFlags::PERSISTENT_RECV))
            };
            if dup {
                return Err(Violation::Persistent(
                    "a second persistent advertisement of the same kind".into(),
                ));
            }
        } else if flags.has(AdvertFlags::NOTIFY) {
            return Err(Violation::Persistent(
                "read notification asked for a send that is not persistent".into(),
            ));
        }
        if !flags.has(AdvertFlags::IMMEDIATE)
            && advert.len > 0
            && advert.addr.checked_add(advert.len).is_none()
        {
            return Err(Violation::BadRange(format!(
                "advert {}: address {:#x} + length {} overflows",
                advert.seq, advert.addr, advert.len
            )));
        }
        self.expected_seq = self.expected_seq.wrapping_add(1);
        self.stats.adverts_received += 1;
        if flags.has(AdvertFlags::IMMEDIATE) && self.adverts.is_empty() && !self.recvs.is_empty() {
            // Fast path: copy straight from the control buffer into the waiting receive.
            let mut req = self.recvs.pop_front().expect("checked");
            if req.offset.is_some() {
                req.ticket
                    .complete(Err(OpError::PersistentEnded), 0, EventFlags::default());
                self.adverts.push_back(PeerAdvert {
                    advert,
                    inline: Some(inline_copy()?),
                    ending: false,
                });
                self.match_adverts(link);
                return Ok(());
            }
            let cap = req.sge.len();
            let n = (advert.len as usize).min(cap);
            if n > 0 {
                inline(&mut req.sge)?;
            }
            self.finish_immediate(advert, req, n);
        } else {
            let data = if flags.has(AdvertFlags::IMMEDIATE) {
                Some(inline_copy()?)
            } else {
                None
            };
            self.adverts.push_back(PeerAdvert {
                advert,
                inline: data,
                ending: false,
            });
            self.match_adverts(link);
        }
        self.complete_transfers(link);
        Ok(())
    }

    fn finish_immediate(&mut self, advert: Advert, req: RecvReq, n: usize) {
        let truncated = advert.len as usize > n;
        self.stats.truncated += u64::from(truncated);
        // The lease on the receive buffer is released here (the copy is done).
        drop(req.sge);
        self.transfers.push_back(Transfer {
            seq: advert.seq,
            ticket: Some(req.ticket),
            bytes: n,
            truncated,
            reads_in_flight: 0,
            failed: None,
            persistent: false,
        });
    }

    /// Issues the reads that move `n` bytes from `addr` (peer memory) into the receive buffer.
    fn push_reads(
        &self,
        sge: Sge,
        n: usize,
        addr: u64,
        key: u64,
        seq: u32,
        link: &mut Link,
    ) -> u32 {
        if n == 0 {
            return 0;
        }
        let (lease, reg) = sge.into_parts();
        let mut rest = lease.narrow(0..n);
        let mut offset = 0u64;
        let mut reads = 0;
        while !rest.is_empty() {
            let chunk = (rest.len() as u64).min(self.max_message) as usize;
            let (now, later) = rest.split_at(chunk);
            rest = later;
            let local = Sge::new(now, reg.clone()).expect("lease stays on its buffer");
            let remote = RemoteRef {
                addr: addr + offset,
                key,
            };
            link.push_read(DataOp::Read { local, remote }, seq);
            offset += chunk as u64;
            reads += 1;
        }
        reads
    }

    /// Matches receives with advertisements in order (seed 002, 3.1) and starts the reads. A persistent send at
    /// the head is never consumed: every receive reads it again (seed 002, 4.2), until its owner ends it. A
    /// persistent receive's advert needs no receive: it is taken as it reaches the head.
    fn match_adverts(&mut self, link: &mut Link) {
        while let Some(head) = self.adverts.front() {
            let flags = head.advert.flags;
            if flags.has(AdvertFlags::PERSISTENT_RECV) {
                let a = self.adverts.pop_front().expect("checked").advert;
                self.peer_precv = Some(PeerPersistentRecv {
                    seq: a.seq,
                    addr: a.addr,
                    key: a.rkey,
                    len: a.len,
                    ending: false,
                });
                self.transfers.push_back(Transfer {
                    seq: a.seq,
                    ticket: None,
                    bytes: 0,
                    truncated: false,
                    reads_in_flight: 0,
                    failed: None,
                    persistent: false,
                });
                continue;
            }
            if flags.has(AdvertFlags::PERSISTENT) {
                if head.ending {
                    break;
                }
                let Some(req) = self.recvs.pop_front() else {
                    break;
                };
                let advert = head.advert;
                let offset = req.offset.unwrap_or(0);
                let avail = advert.len.saturating_sub(offset);
                let cap = req.sge.len();
                let n = usize::try_from(avail).unwrap_or(usize::MAX).min(cap);
                let truncated = req.offset.is_none() && avail > n as u64;
                self.stats.truncated += u64::from(truncated);
                self.stats.persistent_reads += 1;
                let reads = self.push_reads(
                    req.sge,
                    n,
                    advert.addr + offset,
                    advert.rkey,
                    advert.seq,
                    link,
                );
                self.transfers.push_back(Transfer {
                    seq: advert.seq,
                    ticket: Some(req.ticket),
                    bytes: n,
                    truncated,
                    reads_in_flight: reads,
                    failed: None,
                    persistent: true,
                });
                continue;
            }
            let Some(req) = self.recvs.pop_front() else {
                break;
            };
            if req.offset.is_some() {
                // An offset receive needs the peer's persistent send, which has ended.
                req.ticket
                    .complete(Err(OpError::PersistentEnded), 0, EventFlags::default());
                continue;
            }
            let PeerAdvert { advert, inline, .. } = self.adverts.pop_front().expect("checked");
            let mut req = req;
            let cap = req.sge.len();
            let n = usize::try_from(advert.len).unwrap_or(usize::MAX).min(cap);
            if let Some(data) = inline {
                if n > 0 {
                    // The receive's lease is ours until we drop it: writing through it cannot fail.
                    req.sge
                        .lease_mut()
                        .write(0, &data[..n])
                        .expect("receive lease covers the copy");
                }
                self.finish_immediate(advert, req, n);
                continue;
            }
            let truncated = advert.len as usize > n;
            self.stats.truncated += u64::from(truncated);
            let reads = self.push_reads(req.sge, n, advert.addr, advert.rkey, advert.seq, link);
            self.transfers.push_back(Transfer {
                seq: advert.seq,
                ticket: Some(req.ticket),
                bytes: n,
                truncated,
                reads_in_flight: reads,
                failed: None,
                persistent: false,
            });
        }
        // Transfers that need no read (immediate data, empty receive buffers) are complete now.
        self.complete_transfers(link);
    }

    /// An RDMA read finished.
    pub(crate) fn on_read_done(
        &mut self,
        seq: u32,
        status: Result<(), WcError>,
        link: &mut Link,
    ) -> Result<(), Violation> {
        let Some(t) = self
            .transfers
            .iter_mut()
            .find(|t| t.seq == seq && t.reads_in_flight > 0)
        else {
            return Ok(()); // a read of a transfer that was already failed and completed
        };
        t.reads_in_flight -= 1;
        match status {
            Ok(()) => {}
            Err(WcError::RemoteAccess) => {
                return Err(Violation::RemoteAccess(format!(
                    "read of advert {seq} refused by the peer's device"
                )));
            }
            Err(e) => {
                // A failed read means the connection broke (RC: the queue pair is in error): this message is
                // lost, so no message behind it may complete as if nothing were missing (seqpacket delivers
                // in order, seed 002, 3.1), even one whose bytes came inline.
                let err: OpError = e.into();
                for t in self.transfers.iter_mut().skip_while(|t| t.seq != seq) {
                    t.failed.get_or_insert(err.clone());
                }
            }
        }
        self.complete_transfers(link);
        Ok(())
    }

    /// Completes finished transfers in order. Reads of a persistent send do not consume it; each one is reported
    /// to its owner when it asked for notifications (seed 002, 4.2). A persistent send that its owner ended is
    /// consumed once no read of it is in flight.
    fn complete_transfers(&mut self, link: &mut Link) {
        self.complete_transfers_with(Some(link));
    }

    /// [`MessageProto::complete_transfers`]; without a link (the connection is failing) nothing is sent.
    fn complete_transfers_with(&mut self, mut link: Option<&mut Link>) {
        while let Some(t) = self.transfers.front() {
            if t.reads_in_flight > 0 {
                break;
            }
            let mut t = self.transfers.pop_front().expect("checked");
            let flags = EventFlags {
                truncated: t.truncated,
                eof: false,
            };
            let ok = t.failed.is_none();
            if let Some(ticket) = t.ticket.take() {
                match t.failed.take() {
                    None => ticket.complete(Ok(()), t.bytes, flags),
                    // The sender cancelled this message by closing: for the receiver, the stream ended.
                    Some(OpError::PeerClosed) => ticket.complete_eof(),
                    Some(e) => ticket.complete(Err(e), 0, flags),
                }
            }
            if t.persistent {
                let notify = self.adverts.front().is_some_and(|a| {
                    a.advert.seq == t.seq && a.advert.flags.has(AdvertFlags::NOTIFY)
                });
                if let (true, true, Some(link)) = (notify, ok, link.as_deref_mut()) {
                    link.push_ctrl(Body::ReadNotify { seq: t.seq }, None, None);
                }
            } else {
                self.done_seq = self.done_seq.wrapping_add(1);
            }
        }
        // An ended persistent send is consumed once its reads are done.
        let ended = self
            .adverts
            .front()
            .is_some_and(|a| a.ending && a.advert.flags.has(AdvertFlags::PERSISTENT));
        if let (true, Some(link)) = (ended && !self.transfers.iter().any(|t| t.persistent), link) {
            self.adverts.pop_front();
            self.done_seq = self.done_seq.wrapping_add(1);
            self.match_adverts(link);
        }
    }

    /// The peer read our persistent send `seq` (seed 002, 4.2, the notifying variant): an event for the send's
    /// queue. While the queue is full, reads are counted and reported together in the next event's `bytes`.
    pub(crate) fn on_read_notify(&mut self, seq: u32) -> Result<(), Violation> {
        let Some(o) = self.unacked.iter_mut().find(|o| o.seq == seq) else {
            return Err(Violation::Persistent(format!(
                "read notification for unknown advert {seq}"
            )));
        };
        let (Some(p), Some(ticket)) = (o.persistent.as_mut(), o.ticket.as_ref()) else {
            return Err(Violation::Persistent(format!(
                "read notification for advert {seq}, which is not a persistent send"
            )));
        };
        if !p.notify {
            return Err(Violation::Persistent(format!(
                "read notification for advert {seq}, which asked for none"
            )));
        }
        p.reads += 1;
        ticket.notify(1);
        Ok(())
    }

    /// Ends our persistent send(s) and receive (seed 002: "ends when the sender cancels"). Returns whether there
    /// was anything to end.
    pub(crate) fn end_persistent(&mut self, link: &mut Link) -> bool {
        let mut any = false;
        for o in self.unacked.iter_mut() {
            if let Some(p) = o.persistent.as_mut() {
                if !p.ending && !o.acked {
                    p.ending = true;
                    any = true;
                    link.push_ctrl(
                        Body::PersistentEnd {
                            seq: o.seq,
                            echo: false,
                        },
                        None,
                        None,
                    );
                }
            }
        }
        if let Some(own) = self.own_precv.as_mut() {
            if !own.ending && own.seq != u32::MAX {
                own.ending = true;
                any = true;
                link.push_ctrl(
                    Body::PersistentEnd {
                        seq: own.seq,
                        echo: false,
                    },
                    None,
                    None,
                );
            }
        }
        any
    }

    /// PERSISTENT_END from the peer: it ends its persistent send or receive, or confirms the end of ours.
    pub(crate) fn on_persistent_end(
        &mut self,
        seq: u32,
        echo: bool,
        link: &mut Link,
    ) -> Result<(), Violation> {
        if echo {
            let Some(own) = self.own_precv.as_mut().filter(|o| o.seq == seq && o.ending) else {
                return Err(Violation::Persistent(format!(
                    "confirmation of an end we never asked for ({seq})"
                )));
            };
            // The peer writes no more: revoke the key, then complete the receive.
            own.exposure = None;
            let own = self.own_precv.take().expect("checked");
            if let Some(t) = own.ticket {
                t.complete(Ok(()), own.len, EventFlags::default());
            }
            return Ok(());
        }
        if let Some(head) = self.adverts.front_mut() {
            if head.advert.seq == seq
                && head.advert.flags.has(AdvertFlags::PERSISTENT)
                && !head.ending
            {
                head.ending = true;
                // Receives waiting behind it now wait for the next advert; offset receives fail.
                self.complete_transfers(link);
                self.match_adverts(link);
                return Ok(());
            }
        }
        if let Some(p) = self.peer_precv.as_mut() {
            if p.seq == seq && !p.ending {
                p.ending = true;
                self.finish_peer_precv(link);
                return Ok(());
            }
        }
        Err(Violation::Persistent(format!(
            "end of unknown persistent advert {seq}"
        )))
    }

    /// Whether an acknowledgment is due.
    pub(crate) fn ack_due(&self) -> bool {
        self.done_seq != self.acked_seq
    }

    /// Whether a due acknowledgment should go now rather than wait for a reply to carry it.
    ///
    /// Like TCP's delayed acknowledgment, but only for request/response traffic: when we have sent adverts since
    /// our last acknowledgment, the application is answering, and its next advert will carry the acknowledgment.
    /// A one-way stream of messages is acknowledged at once, and so is any backlog of half the peer's credits
    /// (the sender must never stall on a delayed acknowledgment).
    pub(crate) fn ack_now(&self) -> bool {
        let waiting = self.expected_seq.wrapping_sub(self.acked_seq);
        let answering = self.stats.adverts_sent > self.ack_marker;
        !self.delay_acks
            || !answering
            || self.peer_closed
            || waiting >= self.recv_window.div_ceil(2)
    }

    /// Queues an explicit ACK if one is due and none is queued (it is dropped at send time if a piggyback took it).
    pub(crate) fn queue_ack(&mut self, link: &mut Link) {
        if self.ack_due() && !link.has_queued(Kind::Ack) {
            link.push_ctrl(Body::Ack, None, None);
        }
    }

    /// The peer acknowledged `ack` adverts in total (seed 002, 3.2).
    pub(crate) fn on_ack(&mut self, ack: u32, link: &mut Link) -> Result<(), Violation> {
        if let Some(floor) = self.stopped_from {
            // The peer stopped receiving and our sends from `floor` on were failed. Transfers it had under way
            // may still finish and be acknowledged after its notice (soak, with coalescing: an acknowledgment
            // held behind a send in flight left after it); that changes nothing here, but it must not reach
            // beyond what we sent.
            if ack.wrapping_sub(floor) <= self.next_seq.wrapping_sub(floor) {
                return Ok(());
            }
            return Err(Violation::UnknownAck {
                seq: ack,
                oldest: floor,
                outstanding: self.next_seq.wrapping_sub(floor) as usize,
            });
        }
        let oldest = self
            .unacked
            .iter()
            .find(|o| !o.acked)
            .map(|o| o.seq)
            .unwrap_or(self.next_seq);
        let newly = ack.wrapping_sub(oldest) as usize;
        let waiting = self.unacked.iter().filter(|o| !o.acked).count();
        if newly > waiting {
            return Err(Violation::UnknownAck {
                seq: ack,
                oldest,
                outstanding: waiting,
            });
        }
        let mut marked = 0;
        for o in self.unacked.iter_mut().filter(|o| !o.acked).take(newly) {
            o.acked = true;
            // Revoke the remote key now: the peer is done reading (least exposure).
            o.exposure = None;
            marked += 1;
        }
        self.credits += marked;
        self.complete_sends();
        self.pump(link);
        Ok(())
    }

    /// The control message carrying immediate data for advert `seq` left (its buffer lease came back).
    pub(crate) fn on_inline_sent(&mut self, seq: u32, status: Result<(), WcError>) {
        if let Some(o) = self.unacked.iter_mut().find(|o| o.seq == seq) {
            o.inline_in_flight = false;
            if let Err(e) = status {
                o.failed.get_or_insert(e.into());
            }
        }
        self.complete_sends();
    }

    /// Completes sends in order: an acknowledged send once its local buffer is free too, and an immediate send
    /// as soon as its control message has left (seed 002, 4.1: the data travels inside the advertisement, so
    /// once the transport has it the buffer is free and nothing remains to wait for; like TCP's `send`, the
    /// event says the bytes are on their way, and the acknowledgment only returns the advertisement's credit).
    /// An immediate send behind one still waiting for its acknowledgment waits too: events stay in order.
    fn complete_sends(&mut self) {
        self.retire_finished();
        for o in self.unacked.iter_mut() {
            if o.ticket.is_none() {
                continue; // completed early already
            }
            if !(o.immediate && !o.inline_in_flight && o.failed.is_none()) {
                break;
            }
            if let Some(t) = o.ticket.take() {
                t.complete(Ok(()), o.len, EventFlags::default());
            }
        }
    }

    /// Pops, in order, the sends that are acknowledged (or failed) with their buffers free, completing the
    /// ones not completed yet.
    fn retire_finished(&mut self) {
        while let Some(o) = self.unacked.front() {
            let finished = (o.acked || o.failed.is_some()) && !o.inline_in_flight;
            if !finished {
                return;
            }
            let mut o = self.unacked.pop_front().expect("checked");
            if !o.acked && o.exposure.is_some() && o.ticket.is_some() {
                let exposure = o.exposure.take().expect("checked");
                let ticket = o.ticket.take().expect("checked");
                let err = o.failed.take().unwrap_or(OpError::ConnectionReset);
                self.retired.push((exposure, ticket, err));
                continue;
            }
            if let Some(t) = o.ticket.take() {
                match o.failed.take() {
                    None => t.complete(Ok(()), o.len, EventFlags::default()),
                    Some(e) => t.complete(Err(e), 0, EventFlags::default()),
                }
            }
        }
    }

    /// The peer closed: its unread adverts are gone, our receives end with end-of-stream (including those
    /// whose read is still in flight: the sender cancelled that message), our sends fail.
    pub(crate) fn on_peer_close(&mut self, reason: crate::wire::CloseReason) {
        self.peer_closed = true;
        if reason == crate::wire::CloseReason::ShutdownWrite {
            // Half close: every advert the peer sent came before; they are still read (the peer waits for
            // that), and receives beyond them see end-of-stream. Our sends go on.
            let waiting = self.recvs.len().saturating_sub(self.adverts.len());
            for r in self.recvs.drain(self.recvs.len() - waiting..) {
                r.ticket.complete_eof();
            }
            return;
        }
        self.adverts.clear();
        for r in self.recvs.drain(..) {
            r.ticket.complete_eof();
        }
        for t in self.transfers.iter_mut().filter(|t| t.reads_in_flight > 0) {
            t.failed.get_or_insert(OpError::PeerClosed);
        }
        self.fail_sends(OpError::PeerClosed);
    }

    fn fail_sends(&mut self, err: OpError) {
        for s in self.queue.drain(..) {
            if let Some(t) = s.ticket {
                t.complete(Err(err.clone()), 0, EventFlags::default());
            }
        }
        // Their message left: the peer may have it, so never `Cancelled` (issue 14).
        for o in self.unacked.iter_mut() {
            if !o.acked {
                o.failed.get_or_insert(err.clone().once_started(true));
            }
        }
        self.complete_sends();
    }

    /// Fails the sends not completed yet (the peer stopped receiving).
    pub(crate) fn fail_pending_sends(&mut self, err: OpError) {
        let oldest = self
            .unacked
            .iter()
            .find(|o| !o.acked)
            .map(|o| o.seq)
            .unwrap_or(self.next_seq);
        self.stopped_from.get_or_insert(oldest);
        self.fail_sends(err);
    }

    /// Fails every operation. Those whose memory is still with the transport complete when it comes back
    /// (or at [`MessageProto::drop_all`]).
    pub(crate) fn fail(&mut self, err: OpError) {
        self.fail_sends(err.clone());
        self.fail_receives(err);
    }

    /// Fails the receiving side's operations (a graceful close keeps the sends going).
    pub(crate) fn fail_receives(&mut self, err: OpError) {
        for r in self.recvs.drain(..) {
            r.ticket
                .complete(Err(err.clone()), 0, EventFlags::default());
        }
        self.adverts.clear();
        for t in self.transfers.iter_mut() {
            t.failed.get_or_insert(err.clone());
        }
        self.complete_transfers_with(None);
        for w in self.writes.iter_mut() {
            w.failed.get_or_insert(err.clone());
        }
        if let Some(own) = self.own_precv.as_mut() {
            // Its exposure goes at drop_all, when the peer can no longer write.
            if let Some(t) = own.ticket.take() {
                t.complete(Err(err.clone()), 0, EventFlags::default());
            }
        }
        self.peer_precv = None;
    }

    /// The endpoint is gone and the transport returned every work request: complete everything left.
    pub(crate) fn drop_all(&mut self, err: OpError) {
        for o in self.unacked.iter_mut() {
            o.inline_in_flight = false;
        }
        for t in self.transfers.iter_mut() {
            t.reads_in_flight = 0;
        }
        for w in self.writes.iter_mut() {
            w.done = true;
        }
        self.fail(err.clone());
        while let Some(mut w) = self.writes.pop_front() {
            if let Some(t) = w.ticket.take() {
                t.complete(
                    Err(w.failed.take().unwrap_or(err.clone())),
                    0,
                    EventFlags::default(),
                );
            }
        }
        self.own_precv = None;
        for (exposure, ticket, e) in self.retired.drain(..) {
            drop(exposure);
            ticket.complete(Err(e), 0, EventFlags::default());
        }
    }
}

impl AckSource for MessageProto {
    fn take_ack(&mut self, carrier: Kind) -> Option<u32> {
        if self.done_seq == self.acked_seq {
            return None;
        }
        self.acked_seq = self.done_seq;
        self.ack_marker = self.stats.adverts_sent - u64::from(carrier == Kind::Advert);
        Some(self.done_seq)
    }
}

/// Kind of lease a receive of this mode takes on the user's buffer.
pub(crate) const RECV_LEASE: LeaseKind = LeaseKind::DeviceWrite;

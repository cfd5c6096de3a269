//! Message mode (SOCK_SEQPACKET): the data path of seed 002, section 3.
//!
//! * **Advertisement** (3.1): "an exs_send [becomes] an RDMA send operation that sends a short advertisement
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
use crate::event::{EventFlags, Ticket};
use crate::proto::link::{AckSource, DataOp, Link};
use crate::transport::{Exposure, RemoteRef, Sge, WcError};
use crate::wire::{Advert, AdvertFlags, Body, Kind};

/// How a send's data reaches the peer, decided before it enters the protocol.
#[derive(Debug)]
pub(crate) enum SendData {
    /// Immediate data (seed 002, 4.1): the user's range, leased for the device to read, gathered into the advert.
    Inline(Sge),
    /// The user's range exposed for remote read (seed 002, 3.1).
    Exposed(Box<dyn Exposure>),
}

/// A send waiting for an advert credit.
#[derive(Debug)]
pub(crate) struct SendReq {
    pub ticket: Ticket,
    pub len: usize,
    pub data: SendData,
}

/// A receive waiting for an advertisement: the user's range leased for the device to write.
#[derive(Debug)]
pub(crate) struct RecvReq {
    pub ticket: Ticket,
    pub sge: Sge,
}

#[derive(Debug)]
struct Outstanding {
    seq: u32,
    ticket: Option<Ticket>,
    len: usize,
    /// Held until acknowledged (remote read access to the send's range).
    exposure: Option<Box<dyn Exposure>>,
    /// Immediate data whose send has not completed locally: its lease is still with the transport.
    inline_in_flight: bool,
    acked: bool,
    failed: Option<OpError>,
}

#[derive(Debug)]
struct PeerAdvert {
    advert: Advert,
    /// Immediate data copied out of the control buffer because no receive was waiting.
    inline: Option<Vec<u8>>,
}

#[derive(Debug)]
struct Transfer {
    seq: u32,
    ticket: Option<Ticket>,
    bytes: usize,
    truncated: bool,
    reads_in_flight: u32,
    failed: Option<OpError>,
}

/// Counters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
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
    /// Sends that failed before the peer acknowledged them, with their exposure. The peer may still be
    /// reading, so revoking the key now would turn our close into a remote-access error at the peer; and the
    /// send's event must not come while its buffer is still exposed. Both happen when the endpoint is released
    /// ([`MessageProto::drop_all`]): key first, then the event.
    retired: Vec<(Box<dyn Exposure>, Ticket, OpError)>,
    /// Whether acknowledgments may wait for a message going the other way (delayed acks enabled).
    delay_acks: bool,
    /// Our adverts sent before the last acknowledgment left: more than that means request/response traffic.
    ack_marker: u64,
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
            retired: Vec::new(),
            delay_acks,
            ack_marker: 0,
            stats: MessageStats::default(),
        }
    }

    /// Whether a send of `len` bytes goes as immediate data (seed 002, 4.1: "not exceeding that limit").
    pub(crate) fn is_immediate(&self, len: usize) -> bool {
        len <= self.small_max
    }

    /// Advert credits available now.
    pub(crate) fn credits(&self) -> u32 {
        self.credits
    }

    /// Sends queued or outstanding.
    pub(crate) fn sends_pending(&self) -> usize {
        self.queue.len() + self.unacked.len()
    }

    /// Receives not yet completed.
    pub(crate) fn recvs_pending(&self) -> usize {
        self.recvs.len() + self.transfers.len()
    }

    /// Adverts received and waiting for a receive (readiness for poll).
    pub(crate) fn adverts_waiting(&self) -> usize {
        self.adverts.len()
    }

    pub(crate) fn send(&mut self, req: SendReq, link: &mut Link) {
        self.queue.push_back(req);
        self.pump(link);
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
            let (advert, inline, exposure) = match req.data {
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
                    (
                        Advert {
                            seq,
                            flags: AdvertFlags(0),
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
                ticket: Some(req.ticket),
                len: req.len,
                exposure,
                inline_in_flight,
                acked: false,
                failed: None,
            });
        }
        if !self.queue.is_empty() {
            self.stats.credit_waits += 1;
        }
    }

    pub(crate) fn recv(&mut self, req: RecvReq, link: &mut Link) {
        if self.peer_closed && self.adverts.is_empty() {
            // End of stream: nothing more will come.
            req.ticket.complete(
                Ok(()),
                0,
                EventFlags {
                    eof: true,
                    ..Default::default()
                },
            );
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
        if flags.has(AdvertFlags::PERSISTENT) || flags.has(AdvertFlags::PERSISTENT_RECV) {
            return Err(Violation::Unexpected {
                kind: "persistent ADVERT",
                context: "on a message-mode socket without persistent support",
            });
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
            });
            self.match_adverts(link);
        }
        self.complete_transfers();
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
        });
    }

    /// Matches receives with advertisements in order (seed 002, 3.1) and starts the reads.
    fn match_adverts(&mut self, link: &mut Link) {
        while !self.recvs.is_empty() && !self.adverts.is_empty() {
            let mut req = self.recvs.pop_front().expect("checked");
            let PeerAdvert { advert, inline } = self.adverts.pop_front().expect("checked");
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
            let mut reads = 0;
            if n > 0 {
                let (lease, reg) = req.sge.into_parts();
                let mut rest = lease.narrow(0..n);
                let mut offset = 0u64;
                while !rest.is_empty() {
                    let chunk = (rest.len() as u64).min(self.max_message) as usize;
                    let (now, later) = rest.split_at(chunk);
                    rest = later;
                    let local = Sge::new(now, reg.clone()).expect("lease stays on its buffer");
                    let remote = RemoteRef {
                        addr: advert.addr + offset,
                        key: advert.rkey,
                    };
                    link.push_read(DataOp::Read { local, remote }, advert.seq);
                    offset += chunk as u64;
                    reads += 1;
                }
            }
            self.transfers.push_back(Transfer {
                seq: advert.seq,
                ticket: Some(req.ticket),
                bytes: n,
                truncated,
                reads_in_flight: reads,
                failed: None,
            });
        }
        // Transfers that need no read (immediate data, empty receive buffers) are complete now.
        self.complete_transfers();
    }

    /// An RDMA read finished.
    pub(crate) fn on_read_done(
        &mut self,
        seq: u32,
        status: Result<(), WcError>,
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
                t.failed.get_or_insert(e.into());
            }
        }
        self.complete_transfers();
        Ok(())
    }

    /// Completes finished transfers in order.
    fn complete_transfers(&mut self) {
        while let Some(t) = self.transfers.front() {
            if t.reads_in_flight > 0 {
                return;
            }
            let mut t = self.transfers.pop_front().expect("checked");
            let flags = EventFlags {
                truncated: t.truncated,
                eof: false,
            };
            if let Some(ticket) = t.ticket.take() {
                match t.failed.take() {
                    None => ticket.complete(Ok(()), t.bytes, flags),
                    // The sender cancelled this message by closing: for the receiver, the stream ended.
                    Some(OpError::PeerClosed) => ticket.complete(
                        Ok(()),
                        0,
                        EventFlags {
                            eof: true,
                            truncated: false,
                        },
                    ),
                    Some(e) => ticket.complete(Err(e), 0, flags),
                }
            }
            self.done_seq = self.done_seq.wrapping_add(1);
        }
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

    /// Completes acknowledged sends in order, once their local buffers are free too.
    fn complete_sends(&mut self) {
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
    pub(crate) fn on_peer_close(&mut self) {
        self.peer_closed = true;
        self.adverts.clear();
        for r in self.recvs.drain(..) {
            r.ticket.complete(
                Ok(()),
                0,
                EventFlags {
                    eof: true,
                    ..Default::default()
                },
            );
        }
        for t in self.transfers.iter_mut().filter(|t| t.reads_in_flight > 0) {
            t.failed.get_or_insert(OpError::PeerClosed);
        }
        self.fail_sends(OpError::PeerClosed);
    }

    fn fail_sends(&mut self, err: OpError) {
        for s in self.queue.drain(..) {
            s.ticket
                .complete(Err(err.clone()), 0, EventFlags::default());
        }
        for o in self.unacked.iter_mut() {
            if !o.acked {
                o.failed.get_or_insert(err.clone());
            }
        }
        self.complete_sends();
    }

    /// Fails every operation. Those whose memory is still with the transport complete when it comes back
    /// (or at [`MessageProto::drop_all`]).
    pub(crate) fn fail(&mut self, err: OpError) {
        self.fail_sends(err.clone());
        for r in self.recvs.drain(..) {
            r.ticket
                .complete(Err(err.clone()), 0, EventFlags::default());
        }
        self.adverts.clear();
        for t in self.transfers.iter_mut() {
            t.failed.get_or_insert(err.clone());
        }
        self.complete_transfers();
    }

    /// The endpoint is gone and the transport returned every work request: complete everything left.
    pub(crate) fn drop_all(&mut self, err: OpError) {
        for o in self.unacked.iter_mut() {
            o.inline_in_flight = false;
        }
        for t in self.transfers.iter_mut() {
            t.reads_in_flight = 0;
        }
        self.fail(err);
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

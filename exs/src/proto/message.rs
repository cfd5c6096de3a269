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

/// An advertisement to send, with the immediate bytes to gather after it and the exposure its send keeps.
type AdvertOut = (Advert, Option<Sge>, Option<Box<dyn Exposure>>);

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
    /// Its advert's number, once the advert has gone out (every number is a valid one: they wrap).
    seq: Option<u32>,
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
    /// The receive takes a whole message (not a range of a persistent send: `recv_offset`).
    whole: bool,
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
    /// Our receiving side ended ([`MessageProto::fail_receives`]: we closed, or the connection is failing).
    receives_ended: bool,
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
            receives_ended: false,
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
        // A persistent receive of the peer's counts while its advert still waits behind others too: the peer is
        // persistent from the moment it posted it.
        let theirs = self.peer_precv.is_some()
            || self.adverts.iter().any(|a| {
                a.advert.flags.has(AdvertFlags::PERSISTENT)
                    || a.advert.flags.has(AdvertFlags::PERSISTENT_RECV)
            });
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

    /// A persistent send may start: [`MessageProto::may_be_persistent`], and none of ours is active or waiting for
    /// the peer to confirm its end (the peer holds one persistent send of ours at a time, and takes a second for
    /// a violation).
    pub(crate) fn may_send_persistent(&self) -> Result<(), &'static str> {
        self.may_be_persistent()?;
        let ours = self
            .unacked
            .iter()
            .any(|o| o.persistent.is_some() && !o.acked)
            || self.queue.iter().any(|q| q.persistent.is_some());
        if ours {
            return Err("a persistent send is already active on this socket (or its end is not yet confirmed by the peer: wait for its completion)");
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
                // Once the peer has ended its persistent receive, a small send planned as immediate data goes
                // as an advert as usual ([`MessageProto::writes_to_peer`] said so when it was planned); only one
                // planned as a write into that receive (an offset, or more than immediate data takes) fails.
                if !p.ending || req.offset > 0 || req.len > self.small_max {
                    return self.write_to_peer(req, p, link);
                }
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
            let Some((advert, inline, exposure)) =
                self.advert_for(seq, req.data, req.len, persistent.as_ref())
            else {
                continue; // ended (connection failed) before its advert went out
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

    /// The advertisement of send `seq` (seed 002, 3.1): immediate data (4.1), an exposed send, persistent or not
    /// (4.2), or our persistent receive (4.3; `None` if it ended before its advert went out); with the immediate
    /// bytes to gather and the exposure to keep.
    fn advert_for(
        &mut self,
        seq: u32,
        data: SendData,
        len: usize,
        persistent: Option<&PersistentSend>,
    ) -> Option<AdvertOut> {
        let (flags, addr, rkey, len, inline, exposure) = match data {
            SendData::PersistentRecv => {
                let own = self.own_precv.as_mut()?;
                own.seq = Some(seq);
                let r = own
                    .exposure
                    .as_ref()
                    .map(|e| e.remote())
                    .unwrap_or(RemoteRef { addr: 0, key: 0 });
                (
                    AdvertFlags::PERSISTENT_RECV,
                    r.addr,
                    r.key,
                    own.len,
                    None,
                    None,
                )
            }
            SendData::Inline(sge) => {
                self.stats.immediate_sent += 1;
                (AdvertFlags::IMMEDIATE, 0, 0, len, Some(sge), None)
            }
            SendData::Exposed(exp) => {
                let r = exp.remote();
                let flags = match persistent {
                    None => 0,
                    Some(p) if p.notify => AdvertFlags::PERSISTENT | AdvertFlags::NOTIFY,
                    Some(_) => AdvertFlags::PERSISTENT,
                };
                (flags, r.addr, r.key, len, None, Some(exp))
            }
        };
        let advert = Advert {
            seq,
            flags: AdvertFlags(flags),
            len: len as u64,
            addr,
            rkey,
        };
        Some((advert, inline, exposure))
    }

    pub(crate) fn recv(&mut self, req: RecvReq, link: &mut Link) {
        // After the peer's close, a receive no advert takes sees end-of-stream, once the receives before it have
        // completed (`end_unmatched_receives`, at the end of the matching).
        self.recvs.push_back(req);
        self.match_adverts(link);
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
            whole: true,
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
                    t.failed.get_or_insert_with(|| err.clone());
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
                eor: t.whole,
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
        // An ended persistent send is consumed once its reads are done, and those of the adverts before it (every
        // transfer left is one of them: none starts past the persistent send at the head). It counts as done after
        // them: an acknowledgment of it releases every send before it on the peer.
        let ended = self
            .adverts
            .front()
            .is_some_and(|a| a.ending && a.advert.flags.has(AdvertFlags::PERSISTENT));
        if let (true, Some(link)) = (ended && self.transfers.is_empty(), link) {
            self.adverts.pop_front();
            self.done_seq = self.done_seq.wrapping_add(1);
            self.match_adverts(link);
        }
        // The last read done: receives waiting behind it after the peer's close see end-of-stream now.
        self.end_unmatched_receives();
    }
}

/// Kind of lease a receive of this mode takes on the user's buffer.
pub(crate) const RECV_LEASE: LeaseKind = LeaseKind::DeviceWrite;

mod ack;
mod adverts;
mod persistent;
mod teardown;

//! The control link of one connection: control-message buffers, their credits, and send-queue accounting.
//!
//! Both socket types exchange small control messages (adverts, acknowledgments, window updates, close) by
//! two-sided send/receive, and stream data by write-with-immediate, which also consumes a posted receive on verbs.
//! "The implementation must have previously provided buffers to receive these unsolicited messages or the RDMA
//! hardware will cause a fatal error" (seed 002, 3.2). Seed 002 bounds advertisements with send/recv credits
//! (implemented in [`super::message`]); this layer bounds *every* message that consumes a receive buffer, so that
//! acknowledgments, window updates and stream writes can never overrun the peer either.
//!
//! ## Link credits
//! Each side posts `W` control receive buffers for its peer (announced in the handshake) and reposts a buffer as
//! soon as the message in it has been processed (immediate data that no receive is waiting for is copied out
//! first), so buffers never wait on the application. The sender holds `tx` credits (initially `W`); every
//! message that consumes a peer buffer costs one. The receiver counts buffers it reposted since it last told the
//! peer (`owed`) and reports them in the `credits` field of **every** control message it sends.
//!
//! Deadlock freedom, with `W >= 4`, threshold `T = W / 2 >= 2` and a reserve of one credit:
//! * data-bearing messages (adverts, acks, stream writes) need `tx >= 2`; an explicit CREDIT message may use the
//!   last credit;
//! * a side sends an explicit CREDIT when `owed >= T`, whatever consumed the buffers.
//!
//! Suppose both sides are stuck with nothing in flight. A side that cannot send data has `tx <= 1`, so the peer
//! owes it `W - 1 >= T` credits and would send a CREDIT unless its own `tx == 0`; so both have `tx == 0` and owe
//! `W`. Each side's last message was then a CREDIT (nothing else may use the last credit), which reset its `owed`
//! to 0; so each side received all `W` of the peer's messages *after* sending its own last CREDIT, including the
//! peer's last CREDIT, which carried `owed >= T >= 1` credits that arrived after the receiver's last send: its `tx`
//! cannot be 0. Contradiction. An explicit CREDIT adds one to the peer's `owed`; with `T >= 2` that echo stops after
//! one round.
//!
//! ## Coalescing
//! Control messages queued while an earlier control send is still in flight wait for it (a lone message never
//! waits, nor one too large to share a buffer with another as large) and then go together: copied one after another into a pack buffer, each header but the last flagged
//! `wire::FLAG_MORE`, in one send that consumes one peer buffer and one credit (issue 12: on software providers
//! every send is a system call and a completion). Only messages of one queue share a buffer: a packet that uses
//! the reserve credit holds urgent messages only, so the argument above still counts buffers. Nothing follows a
//! CLOSE in a buffer. The first message carries the credits owed; an ACK whose acknowledgment rode on an earlier
//! message of the packet is dropped, as when sent alone.

use std::collections::VecDeque;
use std::sync::Arc;

use exs_dma::{DmaBuf, LeaseKind};

use crate::error::Violation;
use crate::transport::{Op, Registration, RemoteRef, Sge, WorkRequest};
use crate::wire::{Body, CloseReason, Kind, Message, WireError, HEADER_LEN};

/// Pack buffers per connection: one in flight, one filling while an urgent message is out.
pub(crate) const PACK_SLOTS: u32 = 2;

/// Smallest control window a connection accepts (see the deadlock argument above).
pub(crate) const MIN_WINDOW: u32 = 4;

/// Stream advertisements and window updates one connection may hold waiting for the peer's credits. These are
/// the control messages a peer's writes make us queue: an honest peer that stops returning credits also stops
/// writing, and holds at most its advert credits' worth; where its writes with immediate data cost it no credit
/// (transports whose write-with-immediate consumes no receive), a peer that writes on and returns none would
/// make us queue one per receive and per window report for ever. The echo of a persistent receive's end counts
/// too: a peer may open and end persistent receives without limit, each costing us an echo (review finding). The
/// others are bounded otherwise (adverts by advert credits, acknowledgments and credits by folding, our own
/// ends by our persistent operations) or made by our own application's calls at its pace (offset notices, read
/// notifications), and do not count; a peer that starves them is found by the keepalive ([`Link::keepalive`]).
pub(crate) const CTRL_BACKLOG_MAX: usize = 4096;

const CLASS_SHIFT: u32 = 62;
const CLASS_RECV: u64 = 0;
const CLASS_CTRL: u64 = 1;
const CLASS_DATA: u64 = 2;
const CLASS_POOL: u64 = 3;

/// What a work request id names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum WrKind {
    /// A control receive slot.
    Recv(u32),
    /// A control send slot.
    Ctrl(u32),
    /// A data operation (write or read) with a protocol tag.
    Data(u32),
    /// A slot of the context's shared receive pool (seed 003).
    Pool(u32),
}

pub(crate) fn wr_id(kind: WrKind) -> u64 {
    match kind {
        WrKind::Recv(s) => (CLASS_RECV << CLASS_SHIFT) | u64::from(s),
        WrKind::Ctrl(s) => (CLASS_CTRL << CLASS_SHIFT) | u64::from(s),
        WrKind::Data(t) => (CLASS_DATA << CLASS_SHIFT) | u64::from(t),
        WrKind::Pool(s) => (CLASS_POOL << CLASS_SHIFT) | u64::from(s),
    }
}

pub(crate) fn wr_kind(id: u64) -> Option<WrKind> {
    let low = (id & 0xffff_ffff) as u32;
    if (id >> 32) & ((1 << (CLASS_SHIFT - 32)) - 1) != 0 {
        return None; // not an id of ours
    }
    match id >> CLASS_SHIFT {
        CLASS_RECV => Some(WrKind::Recv(low)),
        CLASS_CTRL => Some(WrKind::Ctrl(low)),
        CLASS_DATA => Some(WrKind::Data(low)),
        CLASS_POOL => Some(WrKind::Pool(low)),
        _ => None,
    }
}

/// A registered buffer cut into equal slots.
#[derive(Debug)]
pub(crate) struct Slots {
    pub buf: Arc<DmaBuf>,
    pub reg: Arc<dyn Registration>,
    pub size: usize,
    pub count: u32,
}

impl Slots {
    fn range(&self, slot: u32) -> std::ops::Range<usize> {
        let start = slot as usize * self.size;
        start..start + self.size
    }

    /// A receive work request for `slot`, identified as `id`.
    pub(crate) fn recv_wr(&self, slot: u32, id: u64) -> Result<WorkRequest, Violation> {
        let sge = Sge::of(&self.reg, self.range(slot), LeaseKind::DeviceWrite).map_err(|e| {
            Violation::BadRange(format!("control receive slot {slot} is busy: {e}"))
        })?;
        Ok(WorkRequest {
            wr_id: id,
            op: Op::Recv { sge },
        })
    }

    /// Decodes the message at offset `at` of a receive slot whose receive completed with `len` bytes (a buffer
    /// may hold several messages: `wire::FLAG_MORE`). Returns the message, the byte range of its immediate data
    /// inside the slot buffer, and the offset of the next message in the slot, if one follows.
    pub(crate) fn decode(
        &self,
        slot: u32,
        len: usize,
        at: usize,
    ) -> Result<(Message, std::ops::Range<usize>, Option<usize>), Violation> {
        if slot >= self.count {
            return Err(Violation::BadRange(format!(
                "receive completion for unknown slot {slot}"
            )));
        }
        if len > self.size {
            return Err(Violation::Malformed(WireError::LengthMismatch {
                expected: self.size,
                got: len,
            }));
        }
        let range = self.range(slot);
        let start = range.start + at.min(len);
        let f = self
            .buf
            .with_slice(start..range.start + len, Message::decode_framed)
            .map_err(|e| Violation::BadRange(format!("receive slot still leased: {e}")))??;
        let inline = start + f.inline_at..start + f.end;
        Ok((f.msg, inline, f.more.then_some(at + f.end)))
    }
}

/// A data operation: RDMA write (with immediate: a stream transfer) or RDMA read.
#[derive(Debug)]
pub(crate) enum DataOp {
    Write {
        local: Vec<Sge>,
        remote: RemoteRef,
        imm: Option<u32>,
    },
    Read {
        local: Sge,
        remote: RemoteRef,
    },
}

/// Whether the front of a send queue may go now (see `Link::admit`).
enum Admit {
    Go,
    /// A credit update or acknowledgment that already rode on another message: dropped.
    Pointless,
    /// Coalescing: it waits for the control message in flight.
    Hold,
    /// Not enough send credits.
    NoCredit,
    /// The send queue is full.
    NoRoom,
}

#[derive(Debug)]
enum Outgoing {
    Ctrl {
        body: Body,
        inline: Option<Sge>,
        notify: Option<u32>,
    },
    Data {
        op: DataOp,
        tag: u32,
    },
}

/// Counters for tests and benchmarks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct LinkStats {
    /// Control messages posted.
    pub ctrl_sent: u64,
    /// Explicit CREDIT messages posted.
    pub credit_msgs: u64,
    /// Control messages received.
    pub ctrl_received: u64,
    /// Write-with-immediate posted.
    pub writes_imm: u64,
    /// RDMA reads posted.
    pub reads: u64,
    /// Times a data message waited for link credits.
    pub credit_stalls: u64,
    /// Keepalive probes queued on an idle connection.
    pub keepalives: u64,
    /// Sends that carried several control messages (coalescing).
    pub packets: u64,
    /// Control messages that travelled in such sends.
    pub packed: u64,
    /// Stream window updates folded into one still queued (both report the total consumed).
    pub windows_merged: u64,
    /// Control messages waiting now (for credits, or behind others).
    pub ctrl_queued: u64,
}

impl LinkStats {
    /// Sends that carried control messages: one per message sent alone, one per pack of several.
    pub fn ctrl_sends(&self) -> u64 {
        self.ctrl_sent - self.packed + self.packets
    }
}

/// See the module documentation.
#[derive(Debug)]
pub(crate) struct Link {
    /// This connection's own receive slots, or `None` when its receives come from the context's shared pool.
    rx: Option<Slots>,
    /// Receive buffers promised to the peer (own slots, or credits against the shared pool).
    window_in: u32,
    /// Bytes of one receive buffer.
    rx_slot_size: usize,
    tx: Slots,
    free_tx: Vec<u32>,
    /// What to report when a control send slot completes (message-mode immediate sends).
    tx_notify: Vec<Option<u32>>,
    /// Buffers for several control messages per send (see "Coalescing"); `None` when coalescing is off. Their
    /// work request ids follow the control slots' (`Ctrl(tx.count + i)`).
    pack: Option<Slots>,
    free_pack: Vec<u32>,
    /// What to report when a pack buffer's send completes.
    pack_notify: Vec<Vec<u32>>,
    /// Bytes of one of the peer's receive buffers (handshake): a packet's bound.
    peer_slot: usize,
    window_out: u32,
    spent: u32,
    owed: u32,
    threshold: u32,
    sq_free: u32,
    reads_free: u32,
    imm_consumes_recv: bool,
    urgent: VecDeque<Outgoing>,
    normal: VecDeque<Outgoing>,
    /// Control messages in `normal`.
    ctrl_queued: usize,
    /// Control messages in `normal` that the peer makes us send (see [`CTRL_BACKLOG_MAX`]).
    ctrl_backlog: usize,
    reads: VecDeque<(DataOp, u32)>,
    credit_queued: bool,
    /// Keepalive intervals in a row through which messages waited for credits and none came back (see
    /// [`Link::keepalive`]).
    starved_checks: u8,
    /// Which queues' messages waited for credits at the last keepalive check.
    waited_at_check: Queues,
    /// Which queues a message left since the last keepalive check.
    moved_since_check: Queues,
    /// A keepalive CREDIT is queued (sent even with no credits owed).
    keepalive_queued: bool,
    /// Something was posted since the last keepalive check.
    sent_since_check: bool,
    started: bool,
    /// The final CLOSE has been posted: nothing more will be.
    closed: bool,
    pub stats: LinkStats,
}

/// Where the cumulative message-mode acknowledgment comes from when a control message is built.
pub(crate) trait AckSource {
    /// A new cumulative acknowledgment to piggyback on a message of kind `carrier`, if there is one (marks it
    /// sent).
    fn take_ack(&mut self, carrier: Kind) -> Option<u32>;
}

impl AckSource for () {
    fn take_ack(&mut self, _carrier: Kind) -> Option<u32> {
        None
    }
}

impl Link {
    /// A link with its own receive slots (`rx`), or, with `rx == Err((window, slot_size))`, one whose receives
    /// come from the shared pool: it then promises the peer `window` buffers of `slot_size` bytes.
    pub(crate) fn new(
        rx: Result<Slots, (u32, usize)>,
        tx: Slots,
        pack: Option<Slots>,
        max_send_wr: u32,
        max_read_depth: u32,
        imm_consumes_recv: bool,
    ) -> Self {
        let free_tx = (0..tx.count).rev().collect();
        let tx_notify = vec![None; tx.count as usize];
        let packs = pack.as_ref().map_or(0, |p| p.count);
        let free_pack = (0..packs).rev().collect();
        let pack_notify = vec![Vec::new(); packs as usize];
        let (rx, window_in, rx_slot_size) = match rx {
            Ok(s) => {
                let (w, z) = (s.count, s.size);
                (Some(s), w, z)
            }
            Err((w, z)) => (None, w, z),
        };
        let threshold = (window_in / 2).max(2);
        Link {
            rx,
            window_in,
            rx_slot_size,
            tx,
            free_tx,
            tx_notify,
            pack,
            free_pack,
            pack_notify,
            peer_slot: 0,
            window_out: 0,
            spent: 0,
            owed: 0,
            threshold,
            sq_free: max_send_wr.max(2),
            reads_free: max_read_depth.max(1),
            imm_consumes_recv,
            urgent: VecDeque::new(),
            normal: VecDeque::new(),
            ctrl_queued: 0,
            ctrl_backlog: 0,
            reads: VecDeque::new(),
            credit_queued: false,
            keepalive_queued: false,
            starved_checks: 0,
            waited_at_check: Queues::default(),
            moved_since_check: Queues::default(),
            sent_since_check: false,
            started: false,
            closed: false,
            stats: LinkStats::default(),
        }
    }

    /// Our receive window (buffers posted for the peer).
    pub(crate) fn window_in(&self) -> u32 {
        self.window_in
    }

    /// Bytes one control receive buffer holds.
    pub(crate) fn slot_size(&self) -> usize {
        self.rx_slot_size
    }

    /// Bytes of receive memory this connection owns (zero when it draws on the shared pool).
    pub(crate) fn own_rx_bytes(&self) -> usize {
        self.rx.as_ref().map_or(0, |s| s.size * s.count as usize)
    }

    /// Receives to post before the connection comes up: every own receive slot (none with the shared pool).
    pub(crate) fn initial_recvs(&mut self) -> Result<Vec<WorkRequest>, Violation> {
        match &self.rx {
            Some(rx) => (0..rx.count)
                .map(|s| rx.recv_wr(s, wr_id(WrKind::Recv(s))))
                .collect(),
            None => Ok(Vec::new()),
        }
    }

    /// The handshake told us the peer's window and the size of its receive buffers: the link may send from now
    /// on.
    pub(crate) fn start(&mut self, window_out: u32, peer_slot: usize) {
        self.window_out = window_out;
        self.peer_slot = peer_slot;
        self.started = true;
    }

    /// Link credits available.
    pub(crate) fn tx_credits(&self) -> u32 {
        self.window_out - self.spent
    }

    /// The counters, with the control messages waiting now.
    pub(crate) fn stats(&self) -> LinkStats {
        LinkStats {
            ctrl_queued: self.ctrl_queued as u64,
            ..self.stats
        }
    }

    /// Whether nothing waits to be posted (after the final CLOSE nothing will be).
    pub(crate) fn is_idle(&self) -> bool {
        self.closed || (self.urgent.is_empty() && self.normal.is_empty() && self.reads.is_empty())
    }

    /// Whether the final CLOSE has been posted.
    pub(crate) fn is_closed(&self) -> bool {
        self.closed
    }

    /// The endpoint is gone (every work request came back): what is still queued can never be posted, and
    /// nothing more will be. A stream whose peer closed keeps its state after that to deliver buffered bytes;
    /// its link must not post the writes that waited for credits on a released endpoint (soak: they faulted a
    /// connection already down,).
    pub(crate) fn discard(&mut self) {
        self.urgent.clear();
        self.normal.clear();
        self.ctrl_queued = 0;
        self.ctrl_backlog = 0;
        self.reads.clear();
        self.closed = true;
    }

    /// Whether every posted send-side work request has completed.
    pub(crate) fn sends_drained(&self, max_send_wr: u32) -> bool {
        self.sq_free >= max_send_wr.max(2) && self.ctrl_in_flight() == 0
    }

    /// Control sends posted and not yet completed.
    fn ctrl_in_flight(&self) -> usize {
        let packs = self
            .pack
            .as_ref()
            .map_or(0, |p| p.count as usize - self.free_pack.len());
        self.tx.count as usize - self.free_tx.len() + packs
    }

    /// Queues a control message. `notify` is handed back by [`Link::on_ctrl_done`] when its send completes.
    ///
    /// A STREAM_WINDOW right behind another still queued replaces what that one says (both report the total
    /// consumed): a peer that withholds our credits while its writes, which cost it none on some transports, keep
    /// us reporting space made one queued message per report, without bound (review finding).
    pub(crate) fn push_ctrl(&mut self, body: Body, inline: Option<Sge>, notify: Option<u32>) {
        if let (
            Body::StreamWindow { consumed },
            Some(Outgoing::Ctrl {
                body: Body::StreamWindow { consumed: queued },
                notify: None,
                ..
            }),
            None,
        ) = (body, self.normal.back_mut(), notify)
        {
            *queued = consumed;
            self.stats.windows_merged += 1;
            return;
        }
        self.ctrl_queued += 1;
        self.ctrl_backlog += usize::from(paced_by_peer(&body));
        self.normal.push_back(Outgoing::Ctrl {
            body,
            inline,
            notify,
        });
    }

    /// [`Violation::ControlBacklog`] once more than [`CTRL_BACKLOG_MAX`] control messages the peer makes us send
    /// (stream advertisements, window updates, persistent ends' echoes) wait: the peer returns none of our
    /// credits and still makes us answer. Whatever it does, what a connection
    /// queues for it stays bounded.
    pub(crate) fn check_backlog(&self) -> Result<(), Violation> {
        if self.ctrl_backlog > CTRL_BACKLOG_MAX {
            return Err(Violation::ControlBacklog {
                queued: self.ctrl_backlog,
            });
        }
        Ok(())
    }

    /// Queues a control message that may use the reserve credit (CLOSE).
    pub(crate) fn push_urgent(&mut self, body: Body) {
        self.urgent.push_back(Outgoing::Ctrl {
            body,
            inline: None,
            notify: None,
        });
    }

    /// Queues an RDMA write (with immediate: a stream transfer), in order with control messages.
    pub(crate) fn push_write(&mut self, op: DataOp, tag: u32) {
        self.normal.push_back(Outgoing::Data { op, tag });
    }

    /// Queues an RDMA read (bounded by the read depth, not by link credits).
    pub(crate) fn push_read(&mut self, op: DataOp, tag: u32) {
        self.reads.push_back((op, tag));
    }

    /// Whether an explicit acknowledgment or credit message is already waiting.
    pub(crate) fn has_queued(&self, kind: Kind) -> bool {
        self.normal
            .iter()
            .chain(self.urgent.iter())
            .any(|o| matches!(o, Outgoing::Ctrl { body, .. } if body.kind() == kind))
    }

    fn consumes(&self, o: &Outgoing) -> bool {
        match o {
            Outgoing::Ctrl { .. } => true,
            Outgoing::Data {
                op: DataOp::Write { imm: Some(_), .. },
                ..
            } => self.imm_consumes_recv,
            Outgoing::Data { .. } => false,
        }
    }

    /// Posts what resources allow, in order: urgent messages (may use the reserve credit), then the normal
    /// queue (keeps one credit in reserve), and reads up to the read depth.
    ///
    /// Once a final CLOSE (not a write shutdown, not a stop-receiving notice) has been posted, nothing more is: the peer sees nothing after it
    /// (issue 14: the closing side kept posting writes that had waited for credits).
    pub(crate) fn flush(&mut self, out: &mut Vec<WorkRequest>, acks: &mut dyn AckSource) {
        if !self.started || self.closed {
            return;
        }
        for urgent in [true, false] {
            if !self.flush_queue(urgent, out, acks) {
                return;
            }
        }
        self.post_reads(out);
    }

    /// Posts from one queue while its front may go. False: nothing more may be posted this round (the send queue
    /// or the control slots are full, or the final CLOSE went).
    fn flush_queue(
        &mut self,
        urgent: bool,
        out: &mut Vec<WorkRequest>,
        acks: &mut dyn AckSource,
    ) -> bool {
        loop {
            let queue = if urgent { &self.urgent } else { &self.normal };
            let Some(front) = queue.front() else {
                return true;
            };
            let is_ctrl = matches!(front, Outgoing::Ctrl { .. });
            match self.admit(urgent, front) {
                Admit::Go => {}
                Admit::Pointless => {
                    self.pop(urgent);
                    self.credit_queued = false;
                    continue;
                }
                Admit::Hold => return true,
                Admit::NoCredit => {
                    if !urgent {
                        self.stats.credit_stalls += 1;
                    }
                    return true;
                }
                Admit::NoRoom => return false,
            }
            if is_ctrl && self.packable(urgent) {
                if self.post_packet(urgent, acks, out) {
                    self.closed = true;
                    return false;
                }
                continue;
            }
            if is_ctrl && self.free_tx.is_empty() {
                return false;
            }
            let item = self.pop(urgent).expect("front exists");
            if self.post_item(item, acks, out) {
                self.closed = true;
                return false;
            }
        }
    }

    /// Whether the front of a queue may go now.
    fn admit(&self, urgent: bool, front: &Outgoing) -> Admit {
        // Drop messages that became pointless: a CREDIT whose credits already rode on an earlier message, an ACK
        // whose acknowledgment did.
        if let Outgoing::Ctrl { body, .. } = front {
            if self.pointless_credit(body) {
                return Admit::Pointless;
            }
        }
        let is_ctrl = matches!(front, Outgoing::Ctrl { .. });
        // Coalescing: a control message waits while another is in flight; it then leaves with the others that
        // queued behind it (the completion that ends the wait flushes the link again).
        if !urgent && is_ctrl && self.ctrl_in_flight() > 0 && self.worth_holding(front) {
            return Admit::Hold;
        }
        // The last credit is kept for urgent messages and CLOSE (the peer frees its slots without us).
        let reserve_ok = urgent
            || matches!(
                front,
                Outgoing::Ctrl {
                    body: Body::Close(_),
                    ..
                }
            );
        let need = match (self.consumes(front), reserve_ok) {
            (false, _) => 0,
            (true, true) => 1,
            (true, false) => 2,
        };
        if need > 0 && self.tx_credits() < need {
            return Admit::NoCredit;
        }
        if self.sq_free == 0 {
            return Admit::NoRoom;
        }
        Admit::Go
    }

    /// Posts one queued item; true if it was the final CLOSE.
    fn post_item(
        &mut self,
        item: Outgoing,
        acks: &mut dyn AckSource,
        out: &mut Vec<WorkRequest>,
    ) -> bool {
        match item {
            Outgoing::Ctrl {
                body,
                inline,
                notify,
            } => {
                let Some(ack) = Self::ack_for(&body, acks) else {
                    return false; // already acknowledged by a piggyback
                };
                let last = matches!(
                    body,
                    Body::Close(CloseReason::Close | CloseReason::Violation)
                );
                self.post_ctrl(body, inline, notify, ack, out);
                last
            }
            Outgoing::Data { op, tag } => {
                let consumes =
                    matches!(op, DataOp::Write { imm: Some(_), .. }) && self.imm_consumes_recv;
                if consumes {
                    self.spent += 1;
                }
                self.stats.writes_imm += 1;
                self.sq_free -= 1;
                self.sent_since_check = true;
                out.push(data_wr(op, tag));
                false
            }
        }
    }

    /// Posts queued reads up to the read depth.
    fn post_reads(&mut self, out: &mut Vec<WorkRequest>) {
        while self.reads_free > 0 && self.sq_free > 0 {
            let Some((op, tag)) = self.reads.pop_front() else {
                break;
            };
            self.reads_free -= 1;
            self.sq_free -= 1;
            self.stats.reads += 1;
            out.push(data_wr(op, tag));
        }
    }

    fn pop(&mut self, urgent: bool) -> Option<Outgoing> {
        if urgent {
            let o = self.urgent.pop_front();
            self.moved_since_check.urgent |= o.is_some();
            o
        } else {
            let o = self.normal.pop_front();
            self.moved_since_check.normal |= o.is_some();
            if let Some(Outgoing::Ctrl { body, .. }) = &o {
                self.ctrl_queued -= 1;
                self.ctrl_backlog -= usize::from(paced_by_peer(body));
            }
            o
        }
    }

    /// Whether `body` is a CREDIT with nothing left to say: its credits rode on an earlier message, and it is no
    /// keepalive probe.
    fn pointless_credit(&self, body: &Body) -> bool {
        matches!(body, Body::Credit) && self.owed == 0 && !self.keepalive_queued
    }

    /// The message for `body` as it leaves now: it returns every credit owed (and a CREDIT is no longer queued).
    fn stamp(&mut self, body: Body, ack: Option<u32>) -> Message {
        let credits = self.owed.min(u32::from(u16::MAX));
        self.owed -= credits;
        if matches!(body, Body::Credit) {
            self.credit_queued = false;
            self.keepalive_queued = false;
            self.stats.credit_msgs += 1;
        }
        Message {
            credits: credits as u16,
            ack,
            body,
        }
    }

    /// The acknowledgment a message of `body` carries, or `None` when it is an ACK with nothing left to
    /// acknowledge (the acknowledgment rode on an earlier message): it is dropped.
    fn ack_for(body: &Body, acks: &mut dyn AckSource) -> Option<Option<u32>> {
        if body.kind() == Kind::Ack {
            acks.take_ack(Kind::Ack).map(Some)
        } else {
            Some(acks.take_ack(body.kind()))
        }
    }

    fn post_ctrl(
        &mut self,
        body: Body,
        inline: Option<Sge>,
        notify: Option<u32>,
        ack: Option<u32>,
        out: &mut Vec<WorkRequest>,
    ) {
        let slot = self.free_tx.pop().expect("checked by flush");
        self.sent_since_check = true;
        let msg = self.stamp(body, ack);
        let range = self.tx.range(slot);
        let len = msg.encoded_len();
        // The slot is free (not leased), so the CPU may write it.
        self.tx
            .buf
            .with_slice_mut(range.start..range.start + len, |b| msg.encode(b))
            .expect("a free control send slot is not leased");
        let header = Sge::of(
            &self.tx.reg,
            range.start..range.start + len,
            LeaseKind::DeviceRead,
        )
        .expect("a free control send slot is not leased");
        // Sized for the inline data too: growing it cost a reallocation per message.
        let mut sges = Vec::with_capacity(1 + usize::from(inline.is_some()));
        sges.push(header);
        sges.extend(inline);
        self.tx_notify[slot as usize] = notify;
        self.spent += 1;
        self.sq_free -= 1;
        self.stats.ctrl_sent += 1;
        out.push(WorkRequest {
            wr_id: wr_id(WrKind::Ctrl(slot)),
            op: Op::Send { sges, imm: None },
        });
    }

    /// Largest immediate payload one of the peer's receive buffers takes, given the peer's slot size.
    pub(crate) fn inline_room(peer_slot: u16) -> usize {
        (peer_slot as usize).saturating_sub(HEADER_LEN + 32)
    }
}

fn data_wr(op: DataOp, tag: u32) -> WorkRequest {
    let op = match op {
        DataOp::Write { local, remote, imm } => Op::Write { local, remote, imm },
        DataOp::Read { local, remote } => Op::Read { local, remote },
    };
    WorkRequest {
        wr_id: wr_id(WrKind::Data(tag)),
        op,
    }
}

mod credits;
mod pack;

/// One flag per outgoing queue (see [`Link::keepalive`]).
#[derive(Clone, Copy, Debug, Default)]
struct Queues {
    urgent: bool,
    normal: bool,
}

/// Whether a queued control message counts against [`CTRL_BACKLOG_MAX`] (see there).
fn paced_by_peer(body: &Body) -> bool {
    matches!(
        body,
        Body::StreamAdvert(_) | Body::StreamWindow { .. } | Body::PersistentEnd { echo: true, .. }
    )
}

#[cfg(test)]
mod tests;

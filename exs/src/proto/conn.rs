//! One connection: the control link plus the protocol of its socket type.
//!
//! Input: completions from the transport and API calls (through the engine). Output: work requests appended to a
//! vector (the engine posts them) and completed tickets (events). No transport calls happen here.

use std::time::{Duration, Instant};

use crate::config::LazyNow;
use crate::error::{OpError, Violation};
use crate::options::{SockType, SocketOptions};
use crate::proto::link::{self, Link, WrKind, MIN_WINDOW};
use crate::proto::message::MessageProto;
use crate::proto::pool::RecvPool;
use crate::proto::stream::{StreamProto, StreamSetup};
use crate::transport::{Completed, Completion, EndpointId, Exposure, WcError, WorkRequest};
use crate::wire::{Body, CloseReason, Handshake, Message, WireSockType};

pub(crate) mod layout;
mod order;
mod plan;
pub(crate) use order::HoldId;
pub(crate) use plan::{check_flags, RecvMemory, RecvPlan, RecvRefused, SendPlan};

pub(crate) use crate::proto::limits::Limits;

/// The protocol's timings, which the seeds leave to the implementation.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Timing {
    /// How long an acknowledgment may wait for a reply to carry it (message mode); zero: acknowledge at once.
    pub ack_delay: Duration,
    /// A connection that sent nothing for this long probes its peer (a CREDIT), so that a peer that vanished is
    /// found by the transport's retries.
    pub keepalive: Option<Duration>,
}

/// Checks a peer's handshake against a socket of type `ty` with `opts` (what [`Conn::establish`] would refuse), so
/// that a listener refuses a bad request before it sets a connection up for it.
pub(crate) fn check_peer_handshake(
    peer: &Handshake,
    ty: SockType,
    opts: &SocketOptions,
) -> Result<(), Violation> {
    let ours = match ty {
        SockType::SeqPacket => WireSockType::SeqPacket,
        SockType::Stream => WireSockType::Stream,
    };
    if peer.sock_type != ours {
        return Err(Violation::SocketTypeMismatch {
            ours: ty.name(),
            theirs: match peer.sock_type {
                WireSockType::SeqPacket => "seqpacket",
                WireSockType::Stream => "stream",
            },
        });
    }
    if u32::from(peer.ctrl_window) < MIN_WINDOW {
        return Err(Violation::Handshake(format!(
            "control window {} is below the minimum {MIN_WINDOW}",
            peer.ctrl_window
        )));
    }
    match ty {
        SockType::SeqPacket => {
            if opts.send_credits.min(peer.recv_credits) == 0
                || opts.recv_credits.min(peer.send_credits) == 0
            {
                return Err(Violation::Handshake("zero advert credits".into()));
            }
        }
        SockType::Stream => crate::proto::stream::check_peer_ring(peer)?,
    }
    Ok(())
}

/// The socket-type protocol, chosen when the handshake completes.
#[derive(Debug)]
pub(crate) enum Mode {
    Message(Box<MessageProto>),
    Stream(Box<StreamProto>),
}

/// What a completion meant beyond the protocol's own bookkeeping.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Incoming {
    Nothing,
    /// The peer sent CLOSE.
    PeerClose(CloseReason),
}

/// Why a connection must go down.
#[derive(Debug)]
pub(crate) enum Fault {
    /// The peer broke the protocol.
    Peer(Violation),
    /// The transport reported a failure on one of our work requests.
    Transport(WcError),
}

impl From<Violation> for Fault {
    fn from(v: Violation) -> Self {
        Fault::Peer(v)
    }
}

impl Fault {
    /// A failed receive (not flushed) of a control buffer. A length error there is the peer's doing: the buffers
    /// are the ones we announced (it read as "invalid argument", a transport failure of ours). The same status on
    /// a request of ours (a write beyond the device's largest message) stays the transport's.
    pub(crate) fn of_recv(e: &WcError) -> Fault {
        match e {
            WcError::LocalLength => Fault::Peer(Violation::MessageTooLong),
            other => Fault::Transport(other.clone()),
        }
    }

    pub(crate) fn into_op_error(self) -> OpError {
        match self {
            Fault::Peer(v) => OpError::PeerMisbehaved(v),
            Fault::Transport(e) => e.into(),
        }
    }
}

/// See the module documentation.
#[derive(Debug)]
pub(crate) struct Conn {
    pub ep: EndpointId,
    pub sock_type: SockType,
    pub link: Link,
    pub local: Handshake,
    pub mode: Option<Mode>,
    pub limits: Limits,
    /// Stream mode: our intermediate stream buffer, exposed for the peer to write (held for the connection's life).
    pub stream_setup: Option<StreamSetup>,
    pub close_queued: bool,
    /// A graceful close waits for the sends before its CLOSE.
    closing: bool,
    /// Sends the application started that are still to be handed over in parts (a stream sendfile reads its file
    /// as it goes), and the sends made after them, which wait for them (see [`order`]). While any is held or
    /// waits, neither a graceful close's CLOSE nor a write shutdown's goes out, so the peer never sees a clean end
    /// of stream after part of it (issue 26: a graceful close delivers every send already started). See
    /// [`Conn::hold_sends`].
    order: order::SendOrder<plan::TakenSend>,
    /// A write shutdown: its ticket, and whether its CLOSE(ShutdownWrite) is queued.
    shutdown: Option<(crate::proto::op::OpToken, bool)>,
    timing: Timing,
    /// When a delayed acknowledgment (message mode) or a held window update (stream mode) goes anyway.
    ack_at: Option<Instant>,
    /// Stream mode: when a sender holding its indirect transfers for an advertisement goes on anyway
    /// ([`RESYNC_HOLD`](crate::proto::stream::RESYNC_HOLD) after the hold began, or after the receiver last showed
    /// progress through the stream buffer).
    resync_at: Option<Instant>,
    /// When the next keepalive check is due.
    keepalive_at: Option<Instant>,
    /// The peer stopped receiving (its CLOSE StopReceiving): no new send may start ([`Conn::refuses_sends`]).
    peer_stopped: bool,
    /// What the control buffers cost the context's memory budget, given back with the connection.
    _charge: crate::budget::Charge,
}

/// What a connection starts from besides its link: the transport's limits, the protocol's timings, its stream
/// buffer's setup (stream sockets) and what its buffers cost the memory budget.
#[derive(Debug)]
pub(crate) struct Setup {
    pub limits: Limits,
    pub timing: Timing,
    pub stream: Option<StreamSetup>,
    pub charge: crate::budget::Charge,
}

impl Conn {
    pub(crate) fn new(
        ep: EndpointId,
        sock_type: SockType,
        link: Link,
        local: Handshake,
        setup: Setup,
    ) -> Self {
        Conn {
            ep,
            sock_type,
            link,
            local,
            mode: None,
            limits: setup.limits,
            stream_setup: setup.stream,
            close_queued: false,
            closing: false,
            order: order::SendOrder::default(),
            shutdown: None,
            timing: setup.timing,
            ack_at: None,
            resync_at: None,
            keepalive_at: None,
            peer_stopped: false,
            _charge: setup.charge,
        }
    }

    /// Applies the peer's handshake: checks it and negotiates credits and sizes (seed 002, 3.2:
    /// "the EXS interfaces on both sides negotiate the initial values").
    pub(crate) fn establish(
        &mut self,
        peer: &Handshake,
        opts: &SocketOptions,
        now: Instant,
    ) -> Result<(), Violation> {
        let delay_acks = !self.timing.ack_delay.is_zero();
        check_peer_handshake(peer, self.sock_type, opts)?;
        self.link
            .start(u32::from(peer.ctrl_window), usize::from(peer.slot_size));
        let room = Link::inline_room(peer.slot_size);
        self.mode = Some(match self.sock_type {
            SockType::SeqPacket => {
                let send = u32::from(opts.send_credits.min(peer.recv_credits));
                let recv = u32::from(opts.recv_credits.min(peer.send_credits));
                if send == 0 || recv == 0 {
                    return Err(Violation::Handshake("zero advert credits".into()));
                }
                let small = (opts.small_packet_max_size as usize).min(room);
                Mode::Message(Box::new(MessageProto::new(
                    send,
                    recv,
                    small,
                    self.limits.max_message,
                    delay_acks,
                )))
            }
            SockType::Stream => {
                let setup = self.stream_setup.take().ok_or_else(|| {
                    Violation::Handshake("stream socket without a stream buffer".into())
                })?;
                let mut s = StreamProto::new(setup, peer, opts, self.limits, delay_acks)?;
                s.set_max_sge(self.limits.max_sge);
                Mode::Stream(Box::new(s))
            }
        });
        self.keepalive_at = self.timing.keepalive.map(|k| now + k);
        Ok(())
    }

    /// When the connection next needs [`Conn::handle_timeout`], if ever (the engine keeps a timer at this deadline,
    /// as quinn-proto's `Connection::poll_timeout`).
    ///
    /// In two parts, which change at different paces: the near one (a delayed acknowledgment or window update, a
    /// stream sender's hold), set and cleared with the messages, and the keepalive check, which moves only when it
    /// comes due. The engine keeps a timer for each, so the messages do not move the keepalive's.
    pub(crate) fn poll_timeout(&self) -> ConnTimeouts {
        ConnTimeouts {
            near: [self.ack_at, self.resync_at].into_iter().flatten().min(),
            keepalive: self.keepalive_at,
        }
    }

    /// Does what is due at `now`: a delayed acknowledgment or window update goes; a stream sender's hold for an
    /// advertisement ends; an idle connection queues a keepalive probe. The engine flushes the connection
    /// afterwards. Returns whether anything was queued; `Err` when the peer withheld credits too long (see
    /// [`Link::keepalive`]).
    pub(crate) fn handle_timeout(&mut self, now: Instant) -> Result<bool, Fault> {
        let mut queued = false;
        if self.ack_at.is_some_and(|at| at <= now) {
            self.ack_at = None;
            self.force_ack();
            queued = true;
        }
        if self.resync_at.is_some_and(|at| at <= now) {
            self.resync_at = None;
            if let Some(Mode::Stream(s)) = &mut self.mode {
                s.end_resync_hold();
            }
            queued = true;
        }
        if let Some(at) = self.keepalive_at.filter(|&at| at <= now) {
            let _ = at;
            self.keepalive_at = self.timing.keepalive.map(|k| now + k);
            queued |= self.link.keepalive()?;
        }
        Ok(queued)
    }

    /// The connection's life around the protocol is ending (a close, a violation, the transport): no more
    /// keepalive probes.
    fn stop_keepalive(&mut self) {
        self.keepalive_at = None;
    }

    pub(crate) fn is_established(&self) -> bool {
        self.mode.is_some()
    }

    pub(crate) fn message(&mut self) -> Option<&mut MessageProto> {
        match &mut self.mode {
            Some(Mode::Message(m)) => Some(m),
            _ => None,
        }
    }

    pub(crate) fn stream(&mut self) -> Option<&mut StreamProto> {
        match &mut self.mode {
            Some(Mode::Stream(s)) => Some(s),
            _ => None,
        }
    }

    /// Posts a persistent receive (seed 002, 4.3); refused (ticket back) when the rules forbid it.
    pub(crate) fn recv_persistent(
        &mut self,
        ticket: crate::proto::op::OpToken,
        exposure: Box<dyn Exposure>,
    ) -> Result<(), (crate::proto::op::OpToken, &'static str)> {
        match &mut self.mode {
            Some(Mode::Message(m)) => m.recv_persistent(ticket, exposure, &mut self.link),
            _ => Err((
                ticket,
                "persistent receives exist on SOCK_SEQPACKET sockets only",
            )),
        }
    }

    /// Ends this side's persistent operations; false if there were none.
    pub(crate) fn end_persistent(&mut self) -> bool {
        match &mut self.mode {
            Some(Mode::Message(m)) => m.end_persistent(&mut self.link),
            _ => false,
        }
    }

    /// Queues CLOSE (once): after everything already queued for an orderly close, ahead of it for a violation.
    /// Nothing is posted after it (see [`Link::flush`]).
    pub(crate) fn queue_close(&mut self, reason: CloseReason) {
        self.stop_keepalive();
        if !self.close_queued {
            self.close_queued = true;
            match reason {
                CloseReason::Violation => self.link.push_urgent(Body::Close(reason)),
                _ => self.link.push_ctrl(Body::Close(reason), None, None),
            }
        }
    }

    /// Closes like TCP's `close()`: receives are cancelled; sends already posted go on and complete; CLOSE
    /// follows once every one of them has completed, so the peer gets every byte, then end-of-stream (issue 14:
    /// close was abortive, and its CLOSE could overtake writes waiting for credits).
    /// Persistent operations end as [`Conn::end_persistent`] ends them, and CLOSE waits for those too.
    pub(crate) fn close_gracefully(&mut self) {
        self.stop_keepalive();
        self.cancel_receives(OpError::Cancelled);
        // The peer's sends to us can no longer complete: say so now, in order (after the acknowledgments already
        // queued, so that nothing we received is reported failed to the peer).
        if self.is_established() {
            self.link
                .push_ctrl(Body::Close(CloseReason::StopReceiving), None, None);
        }
        if let Some(Mode::Message(m)) = &mut self.mode {
            m.end_persistent(&mut self.link);
        }
        self.closing = true;
        self.advance_close();
    }

    fn advance_close(&mut self) {
        let done = self.order.is_idle()
            && match &self.mode {
                Some(Mode::Message(m)) => m.sends_done_all(),
                Some(Mode::Stream(s)) => s.sends_done(),
                None => true,
            };
        if self.closing && done {
            self.queue_close(CloseReason::Close);
        }
    }

    /// Whether the final CLOSE has been posted.
    pub(crate) fn close_sent(&self) -> bool {
        self.link.is_closed()
    }

    /// Posts what can go now. An acknowledgment (message mode) or a stream window update being delayed sets the
    /// deadline at which it goes anyway ([`Conn::poll_timeout`]): the acknowledgment delay, or the stream's
    /// [`WINDOW_HOLD`](crate::proto::stream::WINDOW_HOLD); one sent meanwhile clears it. A stream sender holding
    /// its indirect transfers for an advertisement sets its own deadline the same way
    /// ([`RESYNC_HOLD`](crate::proto::stream::RESYNC_HOLD)), cleared once the hold ends.
    ///
    /// `now` is asked for only when a deadline starts (most flushes start none).
    pub(crate) fn flush(
        &mut self,
        out: &mut Vec<WorkRequest>,
        now: &mut LazyNow<'_>,
    ) -> Result<(), Violation> {
        let delayed = self.flush_now(out)?;
        // A hold lasts RESYNC_HOLD from its start, or from the receiver's last progress through the stream buffer.
        let (resync, progressed) = match &mut self.mode {
            Some(Mode::Stream(s)) => (s.resync_waiting(), s.take_resync_progress()),
            _ => (false, false),
        };
        self.resync_at = match (resync, self.resync_at) {
            (false, _) => None,
            (true, Some(at)) if !progressed => Some(at),
            (true, _) => Some(now.get() + crate::proto::stream::RESYNC_HOLD),
        };
        self.ack_at = match (delayed, self.ack_at) {
            (false, _) => None,
            (true, Some(at)) => Some(at),
            (true, None) => Some(
                now.get()
                    + match self.mode {
                        Some(Mode::Stream(_)) => crate::proto::stream::WINDOW_HOLD,
                        _ => self.timing.ack_delay,
                    },
            ),
        };
        Ok(())
    }

    /// [`Conn::flush`] without the timing: whether an acknowledgment or window update is being delayed.
    fn flush_now(&mut self, out: &mut Vec<WorkRequest>) -> Result<bool, Violation> {
        self.advance_shutdown();
        self.advance_close();
        match &mut self.mode {
            Some(Mode::Message(m)) => {
                if m.ack_due() && m.ack_now() {
                    m.queue_ack(&mut self.link);
                }
                self.link.flush(out, &mut **m);
                self.link.check_backlog()?;
                Ok(m.ack_due())
            }
            Some(Mode::Stream(s)) => {
                let pumped = s.pump(&mut self.link);
                self.link.flush(out, &mut ());
                self.link.check_backlog()?;
                pumped.map(|()| s.window_waiting())
            }
            None => {
                self.link.flush(out, &mut ());
                Ok(false)
            }
        }
    }

    /// Shuts the write direction down once every send before it has left (seed: the peer sees end-of-stream
    /// after the last byte); `ticket` completes when every send has completed.
    pub(crate) fn shutdown_write(&mut self, ticket: crate::proto::op::OpToken) {
        self.shutdown = Some((ticket, false));
        self.advance_shutdown();
    }

    fn advance_shutdown(&mut self) {
        let Some((_, queued)) = &self.shutdown else {
            return;
        };
        let Some((posted, done)) = self.sends_state() else {
            return;
        };
        if !queued && posted && self.order.is_idle() {
            // After every advert and write already queued on the link, in order.
            self.link
                .push_ctrl(Body::Close(CloseReason::ShutdownWrite), None, None);
            self.shutdown.as_mut().expect("checked").1 = true;
        }
        if self.shutdown.as_ref().is_some_and(|s| s.1) && done {
            let (t, _) = self.shutdown.take().expect("checked");
            t.complete(Ok(()), 0, crate::proto::op::EventFlags::default());
        }
    }

    /// Whether every send is posted, and whether every send has completed (`None` before the mode is known).
    fn sends_state(&self) -> Option<(bool, bool)> {
        match &self.mode {
            Some(Mode::Message(m)) => Some((m.sends_posted(), m.sends_done())),
            Some(Mode::Stream(s)) => Some((s.sends_posted(), s.sends_done())),
            None => None,
        }
    }

    /// Holds the end of stream back for a send started now and handed over in parts later (a stream sendfile):
    /// a graceful close or a write shutdown meanwhile sends its CLOSE only after [`Conn::release_sends`], and the
    /// sends made meanwhile go after all of it ([`Conn::start_send`]). The parts themselves still go out while the
    /// connection closes ([`Conn::holds_sends`]); a failure (the linger time running out included) ends every
    /// hold.
    pub(crate) fn hold_sends(&mut self) -> HoldId {
        self.order.hold()
    }

    /// The last part of held send `id` has been handed over: the sends that waited for it start, and the close it
    /// held back may go out (at the next flush). One that gave up part way is not released: the connection is
    /// reset instead ([`Conn::fail`] fails what waited for it), since whatever followed part of it on the stream
    /// would tell the peer it had the whole.
    pub(crate) fn release_sends(&mut self, id: HoldId) {
        for send in self.order.release(id) {
            self.start_now(send);
        }
    }

    /// Whether held send `id`'s next part may still go out (a send the application started before its close or
    /// write shutdown).
    pub(crate) fn holds_sends(&self, id: HoldId) -> bool {
        self.order.holds(id)
    }

    /// Readiness for poll: (readable, writable).
    pub(crate) fn readiness(&self) -> (bool, bool) {
        match &self.mode {
            Some(Mode::Message(m)) => (m.readable(), m.writable()),
            Some(Mode::Stream(s)) => (s.readable(), s.writable()),
            None => (false, false),
        }
    }

    /// Posts a stream receive (leased; exposed for remote write now under the trusted policy, else when advertised).
    pub(crate) fn recv_stream(
        &mut self,
        ticket: crate::proto::op::OpToken,
        mem: crate::proto::stream::StreamRecvMemory,
        flags: crate::options::MsgFlags,
    ) -> Result<(), Violation> {
        match &mut self.mode {
            Some(Mode::Stream(s)) => s.recv(ticket, mem, flags, &mut self.link),
            _ => Err(Violation::Unexpected {
                kind: "stream receive",
                context: "on a message socket",
            }),
        }
    }

    /// Whether a stream receive waits for its key (see [`Conn::take_recv_to_key`]).
    pub(crate) fn recv_key_wanted(&self) -> bool {
        matches!(&self.mode, Some(Mode::Stream(s)) if s.recv_key_wanted())
    }

    /// The memory of the stream receive to advertise next, if it waits for its key (see
    /// [`crate::proto::stream::StreamRecvMemory`]); the key comes back through [`Conn::give_recv_key`].
    pub(crate) fn take_recv_to_key(&mut self) -> Option<crate::transport::Sge> {
        match &mut self.mode {
            Some(Mode::Stream(s)) => s.take_recv_to_key(&mut self.link),
            _ => None,
        }
    }

    /// The key of the receive [`Conn::take_recv_to_key`] handed out, or its memory again without one (see
    /// [`crate::proto::stream::StreamProto::give_recv_key`]).
    pub(crate) fn give_recv_key(&mut self, keyed: Result<Box<dyn Exposure>, OpError>) {
        if let Some(Mode::Stream(s)) = &mut self.mode {
            s.give_recv_key(keyed, &mut self.link);
        }
    }

    /// The acknowledgment delay expired: acknowledge (message mode) or report stream-buffer space (stream mode)
    /// now.
    pub(crate) fn force_ack(&mut self) {
        match &mut self.mode {
            Some(Mode::Message(m)) => m.queue_ack(&mut self.link),
            Some(Mode::Stream(s)) => s.force_window(&mut self.link),
            None => {}
        }
    }

    /// Handles one completion of this connection's endpoint.
    /// `pool` is the context's shared receive pool, for completions of its buffers (the engine reposts those).
    pub(crate) fn on_completion(
        &mut self,
        c: &Completion,
        out: &mut Vec<WorkRequest>,
        pool: Option<&RecvPool>,
    ) -> Result<Incoming, Fault> {
        match (c.op, link::wr_kind(c.wr_id)) {
            (Completed::Recv { len, imm }, Some(kind @ (WrKind::Recv(_) | WrKind::Pool(_)))) => {
                match &c.status {
                    Ok(()) => {}
                    Err(WcError::Flushed) => return Ok(Incoming::Nothing),
                    Err(e) => return Err(Fault::of_recv(e)),
                }
                let incoming = match imm {
                    Some(imm) => {
                        self.on_write_imm(imm)?;
                        Incoming::Nothing
                    }
                    None => self.on_buffer(kind, len as usize, pool)?,
                };
                match kind {
                    WrKind::Recv(slot) => self.link.repost(slot, out)?,
                    _ => self.link.consumed()?,
                }
                Ok(incoming)
            }
            (Completed::RemoteWrite { imm }, _) => {
                // A peer's write that failed on its way in (a reset mid-transfer, our own shutdown cutting it)
                // carries its immediate too: its bytes did not all arrive, so it is the connection's end, never
                // data (taken as data, the stream moved past bytes it never received).
                match &c.status {
                    Ok(()) => {}
                    Err(WcError::Flushed) => return Ok(Incoming::Nothing),
                    Err(e) => return Err(Fault::Transport(e.clone())),
                }
                self.on_write_imm(imm)?;
                Ok(Incoming::Nothing)
            }
            (Completed::Send, Some(WrKind::Ctrl(slot))) => {
                let mode = &mut self.mode;
                self.link.on_ctrl_done(slot, &mut |seq| {
                    if let Some(Mode::Message(m)) = mode {
                        m.on_inline_sent(seq, c.status.clone());
                    }
                });
                self.check_local(&c.status)?;
                Ok(Incoming::Nothing)
            }
            (Completed::Read, Some(WrKind::Data(tag))) => {
                self.link.on_data_done(true);
                match &mut self.mode {
                    Some(Mode::Message(m)) => {
                        m.on_read_done(tag, c.status.clone(), &mut self.link)?
                    }
                    Some(Mode::Stream(_)) | None => {}
                }
                self.check_local(&c.status)?;
                Ok(Incoming::Nothing)
            }
            (Completed::Write, Some(WrKind::Data(tag))) => {
                self.link.on_data_done(false);
                match &mut self.mode {
                    Some(Mode::Stream(s)) => s.on_write_done(tag, c.status.clone()),
                    Some(Mode::Message(m)) => {
                        m.on_write_done(tag, c.status.clone(), &mut self.link)
                    }
                    None => {}
                }
                self.check_local(&c.status)?;
                Ok(Incoming::Nothing)
            }
            (op, kind) => Err(Fault::Transport(WcError::Other(format!(
                "completion {op:?} does not match work request {kind:?} ({:#x})",
                c.wr_id
            )))),
        }
    }

    /// A local work request failed: a flush is part of going down, anything else brings the connection down.
    fn check_local(&self, status: &Result<(), WcError>) -> Result<(), Fault> {
        match status {
            Ok(()) | Err(WcError::Flushed) => Ok(()),
            Err(WcError::RemoteAccess) => Err(Fault::Peer(Violation::RemoteAccess(
                "the peer's device refused our RDMA access".into(),
            ))),
            Err(e) => Err(Fault::Transport(e.clone())),
        }
    }

    fn on_write_imm(&mut self, imm: u32) -> Result<(), Violation> {
        match &mut self.mode {
            Some(Mode::Stream(s)) => s.on_write_imm(imm, &mut self.link),
            _ => Err(Violation::Unexpected {
                kind: "write-with-immediate",
                context: "on a message-mode socket",
            }),
        }
    }

    /// Handles the control messages of one receive buffer, in order (several share a buffer when the peer sent
    /// them together: `wire::FLAG_MORE`). Nothing may follow a CLOSE.
    fn on_buffer(
        &mut self,
        kind: WrKind,
        len: usize,
        pool: Option<&RecvPool>,
    ) -> Result<Incoming, Violation> {
        let mut at = Some(0);
        let mut incoming = Incoming::Nothing;
        while let Some(offset) = at {
            let (slots, slot) = match kind {
                WrKind::Pool(id) => pool
                    .ok_or_else(|| Violation::BadRange("a pool completion without a pool".into()))?
                    .slot(id)?,
                WrKind::Recv(slot) => (self.link.own_rx()?, slot),
                _ => unreachable!("only receive completions carry control messages"),
            };
            let (msg, inline, next) = slots.decode(slot, len, offset)?;
            if matches!(incoming, Incoming::PeerClose(_)) {
                return Err(Violation::Unexpected {
                    kind: msg.body.kind().name(),
                    context: "after CLOSE in the same buffer",
                });
            }
            let rx = std::sync::Arc::clone(&slots.buf);
            incoming = self.on_message(msg, inline, &rx)?;
            at = next;
        }
        Ok(incoming)
    }

    /// Handles a control message whose immediate data sits at `inline` in `rx`.
    fn on_message(
        &mut self,
        msg: Message,
        inline: std::ops::Range<usize>,
        rx: &std::sync::Arc<exs_dma::DmaBuf>,
    ) -> Result<Incoming, Violation> {
        self.link.credits_returned(msg.credits)?;
        let Some(mode) = &mut self.mode else {
            return Err(Violation::Unexpected {
                kind: msg.body.kind().name(),
                context: "before the handshake",
            });
        };
        // A read notification tells of a read that came before the acknowledgment it carries (the peer may consume
        // an ended persistent send right after that read): it is taken first, while its send is outstanding.
        if let (Body::ReadNotify { seq }, Mode::Message(m)) = (&msg.body, &mut *mode) {
            m.on_read_notify(*seq)?;
        }
        if let Some(ack) = msg.ack {
            match mode {
                Mode::Message(m) => m.on_ack(ack, &mut self.link)?,
                Mode::Stream(_) => {
                    return Err(Violation::Unexpected {
                        kind: "acknowledgment",
                        context: "on a stream socket",
                    })
                }
            }
        }
        match (msg.body, mode) {
            (Body::Credit, _) | (Body::Ack, Mode::Message(_)) => {}
            (Body::Close(reason), _) => return Ok(Incoming::PeerClose(reason)),
            (Body::Advert(a), Mode::Message(m)) => {
                let range = inline.clone();
                let mut into_recv = |sge: &mut crate::transport::Sge| -> Result<(), Violation> {
                    let n = sge.len().min(range.len());
                    sge.fill_from(0, rx, range.start, n)
                        .map_err(|e| Violation::BadRange(e.to_string()))
                };
                let rx2 = rx;
                let mut copy_out = || -> Result<Vec<u8>, Violation> {
                    let mut v = vec![0u8; inline.len()];
                    rx2.read_at(inline.start, &mut v)
                        .map_err(|e| Violation::BadRange(e.to_string()))?;
                    Ok(v)
                };
                m.on_advert(a, &mut into_recv, &mut copy_out, &mut self.link)?;
            }
            (Body::ReadNotify { .. }, Mode::Message(_)) => {} // taken above
            (Body::PersistentEnd { seq, echo }, Mode::Message(m)) => {
                m.on_persistent_end(seq, echo, &mut self.link)?
            }
            (Body::StreamAdvert(a), Mode::Stream(s)) => s.on_advert(a, &mut self.link)?,
            (Body::StreamWindow { consumed }, Mode::Stream(s)) => s.on_window(consumed)?,
            (Body::StreamRing { addr, rkey }, Mode::Stream(s)) => {
                s.on_ring(addr, rkey, &mut self.link)?
            }
            (Body::StreamRingWanted, Mode::Stream(s)) => s.on_ring_wanted(),
            (body, _) => {
                return Err(Violation::Unexpected {
                    kind: body.kind().name(),
                    context: "for this socket type",
                });
            }
        }
        Ok(Incoming::Nothing)
    }

    /// Fails every operation (some complete once the transport returns their memory).
    pub(crate) fn fail(&mut self, err: OpError) {
        self.stop_keepalive();
        // Nothing more goes out: a held send's next part is refused (see [`Conn::holds_sends`]), and the sends
        // that waited for one fail.
        self.fail_waiting(&err);
        if let Some((t, _)) = self.shutdown.take() {
            t.complete(Err(err.clone()), 0, crate::proto::op::EventFlags::default());
        }
        match &mut self.mode {
            Some(Mode::Message(m)) => m.fail(err),
            Some(Mode::Stream(s)) => s.fail(err),
            None => {}
        }
    }

    /// Fails the receiving side's operations only.
    fn cancel_receives(&mut self, err: OpError) {
        match &mut self.mode {
            Some(Mode::Message(m)) => m.fail_receives(err),
            Some(Mode::Stream(s)) => s.fail_receives(err),
            None => {}
        }
    }

    /// Ends every hold and fails the sends that waited for one ([`Conn::hold_sends`]).
    fn fail_waiting(&mut self, err: &OpError) {
        for send in self.order.fail() {
            send.ticket
                .complete(Err(err.clone()), 0, crate::proto::op::EventFlags::default());
        }
    }

    /// The endpoint was released: every work request is back; complete whatever is left.
    pub(crate) fn drop_all(&mut self, err: OpError) {
        self.stop_keepalive();
        // A send still waiting for a held one would otherwise start later on a connection that is gone.
        self.fail_waiting(&err);
        self.ack_at = None;
        self.resync_at = None;
        self.link.discard();
        // A shutdown whose CLOSE is queued and whose sends all completed succeeded, though the round that would
        // have said so (`advance_shutdown`, at its flush) did not come before the disconnect (review finding).
        let finished = self.shutdown.as_ref().is_some_and(|s| s.1)
            && self.sends_state().is_some_and(|(_, done)| done);
        if finished {
            if let Some((t, _)) = self.shutdown.take() {
                t.complete(Ok(()), 0, crate::proto::op::EventFlags::default());
            }
        }
        match &mut self.mode {
            Some(Mode::Message(m)) => m.drop_all(err.clone()),
            Some(Mode::Stream(s)) => s.drop_all(err.clone()),
            None => {}
        }
        // A write shutdown still pending had sends before it that never all completed: it fails with them (review
        // finding: it was left pending, and a wait for it never returned once the peer reset or went away).
        if let Some((t, _)) = self.shutdown.take() {
            t.complete(Err(err), 0, crate::proto::op::EventFlags::default());
        }
    }

    /// The peer stopped receiving (it closed; its final CLOSE follows its data): our sends not yet completed
    /// never will.
    pub(crate) fn on_peer_stopped_receiving(&mut self) {
        self.peer_stopped = true;
        match &mut self.mode {
            Some(Mode::Message(m)) => m.fail_pending_sends(OpError::PeerClosed),
            Some(Mode::Stream(s)) => s.fail_pending_sends(OpError::PeerClosed),
            None => {}
        }
    }

    /// Why a new send may not start though the connection is open: the peer stopped receiving, and its final
    /// CLOSE (which ends the connection) has not come yet. A send made meanwhile would never be acknowledged, and
    /// a peer that never sends its final CLOSE would hold it until the close's linger (review finding; test
    /// `hostile_sends_after_the_peer_stopped_receiving_are_refused`).
    pub(crate) fn refuses_sends(&self) -> Option<OpError> {
        self.peer_stopped.then_some(OpError::PeerClosed)
    }

    /// The connection went down without the peer's close: a stream's bytes already received stay readable
    /// ([`StreamProto::on_reset`](crate::proto::stream::StreamProto::on_reset)); call before [`Conn::drop_all`].
    pub(crate) fn on_reset(&mut self, err: OpError) {
        if let Some(Mode::Stream(s)) = &mut self.mode {
            s.on_reset(err);
        }
    }

    /// The peer closed (CLOSE received).
    pub(crate) fn on_peer_close(&mut self, reason: CloseReason) {
        match &mut self.mode {
            Some(Mode::Message(m)) => m.on_peer_close(reason),
            Some(Mode::Stream(s)) => s.on_peer_close(reason),
            None => {}
        }
    }

    /// Whether the send side has nothing queued or in flight (used to disconnect after CLOSE went out).
    pub(crate) fn sends_drained(&self) -> bool {
        self.link.is_idle() && self.link.sends_drained(self.limits.max_send_wr)
    }
}

/// When a connection next needs [`Conn::handle_timeout`] ([`Conn::poll_timeout`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct ConnTimeouts {
    /// A delayed acknowledgment or window update, or the end of a stream sender's hold for an advertisement.
    pub(crate) near: Option<Instant>,
    /// The next keepalive check.
    pub(crate) keepalive: Option<Instant>,
}

#[cfg(test)]
mod tests;

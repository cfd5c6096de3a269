//! How an application's send or receive travels, decided by the protocol before it takes the operation.
//!
//! Seed 002 ("Extended Sockets API and UNH-EXS", section 4) chooses per message: a persistent send's memory is
//! exposed for the peer to read while the application keeps writing it (4.2); a send into the peer's persistent
//! receive is written there at an offset (4.4); a small message travels as immediate data and a larger one is
//! exposed for the peer's RDMA read (4.1, 3.1); a stream send goes to the dynamic stream protocol (seed 001). The
//! connection's state (socket type, the peer's persistent buffers, the immediate-data threshold) decides; the
//! engine only leases and exposes the memory as told ([`SendPlan`], [`RecvPlan`]) and hands the result back
//! ([`Conn::start_send`]).

use exs_dma::LeaseKind;

use super::{Conn, Mode};
use crate::error::{BufferError, RecvError, SendError, StateError, Violation};
use crate::options::{MsgFlags, SockType};
use crate::proto::message::{RecvReq, SendData, SendReq, RECV_LEASE};
use crate::proto::op::OpToken;
use crate::proto::stream::StreamRecvMemory;
use crate::transport::{Exposure, Sge};

/// A send the connection has taken, its memory prepared as planned ([`Conn::start_send`]).
#[derive(Debug)]
pub(super) struct TakenSend {
    pub(super) ticket: OpToken,
    data: SendData,
    len: usize,
    flags: MsgFlags,
    offset: Option<u64>,
}

/// What the engine does with a send's memory before the protocol takes it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum SendPlan {
    /// The device reads the bytes as they are posted (immediate data, a write into the peer's persistent receive,
    /// or a stream send): lease them for device read.
    Inline,
    /// The peer reads the bytes by RDMA read: expose them. `persistent` (seed 002, 4.2): the application keeps
    /// writing them meanwhile, so the lease is shared.
    Exposed {
        /// A persistent send.
        persistent: bool,
    },
}

impl SendPlan {
    /// How the memory is leased.
    pub(crate) fn lease_kind(self) -> LeaseKind {
        match self {
            SendPlan::Exposed { persistent: true } => LeaseKind::DeviceReadShared,
            SendPlan::Inline | SendPlan::Exposed { persistent: false } => LeaseKind::DeviceRead,
        }
    }
}

/// What the engine does with a receive's memory before the protocol takes it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum RecvPlan {
    /// A persistent receive (seed 002, 4.3): exposed for the peer's writes while the application reads, shared.
    Persistent,
    /// A message receive: leased for the device to write (the peer's immediate data lands there, or an RDMA read
    /// of its exposed send).
    Message,
    /// A stream receive: leased, and exposed for the peer's direct transfers (seed 001) when it is advertised
    /// (see [`StreamRecvMemory`]).
    Stream {
        /// It never takes a key: the peer has closed (it writes nothing more; what our stream buffer still holds
        /// is copied in).
        keyless: bool,
    },
}

impl RecvPlan {
    /// How the memory is leased.
    pub(crate) fn lease_kind(self) -> LeaseKind {
        match self {
            RecvPlan::Persistent => LeaseKind::DeviceWriteShared,
            RecvPlan::Message => RECV_LEASE,
            RecvPlan::Stream { .. } => LeaseKind::DeviceWrite,
        }
    }
}

impl Conn {
    fn sock_type(&self) -> SockType {
        match self.mode {
            Some(Mode::Stream(_)) => SockType::Stream,
            _ => SockType::SeqPacket,
        }
    }

    /// Decides how a send of `len` bytes travels, or why it may not start. `offset`: `exs_send_offset` (seed 002,
    /// 4.4) into the peer's persistent receive.
    pub(crate) fn plan_send(
        &mut self,
        len: usize,
        flags: MsgFlags,
        offset: Option<u64>,
    ) -> Result<SendPlan, SendError> {
        check_flags(flags, self.sock_type(), offset.is_some())?;
        let persistent = flags.contains(MsgFlags::PERSISTENT);
        let m = match &mut self.mode {
            Some(Mode::Message(m)) => m,
            _ if len == 0 => return Err(BufferError::Empty.into()),
            _ => return Ok(SendPlan::Inline),
        };
        if persistent {
            m.may_send_persistent().map_err(StateError::Persistent)?;
        }
        match (offset, m.peer_precv_len()) {
            (Some(_), None) => {
                return Err(StateError::Persistent(
                    "send_offset needs the peer's persistent receive, and it has none active",
                )
                .into())
            }
            (o, Some(size)) if !persistent => {
                let offset = o.unwrap_or(0);
                if offset.checked_add(len as u64).is_none_or(|end| end > size) {
                    return Err(StateError::OffsetOutOfRange {
                        offset,
                        len: len as u64,
                        size,
                    }
                    .into());
                }
                // One RDMA write carries it (`MessageProto::write_to_peer`): the device refuses one longer than its
                // largest message, and that failure would end the connection (review finding).
                if len as u64 > self.limits.max_message {
                    return Err(StateError::Persistent(
                        "a send into the peer's persistent receive is one RDMA write, and this one is longer than \
                         the transport's largest message (Capabilities::max_message): send it in parts, each at its \
                         offset (send_offset)",
                    )
                    .into());
                }
            }
            _ => {}
        }
        if persistent {
            return Ok(SendPlan::Exposed { persistent: true });
        }
        // Seed 002, 4.1: immediate data when it is small enough or written into the peer's persistent receive;
        // else the peer reads it.
        Ok(if m.writes_to_peer() || m.is_immediate(len) {
            SendPlan::Inline
        } else {
            SendPlan::Exposed { persistent: false }
        })
    }

    /// Starts a send planned by [`Conn::plan_send`], its memory prepared as planned (`part_of`: a part of that
    /// held send), or keeps it until the held sends started before it have handed over their last parts
    /// ([`Conn::hold_sends`]): a stream's bytes go in the order its sends were made.
    pub(crate) fn start_send(
        &mut self,
        ticket: OpToken,
        data: SendData,
        len: usize,
        flags: MsgFlags,
        offset: Option<u64>,
        part_of: Option<super::HoldId>,
    ) {
        let send = TakenSend {
            ticket,
            data,
            len,
            flags,
            offset,
        };
        if let Some(send) = self.order.take(send, part_of) {
            self.start_now(send);
        }
    }

    pub(super) fn start_now(&mut self, send: TakenSend) {
        let TakenSend {
            ticket,
            data,
            len,
            flags,
            offset,
        } = send;
        match (&mut self.mode, data) {
            (Some(Mode::Stream(s)), SendData::Inline(sge)) => s.send(ticket, sge, flags),
            (Some(Mode::Message(m)), data) => m.send(
                SendReq {
                    ticket: Some(ticket),
                    len,
                    data,
                    persistent: flags
                        .contains(MsgFlags::PERSISTENT)
                        .then_some(flags.contains(MsgFlags::NOTIFY)),
                    offset: offset.unwrap_or(0),
                },
                &mut self.link,
            ),
            _ => unreachable!("a send starts only as planned for its connection"),
        }
    }

    /// Decides how a receive of `len` bytes is taken, or why it may not start. `offset`: `exs_recv_offset` (seed
    /// 002, 4.4) from the peer's persistent send; `peer_closed`: the peer's close has arrived.
    pub(crate) fn plan_recv(
        &mut self,
        len: usize,
        flags: MsgFlags,
        offset: Option<u64>,
        peer_closed: bool,
    ) -> Result<RecvPlan, RecvError> {
        check_flags(flags, self.sock_type(), offset.is_some())?;
        let m = match &mut self.mode {
            Some(Mode::Message(m)) => m,
            _ if len == 0 => return Err(BufferError::Empty.into()),
            _ => {
                return Ok(RecvPlan::Stream {
                    keyless: peer_closed,
                })
            }
        };
        if flags.contains(MsgFlags::PERSISTENT) {
            m.may_be_persistent().map_err(StateError::Persistent)?;
            if len == 0 {
                return Err(BufferError::Empty.into());
            }
            return Ok(RecvPlan::Persistent);
        }
        if let Some(offset) = offset {
            let size = m.peer_psend_len().ok_or(StateError::Persistent(
                "recv_offset needs the peer's persistent send, and none has arrived (or it ended)",
            ))?;
            let len = len as u64;
            if offset.checked_add(len).is_none_or(|end| end > size) {
                return Err(StateError::OffsetOutOfRange { offset, len, size }.into());
            }
        }
        Ok(RecvPlan::Message)
    }
}

/// A receive's memory, prepared as planned.
pub(crate) enum RecvMemory {
    /// Leased for the device to write ([`RecvPlan::Message`]).
    Leased(Sge),
    /// A stream receive's ([`RecvPlan::Stream`]).
    Stream(StreamRecvMemory),
    /// Exposed for the peer's writes ([`RecvPlan::Persistent`]).
    Exposed(Box<dyn Exposure>),
}

/// Why a planned receive did not start.
pub(crate) enum RecvRefused {
    /// The persistent-receive rules refused it (seed 002, 4.3); the ticket comes back.
    Persistent(OpToken, &'static str),
    /// The stream protocol found the peer in breach: the connection faults.
    Peer(Violation),
}

impl Conn {
    /// Starts a receive planned by [`Conn::plan_recv`], its memory prepared as planned.
    pub(crate) fn start_recv(
        &mut self,
        ticket: OpToken,
        mem: RecvMemory,
        flags: MsgFlags,
        offset: Option<u64>,
    ) -> Result<(), RecvRefused> {
        match (&mut self.mode, mem) {
            (Some(Mode::Message(m)), RecvMemory::Leased(sge)) => {
                m.recv(
                    RecvReq {
                        ticket,
                        sge,
                        offset,
                    },
                    &mut self.link,
                );
                Ok(())
            }
            (Some(Mode::Message(_)), RecvMemory::Exposed(e)) => self
                .recv_persistent(ticket, e)
                .map_err(|(t, why)| RecvRefused::Persistent(t, why)),
            (_, RecvMemory::Stream(mem)) => self
                .recv_stream(ticket, mem, flags)
                .map_err(RecvRefused::Peer),
            (_, RecvMemory::Leased(_) | RecvMemory::Exposed(_)) => {
                unreachable!("a receive starts only as planned for its connection")
            }
        }
    }
}

/// Flags and offsets that a socket type cannot take.
pub(crate) fn check_flags(flags: MsgFlags, ty: SockType, offset: bool) -> Result<(), StateError> {
    let known = MsgFlags::WAITALL.0 | MsgFlags::PERSISTENT.0 | MsgFlags::NOTIFY.0;
    if flags.0 & !known != 0 {
        return Err(StateError::Persistent("unknown flag bits"));
    }
    if flags.contains(MsgFlags::NOTIFY) && !flags.contains(MsgFlags::PERSISTENT) {
        return Err(StateError::Persistent(
            "NOTIFY applies to persistent sends only",
        ));
    }
    if ty == SockType::Stream && (flags.contains(MsgFlags::PERSISTENT) || offset) {
        return Err(StateError::Persistent(
            "persistent and offset transfers exist on SOCK_SEQPACKET sockets only",
        ));
    }
    Ok(())
}

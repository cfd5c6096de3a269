//! The wire format: every control message and the connection handshake.
//!
//! Fixed little-endian layouts, versioned. The decoders take any byte slice and return an error, never panic
//! (a property test feeds them random bytes, and a fuzz target does the same).
//!
//! ```text
//! control message = header (16 bytes) + body (kind-specific, body_len bytes) + inline data (immediate adverts)
//!
//! header:  0 version u8 | 1 kind u8 | 2 flags u16 | 4 credits u16 | 6 body_len u16 | 8 ack u32 | 12 reserved u32
//! ```
//!
//! * `credits`: control-buffer credits returned to the peer (the link layer, `proto::link` in the source).
//! * `ack` (valid when `flags & FLAG_ACK`): cumulative count of the peer's message-mode advertisements whose data
//!   transfer finished (the UNH-EXS paper, 3.2: the acknowledgment that completes a send and returns its credit), so an
//!   acknowledgment rides on any message going the other way.
//! * `flags & FLAG_MORE`: another control message follows this one (and its inline data) in the same buffer.
//!   Messages queued while an earlier control send is still in flight go out together, several per send and per
//!   receive buffer (one provider call and one link credit for many small messages). Nothing follows a
//!   CLOSE in a buffer.
//!
//! Data itself never travels in control messages except as the immediate data of the UNH-EXS paper, 4.1. Stream data
//! travels by RDMA write-with-immediate; its 32-bit immediate is described by [`Imm`].

use std::fmt;

mod decode;

use decode::Reader;
// Named only by the tools and tests of feature `testing` (the engine reads frames through `decode_framed`).
#[cfg_attr(not(feature = "testing"), allow(unused_imports))]
pub use decode::{frames, Framed, Frames};

/// Protocol version spoken by this implementation.
pub const VERSION: u8 = 1;
/// Length of the control-message header.
pub const HEADER_LEN: usize = 16;
/// Handshake magic ("EXS" + protocol generation), first four bytes of the connection private data.
pub const HANDSHAKE_MAGIC: u32 = u32::from_le_bytes(*b"EXS1");
/// Length of the encoded handshake. Must fit the smallest private-data space we support
/// (rdma_cm on InfiniBand/RoCE leaves 56 bytes in a connect request).
pub const HANDSHAKE_LEN: usize = 48;

/// Header flag: the `ack` field is valid.
pub const FLAG_ACK: u16 = 1;
/// Header flag: another message follows this one in the same buffer.
pub const FLAG_MORE: u16 = 2;
const KNOWN_FLAGS: u16 = FLAG_ACK | FLAG_MORE;

/// Why bytes could not be decoded.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    /// Fewer bytes than the layout needs.
    #[error("message too short: need {need} bytes, got {got}")]
    TooShort {
        /// Bytes the layout needs.
        need: usize,
        /// Bytes there were.
        got: usize,
    },
    /// More bytes than the header announces.
    #[error("message length {got} does not match the {expected} bytes its header announces")]
    LengthMismatch {
        /// Bytes the header announces (header, body and inline data).
        expected: usize,
        /// Bytes there were.
        got: usize,
    },
    /// A version we do not speak.
    #[error("unsupported protocol version {0} (we speak {VERSION})")]
    Version(u8),
    /// An unknown message kind.
    #[error("unknown message kind {0}")]
    UnknownKind(u8),
    /// Flags we do not know, or reserved bytes that are not zero.
    #[error("reserved bits set: {0}")]
    Reserved(&'static str),
    /// The handshake does not start with our magic.
    #[error("not an exs handshake (magic {0:#010x})")]
    BadMagic(u32),
    /// A field has a value outside its domain.
    #[error("invalid field {field}: {value}")]
    Invalid {
        /// The field's name.
        field: &'static str,
        /// The value it had.
        value: u64,
    },
}

/// Kinds of control messages.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Kind {
    /// Message mode: a send advertises its buffer (the UNH-EXS paper, 3.1).
    Advert = 1,
    /// Message mode: acknowledgment only (the `ack` header field), when nothing else goes the other way.
    Ack = 2,
    /// Control-buffer credits only.
    Credit = 3,
    /// The sender closes or shuts down its side.
    Close = 4,
    /// Stream mode: the receiver advertises a receive buffer (the dynamic stream protocol).
    StreamAdvert = 5,
    /// Stream mode: the receiver reports stream-buffer space it has freed.
    StreamWindow = 6,
    /// Persistent send: the peer has read the persistent buffer (the UNH-EXS paper, 4.2, the "notify" variant).
    ReadNotify = 7,
    /// Offsets (the UNH-EXS paper, 4.4): write into the peer's persistent receive buffer at an offset, done.
    OffsetWritten = 8,
    /// A persistent send or receive ends (or, echoed, its end is confirmed).
    PersistentEnd = 9,
    /// Stream mode: the address and key of the sender's intermediate stream buffer, when they could not travel in
    /// the handshake (keys bound to the connection exist only once it is up: memory windows).
    StreamRing = 10,
    /// Stream mode: the sender asks for the receiver's stream buffer (allocated on first need, so an idle
    /// connection holds none).
    StreamRingWanted = 11,
}

impl Kind {
    fn from_u8(v: u8) -> Result<Self, WireError> {
        Ok(match v {
            1 => Kind::Advert,
            2 => Kind::Ack,
            3 => Kind::Credit,
            4 => Kind::Close,
            5 => Kind::StreamAdvert,
            6 => Kind::StreamWindow,
            7 => Kind::ReadNotify,
            8 => Kind::OffsetWritten,
            9 => Kind::PersistentEnd,
            10 => Kind::StreamRing,
            11 => Kind::StreamRingWanted,
            other => return Err(WireError::UnknownKind(other)),
        })
    }

    /// Short name for logs and errors.
    pub fn name(self) -> &'static str {
        match self {
            Kind::Advert => "ADVERT",
            Kind::Ack => "ACK",
            Kind::Credit => "CREDIT",
            Kind::Close => "CLOSE",
            Kind::StreamAdvert => "STREAM_ADVERT",
            Kind::StreamWindow => "STREAM_WINDOW",
            Kind::ReadNotify => "READ_NOTIFY",
            Kind::OffsetWritten => "OFFSET_WRITTEN",
            Kind::StreamRing => "STREAM_RING",
            Kind::StreamRingWanted => "STREAM_RING_WANTED",
            Kind::PersistentEnd => "PERSISTENT_END",
        }
    }
}

/// Flags of a message-mode advertisement.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AdvertFlags(pub u32);

impl AdvertFlags {
    /// The data follows the advertisement inline (the UNH-EXS paper, 4.1, "immediate data").
    pub const IMMEDIATE: u32 = 1;
    /// The buffer stays exposed for repeated reads by the peer's receives (the UNH-EXS paper, 4.2).
    pub const PERSISTENT: u32 = 2;
    /// With PERSISTENT: the sender wants a READ_NOTIFY each time the peer has read it.
    pub const NOTIFY: u32 = 4;
    /// The buffer is a persistent receive: the peer may write it (at offsets) (the UNH-EXS paper, 4.3 and 4.4).
    pub const PERSISTENT_RECV: u32 = 8;
    const KNOWN: u32 = Self::IMMEDIATE | Self::PERSISTENT | Self::NOTIFY | Self::PERSISTENT_RECV;

    /// Whether `flag` is set.
    pub fn has(self, flag: u32) -> bool {
        self.0 & flag != 0
    }
}

/// A message-mode advertisement: "the size and the starting address of the data block to be sent, and a memory
/// registration handle that gives the receiving side permission to transfer the block" (the UNH-EXS paper, 3.1).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Advert {
    /// Sequence number of this advertisement on the connection (wrapping).
    pub seq: u32,
    /// Flags.
    pub flags: AdvertFlags,
    /// Length of the message in bytes.
    pub len: u64,
    /// Remote address of the data, as the peer's transport addresses it.
    pub addr: u64,
    /// Remote key.
    pub rkey: u64,
}

/// Why a side closes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u32)]
pub enum CloseReason {
    /// Orderly close of the whole connection.
    Close = 1,
    /// Half close: the sender will send no more data (shutdown(SHUT_WR)).
    ShutdownWrite = 2,
    /// The sender found a protocol violation by the receiver of this message.
    Violation = 3,
    /// The sender closed and takes nothing more (its receives were cancelled): the receiver's sends that have not
    /// completed never will. Data the sender posted before still arrives, then its final CLOSE (without it, two
    /// sides closing at once, each with sends the other would never receive, waited for the linger time).
    StopReceiving = 4,
}

/// A stream-mode advertisement of a receive buffer (the dynamic stream protocol): address, length, key, the estimated
/// next sequence number and the phase, plus the stream-buffer space freed so far (piggybacked window update).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StreamAdvert {
    /// Remote address of the receive buffer.
    pub addr: u64,
    /// Remote key of the receive buffer.
    pub rkey: u64,
    /// Length of the receive buffer.
    pub len: u64,
    /// Estimated next-expected sequence number ("source seqno", the dynamic stream protocol).
    pub seq: u64,
    /// Phase number (the dynamic stream protocol).
    pub phase: u32,
    /// Whether the receive has MSG_WAITALL (the advert may be consumed by several transfers).
    pub waitall: bool,
    /// Cumulative bytes of the intermediate stream buffer the receiver has consumed.
    pub consumed: u64,
}

/// Persistent-receive data written at an offset (the UNH-EXS paper, 4.4): the writer tells the owner what changed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OffsetWritten {
    /// Offset inside the persistent receive buffer.
    pub offset: u64,
    /// Bytes written.
    pub len: u64,
}

/// The body of a control message.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Body {
    /// See [`Advert`]. `inline` bytes of immediate data follow when `flags` has IMMEDIATE.
    Advert(Advert),
    /// Acknowledgment only.
    Ack,
    /// Credits only.
    Credit,
    /// Close or half close.
    Close(CloseReason),
    /// See [`StreamAdvert`].
    StreamAdvert(StreamAdvert),
    /// Cumulative bytes of stream buffer consumed.
    StreamWindow {
        /// Cumulative bytes consumed.
        consumed: u64,
    },
    /// The peer has read the persistent buffer of advertisement `seq`.
    ReadNotify {
        /// Sequence number of the persistent advertisement.
        seq: u32,
    },
    /// See [`OffsetWritten`].
    OffsetWritten(OffsetWritten),
    /// The owner of persistent advertisement `seq` ends it (`echo == false`); the peer, once it no longer
    /// touches that memory, confirms (`echo == true`) for a persistent receive. A persistent send's end is
    /// confirmed by the ordinary acknowledgment.
    PersistentEnd {
        /// Sequence number of the persistent advertisement (in its owner's sequence space).
        seq: u32,
        /// This is the confirmation.
        echo: bool,
    },
    /// The stream buffer's remote address and key (its length travelled in the handshake).
    StreamRing {
        /// Remote address of the first byte.
        addr: u64,
        /// Remote key.
        rkey: u64,
    },
    /// The sender needs the receiver's stream buffer (answered by STREAM_RING).
    StreamRingWanted,
}

impl Body {
    /// The kind of this body.
    pub fn kind(&self) -> Kind {
        match self {
            Body::Advert(_) => Kind::Advert,
            Body::Ack => Kind::Ack,
            Body::Credit => Kind::Credit,
            Body::Close(_) => Kind::Close,
            Body::StreamAdvert(_) => Kind::StreamAdvert,
            Body::StreamWindow { .. } => Kind::StreamWindow,
            Body::ReadNotify { .. } => Kind::ReadNotify,
            Body::OffsetWritten(_) => Kind::OffsetWritten,
            Body::PersistentEnd { .. } => Kind::PersistentEnd,
            Body::StreamRing { .. } => Kind::StreamRing,
            Body::StreamRingWanted => Kind::StreamRingWanted,
        }
    }

    fn body_len(&self) -> usize {
        match self {
            Body::Advert(_) => 32,
            Body::Ack | Body::Credit | Body::StreamRingWanted => 0,
            Body::Close(_) => 8,
            Body::StreamAdvert(_) => 48,
            Body::StreamWindow { .. } => 8,
            Body::ReadNotify { .. } => 8,
            Body::OffsetWritten(_) => 16,
            Body::PersistentEnd { .. } => 8,
            Body::StreamRing { .. } => 16,
        }
    }
}

/// A decoded control message.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Message {
    /// Control-buffer credits returned.
    pub credits: u16,
    /// Cumulative acknowledgment of the receiver's message-mode adverts, if present.
    pub ack: Option<u32>,
    /// The body.
    pub body: Body,
}

impl Message {
    /// A message with no credits and no ack.
    pub fn new(body: Body) -> Self {
        Self {
            credits: 0,
            ack: None,
            body,
        }
    }

    /// Bytes of immediate data that follow the encoded message.
    pub fn inline_len(&self) -> usize {
        match self.body {
            Body::Advert(a) if a.flags.has(AdvertFlags::IMMEDIATE) => a.len as usize,
            _ => 0,
        }
    }

    /// Length of the encoding, without immediate data.
    pub fn encoded_len(&self) -> usize {
        HEADER_LEN + self.body.body_len()
    }

    /// Encodes into `out` (at least [`Message::encoded_len`] bytes) and returns the bytes written.
    /// Immediate data is not copied: the sender gathers it from the user's buffer (the UNH-EXS paper, 4.1).
    pub fn encode(&self, out: &mut [u8]) -> usize {
        self.encode_framed(out, false)
    }

    /// Encodes like [`Message::encode`], with [`FLAG_MORE`] set when `more` (another message follows this one's
    /// immediate data in the same buffer).
    pub fn encode_framed(&self, out: &mut [u8], more: bool) -> usize {
        let n = self.encoded_len();
        let mut w = Writer {
            buf: &mut out[..n],
            at: 0,
        };
        w.u8(VERSION);
        w.u8(self.body.kind() as u8);
        let ack = if self.ack.is_some() { FLAG_ACK } else { 0 };
        w.u16(ack | if more { FLAG_MORE } else { 0 });
        w.u16(self.credits);
        w.u16(self.body.body_len() as u16);
        w.u32(self.ack.unwrap_or(0));
        w.u32(0);
        match self.body {
            Body::Advert(a) => {
                w.u32(a.seq);
                w.u32(a.flags.0);
                w.u64(a.len);
                w.u64(a.addr);
                w.u64(a.rkey);
            }
            Body::Ack | Body::Credit | Body::StreamRingWanted => {}
            Body::Close(r) => {
                w.u32(r as u32);
                w.u32(0);
            }
            Body::StreamAdvert(s) => {
                w.u64(s.addr);
                w.u64(s.rkey);
                w.u64(s.len);
                w.u64(s.seq);
                w.u32(s.phase);
                w.u32(u32::from(s.waitall));
                w.u64(s.consumed);
            }
            Body::StreamWindow { consumed } => w.u64(consumed),
            Body::ReadNotify { seq } => {
                w.u32(seq);
                w.u32(0);
            }
            Body::OffsetWritten(o) => {
                w.u64(o.offset);
                w.u64(o.len);
            }
            Body::PersistentEnd { seq, echo } => {
                w.u32(seq);
                w.u32(u32::from(echo));
            }
            Body::StreamRing { addr, rkey } => {
                w.u64(addr);
                w.u64(rkey);
            }
        }
        debug_assert_eq!(w.at, n);
        n
    }

    /// Encodes into a new vector (tests and tools).
    pub fn to_vec(self) -> Vec<u8> {
        let mut v = vec![0u8; self.encoded_len()];
        self.encode(&mut v);
        v
    }
}

/// Socket type carried in the handshake.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum WireSockType {
    /// SOCK_SEQPACKET: message mode.
    SeqPacket = 1,
    /// SOCK_STREAM: the dynamic stream protocol.
    Stream = 2,
}

/// What each side proposes when connecting; carried as connection private data.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Handshake {
    /// Socket type of the sender.
    pub sock_type: WireSockType,
    /// Control receive buffers the sender has posted for the peer (the peer's control-message window).
    pub ctrl_window: u16,
    /// Bytes each of those buffers holds (header + immediate data).
    pub slot_size: u16,
    /// Advertisements the sender wants to have outstanding (the UNH-EXS paper, 3.2, "send_credits").
    pub send_credits: u16,
    /// Advertisements the sender is prepared to receive ("recv_credits").
    pub recv_credits: u16,
    /// The sender's small_packet_max_size (the UNH-EXS paper, 4.1).
    pub small_max: u32,
    /// Stream mode: the sender's intermediate stream buffer (zero length when none).
    pub stream_len: u32,
    /// Remote address of the stream buffer.
    pub stream_addr: u64,
    /// Remote key of the stream buffer.
    pub stream_rkey: u64,
    /// Whether the sender's device performs RDMA write-with-immediate natively (informational).
    pub native_imm: bool,
}

impl Handshake {
    /// Encodes into [`HANDSHAKE_LEN`] bytes.
    pub fn encode(&self) -> [u8; HANDSHAKE_LEN] {
        let mut out = [0u8; HANDSHAKE_LEN];
        let mut w = Writer {
            buf: &mut out,
            at: 0,
        };
        w.u32(HANDSHAKE_MAGIC);
        w.u8(VERSION);
        w.u8(self.sock_type as u8);
        w.u16(u16::from(self.native_imm));
        w.u16(self.ctrl_window);
        w.u16(self.slot_size);
        w.u16(self.send_credits);
        w.u16(self.recv_credits);
        w.u32(self.small_max);
        w.u32(self.stream_len);
        w.u64(self.stream_addr);
        w.u64(self.stream_rkey);
        w.u64(0);
        out
    }

    /// Decodes private data. Trailing bytes are allowed (transports may pad private data with zeros).
    pub fn decode(bytes: &[u8]) -> Result<Handshake, WireError> {
        let mut r = Reader::new(bytes);
        let magic = r.u32()?;
        if magic != HANDSHAKE_MAGIC {
            return Err(WireError::BadMagic(magic));
        }
        let version = r.u8()?;
        if version != VERSION {
            return Err(WireError::Version(version));
        }
        let sock_type = match r.u8()? {
            1 => WireSockType::SeqPacket,
            2 => WireSockType::Stream,
            other => {
                return Err(WireError::Invalid {
                    field: "socket type",
                    value: other.into(),
                })
            }
        };
        let flags = r.u16()?;
        if flags & !1 != 0 {
            return Err(WireError::Reserved("handshake flags"));
        }
        let hs = Handshake {
            sock_type,
            native_imm: flags & 1 != 0,
            ctrl_window: r.u16()?,
            slot_size: r.u16()?,
            send_credits: r.u16()?,
            recv_credits: r.u16()?,
            small_max: r.u32()?,
            stream_len: r.u32()?,
            stream_addr: r.u64()?,
            stream_rkey: r.u64()?,
        };
        if r.u64()? != 0 {
            return Err(WireError::Reserved("handshake reserved"));
        }
        if (hs.slot_size as usize) < HEADER_LEN + 48 {
            return Err(WireError::Invalid {
                field: "slot_size",
                value: hs.slot_size.into(),
            });
        }
        Ok(hs)
    }
}

/// The 32-bit immediate of a stream-mode RDMA write-with-immediate.
///
/// Bit 31 tells a direct transfer (into the advertised receive buffer, Figure 1 of the dynamic stream protocol) from an
/// indirect one (into the intermediate stream buffer, Figure 2); bits 0-30 carry the length. Lengths up to 2^31 - 1
/// fit, so a transfer of any size is split into chunks of at most [`Imm::MAX_LEN`] bytes (never a 16-bit field, which
/// could not describe a 64 KiB transfer). Where the target does not report the length of a write-with-immediate
/// (libfabric tcp reports 0), the immediate is the only source of truth.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Imm {
    /// Direct transfer of this many bytes into the receive at the head of the queue.
    Direct(u32),
    /// Indirect transfer of this many bytes into the stream buffer.
    Indirect(u32),
}

impl Imm {
    /// Largest length one transfer can carry.
    pub const MAX_LEN: u32 = (1 << 31) - 1;

    /// Encodes to the 32-bit immediate value.
    pub fn encode(self) -> u32 {
        match self {
            Imm::Direct(n) => n & Self::MAX_LEN,
            Imm::Indirect(n) => (1 << 31) | (n & Self::MAX_LEN),
        }
    }

    /// Decodes a 32-bit immediate value (every value is valid).
    pub fn decode(v: u32) -> Imm {
        if v & (1 << 31) != 0 {
            Imm::Indirect(v & Self::MAX_LEN)
        } else {
            Imm::Direct(v)
        }
    }
}

impl fmt::Display for Imm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Imm::Direct(n) => write!(f, "D{n}"),
            Imm::Indirect(n) => write!(f, "I{n}"),
        }
    }
}

struct Writer<'a> {
    buf: &'a mut [u8],
    at: usize,
}

impl Writer<'_> {
    fn put(&mut self, b: &[u8]) {
        self.buf[self.at..self.at + b.len()].copy_from_slice(b);
        self.at += b.len();
    }
    fn u8(&mut self, v: u8) {
        self.put(&[v]);
    }
    fn u16(&mut self, v: u16) {
        self.put(&v.to_le_bytes());
    }
    fn u32(&mut self, v: u32) {
        self.put(&v.to_le_bytes());
    }
    fn u64(&mut self, v: u64) {
        self.put(&v.to_le_bytes());
    }
}

#[cfg(test)]
mod tests;

//! Decoding control messages: the header, then the body its kind names, then the framing that says where the
//! message (and its immediate data) ends. Every step returns an error on bytes it does not accept, never panics.

use super::{
    Advert, AdvertFlags, Body, CloseReason, Kind, Message, OffsetWritten, StreamAdvert, WireError,
    FLAG_ACK, FLAG_MORE, HEADER_LEN, KNOWN_FLAGS, VERSION,
};

impl Message {
    /// Decodes a control message received as `bytes` (header, body and any immediate data), alone in its
    /// buffer. Returns the message and the offset at which immediate data starts.
    pub fn decode(bytes: &[u8]) -> Result<(Message, usize), WireError> {
        let f = Self::decode_framed(bytes)?;
        if f.more {
            return Err(WireError::Invalid {
                field: "more flag of a message alone in its buffer",
                value: 1,
            });
        }
        Ok((f.msg, f.inline_at))
    }

    /// Decodes the first control message of a buffer that may hold several ([`FLAG_MORE`]): the next one starts
    /// at [`Framed::end`]. A message without the flag must end the buffer exactly; one with it must be followed
    /// by at least a header.
    pub fn decode_framed(bytes: &[u8]) -> Result<Framed, WireError> {
        let mut r = Reader::new(bytes);
        let head = Header::decode(&mut r)?;
        let body = Body::decode(head.kind, &mut r)?;
        if head.body_len != body.body_len() {
            return Err(WireError::Invalid {
                field: "body_len",
                value: head.body_len as u64,
            });
        }
        let msg = Message {
            credits: head.credits,
            ack: head.ack,
            body,
        };
        let more = head.flags & FLAG_MORE != 0;
        let end = msg.frame_end(bytes.len(), more)?;
        Ok(Framed {
            msg,
            inline_at: r.at,
            end,
            more,
        })
    }

    /// Where this message and its immediate data end in a buffer of `got` bytes: exactly at its end when nothing
    /// follows, and at least a header before it when `more` says something does.
    fn frame_end(&self, got: usize, more: bool) -> Result<usize, WireError> {
        // An immediate advert's length comes from the peer: it may be anything up to u64::MAX (found by fuzzing).
        let expected =
            (HEADER_LEN as u64 + self.body.body_len() as u64).saturating_add(self.inline_len_u64());
        let with_next = expected.saturating_add(HEADER_LEN as u64);
        if more && (got as u64) < with_next {
            return Err(WireError::TooShort {
                need: usize::try_from(with_next).unwrap_or(usize::MAX),
                got,
            });
        }
        if !more && got as u64 != expected {
            return Err(WireError::LengthMismatch {
                expected: usize::try_from(expected).unwrap_or(usize::MAX),
                got,
            });
        }
        // Within the buffer (checked above), so it fits a usize.
        Ok(expected as usize)
    }

    fn inline_len_u64(&self) -> u64 {
        match self.body {
            Body::Advert(a) if a.flags.has(AdvertFlags::IMMEDIATE) => a.len,
            _ => 0,
        }
    }
}

/// The fixed header of a control message, checked on its own (reserved bits and words zero, the ack field
/// present exactly when its flag says so).
struct Header {
    kind: Kind,
    flags: u16,
    credits: u16,
    body_len: usize,
    ack: Option<u32>,
}

impl Header {
    fn decode(r: &mut Reader<'_>) -> Result<Header, WireError> {
        let version = r.u8()?;
        if version != VERSION {
            return Err(WireError::Version(version));
        }
        let kind = Kind::from_u8(r.u8()?)?;
        let flags = r.u16()?;
        if flags & !KNOWN_FLAGS != 0 {
            return Err(WireError::Reserved("header flags"));
        }
        let credits = r.u16()?;
        let body_len = r.u16()? as usize;
        let ack = r.u32()?;
        if r.u32()? != 0 {
            return Err(WireError::Reserved("header reserved word"));
        }
        if flags & FLAG_ACK == 0 && ack != 0 {
            return Err(WireError::Reserved("ack field without the ack flag"));
        }
        let ack = (flags & FLAG_ACK != 0).then_some(ack);
        if ack.is_none() && kind == Kind::Ack {
            return Err(WireError::Invalid {
                field: "ack flag of ACK",
                value: 0,
            });
        }
        Ok(Header {
            kind,
            flags,
            credits,
            body_len,
            ack,
        })
    }
}

impl Body {
    /// Decodes the body of a message of `kind`.
    fn decode(kind: Kind, r: &mut Reader<'_>) -> Result<Body, WireError> {
        Ok(match kind {
            Kind::Advert => Body::Advert(decode_advert(r)?),
            Kind::Ack => Body::Ack,
            Kind::Credit => Body::Credit,
            Kind::StreamRingWanted => Body::StreamRingWanted,
            Kind::Close => Body::Close(decode_close(r)?),
            Kind::StreamAdvert => Body::StreamAdvert(decode_stream_advert(r)?),
            Kind::StreamWindow => Body::StreamWindow { consumed: r.u64()? },
            Kind::ReadNotify => {
                let seq = r.u32()?;
                if r.u32()? != 0 {
                    return Err(WireError::Reserved("read-notify padding"));
                }
                Body::ReadNotify { seq }
            }
            Kind::OffsetWritten => Body::OffsetWritten(OffsetWritten {
                offset: r.u64()?,
                len: r.u64()?,
            }),
            Kind::PersistentEnd => {
                let seq = r.u32()?;
                let echo = r.flag("persistent-end flags")?;
                Body::PersistentEnd { seq, echo }
            }
            Kind::StreamRing => {
                let addr = r.u64()?;
                let rkey = r.u64()?;
                if rkey == 0 && addr == 0 {
                    return Err(WireError::Invalid {
                        field: "stream ring key",
                        value: 0,
                    });
                }
                Body::StreamRing { addr, rkey }
            }
        })
    }
}

fn decode_advert(r: &mut Reader<'_>) -> Result<Advert, WireError> {
    let seq = r.u32()?;
    let flags = AdvertFlags(r.u32()?);
    if flags.0 & !AdvertFlags::KNOWN != 0 {
        return Err(WireError::Reserved("advert flags"));
    }
    let (len, addr, rkey) = (r.u64()?, r.u64()?, r.u64()?);
    Ok(Advert {
        seq,
        flags,
        len,
        addr,
        rkey,
    })
}

fn decode_close(r: &mut Reader<'_>) -> Result<CloseReason, WireError> {
    let reason = match r.u32()? {
        1 => CloseReason::Close,
        2 => CloseReason::ShutdownWrite,
        3 => CloseReason::Violation,
        4 => CloseReason::StopReceiving,
        other => {
            return Err(WireError::Invalid {
                field: "close reason",
                value: other.into(),
            })
        }
    };
    if r.u32()? != 0 {
        return Err(WireError::Reserved("close padding"));
    }
    Ok(reason)
}

fn decode_stream_advert(r: &mut Reader<'_>) -> Result<StreamAdvert, WireError> {
    let (addr, rkey, len, seq) = (r.u64()?, r.u64()?, r.u64()?, r.u64()?);
    let phase = r.u32()?;
    let waitall = r.flag("stream advert flags")?;
    let consumed = r.u64()?;
    Ok(StreamAdvert {
        addr,
        rkey,
        len,
        seq,
        phase,
        waitall,
        consumed,
    })
}

/// One control message at the start of a buffer that may hold several (see [`Message::decode_framed`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Framed {
    /// The message.
    pub msg: Message,
    /// Offset of its immediate data (right after header and body).
    pub inline_at: usize,
    /// Offset just past its immediate data: where the next message starts when `more`.
    pub end: usize,
    /// Another message follows ([`FLAG_MORE`]).
    pub more: bool,
}

/// The messages of a buffer that may hold several, in order, each with its offset in `bytes` (the offsets in its
/// [`Framed`] count from there). Ends after the message without [`FLAG_MORE`], or after the first error.
pub fn frames(bytes: &[u8]) -> Frames<'_> {
    Frames { bytes, at: Some(0) }
}

/// See [`frames`].
#[derive(Clone, Debug)]
pub struct Frames<'a> {
    bytes: &'a [u8],
    /// Where the next message starts; `None` once the buffer is done.
    at: Option<usize>,
}

impl Iterator for Frames<'_> {
    type Item = Result<(usize, Framed), WireError>;

    fn next(&mut self) -> Option<Self::Item> {
        let at = self.at.take()?;
        let r = Message::decode_framed(&self.bytes[at..]);
        if let Ok(f) = &r {
            // Within the buffer: `decode_framed` checked that `end` bytes and a header follow `at`.
            self.at = f.more.then_some(at + f.end);
        }
        Some(r.map(|f| (at, f)))
    }
}

/// Reads little-endian fields from the front of a buffer; running past its end is [`WireError::TooShort`].
pub(super) struct Reader<'a> {
    buf: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    pub(super) fn new(buf: &'a [u8]) -> Self {
        Reader { buf, at: 0 }
    }
    fn take<const N: usize>(&mut self) -> Result<[u8; N], WireError> {
        let end = self.at + N;
        let got = self.buf.get(self.at..end).ok_or(WireError::TooShort {
            need: end,
            got: self.buf.len(),
        })?;
        self.at = end;
        let mut out = [0u8; N];
        out.copy_from_slice(got);
        Ok(out)
    }
    pub(super) fn u8(&mut self) -> Result<u8, WireError> {
        Ok(self.take::<1>()?[0])
    }
    pub(super) fn u16(&mut self) -> Result<u16, WireError> {
        Ok(u16::from_le_bytes(self.take()?))
    }
    pub(super) fn u32(&mut self) -> Result<u32, WireError> {
        Ok(u32::from_le_bytes(self.take()?))
    }
    pub(super) fn u64(&mut self) -> Result<u64, WireError> {
        Ok(u64::from_le_bytes(self.take()?))
    }
    /// A 32-bit word that must be 0 (false) or 1 (true).
    fn flag(&mut self, field: &'static str) -> Result<bool, WireError> {
        match self.u32()? {
            0 => Ok(false),
            1 => Ok(true),
            other => Err(WireError::Invalid {
                field,
                value: other.into(),
            }),
        }
    }
}

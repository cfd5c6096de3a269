//! Socket types, flags and options (ES-API `exs_socket` types, `exs_fcntl`).

use crate::error::OptionError;

/// Socket type (ES-API `exs_socket(domain, type, protocol)`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SockType {
    /// SOCK_SEQPACKET: reliable messages with boundaries (message mode, the UNH-EXS paper section 3).
    SeqPacket,
    /// SOCK_STREAM: a byte stream with TCP's semantics (the dynamic stream protocol, the dynamic stream protocol).
    Stream,
}

impl SockType {
    /// Lower-case name.
    pub fn name(self) -> &'static str {
        match self {
            SockType::SeqPacket => "seqpacket",
            SockType::Stream => "stream",
        }
    }
}

/// Flags of `send`/`recv` (ES-API MSG_* and EXS_* flags).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct MsgFlags(pub u32);

impl MsgFlags {
    /// No flags.
    pub const NONE: MsgFlags = MsgFlags(0);
    /// Stream receive: complete only when the whole buffer is full (MSG_WAITALL).
    pub const WAITALL: MsgFlags = MsgFlags(1);
    /// Persistent send or receive (EXS_PERSISTENT, the UNH-EXS paper sections 4.2 and 4.3).
    pub const PERSISTENT: MsgFlags = MsgFlags(2);
    /// Persistent send: an event each time the peer has read the buffer (the UNH-EXS paper, 4.2).
    pub const NOTIFY: MsgFlags = MsgFlags(4);

    /// Whether all flags of `other` are set.
    pub fn contains(self, other: MsgFlags) -> bool {
        self.0 & other.0 == other.0
    }
}

impl std::ops::BitOr for MsgFlags {
    type Output = MsgFlags;
    fn bitor(self, rhs: MsgFlags) -> MsgFlags {
        MsgFlags(self.0 | rhs.0)
    }
}

/// Per-socket settings (ES-API `exs_fcntl`): read them with [`Socket::options`](crate::Socket::options), change
/// them with the `with_*` setters and [`Socket::set_options`](crate::Socket::set_options), or in one step with
/// [`Socket::update_options`](crate::Socket::update_options) where other threads may change the socket's options
/// at the same time. Those marked "before connect" are negotiated in the handshake and cannot change on a
/// connection; a listener's may change while it listens, for the connections set up after the change.
///
/// ```
/// # #[cfg(feature = "fabric")] {
/// # std::env::set_var("EXS_BACKEND", "fabric");
/// use exs::{Context, SockType, Socket};
///
/// let ctx = Context::from_env()?;
/// let s = Socket::new(&ctx, SockType::SeqPacket)?;
/// s.set_options(s.options()?.with_send_credits(64).with_recv_credits(64))?;
/// assert_eq!(s.options()?.send_credits, 64);
/// // Checked as a whole: nothing changes when one value is out of range.
/// assert!(s.set_options(s.options()?.with_recv_credits(1).with_backlog(0)).is_err());
/// assert_eq!(s.options()?.recv_credits, 64);
/// # }
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct SocketOptions {
    /// Advertisements we want to have outstanding (the UNH-EXS paper, 3.2 "send_credits"). Before connect. 1..=4096.
    pub send_credits: u16,
    /// Advertisements we accept outstanding from the peer ("recv_credits"). Before connect. 1..=4096.
    pub recv_credits: u16,
    /// Sends up to this size travel as immediate data in the advertisement (the UNH-EXS paper, 4.1). Before connect.
    /// 0..=[`SocketOptions::MAX_SMALL`]. What a connection uses is also at most what the peer's control buffers
    /// hold (its shared receive pool's slots: [`crate::SharedRecv`]); the option keeps the value set.
    pub small_packet_max_size: u32,
    /// Stream sockets: bytes of the intermediate stream buffer (the dynamic stream protocol). Before connect. 64..=1
    /// GiB.
    pub stream_buffer_size: u32,
    /// Stream sockets: allocate, register and expose the stream buffer as soon as the connection is up, rather
    /// than when the peer first needs it. Saves the peer's first indirect transfer one round trip; costs the
    /// buffer on every idle connection. Before connect. Off by default.
    pub stream_buffer_eager: bool,
    /// Control receive buffers posted per connection (the link window). 0 picks a size from the credits.
    /// Before connect. 0 or 4..=4096.
    pub control_window: u16,
    /// Listening sockets: connections held for the application (being set up, or established and waiting for an
    /// accept); requests beyond are refused. 1..=65535.
    pub backlog: u32,
    /// Stream sockets: record protocol decisions (adverts, phases, direct/indirect transfers) for
    /// [`Socket::stream_trace`](crate::Socket::stream_trace). Off by default.
    pub trace: bool,
    /// Send control messages queued while an earlier one is still in flight together, several per send and per
    /// peer receive buffer (the immediate data of small sends is then copied once into the shared send buffer),
    /// like TCP's autocorking. A lone message is never held back. On by default; off costs one provider call and
    /// one peer buffer per message. Before connect; on a stream socket at any time, where it also lets small
    /// writes wait for the write in flight (off is TCP_NODELAY, `Stream::set_nodelay`).
    pub coalesce: bool,
}

impl SocketOptions {
    /// Largest `small_packet_max_size` (a control buffer must stay under 64 KiB).
    pub const MAX_SMALL: u32 = 32 * 1024;

    /// The control window in effect.
    pub(crate) fn effective_window(&self, sock_type: SockType) -> u16 {
        if self.control_window != 0 {
            return self.control_window;
        }
        let base = match sock_type {
            // Adverts from the peer, acknowledgments of ours, and room for CLOSE and credits.
            SockType::SeqPacket => {
                u32::from(self.recv_credits) + u32::from(self.send_credits) / 2 + 4
            }
            // Stream writes consume buffers too (verbs), so the window is larger.
            SockType::Stream => u32::from(self.recv_credits) + 64,
        };
        base.clamp(8, 4096) as u16
    }
}

impl Default for SocketOptions {
    fn default() -> Self {
        SocketOptions {
            send_credits: 16,
            recv_credits: 16,
            small_packet_max_size: 512,
            stream_buffer_size: 1 << 20,
            stream_buffer_eager: false,
            control_window: 0,
            backlog: 128,
            trace: false,
            coalesce: true,
        }
    }
}

/// Declares the `with_*` setters and the per-field changes checked by [`SocketOptions::changes`].
macro_rules! setters {
    ($($field:ident: $ty:ty => $variant:ident, $setter:ident;)*) => {
        impl SocketOptions {
            $(
                #[doc = concat!("Sets [`", stringify!($field), "`](SocketOptions::", stringify!($field), ").")]
                #[must_use]
                pub fn $setter(mut self, value: $ty) -> Self {
                    self.$field = value;
                    self
                }
            )*

            /// The fields of `new` that differ from `self`, each with its new value.
            pub(crate) fn changes(&self, new: &SocketOptions) -> Vec<Opt> {
                let mut v = Vec::new();
                $(
                    if self.$field != new.$field {
                        v.push(Opt::$variant(new.$field));
                    }
                )*
                v
            }
        }

        /// One field's new value, as checked and applied by the engine.
        #[derive(Clone, Copy, Debug, PartialEq, Eq)]
        pub(crate) enum Opt {
            $($variant($ty),)*
        }

        impl Opt {
            /// The field's name.
            pub(crate) fn name(&self) -> &'static str {
                match self {
                    $(Opt::$variant(_) => stringify!($field),)*
                }
            }
        }
    };
}

setters! {
    send_credits: u16 => SendCredits, with_send_credits;
    recv_credits: u16 => RecvCredits, with_recv_credits;
    small_packet_max_size: u32 => SmallPacketMaxSize, with_small_packet_max_size;
    stream_buffer_size: u32 => StreamBufferSize, with_stream_buffer_size;
    stream_buffer_eager: bool => StreamBufferEager, with_stream_buffer_eager;
    control_window: u16 => ControlWindow, with_control_window;
    backlog: u32 => Backlog, with_backlog;
    trace: bool => Trace, with_trace;
    coalesce: bool => Coalesce, with_coalesce;
}

impl Opt {
    /// Whether the field is negotiated at connect (and so frozen afterwards).
    pub(crate) fn negotiated(&self) -> bool {
        !matches!(self, Opt::Backlog(_) | Opt::Trace(_))
    }

    /// Checks the value and applies it.
    pub(crate) fn apply(self, o: &mut SocketOptions) -> Result<(), OptionError> {
        fn range(
            name: &'static str,
            v: u64,
            lo: u64,
            hi: u64,
            allowed: &'static str,
        ) -> Result<(), OptionError> {
            if v < lo || v > hi {
                return Err(OptionError::OutOfRange {
                    name,
                    value: v,
                    allowed,
                });
            }
            Ok(())
        }
        let name = self.name();
        match self {
            Opt::SendCredits(v) => {
                range(name, v.into(), 1, 4096, "1..=4096")?;
                o.send_credits = v;
            }
            Opt::RecvCredits(v) => {
                range(name, v.into(), 1, 4096, "1..=4096")?;
                o.recv_credits = v;
            }
            Opt::SmallPacketMaxSize(v) => {
                range(
                    name,
                    v.into(),
                    0,
                    SocketOptions::MAX_SMALL.into(),
                    "0..=32768",
                )?;
                o.small_packet_max_size = v;
            }
            Opt::StreamBufferSize(v) => {
                range(name, v.into(), 64, 1 << 30, "64..=1073741824")?;
                o.stream_buffer_size = v;
            }
            Opt::ControlWindow(v) => {
                if v != 0 {
                    range(name, v.into(), 4, 4096, "0 or 4..=4096")?;
                }
                o.control_window = v;
            }
            Opt::Backlog(v) => {
                range(name, v.into(), 1, 65535, "1..=65535")?;
                o.backlog = v;
            }
            Opt::Trace(v) => o.trace = v,
            Opt::StreamBufferEager(v) => o.stream_buffer_eager = v,
            Opt::Coalesce(v) => o.coalesce = v,
        }
        Ok(())
    }
}

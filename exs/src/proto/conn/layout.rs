//! A connection's control buffers and its half of the handshake: the protocol sizes them from the socket's
//! options (seed 002's control window and credits, the immediate-data size, coalescing) and whether the shared
//! receive pool of seed 003 ("Shared receive queue") serves the connection; the engine allocates and registers
//! what the layout says.

use crate::options::{SockType, SocketOptions};
use crate::proto::link::PACK_SLOTS;
use crate::proto::stream::StreamSetup;
use crate::wire::{Handshake, WireSockType, HEADER_LEN};

/// Bytes of a control send slot: a header and the largest body (immediate data goes as a second entry).
pub(crate) const TX_SLOT: usize = 64;

/// Immediate messages of the largest size one coalesced message-mode buffer holds: a burst of small messages
/// shares sends and buffers (the bench's small-message rows show the gain); it multiplies a connection's receive
/// memory by as much.
pub(crate) const PACKED_PER_BUFFER: usize = 4;

/// A control receive slot holds `n` messages of a header, the largest body, and immediate data up to `small`
/// bytes.
pub(crate) fn ctrl_slot_size(small: usize, n: usize) -> usize {
    (HEADER_LEN + 48 + small)
        .saturating_mul(n)
        .max(HEADER_LEN + 48)
        .next_multiple_of(64)
        .min(u16::MAX as usize & !63)
}

/// The control buffers of one connection.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Layout {
    /// Control receive buffers (the window the peer may fill).
    pub(crate) window: u32,
    /// Bytes of one control receive buffer (the pool's slot size when pooled).
    pub(crate) slot: usize,
    /// Control send slots.
    pub(crate) tx_count: u32,
    /// The shared pool receives for the connection (seed 003): it owns no receive buffers.
    pub(crate) pooled: bool,
    /// Pack buffers for coalesced control messages.
    pub(crate) pack: bool,
}

impl Layout {
    /// The layout of a `ty` connection with `opts`; `pooled`: the shared pool's slot size when the pool serves it.
    pub(crate) fn new(ty: SockType, opts: &SocketOptions, pooled: Option<usize>) -> Self {
        let window = u32::from(opts.effective_window(ty));
        let per_buffer = if opts.coalesce && ty == SockType::SeqPacket {
            PACKED_PER_BUFFER
        } else {
            1
        };
        Layout {
            window,
            slot: pooled
                .unwrap_or_else(|| ctrl_slot_size(opts.small_packet_max_size as usize, per_buffer)),
            tx_count: window.max(16),
            pooled: pooled.is_some(),
            pack: opts.coalesce,
        }
    }

    /// Device-visible bytes the connection's own buffers take (charged to the context's budget).
    pub(crate) fn bytes(&self) -> usize {
        let rx = if self.pooled {
            0
        } else {
            self.slot * self.window as usize
        };
        let pack = if self.pack {
            self.slot * PACK_SLOTS as usize
        } else {
            0
        };
        rx + TX_SLOT * self.tx_count as usize + pack
    }

    /// The stream protocol's setup. The stream buffer is allocated when the peer first needs it; its address and
    /// key follow then (STREAM_RING), so the handshake carries only its length.
    pub(crate) fn stream_setup(ty: SockType, opts: &SocketOptions) -> Option<StreamSetup> {
        match ty {
            SockType::SeqPacket => None,
            SockType::Stream => Some(StreamSetup {
                len: opts.stream_buffer_size as usize,
            }),
        }
    }

    /// This side's handshake (seed 002: the connection's parameters, sent with the connect request or its
    /// answer).
    pub(crate) fn handshake(
        &self,
        ty: SockType,
        opts: &SocketOptions,
        native_imm: bool,
    ) -> Handshake {
        Handshake {
            sock_type: match ty {
                SockType::SeqPacket => WireSockType::SeqPacket,
                SockType::Stream => WireSockType::Stream,
            },
            ctrl_window: self.window as u16,
            slot_size: self.slot as u16,
            send_credits: opts.send_credits,
            recv_credits: opts.recv_credits,
            small_max: opts.small_packet_max_size,
            stream_len: Self::stream_setup(ty, opts).map_or(0, |s| s.len as u32),
            stream_addr: 0,
            stream_rkey: 0,
            native_imm,
        }
    }
}

//! Coalescing: several control messages in one send and one peer buffer (see "Coalescing" in the parent
//! module).

use std::sync::Arc;

use exs_dma::{Lease, LeaseKind};

use super::{wr_id, AckSource, Link, Outgoing, WrKind};
use crate::transport::{Op, Sge, WorkRequest};
use crate::wire::{Body, CloseReason, Message, HEADER_LEN};

impl Link {
    /// Bytes a queued control message takes in a buffer (header, body, immediate data).
    pub(super) fn wire_len(o: &Outgoing) -> usize {
        match o {
            Outgoing::Ctrl { body, inline, .. } => {
                Message::new(*body).encoded_len() + inline.as_ref().map_or(0, Sge::len)
            }
            Outgoing::Data { .. } => usize::MAX,
        }
    }

    /// Whether a control message should wait for the one in flight: only when coalescing is on and another
    /// message as large could join it in one buffer (holding a message that must travel alone only delays it).
    pub(super) fn worth_holding(&self, o: &Outgoing) -> bool {
        let Some(pack) = &self.pack else {
            return false;
        };
        Self::wire_len(o).saturating_mul(2) <= pack.size.min(self.peer_slot)
    }

    /// Whether the first two messages of a queue can share a buffer (a pack buffer is free, both are control
    /// messages, the first is no CLOSE, and both fit the peer's receive buffer and ours).
    pub(super) fn packable(&self, urgent: bool) -> bool {
        let Some(pack) = &self.pack else {
            return false;
        };
        if self.free_pack.is_empty() {
            return false;
        }
        let queue = if urgent { &self.urgent } else { &self.normal };
        let (Some(first), Some(second)) = (queue.front(), queue.get(1)) else {
            return false;
        };
        if matches!(
            first,
            Outgoing::Ctrl {
                body: Body::Close(_),
                ..
            }
        ) {
            return false;
        }
        Self::wire_len(first).saturating_add(Self::wire_len(second))
            <= pack.size.min(self.peer_slot)
    }

    /// Posts control messages from the front of a queue together in one pack buffer (see "Coalescing"), as many
    /// as fit. Returns whether a final CLOSE went out. The caller checked credits for the first message and
    /// that a send-queue entry and a pack buffer are free.
    pub(super) fn post_packet(
        &mut self,
        urgent: bool,
        acks: &mut dyn AckSource,
        out: &mut Vec<WorkRequest>,
    ) -> bool {
        let pack = self.pack.as_ref().expect("checked by packable");
        let limit = pack.size.min(self.peer_slot);
        let p = self.free_pack.pop().expect("checked by packable");
        let base = p as usize * pack.size;
        let (buf, reg) = (Arc::clone(&pack.buf), Arc::clone(&pack.reg));
        // The pack buffer is free (not leased): the CPU may write it.
        let mut dst = buf
            .lease(base..base + limit, LeaseKind::CpuWrite)
            .expect("a free pack buffer is not leased");
        let packed = self.fill_pack(urgent, acks, &mut dst, limit, p);
        drop(dst);
        if packed.count == 0 {
            self.free_pack.push(p);
            return false;
        }
        let sge = Sge::of(&reg, base..base + packed.len, LeaseKind::DeviceRead)
            .expect("a pack buffer just written is not leased");
        self.spent += 1;
        self.sq_free -= 1;
        self.sent_since_check = true;
        self.stats.ctrl_sent += packed.count;
        self.stats.packets += 1;
        self.stats.packed += packed.count;
        out.push(WorkRequest {
            wr_id: wr_id(WrKind::Ctrl(self.tx.count + p)),
            op: Op::Send {
                sges: vec![sge],
                imm: None,
            },
        });
        packed.final_close
    }

    /// Writes the messages at the front of a queue into pack buffer `p` (`dst`, `limit` bytes), each framed as
    /// followed by another but the last.
    fn fill_pack(
        &mut self,
        urgent: bool,
        acks: &mut dyn AckSource,
        dst: &mut Lease,
        limit: usize,
        p: u32,
    ) -> Packed {
        let mut packed = Packed {
            len: 0,
            count: 0,
            final_close: false,
        };
        let mut last: Option<(usize, Message)> = None;
        let mut header = [0u8; HEADER_LEN + 48];
        loop {
            let queue = if urgent { &self.urgent } else { &self.normal };
            let Some(front) = queue.front() else { break };
            if !matches!(front, Outgoing::Ctrl { .. }) || packed.len + Self::wire_len(front) > limit
            {
                break;
            }
            let Some(Outgoing::Ctrl {
                body,
                inline,
                notify,
            }) = self.pop(urgent)
            else {
                unreachable!("checked above")
            };
            if self.pointless_credit(&body) {
                self.credit_queued = false;
                continue; // its credits rode on an earlier message
            }
            let Some(ack) = Self::ack_for(&body, acks) else {
                continue; // the acknowledgment rode on an earlier message
            };
            let at = packed.len;
            let msg = self.stamp(body, ack);
            let n = msg.encode_framed(&mut header, true);
            dst.write(at, &header[..n])
                .expect("inside the pack buffer (checked against limit)");
            if let Some(sge) = &inline {
                sge.lease()
                    .copy_to(0, dst, at + n, sge.len())
                    .expect("inside the pack buffer (checked against limit)");
            }
            last = Some((at, msg));
            packed.len += n + inline.as_ref().map_or(0, Sge::len);
            packed.count += 1;
            self.pack_notify[p as usize].extend(notify);
            if let Body::Close(reason) = body {
                packed.final_close = matches!(reason, CloseReason::Close | CloseReason::Violation);
                break;
            }
        }
        // The last message of the buffer says nothing follows it.
        if let Some((off, msg)) = last {
            let n = msg.encode_framed(&mut header, false);
            dst.write(off, &header[..n])
                .expect("inside the pack buffer");
        }
        packed
    }
}

/// What one pack buffer holds.
struct Packed {
    /// Bytes written.
    len: usize,
    /// Messages in it.
    count: u64,
    /// Whether the last is a final CLOSE.
    final_close: bool,
}

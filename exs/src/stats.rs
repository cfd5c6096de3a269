//! Counters, in one place: a context's ([`Context::stats`](crate::Context::stats): [`EngineStats`], with its progress
//! threads' [`ProgressStats`] and shared receive pool's [`PoolStats`]), a connection's
//! ([`Socket::stats`](crate::Socket::stats): [`ConnStats`] with its [`LinkStats`] and its [`MessageStats`] or
//! [`StreamStats`]), an event queue's ([`EventQueue::stats`](crate::EventQueue::stats): [`QueueStats`]), and the stream
//! protocol's decisions ([`Socket::stream_trace`](crate::Socket::stream_trace): [`StreamTrace`]).
//!
//! A connection's counters also come as named entries ([`ConnStats::entries`]) and print as one readable block
//! (`Display`).

use std::fmt;

pub use crate::engine::ConnStats;
pub use crate::engine::EngineStats;
pub use crate::event::QueueStats;
pub use crate::progress::ProgressStats;
pub use crate::proto::link::LinkStats;
pub use crate::proto::message::MessageStats;
pub use crate::proto::pool::PoolStats;
pub use crate::proto::stream::{StreamStats, StreamTrace};

impl ConnStats {
    /// Every counter with a stable name (`group.counter`), in the order `Display` shows them; `handshake_us` is
    /// 0 until the connection is up. Tools print these (`exs info --json` lists the names).
    pub fn entries(&self) -> Vec<(&'static str, u64)> {
        let (l, m, s) = (&self.link, &self.message, &self.stream);
        let handshake = self.handshake.map_or(0, |d| d.as_micros() as u64);
        vec![
            ("bytes_sent", self.bytes_sent),
            ("bytes_received", self.bytes_received),
            ("handshake_us", handshake),
            ("link.ctrl_sent", l.ctrl_sent),
            ("link.ctrl_received", l.ctrl_received),
            ("link.credit_msgs", l.credit_msgs),
            ("link.writes_imm", l.writes_imm),
            ("link.reads", l.reads),
            ("link.credit_stalls", l.credit_stalls),
            ("link.keepalives", l.keepalives),
            ("link.packets", l.packets),
            ("link.packed", l.packed),
            ("link.window_in", self.window_in.into()),
            ("link.slot_size", self.slot_size as u64),
            ("message.adverts_sent", m.adverts_sent),
            ("message.immediate_sent", m.immediate_sent),
            ("message.adverts_received", m.adverts_received),
            ("message.credit_waits", m.credit_waits),
            ("message.truncated", m.truncated),
            ("message.persistent_reads", m.persistent_reads),
            ("message.persistent_writes", m.persistent_writes),
            ("stream.direct_sent", s.direct_sent),
            ("stream.direct_bytes", s.direct_bytes),
            ("stream.indirect_sent", s.indirect_sent),
            ("stream.indirect_bytes", s.indirect_bytes),
            ("stream.packed_sends", s.packed_sends),
            ("stream.adverts_sent", s.adverts_sent),
            ("stream.adverts_accepted", s.adverts_accepted),
            ("stream.adverts_rejected", s.adverts_rejected),
            ("stream.window_updates", s.window_updates),
            ("stream.space_stalls", s.space_stalls),
            ("stream.copied_bytes", s.copied_bytes),
        ]
    }
}

/// One line a group (`connection`, `link`, `message`, `stream`): `name value` pairs, the group's prefix dropped.
impl fmt::Display for ConnStats {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut group = None;
        for (name, value) in self.entries() {
            let (g, field) = name.split_once('.').unwrap_or(("connection", name));
            if group != Some(g) {
                if group.is_some() {
                    writeln!(f)?;
                }
                write!(f, "{g:<10}")?;
                group = Some(g);
            }
            write!(f, " {field} {value}")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stats_display_as_one_line_a_group_with_every_entry() {
        let mut s = ConnStats {
            bytes_sent: 12,
            handshake: Some(std::time::Duration::from_micros(340)),
            ..Default::default()
        };
        s.stream.copied_bytes = 7;
        let text = s.to_string();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 4, "{text}");
        assert!(lines[0].starts_with("connection bytes_sent 12 bytes_received 0 handshake_us 340"));
        assert!(lines[1].starts_with("link       "), "{text}");
        assert!(lines[3].ends_with("copied_bytes 7"), "{text}");
        let words: usize = lines.iter().map(|l| l.split_whitespace().count() - 1).sum();
        assert_eq!(words, 2 * s.entries().len());
    }
}

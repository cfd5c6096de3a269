//! Message mode (SOCK_SEQPACKET) on the simulated fabric: seed 002, section 3.

mod common;

use common::*;
use exs::{EventKind, SockType};

#[test]
fn one_message_arrives_intact() {
    let p = pair(SockType::SeqPacket);
    let data = pattern(1000, 1);
    let (s, r, got) = p.transfer(&data, 4096);
    assert_eq!((s.kind, s.status.clone(), s.bytes), (EventKind::Send, Ok(()), 1000));
    assert_eq!((r.kind, r.status.clone(), r.bytes), (EventKind::Recv, Ok(()), 1000));
    assert!(!r.flags.truncated);
    assert_eq!(got, data);
}

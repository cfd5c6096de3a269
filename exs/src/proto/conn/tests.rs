//! Unit tests of the connection's fault mapping.

use super::*;

/// Review finding: a length error was put on the peer for any request; it is the peer's only on a receive of
/// a control buffer (the size we announced). On a request of ours (a write beyond the device's largest
/// message) it stays the transport's.
#[test]
fn a_length_error_is_the_peers_only_on_a_receive() {
    assert!(matches!(
        Fault::of_recv(&WcError::LocalLength).into_op_error(),
        OpError::PeerMisbehaved(Violation::MessageTooLong)
    ));
    assert!(matches!(
        OpError::from(WcError::LocalLength),
        OpError::Transport(_)
    ));
    assert_eq!(
        Fault::of_recv(&WcError::RetryExceeded).into_op_error(),
        OpError::ConnectionReset
    );
}

/// A failed work request read as "invalid argument: work request failed: ..." (`InvalidInput`, `EINVAL` in C), as
/// if the caller had passed a bad argument. It is the device's failure (`Other`, `EIO`), in its own words; a
/// peer that stopped taking messages resets the connection.
#[test]
fn a_failed_work_request_is_the_devices_not_an_invalid_argument() {
    for e in [
        WcError::LocalProtection,
        WcError::LocalLength,
        WcError::Other("local QP operation error".into()),
    ] {
        let op = OpError::from(e.clone());
        assert_eq!(op.blame(), crate::Blame::Transport);
        let io = std::io::Error::from(op.clone());
        assert_eq!(io.kind(), std::io::ErrorKind::Other, "{op}");
        assert!(
            op.to_string().contains(&e.to_string()) && !op.to_string().contains("invalid argument"),
            "{op}"
        );
    }
    let rnr = Fault::of_recv(&WcError::RnrRetryExceeded).into_op_error();
    assert_eq!(rnr, OpError::ConnectionReset);
    assert_eq!(rnr.blame(), crate::Blame::Peer);
}

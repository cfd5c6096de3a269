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

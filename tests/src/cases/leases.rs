//! The transports keep the lease table true: the device never writes into memory whose lease does not let it. A
//! receive or an RDMA read into memory leased only for the device to read is refused before it is posted (a review
//! found it posted: safe code could then borrow the bytes while the device wrote them).

use exs::transport::RemoteRef;
use exs::SockType;
use exs_dma::LeaseKind;

use super::hostile::victim;
use crate::{ensure, Backend, Case, Requires};

pub fn cases() -> Vec<Case> {
    vec![Case {
        name: "a_receive_or_read_into_memory_the_device_may_only_read_is_refused",
        run: read_only_sinks_refused,
        requires: Requires::Nothing,
    }]
}

fn read_only_sinks_refused(b: &dyn Backend) -> Result<(), String> {
    let v = victim(b, SockType::SeqPacket)?;
    let (mut raw, _s) = v.accept_good()?;
    let remote = Some(RemoteRef { addr: 0, key: 0 });
    for kind in [
        LeaseKind::DeviceRead,
        LeaseKind::DeviceReadShared,
        LeaseKind::CpuRead,
        LeaseKind::CpuWrite,
    ] {
        for (what, remote) in [("receive", None), ("RDMA read", remote)] {
            match raw.post_sink_leased(kind, remote) {
                Ok(_) => return Err(format!("a {what} into memory leased {kind:?} was posted")),
                Err(e) => ensure!(
                    e.contains("device would write"),
                    "a {what} into memory leased {kind:?}: refused, but for another reason: {e}"
                ),
            }
        }
    }
    // A sink the device may write is posted as before: a receive (the read needs a real key).
    raw.post_sink_leased(LeaseKind::DeviceWrite, None)
        .map_err(|e| format!("a receive into memory leased DeviceWrite: {e}"))?;
    Ok(())
}

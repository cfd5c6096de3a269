//! Connection-management events: rdma_cm events turned into exs events, and the steps of an outgoing connection
//! they drive (route resolution, queue pair, `rdma_connect`).

use std::net::SocketAddr;
use std::ptr;

use exs_transport::{CmEvent, ConnectFailure, EndpointId, ListenerId};
use rdma_sys::*;

use crate::connection::{to_socketaddr, EpState, ReadDepths};
use crate::{VerbsTransport, RESOLVE_TIMEOUT_MS, TAG_EP, TAG_LISTENER};

/// Why `rdma_connect` failed, as the engine's reason. On iWARP the connection's TCP handshake happens inside the
/// call (siw; Chelsio's adapters report the same through an event), so a closed port or an unreachable peer shows
/// here rather than as a `REJECTED` or `UNREACHABLE` event.
fn connect_failure(err: std::io::Error) -> ConnectFailure {
    match err.raw_os_error() {
        Some(libc::ECONNREFUSED) => ConnectFailure::Refused(Vec::new()),
        Some(libc::ETIMEDOUT) => ConnectFailure::TimedOut,
        Some(libc::ENETUNREACH | libc::EHOSTUNREACH) => ConnectFailure::Unreachable,
        _ => ConnectFailure::Other(exs_transport::TransportError::os("rdma_connect", err)),
    }
}

/// The error of a `CONNECT_ERROR` event: its status is a negative errno where the kernel made the event (iWARP),
/// and -1 where librdmacm did, when it could not bring the queue pair up for the peer's answer (InfiniBand and
/// RoCE): that says no more than that (review finding: it read as `EPERM`).
fn connect_error(status: i32) -> exs_transport::TransportError {
    const CALL: &str = "rdma_connect (RDMA_CM_EVENT_CONNECT_ERROR)";
    if status == -1 {
        return exs_transport::TransportError::Os {
            call: exs_transport::CallError {
                call: CALL.into(),
                code: -1,
            },
            kind: std::io::ErrorKind::ConnectionAborted,
            message: "the connection could not be set up for the peer's answer".into(),
        };
    }
    exs_transport::TransportError::os(
        CALL,
        std::io::Error::from_raw_os_error(status.unsigned_abs() as i32),
    )
}

/// The rdma_cm events after which a connection's queue pair can carry nothing more: it goes to the error state
/// ([`VerbsTransport::flush_ep`]).
fn ends_connection(kind: rdma_cm_event_type::Type) -> bool {
    use rdma_cm_event_type::*;
    matches!(
        kind,
        RDMA_CM_EVENT_DISCONNECTED | RDMA_CM_EVENT_DEVICE_REMOVAL
    )
}

impl VerbsTransport {
    pub(crate) fn report_down(&mut self, ep: EndpointId) -> Option<CmEvent> {
        self.eps
            .get_mut(&ep)?
            .end()
            .then_some(CmEvent::Disconnected { ep })
    }

    /// A connect that failed: reported once, and not after the endpoint was reported down (review finding:
    /// `rdma_disconnect` of a connecting id puts its queue pair in error, and the peer's answer then comes as
    /// `CONNECT_ERROR`, which reached the engine after `Disconnected` and released the endpoint twice).
    fn connect_failed(&mut self, ep: EndpointId, reason: ConnectFailure) -> Option<CmEvent> {
        self.eps.get_mut(&ep)?.failed_before_up(ep, reason)
    }

    /// Handles one rdma_cm event; returns what the engine should see.
    fn on_cm_event(&mut self, ev: *mut rdma_cm_event) -> Option<CmEvent> {
        // SAFETY: `ev` came from rdma_get_cm_event and is acknowledged by our caller after this returns.
        let (kind, id, listen_id, status, data, reads) = unsafe {
            let e = &*ev;
            let conn = &e.param.conn;
            let reads = ReadDepths::of_event(conn);
            let data = if conn.private_data.is_null() || conn.private_data_len == 0 {
                Vec::new()
            } else {
                std::slice::from_raw_parts(
                    conn.private_data as *const u8,
                    conn.private_data_len as usize,
                )
                .to_vec()
            };
            (e.event, e.id, e.listen_id, e.status, data, reads)
        };
        // SAFETY: ids in events are live (acknowledgment comes later); the context is what we set.
        let tag = unsafe { (*id).context as usize };
        let ep = EndpointId((tag & 0xffff_ffff) as u32);
        use rdma_cm_event_type::*;
        match kind {
            RDMA_CM_EVENT_CONNECT_REQUEST => self.connect_request(id, listen_id, data, reads),
            _ if tag & TAG_EP == 0 => None,
            RDMA_CM_EVENT_ADDR_RESOLVED => self.addr_resolved(ep),
            RDMA_CM_EVENT_ROUTE_RESOLVED => self.route_resolved(ep),
            RDMA_CM_EVENT_ADDR_ERROR | RDMA_CM_EVENT_ROUTE_ERROR => {
                self.connect_failed(ep, ConnectFailure::Unreachable)
            }
            RDMA_CM_EVENT_UNREACHABLE => self.connect_failed(ep, ConnectFailure::TimedOut),
            RDMA_CM_EVENT_REJECTED => {
                if self.eps.get(&ep)?.state == EpState::Connected {
                    return self.report_down(ep);
                }
                self.connect_failed(ep, ConnectFailure::Refused(data))
            }
            RDMA_CM_EVENT_CONNECT_ERROR => {
                self.connect_failed(ep, ConnectFailure::Other(connect_error(status)))
            }
            RDMA_CM_EVENT_ESTABLISHED => {
                let e = self.eps.get_mut(&ep)?;
                if e.state == EpState::Down {
                    return None;
                }
                e.state = EpState::Connected;
                let active = e.active;
                let first = active && self.settings.limits.iwarp;
                if active {
                    // What the accepting side granted (rdma_cm set our queue pair's depths from it).
                    let ours = ReadDepths::offer(self.settings.read_depth);
                    self.agreed(ep, ReadDepths::accept(ours, reads), reads);
                }
                self.addresses(ep);
                if first {
                    self.send_first_message(ep);
                }
                Some(CmEvent::Established { ep, private: data })
            }
            _ if ends_connection(kind) => {
                self.flush_ep(ep);
                self.report_down(ep)
            }
            _ => None,
        }
    }

    /// Moves an endpoint's queue pair to the error state, so every request on it completes (flushed): rdma_cm
    /// does so on the side that calls `rdma_disconnect`, not on the side told of it, whose requests (shared
    /// receives it had dequeued among them) would otherwise never complete.
    pub(crate) fn flush_ep(&mut self, ep: EndpointId) {
        if let Some(e) = self.eps.get(&ep).filter(|e| !e.qp.is_null()) {
            // A failure is logged: the requests then complete as the device lets them, or at the release.
            let _ = Self::break_qp(e.qp);
        }
    }

    /// A connection request on one of our listeners (refused at once if the listener is gone).
    fn connect_request(
        &mut self,
        id: *mut rdma_cm_id,
        listen_id: *mut rdma_cm_id,
        private: Vec<u8>,
        reads: ReadDepths,
    ) -> Option<CmEvent> {
        // SAFETY: the listener's id is live; its context is the listener tag.
        let ltag = unsafe { (*listen_id).context as usize };
        let listener = ListenerId((ltag & 0xffff_ffff) as u32);
        if ltag & TAG_LISTENER == 0 || !self.listeners.contains_key(&listener) {
            // A request nobody will answer: the peer is refused and the id goes (a connection request counts as an
            // event of its listener, so destroying the new id before the event is acknowledged does not wait for
            // it).
            Self::reject_id(id);
            return None;
        }
        // The request's read depths are kept for the accept (see `accept_request`).
        let request = self.requests.insert(listener, (id, reads));
        // SAFETY: live id.
        let peer = to_socketaddr(unsafe { rdma_get_peer_addr(&*id) } as *const _)
            .unwrap_or_else(|| SocketAddr::from(([0, 0, 0, 0], 0)));
        Some(CmEvent::ConnectRequest {
            listener,
            request,
            peer,
            private,
        })
    }

    /// The address of an outgoing connection is resolved: the route next.
    fn addr_resolved(&mut self, ep: EndpointId) -> Option<CmEvent> {
        let e = self.eps.get(&ep)?;
        // Disconnected while resolving (a connect timeout, a close): `Disconnected` was reported, so the connect
        // goes no further.
        if e.state == EpState::Down {
            return None;
        }
        // SAFETY: live id with a resolved address.
        if unsafe { rdma_resolve_route(e.id, RESOLVE_TIMEOUT_MS) } != 0 {
            let why = exs_transport::TransportError::os(
                "rdma_resolve_route",
                std::io::Error::last_os_error(),
            );
            return self.connect_failed(ep, ConnectFailure::Other(why));
        }
        None
    }

    /// The route of an outgoing connection is resolved: its queue pair, then `rdma_connect`.
    fn route_resolved(&mut self, ep: EndpointId) -> Option<CmEvent> {
        if self.eps.get(&ep)?.state == EpState::Down {
            return None;
        }
        let (private, recvs) = self.eps.get_mut(&ep)?.pending.take()?;
        if let Err(err) = self.create_qp(ep, recvs) {
            return self.connect_failed(ep, ConnectFailure::Other(err));
        }
        let e = self.eps.get_mut(&ep)?;
        e.state = EpState::Connecting;
        let depths = ReadDepths::offer(self.settings.read_depth);
        let mut param = Self::conn_param(&private, depths, self.settings.rnr_retry);
        // SAFETY: live id with a QP; private data lives across the call (copied by rdma_connect).
        if unsafe { rdma_connect(e.id, &mut param) } != 0 {
            let err = std::io::Error::last_os_error();
            return self.connect_failed(ep, connect_failure(err));
        }
        None
    }

    /// [`Transport::poll_cm`](exs_transport::Transport::poll_cm): the backlog first, then rdma_cm events (each
    /// acknowledged once).
    pub(crate) fn next_cm_event(&mut self) -> Option<CmEvent> {
        loop {
            if let Some(ev) = self.cm_backlog.pop_front() {
                return Some(ev);
            }
            let mut ev = ptr::null_mut();
            // SAFETY: non-blocking channel; on success `ev` is a live event we acknowledge below.
            if unsafe { rdma_get_cm_event(self.ch, &mut ev) } != 0 {
                return None;
            }
            let out = self.on_cm_event(ev);
            // SAFETY: every event is acknowledged exactly once.
            unsafe { rdma_ack_cm_event(ev) };
            if let Some(o) = out {
                return Some(o);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The events `on_cm_event` answers with `flush_ep` (the flush itself needs a device).
    #[test]
    fn a_disconnection_or_a_device_removal_is_what_flushes_a_queue_pair() {
        use rdma_cm_event_type::*;
        assert!(ends_connection(RDMA_CM_EVENT_DISCONNECTED));
        assert!(ends_connection(RDMA_CM_EVENT_DEVICE_REMOVAL));
        assert!(!ends_connection(RDMA_CM_EVENT_ESTABLISHED));
        assert!(!ends_connection(RDMA_CM_EVENT_ROUTE_RESOLVED));
    }

    /// Review finding: a connect that failed after its endpoint was reported down (`rdma_disconnect` of a
    /// connecting id, then the peer's answer as `CONNECT_ERROR`) was reported too, and the engine released the
    /// endpoint twice. Both reports take the endpoint's one end.
    #[test]
    fn an_endpoint_ends_once_whichever_report_comes_first() {
        let ep = EndpointId(3);
        let mut e = VerbsTransport::new_ep(std::ptr::null_mut());
        e.active = true;
        assert!(e.end(), "the first report: Disconnected");
        assert_eq!(e.failed_before_up(ep, ConnectFailure::TimedOut), None);
        assert_eq!(e.state, EpState::Down);
        let mut e = VerbsTransport::new_ep(std::ptr::null_mut());
        e.active = true;
        assert_eq!(
            e.failed_before_up(ep, ConnectFailure::TimedOut),
            Some(CmEvent::ConnectFailed {
                ep,
                reason: ConnectFailure::TimedOut
            })
        );
        assert!(!e.end(), "Disconnected after the connect failed");
    }

    /// Review finding: an accepted endpoint that failed before it was established (`REJECTED`, `UNREACHABLE` or
    /// `CONNECT_ERROR` on the passive side) was reported as a failed connect.
    #[test]
    fn an_accepted_endpoint_that_fails_before_it_is_up_is_reported_down() {
        let ep = EndpointId(4);
        let mut e = VerbsTransport::new_ep(std::ptr::null_mut());
        assert_eq!(
            e.failed_before_up(ep, ConnectFailure::TimedOut),
            Some(CmEvent::Disconnected { ep })
        );
    }

    /// Review finding: librdmacm's own `CONNECT_ERROR` (status -1: it could not bring the queue pair up for the
    /// peer's answer) read as `EPERM`; the kernel's carry a negative errno.
    #[test]
    fn a_connect_error_says_what_its_status_can() {
        use std::error::Error;
        let e = connect_error(-1);
        assert_eq!(e.io_kind(), std::io::ErrorKind::ConnectionAborted);
        assert!(!e.to_string().contains("not permitted"), "{e}");
        let e = connect_error(-libc::ETIMEDOUT);
        assert_eq!(e.io_kind(), std::io::ErrorKind::TimedOut);
        assert_eq!(
            e.source().map(|s| s.to_string()).as_deref(),
            Some("rdma_connect (RDMA_CM_EVENT_CONNECT_ERROR) returned 110")
        );
    }
}

//! Connection-management events: the event queue read into exs events (connection requests, established
//! connections, failed connects, connections down).

use std::ffi::c_void;
use std::net::SocketAddr;
use std::ptr;

use exs_transport::{CmEvent, ConnectFailure, EndpointId, ListenerId};

use crate::call::Info;
use crate::connection::EpState;
use crate::ffi::*;
use crate::FabricTransport;

const CM_ENTRY_LEN: usize = std::mem::size_of::<fi_eq_cm_entry>();
const MAX_CM_DATA: usize = 256;

/// Room for one cm entry and its private data, aligned for `fi_eq_cm_entry`.
#[repr(C, align(8))]
struct CmBuf([u8; CM_ENTRY_LEN + MAX_CM_DATA]);

/// What one read of the event queue found.
enum EqRead {
    /// An error entry (a failed connect, a connection down).
    Error(fi_eq_err_entry),
    /// A cm entry of `len` bytes.
    Entry { event: u32, len: usize },
}

/// Why a connect failed, from the error of its event-queue entry.
fn connect_failure(err: i32) -> ConnectFailure {
    match err as u32 {
        FI_ECONNREFUSED => ConnectFailure::Refused(Vec::new()),
        FI_ETIMEDOUT => ConnectFailure::TimedOut,
        113 | 101 => ConnectFailure::Unreachable, // EHOSTUNREACH, ENETUNREACH
        // ENOPROTOOPT, EPROTO, EIO, EINPROGRESS, ECONNRESET: the TCP connection was made, but the tcp provider's
        // handshake met bytes it does not parse, or a close or reset instead of its answer (which of these depends
        // on when the close lands).
        92 | 71 | 5 | 115 | 104 => ConnectFailure::NotAPeer(strerror(err.into())),
        _ => ConnectFailure::Other(crate::call::err("fi_connect", -i64::from(err))),
    }
}

impl FabricTransport {
    pub(crate) fn report_down(&mut self, id: EndpointId) -> Option<CmEvent> {
        let e = self.eps.get_mut(&id)?;
        e.state = EpState::Down;
        if e.reported_down {
            return None;
        }
        e.reported_down = true;
        Some(CmEvent::Disconnected { ep: id })
    }

    /// The next connection-management event from the event queue, skipping entries that are not one (errors on a
    /// listener, events for endpoints already gone or already reported); `None` once the queue is empty.
    pub(crate) fn read_eq(&mut self) -> Option<CmEvent> {
        let mut buf = CmBuf([0; CM_ENTRY_LEN + MAX_CM_DATA]);
        loop {
            let ev = match self.read_eq_entry(&mut buf)? {
                EqRead::Error(ee) => self.on_eq_error(&ee),
                EqRead::Entry { event, len } => self.on_cm_entry(event, &buf, len),
            };
            if ev.is_some() {
                return ev;
            }
        }
    }

    /// Reads one entry (or one error entry) into `buf`; `None` when the queue is empty or cannot be read.
    fn read_eq_entry(&self, buf: &mut CmBuf) -> Option<EqRead> {
        let mut event: u32 = 0;
        // SAFETY: open event queue; `buf` is aligned for fi_eq_cm_entry and long enough for private data.
        let ret = unsafe {
            exs_fi_eq_read(
                self.eq,
                &mut event,
                buf.0.as_mut_ptr() as *mut c_void,
                buf.0.len(),
                0,
            )
        };
        if ret == -(FI_EAGAIN as isize) {
            return None;
        }
        if ret == -(FI_EAVAIL as isize) {
            let mut ee = fi_eq_err_entry::default();
            // SAFETY: an error entry is available.
            if unsafe { exs_fi_eq_readerr(self.eq, &mut ee, 0) } <= 0 {
                return None;
            }
            return Some(EqRead::Error(ee));
        }
        if ret < 0 {
            tracing::error!("fi_eq_read: {}", strerror(ret as i64));
            return None;
        }
        Some(EqRead::Entry {
            event,
            len: ret as usize,
        })
    }

    /// An error entry: a connect that failed (with its reason), or an endpoint that went down.
    pub(crate) fn on_eq_error(&mut self, ee: &fi_eq_err_entry) -> Option<CmEvent> {
        let Some(id) = self.endpoint_of(ee.fid) else {
            if self.listener_of(ee.fid).is_some() {
                tracing::warn!(
                    err = ee.err,
                    "event queue error on a listener: {}",
                    strerror(ee.err.into())
                );
            } else {
                tracing::debug!(
                    err = ee.err,
                    "event queue error of no open endpoint: ignored"
                );
            }
            return None;
        };
        let e = self.eps.get_mut(&id)?;
        if e.state != EpState::Connecting {
            return self.report_down(id);
        }
        e.state = EpState::Down;
        e.reported_down = true;
        let reason = connect_failure(ee.err);
        tracing::debug!(
            ?id,
            err = ee.err,
            ?reason,
            "fi_connect failed: {}",
            strerror(ee.err.into())
        );
        Some(CmEvent::ConnectFailed { ep: id, reason })
    }

    /// A connection-management entry of `len` bytes in `buf` (header, then private data).
    fn on_cm_entry(&mut self, event: u32, buf: &CmBuf, len: usize) -> Option<CmEvent> {
        // SAFETY: the provider wrote a cm entry (header plus `len - CM_ENTRY_LEN` bytes of data) into `buf`.
        let entry = unsafe { &*(buf.0.as_ptr() as *const fi_eq_cm_entry) };
        let data = buf.0[CM_ENTRY_LEN.min(len)..len.min(buf.0.len())].to_vec();
        if event == FI_CONNREQ {
            // A request names its passive endpoint, which may be closed already (see `on_connect_request`): it
            // is found by address among the open ones, never read through the pointer.
            let listener = self.listener_of(entry.fid);
            return self.on_connect_request(listener, Info(entry.info), data);
        }
        // Found by address among the open endpoints, never read through: the entry may name one closed since.
        let id = self.endpoint_of(entry.fid);
        match event {
            FI_CONNECTED => {
                let id = id?;
                let e = self.eps.get_mut(&id)?;
                if !matches!(e.state, EpState::Connecting | EpState::Accepting) {
                    return None;
                }
                e.state = EpState::Connected;
                self.addresses(id);
                // Its socket has joined its queue's wait set: the queue is armed (and its entries in the epoll set
                // brought up to date) anew before it can go quiet.
                self.touch(id);
                Some(CmEvent::Established {
                    ep: id,
                    private: data,
                })
            }
            FI_SHUTDOWN => self.report_down(id?),
            other => {
                tracing::debug!(event = other, "ignored event-queue event");
                None
            }
        }
    }

    /// The open endpoint whose fid is `f` (by address only).
    fn endpoint_of(&self, f: *mut fid) -> Option<EndpointId> {
        self.ep_fids.get(&(f as usize)).copied()
    }

    /// The open listener whose passive endpoint is `f` (compared by address only: `f` may name one that is
    /// closed and freed). A request of a closed listener whose freed passive endpoint's address went to a new
    /// one is taken for the new one's: the engine accepts or refuses it as that listener's.
    fn listener_of(&self, f: *mut fid) -> Option<ListenerId> {
        self.listeners
            .iter()
            // SAFETY: `pep` is an open passive endpoint of ours; only the address of its fid is taken.
            .find(|(_, &pep)| unsafe { ptr::addr_of_mut!((*pep).fid) } == f)
            .map(|(&id, _)| id)
    }

    /// A connection request on `listener`: kept until accepted or rejected.
    ///
    /// A request of no open listener comes when libfabric's tcp provider (1.17) finished a handshake it took
    /// in before its listener closed (`settle_requests` in `connection` makes that rare): it names the freed
    /// passive endpoint, which has no reject to answer it. Its information goes; its connection stays open with
    /// nobody to answer it (the peer's connect times out).
    fn on_connect_request(
        &mut self,
        listener: Option<ListenerId>,
        info: Info,
        private: Vec<u8>,
    ) -> Option<CmEvent> {
        let Some(listener) = listener else {
            tracing::warn!(
                "a connection request for a listener that is closed; its connection cannot be refused"
            );
            return None;
        };
        let peer = info.peer();
        let request = self.requests.insert(listener, info);
        let peer = peer.unwrap_or_else(|| SocketAddr::from(([0, 0, 0, 0], 0)));
        Some(CmEvent::ConnectRequest {
            listener,
            request,
            peer,
            private,
        })
    }

    /// [`Transport::poll_cm`](exs_transport::Transport::poll_cm): the backlog first, then the event queue.
    pub(crate) fn next_cm_event(&mut self) -> Option<CmEvent> {
        if let Some(ev) = self.cm_backlog.pop_front() {
            return Some(ev);
        }
        self.read_eq()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::FabricConfig;

    /// An address no object of ours has (nor anything else: reading through it faults).
    const GONE: *mut fid = 0x10 as *mut fid;

    /// Event-queue entries naming an endpoint closed since were read through (its fid's context): with libfabric
    /// 1.17's tcp provider a closed endpoint's entries leave the queue with it, but error entries of a closed
    /// listener, or a provider that keeps them, would have had us read freed memory. Entries are matched by
    /// address against the open endpoints now, and one naming none is ignored.
    #[test]
    fn an_entry_naming_no_open_endpoint_is_ignored_without_reading_through_it() {
        let _serial = crate::tests::serial();
        let mut t = FabricTransport::open(&FabricConfig::default()).expect("open tcp");
        let mut buf = CmBuf([0; CM_ENTRY_LEN + MAX_CM_DATA]);
        let entry = fi_eq_cm_entry {
            fid: GONE,
            ..Default::default()
        };
        // SAFETY: `buf` is aligned for and longer than a cm entry.
        unsafe { std::ptr::write(buf.0.as_mut_ptr().cast::<fi_eq_cm_entry>(), entry) };
        for event in [FI_CONNECTED, FI_SHUTDOWN] {
            assert_eq!(t.on_cm_entry(event, &buf, CM_ENTRY_LEN), None);
        }
        let ee = fi_eq_err_entry {
            fid: GONE,
            err: FI_ECONNREFUSED as i32,
            ..Default::default()
        };
        assert_eq!(t.on_eq_error(&ee), None);
    }

    /// Review finding: an accepted endpoint whose handshake failed before `FI_CONNECTED` (its peer reset it) was
    /// reported as a failed connect, where the transport's `accept` ends with `Established` or `Disconnected`.
    #[test]
    fn an_accepted_connection_that_fails_before_it_is_up_is_reported_down() {
        use exs_transport::Transport;
        use std::time::{Duration, Instant};
        let _serial = crate::tests::serial();
        let cfg = FabricConfig::default();
        let mut server = FabricTransport::open(&cfg).expect("open tcp");
        let mut client = FabricTransport::open(&cfg).expect("open tcp");
        let any = "127.0.0.1:0".parse().expect("address");
        let (_listener, addr) = server.listen(any, 16).expect("listen");
        client
            .connect(EndpointId(1), addr, b"hello", Vec::new())
            .expect("connect");
        let deadline = Instant::now() + Duration::from_secs(20);
        let request = loop {
            assert!(Instant::now() < deadline, "no connection request came");
            client.poll_cm();
            match server.poll_cm() {
                Some(CmEvent::ConnectRequest { request, .. }) => break request,
                Some(other) => panic!("server event {other:?}"),
                None => std::thread::sleep(Duration::from_millis(1)),
            }
        };
        let ep = EndpointId(7);
        server
            .accept(request, ep, b"welcome", Vec::new())
            .expect("accept");
        // What the provider queues when the peer resets the connection before it is up.
        let ee = fi_eq_err_entry {
            fid: crate::connection::fid_addr(server.eps[&ep].ep) as *mut fid,
            err: 104, // ECONNRESET
            ..Default::default()
        };
        assert_eq!(server.on_eq_error(&ee), Some(CmEvent::Disconnected { ep }));
        assert_eq!(server.on_eq_error(&ee), None, "reported twice");
    }

    /// Review finding: a connect that failed in a way with no name of its own kept only the provider's words,
    /// and the engine reported them as an invalid argument; the call and its code now come with it.
    #[test]
    fn a_connect_failure_of_no_known_kind_keeps_the_call_and_its_code() {
        use std::error::Error;
        match connect_failure(90) {
            ConnectFailure::Other(e) => {
                assert_eq!(e.to_string(), "message too long");
                assert_eq!(
                    e.source().map(|s| s.to_string()).as_deref(),
                    Some("fi_connect returned -90")
                );
            }
            other => panic!("{other:?}"),
        }
    }

    /// Listening where no interface of the provider's carries the address reads as that, with the call and code.
    #[test]
    fn listening_on_an_address_of_no_interface_here_says_so() {
        use exs_transport::Transport;
        let _serial = crate::tests::serial();
        let mut t = FabricTransport::open(&FabricConfig::default()).expect("open tcp");
        // TEST-NET-1 (RFC 5737): no interface of this machine's; nothing is sent, it is only looked up and bound.
        let addr = "192.0.2.1:0".parse().expect("address");
        match t.listen(addr, 16) {
            Err(exs_transport::TransportError::AddrNotAvailable(why)) => {
                assert!(why.contains("192.0.2.1"), "{why}")
            }
            Err(e) => panic!("{e:?}"),
            Ok(_) => panic!("listening on 192.0.2.1 was accepted"),
        }
    }
}

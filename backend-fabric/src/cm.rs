//! Connection-management events: the event queue read into exs events (connection requests, established
//! connections, failed connects, connections down).

use std::ffi::c_void;
use std::net::SocketAddr;

use exs_transport::{CmEvent, ConnectFailure, EndpointId, ListenerId};

use crate::call::Info;
use crate::connection::EpState;
use crate::ffi::*;
use crate::{sockaddr, FabricTransport, TAG_EP, TAG_LISTENER};

const CM_ENTRY_LEN: usize = std::mem::size_of::<fi_eq_cm_entry>();
const MAX_CM_DATA: usize = 256;

fn context_of(f: *mut fid) -> usize {
    if f.is_null() {
        return 0;
    }
    // SAFETY: event-queue entries name a fid of one of our objects, whose context we set at creation.
    unsafe { (*f).context as usize }
}

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
        _ => ConnectFailure::Other(strerror(err.into())),
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
    fn on_eq_error(&mut self, ee: &fi_eq_err_entry) -> Option<CmEvent> {
        let tag = context_of(ee.fid);
        if tag & TAG_EP == 0 {
            tracing::warn!(
                err = ee.err,
                "event queue error on a listener: {}",
                strerror(ee.err.into())
            );
            return None;
        }
        let id = EndpointId((tag & 0xffff_ffff) as u32);
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
        let tag = context_of(entry.fid);
        match event {
            FI_CONNREQ => self.on_connect_request(tag, Info(entry.info), data),
            FI_CONNECTED => {
                let id = EndpointId((tag & 0xffff_ffff) as u32);
                let e = self.eps.get_mut(&id)?;
                if e.state != EpState::Connecting {
                    return None;
                }
                e.state = EpState::Connected;
                self.addresses(id);
                Some(CmEvent::Established {
                    ep: id,
                    private: data,
                })
            }
            FI_SHUTDOWN => self.report_down(EndpointId((tag & 0xffff_ffff) as u32)),
            other => {
                tracing::debug!(event = other, "ignored event-queue event");
                None
            }
        }
    }

    /// A connection request on the listener `tag` names: kept until accepted or rejected.
    fn on_connect_request(&mut self, tag: usize, info: Info, private: Vec<u8>) -> Option<CmEvent> {
        let listener = ListenerId((tag & 0xffff_ffff) as u32);
        if tag & TAG_LISTENER == 0 || !self.listeners.contains_key(&listener) {
            // Not reached: a listener is closed only after its requests waiting in this queue were read
            // and rejected (`close_listener`), and fi_reject needs the passive endpoint that received
            // the request. The info goes (fi_freeinfo, once, by `Info`); its connection handle cannot.
            tracing::error!(
                tag,
                "connection request for a listener that is not open; its connection handle leaks"
            );
            return None;
        }
        // SAFETY: `info.0` is the live fi_info of this request; its address, when the provider gives
        // one (not null), is `dest_addrlen` readable bytes owned by the info.
        let peer = unsafe {
            let i = &*info.0;
            if i.dest_addr.is_null() {
                None
            } else {
                sockaddr::decode(std::slice::from_raw_parts(
                    i.dest_addr as *const u8,
                    i.dest_addrlen,
                ))
            }
        };
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

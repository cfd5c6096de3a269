//! Connection-management events: the event queue read into exs events (connection requests, established
//! connections, failed connects, connections down).

use std::ffi::c_void;
use std::net::SocketAddr;

use exs_transport::{CmEvent, ConnectFailure, EndpointId, ListenerId};

use crate::connection::EpState;
use crate::device::Info;
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

    pub(crate) fn read_eq(&mut self) -> Option<CmEvent> {
        #[repr(C, align(8))]
        struct Buf([u8; CM_ENTRY_LEN + MAX_CM_DATA]);
        let mut buf = Buf([0; CM_ENTRY_LEN + MAX_CM_DATA]);
        loop {
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
                let tag = context_of(ee.fid);
                if tag & TAG_EP == 0 {
                    tracing::warn!(
                        err = ee.err,
                        "event queue error on a listener: {}",
                        strerror(ee.err.into())
                    );
                    continue;
                }
                let id = EndpointId((tag & 0xffff_ffff) as u32);
                let Some(e) = self.eps.get(&id) else { continue };
                if e.state == EpState::Connecting {
                    let reason = match ee.err as u32 {
                        FI_ECONNREFUSED => ConnectFailure::Refused(Vec::new()),
                        FI_ETIMEDOUT => ConnectFailure::TimedOut,
                        113 | 101 => ConnectFailure::Unreachable, // EHOSTUNREACH, ENETUNREACH
                        // ENOPROTOOPT, EPROTO, EIO: the tcp provider's handshake met bytes it does not parse, or
                        // a close instead of its answer.
                        92 | 71 | 5 => ConnectFailure::NotAPeer(strerror(ee.err.into())),
                        _ => ConnectFailure::Other(strerror(ee.err.into())),
                    };
                    tracing::debug!(
                        ?id,
                        err = ee.err,
                        ?reason,
                        "fi_connect failed: {}",
                        strerror(ee.err.into())
                    );
                    if let Some(e) = self.eps.get_mut(&id) {
                        e.state = EpState::Down;
                        e.reported_down = true;
                    }
                    return Some(CmEvent::ConnectFailed { ep: id, reason });
                }
                match self.report_down(id) {
                    Some(ev) => return Some(ev),
                    None => continue,
                }
            }
            if ret < 0 {
                tracing::error!("fi_eq_read: {}", strerror(ret as i64));
                return None;
            }
            let len = ret as usize;
            // SAFETY: the provider wrote a cm entry (header plus `len - CM_ENTRY_LEN` bytes of data) into `buf`.
            let entry = unsafe { &*(buf.0.as_ptr() as *const fi_eq_cm_entry) };
            let data = buf.0[CM_ENTRY_LEN.min(len)..len.min(buf.0.len())].to_vec();
            let tag = context_of(entry.fid);
            match event {
                FI_CONNREQ => {
                    let info = Info(entry.info);
                    let listener = ListenerId((tag & 0xffff_ffff) as u32);
                    if tag & TAG_LISTENER == 0 || !self.listeners.contains_key(&listener) {
                        // Not reached: a listener is closed only after its requests waiting in this queue were read
                        // and rejected (`close_listener`), and fi_reject needs the passive endpoint that received
                        // the request. The info goes (fi_freeinfo, once, by `Info`); its connection handle cannot.
                        tracing::error!(
                            tag,
                            "connection request for a listener that is not open; its connection handle leaks"
                        );
                        continue;
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
                    return Some(CmEvent::ConnectRequest {
                        listener,
                        request,
                        peer,
                        private: data,
                    });
                }
                FI_CONNECTED => {
                    let id = EndpointId((tag & 0xffff_ffff) as u32);
                    let Some(e) = self.eps.get_mut(&id) else {
                        continue;
                    };
                    if e.state != EpState::Connecting {
                        continue;
                    }
                    e.state = EpState::Connected;
                    self.addresses(id);
                    return Some(CmEvent::Established {
                        ep: id,
                        private: data,
                    });
                }
                FI_SHUTDOWN => {
                    let id = EndpointId((tag & 0xffff_ffff) as u32);
                    if let Some(ev) = self.report_down(id) {
                        return Some(ev);
                    }
                }
                other => tracing::debug!(event = other, "ignored event-queue event"),
            }
        }
    }

    /// [`Transport::poll_cm`](exs_transport::Transport::poll_cm): the backlog first, then the event queue.
    pub(crate) fn next_cm_event(&mut self) -> Option<CmEvent> {
        if let Some(ev) = self.cm_backlog.pop_front() {
            return Some(ev);
        }
        self.read_eq()
    }
}

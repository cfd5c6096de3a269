//! Registering and exposing memory on the data path (the rules are in [`crate::memory`]): a base registration, and
//! an exposure as a memory window bound through the connection's send queue or as a registration of the range.

use std::sync::Arc;

use exs_dma::Lease;
use exs_transport::{
    EndpointId, Exposure, KeyedLease, Registration, RemoteAccess, RemoteRef, TransportError,
};
use rdma_sys::*;

use crate::connection::EpState;
use crate::memory::{
    reg_mr, BindHold, MrKey, MwSlot, VerbsRegistrar, VerbsRegistration, WindowKey,
};
use crate::{os_err, VerbsTransport};

impl VerbsTransport {
    /// Binds a type 2 memory window over the leased range to `ep`'s queue pair (see [`memory`](crate::memory)).
    /// The bind is a send-queue request, so it executes before anything posted after it, in particular the message
    /// that hands the key to the peer. It is signalled, and its record holds the window and the registration until
    /// it retires: an exposure dropped before that (a cancelled operation) leaves the window to the record.
    fn bind_window(
        &mut self,
        ep: EndpointId,
        reg: &Arc<dyn Registration>,
        lease: Lease,
        access: RemoteAccess,
    ) -> Result<Box<dyn Exposure>, TransportError> {
        let base = reg
            .as_any()
            .downcast_ref::<VerbsRegistration>()
            .ok_or_else(|| TransportError::Invalid("not a registration of this device".into()))?;
        let mr = base.mr;
        self.room_for_bind(ep)?;
        // SAFETY: open protection domain.
        let mw = unsafe { ibv_alloc_mw(self.pd.0, ibv_mw_type::IBV_MW_TYPE_2) }
            .filter(|m| !m.is_null())
            .ok_or_else(|| os_err("ibv_alloc_mw"))?;
        // From here the slot deallocates the window, whatever happens.
        let slot = MwSlot::new(mw);
        let info = ibv_mw_bind_info {
            mr,
            addr: lease.addr(),
            length: lease.len() as u64,
            mw_access_flags: remote_flags(access),
        };
        let hold = BindHold {
            _slot: Arc::clone(&slot),
            _reg: Arc::clone(reg),
        };
        let rkey = self.post_bind(ep, mw, info, hold)?;
        let e = self.eps.get_mut(&ep).ok_or(TransportError::NoEndpoint)?;
        if e.windows.len() >= 64 {
            e.windows.retain(|w| w.strong_count() > 0);
        }
        e.windows.push(Arc::downgrade(&slot));
        let remote = RemoteRef {
            addr: lease.addr(),
            key: u64::from(rkey),
        };
        let key = WindowKey {
            slot,
            _reg: Arc::clone(reg),
            _pd: Arc::clone(&self.pd),
        };
        Ok(Box::new(KeyedLease::new(remote, lease, key)))
    }

    /// A window binds only on a connected queue pair with a free send-queue entry (completions waiting in the
    /// completion queue free entries).
    fn room_for_bind(&mut self, ep: EndpointId) -> Result<(), TransportError> {
        let e = self.eps.get(&ep).ok_or(TransportError::NoEndpoint)?;
        if e.qp.is_null() || e.state != EpState::Connected {
            return Err(TransportError::Invalid(
                "a memory window binds to a connected queue pair".into(),
            ));
        }
        if e.sends.entries() >= e.sq_cap {
            self.drain_cq();
        }
        let e = self.eps.get(&ep).ok_or(TransportError::NoEndpoint)?;
        if e.sends.entries() >= e.sq_cap {
            return Err(crate::post::queue_full());
        }
        Ok(())
    }

    /// Posts the bind of `mw` over `info` on `ep`'s queue pair and records it, with `hold`; returns the window's
    /// new key.
    fn post_bind(
        &mut self,
        ep: EndpointId,
        mw: *mut ibv_mw,
        info: ibv_mw_bind_info,
        hold: BindHold,
    ) -> Result<u32, TransportError> {
        // SAFETY: `mw` is a live window (`hold` keeps it); the key's low byte moves on with each bind so a stale
        // key fails.
        let rkey = unsafe { ibv_inc_rkey((*mw).rkey) };
        let fill = |w: &mut ibv_send_wr| {
            w.opcode = ibv_wr_opcode::IBV_WR_BIND_MW;
            w.bind_mw_tso_union.bind_mw = bind_mw_t {
                mw,
                rkey,
                bind_info: info,
            };
        };
        // SAFETY: the request names the window and the registration it binds over. `hold` keeps the registration
        // (and with it the buffer of the range) in the request's record until the request retires: its completion,
        // a later one, or the release of its endpoint, which drops the record only after destroying the queue pair.
        // The window is deallocated before the record goes only by that release (`revoke_on_release`), and only
        // once `ibv_modify_qp` has moved the queue pair to the error state, where a queued bind is flushed and
        // never executed; when that move failed, a window whose bind is queued is left to the record. The
        // exposure's lease outlives the window: it is parked on the window when the exposure goes first
        // (`WindowKey::end`).
        unsafe { self.post_own_send(ep, "ibv_post_send (window bind)", fill, Some(hold)) }?;
        Ok(rkey)
    }

    /// [`Transport::register`](exs_transport::Transport::register) and
    /// [`Transport::registrar`](exs_transport::Transport::registrar): registrations need the protection domain
    /// and whether windows are used, nothing else of the transport.
    pub(crate) fn registrar(&self) -> VerbsRegistrar {
        VerbsRegistrar {
            pd: Arc::clone(&self.pd),
            memory_windows: self.settings.memory_windows,
        }
    }

    /// [`Transport::expose`](exs_transport::Transport::expose): a window bound to the endpoint's queue pair, or a
    /// registration of exactly the range.
    pub(crate) fn expose_lease(
        &mut self,
        ep: EndpointId,
        reg: &Arc<dyn Registration>,
        lease: Lease,
        access: RemoteAccess,
    ) -> Result<Box<dyn Exposure>, TransportError> {
        exs_transport::check_exposure(reg, &lease, access)?;
        if self.settings.memory_windows {
            return self.bind_window(ep, reg, lease, access);
        }
        let remote = remote_flags(access);
        let mr = reg_mr(
            &self.pd,
            lease.addr(),
            lease.len(),
            ibv_access_flags::IBV_ACCESS_LOCAL_WRITE.0 | remote,
        )?;
        // SAFETY: live MR.
        let rkey = unsafe { (*mr).rkey };
        let remote = RemoteRef {
            addr: lease.addr(),
            key: u64::from(rkey),
        };
        Ok(Box::new(KeyedLease::new(
            remote,
            lease,
            MrKey::new(mr, &self.pd),
        )))
    }
}

/// The verbs access flag that grants a peer `access`.
fn remote_flags(access: RemoteAccess) -> u32 {
    match access {
        RemoteAccess::Read => ibv_access_flags::IBV_ACCESS_REMOTE_READ.0,
        RemoteAccess::Write => ibv_access_flags::IBV_ACCESS_REMOTE_WRITE.0,
    }
}

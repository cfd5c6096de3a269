//! How memory is exposed to peers: the per-operation default, and the trusted-peer policy of UNH-EXS.
//!
//! **Per operation** ([`ExposurePolicy::PerOperation`], the default): each send in flight and each advertised
//! receive gets a key of its own, naming exactly its range, bound to the one connection it is handed to and revoked
//! when the operation ends (a memory-window bind, or a key-table entry, per operation: `Transport::expose`).
//!
//! **Trusted peers** ([`ExposurePolicy::TrustedPeers`]): the UNH-EXS model (the UNH-EXS paper, section 4:
//! `exs_mregister` registers once and the registration's key is what peers use). The first operation on a region over a
//! connection exposes the *whole* region to that connection (one key per region, connection and access) and the key
//! stays valid until the connection goes or the region is deregistered; every later operation hands out the same key
//! with its own address, and costs no transport call. The key still works on that connection only where the backend
//! binds keys to connections. What is given up: between operations, and outside the ranges the protocol hands out, the
//! peer *can* read (and, for regions used to receive, write) any byte of the region; the application trusts it not to.
//! The per-operation leases are still taken, so exs's own accesses keep their rules.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use exs_dma::{DmaBuf, Lease, LeaseKind};

use crate::transport::{
    EndpointId, Exposure, KeyedLease, Registration, RemoteAccess, RemoteRef, Revoke, Transport,
    TransportError,
};

/// How a context exposes memory to its peers ([`crate::ContextOptions::exposure`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum ExposurePolicy {
    /// A key per operation, for exactly its range, revoked when it ends (the default).
    #[default]
    PerOperation,
    /// UNH-EXS's model for peers that trust each other: one key per region and connection, for the whole region,
    /// valid until the connection goes or the region is deregistered. Cheaper per operation; a peer can reach every
    /// byte of a region it was once given a key to (see the module documentation).
    TrustedPeers,
}

impl ExposurePolicy {
    /// The policy `EXS_EXPOSURE` names: `per-operation` (or unset) or `trusted`.
    pub fn from_env() -> Result<Self, TransportError> {
        match std::env::var("EXS_EXPOSURE") {
            Err(std::env::VarError::NotPresent) => Ok(Self::PerOperation),
            Err(std::env::VarError::NotUnicode(v)) => Err(TransportError::Invalid(format!(
                "exposure policy {v:?} (EXS_EXPOSURE: per-operation or trusted)"
            ))),
            Ok(v) => v.parse(),
        }
    }
}

impl std::str::FromStr for ExposurePolicy {
    type Err = TransportError;

    /// `per-operation` or `trusted`, in any case, around spaces ignored; empty means the default.
    fn from_str(s: &str) -> Result<Self, TransportError> {
        match s.trim().to_ascii_lowercase().as_str() {
            "per-operation" | "" => Ok(Self::PerOperation),
            "trusted" => Ok(Self::TrustedPeers),
            other => Err(TransportError::Invalid(format!(
                "exposure policy {other:?} (EXS_EXPOSURE: per-operation or trusted)"
            ))),
        }
    }
}

/// One whole-region key of the trusted policy. `None` once revoked (region deregistered, connection gone).
#[derive(Debug)]
struct Whole {
    exposure: Mutex<Option<Box<dyn Exposure>>>,
}

/// What keeps a whole-region key alive while an operation uses it: nothing to revoke per operation.
#[derive(Debug)]
struct Borrowed(#[allow(dead_code)] Arc<Whole>);

impl Revoke for Borrowed {
    fn revoke(&mut self) {}
}

/// A whole-region key: the key, what the peer addresses with it, and the address of the region's first byte.
#[derive(Debug)]
struct Entry {
    whole: Arc<Whole>,
    remote: RemoteRef,
    base: u64,
}

/// Why an operation's range was not exposed.
#[derive(Debug)]
pub(crate) enum ExposeError {
    /// The trusted policy's key for the whole region was refused: a borrow of the region's bytes
    /// (`MemoryRegion::with_slice`) is in progress. The caller's, as any other busy buffer.
    Busy(exs_dma::DmaError),
    /// The transport refused or failed.
    Transport(TransportError),
}

impl From<TransportError> for ExposeError {
    fn from(e: TransportError) -> Self {
        ExposeError::Transport(e)
    }
}

impl ExposeError {
    /// As the error of an operation that already started (its completion's): a busy buffer (which only the
    /// trusted policy's whole-region key meets) reads as the transport refusing the key.
    pub(crate) fn into_op_error(self) -> crate::error::OpError {
        match self {
            ExposeError::Busy(d) => {
                crate::error::OpError::Transport(TransportError::Resource(d.to_string()))
            }
            ExposeError::Transport(t) => crate::error::OpError::Transport(t),
        }
    }

    /// The operation's error (`SendError` or `RecvError`): a busy buffer is the caller's, as any other.
    pub(crate) fn into_op<E>(self) -> E
    where
        E: From<crate::error::BufferError> + From<TransportError>,
    {
        match self {
            ExposeError::Busy(d) => crate::error::BufferError::from(d).into(),
            ExposeError::Transport(t) => t.into(),
        }
    }
}

/// The trusted policy's keys of one context, by connection, region (its buffer's address) and access.
#[derive(Debug, Default)]
pub(crate) struct TrustedKeys {
    keys: HashMap<(EndpointId, usize, RemoteAccess), Entry>,
}

/// The key of a buffer: its address (a buffer is in the map only while a whole-region lease keeps it alive).
fn buf_key(buf: &Arc<DmaBuf>) -> usize {
    Arc::as_ptr(buf) as usize
}

impl TrustedKeys {
    /// The exposure of `lease` (an operation's range) under the whole-region key of `reg` on `ep`, exposing the
    /// region first if this connection has no key for it yet. Returns whether a transport exposure was made.
    pub(crate) fn expose(
        &mut self,
        transport: &mut dyn Transport,
        ep: EndpointId,
        reg: &Arc<dyn Registration>,
        lease: Lease,
        access: RemoteAccess,
    ) -> Result<(Box<dyn Exposure>, bool), ExposeError> {
        crate::transport::check_exposure(reg, &lease, access)?;
        let buf = reg.buf();
        let mut made = false;
        let e = match self.keys.entry((ep, buf_key(buf), access)) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(v) => {
                // The key waits for the region's long copies that run without atomics to end (copies that
                // begin meanwhile are atomic): under the engine's lock, so this context's calls wait as long.
                let whole = buf
                    .lease(0..buf.len(), LeaseKind::TrustedKey)
                    .map_err(ExposeError::Busy)?;
                let base = whole.addr();
                let exposure = transport.expose(ep, reg, whole, access)?;
                made = true;
                v.insert(Entry {
                    remote: exposure.remote(),
                    whole: Arc::new(Whole {
                        exposure: Mutex::new(Some(exposure)),
                    }),
                    base,
                })
            }
        };
        let remote = RemoteRef {
            addr: e.remote.addr + (lease.addr() - e.base),
            key: e.remote.key,
        };
        Ok((
            Box::new(KeyedLease::new(
                remote,
                lease,
                Borrowed(Arc::clone(&e.whole)),
            )),
            made,
        ))
    }

    /// Revokes the keys of a connection that is going away (before its endpoint is released).
    pub(crate) fn forget_endpoint(&mut self, ep: EndpointId) {
        self.forget(|k| k.0 == ep, false);
    }

    /// How many whole-region keys name `buf`.
    pub(crate) fn count(&self, buf: &Arc<DmaBuf>) -> usize {
        let b = buf_key(buf);
        self.keys.keys().filter(|k| k.1 == b).count()
    }

    /// Lets go of every key naming `buf` (its region's last handle went): a key no operation uses is revoked at
    /// once; one that a pending operation uses (a stream receive advertised to the peer) is revoked when the last
    /// of them ends and drops it ([`Borrowed`]), as every operation's own key is.
    pub(crate) fn forget_buffer(&mut self, buf: &Arc<DmaBuf>) {
        let b = buf_key(buf);
        self.forget(|k| k.1 == b, true);
    }

    /// Takes the keys `gone` names out of the map and revokes them; with `borrowed_wait`, one an operation still
    /// uses is left to that operation (revoked when its last user drops it).
    fn forget(
        &mut self,
        gone: impl Fn(&(EndpointId, usize, RemoteAccess)) -> bool,
        borrowed_wait: bool,
    ) {
        self.keys.retain(|k, e| {
            if !gone(k) {
                return true;
            }
            if !borrowed_wait || Arc::strong_count(&e.whole) == 1 {
                revoke(&e.whole);
            }
            false
        });
    }

    /// Keys held now.
    pub(crate) fn len(&self) -> usize {
        self.keys.len()
    }
}

fn revoke(w: &Whole) {
    // Dropping the exposure revokes the key, then releases the whole-region lease.
    drop(w.exposure.lock().unwrap_or_else(|p| p.into_inner()).take());
}

#[cfg(test)]
mod tests {
    use super::ExposurePolicy;

    /// `EXS_EXPOSURE=TRUSTED` (or with spaces around) was refused, where every other `EXS_` setting ignores case
    /// and surrounding spaces.
    #[test]
    fn policies_are_named_in_any_case_around_spaces() {
        for v in ["trusted", "TRUSTED", " Trusted "] {
            assert_eq!(
                v.parse::<ExposurePolicy>().unwrap(),
                ExposurePolicy::TrustedPeers
            );
        }
        for v in ["per-operation", "PER-OPERATION", ""] {
            assert_eq!(
                v.parse::<ExposurePolicy>().unwrap(),
                ExposurePolicy::PerOperation
            );
        }
        assert!("sometimes".parse::<ExposurePolicy>().is_err());
    }
}

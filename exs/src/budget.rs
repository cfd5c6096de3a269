//! The context's memory budget: device-visible memory the connections hold (control buffers, stream buffers) is
//! charged against one limit, so that what peers can make a context allocate is bounded by the context, never by
//! what they ask for (a peer's 16-byte STREAM_RING_WANTED used to pin a 1 MiB stream buffer on every connection).
//!
//! A charge is held by what it pays for and given back when that goes.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// The limit and what is charged against it now.
#[derive(Debug, Clone)]
pub(crate) struct Budget {
    limit: u64,
    held: Arc<AtomicU64>,
}

/// Bytes charged against a [`Budget`], given back when dropped.
#[derive(Debug)]
pub(crate) struct Charge {
    bytes: u64,
    held: Arc<AtomicU64>,
}

impl Budget {
    pub(crate) fn new(limit: u64) -> Budget {
        Budget {
            limit,
            held: Arc::new(AtomicU64::new(0)),
        }
    }

    /// Charges `bytes`, or `None` when the budget cannot hold them.
    pub(crate) fn charge(&self, bytes: u64) -> Option<Charge> {
        self.held
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |held| {
                held.checked_add(bytes).filter(|&n| n <= self.limit)
            })
            .ok()?;
        Some(Charge {
            bytes,
            held: Arc::clone(&self.held),
        })
    }

    /// Bytes charged now.
    pub(crate) fn held(&self) -> u64 {
        self.held.load(Ordering::Acquire)
    }

    /// The limit.
    pub(crate) fn limit(&self) -> u64 {
        self.limit
    }
}

impl Drop for Charge {
    fn drop(&mut self) {
        self.held.fetch_sub(self.bytes, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_budget_refuses_beyond_its_limit_and_gets_its_charges_back() {
        let b = Budget::new(100);
        let a = b.charge(60).expect("fits");
        assert!(b.charge(41).is_none(), "beyond the limit");
        let c = b.charge(40).expect("fits exactly");
        assert_eq!(b.held(), 100);
        drop(a);
        assert_eq!(b.held(), 40);
        assert!(b.charge(u64::MAX).is_none(), "no overflow");
        drop(c);
        assert_eq!(b.held(), 0);
    }
}

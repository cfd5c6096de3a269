//! Leaders sleeping on their transports while they wait for events on this queue.
//!
//! A thread that leads contexts sleeps in `ppoll` on their wait descriptors ([`super::EventQueue`]'s
//! `sleep_leading`). Events that other threads complete on the queue meanwhile must wake it too, so it also
//! sleeps on a descriptor of its own, registered here with the number of events it waits for. Each sleeping thread
//! has its own descriptor (one eventfd per thread, made on its first sleep): with one descriptor per queue, a
//! leader that woke read away the wake-up written for another leader of the same queue, which then slept on.

use std::sync::Arc;

use nix::sys::eventfd::{EfdFlags, EventFd};
use smallvec::SmallVec;

thread_local! {
    /// This thread's wake-up descriptor while it sleeps leading. `None` if the process had no descriptor left.
    static WAKE: Option<Arc<EventFd>> =
        EventFd::from_value_and_flags(0, EfdFlags::EFD_NONBLOCK | EfdFlags::EFD_CLOEXEC)
            .ok()
            .map(Arc::new);
}

/// The calling thread's wake-up descriptor (see the module docs), or `None` if it could not be made.
pub(super) fn this_thread() -> Option<Arc<EventFd>> {
    // `None` too while the thread's locals are being destroyed (a dequeue from a destructor).
    WAKE.try_with(Clone::clone).ok().flatten()
}

/// Descriptors to write once the queue's lock is let go (most wake-ups wake one sleeper).
pub(super) type Wakes = SmallVec<[Arc<EventFd>; 2]>;

/// Writes each descriptor: the sleepers they belong to wake up.
pub(super) fn wake(fds: Wakes) {
    for fd in fds {
        let _ = fd.write(1);
    }
}

/// The registered sleepers of one queue.
#[derive(Default)]
pub(crate) struct Sleepers {
    list: SmallVec<[Sleeper; 2]>,
    /// The last token given out.
    tokens: u64,
}

struct Sleeper {
    need: usize,
    token: u64,
    /// Held by `Arc` so that a write after the queue's lock is let go never reaches a descriptor number that the
    /// sleeper's thread closed on exit and the process reused.
    fd: Arc<EventFd>,
}

impl Sleepers {
    /// Registers a leader that waits for `need` events, woken through `fd`: its token.
    pub(crate) fn register(&mut self, need: usize, fd: &Arc<EventFd>) -> u64 {
        self.tokens = self.tokens.wrapping_add(1);
        self.list.push(Sleeper {
            need,
            token: self.tokens,
            fd: Arc::clone(fd),
        });
        self.tokens
    }

    /// A leader woke: its registration goes, if a wake-up did not take it already. Others stay.
    pub(crate) fn unregister(&mut self, token: u64) {
        self.list.retain(|s| s.token != token);
    }

    /// Takes the sleepers whose count `len` queued events reach, for [`wake`].
    pub(super) fn due(&mut self, len: usize) -> Wakes {
        let mut fds = Wakes::new();
        if self.list.iter().any(|s| len >= s.need) {
            self.list.retain(|s| {
                let due = len >= s.need;
                if due {
                    fds.push(Arc::clone(&s.fd));
                }
                !due
            });
        }
        fds
    }

    /// Takes every sleeper (a leader let go: those that follow it retry leading), for [`wake`].
    pub(super) fn all(&mut self) -> Wakes {
        self.list.drain(..).map(|s| s.fd).collect()
    }

    #[cfg(test)]
    pub(crate) fn tokens(&self) -> Vec<u64> {
        self.list.iter().map(|s| s.token).collect()
    }
}

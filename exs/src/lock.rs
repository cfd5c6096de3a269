//! The engine lock, and what must wait until a thread lets go of it.
//!
//! Issue 15: dropping things in an unlucky order deadlocked a context. An event queue the user dropped while it held
//! an undequeued `Accept` event (which owns a socket) and a pending operation lived on in that operation's ticket;
//! when the engine completed the ticket, under its lock, the last reference to the queue went, the queued socket
//! was dropped, and its close locked the engine again. Everything dropped while this thread holds the engine lock
//! that needs the engine (a socket's close, a context's shutdown) is therefore run once the lock is released
//! ([`run_unlocked`]), on the same thread, in order.

use std::cell::{Cell, RefCell};
use std::mem::ManuallyDrop;
use std::ops::{Deref, DerefMut};
use std::sync::{Mutex, MutexGuard};

/// Work waiting for this thread to let go of the engine.
type Later = Vec<Box<dyn FnOnce()>>;

thread_local! {
    /// Engine locks this thread holds. A `Cell` of an integer has no destructor, so it can be read at any time,
    /// also while the thread's other thread-locals are destroyed: a socket kept in a thread-local and dropped at
    /// the thread's exit locks the engine then (review finding: with one `RefCell` of both, whose destructor had
    /// run, the access panicked inside a destructor, which aborts the process).
    static HELD: Cell<usize> = const { Cell::new(0) };
    /// The work waiting for the last of them to go. Without a destructor too (`ManuallyDrop`), so work deferred
    /// by a thread that is exiting is still deferred and run (review finding: with a destructor it could be gone
    /// first, and the work left undone); what is left of the vector's memory at the thread's exit stays.
    static LATER: RefCell<ManuallyDrop<Later>> = const { RefCell::new(ManuallyDrop::new(Vec::new())) };
}

/// The engine (`T`), locked by this thread. Generic so that this module sits below the engine it guards.
pub(crate) struct EngineGuard<'a, T> {
    guard: Option<MutexGuard<'a, T>>,
}

impl<'a, T> EngineGuard<'a, T> {
    /// Waits for the lock (a poisoned lock is taken as it is: the engine's state stays consistent per call).
    pub(crate) fn lock(m: &'a Mutex<T>) -> Self {
        Self::held(m.lock().unwrap_or_else(|p| p.into_inner()))
    }

    /// The lock if nobody holds it.
    pub(crate) fn try_lock(m: &'a Mutex<T>) -> Option<Self> {
        match m.try_lock() {
            Ok(g) => Some(Self::held(g)),
            Err(std::sync::TryLockError::Poisoned(p)) => Some(Self::held(p.into_inner())),
            Err(std::sync::TryLockError::WouldBlock) => None,
        }
    }

    fn held(g: MutexGuard<'a, T>) -> Self {
        HELD.with(|h| h.set(h.get() + 1));
        EngineGuard { guard: Some(g) }
    }
}

impl<T> Deref for EngineGuard<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        self.guard.as_ref().expect("held until dropped")
    }
}

impl<T> DerefMut for EngineGuard<'_, T> {
    fn deref_mut(&mut self) -> &mut T {
        self.guard.as_mut().expect("held until dropped")
    }
}

impl<T> Drop for EngineGuard<'_, T> {
    fn drop(&mut self) {
        drop(self.guard.take());
        let last = HELD.with(|h| {
            h.set(h.get() - 1);
            h.get() == 0
        });
        if !last {
            return;
        }
        let later = LATER.with(|l| {
            let mut l = l.borrow_mut();
            (!l.is_empty()).then(|| std::mem::take(&mut **l))
        });
        for f in later.into_iter().flatten() {
            f();
        }
    }
}

/// Runs `f` now, or, if this thread holds the engine lock, as soon as it lets go.
pub(crate) fn run_unlocked(f: impl FnOnce() + 'static) {
    if HELD.with(Cell::get) == 0 {
        return f();
    }
    LATER.with(|l| l.borrow_mut().push(Box::new(f)));
}

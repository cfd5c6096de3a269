//! The process's context and its handle tables: what turns a C integer into a Rust object.
//!
//! A handle is checked on every call: one that names nothing (never made, closed, deleted, deregistered) is
//! `EBADF`, never a wild access. Sockets are numbered by exs itself ([`exs::SocketId`], from 1, never reused in
//! a context), so an event names its socket with no table of its own; queues and memory are numbered here, from
//! 1, and never reused either: a stale handle cannot reach a newer object.
//!
//! Locks: each table has its own, held only to look up, insert or remove (a lookup clones the handle out); no
//! call into exs runs under one, except `exs_mderegister`, which holds the memory table's write lock while it
//! deregisters so that no new use of the region can start meanwhile. No table lock is taken under another.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::{Mutex, OnceLock, RwLock, RwLockReadGuard, RwLockWriteGuard};

use exs::{Context, EventQueue, MemoryRegion, Socket};
use libc::c_int;

use crate::errno::Errno;

/// The context `exs_init` opened (one per process, as the ES-API has it).
static CONTEXT: OnceLock<Context> = OnceLock::new();
/// Serializes `exs_init`s that find no context yet, so that exactly one opens it.
static OPENING: Mutex<()> = Mutex::new(());

/// The context, once `exs_init` has opened it (`ENODEV` before).
pub(crate) fn context() -> Result<&'static Context, Errno> {
    CONTEXT.get().ok_or(Errno(libc::ENODEV))
}

/// Opens the context with `open` unless it is open already.
pub(crate) fn open_context<E>(open: impl FnOnce() -> Result<Context, E>) -> Result<(), E> {
    if CONTEXT.get().is_some() {
        return Ok(());
    }
    let _one = OPENING.lock().unwrap_or_else(|p| p.into_inner());
    if CONTEXT.get().is_none() {
        let _ = CONTEXT.set(open()?);
    }
    Ok(())
}

/// A socket and what the C side needs to know of it without asking exs.
#[derive(Clone, Debug)]
pub(crate) struct SockEntry {
    pub(crate) sock: Socket,
    /// `AF_INET` or `AF_INET6`: addresses given to it must be of this family.
    pub(crate) domain: c_int,
    /// SOCK_SEQPACKET (its completed receives are whole messages: `MSG_EOR`).
    pub(crate) seqpacket: bool,
}

/// Registered memory and the range of the caller's address space it covers.
#[derive(Clone, Debug)]
pub(crate) struct MemEntry {
    pub(crate) region: MemoryRegion,
    pub(crate) base: usize,
    pub(crate) len: usize,
    /// `EXS_ACCESS_READ` / `EXS_ACCESS_WRITE`.
    pub(crate) access: c_int,
}

/// Handles to objects of one kind.
#[derive(Debug)]
pub(crate) struct Table<T> {
    map: RwLock<BTreeMap<c_int, T>>,
    next: AtomicI32,
}

impl<T: Clone> Table<T> {
    const fn new() -> Self {
        Table {
            map: RwLock::new(BTreeMap::new()),
            next: AtomicI32::new(1),
        }
    }

    fn read(&self) -> RwLockReadGuard<'_, BTreeMap<c_int, T>> {
        // Each change under the lock is one insert or remove: a panic elsewhere cannot leave the map half-changed.
        self.map.read().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn write(&self) -> RwLockWriteGuard<'_, BTreeMap<c_int, T>> {
        self.map.write().unwrap_or_else(|p| p.into_inner())
    }

    /// A copy of the object behind `h` (`EBADF` if none).
    pub(crate) fn get(&self, h: c_int) -> Result<T, Errno> {
        self.read().get(&h).cloned().ok_or(Errno(libc::EBADF))
    }

    /// `f` of the object behind `h`, under the read lock (`EBADF` if none): for a look that needs no copy.
    pub(crate) fn with<R>(&self, h: c_int, f: impl FnOnce(&T) -> R) -> Result<R, Errno> {
        self.read().get(&h).map(f).ok_or(Errno(libc::EBADF))
    }

    /// Files `v` under the next number (`EMFILE` once the numbers have run out).
    pub(crate) fn insert_new(&self, v: T) -> Result<c_int, Errno> {
        let h = self
            .next
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_add(1))
            .map_err(|_| Errno(libc::EMFILE))?;
        self.write().insert(h, v);
        Ok(h)
    }

    /// Files `v` under `h` (a number exs chose).
    pub(crate) fn insert_at(&self, h: c_int, v: T) {
        self.write().insert(h, v);
    }

    /// Takes the object behind `h` out (`EBADF` if none).
    pub(crate) fn remove(&self, h: c_int) -> Result<T, Errno> {
        self.write().remove(&h).ok_or(Errno(libc::EBADF))
    }
}

/// Open sockets, by their exs number.
pub(crate) static SOCKETS: Table<SockEntry> = Table::new();
/// Event queues.
pub(crate) static QUEUES: Table<EventQueue> = Table::new();
/// Registered memory.
pub(crate) static MEMORY: Table<MemEntry> = Table::new();

/// Files a socket exs made under its own number (`EMFILE` beyond what a C int holds: it is closed).
pub(crate) fn file_socket(sock: Socket, domain: c_int, seqpacket: bool) -> Result<c_int, Errno> {
    let Ok(fd) = c_int::try_from(sock.id().0) else {
        let _ = sock.close();
        return Err(Errno(libc::EMFILE));
    };
    SOCKETS.insert_at(
        fd,
        SockEntry {
            sock,
            domain,
            seqpacket,
        },
    );
    Ok(fd)
}

//! The process's context and its handle tables: what turns a C integer into a Rust object.
//!
//! A handle is checked on every call: one that names nothing (never made, closed, deleted, deregistered) is
//! `EBADF`, never a wild access. Each kind has numbers of its own, so that a handle passed for another kind (a queue
//! for a socket in `exs_close`, memory for a queue in `exs_send`) names nothing and is `EBADF` too: sockets are
//! numbered by exs itself ([`exs::SocketId`], from 1 to [`exs::SocketId::LAST`] and round again, skipping the numbers of sockets
//! it still holds), so an event names its socket with no table of its own; queues are numbered here from
//! [`QUEUE_NUMBERS`]'s start and memory from [`MEMORY_NUMBERS`]'s, each round again within its range, skipping
//! the numbers in use. A new handle therefore never replaces or aliases a live one, and a number comes back only
//! when the count comes round to it, about half a billion handles of its kind after it was given out: only a
//! stale handle used that much later can reach a newer object.
//!
//! Locks: each table has its own, held only to look up, insert or remove (a lookup clones the handle out); no
//! call into exs runs under one, except in `exs_qdelete`, which reads the queue's count of operations outstanding
//! (the queue's own lock, which no exs call holds while it takes a table's) under the queue table's write lock, so
//! that none starts between the count and the removal. `exs_mderegister` takes the region out of its entry under
//! the memory table's write lock and deregisters it with no table lock held: the entry stays filed meanwhile (its
//! number and range are not given out again, and calls naming it are `EBADF`), and goes once the deregistration
//! succeeded, or gets its region back if it was refused. An operation counts its start on its queue
//! under the queue table's read lock and starts with no table lock held ([`crate::queue::start_on`]), so that
//! `exs_qdelete` cannot delete its queue between the look-up and the start. No table lock is taken under another
//! (the count's own mutex is taken under the queue table's lock, never the other way).

use std::collections::btree_map::Entry;
use std::collections::BTreeMap;
use std::ops::RangeInclusive;
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
}

/// Registered memory and the range of the caller's address space it covers.
#[derive(Clone, Debug)]
pub(crate) struct MemEntry {
    /// `None` while `exs_mderegister` undoes the registration: the handle's number and range stay filed, so that
    /// neither is given out again before it has, and calls naming the handle meanwhile fail (`EBADF`).
    pub(crate) region: Option<MemoryRegion>,
    pub(crate) base: usize,
    pub(crate) len: usize,
    /// `EXS_ACCESS_READ` / `EXS_ACCESS_WRITE`.
    pub(crate) access: c_int,
}

/// The numbers of queue handles (positive C ints above every socket number).
pub(crate) const QUEUE_NUMBERS: RangeInclusive<c_int> = 0x2000_0000..=0x3fff_ffff;
/// The numbers of memory handles.
pub(crate) const MEMORY_NUMBERS: RangeInclusive<c_int> = 0x4000_0000..=0x5fff_ffff;

/// Handles to objects of one kind.
#[derive(Debug)]
pub(crate) struct Table<T> {
    map: RwLock<BTreeMap<c_int, T>>,
    /// The number [`Table::insert_new`] tries first. Changed only under the write lock (atomic so that the
    /// statics need no lock of their own).
    next: AtomicI32,
    /// The numbers [`Table::insert_new`] gives out, in turn.
    numbers: RangeInclusive<c_int>,
}

impl<T: Clone> Table<T> {
    /// A table whose new handles take the numbers of `numbers` (sockets, numbered by exs, are filed with
    /// [`Table::insert_at`]).
    const fn new(numbers: RangeInclusive<c_int>) -> Self {
        Table {
            map: RwLock::new(BTreeMap::new()),
            next: AtomicI32::new(*numbers.start()),
            numbers,
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

    /// Files `v` under the next number not in use, counting through the table's numbers and round again: a
    /// program that makes and deletes handles for ever never runs out, and a new handle never takes a live one's
    /// number. `EMFILE` only if every number is in use.
    pub(crate) fn insert_new(&self, v: T) -> Result<c_int, Errno> {
        self.insert_new_unless(v, |_| Ok(()))
    }

    /// [`Table::insert_new`], unless `refuse` finds a reason in the handles filed already (looked at under the same
    /// write lock as the insertion, so that two insertions cannot both pass it).
    pub(crate) fn insert_new_unless(
        &self,
        v: T,
        refuse: impl FnOnce(&BTreeMap<c_int, T>) -> Result<(), Errno>,
    ) -> Result<c_int, Errno> {
        let mut map = self.write();
        refuse(&map)?;
        let mut h = self.next.load(Ordering::Relaxed);
        // At most `map.len()` numbers are taken, so one more try than that finds a free one if any is.
        for _ in 0..=map.len() {
            let candidate = h;
            h = if h >= *self.numbers.end() {
                *self.numbers.start()
            } else {
                h + 1
            };
            if let Entry::Vacant(free) = map.entry(candidate) {
                free.insert(v);
                self.next.store(h, Ordering::Relaxed);
                return Ok(candidate);
            }
        }
        Err(Errno(libc::EMFILE))
    }

    /// Files `v` under `h` (a number exs chose), unless `h` is in use: then `v` comes back and the live entry
    /// stays (a new object must never replace one a program still holds).
    pub(crate) fn insert_at(&self, h: c_int, v: T) -> Result<(), T> {
        match self.write().entry(h) {
            Entry::Vacant(free) => {
                free.insert(v);
                Ok(())
            }
            Entry::Occupied(_) => Err(v),
        }
    }

    /// Takes the object behind `h` out (`EBADF` if none).
    pub(crate) fn remove(&self, h: c_int) -> Result<T, Errno> {
        self.write().remove(&h).ok_or(Errno(libc::EBADF))
    }
}

/// Open sockets, by their exs number (filed with [`file_socket`], never numbered here).
pub(crate) static SOCKETS: Table<SockEntry> = Table::new(1..=exs::SocketId::LAST as c_int);
/// Event queues.
pub(crate) static QUEUES: Table<EventQueue> = Table::new(QUEUE_NUMBERS);
/// Registered memory.
pub(crate) static MEMORY: Table<MemEntry> = Table::new(MEMORY_NUMBERS);

/// Files a socket exs made under its own number. `EMFILE`, and the socket is closed, if the number is not a
/// socket's (past 2^29 - 1, where the other kinds' numbers are) or is still filed: exs numbers sockets from 1 to
/// 2^29 - 1 and skips those it holds, so neither happens while every socket filed here is one of the context's own.
pub(crate) fn file_socket(sock: Socket, domain: c_int) -> Result<c_int, Errno> {
    let fd = c_int::try_from(sock.id().0).unwrap_or(c_int::MAX);
    if !SOCKETS.numbers.contains(&fd) {
        let _ = sock.close();
        return Err(Errno(libc::EMFILE));
    }
    let entry = SockEntry { sock, domain };
    SOCKETS.insert_at(fd, entry).map_err(|refused| {
        let _ = refused.sock.close();
        Errno(libc::EMFILE)
    })?;
    Ok(fd)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A table numbering from 1 to `INT_MAX` whose counter starts at `next`.
    fn table_from(next: c_int) -> Table<u32> {
        let t = Table::new(1..=c_int::MAX);
        t.next.store(next, Ordering::Relaxed);
        t
    }

    #[test]
    fn handle_numbers_wrap_past_int_max_to_numbers_not_in_use() {
        let t = table_from(c_int::MAX - 1);
        let low = t.insert_new(10).unwrap();
        assert_eq!(low, c_int::MAX - 1);
        // 1 and 2 are still in use when the counter comes round to them.
        t.insert_at(1, 11).unwrap();
        t.insert_at(2, 12).unwrap();
        assert_eq!(t.insert_new(13), Ok(c_int::MAX));
        assert_eq!(
            t.insert_new(14),
            Ok(3),
            "past INT_MAX, the first number not in use"
        );
        assert_eq!(t.get(1), Ok(11), "a live handle keeps its object");
        assert_eq!(t.get(2), Ok(12));
        // A number given back is free again when the counter comes round to it; the live ones after it are not.
        t.remove(low).unwrap();
        t.next.store(c_int::MAX - 1, Ordering::Relaxed);
        assert_eq!(t.insert_new(20), Ok(c_int::MAX - 1));
        assert_eq!(t.insert_new(21), Ok(4), "INT_MAX, 1, 2 and 3 are in use");
        assert_eq!(t.get(c_int::MAX), Ok(13));
        assert_eq!(t.get(3), Ok(14));
    }

    #[test]
    fn a_number_in_use_is_never_filed_over() {
        let t = table_from(1);
        t.insert_at(5, 50).unwrap();
        assert_eq!(t.insert_at(5, 51), Err(51), "the new object comes back");
        assert_eq!(t.get(5), Ok(50), "the live entry stays");
        t.remove(5).unwrap();
        assert_eq!(t.insert_at(5, 52), Ok(()));
        assert_eq!(t.get(5), Ok(52));
    }

    #[test]
    fn the_kinds_of_handle_have_numbers_of_their_own() {
        // Each wraps within its own range, never into another kind's.
        for numbers in [QUEUE_NUMBERS, MEMORY_NUMBERS] {
            let t: Table<u32> = Table::new(numbers.clone());
            assert_eq!(t.insert_new(1), Ok(*numbers.start()));
            t.next.store(*numbers.end(), Ordering::Relaxed);
            assert_eq!(t.insert_new(2), Ok(*numbers.end()));
            assert_eq!(
                t.insert_new(3),
                Ok(*numbers.start() + 1),
                "round again, past the live first"
            );
        }
        let sockets = &SOCKETS.numbers;
        assert!(
            sockets.end() < QUEUE_NUMBERS.start() && QUEUE_NUMBERS.end() < MEMORY_NUMBERS.start()
        );
    }
}

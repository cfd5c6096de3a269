//! What lets a thread sleep until a connection's completion queue has something: the queue's wait object and its
//! place in the transport's epoll set ([`crate::CqWait`]).
//!
//! With `FI_WAIT_FD` the queue's wait object is one epoll descriptor of the provider's, entered in the transport's
//! set once. With `FI_WAIT_POLLFD` it is a list of descriptors the provider keeps (the queue's signal, and the
//! connection's socket once connected) with the events it wants on each (`POLLOUT` too while it has bytes the
//! socket would not take): the transport enters each in its own set, and brings the entries up to date whenever
//! the queue is armed ([`FabricTransport::sync_wait`]): `fi_trywait` runs the provider's progress on the queue
//! first, which applies the changes it had queued. Only a read of the queue (its progress), or a post on it, can
//! change what it waits on: each marks the queue unarmed ([`crate::ready`]), so it is armed, and its entries
//! brought up to date, before it can go quiet; a connection that comes up makes its queue hot again too (its
//! socket joins the set then, from the event queue's progress). This rests on what libfabric 1.17's tcp provider
//! does (Debian 12's): its event-queue reads drive connection management only, and a queue's data moves only in
//! that queue's own progress (`reading_connection_events_moves_no_queues_data` pins it). A provider whose
//! event-queue reads also moved a queue's data could change what an armed queue waits on unseen;
//! `EXS_FABRIC_CQ_WAIT=fd` does not depend on it.
//!
//! The epoll set names its entries by descriptor number, and a number the provider closed can come back as another
//! queue's descriptor before the first queue's list is brought up to date: each number therefore has one owner
//! (the endpoint that entered it last), and a queue takes out only the entries it still owns.

use std::os::fd::{BorrowedFd, RawFd};

use nix::sys::epoll::{EpollEvent, EpollFlags};
use smallvec::SmallVec;

use exs_transport::{EndpointId, TransportError};

use crate::call::check;
use crate::ffi::*;
use crate::FabricTransport;

/// A queue's wait object, as the transport's epoll set holds it.
#[derive(Debug)]
pub(crate) enum EpWait {
    /// No wait object ([`crate::CqWait::None`]): the queue stays hot, read in every poll.
    None,
    /// `FI_WAIT_FD`: the provider's epoll descriptor, in the transport's set.
    Fd(RawFd),
    /// `FI_WAIT_POLLFD`: the descriptors entered in the transport's set, with the events entered for each.
    PollFd(PollFds),
}

impl EpWait {
    /// Whether a completion wakes a thread sleeping on the transport's epoll set (the queue may leave the hot
    /// set once armed).
    pub(crate) fn signals(&self) -> bool {
        !matches!(self, EpWait::None)
    }
}

/// A queue's descriptors and the events on each: as a rule two (its signal and its connection's socket).
pub(crate) type PollFds = SmallVec<[(RawFd, i16); 4]>;

/// The descriptors and events a queue opened with `FI_WAIT_POLLFD` waits on now.
pub(crate) fn pollfds_of(cq: *mut fid_cq) -> Result<PollFds, TransportError> {
    let none = pollfd {
        fd: -1,
        events: 0,
        revents: 0,
    };
    let mut fds: SmallVec<[pollfd; 8]> = SmallVec::from_elem(none, 8);
    loop {
        let mut w = fi_wait_pollfd {
            change_index: 0,
            nfds: fds.len(),
            fd: fds.as_mut_ptr(),
        };
        // SAFETY: `cq` is open with a FI_WAIT_POLLFD wait object; FI_GETWAIT copies at most `nfds` entries into
        // `fds` (which holds that many) and writes the set's size to `nfds`.
        let ret = unsafe {
            exs_fi_control(
                &mut (*cq).fid,
                FI_GETWAIT as i32,
                &mut w as *mut fi_wait_pollfd as *mut std::ffi::c_void,
            )
        };
        if ret == -(FI_ETOOSMALL as i32) && w.nfds > fds.len() {
            fds.resize(w.nfds, none);
            continue;
        }
        check("fi_control(FI_GETWAIT)", ret)?;
        fds.truncate(w.nfds);
        // The first entry is the set's own signal (libfabric's `ofi_pollfds` puts it first and never moves it),
        // written whenever a change to the set is queued and read again only by a thread waiting on the set
        // itself, which no one does here: entered, it would make every armed queue look signalled for good.
        // What the changes are about is taken in when the queue is next armed.
        return Ok(fds.iter().skip(1).map(|p| (p.fd, p.events)).collect());
    }
}

/// The epoll events for a pollfd entry's (`POLLIN` and `POLLOUT` have epoll's values).
fn epoll_events(events: i16) -> EpollFlags {
    EpollFlags::from_bits_truncate(i32::from(events))
        & (EpollFlags::EPOLLIN | EpollFlags::EPOLLOUT | EpollFlags::EPOLLPRI)
}

impl FabricTransport {
    /// Enters `now` (a queue's pollfd set) in the transport's epoll set under `id`, in place of `was`: entries no
    /// longer in the set are taken out (the provider may already have closed them: that error is ignored), an
    /// entry whose events changed is modified. Returns what is entered afterwards, also when a step failed part
    /// way (with the error), so that the next update starts from the truth.
    pub(crate) fn enter_pollfds(
        &mut self,
        id: EndpointId,
        was: &[(RawFd, i16)],
        now: &[(RawFd, i16)],
    ) -> (PollFds, Result<(), TransportError>) {
        let data = u64::from(id.0);
        let mut entered: PollFds = SmallVec::new();
        for &(fd, events) in was {
            if now.iter().any(|n| n.0 == fd) {
                entered.push((fd, events));
            } else {
                self.leave(fd, id);
            }
        }
        for &(fd, events) in now {
            let mut ev = EpollEvent::new(epoll_events(events), data);
            // SAFETY: `fd` is in the queue's pollfd set, so open while the queue is; it leaves the epoll set
            // before the queue closes (`release_ep`) or when it leaves the pollfd set.
            let bfd = unsafe { BorrowedFd::borrow_raw(fd) };
            let r = match entered.iter().position(|w| w.0 == fd) {
                Some(i) if entered[i].1 == events => Ok(()),
                Some(i) => self
                    .epoll
                    .modify(bfd, &mut ev)
                    .map(|()| entered[i].1 = events),
                None => match self.epoll.add(bfd, ev) {
                    Err(nix::errno::Errno::EEXIST) => {
                        // Entered already, under another endpoint or none: a descriptor is one queue's.
                        tracing::warn!(
                            ?id,
                            fd,
                            "a queue's descriptor was in the epoll set already"
                        );
                        self.epoll.modify(bfd, &mut ev)
                    }
                    r => r,
                }
                .map(|()| {
                    entered.push((fd, events));
                    self.own(fd, id);
                }),
            };
            if let Err(e) = r {
                return (entered, Err(TransportError::os("epoll_ctl", e.into())));
            }
        }
        (entered, Ok(()))
    }

    /// Brings `id`'s entries in the epoll set up to date with its queue's pollfd set (a `FI_WAIT_POLLFD` queue;
    /// nothing for others). Called once `fi_trywait` has armed the queue: from then on only the set can tell
    /// that it has something.
    pub(crate) fn sync_wait(&mut self, id: EndpointId) -> Result<(), TransportError> {
        let Some(e) = self.eps.get(&id) else {
            return Ok(());
        };
        let EpWait::PollFd(was) = &e.wait else {
            return Ok(());
        };
        let now = pollfds_of(e.cq)?;
        if **was == *now {
            return Ok(());
        }
        let was = was.clone();
        let (entered, r) = self.enter_pollfds(id, &was, &now);
        if let Some(e) = self.eps.get_mut(&id) {
            e.wait = EpWait::PollFd(entered);
        }
        r
    }

    /// Takes endpoint `id`'s queue's entries out of the epoll set (before the queue and its socket close).
    pub(crate) fn leave_epoll(&mut self, id: EndpointId, wait: &EpWait) {
        match wait {
            EpWait::None => {}
            EpWait::Fd(fd) => self.leave(*fd, id),
            EpWait::PollFd(v) => v.iter().for_each(|&(fd, _)| self.leave(fd, id)),
        }
    }

    /// Records that `fd` is entered under `id`'s queue. Another queue that had entered the same number loses it
    /// from its list (the provider closed its descriptor, and the number went to `id`'s): it must not take the
    /// entry out later, nor count on it.
    pub(crate) fn own(&mut self, fd: RawFd, id: EndpointId) {
        let Some(prev) = self.fd_owners.insert(fd, id).filter(|&p| p != id) else {
            return;
        };
        if let Some(EpWait::PollFd(v)) = self.eps.get_mut(&prev).map(|e| &mut e.wait) {
            v.retain(|w| w.0 != fd);
        }
    }

    /// Takes one of `id`'s queue's descriptors out of the epoll set, if it is still that queue's: a number the
    /// provider closed may since have gone to another queue's descriptor, whose entry stays.
    fn leave(&mut self, fd: RawFd, id: EndpointId) {
        if self.fd_owners.get(&fd) != Some(&id) {
            return;
        }
        self.fd_owners.remove(&fd);
        // SAFETY: a plain system call on a number, not a borrow of a descriptor (the provider may have closed this
        // one already, which a `BorrowedFd` must not be: review finding): deleting a number that is no longer in
        // the set, or no longer open, fails harmlessly, and `fd_owners` said it is not another queue's entry.
        let _ = unsafe {
            nix::libc::epoll_ctl(
                std::os::fd::AsRawFd::as_raw_fd(&self.epoll.0),
                nix::libc::EPOLL_CTL_DEL,
                fd,
                std::ptr::null_mut(),
            )
        };
    }
}

#[cfg(test)]
mod tests {
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

    use nix::sys::epoll::EpollTimeout;
    use nix::sys::eventfd::{EfdFlags, EventFd};

    use super::*;
    use crate::FabricConfig;

    const POLLIN: i16 = nix::poll::PollFlags::POLLIN.bits();

    /// A descriptor that stays readable.
    fn eventfd() -> EventFd {
        EventFd::from_value_and_flags(1, EfdFlags::EFD_NONBLOCK).unwrap()
    }

    /// Which endpoints' entries in the transport's epoll set are readable now.
    fn readable(t: &FabricTransport) -> Vec<u64> {
        let mut events = [EpollEvent::empty(); 8];
        let n = t.epoll.wait(&mut events, EpollTimeout::ZERO).unwrap();
        events[..n].iter().map(|e| e.data()).collect()
    }

    /// A queue's descriptor that the provider closed, its number then given to another queue's descriptor: the
    /// first queue's next update (or its release) took the number's entry out of the epoll set, which was the
    /// second queue's by then, and that queue's completions no longer woke a sleeper (a lost wake-up).
    #[test]
    fn a_descriptor_number_reused_by_another_queue_stays_that_queues() {
        let _serial = crate::tests::serial();
        let mut t = FabricTransport::open(&FabricConfig::default()).expect("open tcp");
        let (a, b) = (EndpointId(901), EndpointId(902));
        let first = eventfd();
        let n = first.as_raw_fd();
        let (_, r) = t.enter_pollfds(a, &[], &[(n, POLLIN)]);
        r.unwrap();
        assert!(readable(&t).contains(&901));
        // The provider closes A's descriptor (epoll forgets it) and the number goes to one of B's: at once, so
        // that no other test's descriptor takes it in between.
        let second = eventfd();
        nix::unistd::dup2(second.as_raw_fd(), n).unwrap();
        // `n` is a copy of B's descriptor now; A's went with the dup2 (its file's last descriptor).
        std::mem::forget(first);
        // SAFETY: `n` is open (made by dup2) and owned by nothing else.
        let _owned = unsafe { OwnedFd::from_raw_fd(n) };
        let (_, r) = t.enter_pollfds(b, &[], &[(n, POLLIN)]);
        r.unwrap();
        // A's list no longer has the descriptor: its update, then its release, take out what is A's only.
        let (left, r) = t.enter_pollfds(a, &[(n, POLLIN)], &[]);
        r.unwrap();
        assert!(left.is_empty());
        t.leave_epoll(a, &EpWait::PollFd(left));
        assert!(
            readable(&t).contains(&902),
            "B's descriptor left the epoll set with A's update"
        );
        t.leave_epoll(b, &EpWait::PollFd(SmallVec::from_slice(&[(n, POLLIN)])));
        assert!(!readable(&t).contains(&902), "B's own release takes it out");
    }
}

//! Sockets: `exs_socket` ... `exs_getpeername` (seed 002, Figure 2). Each function is one call of
//! [`exs::Socket`].

use exs::{ConnectError, Readiness, SockType, Socket, SocketError, StateError};
use libc::{c_int, c_short, c_void, sockaddr, socklen_t};

use crate::abi::exs_qhandle_t;
use crate::errno::{call, Errno};
use crate::handles::{context, file_socket, SOCKETS};
use crate::queue::start_on;
use crate::{addr, ctx_value};

/// Creates a socket (UNH-EXS `exs_socket`): `domain` `AF_INET` or `AF_INET6`, `type` `SOCK_STREAM` (a byte
/// stream, seed 001) or `SOCK_SEQPACKET` (messages, seed 002; `SOCK_NONBLOCK` and `SOCK_CLOEXEC` are accepted and
/// change nothing: every exs call is asynchronous), `protocol` 0. Returns the socket, a small positive integer
/// that only exs calls understand, or -1 with `errno`: `EAFNOSUPPORT`, `EINVAL` (another type), `EPROTONOSUPPORT`,
/// `ENODEV` (no `exs_init`).
#[no_mangle]
pub extern "C" fn exs_socket(domain: c_int, r#type: c_int, protocol: c_int) -> c_int {
    call(|| {
        let ctx = context()?;
        if domain != libc::AF_INET && domain != libc::AF_INET6 {
            return Err(Errno(libc::EAFNOSUPPORT));
        }
        let ty = match r#type & !(libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC) {
            libc::SOCK_STREAM => SockType::Stream,
            libc::SOCK_SEQPACKET => SockType::SeqPacket,
            _ => return Err(Errno(libc::EINVAL)),
        };
        if protocol != 0 {
            return Err(Errno(libc::EPROTONOSUPPORT));
        }
        let sock = Socket::new(ctx, ty)?;
        file_socket(sock, domain)
    })
}

/// Binds the socket to a local address (UNH-EXS `exs_bind`) for `exs_listen`; port 0 lets `exs_listen` pick one.
/// The transport chooses an outgoing connection's own address: `exs_connect` refuses a socket bound to one
/// (`EOPNOTSUPP`), except the unspecified address with port 0. -1 with `errno`:
/// `EBADF`, `EAFNOSUPPORT` (not the socket's family), `EINVAL` (already bound, short address), `EFAULT` (null
/// address of a nonzero length).
///
/// # Safety
/// `addr` is null or points to `len` readable bytes.
#[no_mangle]
pub unsafe extern "C" fn exs_bind(fd: c_int, addr: *const sockaddr, len: socklen_t) -> c_int {
    call(|| {
        let s = SOCKETS.get(fd)?;
        // SAFETY: the caller's promise above.
        let a = unsafe { addr::read(addr, len, s.domain) }?;
        s.sock.bind(a)?;
        Ok(0)
    })
}

/// Listens for connections (UNH-EXS `exs_listen`) on the bound address; `backlog` <= 0 keeps the
/// `EXS_F_SET_BACKLOG` value (default 128). On a listening socket it changes only the backlog, as `listen(2)`.
/// -1 with `errno`: `EBADF`, `EDESTADDRREQ` (not bound), `EINVAL` (connected), `EADDRINUSE`, `EADDRNOTAVAIL` (no
/// device has the address).
#[no_mangle]
pub extern "C" fn exs_listen(fd: c_int, backlog: c_int) -> c_int {
    call(|| {
        let s = SOCKETS.get(fd)?;
        let backlog = u32::try_from(backlog).unwrap_or(0).min(65535);
        match s.sock.listen(backlog) {
            // listen(2) of a connected socket is EINVAL.
            Err(SocketError::State(StateError::AlreadyConnected)) => Err(Errno(libc::EINVAL)),
            r => r.map(|_| 0).map_err(Errno::from),
        }
    })
}

/// Accepts one connection, asynchronously (ES-API `exs_accept`): an `EXS_EVT_ACCEPT` event on `qh` carries the
/// new socket in `exs_evt_accepted`, with `context` (-1 with `exs_evt_errno` `EMFILE` if no socket number was left
/// for it: the connection is closed). -1 with `errno` if it could not start: `EBADF` (socket or queue), `EINVAL`
/// (not listening), `EAGAIN` (the queue is full).
#[no_mangle]
pub extern "C" fn exs_accept(fd: c_int, qh: exs_qhandle_t, context: *mut c_void) -> c_int {
    call(|| {
        let s = SOCKETS.get(fd)?;
        start_on(qh, |eq| s.sock.accept(eq, ctx_value(context)))
    })
}

/// Connects, asynchronously (ES-API `exs_connect`): an `EXS_EVT_CONNECT` event on `qh` says how it went
/// (`exs_evt_errno` `ECONNREFUSED`, `ETIMEDOUT`, `EHOSTUNREACH`...). Options set with `exs_fcntl` are
/// negotiated now and fixed from here on. -1 with `errno` if it could not start: `EBADF`, `EAFNOSUPPORT`,
/// `EINVAL` (short address), `EFAULT` (null address of a nonzero length), `EISCONN` (connected, or listening),
/// `EALREADY` (a connect of the socket is under way), `EOPNOTSUPP` (bound to an address: see `exs_bind`), `EAGAIN`;
/// `EINVAL` on a socket whose connect failed or whose connection ended (as BSD's `connect(2)`): such a socket
/// does not connect again, a new one does (`EXS_F_GETERROR` says why it went down).
///
/// # Safety
/// `addr` is null or points to `len` readable bytes.
#[no_mangle]
pub unsafe extern "C" fn exs_connect(
    fd: c_int,
    addr: *const sockaddr,
    len: socklen_t,
    qh: exs_qhandle_t,
    context: *mut c_void,
) -> c_int {
    call(|| {
        let s = SOCKETS.get(fd)?;
        // SAFETY: the caller's promise above.
        let a = unsafe { addr::read(addr, len, s.domain) }?;
        start_on(qh, |eq| {
            s.sock
                .connect(eq, a, ctx_value(context))
                .map_err(|e| match e {
                    // connect(2) of a listening socket is EISCONN.
                    ConnectError::State(StateError::Listening) => Errno(libc::EISCONN),
                    // A socket whose connect failed or whose connection ended does not connect again (BSD's
                    // connect(2) says EINVAL); why it went down is EXS_F_GETERROR's.
                    // (A failed context's own error stays EIO.)
                    ConnectError::State(StateError::ConnectionDown(why))
                        if !matches!(why, exs::OpError::ContextFailed(_)) =>
                    {
                        Errno(libc::EINVAL)
                    }
                    e => Errno::from(e),
                })
        })
    })
}

/// Asks for the socket's readiness (ES-API `exs_poll`): an `EXS_EVT_POLL` event on `qh` comes as soon as the
/// socket is ready for something in `events` (`POLLIN` or `POLLRDNORM`, `POLLOUT` or `POLLWRNORM`), at once if it
/// already is. `revents` has both names of what is ready (`POLLIN | POLLRDNORM`, `POLLOUT | POLLWRNORM`),
/// whichever was asked for (`poll(2)` would return only the asked-for name: test bits with `&`); `POLLERR` and
/// `POLLHUP` are always reported, and a hang-up (the peer closed) also as `POLLRDHUP`. `POLLERR`, `POLLHUP`,
/// `POLLNVAL` and `POLLRDHUP` may be in `events` (as with `poll(2)`). One per socket on a shared queue waits for
/// whichever is ready first. A strict C program (`-std=c99`), whose `<poll.h>` has no `POLLRDNORM`,
/// `POLLWRNORM` or `POLLRDHUP`, uses `EXS_POLLRDNORM`, `EXS_POLLWRNORM` and `EXS_POLLRDHUP`, the same bits. -1
/// with `errno`: `EBADF`, `EINVAL` (a bit exs cannot report: `POLLPRI`, `POLLRDBAND`, `POLLWRBAND`, ...),
/// `ENOTCONN` (neither connected nor listening: unlike `poll(2)`, which would report `POLLOUT | POLLHUP`),
/// `EAGAIN`.
#[no_mangle]
pub extern "C" fn exs_poll(
    fd: c_int,
    events: c_short,
    qh: exs_qhandle_t,
    context: *mut c_void,
) -> c_int {
    call(|| {
        let s = SOCKETS.get(fd)?;
        // Review finding: bits other than POLLIN and POLLOUT were dropped without a word (`POLLRDNORM` from code
        // written for poll(2) then waited for an error or a hang-up only).
        let (read, write) = (
            libc::POLLIN | libc::POLLRDNORM,
            libc::POLLOUT | libc::POLLWRNORM,
        );
        let always = libc::POLLERR | libc::POLLHUP | libc::POLLNVAL | libc::POLLRDHUP;
        if events & !(read | write | always) != 0 {
            return Err(Errno(libc::EINVAL));
        }
        let interest = Readiness {
            readable: events & read != 0,
            writable: events & write != 0,
            ..Readiness::default()
        };
        start_on(qh, |eq| s.sock.poll(eq, interest, ctx_value(context)))
    })
}

/// The `revents` of a readiness: both of poll(2)'s names for reading and for writing, whichever was asked for
/// (review finding: a program that asked with `POLLRDNORM` tested for it), and a hang-up as `POLLHUP` and
/// `POLLRDHUP`.
pub(crate) fn revents(r: Readiness) -> c_short {
    [
        (r.readable, libc::POLLIN | libc::POLLRDNORM),
        (r.writable, libc::POLLOUT | libc::POLLWRNORM),
        (r.error, libc::POLLERR),
        (r.hangup, libc::POLLHUP | libc::POLLRDHUP),
    ]
    .iter()
    .filter(|(on, _)| *on)
    .fold(0, |acc, (_, bit)| acc | bit)
}

/// Shuts the sending side down (`how` `SHUT_WR`; `shutdown(2)`), asynchronously: after the sends already started,
/// the peer's receives see end-of-stream; this side keeps receiving. `EXS_EVT_SHUTDOWN` on `qh` once every
/// earlier send has completed. -1 with `errno`: `EBADF`, `EOPNOTSUPP` (`SHUT_RD`, `SHUT_RDWR`: exs has no
/// receive-side shutdown; `exs_close` ends both), `EINVAL` (another `how`), `ENOTCONN`.
#[no_mangle]
pub extern "C" fn exs_shutdown(
    fd: c_int,
    how: c_int,
    qh: exs_qhandle_t,
    context: *mut c_void,
) -> c_int {
    call(|| {
        let s = SOCKETS.get(fd)?;
        match how {
            libc::SHUT_WR => {}
            libc::SHUT_RD | libc::SHUT_RDWR => return Err(Errno(libc::EOPNOTSUPP)),
            _ => return Err(Errno(libc::EINVAL)),
        }
        start_on(qh, |eq| s.sock.shutdown(eq, ctx_value(context)))
    })
}

/// Closes the socket (UNH-EXS `exs_close`), gracefully like TCP's `close()`: pending receives complete with
/// `ECANCELED`; sends already started still reach the peer and complete, then the peer sees end-of-stream; what
/// is left after the linger time (10 s) ends with `ECONNABORTED` or `ECANCELED`. Events still come for the
/// operations the socket had, with its number. The number is not given to a new socket while exs still holds
/// this one (its lingering connection), nor before the count of socket numbers has come round to it (at
/// 2^29 - 1). -1 with `errno` `EBADF`, or `EIO` when the context has failed (the handle is released all the
/// same, as `close(2)`'s is).
#[no_mangle]
pub extern "C" fn exs_close(fd: c_int) -> c_int {
    call(|| {
        let s = SOCKETS.remove(fd)?;
        s.sock.close()?;
        Ok(0)
    })
}

/// The local address (UNH-EXS `exs_getsockname`), as `getsockname(2)`: at most `*len` bytes at `addr`, the
/// address's full length in `*len`; the unspecified address of the socket's family before it is bound. -1 with
/// `errno` `EBADF`, `EFAULT` (a null pointer).
///
/// # Safety
/// `len` is null or valid for reads and writes; `addr` is null or valid for writes of `*len` bytes.
#[no_mangle]
pub unsafe extern "C" fn exs_getsockname(
    fd: c_int,
    addr: *mut sockaddr,
    len: *mut socklen_t,
) -> c_int {
    call(|| {
        let s = SOCKETS.get(fd)?;
        let local = s.sock.local_addr()?;
        // SAFETY: the caller's promise above.
        unsafe { addr::write(local, s.domain, addr, len) }?;
        Ok(0)
    })
}

/// The peer's address (UNH-EXS `exs_getpeername`), as `getpeername(2)`. -1 with `errno` `EBADF`, `ENOTCONN`,
/// `EFAULT`.
///
/// # Safety
/// `len` is null or valid for reads and writes; `addr` is null or valid for writes of `*len` bytes.
#[no_mangle]
pub unsafe extern "C" fn exs_getpeername(
    fd: c_int,
    addr: *mut sockaddr,
    len: *mut socklen_t,
) -> c_int {
    call(|| {
        let s = SOCKETS.get(fd)?;
        let peer = s.sock.peer_addr()?.ok_or(Errno(libc::ENOTCONN))?;
        // SAFETY: the caller's promise above.
        unsafe { addr::write(Some(peer), s.domain, addr, len) }?;
        Ok(0)
    })
}

/// Files an accepted socket under its number (the `EXS_EVT_ACCEPT` event's `exs_evt_accepted`); `EMFILE` if it
/// could not be (it is closed then).
pub(crate) fn file_accepted(sock: Socket) -> Result<c_int, Errno> {
    let domain = match sock.local_addr() {
        Ok(Some(std::net::SocketAddr::V6(_))) => libc::AF_INET6,
        _ => libc::AF_INET,
    };
    file_socket(sock, domain)
}

#[cfg(test)]
mod tests {
    use std::ptr;

    use exs::sim::{SimConfig, World};
    use exs::EventQueue;

    use super::*;
    use crate::errno::last_errno as errno;
    use crate::handles::QUEUES;

    /// `exs_connect` of `fd` to `to` on queue `qh`.
    fn connect(fd: c_int, to: std::net::SocketAddr, qh: exs_qhandle_t) -> c_int {
        let (a, len) = addr::encode(Some(to), libc::AF_INET);
        // SAFETY: `a` holds an address of `len` bytes.
        unsafe {
            exs_connect(
                fd,
                ptr::addr_of!(a).cast::<sockaddr>(),
                len as socklen_t,
                qh,
                ptr::null_mut(),
            )
        }
    }

    /// A second `exs_connect` while the first was under way was `EISCONN`; `connect(2)` says `EALREADY`. (On a
    /// world whose progress runs only when the test says, so that the first is still under way.)
    #[test]
    fn a_connect_while_one_is_under_way_is_ealready() {
        let world = World::new(SimConfig::default());
        let (a, b) = (world.host(), world.host());
        let l = Socket::new(&b, SockType::Stream).unwrap();
        l.bind(world.addr(1, 7004)).unwrap();
        let at = l.listen(4).unwrap();
        let eq = EventQueue::new(4).unwrap();
        let qh = QUEUES.insert_new(eq.clone()).unwrap();
        let fd = file_socket(Socket::new(&a, SockType::Stream).unwrap(), libc::AF_INET).unwrap();
        assert_eq!(connect(fd, at, qh), 0, "errno {}", errno());
        assert_eq!((connect(fd, at, qh), errno()), (-1, libc::EALREADY));
        world.run_until_idle(100_000);
        assert!(eq.next(None).unwrap().is_ok(), "the first connect goes on");
        assert_eq!((connect(fd, at, qh), errno()), (-1, libc::EISCONN));
        assert_eq!(exs_close(fd), 0);
        l.close().unwrap();
        world.run_until_idle(100_000);
        let _ = crate::queue::exs_qdelete(qh);
    }
}

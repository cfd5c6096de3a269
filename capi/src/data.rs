//! Moving bytes: `exs_send`, `exs_recv`, `exs_send_offset`, `exs_recv_offset`, `exs_sendfile` (seed 002,
//! Figure 2 and sections 4.2-4.4). Each function is one call of [`exs::Socket`].

use std::fs::File;
use std::os::fd::FromRawFd;

use exs::MsgFlags;
use libc::{c_int, c_void, off_t};

use crate::abi::{
    exs_mhandle_t, exs_qhandle_t, EXS_ACCESS_READ, EXS_ACCESS_WRITE, EXS_NOTIFY, EXS_PERSISTENT,
};
use crate::ctx_value;
use crate::errno::{call, Errno};
use crate::handles::SOCKETS;
use crate::memory::slice;
use crate::queue::start_on;

/// Flags that change nothing here: exs raises no `SIGPIPE`, never blocks, and every message is a record.
const HARMLESS: c_int = libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT | libc::MSG_EOR;

/// The exs flags of C `flags`, of which only `allowed` (and the harmless ones) may be set (`EINVAL` otherwise).
fn msg_flags(flags: c_int, allowed: c_int) -> Result<MsgFlags, Errno> {
    if flags & !(allowed | HARMLESS) != 0 {
        return Err(Errno(libc::EINVAL));
    }
    let f = [
        (libc::MSG_WAITALL, MsgFlags::WAITALL),
        (EXS_PERSISTENT, MsgFlags::PERSISTENT),
        (EXS_NOTIFY, MsgFlags::NOTIFY),
    ]
    .iter()
    .filter(|(c, _)| flags & c != 0)
    .fold(MsgFlags::NONE, |acc, (_, f)| acc | *f);
    Ok(f)
}

/// Sends the `len` bytes at `buf`, asynchronously (ES-API `exs_send`). `buf` lies in the memory `mh` registered (with
/// `EXS_ACCESS_READ`); the device reads it there, without a copy, so the program must not change those bytes until the
/// `EXS_EVT_SEND` event on `qh`. `flags`: `EXS_PERSISTENT` (with `EXS_NOTIFY`), seed 002 4.2; `MSG_NOSIGNAL`,
/// `MSG_DONTWAIT` and `MSG_EOR` are accepted and change nothing. On SOCK_SEQPACKET one send is one message. -1 with
/// `errno` if it could not start: `EBADF` (socket, memory or queue), `EINVAL` (the range is not inside the memory, a
/// flag, an empty range on SOCK_STREAM), `EACCES` (registered without read access), `ENOTCONN`, `EPIPE` (shut down, or
/// the peer closed), `EAGAIN` (the queue is full), `EBUSY` (the range is being received into).
#[no_mangle]
pub extern "C" fn exs_send(
    fd: c_int,
    buf: *const c_void,
    len: usize,
    flags: c_int,
    mh: exs_mhandle_t,
    qh: exs_qhandle_t,
    context: *mut c_void,
) -> c_int {
    call(|| {
        let s = SOCKETS.get(fd)?;
        let f = msg_flags(flags, EXS_PERSISTENT | EXS_NOTIFY)?;
        let range = slice(mh, buf, len, EXS_ACCESS_READ)?;
        start_on(qh, |eq| s.sock.send(eq, &range, f, ctx_value(context)))
    })
}

/// Receives into the `len` bytes at `buf`, asynchronously (ES-API `exs_recv`). `buf` lies in the memory `mh`
/// registered (with `EXS_ACCESS_WRITE`); the device writes it there, so the program must not touch those bytes
/// until the `EXS_EVT_RECV` event on `qh`, whose `exs_evt_bytes` says how many arrived (0 at end of stream, which
/// `EXS_EOF` in `exs_evt_flags` tells apart from an empty SOCK_SEQPACKET message).
/// `flags`: `MSG_WAITALL` (SOCK_STREAM: complete only when the buffer is full, or at end of stream),
/// `EXS_PERSISTENT` (seed 002 4.3: the peer's later sends write into this memory). -1 with `errno` as
/// `exs_send` (`EACCES`: registered without write access).
#[no_mangle]
pub extern "C" fn exs_recv(
    fd: c_int,
    buf: *mut c_void,
    len: usize,
    flags: c_int,
    mh: exs_mhandle_t,
    qh: exs_qhandle_t,
    context: *mut c_void,
) -> c_int {
    call(|| {
        let s = SOCKETS.get(fd)?;
        let f = msg_flags(flags, libc::MSG_WAITALL | EXS_PERSISTENT)?;
        let range = slice(mh, buf, len, EXS_ACCESS_WRITE)?;
        start_on(qh, |eq| s.sock.recv(eq, &range, f, ctx_value(context)))
    })
}

/// Writes the `len` bytes at `buf` into the peer's persistent receive at `offset` (UNH-EXS `exs_send_offset`,
/// seed 002 4.4), completing (`EXS_EVT_SEND`) once written. -1 with `errno` as `exs_send`, and `EINVAL` when the
/// peer has no persistent receive or `offset + len` is beyond it.
#[no_mangle]
pub extern "C" fn exs_send_offset(
    fd: c_int,
    buf: *const c_void,
    len: usize,
    flags: c_int,
    mh: exs_mhandle_t,
    offset: u64,
    qh: exs_qhandle_t,
    context: *mut c_void,
) -> c_int {
    call(|| {
        let s = SOCKETS.get(fd)?;
        let f = msg_flags(flags, 0)?;
        let range = slice(mh, buf, len, EXS_ACCESS_READ)?;
        start_on(qh, |eq| {
            s.sock
                .send_offset(eq, &range, offset, f, ctx_value(context))
        })
    })
}

/// Reads `len` bytes from `offset` of the peer's persistent send into `buf` (UNH-EXS `exs_recv_offset`, seed
/// 002 4.4): one RDMA read, nothing happens on the peer's CPU. `EXS_EVT_RECV` once read. -1 with `errno` as
/// `exs_recv`, and `EINVAL` when the peer has no persistent send or `offset + len` is beyond it.
#[no_mangle]
pub extern "C" fn exs_recv_offset(
    fd: c_int,
    buf: *mut c_void,
    len: usize,
    flags: c_int,
    mh: exs_mhandle_t,
    offset: u64,
    qh: exs_qhandle_t,
    context: *mut c_void,
) -> c_int {
    call(|| {
        let s = SOCKETS.get(fd)?;
        let f = msg_flags(flags, 0)?;
        let range = slice(mh, buf, len, EXS_ACCESS_WRITE)?;
        start_on(qh, |eq| {
            s.sock
                .recv_offset(eq, &range, offset, f, ctx_value(context))
        })
    })
}

/// Sends `count` bytes of the file `in_fd` from `offset` (ES-API `exs_sendfile`), completing with `EXS_EVT_SENDFILE`.
/// The bytes are read into memory exs registered itself (no mapping of the file); `in_fd` may be closed once the call
/// returns: a SOCK_SEQPACKET sendfile has read its range by then, and a SOCK_STREAM one reads through a copy of its
/// own, closed when its event comes. Closing a descriptor of a file releases the process's POSIX record locks
/// (`F_SETLK`) on it, so that copy ends them when the transfer ends: a lock held across a stream sendfile is an open
/// file description lock (`F_OFD_SETLK`) or `flock`. A range that goes past the end of a regular file is refused before
/// any memory is taken. On SOCK_SEQPACKET the message is the whole range, read and held in memory before the call
/// returns (the file may change afterwards). On SOCK_STREAM the file is read in 1 MiB chunks as earlier ones are sent,
/// so it must stay as it is until the event; sends made on the socket meanwhile go after the whole file, and a read
/// that fails part way (the file shrank) resets the connection: the event then has the read's errno, and
/// `exs_evt_bytes` counts the chunks that were delivered. `flags` must be 0. -1 with `errno`: `EBADF` (socket, queue,
/// or `in_fd` not open for reading), `EMFILE` (SOCK_STREAM: no descriptor left for exs's copy of `in_fd`), `EINVAL`
/// (negative offset, a flag, beyond the end of the file), `EISDIR`, `ESPIPE` (SOCK_SEQPACKET from a pipe or socket,
/// which cannot be read at an offset), `ENOTCONN`, `EAGAIN`, `ENOMEM`.
#[no_mangle]
pub extern "C" fn exs_sendfile(
    fd: c_int,
    in_fd: c_int,
    offset: off_t,
    count: usize,
    flags: c_int,
    qh: exs_qhandle_t,
    context: *mut c_void,
) -> c_int {
    call(|| {
        let s = SOCKETS.get(fd)?;
        let offset = u64::try_from(offset).map_err(|_| Errno(libc::EINVAL))?;
        if flags != 0 {
            return Err(Errno(libc::EINVAL));
        }
        // SAFETY: fcntl(F_GETFD) only reads the descriptor number; on any number it fails cleanly.
        if unsafe { libc::fcntl(in_fd, libc::F_GETFD) } < 0 {
            return Err(Errno(libc::EBADF));
        }
        // The caller's descriptor itself, borrowed for the call and never closed here: closing any descriptor of a
        // file releases the process's POSIX record locks on it, and a copy made and closed here dropped the
        // caller's locks when the call returned (review finding). A SOCK_STREAM sendfile keeps a copy of its own
        // until its event (see the header).
        // SAFETY: `in_fd` is open (checked above) and stays open for the call (the caller's, by the call's
        // contract); ManuallyDrop keeps the File from closing it.
        let file = std::mem::ManuallyDrop::new(unsafe { File::from_raw_fd(in_fd) });
        start_on(qh, |eq| {
            s.sock
                .sendfile(eq, &file, offset, count, ctx_value(context))
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_translate_and_unknown_ones_are_refused() {
        let persistent = msg_flags(
            EXS_PERSISTENT | EXS_NOTIFY | libc::MSG_NOSIGNAL,
            EXS_PERSISTENT | EXS_NOTIFY,
        );
        assert_eq!(persistent, Ok(MsgFlags::PERSISTENT | MsgFlags::NOTIFY));
        assert_eq!(
            msg_flags(libc::MSG_WAITALL, libc::MSG_WAITALL),
            Ok(MsgFlags::WAITALL)
        );
        assert_eq!(
            msg_flags(libc::MSG_WAITALL, EXS_PERSISTENT),
            Err(Errno(libc::EINVAL))
        );
        assert_eq!(msg_flags(libc::MSG_OOB, 0), Err(Errno(libc::EINVAL)));
        // exs's own bits stay clear of every MSG_* flag a C program may pass.
        for m in [
            libc::MSG_OOB,
            libc::MSG_PEEK,
            libc::MSG_DONTROUTE,
            libc::MSG_TRUNC,
            libc::MSG_DONTWAIT,
            libc::MSG_EOR,
            libc::MSG_WAITALL,
            libc::MSG_NOSIGNAL,
            libc::MSG_MORE,
            libc::MSG_WAITFORONE,
            libc::MSG_ZEROCOPY,
            libc::MSG_FASTOPEN,
            libc::MSG_CMSG_CLOEXEC,
        ] {
            assert_eq!(m & (EXS_PERSISTENT | EXS_NOTIFY), 0, "{m:#x}");
        }
    }
}

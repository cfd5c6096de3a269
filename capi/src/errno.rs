//! What a C caller sees: -1 and `errno`, the one a socket user expects for each typed error of exs, and no
//! panic across the boundary.

use std::io::ErrorKind;
use std::panic::{catch_unwind, AssertUnwindSafe};

use exs::{
    AcceptError, BufferError, CloseError, ConnectError, DequeueError, FileError, InitError,
    MemoryError, OpError, OptionError, PollError, QueueFull, RecvError, SendError, SocketError,
    StateError, TransportError,
};
use libc::c_int;

/// An errno value: the error half of every call's result.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Errno(pub(crate) c_int);

/// Runs the body of one C call: its value, or -1 with `errno` set. A panic (a bug in exs) is caught here and
/// reported as `EIO`: unwinding into C is undefined behaviour, aborting would take the caller's process down.
pub(crate) fn call(body: impl FnOnce() -> Result<c_int, Errno>) -> c_int {
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(v)) => v,
        Ok(Err(Errno(e))) => {
            set_errno(e);
            -1
        }
        Err(_) => {
            set_errno(libc::EIO);
            -1
        }
    }
}

fn set_errno(e: c_int) {
    // SAFETY: `__errno_location` returns the calling thread's errno, valid for the thread's lifetime.
    unsafe { *libc::__errno_location() = e };
}

/// The errno of an error.
pub(crate) trait ToErrno {
    fn errno(&self) -> c_int;
}

/// The calling thread's `errno`, as a C caller reads it after a call (for the unit tests).
#[cfg(test)]
pub(crate) fn last_errno() -> c_int {
    std::io::Error::last_os_error().raw_os_error().unwrap_or(0)
}

impl<E: ToErrno> From<E> for Errno {
    fn from(e: E) -> Errno {
        Errno(e.errno())
    }
}

/// The closest errno of an `io::ErrorKind` (for errors that carry only a kind).
pub(crate) fn kind_errno(kind: ErrorKind) -> c_int {
    use libc::*;
    match kind {
        ErrorKind::NotFound => ENOENT,
        ErrorKind::PermissionDenied => EACCES,
        ErrorKind::ConnectionRefused => ECONNREFUSED,
        ErrorKind::ConnectionReset => ECONNRESET,
        ErrorKind::HostUnreachable => EHOSTUNREACH,
        ErrorKind::NetworkUnreachable => ENETUNREACH,
        ErrorKind::ConnectionAborted => ECONNABORTED,
        ErrorKind::NotConnected => ENOTCONN,
        ErrorKind::AddrInUse => EADDRINUSE,
        ErrorKind::AddrNotAvailable => EADDRNOTAVAIL,
        ErrorKind::NetworkDown => ENETDOWN,
        ErrorKind::BrokenPipe => EPIPE,
        ErrorKind::AlreadyExists => EEXIST,
        ErrorKind::WouldBlock => EAGAIN,
        ErrorKind::InvalidInput | ErrorKind::InvalidData => EINVAL,
        ErrorKind::TimedOut => ETIMEDOUT,
        ErrorKind::Interrupted => EINTR,
        ErrorKind::Unsupported => EOPNOTSUPP,
        ErrorKind::OutOfMemory => ENOMEM,
        ErrorKind::ResourceBusy => EBUSY,
        ErrorKind::UnexpectedEof => EINVAL,
        _ => EIO,
    }
}

impl ToErrno for StateError {
    fn errno(&self) -> c_int {
        match self {
            StateError::InvalidSocket => libc::EBADF,
            StateError::NotConnected => libc::ENOTCONN,
            StateError::AlreadyConnected => libc::EISCONN,
            StateError::Connecting => libc::EALREADY,
            StateError::NotListening | StateError::AlreadyBound => libc::EINVAL,
            StateError::NotBound => libc::EDESTADDRREQ,
            // A TCP listener's send and recv (the calls that meet this) are ENOTCONN.
            StateError::Listening => libc::ENOTCONN,
            StateError::WrongType(_) => libc::EOPNOTSUPP,
            StateError::Shutdown => libc::EPIPE,
            StateError::ConnectionDown(op) => op.errno(),
            StateError::Persistent(_) | StateError::OffsetOutOfRange { .. } => libc::EINVAL,
            other => kind_errno(std::io::Error::from(other.clone()).kind()),
        }
    }
}

impl ToErrno for OpError {
    fn errno(&self) -> c_int {
        match self {
            OpError::Cancelled => libc::ECANCELED,
            OpError::Aborted => libc::ECONNABORTED,
            OpError::PeerClosed => libc::EPIPE,
            OpError::ConnectionReset => libc::ECONNRESET,
            OpError::PeerMisbehaved(_) => libc::EPROTO,
            OpError::Refused => libc::ECONNREFUSED,
            OpError::TimedOut => libc::ETIMEDOUT,
            OpError::Unreachable => libc::EHOSTUNREACH,
            OpError::Transport(t) => t.errno(),
            OpError::ContextFailed(_) => libc::EIO,
            OpError::PersistentEnded => libc::ENODATA,
            OpError::File(f) => f.errno(),
            other => kind_errno(other.io_kind()),
        }
    }
}

/// Errnos of a failed system or provider call that reach C as they are: what they say of the call is what they
/// say to the caller.
const PASSED_THROUGH: [c_int; 8] = [
    libc::EFAULT,
    libc::EACCES,
    libc::EPERM,
    libc::ENOMEM,
    libc::ENOSPC,
    libc::ENOBUFS,
    libc::EMFILE,
    libc::ENFILE,
];

impl ToErrno for TransportError {
    fn errno(&self) -> c_int {
        match self {
            TransportError::NotFound { .. } => libc::ENODEV,
            TransportError::Resource(_) => libc::ENOMEM,
            TransportError::NoEndpoint => libc::ENOTCONN,
            TransportError::Backend { error, .. } => error.errno(),
            // The call's own code where it is an errno (libfabric's negative codes below 256 are errnos too):
            // `EFAULT` from a registration of memory the device cannot use says more than its kind's `EIO`.
            // Only codes the C API gives no meaning of its own (`EBADF` is a bad handle here, `ENODEV` no
            // `exs_init`, `EBUSY` "in use, nothing changed", and so on): the rest go by their kind.
            TransportError::Os { call, kind, .. } => {
                match i32::try_from(call.code.unsigned_abs()) {
                    Ok(code) if PASSED_THROUGH.contains(&code) => code,
                    _ => kind_errno(*kind),
                }
            }
            other => kind_errno(other.io_kind()),
        }
    }
}

impl ToErrno for BufferError {
    fn errno(&self) -> c_int {
        match self {
            BufferError::Busy(_) => libc::EBUSY,
            _ => libc::EINVAL,
        }
    }
}

impl ToErrno for MemoryError {
    fn errno(&self) -> c_int {
        match self {
            MemoryError::InUse { .. } => libc::EBUSY,
            MemoryError::Transport(t) => t.errno(),
            MemoryError::NoMemory { .. } => libc::ENOMEM,
            MemoryError::Kept => libc::EIO,
            _ => libc::EINVAL,
        }
    }
}

/// A read of `exs_sendfile`'s file: the system call's own code (`EBADF` for a descriptor not open for reading,
/// `EISDIR`, `EMFILE`), else its kind's (`EINVAL` for a range past the end of the file).
impl ToErrno for FileError {
    fn errno(&self) -> c_int {
        self.os_error.unwrap_or_else(|| kind_errno(self.kind))
    }
}

impl ToErrno for OptionError {
    fn errno(&self) -> c_int {
        match self {
            // setsockopt's errno for an option that cannot change once connected.
            OptionError::Locked(_) => libc::EISCONN,
            OptionError::State(s) => s.errno(),
            _ => libc::EINVAL,
        }
    }
}

impl ToErrno for QueueFull {
    fn errno(&self) -> c_int {
        libc::EAGAIN
    }
}

impl ToErrno for DequeueError {
    fn errno(&self) -> c_int {
        match self {
            DequeueError::TimedOut => libc::ETIMEDOUT,
            DequeueError::Stalled { .. } => libc::EDEADLK,
            _ => libc::EINVAL,
        }
    }
}

impl ToErrno for InitError {
    fn errno(&self) -> c_int {
        libc::EINVAL
    }
}

/// The errno of each per-operation error: its part's, or its `io::ErrorKind`'s for parts added later.
macro_rules! op_errno {
    ($($ty:ident { $($var:ident),* })*) => {$(
        impl ToErrno for $ty {
            fn errno(&self) -> c_int {
                match self {
                    $($ty::$var(e) => e.errno(),)*
                    other => kind_errno(other.io_kind()),
                }
            }
        }
    )*};
}

op_errno! {
    SendError { State, Buffer, Queue, Option, Transport, Memory, File }
    RecvError { State, Buffer, Queue, Option, Transport }
    ConnectError { State, Queue, Transport }
    AcceptError { State, Queue, Transport }
    SocketError { State, Transport }
    CloseError { State, Queue }
    PollError { State, Queue }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A stream sendfile whose file could not be read part way reported the read's failure in its event as a
    /// transport error (`EINVAL`, or `EIO` for a code with no `io::ErrorKind`): now the event has the read's own
    /// code, as the call does.
    #[test]
    fn a_file_read_that_failed_gives_its_own_code_in_the_event_and_the_call() {
        let f = FileError::from(std::io::Error::from_raw_os_error(libc::ESTALE));
        assert_eq!(OpError::File(f.clone()).errno(), libc::ESTALE);
        assert_eq!(SendError::File(f).errno(), libc::ESTALE);
    }

    /// A registration the device refused (`ibv_reg_mr` of read-only memory: `EFAULT`) reached C as `EIO`, which
    /// the API keeps for a panic: the code's kind has no name in `std::io`. Now the call's own code is the errno.
    #[test]
    fn a_failed_call_gives_its_own_code_as_the_errno() {
        let reg = TransportError::os(
            "ibv_reg_mr",
            std::io::Error::from_raw_os_error(libc::EFAULT),
        );
        assert_eq!(reg.errno(), libc::EFAULT);
        assert_eq!(MemoryError::Transport(reg).errno(), libc::EFAULT);
        // A libfabric code is negative; one with no errno behind it (FI_EOTHER) falls back on its kind.
        let fi = |code: i64, kind| TransportError::Os {
            call: exs::transport::CallError {
                call: "fi_mr_reg".into(),
                code,
            },
            kind,
            message: String::new(),
        };
        assert_eq!(
            fi(-libc::EACCES as i64, std::io::ErrorKind::PermissionDenied).errno(),
            libc::EACCES
        );
        assert_eq!(
            fi(-256, std::io::ErrorKind::OutOfMemory).errno(),
            libc::ENOMEM
        );
        // A code the C API gives a meaning of its own goes by its kind: `EBADF` here is a bad handle.
        assert_eq!(
            fi(-libc::EBADF as i64, std::io::ErrorKind::Other).errno(),
            libc::EIO
        );
        assert_eq!(
            fi(-libc::ENODATA as i64, std::io::ErrorKind::NotFound).errno(),
            libc::ENOENT
        );
    }

    #[test]
    fn a_socket_user_gets_the_errno_of_each_error() {
        assert_eq!(
            SendError::from(StateError::NotConnected).errno(),
            libc::ENOTCONN
        );
        assert_eq!(
            RecvError::from(QueueFull { depth: 1 }).errno(),
            libc::EAGAIN
        );
        let busy = BufferError::Busy(exs_dma::DmaError::InUse { leases: 1 });
        assert_eq!(SendError::from(busy).errno(), libc::EBUSY);
        let outside = BufferError::OutOfRegion {
            start: 0,
            end: 9,
            len: 8,
        };
        assert_eq!(RecvError::from(outside).errno(), libc::EINVAL);
        assert_eq!(MemoryError::InUse { leases: 1 }.errno(), libc::EBUSY);
        assert_eq!(MemoryError::Kept.errno(), libc::EIO);
        // A work request the device failed is not a bad argument of the caller's (it was EINVAL).
        let failed = OpError::from(exs::transport::WcError::Other(
            "local QP operation error".into(),
        ));
        assert_eq!(failed.errno(), libc::EIO);
        assert_eq!(OpError::Refused.errno(), libc::ECONNREFUSED);
        assert_eq!(OpError::Cancelled.errno(), libc::ECANCELED);
        let down = StateError::ConnectionDown(OpError::ConnectionReset);
        assert_eq!(SendError::from(down).errno(), libc::ECONNRESET);
        assert_eq!(SendError::from(StateError::Shutdown).errno(), libc::EPIPE);
        assert_eq!(
            CloseError::from(StateError::InvalidSocket).errno(),
            libc::EBADF
        );
        assert_eq!(OptionError::Locked("send_credits").errno(), libc::EISCONN);
        let nomem = TransportError::Resource("queue pairs".into());
        assert_eq!(ConnectError::from(nomem).errno(), libc::ENOMEM);
        let taken = TransportError::AddrInUse("127.0.0.1:1".parse().unwrap());
        assert_eq!(SocketError::from(taken).errno(), libc::EADDRINUSE);
    }

    #[test]
    fn a_panic_is_reported_as_eio_and_never_unwinds_into_c() {
        let r = call(|| panic!("a bug in exs"));
        assert_eq!(r, -1);
        assert_eq!(
            std::io::Error::last_os_error().raw_os_error(),
            Some(libc::EIO)
        );
        assert_eq!(call(|| Err(Errno(libc::EBADF))), -1);
        assert_eq!(
            std::io::Error::last_os_error().raw_os_error(),
            Some(libc::EBADF)
        );
        assert_eq!(call(|| Ok(7)), 7);
    }
}

//! `exs_fcntl` (UNH-EXS): socket options (seed 002 3.2 credits, 4.1 `small_packet_max_size`, seed 001's stream
//! buffer, ...), `SO_ERROR`, ending persistent operations, and `F_GETFL`/`F_SETFL` for code that sets
//! `O_NONBLOCK`. The variadic entry point is C (`fcntl.c`): it reads the argument of the commands that take one and
//! calls [`exs_fcntl_int`], which is public too, for callers that cannot call a C-variadic function.

use exs::SocketOptions;
use libc::c_int;

use crate::abi::*;
use crate::errno::{call, Errno, ToErrno};
use crate::handles::SOCKETS;

/// What each `EXS_F_GET_*` reads and each `EXS_F_SET_*` (the next number) sets.
#[derive(Clone, Copy, Debug)]
struct Opt {
    get: c_int,
    read: fn(&SocketOptions) -> i64,
    set: fn(SocketOptions, c_int) -> Option<SocketOptions>,
}

/// One row per option: its getter command, how to read it, how to set it from an int (`None`: out of range).
const OPTIONS: [Opt; 8] = [
    Opt {
        get: EXS_F_GET_SEND_CREDITS,
        read: |o| o.send_credits.into(),
        set: |o, v| u16::try_from(v).ok().map(|v| o.with_send_credits(v)),
    },
    Opt {
        get: EXS_F_GET_RECV_CREDITS,
        read: |o| o.recv_credits.into(),
        set: |o, v| u16::try_from(v).ok().map(|v| o.with_recv_credits(v)),
    },
    Opt {
        get: EXS_F_GET_SMALL_PACKET_MAX_SIZE,
        read: |o| o.small_packet_max_size.into(),
        set: |o, v| {
            u32::try_from(v)
                .ok()
                .map(|v| o.with_small_packet_max_size(v))
        },
    },
    Opt {
        get: EXS_F_GET_STREAM_BUFFER_SIZE,
        read: |o| o.stream_buffer_size.into(),
        set: |o, v| u32::try_from(v).ok().map(|v| o.with_stream_buffer_size(v)),
    },
    Opt {
        get: EXS_F_GET_STREAM_BUFFER_EAGER,
        read: |o| o.stream_buffer_eager.into(),
        set: |o, v| Some(o.with_stream_buffer_eager(v != 0)),
    },
    Opt {
        get: EXS_F_GET_CONTROL_WINDOW,
        read: |o| o.control_window.into(),
        set: |o, v| u16::try_from(v).ok().map(|v| o.with_control_window(v)),
    },
    Opt {
        get: EXS_F_GET_BACKLOG,
        read: |o| o.backlog.into(),
        set: |o, v| u32::try_from(v).ok().map(|v| o.with_backlog(v)),
    },
    Opt {
        get: EXS_F_GET_COALESCE,
        read: |o| o.coalesce.into(),
        set: |o, v| Some(o.with_coalesce(v != 0)),
    },
];

/// `exs_fcntl` with its argument as a plain `int` (ignored by the commands that take none), for callers that
/// cannot call a C-variadic function (Go's cgo, some foreign-function interfaces). Same results and `errno`s.
#[no_mangle]
pub extern "C" fn exs_fcntl_int(fd: c_int, cmd: c_int, arg: c_int) -> c_int {
    call(|| {
        let s = SOCKETS.get(fd)?;
        match cmd {
            // Every exs call is asynchronous already: O_NONBLOCK is always in effect.
            libc::F_GETFL => Ok(libc::O_RDWR | libc::O_NONBLOCK),
            libc::F_SETFL if arg & libc::O_NONBLOCK != 0 => Ok(0),
            EXS_F_GETERROR => Ok(s.sock.error()?.map_or(0, |e| e.errno())),
            EXS_F_END_PERSISTENT => {
                s.sock.end_persistent()?;
                Ok(0)
            }
            _ => {
                if let Some(o) = OPTIONS.iter().find(|o| o.get == cmd) {
                    let v = (o.read)(&s.sock.options()?);
                    return c_int::try_from(v).map_err(|_| Errno(libc::EOVERFLOW));
                }
                let o = OPTIONS
                    .iter()
                    .find(|o| o.get + 1 == cmd)
                    .ok_or(Errno(libc::EINVAL))?;
                // Read, changed and written in one step (two threads setting different options of one socket at
                // once each wrote the other's field back to its old value).
                let mut in_range = true;
                s.sock.update_options(|cur| {
                    (o.set)(cur, arg).unwrap_or_else(|| {
                        in_range = false;
                        cur
                    })
                })?;
                if !in_range {
                    return Err(Errno(libc::EINVAL));
                }
                Ok(0)
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// fcntl.c reads an argument for F_SETFL and for the odd offsets of `EXS_F_GET_SEND_CREDITS..=EXS_F_SET_COALESCE`
    /// (it cannot see this table). Reading one for a command given none is undefined behaviour, and not reading one
    /// for a setter sets 0: so the setters of the table must be exactly those offsets.
    #[test]
    fn the_variadic_entry_reads_an_argument_for_exactly_the_setters() {
        let range: Vec<c_int> = (EXS_F_GET_SEND_CREDITS..=EXS_F_SET_COALESCE).collect();
        let setters: Vec<c_int> = OPTIONS.iter().map(|o| o.get + 1).collect();
        let odd: Vec<c_int> = range
            .iter()
            .copied()
            .filter(|c| (c - EXS_F_GET_SEND_CREDITS) % 2 == 1)
            .collect();
        assert_eq!(setters, odd, "the option table against fcntl.c's rule");
        let getters: Vec<c_int> = OPTIONS.iter().map(|o| o.get).collect();
        assert!(getters
            .iter()
            .all(|g| (g - EXS_F_GET_SEND_CREDITS) % 2 == 0));
        for other in [EXS_F_GETERROR, EXS_F_END_PERSISTENT, libc::F_GETFL] {
            assert!(!range.contains(&other), "{other:#x} takes no argument");
        }
    }
}

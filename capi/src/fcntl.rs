//! `exs_fcntl` (UNH-EXS): socket options (seed 002 3.2 credits, 4.1 `small_packet_max_size`, seed 001's stream
//! buffer, ...), `SO_ERROR`, ending persistent operations, and `F_GETFL`/`F_SETFL` for code that sets
//! `O_NONBLOCK`. The variadic entry point is C (`fcntl.c`); it asks [`exs_internal_fcntl_takes_arg`] whether to
//! read an argument, then calls [`exs_internal_fcntl`].

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

/// Whether `cmd` takes an `int` argument (fcntl.c reads one only then).
#[no_mangle]
pub extern "C" fn exs_internal_fcntl_takes_arg(cmd: c_int) -> c_int {
    let setter = OPTIONS.iter().any(|o| o.get + 1 == cmd);
    c_int::from(setter || cmd == libc::F_SETFL)
}

/// `exs_fcntl(fd, cmd, arg)` once fcntl.c has read `arg` (0 for commands that take none).
#[no_mangle]
pub extern "C" fn exs_internal_fcntl(fd: c_int, cmd: c_int, arg: c_int) -> c_int {
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

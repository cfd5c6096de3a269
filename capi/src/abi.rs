//! The types and constants of exs.h: the ES-API's shapes (seed 002, Figure 2) where the seed names them, and
//! socket conventions (errno, `MSG_*`, `POLL*`, `struct sockaddr`) where it is silent.

use libc::{c_int, c_short, c_void, ssize_t};

/// The ES-API version this library implements: pass it to `exs_init`.
pub const EXS_VERSION: c_int = 1;

/// An event queue, from `exs_qcreate`; -1 is never a valid one.
pub type exs_qhandle_t = c_int;

/// Registered memory, from `exs_mregister`; -1 is never a valid one.
pub type exs_mhandle_t = c_int;

/// `exs_connect` finished; on success the socket is connected.
pub const EXS_EVT_CONNECT: c_int = 1;
/// `exs_accept` finished; on success `exs_evt_accepted` is the new connected socket.
pub const EXS_EVT_ACCEPT: c_int = 2;
/// `exs_send` or `exs_send_offset` finished; `exs_evt_bytes` were sent.
pub const EXS_EVT_SEND: c_int = 3;
/// `exs_recv` or `exs_recv_offset` finished; `exs_evt_bytes` were placed in the buffer. End of stream is 0
/// bytes with `EXS_EOF` in `exs_evt_flags`; on SOCK_SEQPACKET an empty message is 0 bytes with `MSG_EOR`.
pub const EXS_EVT_RECV: c_int = 4;
/// `exs_sendfile` finished; `exs_evt_bytes` of the file were sent.
pub const EXS_EVT_SENDFILE: c_int = 5;
/// `exs_poll` found the socket ready: `exs_evt_revents` says for what.
pub const EXS_EVT_POLL: c_int = 6;
/// `exs_shutdown` finished: every earlier send has completed and the peer will see end-of-stream.
pub const EXS_EVT_SHUTDOWN: c_int = 7;
/// The peer read a persistent send made with `EXS_NOTIFY` (seed 002, 4.2); `exs_evt_bytes` is the number of
/// reads this event reports (several when the queue was full).
pub const EXS_EVT_READ_NOTIFY: c_int = 8;

/// Send/recv flag: a persistent send or receive (seed 002, 4.2 and 4.3). A persistent send's memory stays open
/// to every later receive of the peer, which pulls its current contents; a persistent receive's memory takes
/// every later send of the peer. Its event comes when it is ended (`EXS_F_END_PERSISTENT`, or a close).
/// SOCK_SEQPACKET only; only one side of a connection may be persistent. A bit no `MSG_*` flag uses.
pub const EXS_PERSISTENT: c_int = 0x0010_0000;
/// Send flag, with `EXS_PERSISTENT`: an `EXS_EVT_READ_NOTIFY` event each time the peer has read the memory
/// (seed 002, 4.2: the double-buffered transaction exchange).
pub const EXS_NOTIFY: c_int = 0x0020_0000;

/// `exs_evt_flags` of an `EXS_EVT_RECV`: end of stream (the peer shut down writing, or closed): no bytes, and
/// no receive after it takes any. A bit no `MSG_*` flag uses.
pub const EXS_EOF: c_int = 0x0040_0000;

/// `exs_mregister` access: the memory may be sent from (the device reads it).
pub const EXS_ACCESS_READ: c_int = 1;
/// `exs_mregister` access: the memory may be received into (the device writes it).
pub const EXS_ACCESS_WRITE: c_int = 2;

/// `POLLRDNORM` (`exs_poll`, `exs_evt_revents`): the same bit, for strict C programs, which `<poll.h>` gives it
/// only with `_XOPEN_SOURCE` or `_GNU_SOURCE`.
pub const EXS_POLLRDNORM: c_short = 0x040;
/// `POLLWRNORM`, for the same programs.
pub const EXS_POLLWRNORM: c_short = 0x100;
/// `POLLRDHUP` (Linux), which `<poll.h>` gives only with `_GNU_SOURCE`.
pub const EXS_POLLRDHUP: c_short = 0x2000;

/// `exs_qwait_mode`: poll once, spin briefly when recent waits were short (no longer than a sleep and a wake-up
/// would cost), then sleep until the number of events still missing has arrived (seed 004).
/// The default.
pub const EXS_WAIT_ADAPTIVE: c_int = 0;
/// `exs_qwait_mode`: sleep, and wake on every event.
pub const EXS_WAIT_BLOCK: c_int = 1;
/// `exs_qwait_mode`: never sleep; the waiting thread runs the protocol itself (lowest latency, a core busy).
pub const EXS_WAIT_BUSY: c_int = 2;

/// `exs_fcntl`: the errno of why the connection went down (like `SO_ERROR`), 0 while it is up.
pub const EXS_F_GETERROR: c_int = 0x4500;
/// `exs_fcntl`: ends this side's persistent send and receive; their events follow once the peer let go.
pub const EXS_F_END_PERSISTENT: c_int = 0x4502;
/// `exs_fcntl`: advertisements this side may have outstanding (seed 002, 3.2 "send_credits"), 1..4096.
pub const EXS_F_GET_SEND_CREDITS: c_int = 0x4510;
/// `exs_fcntl(fd, EXS_F_SET_SEND_CREDITS, int)`: before connect (negotiated).
pub const EXS_F_SET_SEND_CREDITS: c_int = 0x4511;
/// `exs_fcntl`: advertisements accepted outstanding from the peer ("recv_credits"), 1..4096.
pub const EXS_F_GET_RECV_CREDITS: c_int = 0x4512;
/// `exs_fcntl(fd, EXS_F_SET_RECV_CREDITS, int)`: before connect (negotiated).
pub const EXS_F_SET_RECV_CREDITS: c_int = 0x4513;
/// `exs_fcntl`: sends up to this many bytes travel inside the advertisement (seed 002, 4.1), 0..32768.
pub const EXS_F_GET_SMALL_PACKET_MAX_SIZE: c_int = 0x4514;
/// `exs_fcntl(fd, EXS_F_SET_SMALL_PACKET_MAX_SIZE, int)`: before connect.
pub const EXS_F_SET_SMALL_PACKET_MAX_SIZE: c_int = 0x4515;
/// `exs_fcntl`: SOCK_STREAM, bytes of the intermediate stream buffer (seed 001), 64..2^30.
pub const EXS_F_GET_STREAM_BUFFER_SIZE: c_int = 0x4516;
/// `exs_fcntl(fd, EXS_F_SET_STREAM_BUFFER_SIZE, int)`: before connect.
pub const EXS_F_SET_STREAM_BUFFER_SIZE: c_int = 0x4517;
/// `exs_fcntl`: SOCK_STREAM, whether the stream buffer is made at connection time (1) or on first need (0).
pub const EXS_F_GET_STREAM_BUFFER_EAGER: c_int = 0x4518;
/// `exs_fcntl(fd, EXS_F_SET_STREAM_BUFFER_EAGER, int)`: before connect.
pub const EXS_F_SET_STREAM_BUFFER_EAGER: c_int = 0x4519;
/// `exs_fcntl`: control receive buffers per connection (0: sized from the credits; else 4..4096).
pub const EXS_F_GET_CONTROL_WINDOW: c_int = 0x451a;
/// `exs_fcntl(fd, EXS_F_SET_CONTROL_WINDOW, int)`: before connect.
pub const EXS_F_SET_CONTROL_WINDOW: c_int = 0x451b;
/// `exs_fcntl`: listening sockets, connection requests held while no accept is pending, 1..65535.
pub const EXS_F_GET_BACKLOG: c_int = 0x451c;
/// `exs_fcntl(fd, EXS_F_SET_BACKLOG, int)`.
pub const EXS_F_SET_BACKLOG: c_int = 0x451d;
/// `exs_fcntl`: whether control messages queued behind one in flight leave together (1, the default).
pub const EXS_F_GET_COALESCE: c_int = 0x451e;
/// `exs_fcntl(fd, EXS_F_SET_COALESCE, int)`: at any time on a SOCK_STREAM socket (0 there is `TCP_NODELAY`: small
/// writes leave at once); before connect on a SOCK_SEQPACKET one.
pub const EXS_F_SET_COALESCE: c_int = 0x451f;

/// One completed operation, filled in by `exs_qdequeue`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct exs_event {
    /// `EXS_EVT_CONNECT`, `EXS_EVT_ACCEPT`, `EXS_EVT_SEND`, `EXS_EVT_RECV`, `EXS_EVT_SENDFILE`, `EXS_EVT_POLL`,
    /// `EXS_EVT_SHUTDOWN`, `EXS_EVT_READ_NOTIFY`.
    pub exs_evt_type: c_int,
    /// 0, or the errno of the failed operation (`ECONNREFUSED`, `ECONNRESET`, `ECANCELED` for an operation a
    /// close ended before any of it reached the peer, `ECONNABORTED` after part of it may have, `EPROTO` for a
    /// peer that broke the protocol, ...).
    pub exs_evt_errno: c_int,
    /// The context pointer given with the operation.
    pub exs_evt_context: *mut c_void,
    /// The socket the operation was on.
    pub exs_evt_fd: c_int,
    /// Bytes moved by a send, receive or sendfile; 0 at end of stream (with `EXS_EOF`) and for an empty
    /// SOCK_SEQPACKET message (with `MSG_EOR`).
    pub exs_evt_bytes: ssize_t,
    /// `EXS_EVT_ACCEPT`: the new connected socket (-1 otherwise).
    pub exs_evt_accepted: c_int,
    /// `MSG_EOR`: a SOCK_SEQPACKET receive holds a whole message (not `exs_recv_offset`'s range of the peer's
    /// persistent send); `MSG_TRUNC`: the message was longer than the buffer and the rest was discarded;
    /// `EXS_EOF`: the receive took the end of stream.
    pub exs_evt_flags: c_int,
    /// `EXS_EVT_POLL`: `POLLIN | POLLRDNORM`, `POLLOUT | POLLWRNORM`, `POLLERR`, `POLLHUP | POLLRDHUP`.
    pub exs_evt_revents: c_short,
}

/// One completed operation (see `struct exs_event`).
pub type exs_event_t = exs_event;

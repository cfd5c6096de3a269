//! The errno of a call a socket's state refuses, through the C functions, on the simulated fabric
//! (`EXS_BACKEND=sim`): what a sockets programmer's code checks for.

use std::net::SocketAddr;
use std::ptr;

use exs_capi::abi::{exs_event_t, EXS_ACCESS_READ, EXS_ACCESS_WRITE};
use exs_capi::data::{exs_recv, exs_send};
use exs_capi::memory::{exs_mderegister, exs_mregister};
use exs_capi::queue::{exs_qcreate, exs_qdelete, exs_qdequeue};
use exs_capi::socket::{exs_bind, exs_close, exs_connect, exs_listen, exs_poll, exs_socket};
use libc::{c_int, c_void, sockaddr, sockaddr_in, socklen_t};

mod common;
use common::{errno, init_sim};

fn sockaddr_of(a: SocketAddr) -> sockaddr_in {
    let SocketAddr::V4(a) = a else {
        panic!("the simulator's addresses are IPv4")
    };
    sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: a.port().to_be(),
        sin_addr: libc::in_addr {
            s_addr: u32::from(*a.ip()).to_be(),
        },
        sin_zero: [0; 8],
    }
}

const LEN: socklen_t = std::mem::size_of::<sockaddr_in>() as socklen_t;

fn bind(fd: c_int, a: &sockaddr_in) -> c_int {
    // SAFETY: `a` is a whole sockaddr_in.
    unsafe { exs_bind(fd, ptr::from_ref(a).cast::<sockaddr>(), LEN) }
}

fn connect(fd: c_int, a: &sockaddr_in, qh: c_int) -> c_int {
    // SAFETY: `a` is a whole sockaddr_in.
    unsafe {
        exs_connect(
            fd,
            ptr::from_ref(a).cast::<sockaddr>(),
            LEN,
            qh,
            ptr::null_mut(),
        )
    }
}

/// The errno values these calls gave were not the ones the header promised or `bind(2)`, `listen(2)`,
/// `connect(2)`, `send(2)` and `recv(2)` give: `exs_bind` of a listening socket was `EISCONN` (`EINVAL`), a
/// second `exs_listen` failed with `EISCONN` (it changes the backlog), and `exs_send` or `exs_recv` on a listener
/// `EOPNOTSUPP` (`ENOTCONN`). (`EALREADY` for a connect while one is under way is a unit test of `socket.rs`:
/// here the context's progress thread may finish the first connect at once.)
#[test]
fn calls_a_sockets_state_refuses_give_the_errno_of_their_sockets_call() {
    init_sim();
    let q = exs_qcreate(8);
    let mut mem = vec![0u8; 4096];
    // SAFETY: `mem` is readable and writable for its length and outlives the registration (deregistered below).
    let m = unsafe {
        exs_mregister(
            mem.as_mut_ptr().cast::<c_void>(),
            mem.len(),
            EXS_ACCESS_READ | EXS_ACCESS_WRITE,
        )
    };
    assert!(q > 0 && m > 0, "errno {}", errno());
    let at = sockaddr_of(exs::sim_addr(0, 7100));
    let l = exs_socket(libc::AF_INET, libc::SOCK_STREAM, 0);
    assert_eq!(bind(l, &at), 0, "errno {}", errno());
    assert_eq!(exs_listen(l, 4), 0, "errno {}", errno());
    assert_eq!(
        exs_listen(l, 8),
        0,
        "listening again sets the backlog: errno {}",
        errno()
    );
    assert_eq!(
        (bind(l, &at), errno()),
        (-1, libc::EINVAL),
        "bind of a listener"
    );
    assert_eq!(
        (connect(l, &at, q), errno()),
        (-1, libc::EISCONN),
        "connect of a listener"
    );
    let buf = mem.as_mut_ptr().cast::<c_void>();
    let send = exs_send(l, buf, 16, 0, m, q, ptr::null_mut());
    assert_eq!((send, errno()), (-1, libc::ENOTCONN), "send on a listener");
    let recv = exs_recv(l, buf, 16, 0, m, q, ptr::null_mut());
    assert_eq!((recv, errno()), (-1, libc::ENOTCONN), "recv on a listener");

    let c = exs_socket(libc::AF_INET, libc::SOCK_STREAM, 0);
    // Review finding: the header did not name it.
    let poll = exs_poll(c, libc::POLLOUT, q, ptr::null_mut());
    assert_eq!((poll, errno()), (-1, libc::ENOTCONN), "poll before connect");
    assert_eq!(connect(c, &at, q), 0, "errno {}", errno());
    // SAFETY: an all-zero event is a valid one (integers and a null context).
    let mut ev: [exs_event_t; 1] = unsafe { std::mem::zeroed() };
    // SAFETY: room for one event; no timeout (the simulator connects at once).
    let got = unsafe { exs_qdequeue(q, ev.as_mut_ptr(), -1, ptr::null()) };
    assert_eq!(
        (got, ev[0].exs_evt_errno),
        (1, 0),
        "the connect: errno {}",
        errno()
    );
    assert_eq!(
        (connect(c, &at, q), errno()),
        (-1, libc::EISCONN),
        "connect when connected"
    );
    assert_eq!(
        (exs_listen(c, 4), errno()),
        (-1, libc::EINVAL),
        "listen when connected"
    );
    assert_eq!(
        (bind(c, &at), errno()),
        (-1, libc::EINVAL),
        "bind when connected"
    );

    // A connect where nobody listens fails in its event; a second connect of that socket is EINVAL (as BSD's
    // connect(2) after a failed one): it was EISCONN, which a retry loop took for success, then the failure's
    // own errno, which read as a fresh refusal (review findings).
    let refused = exs_socket(libc::AF_INET, libc::SOCK_STREAM, 0);
    let nobody = sockaddr_of(exs::sim_addr(0, 7101));
    assert_eq!(connect(refused, &nobody, q), 0, "errno {}", errno());
    // SAFETY: room for one event; no timeout (the simulator refuses at once).
    let got = unsafe { exs_qdequeue(q, ev.as_mut_ptr(), -1, ptr::null()) };
    assert_eq!((got, ev[0].exs_evt_errno), (1, libc::ECONNREFUSED));
    assert_eq!(
        (connect(refused, &nobody, q), errno()),
        (-1, libc::EINVAL),
        "connect after a failed connect"
    );

    for fd in [c, l, refused] {
        assert_eq!(exs_close(fd), 0, "errno {}", errno());
    }
    assert_eq!(exs_mderegister(m), 0, "errno {}", errno());
    assert_eq!(exs_qdelete(q), 0, "errno {}", errno());
    drop(mem);
}

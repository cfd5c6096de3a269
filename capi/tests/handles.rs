//! Handles of each kind through the C functions, on the simulated fabric (`EXS_BACKEND=sim`).

use exs_capi::abi::EXS_ACCESS_READ;
use exs_capi::memory::{exs_mderegister, exs_mregister};
use exs_capi::queue::{exs_qcreate, exs_qdelete};
use exs_capi::socket::{exs_close, exs_socket};
use libc::c_void;

mod common;
use common::{errno, init_sim};

/// Sockets, queues and memory were all numbered from 1, so the first of each had the same number, and a handle
/// passed for another kind named an object of that kind: `exs_close` of a queue handle closed a socket, and
/// `exs_mderegister` of a socket's number deregistered memory the program still used (and might free, while the
/// peer held a key to it). Each kind now has numbers of its own, and a handle of another kind is `EBADF`.
#[test]
fn a_handle_passed_for_another_kind_is_ebadf() {
    init_sim();
    let q = exs_qcreate(4);
    let s = exs_socket(libc::AF_INET, libc::SOCK_STREAM, 0);
    let mut mem = vec![0u8; 4096];
    // SAFETY: `mem` is readable for its length and outlives the registration (deregistered below, before it goes).
    let m = unsafe {
        exs_mregister(
            mem.as_mut_ptr().cast::<c_void>(),
            mem.len(),
            EXS_ACCESS_READ,
        )
    };
    assert!(q > 0 && s > 0 && m > 0, "errno {}", errno());
    assert!(
        q != s && m != s && m != q,
        "socket {s}, queue {q}, memory {m}"
    );
    for (what, ret) in [
        ("exs_close of a queue", exs_close(q)),
        ("exs_close of memory", exs_close(m)),
        ("exs_qdelete of a socket", exs_qdelete(s)),
        ("exs_qdelete of memory", exs_qdelete(m)),
        ("exs_mderegister of a socket", exs_mderegister(s)),
        ("exs_mderegister of a queue", exs_mderegister(q)),
    ] {
        assert_eq!((ret, errno()), (-1, libc::EBADF), "{what}");
    }
    // Each object is still there, behind its own handle.
    assert_eq!(exs_close(s), 0, "errno {}", errno());
    assert_eq!(exs_qdelete(q), 0, "errno {}", errno());
    assert_eq!(exs_mderegister(m), 0, "errno {}", errno());
    drop(mem);
}

//! `exs_fcntl` through the C functions, on the simulated fabric (`EXS_BACKEND=sim`).

use exs_capi::abi::{EXS_F_GET_SEND_CREDITS, EXS_F_GET_SMALL_PACKET_MAX_SIZE};
use exs_capi::fcntl::exs_fcntl_int;
use exs_capi::socket::{exs_close, exs_socket};
use libc::c_int;

mod common;
use common::{errno, init_sim};

/// Two threads set two different options of one socket at once, each reading its own back after every set. A set
/// read the options, changed one and wrote them all back, so a set from the other thread in between was undone:
/// a thread found its option back at an older value.
#[test]
fn options_set_from_two_threads_at_once_both_hold() {
    init_sim();
    let s = exs_socket(libc::AF_INET, libc::SOCK_STREAM, 0);
    assert!(s > 0, "errno {}", errno());
    const ROUNDS: c_int = 5_000;
    let setter = |get: c_int, value: fn(c_int) -> c_int| {
        move || {
            for i in 0..ROUNDS {
                let v = value(i);
                assert_eq!(exs_fcntl_int(s, get + 1, v), 0, "errno {}", errno());
                let now = exs_fcntl_int(s, get, 0);
                assert_eq!(now, v, "round {i}: the option set just before reads {now}");
            }
        }
    };
    let credits = std::thread::spawn(setter(EXS_F_GET_SEND_CREDITS, |i| 4 + i % 29));
    let small = std::thread::spawn(setter(EXS_F_GET_SMALL_PACKET_MAX_SIZE, |i| 64 + i % 97));
    credits.join().expect("the send-credits thread");
    small.join().expect("the small-packet thread");
    assert_eq!(exs_close(s), 0);
}

//! What the C API's integration tests share: the thread's errno, and the process's context on the simulated fabric.

use exs_capi::abi::EXS_VERSION;
use exs_capi::exs_init;
use libc::c_int;

/// The calling thread's `errno`.
pub fn errno() -> c_int {
    std::io::Error::last_os_error().raw_os_error().unwrap_or(0)
}

/// Opens the process's context on the simulated fabric (`EXS_BACKEND=sim`), as a C program's `exs_init` does.
pub fn init_sim() {
    std::env::set_var("EXS_BACKEND", "sim");
    assert_eq!(exs_init(EXS_VERSION), 0, "errno {}", errno());
}

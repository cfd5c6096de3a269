//! `exs_init`'s errors, in a process with no context yet (this test binary opens none).

use exs_capi::abi::EXS_VERSION;
use exs_capi::exs_init;

/// A review found it: a libfabric that cannot be loaded (not installed) reached C as `EOPNOTSUPP`, where the header
/// promises `ENODEV` for "no such backend, device or provider". The library is looked for once per process, so
/// this binary holds this one test.
#[test]
fn a_backend_that_cannot_be_loaded_or_does_not_exist_is_enodev() {
    std::env::set_var("EXS_FABRIC_LIBRARY", "/nonexistent/libfabric.so.1");
    std::env::set_var("EXS_BACKEND", "fabric");
    assert_eq!(exs_init(EXS_VERSION), -1);
    assert_eq!(
        std::io::Error::last_os_error().raw_os_error().unwrap_or(0),
        libc::ENODEV,
        "libfabric not installed"
    );
    std::env::set_var("EXS_BACKEND", "exs-no-such-backend");
    assert_eq!(exs_init(EXS_VERSION), -1);
    assert_eq!(
        std::io::Error::last_os_error().raw_os_error().unwrap_or(0),
        libc::ENODEV,
        "a backend that does not exist"
    );
}

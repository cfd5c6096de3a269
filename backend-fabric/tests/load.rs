//! libfabric is loaded when a process first opens a fabric context, not linked: a machine without it (or with
//! `EXS_FABRIC_LIBRARY` naming a file that is not there) gets an error that says what to install, not a binary
//! that fails to start.

use std::process::Command;

use exs_backend_fabric::{FabricConfig, FabricTransport};
use exs_transport::TransportError;

const NAME: &str =
    "a_libfabric_that_cannot_be_loaded_is_reported_as_unsupported_with_what_to_install";
const MISSING: &str = "/nonexistent/libfabric.so.1";

/// Runs in a process of its own (the library is looked for once per process): the test binary again, with the
/// variable set.
#[test]
fn a_libfabric_that_cannot_be_loaded_is_reported_as_unsupported_with_what_to_install() {
    if std::env::var_os("EXS_LOAD_TEST_CHILD").is_some() {
        let e = FabricTransport::open(&FabricConfig::default())
            .expect_err("a transport without libfabric");
        let text = e.to_string();
        assert!(matches!(e, TransportError::Unsupported(_)), "{e:?}");
        assert!(
            text.contains("libfabric could not be loaded")
                && text.contains(MISSING)
                && text.contains("apt-get install libfabric1"),
            "{text}"
        );
        assert!(exs_backend_fabric::providers().is_empty());
        return;
    }
    let out = Command::new(std::env::current_exe().expect("the test binary"))
        .args(["--exact", NAME, "--nocapture", "--test-threads=1"])
        .env("EXS_LOAD_TEST_CHILD", "1")
        .env("EXS_FABRIC_LIBRARY", MISSING)
        .output()
        .expect("running the test binary");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.contains("1 passed"),
        "the child run failed: {stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

//! libfabric is loaded when a process first opens a fabric context, not linked: a machine without it (or with
//! `EXS_FABRIC_LIBRARY` naming a file that is not there, or is not libfabric) gets an error that says so, not a
//! binary that fails to start.

use std::process::Command;

use exs_backend_fabric::{FabricConfig, FabricTransport};
use exs_transport::TransportError;

/// Runs `name` again in a process of its own with `EXS_FABRIC_LIBRARY=library` (the library is looked for once
/// per process); false in that process itself, where the caller checks what opening a transport says.
fn in_child(name: &str, library: &str) -> bool {
    if std::env::var_os("EXS_LOAD_TEST_CHILD").is_some() {
        return false;
    }
    let out = Command::new(std::env::current_exe().expect("the test binary"))
        .args(["--exact", name, "--nocapture", "--test-threads=1"])
        .env("EXS_LOAD_TEST_CHILD", "1")
        .env("EXS_FABRIC_LIBRARY", library)
        .output()
        .expect("running the test binary");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.contains("1 passed"),
        "the child run failed: {stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    true
}

/// What opening a transport says, checked as refused for want of libfabric.
fn refusal() -> String {
    let e =
        FabricTransport::open(&FabricConfig::default()).expect_err("a transport without libfabric");
    assert!(matches!(e, TransportError::Unsupported(_)), "{e:?}");
    assert!(exs_backend_fabric::providers().is_empty());
    let text = e.to_string();
    assert!(
        text.contains("libfabric could not be loaded")
            && text.contains("apt-get install libfabric1"),
        "{text}"
    );
    text
}

#[test]
fn a_libfabric_that_cannot_be_loaded_is_reported_as_unsupported_with_what_to_install() {
    const MISSING: &str = "/nonexistent/libfabric.so.1";
    if in_child(
        "a_libfabric_that_cannot_be_loaded_is_reported_as_unsupported_with_what_to_install",
        MISSING,
    ) {
        return;
    }
    let text = refusal();
    assert!(text.contains(MISSING), "{text}");
}

/// A library that loads but has not the functions at the versions the build's libfabric gave them (here the C
/// library; an older libfabric alike) is refused as a linked program would fail to start, naming what it lacks.
#[test]
fn a_library_without_libfabrics_functions_is_refused_naming_the_one_it_lacks() {
    if in_child(
        "a_library_without_libfabrics_functions_is_refused_naming_the_one_it_lacks",
        "libc.so.6",
    ) {
        return;
    }
    let text = refusal();
    assert!(text.contains("libc.so.6 has no fi_"), "{text}");
}

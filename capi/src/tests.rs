//! The header cannot drift from the Rust declarations, and it is good C and C++.

use std::path::{Path, PathBuf};
use std::process::Command;

fn crate_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// What cbindgen makes of this crate now.
fn generated() -> String {
    let dir = crate_dir();
    let config = cbindgen::Config::from_file(dir.join("cbindgen.toml")).expect("cbindgen.toml");
    let mut out = Vec::new();
    cbindgen::Builder::new()
        .with_crate(&dir)
        .with_config(config)
        .generate()
        .expect("cbindgen parses the crate")
        .write(&mut out);
    String::from_utf8(out).expect("a header is text")
}

#[test]
fn the_committed_header_is_what_cbindgen_generates() {
    let path = crate_dir().join("include/exs.h");
    let want = generated();
    if std::env::var_os("EXS_BLESS").is_some() {
        std::fs::write(&path, &want).expect("writing include/exs.h");
    }
    let have = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        have == want,
        "capi/include/exs.h differs from the Rust declarations: regenerate it with \
         `EXS_BLESS=1 cargo test -p exs-capi the_committed_header` and commit it"
    );
}

/// Compiles a file that includes exs.h with every warning as an error.
fn compile(compiler: &str, std: &str, lang: &str, src: &Path) {
    let out = Command::new(compiler)
        .args([
            std,
            "-x",
            lang,
            "-Wall",
            "-Wextra",
            "-pedantic",
            "-Werror",
            "-fsyntax-only",
        ])
        .arg("-I")
        .arg(crate_dir().join("include"))
        .arg(src)
        .output()
        .unwrap_or_else(|e| panic!("running {compiler}: {e}"));
    assert!(
        out.status.success(),
        "{compiler} {std} rejects exs.h:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn the_header_compiles_warning_free_as_c99_and_as_cpp11() {
    let dir = std::env::temp_dir().join(format!("exs-capi-header-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let src = dir.join("use.c");
    // Every name the contract promises, used once, so that a missing one fails to compile.
    std::fs::write(
        &src,
        r#"#include <exs.h>
static int use_all(void)
{
    exs_event_t ev;
    struct exs_event *p = &ev;
    exs_qhandle_t q = exs_qcreate(4);
    exs_mhandle_t m = -1;
    int flags = MSG_WAITALL | EXS_PERSISTENT | EXS_NOTIFY | EXS_ACCESS_READ | EXS_ACCESS_WRITE;
    int kinds = EXS_EVT_CONNECT + EXS_EVT_ACCEPT + EXS_EVT_SEND + EXS_EVT_RECV + EXS_EVT_SENDFILE + EXS_EVT_POLL
              + EXS_EVT_SHUTDOWN + EXS_EVT_READ_NOTIFY;
    ev.exs_evt_type = 0; ev.exs_evt_errno = 0; ev.exs_evt_context = 0; ev.exs_evt_fd = 0; ev.exs_evt_bytes = 0;
    ev.exs_evt_accepted = 0; ev.exs_evt_flags = 0; ev.exs_evt_revents = 0;
    short bits = EXS_POLLRDNORM | EXS_POLLWRNORM | EXS_POLLRDHUP;
    (void)p; (void)m; (void)flags; (void)kinds; (void)bits;
    return exs_init(EXS_VERSION) + q + exs_fcntl(0, EXS_F_GETERROR) + exs_fcntl(0, EXS_F_SET_SEND_CREDITS, 4);
}
int main(void) { return use_all(); }
"#,
    )
    .unwrap();
    compile("cc", "-std=c99", "c", &src);
    compile("c++", "-std=c++11", "c++", &src);
    let _ = std::fs::remove_dir_all(&dir);
}

/// The header's names of the poll bits strict C lacks are Linux's bits (written out: cbindgen copies literals only).
#[test]
fn the_headers_poll_bits_are_the_systems() {
    use crate::abi::*;
    assert_eq!(EXS_POLLRDNORM, libc::POLLRDNORM);
    assert_eq!(EXS_POLLWRNORM, libc::POLLWRNORM);
    assert_eq!(EXS_POLLRDHUP, libc::POLLRDHUP);
}

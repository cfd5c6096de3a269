//! Compiles the one function of exs.h that Rust cannot define (stable Rust has no C-variadic definitions):
//! `exs_fcntl(int fd, int cmd, ...)`, which reads its argument and calls into Rust. The object is linked whole
//! into both libraries, and a second version script exports it from libexs.so (rustc's own lists only the
//! functions defined in Rust).

use std::path::PathBuf;

fn main() {
    let dir = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets it"));
    println!("cargo:rerun-if-changed=src/fcntl.c");
    println!("cargo:rerun-if-changed=include/exs.h");
    println!("cargo:rerun-if-changed=exs.map");
    cc::Build::new()
        .file("src/fcntl.c")
        .include("include")
        .warnings(true)
        .extra_warnings(true)
        .flag("-std=c99")
        .flag("-pedantic")
        .link_lib_modifier("+whole-archive")
        .compile("exs_fcntl");
    println!(
        "cargo:rustc-cdylib-link-arg=-Wl,--version-script={}",
        dir.join("exs.map").display()
    );
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libexs.so");
}

//! Finds the system libfabric's headers (>= 1.17) with pkg-config, compiles the C shim for its static inline calls
//! and the loader of the library itself (not linked: loaded on first use), and generates bindings for the subset of
//! the API we use.

use std::env;
use std::path::PathBuf;

fn main() {
    // The headers only: the library is loaded when a process first opens a fabric context (see shim/shim.c), not
    // linked.
    let lib = match pkg_config::Config::new()
        .atleast_version("1.17")
        .cargo_metadata(false)
        .probe("libfabric")
    {
        Ok(lib) => lib,
        Err(e) => panic!(
            "libfabric >= 1.17 was not found by pkg-config ({e}).\n\
             On Debian/Ubuntu: apt-get install libfabric-dev pkg-config (or run `cargo xtask test` as root)"
        ),
    };
    println!("cargo:rerun-if-changed=shim/shim.c");
    println!("cargo:rerun-if-changed=shim/shim.h");
    let mut build = cc::Build::new();
    build
        .file("shim/shim.c")
        .warnings(true)
        .flag_if_supported("-Wno-unused-parameter");
    for p in &lib.include_paths {
        build.include(p);
    }
    build.compile("exs_fi_shim");
    println!("cargo:rustc-link-lib=dl");

    let mut bg = bindgen::Builder::default()
        .header("shim/shim.h")
        .allowlist_function("exs_fi_.*")
        .allowlist_type("fi_.*")
        .allowlist_var("FI_.*")
        .derive_default(true)
        .layout_tests(false)
        .generate_comments(false)
        .parse_callbacks(Box::new(bindgen::CargoCallbacks::new()));
    for p in &lib.include_paths {
        bg = bg.clang_arg(format!("-I{}", p.display()));
    }
    let bindings = bg.generate().expect(
        "bindgen could not parse the libfabric headers; it needs libclang (apt-get install clang libclang-dev)",
    );
    let out = PathBuf::from(env::var("OUT_DIR").expect("OUT_DIR"));
    bindings
        .write_to_file(out.join("fi.rs"))
        .expect("write bindings");
}

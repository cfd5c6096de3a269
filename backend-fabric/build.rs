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
    for (name, version) in symbol_versions(&build.get_compiler()) {
        let macro_name = format!("EXS_FI_V_{}", name.trim_start_matches("fi_").to_uppercase());
        build.define(&macro_name, Some(format!("\"{version}\"").as_str()));
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

/// The functions the shim's loader looks up in libfabric.
const LOADED: [&str; 5] = [
    "fi_getinfo",
    "fi_freeinfo",
    "fi_dupinfo",
    "fi_fabric",
    "fi_strerror",
];

/// The version linking against the build's libfabric would bind for each of [`LOADED`] (the library's defaults,
/// `name@@version` in its dynamic symbol table), so that the loader asks for the same ones whatever libfabric it
/// loads later. Found through the C compiler (`-print-file-name`) and `nm` (binutils, which the compiler needs);
/// where either fails, a warning, and the loader takes the loaded library's defaults.
fn symbol_versions(cc: &cc::Tool) -> Vec<(String, String)> {
    let found = std::process::Command::new(cc.path())
        .arg("-print-file-name=libfabric.so")
        .output()
        .ok()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .filter(|p| p.contains('/'))
        .and_then(|lib| {
            std::process::Command::new("nm")
                .args(["-D", "--defined-only", &lib])
                .output()
                .ok()
                .filter(|o| o.status.success())
        });
    let Some(out) = found else {
        println!(
            "cargo:warning=libfabric's symbol versions not found (no libfabric.so for the compiler, or no nm): \
             the shim loads the defaults of the library it finds at run time"
        );
        return Vec::new();
    };
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().last()?.split_once("@@"))
        .filter(|(name, _)| LOADED.contains(name))
        .map(|(name, version)| (name.to_string(), version.to_string()))
        .collect()
}

//! `cargo xtask c [--prefix DIR]`: the C library's installed layout (issue 30), and the C stage of `cargo xtask
//! test`: the examples and the C API's tests, built from that layout with the system's C (and C++) compiler,
//! run on libfabric tcp here and on Soft-RoCE in the guest.
//!
//! ```text
//! DIR/include/exs.h  DIR/lib/libexs.so  DIR/lib/libexs.a  DIR/lib/pkgconfig/exs.pc
//! cc prog.c $(PKG_CONFIG_PATH=DIR/lib/pkgconfig pkg-config --cflags --libs exs)
//! ```

use std::path::{Path, PathBuf};
use std::process::Command;

use clap::Args;

use crate::runner::run_counting;
use crate::sys::{self, Result};

#[derive(Args)]
pub struct CArgs {
    /// Where to lay out include/, lib/ and lib/pkgconfig/ (default: target/c).
    #[arg(long)]
    pub prefix: Option<PathBuf>,
    /// Install the debug build instead of the optimized one (the `dist` profile: fat LTO, one codegen unit).
    #[arg(long)]
    pub debug: bool,
    /// Also build the C examples and tests from the layout into DIR/bin.
    #[arg(long)]
    pub examples: bool,
}

/// What a program linked with libexs.a needs besides it: `rustc --print native-static-libs` of the crate (the
/// backends' libraries and Rust's runtime's; not libfabric, which is loaded when a program first opens a fabric
/// context). The statically linked example checks that the list is complete.
const LIBS_PRIVATE: &str = "-libverbs -lrdmacm -lgcc_s -lutil -lrt -lpthread -lm -ldl";

/// The C programs: name, source, and arguments for a run in the test stage (before the address). The round trips
/// are few: in the emulated guest one takes about 13 ms (ping_pong busy-polls in two processes on the guest's two
/// processors, beside the kernel's Soft-RoCE work; epoll's wakes a progress thread), and a thousand of each took
/// half a minute there.
const PROGRAMS: [(&str, &str, &[&str]); 5] = [
    ("echo", "capi/examples/echo.c", &[]),
    ("ping_pong", "capi/examples/ping_pong.c", &["-n", "200"]),
    ("persistent", "capi/examples/persistent.c", &[]),
    ("epoll", "capi/examples/epoll.c", &["-n", "200"]),
    ("capi_tests", "capi/tests/capi_tests.c", &[]),
];

/// Variants of the echo example, built too: as C++, and linked with the static library.
const ECHO_VARIANTS: [&str; 2] = ["echo-cpp", "echo-static"];

/// Where `cargo xtask test` installs (the debug build, which the workspace build already made).
pub fn test_prefix() -> PathBuf {
    sys::root().join("target/c-test")
}

pub fn run(a: CArgs) -> Result<()> {
    // What the backends' builds need, as `demo` and `test` install it (review finding: on a fresh machine the
    // README's C commands failed in the backends' build scripts).
    sys::ensure_packages(sys::BUILD_PACKAGES)?;
    let prefix = a.prefix.unwrap_or_else(|| sys::root().join("target/c"));
    let dir = install(&prefix, !a.debug)?;
    if a.examples {
        let bin = build_programs(&dir)?;
        println!("examples and tests in {}", bin.display());
    }
    println!(
        "exs for C in {}: include/exs.h, lib/libexs.so, lib/libexs.a, lib/pkgconfig/exs.pc\n\
         cc prog.c $(PKG_CONFIG_PATH={}/lib/pkgconfig pkg-config --cflags --libs exs)",
        dir.display(),
        dir.display()
    );
    Ok(())
}

/// Builds the library (`optimized`: with the `dist` profile, as we ship it; else the debug build) and lays it out
/// under `prefix` (made absolute); returns the absolute prefix.
pub fn install(prefix: &Path, optimized: bool) -> Result<PathBuf> {
    let mut build = sys::cargo();
    if optimized {
        // The two C libraries only: a crate that is an rlib too (the crate's own Rust tests link it) is built
        // without LTO whatever the profile says.
        build.args([
            "rustc",
            "-p",
            "exs-capi",
            "--lib",
            "--profile",
            sys::DIST,
            "--crate-type",
            "cdylib,staticlib",
        ]);
    } else {
        build.args(["build", "-p", "exs-capi"]);
    }
    sys::run(&mut build)?;
    let built = if optimized {
        sys::dist_dir()
    } else {
        sys::root().join("target/debug")
    };
    let prefix = std::path::absolute(prefix).map_err(|e| e.to_string())?;
    for d in ["include", "lib/pkgconfig"] {
        std::fs::create_dir_all(prefix.join(d))
            .map_err(|e| format!("{}: {e}", prefix.display()))?;
    }
    place(
        &sys::root().join("capi/include/exs.h"),
        &prefix.join("include/exs.h"),
    )?;
    check_exports(
        &built.join("libexs_capi.so"),
        &sys::root().join("capi/include/exs.h"),
    )?;
    place(&built.join("libexs_capi.so"), &prefix.join("lib/libexs.so"))?;
    place(&built.join("libexs_capi.a"), &prefix.join("lib/libexs.a"))?;
    let pc = format!(
        "prefix={}\nlibdir=${{prefix}}/lib\nincludedir=${{prefix}}/include\n\n\
         Name: exs\n\
         Description: Extended Sockets (ES-API) over RDMA: verbs and libfabric\n\
         Version: {}\n\
         Libs: -L${{libdir}} -lexs\n\
         Libs.private: {LIBS_PRIVATE}\n\
         Cflags: -I${{includedir}}\n",
        prefix.display(),
        env!("CARGO_PKG_VERSION"),
    );
    std::fs::write(prefix.join("lib/pkgconfig/exs.pc"), pc).map_err(|e| e.to_string())?;
    Ok(prefix)
}

/// The functions libexs.so exports are exactly those exs.h declares: no internal helper a C program could link
/// against (and then lose in the next release), none of the header's missing.
fn check_exports(lib: &Path, header: &Path) -> Result<()> {
    let out = Command::new("nm")
        .args(["-D", "--defined-only", "--format=posix"])
        .arg(lib)
        .output()
        .map_err(|e| format!("nm (binutils) on {}: {e}", lib.display()))?;
    if !out.status.success() {
        return Err(format!(
            "nm on {}: {}",
            lib.display(),
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    let header =
        std::fs::read_to_string(header).map_err(|e| format!("{}: {e}", header.display()))?;
    let wrong = export_mismatch(&String::from_utf8_lossy(&out.stdout), &header);
    if wrong.is_empty() {
        Ok(())
    } else {
        Err(format!("{}: {}", lib.display(), wrong.join("; ")))
    }
}

/// What differs between the functions in `nm -D --defined-only --format=posix` output and those `header`
/// declares (a name followed by `(` at the start of a declaration's line, after its return type).
fn export_mismatch(nm: &str, header: &str) -> Vec<String> {
    let exported: std::collections::BTreeSet<&str> = nm
        .lines()
        .filter_map(|l| {
            let mut f = l.split_whitespace();
            let (name, kind) = (f.next()?, f.next()?);
            // The loader's own entry points of every shared object.
            (kind == "T" && !matches!(name, "_init" | "_fini")).then_some(name)
        })
        .collect();
    let declared: std::collections::BTreeSet<&str> = header
        .lines()
        .filter(|l| !l.starts_with(' ') && !l.starts_with('#') && !l.starts_with('/'))
        .filter_map(|l| {
            let name = l.split('(').next()?.split_whitespace().last()?;
            let name = name.trim_start_matches('*');
            (l.contains('(') && name.starts_with("exs_")).then_some(name)
        })
        .collect();
    let mut wrong: Vec<String> = exported
        .difference(&declared)
        .map(|n| format!("{n} is exported but exs.h does not declare it"))
        .collect();
    wrong.extend(
        declared
            .difference(&exported)
            .map(|n| format!("exs.h declares {n} but the library does not export it")),
    );
    wrong
}

/// Copies a file into place by renaming a copy over it: a program running on the old library keeps its mapping.
fn place(from: &Path, to: &Path) -> Result<()> {
    let tmp = to.with_extension("tmp");
    std::fs::copy(from, &tmp).map_err(|e| format!("copying {}: {e}", from.display()))?;
    std::fs::rename(&tmp, to).map_err(|e| format!("{}: {e}", to.display()))
}

/// `pkg-config ARGS exs` against the layout under `prefix`, split into arguments.
fn pkg_config(prefix: &Path, args: &[&str]) -> Result<Vec<String>> {
    let out = sys::output(
        Command::new("pkg-config")
            .args(args)
            .arg("exs")
            .env("PKG_CONFIG_PATH", prefix.join("lib/pkgconfig")),
    )?;
    Ok(out.split_whitespace().map(String::from).collect())
}

/// Builds every C program from the layout under `prefix` into `prefix/bin`, warnings as errors: the examples and
/// the tests as C99, the echo example also as C++11 and linked with libexs.a.
pub fn build_programs(prefix: &Path) -> Result<PathBuf> {
    sys::ensure_packages(&["gcc", "g++", "pkg-config"])?;
    let bin = prefix.join("bin");
    std::fs::create_dir_all(&bin).map_err(|e| e.to_string())?;
    let flags = pkg_config(prefix, &["--cflags", "--libs"])?;
    let rpath = format!("-Wl,-rpath,{}", prefix.join("lib").display());
    let strict = [
        "-Wall",
        "-Wextra",
        "-pedantic",
        "-Werror",
        "-O2",
        "-pthread",
    ];
    let compile = |compiler: &str, std: &[&str], src: &str, out: &Path, link: &[String]| {
        sys::run(
            Command::new(compiler)
                .args(std)
                .args(strict)
                .arg(sys::root().join(src))
                .args(link)
                .arg("-o")
                .arg(out),
        )
    };
    for (name, src, _) in PROGRAMS {
        let mut link = flags.clone();
        link.push(rpath.clone());
        compile("cc", &["-std=c99"], src, &bin.join(name), &link)?;
    }
    let mut link = flags.clone();
    link.push(rpath);
    compile(
        "c++",
        &["-std=c++11", "-x", "c++"],
        PROGRAMS[0].1,
        &bin.join(ECHO_VARIANTS[0]),
        &link,
    )?;
    // libexs.a first, the rest from Libs.private; --as-needed drops libexs.so, which the static one made moot.
    let mut link: Vec<String> = ["-Wl,--as-needed", "-Wl,-Bstatic", "-lexs", "-Wl,-Bdynamic"]
        .map(String::from)
        .to_vec();
    link.extend(pkg_config(prefix, &["--static", "--cflags", "--libs"])?);
    let static_echo = bin.join(ECHO_VARIANTS[1]);
    compile("cc", &["-std=c99"], PROGRAMS[0].1, &static_echo, &link)?;
    let needed = sys::output(Command::new("readelf").arg("-d").arg(&static_echo))?;
    if needed.contains("libexs.so") {
        return Err(format!("{} still needs libexs.so", static_echo.display()));
    }
    // The README's program must stay true: compiled (never run: it names an address outside this machine).
    let readme = bin.join("readme.c");
    std::fs::write(&readme, readme_program()?).map_err(|e| e.to_string())?;
    let mut link = flags;
    link.push(format!("-Wl,-rpath,{}", prefix.join("lib").display()));
    compile(
        "cc",
        &["-std=c99"],
        &readme.to_string_lossy(),
        &bin.join("readme"),
        &link,
    )?;
    Ok(bin)
}

/// The C program of the README's "From C" section.
fn readme_program() -> Result<String> {
    let text = std::fs::read_to_string(sys::root().join("README.md")).map_err(|e| e.to_string())?;
    let section = text
        .split("\n## From C\n")
        .nth(1)
        .ok_or("README.md has no \"From C\" section")?;
    let code = section
        .split("```c\n")
        .nth(1)
        .and_then(|rest| rest.split("\n```").next())
        .ok_or("the README's \"From C\" section has no C program")?;
    Ok(format!("{code}\n"))
}

/// The runs of the C stage on one backend, as shell lines: each example (and the echo's variants) is one test;
/// capi_tests prints its own. `env` are the backend's variables, `addr` the address to listen on.
fn script(bin: &Path, env: &str, addr: &str) -> String {
    let mut s = format!(
        "capi() {{ name=$1; shift; if env {env} timeout 300 \"$@\" >&2; then echo \"test capi::$name ... ok\"; \
         echo 'test result: ok. 1 passed; 0 failed; 0 ignored'; else echo \"test capi::$name ... FAILED\"; \
         echo 'test result: FAILED. 0 passed; 1 failed; 0 ignored'; fi; }}\n"
    );
    let b = bin.display();
    for (name, _, args) in PROGRAMS.iter().filter(|p| p.0 != "capi_tests") {
        s += &format!("capi {name} {b}/{name} {} {addr}\n", args.join(" "));
    }
    for name in ECHO_VARIANTS {
        s += &format!("capi {name} {b}/{name} {addr}\n");
    }
    s += &format!("env {env} timeout 300 {b}/capi_tests {addr}\n");
    s
}

/// The C stage on this host, over libfabric tcp on 127.0.0.1: install the debug build, build the programs, run
/// them. Adds a summary line; a failure is named in `failures`.
pub fn host_stage(summary: &mut Vec<String>, failures: &mut Vec<String>) {
    let run = || -> Result<(crate::runner::Counts, bool)> {
        let prefix = install(&test_prefix(), false)?;
        let bin = build_programs(&prefix)?;
        let sh = script(&bin, "EXS_BACKEND=fabric EXS_PROVIDER=tcp", "127.0.0.1");
        let (c, ok, _) = run_counting(Command::new("sh").args(["-c", &sh]))?;
        Ok((c, ok))
    };
    let label =
        "C API on libfabric tcp (examples, echo as C++ and static, capi_tests; from target/c-test)";
    match run() {
        Ok((c, ok)) => {
            if !ok || c.failed > 0 || c.passed == 0 {
                failures.push("C API".into());
            }
            summary.push(format!(
                "{label}: {} ran, {} passed, {} failed",
                c.passed + c.failed,
                c.passed,
                c.failed
            ));
        }
        Err(e) => {
            summary.push(format!("{label}: could not run: {e}"));
            failures.push("C API".into());
        }
    }
}

/// The C stage's section of the RDMA script (`test::rdma_script`): the programs the host stage built, over verbs
/// on the Soft-RoCE device at `addr`. Built here when the host stage did not run (`--backend softroce`).
pub fn rdma_section(addr: &str) -> String {
    let prefix = test_prefix();
    let built = install(&prefix, false).and_then(|p| build_programs(&p));
    match built {
        Ok(bin) => format!(
            "section capi:verbs\n{}",
            script(&bin, &format!("EXS_BACKEND=verbs EXS_ADDR={addr}"), addr)
        ),
        Err(e) => format!(
            "section capi:verbs\necho 'test capi::build ... FAILED'; echo 'test result: FAILED. 0 passed; 1 failed; 0 ignored'\necho 'xtask: the C programs could not be built: {}' >&2\n",
            e.replace('\'', "")
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_c_stage_runs_every_program_with_the_backend_s_variables() {
        let s = script(
            Path::new("/p/bin"),
            "EXS_BACKEND=verbs EXS_ADDR=10.1.1.1",
            "10.1.1.1",
        );
        for (name, _, _) in PROGRAMS {
            assert!(
                s.contains(&format!("/p/bin/{name} ")),
                "{name} missing:\n{s}"
            );
        }
        for name in ECHO_VARIANTS {
            assert!(
                s.contains(&format!("capi {name} /p/bin/{name} 10.1.1.1")),
                "{s}"
            );
        }
        assert!(
            s.contains("capi ping_pong /p/bin/ping_pong -n 200 10.1.1.1"),
            "{s}"
        );
        assert!(s.contains(
            "env EXS_BACKEND=verbs EXS_ADDR=10.1.1.1 timeout 300 /p/bin/capi_tests 10.1.1.1"
        ));
        assert_eq!(
            s.matches("test result: ok. 1 passed").count(),
            1,
            "one wrapper"
        );
    }

    #[test]
    fn the_library_exports_exactly_what_the_header_declares() {
        let header = "int exs_init(int version);\nstruct exs_event *exs_evt(int q,\n                           int x);\n\
                      /* exs_fcntl_int(fd) in a comment */\n * `exs_send(` in documentation\nint exs_fcntl(int fd, int cmd, ...);\n";
        let nm = "exs_init T 1000 10\nexs_evt T 1010 10\nexs_fcntl T 1020 10\n_init T 0 0\nexs_data D 10 4\n";
        assert!(
            export_mismatch(nm, header).is_empty(),
            "{:?}",
            export_mismatch(nm, header)
        );
        let nm = format!("{nm}exs_internal_fcntl T 1030 10\n");
        assert_eq!(
            export_mismatch(&nm, header),
            ["exs_internal_fcntl is exported but exs.h does not declare it"]
        );
        let header = format!("{header}int exs_gone(void);\n");
        assert_eq!(
            export_mismatch("exs_init T 1 1\nexs_evt T 2 2\nexs_fcntl T 3 3\n", &header),
            ["exs.h declares exs_gone but the library does not export it"]
        );
    }

    #[test]
    fn the_readme_s_c_program_is_found() {
        let code = readme_program().unwrap();
        assert!(
            code.starts_with("#include <exs.h>") && code.contains("exs_init(EXS_VERSION)"),
            "{code}"
        );
        assert!(!code.contains("```"));
    }
}

//! A crate outside the workspace, as a user would write it (issue 16): it depends on `exs` alone, with one backend
//! feature (`fabric`) and `tokio`, builds the examples of `exs/examples/` as its own, and runs each: the blocking
//! echo, the file copy (a file checked byte for byte), the async echo and the hyper example.

pub mod features;

use std::path::Path;
use std::process::Command;

use crate::sys::{self, Result};

/// The examples, and the crates they use besides `exs` (declared as exs's own dev-dependencies).
const EXAMPLES: [&str; 4] = ["echo", "file_copy", "async_echo", "http"];
const EXAMPLE_CRATES: [&str; 5] = ["tokio", "hyper", "hyper-util", "http-body-util", "bytes"];

/// The lines of exs's `[dev-dependencies]` that declare the examples' crates, so both builds ask for the same.
fn example_dependencies(manifest: &str) -> Result<String> {
    let mut section = "";
    let mut out = String::new();
    for l in manifest.lines() {
        if l.starts_with('[') {
            section = l.trim();
        } else if section == "[dev-dependencies]" {
            let name = l.split('=').next().unwrap_or("").trim();
            if EXAMPLE_CRATES.contains(&name) {
                out.push_str(l);
                out.push('\n');
            }
        }
    }
    match out.lines().count() {
        n if n == EXAMPLE_CRATES.len() => Ok(out),
        n => Err(format!(
            "exs/Cargo.toml declares {n} of the examples' {} dev-dependencies",
            EXAMPLE_CRATES.len()
        )),
    }
}

/// Writes the crate under `target/outside-crate`, builds its examples and runs them on libfabric tcp. Returns a
/// line for the summary.
pub fn run() -> Result<String> {
    let root = sys::root();
    let dir = root.join("target/outside-crate");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(dir.join("examples")).map_err(|e| format!("{}: {e}", dir.display()))?;
    let manifest = std::fs::read_to_string(root.join("exs/Cargo.toml"))
        .map_err(|e| format!("exs/Cargo.toml: {e}"))?;
    let dependencies = example_dependencies(&manifest)?;
    // exs as a registry would serve it: its package, and its dependencies among our crates from theirs (unpacked
    // by the package stage, which runs first).
    let (exs, patch) = crate::package::exs_from_packages(
        r#", features = ["fabric", "tokio"]"#,
        &["exs-dma", "exs-transport", "exs-backend-fabric"],
    )?;
    let write =
        |p: &Path, text: &str| std::fs::write(p, text).map_err(|e| format!("{}: {e}", p.display()));
    write(
        &dir.join("Cargo.toml"),
        &format!(
            "[package]\nname = \"exs-user\"\nversion = \"0.1.0\"\nedition = \"2021\"\npublish = false\n\n\
             # Not part of the exs workspace: what a user's crate looks like.\n[workspace]\n\n\
             [features]\n# The examples pick the simulated host's address when built with it.\nsim = [\"exs/sim\"]\n\n\
             [dependencies]\n{exs}{dependencies}\n{patch}"
        ),
    )?;
    std::fs::create_dir_all(dir.join("src")).map_err(|e| format!("{}: {e}", dir.display()))?;
    write(&dir.join("src/lib.rs"), "")?;
    let mut user_lines = Vec::new();
    for ex in EXAMPLES {
        let src = root.join("exs/examples").join(format!("{ex}.rs"));
        let text = std::fs::read_to_string(&src).map_err(|e| format!("{}: {e}", src.display()))?;
        if ex == "file_copy" {
            user_lines.push(main_lines(&text));
        }
        write(&dir.join("examples").join(format!("{ex}.rs")), &text)?;
    }
    // The workspace's lock file: the same dependency versions, nothing new to download.
    std::fs::copy(root.join("Cargo.lock"), dir.join("Cargo.lock"))
        .map_err(|e| format!("Cargo.lock: {e}"))?;
    let target = root.join("target");
    sys::run(sys::cargo_outside(&dir).args(["build", "--offline", "--examples"]))?;
    let bin = |ex: &str| target.join("debug/examples").join(ex);
    let fabric = |c: &mut Command| {
        c.env("EXS_BACKEND", "fabric").env("EXS_PROVIDER", "tcp");
    };
    for ex in ["echo", "async_echo", "http"] {
        let mut c = Command::new(bin(ex));
        fabric(&mut c);
        sys::run(&mut c).map_err(|e| format!("example {ex}: {e}"))?;
    }
    // The file copy: 3 MiB + 5 bytes (not a multiple of any chunk), compared byte for byte.
    let src = dir.join("copy-src");
    let dst = dir.join("copy-dst");
    let data: Vec<u8> = (0..(3usize << 20) + 5)
        .map(|i| (i * 7 + i / 4093) as u8)
        .collect();
    std::fs::write(&src, &data).map_err(|e| e.to_string())?;
    let mut c = Command::new(bin("file_copy"));
    c.arg(&src).arg(&dst);
    fabric(&mut c);
    sys::run(&mut c).map_err(|e| format!("example file_copy: {e}"))?;
    let got = std::fs::read(&dst).map_err(|e| e.to_string())?;
    if got != data {
        return Err(format!(
            "example file_copy: the copy differs ({} bytes, want {})",
            got.len(),
            data.len()
        ));
    }
    Ok(format!(
        "a crate outside the workspace (the packaged exs with features fabric, tokio) built and ran echo, file_copy ({} bytes \
         checked; {} lines of user code in main), async_echo, http",
        data.len(),
        user_lines[0]
    ))
}

/// Lines of `fn main`'s body, not counting blank lines and comments.
fn main_lines(text: &str) -> usize {
    let Some(start) = text.find("fn main") else {
        return 0;
    };
    text[start..]
        .lines()
        .skip(1)
        .take_while(|l| *l != "}")
        .filter(|l| !l.trim().is_empty() && !l.trim_start().starts_with("//"))
        .count()
}

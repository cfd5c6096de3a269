//! Cargo features are additive (issue 29): a user's crate outside the workspace depends on `exs` with each backend
//! alone and with all of them, and runs the same first program (a `Stream` echo on loopback) with no `EXS_*`
//! variable set. Each backend alone and all together must run, except verbs alone on a machine where nothing says
//! which RDMA address to use: that must fail, and say so in plain words. All together must pick libfabric.

use std::process::Command;

use crate::sys::{self, Result};

/// The first program: `Context::from_env`, a listener, a connection, one echo; it prints the backend it ran on.
const PROGRAM: &str = r#"use std::io::{Read, Write};

fn main() {
    match run() {
        Ok(backend) => println!("echo ok on {backend}"),
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(1);
        }
    }
}

fn run() -> Result<String, Box<dyn std::error::Error>> {
    let (server, client) = (exs::Context::from_env()?, exs::Context::from_env()?);
    let backend = server.backend().ok_or("a context of an unknown backend")?;
    let listener = exs::Listener::bind_in(&server, listen_addr(backend))?;
    let addr = listener.local_addr()?;
    let echo = std::thread::spawn(move || -> std::io::Result<()> {
        let (mut s, _) = listener.accept()?;
        let mut buf = [0u8; 64];
        let n = s.read(&mut buf)?;
        s.write_all(&buf[..n])
    });
    let mut c = exs::Stream::connect_in(&client, addr)?;
    c.write_all(b"first program")?;
    let mut back = [0u8; 13];
    c.read_exact(&mut back)?;
    echo.join().map_err(|_| "the echo thread panicked")??;
    if &back != b"first program" {
        return Err("the echo differs".into());
    }
    Ok(backend.to_string())
}

fn listen_addr(backend: exs::BackendKind) -> std::net::SocketAddr {
    #[cfg(feature = "sim")]
    if backend == exs::BackendKind::Sim {
        return exs::sim_addr(0, 7000);
    }
    let _ = backend;
    "127.0.0.1:0".parse().expect("an address")
}
"#;

/// The combinations, and the backend each must run on (`None`: it must fail, with the message checked below).
const COMBINATIONS: [(&str, Option<&str>); 4] = [
    ("fabric", Some("fabric")),
    ("sim", Some("sim")),
    ("verbs", None),
    ("verbs,fabric,sim", Some("fabric")),
];

/// What verbs alone must say with no `EXS_ADDR` (the rest of the line lists the machine's RDMA devices).
const VERBS_ALONE: &str =
    "error: not found: a backend that can serve here (not verbs: EXS_ADDR is not set (verbs \
                           needs the IP address of an RDMA device's interface; this machine has";

/// Builds the crate under `target/feature-crate` with each combination, runs the program with no `EXS_*` variable,
/// and checks what it printed. Returns a line for the summary.
pub fn run() -> Result<String> {
    let root = sys::root();
    let dir = root.join("target/feature-crate");
    // exs and its backends as a registry would serve them (their packages, unpacked by the package stage).
    let (exs, patch) = crate::package::exs_from_packages(
        "",
        &[
            "exs-dma",
            "exs-transport",
            "exs-backend-fabric",
            "exs-backend-verbs",
        ],
    )?;
    std::fs::create_dir_all(dir.join("src")).map_err(|e| format!("{}: {e}", dir.display()))?;
    let write = |p: std::path::PathBuf, text: &str| {
        std::fs::write(&p, text).map_err(|e| format!("{}: {e}", p.display()))
    };
    write(
        dir.join("Cargo.toml"),
        &format!(
            "[package]\nname = \"exs-first\"\nversion = \"0.1.0\"\nedition = \"2021\"\npublish = false\n\n\
             # Not part of the exs workspace: what a user's crate looks like.\n[workspace]\n\n\
             [features]\nverbs = [\"exs/verbs\"]\nfabric = [\"exs/fabric\"]\nsim = [\"exs/sim\"]\n\n\
             [dependencies]\n{exs}\n{patch}"
        ),
    )?;
    write(dir.join("src/main.rs"), PROGRAM)?;
    std::fs::copy(root.join("Cargo.lock"), dir.join("Cargo.lock"))
        .map_err(|e| format!("Cargo.lock: {e}"))?;
    let target = root.join("target");
    let mut ran = Vec::new();
    for (features, want) in COMBINATIONS {
        sys::run(sys::cargo_outside(&dir).args(["build", "--offline", "--features", features]))?;
        let mut c = Command::new(target.join("debug/exs-first"));
        for (k, _) in std::env::vars().filter(|(k, _)| k.starts_with("EXS_")) {
            c.env_remove(k);
        }
        let out = c
            .output()
            .map_err(|e| format!("exs-first ({features}): {e}"))?;
        let (stdout, stderr) = (
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr),
        );
        check(features, want, out.status.success(), &stdout, &stderr)?;
        ran.push(match want {
            Some(b) => format!("[{features}] ran on {b}"),
            None => format!("[{features}] refused in plain words"),
        });
    }
    Ok(format!(
        "features: a crate outside the workspace with no EXS_* variable: {}",
        ran.join(", ")
    ))
}

fn check(features: &str, want: Option<&str>, ok: bool, stdout: &str, stderr: &str) -> Result<()> {
    match want {
        Some(b) if ok && stdout.trim() == format!("echo ok on {b}") => Ok(()),
        None if !ok && stderr.starts_with(VERBS_ALONE) => Ok(()),
        _ => {
            Err(format!(
            "exs with features {features}: want {}, got (exit ok: {ok}) stdout {:?} stderr {:?}",
            want.map_or("the verbs-alone refusal".to_string(), |b| format!("an echo on {b}")),
            stdout.trim(),
            stderr.trim()
        ))
        }
    }
}

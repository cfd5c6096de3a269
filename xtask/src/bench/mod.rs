//! `cargo xtask bench [--quick]`: the seed paper's benchmark set (seed 002, section 5) beside the best peers,
//! measured in the same invocation, interleaved, repeated; medians and ranges go to
//! `bench/results/<date>-<suite>.csv`, SVG plots and a markdown report; the last full run's report is
//! `bench/<suite>.md` (the README links to it and is never rewritten).
//!
//! Suites: `host` (libfabric tcp on 127.0.0.1: exs, the raw libfabric RMA loop, plain TCP with and without
//! Nagle, the three wait modes, and the per-round-trip cost of an 8-byte ping-pong against `fi_pingpong` and
//! blocking TCP, counted by `perf stat`) and `softroce` (one rxe device in the QEMU guest, or natively: exs over verbs, the
//! raw verbs loop, perftest's ib_write_bw / ib_read_bw / ib_send_lat / ib_read_lat, rsockets' rstream and
//! `rstream -T s`).

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::process::Command;
use std::time::{Duration, Instant};

use clap::Args;

use crate::sys::{self, Result};
use crate::{rxe, vm};

mod idle;
mod jobs;
mod parse;
mod plot;
mod report;
mod streams;
#[cfg(test)]
mod tests;

use idle::*;
use jobs::*;
use parse::*;
use plot::*;
use report::*;
use streams::*;

#[derive(Args)]
pub struct BenchArgs {
    /// A representative subset: about ten minutes for the host suite on two cores (each target pair runs several
    /// times a round).
    #[arg(long)]
    pub quick: bool,
    /// Repeats of every point (default 3; quick: 2 on the host, 1 in the Soft-RoCE guest).
    #[arg(long)]
    pub repeats: Option<usize>,
    /// Run one suite only: host or softroce (default: both).
    #[arg(long)]
    pub suite: Option<String>,
}

/// The command as it was given, for the results' header: the flags that change what runs and how often.
fn command_line(a: &BenchArgs) -> String {
    let mut c = String::from("cargo xtask bench");
    if a.quick {
        c.push_str(" --quick");
    }
    if let Some(r) = a.repeats {
        let _ = write!(c, " --repeats {r}");
    }
    if let Some(s) = &a.suite {
        let _ = write!(c, " --suite {s}");
    }
    c
}

/// How a job's output becomes numbers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Parse {
    /// JSON lines of the exs tool: bytes_per_sec, cpu_client, cpu_server, mean_us.
    Json,
    /// perftest bandwidth (BW average, MB/s).
    PerftestBw,
    /// perftest latency (t_typical, usec).
    PerftestLat,
    /// rstream (Gb/sec).
    Rstream,
    /// A ping-pong run with a short and a long count of round trips under `perf stat -x,` (both processes):
    /// system calls and context switches per extra round trip, plus the long run's own latency (exs/tcp JSON, or
    /// fi_pingpong's usec/xfer).
    PerfPing(usize, usize),
    /// A ping-pong run with a short and a long count of round trips under callgrind (every process of the run,
    /// each printing `Collected : N`): user-space instructions per extra round trip, both processes. Unlike time,
    /// this count does not drift with the machine's load.
    Instructions(usize, usize),
}

#[derive(Clone, Debug)]
pub(super) struct Job {
    tool: String,
    variant: String,
    size: u64,
    depth: usize,
    cmd: String,
    parse: Parse,
}

/// One measured number.
#[derive(Clone, Debug)]
pub(super) struct Row {
    suite: String,
    tool: String,
    variant: String,
    size: u64,
    depth: usize,
    metric: String,
    repeat: usize,
    value: f64,
}

pub(super) fn job(
    tool: &str,
    variant: &str,
    size: u64,
    depth: usize,
    cmd: String,
    parse: Parse,
) -> Job {
    Job {
        tool: tool.into(),
        variant: variant.into(),
        size,
        depth,
        cmd,
        parse,
    }
}

#[derive(Clone)]
pub(super) struct Plan {
    sizes: Vec<u64>,
    depths: Vec<usize>,
    seconds: f64,
    pings: usize,
    /// Longest a single job may take before it is killed (a hung peer tool must not hang the run).
    timeout: u32,
    quick: bool,
}

pub(super) fn plan(quick: bool) -> Plan {
    if quick {
        Plan {
            sizes: vec![64, 4096, 65536, 1 << 20],
            depths: vec![8],
            seconds: 0.5,
            pings: 1000,
            timeout: 60,
            quick,
        }
    } else {
        Plan {
            // 64 B: a target pair of issue 26 (the stream beside TCP nodelay) names it.
            sizes: vec![1, 16, 64, 256, 4096, 65536, 1 << 20, 4 << 20, 16 << 20],
            depths: vec![1, 2, 4, 8],
            seconds: 1.5,
            pings: 5000,
            timeout: 180,
            quick,
        }
    }
}

fn run_host(jobs: &[Job], repeats: usize, timeout: u32) -> Result<String> {
    // From a file: the cleanup's pkill patterns must not match the shell's own command line.
    let path = sys::root().join("target/bench-host.sh");
    std::fs::write(&path, script(jobs, repeats, timeout)).map_err(|e| e.to_string())?;
    let out = Command::new("sh")
        .arg(&path)
        .current_dir(sys::root())
        .output()
        .map_err(|e| e.to_string())?;
    eprint!("{}", String::from_utf8_lossy(&out.stderr));
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

pub fn run(a: BenchArgs) -> Result<()> {
    let started = Instant::now();
    sys::ensure_packages(sys::BUILD_PACKAGES)?;
    // fi_pingpong (libfabric's own ping-pong), perf and valgrind (per-round-trip counts) for the cost table.
    // valgrind (callgrind): user-space instructions per round trip, beside the system calls.
    sys::ensure_packages(&["libfabric-bin", "linux-perf", "valgrind"])?;
    let exe = sys::dist_exs()?;
    // The guest runs xtask only to bring its devices up: no need to optimize it as one unit.
    sys::run(sys::cargo().args(["build", "--release", "-p", "xtask"]))?;
    let exe = exe.to_string_lossy();
    // Issue 30: the C library's release layout and its examples (the ping-pong is measured beside `exs ping`).
    let c_bin = crate::capi::install(&sys::root().join("target/c"), true)
        .and_then(|prefix| crate::capi::build_programs(&prefix))?;
    let c_bin = c_bin.to_string_lossy();
    let p = plan(a.quick);
    let repeats = a.repeats.unwrap_or(if a.quick { 2 } else { 3 });
    let cmd = command_line(&a);
    let machine = machine();
    let want = |s: &str| a.suite.as_deref().is_none_or(|w| w == s);
    if want("host") {
        let mut jobs = host_jobs(&exe, &c_bin, &p);
        jobs.extend(stream_jobs(&build_stream_bench()?, a.quick));
        eprintln!(
            "xtask: host suite: {} points x {repeats} repeats",
            jobs.len()
        );
        let out = run_host(&jobs, repeats, p.timeout)?;
        let rows = collect("host", &jobs, &out);
        let md = write_results(
            "host",
            a.quick,
            &rows,
            &cmd,
            &format!("{machine}, libfabric tcp on 127.0.0.1"),
        )?;
        publish("host", a.quick, &md)?;
        eprintln!(
            "xtask: host suite done at {:.0}s",
            started.elapsed().as_secs_f64()
        );
    }
    if want("softroce") {
        softroce_suite(&a, &exe, &c_bin, &p, repeats, &cmd, &machine)?;
    }
    eprintln!("xtask: bench took {:.0?}", started.elapsed());
    Ok(())
}

/// The Soft-RoCE suite: rxe and, beside it in the same guest boot (or natively, where the kernel has both), siw.
fn softroce_suite(
    a: &BenchArgs,
    exe: &str,
    c_bin: &str,
    p: &Plan,
    repeats: usize,
    cmd: &str,
    machine: &str,
) -> Result<()> {
    let native = sys::is_root()
        && exs_backend_softroce::kernel_supports(exs_backend_softroce::Kind::Rxe).is_ok();
    // siw: this kernel's own natively, else a build for the guest's kernel.
    let (vm, siw_load) = if native {
        let has = exs_backend_softroce::kernel_supports(exs_backend_softroce::Kind::Siw).is_ok();
        (None, has.then(String::new))
    } else {
        sys::ensure_packages(&["perftest", "rdmacm-utils"])?;
        let v = vm::Vm::prepare()?;
        let load = crate::siw::prepare(v.dir(), &v.kver)
            .map(|m| {
                format!(
                    "ulimit -l unlimited\n{}",
                    crate::siw::load_lines(&m.path(crate::siw::Variant::Stock))
                )
            })
            .map_err(|e| eprintln!("xtask: no siw in this run: {e}"))
            .ok();
        (Some(v), load)
    };
    let mut jobs = softroce_jobs(exe, c_bin, &build_stream_bench()?, p, a.quick);
    if siw_load.is_some() {
        jobs.extend(siw_jobs(exe, p, a.quick));
    }
    // One round in the guest for --quick: its points take 5-10 s each (emulated CPU), and the quick run must stay
    // within five minutes; the full run repeats.
    let repeats = a.repeats.unwrap_or(if a.quick { 1 } else { repeats });
    eprintln!(
        "xtask: Soft-RoCE suite: {} points x {repeats} repeats",
        jobs.len()
    );
    let xtask = sys::root().join("target/release/xtask");
    // The tool's server and client talk over TCP on the device's address, which needs `lo` up (a fresh guest
    // has it down).
    let siw_up = siw_load.as_ref().map_or(String::new(), |load| {
        format!("{load}{} rxe up --siw >&2 || exit 90\n", xtask.display())
    });
    let body = format!(
        "ip link set lo up\n{} rxe up >&2 || exit 90\n{siw_up}{}",
        xtask.display(),
        script(&jobs, repeats, p.timeout.max(90))
    );
    let (out, where_) = if native {
        let path = sys::root().join("target/bench-softroce.sh");
        std::fs::write(&path, &body).map_err(|e| e.to_string())?;
        let o = Command::new("sh")
            .arg(&path)
            .current_dir(sys::root())
            .output()
            .map_err(|e| e.to_string())?;
        (
            String::from_utf8_lossy(&o.stdout).into_owned(),
            format!("{machine}, Soft-RoCE natively"),
        )
    } else {
        let v = vm.as_ref().expect("prepared above");
        (
            run_in_guest(v, &body)?,
            format!(
                "{machine}, rxe{} in a QEMU guest ({:?}, 2 vCPUs, emulated CPU: compare ratios only)",
                if siw_load.is_some() { " and siw" } else { "" },
                v.accel
            ),
        )
    };
    let rows = collect("softroce", &jobs, &out);
    let md = write_results("softroce", a.quick, &rows, cmd, &where_)?;
    publish("softroce", a.quick, &md)?;
    Ok(())
}

/// Runs a benchmark script in the guest; returns its standard output (its errors pass through).
fn run_in_guest(v: &vm::Vm, body: &str) -> Result<String> {
    let mut out = String::new();
    let o = v.run_streaming(
        &format!("cd {}\n{body}", sys::root().display()),
        Duration::from_secs(3600),
        &mut |l, err| {
            if err {
                eprintln!("{l}");
            } else {
                out.push_str(l);
                out.push('\n');
            }
        },
    )?;
    if o.rc != Some(0) {
        eprintln!(
            "xtask: the benchmark script in the VM ended with {:?}",
            o.rc
        );
    }
    Ok(out)
}

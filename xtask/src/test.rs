//! `cargo xtask test`: every test but the iWARP suite's (`--suite siw`, [`crate::test_siw`]), with a per-backend
//! summary of the conformance suite.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use clap::Args;

use crate::runner::{
    build_checked, checked_tests, conformance_exe, finish, run_counting, run_sections, xtask_copy,
    Sections, RETRY_CASES, RUN, SECTION,
};
use crate::sys::{self, Result};
use crate::{rxe, vm};

#[derive(Args)]
pub struct TestArgs {
    /// Do not try to install missing system packages.
    #[arg(long)]
    pub no_install: bool,
    /// Run only the conformance suite, on these backends (sim, fabric, softroce; default: all); `two-guests`
    /// alone runs only the stage across two QEMU guests (with `--suite siw` too).
    #[arg(long, value_delimiter = ',')]
    pub backend: Vec<String>,
    /// `siw`: instead, the iWARP suite: the conformance suite on soft-iWARP (built for the guest's kernel), in one
    /// guest (stock and peer-to-peer builds) and across two, and on rxe driven the iWARP way; `.ci/run` runs it
    /// after the default suite.
    #[arg(long)]
    pub suite: Option<String>,
}

/// One conformance run on the host: its section name, the backend, a variable that sets the variant.
struct HostSection {
    section: &'static str,
    backend: &'static str,
    env: Option<(&'static str, &'static str)>,
}

/// The case that holds as many connections as the process's descriptor limit allows (both ends in one process)
/// runs by itself after the rest of its section: the cases that run in parallel hold descriptors too, and beside
/// them it ran out of descriptors once in a clean-clone run, on queues without a wait object (whose cases are slower
/// and overlap it longer).
const ALONE: &str = "ten_thousand_connections_open_idle_and_close";

/// The host's conformance runs: the simulator, libfabric tcp (completion queues with `FI_WAIT_POLLFD`, the
/// default), libfabric tcp with `FI_WAIT_FD` queues (`EXS_FABRIC_CQ_WAIT=fd`), and with queues without a wait
/// object (`EXS_FABRIC_CQ_WAIT=none`, for busy polling).
const HOST_SECTIONS: &[HostSection] = &[
    HostSection {
        section: "sim",
        backend: "sim",
        env: None,
    },
    HostSection {
        section: "fabric",
        backend: "fabric",
        env: None,
    },
    HostSection {
        section: "fabric:cq-wait-fd",
        backend: "fabric",
        env: Some(("EXS_FABRIC_CQ_WAIT", "fd")),
    },
    HostSection {
        section: "fabric:cq-no-wait",
        backend: "fabric",
        env: Some(("EXS_FABRIC_CQ_WAIT", "none")),
    },
];

/// The limits a small device might report, forced on rxe (`verbs:small-limits`): nothing inline, two scatter/gather
/// entries (the least exs works with: a header and its data), a short send queue, one read at a time, 64 KiB per
/// operation; with write-with-immediate emulated, so the immediates' payloads come from their registered slab
/// rather than inline.
pub const SMALL_LIMITS: &str =
    "EXS_VERBS_EMULATE_IMM=1 EXS_VERBS_INLINE=0 EXS_VERBS_SGE=2 EXS_VERBS_SEND_DEPTH=32 \
                                EXS_VERBS_READ_DEPTH=1 EXS_VERBS_MAX_MESSAGE=64K";

/// The settings that drive rxe the way an iWARP adapter is driven, through the plain verbs backend:
/// write-with-immediate forced off (the write + send fallback), memory windows off (a registration per exposure),
/// RDMA read sinks registered per read and no receiver-not-ready retry (a message that finds no receive fails its
/// connection; connections post receives of their own, and a few cases run again with the shared pool required) (`verbs:write-imm-emulated,no-windows,read-sinks,no-rnr-retry`, in `--suite siw`).
pub const IWARP_SHAPED: &str =
    "EXS_VERBS_EMULATE_IMM=1 EXS_VERBS_WINDOWS=0 EXS_VERBS_READ_SINKS=1 EXS_VERBS_RNR_RETRY=0";

/// The shell lines that run the RDMA part of the conformance suite: every test on the Soft-RoCE device at the
/// near end of the veth link (so the two-host test reaches the far end; memory windows); the transfers of every
/// size and the who-sends-first cases under [`SMALL_LIMITS`]; and the two-host test of the libfabric backend across
/// the same link (the host has no second host to offer it). The same device driven the way an iWARP adapter is
/// ([`IWARP_SHAPED`]) runs in `--suite siw`, beside the real iWARP device.
///
/// The Soft-RoCE section runs four cases at once: in the emulated guest, with two processors, its cases wait on the
/// device more than they compute (53 s against 66 s with two; eight took 60 s). The cases that measure a share of
/// direct transfers run after them, two at a time, as before.
fn rdma_script(xtask: &Path, exe: &Path) -> String {
    const GUEST_THREADS: usize = 4;
    // The cases that measure how much of a stream goes direct after a block: a receiver slowed by its neighbours
    // advertises late, and the share falls (87% against the 90% they require, once, with four at once).
    const SHARE: &str = "direct_transfers_resume_after_";
    let (_, _, near) = rxe::NEAR;
    let (_, _, far) = rxe::FAR;
    let peer = format!("EXS_PEER_ADDR={far} EXS_PEER_LINK={}", rxe::NEAR.1);
    let exe = exe.display();
    format!(
        "set -u
export {RETRY_CASES}
{xtask} rxe up --link || {{ echo 'xtask: Soft-RoCE setup failed' >&2; exit 90; }}
{SECTION}{RUN}section softroce
run env EXS_SOFTROCE_ADDR={near} {peer} {exe} softroce:: --test-threads {GUEST_THREADS} --skip {SHARE}
run env EXS_SOFTROCE_ADDR={near} {peer} {exe} softroce::{SHARE}
section verbs:small-limits
run env EXS_VERBS_ADDR={near} {SMALL_LIMITS} {exe} verbs::seqpacket_sizes_1b_to_16mib --exact
run env EXS_VERBS_ADDR={near} {SMALL_LIMITS} {exe} verbs::stream_sizes_1b_to_16mib --exact
run env EXS_VERBS_ADDR={near} {SMALL_LIMITS} {exe} verbs::the_
section fabric:over-the-link
run env EXS_FABRIC_ADDR={near} {peer} {exe} fabric::two_hosts_over_a_link --exact
section tools:verbs
tool() {{ name=$1; shift; if \"$@\" >&2; then echo \"test tools::$name ... ok\"; echo 'test result: ok. 1 passed; 0 failed; 0 ignored'; else echo \"test tools::$name ... FAILED\"; echo 'test result: FAILED. 0 passed; 1 failed; 0 ignored'; fi; }}
tool raw_baseline_runs_on_verbs_with_memory_windows {tool} rawpump --backend verbs --addr {near} --op read --size 64K --seconds 0.5 --json
tool pump_on_one_host_over_verbs {tool} pump --backend verbs --addr {near} --size 64K --seconds 0.5 --json
",
        xtask = xtask.display(),
        tool = sys::root().join("target/debug/exs").display(),
    )
}

/// Where the RDMA tests run: here when the kernel has Soft-RoCE and we may configure it, else in the QEMU guest
/// (returns whether they ran in a guest).
/// `EXS_RDMA_TESTS=native|vm` forces one.
fn rdma_conformance(
    exe: &Path,
    summary: &mut Vec<String>,
    failures: &mut Vec<String>,
) -> Result<bool> {
    let xtask = xtask_copy()?;
    // Issue 30: the C examples and tests over verbs, a section of their own after the others.
    let script = rdma_script(&xtask, exe) + &crate::capi::rdma_section(rxe::NEAR.2);
    let forced = std::env::var("EXS_RDMA_TESTS").ok();
    let native = match forced.as_deref() {
        Some("native") => true,
        Some("vm") => false,
        _ => {
            sys::is_root()
                && exs_backend_softroce::kernel_supports(exs_backend_softroce::Kind::Rxe).is_ok()
        }
    };
    let mut sections = Sections::default();
    let start = std::time::Instant::now();
    let where_ = if native {
        eprintln!("xtask: this kernel has Soft-RoCE: running the RDMA tests natively");
        let existed: Vec<String> = exs_backend_softroce::devices()
            .into_iter()
            .map(|d| d.name)
            .collect();
        let ok = run_sections(Command::new("sh").args(["-c", &script]), &mut sections)?;
        if !existed.iter().any(|d| d == rxe::NEAR.0) {
            rxe::down();
        }
        if !ok && sections.is_empty() {
            return Err("the Soft-RoCE setup failed (see above)".into());
        }
        " (native)".to_string()
    } else {
        eprintln!("xtask: no usable Soft-RoCE in this kernel: running the RDMA tests in a throw-away QEMU guest");
        let vm = vm::Vm::prepare()?;
        let o = vm.run_streaming(&script, Duration::from_secs(40 * 60), &mut |l, e| {
            sections.line(l, e)
        })?;
        match o.rc {
            None => {
                return Err(format!(
                    "the VM gave no exit code; console:\n{}",
                    vm::tail(&o.console, 40)
                ))
            }
            Some(90) => {
                return Err(format!(
                    "Soft-RoCE setup failed in the VM; console:\n{}",
                    vm::tail(&o.console, 40)
                ))
            }
            Some(_) => {}
        }
        format!(" (QEMU guest, kernel {}, {:?})", vm.kver, vm.accel)
    };
    sections.report(&where_, summary, failures);
    summary.push(format!("RDMA tests took {:.0?}", start.elapsed()));
    Ok(!native)
}

pub fn run(args: TestArgs) -> Result<()> {
    if !args.no_install {
        sys::ensure_packages(sys::BUILD_PACKAGES)?;
    }
    match args.suite.as_deref() {
        None | Some("default") => {}
        Some("siw") => {
            let only_pair =
                !args.backend.is_empty() && args.backend.iter().all(|b| b == "two-guests");
            return crate::test_siw::run(only_pair);
        }
        Some(other) => return Err(format!("unknown suite {other:?} (default, siw)")),
    }
    let mut out = Outcome::default();
    let only_conformance = !args.backend.is_empty();
    let wanted = |b: &str| !only_conformance || args.backend.iter().any(|x| x == b);
    // Everything but the conformance suite and the property tests, which run from the checked optimized build
    // (`checked_tests`), with the workspace tests' features: they reuse this build.
    out.timed("build", |_| sys::run(&mut debug_build()))?;
    if !only_conformance {
        checks(&mut out);
        workspace_tests(&mut out)?;
        users_stages(&mut out);
    }
    let exe = out.timed("conformance build", |_| conformance_exe())?;
    out.timed("host conformance", |o| host_conformance(&exe, &wanted, o));
    if only_conformance && args.backend.iter().all(|b| b == "two-guests") {
        // Only the two-guest stage (`--backend two-guests`).
        two_guests(&exe, &mut out);
    } else if wanted("softroce") || wanted("verbs") {
        rdma_stages(&exe, &mut out);
    }
    out.summary.push(out.times_line());
    finish("cargo xtask test", &out.summary, &out.failures)
}

/// The debug build: every crate and target but the conformance suite's and the property tests'.
pub fn debug_build() -> Command {
    let mut cmd = workspace("build");
    cmd.arg("--all-targets");
    cmd
}

/// `cargo SUBCOMMAND` over the debug build's crates, with its features.
fn workspace(subcommand: &str) -> Command {
    let mut cmd = sys::cargo();
    cmd.args([
        subcommand,
        "--workspace",
        "--exclude",
        "exs-conformance",
        "--exclude",
        "exs-props",
        "--features",
        WORKSPACE_FEATURES,
    ]);
    cmd
}

/// The module of the tools' server cases (`tools/exs/tests/server/`), which run apart.
const SERVED: &str = "served::";

/// The features of the debug build and the workspace tests (the crates enable their backends themselves).
const WORKSPACE_FEATURES: &str = "exs/sim,exs/tokio";

/// Every backend feature of the workspace, for clippy.
const ALL_FEATURES: &str =
    "exs-conformance/sim,exs-conformance/fabric,exs-conformance/softroce,exs/tokio";

/// The run's summary lines, the names of what failed, and how long each stage took.
#[derive(Default)]
struct Outcome {
    summary: Vec<String>,
    failures: Vec<String>,
    times: Vec<(&'static str, Duration)>,
}

impl Outcome {
    /// Runs one stage, timed: where the clean-clone run's fifteen minutes go.
    fn timed<R>(&mut self, stage: &'static str, f: impl FnOnce(&mut Self) -> R) -> R {
        let start = std::time::Instant::now();
        let r = f(self);
        self.times.push((stage, start.elapsed()));
        r
    }

    /// `stage times: build 97 s, clippy 35 s, ...; 994 s in these stages` (the rest: installing, rustfmt).
    fn times_line(&self) -> String {
        let each: Vec<String> = self
            .times
            .iter()
            .map(|(s, d)| format!("{s} {:.0} s", d.as_secs_f64()))
            .collect();
        let all: Duration = self.times.iter().map(|(_, d)| *d).sum();
        format!(
            "stage times: {}; {:.0} s in these stages",
            each.join(", "),
            all.as_secs_f64()
        )
    }

    /// A stage that reports one line: the line when it passed; `what: error` and a failure when it did not.
    fn stage(&mut self, what: &str, failure: &str, r: Result<String>) {
        match r {
            Ok(line) => self.summary.push(line),
            Err(e) => {
                eprintln!("xtask: {what}: {e}");
                self.summary.push(format!("{what}: {e}"));
                self.failures.push(failure.to_string());
            }
        }
    }

    /// A test command: its counts, and a failure when it failed, any test did, or none ran (a filter that no longer
    /// selects anything must not pass unnoticed).
    fn tally(&mut self, what: &'static str, label: &str, cmd: &mut Command) -> Result<()> {
        let (c, ok, _) = self.timed(what, |_| run_counting(cmd))?;
        if !ok || c.failed > 0 || c.passed == 0 {
            self.failures.push(what.to_string());
        }
        self.summary.push(format!(
            "{label}: {} ran, {} passed, {} failed",
            c.passed + c.failed,
            c.passed,
            c.failed
        ));
        Ok(())
    }
}

/// Lints, formatting, documentation and packaging.
fn checks(out: &mut Outcome) {
    // Lints are part of the test: every crate, every target, every backend feature, warnings denied.
    let mut clippy = sys::cargo();
    clippy.args([
        "clippy",
        "--workspace",
        "--all-targets",
        "--features",
        ALL_FEATURES,
        "--",
        "-D",
        "warnings",
    ]);
    out.timed("clippy", |o| {
        o.stage(
            "clippy",
            "clippy",
            sys::run(&mut clippy)
                .map(|()| "clippy (all crates and targets, -D warnings): clean".to_string()),
        )
    });
    // Formatting: the tree is as `cargo fmt` leaves it (rustfmt ships with every rustup toolchain).
    out.stage(
        "rustfmt",
        "rustfmt",
        sys::run(sys::cargo().args(["fmt", "--all", "--", "--check"]))
            .map(|()| "rustfmt: clean".to_string()),
    );
    // The public crates' documentation, every feature on: every link resolved, every warning denied (the
    // crates that must document every item say so themselves, `#![deny(missing_docs)]`).
    out.timed("cargo doc", |o| {
        o.stage(
            "cargo doc",
            "cargo doc",
            crate::package::doc_command()
                .and_then(|mut c| sys::run(&mut c))
                .map(|()| {
                    "cargo doc (every public crate, every feature, -D warnings): clean".to_string()
                }),
        )
    });
    // Every public crate packages, with every file its build reads; rust-version is not newer than this compiler.
    // The crates outside the workspace (`users_stages`) build exs and its backends from these packages.
    out.timed("cargo package", |o| {
        o.stage(
            "cargo package",
            "cargo package",
            crate::package::stage(&mut debug_build()),
        )
    });
}

/// The workspace's tests, the front page's examples, the long property runs and the fuzz targets.
fn workspace_tests(out: &mut Outcome) -> Result<()> {
    out.tally(
        "workspace tests",
        "workspace (unit, protocol, property tests)",
        workspace("test")
            .arg("--no-fail-fast")
            .args(["--", "--skip", SERVED]),
    )?;
    // The tools' server cases spend their time waiting on a server's limits, not computing: eight at once took
    // them from 31 s to 12 s on two cores. Selected from the whole workspace, as the debug build was, so that
    // nothing is built again with other features.
    out.tally(
        "tools' server tests",
        "the exs tool's servers against hostile clients, eight cases at once",
        workspace("test")
            .args(["--test", "server", "--", SERVED])
            .env("RUST_TEST_THREADS", "8"),
    )?;
    // The front page's examples on the real default backend (libfabric tcp on loopback), as a user builds them.
    out.tally(
        "doc examples on libfabric",
        "doc examples (exs, features fabric and tokio: libfabric tcp on 127.0.0.1)",
        sys::cargo().args(["test", "--doc", "-p", "exs", "--features", "fabric,tokio"]),
    )?;
    out.timed("optimized build", |_| build_checked())?;
    // The long property runs, in the checked optimized build: 10,000 stream cases (issue: "at least 10,000 cases in CI")
    // and 2,000 message-mode cases.
    out.tally(
        "long property tests",
        "property tests, optimized with overflow checks and debug assertions (10,000 stream + 2,000 message cases)",
        checked_tests(&["stream_props", "message_props"])
            .env("EXS_STREAM_CASES", "10000")
            .env("EXS_PROPTEST_CASES", "2000"),
    )?;
    // The fuzz targets as bounded property tests, optimized so that they cover ground.
    out.tally(
        "fuzz property tests",
        "fuzz targets as property tests, optimized with overflow checks (16,000 wire inputs, 1,000 + 200 crafted-peer runs)",
        checked_tests(&["fuzz_props"]).env("EXS_FUZZ_CASES", "1000"),
    )
}

/// What a user meets: a short soak, a crate outside the workspace, the feature combinations, the C library.
fn users_stages(out: &mut Outcome) {
    // A short soak on sim and libfabric tcp (`cargo xtask soak` runs long ones).
    let soak = out.timed("soak", |_| {
        crate::soak::soak_with(&sys::root().join("target/debug/exs"), 20, 1)
    });
    match soak {
        Ok(lines) => out
            .summary
            .extend(lines.into_iter().map(|l| format!("soak: {l}"))),
        Err(e) => {
            out.summary.push(format!("soak: {e}"));
            out.failures.push("soak".to_string());
        }
    }
    // Issue 16: a user's crate outside the workspace, depending on exs alone, builds and runs the examples.
    out.timed("outside crate", |o| {
        o.stage("outside crate", "outside crate", crate::outside::run())
    });
    // Issue 29: features are additive; each backend alone and all together, with no EXS_* variable.
    out.timed("features", |o| {
        o.stage(
            "features",
            "feature combinations",
            crate::outside::features::run(),
        )
    });
    // Issue 30: the C library's layout, the C examples and the C API's tests, on libfabric tcp.
    out.timed("C API", |o| {
        crate::capi::host_stage(&mut o.summary, &mut o.failures)
    });
}

/// The conformance suite on the host's backends that are wanted, in two lanes side by side ([`HOST_LANES`]): one
/// section's cases kept the two cores about half busy. The first lane's lines are echoed as they come (a case that
/// hangs shows where); the second's are held and echoed whole once both lanes are done, whatever became of them,
/// so that each section reads in one piece.
fn host_conformance(exe: &Path, wanted: &dyn Fn(&str) -> bool, out: &mut Outcome) {
    let alone = std::sync::Mutex::new(());
    let lanes: Vec<(Sections, Result<()>)> = std::thread::scope(|s| {
        let lanes: Vec<_> = HOST_LANES
            .iter()
            .enumerate()
            .map(|(i, lane)| {
                let sections: Vec<&HostSection> = HOST_SECTIONS
                    .iter()
                    .filter(|h| lane.contains(&h.section) && wanted(h.backend))
                    .collect();
                let alone = &alone;
                s.spawn(move || {
                    let mut host = match i {
                        0 => Sections::default(),
                        _ => Sections::held(),
                    };
                    let r = sections
                        .into_iter()
                        .try_for_each(|h| host_section(exe, h, alone, &mut host));
                    (host, r)
                })
            })
            .collect();
        lanes
            .into_iter()
            .map(|l| {
                l.join()
                    .unwrap_or_else(|_| (Sections::default(), Err("a lane panicked".into())))
            })
            .collect()
    });
    for (mut host, r) in lanes {
        host.echo_held();
        host.report("", &mut out.summary, &mut out.failures);
        // A run that could not be started or waited for fails the stage, and the rest of the run goes on.
        if let Err(e) = r {
            out.summary
                .push(format!("host conformance: could not run: {e}"));
            out.failures.push("host conformance".into());
        }
    }
}

/// The host's sections (of [`HOST_SECTIONS`]) in the lanes that run side by side, each lane's in turn: about the
/// same time each.
const HOST_LANES: [&[&str]; 2] = [
    &["sim", "fabric"],
    &["fabric:cq-wait-fd", "fabric:cq-no-wait"],
];

/// One section: its cases, then [`ALONE`] by itself in a process of its own, holding `alone` so that the two
/// lanes' [`ALONE`] runs do not overlap (each may hold some ten thousand of the host's TCP ports). A run that ends
/// badly with no case failed (a crash before its results) counts as a failed case of its section.
fn host_section(
    exe: &Path,
    h: &HostSection,
    alone: &std::sync::Mutex<()>,
    host: &mut Sections,
) -> Result<()> {
    host.line(&format!("@@section {}", h.section), false);
    host.line(&format!("@@section {}", h.section), true);
    let mut cmd = Command::new(exe);
    cmd.arg(format!("{}::", h.backend))
        // The two-host case needs the link that the RDMA stage builds; it runs there.
        .args(["--skip", "two_hosts_over_a_link"])
        .args(["--skip", "peer_host_killed_mid_transfer"]);
    cmd.args(["--skip", ALONE]);
    let mut by_itself = Command::new(exe);
    by_itself
        .arg(format!("{}::{ALONE}", h.backend))
        .arg("--exact");
    for c in [&mut cmd, &mut by_itself] {
        if let Some((k, v)) = h.env {
            c.env(k, v);
        }
    }
    let ok = run_sections(&mut cmd, host)?;
    host.ended(ok);
    let _one_at_a_time = alone.lock().unwrap_or_else(|p| p.into_inner());
    let ok = run_sections(&mut by_itself, host)?;
    host.ended(ok);
    Ok(())
}

/// The RDMA stage (Soft-RoCE in a guest, or natively), then, where it ran in a guest, the stage across two.
fn rdma_stages(exe: &Path, out: &mut Outcome) {
    let rdma = out.timed("RDMA (one guest)", |o| {
        rdma_conformance(exe, &mut o.summary, &mut o.failures)
    });
    match rdma {
        Err(e) => {
            out.summary.push(format!("conformance on Soft-RoCE: could not run: {e}"));
            out.failures.push("conformance on Soft-RoCE".into());
        }
        // Issue 17: across two guests with kernels of their own (where the RDMA tests ran in a guest).
        Ok(true) => two_guests(exe, out),
        Ok(false) => out.summary.push(
            "two guests: not run (native Soft-RoCE: the cross-host cases ran over the veth link in one kernel)"
                .into(),
        ),
    }
}

/// The stage across two QEMU guests with rxe.
fn two_guests(exe: &Path, out: &mut Outcome) {
    let tool = sys::root().join("target/debug/exs");
    let dev = vm::GuestDevice::Rxe;
    let r = out.timed("two guests", |o| {
        crate::twohosts::run(exe, &tool, &dev, &mut o.summary, &mut o.failures)
    });
    if let Err(e) = r {
        out.summary.push(format!("two guests: could not run: {e}"));
        out.failures.push("two guests".into());
    }
}

#[cfg(test)]
mod tests {
    use super::{HOST_LANES, HOST_SECTIONS};

    #[test]
    fn every_host_section_runs_in_exactly_one_lane() {
        for h in HOST_SECTIONS {
            let lanes = HOST_LANES.iter().filter(|l| l.contains(&h.section)).count();
            assert_eq!(lanes, 1, "{} is in {lanes} lanes", h.section);
        }
        let named: usize = HOST_LANES.iter().map(|l| l.len()).sum();
        assert_eq!(
            named,
            HOST_SECTIONS.len(),
            "a lane names a section that does not exist"
        );
    }
}

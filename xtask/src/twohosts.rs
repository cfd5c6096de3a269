//! The two-guest stage of `cargo xtask test` (issue 17): two QEMU guests, each with its own kernel and its own
//! rxe (or, in `--suite siw`, siw) device on a virtual link between them (no kernel sees both ends; `vm::Vm::run_pair`). Guest 0 runs the
//! conformance cases that need a second host, with the peer's processes started and killed by an agent in guest 1
//! (`EXS_PEER_AGENT`), on verbs and on libfabric tcp; then `exs pump --server` in guest 0 against
//! `exs pump --client` in guest 1 (verbs and fabric), and `ib_write_bw` between the same two guests.

use std::path::Path;
use std::time::Duration;

use crate::runner::{Sections, RUN, SECTION};
use crate::sys::Result;
use crate::vm::{self, GuestDevice, PAIR_ADDRS};

const AGENT_PORT: u16 = 18600;
const PUMP_PORT: u16 = 18515;
/// perftest's steps take ports from here on, one each.
const PERFTEST_PORT: u16 = 18530;
/// The cases that need a second host.
const CASES: [&str; 2] = ["two_hosts_over_a_link", "peer_host_killed_mid_transfer"];
/// Points of the pump across the link (the guests emulate their CPUs: a few, short; the figures show that the
/// tools work across two kernels, they are not a benchmark).
const PUMP: &str = "--size 64K,1M --seconds 1 --json";

/// perftest's device flags: iWARP connects through rdma_cm only (`-R`).
fn perftest_dev(dev: &GuestDevice) -> String {
    match dev {
        GuestDevice::Rxe => format!("-d {}", dev.name()),
        GuestDevice::Siw(_) => format!("-d {} -R", dev.name()),
    }
}

/// One run of a peer tool (perftest) across the link: the same arguments on both sides, the client adding the
/// server's address.
struct PeerStep {
    tool: &'static str,
    args: String,
}

/// perftest's runs across the link, each on a port of its own: a client that retries after a failed run can only
/// meet the server of its own step, never a later one.
fn perftest_steps(dev: &GuestDevice) -> Vec<PeerStep> {
    let pt = perftest_dev(dev);
    let runs = [
        ("ib_write_bw", "-s 65536 -n 100"),
        ("ib_write_bw", "-s 1048576 -n 10"),
        ("ib_send_lat", "-s 8 -n 50"),
    ];
    runs.iter()
        .zip(PERFTEST_PORT..)
        .map(|(&(tool, sizes), port)| PeerStep {
            tool,
            args: format!("{tool} {pt} -p {port} {sizes}"),
        })
        .collect()
}

/// Shell function for the server side of a peer-tool step: a server whose run failed (perftest's own, between soft
/// devices, can end with a flushed work request) starts again for its client's retry, a few times. Each run is
/// bounded; one that timed out (no client came: it moved on) is not started again, so a step holds the guest for
/// two minutes at most beyond its failures.
const SERVE: &str = "serve() { n=0; while [ $n -lt 3 ]; do timeout -k 10 120 \"$@\"; rc=$?; [ $rc -eq 0 ] && return 0; [ $rc -eq 124 ] && return 1; [ $rc -eq 127 ] && return 127; n=$((n+1)); echo \"PAIR-NOTE $1 server run $n failed ($rc)\" >&2; done; return 1; }\n";

/// Shell function for the client side of a peer-tool step: tries `$2...` until it succeeds or `$1` seconds have
/// gone by (the server may not listen yet), each try under `timeout` for what is left of them (at most 120 s, as a
/// server's run), so that a step ends within `$1` and ten seconds. Bounded in time, not in tries: after
/// perftest's client crashed between soft devices, each later try could spend some 15 s failing to resolve the
/// address, and sixty of them held the pair for a quarter of an hour. A tool that is not there (127) is not
/// tried again.
const PEER_RETRY: &str = "peer_retry() { end=$(( $(date +%s) + $1 )); shift; while :; do left=$(( end - $(date +%s) )); [ $left -gt 120 ] && left=120; [ $left -lt 1 ] && return 1; timeout -k 10 $left \"$@\"; rc=$?; [ $rc -eq 0 ] && return 0; [ $rc -eq 127 ] && return 127; sleep 1; done; }\n";

/// Seconds a peer-tool client keeps trying.
const PEER_PATIENCE: u32 = 120;

/// What a peer-tool step's side says when it failed: a tool missing from the guest (127) is a failure of the
/// stage's setup; any other failure is perftest's own ([`peer_failed`]).
fn peer_outcome(tool: &str, side: &str) -> String {
    format!(
        "|| {{ [ $? -eq 127 ] && echo 'PAIR-FAIL {tool} {side}: not found' || echo 'PAIR-PEER-FAIL {tool} {side}'; }}"
    )
}

fn guest0(exe: &Path, tool: &Path, dev: &GuestDevice) -> String {
    let (near, far) = (PAIR_ADDRS[0], PAIR_ADDRS[1]);
    let exe = exe.display();
    let tool = tool.display();
    let agent = format!("{far}:{AGENT_PORT}");
    let mut s = format!("{SECTION}{RUN}");
    // With siw the libfabric tcp stage would repeat the rxe run's: only verbs, on siw.
    let backends: &[(&str, &str)] = match dev {
        GuestDevice::Rxe => &[("verbs", "EXS_VERBS_ADDR"), ("fabric", "EXS_FABRIC_ADDR")],
        GuestDevice::Siw(_) => &[("verbs", "EXS_VERBS_ADDR")],
    };
    let label = match dev {
        GuestDevice::Rxe => "two-guests",
        GuestDevice::Siw(_) => "siw-two-guests",
    };
    for (backend, var) in backends {
        s.push_str(&format!("section {backend}:{label}\n"));
        for case in CASES {
            s.push_str(&format!(
                "run env {var}={near} EXS_PEER_ADDR={far} EXS_PEER_LINK=eth0 EXS_PEER_AGENT={agent} {exe} \
                 {backend}::{case} --exact\n"
            ));
        }
    }
    s.push_str(&format!(
        "env EXS_PEER_AGENT={agent} EXS_CONFORMANCE_ROLE=agent-quit {exe}\n\
         echo '@@pump servers'\n\
         {tool} pump --server --once --backend verbs --addr {near} -p {PUMP_PORT} || echo 'PAIR-FAIL pump server verbs'\n\
         {tool} pump --server --once --backend fabric --addr {near} -p {} || echo 'PAIR-FAIL pump server fabric'\n\
         {tool} ping --server --once --backend verbs --addr {near} -p {} || echo 'PAIR-FAIL ping server verbs'\n\
         {tool} demo --server --once --backend verbs --addr {near} -p {} || echo 'PAIR-FAIL demo server verbs'\n",
        PUMP_PORT + 1,
        PUMP_PORT + 2,
        PUMP_PORT + 3,
    ));
    s.push_str(SERVE);
    for step in perftest_steps(dev) {
        s.push_str(&format!(
            "serve {} >/dev/null {}\n",
            step.args,
            peer_outcome(step.tool, "server")
        ));
    }
    s
}

fn guest1(exe: &Path, tool: &Path, dev: &GuestDevice) -> String {
    let (near, far) = (PAIR_ADDRS[0], PAIR_ADDRS[1]);
    let exe = exe.display();
    let tool = tool.display();
    let mut s = format!(
        "{retry}env EXS_VERBS_ADDR={far} EXS_FABRIC_ADDR={far} EXS_SOFTROCE_ADDR={far} EXS_CONFORMANCE_ROLE=agent \
         EXS_CONFORMANCE_AGENT={far}:{AGENT_PORT} {exe}\n\
         echo 'PAIR-POINT verbs'\n\
         retry {tool} pump --client {near}:{PUMP_PORT} --backend verbs --addr {far} {PUMP} || echo 'PAIR-FAIL pump client verbs'\n\
         echo 'PAIR-POINT fabric'\n\
         retry {tool} pump --client {near}:{} --backend fabric --addr {far} {PUMP} || echo 'PAIR-FAIL pump client fabric'\n\
         echo 'PAIR-POINT ping'\n\
         retry {tool} ping --client {near}:{} --backend verbs --addr {far} --size 8 --count 50 --json || echo 'PAIR-FAIL ping client verbs'\n\
         echo 'PAIR-POINT demo'\n\
         retry {tool} demo --client {near}:{} --backend verbs --addr {far} --size 16M --no-tcp --json || echo 'PAIR-FAIL demo client verbs'\n",
        PUMP_PORT + 1,
        PUMP_PORT + 2,
        PUMP_PORT + 3,
        retry = vm::RETRY,
    );
    s.push_str(PEER_RETRY);
    let mut point = "";
    for step in perftest_steps(dev) {
        if step.tool != point {
            s.push_str(&format!("echo 'PAIR-POINT {}'\n", step.tool));
            point = step.tool;
        }
        s.push_str(&format!(
            "peer_retry {PEER_PATIENCE} {} {near} {}\n",
            step.args,
            peer_outcome(step.tool, "client")
        ));
    }
    s
}

/// What guest 1 measured: (label, size, MB/s).
#[derive(Default)]
struct Measured {
    label: String,
    points: Vec<(String, u64, f64)>,
    failed: Vec<String>,
    /// Peer-tool (perftest) steps that failed: reported, not counted against exs (see [`peer_failed`]).
    peer_failed: Vec<String>,
    /// `exs ping` median one-way latency, µs.
    latency: Option<f64>,
    /// `exs demo` MB/s (checksums verified).
    demo: Option<f64>,
    /// `ib_send_lat` typical one-way latency, µs.
    send_lat: Option<f64>,
}

impl Measured {
    fn line(&mut self, l: &str) {
        if let Some(label) = l.strip_prefix("PAIR-POINT ") {
            self.label = label.to_string();
        } else if let Some(what) = l.strip_prefix("PAIR-FAIL ") {
            self.failed.push(what.to_string());
        } else if let Some(what) = l.strip_prefix("PAIR-PEER-FAIL ") {
            self.peer_failed.push(what.to_string());
        } else if let Ok(v) = serde_json::from_str::<serde_json::Value>(l) {
            if let (Some(size), Some(bps)) = (v["size"].as_u64(), v["bytes_per_sec"].as_f64()) {
                self.points.push((self.label.clone(), size, bps / 1e6));
            } else if let Some(us) = v["median_us"].as_f64() {
                self.latency = Some(us);
            } else if v["tool"] == "exs-demo" {
                if v["checksum_ok"] != true {
                    self.failed.push("demo: checksum mismatch".into());
                }
                self.demo = v["bytes_per_sec"].as_f64().map(|b| b / 1e6);
            }
        } else if self.label == "ib_send_lat" {
            // " 8       50           ...  t_typical[usec] ..." (#bytes #iterations t_min t_max t_typical ...)
            let w: Vec<&str> = l.split_whitespace().collect();
            if w.len() >= 5 && w[0] == "8" {
                self.send_lat = w[4].parse().ok();
            }
        } else if self.label == "ib_write_bw" {
            // " 65536      300              8.90               7.04   		   0.000113" (MB here: MiB)
            let w: Vec<&str> = l.split_whitespace().collect();
            if let (true, Ok(size), Ok(avg)) = (
                w.len() >= 5,
                w.first()
                    .map_or(Err(()), |x| x.parse::<u64>().map_err(drop)),
                w.get(3).map_or(Err(()), |x| x.parse::<f64>().map_err(drop)),
            ) {
                self.points
                    .push(("ib_write_bw".into(), size, avg * 1.048_576));
            }
        }
    }
}

/// Runs the stage; its lines go to `summary`, failures to `failures`.
pub fn run(
    exe: &Path,
    tool: &Path,
    dev: &GuestDevice,
    summary: &mut Vec<String>,
    failures: &mut Vec<String>,
) -> Result<()> {
    let vm = vm::Vm::prepare()?;
    let start = std::time::Instant::now();
    let mut sections = Sections::default();
    let mut measured = Measured::default();
    let cwd = crate::sys::root();
    let scripts = [
        format!("cd {}\n{}", cwd.display(), guest0(exe, tool, dev)),
        format!("cd {}\n{}", cwd.display(), guest1(exe, tool, dev)),
    ];
    let outcomes = vm.run_pair(
        dev,
        [&scripts[0], &scripts[1]],
        Duration::from_secs(15 * 60),
        &mut |i, l, err| {
            if i == 0 {
                sections.line(l, err);
                if let Some(what) = l.strip_prefix("PAIR-FAIL ") {
                    measured.failed.push(what.to_string());
                } else if let Some(what) = l.strip_prefix("PAIR-PEER-FAIL ") {
                    measured.peer_failed.push(what.to_string());
                }
            } else {
                if err {
                    eprintln!("[guest1] {l}");
                } else {
                    println!("[guest1] {l}");
                }
                measured.line(l);
            }
        },
    )?;
    for (i, o) in outcomes.iter().enumerate() {
        if o.rc.is_none() || o.rc == Some(90) {
            failures.push(format!("two guests: guest {i} setup"));
            summary.push(format!(
                "two guests: guest {i} {}; console:\n{}",
                if o.rc.is_none() {
                    "gave no exit code"
                } else {
                    "could not set up its link or its RDMA device"
                },
                vm::tail(&o.console, 20)
            ));
        }
    }
    let where_ = format!(
        " (two QEMU guests, kernel {} each, {:?}: {} on eth0 at {} and {}, a virtual link between them)",
        vm.kver,
        vm.accel,
        dev.name(),
        PAIR_ADDRS[0],
        PAIR_ADDRS[1]
    );
    sections.report(&where_, summary, failures);
    let fmt = |label: &str| {
        measured
            .points
            .iter()
            .filter(|p| p.0 == label)
            .map(|p| format!("{} {:.1} MB/s", size_name(p.1), p.2))
            .collect::<Vec<_>>()
            .join(", ")
    };
    for label in ["verbs", "fabric", "ib_write_bw"] {
        // perftest's numbers may be missing only when a step of it said it failed (reported below).
        let excused = label == "ib_write_bw" && !measured.peer_failed.is_empty();
        if !excused && !measured.points.iter().any(|p| p.0 == label) {
            failures.push(format!("two guests: {label} across the link"));
        }
    }
    if let Some(note) = peer_failed(&measured.peer_failed) {
        eprintln!("xtask: {note}");
        summary.push(note);
    }
    if measured.latency.is_none() || measured.demo.is_none() {
        failures.push("two guests: exs ping or exs demo across the link".into());
    }
    for f in &measured.failed {
        failures.push(format!("two guests: {f}"));
    }
    summary.push(format!(
        "two guests, guest 0 serving guest 1 across the link (debug build, emulated CPUs): exs pump verbs {}; \
         exs pump fabric (tcp) {}; ib_write_bw {}; exs ping verbs 8 B median one-way {:.0} µs (ib_send_lat {:.0} µs); exs demo verbs \
         16 MiB {:.1} MB/s, checksums verified ({} failed steps; {:.0?})",
        fmt("verbs"),
        fmt("fabric"),
        fmt("ib_write_bw"),
        measured.latency.unwrap_or(f64::NAN),
        measured.send_lat.unwrap_or(f64::NAN),
        measured.demo.unwrap_or(f64::NAN),
        measured.failed.len(),
        start.elapsed()
    ));
    Ok(())
}

/// The loud note for peer-tool steps that failed. perftest runs beside exs for its numbers; between two soft
/// devices its own client can fail (a crash on a flushed work request, seen with siw), which says nothing of exs:
/// the note names the steps and says their numbers are missing, and the stage fails only on what exs did (and on
/// perftest's numbers missing with no step saying it failed, or perftest missing from the guest).
fn peer_failed(steps: &[String]) -> Option<String> {
    (!steps.is_empty()).then(|| {
        format!(
            "two guests: PEER TOOL FAILED: {} (perftest's own run between the guests; its numbers are missing \
             from this run, exs's steps are judged on their own)",
            steps.join(", ")
        )
    })
}

fn size_name(n: u64) -> String {
    match n {
        n if n >= 1 << 20 && n % (1 << 20) == 0 => format!("{} MiB", n >> 20),
        n if n >= 1 << 10 && n % (1 << 10) == 0 => format!("{} KiB", n >> 10),
        n => format!("{n} B"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs `sh -c` on the script `script(dir, count)` makes, in a directory of its own (`name`), where `count` is
    /// a file the script's command counts its runs in; returns the exit code and the runs made.
    fn sh_counting(name: &str, script: impl Fn(&Path, &Path) -> String) -> (i32, u32) {
        let dir = std::env::temp_dir().join(format!("exs-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let count = dir.join("runs");
        let out = std::process::Command::new("sh")
            .arg("-c")
            .arg(script(&dir, &count))
            .output()
            .unwrap();
        let runs = std::fs::read_to_string(&count)
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        (out.status.code().unwrap(), runs)
    }

    /// Runs `serve` around a command that fails (with `code`) its first `fail` runs; returns the exit code and the
    /// runs made.
    fn serve_with_flaky(fail: u32, code: u8) -> (i32, u32) {
        sh_counting(&format!("serve-{fail}-{code}"), |dir, count| {
            // A program, not a shell function: `serve` runs its command under `timeout`, as it runs perftest.
            let flaky = dir.join("flaky");
            std::fs::write(
                &flaky,
                format!(
                    "#!/bin/sh\nn=$(cat {c} 2>/dev/null || echo 0); n=$((n+1)); echo $n > {c}; [ $n -gt {fail} ] || exit {code}\n",
                    c = count.display()
                ),
            )
            .unwrap();
            format!("{SERVE}serve sh {}", flaky.display())
        })
    }

    #[test]
    fn a_peer_tool_server_whose_run_failed_serves_again_a_bounded_number_of_times() {
        assert_eq!(serve_with_flaky(0, 1), (0, 1));
        assert_eq!(serve_with_flaky(1, 1), (0, 2));
        assert_eq!(serve_with_flaky(99, 1), (1, 3));
        // A run that timed out (its client moved on) is not started again.
        assert_eq!(serve_with_flaky(99, 124), (1, 1));
        // Nor one that could not start (the tool is missing).
        assert_eq!(serve_with_flaky(99, 127), (127, 1));
    }

    #[test]
    fn each_peer_tool_step_has_a_port_of_its_own_on_both_sides() {
        for dev in [GuestDevice::Rxe, GuestDevice::Siw("siw0".into())] {
            let steps = perftest_steps(&dev);
            let mut ports: Vec<&str> = steps
                .iter()
                .map(|s| {
                    s.args
                        .split(" -p ")
                        .nth(1)
                        .unwrap()
                        .split(' ')
                        .next()
                        .unwrap()
                })
                .collect();
            ports.dedup();
            assert_eq!(ports.len(), steps.len());
            let (g0, g1) = (
                guest0(Path::new("exe"), Path::new("exs"), &dev),
                guest1(Path::new("exe"), Path::new("exs"), &dev),
            );
            for step in &steps {
                assert!(
                    g0.contains(&format!("serve {} >/dev/null", step.args)),
                    "{g0}"
                );
                assert!(
                    g1.contains(&format!(
                        "peer_retry {PEER_PATIENCE} {} {}",
                        step.args, PAIR_ADDRS[0]
                    )),
                    "{g1}"
                );
            }
        }
    }

    /// Runs `peer_retry` with `secs` of patience around a command that fails its first `fail` runs; returns the
    /// exit code, the runs made and the seconds it took.
    fn peer_retry_with_flaky(secs: u32, fail: u32) -> (i32, u32, u64) {
        let start = std::time::Instant::now();
        let (rc, runs) = sh_counting(&format!("peer-retry-{fail}"), |_, count| {
            format!(
                "{PEER_RETRY}peer_retry {secs} sh -c 'n=$(cat {c} 2>/dev/null || echo 0); n=$((n+1)); echo $n > {c}; [ $n -gt {fail} ]'",
                c = count.display()
            )
        });
        (rc, runs, start.elapsed().as_secs())
    }

    /// The two-siw-guest flake: perftest's client crashed, then every retry failed slowly, sixty of them.
    #[test]
    fn a_peer_tool_client_retries_until_it_succeeds_or_its_patience_runs_out() {
        let (rc, runs, _) = peer_retry_with_flaky(30, 2);
        assert_eq!((rc, runs), (0, 3));
        let (rc, runs, secs) = peer_retry_with_flaky(2, 99);
        assert_eq!(rc, 1);
        assert!((1..=3).contains(&runs), "{runs} runs");
        assert!(secs <= 4, "{secs} s");
        // A try that would outlast the patience is cut at its end.
        let start = std::time::Instant::now();
        let out = std::process::Command::new("sh")
            .arg("-c")
            .arg(format!("{PEER_RETRY}peer_retry 2 sleep 30"))
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(1));
        assert!(start.elapsed().as_secs() <= 5, "{:?}", start.elapsed());
    }

    #[test]
    fn a_failed_peer_tool_step_is_reported_but_is_not_a_failure_of_exs() {
        let mut m = Measured::default();
        for l in [
            "PAIR-POINT ib_send_lat",
            "PAIR-PEER-FAIL ib_send_lat client",
            "PAIR-FAIL demo client verbs",
        ] {
            m.line(l);
        }
        assert_eq!(m.peer_failed, ["ib_send_lat client"]);
        assert_eq!(m.failed, ["demo client verbs"]);
        let note = peer_failed(&m.peer_failed).unwrap();
        assert!(
            note.contains("PEER TOOL FAILED: ib_send_lat client"),
            "{note}"
        );
        assert_eq!(peer_failed(&[]), None);
        // A tool missing from the guest is the stage's failure, any other failure perftest's own.
        for (cmd, said) in [
            (
                "exs-no-such-tool",
                "PAIR-FAIL ib_send_lat client: not found",
            ),
            ("false", "PAIR-PEER-FAIL ib_send_lat client"),
        ] {
            let out = std::process::Command::new("sh")
                .arg("-c")
                .arg(format!("{cmd} {}", peer_outcome("ib_send_lat", "client")))
                .output()
                .unwrap();
            assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), said);
        }
    }
}

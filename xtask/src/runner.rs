//! What every test stage shares: running a command while counting libtest's results, cutting a script's output into
//! sections (one per backend or stage), the conformance binary, a copy of this xtask for guests, and the summary.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Command, Stdio};

use crate::sys::{self, Result};

/// Counts from libtest's "test result:" lines.
#[derive(Default, Clone, Copy, Debug)]
pub struct Counts {
    pub passed: u64,
    pub failed: u64,
    pub ignored: u64,
}

impl Counts {
    fn add(&mut self, o: Counts) {
        self.passed += o.passed;
        self.failed += o.failed;
        self.ignored += o.ignored;
    }
}

fn parse_result(line: &str) -> Option<Counts> {
    let rest = line.trim().strip_prefix("test result: ")?;
    let num = |word: &str| -> u64 {
        rest.split(';')
            .find_map(|part| {
                let part = part
                    .trim()
                    .trim_start_matches("ok.")
                    .trim_start_matches("FAILED.")
                    .trim();
                part.strip_suffix(word).and_then(|n| n.trim().parse().ok())
            })
            .unwrap_or(0)
    };
    Some(Counts {
        passed: num("passed"),
        failed: num("failed"),
        ignored: num("ignored"),
    })
}

/// Starts a command (shown first) with its standard output and error piped to us.
fn spawn_piped(cmd: &mut Command) -> Result<std::process::Child> {
    eprintln!("+ {}", sys::show(cmd));
    cmd.stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("cannot run {}: {e}", sys::show(cmd)))
}

/// Runs a command, echoing its output, and sums its "test result:" lines. Also returns the SKIPPED lines.
pub fn run_counting(cmd: &mut Command) -> Result<(Counts, bool, Vec<String>)> {
    let mut child = spawn_piped(cmd)?;
    let stderr = child.stderr.take().expect("piped");
    let skips = std::thread::spawn(move || {
        let mut skips = Vec::new();
        for line in BufReader::new(stderr).lines().map_while(|l| l.ok()) {
            eprintln!("{line}");
            if line.starts_with("SKIPPED") {
                skips.push(line);
            }
        }
        skips
    });
    let mut counts = Counts::default();
    for line in BufReader::new(child.stdout.take().expect("piped"))
        .lines()
        .map_while(|l| l.ok())
    {
        println!("{line}");
        if let Some(c) = parse_result(&line) {
            counts.add(c);
        }
    }
    let status = child.wait().map_err(|e| e.to_string())?;
    let skips = skips.join().unwrap_or_default();
    Ok((counts, status.success(), skips))
}

/// The crates whose tests run from the checked optimized build, and their features: the conformance suite with every
/// backend, and the long property tests. Built by one cargo command, so exs and every dependency are built once for
/// both.
const CHECKED_CRATES: [&str; 6] = [
    "-p",
    "exs-conformance",
    "-p",
    "exs-props",
    "--features",
    "exs-conformance/sim,exs-conformance/fabric,exs-conformance/softroce",
];

/// The checked optimized build: optimized as `release` is, with overflow checks and debug assertions on (no panic
/// may be reachable from peer input in debug builds either, issue 15), without debug information (the build is its
/// own anyway, and linking it was much of its time).
///
/// It is the `dev` profile raised by these variables, not `release`: cargo keeps each profile's build apart, so a
/// release build compiled again every build script, procedural macro and their dependencies (bindgen twice, syn,
/// clang-sys, ...) that the debug build had just compiled. Under `dev` it finds them built (`docs/testing.md`).
pub const CHECKED: [(&str, &str); 6] = [
    ("CARGO_PROFILE_DEV_OPT_LEVEL", "3"),
    ("CARGO_PROFILE_DEV_CODEGEN_UNITS", "16"),
    ("CARGO_PROFILE_DEV_INCREMENTAL", "false"),
    ("CARGO_PROFILE_DEV_DEBUG", "false"),
    ("CARGO_PROFILE_DEV_OVERFLOW_CHECKS", "true"),
    ("CARGO_PROFILE_DEV_DEBUG_ASSERTIONS", "true"),
];

/// The test harness's own dependencies, left unoptimized in the checked build: command lines (libtest-mimic's
/// clap) and log filters (tracing-subscriber's regexes) are parsed once per run. Optimizing them was a quarter of
/// the build's compile time.
const UNOPTIMIZED: [&str; 5] = [
    "clap_builder",
    "libtest-mimic",
    "regex-automata",
    "regex-syntax",
    "tracing-subscriber",
];

/// `cargo test` of these test targets (of the conformance suite or the property tests) from the checked optimized
/// build ([`CHECKED`]). The conformance suite runs from it, not from the debug build: in the emulated guests, half
/// of the RDMA stages' time went to the debug build's own code (`docs/testing.md`).
pub fn checked_tests(targets: &[&str]) -> Command {
    let mut cmd = sys::cargo();
    cmd.arg("test").args(CHECKED_CRATES);
    for t in targets {
        cmd.args(["--test", t]);
    }
    for p in UNOPTIMIZED {
        cmd.arg("--config")
            .arg(format!("profile.dev.package.{p}.opt-level=0"));
    }
    cmd.envs(CHECKED);
    cmd
}

/// Every test target of the checked optimized build: the conformance suite and the property tests.
const CHECKED_TARGETS: [&str; 4] = ["conformance", "stream_props", "message_props", "fuzz_props"];

/// Builds every test target of the checked optimized build in one cargo command (its crates build side by side
/// on the cores; in a command per target each ended on one big crate alone), so that the runs after build nothing.
pub fn build_checked() -> Result<()> {
    sys::run(checked_tests(&CHECKED_TARGETS).arg("--no-run"))
}

/// Builds the conformance suite with every backend (checked optimized build) and returns the test binary's path.
pub fn conformance_exe() -> Result<PathBuf> {
    let out = sys::output(
        checked_tests(&["conformance"])
            .args(["--no-run", "--message-format=json-render-diagnostics"]),
    )?;
    out.lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v["reason"] == "compiler-artifact" && v["target"]["name"] == "conformance")
        .find_map(|v| v["executable"].as_str().map(PathBuf::from))
        .ok_or_else(|| "cargo did not report the conformance test binary".to_string())
}

/// Results of a script whose output is cut into sections by `@@section NAME` lines (on stdout and stderr):
/// libtest counts, SKIPPED lines and the BACKEND line of each section.
#[derive(Default)]
pub struct Sections {
    current: [Option<String>; 2],
    order: Vec<String>,
    counts: BTreeMap<String, Counts>,
    skips: BTreeMap<String, Vec<String>>,
    backends: BTreeMap<String, Vec<String>>,
    /// The messages of the failed cases (libtest's `---- NAME ----` blocks), repeated under the summary: a CI log
    /// cut to its last lines showed which case failed and not why.
    why: BTreeMap<String, Vec<String>>,
    /// The cases run again after a failure (`EXS_CONFORMANCE_RETRY`), each with its first failure.
    flaky: BTreeMap<String, Vec<String>>,
    /// Whether the stdout lines now are a failed case's message.
    in_why: bool,
    /// Lines held back rather than echoed as they come ([`Sections::held`]).
    held: Option<Vec<(String, bool)>>,
}

impl Sections {
    /// Sections whose lines are held until [`Sections::echo_held`], for a run beside another whose lines would
    /// otherwise interleave with its own.
    pub fn held() -> Sections {
        Sections {
            held: Some(Vec::new()),
            ..Sections::default()
        }
    }

    /// Echoes the lines held so far, in their order.
    pub fn echo_held(&mut self) {
        for (l, stderr) in self.held.iter_mut().flat_map(std::mem::take) {
            echo(&l, stderr);
        }
    }

    /// Records how the run whose lines were just taken ended: one that failed with no failed case in its current
    /// section (a crash before its results, or a harness error) counts as a failed case there.
    pub fn ended(&mut self, ok: bool) {
        let Some(cur) = self.current[0].clone() else {
            return;
        };
        let c = self.counts.entry(cur).or_default();
        if !ok && c.failed == 0 {
            c.failed = 1;
        }
    }

    /// Whether no section began.
    pub fn is_empty(&self) -> bool {
        self.order.is_empty()
    }

    /// Takes one line of output (echoing it, or holding it).
    pub fn line(&mut self, l: &str, stderr: bool) {
        match &mut self.held {
            Some(held) => held.push((l.to_string(), stderr)),
            None => echo(l, stderr),
        }
        if let (false, Some(rc)) = (stderr, l.strip_prefix("@@ended ")) {
            // A run that died inside a failure's message ends it there.
            self.in_why = false;
            self.ended(rc.trim() == "0");
            return;
        }
        if let Some(name) = l.strip_prefix("@@section ") {
            if !stderr {
                self.in_why = false;
            }
            if !self.order.iter().any(|n| n == name) {
                self.order.push(name.to_string());
            }
            self.current[stderr as usize] = Some(name.to_string());
            return;
        }
        let Some(cur) = self.current[stderr as usize].clone() else {
            return;
        };
        if !stderr {
            self.take_why(&cur, l);
            if let Some(c) = parse_result(l) {
                self.counts.entry(cur).or_default().add(c);
            }
        } else if l.starts_with("FLAKY ") || l.starts_with("FAILED TWICE ") {
            self.flaky.entry(cur).or_default().push(l.to_string());
        } else if l.starts_with("SKIPPED") {
            self.skips.entry(cur).or_default().push(l.to_string());
        } else if let Some(b) = l.strip_prefix("BACKEND ") {
            self.backends.entry(cur).or_default().push(b.to_string());
        }
    }

    /// Keeps `l` if it is part of a failed case's message (from its `---- NAME ----` header to libtest's list of
    /// the failed cases), at most [`WHY_LINES`] per section.
    fn take_why(&mut self, cur: &str, l: &str) {
        if l.starts_with("---- ") && l.ends_with(" ----") {
            self.in_why = true;
        } else if l == "failures:" || parse_result(l).is_some() {
            self.in_why = false;
        }
        let why = self.why.entry(cur.to_string()).or_default();
        if self.in_why && !l.trim().is_empty() && why.len() < WHY_LINES {
            why.push(format!("    {l}"));
        }
    }

    /// One summary line per section; a section whose name is `backend[:anything]` keeps only that backend's skips.
    pub fn report(&self, where_: &str, summary: &mut Vec<String>, failures: &mut Vec<String>) {
        for name in &self.order {
            let c = self.counts.get(name).copied().unwrap_or_default();
            let backend = name.split(':').next().unwrap_or(name);
            let skips: Vec<&String> = self
                .skips
                .get(name)
                .into_iter()
                .flatten()
                .filter(|l| {
                    l.starts_with(&format!("SKIPPED {backend}::"))
                        || l.starts_with(&format!("SKIPPED backend {backend}:"))
                })
                .collect();
            let on = self
                .backends
                .get(name)
                .into_iter()
                .flatten()
                .find_map(|b| b.strip_prefix(&format!("{backend}: ")))
                .filter(|d| !d.is_empty())
                .map(|d| format!(" [{d}]"))
                .unwrap_or_default();
            if c.failed > 0 || c.passed == 0 {
                failures.push(format!("conformance on {name}{where_}"));
            }
            summary.push(format!(
                "conformance on {name}{where_}{on}: {} ran, {} passed, {} failed, {} skipped{}",
                c.passed + c.failed,
                c.passed,
                c.failed,
                c.ignored,
                // Skip reasons are printed for every trial; only those of trials that ran as ignored matter.
                if skips.is_empty() || c.ignored == 0 {
                    String::new()
                } else {
                    format!(
                        " ({})",
                        skips
                            .iter()
                            .map(|s| s.as_str())
                            .collect::<Vec<_>>()
                            .join("; ")
                    )
                }
            ));
            summary.extend(self.why.get(name).into_iter().flatten().cloned());
            // Loud, like a skip: a case that passed only when run again is named with its first failure.
            summary.extend(
                self.flaky
                    .get(name)
                    .into_iter()
                    .flatten()
                    .map(|l| format!("    {l}")),
            );
        }
    }
}

/// Most lines of failure messages repeated per section.
const WHY_LINES: usize = 40;

fn echo(l: &str, stderr: bool) {
    if stderr {
        eprintln!("{l}");
    } else {
        println!("{l}");
    }
}

/// Runs a command, handing every output line to `sections`.
pub fn run_sections(cmd: &mut Command, sections: &mut Sections) -> Result<bool> {
    let mut child = spawn_piped(cmd)?;
    let (tx, rx) = std::sync::mpsc::channel::<(String, bool)>();
    let err = child.stderr.take().expect("piped");
    let out = child.stdout.take().expect("piped");
    let t1 = {
        let tx = tx.clone();
        std::thread::spawn(move || {
            BufReader::new(err)
                .lines()
                .map_while(|l| l.ok())
                .for_each(|l| drop(tx.send((l, true))))
        })
    };
    let t2 = std::thread::spawn(move || {
        BufReader::new(out)
            .lines()
            .map_while(|l| l.ok())
            .for_each(|l| drop(tx.send((l, false))))
    });
    for (l, stderr) in rx {
        sections.line(&l, stderr);
    }
    let _ = (t1.join(), t2.join());
    Ok(child.wait().map_err(|e| e.to_string())?.success())
}

/// Shell function that runs a command and says how it ended (`@@ended STATUS`, read by [`Sections::line`]): a run
/// that crashed before its results fails its section even when the section's other runs passed.
/// The marker starts a line of its own even after a test's half-written `test NAME ... ` line (a crash mid-case).
pub const RUN: &str = "run() { \"$@\"; printf '\\n@@ended %s\\n' \"$?\"; }\n";

/// The shell line that has a guest's conformance runs try a failed case once more: a case that then passes is
/// told as `FLAKY` with its first failure, in the section's summary ([`Sections::report`]). In the emulated guests
/// a case can meet the device's resources held a moment by its neighbour's; the host's stages never retry.
pub const RETRY_CASES: &str = "EXS_CONFORMANCE_RETRY=1";

/// Shell lines that cut the output into sections (see [`Sections`]).
pub const SECTION: &str = "section() { echo \"@@section $1\"; echo \"@@section $1\" >&2; }\n";

/// A copy of this xtask binary that the guest (or a root shell) can run. The workspace build in `run` may relink
/// `target/debug/xtask` itself (features unified with other members differ from `cargo xtask`'s own build), and a
/// replaced executable's `/proc/self/exe` ends in " (deleted)".
pub fn xtask_copy() -> Result<PathBuf> {
    let me = std::env::current_exe().map_err(|e| e.to_string())?;
    let me = PathBuf::from(me.to_string_lossy().trim_end_matches(" (deleted)"));
    let copy = sys::root().join("target/xtask-runner");
    // Read the running image itself: the path may already name a newer file.
    std::fs::copy("/proc/self/exe", &copy)
        .or_else(|_| std::fs::copy(&me, &copy))
        .map_err(|e| format!("copying the xtask binary to {}: {e}", copy.display()))?;
    Ok(copy)
}

/// Prints the summary; an error names what failed.
pub fn finish(what: &str, summary: &[String], failures: &[String]) -> Result<()> {
    eprintln!("\n==== {what} ====");
    for s in summary {
        eprintln!("{s}");
    }
    if failures.is_empty() {
        eprintln!("all tests passed");
        Ok(())
    } else {
        Err(format!("failures in: {}", failures.join(", ")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_libtest_result_lines() {
        let c = parse_result("test result: ok. 22 passed; 0 failed; 2 ignored; 0 measured; 0 filtered out; finished in 1s").unwrap();
        assert_eq!((c.passed, c.failed, c.ignored), (22, 0, 2));
        let c = parse_result("test result: FAILED. 11 passed; 1 failed; 0 ignored; 0 measured")
            .unwrap();
        assert_eq!((c.passed, c.failed, c.ignored), (11, 1, 0));
        assert!(parse_result("running 3 tests").is_none());
    }

    /// The summary lines and failures `s` reports.
    fn reported(s: &Sections) -> (Vec<String>, Vec<String>) {
        let (mut summary, mut failures) = (Vec::new(), Vec::new());
        s.report("", &mut summary, &mut failures);
        (summary, failures)
    }

    /// Review: a section whose process crashed before its results, beside a run of the same section that passed,
    /// was reported as passing.
    #[test]
    fn a_run_that_ended_badly_with_no_case_failed_fails_its_section() {
        let mut s = Sections::held();
        for stderr in [false, true] {
            s.line("@@section fabric", stderr);
        }
        s.line("running 111 tests", false);
        s.ended(false);
        s.line(
            "test result: ok. 1 passed; 0 failed; 0 ignored; 0 measured",
            false,
        );
        s.ended(true);
        let (summary, failures) = reported(&s);
        assert_eq!(failures, ["conformance on fabric"]);
        assert!(
            summary[0].contains("2 ran, 1 passed, 1 failed"),
            "{summary:?}"
        );
        // A script's runs say how they ended (`RUN`): a crash among passing runs fails the section.
        let mut s = Sections::held();
        s.line("@@section softroce", false);
        s.line(
            "test result: ok. 100 passed; 0 failed; 0 ignored; 0 measured",
            false,
        );
        s.line("@@ended 0", false);
        s.line("@@ended 134", false);
        s.line(
            "test result: ok. 4 passed; 0 failed; 0 ignored; 0 measured",
            false,
        );
        s.line("@@ended 0", false);
        assert_eq!(reported(&s).1, ["conformance on softroce"]);
        // A run that failed because a case did counts that case only.
        let mut s = Sections::held();
        s.line("@@section sim", false);
        s.line(
            "test result: FAILED. 3 passed; 2 failed; 0 ignored; 0 measured",
            false,
        );
        s.ended(false);
        let (summary, _) = reported(&s);
        assert!(
            summary[0].contains("5 ran, 3 passed, 2 failed"),
            "{summary:?}"
        );
    }

    /// A CI log cut to its last lines named the failed case but not its message, which was printed long before; a
    /// case that passed only when run again is named too.
    #[test]
    fn failed_and_flaky_cases_are_told_under_their_sections_summary() {
        let mut s = Sections::held();
        for stderr in [false, true] {
            s.line("@@section softroce:siw", stderr);
        }
        for l in [
            "test softroce::a ... FAILED",
            "",
            "failures:",
            "",
            "---- softroce::a ----",
            "peer_addr after a reset: Ok(1.2.3.4:5)",
            "",
            "",
            "failures:",
            "    softroce::a",
            "",
            "test result: FAILED. 3 passed; 1 failed; 0 ignored; 0 measured",
        ] {
            s.line(l, false);
        }
        s.line(
            "FLAKY softroce::b: passed when run again; the first run failed: connect failed: Refused([])",
            true,
        );
        // A run that dies inside a failure's message: the next section's lines are not taken for it.
        s.line("---- softroce::c ----", false);
        s.line("@@ended 134", false);
        s.line("@@section tools:siw", false);
        s.line("test tools::ping ... ok", false);
        s.line("test result: ok. 1 passed; 0 failed; 0 ignored", false);
        let (summary, failures) = reported(&s);
        assert_eq!(failures, ["conformance on softroce:siw"]);
        assert_eq!(
            summary[1..5],
            [
                "    ---- softroce::a ----",
                "    peer_addr after a reset: Ok(1.2.3.4:5)",
                "    ---- softroce::c ----",
                "    FLAKY softroce::b: passed when run again; the first run failed: connect failed: Refused([])"
            ]
        );
        assert!(
            !summary.iter().any(|l| l.contains("tools::ping")),
            "{summary:?}"
        );
    }
}

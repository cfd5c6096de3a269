//! The command line refuses what it cannot honour, with clap's usage status (2), and never coerces a value or
//! panics on one; its help says what the tool does.

mod common;

use std::process::Output;

use common::exs;

/// Asserts a usage error: status 2, clap's `error:` line, and `want` in it; no output on stdout.
fn usage_error(args: &[&str], want: &str) {
    let out = exs(args);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        out.status.code(),
        Some(2),
        "{args:?}: {}\n{err}",
        out.status
    );
    assert!(err.starts_with("error:"), "{args:?}: {err}");
    assert!(err.contains(want), "{args:?}: {want:?} not in {err}");
    assert!(!err.contains("panicked"), "{args:?}: {err}");
    assert!(out.stdout.is_empty(), "{args:?} ran: {}", stdout(&out));
}

fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn ping_count_zero_is_a_usage_error_not_ten_pings() {
    usage_error(&["ping", "--backend", "sim", "--count", "0"], "--count");
    usage_error(&["tcpping", "--count", "0"], "--count");
}

#[test]
fn depth_out_of_range_is_a_usage_error_not_clamped() {
    for tool in ["pump", "demo", "rawpump"] {
        usage_error(&[tool, "--backend", "sim", "--depth", "0"], "1..=64");
        usage_error(&[tool, "--backend", "sim", "--depth", "100000"], "1..=64");
    }
    usage_error(&["pump", "--backend", "sim", "--depth", "8,0"], "--depth");
}

#[test]
fn huge_seconds_and_counts_are_usage_errors_not_panics() {
    for (args, flag) in [
        (
            &["pump", "--seconds", "99999999999999999999"][..],
            "--seconds",
        ),
        (&["pump", "--seconds", "1e30"], "--seconds"),
        (&["pump", "--seconds", "nan"], "--seconds"),
        (&["pump", "--seconds=-1"], "--seconds"),
        (&["pump", "--seconds", "0"], "--seconds"),
        (&["rawpump", "--seconds", "inf"], "--seconds"),
        (&["tcppump", "--seconds", "1e30"], "--seconds"),
        (&["ping", "--count", "18446744073709551615"], "--count"),
        (&["ping", "--count", "18446744073709551616"], "--count"),
        (&["tcpping", "--count", "99999999999"], "--count"),
        (&["soak", "--seconds", "18446744073709551615"], "--seconds"),
        (&["pump", "--size", "0"], "--size"),
        (&["pump", "--size", "17M"], "--size"),
        (&["pump", "--size", "99999999999T"], "--size"),
        (&["demo", "--chunk", "1G"], "--chunk"),
        (&["ping", "--idle", "4294967296"], "--idle"),
    ] {
        usage_error(args, flag);
    }
}

#[test]
fn range_and_conflict_errors_exit_like_parse_errors() {
    // A parse error, a range error and a conflict between values: one status, clap's.
    usage_error(&["pump", "--mode", "fast"], "possible values");
    usage_error(&["pump", "--depth", "65"], "--depth");
    usage_error(
        &[
            "pump",
            "--backend",
            "sim",
            "--mode",
            "immediate",
            "--type",
            "stream",
        ],
        "seqpacket sockets only",
    );
    usage_error(
        &[
            "pump",
            "--backend",
            "sim",
            "--mode",
            "persistent",
            "--type",
            "stream",
        ],
        "Usage: exs pump",
    );
    usage_error(
        &[
            "ping",
            "--backend",
            "sim",
            "--mode",
            "immediate",
            "--size",
            "64K",
        ],
        "no --size fits immediate data",
    );
    usage_error(&["pump", "--max-seconds", "5"], "--server");
    usage_error(&["pump", "--server", "--max-seconds", "0"], "--max-seconds");
    usage_error(&["pump", "--server", "--max-grace", "0"], "--max-grace");
    usage_error(&["ping", "--max-grace", "5"], "--server");
    usage_error(&["pump", "--server", "--max-memory", "5G"], "--max-memory");
    usage_error(&["pump", "--client", "host:99999"], "not a port");
    // As many idle connections as a context takes beside the ping's own, and not one more.
    let most = exs::ContextOptions::default().max_connections - 1;
    usage_error(&["ping", "--idle", &(most + 1).to_string()], "--idle");
    usage_error(
        &["ping", "--server", "--max-idle", &(most + 1).to_string()],
        "--max-idle",
    );
}

#[test]
fn version_prints_the_tools_version() {
    let out = exs(&["--version"]);
    assert!(out.status.success());
    assert_eq!(
        stdout(&out).trim(),
        format!("exs {}", env!("CARGO_PKG_VERSION"))
    );
}

#[test]
fn immediate_mode_help_states_the_librarys_limit() {
    let limit = format!("at most {} bytes", exs::SocketOptions::MAX_SMALL);
    for tool in ["pump", "ping"] {
        let out = exs(&[tool, "--help"]);
        assert!(out.status.success());
        let help = stdout(&out);
        let line = help
            .lines()
            .find(|l| l.trim_start().starts_with("- immediate:"))
            .unwrap_or_else(|| panic!("no immediate mode in {help}"));
        assert!(line.contains(&limit), "{line}");
    }
    // What the help promises is what runs: the limit itself goes, one byte more is refused.
    let max = exs::SocketOptions::MAX_SMALL.to_string();
    let over = (exs::SocketOptions::MAX_SMALL + 1).to_string();
    let out = exs(&[
        "ping",
        "--backend",
        "sim",
        "--mode",
        "immediate",
        "--size",
        &max,
        "--count",
        "5",
        "--json",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    usage_error(
        &[
            "ping",
            "--backend",
            "sim",
            "--mode",
            "immediate",
            "--size",
            &over,
        ],
        "immediate",
    );
}

#[test]
fn demo_size_zero_is_refused_not_a_nan_ratio() {
    usage_error(&["demo", "--backend", "sim", "--size", "0"], "--size");
    let out = exs(&[
        "demo",
        "--backend",
        "sim",
        "--size",
        "1",
        "--chunk",
        "1",
        "--no-tcp",
    ]);
    assert!(out.status.success());
    assert!(!stdout(&out).contains("NaN"), "{}", stdout(&out));
}

#[test]
fn tcppump_and_tcpping_take_only_their_own_options() {
    usage_error(&["tcpping", "--seconds", "1"], "--seconds");
    usage_error(&["tcppump", "--count", "10"], "--count");
    let help = stdout(&exs(&["tcpping", "--help"]));
    assert!(
        help.contains("--count") && !help.contains("--seconds"),
        "{help}"
    );
    assert!(
        !help.contains("(tcpping)") && !help.contains("tcpping:"),
        "{help}"
    );
    let help = stdout(&exs(&["tcppump", "--help"]));
    assert!(
        help.contains("--seconds") && !help.contains("--count"),
        "{help}"
    );
}

#[test]
fn numeric_options_state_their_ranges_in_the_help() {
    let help = stdout(&exs(&["pump", "--help"]));
    for want in ["1 B to 16 MiB", "1 to 64", "at most 86400"] {
        assert!(help.contains(want), "{want:?} not in {help}");
    }
    let help = stdout(&exs(&["pump", "--server", "--help"]));
    for limit in [
        "--max-seconds",
        "--max-grace",
        "--max-bytes",
        "--max-count",
        "--max-idle",
        "--max-memory",
        "--no-busy-wait",
    ] {
        assert!(help.contains(limit), "{limit} not in {help}");
    }
    // Review finding: the limits' help gave no ranges.
    for want in [
        "1 B to 4 GiB",
        "1 to 10000000",
        "at most 86400): the most a pump client",
    ] {
        assert!(help.contains(want), "{want:?} not in {help}");
    }
}

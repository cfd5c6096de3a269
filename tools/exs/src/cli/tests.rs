//! The command line's ranges, and a property test over whole argument vectors: whatever a user types, parsing
//! ends in a usage error with clap's status (2), or in values within their ranges that the run accepts; never
//! in a panic.

use clap::{CommandFactory, Parser};
use proptest::prelude::*;

use super::*;
use crate::control::{Limits, Params as _};
use crate::{Cli, Cmd};

#[test]
fn ranges_refuse_zero_overflow_and_non_numbers() {
    for bad in [
        "0",
        "-1",
        "nan",
        "inf",
        "1e30",
        "99999999999999999999",
        "2s",
        "",
    ] {
        assert!(seconds(bad).is_err(), "{bad}");
    }
    assert_eq!(seconds("0.25"), Ok(0.25));
    assert_eq!(seconds("86400"), Ok(MAX_SECONDS));
    assert!(target("10.0.0.5:99999").is_err());
    assert!(target(":1").is_err());
    assert_eq!(target("host:7").unwrap(), "host:7");
    assert_eq!(target("::1").unwrap(), "::1");
    assert_eq!(fmt_size(16 << 20), "16 MiB");
    assert_eq!(fmt_size(1000), "1000 B");
    assert_eq!(fmt_size(0), "0 B");
    assert_eq!(
        check_in("--size", 0, &(1..=MAX_MESSAGE)).unwrap_err(),
        "--size 0 B: from 1 B to 16 MiB"
    );
    assert!(check_seconds(1e30, MAX_SECONDS)
        .unwrap_err()
        .contains("1e30"));
}

#[test]
fn every_checked_number_of_seconds_is_a_duration() {
    for s in [f64::MIN_POSITIVE, 1e-9, 0.5, MAX_SECONDS] {
        check_seconds(s, MAX_SECONDS).unwrap();
        assert!(duration(s) <= std::time::Duration::from_secs(86_400));
    }
}

#[test]
fn the_command_line_definition_is_consistent() {
    Cli::command().debug_assert();
}

#[test]
fn a_conflict_found_after_parsing_is_a_usage_error_of_its_subcommand() {
    let e = usage_error("pump", "no --size fits immediate data");
    assert_eq!(e.exit_code(), 2);
    let text = e.render().to_string();
    assert!(text.contains("Usage: exs pump"), "{text}");
}

/// Every value accepted is within its range, and what the run does next with it does not fail or panic.
fn accepted(cmd: &Cmd) -> Result<(), TestCaseError> {
    let secs = |s: f64| s.is_finite() && s > 0.0 && s <= MAX_SECONDS;
    match cmd {
        Cmd::Pump(a) => {
            prop_assert!(a.size.iter().all(|s| (1..=MAX_MESSAGE).contains(s)));
            prop_assert!(a.depth.iter().all(|d| (1..=MAX_DEPTH as usize).contains(d)));
            prop_assert!(secs(a.seconds));
            limits_in_range(&a.peer.limits)?;
            if !a.peer.server {
                let (points, _) = crate::pump::points(a).map_err(TestCaseError::fail)?;
                for p in points {
                    prop_assert!(p.check(&Limits::widest()).is_ok());
                    let _ = duration(p.seconds);
                }
            }
        }
        Cmd::Ping(a) => {
            prop_assert!(a.size.iter().all(|s| (0..=MAX_MESSAGE).contains(s)));
            prop_assert!((1..=MAX_COUNT).contains(&a.count));
            prop_assert!(u64::from(a.idle) <= max_idle());
            limits_in_range(&a.peer.limits)?;
            if !a.peer.server {
                let (points, _) = crate::ping::points(a).map_err(TestCaseError::fail)?;
                prop_assert!(points.iter().all(|p| p.check(&Limits::widest()).is_ok()));
            }
        }
        Cmd::Demo(a) => {
            prop_assert!((1..=MAX_TRANSFER).contains(&a.size));
            prop_assert!((1..=MAX_CHUNK).contains(&a.chunk));
            prop_assert!((1..=MAX_DEPTH as usize).contains(&a.depth));
            limits_in_range(&a.peer.limits)?;
        }
        Cmd::Rawpump(a) => {
            prop_assert!((1..=MAX_MESSAGE).contains(&a.size));
            prop_assert!((1..=MAX_DEPTH as usize).contains(&a.depth));
            prop_assert!(secs(a.seconds));
        }
        Cmd::Rawping(a) => {
            prop_assert!((1..=4096).contains(&a.size));
            prop_assert!((1..=MAX_COUNT).contains(&a.count));
        }
        Cmd::Tcppump(a) => {
            prop_assert!((1..=MAX_MESSAGE).contains(&a.size));
            prop_assert!(secs(a.seconds));
        }
        Cmd::Tcpping(a) => {
            prop_assert!((1..=MAX_MESSAGE).contains(&a.size));
            prop_assert!((1..=MAX_COUNT).contains(&a.count));
        }
        Cmd::Soak(a) => prop_assert!((1..=MAX_SOAK_SECONDS).contains(&a.seconds)),
        Cmd::Info(_) => {}
    }
    Ok(())
}

fn limits_in_range(l: &Limits) -> Result<(), TestCaseError> {
    prop_assert!(l.max_seconds > 0.0 && l.max_seconds <= MAX_SECONDS);
    prop_assert!(l.max_grace > 0.0 && l.max_grace <= MAX_SECONDS);
    prop_assert!((1..=MAX_TRANSFER).contains(&l.max_bytes));
    prop_assert!((1..=MAX_COUNT).contains(&l.max_count));
    prop_assert!(l.max_idle <= max_idle());
    prop_assert!((1..=MAX_MEMORY).contains(&l.max_memory));
    prop_assert!(l.max_session > 0.0 && l.max_session <= MAX_SECONDS);
    Ok(())
}

/// Values a user might type for some flag.
const TYPED: &[&str] = &[
    "8",
    "64K",
    "1M",
    "16M",
    "32K",
    "1,1K",
    "4K,64K",
    "1,2,4,8",
    "immediate",
    "persistent",
    "normal",
    "default",
    "stream",
    "seqpacket",
    "busy",
    "block",
    "adaptive",
    "sim",
    "fabric",
    "write",
    "read",
    "127.0.0.1",
    "host:7",
    "[::1]:5",
    "300",
    "64G",
    "1000000",
    "256M",
];

/// Edges, overflows, signs, units and noise no flag should take quietly.
const EDGES: &[&str] = &[
    "0",
    "-1",
    "65",
    "0.0",
    "1e-300",
    "1e30",
    "1e308",
    "nan",
    "NaN",
    "inf",
    "-inf",
    "86400",
    "86400.1",
    "99999999999999999999",
    "18446744073709551615",
    "18446744073709551616",
    "10000000",
    "10000001",
    "16MiB",
    "17M",
    "32769",
    "1G",
    "1T",
    "1P",
    "2P",
    "1024P",
    "0K",
    "",
    " ",
    ",",
    "0,8",
    "8,",
    "host:99999",
    ":",
    "604801",
    "16383",
    "16384",
    "4294967296",
    "4G",
    "5G",
];

/// Values a user might type, and values no one should: edges, overflows, signs, units, lists, words, noise.
fn value() -> impl Strategy<Value = String> {
    let plausible = prop_oneof![
        (1u64..=80).prop_map(|v| v.to_string()),
        (1u32..=40).prop_map(|v| format!("0.{v}")),
        prop::sample::select(TYPED).prop_map(String::from),
    ];
    let edges = prop::sample::select(EDGES).prop_map(String::from);
    prop_oneof![
        4 => plausible,
        2 => edges,
        1 => any::<u64>().prop_map(|v| v.to_string()),
        1 => any::<i64>().prop_map(|v| v.to_string()),
        1 => any::<f64>().prop_map(|v| v.to_string()),
        1 => "[ -~]{0,12}",
    ]
}

/// A subcommand and some of its own flags (and now and then one it does not have), with or without values.
fn arguments() -> impl Strategy<Value = Vec<String>> {
    let subs: Vec<(String, Vec<String>)> = Cli::command()
        .get_subcommands()
        .map(|s| {
            let mut flags: Vec<String> = s
                .get_arguments()
                .filter_map(|a| a.get_long().map(|l| format!("--{l}")))
                .collect();
            flags.extend(["--bogus".to_string(), "--version".into()]);
            (s.get_name().to_string(), flags)
        })
        .collect();
    prop::sample::select(subs)
        .prop_flat_map(|(sub, flags)| {
            let pair = (
                prop::sample::select(flags),
                prop::option::weighted(0.8, value()),
                any::<bool>(),
            );
            (Just(sub), prop::collection::vec(pair, 0..5))
        })
        .prop_map(|(sub, pairs)| {
            let mut v = vec!["exs".to_string(), sub];
            for (f, val, joined) in pairs {
                match (val, joined) {
                    (Some(x), true) => v.push(format!("{f}={x}")),
                    (Some(x), false) => v.extend([f, x]),
                    (None, _) => v.push(f),
                }
            }
            v
        })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 3000, ..ProptestConfig::default() })]

    #[test]
    fn any_arguments_give_a_usage_error_or_values_in_range(args in arguments()) {
        match Cli::try_parse_from(&args) {
            Err(e) => {
                use clap::error::ErrorKind::*;
                match e.kind() {
                    DisplayHelp | DisplayVersion => prop_assert_eq!(e.exit_code(), 0),
                    _ => prop_assert_eq!(e.exit_code(), 2, "{:?}: {}", args, e),
                }
            }
            Ok(cli) => match cli.cmd.validate() {
                Err((sub, msg)) => prop_assert_eq!(usage_error(sub, msg).exit_code(), 2),
                Ok(()) => accepted(&cli.cmd)?,
            },
        }
    }
}

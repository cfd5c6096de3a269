//! The conformance suite runner: every case on every backend compiled in (`cargo test -p exs-conformance
//! --features fabric`). Trial names are `<backend>::<case>`. A backend that cannot run here, or a case that needs
//! what the backend lacks, is reported as ignored with the reason on stderr (and fails with it if run anyway).

use libtest_mimic::{Arguments, Failed, Trial};

fn main() {
    if std::env::var_os("EXS_LOG").is_some() {
        tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_env("EXS_LOG"))
            .with_writer(std::io::stderr)
            .init();
    }
    if let Some(code) = exs_conformance::child::run_if_child() {
        std::process::exit(code);
    }
    let args = Arguments::from_args();
    // Whether this run selects a trial: libtest-mimic's own filter and --skip (the trial taken as ignored, so that
    // --ignored does not leave it out).
    let selected = |name: &str| {
        !args.is_filtered_out(&Trial::test(name.to_string(), || Ok(())).with_ignored_flag(true))
    };
    let retry = std::env::var_os(exs_conformance::RETRY).is_some_and(|v| v == "1");
    let mut trials = Vec::new();
    for backend in exs_conformance::backends::enabled() {
        let backend: &'static dyn exs_conformance::Backend = Box::leak(backend);
        let cases = exs_conformance::all_cases();
        let names: Vec<String> = cases
            .iter()
            .map(|case| format!("{}::{}", backend.name(), case.name))
            .collect();
        // A backend none of whose trials this run selects is not opened: in the emulated guest, opening a
        // libfabric fabric took seconds of every run of a few verbs cases. Nor is one for `--list`, which runs
        // nothing (but `--list --ignored` lists the trials skipped here, which takes knowing them).
        let wanted = (!args.list || args.ignored) && names.iter().any(|n| selected(n));
        let unavailable = if wanted { backend.unavailable() } else { None };
        match &unavailable {
            _ if !wanted => {}
            Some(why) => eprintln!("SKIPPED backend {}: {why}", backend.name()),
            None => eprintln!("BACKEND {}: {}", backend.name(), backend.describe()),
        }
        for (case, name) in cases.into_iter().zip(names) {
            let skip = match wanted {
                true => unavailable.clone().or_else(|| case.skip_reason(backend)),
                false => None, // filtered out: never run, never asked
            };
            // Say why a trial is skipped only when this run would have run it.
            if let Some(why) = &skip {
                if unavailable.is_none() && selected(&name) {
                    eprintln!("SKIPPED {name}: {why}");
                }
            }
            let run = case.run;
            // A skipped trial is ignored; run anyway (`--ignored`, `--include-ignored`), it fails saying why it
            // cannot run here, rather than running on a backend that could not open or lacks what it needs.
            let trial = match skip {
                None => {
                    let n = name.clone();
                    Trial::test(name, move || {
                        exs_conformance::run_again_once(&n, retry, || run(backend))
                            .map_err(Failed::from)
                    })
                }
                Some(why) => {
                    Trial::test(name, move || Err(format!("cannot run here: {why}").into()))
                        .with_ignored_flag(true)
                }
            };
            trials.push(trial);
        }
    }
    libtest_mimic::run(&args, trials).exit();
}

//! The markdown report of a suite, its targets as ratios, the CSV and the suite's page (`bench/<suite>.md`).

use super::*;

/// The markdown report of one suite: tables, then the targets with their ratios.
pub(super) fn markdown(
    suite: &str,
    sum: &BTreeMap<Key, (f64, f64, f64, usize)>,
    cmd: &str,
    machine: &str,
    files: &[String],
) -> String {
    let mut s = String::new();
    let _ = writeln!(s, "#### {suite}\n\n`{cmd}` on {machine}; the exs tools built with the `dist` profile (fat LTO, one codegen unit). Median (min-max) of the repeats (the streams' one-way rows, hyper's GET and the points the stream pump's targets compare run several times a round, side by side: the median is of all their runs); throughput in MB/s (10^6 bytes/s), CPU as % of one core (user+system over wall), at the largest depth measured.\n");
    let mut cols: Vec<(String, String)> = sum
        .keys()
        .filter(|k| {
            k.4 == "bytes_per_sec"
                && !k.0.ends_with("-ping")
                && k.0 != "exs-wait"
                && k.0 != "exs-exposure"
        })
        .map(|k| (k.0.clone(), k.1.clone()))
        .collect();
    cols.dedup();
    cols.sort();
    cols.dedup();
    let mut sizes: Vec<u64> = sum
        .keys()
        .filter(|k| k.4 == "bytes_per_sec")
        .map(|k| k.2)
        .collect();
    sizes.sort();
    sizes.dedup();
    let _ = writeln!(
        s,
        "| size | {} |",
        cols.iter()
            .map(|c| if c.0 == c.1 {
                c.0.clone()
            } else {
                format!("{} {}", c.0, c.1)
            })
            .collect::<Vec<_>>()
            .join(" | ")
    );
    let _ = writeln!(s, "|---|{}", "---|".repeat(cols.len()));
    for &size in sizes.iter().filter(|&&z| z > 1) {
        let _ = writeln!(
            s,
            "| {} | {} |",
            fmt_size(size),
            cols.iter()
                .map(|c| cell(get(sum, &c.0, &c.1, size, "bytes_per_sec"), 1e-6, 0))
                .collect::<Vec<_>>()
                .join(" | ")
        );
    }
    let _ = writeln!(s, "\nCPU (client / server, % of a core):\n");
    let exs_cols: Vec<&(String, String)> = cols.iter().filter(|c| c.0 == "exs").collect();
    exs_header(&mut s, &exs_cols);
    for &size in &sizes {
        let _ = writeln!(
            s,
            "| {} | {} |",
            fmt_size(size),
            exs_cols
                .iter()
                .map(|c| format!(
                    "{} / {}",
                    get(sum, &c.0, &c.1, size, "cpu_client")
                        .map_or("-".into(), |v| format!("{:.0}", v.0 * 100.0)),
                    get(sum, &c.0, &c.1, size, "cpu_server")
                        .map_or("-".into(), |v| format!("{:.0}", v.0 * 100.0))
                ))
                .collect::<Vec<_>>()
                .join(" | ")
        );
    }
    per_message_table(&mut s, sum, &exs_cols, &sizes);
    let costs: Vec<&Key> = sum
        .keys()
        .filter(|k| k.0 == "cost" && k.4 == "syscalls_per_rt")
        .collect();
    if !costs.is_empty() {
        let _ = writeln!(s, "\nPer round trip, 8-byte ping-pong, both processes (`perf stat -e raw_syscalls:sys_enter,context-switches`; the difference between a run of N and of 3N round trips, so process start-up is not counted), user-space instructions per round trip (callgrind, every process, the difference between 500 and 2,000 round trips), and one-way latency in µs (fi_pingpong reports a mean only):\n\n| test | syscalls | context switches | user instructions | mean µs | median µs |\n|---|---|---|---|---|---|");
        for k in costs {
            let g = |m: &str, d: usize| {
                get(sum, "cost", &k.1, 8, m).map_or("-".into(), |v| format!("{:.*}", d, v.0))
            };
            let _ = writeln!(
                s,
                "| {} | {} | {} | {} | {} | {} |",
                k.1,
                g("syscalls_per_rt", 1),
                g("cs_per_rt", 2),
                g("instr_per_rt", 0),
                g("mean_us", 2),
                g("median_us", 2)
            );
        }
    }
    idle_table(&mut s, sum);
    let lat: Vec<&Key> = sum
        .keys()
        .filter(|k| k.4 == "mean_us" && k.0 != "cost" && k.0 != "idle")
        .collect();
    if !lat.is_empty() {
        let _ = writeln!(s, "\nLatency, 8-byte payload (exs and TCP: one-way, half the round trip; exs persistent and ib_read_lat: one RDMA read; ib_send_lat: one-way), µs, mean / median:\n\n| test | mean | median |\n|---|---|---|");
        for k in lat {
            let med = get(sum, &k.0, &k.1, k.2, "median_us")
                .map_or("-".into(), |v| format!("{:.2}", v.0));
            let _ = writeln!(
                s,
                "| {} {} | {} | {med} |",
                k.0,
                k.1,
                cell(get(sum, &k.0, &k.1, k.2, "mean_us"), 1.0, 2)
            );
        }
    }
    let waits: Vec<(u64, String)> = sum
        .keys()
        .filter(|k| k.0 == "exs-wait" && k.4 == "bytes_per_sec")
        .map(|k| (k.2, k.1.clone()))
        .collect();
    if !waits.is_empty() {
        let _ = writeln!(s, "\nWait modes (seqpacket, depth 8): MB/s, and client / server CPU %:\n\n| size | adaptive | block | busy |\n|---|---|---|---|");
        let mut ws: Vec<u64> = waits.iter().map(|w| w.0).collect();
        ws.sort();
        ws.dedup();
        for size in ws {
            let c = |m: &str| {
                let t = get(sum, "exs-wait", m, size, "bytes_per_sec").map_or(0.0, |v| v.0 / 1e6);
                let cc = get(sum, "exs-wait", m, size, "cpu_client").map_or(0.0, |v| v.0 * 100.0);
                let cs = get(sum, "exs-wait", m, size, "cpu_server").map_or(0.0, |v| v.0 * 100.0);
                format!("{t:.0} ({cc:.0}% / {cs:.0}%)")
            };
            let _ = writeln!(
                s,
                "| {} | {} | {} | {} |",
                fmt_size(size),
                c("adaptive"),
                c("block"),
                c("busy")
            );
        }
    }
    let mut es: Vec<u64> = sum
        .keys()
        .filter(|k| k.0 == "exs-exposure" && k.4 == "bytes_per_sec")
        .map(|k| k.2)
        .collect();
    es.sort();
    es.dedup();
    if !es.is_empty() {
        let _ = writeln!(s, "\nExposure policies (seqpacket sends the peer pulls with RDMA reads, `--mode normal`, depth 8): MB/s, remote keys the sender made per message, memory registrations per message (both sides):\n\n| size | per operation (default) | trusted peers (UNH-EXS) |\n|---|---|---|");
        for size in es {
            let c = |p: &str| {
                let t =
                    get(sum, "exs-exposure", p, size, "bytes_per_sec").map_or(0.0, |v| v.0 / 1e6);
                let k = get(sum, "exs-exposure", p, size, "client_exposures_per_msg")
                    .map_or(f64::NAN, |v| v.0);
                let r = get(sum, "exs-exposure", p, size, "registrations_per_msg")
                    .map_or(f64::NAN, |v| v.0);
                format!("{t:.0}, {k:.3} keys, {r:.3} registrations")
            };
            let _ = writeln!(
                s,
                "| {} | {} | {} |",
                fmt_size(size),
                c("per-operation"),
                c("trusted")
            );
        }
    }
    let _ = writeln!(s, "\nTargets (ratios of medians from this run):\n");
    for t in targets(suite, sum) {
        let _ = writeln!(s, "- {t}");
    }
    if !files.is_empty() {
        let _ = writeln!(
            s,
            "\nPlots: {}",
            files
                .iter()
                .map(|f| format!("[{f}]({f})"))
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    s
}

/// `a / b` when both were measured.
fn ratio(a: Option<f64>, b: Option<f64>) -> Option<f64> {
    match (a, b) {
        (Some(a), Some(b)) if b > 0.0 && a.is_finite() && b.is_finite() => Some(a / b),
        _ => None,
    }
}

pub(super) fn ratio_line(
    name: &str,
    a: Option<f64>,
    b: Option<f64>,
    ok: impl Fn(f64) -> bool,
    want: &str,
) -> String {
    match ratio(a, b) {
        Some(r) => format!(
            "{name}: {r:.2}x (target {want}) - {}",
            if ok(r) { "met" } else { "missed" }
        ),
        None => format!("{name}: not measured in this run"),
    }
}

/// A ratio reported for what it explains, with no target of its own.
fn explain_line(name: &str, a: Option<f64>, b: Option<f64>, what: &str) -> String {
    match ratio(a, b) {
        Some(r) => format!("{name}: {r:.2}x (no target: {what})"),
        None => format!("{name}: not measured in this run"),
    }
}

/// The per-round-trip targets of the 8-byte ping-pong (`cost` rows), and beside them what the transport alone
/// costs in the same run.
fn cost_targets(sum: &BTreeMap<Key, (f64, f64, f64, usize)>) -> Vec<String> {
    let cost = |v: &str, m: &str| get(sum, "cost", v, 8, m).map(|x| x.0);
    let mut v = Vec::new();
    for (row, name) in [
        ("exs busy", "exs busy ping"),
        (
            "exs busy fd",
            "exs busy ping on FI_WAIT_FD completion queues (--cq-wait fd)",
        ),
        (
            "exs busy nowait",
            "exs busy ping on completion queues without a wait object (--cq-no-wait, as fi_pingpong's)",
        ),
    ] {
        for (metric, what) in [
            ("syscalls_per_rt", "syscalls per round trip"),
            ("mean_us", "mean one-way (a mean: fi_pingpong reports no median)"),
        ] {
            v.push(ratio_line(
                &format!("{name} {what} vs fi_pingpong"),
                cost(row, metric),
                cost("fi_pingpong", metric),
                |r| r <= 1.5,
                "<= 1.5x",
            ));
        }
    }
    for (w, max) in [("exs busy", 0.2), ("exs adaptive", 2.5), ("exs block", 2.5)] {
        let cs = cost(w, "cs_per_rt");
        v.push(format!(
            "{w}: {} context switches per round trip (want <= {max}): {}",
            cs.map_or("-".into(), |c| format!("{c:.2}")),
            match cs {
                Some(c) if c <= max => "met",
                Some(_) => "MISSED",
                None => "not measured",
            }
        ));
    }
    for w in ["exs adaptive", "exs block"] {
        v.push(ratio_line(
            &format!("{w} ping median one-way vs blocking TCP nodelay"),
            cost(w, "median_us"),
            cost("tcp nodelay", "median_us"),
            |r| r <= 1.0,
            "<= 1.0x",
        ));
    }
    for (w, raw) in [("exs block", "raw block"), ("exs busy", "raw busy")] {
        v.push(explain_line(
            &format!("{raw} (the transport alone) median one-way vs blocking TCP nodelay"),
            cost(raw, "median_us"),
            cost("tcp nodelay", "median_us"),
            "what the transport itself costs",
        ));
        v.push(explain_line(
            &format!("{w} ping median one-way vs {raw}"),
            cost(w, "median_us"),
            cost(raw, "median_us"),
            "what exs costs above the transport",
        ));
    }
    for (w, what) in [
        ("exs busy", "the busy exs ping"),
        ("exs block", "the blocking exs ping"),
        ("raw block", "the transport alone (blocking)"),
    ] {
        v.push(explain_line(
            &format!("{w}: user-space instructions per round trip vs fi_pingpong"),
            cost(w, "instr_per_rt"),
            cost("fi_pingpong", "instr_per_rt"),
            &format!("what {what} runs in user space per round trip, both processes (callgrind)"),
        ));
    }
    v
}

pub(super) fn targets(suite: &str, sum: &BTreeMap<Key, (f64, f64, f64, usize)>) -> Vec<String> {
    let bw = |t: &str, v: &str, z: u64| get(sum, t, v, z, "bytes_per_sec").map(|x| x.0);
    let lat = |t: &str, v: &str| get(sum, t, v, 8, "mean_us").map(|x| x.0);
    let mib = 1 << 20;
    let mut v = idle_targets(sum);
    if suite == "host" {
        v.extend(stream_targets(sum));
        v.extend(cost_targets(sum));
        v.push(ratio_line(
            "exs seqpacket vs raw libfabric RMA write loop, 1 MiB",
            bw("exs", "seqpacket", mib),
            bw("raw", "write", mib),
            |r| r >= 0.9,
            ">= 0.9x",
        ));
        let tcp = bw("tcp", "nagle", mib)
            .into_iter()
            .chain(bw("tcp", "nodelay", mib))
            .fold(None, |a: Option<f64>, x| Some(a.map_or(x, |a| a.max(x))));
        v.push(ratio_line(
            "exs seqpacket vs best plain TCP, 1 MiB",
            bw("exs", "seqpacket", mib),
            tcp,
            |r| r >= 1.0,
            ">= 1.0x",
        ));
        v.push(ratio_line(
            "exs stream vs best plain TCP, 1 MiB",
            bw("exs", "stream", mib),
            tcp,
            |r| r >= 1.0,
            ">= 1.0x",
        ));
        // Issue 26: the stream pump at small sizes beside TCP without Nagle, at large ones beside the transport's
        // own write loop.
        let nodelay = (("tcp", "nodelay"), "TCP nodelay", 1.0);
        let raw = (("raw", "write"), "raw libfabric RMA write loop", 0.9);
        for (size, ((tool, variant), name, min)) in
            [(64u64, nodelay), (4096, nodelay), (65536, raw), (mib, raw)]
        {
            v.push(ratio_line(
                &format!("exs stream vs {name}, {}", fmt_size(size)),
                bw("exs", "stream", size),
                bw(tool, variant, size),
                |r| r >= min,
                &format!(">= {min:.1}x, issue 26"),
            ));
        }
        v.push(ratio_line(
            "exs stream at depth 32 (twice the advert credits) vs at depth 8, 1 MiB",
            bw("exs-deep", "stream", mib),
            bw("exs", "stream", mib),
            |r| r >= 0.9,
            ">= 0.9x, a deeper pipeline must not fall back on the stream buffer",
        ));
        if let Some((share, _, _)) = get(sum, "exs-deep", "stream", mib, "direct_share") {
            v.push(format!(
                "exs stream at depth 32, 1 MiB: {share:.3} of the bytes went straight into the receives (the rest \
                 through the stream buffer)"
            ));
        }
        v.push(explain_line(
            "raw libfabric RMA write loop at depth 32 vs at depth 8, 1 MiB",
            bw("raw-deep", "write", mib),
            bw("raw", "write", mib),
            "what twice the memory in flight costs the transport itself",
        ));
        for size in [65536u64, mib] {
            let a = bw("exs-wait", "adaptive", size);
            let best = bw("exs-wait", "busy", size)
                .into_iter()
                .chain(bw("exs-wait", "block", size))
                .fold(None, |m: Option<f64>, x| Some(m.map_or(x, |m| m.max(x))));
            v.push(ratio_line(
                &format!(
                    "adaptive wait vs the better of busy-poll and block, {}",
                    fmt_size(size)
                ),
                a,
                best,
                |r| r >= 0.9,
                ">= 0.9x",
            ));
            let cpu = |m: &str| get(sum, "exs-wait", m, size, "cpu_client").map(|x| x.0 * 100.0);
            if let (Some(a), Some(b)) = (cpu("adaptive"), cpu("block")) {
                v.push(format!("adaptive wait client CPU {a:.0}% vs block {b:.0}% at {} (target: at most block + 10 points) - {}", fmt_size(size), if a <= b + 10.0 { "met" } else { "missed" }));
            }
        }
    } else {
        for size in [65536u64, mib] {
            v.push(ratio_line(
                &format!("exs seqpacket vs ib_read_bw, {}", fmt_size(size)),
                bw("exs", "seqpacket", size),
                bw("perftest", "ib_read_bw", size),
                |r| r >= 0.9,
                ">= 0.9x",
            ));
            v.push(ratio_line(
                &format!("exs stream vs ib_write_bw, {}", fmt_size(size)),
                bw("exs", "stream", size),
                bw("perftest", "ib_write_bw", size),
                |r| r >= 0.9,
                ">= 0.9x",
            ));
            v.push(ratio_line(
                &format!("exs stream vs rstream, {}", fmt_size(size)),
                bw("exs", "stream", size),
                bw("rstream", "rstream", size),
                |r| r >= 1.0,
                ">= 1.0x, issue 12; issue 7 asked 1.5x",
            ));
            v.push(ratio_line(
                &format!(
                    "exs::Stream ({} writes) vs rstream, {}",
                    fmt_size(size),
                    fmt_size(size)
                ),
                bw("streams", "exs-std", size),
                bw("rstream", "rstream", size),
                |r| r >= 1.0,
                ">= 1.0x, issue 26",
            ));
        }
        v.push(ratio_line(
            "exs immediate one-way latency vs ib_send_lat, 8 B",
            lat("exs-ping", "immediate"),
            lat("perftest", "ib_send_lat"),
            |r| r <= 2.0,
            "<= 2x, issue 12; issue 7 asked 1.5x",
        ));
        v.push(ratio_line(
            "exs persistent read vs ib_read_lat, 8 B",
            lat("exs-ping", "persistent"),
            lat("perftest", "ib_read_lat"),
            |r| r <= 1.5,
            "<= 1.5x, issue 12; issue 7 asked 1.3x",
        ));
        v.extend(siw_targets(sum));
    }
    if suite == "softroce" {
        let reg = |m: &str| get(sum, "streams-register", "exs-std", REGISTERED, m).map(|x| x.0);
        v.push(explain_line(
            &format!(
                "exs::Stream 8 B round trip p99 while another thread registers {} regions vs quiet",
                fmt_size(REGISTERED)
            ),
            reg("register_p99_us"),
            reg("quiet_p99_us"),
            "the device pins a region's pages meanwhile; a connection must not wait for it",
        ));
    }
    // Issue 30: the ES-API from C costs nothing measurable beside the Rust API.
    v.push(ratio_line(
        "C ping-pong through libexs vs exs ping (Rust), median one-way, immediate 8 B",
        get(sum, "exs-c-ping", "immediate", 8, "median_us").map(|x| x.0),
        get(sum, "exs-ping", "immediate", 8, "median_us").map(|x| x.0),
        |r| r <= 1.1,
        "<= 1.1x",
    ));
    let sizes: Vec<u64> = sum
        .keys()
        .filter(|k| k.0 == "exs" && k.1 == "persistent")
        .map(|k| k.2)
        .collect();
    if let Some(&z) = sizes.iter().max() {
        if let Some(c) = get(sum, "exs", "persistent", z, "cpu_client") {
            v.push(format!("persistent sender CPU while the peer pulls ({}): {:.1}% of a core (target: near zero) - {}", fmt_size(z), c.0 * 100.0, if c.0 < 0.05 { "met" } else { "missed" }));
        }
    }
    v
}

/// The same targets on soft-iWARP (issue 31), where the run measured it (tools named `siw-...`).
fn siw_targets(sum: &BTreeMap<Key, (f64, f64, f64, usize)>) -> Vec<String> {
    let bw = |t: &str, v: &str, z: u64| get(sum, t, v, z, "bytes_per_sec").map(|x| x.0);
    let lat = |t: &str, v: &str| get(sum, t, v, 8, "mean_us").map(|x| x.0);
    if !sum.keys().any(|k| k.0.starts_with("siw-")) {
        return Vec::new();
    }
    let z = 65536;
    vec![
        ratio_line(
            "siw: exs seqpacket vs ib_read_bw, 64 KiB",
            bw("siw-exs", "seqpacket", z),
            bw("siw-perftest", "ib_read_bw", z),
            |r| r >= 0.9,
            ">= 0.9x",
        ),
        ratio_line(
            "siw: exs stream vs ib_write_bw, 64 KiB",
            bw("siw-exs", "stream", z),
            bw("siw-perftest", "ib_write_bw", z),
            |r| r >= 0.9,
            ">= 0.9x",
        ),
        ratio_line(
            "siw: exs immediate one-way latency vs ib_send_lat, 8 B",
            lat("siw-exs-ping", "immediate"),
            lat("siw-perftest", "ib_send_lat"),
            |r| r <= 2.0,
            "<= 2x",
        ),
        ratio_line(
            "siw: exs persistent read vs ib_read_lat, 8 B",
            lat("siw-exs-ping", "persistent"),
            lat("siw-perftest", "ib_read_lat"),
            |r| r <= 1.5,
            "<= 1.5x",
        ),
    ]
}

/// `quick` runs go to files of their own (`-quick`), so that they never replace a full run's; a second run of
/// a suite the same day gets its own files too (`-2`, `-3`: the bench README may cite the first).
pub(super) fn write_results(
    suite: &str,
    quick: bool,
    rows: &[Row],
    cmd: &str,
    machine: &str,
) -> Result<String> {
    let dir = sys::root().join("bench/results");
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    let date = sys::output(Command::new("date").args(["-u", "+%Y-%m-%d"]))?
        .trim()
        .to_string();
    let base = format!("{date}-{suite}{}", if quick { "-quick" } else { "" });
    let stem = (1..)
        .map(|n| match n {
            1 => base.clone(),
            n => format!("{base}-{n}"),
        })
        .find(|s| !dir.join(format!("{s}.csv")).exists())
        .expect("some run number is free");
    let mut csv = String::from("suite,tool,variant,size,depth,metric,repeat,value\n");
    for r in rows {
        let _ = writeln!(
            csv,
            "{},{},{},{},{},{},{},{}",
            r.suite, r.tool, r.variant, r.size, r.depth, r.metric, r.repeat, r.value
        );
    }
    std::fs::write(dir.join(format!("{stem}.csv")), csv).map_err(|e| e.to_string())?;
    let sum = summarize(rows);
    let mut files = Vec::new();
    for (name, metric, scale, ylabel, logy) in [
        ("throughput", "bytes_per_sec", 1e-6, "MB/s (log)", true),
        (
            "cpu-client",
            "cpu_client",
            100.0,
            "client CPU, % of a core",
            false,
        ),
        (
            "cpu-server",
            "cpu_server",
            100.0,
            "server CPU, % of a core",
            false,
        ),
    ] {
        let svg = svg(
            &format!("{suite}: {name} vs message size"),
            ylabel,
            &series(&sum, metric, scale),
            logy,
        );
        if !svg.is_empty() {
            let f = format!("{stem}-{name}.svg");
            std::fs::write(dir.join(&f), svg).map_err(|e| e.to_string())?;
            files.push(f);
        }
    }
    let md = markdown(suite, &sum, cmd, machine, &files);
    std::fs::write(dir.join(format!("{stem}.md")), &md).map_err(|e| e.to_string())?;
    eprintln!(
        "xtask: wrote bench/results/{stem}.csv, .md and {} plots",
        files.len()
    );
    Ok(md)
}

pub(super) fn machine() -> String {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|c| {
            c.lines()
                .find(|l| l.starts_with("model name"))
                .map(|l| l.split(':').nth(1).unwrap_or("").trim().to_string())
        })
        .unwrap_or_default();
    let n = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1);
    format!("{n} vCPUs ({cpu})")
}

/// `bench/<suite>.md` shows the last full run (the dated files under `bench/results/` keep every run); a quick
/// run's table is printed. The README links to these files and is never rewritten.
pub(super) fn publish(suite: &str, quick: bool, md: &str) -> Result<()> {
    if quick {
        println!("{md}");
        return Ok(());
    }
    let path = sys::root().join(format!("bench/{suite}.md"));
    std::fs::write(&path, suite_page(suite, md)).map_err(|e| format!("{}: {e}", path.display()))?;
    eprintln!("xtask: wrote bench/{suite}.md");
    Ok(())
}

/// The page of a suite's last full run: a generated-file notice, then the run's report with its links made
/// relative to `bench/` (the report itself lives in `bench/results/`).
pub(super) fn suite_page(suite: &str, md: &str) -> String {
    format!(
        "<!-- Generated by `cargo xtask bench --suite {suite}`: edits are overwritten. -->\n\
         # Benchmarks: the `{suite}` suite, last full run\n\n\
         How to read these tables, and what changed between runs: [bench/README.md](README.md). Every run's CSV, \
         report and plots: [bench/results/](results/).\n\n{}\n",
        md.replace("](", "](results/")
    )
}

/// Issue 12: context switches (voluntary and involuntary, `getrusage`) and progress-thread wake-ups per message,
/// each side, beside the throughput of the same runs; then the same for the latency runs (`exs ping`).
fn per_message_table(
    s: &mut String,
    sum: &BTreeMap<Key, (f64, f64, f64, usize)>,
    exs_cols: &[&(String, String)],
    sizes: &[u64],
) {
    let pair = |tool: &str, variant: &str, size: u64, m: &str, d: usize| {
        let side = |who: &str| {
            get(sum, tool, variant, size, &format!("{who}_{m}"))
                .map_or("-".into(), |v| format!("{:.*}", d, v.0))
        };
        format!("{} / {}", side("client"), side("server"))
    };
    let has = |tool: &str, variant: &str, size: u64| {
        get(sum, tool, variant, size, "client_cs_per_msg").is_some()
    };
    if exs_cols
        .iter()
        .any(|c| sizes.iter().any(|&z| has(&c.0, &c.1, z)))
    {
        let _ = writeln!(s, "\nPer message, client / server (`exs pump --json`): context switches (voluntary + involuntary, `getrusage`) and progress-thread wake-ups:\n");
        exs_header(s, exs_cols);
        for &size in sizes.iter().filter(|&&z| z > 1) {
            let _ = writeln!(
                s,
                "| {} | {} |",
                fmt_size(size),
                exs_cols
                    .iter()
                    .map(|c| if has(&c.0, &c.1, size) {
                        format!(
                            "{} cs, {} wake-ups",
                            pair(&c.0, &c.1, size, "cs_per_msg", 3),
                            pair(&c.0, &c.1, size, "wakeups_per_msg", 4)
                        )
                    } else {
                        "-".into()
                    })
                    .collect::<Vec<_>>()
                    .join(" | ")
            );
        }
    }
    let pings: Vec<&Key> = sum
        .keys()
        .filter(|k| k.0.ends_with("-ping") && k.4 == "client_cs_per_msg")
        .collect();
    if !pings.is_empty() {
        let _ = writeln!(s, "\nPer ping, client / server (`exs ping --json`, 8 bytes): context switches (`getrusage`) and progress-thread wake-ups:\n\n| test | context switches | progress wake-ups |\n|---|---|---|");
        for k in pings {
            let _ = writeln!(
                s,
                "| {} {} | {} | {} |",
                k.0,
                k.1,
                pair(&k.0, &k.1, k.2, "cs_per_msg", 3),
                pair(&k.0, &k.1, k.2, "wakeups_per_msg", 4)
            );
        }
    }
}

/// The header of a table with a column per exs variant.
fn exs_header(s: &mut String, exs_cols: &[&(String, String)]) {
    let _ = writeln!(
        s,
        "| size | {} |",
        exs_cols
            .iter()
            .map(|c| format!("exs {}", c.1))
            .collect::<Vec<_>>()
            .join(" | ")
    );
    let _ = writeln!(s, "|---|{}", "---|".repeat(exs_cols.len()));
}

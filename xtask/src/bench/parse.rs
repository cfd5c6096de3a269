//! Each job's output turned into rows, the interleaved run script, and the medians.

use super::*;

/// Turns one job's output into rows.
pub(super) fn parse(suite: &str, j: &Job, repeat: usize, out: &str) -> Vec<Row> {
    let row = |metric: &str, value: f64| Row {
        suite: suite.into(),
        tool: j.tool.clone(),
        variant: j.variant.clone(),
        size: j.size,
        depth: j.depth,
        metric: metric.into(),
        repeat,
        value,
    };
    let mut rows = Vec::new();
    match j.parse {
        Parse::Json => {
            for v in out
                .lines()
                .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            {
                for m in [
                    "bytes_per_sec",
                    "cpu_client",
                    "cpu_server",
                    "mean_us",
                    "median_us",
                    "client_exposures_per_msg",
                    "registrations_per_msg",
                    "direct_share",
                    // `stream_bench register`: round trips quiet, then beside registrations.
                    "quiet_p99_us",
                    "register_p99_us",
                    "register_max_us",
                ]
                .into_iter()
                .chain(IDLE_METRICS)
                {
                    if let Some(x) = v[m].as_f64() {
                        rows.push(row(m, x));
                    }
                }
                // Issue 12: what each message cost each side, from `getrusage` and the context's counters.
                for side in ["client", "server"] {
                    let f = |m: &str| v[format!("{side}_{m}")].as_f64();
                    if let (Some(vol), Some(invol)) = (f("vcsw_per_msg"), f("ivcsw_per_msg")) {
                        rows.push(row(&format!("{side}_cs_per_msg"), vol + invol));
                    }
                    if let Some(w) = f("progress_wakeups_per_msg") {
                        rows.push(row(&format!("{side}_wakeups_per_msg"), w));
                    }
                }
            }
        }
        Parse::PerftestBw | Parse::PerftestLat => {
            // The data line starts with the size in bytes.
            for l in out.lines() {
                let f: Vec<&str> = l.split_whitespace().collect();
                if f.first().and_then(|x| x.parse::<u64>().ok()) != Some(j.size) || f.len() < 5 {
                    continue;
                }
                let num = |i: usize| f.get(i).and_then(|x| x.parse::<f64>().ok());
                if j.parse == Parse::PerftestBw {
                    if let Some(mb) = num(3) {
                        rows.push(row("bytes_per_sec", mb * 1e6 * 1.048576));
                    }
                } else if let (Some(typ), Some(avg)) = (num(4), num(5)) {
                    rows.push(row("median_us", typ));
                    rows.push(row("mean_us", avg));
                }
            }
        }
        Parse::PerfPing(short, long) => {
            let mut counts: BTreeMap<(&str, &str), f64> = BTreeMap::new();
            let mut part = "";
            for l in out.lines() {
                if let Some(p) = l.strip_prefix("@@") {
                    part = if p == "short" { "short" } else { "long" };
                    continue;
                }
                let f: Vec<&str> = l.split(',').collect();
                if let (Some(c), Some(ev)) = (
                    f.first().and_then(|x| x.trim().parse::<f64>().ok()),
                    f.get(2),
                ) {
                    counts.insert((part, ev), c);
                }
                // fi_pingpong: bytes #sent #ack total time MB/sec usec/xfer Mxfers/sec
                let w: Vec<&str> = l.split_whitespace().collect();
                if w.len() == 8 && w[0] == "8" && w[2].starts_with('=') {
                    if let Ok(us) = w[6].parse::<f64>() {
                        rows.push(row("mean_us", us));
                    }
                }
            }
            let extra = long.saturating_sub(short).max(1) as f64;
            for (ev, metric) in [
                ("raw_syscalls:sys_enter", "syscalls_per_rt"),
                ("context-switches", "cs_per_rt"),
            ] {
                if let (Some(a), Some(b)) = (counts.get(&("short", ev)), counts.get(&("long", ev)))
                {
                    rows.push(row(metric, ((b - a) / extra).max(0.0)));
                }
            }
            for v in out
                .lines()
                .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            {
                for m in ["mean_us", "median_us"].into_iter().chain(IDLE_METRICS) {
                    if let Some(x) = v[m].as_f64() {
                        rows.push(row(m, x));
                    }
                }
            }
        }
        Parse::Instructions(short, long) => {
            // valgrind prints `==PID== Collected : N` for each process it ran; the short run's part comes first.
            let mut sums = [0f64; 2];
            let mut part = None;
            for l in out.lines() {
                match l.strip_prefix("@@") {
                    Some("short") => part = Some(0),
                    Some(_) => part = Some(1),
                    None => {}
                }
                let n = l
                    .split_once("Collected :")
                    .and_then(|(_, n)| n.trim().parse::<f64>().ok());
                if let (Some(p), Some(n)) = (part, n) {
                    sums[p] += n;
                }
            }
            if sums[0] > 0.0 && sums[1] > sums[0] {
                let extra = long.saturating_sub(short).max(1) as f64;
                rows.push(row("instr_per_rt", (sums[1] - sums[0]) / extra));
            }
        }
        Parse::Rstream => {
            // name bytes xfers iters total time Gb/sec usec/xfer
            if let Some(l) = out
                .lines()
                .rev()
                .find(|l| l.split_whitespace().count() >= 8)
            {
                if let Some(g) = l
                    .split_whitespace()
                    .nth(6)
                    .and_then(|x| x.parse::<f64>().ok())
                {
                    rows.push(row("bytes_per_sec", g * 1e9 / 8.0));
                }
            }
        }
    }
    // perftest prints `inf` when its clock readings go wrong (seen under TCG): that repeat measured nothing.
    // A throughput of 0 (ib_read_bw in duration mode on rxe) measured nothing either.
    rows.retain(|r| r.value.is_finite() && !(r.metric == "bytes_per_sec" && r.value <= 0.0));
    rows
}

/// Kills what a timed-out job may have left behind (servers started in the background).
pub(super) const CLEANUP: &str = "for p in ib_write_bw ib_read_bw ib_send_lat ib_read_lat rstream fi_pingpong ping_pong; do pkill -x $p; done 2>/dev/null; \
                       pkill -f 'exs (pump|ping|demo) --server --once --announce|exs (rawpump|rawping|tcppump|tcpping) ' 2>/dev/null; true";

/// The jobs as one shell script with markers, repeated and interleaved (every job once per round).
pub(super) fn script(jobs: &[Job], repeats: usize, timeout: u32) -> String {
    let mut s = String::new();
    for r in 0..repeats {
        for (i, j) in jobs.iter().enumerate() {
            let cmd = j.cmd.replace('\'', "'\\''");
            let _ = writeln!(
                s,
                "echo '@@job {i} {r}'; timeout -k 5 {timeout} sh -c '{cmd}' || echo 'job {i} failed or timed out' >&2; {CLEANUP}"
            );
        }
    }
    s
}

pub(super) fn collect(suite: &str, jobs: &[Job], output: &str) -> Vec<Row> {
    let mut rows = Vec::new();
    let mut cur: Option<(usize, usize)> = None;
    let mut buf = String::new();
    let flush = |cur: Option<(usize, usize)>, buf: &mut String, rows: &mut Vec<Row>| {
        if let Some((i, r)) = cur {
            if let Some(j) = jobs.get(i) {
                rows.extend(parse(suite, j, r, buf));
            }
        }
        buf.clear();
    };
    for l in output.lines() {
        if let Some(rest) = l.strip_prefix("@@job ") {
            flush(cur, &mut buf, &mut rows);
            let mut it = rest
                .split_whitespace()
                .filter_map(|x| x.parse::<usize>().ok());
            cur = it.next().zip(it.next());
        } else {
            buf.push_str(l);
            buf.push('\n');
        }
    }
    flush(cur, &mut buf, &mut rows);
    rows
}

/// Median and range of each (tool, variant, size, depth, metric).
pub(super) type Key = (String, String, u64, usize, String);

pub(super) fn summarize(rows: &[Row]) -> BTreeMap<Key, (f64, f64, f64, usize)> {
    let mut groups: BTreeMap<Key, Vec<f64>> = BTreeMap::new();
    for r in rows {
        groups
            .entry((
                r.tool.clone(),
                r.variant.clone(),
                r.size,
                r.depth,
                r.metric.clone(),
            ))
            .or_default()
            .push(r.value);
    }
    groups
        .into_iter()
        .map(|(k, mut v)| {
            v.sort_by(f64::total_cmp);
            let med = if v.len() % 2 == 1 {
                v[v.len() / 2]
            } else {
                (v[v.len() / 2 - 1] + v[v.len() / 2]) / 2.0
            };
            (k, (med, v[0], v[v.len() - 1], v.len()))
        })
        .collect()
}

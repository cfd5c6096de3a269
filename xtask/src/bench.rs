//! `cargo xtask bench [--quick]`: the seed paper's benchmark set (seed 002, section 5) beside the best peers,
//! measured in the same invocation, interleaved, repeated; medians and ranges go to
//! `bench/results/<date>-<suite>.csv`, SVG plots and a markdown table that the README includes.
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

#[derive(Args)]
pub struct BenchArgs {
    /// A representative subset in under five minutes.
    #[arg(long)]
    pub quick: bool,
    /// Repeats of every point (default 3; quick: 2 on the host, 1 in the Soft-RoCE guest).
    #[arg(long)]
    pub repeats: Option<usize>,
    /// Run one suite only: host or softroce (default: both).
    #[arg(long)]
    pub suite: Option<String>,
}

/// How a job's output becomes numbers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Parse {
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
}

#[derive(Clone, Debug)]
struct Job {
    tool: String,
    variant: String,
    size: u64,
    depth: usize,
    cmd: String,
    parse: Parse,
}

/// One measured number.
#[derive(Clone, Debug)]
struct Row {
    suite: String,
    tool: String,
    variant: String,
    size: u64,
    depth: usize,
    metric: String,
    repeat: usize,
    value: f64,
}

fn job(tool: &str, variant: &str, size: u64, depth: usize, cmd: String, parse: Parse) -> Job {
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
struct Plan {
    sizes: Vec<u64>,
    depths: Vec<usize>,
    seconds: f64,
    pings: usize,
    /// Longest a single job may take before it is killed (a hung peer tool must not hang the run).
    timeout: u32,
}

fn plan(quick: bool) -> Plan {
    if quick {
        Plan {
            sizes: vec![64, 4096, 65536, 1 << 20],
            depths: vec![8],
            seconds: 0.5,
            pings: 1000,
            timeout: 60,
        }
    } else {
        Plan {
            sizes: vec![1, 16, 256, 4096, 65536, 1 << 20, 4 << 20, 16 << 20],
            depths: vec![1, 2, 4, 8],
            seconds: 1.5,
            pings: 5000,
            timeout: 180,
        }
    }
}

/// The exs tool invocations of a suite (`backend` are the backend flags).
fn exs_jobs(exe: &str, backend: &str, p: &Plan, wait_modes: bool) -> Vec<Job> {
    let mut v = Vec::new();
    let secs = p.seconds;
    for &size in &p.sizes {
        for &depth in &p.depths {
            for (variant, flags) in [
                // What a user gets: the transport's immediate-data threshold decides (seed 002, 4.1).
                ("seqpacket", "--type seqpacket --mode default"),
                ("stream", "--type stream --mode normal"),
            ] {
                v.push(job(
                    "exs",
                    variant,
                    size,
                    depth,
                    format!("{exe} pump {backend} {flags} --size {size} --depth {depth} --seconds {secs} --json"),
                    Parse::Json,
                ));
            }
            if size <= 512 {
                v.push(job(
                    "exs",
                    "immediate",
                    size,
                    depth,
                    format!("{exe} pump {backend} --mode immediate --size {size} --depth {depth} --seconds {secs} --json"),
                    Parse::Json,
                ));
            }
            if size >= 4096 {
                v.push(job(
                    "exs",
                    "persistent",
                    size,
                    depth,
                    format!("{exe} pump {backend} --mode persistent --size {size} --depth {depth} --seconds {secs} --json"),
                    Parse::Json,
                ));
            }
            if size >= 64 {
                for op in ["write", "read"] {
                    v.push(job(
                        "raw",
                        op,
                        size,
                        depth,
                        format!("{exe} rawpump {backend} --op {op} --size {size} --depth {depth} --seconds {secs} --json"),
                        Parse::Json,
                    ));
                }
            }
        }
    }
    // Issue 13: the two exposure policies side by side, on sends that the peer pulls with RDMA reads (each needs a
    // remote key): a key per operation against UNH-EXS's key per region and connection.
    let exposure_sizes: &[u64] = if wait_modes {
        &[4096, 65536, 1 << 20]
    } else {
        &[65536]
    };
    for &size in exposure_sizes {
        for policy in ["per-operation", "trusted"] {
            v.push(job(
                "exs-exposure",
                policy,
                size,
                8,
                format!("{exe} pump {backend} --type seqpacket --mode normal --exposure {policy} --size {size} --depth 8 --seconds {secs} --json"),
                Parse::Json,
            ));
        }
    }
    if wait_modes {
        for size in [65536u64, 1 << 20] {
            for wait in ["adaptive", "block", "busy"] {
                v.push(job(
                    "exs-wait",
                    wait,
                    size,
                    8,
                    format!("{exe} pump {backend} --size {size} --depth 8 --seconds {secs} --wait {wait} --json"),
                    Parse::Json,
                ));
            }
        }
    }
    let n = p.pings;
    for mode in ["immediate", "normal", "persistent"] {
        v.push(job(
            "exs-ping",
            mode,
            8,
            1,
            format!("{exe} ping {backend} --mode {mode} --size 8 --count {n} --json"),
            Parse::Json,
        ));
    }
    v
}

fn host_jobs(exe: &str, p: &Plan) -> Vec<Job> {
    let mut v = exs_jobs(
        exe,
        "--backend fabric --provider tcp --addr 127.0.0.1",
        p,
        true,
    );
    for &size in &p.sizes {
        for (variant, flag) in [("nagle", ""), ("nodelay", "--nodelay")] {
            v.push(job(
                "tcp",
                variant,
                size,
                1,
                format!(
                    "{exe} tcppump --size {size} --seconds {} {flag} --json",
                    p.seconds
                ),
                Parse::Json,
            ));
        }
    }
    v.push(job(
        "tcp-ping",
        "nodelay",
        8,
        1,
        format!(
            "{exe} tcpping --size 8 --count {} --nodelay --json",
            p.pings
        ),
        Parse::Json,
    ));
    v.extend(cost_jobs(exe));
    v
}

fn softroce_jobs(exe: &str, p: &Plan, quick: bool) -> Vec<Job> {
    let (dev, _, addr) = rxe::DUMMY;
    // The guest's CPU is emulated: the quick run keeps to the sizes the targets name.
    let quick_plan;
    let p = if quick {
        quick_plan = Plan {
            sizes: vec![65536],
            depths: p.depths.clone(),
            seconds: 1.0,
            pings: 300,
            timeout: 90,
        };
        &quick_plan
    } else {
        // Every exs point in the guest costs seconds of emulated start-up: the sizes and depths that show the shape.
        quick_plan = Plan {
            sizes: vec![4096, 65536, 1 << 20],
            depths: vec![1, 8],
            ..p.clone()
        };
        &quick_plan
    };
    let mut v = exs_jobs(exe, &format!("--backend verbs --addr {addr}"), p, false);
    // perftest and rstream: server in the background, client in front, on the same device.
    let pt = |bin: &str, size: u64, extra: &str| {
        format!(
            "{bin} -R -d {dev} -F -s {size} {extra} >/dev/null 2>&1 & {}",
            retry(&format!("{bin} -R -d {dev} -F -s {size} {extra} {addr}"))
        )
    };
    let depth = p.depths.iter().copied().max().unwrap_or(8);
    for &size in p.sizes.iter().filter(|&&s| s >= 64) {
        // The same number of transfers in flight as exs gets.
        // Iterations, not duration: in duration mode (-D) ib_read_bw counts 0 iterations of 1 MiB reads on rxe.
        let iters = (32u64 << 20).div_ceil(size).clamp(100, 5_000);
        let extra = format!("-n {iters} -t {depth}");
        v.push(job(
            "perftest",
            "ib_write_bw",
            size,
            depth,
            pt("ib_write_bw", size, &extra),
            Parse::PerftestBw,
        ));
        let extra = format!("-n {iters} -o {depth}");
        v.push(job(
            "perftest",
            "ib_read_bw",
            size,
            depth,
            pt("ib_read_bw", size, &extra),
            Parse::PerftestBw,
        ));
        for (variant, t) in [("rstream", ""), ("rstream-tcp", "-T s")] {
            let count = (32u64 << 20).div_ceil(size).clamp(100, 5_000);
            v.push(job(
                "rstream",
                variant,
                size,
                1,
                {
                    let client = format!("rstream {t} -s {addr} -S {size} -C {count}");
                    // Over TCP a client that gives up early can leave the server serving a dead connection: wait
                    // until the server listens (rstream's port, 7471) and connect once.
                    let connect = if t.is_empty() {
                        retry(&client)
                    } else {
                        format!("for i in $(seq 60); do ss -Hltn 'sport = :7471' | grep -q . && break; sleep 0.5; done; {client}; wait")
                    };
                    format!("rstream {t} -S {size} -C {count} >/dev/null 2>&1 & {connect}")
                },
                Parse::Rstream,
            ));
        }
    }
    v.push(job(
        "perftest",
        "ib_send_lat",
        8,
        1,
        pt("ib_send_lat", 8, "-n 2000"),
        Parse::PerftestLat,
    ));
    v.push(job(
        "perftest",
        "ib_read_lat",
        8,
        1,
        pt("ib_read_lat", 8, "-n 2000"),
        Parse::PerftestLat,
    ));
    if quick {
        // Only what the targets compare: every point costs seconds of emulated CPU.
        v.retain(|j| {
            !matches!(
                (j.tool.as_str(), j.variant.as_str()),
                ("raw", "read") | ("rstream", "rstream-tcp") | ("exs-ping", "normal")
            )
        });
    }
    v
}

/// Runs a peer tool's client until it connects: under an emulated CPU its server can take seconds to listen. Then
/// waits for the server.
/// Where `perf stat` writes its counts for a cost job (read back by the same job's script).
const PERF_OUT: &str = "/tmp/exs-bench-perf";

/// Runs a ping-pong twice under `perf stat` (system calls and context switches of it and its children): once
/// with `short` round trips (its output dropped), once with `long`. The difference of the two counts is the cost
/// of the extra round trips alone, without process start-up (libfabric's initialisation alone makes ~10,000 calls
/// per process). `cmd(n)` is the command for `n` round trips.
fn perf_twice(cmd: impl Fn(usize) -> String, short: usize, long: usize) -> String {
    let stat = "perf stat -x, -e raw_syscalls:sys_enter,context-switches";
    format!(
        "{stat} -o {PERF_OUT}.short -- {} >/dev/null 2>&1; {stat} -o {PERF_OUT}.long -- {}; \
         echo @@short; cat {PERF_OUT}.short; echo @@long; cat {PERF_OUT}.long; rm -f {PERF_OUT}.short {PERF_OUT}.long",
        cmd(short),
        cmd(long)
    )
}

/// Per-message cost on the host (issue 12): the same 8-byte ping-pong through libfabric's own `fi_pingpong`
/// (busy polling), exs immediate pings in each wait mode, and blocking TCP, each counted by `perf stat`.
fn cost_jobs(exe: &str) -> Vec<Job> {
    // Enough round trips that the difference is steady, in quick runs too (3 s at most per run, blocking).
    let (short, long) = (10_000, 30_000);
    // exs ping counts a 10% warm-up (+1) as round trips too.
    let exs_rts = |n: usize| n + n / 10 + 1;
    let mut v = vec![job(
        "cost",
        "fi_pingpong",
        8,
        1,
        perf_twice(
            |n| {
                format!(
                    "sh -c 'fi_pingpong -p tcp -e msg -I {n} -S 8 >/dev/null 2>&1 & sleep 1; \
                     fi_pingpong -p tcp -e msg -I {n} -S 8 127.0.0.1; wait'"
                )
            },
            short,
            long,
        ),
        Parse::PerfPing(short, long),
    )];
    for wait in ["busy", "adaptive", "block"] {
        v.push(job(
            "cost",
            &format!("exs {wait}"),
            8,
            1,
            perf_twice(
                |n| {
                    format!(
                        "{exe} ping --backend fabric --provider tcp --addr 127.0.0.1 --mode immediate --size 8 --count {n} --wait {wait} --json"
                    )
                },
                short,
                long,
            ),
            Parse::PerfPing(exs_rts(short), exs_rts(long)),
        ));
    }
    v.push(job(
        "cost",
        "tcp nodelay",
        8,
        1,
        perf_twice(
            |n| format!("{exe} tcpping --size 8 --count {n} --nodelay --json"),
            short,
            long,
        ),
        Parse::PerfPing(short, long),
    ));
    v
}

fn retry(client: &str) -> String {
    format!("for i in 1 2 3 4 5; do sleep 1; {client} && break; done; wait")
}

/// Turns one job's output into rows.
fn parse(suite: &str, j: &Job, repeat: usize, out: &str) -> Vec<Row> {
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
                ] {
                    if let Some(x) = v[m].as_f64() {
                        rows.push(row(m, x));
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
                for m in ["mean_us", "median_us"] {
                    if let Some(x) = v[m].as_f64() {
                        rows.push(row(m, x));
                    }
                }
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
const CLEANUP: &str = "for p in ib_write_bw ib_read_bw ib_send_lat ib_read_lat rstream fi_pingpong; do pkill -x $p; done 2>/dev/null; \
                       pkill -f 'exs (pump|ping|demo) --server --once --announce|exs (rawpump|tcppump|tcpping) ' 2>/dev/null; true";

/// The jobs as one shell script with markers, repeated and interleaved (every job once per round).
fn script(jobs: &[Job], repeats: usize, timeout: u32) -> String {
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

fn collect(suite: &str, jobs: &[Job], output: &str) -> Vec<Row> {
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
type Key = (String, String, u64, usize, String);

fn summarize(rows: &[Row]) -> BTreeMap<Key, (f64, f64, f64, usize)> {
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

fn fmt_size(n: u64) -> String {
    match n {
        n if n >= 1 << 20 && n % (1 << 20) == 0 => format!("{} MiB", n >> 20),
        n if n >= 1024 && n % 1024 == 0 => format!("{} KiB", n >> 10),
        n => format!("{n} B"),
    }
}

/// A log-log (or log-x) SVG line plot.
fn svg(title: &str, ylabel: &str, series: &[(String, Vec<(f64, f64)>)], logy: bool) -> String {
    let (w, h, ml, mr, mt, mb) = (760.0, 440.0, 70.0, 200.0, 40.0, 50.0);
    let pts: Vec<(f64, f64)> = series
        .iter()
        .flat_map(|s| s.1.iter().copied())
        .filter(|p| p.0 > 0.0 && (!logy || p.1 > 0.0))
        .collect();
    if pts.is_empty() {
        return String::new();
    }
    let lx = |x: f64| x.log10();
    let ly = |y: f64| if logy { y.log10() } else { y };
    let (x0, x1) = pts.iter().fold((f64::MAX, f64::MIN), |a, p| {
        (a.0.min(lx(p.0)), a.1.max(lx(p.0)))
    });
    let (mut y0, mut y1) = pts.iter().fold((f64::MAX, f64::MIN), |a, p| {
        (a.0.min(ly(p.1)), a.1.max(ly(p.1)))
    });
    if logy {
        y0 = y0.floor();
        y1 = y1.ceil();
    } else {
        y0 = 0.0;
        y1 = (y1 * 1.1).max(1e-9);
    }
    let (x0, x1) = (x0.floor(), x1.ceil().max(x0.floor() + 1.0));
    let (y0, y1) = (y0, if y1 > y0 { y1 } else { y0 + 1.0 });
    let px = |x: f64| ml + (lx(x) - x0) / (x1 - x0) * (w - ml - mr);
    let py = |y: f64| h - mb - (ly(y) - y0) / (y1 - y0) * (h - mt - mb);
    let mut s = format!("<svg xmlns='http://www.w3.org/2000/svg' width='{w}' height='{h}' font-family='sans-serif' font-size='11'>\n<rect width='100%' height='100%' fill='white'/>\n");
    let _ = writeln!(s, "<text x='{}' y='20' font-size='14'>{title}</text>", ml);
    let _ = writeln!(
        s,
        "<line x1='{ml}' y1='{}' x2='{}' y2='{}' stroke='black'/>",
        h - mb,
        w - mr,
        h - mb
    );
    let _ = writeln!(
        s,
        "<line x1='{ml}' y1='{mt}' x2='{ml}' y2='{}' stroke='black'/>",
        h - mb
    );
    for e in (x0 as i32)..=(x1 as i32) {
        let x = ml + (f64::from(e) - x0) / (x1 - x0) * (w - ml - mr);
        let _ = writeln!(s, "<line x1='{x}' y1='{mt}' x2='{x}' y2='{}' stroke='#ddd'/><text x='{x}' y='{}' text-anchor='middle'>{}</text>", h - mb, h - mb + 15.0, fmt_size(10f64.powi(e) as u64).replace(" B", "B"));
    }
    let _ = writeln!(
        s,
        "<text x='{}' y='{}' text-anchor='middle'>message size (bytes, log)</text>",
        (ml + w - mr) / 2.0,
        h - 12.0
    );
    let steps = if logy { (y1 - y0) as i32 } else { 5 };
    for i in 0..=steps {
        let v = y0 + (y1 - y0) * f64::from(i) / f64::from(steps.max(1));
        let y = h - mb - (v - y0) / (y1 - y0) * (h - mt - mb);
        let label = if logy {
            format!("{:.0e}", 10f64.powf(v))
        } else {
            format!("{v:.0}")
        };
        let _ = writeln!(s, "<line x1='{ml}' y1='{y}' x2='{}' y2='{y}' stroke='#eee'/><text x='{}' y='{}' text-anchor='end'>{label}</text>", w - mr, ml - 5.0, y + 4.0);
    }
    let _ = writeln!(
        s,
        "<text x='15' y='{}' transform='rotate(-90 15 {})' text-anchor='middle'>{ylabel}</text>",
        (mt + h - mb) / 2.0,
        (mt + h - mb) / 2.0
    );
    let colors = [
        "#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
        "#bcbd22", "#17becf", "#000000", "#aec7e8",
    ];
    for (i, (name, ps)) in series.iter().enumerate() {
        let c = colors[i % colors.len()];
        let ps: Vec<&(f64, f64)> = ps
            .iter()
            .filter(|p| p.0 > 0.0 && (!logy || p.1 > 0.0))
            .collect();
        if ps.is_empty() {
            continue;
        }
        let path: Vec<String> = ps
            .iter()
            .map(|p| format!("{:.1},{:.1}", px(p.0), py(p.1)))
            .collect();
        let _ = writeln!(
            s,
            "<polyline fill='none' stroke='{c}' stroke-width='2' points='{}'/>",
            path.join(" ")
        );
        for p in &ps {
            let _ = writeln!(
                s,
                "<circle cx='{:.1}' cy='{:.1}' r='3' fill='{c}'/>",
                px(p.0),
                py(p.1)
            );
        }
        let ly = mt + 10.0 + i as f64 * 16.0;
        let _ = writeln!(s, "<line x1='{}' y1='{ly}' x2='{}' y2='{ly}' stroke='{c}' stroke-width='3'/><text x='{}' y='{}'>{name}</text>", w - mr + 10.0, w - mr + 30.0, w - mr + 35.0, ly + 4.0);
    }
    s.push_str("</svg>\n");
    s
}

/// Series of `metric` against size, one per (tool, variant) at the largest depth measured.
fn series(
    sum: &BTreeMap<Key, (f64, f64, f64, usize)>,
    metric: &str,
    scale: f64,
) -> Vec<(String, Vec<(f64, f64)>)> {
    let mut by: BTreeMap<String, BTreeMap<u64, (usize, f64)>> = BTreeMap::new();
    for ((tool, variant, size, depth, m), v) in sum {
        if m != metric || tool.ends_with("-ping") || tool == "exs-wait" || tool == "exs-exposure" {
            continue;
        }
        let e = by
            .entry(format!("{tool} {variant}"))
            .or_default()
            .entry(*size)
            .or_insert((0, 0.0));
        if *depth >= e.0 {
            *e = (*depth, v.0 * scale);
        }
    }
    by.into_iter()
        .map(|(k, pts)| {
            (
                k,
                pts.into_iter().map(|(s, (_, v))| (s as f64, v)).collect(),
            )
        })
        .collect()
}

fn get(
    sum: &BTreeMap<Key, (f64, f64, f64, usize)>,
    tool: &str,
    variant: &str,
    size: u64,
    metric: &str,
) -> Option<(f64, f64, f64)> {
    sum.iter()
        .filter(|(k, _)| k.0 == tool && k.1 == variant && k.2 == size && k.4 == metric)
        .max_by_key(|(k, _)| k.3)
        .map(|(_, v)| (v.0, v.1, v.2))
}

fn cell(v: Option<(f64, f64, f64)>, scale: f64, digits: usize) -> String {
    match v {
        Some((m, lo, hi)) => format!(
            "{:.*} ({:.*}-{:.*})",
            digits,
            m * scale,
            digits,
            lo * scale,
            digits,
            hi * scale
        ),
        None => "-".into(),
    }
}

/// The markdown report of one suite: tables, then the targets with their ratios.
fn markdown(
    suite: &str,
    sum: &BTreeMap<Key, (f64, f64, f64, usize)>,
    cmd: &str,
    machine: &str,
    files: &[String],
) -> String {
    let mut s = String::new();
    let _ = writeln!(s, "#### {suite}\n\n`{cmd}` on {machine}. Median (min-max) of the repeats; throughput in MB/s (10^6 bytes/s), CPU as % of one core (user+system over wall), at the largest depth measured.\n");
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
    let costs: Vec<&Key> = sum
        .keys()
        .filter(|k| k.0 == "cost" && k.4 == "syscalls_per_rt")
        .collect();
    if !costs.is_empty() {
        let _ = writeln!(s, "\nPer round trip, 8-byte ping-pong, both processes (`perf stat -e raw_syscalls:sys_enter,context-switches`; the difference between a run of N and of 3N round trips, so process start-up is not counted), and one-way latency in µs (fi_pingpong reports a mean only):\n\n| test | syscalls | context switches | mean µs | median µs |\n|---|---|---|---|---|");
        for k in costs {
            let g = |m: &str, d: usize| {
                get(sum, "cost", &k.1, 8, m).map_or("-".into(), |v| format!("{:.*}", d, v.0))
            };
            let _ = writeln!(
                s,
                "| {} | {} | {} | {} | {} |",
                k.1,
                g("syscalls_per_rt", 1),
                g("cs_per_rt", 2),
                g("mean_us", 2),
                g("median_us", 2)
            );
        }
    }
    let lat: Vec<&Key> = sum
        .keys()
        .filter(|k| k.4 == "mean_us" && k.0 != "cost")
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

fn ratio_line(
    name: &str,
    a: Option<f64>,
    b: Option<f64>,
    ok: impl Fn(f64) -> bool,
    want: &str,
) -> String {
    match (a, b) {
        (Some(a), Some(b)) if b > 0.0 && a.is_finite() && b.is_finite() => {
            let r = a / b;
            format!(
                "{name}: {r:.2}x (target {want}) - {}",
                if ok(r) { "met" } else { "missed" }
            )
        }
        _ => format!("{name}: not measured in this run"),
    }
}

fn targets(suite: &str, sum: &BTreeMap<Key, (f64, f64, f64, usize)>) -> Vec<String> {
    let bw = |t: &str, v: &str, z: u64| get(sum, t, v, z, "bytes_per_sec").map(|x| x.0);
    let lat = |t: &str, v: &str| get(sum, t, v, 8, "mean_us").map(|x| x.0);
    let mib = 1 << 20;
    let mut v = Vec::new();
    if suite == "host" {
        let cost = |v: &str, m: &str| get(sum, "cost", v, 8, m).map(|x| x.0);
        v.push(ratio_line(
            "exs busy ping syscalls per round trip vs fi_pingpong",
            cost("exs busy", "syscalls_per_rt"),
            cost("fi_pingpong", "syscalls_per_rt"),
            |r| r <= 1.5,
            "<= 1.5x",
        ));
        v.push(ratio_line(
            "exs busy ping mean one-way vs fi_pingpong (a mean: it reports no median)",
            cost("exs busy", "mean_us"),
            cost("fi_pingpong", "mean_us"),
            |r| r <= 1.5,
            "<= 1.5x",
        ));
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
                |r| r >= 1.5,
                ">= 1.5x",
            ));
        }
        v.push(ratio_line(
            "exs immediate one-way latency vs ib_send_lat, 8 B",
            lat("exs-ping", "immediate"),
            lat("perftest", "ib_send_lat"),
            |r| r <= 1.5,
            "<= 1.5x",
        ));
        v.push(ratio_line(
            "exs persistent read vs ib_read_lat, 8 B",
            lat("exs-ping", "persistent"),
            lat("perftest", "ib_read_lat"),
            |r| r <= 1.3,
            "<= 1.3x",
        ));
    }
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

/// `quick` runs go to files of their own (`-quick`), so that they never replace a full run's.
fn write_results(
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
    let stem = format!("{date}-{suite}{}", if quick { "-quick" } else { "" });
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
    // The README includes the tables (links made relative to the repository root).
    Ok(md.replace("](", "](bench/results/"))
}

fn machine() -> String {
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

/// The README shows full runs; a quick run's table is printed.
fn publish(suite: &str, quick: bool, md: &str) -> Result<()> {
    if quick {
        println!("{md}");
        Ok(())
    } else {
        update_readme(suite, md)
    }
}

/// Replaces the README's generated section for `suite`.
fn update_readme(suite: &str, md: &str) -> Result<()> {
    let path = sys::root().join("README.md");
    let text = std::fs::read_to_string(&path).map_err(|e| e.to_string())?;
    let (start, end) = (
        format!("<!-- bench:{suite}:start -->"),
        format!("<!-- bench:{suite}:end -->"),
    );
    let (Some(a), Some(b)) = (text.find(&start), text.find(&end)) else {
        eprintln!("xtask: README has no {start} marker; not updated");
        return Ok(());
    };
    let new = format!("{}{start}\n{md}\n{}", &text[..a], &text[b..]);
    std::fs::write(&path, new).map_err(|e| e.to_string())
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
    // fi_pingpong (libfabric's own ping-pong) and perf (per-round-trip counts) for the cost table.
    sys::ensure_packages(&["libfabric-bin", "linux-perf"])?;
    sys::run(sys::cargo().args(["build", "--release", "-p", "exs-tools", "-p", "xtask"]))?;
    let exe = sys::root().join("target/release/exs");
    let exe = exe.to_string_lossy();
    let p = plan(a.quick);
    let repeats = a.repeats.unwrap_or(if a.quick { 2 } else { 3 });
    let cmd = format!("cargo xtask bench{}", if a.quick { " --quick" } else { "" });
    let machine = machine();
    let want = |s: &str| a.suite.as_deref().is_none_or(|w| w == s);
    if want("host") {
        let jobs = host_jobs(&exe, &p);
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
        let jobs = softroce_jobs(&exe, &p, a.quick);
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
        let body = format!(
            "ip link set lo up\n{} rxe up >&2 || exit 90\n{}",
            xtask.display(),
            script(&jobs, repeats, p.timeout.max(90))
        );
        let native = sys::is_root()
            && exs_backend_softroce::kernel_supports(exs_backend_softroce::Kind::Rxe).is_ok();
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
            sys::ensure_packages(&["perftest", "rdmacm-utils"])?;
            let v = vm::Vm::prepare()?;
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
            (out, format!("{machine}, rxe in a QEMU guest ({:?}, 2 vCPUs, emulated CPU: compare ratios only)", v.accel))
        };
        let rows = collect("softroce", &jobs, &out);
        let md = write_results("softroce", a.quick, &rows, &cmd, &where_)?;
        publish("softroce", a.quick, &md)?;
    }
    eprintln!("xtask: bench took {:.0?}", started.elapsed());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_perftest_and_rstream_output() {
        let j = job(
            "perftest",
            "ib_write_bw",
            65536,
            1,
            String::new(),
            Parse::PerftestBw,
        );
        let out = " #bytes     #iterations    BW peak[MB/sec]    BW average[MB/sec]   MsgRate[Mpps]\n 65536      1000             40.10              38.20  0.000611\n";
        let rows = parse("s", &j, 0, out);
        assert_eq!(rows.len(), 1);
        assert!((rows[0].value - 38.20e6 * 1.048576).abs() < 1.0);
        let j = job(
            "perftest",
            "ib_send_lat",
            8,
            1,
            String::new(),
            Parse::PerftestLat,
        );
        let out = " #bytes #iterations    t_min[usec]    t_max[usec]  t_typical[usec]    t_avg[usec]    t_stdev[usec]   99% percentile[usec]   99.9% percentile[usec] \n 8       1000          9.10           80.00        12.50              13.10          2.00            20.00                  70.00\n";
        let rows = parse("s", &j, 0, out);
        assert_eq!(
            rows.iter()
                .map(|r| (r.metric.as_str(), r.value))
                .collect::<Vec<_>>(),
            [("median_us", 12.5), ("mean_us", 13.1)]
        );
        let j = job(
            "rstream",
            "rstream",
            65536,
            1,
            String::new(),
            Parse::Rstream,
        );
        let out = "name      bytes   xfers   iters   total       time     Gb/sec    usec/xfer\n64k_bw   64k     1000    1       125m        1.23s    0.85     616.31\n";
        let rows = parse("s", &j, 0, out);
        assert!((rows[0].value - 0.85e9 / 8.0).abs() < 1.0);
    }

    #[test]
    fn parses_perf_stat_counts_per_round_trip_and_fi_pingpong() {
        let j = job(
            "cost",
            "fi_pingpong",
            8,
            1,
            String::new(),
            Parse::PerfPing(10000, 30000),
        );
        let out =
            "bytes   #sent   #ack     total       time     MB/sec    usec/xfer   Mxfers/sec\n\
                   8       30k     =30k     468k        0.25s      1.94       4.13       0.24\n\
                   @@short\n# started on Mon Nov 23\n\n\
                   230000,,raw_syscalls:sys_enter,313616920,100.00,,\n\
                   1826,,context-switches,313616920,100.00,,\n\
                   @@long\n\
                   630000,,raw_syscalls:sys_enter,313616920,100.00,,\n\
                   2826,,context-switches,313616920,100.00,,\n";
        let rows = parse("host", &j, 0, out);
        let get = |m: &str| rows.iter().find(|r| r.metric == m).map(|r| r.value);
        assert_eq!(get("mean_us"), Some(4.13));
        assert_eq!(get("syscalls_per_rt"), Some(20.0));
        assert_eq!(get("cs_per_rt"), Some(0.05));
        let j = job(
            "cost",
            "exs busy",
            8,
            1,
            String::new(),
            Parse::PerfPing(100, 300),
        );
        let out = "@@short\n1000,,raw_syscalls:sys_enter,1,100.00,,\n@@long\n{\"median_us\": 9.5, \"mean_us\": 10.0}\n3000,,raw_syscalls:sys_enter,1,100.00,,\n";
        let rows = parse("host", &j, 0, out);
        assert_eq!(rows.len(), 3, "{rows:?}");
        assert_eq!(get_metric(&rows, "syscalls_per_rt"), Some(10.0));
    }

    fn get_metric(rows: &[Row], m: &str) -> Option<f64> {
        rows.iter().find(|r| r.metric == m).map(|r| r.value)
    }

    #[test]
    fn collects_jobs_by_marker_and_takes_medians() {
        let jobs = vec![job("exs", "seqpacket", 4096, 8, String::new(), Parse::Json)];
        let out = "@@job 0 0\n{\"bytes_per_sec\": 10.0}\n@@job 0 1\n{\"bytes_per_sec\": 30.0}\n@@job 0 2\n{\"bytes_per_sec\": 20.0}\n";
        let rows = collect("host", &jobs, out);
        assert_eq!(rows.len(), 3);
        let s = summarize(&rows);
        let v = s.values().next().unwrap();
        assert_eq!((v.0, v.1, v.2, v.3), (20.0, 10.0, 30.0, 3));
    }

    #[test]
    fn svg_plot_is_well_formed() {
        let s = svg(
            "t",
            "y",
            &[("a".into(), vec![(64.0, 10.0), (65536.0, 1000.0)])],
            true,
        );
        assert!(
            s.starts_with("<svg") && s.trim_end().ends_with("</svg>") && s.contains("polyline")
        );
    }
}

//! Idle connections beside a ping-pong: what one round trip costs, and what each idle connection holds, with 0 to
//! 10,000 idle connections on the same contexts (`exs ping --idle N`). A server holds many connections and few are
//! busy: the cost of an operation must not grow with the rest.

use super::*;

/// What the idle rows measure besides latency (the tool's JSON names).
pub(super) const IDLE_METRICS: [&str; 6] = [
    "idle_open_secs",
    "idle_close_secs",
    "client_idle_engine_bytes_per_conn",
    "client_idle_rss_bytes_per_conn",
    "server_idle_engine_bytes_per_conn",
    "server_idle_rss_bytes_per_conn",
];

/// Descriptors one connection holds on libfabric tcp with `FI_WAIT_POLLFD` queues, the default (the socket and
/// its completion queue's two signal pairs; the tool's own count is `FDS_PER_CONN` in `tools/exs/src/idle.rs`):
/// counting four, the largest row asked for more connections than the descriptor limit holds, and failed.
const FDS_PER_CONN: u64 = 5;

/// The most idle connections each side's process can hold on libfabric tcp here: 10,000, or fewer when the
/// descriptor limit (which an unprivileged process, or a container without CAP_SYS_RESOURCE, cannot raise) is
/// lower, in thousands.
pub(super) fn fabric_max_idle() -> usize {
    // "Max open files  <soft>  <hard>  files" in /proc/self/limits.
    let hard = std::fs::read_to_string("/proc/self/limits")
        .ok()
        .and_then(|l| {
            l.lines()
                .find(|l| l.starts_with("Max open files"))
                .and_then(|l| l.split_whitespace().nth(4).map(str::to_string))
        })
        .and_then(|h| h.parse::<u64>().ok())
        .unwrap_or(1024);
    let fit = hard.saturating_sub(1024) / FDS_PER_CONN;
    ((fit.min(10_000) / 1000) * 1000).max(100) as usize
}

/// Blocking 8-byte ping-pongs beside `counts` idle connections on `backend` (label `name`), counted by `perf
/// stat` when `perf` (the host) or timed only (the guest).
pub(super) fn idle_jobs(
    exe: &str,
    name: &str,
    backend: &str,
    counts: &[usize],
    perf: bool,
) -> Vec<Job> {
    // Opening and closing thousands of connections costs more system calls than the whole ping-pong, and how
    // many varies from run to run by more than the ping-pong makes: perf counts only the ping-pong
    // (`perf_twice_windowed`), and the two runs' difference is that of their round trips.
    let (short, long) = (5_000, 25_000);
    let exs_rts = |n: usize| n + n / 10 + 1;
    counts
        .iter()
        .map(|&idle| {
            let cmd = |n: usize| {
                format!("{exe} ping {backend} --mode immediate --size 8 --count {n} --wait block --idle {idle} --json")
            };
            if perf {
                job(
                    "idle",
                    name,
                    idle as u64,
                    1,
                    perf_twice_windowed(cmd, short, long),
                    Parse::PerfPing(exs_rts(short), exs_rts(long)),
                )
            } else {
                job("idle", name, idle as u64, 1, cmd(long), Parse::Json)
            }
        })
        .collect()
}

/// The table of the idle rows, one per backend and count, and each backend's largest count against none.
pub(super) fn idle_table(s: &mut String, sum: &BTreeMap<Key, (f64, f64, f64, usize)>) {
    let mut keys: Vec<(String, u64)> = sum
        .keys()
        .filter(|k| k.0 == "idle" && k.4 == "median_us")
        .map(|k| (k.1.clone(), k.2))
        .collect();
    if keys.is_empty() {
        return;
    }
    keys.sort();
    keys.dedup();
    let _ = writeln!(s, "\nIdle connections beside a blocking 8-byte ping-pong (`exs ping --idle N --wait block`): per round trip, both processes (`perf stat`, where it runs), median one-way µs, the seconds to open and to close the idle connections, and what each idle connection holds: device-visible memory the engine allocated (`connection_bytes`) and resident memory of the process (which includes the provider's own), client / server:\n\n| backend | idle | syscalls | context switches | median µs | open s | close s | engine bytes | resident bytes |\n|---|---|---|---|---|---|---|---|---|");
    for (b, n) in &keys {
        let g = |m: &str, d: usize| {
            get(sum, "idle", b, *n, m).map_or("-".into(), |v| format!("{:.*}", d, v.0))
        };
        let pair = |side: &str| {
            format!(
                "{} / {}",
                g(&format!("client_idle_{side}_bytes_per_conn"), 0),
                g(&format!("server_idle_{side}_bytes_per_conn"), 0)
            )
        };
        let (mem, rss) = if *n == 0 {
            ("-".to_string(), "-".to_string())
        } else {
            (pair("engine"), pair("rss"))
        };
        let _ = writeln!(
            s,
            "| {b} | {n} | {} | {} | {} | {} | {} | {mem} | {rss} |",
            g("syscalls_per_rt", 1),
            g("cs_per_rt", 2),
            g("median_us", 1),
            g("idle_open_secs", 2),
            g("idle_close_secs", 2),
        );
    }
}

/// Targets: with the most idle connections measured, within 1.1x of none (system calls where counted, and the
/// median one-way time).
pub(super) fn idle_targets(sum: &BTreeMap<Key, (f64, f64, f64, usize)>) -> Vec<String> {
    let mut backends: Vec<String> = sum
        .keys()
        .filter(|k| k.0 == "idle")
        .map(|k| k.1.clone())
        .collect();
    backends.dedup();
    let mut v = Vec::new();
    for b in backends {
        let Some(most) = sum
            .keys()
            .filter(|k| k.0 == "idle" && k.1 == b && k.4 == "median_us")
            .map(|k| k.2)
            .max()
        else {
            continue;
        };
        for (m, what) in [
            ("syscalls_per_rt", "system calls per round trip"),
            ("median_us", "median one-way"),
        ] {
            if get(sum, "idle", &b, 0, m).is_none() {
                continue;
            }
            v.push(ratio_line(
                &format!("{b}: {what} with {most} idle connections vs none"),
                get(sum, "idle", &b, most, m).map(|x| x.0),
                get(sum, "idle", &b, 0, m).map(|x| x.0),
                |r| r <= 1.1,
                "<= 1.1x",
            ));
        }
    }
    v
}

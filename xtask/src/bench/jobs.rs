//! The jobs of each suite: exs, its raw baselines and the peers, as shell command lines.

use super::*;

/// The exs tool invocations of a suite (`backend` are the backend flags).
pub(super) fn exs_jobs(exe: &str, backend: &str, p: &Plan, wait_modes: bool) -> Vec<Job> {
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
        // The stream pump twice as deep as the default advert credits (16): receives posted past the credits go
        // unadvertised, and a sender that went through the stream buffer for one of them stayed there.
        v.push(job(
            "exs-deep",
            "stream",
            1 << 20,
            32,
            format!("{exe} pump {backend} --type stream --mode normal --size {} --depth 32 --seconds {secs} --json", 1 << 20),
            Parse::Json,
        ));
        // The transport's own write loop as deep: twice the memory in flight costs it too (caches), which the
        // stream's ratio above includes.
        v.push(job(
            "raw-deep",
            "write",
            1 << 20,
            32,
            format!(
                "{exe} rawpump {backend} --op write --size {} --depth 32 --seconds {secs} --json",
                1 << 20
            ),
            Parse::Json,
        ));
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

/// Issue 30: the C example `ping_pong` (through libexs, `exs ping`'s defaults: immediate 8-byte messages, busy
/// polling, a forked server) beside `exs ping --mode immediate`; `env` names the backend, `addr` where to listen.
pub(super) fn c_ping_job(c_bin: &str, env: &str, addr: &str, p: &Plan) -> Job {
    job(
        "exs-c-ping",
        "immediate",
        8,
        1,
        format!("env {env} {c_bin}/ping_pong -n {} -s 8 -j {addr}", p.pings),
        Parse::Json,
    )
}

pub(super) fn host_jobs(exe: &str, c_bin: &str, p: &Plan) -> Vec<Job> {
    let mut v = exs_jobs(
        exe,
        "--backend fabric --provider tcp --addr 127.0.0.1",
        p,
        true,
    );
    v.push(c_ping_job(
        c_bin,
        "EXS_BACKEND=fabric EXS_PROVIDER=tcp",
        "127.0.0.1",
        p,
    ));
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
    // Issue 25: idle connections beside a ping-pong, on the simulator and on libfabric tcp.
    let (sim, fabric): (Vec<usize>, Vec<usize>) = if p.quick {
        (vec![0, 1000], vec![0, 1000])
    } else {
        (
            vec![0, 100, 1000, 10_000],
            vec![0, 100, 1000, fabric_max_idle()],
        )
    };
    v.extend(idle_jobs(exe, "sim", "--backend sim", &sim, true));
    v.extend(idle_jobs(
        exe,
        "fabric tcp",
        "--backend fabric --provider tcp --addr 127.0.0.1",
        &fabric,
        true,
    ));
    // Issue 26's pump targets: each pair runs side by side PAIRED_RUNS times a round.
    let mib = 1 << 20;
    let pairs = [
        (("exs", "stream", 64), ("tcp", "nodelay", 64)),
        (("exs", "stream", 4096), ("tcp", "nodelay", 4096)),
        (("exs", "stream", 65536), ("raw", "write", 65536)),
        (("exs", "stream", mib), ("raw", "write", mib)),
        (("exs-deep", "stream", mib), ("exs", "stream", mib)),
    ];
    let extra = pair_up(&v, &pairs, PAIRED_RUNS - 1);
    v.extend(extra);
    v
}

/// Runs a round gives each point of a target pair whose two sides are a few percent apart (the small-message stream
/// against TCP, the stream against the transport's write loop): the machine's speed drifts by tens of percent
/// within minutes, and the issue asks for medians of at least five interleaved runs (two rounds for `--quick`).
pub(super) const PAIRED_RUNS: usize = 3;

/// A point of the plan: tool, variant, size.
pub(super) type Point<'a> = (&'a str, &'a str, u64);

/// `extra` more runs of each pair's two points, one after the other: copies of the jobs already in `jobs` (for a
/// point measured at several depths, the deepest, which the targets read), so that their rows join the same
/// medians. A pair with a point not in `jobs` is left out.
pub(super) fn pair_up(jobs: &[Job], pairs: &[(Point, Point)], extra: usize) -> Vec<Job> {
    let find = |(tool, variant, size): Point| {
        jobs.iter()
            .filter(|j| j.tool == tool && j.variant == variant && j.size == size)
            .max_by_key(|j| j.depth)
    };
    let mut v = Vec::new();
    for &(a, b) in pairs {
        if let (Some(a), Some(b)) = (find(a), find(b)) {
            for _ in 0..extra {
                v.push(a.clone());
                v.push(b.clone());
            }
        }
    }
    v
}

pub(super) fn softroce_jobs(
    exe: &str,
    c_bin: &str,
    stream_bench: &str,
    p: &Plan,
    quick: bool,
) -> Vec<Job> {
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
            quick: true,
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
    // Issue 25: idle connections beside a ping-pong, as many as the guest's memory allows.
    let counts: &[usize] = if quick { &[0, 100] } else { &[0, 100, 400] };
    v.extend(idle_jobs(
        exe,
        "verbs",
        &format!("--backend verbs --addr {addr}"),
        counts,
        false,
    ));
    v.push(c_ping_job(
        c_bin,
        &format!("EXS_BACKEND=verbs EXS_ADDR={addr}"),
        addr,
        p,
    ));
    // perftest and rstream: server in the background, client in front, on the same device.
    let pt = |bin: &str, size: u64, extra: &str| perftest(bin, dev, addr, size, extra);
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
        // Issue 26: `exs::Stream` written as rstream writes, `size` bytes at a time (server and client in one
        // process, two contexts on the device), beside rstream.
        let count = (32u64 << 20).div_ceil(size).clamp(100, 5_000);
        v.push(job(
            "streams",
            "exs-std",
            size,
            1,
            format!(
                "EXS_BACKEND=verbs EXS_ADDR={addr} {stream_bench} bulk exs-std {} {size}",
                count * size
            ),
            Parse::Json,
        ));
        for (variant, t) in [("rstream", ""), ("rstream-tcp", "-T s")] {
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
    // 8-byte round trips while another thread of the client's context registers and deregisters large regions:
    // the device pins and unpins their pages, and the connection must not wait for it.
    v.push(job(
        "streams-register",
        "exs-std",
        REGISTERED,
        1,
        format!("EXS_BACKEND=verbs EXS_ADDR={addr} {stream_bench} register exs-std {REGISTERED} 4"),
        Parse::Json,
    ));
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

/// The size of the regions another thread registers beside a ping-pong in the Soft-RoCE suite.
pub(super) const REGISTERED: u64 = 128 << 20;

/// The same points on soft-iWARP (`exs_siw0`, on its own interface beside `exs_rxe0` in the same guest boot): exs
/// and perftest (through rdma_cm: iWARP has no other way), tools named `siw-...`. Fewer than on rxe: the
/// throughput sizes the targets name, and the latencies.
pub(super) fn siw_jobs(exe: &str, p: &Plan, quick: bool) -> Vec<Job> {
    let (dev, _, addr) = rxe::SIW_DUMMY;
    let plan = Plan {
        sizes: if quick {
            vec![65536]
        } else {
            vec![65536, 1 << 20]
        },
        depths: vec![8],
        seconds: p.seconds.min(1.0),
        pings: p.pings.min(1000),
        timeout: p.timeout,
        quick,
    };
    let mut v: Vec<Job> = exs_jobs(exe, &format!("--backend verbs --addr {addr}"), &plan, false)
        .into_iter()
        .filter(|j| j.tool == "exs" || (j.tool == "exs-ping" && j.variant != "normal"))
        .collect();
    let pt = |bin: &str, size: u64, extra: &str| perftest(bin, dev, addr, size, extra);
    for &size in &plan.sizes {
        let iters = (32u64 << 20).div_ceil(size).clamp(100, 5_000);
        v.push(job(
            "perftest",
            "ib_write_bw",
            size,
            8,
            pt("ib_write_bw", size, &format!("-n {iters} -t 8")),
            Parse::PerftestBw,
        ));
        v.push(job(
            "perftest",
            "ib_read_bw",
            size,
            8,
            pt("ib_read_bw", size, &format!("-n {iters} -o 8")),
            Parse::PerftestBw,
        ));
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
    for j in &mut v {
        j.tool = format!("siw-{}", j.tool);
    }
    v
}

/// Where `perf stat` writes its counts for a cost job (read back by the same job's script).
pub(super) const PERF_OUT: &str = "/tmp/exs-bench-perf";

/// Runs a ping-pong twice under `perf stat` (system calls and context switches of it and its children): once
/// with `short` round trips (its output dropped), once with `long`. The difference of the two counts is the cost
/// of the extra round trips alone, without process start-up (libfabric's initialisation alone makes ~10,000 calls
/// per process). `cmd(n)` is the command for `n` round trips.
pub(super) fn perf_twice(cmd: impl Fn(usize) -> String, short: usize, long: usize) -> String {
    perf_pair("", "", cmd, short, long)
}

/// As [`perf_twice`], counting only what the program measures: perf starts with its events off and `exs ping`
/// turns them on and off around its ping-pong through perf's control fifo (`EXS_PERF_CONTROL`), for runs whose
/// set-up and tear-down (thousands of idle connections) cost more, and vary more from run to run, than the
/// ping-pong itself.
pub(super) fn perf_twice_windowed(
    cmd: impl Fn(usize) -> String,
    short: usize,
    long: usize,
) -> String {
    let ctl = format!("{PERF_OUT}.ctl");
    let pair = perf_pair(
        &format!("-D -1 --control fifo:{ctl}"),
        &format!("env EXS_PERF_CONTROL={ctl} "),
        cmd,
        short,
        long,
    );
    format!("rm -f {ctl}; mkfifo {ctl}; {pair}; rm -f {ctl}")
}

/// The two `perf stat` runs of [`perf_twice`], with extra perf options and a prefix to the command.
fn perf_pair(
    perf_opts: &str,
    prefix: &str,
    cmd: impl Fn(usize) -> String,
    short: usize,
    long: usize,
) -> String {
    let stat = format!("perf stat -x, -e raw_syscalls:sys_enter,context-switches {perf_opts}");
    format!(
        "{stat} -o {PERF_OUT}.short -- {prefix}{} >/dev/null 2>&1; {stat} -o {PERF_OUT}.long -- {prefix}{}; \
         echo @@short; cat {PERF_OUT}.short; echo @@long; cat {PERF_OUT}.long; rm -f {PERF_OUT}.short {PERF_OUT}.long",
        cmd(short),
        cmd(long)
    )
}

/// libfabric's own 8-byte ping-pong, `n` round trips (busy polling), its server given `settle` seconds to start.
fn fi_pingpong_cmd(n: usize, settle: u32) -> String {
    format!(
        "sh -c 'fi_pingpong -p tcp -e msg -I {n} -S 8 >/dev/null 2>&1 & sleep {settle}; \
         fi_pingpong -p tcp -e msg -I {n} -S 8 127.0.0.1; wait'"
    )
}

/// `exs ping` of `n` immediate 8-byte round trips on libfabric tcp, waiting as `wait` says (`extra`: more flags).
fn exs_ping_cmd(exe: &str, wait: &str, extra: &str, n: usize) -> String {
    format!(
        "{exe} ping --backend fabric --provider tcp --addr 127.0.0.1 --mode immediate --size 8 --count {n} --wait {wait}{extra} --json"
    )
}

/// The transport's own ping-pong (`exs rawping`), `n` 8-byte round trips on libfabric tcp.
fn rawping_cmd(exe: &str, wait: &str, n: usize) -> String {
    format!(
        "{exe} rawping --backend fabric --provider tcp --addr 127.0.0.1 --size 8 --count {n} --wait {wait} --json"
    )
}

/// Round trips `exs ping` makes for `n` asked: it counts its warm-up (a tenth more, plus one) too.
fn exs_ping_rts(n: usize) -> usize {
    n + n / 10 + 1
}

/// Round trips `exs rawping` and `exs tcpping` make for `n` asked: they warm up with a tenth more.
fn warmed_rts(n: usize) -> usize {
    n + n / 10
}

/// A row of the per-round-trip cost table: an 8-byte ping-pong `name` run by `script`, read as `parse` says.
fn cost_job(name: &str, script: String, parse: Parse) -> Job {
    job("cost", name, 8, 1, script, parse)
}

/// Per-message cost on the host (issue 12): the same 8-byte ping-pong through libfabric's own `fi_pingpong`
/// (busy polling), exs immediate pings in each wait mode, the bare transport's ping-pong (`exs rawping`, busy and
/// blocking), and blocking TCP, each counted by `perf stat`; then the instructions of some of them.
pub(super) fn cost_jobs(exe: &str) -> Vec<Job> {
    // Enough round trips that the difference is steady, in quick runs too, and few enough for a short run.
    let (short, long) = (10_000, 30_000);
    let counted = |name: &str, cmd: &dyn Fn(usize) -> String, rts: fn(usize) -> usize| {
        cost_job(
            name,
            perf_twice(cmd, short, long),
            Parse::PerfPing(rts(short), rts(long)),
        )
    };
    let mut v = vec![counted("fi_pingpong", &|n| fi_pingpong_cmd(n, 1), |n| n)];
    // `busy` on the default wait object (FI_WAIT_POLLFD); `busy fd`: on FI_WAIT_FD queues (the provider's epoll set
    // nested in the transport's); `busy nowait`: on queues without a wait object, as fi_pingpong opens its own.
    for (name, wait, extra) in [
        ("busy", "busy", ""),
        ("busy fd", "busy", " --cq-wait fd"),
        ("busy nowait", "busy", " --cq-no-wait"),
        ("adaptive", "adaptive", ""),
        ("block", "block", ""),
    ] {
        v.push(counted(
            &format!("exs {name}"),
            &|n| exs_ping_cmd(exe, wait, extra, n),
            exs_ping_rts,
        ));
    }
    // The transport's own ping-pong, no exs protocol: what a round trip costs libfabric tcp itself.
    for wait in ["busy", "block"] {
        v.push(counted(
            &format!("raw {wait}"),
            &|n| rawping_cmd(exe, wait, n),
            warmed_rts,
        ));
    }
    v.push(counted(
        "tcp nodelay",
        &|n| format!("{exe} tcpping --size 8 --count {n} --nodelay --json"),
        warmed_rts,
    ));
    v.extend(instruction_jobs(exe));
    v
}

/// User-space instructions per round trip of the same ping-pongs (callgrind, every process of the run): what each
/// round trip costs in instructions, which the machine's load does not move, and which an emulated CPU (the
/// Soft-RoCE guest) pays many times over. Deterministic, so a few hundred round trips are enough.
fn instruction_jobs(exe: &str) -> Vec<Job> {
    let (short, long) = (500, 2_000);
    let counted = |name: &str, cmd: &dyn Fn(usize) -> String, rts: fn(usize) -> usize| {
        cost_job(
            name,
            callgrind_twice(cmd, short, long),
            Parse::Instructions(rts(short), rts(long)),
        )
    };
    vec![
        // Its server starts slower under valgrind.
        counted("fi_pingpong", &|n| fi_pingpong_cmd(n, 2), |n| n),
        counted(
            "exs busy",
            &|n| exs_ping_cmd(exe, "busy", "", n),
            exs_ping_rts,
        ),
        counted(
            "exs block",
            &|n| exs_ping_cmd(exe, "block", "", n),
            exs_ping_rts,
        ),
        counted("raw block", &|n| rawping_cmd(exe, "block", n), warmed_rts),
    ]
}

/// Two runs of a command under callgrind, a short and a long one, each process's total after `@@short` and
/// `@@long` (see [`Parse::Instructions`]).
fn callgrind_twice(cmd: impl Fn(usize) -> String, short: usize, long: usize) -> String {
    let log = format!("{PERF_OUT}.cg");
    let vg = format!(
        "valgrind --tool=callgrind --trace-children=yes --callgrind-out-file=/dev/null --log-file={log}.%p"
    );
    format!(
        "rm -f {log}.*; {vg} {} >/dev/null 2>&1; echo @@short; cat {log}.*; rm -f {log}.*; \
         {vg} {} >/dev/null 2>&1; echo @@long; cat {log}.*; rm -f {log}.*",
        cmd(short),
        cmd(long)
    )
}

pub(super) fn retry(client: &str) -> String {
    format!("for i in 1 2 3 4 5; do sleep 1; {client} && break; done; wait")
}

/// A perftest run over rdma_cm (`-R`) on device `dev`: the server in the background, the client in front. A
/// server whose client was refused or crashed (a connection request that came before it listened, rejected)
/// serves no second one, so each of up to five tries starts a server of its own.
pub(super) fn perftest(bin: &str, dev: &str, addr: &str, size: u64, extra: &str) -> String {
    let args = format!("-R -d {dev} -F -s {size} {extra}");
    format!(
        "for i in 1 2 3 4 5; do {bin} {args} >/dev/null 2>&1 & sleep 1; {bin} {args} {addr} && break; \
         pkill -x {bin}; wait; done; wait"
    )
}

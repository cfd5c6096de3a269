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
fn parses_callgrind_totals_per_round_trip_over_every_process() {
    let j = job(
        "cost",
        "exs busy",
        8,
        1,
        String::new(),
        Parse::Instructions(551, 2201),
    );
    // Two processes per run (client and server), each with its own total.
    let out = "@@short\n==11== Callgrind, a call-graph generating cache profiler\n==11== Collected : 100000000\n\
               ==12== Collected : 50000000\n@@long\n==13== Collected : 150000000\n==14== Collected : 82500000\n";
    let rows = parse("host", &j, 0, out);
    assert_eq!(rows.len(), 1, "{rows:?}");
    assert_eq!(rows[0].metric, "instr_per_rt");
    assert!((rows[0].value - 50000.0).abs() < 1e-6, "{}", rows[0].value);
    // A run that printed nothing (valgrind missing) measures nothing.
    assert!(parse("host", &j, 0, "@@short\n@@long\n").is_empty());
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
    let out = "bytes   #sent   #ack     total       time     MB/sec    usec/xfer   Mxfers/sec\n\
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

/// Issue 12: the per-message context switches and progress-thread wake-ups `exs pump --json` reports reach the
/// report, summed per side, beside the throughput of the same runs.
#[test]
fn per_message_context_switches_and_wakeups_reach_the_report() {
    let jobs = vec![job("exs", "seqpacket", 4096, 8, String::new(), Parse::Json)];
    let out = "@@job 0 0\n{\"bytes_per_sec\": 1e8, \"client_vcsw_per_msg\": 0.25, \"client_ivcsw_per_msg\": 0.5, \
               \"server_vcsw_per_msg\": 1.0, \"server_ivcsw_per_msg\": 0.125, \"client_progress_wakeups_per_msg\": 0.01, \
               \"server_progress_wakeups_per_msg\": 0.02}\n";
    let rows = collect("host", &jobs, out);
    assert_eq!(get_metric(&rows, "client_cs_per_msg"), Some(0.75));
    assert_eq!(get_metric(&rows, "server_cs_per_msg"), Some(1.125));
    assert_eq!(get_metric(&rows, "server_wakeups_per_msg"), Some(0.02));
    let md = markdown("host", &summarize(&rows), "cmd", "m", &[]);
    assert!(
        md.contains("| 4 KiB | 0.750 / 1.125 cs, 0.0100 / 0.0200 wake-ups |"),
        "{md}"
    );
}

#[test]
fn svg_plot_is_well_formed() {
    let s = svg(
        "t",
        "y",
        &[("a".into(), vec![(64.0, 10.0), (65536.0, 1000.0)])],
        true,
    );
    assert!(s.starts_with("<svg") && s.trim_end().ends_with("</svg>") && s.contains("polyline"));
}

#[test]
fn idle_rows_carry_memory_and_times_into_their_table_and_targets() {
    let json = |idle: u64, median: f64| {
        format!(
            "{{\"median_us\":{median},\"mean_us\":{median},\"idle\":{idle},\"idle_open_secs\":0.5,\
             \"idle_close_secs\":0.25,\"client_idle_engine_bytes_per_conn\":52000,\
             \"client_idle_rss_bytes_per_conn\":7000,\"server_idle_engine_bytes_per_conn\":51000,\
             \"server_idle_rss_bytes_per_conn\":6000}}"
        )
    };
    let mut rows = Vec::new();
    for (idle, median, calls) in [(0u64, 40.0, 220_000.0), (1000, 42.0, 240_000.0)] {
        let j = job(
            "idle",
            "fabric tcp",
            idle,
            1,
            String::new(),
            Parse::PerfPing(10, 1010),
        );
        let out = format!(
            "@@short\n100000,,raw_syscalls:sys_enter,1,100.00,,\n1000,,context-switches,1,100.00,,\n\
             @@long\n{calls},,raw_syscalls:sys_enter,1,100.00,,\n3000,,context-switches,1,100.00,,\n{}\n",
            json(idle, median)
        );
        rows.extend(parse("host", &j, 0, &out));
    }
    let sum = summarize(&rows);
    let mut s = String::new();
    idle_table(&mut s, &sum);
    assert!(s.contains("| fabric tcp | 1000 | 140.0 | 2.00 | 42.0 | 0.50 | 0.25 | 52000 / 51000 | 7000 / 6000 |"), "{s}");
    let t = idle_targets(&sum);
    assert!(
        t.iter().any(|l| l
            .contains("system calls per round trip with 1000 idle connections vs none: 1.17x")
            && l.ends_with("missed")),
        "{t:?}"
    );
    assert!(
        t.iter().any(
            |l| l.contains("median one-way with 1000 idle connections vs none: 1.05x")
                && l.ends_with("met")
        ),
        "{t:?}"
    );
}

/// Issue 31: siw beside rxe in the Soft-RoCE suite: its own tools (`siw-...`), perftest through rdma_cm on the siw
/// device, and the targets computed for it from the same run.
#[test]
fn siw_points_run_on_the_siw_device_and_have_targets_of_their_own() {
    let jobs = siw_jobs("exs", &plan(true), true);
    assert!(jobs.iter().all(|j| j.tool.starts_with("siw-")));
    for j in jobs.iter().filter(|j| j.tool == "siw-perftest") {
        assert!(j.cmd.contains("-R -d exs_siw0"), "{}", j.cmd);
    }
    assert!(jobs.iter().any(|j| j.tool == "siw-exs-ping"
        && j.variant == "immediate"
        && j.cmd.contains("192.168.79.1")));
    let mut sum = BTreeMap::new();
    let mut put = |tool: &str, variant: &str, size: u64, metric: &str, v: f64| {
        sum.insert(
            (tool.into(), variant.into(), size, 8, metric.into()),
            (v, v, v, 1),
        );
    };
    put("siw-exs", "seqpacket", 65536, "bytes_per_sec", 45.0);
    put("siw-perftest", "ib_read_bw", 65536, "bytes_per_sec", 50.0);
    put("siw-exs-ping", "immediate", 8, "mean_us", 30.0);
    put("siw-perftest", "ib_send_lat", 8, "mean_us", 20.0);
    let t = targets("softroce", &sum);
    assert!(
        t.contains(
            &"siw: exs seqpacket vs ib_read_bw, 64 KiB: 0.90x (target >= 0.9x) - met".to_string()
        ),
        "{t:?}"
    );
    assert!(t.iter().any(|l| l.starts_with("siw: exs immediate one-way latency vs ib_send_lat, 8 B: 1.50x")), "{t:?}");
}

#[test]
fn a_suite_page_links_into_the_results_and_says_it_is_generated() {
    let page =
        super::report::suite_page("host", "| a |\n![plot](2026-11-22-host-throughput.svg)\n");
    assert!(
        page.starts_with("<!-- Generated by `cargo xtask bench --suite host`"),
        "{page}"
    );
    assert!(
        page.contains("](results/2026-11-22-host-throughput.svg)"),
        "{page}"
    );
    assert!(page.contains("[bench/README.md](README.md)"), "{page}");
}

/// Issue 26: the streams' rows (the stream bench beside TCP, and its request/response beside `exs ping`) reach
/// the targets with their own ratios, and the jobs run the stream bench on libfabric tcp.
#[test]
fn stream_rows_are_compared_with_tcp_and_exs_ping() {
    let jobs = stream_jobs("sb", false);
    assert!(jobs
        .iter()
        .all(|j| j.cmd.starts_with("EXS_BACKEND=fabric EXS_PROVIDER=tcp sb ")));
    assert!(jobs
        .iter()
        .any(|j| j.cmd.ends_with("bulk exs-tokio 268435456")));
    let mut sum = BTreeMap::new();
    let mut put = |tool: &str, variant: &str, size: u64, metric: &str, v: f64| {
        sum.insert(
            (tool.into(), variant.into(), size, 1, metric.into()),
            (v, v, v, 1),
        );
    };
    put("streams", "exs-tokio", 256 << 20, "bytes_per_sec", 95.0);
    put("streams", "tcp-tokio", 256 << 20, "bytes_per_sec", 100.0);
    put("streams", "exs-std", 256 << 20, "bytes_per_sec", 50.0);
    put("streams", "tcp-std", 256 << 20, "bytes_per_sec", 100.0);
    put("streams-rr", "exs-std", 8, "mean_us", 33.0);
    put("cost", "exs adaptive", 8, "mean_us", 30.0);
    let t = stream_targets(&sum);
    assert!(
        t.contains(
            &"exs::tokio::Stream one way vs tokio::net::TcpStream: 0.95x (target >= 0.9x) - met"
                .to_string()
        ),
        "{t:?}"
    );
    assert!(
        t.contains(
            &"exs::Stream one way vs std::net::TcpStream: 0.50x (target >= 0.9x) - missed"
                .to_string()
        ),
        "{t:?}"
    );
    assert!(
        t.iter()
            .any(|l| l.contains("request/response") && l.contains("1.10x") && l.ends_with("met")),
        "{t:?}"
    );
    assert!(
        t.iter()
            .any(|l| l.starts_with("hyper 64 MiB GET") && l.ends_with("not measured in this run")),
        "{t:?}"
    );
}

/// Issue 26: on Soft-RoCE, `exs::Stream` written a row's size at a time (as rstream writes) runs on the device in the
/// guest and is compared with rstream.
#[test]
fn the_soft_roce_stream_row_writes_as_rstream_does_and_is_compared_with_it() {
    let jobs = softroce_jobs("exs", "c", "sb", &plan(true), true);
    let (_, _, addr) = rxe::DUMMY;
    let j = jobs
        .iter()
        .find(|j| j.tool == "streams" && j.variant == "exs-std")
        .expect("a stream row");
    assert_eq!(j.size, 65536);
    assert!(
        j.cmd.starts_with(&format!(
            "EXS_BACKEND=verbs EXS_ADDR={addr} sb bulk exs-std "
        )) && j.cmd.ends_with(" 65536"),
        "{}",
        j.cmd
    );
    let mut sum = BTreeMap::new();
    for (tool, variant, v) in [("streams", "exs-std", 16.0), ("rstream", "rstream", 15.0)] {
        sum.insert(
            (
                tool.into(),
                variant.into(),
                65536,
                1,
                "bytes_per_sec".into(),
            ),
            (v, v, v, 1),
        );
    }
    let t = targets("softroce", &sum);
    assert!(
        t.contains(&"exs::Stream (64 KiB writes) vs rstream, 64 KiB: 1.07x (target >= 1.0x, issue 26) - met".to_string()),
        "{t:?}"
    );
}

/// The Soft-RoCE suite pings beside another thread's registrations of large regions (in the guest, on the device)
/// and reports the tail round trip beside the quiet one.
#[test]
fn round_trips_beside_registrations_are_measured_on_soft_roce() {
    let jobs = softroce_jobs("exs", "c", "sb", &plan(true), true);
    let (_, _, addr) = rxe::DUMMY;
    let j = jobs
        .iter()
        .find(|j| j.tool == "streams-register")
        .expect("a registration row");
    assert_eq!(
        j.cmd,
        format!("EXS_BACKEND=verbs EXS_ADDR={addr} sb register exs-std {REGISTERED} 4")
    );
    let mut sum = BTreeMap::new();
    for (metric, v) in [("quiet_p99_us", 40.0), ("register_p99_us", 50.0)] {
        sum.insert(
            (
                "streams-register".into(),
                "exs-std".into(),
                REGISTERED,
                1,
                metric.into(),
            ),
            (v, v, v, 1),
        );
    }
    let t = targets("softroce", &sum);
    assert!(
        t.iter().any(|l| l.starts_with(
            "exs::Stream 8 B round trip p99 while another thread registers 128 MiB regions vs quiet: 1.25x (no target"
        )),
        "{t:?}"
    );
    assert!(
        !targets("host", &sum)
            .iter()
            .any(|l| l.contains("registers")),
        "a host row"
    );
}

/// Issue 26: the stream pump's targets, beside TCP without Nagle at small sizes and beside the raw write loop at
/// large ones.
#[test]
fn the_stream_pump_is_compared_with_tcp_nodelay_and_the_raw_write_loop() {
    let mut sum = BTreeMap::new();
    for (tool, variant, size, v) in [
        ("exs", "stream", 4096, 110.0),
        ("tcp", "nodelay", 4096, 100.0),
        ("exs", "stream", 1 << 20, 80.0),
        ("raw", "write", 1 << 20, 100.0),
    ] {
        sum.insert(
            (tool.into(), variant.into(), size, 1, "bytes_per_sec".into()),
            (v, v, v, 1),
        );
    }
    let t = targets("host", &sum);
    for want in [
        "exs stream vs TCP nodelay, 4 KiB: 1.10x (target >= 1.0x, issue 26) - met",
        "exs stream vs raw libfabric RMA write loop, 1 MiB: 0.80x (target >= 0.9x, issue 26) - missed",
    ] {
        assert!(t.contains(&want.to_string()), "{want}: {t:?}");
    }
}

/// Issue 26: the points the stream pump's targets compare run side by side several times a round (the deepest of a
/// point measured at several depths), their extra runs join the same medians, and the streams' one-way rows and
/// hyper's GET run five times a round; a pair with a point the plan leaves out adds nothing.
#[test]
fn target_pairs_run_side_by_side_several_times_a_round_into_the_same_medians() {
    let p = plan(true);
    let jobs = host_jobs("exs", "c", &p);
    let count = |tool: &str, variant: &str, size: u64| {
        jobs.iter()
            .filter(|j| j.tool == tool && j.variant == variant && j.size == size)
            .count()
    };
    assert_eq!(count("exs", "stream", 64), PAIRED_RUNS);
    assert_eq!(count("tcp", "nodelay", 4096), PAIRED_RUNS);
    // The 1 MiB stream is in two pairs: against the raw loop and against the deeper stream.
    assert_eq!(count("exs", "stream", 1 << 20), 2 * PAIRED_RUNS - 1);
    let at = jobs
        .iter()
        .position(|j| j.tool == "exs" && j.variant == "stream" && j.size == 64)
        .unwrap();
    let extra = &jobs[jobs.len() - 2 * (PAIRED_RUNS - 1) * 5..];
    assert!(extra[..2]
        .iter()
        .zip(["stream", "nodelay"])
        .all(|(j, v)| j.variant == v && j.size == 64));
    assert_eq!(extra[0].cmd, jobs[at].cmd);
    let deep = job("exs", "stream", 4096, 8, "d8".into(), Parse::Json);
    let shallow = job("exs", "stream", 4096, 1, "d1".into(), Parse::Json);
    let extra = pair_up(
        &[
            shallow,
            deep,
            job("tcp", "nodelay", 4096, 1, "t".into(), Parse::Json),
        ],
        &[
            (("exs", "stream", 4096), ("tcp", "nodelay", 4096)),
            (("exs", "stream", 64), ("tcp", "nodelay", 64)),
        ],
        2,
    );
    let cmds: Vec<&str> = extra.iter().map(|j| j.cmd.as_str()).collect();
    assert_eq!(cmds, ["d8", "t", "d8", "t"]);
    // Two runs of one point in a round join its median with the other round's.
    let two = vec![jobs[at].clone(), jobs[at].clone()];
    let out = "@@job 0 0\n{\"bytes_per_sec\": 10.0}\n@@job 1 0\n{\"bytes_per_sec\": 40.0}\n@@job 0 1\n{\"bytes_per_sec\": 20.0}\n";
    let s = summarize(&collect("host", &two, out));
    let v = s
        .values()
        .find(|v| v.3 == 3)
        .expect("one point, three runs");
    assert_eq!((v.0, v.1, v.2), (20.0, 10.0, 40.0));
    let streams = stream_jobs("sb", false);
    for (tool, variant) in [("streams", "exs-std"), ("streams-http", "exs")] {
        assert_eq!(
            streams
                .iter()
                .filter(|j| j.tool == tool && j.variant == variant)
                .count(),
            BULK_RUNS,
            "{tool} {variant}"
        );
    }
    assert!(stream_jobs("sb", true)
        .iter()
        .filter(|j| j.tool == "streams")
        .all(|j| j.size == 256 << 20));
}

/// The stream pump twice as deep is reported with the share of its bytes that went straight into the receives, and
/// beside the transport's own write loop as deep against at depth 8 (what the deeper pipeline costs without exs).
#[test]
fn the_deep_stream_row_says_its_direct_share_beside_the_raw_loop_as_deep() {
    let mut sum = BTreeMap::new();
    for (tool, variant, depth, metric, v) in [
        ("exs-deep", "stream", 32, "bytes_per_sec", 80.0),
        ("exs-deep", "stream", 32, "direct_share", 0.995),
        ("exs", "stream", 8, "bytes_per_sec", 100.0),
        ("raw-deep", "write", 32, "bytes_per_sec", 75.0),
        ("raw", "write", 8, "bytes_per_sec", 100.0),
    ] {
        sum.insert(
            (tool.into(), variant.into(), 1 << 20, depth, metric.into()),
            (v, v, v, 1),
        );
    }
    let t = targets("host", &sum);
    for want in [
        "exs stream at depth 32 (twice the advert credits) vs at depth 8, 1 MiB: 0.80x (target >= 0.9x, a deeper pipeline must not fall back on the stream buffer) - missed",
        "exs stream at depth 32, 1 MiB: 0.995 of the bytes went straight into the receives (the rest through the stream buffer)",
        "raw libfabric RMA write loop at depth 32 vs at depth 8, 1 MiB: 0.75x (no target: what twice the memory in flight costs the transport itself)",
    ] {
        assert!(t.contains(&want.to_string()), "{want}: {t:?}");
    }
}

/// The idle rows count only the ping-pong: perf starts with its events off and `exs ping` switches them on and off
/// through perf's control fifo (opening and closing thousands of idle connections costs more system calls, and
/// varies more, than the whole ping-pong).
#[test]
fn idle_rows_count_only_the_ping_pong() {
    let jobs = idle_jobs("exs", "fabric tcp", "--backend fabric", &[0, 4000], true);
    assert_eq!(jobs.len(), 2);
    for j in &jobs {
        assert!(
            j.cmd.contains("mkfifo /tmp/exs-bench-perf.ctl"),
            "{}",
            j.cmd
        );
        assert_eq!(
            j.cmd
                .matches("-D -1 --control fifo:/tmp/exs-bench-perf.ctl")
                .count(),
            2
        );
        assert_eq!(
            j.cmd
                .matches("env EXS_PERF_CONTROL=/tmp/exs-bench-perf.ctl exs ping")
                .count(),
            2
        );
    }
    // Without perf (the guest), the ping runs alone.
    let timed = idle_jobs("exs", "verbs", "--backend verbs", &[100], false);
    assert!(!timed[0].cmd.contains("perf"), "{}", timed[0].cmd);
}

/// The results' header names the command that made them, repeats and suite included (a run with five repeats of
/// one suite was headed plain `cargo xtask bench --quick`).
#[test]
fn the_results_header_names_the_repeats_and_the_suite_it_ran() {
    let args = |quick, repeats, suite: Option<&str>| BenchArgs {
        quick,
        repeats,
        suite: suite.map(String::from),
    };
    assert_eq!(command_line(&args(false, None, None)), "cargo xtask bench");
    assert_eq!(
        command_line(&args(true, Some(5), Some("host"))),
        "cargo xtask bench --quick --repeats 5 --suite host"
    );
    assert_eq!(
        command_line(&args(false, None, Some("softroce"))),
        "cargo xtask bench --suite softroce"
    );
}

/// A perftest server that refused its client (a connection request that came before it listened, rejected) or
/// crashed serves no second one: the bench's rxe `ib_send_lat` point once went unmeasured after five tries of a
/// client against the one dead server. Each try now starts a server of its own. Run with a stand-in `ib_send_lat`
/// whose client succeeds only once a second server has started.
#[test]
fn a_perftest_point_starts_a_server_for_each_try_of_its_client() {
    let dir = std::env::temp_dir().join(format!("exs-perftest-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let fake = dir.join("ib_send_lat");
    std::fs::write(
        &fake,
        r#"#!/bin/sh
d=$(dirname "$0")
for a; do last=$a; done
case "$last" in
  127.0.0.1) served=$(cat "$d/served" 2>/dev/null || echo 0)
     [ "$served" -ge 2 ] && { echo "served by server $served"; exit 0; }; exit 1;;
  *) n=$(cat "$d/served" 2>/dev/null || echo 0); echo $((n + 1)) > "$d/served"; exit 0;;
esac
"#,
    )
    .unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&fake, std::fs::Permissions::from_mode(0o755)).unwrap();
    let cmd = perftest("ib_send_lat", "exs_rxe0", "127.0.0.1", 8, "-n 10");
    let path = format!(
        "{}:{}",
        dir.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let out = std::process::Command::new("sh")
        .arg("-c")
        .arg(&cmd)
        .env("PATH", path)
        .output()
        .unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("served by server 2"), "{cmd}: {stdout:?}");
}

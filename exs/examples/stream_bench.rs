//! The program `cargo xtask bench` measures exs streams with, beside the same code over TCP (issue 26): one JSON
//! line per run on stdout.
//!
//! ```sh
//! # 256 MiB one way, written with write_all and read with read_to_end, server and client in this process:
//! EXS_BACKEND=fabric cargo run --release -p exs --features tokio,fabric --example stream_bench -- bulk exs-tokio
//! #   APIs: exs-tokio (exs::tokio::Stream), tcp-tokio (tokio::net::TcpStream), exs-std (exs::Stream),
//! #   tcp-std (std::net::TcpStream); optional: the size in bytes, then the size of each write (default: one
//! #   write_all of the whole buffer), e.g. `bulk exs-std BYTES WRITE` to write as rstream does, a piece at a time
//! # 8-byte request/response (one-way time: half the round trip, as `exs ping` reports it):
//! ... --example stream_bench -- rr exs-std [COUNT]        # or tcp-std
//! # hyper's GET of 64 MiB, every byte checked (exs/examples/http.rs):
//! ... --example stream_bench -- http exs [BYTES]          # or tcp
//! # 8-byte round trips for a second, then while another thread of the client's context registers REGIONS
//! # regions of BYTES (default 4 of 128 MiB) and deregisters each: the longest and p99 round trips of each part
//! ... --example stream_bench -- register exs-std [BYTES [REGIONS]]
//! ```
//!
//! Environment: `STREAM_BENCH_CFG=send_buffer,send_piece,recv_buffer,recv_pieces` sets the exs streams' buffers
//! (`exs::StreamConfig`; default: its defaults); `STREAM_BENCH_FRESH=1` reads into a vector whose pages were never
//! touched (default: touched before the clock starts, see `sink`); `STREAM_BENCH_ROUNDS=N` sums N transfers.
//!
//! exs runs on two contexts of the backend the environment names (`Context::from_env`), a server and a client,
//! as two hosts would; TCP runs on loopback. Listening address: `EXS_ADDR`, else 127.0.0.1 (the simulated host 0
//! with `EXS_BACKEND=sim`).

use std::io::{self, Read, Write};
use std::net::SocketAddr;
use std::time::{Duration, Instant};

#[allow(dead_code)]
#[path = "http.rs"]
mod http;

fn other(e: impl std::fmt::Display) -> io::Error {
    io::Error::other(e.to_string())
}

fn listen_addr() -> io::Result<SocketAddr> {
    if let Ok(a) = std::env::var("EXS_ADDR") {
        return Ok(SocketAddr::new(a.parse().map_err(other)?, 0));
    }
    #[cfg(feature = "sim")]
    if std::env::var("EXS_BACKEND").as_deref() == Ok("sim") {
        return Ok(exs::sim_addr(0, 7300));
    }
    Ok("127.0.0.1:0".parse().expect("an address"))
}

fn runtime() -> io::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
}

/// The streams' buffers: the defaults, or `STREAM_BENCH_CFG=send_buffer,send_piece,recv_buffer,recv_pieces`.
fn cfg() -> exs::StreamConfig {
    let mut c = exs::StreamConfig::default();
    if let Ok(v) = std::env::var("STREAM_BENCH_CFG") {
        let n: Vec<usize> = v.split(',').filter_map(|x| x.parse().ok()).collect();
        if let [sb, sp, rb, rp] = n[..] {
            (c.send_buffer, c.send_piece, c.recv_buffer, c.recv_pieces) = (sb, sp, rb, rp);
        }
    }
    c
}

fn contexts() -> io::Result<(exs::Context, exs::Context)> {
    Ok((exs::Context::from_env()?, exs::Context::from_env()?))
}

/// The reader's vector: room for `len` bytes and the end-of-stream probe, its pages touched before the timed part
/// (unless `STREAM_BENCH_FRESH` is set). A fresh vector's first-touch faults are the same work for every API (the
/// kernel's copy into a TCP reader's memory takes them too), and on a virtual machine they can take as long as the
/// transfer and vary from run to run with the host's memory, which would blur the ratios between the streams.
fn sink(len: usize) -> Vec<u8> {
    let mut v = Vec::with_capacity(len + 64);
    if std::env::var_os("STREAM_BENCH_FRESH").is_none() {
        v.resize(len + 64, 0);
        v.clear();
    }
    v
}

/// The bytes sent one way: not all zero, so that a lost or misplaced chunk shows in the check.
fn payload(len: usize) -> Vec<u8> {
    (0..len).map(|i| (i / 4096) as u8 ^ (i as u8)).collect()
}

fn check(got: &[u8], want: &[u8]) -> io::Result<()> {
    if got.len() != want.len() {
        return Err(other(format!(
            "received {} bytes of {}",
            got.len(),
            want.len()
        )));
    }
    if got != want {
        return Err(other("the received bytes differ from those sent"));
    }
    Ok(())
}

/// With `STREAM_BENCH_STATS` set: a function that prints the sending connection's counters to stderr (direct
/// and indirect bytes, writes posted), for exs streams.
fn stats_of<S: 'static>(s: &S) -> Box<dyn Fn()> {
    let any: &dyn std::any::Any = s;
    let sock = match (
        any.downcast_ref::<exs::Stream>(),
        any.downcast_ref::<exs::tokio::Stream>(),
    ) {
        (Some(s), _) => s.socket().clone(),
        (_, Some(s)) => s.socket().clone(),
        _ => return Box::new(|| ()),
    };
    if std::env::var_os("STREAM_BENCH_STATS").is_none() {
        return Box::new(|| ());
    }
    Box::new(move || {
        if let Some(st) = sock.stats() {
            eprintln!("client: {:?}\n{:?}", st.stream, st.link);
        }
    })
}

/// Writes `data` with `write_all`, shuts the writing side down; the other side reads with `read_to_end`. The
/// time runs from the connection's start to the reader's end-of-stream.
fn bulk_std<S, L>(
    data: &[u8],
    write: usize,
    listen: impl FnOnce() -> io::Result<(L, SocketAddr)>,
    accept: impl FnOnce(L) -> io::Result<S> + Send + 'static,
    connect: impl FnOnce(SocketAddr) -> io::Result<S>,
    shutdown: impl Fn(&S) -> io::Result<()>,
) -> io::Result<(Duration, Duration)>
where
    S: Read + Write + Send + 'static,
    L: Send + 'static,
{
    let (l, addr) = listen()?;
    let len = data.len();
    let mut got = sink(len);
    let reader = std::thread::spawn(move || -> io::Result<(Vec<u8>, Instant)> {
        let mut s = accept(l)?;
        s.read_to_end(&mut got)?;
        Ok((got, Instant::now()))
    });
    let mut c = connect(addr)?;
    let stats = stats_of(&c);
    let (t, cpu0) = (Instant::now(), cpu());
    for piece in data.chunks(write.max(1)) {
        c.write_all(piece)?;
    }
    shutdown(&c)?;
    let (got, end) = reader.join().map_err(|_| other("the reader panicked"))??;
    let cpu = cpu() - cpu0;
    stats();
    check(&got, data)?;
    Ok((end - t, cpu))
}

async fn bulk_tokio<S>(
    data: std::sync::Arc<Vec<u8>>,
    write: usize,
    accepted: tokio::task::JoinHandle<io::Result<S>>,
    mut c: S,
) -> io::Result<(Duration, Duration)>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let len = data.len();
    let mut got = sink(len);
    let reader = tokio::spawn(async move {
        let mut s = accepted.await.map_err(other)??;
        s.read_to_end(&mut got).await?;
        Ok::<_, io::Error>((got, Instant::now()))
    });
    let stats = stats_of(&c);
    let (t, cpu0) = (Instant::now(), cpu());
    for piece in data.chunks(write.max(1)) {
        c.write_all(piece).await?;
    }
    c.shutdown().await?;
    let (got, end) = reader.await.map_err(other)??;
    let cpu = cpu() - cpu0;
    stats();
    check(&got, &data)?;
    Ok((end - t, cpu))
}

/// The time and the CPU time (both ends) of [`bulk_std`] or [`bulk_tokio`] over `api`: one transfer, or the sum
/// of `STREAM_BENCH_ROUNDS` of them on fresh connections (for profiles, which the set-up would blur otherwise).
fn bulk(api: &str, len: usize, write: usize) -> io::Result<(Duration, Duration)> {
    let rounds: usize = std::env::var("STREAM_BENCH_ROUNDS")
        .ok()
        .and_then(|r| r.parse().ok())
        .unwrap_or(1);
    let data = std::sync::Arc::new(payload(len));
    let mut sum = (Duration::ZERO, Duration::ZERO);
    for _ in 0..rounds {
        let (t, c) = bulk_once(api, &data, write)?;
        sum = (sum.0 + t, sum.1 + c);
    }
    Ok(sum)
}

fn bulk_once(
    api: &str,
    data: &std::sync::Arc<Vec<u8>>,
    write: usize,
) -> io::Result<(Duration, Duration)> {
    let data = std::sync::Arc::clone(data);
    match api {
        "exs-std" => {
            let (server, client) = contexts()?;
            bulk_std(
                &data,
                write,
                || {
                    let l = exs::Listener::bind_with(&server, listen_addr()?, &cfg())?;
                    let a = l.local_addr()?;
                    Ok((l, a))
                },
                |l: exs::Listener| Ok(l.accept()?.0),
                |a| exs::Stream::connect_with(&client, a, &cfg()),
                |s| s.shutdown(std::net::Shutdown::Write),
            )
        }
        "tcp-std" => bulk_std(
            &data,
            write,
            || {
                let l = std::net::TcpListener::bind("127.0.0.1:0")?;
                let a = l.local_addr()?;
                Ok((l, a))
            },
            |l: std::net::TcpListener| Ok(l.accept()?.0),
            std::net::TcpStream::connect,
            |s| s.shutdown(std::net::Shutdown::Write),
        ),
        "exs-tokio" => {
            let (server, client) = contexts()?;
            let (s2, c2) = (server.clone(), client.clone());
            let r = runtime()?.block_on(async move {
                let l = exs::tokio::Listener::bind_with(&server, listen_addr()?, &cfg()).await?;
                let addr = l.local_addr()?;
                let accepted = tokio::spawn(async move { Ok(l.accept().await?.0) });
                let c = exs::tokio::Stream::connect_with(&client, addr, &cfg()).await?;
                bulk_tokio(data, write, accepted, c).await
            });
            // Who ran the protocol on each side (tasks leading, the progress thread's wake-ups).
            if std::env::var_os("STREAM_BENCH_STATS").is_some() {
                eprintln!(
                    "progress: client {:?}\nprogress: server {:?}",
                    c2.progress_stats(),
                    s2.progress_stats()
                );
            }
            r
        }
        "tcp-tokio" => runtime()?.block_on(async move {
            let l = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
            let addr = l.local_addr()?;
            let accepted = tokio::spawn(async move { Ok(l.accept().await?.0) });
            let c = tokio::net::TcpStream::connect(addr).await?;
            bulk_tokio(data, write, accepted, c).await
        }),
        _ => Err(other(format!(
            "unknown API {api:?}: exs-tokio, tcp-tokio, exs-std, tcp-std"
        ))),
    }
}

/// `count` round trips of `size` bytes after a tenth as many for warm-up; returns the mean one-way time.
fn ping<S: Read + Write>(c: &mut S, size: usize, count: usize) -> io::Result<Duration> {
    let mut buf = vec![0u8; size];
    let mut round = |buf: &mut [u8]| -> io::Result<()> {
        c.write_all(buf)?;
        c.read_exact(buf)
    };
    for _ in 0..count / 10 + 1 {
        round(&mut buf)?;
    }
    let t = Instant::now();
    for _ in 0..count {
        round(&mut buf)?;
    }
    Ok(t.elapsed() / (2 * count as u32))
}

/// The echo side of [`ping`]: answers every `size` bytes until end-of-stream.
fn pong<S: Read + Write>(mut s: S, size: usize) -> io::Result<()> {
    let mut buf = vec![0u8; size];
    loop {
        let mut at = 0;
        while at < size {
            match s.read(&mut buf[at..])? {
                0 => return Ok(()),
                n => at += n,
            }
        }
        s.write_all(&buf)?;
    }
}

fn rr(api: &str, size: usize, count: usize) -> io::Result<Duration> {
    match api {
        "exs-std" => {
            let (server, client) = contexts()?;
            let l = exs::Listener::bind_with(&server, listen_addr()?, &cfg())?;
            let addr = l.local_addr()?;
            let echo = std::thread::spawn(move || pong(l.accept()?.0, size));
            let mut c = exs::Stream::connect_with(&client, addr, &cfg())?;
            let stats = stats_of(&c);
            let took = ping(&mut c, size, count)?;
            stats();
            c.shutdown(std::net::Shutdown::Write)?;
            echo.join().map_err(|_| other("the echo panicked"))??;
            Ok(took)
        }
        "tcp-std" => {
            let l = std::net::TcpListener::bind("127.0.0.1:0")?;
            let addr = l.local_addr()?;
            let echo = std::thread::spawn(move || {
                let s = l.accept()?.0;
                s.set_nodelay(true)?;
                pong(s, size)
            });
            let mut c = std::net::TcpStream::connect(addr)?;
            c.set_nodelay(true)?;
            let took = ping(&mut c, size, count)?;
            c.shutdown(std::net::Shutdown::Write)?;
            echo.join().map_err(|_| other("the echo panicked"))??;
            Ok(took)
        }
        _ => Err(other(format!("unknown API {api:?}: exs-std, tcp-std"))),
    }
}

/// Round trips of 8 bytes over `c`, each timed, until `done` says so (asked after each).
fn round_trips(c: &mut exs::Stream, mut done: impl FnMut() -> bool) -> io::Result<Vec<Duration>> {
    let mut buf = [0u8; 8];
    let mut v = Vec::new();
    while !done() {
        let t = Instant::now();
        c.write_all(&buf)?;
        c.read_exact(&mut buf)?;
        v.push(t.elapsed());
    }
    Ok(v)
}

/// The p99 (nearest rank) and the longest of `v`, in microseconds; `None` if `v` is empty.
fn tail(v: &mut [Duration]) -> Option<(f64, f64)> {
    v.sort();
    let us = |d: &Duration| d.as_secs_f64() * 1e6;
    let rank = (v.len() * 99).div_ceil(100).max(1);
    Some((us(v.get(rank - 1)?), us(v.last()?)))
}

/// 8-byte round trips over an exs stream, quiet for a second, then while another thread of the client's context
/// registers `regions` regions of `len` bytes, one after the other, and deregisters each. Registering pins the
/// pages (verbs), a while for a large region: the connection must not wait for it.
fn register_beside(len: usize, regions: usize) -> io::Result<String> {
    use std::sync::atomic::{AtomicBool, Ordering};
    let (server, client) = contexts()?;
    let l = exs::Listener::bind_with(&server, listen_addr()?, &cfg())?;
    let addr = l.local_addr()?;
    let echo = std::thread::spawn(move || pong(l.accept()?.0, 8));
    let mut c = exs::Stream::connect_with(&client, addr, &cfg())?;
    let start = Instant::now();
    let mut quiet = round_trips(&mut c, || start.elapsed() >= Duration::from_secs(1))?;
    let stop = std::sync::Arc::new(AtomicBool::new(false));
    let (done, ctx) = (std::sync::Arc::clone(&stop), client.clone());
    let registering = std::thread::spawn(move || -> io::Result<Duration> {
        let mut longest = Duration::ZERO;
        let r = (|| -> io::Result<()> {
            for _ in 0..regions {
                let t = Instant::now();
                let region = exs::MemoryRegion::alloc(&ctx, len).map_err(other)?;
                region.deregister().map_err(other)?;
                longest = longest.max(t.elapsed());
            }
            Ok(())
        })();
        done.store(true, Ordering::SeqCst);
        r.map(|()| longest)
    });
    let mut busy = round_trips(&mut c, || stop.load(Ordering::SeqCst))?;
    let longest = registering
        .join()
        .map_err(|_| other("the registering thread panicked"))??;
    c.shutdown(std::net::Shutdown::Write)?;
    echo.join().map_err(|_| other("the echo panicked"))??;
    let none = || other("no round trip in one of the parts");
    let (q99, qmax) = tail(&mut quiet).ok_or_else(none)?;
    let (b99, bmax) = tail(&mut busy).ok_or_else(none)?;
    Ok(format!(
        r#"{{"test":"register","api":"exs-std","bytes":{len},"regions":{regions},"quiet_trips":{},"quiet_p99_us":{q99:.1},"quiet_max_us":{qmax:.1},"register_trips":{},"register_p99_us":{b99:.1},"register_max_us":{bmax:.1},"register_longest_ms":{:.1}}}"#,
        quiet.len(),
        busy.len(),
        longest.as_secs_f64() * 1e3
    ))
}

fn http(api: &str, len: usize) -> io::Result<Duration> {
    let rt = runtime()?;
    match api {
        "exs" => {
            let (server, client) = contexts()?;
            rt.block_on(http::fetch(&server, &client, listen_addr()?, len))
        }
        "tcp" => rt.block_on(http::fetch_tcp(len)),
        _ => Err(other(format!("unknown API {api:?}: exs, tcp"))),
    }
}

/// CPU time of this process so far (user + system, every thread): both ends run here.
fn cpu() -> Duration {
    use nix::sys::resource::{getrusage, UsageWho};
    getrusage(UsageWho::RUSAGE_SELF).map_or(Duration::ZERO, |u| {
        let t = |tv: nix::sys::time::TimeVal| {
            Duration::new(tv.tv_sec() as u64, tv.tv_usec() as u32 * 1000)
        };
        t(u.user_time()) + t(u.system_time())
    })
}

fn main() -> io::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let arg = |i: usize, default: usize| -> io::Result<usize> {
        args.get(i).map_or(Ok(default), |a| {
            a.parse().map_err(|e| other(format!("{a:?}: {e}")))
        })
    };
    let (test, api) = match (args.first(), args.get(1)) {
        (Some(t), Some(a)) => (t.as_str(), a.as_str()),
        _ => {
            return Err(other(
                "usage: stream_bench bulk|rr|http|register API [BYTES [WRITE|REGIONS]|COUNT]",
            ))
        }
    };
    let line = match test {
        "bulk" | "http" => {
            let len = arg(2, if test == "bulk" { 256 << 20 } else { 64 << 20 })?;
            let rounds: usize = std::env::var("STREAM_BENCH_ROUNDS")
                .ok()
                .and_then(|r| r.parse().ok())
                .filter(|_| test == "bulk")
                .unwrap_or(1);
            let write = arg(3, len)?;
            let (took, cpu) = if test == "bulk" {
                bulk(api, len, write)?
            } else {
                let cpu0 = cpu();
                let took = http(api, len)?;
                (took, cpu() - cpu0)
            };
            format!(
                r#"{{"test":"{test}","api":"{api}","bytes":{len},"write":{write},"secs":{:.6},"bytes_per_sec":{:.0},"cpu_ns_per_kib":{:.0}}}"#,
                took.as_secs_f64(),
                (len * rounds) as f64 / took.as_secs_f64(),
                cpu.as_nanos() as f64 / ((len * rounds) as f64 / 1024.0)
            )
        }
        "rr" => {
            let count = arg(2, 20_000)?;
            let one_way = rr(api, 8, count)?;
            format!(
                r#"{{"test":"rr","api":"{api}","size":8,"count":{count},"mean_us":{:.3}}}"#,
                one_way.as_secs_f64() * 1e6
            )
        }
        "register" if api == "exs-std" => register_beside(arg(2, 128 << 20)?, arg(3, 4)?)?,
        "register" => return Err(other(format!("unknown API {api:?}: exs-std"))),
        _ => {
            return Err(other(format!(
                "unknown test {test:?}: bulk, rr, http, register"
            )))
        }
    };
    println!("{line}");
    Ok(())
}

//! `exs demo`: move a volume of data client to server through exs with a progress bar, verify a checksum of every
//! received byte, and do the same over plain TCP (std::net) in the same run.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::process::Command;
use std::time::{Duration, Instant};

use exs::{Context, EventKind, EventQueue, MemoryRegion, MsgFlags, SockType, Socket, SocketOption};

use crate::backend::{BackendArgs, Opened};
use crate::progress::Progress;
use crate::util::{fmt_bytes, fmt_rate};

/// Order-dependent fold of per-chunk hashes: the checksum of the whole stream.
fn fold(h: u64, chunk: &[u8]) -> u64 {
    let c = xxhash_rust::xxh3::xxh3_64(chunk) ^ (chunk.len() as u64).rotate_left(32);
    (h ^ c).wrapping_mul(0x9E37_79B9_7F4A_7C15).rotate_left(29)
}

const SEED: u64 = 0x5EED;
const SOURCES: usize = 8;

/// The client's source data: `SOURCES` chunks of random bytes, sent in rotation.
fn sources(chunk: usize) -> Vec<Vec<u8>> {
    let mut x = 0x243F_6A88_85A3_08D3u64;
    (0..SOURCES)
        .map(|_| {
            let mut v = vec![0u8; chunk];
            for w in v.chunks_mut(8) {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                let b = x.to_le_bytes();
                w.copy_from_slice(&b[..w.len()]);
            }
            v
        })
        .collect()
}

/// The checksum the server must report for `size` bytes sent in `chunk`-byte messages.
fn expected(srcs: &[Vec<u8>], size: u64, chunk: usize) -> u64 {
    let mut h = SEED;
    let (mut left, mut i) = (size, 0usize);
    while left > 0 {
        let n = (chunk as u64).min(left) as usize;
        h = fold(h, &srcs[i % SOURCES][..n]);
        left -= n as u64;
        i += 1;
    }
    h
}

#[derive(Clone, Debug, clap::Args)]
pub struct DemoArgs {
    #[command(flatten)]
    pub backend: BackendArgs,
    /// Bytes to move (K, M, G suffixes are binary).
    #[arg(long, default_value = "1G", value_parser = crate::util::parse_size)]
    pub size: u64,
    /// Bytes per message.
    #[arg(long, default_value = "4M", value_parser = crate::util::parse_size)]
    pub chunk: u64,
    /// Messages in flight.
    #[arg(long, default_value_t = 8)]
    pub depth: usize,
    /// Skip the TCP baseline.
    #[arg(long)]
    pub no_tcp: bool,
}

/// One measured transfer.
pub struct Outcome {
    pub label: String,
    pub bytes: u64,
    pub secs: f64,
    pub checksum_ok: bool,
}

pub fn run(a: DemoArgs) -> Result<(), String> {
    if a.chunk == 0 || a.chunk > 256 << 20 {
        return Err("--chunk must be between 1 byte and 256 MiB".into());
    }
    let opened = Opened::open(&a.backend)?;
    let chunk = a.chunk as usize;
    eprintln!(
        "exs demo: {} through {} in {} messages, {} in flight",
        fmt_bytes(a.size),
        opened.label(),
        fmt_bytes(a.chunk),
        a.depth
    );
    let srcs = sources(chunk);
    let want = expected(&srcs, a.size, chunk);
    let mut results = vec![exs_transfer(&opened, &a, &srcs, want)?];
    if !a.no_tcp {
        results.push(tcp_transfer(&a, &srcs, want)?);
    }
    println!();
    for r in &results {
        println!(
            "{:<22} {} in {:.3} s  {}  checksum {}",
            r.label,
            fmt_bytes(r.bytes),
            r.secs,
            fmt_rate(r.bytes as f64 / r.secs),
            if r.checksum_ok {
                "verified"
            } else {
                "MISMATCH"
            }
        );
    }
    if results.len() == 2 {
        let ratio = (results[0].bytes as f64 / results[0].secs)
            / (results[1].bytes as f64 / results[1].secs);
        println!("{:<22} {ratio:.2}x plain TCP", "exs vs TCP:");
    }
    if results.iter().any(|r| !r.checksum_ok) {
        return Err("checksum mismatch".into());
    }
    Ok(())
}

fn spawn_server(mode: &str, a: &DemoArgs) -> Result<(std::process::Child, SocketAddr), String> {
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let mut cmd = Command::new(exe);
    cmd.args([
        "demo-server",
        "--mode",
        mode,
        "--chunk",
        &a.chunk.to_string(),
    ]);
    cmd.args(a.backend.to_args());
    let (child, addr, _out) = crate::util::spawn_listening(&mut cmd)?;
    Ok((child, addr))
}

fn wait_child(mut child: std::process::Child) -> Result<(), String> {
    let st = child.wait().map_err(|e| e.to_string())?;
    if !st.success() {
        return Err(format!("server process exited with {st}"));
    }
    Ok(())
}

fn exs_transfer(
    opened: &Opened,
    a: &DemoArgs,
    srcs: &[Vec<u8>],
    want: u64,
) -> Result<Outcome, String> {
    let chunk = a.chunk as usize;
    // Open our side first: a missing provider or device is reported here, with what exists.
    let ctx = opened.host()?;
    // The server: another process where the backend allows it, a thread otherwise.
    let (child, thread, addr) = if opened.processes() {
        let (c, addr) = spawn_server("exs", a)?;
        (Some(c), None, addr)
    } else {
        let ctx = opened.host()?;
        let listen = opened.listen_addr(0);
        let (tx, rx) = std::sync::mpsc::channel();
        let t = std::thread::spawn(move || {
            exs_server(&ctx, listen, chunk, |addr| {
                let _ = tx.send(addr);
            })
        });
        let addr = rx
            .recv()
            .map_err(|_| "the server thread failed to listen".to_string())?;
        (None, Some(t), addr)
    };
    let eq = EventQueue::new(a.depth + 8);
    let s = Socket::new(&ctx, SockType::SeqPacket).map_err(|e| e.to_string())?;
    let credits = (a.depth as u16).clamp(1, 64);
    s.set_option(SocketOption::SendCredits(credits))
        .map_err(|e| e.to_string())?;
    s.connect(addr, &eq, 0).map_err(|e| e.to_string())?;
    let ev = eq
        .next(Some(Duration::from_secs(30)))
        .map_err(|e| format!("connect: {e}"))?;
    ev.status.map_err(|e| format!("connect to {addr}: {e}"))?;
    let regions: Vec<MemoryRegion> = srcs
        .iter()
        .map(|v| MemoryRegion::from_vec(&ctx, v.clone()))
        .collect::<Result<_, _>>()
        .map_err(|e| e.to_string())?;
    let header =
        MemoryRegion::from_vec(&ctx, [a.size.to_le_bytes(), a.chunk.to_le_bytes()].concat())
            .map_err(|e| e.to_string())?;
    let reply = MemoryRegion::alloc(&ctx, 8).map_err(|e| e.to_string())?;
    s.recv(&eq, &reply.all(), MsgFlags::NONE, u64::MAX)
        .map_err(|e| e.to_string())?;
    let start = Instant::now();
    s.send(&eq, &header.all(), MsgFlags::NONE, u64::MAX - 1)
        .map_err(|e| e.to_string())?;
    let mut progress = Progress::new(&opened.label(), a.size);
    let (mut posted, mut done, mut i, mut inflight) = (0u64, 0u64, 0usize, 0usize);
    let mut got_reply = false;
    let mut events = Vec::new();
    while done < a.size || !got_reply {
        while inflight < a.depth && posted < a.size {
            let n = (a.chunk).min(a.size - posted) as usize;
            s.send(
                &eq,
                &regions[i % SOURCES].slice(0..n),
                MsgFlags::NONE,
                n as u64,
            )
            .map_err(|e| e.to_string())?;
            posted += n as u64;
            inflight += 1;
            i += 1;
        }
        events.clear();
        eq.dequeue(&mut events, 1, 64, Some(Duration::from_secs(60)))
            .map_err(|e| format!("waiting: {e}"))?;
        for ev in events.drain(..) {
            ev.status
                .clone()
                .map_err(|e| format!("{:?} failed: {e}", ev.kind))?;
            match (ev.kind, ev.context) {
                (EventKind::Recv, _) => got_reply = true,
                (EventKind::Send, c) if c >= u64::MAX - 1 => {}
                (EventKind::Send, n) => {
                    done += n;
                    inflight -= 1;
                    progress.update(done);
                }
                _ => {}
            }
        }
    }
    let secs = start.elapsed().as_secs_f64();
    progress.finish();
    let mut sum = [0u8; 8];
    reply.read(0, &mut sum).map_err(|e| e.to_string())?;
    s.close().map_err(|e| e.to_string())?;
    if let Some(c) = child {
        wait_child(c)?;
    }
    if let Some(t) = thread {
        t.join().map_err(|_| "server thread panicked")??;
    }
    Ok(Outcome {
        label: opened.label(),
        bytes: a.size,
        secs,
        checksum_ok: u64::from_le_bytes(sum) == want,
    })
}

/// The exs server: one connection; a ring of receives; hashes every byte received; replies with the checksum.
pub fn exs_server(
    ctx: &Context,
    listen: SocketAddr,
    chunk: usize,
    announce: impl FnOnce(SocketAddr),
) -> Result<(), String> {
    const RING: usize = 8;
    let eq = EventQueue::new(64);
    let (_listener, s) = crate::util::accept_one(
        ctx,
        SockType::SeqPacket,
        vec![SocketOption::RecvCredits(64)],
        listen,
        &eq,
        announce,
    )?;
    let header = MemoryRegion::alloc(ctx, 16).map_err(|e| e.to_string())?;
    s.recv(&eq, &header.all(), MsgFlags::NONE, u64::MAX)
        .map_err(|e| e.to_string())?;
    let ev = eq
        .next(Some(Duration::from_secs(60)))
        .map_err(|e| format!("header: {e}"))?;
    ev.status.map_err(|e| format!("header: {e}"))?;
    let mut h = [0u8; 16];
    header.read(0, &mut h).map_err(|e| e.to_string())?;
    let size = u64::from_le_bytes(h[..8].try_into().expect("8"));
    let ring = MemoryRegion::alloc(ctx, RING * chunk).map_err(|e| e.to_string())?;
    for k in 0..RING {
        s.recv(
            &eq,
            &ring.slice(k * chunk..(k + 1) * chunk),
            MsgFlags::NONE,
            k as u64,
        )
        .map_err(|e| e.to_string())?;
    }
    let (mut got, mut sum, mut events) = (0u64, SEED, Vec::new());
    while got < size {
        events.clear();
        eq.dequeue(&mut events, 1, 64, Some(Duration::from_secs(60)))
            .map_err(|e| format!("receiving: {e}"))?;
        for ev in events.drain(..) {
            ev.status.clone().map_err(|e| format!("receive: {e}"))?;
            let k = ev.context as usize;
            let range = k * chunk..k * chunk + ev.bytes;
            sum = ring
                .with_slice(range, |b| fold(sum, b))
                .map_err(|e| e.to_string())?;
            got += ev.bytes as u64;
            if got < size {
                s.recv(
                    &eq,
                    &ring.slice(k * chunk..(k + 1) * chunk),
                    MsgFlags::NONE,
                    k as u64,
                )
                .map_err(|e| e.to_string())?;
            }
        }
    }
    let reply =
        MemoryRegion::from_vec(ctx, sum.to_le_bytes().to_vec()).map_err(|e| e.to_string())?;
    s.send(&eq, &reply.all(), MsgFlags::NONE, 0)
        .map_err(|e| e.to_string())?;
    loop {
        let ev = eq
            .next(Some(Duration::from_secs(60)))
            .map_err(|e| format!("reply: {e}"))?;
        if ev.kind == EventKind::Send {
            ev.status.map_err(|e| format!("reply: {e}"))?;
            break;
        }
    }
    // Wait for the client to close, so the reply is read before we go.
    let tail = MemoryRegion::alloc(ctx, 1).map_err(|e| e.to_string())?;
    s.recv(&eq, &tail.all(), MsgFlags::NONE, 0)
        .map_err(|e| e.to_string())?;
    let _ = eq.next(Some(Duration::from_secs(60)));
    Ok(())
}

fn tcp_transfer(a: &DemoArgs, srcs: &[Vec<u8>], want: u64) -> Result<Outcome, String> {
    let (child, addr) = spawn_server("tcp", a)?;
    let mut st = TcpStream::connect(addr).map_err(|e| format!("tcp connect: {e}"))?;
    let start = Instant::now();
    st.write_all(&[a.size.to_le_bytes(), a.chunk.to_le_bytes()].concat())
        .map_err(|e| e.to_string())?;
    let mut progress = Progress::new("TCP (std::net)", a.size);
    let (mut sent, mut i) = (0u64, 0usize);
    while sent < a.size {
        let n = a.chunk.min(a.size - sent) as usize;
        st.write_all(&srcs[i % SOURCES][..n])
            .map_err(|e| format!("tcp write: {e}"))?;
        sent += n as u64;
        i += 1;
        progress.update(sent);
    }
    let mut sum = [0u8; 8];
    st.read_exact(&mut sum)
        .map_err(|e| format!("tcp reply: {e}"))?;
    let secs = start.elapsed().as_secs_f64();
    progress.finish();
    drop(st);
    wait_child(child)?;
    Ok(Outcome {
        label: "TCP (std::net)".into(),
        bytes: a.size,
        secs,
        checksum_ok: u64::from_le_bytes(sum) == want,
    })
}

/// The TCP server: one connection; reads every chunk, hashes it the same way, replies with the checksum.
pub fn tcp_server(
    listen: SocketAddr,
    chunk: usize,
    announce: impl FnOnce(SocketAddr),
) -> Result<(), String> {
    let l = TcpListener::bind(listen).map_err(|e| e.to_string())?;
    announce(l.local_addr().map_err(|e| e.to_string())?);
    let (mut st, _) = l.accept().map_err(|e| e.to_string())?;
    let mut h = [0u8; 16];
    st.read_exact(&mut h).map_err(|e| e.to_string())?;
    let size = u64::from_le_bytes(h[..8].try_into().expect("8"));
    let mut buf = vec![0u8; chunk];
    let (mut got, mut sum) = (0u64, SEED);
    while got < size {
        let n = (chunk as u64).min(size - got) as usize;
        st.read_exact(&mut buf[..n]).map_err(|e| e.to_string())?;
        sum = fold(sum, &buf[..n]);
        got += n as u64;
    }
    st.write_all(&sum.to_le_bytes())
        .map_err(|e| e.to_string())?;
    let _ = st.read(&mut h);
    Ok(())
}

#[derive(Clone, Debug, clap::Args)]
pub struct ServerArgs {
    #[command(flatten)]
    pub backend: BackendArgs,
    /// exs or tcp.
    #[arg(long)]
    pub mode: String,
    #[arg(long, value_parser = crate::util::parse_size)]
    pub chunk: u64,
}

/// The server process of the demo (`exs demo-server`), announcing its address on stdout.
pub fn server(a: ServerArgs) -> Result<(), String> {
    let announce = |addr: SocketAddr| {
        println!("LISTEN {addr}");
        let _ = std::io::stdout().flush();
    };
    match a.mode.as_str() {
        "tcp" => tcp_server(
            SocketAddr::new(a.backend.addr, 0),
            a.chunk as usize,
            announce,
        ),
        "exs" => {
            let opened = Opened::open(&a.backend)?;
            let ctx = opened.host()?;
            exs_server(&ctx, opened.listen_addr(0), a.chunk as usize, announce)
        }
        other => Err(format!("unknown server mode {other}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn expected_checksum_follows_every_byte_and_the_order() {
        let srcs = sources(1000);
        let a = expected(&srcs, 5500, 1000);
        assert_eq!(a, expected(&srcs, 5500, 1000));
        assert_ne!(a, expected(&srcs, 5499, 1000));
        assert_ne!(a, expected(&srcs, 5500, 500));
        let mut h = SEED;
        for (i, n) in [1000, 1000, 1000, 1000, 1000, 500].into_iter().enumerate() {
            h = fold(h, &srcs[i][..n]);
        }
        assert_eq!(h, a);
        let mut bad = srcs[2].clone();
        bad[17] ^= 1;
        let mut h2 = SEED;
        for (i, n) in [1000, 1000, 1000, 1000, 1000, 500].into_iter().enumerate() {
            h2 = fold(h2, if i == 2 { &bad[..n] } else { &srcs[i][..n] });
        }
        assert_ne!(h2, a, "one flipped bit changes the checksum");
    }
}

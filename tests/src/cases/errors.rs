//! Errors a user reads: plain words, the provider's call and code kept out of the message (issue 29). Something
//! that is not an exs peer is played by a `std::net` socket on loopback.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener};
use std::time::Duration;

use crate::{ensure, Backend, Case, Requires};

pub fn cases() -> Vec<Case> {
    let c = |name, run| Case {
        name,
        run,
        requires: Requires::PlainTcp,
    };
    vec![
        c("a_listen_on_an_address_in_use_says_address_in_use", |b| {
            address_in_use(b)
        }),
        c(
            "a_connect_to_a_tcp_server_that_writes_garbage_says_not_an_exs_peer",
            |b| not_a_peer(b, Some(b"HTTP/1.1 400 Bad Request\r\n\r\n".repeat(8))),
        ),
        c(
            "a_connect_to_a_tcp_server_that_closes_says_not_an_exs_peer",
            |b| not_a_peer(b, Some(Vec::new())),
        ),
        c(
            "a_connect_to_a_silent_tcp_server_says_no_exs_peer_answered",
            |b| not_a_peer(b, None),
        ),
    ]
}

fn address_in_use(b: &dyn Backend) -> Result<(), String> {
    let net = b.net();
    let taken = TcpListener::bind(net.listen_addr(0)).map_err(|e| e.to_string())?;
    let addr = taken.local_addr().map_err(|e| e.to_string())?;
    let ctx = net.host();
    let e = exs::Listener::bind_in(&ctx, addr)
        .err()
        .ok_or_else(|| format!("listening on {addr}, taken by a TCP socket, succeeded"))?;
    ensure!(
        e.kind() == std::io::ErrorKind::AddrInUse
            && e.to_string() == format!("address in use: {addr}"),
        "listening on a taken address: {:?} {e}",
        e.kind()
    );
    Ok(())
}

/// Connects to a TCP server that reads what comes, then answers `reply` and closes (`None`: says nothing and keeps
/// the connection open).
fn not_a_peer(b: &dyn Backend, reply: Option<Vec<u8>>) -> Result<(), String> {
    let net = b.net();
    let server = TcpListener::bind(net.listen_addr(0)).map_err(|e| e.to_string())?;
    let addr: SocketAddr = server.local_addr().map_err(|e| e.to_string())?;
    let silent = reply.is_none();
    let plain = std::thread::spawn(move || {
        if let Ok((mut s, _)) = server.accept() {
            let mut buf = [0u8; 256];
            let _ = s.set_read_timeout(Some(Duration::from_millis(200)));
            let _ = s.read(&mut buf);
            match reply {
                Some(r) => {
                    let _ = s.write_all(&r);
                }
                None => std::thread::sleep(Duration::from_secs(3)),
            }
        }
    });
    let mut opts = exs::ContextOptions::default();
    opts.connect_timeout = Duration::from_secs(2);
    let ctx = net.host_with(opts);
    let got = exs::Stream::connect_in(&ctx, addr);
    let _ = plain.join();
    let e = got
        .err()
        .ok_or_else(|| format!("a connect to a plain TCP server at {addr} succeeded"))?;
    let want = if silent {
        format!("connecting to {addr}: timed out; no exs peer answered")
    } else {
        format!("{addr} is not an exs peer")
    };
    ensure!(
        e.to_string().contains(&want),
        "a connect to a plain TCP server ({}): {:?}: {e}",
        if silent { "silent" } else { "answering" },
        e.kind()
    );
    Ok(())
}

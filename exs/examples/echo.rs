//! A blocking echo server and client with `exs::Listener` and `exs::Stream` (`std::io`), like `std::net`.
//!
//! ```sh
//! EXS_BACKEND=fabric cargo run -p exs --features fabric --example echo
//! EXS_BACKEND=sim cargo run -p exs --features sim --example echo
//! ```

use std::io::{Read, Write};

fn main() -> std::io::Result<()> {
    let (server, client) = (exs::Context::from_env()?, exs::Context::from_env()?);
    let listener = exs::Listener::bind_in(&server, listen_addr())?;
    let addr = listener.local_addr()?;
    let echo = std::thread::spawn(move || -> std::io::Result<()> {
        let (mut s, peer) = listener.accept()?;
        println!("server: connection from {peer}");
        let mut buf = [0u8; 4096];
        loop {
            let n = s.read(&mut buf)?;
            if n == 0 {
                return Ok(()); // end of stream
            }
            s.write_all(&buf[..n])?;
        }
    });
    let mut c = exs::Stream::connect_in(&client, addr)?;
    c.write_all(b"hello over RDMA")?;
    let mut back = [0u8; 15];
    c.read_exact(&mut back)?;
    println!("client: {}", String::from_utf8_lossy(&back));
    c.shutdown(std::net::Shutdown::Write)?;
    echo.join().expect("echo thread")
}

/// Where to listen: `EXS_ADDR` (verbs: an address of the RDMA device), else loopback (or the simulated host 0).
fn listen_addr() -> std::net::SocketAddr {
    match std::env::var("EXS_ADDR") {
        Ok(a) => std::net::SocketAddr::new(a.parse().expect("EXS_ADDR is an IP address"), 0),
        #[cfg(feature = "sim")]
        Err(_) if std::env::var("EXS_BACKEND").as_deref() == Ok("sim") => exs::sim_addr(0, 7000),
        Err(_) => "127.0.0.1:0".parse().expect("an address"),
    }
}

//! HTTP/1.1 with hyper over exs streams: a server answers every GET with a body of the asked size, the client
//! fetches 64 MiB and checks every byte; then the same over plain TCP on loopback, for comparison.
//!
//! ```sh
//! EXS_BACKEND=fabric cargo run --release -p exs --features tokio,fabric --example http
//! EXS_BACKEND=verbs EXS_ADDR=192.168.1.5 cargo run --release -p exs --features tokio,verbs --example http
//! ```
//! The conformance suite runs [`fetch`] on every backend (`http_over_exs_streams_with_hyper`).

use std::convert::Infallible;
use std::io;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Empty, Full};
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite};

/// The byte at `i` of every body (so the client can check each one).
pub fn byte(i: usize) -> u8 {
    (i.wrapping_mul(31) ^ (i >> 11)) as u8
}

fn other(e: impl std::fmt::Display) -> io::Error {
    io::Error::other(e.to_string())
}

/// Serves one HTTP/1.1 connection: `GET /N` answers N bytes.
pub async fn serve<T: AsyncRead + AsyncWrite + Unpin + Send + 'static>(io: T) -> io::Result<()> {
    let service = hyper::service::service_fn(|req: Request<hyper::body::Incoming>| async move {
        let n: usize = req
            .uri()
            .path()
            .trim_start_matches('/')
            .parse()
            .unwrap_or(0);
        let body: Vec<u8> = (0..n).map(byte).collect();
        Ok::<_, Infallible>(Response::new(Full::new(Bytes::from(body))))
    });
    hyper::server::conn::http1::Builder::new()
        .serve_connection(TokioIo::new(io), service)
        .await
        .map_err(other)
}

/// Fetches `len` bytes over `io` with hyper's client; checks every byte; returns how long the request took.
pub async fn get<T: AsyncRead + AsyncWrite + Unpin + Send + 'static>(
    io: T,
    len: usize,
) -> io::Result<Duration> {
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(io))
        .await
        .map_err(other)?;
    let driver = tokio::spawn(conn);
    let t = Instant::now();
    let req = Request::get(format!("/{len}"))
        .header(hyper::header::HOST, "exs")
        .body(Empty::<Bytes>::new())
        .map_err(other)?;
    let resp = sender.send_request(req).await.map_err(other)?;
    let body = resp.into_body().collect().await.map_err(other)?.to_bytes();
    let took = t.elapsed();
    if body.len() != len {
        return Err(other(format!("got {} bytes of {len}", body.len())));
    }
    if let Some(i) = (0..len).find(|&i| body[i] != byte(i)) {
        return Err(other(format!("byte {i} of {len} differs")));
    }
    drop(sender);
    let _ = driver.await;
    Ok(took)
}

/// A server on `server` at `listen`, a client on `client`: fetches `len` bytes; returns the request's duration.
pub async fn fetch(
    server: &exs::Context,
    client: &exs::Context,
    listen: std::net::SocketAddr,
    len: usize,
) -> io::Result<Duration> {
    let listener = exs::tokio::Listener::bind_in(server, listen).await?;
    let addr = listener.local_addr()?;
    let srv = tokio::spawn(async move {
        let (s, _) = listener.accept().await?;
        serve(s).await
    });
    let c = exs::tokio::Stream::connect_in(client, addr).await?;
    let took = get(c, len).await?;
    srv.await.map_err(other)??;
    Ok(took)
}

/// The same over plain TCP on loopback.
pub async fn fetch_tcp(len: usize) -> io::Result<Duration> {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = l.local_addr()?;
    let srv = tokio::spawn(async move {
        let (s, _) = l.accept().await?;
        serve(s).await
    });
    let c = tokio::net::TcpStream::connect(addr).await?;
    let took = get(c, len).await?;
    srv.await.map_err(other)??;
    Ok(took)
}

#[allow(dead_code)]
fn main() -> io::Result<()> {
    const LEN: usize = 64 << 20;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let (server, client) = (exs::Context::from_env()?, exs::Context::from_env()?);
    let listen = match std::env::var("EXS_ADDR") {
        Ok(a) => std::net::SocketAddr::new(a.parse().map_err(other)?, 0),
        Err(_) => "127.0.0.1:0".parse().expect("an address"),
    };
    let mb = |d: Duration| LEN as f64 / d.as_secs_f64() / 1e6;
    let exs = rt.block_on(fetch(&server, &client, listen, LEN))?;
    let tcp = rt.block_on(fetch_tcp(LEN))?;
    println!(
        "GET of 64 MiB with hyper, every byte checked: exs ({}) {:.0} MB/s, plain TCP {:.0} MB/s",
        server.capabilities().name,
        mb(exs),
        mb(tcp)
    );
    Ok(())
}

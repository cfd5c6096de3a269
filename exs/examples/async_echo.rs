//! An async echo with `exs::tokio` (`AsyncRead`/`AsyncWrite`), written as with `tokio::net`: the same program
//! over TCP is this one with `exs::tokio::Listener` and `Stream` renamed `tokio::net::TcpListener` and
//! `TcpStream`. Both ends run on the process's default context (`exs::default_context`, the backend the
//! environment names).
//! `EXS_BACKEND=fabric cargo run -p exs --features tokio,fabric --example async_echo`

use tokio::io::{AsyncReadExt, AsyncWriteExt};

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> std::io::Result<()> {
    let listener = exs::tokio::Listener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let echo = tokio::spawn(async move {
        let (mut s, _) = listener.accept().await?;
        let mut buf = [0u8; 4096];
        loop {
            let n = s.read(&mut buf).await?;
            if n == 0 {
                return s.shutdown().await;
            }
            s.write_all(&buf[..n]).await?;
        }
    });
    let mut c = exs::tokio::Stream::connect(addr).await?;
    c.write_all(b"hello, async").await?;
    c.shutdown().await?;
    let mut back = Vec::new();
    c.read_to_end(&mut back).await?;
    println!("{}", String::from_utf8_lossy(&back));
    echo.await.expect("echo task")
}

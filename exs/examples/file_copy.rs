//! Copies a file to a peer with `sendfile` (bounded memory, one copy) and writes what arrives: the user code is the
//! 15 lines of `main`. `cargo run -p exs --features fabric --example file_copy -- SRC DST`
use std::io::{copy, Write};

fn main() -> std::io::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let (src, dst) = (
        std::fs::File::open(&args[1])?,
        std::fs::File::create(&args[2])?,
    );
    let (a, b) = (exs::Context::from_env()?, exs::Context::from_env()?);
    let listener = exs::Listener::bind_in(&b, "127.0.0.1:0")?;
    let addr = listener.local_addr()?;
    let rx = std::thread::spawn(move || -> std::io::Result<u64> {
        copy(&mut listener.accept()?.0, &mut &dst)
    });
    let mut tx = exs::Stream::connect_in(&a, addr)?;
    let q = exs::EventQueue::new(1)?;
    tx.socket()
        .sendfile(&q, &src, 0, src.metadata()?.len() as usize, 0)?;
    q.next(None).map_err(std::io::Error::from)?.status?;
    tx.flush()?;
    tx.shutdown(std::net::Shutdown::Write)?;
    println!("copied {} bytes", rx.join().expect("receiver")?);
    Ok(())
}

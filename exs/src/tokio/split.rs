//! The halves of a [`Stream`], like tokio's `TcpStream::split` / `into_split`. Each direction has its own queue
//! and descriptor (see the parent module), so the halves share nothing but the socket.

use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::task::{Context as TaskContext, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use super::{ReadPart, Stream, WritePart};
use crate::socket::Socket;
use crate::stream_io as sio;

/// The reading half of a borrowed [`Stream`] ([`Stream::split`]).
pub struct ReadHalf<'a>(pub(super) &'a mut ReadPart);

/// The writing half of a borrowed [`Stream`] ([`Stream::split`]).
pub struct WriteHalf<'a>(pub(super) &'a mut WritePart);

/// The reading half of a [`Stream`] ([`Stream::into_split`]).
pub struct OwnedReadHalf {
    read: Box<ReadPart>,
}

/// The writing half of a [`Stream`] ([`Stream::into_split`]). Dropping it shuts the writing side down, as
/// tokio's does, unless [`OwnedWriteHalf::forget`] was called.
pub struct OwnedWriteHalf {
    /// `None` once given back to [`OwnedWriteHalf::reunite`].
    write: Option<Box<WritePart>>,
    shutdown_on_drop: bool,
}

/// The halves given to `reunite` came from different streams; here they are back.
#[derive(Debug)]
pub struct ReuniteError(pub OwnedReadHalf, pub OwnedWriteHalf);

impl std::fmt::Display for ReuniteError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("tried to reunite halves that are not from the same stream")
    }
}

impl std::error::Error for ReuniteError {}

pub(super) fn into_split(s: Stream) -> (OwnedReadHalf, OwnedWriteHalf) {
    (
        OwnedReadHalf {
            read: Box::new(s.read),
        },
        OwnedWriteHalf {
            write: Some(Box::new(s.write)),
            shutdown_on_drop: true,
        },
    )
}

fn same(a: &Socket, b: &Socket) -> bool {
    a.id() == b.id() && a.context().id() == b.context().id()
}

impl OwnedReadHalf {
    /// The stream again, if `w` is its other half.
    pub fn reunite(self, mut w: OwnedWriteHalf) -> Result<Stream, ReuniteError> {
        if !same(&self.read.core.sock, w.sock()) {
            return Err(ReuniteError(self, w));
        }
        let write = w.write.take().expect("present until reunited or dropped");
        Ok(Stream {
            read: *self.read,
            write: *write,
        })
    }

    /// This side's address.
    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        sio::addr_of(self.read.core.sock.local_addr())
    }

    /// The peer's address.
    pub fn peer_addr(&self) -> io::Result<SocketAddr> {
        sio::addr_of(self.read.core.sock.peer_addr())
    }
}

impl OwnedWriteHalf {
    fn part(&mut self) -> &mut WritePart {
        self.write
            .as_mut()
            .expect("present until reunited or dropped")
    }

    /// The stream again, if `r` is its other half.
    pub fn reunite(self, r: OwnedReadHalf) -> Result<Stream, ReuniteError> {
        r.reunite(self)
    }

    /// Drops the half without shutting the writing side down (the stream closes once the read half is gone
    /// too).
    pub fn forget(mut self) {
        self.shutdown_on_drop = false;
    }

    fn sock(&self) -> &Socket {
        &self
            .write
            .as_ref()
            .expect("present until reunited or dropped")
            .core
            .sock
    }

    /// This side's address.
    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        sio::addr_of(self.sock().local_addr())
    }

    /// The peer's address.
    pub fn peer_addr(&self) -> io::Result<SocketAddr> {
        sio::addr_of(self.sock().peer_addr())
    }
}

impl Drop for OwnedWriteHalf {
    fn drop(&mut self) {
        if let (Some(w), true) = (self.write.as_mut(), self.shutdown_on_drop) {
            let _ = w.core.shutdown();
        }
    }
}

impl ReadHalf<'_> {
    /// This side's address (as `tokio::net::tcp::ReadHalf::local_addr`).
    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        sio::addr_of(self.0.core.sock.local_addr())
    }

    /// The peer's address.
    pub fn peer_addr(&self) -> io::Result<SocketAddr> {
        sio::addr_of(self.0.core.sock.peer_addr())
    }
}

impl WriteHalf<'_> {
    /// This side's address (as `tokio::net::tcp::WriteHalf::local_addr`).
    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        sio::addr_of(self.0.core.sock.local_addr())
    }

    /// The peer's address.
    pub fn peer_addr(&self) -> io::Result<SocketAddr> {
        sio::addr_of(self.0.core.sock.peer_addr())
    }
}

impl std::fmt::Debug for OwnedReadHalf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OwnedReadHalf")
            .field("socket", &self.read.core.sock)
            .finish()
    }
}

impl std::fmt::Debug for OwnedWriteHalf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OwnedWriteHalf")
            .field("socket", &self.write.as_ref().map(|w| &w.core.sock))
            .finish()
    }
}

impl std::fmt::Debug for ReadHalf<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReadHalf")
            .field("socket", &self.0.core.sock)
            .finish()
    }
}

impl std::fmt::Debug for WriteHalf<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WriteHalf")
            .field("socket", &self.0.core.sock)
            .finish()
    }
}

/// `AsyncRead` for a half that holds a [`ReadPart`].
macro_rules! async_read {
    ($t:ty, $part:ident => $get:expr) => {
        impl AsyncRead for $t {
            fn poll_read(
                self: Pin<&mut Self>,
                cx: &mut TaskContext<'_>,
                buf: &mut ReadBuf<'_>,
            ) -> Poll<io::Result<()>> {
                let $part = self.get_mut();
                $get.poll_read(cx, buf)
            }
        }
    };
}

/// `AsyncWrite` for a half that holds a [`WritePart`] (flush and shutdown as [`Stream`]'s).
macro_rules! async_write {
    ($t:ty, $part:ident => $get:expr) => {
        impl AsyncWrite for $t {
            fn poll_write(
                self: Pin<&mut Self>,
                cx: &mut TaskContext<'_>,
                buf: &[u8],
            ) -> Poll<io::Result<usize>> {
                let $part = self.get_mut();
                $get.poll_write(cx, buf)
            }

            fn poll_write_vectored(
                self: Pin<&mut Self>,
                cx: &mut TaskContext<'_>,
                bufs: &[io::IoSlice<'_>],
            ) -> Poll<io::Result<usize>> {
                let $part = self.get_mut();
                $get.poll_write_vectored(cx, bufs)
            }

            fn is_write_vectored(&self) -> bool {
                true
            }

            fn poll_flush(self: Pin<&mut Self>, _cx: &mut TaskContext<'_>) -> Poll<io::Result<()>> {
                let $part = self.get_mut();
                Poll::Ready($get.core.flush())
            }

            fn poll_shutdown(
                self: Pin<&mut Self>,
                _cx: &mut TaskContext<'_>,
            ) -> Poll<io::Result<()>> {
                let $part = self.get_mut();
                Poll::Ready($get.core.shutdown())
            }
        }
    };
}

async_read!(ReadHalf<'_>, h => h.0);
async_read!(OwnedReadHalf, h => h.read);
async_write!(WriteHalf<'_>, h => h.0);
async_write!(OwnedWriteHalf, h => h.part());

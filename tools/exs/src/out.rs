//! Results on standard output. `println!` panics when the reader has gone (`exs pump --json | head -1`: exit
//! status 101 at the next point). [`line`] instead notes it: later results are not written, the measuring loops
//! stop at their next point ([`gone`]), and the run still ends with its own verdict (a checksum mismatch or a
//! corrupted byte is still an error). Any other error writing results fails the run ([`failed`]).

use std::io::Write;
use std::sync::atomic::{AtomicBool, Ordering};

/// `println!` for results, through [`line`].
macro_rules! outln {
    ($($arg:tt)*) => {
        $crate::out::line(format_args!($($arg)*))
    };
}
pub(crate) use outln;

/// Standard output's reader has gone, or writing failed: no result is written any more.
static GONE: AtomicBool = AtomicBool::new(false);
/// Writing a result failed for another reason than a reader gone (a full disk, an I/O error).
static FAILED: AtomicBool = AtomicBool::new(false);

/// Writes a line of results to standard output, unless [`gone`].
pub fn line(args: std::fmt::Arguments<'_>) {
    if gone() {
        return;
    }
    let mut out = std::io::stdout().lock();
    let r = out
        .write_fmt(args)
        .and_then(|()| out.write_all(b"\n"))
        .and_then(|()| out.flush());
    if let Err(e) = r {
        GONE.store(true, Ordering::Relaxed);
        if e.kind() != std::io::ErrorKind::BrokenPipe {
            FAILED.store(true, Ordering::Relaxed);
            crate::log::note(format_args!(
                "exs: error: writing results to standard output: {e}"
            ));
        }
    }
}

/// A helper server's first and only line, `LISTEN ADDR`, read by the process that started it; an error if it could
/// not be written (that process has gone: nobody will connect).
pub fn announce(addr: impl std::fmt::Display) -> anyhow::Result<()> {
    line(format_args!("LISTEN {addr}"));
    if gone() {
        anyhow::bail!("nobody read this server's address (the process that started it has gone)");
    }
    Ok(())
}

/// Whether results can no longer be written: a loop of measurements may stop.
pub fn gone() -> bool {
    GONE.load(Ordering::Relaxed)
}

/// Whether writing results failed (not for a reader gone): the run fails.
pub fn failed() -> bool {
    FAILED.load(Ordering::Relaxed)
}

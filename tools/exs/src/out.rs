//! Results on standard output. `println!` panics when the reader has gone (`exs pump --json | head -1`: exit
//! status 101 at the next point); [`line`] ends the run quietly instead, as other command-line tools do.

use std::io::Write;

/// `println!` for results, through [`line`].
macro_rules! outln {
    ($($arg:tt)*) => {
        $crate::out::line(format_args!($($arg)*))
    };
}
pub(crate) use outln;

/// Writes a line to standard output. If the reader has gone, the run ends here, with status 0, once the log is
/// flushed: no later result could be read. Any other error is ignored, as a full disk would be by `println!`'s
/// callers.
pub fn line(args: std::fmt::Arguments<'_>) {
    let mut out = std::io::stdout().lock();
    let r = out
        .write_fmt(args)
        .and_then(|()| out.write_all(b"\n"))
        .and_then(|()| out.flush());
    if let Err(e) = r {
        if e.kind() == std::io::ErrorKind::BrokenPipe {
            crate::log::flush(std::time::Duration::from_secs(1));
            std::process::exit(0);
        }
    }
}

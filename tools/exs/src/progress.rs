//! Progress on stderr through indicatif: a bar redrawn in place on a terminal; otherwise the bar is hidden and a
//! plain line is printed every 10% (CI logs stay readable).

use std::io::IsTerminal;
use std::time::Instant;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

use crate::size::fmt_bytes;
use crate::util::fmt_rate;

fn stderr_target() -> (ProgressDrawTarget, bool) {
    if std::io::stderr().is_terminal() {
        (ProgressDrawTarget::stderr(), true)
    } else {
        (ProgressDrawTarget::hidden(), false)
    }
}

/// Bytes moved out of a known total.
pub struct Progress {
    bar: ProgressBar,
    label: String,
    total: u64,
    start: Instant,
    tty: bool,
    last_tenth: u64,
}

impl Progress {
    pub fn new(label: &str, total: u64) -> Self {
        let (target, tty) = stderr_target();
        let bar = ProgressBar::with_draw_target(Some(total.max(1)), target);
        bar.set_style(
            ProgressStyle::with_template(
                "{msg:<20} [{bar:30}] {percent:>3}% {bytes} / {total_bytes}  {bytes_per_sec}  {elapsed}",
            )
            .expect("a valid template")
            .progress_chars("#>."),
        );
        bar.set_message(label.to_string());
        Progress {
            bar,
            label: label.into(),
            total: total.max(1),
            start: Instant::now(),
            tty,
            last_tenth: 0,
        }
    }

    pub fn update(&mut self, done: u64) {
        self.bar.set_position(done);
        if !self.tty {
            let tenth = done * 10 / self.total;
            if tenth > self.last_tenth {
                self.last_tenth = tenth;
                let secs = self.start.elapsed().as_secs_f64().max(1e-9);
                crate::log::note(format_args!(
                    "{:<20} {:>3}% {} / {}  {}",
                    self.label,
                    done * 100 / self.total,
                    fmt_bytes(done),
                    fmt_bytes(self.total),
                    fmt_rate(done as f64 / secs)
                ));
            }
        }
    }

    /// Leaves the finished bar on the terminal.
    pub fn finish(&mut self) {
        self.bar.finish();
    }
}

/// Tests out of a known number (pump, ping): on a terminal only, since the results go to stdout line by line.
/// No ticking thread: it would disturb what is measured; the bar is redrawn between tests.
pub fn points(total: usize) -> ProgressBar {
    let (target, _) = stderr_target();
    let bar = ProgressBar::with_draw_target(Some(total as u64), target);
    bar.set_style(
        ProgressStyle::with_template("{prefix}: [{bar:20}] {pos}/{len} done; now {msg}...")
            .expect("a valid template")
            .progress_chars("#>."),
    );
    bar
}

//! Output that never stops a server: lines go through a bounded queue to a thread of their own that writes them.
//! A reader that stops draining the pipe (a server's log read by a program that hung) then costs lines, not the
//! server: a write to a full pipe blocks, and a server's accepting thread or a client's session blocked in one
//! serves nobody. A line that finds the queue full is counted, and the count is written once lines go out again,
//! where they would have been. `exs` writes its tracing output ([`Stderr`]) and its servers' notes ([`note`]) this
//! way, on standard error, and a `--json` server its reports ([`report`]) on standard output: their count of lines
//! dropped goes to the log, at the next report (standard output carries JSON only, and may stay stalled). It waits
//! for both queues, a bounded time, before it exits ([`flush`]): the reports at most half of it, so that a stalled
//! standard output leaves the log its time.

use std::io::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender, TrySendError};
use std::sync::{Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// One queue and the stream its thread writes to.
struct Lines {
    queue: OnceLock<Queue>,
    /// Standard output (`true`) or standard error.
    stdout: bool,
    /// Lines the queue holds: what a stalled reader costs in memory.
    capacity: usize,
    /// The writing thread's name.
    thread: &'static str,
    /// What its lines are, in the count of those dropped.
    what: &'static str,
}

/// Log lines (short: clients' words in them are shortened), on standard error.
static LOG: Lines = Lines {
    queue: OnceLock::new(),
    stdout: false,
    capacity: 1024,
    thread: "exs-log",
    what: "log lines",
};

/// A `--json` server's reports, a line per test (a few kilobytes at most), on standard output.
static REPORTS: Lines = Lines {
    queue: OnceLock::new(),
    stdout: true,
    capacity: 16,
    thread: "exs-reports",
    what: "report lines",
};

struct Queue {
    /// `None` when no thread could be started: log lines are then written where they are made, and reports
    /// counted.
    tx: Option<SyncSender<Vec<u8>>>,
    /// Lines dropped since their count was last queued (reports: also those never queued for want of a thread).
    dropped: AtomicU64,
    /// Lines queued and not written yet, for [`flush`].
    pending: Mutex<u64>,
    written: Condvar,
}

impl Queue {
    /// A queued line is done with: written (`lost` 0), or dropped with `lost` lines to count. Under the lock of
    /// `pending`, so that the count at exit (`Lines::flush_until`) has a dropped line in one of the two, never both.
    fn settle(&self, lost: u64) {
        let mut pending = self.pending.lock().unwrap_or_else(|p| p.into_inner());
        self.dropped.fetch_add(lost, Ordering::Relaxed);
        *pending -= 1;
        if *pending == 0 {
            self.written.notify_all();
        }
    }
}

impl Lines {
    fn queue(&'static self) -> &'static Queue {
        self.queue.get_or_init(|| {
            let (tx, rx) = sync_channel::<Vec<u8>>(self.capacity);
            let started = std::thread::Builder::new()
                .name(self.thread.into())
                .spawn(move || self.write_queued(rx));
            Queue {
                tx: started.ok().map(|_| tx),
                dropped: AtomicU64::new(0),
                pending: Mutex::new(0),
                written: Condvar::new(),
            }
        })
    }

    /// The writing thread.
    fn write_queued(&'static self, rx: Receiver<Vec<u8>>) {
        // Waits for `queue()`'s first call to finish (this thread starts inside it).
        let q = self.queue();
        for line in rx {
            self.write_now(&line);
            q.settle(0);
        }
    }

    /// Writes, whatever becomes of it (not `eprintln!` or `println!`, which panic when the reader of a pipe went
    /// away).
    fn write_now(&self, line: &[u8]) {
        let _ = if self.stdout {
            std::io::stdout().lock().write_all(line)
        } else {
            std::io::stderr().lock().write_all(line)
        };
    }

    /// The line that says `n` lines were dropped.
    fn count_line(&self, n: u64) -> Vec<u8> {
        let stream = if self.stdout { "output" } else { "error" };
        format!(
            "exs: {n} {} dropped (standard {stream} was not read as fast as they came)\n",
            self.what
        )
        .into_bytes()
    }

    /// Queues one line (ending in a newline), after the count of lines dropped before it, if any (so the count
    /// stands where they would have been; a count of report lines goes to the log instead); a line that finds the
    /// queue full is counted, and so is a count that does. With `patience`, waits that long for room first.
    /// Whether the line went out (queued, or written here).
    fn queue_line(&'static self, line: Vec<u8>, patience: Duration) -> bool {
        let q = self.queue();
        // An empty line carries only the count ([`flush`]): if it finds no room, it is not a line dropped.
        let counted = u64::from(!line.is_empty());
        if self.stdout && q.tx.is_none() {
            // No writing thread: a report is not written on the session's thread (a stalled standard output would
            // hold it, what the queue is for); it is counted, and the count logged at exit.
            q.dropped.fetch_add(counted, Ordering::Relaxed);
            return false;
        }
        let dropped = q.dropped.swap(0, Ordering::Relaxed);
        if dropped == 0 && counted == 0 {
            return true;
        }
        let mut line = match dropped {
            0 => line,
            n if self.stdout => {
                // A count the log had no room for waits for the next report.
                if !LOG.queue_line(self.count_line(n), Duration::ZERO) {
                    q.dropped.fetch_add(n, Ordering::Relaxed);
                }
                if line.is_empty() {
                    return true;
                }
                line
            }
            n => {
                let mut with = self.count_line(n);
                with.extend_from_slice(&line);
                with
            }
        };
        let Some(tx) = &q.tx else {
            // No writing thread (and not a report: above): the line is written here.
            self.write_now(&line);
            return true;
        };
        *q.pending.lock().unwrap_or_else(|p| p.into_inner()) += 1;
        let end = Instant::now() + patience;
        loop {
            match tx.try_send(line) {
                Ok(()) => return true,
                Err(TrySendError::Full(back)) if Instant::now() < end => {
                    line = back;
                    std::thread::sleep(Duration::from_millis(1));
                }
                Err(_) => break,
            }
        }
        // A count of report lines went to the log: only this line is dropped here.
        q.settle(if self.stdout {
            counted
        } else {
            dropped + counted
        });
        false
    }

    /// Waits until every queued line is written (at most until `end`); whether they were.
    fn wait_written(&'static self, end: Instant) -> bool {
        let q = self.queue();
        let mut pending = q.pending.lock().unwrap_or_else(|p| p.into_inner());
        while *pending > 0 {
            let left = end.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            pending = q
                .written
                .wait_timeout(pending, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        true
    }

    /// [`flush`] of this queue, until `end`. For the reports, at exit: those dropped and those still unwritten at
    /// `end` are counted once, in the log.
    fn flush_until(&'static self, end: Instant) {
        // Nothing was ever queued (and the panic hook must not start the writer).
        let Some(q) = self.queue.get() else {
            return;
        };
        if self.stdout {
            // At exit: the reports dropped, and those still unwritten at `end`, in one count.
            self.wait_written(end);
            let pending = q.pending.lock().unwrap_or_else(|p| p.into_inner());
            let lost = q.dropped.swap(0, Ordering::Relaxed) + *pending;
            drop(pending);
            if lost > 0 {
                LOG.queue_line(
                    format!(
                        "exs: {lost} report lines dropped or not written (standard output was not read)\n"
                    )
                    .into_bytes(),
                    Duration::ZERO,
                );
            }
            return;
        }
        if self.wait_written(end) && q.dropped.load(Ordering::Relaxed) > 0 {
            self.queue_line(Vec::new(), Duration::ZERO);
            self.wait_written(end);
        }
    }
}

/// Writes a line to standard error through the queue (dropped, and counted, if the queue is full).
pub fn note(line: std::fmt::Arguments<'_>) {
    LOG.queue_line(format!("{line}\n").into_bytes(), Duration::ZERO);
}

/// [`note`] for a line that matters more than speed (the error `exs` ends with): waits up to `patience` for room.
/// Counted as dropped if none comes.
pub fn note_patiently(line: std::fmt::Arguments<'_>, patience: Duration) {
    LOG.queue_line(format!("{line}\n").into_bytes(), patience);
}

/// Writes a server's report line (`--json`) to standard output through its queue: a reader that stopped costs
/// reports (counted in the log), never the session that made them.
pub fn report(line: std::fmt::Arguments<'_>) {
    REPORTS.queue_line(format!("{line}\n").into_bytes(), Duration::ZERO);
}

/// Waits until every queued line is written, then writes the count of lines dropped since the last one went out,
/// if any; at most `patience` in all (a reader that stopped for good keeps the rest). The reports first, for at most
/// half of it (their count of lines dropped or still unwritten goes to the log), then the log.
pub fn flush(patience: Duration) {
    let start = Instant::now();
    REPORTS.flush_until(start + patience / 2);
    LOG.flush_until(start + patience);
}

/// A panic's message, as the standard hook writes it (with a backtrace where `RUST_BACKTRACE` asks for one),
/// queued after the log lines queued before it; waits at most `patience` for the log to go out. `false` on the
/// log's own writer thread (the caller then uses the standard hook).
pub fn panic_to_log(info: &std::panic::PanicHookInfo<'_>, patience: Duration) -> bool {
    let thread = std::thread::current();
    if thread.name() == Some(LOG.thread) {
        return false;
    }
    let payload = info.payload();
    let message = payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "Box<dyn Any>".into());
    let at = info
        .location()
        .map(|l| format!(" at {l}"))
        .unwrap_or_default();
    let backtrace = std::backtrace::Backtrace::capture();
    let backtrace = match backtrace.status() {
        std::backtrace::BacktraceStatus::Captured => format!("\nstack backtrace:\n{backtrace}"),
        _ => String::new(),
    };
    let name = thread.name().unwrap_or("<unnamed>");
    let end = Instant::now() + patience;
    LOG.queue_line(
        format!("thread '{name}' panicked{at}:\n{message}{backtrace}\n").into_bytes(),
        patience,
    );
    LOG.flush_until(end);
    true
}

/// tracing's writer: each event is gathered, then queued as one line.
pub struct Stderr;

/// One event's text, queued when tracing is done with it.
pub struct Event(Vec<u8>);

impl Write for Event {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        if !self.0.is_empty() {
            LOG.queue_line(std::mem::take(&mut self.0), Duration::ZERO);
        }
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for Stderr {
    type Writer = Event;

    fn make_writer(&'a self) -> Event {
        Event(Vec::new())
    }
}

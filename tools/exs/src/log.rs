//! Standard error that never stops a server: log lines go through a bounded queue to a thread of their own that
//! writes them. A reader that stops draining the pipe (a server's log read by a program that hung) then costs
//! lines, not the server: a write to a full pipe blocks, and a server's accepting thread or a client's session
//! blocked in one serves nobody. A line that finds the queue full is counted, and the count is written once lines
//! go out again, where they would have been. `exs` writes its tracing output ([`Stderr`]) and its servers' notes
//! ([`note`]) this way, and waits for the queue, a bounded time, before it exits ([`flush`]).

use std::io::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender, TrySendError};
use std::sync::{Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// Lines the queue holds: what a stalled reader costs in memory (the lines are short: clients' words in them are
/// shortened).
const QUEUED: usize = 1024;

struct Queue {
    /// `None` when no thread could be started: lines are then written where they are made.
    tx: Option<SyncSender<Vec<u8>>>,
    /// Lines that found the queue full since the last count was written.
    dropped: AtomicU64,
    /// Lines queued and not written yet, for [`flush`].
    pending: Mutex<u64>,
    written: Condvar,
}

static QUEUE: OnceLock<Queue> = OnceLock::new();

fn queue() -> &'static Queue {
    QUEUE.get_or_init(|| {
        let (tx, rx) = sync_channel::<Vec<u8>>(QUEUED);
        let started = std::thread::Builder::new()
            .name("exs-log".into())
            .spawn(move || write_queued(rx));
        Queue {
            tx: started.ok().map(|_| tx),
            dropped: AtomicU64::new(0),
            pending: Mutex::new(0),
            written: Condvar::new(),
        }
    })
}

/// The writing thread.
fn write_queued(rx: Receiver<Vec<u8>>) {
    // Waits for `queue()`'s first call to finish (this thread starts inside it).
    let q = queue();
    for line in rx {
        write_now(&line);
        let mut pending = q.pending.lock().unwrap_or_else(|p| p.into_inner());
        *pending -= 1;
        if *pending == 0 {
            q.written.notify_all();
        }
    }
}

/// Writes, whatever becomes of it (not `eprintln!`, which panics when the reader of a pipe went away).
fn write_now(line: &[u8]) {
    let _ = std::io::stderr().lock().write_all(line);
}

/// Queues one line (ending in a newline), after the count of lines dropped before it, if any (so the count stands
/// where they would have been); a line that finds the queue full is counted, and so is a count that does. With
/// `patience`, waits that long for room first.
fn queue_line(line: Vec<u8>, patience: Duration) {
    let q = queue();
    // An empty line carries only the count ([`flush`]): if it finds no room, it is not a line dropped.
    let counted = u64::from(!line.is_empty());
    let dropped = q.dropped.swap(0, Ordering::Relaxed);
    if dropped == 0 && counted == 0 {
        return;
    }
    let mut line = match dropped {
        0 => line,
        n => {
            let mut with = format!(
                "exs: {n} log lines dropped (standard error was not read as fast as they came)\n"
            )
            .into_bytes();
            with.extend_from_slice(&line);
            with
        }
    };
    let Some(tx) = &q.tx else {
        return write_now(&line);
    };
    *q.pending.lock().unwrap_or_else(|p| p.into_inner()) += 1;
    let end = Instant::now() + patience;
    loop {
        match tx.try_send(line) {
            Ok(()) => return,
            Err(TrySendError::Full(back)) if Instant::now() < end => {
                line = back;
                std::thread::sleep(Duration::from_millis(1));
            }
            Err(_) => break,
        }
    }
    q.dropped.fetch_add(dropped + counted, Ordering::Relaxed);
    let mut pending = q.pending.lock().unwrap_or_else(|p| p.into_inner());
    *pending -= 1;
    if *pending == 0 {
        q.written.notify_all();
    }
}

/// Writes a line to standard error through the queue (dropped, and counted, if the queue is full).
pub fn note(line: std::fmt::Arguments<'_>) {
    queue_line(format!("{line}\n").into_bytes(), Duration::ZERO);
}

/// [`note`] for a line that matters more than speed (the error `exs` ends with): waits up to `patience` for room.
/// Counted as dropped if none comes.
pub fn note_patiently(line: std::fmt::Arguments<'_>, patience: Duration) {
    queue_line(format!("{line}\n").into_bytes(), patience);
}

/// Waits until every queued line is written, then writes the count of lines dropped since the last one went out,
/// if any; at most `patience` in all (a reader that stopped for good keeps the rest).
pub fn flush(patience: Duration) {
    // Nothing was ever queued (and the panic hook must not start the writer).
    if QUEUE.get().is_none() {
        return;
    }
    let end = Instant::now() + patience;
    let wait = || {
        let q = queue();
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
    };
    if wait() && queue().dropped.load(Ordering::Relaxed) > 0 {
        queue_line(Vec::new(), Duration::ZERO);
        wait();
    }
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
            queue_line(std::mem::take(&mut self.0), Duration::ZERO);
        }
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for Stderr {
    type Writer = Event;

    fn make_writer(&'a self) -> Event {
        Event(Vec::new())
    }
}

//! A small progress bar on stderr: redrawn in place on a terminal, a line every 10% otherwise (CI logs).

use std::io::{IsTerminal, Write};
use std::time::Instant;

use crate::util::{fmt_bytes, fmt_rate};

pub struct Progress {
    label: String,
    total: u64,
    start: Instant,
    tty: bool,
    last_tenth: u64,
    last_draw: Instant,
}

impl Progress {
    pub fn new(label: &str, total: u64) -> Self {
        let now = Instant::now();
        Progress {
            label: label.into(),
            total: total.max(1),
            start: now,
            tty: std::io::stderr().is_terminal(),
            last_tenth: 0,
            last_draw: now,
        }
    }

    fn line(&self, done: u64) -> String {
        const W: u64 = 30;
        let filled = (done * W / self.total).min(W) as usize;
        let secs = self.start.elapsed().as_secs_f64().max(1e-9);
        format!(
            "{:<20} [{}{}] {:>3}% {} / {}  {}",
            self.label,
            "#".repeat(filled),
            ".".repeat(W as usize - filled),
            done * 100 / self.total,
            fmt_bytes(done),
            fmt_bytes(self.total),
            fmt_rate(done as f64 / secs)
        )
    }

    pub fn update(&mut self, done: u64) {
        if self.tty {
            if self.last_draw.elapsed().as_millis() >= 50 || done >= self.total {
                eprint!("\r{}", self.line(done));
                let _ = std::io::stderr().flush();
                self.last_draw = Instant::now();
            }
        } else {
            let tenth = done * 10 / self.total;
            if tenth > self.last_tenth {
                self.last_tenth = tenth;
                eprintln!("{}", self.line(done));
            }
        }
    }

    pub fn finish(&mut self) {
        if self.tty {
            eprintln!("\r{}", self.line(self.total));
        }
    }
}

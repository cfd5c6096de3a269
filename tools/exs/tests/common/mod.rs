//! What the tool's tests share: running `exs`, and a server process with its log.

#![allow(dead_code)] // each test file uses its part

use std::io::{BufRead, BufReader};
use std::net::TcpListener;
use std::process::{Child, ChildStderr, ChildStdout, Command, Output, Stdio};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::Value;

pub const EXE: &str = env!("CARGO_BIN_EXE_exs");

pub fn exs(args: &[&str]) -> Output {
    Command::new(EXE)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("the exs binary runs")
}

/// `exs ARGS` started with its standard output and error piped (and no standard input), for a test that reads or
/// closes them while it runs.
pub fn spawn_piped(args: &[&str]) -> Child {
    Command::new(EXE)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("the exs binary runs")
}

/// A TCP port nobody listens on right now.
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A server process, killed if the test fails before it exits, with every line it logged.
pub struct Server {
    child: Option<Child>,
    pub port: u16,
    log: Arc<Mutex<Vec<String>>>,
    /// The read end of its standard error, held and never read ([`Reader::Stalls`]).
    stalled: Option<BufReader<ChildStderr>>,
    /// The read end of its standard output, held and never read ([`Server::start_reporting_unread`]).
    unread_out: Option<ChildStdout>,
}

/// What becomes of the reader of a server's standard error once the server serves.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Reader {
    /// Reads every line (and [`Server::log`] has them).
    Keeps,
    /// Goes away: the server's later lines meet a broken pipe.
    Goes,
    /// Stays, and reads nothing more: the pipe fills.
    Stalls,
}

impl Server {
    /// Starts `exs TOOL --server ARGS` on `port` and waits until it says it serves.
    pub fn start(tool: &str, port: u16, args: &[&str]) -> Server {
        Self::start_logging(tool, port, args, true)
    }

    /// [`Server::start`], with the reader of its standard error gone once it serves (`keep_reading: false`): its
    /// later log lines meet a broken pipe.
    pub fn start_logging(tool: &str, port: u16, args: &[&str], keep_reading: bool) -> Server {
        let reader = if keep_reading {
            Reader::Keeps
        } else {
            Reader::Goes
        };
        Self::start_with(tool, port, args, reader, &[])
    }

    /// [`Server::start`] with variables set (`env`), and what becomes of the reader of its standard error once it
    /// serves.
    pub fn start_with(
        tool: &str,
        port: u16,
        args: &[&str],
        reader: Reader,
        env: &[(&str, &str)],
    ) -> Server {
        Self::spawn(tool, port, args, reader, env, false)
    }

    /// [`Server::start`] with `--json`, its standard output a pipe that nobody reads ([`Server::unread_output`]);
    /// its standard error is read.
    pub fn start_reporting_unread(tool: &str, port: u16, args: &[&str]) -> Server {
        let args: Vec<&str> = args.iter().copied().chain(["--json"]).collect();
        Self::spawn(tool, port, &args, Reader::Keeps, &[], true)
    }

    fn spawn(
        tool: &str,
        port: u16,
        args: &[&str],
        reader: Reader,
        env: &[(&str, &str)],
        piped_out: bool,
    ) -> Server {
        let mut child = Command::new(EXE)
            .args([
                tool,
                "--server",
                "--backend",
                "fabric",
                "--addr",
                "127.0.0.1",
                "-p",
                &port.to_string(),
            ])
            .args(args)
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(if piped_out {
                Stdio::piped()
            } else {
                Stdio::null()
            })
            .stderr(Stdio::piped())
            .spawn()
            .expect("the server starts");
        let unread_out = child.stdout.take();
        let err = child.stderr.take().unwrap();
        let (tx, rx) = mpsc::channel();
        let (stall_tx, stall_rx) = mpsc::channel();
        let log = Arc::new(Mutex::new(Vec::new()));
        let lines = Arc::clone(&log);
        std::thread::spawn(move || {
            let mut r = BufReader::new(err);
            let mut line = String::new();
            while matches!(r.read_line(&mut line), Ok(n) if n > 0) {
                let l = std::mem::take(&mut line);
                let l = l.trim_end_matches('\n');
                eprintln!("server: {l}");
                let serving = l.contains("serving on");
                lines.lock().unwrap().push(l.to_string());
                if serving {
                    if reader == Reader::Stalls {
                        let _ = stall_tx.send(r);
                        let _ = tx.send(());
                        return;
                    }
                    let _ = tx.send(());
                    if reader == Reader::Goes {
                        return;
                    }
                }
            }
        });
        rx.recv_timeout(Duration::from_secs(60))
            .expect("the server says it is serving");
        Server {
            child: Some(child),
            port,
            log,
            stalled: stall_rx.try_recv().ok(),
            unread_out,
        }
    }

    /// The read end of the standard output of a server started by [`Server::start_reporting_unread`].
    pub fn unread_output(&self) -> Option<&ChildStdout> {
        self.unread_out.as_ref()
    }

    /// The read end of a stalled server's standard error ([`Reader::Stalls`]), not read so far: the caller's now.
    pub fn take_stalled_log(&mut self) -> Option<BufReader<ChildStderr>> {
        self.stalled.take()
    }

    /// `127.0.0.1:PORT`, for `--client`.
    pub fn target(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// Every line logged so far.
    pub fn log(&self) -> Vec<String> {
        self.log.lock().unwrap().clone()
    }

    /// Waits until a logged line contains `what` (at most `patience`); returns it.
    pub fn wait_for_log(&self, what: &str, patience: Duration) -> Option<String> {
        let t = Instant::now();
        while t.elapsed() < patience {
            if let Some(l) = self.log().into_iter().find(|l| l.contains(what)) {
                return Some(l);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        None
    }

    /// Whether the process still runs.
    pub fn alive(&mut self) -> bool {
        matches!(self.child.as_mut().unwrap().try_wait(), Ok(None))
    }

    /// A line of its /proc status, in kB (`VmHWM`: peak resident memory; `VmRSS`: now).
    pub fn status_kb(&self, key: &str) -> u64 {
        let pid = self.child.as_ref().unwrap().id();
        let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
        s.lines()
            .find_map(|l| l.strip_prefix(key)?.strip_prefix(':'))
            .and_then(|v| v.split_whitespace().next()?.parse().ok())
            .unwrap_or_else(|| panic!("no {key} in /proc/{pid}/status"))
    }

    /// Waits for it to exit by itself; returns whether it succeeded.
    pub fn wait(mut self) -> bool {
        let mut c = self.child.take().unwrap();
        let t = Instant::now();
        loop {
            if let Some(st) = c.try_wait().unwrap() {
                return st.success();
            }
            if t.elapsed() > Duration::from_secs(60) {
                let _ = c.kill();
                panic!("the --once server did not exit after its client");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(c) = &mut self.child {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Stdout's JSON lines, after checking the command succeeded.
pub fn json_lines(out: &Output) -> Vec<Value> {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "failed: {}\n{stderr}", out.status);
    let stdout = String::from_utf8_lossy(&out.stdout);
    stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON: {l:?}: {e}")))
        .collect()
}

pub fn num(v: &Value, k: &str) -> f64 {
    v[k].as_f64()
        .unwrap_or_else(|| panic!("no number {k} in {v}"))
}

/// An honest client's short test against `server`: a few pings, or a short pump or demo.
pub fn honest(tool: &str, server: &Server) -> Output {
    honest_with(tool, server, &[])
}

/// [`honest`]'s client with `extra` arguments after its own.
pub fn honest_with(tool: &str, server: &Server, extra: &[&str]) -> Output {
    let target = server.target();
    let mut args: Vec<&str> = match tool {
        "ping" => vec![
            "ping", "-c", &target, "--size", "8", "--count", "20", "--mode", "normal", "--json",
        ],
        "pump" => vec![
            "pump",
            "-c",
            &target,
            "--size",
            "4K",
            "--seconds",
            "0.2",
            "--json",
        ],
        _ => vec![
            "demo", "-c", &target, "--size", "256K", "--chunk", "64K", "--no-tcp", "--json",
        ],
    };
    args.extend_from_slice(extra);
    exs(&args)
}

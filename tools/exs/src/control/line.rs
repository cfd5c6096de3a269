//! One line of the control connection, read with a bound on its length and a deadline on its arrival: a peer
//! that sends an endless line, or trickles a byte now and then, costs at most [`MAX_LINE`] bytes and the
//! deadline's time. Whatever a peer sent appears in messages and logs only as a short excerpt.

use std::io::{self, BufRead, BufReader, ErrorKind};
use std::net::TcpStream;
use std::time::Instant;

/// The longest control line accepted (the protocol's lines are a few hundred bytes).
pub const MAX_LINE: usize = 64 << 10;
/// How much of a peer's text a message quotes.
const EXCERPT: usize = 60;

/// Why no line came.
#[derive(Debug)]
pub enum LineError {
    /// Nothing complete arrived before the deadline.
    Silent,
    /// The line went past [`MAX_LINE`] bytes; what it began with.
    TooLong(String),
    /// The connection failed.
    Io(io::Error),
}

impl std::fmt::Display for LineError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            LineError::Silent => f.write_str("no complete line in time"),
            LineError::TooLong(start) => write!(
                f,
                "a line longer than {} KiB (control lines are short), beginning {start}",
                MAX_LINE >> 10
            ),
            LineError::Io(e) => write!(f, "{e}"),
        }
    }
}

impl std::error::Error for LineError {}

/// Reads the next line into `line` (without its newline) before `deadline`; `Ok(false)` at the end of the
/// connection. Never buffers more than `max` bytes of it.
pub fn read_line(
    r: &mut BufReader<TcpStream>,
    line: &mut Vec<u8>,
    max: usize,
    deadline: Instant,
) -> Result<bool, LineError> {
    line.clear();
    loop {
        if r.buffer().is_empty() {
            // Each read waits only for what is left of the deadline: a trickle of bytes cannot extend it.
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(LineError::Silent);
            }
            r.get_ref()
                .set_read_timeout(Some(left))
                .map_err(LineError::Io)?;
        }
        let buf = match r.fill_buf() {
            Ok(b) => b,
            Err(e) if e.kind() == ErrorKind::Interrupted => continue,
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                return Err(LineError::Silent)
            }
            Err(e) => return Err(LineError::Io(e)),
        };
        if buf.is_empty() {
            // The end: a last line without its newline still counts.
            return Ok(!line.is_empty());
        }
        let (take, end) = match buf.iter().position(|&b| b == b'\n') {
            Some(i) => (i, true),
            None => (buf.len(), false),
        };
        if line.len() + take > max {
            let mut start = line[..line.len().min(EXCERPT * 4)].to_vec();
            let more = (EXCERPT * 4 - start.len()).min(buf.len());
            start.extend_from_slice(&buf[..more]);
            return Err(LineError::TooLong(format!("{}...", quote(&start))));
        }
        line.extend_from_slice(&buf[..take]);
        r.consume(take + usize::from(end));
        if end {
            return Ok(true);
        }
    }
}

/// A short, quoted, escaped excerpt of a peer's bytes: at most [`EXCERPT`] characters, with the length when cut.
pub fn excerpt(b: &[u8]) -> String {
    let q = quote(b);
    if b.len() > EXCERPT {
        format!("{q}... ({} bytes)", b.len())
    } else {
        q
    }
}

/// The first [`EXCERPT`] characters of `b`, quoted and escaped.
fn quote(b: &[u8]) -> String {
    let text = String::from_utf8_lossy(&b[..b.len().min(EXCERPT * 4)]);
    let s: String = text.chars().take(EXCERPT).collect();
    format!("{s:?}")
}

/// At most `max` characters of a message that may quote a peer (serde's errors quote the value they refused).
/// Control characters, backslashes and the characters that reorder text on screen are escaped (`\n`, `\\`,
/// `\u{1b}`, `\u{202e}`): text a peer sent must not add lines to the log it goes into, fake an escape, send
/// escape sequences to a terminal or make a line display other than it reads.
pub fn shorten(s: &str, max: usize) -> String {
    let mut t = String::new();
    for (i, c) in s.chars().enumerate() {
        if i == max {
            t.push_str("...");
            break;
        }
        if c.is_control() || c == '\\' || reorders(c) {
            t.extend(c.escape_default());
        } else {
            t.push(c);
        }
    }
    t
}

/// The Unicode bidirectional marks, embeddings, overrides and isolates.
fn reorders(c: char) -> bool {
    matches!(c, '\u{061c}' | '\u{200e}' | '\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}')
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::net::TcpListener;
    use std::time::Duration;

    fn pair() -> (TcpStream, BufReader<TcpStream>) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let c = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        (c, BufReader::new(l.accept().unwrap().0))
    }

    fn soon() -> Instant {
        Instant::now() + Duration::from_secs(5)
    }

    #[test]
    fn lines_split_at_newlines_and_the_last_needs_none() {
        let (mut c, mut r) = pair();
        c.write_all(b"one\ntwo\nthree").unwrap();
        drop(c);
        let mut l = Vec::new();
        for want in ["one", "two", "three"] {
            assert!(read_line(&mut r, &mut l, 100, soon()).unwrap());
            assert_eq!(l, want.as_bytes());
        }
        assert!(!read_line(&mut r, &mut l, 100, soon()).unwrap());
    }

    #[test]
    fn a_line_longer_than_the_bound_is_refused_without_reading_it_all() {
        let (mut c, mut r) = pair();
        let w = std::thread::spawn(move || {
            // Far more than the bound, and never a newline: only the bound is ever held by the reader.
            let chunk = vec![b'a'; 1 << 20];
            for _ in 0..64 {
                if c.write_all(&chunk).is_err() {
                    break;
                }
            }
        });
        let mut l = Vec::new();
        match read_line(&mut r, &mut l, 1000, soon()) {
            Err(LineError::TooLong(start)) => {
                assert!(start.starts_with("\"aaaa"), "{start}");
                assert!(start.len() < 100, "{start}");
            }
            other => panic!("{other:?}"),
        }
        assert!(
            l.capacity() <= 1000 + (8 << 10),
            "held {} bytes",
            l.capacity()
        );
        drop(r);
        w.join().unwrap();
    }

    #[test]
    fn a_trickle_of_bytes_does_not_extend_the_deadline() {
        let (mut c, mut r) = pair();
        let w = std::thread::spawn(move || {
            for _ in 0..30 {
                if c.write_all(b"x").is_err() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        });
        let t = Instant::now();
        let mut l = Vec::new();
        let r2 = read_line(
            &mut r,
            &mut l,
            100,
            Instant::now() + Duration::from_millis(500),
        );
        assert!(matches!(r2, Err(LineError::Silent)), "{r2:?}");
        assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
        drop(r);
        w.join().unwrap();
    }

    #[test]
    fn excerpts_are_short_and_escaped() {
        assert_eq!(excerpt(b"hi"), "\"hi\"");
        let e = excerpt(&[b'\n'; 1000]);
        assert!(
            e.starts_with("\"\\n\\n") && e.ends_with("(1000 bytes)"),
            "{e}"
        );
        assert!(e.len() < 160);
        assert_eq!(shorten("abcdef", 3), "abc...");
    }

    /// A client's hello named its tool `x\nexs demo: client 10.9.9.9:1: done (3 tests)`, and the server's log got
    /// a second line that no client's end had written.
    #[test]
    fn text_from_a_peer_is_shortened_onto_one_line_without_control_characters() {
        let s = shorten("x\nexs demo: client 10.9.9.9:1: done\r\u{1b}[31m", 200);
        assert!(!s.chars().any(char::is_control), "{s:?}");
        assert_eq!(s, "x\\nexs demo: client 10.9.9.9:1: done\\r\\u{1b}[31m");
        assert_eq!(shorten("ab\ncd", 3), "ab\\n...");
        assert_eq!(
            shorten("a\\nb", 10),
            "a\\\\nb",
            "a backslash cannot fake an escape"
        );
        assert_eq!(shorten("x\u{202e}y", 10), "x\\u{202e}y");
    }
}

//! `exs_sendfile` through the C functions, on the simulated fabric (`EXS_BACKEND=sim`).

use std::io::Write;
use std::os::fd::AsRawFd;
use std::ptr;
use std::sync::{Mutex, MutexGuard};

use exs_capi::abi::exs_qhandle_t;
use exs_capi::data::exs_sendfile;
use exs_capi::queue::{exs_qcreate, exs_qdelete};
use exs_capi::socket::{exs_close, exs_socket};

mod common;
use common::{errno, init_sim};

/// The tests change the process's descriptor limit: one at a time.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

/// The lock, the simulated context and a queue.
fn setup() -> (MutexGuard<'static, ()>, exs_qhandle_t) {
    let one = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    init_sim();
    let q = exs_qcreate(4);
    assert!(q > 0, "errno {}", errno());
    (one, q)
}

/// A file of `len` bytes.
fn file_of(len: usize) -> std::fs::File {
    let mut f = tempfile::tempfile().unwrap();
    f.write_all(&vec![7; len]).unwrap();
    f
}

/// A SOCK_STREAM sendfile copies `in_fd`, to read it after the call returns; when no descriptor was left for the
/// copy the call failed with `EBADF`, as if `in_fd` were not open. Now it is `EMFILE`, the copy's own errno.
#[test]
fn a_sendfile_without_a_descriptor_left_reports_emfile() {
    let (_one, q) = setup();
    let s = exs_socket(libc::AF_INET, libc::SOCK_STREAM, 0);
    assert!(s > 0, "errno {}", errno());
    let file = file_of(100);
    // SAFETY: dup only reads the descriptor number; the copy (the lowest descriptor free) is this test's.
    let free = unsafe { libc::dup(file.as_raw_fd()) };
    assert!(free >= 0, "errno {}", errno());
    // SAFETY: `free` is the copy just made, which nothing else uses.
    let closed = unsafe { libc::close(free) };
    assert_eq!(closed, 0);
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes the rlimit it is given.
    let got = unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) };
    assert_eq!(got, 0);
    // No descriptor free below the limit: every one below `free` is open.
    let tight = libc::rlimit {
        rlim_cur: free as libc::rlim_t,
        rlim_max: limit.rlim_max,
    };
    // SAFETY: setrlimit reads the rlimit it is given; the old limit is restored below.
    assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &tight) }, 0);
    let r = exs_sendfile(s, file.as_raw_fd(), 0, 10, 0, q, ptr::null_mut());
    let e = errno();
    // SAFETY: as above.
    assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &limit) }, 0);
    assert_eq!((r, e), (-1, libc::EMFILE));
    // A descriptor that is not open is still EBADF.
    let r = exs_sendfile(s, -1, 0, 10, 0, q, ptr::null_mut());
    assert_eq!((r, errno()), (-1, libc::EBADF));
    assert_eq!(exs_close(s), 0);
    assert_eq!(exs_qdelete(q), 0);
}

/// A SOCK_SEQPACKET sendfile holds its whole range in registered memory, and it took that memory for `count`
/// before looking at the file: 2^60 bytes of a 1 KiB file failed with `ENOMEM` (64 GiB tried to pin 64 GiB).
/// Now a range past the end of the file is `EINVAL` before any memory is taken.
#[test]
fn a_seqpacket_sendfile_past_the_end_of_a_small_file_is_einval_not_an_allocation() {
    let (_one, q) = setup();
    let s = exs_socket(libc::AF_INET, libc::SOCK_SEQPACKET, 0);
    assert!(s > 0, "errno {}", errno());
    let file = file_of(1024);
    for count in [1usize << 60, 64 << 30, 1025] {
        let r = exs_sendfile(s, file.as_raw_fd(), 0, count, 0, q, ptr::null_mut());
        assert_eq!((r, errno()), (-1, libc::EINVAL), "count {count}");
    }
    assert_eq!(exs_close(s), 0);
    assert_eq!(exs_qdelete(q), 0);
}

/// A file exs cannot read reached C as `EIO`, the errno the API keeps for a panic: the read's error kept only its
/// `io::ErrorKind`, and `EBADF` or `EISDIR` have none of their own. Now the system call's code is the errno.
#[test]
fn a_file_that_cannot_be_read_gives_the_reads_own_errno() {
    let (_one, q) = setup();
    for ty in [libc::SOCK_SEQPACKET, libc::SOCK_STREAM] {
        let s = exs_socket(libc::AF_INET, ty, 0);
        assert!(s > 0, "errno {}", errno());
        let dir = std::fs::File::open(std::env::temp_dir()).unwrap();
        let r = exs_sendfile(s, dir.as_raw_fd(), 0, 10, 0, q, ptr::null_mut());
        assert_eq!((r, errno()), (-1, libc::EISDIR), "a directory, type {ty}");
        let path =
            std::env::temp_dir().join(format!("exs-capi-wronly-{}-{ty}", std::process::id()));
        let mut wronly = std::fs::File::create(&path).unwrap();
        wronly.write_all(&[1; 100]).unwrap();
        let r = exs_sendfile(s, wronly.as_raw_fd(), 0, 10, 0, q, ptr::null_mut());
        let e = errno();
        let _ = std::fs::remove_file(&path);
        assert_eq!(
            (r, e),
            (-1, libc::EBADF),
            "a file open for writing only, type {ty}"
        );
        assert_eq!(exs_close(s), 0);
    }
    assert_eq!(exs_qdelete(q), 0);
}

/// A SOCK_STREAM sendfile read its range as it went: a range past the end of a file of more than a chunk was found
/// only once part of the file had gone (the call succeeded, the connection was then reset), one within the first
/// chunks failed the call. Now both socket types refuse it at once.
#[test]
fn a_stream_sendfile_past_the_end_of_a_file_is_einval() {
    let (_one, q) = setup();
    let s = exs_socket(libc::AF_INET, libc::SOCK_STREAM, 0);
    assert!(s > 0, "errno {}", errno());
    for (len, count) in [(100_000, 200_000), (3 << 20, 4 << 20)] {
        let file = file_of(len);
        let r = exs_sendfile(s, file.as_raw_fd(), 0, count, 0, q, ptr::null_mut());
        assert_eq!((r, errno()), (-1, libc::EINVAL), "{count} bytes of {len}");
    }
    assert_eq!(exs_close(s), 0);
    assert_eq!(exs_qdelete(q), 0);
}

/// Whether a write lock on all of the file would conflict with a lock held on it, asked through `other`, a second
/// open file description of it (an open file description lock conflicts with the process's own POSIX record
/// locks). `other` stays open while the locks are looked at: closing it would release them too.
fn locked(other: &std::fs::File) -> bool {
    // SAFETY: flock is plain data; all-zero is a valid value, filled in below.
    let mut fl: libc::flock = unsafe { std::mem::zeroed() };
    fl.l_type = libc::F_WRLCK as libc::c_short;
    fl.l_whence = libc::SEEK_SET as libc::c_short;
    // SAFETY: F_OFD_GETLK reads and writes the flock it is given.
    let r = unsafe { libc::fcntl(other.as_raw_fd(), libc::F_OFD_GETLK, &mut fl) };
    assert_eq!(r, 0, "errno {}", errno());
    fl.l_type != libc::F_UNLCK as libc::c_short
}

/// A review found it: `exs_sendfile` read through a copy of `in_fd` that it closed when the call returned, and
/// closing any descriptor of a file releases the process's POSIX record locks on it: a lock the program held on
/// the file was gone after a SOCK_SEQPACKET sendfile. The call now reads the caller's descriptor itself.
#[test]
fn a_seqpacket_sendfile_leaves_the_callers_record_locks_on_the_file() {
    let (_one, q) = setup();
    let s = exs_socket(libc::AF_INET, libc::SOCK_SEQPACKET, 0);
    assert!(s > 0, "errno {}", errno());
    let file = file_of(4096);
    let other = std::fs::File::open(format!("/proc/self/fd/{}", file.as_raw_fd())).unwrap();
    // SAFETY: flock is plain data; all-zero is a valid value, filled in below.
    let mut fl: libc::flock = unsafe { std::mem::zeroed() };
    fl.l_type = libc::F_WRLCK as libc::c_short;
    fl.l_whence = libc::SEEK_SET as libc::c_short;
    // SAFETY: F_SETLK reads the flock it is given.
    let r = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_SETLK, &fl) };
    assert_eq!(r, 0, "errno {}", errno());
    assert!(locked(&other), "the lock is taken");
    // Not connected: the range is read, then the send is refused.
    let r = exs_sendfile(s, file.as_raw_fd(), 0, 4096, 0, q, ptr::null_mut());
    assert_eq!((r, errno()), (-1, libc::ENOTCONN));
    assert!(locked(&other), "the caller's lock was released by the call");
    assert_eq!(exs_close(s), 0);
    assert_eq!(exs_qdelete(q), 0);
}

//! `exs_mregister` through the C functions, on the simulated fabric (`EXS_BACKEND=sim`).

use exs_capi::abi::{EXS_ACCESS_READ, EXS_ACCESS_WRITE};
use exs_capi::memory::{exs_mderegister, exs_mregister};
use libc::{c_int, c_void};

mod common;
use common::{errno, init_sim};

/// Registering memory registered already made a second region with a lease table of its own: a receive into
/// the bytes through one handle and a send of them through the other ran at once (with small messages, two
/// plain CPU copies of the same bytes, a data race), where one region refuses the second with `EBUSY`. Now a
/// range that overlaps a registered one is refused, and ranges side by side are not.
#[test]
fn a_range_overlapping_registered_memory_is_refused() {
    init_sim();
    let mut mem = vec![0u8; 3 * 4096];
    let base = mem.as_mut_ptr();
    let at = |off: usize| base.wrapping_add(off).cast::<c_void>();
    let both = EXS_ACCESS_READ | EXS_ACCESS_WRITE;
    // Every registration below is of `mem`, which outlives them: each is deregistered before it is dropped.
    let register = |off: usize, len: usize, access: c_int| {
        // SAFETY: `mem` is readable and writable for `off..off + len` and outlives the registration (above).
        unsafe { exs_mregister(at(off), len, access) }
    };
    let mid = register(4096, 4096, EXS_ACCESS_WRITE);
    assert!(mid > 0, "errno {}", errno());
    for (off, len, what) in [
        (4096, 4096, "the same range"),
        (4096 + 100, 10, "inside it"),
        (4000, 200, "across its start"),
        (8000, 200, "across its end"),
        (0, 3 * 4096, "around it"),
    ] {
        let h = register(off, len, EXS_ACCESS_READ);
        assert_eq!((h, errno()), (-1, libc::EBUSY), "{what}");
    }
    let before = register(0, 4096, both);
    let after = register(8192, 4096, both);
    assert!(before > 0 && after > 0, "side by side: errno {}", errno());
    for h in [mid, before, after] {
        assert_eq!(exs_mderegister(h), 0, "errno {}", errno());
    }
    // Once deregistered, the range may be registered again.
    let again = register(4096, 4096, both);
    assert!(again > 0, "errno {}", errno());
    assert_eq!(exs_mderegister(again), 0);
    drop(mem);
}

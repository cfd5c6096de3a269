use super::*;

#[test]
fn copy_into_moves_bytes_from_a_shared_device_range_in_one_copy() {
    let src = Arc::new(DmaBuf::from_vec((0..=255u8).cycle().take(10_000).collect()));
    // The ring's own lease: a device may write any of it at any time.
    let _ring = src.lease(0..10_000, LeaseKind::DeviceWriteShared).unwrap();
    let dst = Arc::new(DmaBuf::new(10_000));
    let mut recv = dst.lease(100..9_100, LeaseKind::DeviceWrite).unwrap();
    src.copy_into(5_000, &mut recv, 10, 4_000).unwrap();
    drop(recv);
    let mut out = vec![0u8; 4_000];
    dst.read_at(110, &mut out).unwrap();
    let want: Vec<u8> = (0..=255u8).cycle().skip(5_000 % 256).take(4_000).collect();
    assert_eq!(out, want);
    let read_only = dst.lease(0..10, LeaseKind::DeviceRead).unwrap();
    let mut ro = read_only;
    assert!(
        src.copy_into(0, &mut ro, 0, 10).is_err(),
        "a read lease is not a destination"
    );
    let mut small = dst.lease(20..30, LeaseKind::DeviceWrite).unwrap();
    assert!(
        src.copy_into(0, &mut small, 5, 10).is_err(),
        "out of the destination's bounds"
    );
    assert!(
        src.copy_into(9_995, &mut small, 0, 10).is_err(),
        "out of the source's bounds"
    );
}

#[test]
fn allocated_buffers_are_not_inherited_by_a_child_process() {
    // Issue 15 (fork safety): the kernel marks such a mapping "wf" (wipe on fork; "dc", do not copy, on a kernel
    // without it) in /proc/self/smaps.
    let b = DmaBuf::new(3 * PAGE + 100);
    let addr = b.addr();
    let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
    let mut inside = false;
    let mut flags = None;
    for line in smaps.lines() {
        if let Some((range, _)) = line.split_once(' ') {
            if let Some((lo, hi)) = range.split_once('-') {
                if let (Ok(lo), Ok(hi)) = (u64::from_str_radix(lo, 16), u64::from_str_radix(hi, 16))
                {
                    inside = lo <= addr && addr < hi;
                    continue;
                }
            }
        }
        if inside {
            if let Some(f) = line.strip_prefix("VmFlags:") {
                flags = Some(f.to_string());
                break;
            }
        }
    }
    let flags = flags.expect("the buffer's mapping is in /proc/self/smaps");
    assert!(
        flags.split_whitespace().any(|f| f == "wf" || f == "dc"),
        "the buffer's pages would be copied into a child: VmFlags{flags}"
    );
}

/// Review: with `MADV_DONTFORK` a forked child kept the arena's records and every buffer made before the fork, but
/// not their memory: reading such a buffer in the child (safe code) faulted. With `MADV_WIPEONFORK` the child has
/// the memory, zero-filled and its own.
#[test]
fn a_buffer_made_before_a_fork_reads_zeros_in_the_child() {
    let b = DmaBuf::new(2 * PAGE);
    b.write_at(100, b"parent").unwrap();
    // SAFETY: the child only reads this test's buffer (its own table lock, which no other thread holds) and
    // leaves with `_exit`, running no destructor or atexit handler of the parent's.
    match unsafe { libc::fork() } {
        0 => {
            let mut got = [9u8; 6];
            let ok = b.read_at(100, &mut got).is_ok() && got == [0; 6];
            // SAFETY: ends the child at once.
            unsafe { libc::_exit(if ok { 0 } else { 1 }) }
        }
        -1 => panic!("fork failed"),
        child => {
            let mut status = 0;
            // SAFETY: waits for the child just forked.
            assert_eq!(unsafe { libc::waitpid(child, &mut status, 0) }, child);
            assert!(
                libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
                "the child read the buffer wrongly or faulted (status {status:#x})"
            );
            let mut got = [0u8; 6];
            b.read_at(100, &mut got).unwrap();
            assert_eq!(&got, b"parent", "the parent's bytes stay");
        }
    }
}

/// Review: an empty lease (here the empty half of a `split_at`) counted as overlapping every range around its
/// position, so a borrow of the bytes around it was refused as busy.
#[test]
fn an_empty_lease_takes_no_byte() {
    let b = DmaBuf::new(100);
    let l = b.lease(10..20, LeaseKind::DeviceWrite).unwrap();
    let (empty, rest) = l.split_at(0);
    drop(rest);
    assert!(empty.is_empty());
    assert!(!b.is_range_leased(0..100), "an empty lease holds no byte");
    assert!(
        b.with_slice(0..100, |s| s.len()).is_ok(),
        "a borrow around it is not busy"
    );
    let again = b.lease(0..100, LeaseKind::DeviceWrite);
    assert!(again.is_ok(), "a lease over it is not busy: {again:?}");
    drop(empty);
}

#[test]
fn new_buffer_is_zeroed_and_page_aligned() {
    let b = DmaBuf::new(10_000);
    assert_eq!(b.addr() % PAGE as u64, 0);
    let mut out = vec![1u8; 10_000];
    b.read_at(0, &mut out).unwrap();
    assert!(out.iter().all(|&x| x == 0));
}

#[test]
fn vec_round_trip_keeps_bytes_and_needs_sole_ownership() {
    let b = DmaBuf::from_vec(b"hello".to_vec());
    let lease = b.lease(0..5, LeaseKind::DeviceRead).unwrap();
    let (b, err) = DmaBuf::into_vec(b).unwrap_err();
    assert_eq!(err, DmaError::InUse { leases: 1 });
    drop(lease);
    assert_eq!(DmaBuf::into_vec(b).unwrap(), b"hello");
}

#[test]
fn foreign_memory_is_leased_in_place_and_left_to_its_owner() {
    let mut owner = vec![7u8; 64];
    let ptr = NonNull::new(owner.as_mut_ptr()).unwrap();
    // SAFETY: `owner` outlives `b` (dropped below before `owner` is read) and is not touched while `b` lives.
    let b = unsafe { DmaBuf::from_raw_parts(ptr, 16) };
    assert_eq!(
        b.addr(),
        ptr.as_ptr() as u64,
        "no copy: the device sees the owner's bytes"
    );
    assert_eq!(b.len(), 16);
    b.write_at(4, b"abcd").unwrap();
    let recv = b.lease(0..8, LeaseKind::DeviceWrite).unwrap();
    assert!(
        b.write_at(0, b"x").is_err(),
        "the table guards foreign memory too"
    );
    assert!(
        b.lease(15..17, LeaseKind::DeviceRead).is_err(),
        "bounds are the range handed over"
    );
    drop(recv);
    assert_eq!(
        DmaBuf::into_vec(Arc::clone(&b)).unwrap_err().1,
        DmaError::InUse { leases: 0 }
    );
    // The last handle goes: nothing is freed, the owner's bytes are as written.
    assert_eq!(
        DmaBuf::into_vec(b).unwrap(),
        b"\x07\x07\x07\x07abcd\x07\x07\x07\x07\x07\x07\x07\x07"
    );
    assert_eq!(&owner[..10], b"\x07\x07\x07\x07abcd\x07\x07");
    owner.push(1);
}

#[test]
fn a_trusted_key_goes_over_leases_held_and_leaves_the_cpu_only_copies() {
    let b = DmaBuf::new(100);
    let _borrow = b.lease(0..10, LeaseKind::CpuRead).unwrap();
    let _recv = b.lease(10..20, LeaseKind::DeviceWrite).unwrap();
    let key = b.lease(0..100, LeaseKind::TrustedKey).unwrap();
    // Operations keep taking their own leases under the key.
    let _send = b.lease(30..40, LeaseKind::DeviceRead).unwrap();
    let _recv2 = b.lease(40..50, LeaseKind::DeviceWrite).unwrap();
    // The CPU copies (atomically) but does not borrow while the peer may write any byte.
    b.write_at(60, b"abc").unwrap();
    let mut out = [0u8; 3];
    b.read_at(60, &mut out).unwrap();
    assert_eq!(&out, b"abc");
    assert!(matches!(
        b.with_slice(60..63, |_| ()),
        Err(DmaError::Busy { .. })
    ));
    assert!(matches!(
        b.with_slice_mut(60..63, |_| ()),
        Err(DmaError::Busy { .. })
    ));
    // It counts as a lease (the region cannot be deregistered under it), and borrows come back without it.
    assert_eq!(b.lease_count(), 5);
    drop(key);
    assert_eq!(b.with_slice(60..63, |s| s.to_vec()).unwrap(), b"abc");
}

#[test]
fn a_trusted_key_is_refused_beside_a_borrow_of_the_bytes() {
    // A reference to the bytes must not see a peer's writes: the key is refused while one lives, as a borrow is
    // refused while a key is held, and goes over the range once the borrow ended.
    let b = DmaBuf::new(100);
    let refused = b.with_slice(10..20, |_| b.lease(0..100, LeaseKind::TrustedKey).err());
    assert!(
        matches!(refused, Ok(Some(DmaError::Busy { .. }))),
        "{refused:?}"
    );
    let refused = b.with_slice_mut(10..20, |_| b.lease(0..100, LeaseKind::TrustedKey).err());
    assert!(
        matches!(refused, Ok(Some(DmaError::Busy { .. }))),
        "{refused:?}"
    );
    // A CPU lease that only copies through itself is no borrow of references.
    let cpu = b.lease(10..20, LeaseKind::CpuRead).unwrap();
    let key = b.lease(0..100, LeaseKind::TrustedKey).unwrap();
    drop((cpu, key));
    // A borrow split in two stays a borrow.
    let (first, _second) = b
        .lease_for(0..20, LeaseKind::CpuRead, Some(CpuMode::Refs))
        .unwrap()
        .split_at(10);
    assert!(b.lease(0..100, LeaseKind::TrustedKey).is_err());
    drop(first);
}

#[test]
fn a_trusted_key_waits_for_a_plain_copy_in_progress() {
    // A long copy that found no racy lease copies without atomics; a trusted key taken meanwhile would let a peer
    // write the bytes under it. The key waits for the copy to end, and copies after it are atomic.
    let b = DmaBuf::new(64 << 10);
    let range = 0..64 << 10;
    let (taken, key_taken) = std::sync::mpsc::channel();
    let taker = b.accessing(&range, false, |racy| {
        assert!(!racy, "nothing racy overlaps the copy");
        let theirs = Arc::clone(&b);
        let taker = std::thread::spawn(move || {
            let key = theirs.lease(0..64 << 10, LeaseKind::TrustedKey).unwrap();
            taken.send(()).unwrap();
            key
        });
        // The key comes to wait (ten seconds at most for its thread to get there), and is not taken.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while !b.table().key_waits() && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        assert!(b.table().key_waits(), "the key never came to wait");
        assert!(
            key_taken
                .recv_timeout(std::time::Duration::from_millis(50))
                .is_err(),
            "a trusted key was taken during a plain copy"
        );
        // While the key waits, accesses that begin are atomic, so that the wait ends.
        assert!(b.accessing(&(0..64 << 10), false, |racy| racy));
        taker
    });
    key_taken
        .recv_timeout(std::time::Duration::from_secs(10))
        .expect("the key is taken once the copy ended");
    let _key = taker.join().unwrap();
    assert!(
        b.accessing(&range, false, |racy| racy),
        "copies under the key are atomic"
    );
    assert!(!b.table().plain_overlaps(&range));
}

#[test]
fn a_short_access_runs_under_the_table_s_lock_and_is_not_recorded() {
    let b = DmaBuf::new(64 << 10);
    b.accessing(&(0..COPY_UNDER_LOCK), false, |racy| {
        assert!(!racy);
        assert!(
            b.leases.try_lock().is_err(),
            "the table's lock is held: no key can come"
        );
    });
    assert!(!b.table().plain_overlaps(&(0..64 << 10)));
}

/// Runs `op` again and again in a thread until a plain access shows over `range` of every buffer of `bufs`
/// (each at least once), or for ten seconds; returns whether all did.
fn shows_plain(bufs: &[&Arc<DmaBuf>], range: Range<usize>, op: impl Fn() + Send + 'static) -> bool {
    use std::sync::atomic::AtomicBool;
    let stop = Arc::new(AtomicBool::new(false));
    let running = {
        let stop = Arc::clone(&stop);
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                op();
            }
        })
    };
    let mut seen = vec![false; bufs.len()];
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while !seen.iter().all(|s| *s) && std::time::Instant::now() < deadline {
        for (s, b) in seen.iter_mut().zip(bufs) {
            *s |= b.table().plain_overlaps(&range);
        }
    }
    stop.store(true, Ordering::Relaxed);
    running.join().unwrap();
    seen.iter().all(|s| *s)
}

#[test]
fn every_long_access_without_atomics_is_recorded_while_it_runs() {
    // What a trusted key waits for: each way of touching more than a short copy's bytes records itself.
    const N: usize = 16 << 20;
    let a = DmaBuf::new(N);
    let b = DmaBuf::new(N);
    let whole = 0..N;
    let (a2, b2) = (Arc::clone(&a), Arc::clone(&b));
    assert!(
        shows_plain(&[&a], whole.clone(), move || {
            let mut out = vec![0u8; N];
            a2.read_at(0, &mut out).unwrap();
        }),
        "read_at"
    );
    let a2 = Arc::clone(&a);
    assert!(
        shows_plain(&[&a], whole.clone(), move || {
            a2.write_at(0, &vec![1u8; N]).unwrap();
        }),
        "write_at"
    );
    let a2 = Arc::clone(&a);
    let dst = std::sync::Mutex::new(b2.lease(0..N, LeaseKind::DeviceWrite).unwrap());
    assert!(
        shows_plain(&[&a, &b], whole.clone(), move || {
            a2.copy_into(0, &mut dst.lock().unwrap(), 0, N).unwrap();
        }),
        "copy_into, both sides"
    );
    let src = a.lease(0..N, LeaseKind::DeviceRead).unwrap();
    let dst = std::sync::Mutex::new(b.lease(0..N, LeaseKind::DeviceWrite).unwrap());
    assert!(
        shows_plain(&[&a, &b], whole.clone(), move || {
            src.copy_to(0, &mut dst.lock().unwrap(), 0, N).unwrap();
        }),
        "copy_to, both sides"
    );
    let dst = std::sync::Mutex::new(b.lease(0..N, LeaseKind::DeviceWrite).unwrap());
    assert!(
        shows_plain(&[&b], whole.clone(), move || {
            let mut d = dst.lock().unwrap();
            d.write(0, &vec![2u8; N]).unwrap();
            let mut out = vec![0u8; N];
            d.read(0, &mut out).unwrap();
        }),
        "a lease's read and write"
    );
    assert!(!a.table().plain_overlaps(&whole) && !b.table().plain_overlaps(&whole));
    assert_eq!((a.lease_count(), b.lease_count()), (0, 0));
}

#[test]
fn device_write_excludes_everything_overlapping() {
    let b = DmaBuf::new(100);
    let _w = b.lease(10..20, LeaseKind::DeviceWrite).unwrap();
    for kind in [
        LeaseKind::DeviceRead,
        LeaseKind::DeviceWrite,
        LeaseKind::CpuRead,
        LeaseKind::CpuWrite,
    ] {
        assert!(
            matches!(b.lease(15..25, kind), Err(DmaError::Busy { .. })),
            "{kind:?}"
        );
    }
    assert!(b.read_at(19, &mut [0u8; 1]).is_err());
    // Disjoint ranges are fine; touching ranges do not overlap.
    b.lease(20..30, LeaseKind::DeviceWrite).unwrap();
    b.read_at(0, &mut [0u8; 10]).unwrap();
}

#[test]
fn device_read_allows_cpu_read_but_not_write() {
    let b = DmaBuf::new(100);
    let _r = b.lease(0..50, LeaseKind::DeviceRead).unwrap();
    b.lease(0..50, LeaseKind::DeviceRead).unwrap();
    b.with_slice(0..50, |s| assert_eq!(s.len(), 50)).unwrap();
    assert!(b.write_at(0, &[1]).is_err());
    assert!(b.with_slice_mut(40..60, |_| ()).is_err());
}

#[test]
fn persistent_kinds_allow_copies_but_not_borrows() {
    let b = DmaBuf::new(64);
    let mut remote = b.lease(0..64, LeaseKind::DeviceWriteShared).unwrap();
    remote.write(0, b"new").unwrap();
    let mut out = [0u8; 3];
    b.read_at(0, &mut out).unwrap();
    assert_eq!(&out, b"new");
    assert!(
        b.with_slice(0..3, |_| ()).is_err(),
        "a borrow next to a remote writer must be refused"
    );
    assert!(
        b.write_at(0, b"x").is_err(),
        "the CPU may not write where the remote writes"
    );

    let c = DmaBuf::new(64);
    let _reader = c.lease(0..64, LeaseKind::DeviceReadShared).unwrap();
    c.write_at(0, b"update").unwrap();
    assert!(c.with_slice_mut(0..6, |_| ()).is_err());
}

#[test]
fn split_and_narrow_keep_exclusion_and_release_the_rest() {
    let b = DmaBuf::new(100);
    let l = b.lease(0..100, LeaseKind::DeviceWrite).unwrap();
    let (a, c) = l.split_at(40);
    assert_eq!((a.offset(), a.len(), c.offset(), c.len()), (0, 40, 40, 60));
    drop(a);
    b.read_at(0, &mut [0u8; 40]).unwrap();
    assert!(b.read_at(40, &mut [0u8; 1]).is_err());
    let mid = c.narrow(10..20);
    assert_eq!((mid.offset(), mid.len()), (50, 10));
    assert_eq!(b.lease_count(), 1);
    b.read_at(40, &mut [0u8; 10]).unwrap();
    b.read_at(60, &mut [0u8; 40]).unwrap();
}

#[test]
fn a_copy_is_racy_exactly_while_a_shared_lease_overlaps_it() {
    // The table counts the shared leases it holds; a copy looks for an overlapping one only when there are some.
    let b = DmaBuf::new(4096);
    let plain = b.lease(0..1024, LeaseKind::DeviceRead).unwrap();
    assert!(!b.racy(&(0..4096)));
    let shared = b.lease(1024..2048, LeaseKind::DeviceWriteShared).unwrap();
    assert!(b.racy(&(1000..1100)) && !b.racy(&(0..1024)) && !b.racy(&(2048..4096)));
    // Split in two, each half still counts; the other leases come and go around it.
    let (low, high) = shared.split_at(512);
    let tmp = b.lease(3000..3100, LeaseKind::CpuWrite).unwrap();
    drop(tmp);
    assert!(b.racy(&(1100..1200)) && b.racy(&(1600..1700)));
    drop(low);
    assert!(!b.racy(&(1100..1200)) && b.racy(&(1600..1700)));
    drop(high);
    assert!(!b.racy(&(0..4096)));
    drop(plain);
    assert_eq!(b.lease_count(), 0);
}

#[test]
fn lease_copy_moves_bytes_between_buffers() {
    let src = DmaBuf::from_vec((0..=255u8).collect());
    let dst = DmaBuf::new(256);
    let s = src.lease(0..256, LeaseKind::DeviceRead).unwrap();
    let mut d = dst.lease(0..256, LeaseKind::DeviceWrite).unwrap();
    s.copy_to(16, &mut d, 0, 100).unwrap();
    assert!(s.copy_to(200, &mut d, 0, 100).is_err(), "source overrun");
    assert!(
        s.copy_to(0, &mut d, 200, 100).is_err(),
        "destination overrun"
    );
    drop(d);
    let mut out = vec![0u8; 100];
    dst.read_at(0, &mut out).unwrap();
    assert_eq!(out, (16..116u8).collect::<Vec<_>>());
}

#[test]
fn read_lease_cannot_write_and_bounds_are_checked() {
    let b = DmaBuf::new(8);
    let mut r = b.lease(0..8, LeaseKind::DeviceRead).unwrap();
    assert!(matches!(r.write(0, b"x"), Err(DmaError::WrongKind { .. })));
    assert!(matches!(
        b.lease(4..9, LeaseKind::DeviceRead),
        Err(DmaError::OutOfBounds { .. })
    ));
    assert!(b.read_at(usize::MAX, &mut [0u8; 2]).is_err());
}

/// A review found it: a lease that does not start at the buffer's start reported an offset past counting by
/// adding it to its start unchecked (a panic with overflow checks on) instead of returning `OutOfBounds`.
#[test]
fn an_offset_past_counting_on_a_lease_is_out_of_bounds_not_a_panic() {
    let b = DmaBuf::new(16);
    let l = b.lease(1..10, LeaseKind::DeviceRead).unwrap();
    assert!(matches!(
        l.read(usize::MAX, &mut [0u8; 1]),
        Err(DmaError::OutOfBounds { .. })
    ));
}

#[test]
fn buffer_outlives_its_handle_while_leased() {
    let b = DmaBuf::from_vec(vec![7u8; 32]);
    let lease = b.lease(0..32, LeaseKind::DeviceRead).unwrap();
    drop(b);
    let mut out = [0u8; 32];
    lease.read(0, &mut out).unwrap();
    assert_eq!(out, [7u8; 32]);
}

#[test]
fn shared_copies_race_without_data_race() {
    // A "device" thread keeps writing a shared range while the CPU copies it out.
    let b = DmaBuf::new(4096);
    let mut dev = b.lease(0..4096, LeaseKind::DeviceWriteShared).unwrap();
    let t = std::thread::spawn(move || {
        for i in 0..200u8 {
            dev.write(0, &[i; 4096]).unwrap();
        }
    });
    let mut out = vec![0u8; 4096];
    for _ in 0..200 {
        b.read_at(0, &mut out).unwrap();
    }
    t.join().unwrap();
}

proptest::proptest! {
    #[test]
    fn table_never_grants_conflicting_writes(ops in proptest::collection::vec((0usize..64, 1usize..32, 0u8..4), 1..40)) {
        let b = DmaBuf::new(96);
        let mut held: Vec<Lease> = Vec::new();
        for (start, len, k) in ops {
            let kind = [LeaseKind::DeviceRead, LeaseKind::DeviceWrite, LeaseKind::CpuRead, LeaseKind::CpuWrite][k as usize];
            if let Ok(l) = b.lease(start..start + len, kind) {
                held.push(l);
            }
        }
        for (i, x) in held.iter().enumerate() {
            for y in &held[i + 1..] {
                let overlap = x.offset() < y.offset() + y.len() && y.offset() < x.offset() + x.len();
                let writes = x.kind().writes() || y.kind().writes();
                proptest::prop_assert!(!(overlap && writes), "{x:?} and {y:?} both granted");
            }
        }
    }
}

proptest::proptest! {
    /// With leases of every length taken and given back in any order, the table sees every overlap a look at all
    /// of the leases held sees, and grants no write next to another lease.
    #[test]
    fn the_lease_table_sees_every_overlap_as_leases_come_and_go(
        ops in proptest::collection::vec((0u8..3, 0usize..120, 1usize..64, 0u8..4, 0usize..64), 1..80),
    ) {
        let b = DmaBuf::new(192);
        let mut held: Vec<Lease> = Vec::new();
        for (what, start, len, k, pick) in ops {
            let kind = [LeaseKind::DeviceRead, LeaseKind::DeviceWrite, LeaseKind::CpuRead, LeaseKind::CpuWrite][k as usize];
            match what {
                0 | 1 => {
                    if let Ok(l) = b.lease(start..start + len, kind) {
                        held.push(l);
                    }
                }
                _ if !held.is_empty() => {
                    held.swap_remove(pick % held.len());
                }
                _ => {}
            }
            proptest::prop_assert_eq!(b.lease_count(), held.len());
            let probe = start..start + len / 2 + 1;
            let seen = held.iter().any(|l| l.offset() < probe.end && probe.start < l.offset() + l.len());
            proptest::prop_assert_eq!(b.is_range_leased(probe.clone()), seen, "{:?} among {:?}", probe, held);
            for (i, x) in held.iter().enumerate() {
                for y in &held[i + 1..] {
                    let overlap = x.offset() < y.offset() + y.len() && y.offset() < x.offset() + x.len();
                    let writes = x.kind().writes() || y.kind().writes();
                    proptest::prop_assert!(!(overlap && writes), "{x:?} and {y:?} both granted");
                }
            }
        }
    }
}

/// Mappings of this process (`/proc/self/maps` lines).
fn mappings() -> usize {
    std::fs::read_to_string("/proc/self/maps")
        .expect("/proc/self/maps")
        .lines()
        .count()
}

/// Issue 25: every buffer was a mapping of its own (its own `madvise`), so ~10,000 connections with a few control
/// buffers each reached `vm.max_map_count` and allocation failed ("cannot allocate 640 bytes of device-visible
/// memory"). Small buffers now share a few large mappings.
#[test]
fn many_small_buffers_share_a_few_mappings() {
    let before = mappings();
    let bufs: Vec<_> = (0..20_000)
        .map(|i| DmaBuf::new(640 + (i % 3) * PAGE))
        .collect();
    let grown = mappings().saturating_sub(before);
    assert!(
        grown < 200,
        "20,000 small buffers added {grown} mappings (the kernel allows 65,530 by default)"
    );
    assert!(super::arena::chunks() >= 1);
    drop(bufs);
}

/// A block handed out again after its buffer went is zeroed (its pages went back to the kernel), and a large
/// buffer (a mapping of its own) works the same.
#[test]
fn a_reused_block_is_zeroed() {
    for len in [PAGE, 5 * PAGE + 3, 2 << 20] {
        for round in 0..3 {
            let b = DmaBuf::new(len);
            let mut out = vec![7u8; len];
            b.read_at(0, &mut out).unwrap();
            assert!(
                out.iter().all(|&x| x == 0),
                "round {round}: a {len}-byte buffer was not zeroed"
            );
            b.write_at(0, &vec![0xAB; len]).unwrap();
        }
    }
}

#[test]
fn short_and_long_copies_obey_the_same_exclusions_and_leave_no_lease() {
    for len in [
        16,
        COPY_UNDER_LOCK,
        COPY_UNDER_LOCK + 1,
        3 * COPY_UNDER_LOCK,
    ] {
        let b = DmaBuf::new(4 * COPY_UNDER_LOCK);
        let w = b.lease(0..8, LeaseKind::DeviceWrite).unwrap();
        let mut out = vec![0u8; len];
        assert!(
            matches!(b.read_at(4, &mut out), Err(DmaError::Busy { .. })),
            "{len}: a read beside a device write"
        );
        assert!(
            matches!(b.write_at(0, &out), Err(DmaError::Busy { .. })),
            "{len}: a write beside a device write"
        );
        drop(w);
        let r = b.lease(0..8, LeaseKind::DeviceRead).unwrap();
        b.read_at(0, &mut out).unwrap();
        assert!(
            b.write_at(0, &out).is_err(),
            "{len}: a write beside a device read"
        );
        b.write_at(8, &vec![7u8; len]).unwrap();
        b.read_at(8, &mut out).unwrap();
        assert!(out.iter().all(|&x| x == 7), "{len}");
        drop(r);
        assert_eq!(b.lease_count(), 0, "{len}: a copy leaves no lease behind");
    }
}

#[test]
fn copy_into_a_lease_on_the_same_buffer_does_not_deadlock() {
    for len in [8, 2 * COPY_UNDER_LOCK] {
        let b = Arc::new(DmaBuf::new(8 * COPY_UNDER_LOCK));
        b.write_at(0, &vec![3u8; len]).unwrap();
        let mut dst = b
            .lease(
                4 * COPY_UNDER_LOCK..8 * COPY_UNDER_LOCK,
                LeaseKind::DeviceWrite,
            )
            .unwrap();
        b.copy_into(0, &mut dst, 0, len).unwrap();
        assert!(
            b.copy_into(4 * COPY_UNDER_LOCK, &mut dst, 0, len).is_err(),
            "{len}: the source overlaps the destination's exclusive lease"
        );
        drop(dst);
        let mut out = vec![0u8; len];
        b.read_at(4 * COPY_UNDER_LOCK, &mut out).unwrap();
        assert!(out.iter().all(|&x| x == 3), "{len}");
    }
}

#[test]
fn copies_going_both_ways_between_two_buffers_do_not_deadlock() {
    // A short copy (`copy_into`, `Lease::copy_to`) holds both buffers' tables: taken in one order whichever way it
    // goes. Two threads copy each way 20,000 times; a deadlock fails the case after 60 s instead of hanging it.
    let a = DmaBuf::new(2 * COPY_UNDER_LOCK);
    let b = DmaBuf::new(2 * COPY_UNDER_LOCK);
    a.write_at(0, &[7u8; COPY_UNDER_LOCK]).unwrap();
    b.write_at(0, &[9u8; COPY_UNDER_LOCK]).unwrap();
    let (done, finished) = std::sync::mpsc::channel();
    let way = |from: &Arc<DmaBuf>, to: &Arc<DmaBuf>| {
        let (from, done) = (Arc::clone(from), done.clone());
        let mut dst = to
            .lease(COPY_UNDER_LOCK..2 * COPY_UNDER_LOCK, LeaseKind::DeviceWrite)
            .unwrap();
        std::thread::spawn(move || {
            let src = from
                .lease(0..COPY_UNDER_LOCK, LeaseKind::DeviceRead)
                .unwrap();
            for i in 0..20_000 {
                let len = if i % 2 == 0 { 64 } else { COPY_UNDER_LOCK };
                if i % 4 < 2 {
                    from.copy_into(0, &mut dst, 0, len).unwrap();
                } else {
                    src.copy_to(0, &mut dst, 0, len).unwrap();
                }
            }
            done.send(()).unwrap();
        })
    };
    let (one, other) = (way(&a, &b), way(&b, &a));
    for _ in 0..2 {
        finished
            .recv_timeout(std::time::Duration::from_secs(60))
            .expect("copies going both ways deadlocked");
    }
    one.join().unwrap();
    other.join().unwrap();
    let mut out = vec![0u8; COPY_UNDER_LOCK];
    b.read_at(COPY_UNDER_LOCK, &mut out).unwrap();
    assert!(out.iter().all(|&x| x == 7), "a's bytes in b");
    a.read_at(COPY_UNDER_LOCK, &mut out).unwrap();
    assert!(out.iter().all(|&x| x == 9), "b's bytes in a");
}

/// A buffer only devices write is copied a word at a time on the word grid: every start and length around the word
/// size reads and writes exactly the bytes asked for, and leaves the neighbours of a part-word write as they were.
#[test]
fn a_device_written_buffer_copies_every_byte_at_every_alignment() {
    let b = DmaBuf::try_new_device_written(96).unwrap();
    let mut model: Vec<u8> = (0..96u8)
        .map(|i| i.wrapping_mul(37).wrapping_add(11))
        .collect();
    b.write_at(0, &model).unwrap();
    for start in 0..17 {
        for len in 0..40 {
            let mut got = vec![0xAAu8; len];
            b.read_at(start, &mut got).unwrap();
            assert_eq!(
                got,
                &model[start..start + len],
                "read at {start}, len {len}"
            );
            let new: Vec<u8> = (0..len).map(|i| (start * 40 + len + i) as u8).collect();
            b.write_at(start, &new).unwrap();
            model[start..start + len].copy_from_slice(&new);
            let mut all = vec![0u8; 96];
            b.read_at(0, &mut all).unwrap();
            assert_eq!(all, model, "after a write at {start}, len {len}");
        }
    }
}

/// Two devices writing the two halves of one word through their own shared leases at the same time lose neither
/// half: a part-word write replaces only its bytes of the word, atomically.
#[test]
fn part_word_writes_to_one_device_written_word_lose_nothing() {
    let b = DmaBuf::try_new_device_written(64).unwrap();
    let half = std::mem::size_of::<usize>() / 2;
    let writer = |range: Range<usize>, tag: u8| {
        let mut lease = b
            .lease(range.clone(), LeaseKind::DeviceWriteShared)
            .unwrap();
        std::thread::spawn(move || {
            for i in 0..20_000u32 {
                let v = vec![tag ^ i as u8; range.len()];
                lease.write(0, &v).unwrap();
            }
        })
    };
    let (a, c) = (writer(0..half, 0x11), writer(half..2 * half, 0x22));
    a.join().unwrap();
    c.join().unwrap();
    let mut got = vec![0u8; 2 * half];
    b.read_at(0, &mut got).unwrap();
    let last = 19_999u32 as u8;
    assert!(got[..half].iter().all(|&x| x == 0x11 ^ last), "{got:?}");
    assert!(got[half..].iter().all(|&x| x == 0x22 ^ last), "{got:?}");
}

/// A buffer only devices write is never borrowed: a reference next to a part-word write through a device lease
/// would race the compare-and-swap of the word they share.
#[test]
fn a_device_written_buffer_refuses_borrows() {
    let b = DmaBuf::try_new_device_written(16).unwrap();
    let _device = b.lease(3..8, LeaseKind::DeviceWriteShared).unwrap();
    assert!(matches!(
        b.with_slice(0..3, |s| s.len()),
        Err(DmaError::WrongKind { .. })
    ));
    assert!(matches!(
        b.with_slice_mut(8..16, |s| s.len()),
        Err(DmaError::WrongKind { .. })
    ));
    b.read_at(0, &mut [0u8; 3]).unwrap();
    b.write_at(8, &[1u8; 8]).unwrap();
}

/// The kernel's page size the tools count resident memory in (`/proc/self/statm`): a power of two, at least
/// 4 KiB, on Linux.
#[test]
fn the_kernels_page_size_is_told() {
    let p = crate::page_size();
    assert!(p >= 4096 && p.is_power_of_two(), "{p}");
}

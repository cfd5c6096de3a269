//! The fuzz targets of `fuzz/` as bounded property tests on stable Rust, so `cargo xtask test` exercises them:
//! random bytes into the wire decoders, and random crafted-peer event sequences against a live connection on the
//! simulated fabric (`exs::sim::fuzz`). `EXS_FUZZ_CASES` sets the number of cases (default 64; CI runs more in
//! its checked optimized build). Crashes found by fuzzing are kept as named regression tests below.

use exs::sim::fuzz;
use proptest::prelude::*;

fn cases() -> u32 {
    std::env::var("EXS_FUZZ_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(64)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases() * 16, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn wire_decoders_never_panic_and_round_trip(data in proptest::collection::vec(any::<u8>(), 0..200)) {
        fuzz::wire(&data);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(), failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn a_crafted_peer_never_breaks_the_promises(data in proptest::collection::vec(any::<u8>(), 0..600)) {
        fuzz::peer(&data);
    }
}

/// The same target steered toward well-formed messages (the random inputs above mostly end in malformed ones):
/// every event is a structured message, so the state machine's deeper paths run.
#[test]
fn a_crafted_peer_sending_well_formed_messages() {
    let mut violations = 0;
    for seed in 0..200u32 {
        let mut data = vec![(seed & 1) as u8, seed as u8, (seed >> 8) as u8];
        let mut x = seed.wrapping_mul(2_654_435_761) | 1;
        for _ in 0..300 {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            data.push(x as u8);
        }
        // Event selectors: mostly structured messages (2..=4), some local sends/receives (5, 6), drives (7).
        for i in (3..data.len()).step_by(23) {
            data[i] = [2, 3, 4, 5, 6, 7, 2, 3][(data[i] % 8) as usize];
        }
        if fuzz::peer(&data).violation {
            violations += 1;
        }
    }
    assert!(
        violations > 0,
        "no input provoked a violation: the harness is not reaching the protocol"
    );
}

//! libFuzzer target: a crafted peer's events against a live exs connection on the simulated fabric
//! (`cargo +nightly fuzz run peer`).
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    exs::sim::fuzz::peer(data);
});

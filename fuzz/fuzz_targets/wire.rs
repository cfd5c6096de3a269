//! libFuzzer target: the wire decoders (`cargo +nightly fuzz run wire`).
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| exs::sim::fuzz::wire(data));

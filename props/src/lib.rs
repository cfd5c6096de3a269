//! The protocol's long property tests, on the simulated fabric: `tests/stream_props.rs` (random stream sends and
//! receives against a byte-exact model), `tests/message_props.rs` (the same for SOCK_SEQPACKET) and
//! `tests/fuzz_props.rs` (the `fuzz/` targets as bounded property runs). They live in a crate of their own so that
//! `cargo xtask test` builds them optimized (its checked optimized build) without the rest of exs's test
//! dependencies (tokio, hyper, ...). The fixtures they share with exs's own tests are `exs/tests/common`, included
//! by path.

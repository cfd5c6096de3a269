//! `exs pump|ping|demo --server` against careless and hostile clients (issue 27): users run these servers on
//! shared hosts, so no line, parameter or silence a client sends may crash, stall or bloat one. Each test drives
//! a real server process over TCP on 127.0.0.1 (libfabric's tcp provider carries the tests themselves).
//!
//! The cases live in a module of their own, `served::`, so that `cargo xtask test` can run them apart from the
//! workspace's other tests and many at once: each spends most of its time waiting on a server's limits.

#[path = "../common/mod.rs"]
mod common;
mod served;

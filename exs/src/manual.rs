//! The manual: how exs maps the ES-API onto RDMA, the protocols, memory and keys, progress and waiting, and the
//! backends. Text only; the API reference is the rest of this crate.
//!
//! exs implements four sources:
//!
//! | source | what exs takes from it | chapters |
//! | --- | --- | --- |
//! | R. D. Russell, *A General-Purpose API for iWARP and InfiniBand* (the UNH-EXS paper) | the ES-API calls, message mode (adverts, receiver-driven RDMA reads, acknowledgments), credits, immediate data, persistent sends and receives, offsets, the benchmark set | [`api`], [`message_mode`], [`c_api`] |
//! | the design note *Dynamic UNH EXS Stream Protocol* | SOCK_STREAM: direct and indirect transfers, estimated sequence numbers, phases, its Figures 4-7 as tests | [`stream_mode`] |
//! | uDAPL's `dat_srq_post_recv` man page (the shared receive queue) | one pool of receive buffers for many connections | [`shared_pool`] |
//! | US patent 7,577,712, *Efficient event completion in UDAPL* | the adaptive completion wait: poll once, then block until the events still missing have arrived | [`progress`] |
//!
//! The code, these chapters and the C header cite them by number: seed 001 is the stream protocol's design note,
//! seed 002 the UNH-EXS paper, seed 003 the shared receive queue's man page and seed 004 the patent.
//!
//! The rest is this implementation's own: [`memory`] (leases, least exposure, keys bound to one connection),
//! [`backends`] (libfabric, rdma-core verbs, Soft-RoCE, and their settings), [`scaling`] (many connections, idle
//! memory, serving untrusted clients) and [`reliability`] (hostile peers, regression tests); [`inside`] draws how
//! the crate's own modules depend on each other. Benchmark results are not here: they live in the repository's
//! `bench/` directory, written by `cargo xtask bench` beside the peers they are compared with. A figure a chapter
//! gives (a provider's allocation, a defect's symptom) explains a design choice and says how it was seen.

#[doc = include_str!("manual/api.md")]
pub mod api {}
#[doc = include_str!("manual/message_mode.md")]
pub mod message_mode {}
#[doc = include_str!("manual/stream_mode.md")]
pub mod stream_mode {}
#[doc = include_str!("manual/shared_pool.md")]
pub mod shared_pool {}
#[doc = include_str!("manual/progress.md")]
pub mod progress {}
#[doc = include_str!("manual/memory.md")]
pub mod memory {}
#[doc = include_str!("manual/backends.md")]
pub mod backends {}
#[doc = include_str!("manual/scaling.md")]
pub mod scaling {}
#[doc = include_str!("manual/reliability.md")]
pub mod reliability {}
#[doc = include_str!("manual/c_api.md")]
pub mod c_api {}
#[doc = include_str!("manual/inside.md")]
pub mod inside {}

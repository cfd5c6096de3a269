//! The tests, by topic.

pub mod errors;
pub mod extensions;
pub mod first;
pub mod hostile;
pub mod keys;
pub mod leaks;
pub mod leases;
pub mod message;
pub mod process;
pub mod scale;
pub mod stream;
pub mod stream_close;
pub mod stream_io;
pub mod waiting;

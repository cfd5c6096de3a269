//! The tests, by topic.

pub mod extensions;
pub mod hostile;
pub mod keys;
pub mod message;
pub mod process;
pub mod scale;
pub mod stream;

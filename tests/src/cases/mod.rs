//! The tests, by topic.

pub mod message;
pub mod process;
pub mod scale;
pub mod stream;

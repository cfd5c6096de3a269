//! The protocol core: deterministic state machines with no I/O.
//!
//! * [`link`]: control-message buffers, link credits, send-queue accounting (shared by both socket types).
//! * [`message`]: SOCK_SEQPACKET, seed 002 section 3 (adverts, receiver-driven reads, acknowledgments, credits).
//! * [`stream`]: SOCK_STREAM, seed 001 (direct and indirect transfers, estimated sequence numbers, phases).
//! * [`pool`]: the shared receive pool of a context, seed 003.
//! * `conn`: one connection, composing the link with the protocol of its socket type.
//! * `limits`: what the protocol needs to know of the transport.
//! * `op`: operations as the protocol sees them; completions go back to the engine as values.

pub(crate) mod conn;
pub(crate) mod limits;
pub mod link;
pub mod message;
pub(crate) mod op;
pub mod pool;
pub mod stream;

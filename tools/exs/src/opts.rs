//! The values of the tool's enumerated flags (`--mode`, `--wait`, `--type`, `--backend`, `--op`): clap lists them
//! in `--help` and refuses others; serde carries them between client and server with the same spellings.

use clap::ValueEnum;
use serde::{Deserialize, Serialize};

/// Prints a value the way it is spelled on the command line (and in JSON).
macro_rules! display_as_value {
    ($($t:ty),*) => {$(
        impl std::fmt::Display for $t {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                let v = ValueEnum::to_possible_value(self).expect("no value is skipped");
                f.write_str(v.get_name())
            }
        }
    )*};
}

/// Which backend carries exs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum BackendKind {
    /// libfabric (MSG endpoints): the tcp provider anywhere, verbs on RDMA hardware.
    Fabric,
    /// rdma-core verbs and rdma_cm: InfiniBand, RoCE, iWARP, Soft-RoCE.
    Verbs,
    /// The simulated fabric, inside this one process.
    Sim,
}

/// The wait object of the fabric backend's completion queues (`--cq-wait`; see `exs::fabric::CqWait`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CqWaitKind {
    /// FI_WAIT_POLLFD (the default): a thread can sleep, and the tcp provider polls its sockets as without one.
    Pollfd,
    /// FI_WAIT_FD: the provider's own epoll set, nested in the transport's.
    Fd,
    /// No wait object, as fi_pingpong opens its queues for busy polling (a thread that sleeps on the context
    /// polls every millisecond instead).
    None,
}

/// The help of `--mode immediate`, with the library's limit.
fn immediate_help() -> String {
    format!(
        "Data inside the advert (at most {} bytes; seqpacket only)",
        exs::SocketOptions::MAX_SMALL
    )
}

/// How `exs pump` sends.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PumpMode {
    /// The transport's immediate-data threshold decides.
    Default,
    /// Adverts and RDMA reads (streams: writes).
    Normal,
    #[value(help = immediate_help())]
    Immediate,
    /// One persistent send the server keeps reading (seqpacket only).
    Persistent,
}

/// How `exs ping` sends.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PingMode {
    /// Advert and RDMA read, echoed.
    Normal,
    #[value(help = format!("{}, echoed", immediate_help()))]
    Immediate,
    /// Each receive is one RDMA read of the server's persistent send (time per read).
    Persistent,
}

/// The event queues' wait mode.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Wait {
    /// Spin briefly, then sleep (the adaptive completion wait).
    Adaptive,
    /// Sleep until an event.
    Block,
    /// Poll without sleeping.
    Busy,
}

impl Wait {
    pub fn mode(self) -> exs::WaitMode {
        match self {
            Wait::Adaptive => exs::WaitMode::Adaptive { spin: 0 },
            Wait::Block => exs::WaitMode::Block,
            Wait::Busy => exs::WaitMode::BusyPoll,
        }
    }
}

/// The socket type.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Type {
    /// SOCK_SEQPACKET: messages.
    Seqpacket,
    /// SOCK_STREAM: a byte stream.
    Stream,
}

impl Type {
    pub fn sock(self) -> exs::SockType {
        match self {
            Type::Seqpacket => exs::SockType::SeqPacket,
            Type::Stream => exs::SockType::Stream,
        }
    }
}

/// The RDMA operation of `exs rawpump`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RawOp {
    /// RDMA writes into the server's buffer.
    Write,
    /// RDMA reads from the server's buffer.
    Read,
}

/// How `exs rawping` waits: the transport has no adaptive wait of its own.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RawWait {
    /// Sleep on the transport's wait descriptor, armed first.
    Block,
    /// Poll without sleeping.
    Busy,
}

display_as_value!(
    BackendKind,
    CqWaitKind,
    PumpMode,
    PingMode,
    Wait,
    Type,
    RawOp,
    RawWait
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_keep_their_spellings_on_the_command_line_and_in_json() {
        assert_eq!(PumpMode::Persistent.to_string(), "persistent");
        assert_eq!(Type::Seqpacket.to_string(), "seqpacket");
        assert_eq!(Wait::from_str("busy", false), Ok(Wait::Busy));
        assert_eq!(
            serde_json::to_string(&PingMode::Immediate).unwrap(),
            "\"immediate\""
        );
        assert_eq!(
            serde_json::from_str::<BackendKind>("\"fabric\"").unwrap(),
            BackendKind::Fabric
        );
    }
}

//! What waiting costs, counted on every backend: the calls a blocking ping-pong makes into the transport.

use exs::{SockType, SocketOptions};

use crate::util::*;
use crate::{ensure, Backend, Case, Requires};

pub fn cases() -> Vec<Case> {
    vec![Case {
        name: "a_blocking_ping_pong_reads_connection_events_only_after_a_failed_arm_or_every_few_rounds",
        run: connection_events_in_a_blocking_ping_pong,
        requires: Requires::Nothing,
    }]
}

/// Round trips of the ping-pong.
const ROUND_TRIPS: usize = 100;

/// Every backend's arm also says whether a connection event waits (libfabric's `fi_trywait` is given the event
/// queue, the verbs arm looks at the rdma_cm channel, the simulator at its own), so the round before a sleep, which
/// finds no completions, need not read the channel (a system call per read on the software providers and rxe):
/// it is read after an arm that failed and every `CM_EVERY` rounds. Before, more than one read per message on
/// rxe (where each round trip runs more rounds than on the simulator, so the every-few-rounds reads weigh more).
fn connection_events_in_a_blocking_ping_pong(b: &dyn Backend) -> Result<(), String> {
    let net = b.net();
    let opts = SocketOptions::default().with_small_packet_max_size(64);
    let p = pair(&*net, SockType::SeqPacket, opts)?;
    let ((a0, b0), (a1, b1)) = p.ping_pong_on(&p.eq_a, &p.eq_b, ROUND_TRIPS, |p| {
        (p.a.stats(), p.b.stats())
    })?;
    let msgs = 2 * ROUND_TRIPS as u64;
    let arms = a1.arms - a0.arms + b1.arms - b0.arms;
    let reads = a1.cm_polls - a0.cm_polls + b1.cm_polls - b0.cm_polls;
    eprintln!(
        "{}: per message, {:.2} connection-event reads, {:.2} arms",
        b.name(),
        reads as f64 / msgs as f64,
        arms as f64 / msgs as f64
    );
    ensure!(arms > 0, "nobody slept on the transport: {a1:?} {b1:?}");
    ensure!(
        reads * 5 <= 3 * msgs,
        "{reads} connection-event reads and {arms} arms for {msgs} messages: {a1:?} {b1:?}"
    );
    Ok(())
}

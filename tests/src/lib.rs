//! The cross-backend conformance suite (see `conformance.rs` for the runner).
//!
//! Every test is written once against [`Net`] (a way to get contexts and addresses) and runs on every backend
//! compiled in: `sim` (the simulated fabric, with progress threads as a real device has), `fabric` (libfabric,
//! tcp provider unless `EXS_FABRIC_PROVIDER` says otherwise), and later `verbs`/`softroce`. A backend that cannot
//! run here says why and its tests count as skipped, loudly.

pub mod backends;
pub mod cases;
pub mod child;
pub mod util;

use std::net::SocketAddr;

use exs::Context;

/// Whether the run requires the shared receive pool of its hosts (`EXS_CONFORMANCE_SHARED_RECV=1`; see
/// [`Net::host`]).
pub fn shared_recv_required() -> bool {
    std::env::var("EXS_CONFORMANCE_SHARED_RECV").is_ok_and(|v| v == "1")
}

/// What a test needs from a backend: hosts and addresses.
pub trait Net {
    /// A new host (a context with its own transport and progress thread), with the default options, but for
    /// `EXS_CONFORMANCE_SHARED_RECV=1`, which requires the shared receive pool (where a device turns it off by
    /// default: iWARP, whose pool must then cover every credit its connections promise).
    fn host(&self) -> Context {
        let mut opts = exs::ContextOptions::default();
        if shared_recv_required() {
            opts.shared_recv.enabled = Some(true);
        }
        self.host_with(opts)
    }
    /// A new host with `opts` (the simulator keeps its own clock and progress).
    fn host_with(&self, opts: exs::ContextOptions) -> Context;
    /// An address to listen on for the `i`th host created (port 0: any).
    fn listen_addr(&self, i: usize) -> SocketAddr;
    /// A bare transport on this network, with no exs engine, to play a crafted peer ([`exs::testing::RawPeer`]).
    fn raw(&self) -> Result<Box<dyn exs::Transport>, String>;
    /// Sends a connection request to `addr` with `private` data from a peer that vanishes before the connection is
    /// up (its transport goes away, as a killed process's does).
    fn vanishing_request(&self, addr: SocketAddr, private: &[u8]) -> Result<(), String> {
        let mut t = self.raw()?;
        t.connect(exs::transport::EndpointId(1), addr, private, Vec::new())
            .map_err(|e| e.to_string())?;
        drop(t);
        Ok(())
    }
}

/// A backend of the suite.
pub trait Backend: Send + Sync {
    /// Short name (`sim`, `fabric`, ...): trial names start with it.
    fn name(&self) -> &'static str;
    /// Why the backend cannot run on this machine, if it cannot.
    fn unavailable(&self) -> Option<String>;
    /// A fresh network for one test.
    fn net(&self) -> Box<dyn Net>;
    /// Whether hosts can live in separate processes (not the in-process simulator).
    fn processes(&self) -> bool;
    /// What exactly it runs on (device, provider, address), for the report.
    fn describe(&self) -> String {
        String::new()
    }
    /// Why a remote key of this configuration is valid beyond its one connection, if it is (a documented
    /// fallback: verbs without memory windows).
    fn keys_unbound(&self) -> Option<String> {
        None
    }
    /// Whether the peer's device refusing an RDMA access (a wrong key, a range beyond the exposure) may reach us
    /// as a reset of the connection rather than as a remote-access error: libfabric's software providers, and
    /// iWARP, where the refusing side sends a TERMINATE message and closes (siw completes the failed read only as
    /// flushed).
    fn access_errors_reset(&self) -> bool {
        false
    }
    /// Whether connections travel over plain TCP sockets of this host (libfabric's tcp provider).
    fn plain_tcp(&self) -> bool {
        false
    }
    /// File descriptors a connection with both ends in this process holds, where descriptors bound how many
    /// connections one process can hold (libfabric's tcp provider); `None` where they do not.
    fn descriptors_per_connection(&self) -> Option<u64> {
        None
    }
    /// Why every poll of this configuration reads every connection's completion queue, if it does (libfabric with
    /// no wait object: a queue that cannot signal stays hot, by design): there, what a poll costs grows with the
    /// connections held, and the ten-thousand-connection case scales down.
    fn polls_every_connection(&self) -> Option<&'static str> {
        None
    }
    /// Why a connection request caught in flight when its listener closes may be dropped unanswered, if it may:
    /// its connect then times out instead of being refused, and nothing this process does can answer it.
    fn closing_listener_drops_requests(&self) -> Option<&'static str> {
        None
    }
}

/// A test: `Ok` or a message saying what broke.
pub type TestFn = fn(&dyn Backend) -> Result<(), String>;

/// What a case needs beyond a backend.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Requires {
    /// Nothing: runs on every backend.
    Nothing,
    /// Hosts in separate processes (not the in-process simulator).
    Processes,
    /// A second host across a network link: a child process using the address `EXS_PEER_ADDR`, the far end of a
    /// link whose near end carries this backend's address (`cargo xtask rxe up --link` sets up two rxe devices on
    /// the ends of a veth pair, with routing that sends their traffic across it).
    PeerHost,
    /// Remote keys bound to one connection (not the documented fallback without memory windows).
    BoundKeys,
    /// Connections over plain TCP sockets of this host (libfabric's tcp provider), so that a `std::net` socket can
    /// play something that is not an exs peer.
    PlainTcp,
}

/// A named test and what it needs.
#[derive(Debug)]
pub struct Case {
    pub name: &'static str,
    pub run: TestFn,
    pub requires: Requires,
}

impl Case {
    /// Why this case cannot run on `backend` here, if it cannot.
    pub fn skip_reason(&self, backend: &dyn Backend) -> Option<String> {
        let processes = || {
            (!backend.processes())
                .then(|| format!("{} hosts cannot live in separate processes", backend.name()))
        };
        match self.requires {
            Requires::Nothing => None,
            Requires::Processes => processes(),
            Requires::PeerHost => processes().or_else(|| {
                child::peer_host()
                    .err()
                    .map(|why| format!("no second host across a link: {why}"))
            }),
            Requires::BoundKeys => backend.keys_unbound(),
            Requires::PlainTcp => (!backend.plain_tcp())
                .then(|| format!("{} does not connect over plain TCP sockets", backend.name())),
        }
    }
}

/// Every test of the suite.
pub fn all_cases() -> Vec<Case> {
    let mut v = Vec::new();
    v.extend(cases::message::cases());
    v.extend(cases::first::cases());
    v.extend(cases::stream::cases());
    v.extend(cases::stream_close::cases());
    v.extend(cases::stream_io::cases());
    v.extend(cases::process::cases());
    v.extend(cases::scale::cases());
    v.extend(cases::extensions::cases());
    v.extend(cases::hostile::cases());
    v.extend(cases::keys::cases());
    v.extend(cases::leases::cases());
    v.extend(cases::leaks::cases());
    v.extend(cases::errors::cases());
    v.extend(cases::waiting::cases());
    v
}

/// `EXS_CONFORMANCE_RETRY=1`: a case that fails is run once more, and passes if that run passes, with a `FLAKY` line
/// on stderr giving the first failure (the test stages in the emulated guests set it: there a case that needs a
/// device's resources can find them taken for a moment by its neighbour's; the summary lists every such line).
pub const RETRY: &str = "EXS_CONFORMANCE_RETRY";

/// Runs `case`; if it fails and `retry` is on, runs it again and says so.
pub fn run_again_once(
    name: &str,
    retry: bool,
    case: impl Fn() -> Result<(), String>,
) -> Result<(), String> {
    // A panic (an `expect` on a resource) counts as a failure, and its run is tried again as well.
    let once = || {
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(&case)).unwrap_or_else(|p| {
            let why = p
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()));
            Err(format!("test panicked: {}", why.unwrap_or_default()))
        })
    };
    match once() {
        Err(first) if retry => {
            // A moment for what the first run left (its threads, the device's resources) to go.
            std::thread::sleep(std::time::Duration::from_millis(500));
            let again = once();
            let first = first.replace('\n', " | ");
            match &again {
                Ok(()) => {
                    eprintln!("FLAKY {name}: passed when run again; the first run failed: {first}")
                }
                Err(_) => eprintln!("FAILED TWICE {name}: the first run failed: {first}"),
            }
            again
        }
        r => r,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;

    /// A case that fails once then passes passes when retried, and only then; one that panics is retried too.
    #[test]
    fn a_failed_case_is_run_once_more_only_when_asked() {
        let runs = Cell::new(0);
        let first_fails = || {
            runs.set(runs.get() + 1);
            if runs.get() == 1 {
                Err("busy".to_string())
            } else {
                Ok(())
            }
        };
        assert_eq!(run_again_once("c", false, first_fails), Err("busy".into()));
        runs.set(0);
        assert_eq!(run_again_once("c", true, first_fails), Ok(()));
        assert_eq!(runs.get(), 2);
        let panics_once = || {
            runs.set(runs.get() + 1);
            assert!(runs.get() > 3, "no device");
            Ok(())
        };
        assert_eq!(run_again_once("c", true, panics_once), Ok(()));
        let always = || Err::<(), _>("broken".to_string());
        assert_eq!(run_again_once("c", true, always), Err("broken".into()));
    }
}

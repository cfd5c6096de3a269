//! `cargo xtask test --suite siw`: the conformance suite on soft-iWARP. No Debian kernel builds siw, so where this
//! kernel cannot load it the suite runs in the QEMU guest with siw.ko built for the guest's kernel ([`crate::siw`]):
//!
//! * every case on `exs_siw1` at the near end of the veth link (`softroce:siw`), the tools over it (`tools:siw`);
//! * the cases of many connections and of bursts again with the shared receive pool required (off by default on
//!   iWARP; a required pool holds a buffer for every credit promised; `softroce:siw-shared-pool`);
//! * the cases whose data moves by RDMA reads again with read sinks off (`EXS_VERBS_READ_SINKS=0`: siw reads into
//!   the base registration; `softroce:siw-no-read-sinks`);
//! * with the peer-to-peer build (MPA RTR by a zero-length RDMA read, as iw_cxgb4 connects by default): the
//!   who-sends-first cases, connecting and accepting, and the two-host transfer (`softroce:siw-p2p-read-rtr`);
//! * then every case on rxe driven the way an iWARP adapter is
//!   (`verbs:write-imm-emulated,no-windows,read-sinks,no-rnr-retry`: write-with-immediate emulated, no memory
//!   windows, read sinks, no receiver-not-ready retry; [`crate::test::IWARP_SHAPED`]), and the shared pool's
//!   cases again with the pool required (`verbs:iwarp-shaped-shared-pool`);
//! * across two guests with siw0 on each (the peer-host cases on verbs, the tools, perftest with rdma_cm).
//!
//! It is a suite of its own because the guest's emulated CPU makes siw (iWARP over the kernel's TCP) the slowest
//! device to test: beside the default suite it would pass the fifteen minutes a clean-clone `cargo xtask test` may
//! take, as the iWARP-shaped rxe run did. `.ci/run` runs both.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use exs_backend_softroce::Kind;

use crate::runner::{
    conformance_exe, finish, run_sections, xtask_copy, Sections, RETRY_CASES, RUN, SECTION,
};
use crate::siw::{self, Variant};
use crate::sys::{self, Result};
use crate::{rxe, vm};

/// The cases run again with the peer-to-peer build: who sends first, connecting, and a transfer across the link.
const P2P_CASES: [&str; 3] = [
    "softroce::the_",
    "softroce::seqpacket_connect_and_accept",
    "softroce::two_hosts_over_a_link",
];

/// The case run apart from the others on siw, after them: its 400 connects refused in a row left another case,
/// beside it, a moment without the device's resources (a completion queue not created, a connect refused).
const ALONE: &str = "softroce::refused_connects_leave_no_sockets_or_ids";

/// The cases run again with the shared receive pool required (`EXS_CONFORMANCE_SHARED_RECV=1`; it is off by default
/// on iWARP, and a required one holds a buffer for every credit promised): many connections, and bursts.
const SHARED_POOL_CASES: [&str; 6] = [
    "softroce::listener_accepts_many_connections",
    "softroce::stream_receives_filled_from_the_stream_buffer_get_no_key",
    "softroce::idle_stream_connections_hold_no_stream_buffer",
    "softroce::seqpacket_credits_under_pressure",
    "softroce::seqpacket_64_outstanding_each_way",
    "softroce::stream_small_buffer_many_small_writes",
];

/// The cases run again with read sinks off: the transfers whose large messages are RDMA reads, persistent reads.
const NO_SINK_CASES: [&str; 2] = [
    "softroce::seqpacket_sizes_1b_to_16mib",
    "softroce::persistent_send_read_repeatedly",
];

/// The script of the one-guest stage; `load(v)` is the shell that loads build `v` of siw (`None`: this kernel's
/// own siw, and no peer-to-peer stage); `with_rxe`: then rxe, driven the iWARP way, on the same link.
fn script(
    xtask: &Path,
    exe: &Path,
    load: impl Fn(Variant) -> Option<String>,
    with_rxe: bool,
) -> String {
    let (_, _, near) = rxe::NEAR;
    let (_, _, far) = rxe::FAR;
    let env = format!(
        "EXS_SOFTROCE_ADDR={near} EXS_PEER_ADDR={far} EXS_PEER_LINK={}",
        rxe::NEAR.1
    );
    let (exe, xtask) = (exe.display(), xtask.display());
    let tool = sys::root().join("target/debug/exs");
    let tool = tool.display();
    let up = format!(
        "{xtask} rxe up --link --siw >&2 || {{ echo 'xtask: siw setup failed' >&2; exit 90; }}\n"
    );
    let mut s = format!(
        "set -u\nulimit -l unlimited\nexport {RETRY_CASES}\n{SECTION}{RUN}{}{up}\
         section softroce:siw\n\
         run env {env} {exe} softroce:: --skip {ALONE}\n\
         run env {env} {exe} {ALONE} --exact\n\
         section tools:siw\n\
         tool() {{ name=$1; shift; if \"$@\" >&2; then echo \"test tools::$name ... ok\"; echo 'test result: ok. 1 passed; 0 failed; 0 ignored'; else echo \"test tools::$name ... FAILED\"; echo 'test result: FAILED. 0 passed; 1 failed; 0 ignored'; fi; }}\n\
         tool info_on_siw {tool} info --backend verbs --addr {near}\n\
         tool pump_on_siw {tool} pump --backend verbs --addr {near} --size 64,64K --seconds 0.5 --json\n\
         tool ping_on_siw {tool} ping --backend verbs --addr {near} --size 8 --count 100 --json\n",
        load(Variant::Stock).unwrap_or_default()
    );
    s.push_str("section softroce:siw-shared-pool\n");
    for case in SHARED_POOL_CASES {
        s.push_str(&format!(
            "run env {env} EXS_CONFORMANCE_SHARED_RECV=1 {exe} {case}\n"
        ));
    }
    s.push_str("section softroce:siw-no-read-sinks\n");
    for case in NO_SINK_CASES {
        s.push_str(&format!(
            "run env {env} EXS_VERBS_READ_SINKS=0 {exe} {case}\n"
        ));
    }
    if let Some(p2p) = load(Variant::P2pReadRtr) {
        s.push_str(&format!(
            "{xtask} rxe down >&2\n{p2p}{up}section softroce:siw-p2p-read-rtr\n"
        ));
        for case in P2P_CASES {
            s.push_str(&format!("run env {env} {exe} {case}\n"));
        }
    }
    if with_rxe {
        // Every case on rxe through the plain verbs backend as an iWARP adapter is driven: the same code paths as
        // siw's on a device that could do without them (what differs is siw's own). The section opens first, so
        // that a failed setup is that section's failure (nothing ran in it) and not the whole guest's.
        s.push_str(&format!(
            "section verbs:write-imm-emulated,no-windows,read-sinks,no-rnr-retry\n\
             {xtask} rxe down >&2\n\
             if {xtask} rxe up --link >&2; then\n\
             run env EXS_VERBS_ADDR={near} {} EXS_PEER_ADDR={far} EXS_PEER_LINK={} {exe} verbs::\n\
             else echo 'xtask: Soft-RoCE setup failed' >&2; fi\n",
            crate::test::IWARP_SHAPED,
            rxe::NEAR.1
        ));
        // The shared pool's cases again with the pool required, on rxe that fails a message with no receive at once.
        s.push_str("section verbs:iwarp-shaped-shared-pool\n");
        for case in SHARED_POOL_CASES {
            s.push_str(&format!(
                "run env EXS_VERBS_ADDR={near} {} EXS_CONFORMANCE_SHARED_RECV=1 {exe} {}\n",
                crate::test::IWARP_SHAPED,
                case.replacen("softroce::", "verbs::", 1)
            ));
        }
    }
    s
}

/// Runs the suite (see the module documentation); `only_pair`: only the stage across two guests.
pub fn run(only_pair: bool) -> Result<()> {
    let started = Instant::now();
    sys::run(sys::cargo().args(["build", "-p", "exs-tools", "--bins"]))?;
    let exe = conformance_exe()?;
    let xtask = xtask_copy()?;
    let mut summary = Vec::new();
    let mut failures = Vec::new();
    let mut sections = Sections::default();
    let native = sys::is_root() && exs_backend_softroce::kernel_supports(Kind::Siw).is_ok();
    let where_ = if native {
        eprintln!("xtask: this kernel has siw: running the suite natively (stock siw only)");
        let with_rxe = exs_backend_softroce::kernel_supports(Kind::Rxe).is_ok();
        if !with_rxe {
            summary.push(
                "SKIPPED verbs:write-imm-emulated,no-windows,read-sinks,no-rnr-retry: this kernel has no rdma_rxe".into(),
            );
        }
        let ok = run_sections(
            Command::new("sh").args(["-c", &script(&xtask, &exe, |_| None, with_rxe)]),
            &mut sections,
        )?;
        rxe::down();
        if !ok && sections.is_empty() {
            return Err("the siw setup failed (see above)".into());
        }
        " (native)".to_string()
    } else {
        let vm = vm::Vm::prepare()?;
        let t = Instant::now();
        let mods = siw::prepare(vm.dir(), &vm.kver)?;
        summary.push(format!(
            "siw.ko for {} (stock and peer-to-peer builds): ready in {:.0?}",
            vm.kver,
            t.elapsed()
        ));
        if !only_pair {
            let body = script(&xtask, &exe, |v| Some(siw::load_lines(&mods.path(v))), true);
            let t = Instant::now();
            let o = vm.run_streaming(&body, Duration::from_secs(40 * 60), &mut |l, e| {
                sections.line(l, e)
            })?;
            if o.rc.is_none() || o.rc == Some(90) {
                return Err(format!(
                    "the siw guest failed; console:\n{}",
                    vm::tail(&o.console, 40)
                ));
            }
            summary.push(format!("siw in one guest took {:.0?}", t.elapsed()));
        }
        let tool = sys::root().join("target/debug/exs");
        let dev = vm::GuestDevice::Siw(mods.path(Variant::Stock));
        if let Err(e) = crate::twohosts::run(&exe, &tool, &dev, &mut summary, &mut failures) {
            summary.push(format!("two guests on siw: could not run: {e}"));
            failures.push("two guests on siw".into());
        }
        format!(" (QEMU guest, kernel {}, {:?})", vm.kver, vm.accel)
    };
    let mut lines = Vec::new();
    sections.report(&where_, &mut lines, &mut failures);
    lines.append(&mut summary);
    lines.push(format!("the siw suite took {:.0?}", started.elapsed()));
    finish("cargo xtask test --suite siw", &lines, &failures)
}

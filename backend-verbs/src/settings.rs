//! The verbs settings of a transport: what the device can do (queried, and probed where verbs has no query: the
//! inline size), what this transport uses (exs's defaults bounded by the device), and the overrides a deployment
//! gives in [`VerbsConfig`](crate::VerbsConfig) or in the environment (`EXS_VERBS_*`). [`VerbsSettings::decide`] is
//! the whole policy and touches no device, so it is tested without one.

use exs_transport::TransportError;

/// Overrides of the settings; `None` leaves the device's value (or exs's default within it). A value above what
/// the device allows is lowered to the device's, with a warning.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct VerbsLimits {
    /// Largest payload sent inline (`EXS_VERBS_INLINE`); 0 sends nothing inline.
    pub inline: Option<u32>,
    /// Send-queue entries per connection (`EXS_VERBS_SEND_DEPTH`).
    pub send_depth: Option<u32>,
    /// Receive-queue entries per connection (`EXS_VERBS_RECV_DEPTH`).
    pub recv_depth: Option<u32>,
    /// Completion-queue entries of the transport (`EXS_VERBS_CQ_DEPTH`).
    pub cq_depth: Option<u32>,
    /// Shared receive queue entries (`EXS_VERBS_SRQ_DEPTH`); 0 uses no shared receive queue.
    pub srq_depth: Option<u32>,
    /// Scatter/gather entries per send or write (`EXS_VERBS_SGE`).
    pub sge: Option<u32>,
    /// Largest single send, write or read (`EXS_VERBS_MAX_MESSAGE`).
    pub max_message: Option<u64>,
    /// RDMA reads outstanding per connection, each way (`EXS_VERBS_READ_DEPTH`).
    pub read_depth: Option<u32>,
}

/// The environment variable of each override.
const LIMIT_VARS: [&str; 8] = [
    "EXS_VERBS_INLINE",
    "EXS_VERBS_SEND_DEPTH",
    "EXS_VERBS_RECV_DEPTH",
    "EXS_VERBS_CQ_DEPTH",
    "EXS_VERBS_SRQ_DEPTH",
    "EXS_VERBS_SGE",
    "EXS_VERBS_MAX_MESSAGE",
    "EXS_VERBS_READ_DEPTH",
];

impl VerbsLimits {
    /// The overrides `var` names (`EXS_VERBS_INLINE`, `_SEND_DEPTH`, `_RECV_DEPTH`, `_CQ_DEPTH`, `_SRQ_DEPTH`, `_SGE`,
    /// `_MAX_MESSAGE`, `_READ_DEPTH`); a value that is not a number is an error naming the variable.
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> Result<VerbsLimits, TransportError> {
        let num = |name: &str| -> Result<Option<u64>, TransportError> {
            match var(name).filter(|v| !v.trim().is_empty()) {
                None => Ok(None),
                Some(v) => parse_size(&v).map(Some).ok_or_else(|| {
                    TransportError::Invalid(format!(
                        "{name}={v:?}: not a number (bytes or entries; K, M and G suffixes allowed)"
                    ))
                }),
            }
        };
        let small = |name: &str| -> Result<Option<u32>, TransportError> {
            num(name)?
                .map(|n| {
                    u32::try_from(n)
                        .map_err(|_| TransportError::Invalid(format!("{name}: {n} is too large")))
                })
                .transpose()
        };
        let [inline, send, recv, cq, srq, sge, msg, read] = LIMIT_VARS;
        Ok(VerbsLimits {
            inline: small(inline)?,
            send_depth: small(send)?,
            recv_depth: small(recv)?,
            cq_depth: small(cq)?,
            srq_depth: small(srq)?,
            sge: small(sge)?,
            max_message: num(msg)?,
            read_depth: small(read)?,
        })
    }

    /// These overrides, with `other`'s where these leave one unset.
    pub fn or(self, other: VerbsLimits) -> VerbsLimits {
        VerbsLimits {
            inline: self.inline.or(other.inline),
            send_depth: self.send_depth.or(other.send_depth),
            recv_depth: self.recv_depth.or(other.recv_depth),
            cq_depth: self.cq_depth.or(other.cq_depth),
            srq_depth: self.srq_depth.or(other.srq_depth),
            sge: self.sge.or(other.sge),
            max_message: self.max_message.or(other.max_message),
            read_depth: self.read_depth.or(other.read_depth),
        }
    }
}

/// `4096`, `64K`, `1M`, `1G` (powers of two).
fn parse_size(s: &str) -> Option<u64> {
    let s = s.trim();
    let (digits, shift) = match s.char_indices().last()? {
        (i, 'k' | 'K') => (&s[..i], 10),
        (i, 'm' | 'M') => (&s[..i], 20),
        (i, 'g' | 'G') => (&s[..i], 30),
        _ => (s, 0),
    };
    digits.parse::<u64>().ok()?.checked_mul(1 << shift)
}

/// Which atomic operations the device has (`atomic_cap`). exs uses none; reported for deployments.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Atomics {
    /// None (siw, most iWARP adapters).
    None,
    /// Atomic with respect to this adapter's own operations.
    Adapter,
    /// Atomic with respect to the host's CPUs as well.
    Global,
}

/// What the device reports (or, for the inline size, what a probe queue pair got).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceLimits {
    /// iWARP (`IBV_TRANSPORT_IWARP`: Chelsio, siw) rather than InfiniBand/RoCE.
    pub iwarp: bool,
    /// `vendor_id` (an OUI or a PCI vendor id, as the driver chooses; siw reports [`SIW_VENDOR_ID`]).
    pub vendor_id: u32,
    /// Largest inline payload a queue pair of this device accepted.
    pub max_inline: u32,
    /// `max_qp_wr`.
    pub max_qp_wr: u32,
    /// `max_cqe`.
    pub max_cqe: u32,
    /// `max_sge`.
    pub max_sge: u32,
    /// `max_sge_rd`: scatter entries of an RDMA read (iWARP: 1).
    pub max_sge_rd: u32,
    /// Port 1's `max_msg_sz`.
    pub max_msg: u64,
    /// Outstanding RDMA reads per queue pair, as responder and as initiator (the lesser).
    pub max_rd_atom: u32,
    /// `max_srq_wr`, 0 without shared receive queues.
    pub max_srq_wr: u32,
    /// `atomic_cap`.
    pub atomics: Atomics,
    /// Type 2 memory windows (`IBV_DEVICE_MEM_WINDOW_TYPE_2B`).
    pub windows: bool,
}

/// The vendor id siw reports (`SIW_VENDOR_ID` in the driver's `siw.h`: "bmt" in ASCII).
pub const SIW_VENDOR_ID: u32 = 0x62_6d74;

impl DeviceLimits {
    /// Whether the sink of an RDMA read must allow remote write. An iWARP read response is a tagged message aimed
    /// at the sink's key, and adapters check that key as they would a peer's RDMA write (Chelsio's `iw_cxgb4`; the
    /// kernel's own `rdma_rw` registers iWARP read sinks with remote write for that reason). siw does not: it
    /// places a read response through the read's own local scatter entry, matched by its outbound read queue, and
    /// checks that entry's key for local write only (`siw_proc_rresp`).
    ///
    /// siw still gets a sink registration per read by default: the read request carries its sink's key to the
    /// peer, and siw carries out a peer's send-with-invalidate on any key of the protection domain it names
    /// (`siw_invalidate_stag` checks the domain only), so reading into a base registration would hand a hostile
    /// peer the key of memory the application uses on its other connections. `EXS_VERBS_READ_SINKS=0` chooses the
    /// registration saved over that. It keeps base keys from being handed out, no more: siw looks a key up by its
    /// index alone and gives indexes out in sequence, so a peer that holds any key can guess the others.
    pub fn read_sink_needs_remote_write(&self) -> bool {
        self.iwarp && self.vendor_id != SIW_VENDOR_ID
    }

    /// Whether the device sends an unsignalled request of a page or more straight from the application's pages and
    /// completes it, and the requests after it, once TCP has them queued, not sent: siw (`siw_prepare_fpdu`, with
    /// `zcopy_tx` on, for unsignalled requests only; "TCP may reuse the buffer for retransmission"). A later
    /// signalled completion then does not mean the pages are free: memory reused after it could go out in place
    /// of what was sent. Such requests are signalled on these devices (siw copies a signalled request's bytes).
    pub fn sends_unsignalled_from_user_pages(&self) -> bool {
        self.vendor_id == SIW_VENDOR_ID
    }
}

/// exs's defaults, within the device's limits.
pub(crate) const DEFAULT_INLINE: u32 = 512;
const DEFAULT_SEND_DEPTH: u32 = 512;
const DEFAULT_RECV_DEPTH: u32 = 1024;
const DEFAULT_CQ_DEPTH: u32 = 8192;
const DEFAULT_SRQ_DEPTH: u32 = 16384;
const DEFAULT_SGE: u32 = 16;
/// Scatter/gather entries exs needs per send: a control message's header and the bytes it carries.
const MIN_SGE: u32 = 2;
const DEFAULT_MAX_MESSAGE: u64 = 1 << 30;
const DEFAULT_READ_DEPTH: u32 = 16;

/// What a transport uses, and what the device offered (`exs info` prints both).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VerbsSettings {
    /// The device's name (`mlx5_0`, `cxgb4_0`, `rxe0`, `siw0`).
    pub device: String,
    /// What the device reported.
    pub limits: DeviceLimits,
    /// Largest payload sent inline.
    pub inline: u32,
    /// Send-queue entries per connection (the engine's share: `send_depth / entries per request`).
    pub send_depth: u32,
    /// Receive-queue entries per connection.
    pub recv_depth: u32,
    /// Completion-queue entries.
    pub cq_depth: u32,
    /// Shared receive queue entries (0: none).
    pub srq_depth: u32,
    /// Scatter/gather entries per send or write.
    pub sge: u32,
    /// Largest single operation in bytes.
    pub max_message: u64,
    /// RDMA reads outstanding per connection.
    pub read_depth: u32,
    /// Write-with-immediate emulated (write, then an 8-byte send): iWARP, or forced.
    pub emulated_imm: bool,
    /// Exposures are type 2 memory windows bound to one queue pair.
    pub memory_windows: bool,
    /// Each RDMA read's sink gets a registration with remote write for the read's duration (iWARP; see
    /// [`DeviceLimits::read_sink_needs_remote_write`]).
    pub read_sinks: bool,
    /// Connections ask the peer's adapter to retry a message that finds no receive posted (`rnr_retry_count` 7,
    /// for ever). Not on iWARP, which has no such retry, nor with `VerbsConfig::rnr_retry` `Some(false)`: such a
    /// message then fails its connection.
    pub rnr_retry: bool,
}

/// The lesser of exs's default (or the override) and the device's limit; an override above the limit is lowered,
/// with a warning naming both.
fn within<T: Ord + Copy + std::fmt::Display>(
    what: &str,
    want: Option<T>,
    default: T,
    device: T,
) -> T {
    match want {
        Some(w) if w > device => {
            tracing::warn!("{what} {w} is more than the device allows; using {device}");
            device
        }
        Some(w) => w,
        None => default.min(device),
    }
}

impl VerbsSettings {
    /// The settings for a device with `dev`'s limits under `cfg`'s choices (already merged with the environment).
    pub fn decide(
        name: &str,
        dev: DeviceLimits,
        cfg: &crate::VerbsConfig,
    ) -> Result<VerbsSettings, TransportError> {
        let l = &cfg.limits;
        let memory_windows = memory_windows(name, &dev, cfg.memory_windows)?;
        check_sge(name, l.sge, dev.max_sge)?;
        let (send_depth, recv_depth) = queue_depths(l, &dev)?;
        let (srq_depth, cq_depth) = completion_depths(l, &dev)?;
        Ok(VerbsSettings {
            device: name.to_string(),
            inline: within("inline size", l.inline, DEFAULT_INLINE, dev.max_inline),
            send_depth,
            recv_depth,
            cq_depth,
            srq_depth,
            sge: within(
                "scatter/gather entries",
                positive("scatter/gather entries", l.sge)?,
                DEFAULT_SGE,
                dev.max_sge,
            ),
            max_message: within(
                "largest message",
                l.max_message.filter(|&m| m > 0),
                DEFAULT_MAX_MESSAGE,
                dev.max_msg,
            ),
            read_depth: within(
                "read depth",
                positive("the read depth", l.read_depth)?,
                DEFAULT_READ_DEPTH,
                dev.max_rd_atom.max(1),
            ),
            emulated_imm: cfg.emulate_write_imm || dev.iwarp,
            memory_windows,
            read_sinks: read_sinks(name, &dev, cfg.read_sink_registration)?,
            rnr_retry: !dev.iwarp && cfg.rnr_retry != Some(false),
            limits: dev,
        })
    }

    /// Native send-queue entries one request of the engine may take: itself, the send of an emulated
    /// write-with-immediate, the bind of a window it exposes.
    pub fn sq_share(&self) -> u32 {
        1 + u32::from(self.emulated_imm) + u32::from(self.memory_windows)
    }

    /// Send-queue entries a queue pair asks for: the engine's requests with their share of extra entries (see
    /// [`VerbsSettings::sq_share`]), and on iWARP one more for the active side's first message.
    pub fn qp_send_wr(&self) -> u32 {
        self.engine_send_wr() * self.sq_share() + u32::from(self.limits.iwarp)
    }

    /// The requests the engine may have outstanding on one connection.
    pub fn engine_send_wr(&self) -> u32 {
        (self.send_depth / self.sq_share()).max(1)
    }
}

/// Whether each RDMA read's sink gets a registration of its own: by default on iWARP; turned off, an error where
/// the device checks a read's sink for remote write (its reads would fail with a remote access error).
fn read_sinks(name: &str, dev: &DeviceLimits, want: Option<bool>) -> Result<bool, TransportError> {
    match want {
        Some(false) if dev.read_sink_needs_remote_write() => Err(TransportError::Unsupported(format!(
            "{name} checks the sink of an RDMA read for remote write: read sinks cannot be turned off \
             (EXS_VERBS_READ_SINKS=0, VerbsConfig::read_sink_registration = Some(false))"
        ))),
        Some(w) => Ok(w),
        None => Ok(dev.iwarp),
    }
}

/// Whether exposures are memory windows: by default where the device has type 2 windows and is not iWARP; asked
/// for on a device without them, an error.
fn memory_windows(
    name: &str,
    dev: &DeviceLimits,
    want: Option<bool>,
) -> Result<bool, TransportError> {
    match want {
        None => Ok(dev.windows && !dev.iwarp),
        Some(false) => Ok(false),
        Some(true) if dev.windows && !dev.iwarp => Ok(true),
        Some(true) => Err(TransportError::Unsupported(format!(
            "{name} has no type 2 memory windows"
        ))),
    }
}

/// A control message with immediate data gathers its header and the application's bytes (no copy): both the
/// setting and the device must allow [`MIN_SGE`] entries.
fn check_sge(name: &str, want: Option<u32>, device: u32) -> Result<(), TransportError> {
    if want.is_some_and(|n| n < MIN_SGE) {
        return Err(TransportError::Invalid(format!(
            "EXS_VERBS_SGE/limits.sge must be at least {MIN_SGE}: a message gathers a header and its data"
        )));
    }
    if device < MIN_SGE {
        return Err(TransportError::Unsupported(format!(
            "{name} gathers {device} scatter/gather entries per send; exs needs {MIN_SGE}"
        )));
    }
    Ok(())
}

/// Send- and receive-queue depths.
fn queue_depths(l: &VerbsLimits, dev: &DeviceLimits) -> Result<(u32, u32), TransportError> {
    Ok((
        within(
            "send-queue depth",
            positive("the send-queue depth", l.send_depth)?,
            DEFAULT_SEND_DEPTH,
            // On iWARP the queue pair has one entry more than the depth (`VerbsSettings::qp_send_wr`).
            dev.max_qp_wr.saturating_sub(u32::from(dev.iwarp)).max(1),
        ),
        within(
            "receive-queue depth",
            positive("the receive-queue depth", l.recv_depth)?,
            DEFAULT_RECV_DEPTH,
            dev.max_qp_wr,
        ),
    ))
}

/// Shared-receive- and completion-queue depths. Every receive of the shared queue completes into the completion
/// queue, so the shared queue is no deeper than half what the device's completion queues hold (the other half is
/// for what connections have on the device: see [`crate::cq`]), and the completion queue starts large enough for
/// it beside [`DEFAULT_CQ_DEPTH`] (some providers, siw, cannot grow a completion queue later).
fn completion_depths(l: &VerbsLimits, dev: &DeviceLimits) -> Result<(u32, u32), TransportError> {
    let srq = within(
        "shared receive queue depth",
        l.srq_depth,
        DEFAULT_SRQ_DEPTH,
        dev.max_srq_wr
            .min(crate::cq::shared_depth_bound(dev.max_cqe)),
    );
    let cq = within(
        "completion-queue depth",
        positive("the completion-queue depth", l.cq_depth)?,
        DEFAULT_CQ_DEPTH.saturating_add(srq),
        dev.max_cqe,
    );
    Ok((srq, cq))
}

/// A count set to 0 is refused: a queue or a gather list of nothing cannot work.
fn positive(what: &str, v: Option<u32>) -> Result<Option<u32>, TransportError> {
    match v {
        Some(0) => Err(TransportError::Invalid(format!(
            "{what} must be at least 1"
        ))),
        _ => Ok(v),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::VerbsConfig;

    /// rxe in the Debian 6.1 guest (`ibv_devinfo -v`, a probe queue pair for the inline size).
    fn rxe() -> DeviceLimits {
        DeviceLimits {
            iwarp: false,
            vendor_id: 0xff_ffff,
            max_inline: 512,
            max_qp_wr: 1_048_576,
            max_cqe: 32_767,
            max_sge: 32,
            max_sge_rd: 32,
            max_msg: 8 << 20,
            max_rd_atom: 128,
            max_srq_wr: 1_048_576,
            atomics: Atomics::Adapter,
            windows: true,
        }
    }

    /// siw in the same guest.
    fn siw() -> DeviceLimits {
        DeviceLimits {
            iwarp: true,
            vendor_id: SIW_VENDOR_ID,
            max_inline: 64,
            max_qp_wr: 32_768,
            max_cqe: 3_276_800,
            max_sge: 6,
            max_sge_rd: 1,
            max_msg: u64::from(u32::MAX),
            max_rd_atom: 128,
            max_srq_wr: 327_680,
            atomics: Atomics::None,
            windows: false,
        }
    }

    fn cfg() -> VerbsConfig {
        VerbsConfig::new([10, 0, 0, 1].into())
    }

    #[test]
    fn the_device_bounds_every_default() {
        let s = VerbsSettings::decide("siw0", siw(), &cfg()).unwrap();
        assert_eq!((s.inline, s.sge, s.send_depth), (64, 6, 512));
        assert!(
            s.emulated_imm && s.read_sinks && !s.memory_windows,
            "iWARP's way"
        );
        assert_eq!(s.sq_share(), 2);
        let r = VerbsSettings::decide("rxe0", rxe(), &cfg()).unwrap();
        assert_eq!((r.inline, r.sge, r.max_message), (512, 16, 8 << 20));
        assert!(!r.emulated_imm && !r.read_sinks && r.memory_windows);
        assert_eq!(r.sq_share(), 2);
    }

    #[test]
    fn read_sinks_are_registered_on_iwarp_and_can_be_turned_off_only_where_the_device_does_not_check_them(
    ) {
        // Chelsio's PCI vendor id (0x1425), as iw_cxgb4 reports it; otherwise siw's limits.
        let cxgb4 = DeviceLimits {
            vendor_id: 0x1425,
            ..siw()
        };
        assert!(cxgb4.read_sink_needs_remote_write());
        assert!(!siw().read_sink_needs_remote_write());
        assert!(!rxe().read_sink_needs_remote_write());
        assert!(
            VerbsSettings::decide("cxgb4_0", cxgb4.clone(), &cfg())
                .unwrap()
                .read_sinks
        );
        let mut off = cfg();
        off.read_sink_registration = Some(false);
        assert!(
            !VerbsSettings::decide("siw0", siw(), &off)
                .unwrap()
                .read_sinks,
            "siw reads into the base registration when asked"
        );
        let e = VerbsSettings::decide("cxgb4_0", cxgb4, &off).unwrap_err();
        assert!(
            matches!(&e, TransportError::Unsupported(m) if m.contains("EXS_VERBS_READ_SINKS")),
            "{e}"
        );
        assert!(
            !VerbsSettings::decide("rxe0", rxe(), &off)
                .unwrap()
                .read_sinks
        );
        let mut on = cfg();
        on.read_sink_registration = Some(true);
        assert!(
            VerbsSettings::decide("rxe0", rxe(), &on)
                .unwrap()
                .read_sinks
        );
    }

    #[test]
    fn the_shared_receive_queue_fits_in_half_the_completion_queue_which_starts_large_enough_for_it()
    {
        let r = VerbsSettings::decide("rxe0", rxe(), &cfg()).unwrap();
        assert_eq!((r.srq_depth, r.cq_depth), (16_383, 16_383 + 8192));
        let s = VerbsSettings::decide("siw0", siw(), &cfg()).unwrap();
        assert_eq!((s.srq_depth, s.cq_depth), (16_384, 16_384 + 8192));
        let mut c = cfg();
        c.limits.srq_depth = Some(30_000);
        c.limits.cq_depth = Some(1024);
        let r = VerbsSettings::decide("rxe0", rxe(), &c).unwrap();
        assert_eq!(
            (r.srq_depth, r.cq_depth),
            (16_383, 1024),
            "an override is bounded; the queue grows to the shared queue when it is created"
        );
    }

    /// iWARP has no receiver-not-ready retry, whatever the configuration asks; InfiniBand/RoCE retries unless told
    /// not to (rxe driven the iWARP way), and the capabilities the engine sees follow (its shared pool is then off
    /// unless required, and a required one covers every credit it promised).
    #[test]
    fn receiver_not_ready_retry_is_never_on_iwarp_and_can_be_turned_off_elsewhere() {
        let mut c = cfg();
        assert!(VerbsSettings::decide("rxe0", rxe(), &c).unwrap().rnr_retry);
        assert!(!VerbsSettings::decide("siw0", siw(), &c).unwrap().rnr_retry);
        c.rnr_retry = Some(true);
        assert!(!VerbsSettings::decide("siw0", siw(), &c).unwrap().rnr_retry);
        c.rnr_retry = Some(false);
        assert!(!VerbsSettings::decide("rxe0", rxe(), &c).unwrap().rnr_retry);
    }

    #[test]
    fn a_device_without_inline_sends_nothing_inline() {
        let mut d = rxe();
        d.max_inline = 0;
        let mut c = cfg();
        c.limits.inline = Some(64);
        assert_eq!(VerbsSettings::decide("x", d, &c).unwrap().inline, 0);
    }

    /// Review finding: on iWARP the queue pair asks for one entry more than the send depth, so a depth of the
    /// device's whole `max_qp_wr` (an override above it is lowered to it) made every queue pair too deep for
    /// the device, and every connection failed.
    #[test]
    fn a_queue_pair_never_asks_for_more_send_entries_than_the_device_has() {
        for dev in [siw(), rxe()] {
            let mut c = cfg();
            c.limits.send_depth = Some(u32::MAX);
            let s = VerbsSettings::decide("x", dev.clone(), &c).unwrap();
            assert!(
                s.qp_send_wr() <= dev.max_qp_wr,
                "{} entries on a device of {}",
                s.qp_send_wr(),
                dev.max_qp_wr
            );
        }
    }

    #[test]
    fn overrides_lower_the_settings_and_are_bounded_by_the_device() {
        let mut c = cfg();
        c.limits = VerbsLimits {
            inline: Some(0),
            send_depth: Some(16),
            sge: Some(100),
            max_message: Some(64 << 10),
            srq_depth: Some(0),
            ..Default::default()
        };
        let s = VerbsSettings::decide("siw0", siw(), &c).unwrap();
        assert_eq!(
            (s.inline, s.send_depth, s.sge, s.max_message, s.srq_depth),
            (0, 16, 6, 64 << 10, 0)
        );
        c.limits = VerbsLimits {
            send_depth: Some(0),
            ..Default::default()
        };
        assert!(
            VerbsSettings::decide("siw0", siw(), &c).is_err(),
            "a queue of no entries is refused"
        );
        c.limits = VerbsLimits {
            sge: Some(1),
            ..Default::default()
        };
        assert!(
            VerbsSettings::decide("siw0", siw(), &c).is_err(),
            "one entry cannot carry a header and its data"
        );
        let mut d = siw();
        d.max_sge = 1;
        assert!(matches!(
            VerbsSettings::decide("x", d, &cfg()),
            Err(TransportError::Unsupported(_))
        ));
    }

    #[test]
    fn windows_cannot_be_required_where_the_device_has_none() {
        let mut c = cfg();
        c.memory_windows = Some(true);
        assert!(matches!(
            VerbsSettings::decide("siw0", siw(), &c),
            Err(TransportError::Unsupported(_))
        ));
        assert!(
            VerbsSettings::decide("rxe0", rxe(), &c)
                .unwrap()
                .memory_windows
        );
    }

    #[test]
    fn limits_come_from_the_environment_and_a_bad_value_names_its_variable() {
        let vars = |k: &str| match k {
            "EXS_VERBS_INLINE" => Some("0".to_string()),
            "EXS_VERBS_MAX_MESSAGE" => Some("64K".to_string()),
            _ => None,
        };
        let l = VerbsLimits::from_vars(vars).unwrap();
        assert_eq!(
            (l.inline, l.max_message, l.sge),
            (Some(0), Some(65536), None)
        );
        let e = VerbsLimits::from_vars(|k| (k == "EXS_VERBS_SGE").then(|| "four".to_string()))
            .unwrap_err();
        assert!(e.to_string().contains("EXS_VERBS_SGE"), "{e}");
        // The configuration wins over the environment.
        let mine = VerbsLimits {
            inline: Some(32),
            ..Default::default()
        };
        assert_eq!(mine.or(l).inline, Some(32));
    }
}

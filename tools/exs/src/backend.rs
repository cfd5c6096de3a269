//! Opening a backend chosen at run time (`--backend`), among those compiled in.

use std::net::{IpAddr, SocketAddr};

#[cfg(any(feature = "fabric", feature = "verbs"))]
use anyhow::Context as _;
use anyhow::{bail, Result};
use exs::Context;

use crate::opts::{BackendKind, CqWaitKind};

/// Which backend and how to reach it.
#[derive(Clone, Debug, clap::Args)]
#[command(next_help_heading = "Backend (each side chooses its own)")]
pub struct BackendArgs {
    /// Backend (each side chooses its own; both must reach the same fabric).
    #[arg(long, value_enum, default_value_t = BackendKind::Fabric)]
    pub backend: BackendKind,
    /// libfabric provider (fabric backend): tcp (default), verbs, net, sockets.
    #[arg(long)]
    pub provider: Option<String>,
    /// libfabric domain (interface or device), if not the provider's first.
    #[arg(long)]
    pub domain: Option<String>,
    /// libfabric: completion queues without a wait object, as `fi_pingpong` opens them for busy polling (a thread
    /// that sleeps on the context polls every millisecond instead); the same as `--cq-wait none`.
    #[arg(long, conflicts_with = "cq_wait")]
    pub cq_no_wait: bool,
    /// libfabric: the completion queues' wait object (default pollfd).
    #[arg(long, value_enum)]
    pub cq_wait: Option<CqWaitKind>,
    /// This side's address: the one to listen on (one host, and --server), and the local RDMA interface's
    /// (verbs: an address of the device's interface).
    #[arg(short = 'a', long, default_value = "127.0.0.1")]
    pub addr: IpAddr,
    /// verbs: the device that must carry --addr (checked), e.g. mlx5_0, cxgb4_0, rxe0.
    #[arg(long)]
    pub device: Option<String>,
    /// verbs: emulate write-with-immediate by write + send even where the device has it.
    #[arg(long)]
    pub emulate_imm: bool,
    /// How this side exposes memory: a key per operation, or UNH-EXS's key per region and connection for
    /// trusted peers (default: EXS_EXPOSURE, else per-operation).
    #[arg(long, value_enum)]
    pub exposure: Option<Exposure>,
}

/// `--exposure`: exs's `ExposurePolicy`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Exposure {
    /// A key per operation, for exactly its range, revoked when it ends.
    PerOperation,
    /// One key per region and connection, for the whole region, until the connection goes.
    Trusted,
}

/// The policy of this process's contexts (one per process: `--exposure`, set when the backend is opened).
static EXPOSURE: std::sync::OnceLock<exs::ExposurePolicy> = std::sync::OnceLock::new();

/// The memory budget of the tools' own contexts, but a server's: measurements hold thousands of idle connections
/// (`exs ping --idle`), which the library's default budget would refuse. A server's contexts have the budget its
/// limits give ([`crate::control::Limits::engine_budget`]): what others may make it hold.
pub const CLIENT_BUDGET: u64 = 64 << 30;

pub fn context_options() -> Result<exs::ContextOptions> {
    let mut o = exs::ContextOptions::default();
    o.memory_budget = CLIENT_BUDGET;
    o.exposure = match EXPOSURE.get() {
        Some(p) => *p,
        None => exs::ExposurePolicy::from_env()?,
    };
    Ok(o)
}

impl BackendArgs {
    /// The libfabric provider (`--provider`, default tcp).
    pub fn provider(&self) -> &str {
        self.provider.as_deref().unwrap_or("tcp")
    }

    /// Refuses a flag of another backend than the one chosen, which it would otherwise drop without a word (review
    /// finding: `--device` with the fabric backend, `--provider` with verbs).
    fn check_flags(&self) -> Result<()> {
        let fabric = [
            ("--provider", self.provider.is_some()),
            ("--domain", self.domain.is_some()),
            ("--cq-wait", self.cq_wait.is_some()),
            ("--cq-no-wait", self.cq_no_wait),
        ];
        let verbs = [
            ("--device", self.device.is_some()),
            ("--emulate-imm", self.emulate_imm),
        ];
        for (flags, owner) in [
            (&fabric[..], BackendKind::Fabric),
            (&verbs[..], BackendKind::Verbs),
        ] {
            if let Some((flag, _)) = flags
                .iter()
                .find(|(_, given)| *given)
                .filter(|_| self.backend != owner)
            {
                bail!(
                    "{flag} is a setting of --backend {owner}, not of --backend {}",
                    self.backend
                );
            }
        }
        Ok(())
    }

    /// The same choice as command-line arguments, for a child process.
    pub fn to_args(&self) -> Vec<String> {
        let mut v = vec![
            "--backend".to_string(),
            self.backend.to_string(),
            "--addr".into(),
            self.addr.to_string(),
        ];
        if let Some(p) = &self.provider {
            v.extend(["--provider".into(), p.clone()]);
        }
        if let Some(d) = &self.domain {
            v.extend(["--domain".into(), d.clone()]);
        }
        if self.cq_no_wait {
            v.push("--cq-no-wait".into());
        }
        if let Some(w) = self.cq_wait {
            v.extend(["--cq-wait".into(), w.to_string()]);
        }
        if let Some(d) = &self.device {
            v.extend(["--device".into(), d.clone()]);
        }
        if self.emulate_imm {
            v.push("--emulate-imm".into());
        }
        if let Some(e) = self.exposure {
            v.extend([
                "--exposure".into(),
                match e {
                    Exposure::PerOperation => "per-operation",
                    Exposure::Trusted => "trusted",
                }
                .into(),
            ]);
        }
        v
    }
}

/// Backends compiled into this binary.
// Each push depends on a feature, so no `vec![]`.
#[allow(clippy::vec_init_then_push)]
pub fn compiled() -> Vec<&'static str> {
    #[allow(unused_mut)]
    let mut v = Vec::new();
    #[cfg(feature = "fabric")]
    v.push("fabric");
    #[cfg(feature = "verbs")]
    v.push("verbs");
    #[cfg(feature = "sim")]
    v.push("sim");
    v
}

/// An opened backend: contexts and addresses. Clones share it (the simulator's world: a server thread and the
/// client are hosts of one network).
#[derive(Clone)]
pub enum Opened {
    #[cfg(feature = "fabric")]
    Fabric(exs_backend_fabric::FabricConfig, IpAddr),
    #[cfg(feature = "verbs")]
    Verbs(exs_backend_verbs::VerbsConfig),
    /// The world, and how many hosts it has (a host's address follows from its index).
    #[cfg(feature = "sim")]
    Sim(exs::sim::World, std::sync::Arc<std::sync::Mutex<usize>>),
}

impl Opened {
    /// See [`crate::control::Host::device_serves_peers`]. libfabric counts as software whatever its provider
    /// (its verbs provider on hardware would not need the process, but nothing here tells the two apart).
    pub fn device_serves_peers(&self) -> bool {
        match self {
            #[cfg(feature = "verbs")]
            Opened::Verbs(_) => true,
            #[allow(unreachable_patterns)]
            _ => false,
        }
    }

    pub fn open(a: &BackendArgs) -> Result<Opened> {
        a.check_flags()?;
        if let Some(e) = a.exposure {
            let _ = EXPOSURE.set(match e {
                Exposure::PerOperation => exs::ExposurePolicy::PerOperation,
                Exposure::Trusted => exs::ExposurePolicy::TrustedPeers,
            });
        }
        match a.backend {
            #[cfg(feature = "fabric")]
            BackendKind::Fabric => {
                let mut cfg = exs_backend_fabric::FabricConfig {
                    provider: a.provider().to_string(),
                    domain: a.domain.clone(),
                    cq_wait: match (a.cq_no_wait, a.cq_wait) {
                        (true, _) | (_, Some(CqWaitKind::None)) => exs_backend_fabric::CqWait::None,
                        (_, Some(CqWaitKind::Fd)) => exs_backend_fabric::CqWait::Fd,
                        _ => exs_backend_fabric::CqWait::PollFd,
                    },
                };
                // The wait object the queues will have, which the reports name (`label`). A provider that cannot
                // be asked fails when a context opens, with its own error.
                if let Ok(w) = cfg.effective_cq_wait() {
                    cfg.cq_wait = w;
                }
                Ok(Opened::Fabric(cfg, a.addr))
            }
            #[cfg(feature = "verbs")]
            BackendKind::Verbs => {
                if a.addr.is_loopback() {
                    bail!(
                        "--backend verbs needs --addr set to the IP address of an RDMA device's interface \
                         (rdma_cm does not work over loopback); RDMA devices here: {}",
                        rdma_devices()
                    );
                }
                let mut cfg = exs_backend_verbs::VerbsConfig::new(a.addr);
                cfg.device = a.device.clone();
                cfg.emulate_write_imm = a.emulate_imm;
                Ok(Opened::Verbs(cfg))
            }
            #[cfg(feature = "sim")]
            BackendKind::Sim => Ok(Opened::Sim(
                exs::sim::World::threaded(exs::sim::SimConfig::default()),
                Default::default(),
            )),
            #[allow(unreachable_patterns)]
            other => bail!(
                "backend {other} is not compiled in; this binary has: {}",
                compiled().join(", ")
            ),
        }
    }

    /// A new host context.
    pub fn host(&self) -> Result<Context> {
        Ok(self.host_listening()?.0)
    }

    /// A new host context and the address it listens on (port 0: any).
    pub fn host_listening(&self) -> Result<(Context, SocketAddr)> {
        self.host_within(CLIENT_BUDGET)
    }

    /// A new host context whose connections may hold `budget` bytes of device-visible memory, and the address it
    /// listens on (port 0: any).
    pub fn host_within(&self, budget: u64) -> Result<(Context, SocketAddr)> {
        let opts = || {
            context_options().map(|mut o| {
                o.memory_budget = budget;
                o
            })
        };
        match self {
            #[cfg(feature = "fabric")]
            Opened::Fabric(cfg, ip) => {
                let ctx = Context::open_with(&exs::Backend::Fabric(cfg.clone()), opts()?)
                    .with_context(|| format!("opening libfabric (provider {})", cfg.provider))?;
                Ok((ctx, SocketAddr::new(*ip, 0)))
            }
            #[cfg(feature = "verbs")]
            Opened::Verbs(cfg) => {
                let ctx = Context::open_with(&exs::Backend::Verbs(cfg.clone()), opts()?)
                    .with_context(|| format!("opening the RDMA device of {}", cfg.addr))?;
                Ok((ctx, SocketAddr::new(cfg.addr, 0)))
            }
            #[cfg(feature = "sim")]
            Opened::Sim(w, hosts) => {
                let mut n = hosts.lock().unwrap_or_else(|p| p.into_inner());
                // As the world's own hosts: no keepalive timers.
                let mut o = opts()?;
                o.keepalive = None;
                let ctx = w.host_with(o);
                let addr = w.addr(*n, 0);
                *n += 1;
                Ok((ctx, addr))
            }
        }
    }

    /// A bare transport of this backend, with no exs engine (raw baselines).
    pub fn raw_transport(&self) -> Result<Box<dyn exs::Transport>> {
        match self {
            #[cfg(feature = "fabric")]
            Opened::Fabric(cfg, _) => exs_backend_fabric::FabricTransport::open(cfg)
                .map(|t| Box::new(t) as Box<dyn exs::Transport>)
                .with_context(|| format!("opening libfabric (provider {})", cfg.provider)),
            #[cfg(feature = "verbs")]
            Opened::Verbs(cfg) => {
                // The raw loop exposes its one buffer before the connection exists (its key rides in the accept's
                // private data), and a memory window binds only to a connected queue pair: the raw baseline uses a
                // registration as its key. Exposure happens once, outside the measured loop.
                let mut raw = cfg.clone();
                raw.memory_windows = Some(false);
                exs_backend_verbs::VerbsTransport::open(&raw)
                    .map(|t| Box::new(t) as Box<dyn exs::Transport>)
                    .with_context(|| format!("opening the RDMA device of {}", cfg.addr))
            }
            #[cfg(feature = "sim")]
            Opened::Sim(w, hosts) => {
                let mut n = hosts.lock().unwrap_or_else(|p| p.into_inner());
                *n += 1;
                Ok(Box::new(w.raw_host()))
            }
        }
    }

    /// Where the `i`th host listens (port 0: any).
    pub fn listen_addr(&self, i: usize) -> SocketAddr {
        // Only the simulator's hosts have addresses of their own.
        #[cfg(not(feature = "sim"))]
        let _ = i;
        match self {
            #[cfg(feature = "fabric")]
            Opened::Fabric(_, ip) => SocketAddr::new(*ip, 0),
            #[cfg(feature = "verbs")]
            Opened::Verbs(cfg) => SocketAddr::new(cfg.addr, 0),
            #[cfg(feature = "sim")]
            Opened::Sim(w, _) => w.addr(i, 0),
        }
    }

    /// Whether client and server can live in separate processes.
    pub fn processes(&self) -> bool {
        match self {
            #[cfg(feature = "fabric")]
            Opened::Fabric(..) => true,
            #[cfg(feature = "verbs")]
            Opened::Verbs(..) => true,
            #[cfg(feature = "sim")]
            Opened::Sim(..) => false,
        }
    }

    /// Name for reports, e.g. `exs (fabric/tcp)`.
    pub fn label(&self) -> String {
        match self {
            #[cfg(feature = "fabric")]
            Opened::Fabric(cfg, _) if cfg.cq_wait == exs_backend_fabric::CqWait::None => {
                format!("exs (fabric/{}, cq-no-wait)", cfg.provider)
            }
            Opened::Fabric(cfg, _) if cfg.cq_wait == exs_backend_fabric::CqWait::Fd => {
                format!("exs (fabric/{}, cq-wait fd)", cfg.provider)
            }
            Opened::Fabric(cfg, _) => format!("exs (fabric/{})", cfg.provider),
            #[cfg(feature = "verbs")]
            Opened::Verbs(cfg) => format!(
                "exs (verbs/{})",
                cfg.device.as_deref().unwrap_or(&cfg.addr.to_string())
            ),
            #[cfg(feature = "sim")]
            Opened::Sim(..) => "exs (sim)".into(),
        }
    }
}

/// The RDMA devices this machine has, with kind, state and addresses, for messages and `exs info`.
#[cfg(feature = "verbs")]
pub fn rdma_devices() -> String {
    let devs = exs_backend_softroce::devices();
    if devs.is_empty() {
        return "none".into();
    }
    devs.iter()
        .map(|d| {
            let ips: Vec<String> = d
                .gids
                .iter()
                .map(|g| g.ip().to_string())
                .filter(|ip| !ip.starts_with("fe80"))
                .collect();
            format!(
                "{} ({:?}, {}, {})",
                d.name,
                d.kind,
                d.state.split(':').nth(1).unwrap_or(&d.state).trim(),
                ips.join(" ")
            )
        })
        .collect::<Vec<_>>()
        .join("; ")
}

/// The verbs backend's settings for `exs info` (what the device reported, what is used, and how to override it),
/// as JSON and as text; `None` for the other backends.
pub fn verbs_settings(opened: &Opened) -> Result<Option<(serde_json::Value, String)>> {
    #[allow(irrefutable_let_patterns)]
    #[cfg(feature = "verbs")]
    if let Opened::Verbs(cfg) = opened {
        let t = exs_backend_verbs::VerbsTransport::open(cfg)
            .with_context(|| format!("opening the RDMA device of {}", cfg.addr))?;
        let s = t.settings();
        let d = &s.limits;
        let json = serde_json::json!({
            "device": s.device, "iwarp": d.iwarp, "vendor_id": d.vendor_id,
            "inline": s.inline, "send_depth": s.send_depth, "recv_depth": s.recv_depth, "cq_depth": s.cq_depth,
            "srq_depth": s.srq_depth, "sge": s.sge, "max_message": s.max_message, "read_depth": s.read_depth,
            "emulated_imm": s.emulated_imm, "memory_windows": s.memory_windows, "read_sinks": s.read_sinks,
            "rnr_retry": s.rnr_retry,
            "device_limits": {"max_inline": d.max_inline, "max_qp_wr": d.max_qp_wr, "max_cqe": d.max_cqe,
                "max_sge": d.max_sge, "max_sge_rd": d.max_sge_rd, "max_msg": d.max_msg,
                "max_rd_atom": d.max_rd_atom, "max_srq_wr": d.max_srq_wr, "atomics": format!("{:?}", d.atomics),
                "memory_windows": d.windows},
        });
        let text = format!(
            "  verbs settings (used / device; EXS_VERBS_INLINE, _SEND_DEPTH, _RECV_DEPTH, _CQ_DEPTH, _SRQ_DEPTH, \
             _SGE, _MAX_MESSAGE, _READ_DEPTH lower them; EXS_VERBS_EMULATE_IMM, _WINDOWS, _READ_SINKS, \
             _RNR_RETRY choose):\n\
             \x20   {} ({}, vendor {:#x}): inline {} / {} B, send queue {} / {}, \
             receive queue {} / {}, completion queue {} / {}\n\
             \x20   shared receive queue {} / {}, scatter/gather {} / {} (reads {}), largest message {} / {} B, \
             read depth {} / {}\n\
             \x20   atomics {:?} (unused), memory windows {}, read sinks registered per read: {}, \
             receiver-not-ready retry: {}\n",
            s.device,
            if d.iwarp { "iWARP" } else { "InfiniBand/RoCE" },
            d.vendor_id,
            s.inline,
            d.max_inline,
            s.send_depth,
            d.max_qp_wr,
            s.recv_depth,
            d.max_qp_wr,
            s.cq_depth,
            d.max_cqe,
            s.srq_depth,
            d.max_srq_wr,
            s.sge,
            d.max_sge,
            d.max_sge_rd,
            s.max_message,
            d.max_msg,
            s.read_depth,
            d.max_rd_atom,
            d.atomics,
            match (s.memory_windows, d.windows) {
                (true, _) => "used (keys bound to one connection)",
                (false, true) => "off (EXS_VERBS_WINDOWS=0)",
                (false, false) => "none on this device (a registration per exposure)",
            },
            s.read_sinks,
            match (s.rnr_retry, d.iwarp) {
                (true, _) => "for ever",
                (false, true) => "none (iWARP)",
                (false, false) => "off (EXS_VERBS_RNR_RETRY=0)",
            },
        );
        return Ok(Some((json, text)));
    }
    let _ = opened;
    Ok(None)
}

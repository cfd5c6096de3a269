//! The backends compiled into this build.

use std::net::SocketAddr;

use exs::Context;

use crate::{Backend, Net};

/// Every backend enabled by cargo features.
// Each push depends on a feature, so no `vec![]`.
#[allow(clippy::vec_init_then_push)]
pub fn enabled() -> Vec<Box<dyn Backend>> {
    #[allow(unused_mut)]
    let mut v: Vec<Box<dyn Backend>> = Vec::new();
    #[cfg(feature = "sim")]
    v.push(Box::new(Sim));
    #[cfg(feature = "fabric")]
    v.push(Box::new(Fabric::from_env()));
    #[cfg(feature = "verbs")]
    v.push(Box::new(Verbs::from_env()));
    #[cfg(feature = "softroce")]
    v.push(Box::new(SoftRoce::discover()));
    v
}

/// Looks a backend up by name (child processes rebuild their parent's backend).
pub fn by_name(name: &str) -> Option<Box<dyn Backend>> {
    enabled().into_iter().find(|b| b.name() == name)
}

#[cfg(feature = "sim")]
#[derive(Debug)]
pub struct Sim;

#[cfg(feature = "sim")]
struct SimNet(exs::sim::World);

#[cfg(feature = "sim")]
impl Net for SimNet {
    fn host(&self) -> Context {
        self.0.host()
    }
    fn host_with(&self, opts: exs::ContextOptions) -> Context {
        self.0.host_with(opts)
    }
    fn listen_addr(&self, i: usize) -> SocketAddr {
        self.0.addr(i, 0)
    }
    fn raw(&self) -> Result<Box<dyn exs::Transport>, String> {
        Ok(Box::new(self.0.raw_host()))
    }
    fn vanishing_request(&self, addr: SocketAddr, private: &[u8]) -> Result<(), String> {
        use exs::Transport as _;
        let mut t = self.0.raw_host();
        t.connect(exs::transport::EndpointId(1), addr, private, Vec::new())
            .map_err(|e| e.to_string())?;
        self.0.kill(self.0.host_of(&t));
        Ok(())
    }
}

#[cfg(feature = "sim")]
impl Backend for Sim {
    fn name(&self) -> &'static str {
        "sim"
    }
    fn unavailable(&self) -> Option<String> {
        None
    }
    fn net(&self) -> Box<dyn Net> {
        // Progress threads and a shared receive queue, as on a real device; the deterministic manual mode is for
        // the exs crate's tests.
        Box::new(SimNet(exs::sim::World::threaded(
            exs::sim::SimConfig::default().with_shared_recv(16384),
        )))
    }
    fn processes(&self) -> bool {
        false
    }
}

#[cfg(feature = "fabric")]
#[derive(Debug)]
pub struct Fabric {
    cfg: exs_backend_fabric::FabricConfig,
    addr: std::net::IpAddr,
}

#[cfg(feature = "fabric")]
impl Fabric {
    /// `EXS_FABRIC_PROVIDER` (default tcp), `EXS_FABRIC_DOMAIN`, `EXS_FABRIC_ADDR` (default 127.0.0.1),
    /// `EXS_FABRIC_CQ_WAIT` (`pollfd`, the default; `fd`; `none`: completion queues without a wait object).
    pub fn from_env() -> Self {
        let provider = std::env::var("EXS_FABRIC_PROVIDER").unwrap_or_else(|_| "tcp".into());
        let domain = std::env::var("EXS_FABRIC_DOMAIN").ok();
        let addr = std::env::var("EXS_FABRIC_ADDR")
            .ok()
            .and_then(|a| a.parse().ok())
            .unwrap_or_else(|| [127, 0, 0, 1].into());
        Fabric {
            cfg: exs_backend_fabric::FabricConfig {
                provider,
                domain,
                cq_wait: std::env::var("EXS_FABRIC_CQ_WAIT").map_or_else(
                    |_| Default::default(),
                    |v| {
                        exs_backend_fabric::parse_cq_wait(&v).unwrap_or_else(|| {
                            panic!("EXS_FABRIC_CQ_WAIT={v}: say pollfd, fd or none")
                        })
                    },
                ),
            },
            addr,
        }
    }
}

#[cfg(feature = "fabric")]
struct FabricNet {
    cfg: exs_backend_fabric::FabricConfig,
    addr: std::net::IpAddr,
}

#[cfg(feature = "fabric")]
impl Net for FabricNet {
    fn host_with(&self, opts: exs::ContextOptions) -> Context {
        Context::open_with(&exs::Backend::Fabric(self.cfg.clone()), opts)
            .expect("open the libfabric provider")
    }
    fn listen_addr(&self, _i: usize) -> SocketAddr {
        SocketAddr::new(self.addr, 0)
    }
    fn raw(&self) -> Result<Box<dyn exs::Transport>, String> {
        exs_backend_fabric::FabricTransport::open(&self.cfg)
            .map(|t| Box::new(t) as Box<dyn exs::Transport>)
            .map_err(|e| e.to_string())
    }
}

#[cfg(feature = "fabric")]
impl Backend for Fabric {
    fn name(&self) -> &'static str {
        "fabric"
    }
    fn access_errors_reset(&self) -> bool {
        true
    }
    fn unavailable(&self) -> Option<String> {
        match exs_backend_fabric::FabricTransport::open(&self.cfg) {
            Ok(_) => None,
            Err(e) => Some(format!(
                "libfabric provider {:?} cannot be opened: {e}",
                self.cfg.provider
            )),
        }
    }
    fn net(&self) -> Box<dyn Net> {
        Box::new(FabricNet {
            cfg: self.cfg.clone(),
            addr: self.addr,
        })
    }
    fn processes(&self) -> bool {
        true
    }
    fn describe(&self) -> String {
        format!("libfabric provider {} on {}", self.cfg.provider, self.addr)
    }
    fn plain_tcp(&self) -> bool {
        self.cfg.provider == "tcp" && self.addr.is_loopback()
    }
    /// On the tcp provider each end holds its socket and what its completion queue signals by: with an
    /// `FI_WAIT_FD` wait object an epoll set and a socket pair (four descriptors an end); with `FI_WAIT_POLLFD`,
    /// or without a wait object (which the provider makes a pollfd set), two socket pairs (five an end). Other
    /// providers are taken to hold as many.
    fn descriptors_per_connection(&self) -> Option<u64> {
        Some(match self.cfg.cq_wait {
            exs_backend_fabric::CqWait::Fd => 8,
            _ => 10,
        })
    }
    fn polls_every_connection(&self) -> Option<&'static str> {
        (self.cfg.cq_wait == exs_backend_fabric::CqWait::None)
            .then_some("queues without a wait object are read in every poll")
    }
}

#[cfg(feature = "verbs")]
struct VerbsNet(Result<exs_backend_verbs::VerbsConfig, String>);

#[cfg(feature = "verbs")]
impl Net for VerbsNet {
    fn host_with(&self, opts: exs::ContextOptions) -> Context {
        let cfg = self.0.as_ref().expect("checked by unavailable()");
        Context::open_with(&exs::Backend::Verbs(cfg.clone()), opts).expect("open the RDMA device")
    }
    fn listen_addr(&self, _i: usize) -> SocketAddr {
        SocketAddr::new(self.0.as_ref().expect("checked").addr, 0)
    }
    fn raw(&self) -> Result<Box<dyn exs::Transport>, String> {
        let cfg = self.0.as_ref().map_err(Clone::clone)?;
        exs_backend_verbs::VerbsTransport::open(cfg)
            .map(|t| Box::new(t) as Box<dyn exs::Transport>)
            .map_err(|e| e.to_string())
    }
}

#[cfg(feature = "verbs")]
fn verbs_unavailable(cfg: &Result<exs_backend_verbs::VerbsConfig, String>) -> Option<String> {
    match cfg {
        Err(why) => Some(why.clone()),
        Ok(c) => exs_backend_verbs::VerbsTransport::open(c)
            .err()
            .map(|e| format!("cannot open an RDMA device: {e}")),
    }
}

/// The settings a transport of this configuration gets (the environment's `EXS_VERBS_*` included), found once by
/// opening one.
#[cfg(feature = "verbs")]
fn verbs_settings(
    cfg: &Result<exs_backend_verbs::VerbsConfig, String>,
    cache: &std::sync::OnceLock<Option<exs_backend_verbs::VerbsSettings>>,
) -> Option<exs_backend_verbs::VerbsSettings> {
    cache
        .get_or_init(|| {
            let c = cfg.as_ref().ok()?;
            exs_backend_verbs::VerbsTransport::open(c)
                .ok()
                .map(|t| t.settings().clone())
        })
        .clone()
}

/// The kernel's iWARP connection manager (iw_cm) marks a listener it destroys to drop its queued events: a request
/// the device (siw) reported just then is dropped with no reject, its TCP connection left open, and its client's
/// connect times out (after siw's ten-second MPA reply timer, or the engine's connect timeout). Requests that reach
/// user space, or are still waiting in the device for their MPA request, are refused.
#[cfg(feature = "verbs")]
const IWCM_DROPS_REQUESTS: &str =
    "iw_cm drops the connection requests it had queued for a listener being destroyed, \
     without a reject (their connects time out)";

#[cfg(feature = "verbs")]
fn verbs_describe(
    cfg: &Result<exs_backend_verbs::VerbsConfig, String>,
    s: Option<exs_backend_verbs::VerbsSettings>,
) -> String {
    let (c, s) = match (cfg, s) {
        (Err(why), _) => return why.clone(),
        (Ok(c), None) => return format!("no device at {}", c.addr),
        (Ok(c), Some(s)) => (c, s),
    };
    let kind = if s.limits.iwarp {
        "iWARP"
    } else {
        "InfiniBand/RoCE"
    };
    let imm = if s.emulated_imm {
        ", write-with-immediate emulated (write + send)"
    } else {
        ""
    };
    let keys = if s.memory_windows {
        ", keys: memory windows bound to one queue pair"
    } else {
        ", keys: one registration per exposure (no memory windows)"
    };
    let sinks = if s.read_sinks {
        ", RDMA read sinks registered per read (iWARP's way)"
    } else {
        ""
    };
    let rnr = if s.rnr_retry {
        ""
    } else {
        ", no receiver-not-ready retry (a message with no receive ends its connection)"
    };
    format!(
        "device {} ({kind}) at {}{imm}{keys}{sinks}{rnr}, inline {} B, {} scatter/gather entries, send queue {}, \
         largest message {} B",
        s.device, c.addr, s.inline, s.sge, s.send_depth, s.max_message
    )
}

#[cfg(feature = "verbs")]
fn verbs_keys_unbound(s: Option<exs_backend_verbs::VerbsSettings>) -> Option<String> {
    s.filter(|s| !s.memory_windows).map(|s| {
        format!(
            "{} exposes memory without memory windows ({}): each exposure is a registration whose key is valid on \
             every queue pair of the protection domain while it lives (the documented fallback)",
            s.device,
            if s.limits.windows { "EXS_VERBS_WINDOWS=0" } else { "the device has none" }
        )
    })
}

/// rdma-core verbs on the device carrying `EXS_VERBS_ADDR` (`EXS_VERBS_DEVICE` to check its name). The transport
/// reads the rest of its `EXS_VERBS_*` variables itself (`VerbsConfig::with_env`): `EXS_VERBS_EMULATE_IMM=1` forces
/// the write + send fallback for write-with-immediate, `EXS_VERBS_WINDOWS=0` exposures without memory windows,
/// `EXS_VERBS_READ_SINKS=1` iWARP's read sinks, `EXS_VERBS_INLINE` and the other limits lower the device's.
#[cfg(feature = "verbs")]
#[derive(Debug)]
pub struct Verbs(
    Result<exs_backend_verbs::VerbsConfig, String>,
    std::sync::OnceLock<Option<exs_backend_verbs::VerbsSettings>>,
);

#[cfg(feature = "verbs")]
impl Verbs {
    pub fn from_env() -> Self {
        let addr = std::env::var("EXS_VERBS_ADDR");
        let cfg = match addr.ok().and_then(|a| a.parse().ok()) {
            None => Err("EXS_VERBS_ADDR is not set to the IP address of an RDMA device".into()),
            Some(addr) => {
                let mut c = exs_backend_verbs::VerbsConfig::new(addr);
                c.device = std::env::var("EXS_VERBS_DEVICE").ok();
                Ok(c)
            }
        };
        Verbs(cfg, Default::default())
    }
}

#[cfg(feature = "verbs")]
impl Backend for Verbs {
    fn name(&self) -> &'static str {
        "verbs"
    }
    fn unavailable(&self) -> Option<String> {
        verbs_unavailable(&self.0)
    }
    fn describe(&self) -> String {
        verbs_describe(&self.0, verbs_settings(&self.0, &self.1))
    }
    fn net(&self) -> Box<dyn Net> {
        Box::new(VerbsNet(self.0.clone()))
    }
    fn processes(&self) -> bool {
        true
    }
    fn keys_unbound(&self) -> Option<String> {
        verbs_keys_unbound(verbs_settings(&self.0, &self.1))
    }
    fn access_errors_reset(&self) -> bool {
        verbs_settings(&self.0, &self.1).is_some_and(|s| s.limits.iwarp)
    }
    fn closing_listener_drops_requests(&self) -> Option<&'static str> {
        verbs_settings(&self.0, &self.1)
            .is_some_and(|s| s.limits.iwarp)
            .then_some(IWCM_DROPS_REQUESTS)
    }
}

/// The verbs backend on a Soft-RoCE (rxe) or soft-iWARP (siw) device found on this machine, with its IPv4 address.
#[cfg(feature = "softroce")]
#[derive(Debug)]
pub struct SoftRoce(
    Result<exs_backend_verbs::VerbsConfig, String>,
    std::sync::OnceLock<Option<exs_backend_verbs::VerbsSettings>>,
);

#[cfg(feature = "softroce")]
impl SoftRoce {
    /// The first active soft device with an IPv4 GID; `EXS_SOFTROCE_ADDR` picks the one carrying that address.
    pub fn discover() -> Self {
        use exs_backend_softroce::{devices, Kind};
        let want: Option<std::net::IpAddr> = std::env::var("EXS_SOFTROCE_ADDR")
            .ok()
            .and_then(|a| a.parse().ok());
        let found = devices()
            .into_iter()
            .filter(|d| d.kind != Kind::Hardware && d.active())
            .find_map(|d| {
                let ip = d
                    .ips()
                    .into_iter()
                    .find(|ip| ip.is_ipv4() && want.is_none_or(|w| *ip == w))?;
                let mut cfg = exs_backend_verbs::VerbsConfig::new(ip);
                cfg.device = Some(d.name.clone());
                Some(cfg)
            });
        SoftRoce(
            found.ok_or_else(|| {
                "no active Soft-RoCE device (rxe/siw) with an IPv4 address on this machine; run `cargo xtask rxe \
                 up` on a kernel with rdma_rxe, or `cargo xtask test`, which runs this suite in a VM"
                    .to_string()
            }),
            Default::default(),
        )
    }
}

#[cfg(feature = "softroce")]
impl Backend for SoftRoce {
    fn name(&self) -> &'static str {
        "softroce"
    }
    fn unavailable(&self) -> Option<String> {
        verbs_unavailable(&self.0)
    }
    fn describe(&self) -> String {
        verbs_describe(&self.0, verbs_settings(&self.0, &self.1))
    }
    fn net(&self) -> Box<dyn Net> {
        Box::new(VerbsNet(self.0.clone()))
    }
    fn processes(&self) -> bool {
        true
    }
    fn keys_unbound(&self) -> Option<String> {
        verbs_keys_unbound(verbs_settings(&self.0, &self.1))
    }
    fn access_errors_reset(&self) -> bool {
        verbs_settings(&self.0, &self.1).is_some_and(|s| s.limits.iwarp)
    }
    fn closing_listener_drops_requests(&self) -> Option<&'static str> {
        verbs_settings(&self.0, &self.1)
            .is_some_and(|s| s.limits.iwarp)
            .then_some(IWCM_DROPS_REQUESTS)
    }
}

//! Choosing a backend: by cargo feature, then by configuration or by environment (issue 16). One dependency does:
//!
//! ```toml
//! exs = { version = "0.1", features = ["verbs"] }   # or "fabric", "sim"
//! ```
//!
//! ```no_run
//! // EXS_BACKEND=verbs EXS_ADDR=192.168.1.5 (EXS_DEVICE=mlx5_0), or EXS_BACKEND=fabric EXS_PROVIDER=tcp
//! let ctx = exs::Context::from_env()?;
//! # Ok::<(), exs::TransportError>(())
//! ```
//!
//! A backend that is asked for but not compiled in is an error naming the ones that are.

#[cfg(feature = "sim")]
use std::sync::OnceLock;

use crate::context::Context;
use crate::transport::TransportError;

/// The libfabric backend (feature `fabric`): its configuration and transport.
#[cfg(feature = "fabric")]
pub use exs_backend_fabric as fabric;
/// The rdma-core verbs backend (feature `verbs`): its configuration and transport.
#[cfg(feature = "verbs")]
pub use exs_backend_verbs as verbs;

/// Which backend a context runs on, with its configuration.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Backend {
    /// libfabric (MSG endpoints): the `tcp` provider anywhere, `verbs` on RDMA hardware.
    #[cfg(feature = "fabric")]
    Fabric(fabric::FabricConfig),
    /// rdma-core verbs and rdma_cm: InfiniBand, RoCE (Mellanox), iWARP (Chelsio), Soft-RoCE.
    #[cfg(feature = "verbs")]
    Verbs(verbs::VerbsConfig),
    /// The simulated fabric, in this process: every context opened with it is a host of one network.
    #[cfg(feature = "sim")]
    Sim,
}

/// The backends compiled into this build, in the order [`Backend::from_env`] prefers them.
pub fn compiled() -> Vec<&'static str> {
    [
        cfg!(feature = "verbs").then_some("verbs"),
        cfg!(feature = "fabric").then_some("fabric"),
        cfg!(feature = "sim").then_some("sim"),
    ]
    .into_iter()
    .flatten()
    .collect()
}

fn missing(name: &str) -> TransportError {
    TransportError::NotFound {
        wanted: format!(
            "backend {name:?} (not compiled in: enable the cargo feature of the same name)"
        ),
        available: compiled().into_iter().map(String::from).collect(),
    }
}

impl Backend {
    /// The backend the environment names: `EXS_BACKEND` (`verbs`, `fabric`, `sim`; default: the first compiled
    /// in of those, in that order), with `EXS_ADDR` (verbs: an address of the RDMA device's interface, required)
    /// and `EXS_DEVICE` (verbs: the device that must carry it), `EXS_PROVIDER` (fabric, default `tcp`) and
    /// `EXS_DOMAIN` (fabric).
    pub fn from_env() -> Result<Backend, TransportError> {
        Self::from_vars(|k| std::env::var(k).ok().filter(|v| !v.is_empty()))
    }

    /// [`Backend::from_env`] over any source of variables.
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> Result<Backend, TransportError> {
        let name = match var("EXS_BACKEND") {
            Some(n) => n,
            None => compiled()
                .first()
                .map(|s| s.to_string())
                .ok_or_else(|| missing("any"))?,
        };
        match name.as_str() {
            "verbs" => {
                #[cfg(feature = "verbs")]
                {
                    let addr = var("EXS_ADDR").ok_or_else(|| {
                        TransportError::AddrNotAvailable(
                            "EXS_ADDR must name an IP address of the RDMA device's interface"
                                .into(),
                        )
                    })?;
                    let addr = addr.parse().map_err(|e| {
                        TransportError::AddrNotAvailable(format!("EXS_ADDR {addr:?}: {e}"))
                    })?;
                    let mut cfg = verbs::VerbsConfig::new(addr);
                    cfg.device = var("EXS_DEVICE");
                    Ok(Backend::Verbs(cfg))
                }
                #[cfg(not(feature = "verbs"))]
                Err(missing("verbs"))
            }
            "fabric" => {
                #[cfg(feature = "fabric")]
                {
                    let mut cfg = fabric::FabricConfig::provider(
                        &var("EXS_PROVIDER").unwrap_or_else(|| "tcp".into()),
                    );
                    cfg.domain = var("EXS_DOMAIN");
                    Ok(Backend::Fabric(cfg))
                }
                #[cfg(not(feature = "fabric"))]
                Err(missing("fabric"))
            }
            "sim" => {
                #[cfg(feature = "sim")]
                {
                    Ok(Backend::Sim)
                }
                #[cfg(not(feature = "sim"))]
                Err(missing("sim"))
            }
            other => Err(TransportError::NotFound {
                wanted: format!("backend {other:?} (EXS_BACKEND: verbs, fabric or sim)"),
                available: compiled().into_iter().map(String::from).collect(),
            }),
        }
    }
}

/// The process's simulated network (`Backend::Sim`).
#[cfg(feature = "sim")]
fn sim_world() -> &'static crate::sim::World {
    static WORLD: OnceLock<crate::sim::World> = OnceLock::new();
    WORLD.get_or_init(|| crate::sim::World::threaded(crate::sim::SimConfig::default()))
}

/// The address of host `host` of the process's simulated network, port `port` (`Backend::Sim`: contexts are
/// hosts 0, 1, ... in the order they were opened).
#[cfg(feature = "sim")]
pub fn sim_addr(host: usize, port: u16) -> std::net::SocketAddr {
    sim_world().addr(host, port)
}

impl Context {
    /// Opens a context on `backend` (with a progress thread and default options).
    pub fn open(backend: &Backend) -> Result<Context, TransportError> {
        Context::open_with(backend, crate::ContextOptions::default())
    }

    /// Opens a context on `backend` with `opts` (the simulated backend keeps its own clock and progress).
    pub fn open_with(
        backend: &Backend,
        opts: crate::ContextOptions,
    ) -> Result<Context, TransportError> {
        match backend {
            #[cfg(feature = "fabric")]
            Backend::Fabric(cfg) => {
                Context::with_options(Box::new(fabric::FabricTransport::open(cfg)?), opts)
            }
            #[cfg(feature = "verbs")]
            Backend::Verbs(cfg) => {
                Context::with_options(Box::new(verbs::VerbsTransport::open(cfg)?), opts)
            }
            #[cfg(feature = "sim")]
            Backend::Sim => Ok(sim_world().host_with(opts)),
            #[allow(unreachable_patterns)]
            _ => {
                let _ = opts;
                Err(missing("none"))
            }
        }
    }

    /// Opens a context on the backend the environment names (see [`Backend::from_env`]); `EXS_EXPOSURE=trusted`
    /// selects [`crate::ExposurePolicy::TrustedPeers`] (`per-operation`, the default, otherwise).
    pub fn from_env() -> Result<Context, TransportError> {
        let opts = crate::ContextOptions {
            exposure: crate::ExposurePolicy::from_env()?,
            ..Default::default()
        };
        Context::open_with(&Backend::from_env()?, opts)
    }
}

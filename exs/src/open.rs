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
//! A backend that is asked for but not compiled in is an error naming the ones that are. With `EXS_BACKEND` unset
//! (or `auto`) the choice follows the rules in `open/choose.rs`: features stay additive.

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

mod choose;

use choose::{choose, Choice};
pub use choose::{BackendKind, UnknownBackend};

/// The backends compiled into this build, in the order [`Backend::from_env`] prefers them.
pub fn compiled() -> Vec<&'static str> {
    compiled_kinds()
        .into_iter()
        .map(BackendKind::name)
        .collect()
}

fn compiled_kinds() -> Vec<BackendKind> {
    BackendKind::ALL
        .into_iter()
        .filter(|k| k.compiled_in())
        .collect()
}

fn missing(name: &str) -> TransportError {
    TransportError::NotFound {
        wanted: format!("the {name} backend: not compiled in (enable exs's cargo feature {name})"),
        available: compiled().into_iter().map(String::from).collect(),
    }
}

impl Backend {
    /// The backend the environment names: `EXS_BACKEND` (`verbs`, `fabric`, `sim`, any case), or with it unset
    /// or `auto`: verbs when an RDMA device carries `EXS_ADDR`, else libfabric, else the simulator when it is the
    /// only backend compiled in. Then `EXS_ADDR` (verbs: an address of the RDMA device's interface, required)
    /// and `EXS_DEVICE` (verbs: the device that must carry it), `EXS_PROVIDER` (fabric, default `tcp`),
    /// `EXS_DOMAIN` (fabric) and `EXS_FABRIC_CQ_WAIT` (fabric: `pollfd`, the default, `fd`, or `none` for
    /// completion queues without a wait object, see `fabric::CqWait`).
    pub fn from_env() -> Result<Backend, TransportError> {
        Self::from_vars(env_var)
    }

    /// [`Backend::from_env`] over any source of variables.
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> Result<Backend, TransportError> {
        Ok(Self::chosen(&var)?.0)
    }

    /// The kind of backend this is.
    pub fn kind(&self) -> BackendKind {
        match self {
            #[cfg(feature = "fabric")]
            Backend::Fabric(_) => BackendKind::Fabric,
            #[cfg(feature = "verbs")]
            Backend::Verbs(_) => BackendKind::Verbs,
            #[cfg(feature = "sim")]
            Backend::Sim => BackendKind::Sim,
            #[allow(unreachable_patterns)]
            _ => unreachable!("Backend has no variant without a backend compiled in"),
        }
    }

    fn chosen(var: &dyn Fn(&str) -> Option<String>) -> Result<(Backend, Choice), TransportError> {
        // Every setting is read without the spaces around it, and an empty one is unset, whatever the source
        // (`EXS_PROVIDER=" tcp "` named no provider; through `from_vars`, an empty `EXS_DOMAIN` named a domain).
        let var = |k: &str| {
            var(k)
                .map(|v| v.trim().to_owned())
                .filter(|v| !v.is_empty())
        };
        let choice = choose(&compiled_kinds(), &var, &choose::Devices)?;
        let backend = Self::configure(choice.kind, &var).map_err(|e| choice.failed(e))?;
        Ok((backend, choice))
    }

    /// The configuration of `kind` from the variables.
    fn configure(
        kind: BackendKind,
        var: &dyn Fn(&str) -> Option<String>,
    ) -> Result<Backend, TransportError> {
        match kind {
            #[cfg(feature = "verbs")]
            BackendKind::Verbs => {
                let addr = var("EXS_ADDR").ok_or_else(|| {
                    let devices = verbs::device_names();
                    TransportError::AddrNotAvailable(format!(
                        "EXS_ADDR is not set; verbs needs the IP address of an RDMA device's interface \
                         (RDMA devices here: {})",
                        if devices.is_empty() { "none".into() } else { devices.join(", ") }
                    ))
                })?;
                let mut cfg = verbs::VerbsConfig::new(choose::parse_addr(&addr)?);
                cfg.device = var("EXS_DEVICE");
                Ok(Backend::Verbs(cfg))
            }
            #[cfg(feature = "fabric")]
            BackendKind::Fabric => {
                let mut cfg = fabric::FabricConfig::provider(
                    &var("EXS_PROVIDER").unwrap_or_else(|| "tcp".into()),
                );
                cfg.domain = var("EXS_DOMAIN");
                if let Some(v) = var("EXS_FABRIC_CQ_WAIT") {
                    cfg.cq_wait = fabric::parse_cq_wait(&v).ok_or_else(|| {
                        TransportError::Invalid(format!(
                            "EXS_FABRIC_CQ_WAIT={v}: say pollfd (the default), fd or none"
                        ))
                    })?;
                }
                Ok(Backend::Fabric(cfg))
            }
            #[cfg(feature = "sim")]
            BackendKind::Sim => Ok(Backend::Sim),
            #[allow(unreachable_patterns)]
            other => {
                let _ = var;
                Err(missing(other.name()))
            }
        }
    }
}

impl Choice {
    /// `error`, saying which backend was being opened and how it was chosen.
    fn failed(&self, error: TransportError) -> TransportError {
        TransportError::Backend {
            backend: self.kind.name().into(),
            why: self.why.clone(),
            error: Box::new(error),
        }
    }
}

fn env_var(k: &str) -> Option<String> {
    std::env::var(k).ok().filter(|v| !v.is_empty())
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

    /// Opens a context on `backend` with `opts` (on the simulated backend: a new host of the process's simulated
    /// network, which runs in real time, with these options' progress and clock).
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
            Backend::Sim => {
                // Refused as on the other backends (review finding: the simulated host panicked on them).
                opts.check()?;
                Ok(sim_world().host_with(opts))
            }
            #[allow(unreachable_patterns)]
            _ => {
                let _ = opts;
                Err(missing("none"))
            }
        }
    }

    /// Opens a context on the backend the environment names (see [`Backend::from_env`]; the choice and why
    /// are logged at info level, and [`Context::backend`] reports it); `EXS_EXPOSURE=trusted` selects
    /// [`crate::ExposurePolicy::TrustedPeers`], `per-operation` (the default, also when unset or empty) the
    /// other; any other value is refused.
    pub fn from_env() -> Result<Context, TransportError> {
        let opts = crate::ContextOptions {
            exposure: crate::ExposurePolicy::from_env()?,
            ..Default::default()
        };
        let (backend, choice) = Backend::chosen(&env_var)?;
        tracing::info!(backend = %choice.kind, why = %choice.why, "exs backend chosen");
        Context::open_with(&backend, opts).map_err(|e| choice.failed(e))
    }

    /// The kind of backend this context runs on (`None` for a transport made outside exs, through
    /// [`Context::new`]).
    pub fn backend(&self) -> Option<BackendKind> {
        BackendKind::of_transport(&self.capabilities().name)
    }
}

#[cfg(all(test, feature = "fabric"))]
mod fabric_vars {
    use super::*;

    fn fabric(vars: &[(&str, &str)]) -> Result<fabric::FabricConfig, TransportError> {
        let var = |k: &str| {
            vars.iter()
                .find(|(n, _)| *n == k)
                .map(|(_, v)| v.to_string())
        };
        match Backend::from_vars(var)? {
            Backend::Fabric(cfg) => Ok(cfg),
            #[allow(unreachable_patterns)]
            other => panic!("not fabric: {other:?}"),
        }
    }

    #[test]
    fn settings_are_read_without_spaces_and_an_empty_one_is_unset() {
        let cfg = fabric(&[
            ("EXS_BACKEND", " fabric "),
            ("EXS_PROVIDER", " tcp "),
            ("EXS_DOMAIN", "   "),
        ])
        .unwrap();
        assert_eq!(cfg.provider, "tcp");
        assert_eq!(cfg.domain, None);
        let cfg = fabric(&[("EXS_BACKEND", "fabric"), ("EXS_PROVIDER", "")]).unwrap();
        assert_eq!(cfg.provider, "tcp", "an empty provider is the default one");
    }

    #[test]
    fn fabric_completion_queues_have_a_wait_object_unless_the_environment_says_none() {
        use fabric::CqWait;
        let cq_wait = |v: &str| fabric(&[("EXS_BACKEND", "fabric"), ("EXS_FABRIC_CQ_WAIT", v)]);
        let unset = fabric(&[("EXS_BACKEND", "fabric")]).unwrap().cq_wait;
        assert_eq!(unset, CqWait::PollFd);
        assert_eq!(cq_wait("pollfd").unwrap().cq_wait, CqWait::PollFd);
        assert_eq!(cq_wait("fd").unwrap().cq_wait, CqWait::Fd);
        assert_eq!(cq_wait("none").unwrap().cq_wait, CqWait::None);
        assert_eq!(cq_wait(" None ").unwrap().cq_wait, CqWait::None);
        let e = cq_wait("sometimes").unwrap_err();
        assert!(
            e.to_string().contains("EXS_FABRIC_CQ_WAIT=sometimes"),
            "{e}"
        );
        // Whose fault: the chosen backend's configuration, named with the variable that chose it.
        assert!(e.to_string().contains("EXS_BACKEND=fabric"), "{e}");
    }
}

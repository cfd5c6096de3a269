//! Opening a backend chosen at run time (`--backend`), among those compiled in.

use std::net::{IpAddr, SocketAddr};

use exs::Context;

/// Which backend and how to reach it.
#[derive(Clone, Debug, clap::Args)]
pub struct BackendArgs {
    /// Backend: fabric (libfabric) or sim (in-process simulated fabric).
    #[arg(long, default_value = "fabric")]
    pub backend: String,
    /// libfabric provider (fabric backend): tcp, verbs, net, sockets.
    #[arg(long, default_value = "tcp")]
    pub provider: String,
    /// libfabric domain (interface or device), if not the provider's first.
    #[arg(long)]
    pub domain: Option<String>,
    /// Address to listen on / connect to.
    #[arg(long, default_value = "127.0.0.1")]
    pub addr: IpAddr,
}

/// Backends compiled into this binary.
pub fn compiled() -> Vec<&'static str> {
    #[allow(unused_mut)]
    let mut v = Vec::new();
    #[cfg(feature = "fabric")]
    v.push("fabric");
    #[cfg(feature = "sim")]
    v.push("sim");
    v
}

/// An opened backend: contexts and addresses.
pub enum Opened {
    #[cfg(feature = "fabric")]
    Fabric(exs_backend_fabric::FabricConfig, IpAddr),
    #[cfg(feature = "sim")]
    Sim(exs::sim::World),
}

impl Opened {
    pub fn open(a: &BackendArgs) -> Result<Opened, String> {
        match a.backend.as_str() {
            #[cfg(feature = "fabric")]
            "fabric" => Ok(Opened::Fabric(
                exs_backend_fabric::FabricConfig {
                    provider: a.provider.clone(),
                    domain: a.domain.clone(),
                },
                a.addr,
            )),
            #[cfg(feature = "sim")]
            "sim" => Ok(Opened::Sim(exs::sim::World::threaded(
                exs::sim::SimConfig::default(),
            ))),
            other => Err(format!(
                "backend {other:?} is not compiled in; this binary has: {}",
                compiled().join(", ")
            )),
        }
    }

    /// A new host context.
    pub fn host(&self) -> Result<Context, String> {
        match self {
            #[cfg(feature = "fabric")]
            Opened::Fabric(cfg, _) => exs_backend_fabric::context(cfg).map_err(|e| e.to_string()),
            #[cfg(feature = "sim")]
            Opened::Sim(w) => Ok(w.host()),
        }
    }

    /// Where the `i`th host listens (port 0: any).
    pub fn listen_addr(&self, i: usize) -> SocketAddr {
        match self {
            #[cfg(feature = "fabric")]
            Opened::Fabric(_, ip) => SocketAddr::new(*ip, 0),
            #[cfg(feature = "sim")]
            Opened::Sim(w) => w.addr(i, 0),
        }
    }

    /// Whether client and server can live in separate processes.
    pub fn processes(&self) -> bool {
        match self {
            #[cfg(feature = "fabric")]
            Opened::Fabric(..) => true,
            #[cfg(feature = "sim")]
            Opened::Sim(_) => false,
        }
    }

    /// Name for reports, e.g. `exs (fabric/tcp)`.
    pub fn label(&self) -> String {
        match self {
            #[cfg(feature = "fabric")]
            Opened::Fabric(cfg, _) => format!("exs (fabric/{})", cfg.provider),
            #[cfg(feature = "sim")]
            Opened::Sim(_) => "exs (sim)".into(),
        }
    }
}

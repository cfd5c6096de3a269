//! The backends compiled into this build.

use std::net::SocketAddr;

use exs::Context;

use crate::{Backend, Net};

/// Every backend enabled by cargo features.
pub fn enabled() -> Vec<Box<dyn Backend>> {
    #[allow(unused_mut)]
    let mut v: Vec<Box<dyn Backend>> = Vec::new();
    #[cfg(feature = "sim")]
    v.push(Box::new(Sim));
    #[cfg(feature = "fabric")]
    v.push(Box::new(Fabric::from_env()));
    v
}

/// Looks a backend up by name (child processes rebuild their parent's backend).
pub fn by_name(name: &str) -> Option<Box<dyn Backend>> {
    enabled().into_iter().find(|b| b.name() == name)
}

#[cfg(feature = "sim")]
pub struct Sim;

#[cfg(feature = "sim")]
struct SimNet(exs::sim::World);

#[cfg(feature = "sim")]
impl Net for SimNet {
    fn host(&self) -> Context {
        self.0.host()
    }
    fn listen_addr(&self, i: usize) -> SocketAddr {
        self.0.addr(i, 0)
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
        // Progress threads, as on a real device; the deterministic manual mode is for the exs crate's tests.
        Box::new(SimNet(exs::sim::World::threaded(exs::sim::SimConfig::default())))
    }
    fn processes(&self) -> bool {
        false
    }
}

#[cfg(feature = "fabric")]
pub struct Fabric {
    cfg: exs_backend_fabric::FabricConfig,
    addr: std::net::IpAddr,
}

#[cfg(feature = "fabric")]
impl Fabric {
    /// `EXS_FABRIC_PROVIDER` (default tcp), `EXS_FABRIC_DOMAIN`, `EXS_FABRIC_ADDR` (default 127.0.0.1).
    pub fn from_env() -> Self {
        let provider = std::env::var("EXS_FABRIC_PROVIDER").unwrap_or_else(|_| "tcp".into());
        let domain = std::env::var("EXS_FABRIC_DOMAIN").ok();
        let addr = std::env::var("EXS_FABRIC_ADDR").ok().and_then(|a| a.parse().ok()).unwrap_or([127, 0, 0, 1].into());
        Fabric { cfg: exs_backend_fabric::FabricConfig { provider, domain }, addr }
    }
}

#[cfg(feature = "fabric")]
struct FabricNet {
    cfg: exs_backend_fabric::FabricConfig,
    addr: std::net::IpAddr,
}

#[cfg(feature = "fabric")]
impl Net for FabricNet {
    fn host(&self) -> Context {
        exs_backend_fabric::context(&self.cfg).expect("open the libfabric provider")
    }
    fn listen_addr(&self, _i: usize) -> SocketAddr {
        SocketAddr::new(self.addr, 0)
    }
}

#[cfg(feature = "fabric")]
impl Backend for Fabric {
    fn name(&self) -> &'static str {
        "fabric"
    }
    fn unavailable(&self) -> Option<String> {
        match exs_backend_fabric::FabricTransport::open(&self.cfg) {
            Ok(_) => None,
            Err(e) => Some(format!("libfabric provider {:?} cannot be opened: {e}", self.cfg.provider)),
        }
    }
    fn net(&self) -> Box<dyn Net> {
        Box::new(FabricNet { cfg: self.cfg.clone(), addr: self.addr })
    }
    fn processes(&self) -> bool {
        true
    }
}

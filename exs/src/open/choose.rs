//! Which backend `Context::from_env` opens: a pure function of the backends compiled in, the environment and
//! what the machine's RDMA devices answer, so that every rule has a unit test.
//!
//! Cargo features are additive: a program that runs with `fabric` alone must still run once `verbs` is added
//! beside it. So with `EXS_BACKEND` unset (or `auto`) verbs is taken only when an RDMA device carries the address
//! the program asked for (`EXS_ADDR`); otherwise libfabric (its `tcp` provider by default); the simulator only
//! when it is the one backend compiled in, since a program that silently talks to an in-process network instead
//! of the one it meant would be worse than an error.

use std::fmt;
use std::net::IpAddr;
use std::str::FromStr;

use crate::transport::TransportError;

/// A kind of backend without its configuration: what `EXS_BACKEND` names and [`crate::Context::backend`]
/// reports. Displayed and parsed in lower case (parsing ignores case).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum BackendKind {
    /// rdma-core verbs and rdma_cm (feature `verbs`).
    Verbs,
    /// libfabric MSG endpoints (feature `fabric`).
    Fabric,
    /// The simulated fabric in this process (feature `sim`).
    Sim,
}

impl BackendKind {
    /// Every kind, in the order of preference when more than one could serve.
    pub const ALL: [BackendKind; 3] = [BackendKind::Verbs, BackendKind::Fabric, BackendKind::Sim];

    /// The name `EXS_BACKEND` and the cargo feature use.
    pub fn name(self) -> &'static str {
        match self {
            BackendKind::Verbs => "verbs",
            BackendKind::Fabric => "fabric",
            BackendKind::Sim => "sim",
        }
    }

    /// Whether this build has the backend (its cargo feature is on).
    pub fn compiled_in(self) -> bool {
        match self {
            BackendKind::Verbs => cfg!(feature = "verbs"),
            BackendKind::Fabric => cfg!(feature = "fabric"),
            BackendKind::Sim => cfg!(feature = "sim"),
        }
    }

    /// The kind of a transport from its capability name (`verbs/rxe0`, `fabric/tcp/lo`, `sim`).
    pub(crate) fn of_transport(name: &str) -> Option<BackendKind> {
        let head = name.split('/').next().unwrap_or(name);
        head.parse().ok()
    }
}

impl fmt::Display for BackendKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A backend name that is none of `verbs`, `fabric`, `sim`.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{0} is not a backend (verbs, fabric or sim)")]
pub struct UnknownBackend(pub String);

impl FromStr for BackendKind {
    type Err = UnknownBackend;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        BackendKind::ALL
            .into_iter()
            .find(|k| s.trim().eq_ignore_ascii_case(k.name()))
            .ok_or_else(|| UnknownBackend(s.trim().to_string()))
    }
}

/// The backend chosen, and why (for the log and for an error if it then fails to open).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Choice {
    pub kind: BackendKind,
    pub why: String,
}

/// What the machine's RDMA side answers (asked only when verbs is compiled in and may be chosen).
pub(crate) trait Rdma {
    /// The device that carries `addr`, or why none does.
    fn device_for(&self, addr: IpAddr) -> Result<String, String>;
    /// The RDMA devices present.
    fn devices(&self) -> Vec<String>;
}

fn not_found(wanted: String, compiled: &[BackendKind]) -> TransportError {
    TransportError::NotFound {
        wanted,
        available: compiled.iter().map(|k| k.name().to_string()).collect(),
    }
}

fn device_list(rdma: &dyn Rdma) -> String {
    let d = rdma.devices();
    if d.is_empty() {
        "this machine has none".into()
    } else {
        format!("this machine has {}", d.join(", "))
    }
}

/// Chooses the backend `Context::from_env` opens; `var` reads the environment (`EXS_BACKEND`, `EXS_ADDR`).
pub(crate) fn choose(
    compiled: &[BackendKind],
    var: &dyn Fn(&str) -> Option<String>,
    rdma: &dyn Rdma,
) -> Result<Choice, TransportError> {
    let asked = var("EXS_BACKEND").filter(|v| !v.trim().eq_ignore_ascii_case("auto"));
    if let Some(asked) = asked {
        let kind: BackendKind = asked.parse().map_err(|e: UnknownBackend| {
            not_found(format!("EXS_BACKEND={}: {e}", e.0), compiled)
        })?;
        if !compiled.contains(&kind) {
            return Err(not_found(
                format!("EXS_BACKEND={kind}: the {kind} backend is not compiled in (enable exs's cargo feature {kind})"),
                compiled,
            ));
        }
        return Ok(Choice {
            kind,
            why: format!("EXS_BACKEND={kind}"),
        });
    }
    // Said, not passed over for the next backend.
    let addr = var("EXS_ADDR")
        .filter(|a| !a.trim().is_empty())
        .map(|a| parse_addr(&a))
        .transpose()?;
    let mut passed = Vec::new();
    if compiled.contains(&BackendKind::Verbs) {
        match verbs_serves(addr, rdma) {
            Ok(why) => {
                return Ok(Choice {
                    kind: BackendKind::Verbs,
                    why,
                })
            }
            Err(why) => passed.push(format!("not verbs: {why}")),
        }
    }
    if compiled.contains(&BackendKind::Fabric) {
        passed.push("libfabric's tcp provider runs anywhere libfabric is installed".into());
        return Ok(Choice {
            kind: BackendKind::Fabric,
            why: passed.join("; "),
        });
    }
    if compiled == [BackendKind::Sim] {
        return Ok(Choice {
            kind: BackendKind::Sim,
            why: "the only backend compiled in".into(),
        });
    }
    if compiled.is_empty() {
        return Err(not_found(
            "a backend: none is compiled in (enable exs's cargo feature verbs, fabric or sim)"
                .into(),
            compiled,
        ));
    }
    if compiled.contains(&BackendKind::Sim) {
        passed.push(
            "the simulator is taken only when EXS_BACKEND=sim or it is the only backend".into(),
        );
    }
    Err(not_found(
        format!("a backend that can serve here ({})", passed.join("; ")),
        compiled,
    ))
}

/// `EXS_ADDR`'s value as an IP address. One that is not an address is the user's mistake, whichever backend it
/// was meant for (`EADDRNOTAVAIL` in C).
pub(crate) fn parse_addr(addr: &str) -> Result<IpAddr, TransportError> {
    addr.trim().parse().map_err(|_| {
        TransportError::AddrNotAvailable(format!("EXS_ADDR={addr} is not an IP address"))
    })
}

/// Why verbs can serve (an RDMA device carries `addr`, `EXS_ADDR`), or why not, in plain words.
fn verbs_serves(addr: Option<IpAddr>, rdma: &dyn Rdma) -> Result<String, String> {
    let Some(ip) = addr else {
        return Err(format!(
            "EXS_ADDR is not set (verbs needs the IP address of an RDMA device's interface; {})",
            device_list(rdma)
        ));
    };
    match rdma.device_for(ip) {
        Ok(dev) => Ok(format!("the RDMA device {dev} carries EXS_ADDR={ip}")),
        Err(why) => {
            tracing::debug!(%ip, %why, "verbs: no device for the address");
            Err(format!(
                "no RDMA device carries EXS_ADDR={ip} ({})",
                device_list(rdma)
            ))
        }
    }
}

/// The machine's RDMA devices, through the verbs backend.
#[cfg(feature = "verbs")]
pub(crate) struct Devices;

#[cfg(feature = "verbs")]
impl Rdma for Devices {
    fn device_for(&self, addr: IpAddr) -> Result<String, String> {
        exs_backend_verbs::device_for(addr).map_err(|e| e.to_string())
    }

    fn devices(&self) -> Vec<String> {
        exs_backend_verbs::device_names()
    }
}

/// No verbs backend: no RDMA devices to ask.
#[cfg(not(feature = "verbs"))]
pub(crate) struct Devices;

#[cfg(not(feature = "verbs"))]
impl Rdma for Devices {
    fn device_for(&self, _: IpAddr) -> Result<String, String> {
        Err("the verbs backend is not compiled in".into())
    }

    fn devices(&self) -> Vec<String> {
        Vec::new()
    }
}

#[cfg(test)]
mod tests;

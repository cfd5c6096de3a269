use super::*;
use BackendKind::{Fabric, Sim, Verbs};

/// A machine with RDMA devices, one of which carries `carried`.
struct Machine {
    devices: Vec<&'static str>,
    carried: Option<(IpAddr, &'static str)>,
}

impl Rdma for Machine {
    fn device_for(&self, addr: IpAddr) -> Result<String, String> {
        match self.carried {
            Some((a, d)) if a == addr => Ok(d.into()),
            _ => Err("No such device".into()),
        }
    }

    fn devices(&self) -> Vec<String> {
        self.devices.iter().map(|d| d.to_string()).collect()
    }
}

const NO_RDMA: Machine = Machine {
    devices: Vec::new(),
    carried: None,
};

fn rxe() -> Machine {
    Machine {
        devices: vec!["rxe0"],
        carried: Some(("10.0.0.5".parse().unwrap(), "rxe0")),
    }
}

fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
    let pairs: Vec<(String, String)> = pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    move |k| pairs.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone())
}

fn kind(compiled: &[BackendKind], vars: &[(&str, &str)], m: &Machine) -> BackendKind {
    choose(compiled, &env(vars), m).expect("a backend").kind
}

fn refusal(compiled: &[BackendKind], vars: &[(&str, &str)], m: &Machine) -> String {
    choose(compiled, &env(vars), m)
        .expect_err("no backend")
        .to_string()
}

#[test]
fn adding_verbs_beside_fabric_keeps_fabric_when_no_device_serves() {
    assert_eq!(kind(&[Fabric], &[], &NO_RDMA), Fabric);
    assert_eq!(kind(&[Verbs, Fabric], &[], &NO_RDMA), Fabric);
    assert_eq!(kind(&[Verbs, Fabric, Sim], &[], &NO_RDMA), Fabric);
    assert_eq!(
        kind(&[Verbs, Fabric], &[("EXS_ADDR", "127.0.0.1")], &rxe()),
        Fabric
    );
}

#[test]
fn auto_takes_verbs_when_a_device_carries_the_address() {
    let c = choose(&[Verbs, Fabric], &env(&[("EXS_ADDR", "10.0.0.5")]), &rxe()).unwrap();
    assert_eq!(c.kind, Verbs);
    assert_eq!(c.why, "the RDMA device rxe0 carries EXS_ADDR=10.0.0.5");
    let auto = [("EXS_BACKEND", "AUTO"), ("EXS_ADDR", "10.0.0.5")];
    assert_eq!(kind(&[Verbs, Fabric, Sim], &auto, &rxe()), Verbs);
}

#[test]
fn the_simulator_is_taken_alone_or_by_name_only() {
    assert_eq!(kind(&[Sim], &[], &NO_RDMA), Sim);
    assert_eq!(kind(&[Fabric, Sim], &[], &NO_RDMA), Fabric);
    assert_eq!(
        refusal(&[Verbs, Sim], &[], &NO_RDMA),
        "not found: a backend that can serve here (not verbs: EXS_ADDR is not set (verbs needs the IP address \
         of an RDMA device's interface; this machine has none); the simulator is taken only when EXS_BACKEND=sim \
         or it is the only backend); available: verbs, sim"
    );
    assert_eq!(
        kind(&[Verbs, Sim], &[("EXS_BACKEND", "sim")], &NO_RDMA),
        Sim
    );
}

#[test]
fn verbs_alone_without_a_device_says_what_it_needs() {
    assert_eq!(
        refusal(&[Verbs], &[], &NO_RDMA),
        "not found: a backend that can serve here (not verbs: EXS_ADDR is not set (verbs needs the IP address \
         of an RDMA device's interface; this machine has none)); available: verbs"
    );
    assert_eq!(
        refusal(&[Verbs], &[("EXS_ADDR", "10.9.9.9")], &rxe()),
        "not found: a backend that can serve here (not verbs: no RDMA device carries EXS_ADDR=10.9.9.9 (this \
         machine has rxe0)); available: verbs"
    );
    // Not an address at all: the user's mistake, said whichever backends are compiled in (with libfabric beside
    // verbs it was passed over, and libfabric opened as if nothing were wrong).
    for compiled in [&[Verbs][..], &[Verbs, Fabric][..], &[Fabric][..]] {
        assert_eq!(
            refusal(compiled, &[("EXS_ADDR", "rxe0")], &rxe()),
            "address not available: EXS_ADDR=rxe0 is not an IP address",
            "{compiled:?}"
        );
    }
    assert!(choose(
        &[Verbs, Fabric],
        &env(&[("EXS_ADDR", "10.0.0.500")]),
        &rxe()
    )
    .is_err());
}

#[test]
fn backend_names_ignore_case_and_an_explicit_choice_is_kept() {
    for name in ["fabric", "FABRIC", " Fabric "] {
        assert_eq!(
            kind(&[Verbs, Fabric], &[("EXS_BACKEND", name)], &rxe()),
            Fabric
        );
    }
    let c = choose(
        &[Verbs, Fabric],
        &env(&[("EXS_BACKEND", "Verbs")]),
        &NO_RDMA,
    )
    .unwrap();
    assert_eq!((c.kind, c.why.as_str()), (Verbs, "EXS_BACKEND=verbs"));
    assert_eq!("SIM".parse::<BackendKind>(), Ok(Sim));
    assert_eq!(Fabric.to_string(), "fabric");
}

#[test]
fn an_unknown_or_missing_backend_is_named_without_nested_quotes() {
    assert_eq!(
        refusal(&[Fabric], &[("EXS_BACKEND", "nonsense")], &NO_RDMA),
        "not found: EXS_BACKEND=nonsense: nonsense is not a backend (verbs, fabric or sim); available: fabric"
    );
    assert_eq!(
        refusal(&[Fabric, Sim], &[("EXS_BACKEND", "verbs")], &NO_RDMA),
        "not found: EXS_BACKEND=verbs: the verbs backend is not compiled in (enable exs's cargo feature verbs); \
         available: fabric, sim"
    );
    assert_eq!(
        refusal(&[], &[], &NO_RDMA),
        "not found: a backend: none is compiled in (enable exs's cargo feature verbs, fabric or sim); available: \
         none"
    );
}

#[test]
fn a_transport_name_tells_its_kind() {
    assert_eq!(BackendKind::of_transport("fabric/tcp/lo"), Some(Fabric));
    assert_eq!(BackendKind::of_transport("verbs/rxe0"), Some(Verbs));
    assert_eq!(BackendKind::of_transport("sim"), Some(Sim));
    assert_eq!(BackendKind::of_transport("other"), None);
}

//! `cargo xtask vm [--siw] [--hosts 2] -- ...`: commands run by hand in the throw-away guests of [`crate::vm`].

use std::io::Write;
use std::time::Duration;

use crate::sys::{self, Result};
use crate::vm::{shell_quote, tail, GuestDevice, Vm, PAIR_ADDRS, RETRY};

/// The device of the guests: rxe, or siw built for the guest's kernel (`--siw`).
fn device(vm: &Vm, siw: bool) -> Result<GuestDevice> {
    if !siw {
        return Ok(GuestDevice::Rxe);
    }
    let m = crate::siw::prepare(vm.dir(), &vm.kver)?;
    Ok(GuestDevice::Siw(m.path(crate::siw::Variant::Stock)))
}

/// `cargo xtask vm -- CMD...`: runs a command in the guest with rxe0 (or siw0) on a dummy interface at
/// 192.168.77.1 (rxe on `lo` breaks rdma_cm), printing its output.
pub fn run_command(args: Vec<String>, siw: bool) -> Result<()> {
    let vm = Vm::prepare()?;
    let dev = device(&vm, siw)?;
    let mut script = String::from(
        "ip link set lo up\n\
         ip link add dummy0 type dummy 2>/dev/null || true\n\
         ip addr add 192.168.77.1/24 dev dummy0\n\
         ip link set dummy0 up\n",
    );
    script.push_str(&dev.setup("dummy0"));
    let cwd = std::env::current_dir().map_err(|e| e.to_string())?;
    script.push_str(&format!("cd {}\n", cwd.display()));
    script.push_str(
        &args
            .iter()
            .map(|a| shell_quote(a))
            .collect::<Vec<_>>()
            .join(" "),
    );
    script.push('\n');
    let o = vm.run_streaming(&script, Duration::from_secs(1800), &mut |l, err| {
        if err {
            eprintln!("{l}");
        } else {
            println!("{l}");
        }
    })?;
    let _ = std::io::stdout().flush();
    match o.rc {
        Some(0) => Ok(()),
        Some(rc) => Err(format!("the command exited with {rc} in the VM")),
        None => Err("the VM did not report an exit code".into()),
    }
}

/// What the two guests run when `cargo xtask vm --hosts 2` gets no commands: exs pump (verbs, then libfabric tcp)
/// and ib_write_bw, servers in guest 0 and clients in guest 1.
fn pair_demo(dev: &str) -> [String; 2] {
    let rdma_cm = if dev == "siw0" { " -R" } else { "" };
    [
        format!(
            "target/release/exs pump --server --once --backend verbs --addr 10.77.0.1 -p 18515 && \
             target/release/exs pump --server --once --backend fabric --addr 10.77.0.1 -p 18516 && \
             ib_write_bw -d {dev}{rdma_cm} -s 65536 -n 500"
        ),
        format!(
            "retry target/release/exs pump --client 10.77.0.1:18515 --backend verbs --addr 10.77.0.2 --size 64K,1M --seconds 2 && \
             retry target/release/exs pump --client 10.77.0.1:18516 --backend fabric --addr 10.77.0.2 --size 64K,1M --seconds 2 && \
             retry ib_write_bw -d {dev}{rdma_cm} -s 65536 -n 500 10.77.0.1"
        ),
    ]
}

/// `cargo xtask vm --hosts 2 [-- GUEST0_LINE GUEST1_LINE]`.
pub fn run_pair_command(args: Vec<String>, siw: bool) -> Result<()> {
    let vm = Vm::prepare()?;
    let dev = device(&vm, siw)?;
    let lines: [String; 2] = match args.as_slice() {
        [] => {
            if !sys::root().join("target/release/exs").exists() {
                sys::run(sys::cargo().args(["build", "--release", "-p", "exs-tools"]))?;
            }
            pair_demo(dev.name())
        }
        [a, b] => [a.clone(), b.clone()],
        _ => {
            return Err(
                "cargo xtask vm --hosts 2 takes two shell lines (guest 0, guest 1) or none".into(),
            )
        }
    };
    let cwd = std::env::current_dir().map_err(|e| e.to_string())?;
    let scripts: Vec<String> = lines
        .iter()
        .map(|l| format!("{RETRY}cd {}\n{l}\n", cwd.display()))
        .collect();
    eprintln!(
        "xtask: two guests ({:?}), guest 0 at {} and guest 1 at {} ({} on eth0 in each)",
        vm.accel,
        PAIR_ADDRS[0],
        PAIR_ADDRS[1],
        dev.name()
    );
    let o = vm.run_pair(
        &dev,
        [&scripts[0], &scripts[1]],
        Duration::from_secs(1800),
        &mut |i, l, err| {
            if err {
                eprintln!("[guest{i}] {l}");
            } else {
                println!("[guest{i}] {l}");
            }
        },
    )?;
    let _ = std::io::stdout().flush();
    for (i, o) in o.iter().enumerate() {
        match o.rc {
            Some(0) => {}
            Some(rc) => return Err(format!("guest {i} exited with {rc}")),
            None => {
                return Err(format!(
                    "guest {i} reported no exit code; console:\n{}",
                    tail(&o.console, 20)
                ))
            }
        }
    }
    Ok(())
}

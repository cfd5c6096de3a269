//! # The ES-API in C
//!
//! `libexs.so` and `libexs.a` with `exs.h`: the functions of seed 002's Figure 2 (`exs_init`, `exs_socket`,
//! `exs_bind`, `exs_listen`, `exs_accept`, `exs_connect`, `exs_send`, `exs_recv`, `exs_send_offset`,
//! `exs_recv_offset`, `exs_sendfile`, `exs_poll`, `exs_fcntl`, `exs_shutdown`, `exs_close`, `exs_getsockname`,
//! `exs_getpeername`) and the ES-API's event queues and memory registration (`exs_qcreate`, `exs_qdequeue`,
//! `exs_qdelete`, `exs_mregister`, `exs_mderegister`), over the Rust API of [`exs`] with both backends
//! (libfabric and rdma-core verbs). `cargo xtask c` installs them with `exs.pc` for pkg-config.
//!
//! Each C function is one thin call of the Rust API, in the module of its kind: [`socket`], [`data`],
//! [`queue`], [`memory`], [`fcntl`]. Around every call: the handles are checked ([`handles`]: a bad one is
//! `EBADF`, never undefined behaviour), a failure is -1 with the `errno` a socket user expects ([`errno`]),
//! and a panic is caught and reported as `EIO` rather than unwinding into C. Every call may be made from any
//! thread at any time.
//!
//! `include/exs.h` is generated from this crate by cbindgen (`cbindgen.toml`); a test regenerates it and fails
//! when the committed header differs, so the two cannot drift.
//!
//! 64-bit targets only: the header takes `off_t` and `struct timespec` from the C library, whose sizes a 32-bit
//! program chooses itself (`_FILE_OFFSET_BITS`, `_TIME_BITS`), and this library could not know which it chose.

#![allow(non_camel_case_types)]
#![deny(missing_docs)]

// Review finding: on a 32-bit target the program and the library could disagree on `off_t` and `time_t`.
#[cfg(not(target_pointer_width = "64"))]
compile_error!(
    "exs-capi is for 64-bit targets: exs.h takes off_t and struct timespec from the C library, whose sizes a \
     32-bit program chooses (_FILE_OFFSET_BITS, _TIME_BITS)"
);

use libc::{c_int, c_void};

mod addr;
mod errno;
mod handles;
#[cfg(test)]
mod tests;

// exs.h lists the functions in this order (cbindgen follows the modules as declared; rustfmt sorts a group).
pub mod abi;

pub mod queue;

pub mod memory;

pub mod socket;

pub mod data;

pub mod fcntl;

/// Checks the ES-API version and opens the process's context (ES-API `exs_init`): a device and one progress
/// thread, on the backend the environment names, as the Rust `Context::from_env` does: `EXS_BACKEND` (`verbs` or
/// `fabric`, the backends `libexs` is built with; unset or `auto`: verbs when an RDMA device carries `EXS_ADDR`,
/// else libfabric), with
/// `EXS_ADDR` (verbs: an address of the RDMA device's interface) and `EXS_DEVICE`, or `EXS_PROVIDER` (fabric, default `tcp`), `EXS_DOMAIN` and `EXS_FABRIC_CQ_WAIT` (`none`: completion queues without a wait object, for busy polling); `EXS_EXPOSURE=trusted` for the
/// UNH-EXS key per region and connection. Call it before any other call but `exs_qcreate`; later calls return 0
/// and keep the context. Returns 0, or -1 with `errno`: `EINVAL` (`version` is not `EXS_VERSION`, or an unknown
/// value of `EXS_EXPOSURE` or `EXS_FABRIC_CQ_WAIT`), `ENODEV` (no
/// such backend, device or provider), `EADDRNOTAVAIL` (`EXS_BACKEND=verbs` with `EXS_ADDR` missing or not a
/// device's), `ENOMEM`.
#[no_mangle]
pub extern "C" fn exs_init(version: c_int) -> c_int {
    errno::call(|| {
        let version = u32::try_from(version).map_err(|_| errno::Errno(libc::EINVAL))?;
        exs::init(version)?;
        handles::open_context(exs::Context::from_env).map_err(|e| errno::Errno(init_errno(&e)))?;
        Ok(0)
    })
}

/// `exs_init`'s errno for a context that did not open. libfabric that cannot be used here (not installed, or no
/// provider that can serve) or a provider or domain that does not exist is `ENODEV`, as the header says, not the
/// call's own code (review finding: `EOPNOTSUPP` and `ENOENT` reached C). A device's settings that conflict (a
/// verbs option the device cannot honour) keep their own errno.
fn init_errno(e: &exs::transport::TransportError) -> c_int {
    use exs::transport::TransportError as T;
    match e {
        T::Backend { backend, error, .. } => match &**error {
            T::Unsupported(_) if backend == "fabric" => libc::ENODEV,
            T::Os { kind, .. } if *kind == std::io::ErrorKind::NotFound => libc::ENODEV,
            _ => errno::ToErrno::errno(e),
        },
        _ => errno::ToErrno::errno(e),
    }
}

/// The user context pointer of an operation, as the Rust API carries it.
fn ctx_value(context: *mut c_void) -> u64 {
    context as usize as u64
}

//! The libfabric calls every part of the backend makes: libfabric's error codes as transport errors,
//! `fi_getinfo` with exs's hints (serialised: it fills process-wide tables), and a queue's wait descriptor in an
//! epoll set.

use std::ffi::{c_void, CStr, CString};
use std::os::fd::{BorrowedFd, RawFd};
use std::ptr;

use exs_transport::TransportError;
use nix::sys::epoll::{Epoll, EpollEvent, EpollFlags};

use crate::ffi::*;

pub(crate) fn err(call: &str, ret: i64) -> TransportError {
    let code = ret.unsigned_abs();
    let kind = match code as u32 {
        FI_EAGAIN => std::io::ErrorKind::WouldBlock,
        FI_ECONNREFUSED => std::io::ErrorKind::ConnectionRefused,
        FI_ETIMEDOUT => std::io::ErrorKind::TimedOut,
        98 => std::io::ErrorKind::AddrInUse,
        99 => std::io::ErrorKind::AddrNotAvailable,
        12 => std::io::ErrorKind::OutOfMemory,
        22 => std::io::ErrorKind::InvalidInput,
        61 => std::io::ErrorKind::NotFound, // FI_ENODATA
        _ => std::io::ErrorKind::Other,
    };
    tracing::debug!(call, ret, "libfabric call failed: {}", strerror(ret));
    TransportError::Os {
        call: exs_transport::CallError {
            call: call.into(),
            code: ret,
        },
        kind,
        message: exs_transport::plain_text(&strerror(ret)),
    }
}

/// Serialises the calls that read or build libfabric's process-wide provider tables (`fi_getinfo`, `fi_fabric`).
/// A provider fills its lists lazily at the first of them; two threads opening transports at once (the test
/// suites do) crashed inside `fi_dupinfo` once. They are not on the data path.
pub(crate) static GETINFO: std::sync::Mutex<()> = std::sync::Mutex::new(());

pub(crate) fn getinfo_lock() -> std::sync::MutexGuard<'static, ()> {
    GETINFO.lock().unwrap_or_else(|p| p.into_inner())
}

pub(crate) fn check(call: &str, ret: i32) -> Result<(), TransportError> {
    if ret < 0 {
        Err(err(call, ret.into()))
    } else {
        Ok(())
    }
}

/// An owned `fi_info` list.
pub(crate) struct Info(pub(crate) *mut fi_info);

impl Info {
    /// The peer's address, for the information of a connection request (when the provider gives one).
    pub(crate) fn peer(&self) -> Option<std::net::SocketAddr> {
        // SAFETY: `self.0` is a live fi_info; its destination address, when not null, is `dest_addrlen`
        // readable bytes owned by the info.
        unsafe {
            let i = &*self.0;
            if i.dest_addr.is_null() {
                None
            } else {
                crate::sockaddr::decode(std::slice::from_raw_parts(
                    i.dest_addr as *const u8,
                    i.dest_addrlen,
                ))
            }
        }
    }
}

impl Drop for Info {
    fn drop(&mut self) {
        if !self.0.is_null() {
            // SAFETY: the pointer came from fi_getinfo/fi_dupinfo or a connection request and is freed once.
            unsafe { exs_fi_freeinfo(self.0) };
        }
    }
}

/// Strings referenced by a hints structure while fi_getinfo runs (freed by Rust, not by fi_freeinfo).
struct Hints {
    info: *mut fi_info,
    _strings: Vec<CString>,
}

impl Drop for Hints {
    fn drop(&mut self) {
        // SAFETY: `info` came from fi_allocinfo; the string fields we set point into `_strings` and are cleared
        // first so fi_freeinfo does not free memory it does not own.
        unsafe {
            (*(*self.info).fabric_attr).prov_name = ptr::null_mut();
            (*(*self.info).domain_attr).name = ptr::null_mut();
            exs_fi_freeinfo(self.info);
        }
    }
}

fn hints(provider: &str, domain: Option<&str>) -> Result<Hints, TransportError> {
    // SAFETY: fi_allocinfo returns a zeroed fi_info with allocated attribute structs (or null).
    let info = unsafe { exs_fi_allocinfo() };
    if info.is_null() {
        return Err(TransportError::Resource("fi_allocinfo".into()));
    }
    // Owned from here: an error below frees it (`Hints::drop`), with whichever name pointers are set.
    let mut h = Hints {
        info,
        _strings: Vec::new(),
    };
    let prov = CString::new(provider)
        .map_err(|_| TransportError::Invalid("provider name has a NUL".into()))?;
    let dom = domain
        .map(CString::new)
        .transpose()
        .map_err(|_| TransportError::Invalid("domain name has a NUL".into()))?;
    // SAFETY: `info` and its attribute structs were just allocated by libfabric; we only set plain fields and
    // pointers into the strings, which `h` keeps for as long as the hints live (see `Hints::drop`).
    unsafe {
        let i = &mut *info;
        i.caps = (FI_MSG
            | FI_RMA
            | FI_READ
            | FI_WRITE
            | FI_RECV
            | FI_SEND
            | FI_REMOTE_READ
            | FI_REMOTE_WRITE) as u64;
        // Our operation contexts point at records with fi_context2 storage, and we post receives for remote CQ
        // data when a provider asks for it.
        i.mode = FI_CONTEXT | FI_CONTEXT2 | FI_RX_CQ_DATA;
        (*i.ep_attr).type_ = fi_ep_type_FI_EP_MSG;
        (*i.domain_attr).mr_mode =
            (FI_MR_LOCAL | FI_MR_VIRT_ADDR | FI_MR_ALLOCATED | FI_MR_PROV_KEY) as i32;
        (*i.domain_attr).threading = fi_threading_FI_THREAD_SAFE;
        (*i.fabric_attr).prov_name = prov.as_ptr() as *mut _;
        if let Some(d) = &dom {
            (*i.domain_attr).name = d.as_ptr() as *mut _;
        }
    }
    h._strings.push(prov);
    h._strings.extend(dom);
    Ok(h)
}

/// libfabric itself, loaded on first use (the shim's loader, see `shim/shim.c`): why it cannot be, said as a user
/// can act on it.
pub(crate) fn loaded() -> Result<(), TransportError> {
    // SAFETY: no arguments; the loader runs once and returns a static string or null.
    let why = unsafe { exs_fi_load_error() };
    if why.is_null() {
        return Ok(());
    }
    Err(TransportError::Unsupported(format!(
        "libfabric could not be loaded ({}); on Debian/Ubuntu: apt-get install libfabric1",
        cstr(why)
    )))
}

pub(crate) fn getinfo(
    provider: &str,
    domain: Option<&str>,
    node: Option<&str>,
    service: Option<&str>,
    flags: u64,
) -> Result<Info, TransportError> {
    loaded()?;
    let h = hints(provider, domain)?;
    let node = node.map(|n| CString::new(n).expect("addresses have no NUL"));
    let service = service.map(|s| CString::new(s).expect("ports have no NUL"));
    let mut out = ptr::null_mut();
    let _tables = getinfo_lock();
    // SAFETY: valid hints; node/service are NUL-terminated or null; `out` receives an allocated list.
    let ret = unsafe {
        exs_fi_getinfo(
            API_VERSION,
            node.as_ref().map_or(ptr::null(), |c| c.as_ptr()),
            service.as_ref().map_or(ptr::null(), |c| c.as_ptr()),
            flags,
            h.info,
            &mut out,
        )
    };
    if ret != 0 || out.is_null() {
        return Err(err("fi_getinfo", ret.into()));
    }
    Ok(Info(out))
}

/// The error of a connect's `fi_getinfo` asked first on the transport's domain, then on any: the second's, with
/// the first's words beside it (the one that names the configured domain is often the one that says why).
pub(crate) fn both_failed(
    domain: &str,
    first: TransportError,
    second: TransportError,
) -> TransportError {
    match second {
        TransportError::Os {
            call,
            kind,
            message,
        } => TransportError::Os {
            call,
            kind,
            message: format!("{message} (on any domain; on domain {domain}: {first})"),
        },
        other => other,
    }
}

pub(crate) fn cstr(p: *const std::os::raw::c_char) -> String {
    if p.is_null() {
        return String::new();
    }
    // SAFETY: libfabric strings are NUL-terminated and live as long as their fi_info.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

pub(crate) fn wait_fd_of(fid: *mut fid) -> Result<RawFd, TransportError> {
    let mut fd: i32 = -1;
    // SAFETY: FI_GETWAIT on a queue opened with FI_WAIT_FD writes one int.
    let ret = unsafe { exs_fi_control(fid, FI_GETWAIT as i32, &mut fd as *mut i32 as *mut c_void) };
    check("fi_control(FI_GETWAIT)", ret)?;
    Ok(fd)
}

pub(crate) fn epoll_add(epoll: &Epoll, fd: RawFd, data: u64) -> Result<(), TransportError> {
    // SAFETY: `fd` is a wait descriptor owned by a libfabric queue that stays open while it is in the set (it is
    // removed before the queue is closed).
    let bfd = unsafe { BorrowedFd::borrow_raw(fd) };
    epoll
        .add(bfd, EpollEvent::new(EpollFlags::EPOLLIN, data))
        .map_err(|e| TransportError::os("epoll_ctl(ADD)", e.into()))
}

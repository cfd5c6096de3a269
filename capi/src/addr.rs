//! `struct sockaddr` to and from `std::net::SocketAddr`, as `bind`, `connect` and `getsockname` read and write
//! them.

use std::mem::size_of;
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6};

use libc::{c_int, sa_family_t, sockaddr, sockaddr_in, sockaddr_in6, sockaddr_storage, socklen_t};

use crate::errno::Errno;

/// Reads the address at `addr` (`len` bytes), which must be of the socket's `domain`. As Linux copies an address
/// in for `bind(2)` and `connect(2)`: no address, or a length beyond any address, is `EINVAL`; a null address of a
/// nonzero length, `EFAULT`. Then a length too short for the family field, or for the family's address, is
/// `EINVAL`.
///
/// # Safety
/// `addr` is null or valid for reads of `len` bytes.
pub(crate) unsafe fn read(
    addr: *const sockaddr,
    len: socklen_t,
    domain: c_int,
) -> Result<SocketAddr, Errno> {
    let len = len as usize;
    if len == 0 || len > size_of::<sockaddr_storage>() {
        return Err(Errno(libc::EINVAL));
    }
    if addr.is_null() {
        return Err(Errno(libc::EFAULT));
    }
    if len < size_of::<sa_family_t>() {
        return Err(Errno(libc::EINVAL));
    }
    // SAFETY: valid for `len` bytes (the caller), and `len` covers the family; unaligned reads for any pointer.
    let family = c_int::from(unsafe { std::ptr::addr_of!((*addr).sa_family).read_unaligned() });
    if family != domain {
        return Err(Errno(libc::EAFNOSUPPORT));
    }
    match family {
        libc::AF_INET if len >= size_of::<sockaddr_in>() => {
            // SAFETY: `len` covers a sockaddr_in, readable per the caller; read unaligned.
            let a = unsafe { addr.cast::<sockaddr_in>().read_unaligned() };
            let ip = Ipv4Addr::from(u32::from_be(a.sin_addr.s_addr));
            Ok(SocketAddr::V4(SocketAddrV4::new(
                ip,
                u16::from_be(a.sin_port),
            )))
        }
        libc::AF_INET6 if len >= size_of::<sockaddr_in6>() => {
            // SAFETY: `len` covers a sockaddr_in6, readable per the caller; read unaligned.
            let a = unsafe { addr.cast::<sockaddr_in6>().read_unaligned() };
            Ok(SocketAddr::V6(SocketAddrV6::new(
                Ipv6Addr::from(a.sin6_addr.s6_addr),
                u16::from_be(a.sin6_port),
                a.sin6_flowinfo,
                a.sin6_scope_id,
            )))
        }
        _ => Err(Errno(libc::EINVAL)),
    }
}

/// The address as a `sockaddr_storage`, and its length; `None` is the unspecified address of `domain`.
pub(crate) fn encode(a: Option<SocketAddr>, domain: c_int) -> (sockaddr_storage, usize) {
    // SAFETY: sockaddr_storage is plain old data: all zeroes is a valid value (family AF_UNSPEC).
    let mut out: sockaddr_storage = unsafe { std::mem::zeroed() };
    let a = a.unwrap_or(if domain == libc::AF_INET6 {
        SocketAddr::V6(SocketAddrV6::new(Ipv6Addr::UNSPECIFIED, 0, 0, 0))
    } else {
        SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, 0))
    });
    let p = std::ptr::addr_of_mut!(out);
    match a {
        SocketAddr::V4(v4) => {
            // SAFETY: all zeroes is a valid sockaddr_in too.
            let mut s: sockaddr_in = unsafe { std::mem::zeroed() };
            s.sin_family = libc::AF_INET as sa_family_t;
            s.sin_port = v4.port().to_be();
            s.sin_addr.s_addr = u32::from(*v4.ip()).to_be();
            // SAFETY: a sockaddr_storage is large and aligned enough for any socket address.
            unsafe { p.cast::<sockaddr_in>().write(s) };
            (out, size_of::<sockaddr_in>())
        }
        SocketAddr::V6(v6) => {
            // SAFETY: all zeroes is a valid sockaddr_in6 too.
            let mut s: sockaddr_in6 = unsafe { std::mem::zeroed() };
            s.sin6_family = libc::AF_INET6 as sa_family_t;
            s.sin6_port = v6.port().to_be();
            s.sin6_addr.s6_addr = v6.ip().octets();
            s.sin6_flowinfo = v6.flowinfo();
            s.sin6_scope_id = v6.scope_id();
            // SAFETY: as above.
            unsafe { p.cast::<sockaddr_in6>().write(s) };
            (out, size_of::<sockaddr_in6>())
        }
    }
}

/// Writes the address as `getsockname` does: at most `*len` bytes of it at `addr`, and its full length into
/// `*len`.
///
/// # Safety
/// `len` is null or valid for reads and writes; `addr` is null or valid for writes of `*len` bytes.
pub(crate) unsafe fn write(
    a: Option<SocketAddr>,
    domain: c_int,
    addr: *mut sockaddr,
    len: *mut socklen_t,
) -> Result<(), Errno> {
    if addr.is_null() || len.is_null() {
        return Err(Errno(libc::EFAULT));
    }
    let (storage, full) = encode(a, domain);
    // SAFETY: `len` is valid for reads (the caller).
    let room = unsafe { len.read() } as usize;
    // SAFETY: `addr` is valid for `room` bytes (the caller) and we copy at most that many from a local that
    // holds `full` bytes; the two cannot overlap.
    unsafe {
        std::ptr::copy_nonoverlapping(
            std::ptr::addr_of!(storage).cast::<u8>(),
            addr.cast::<u8>(),
            room.min(full),
        )
    };
    // SAFETY: `len` is valid for writes (the caller).
    unsafe { len.write(full as socklen_t) };
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_round_trip_and_wrong_families_are_refused() {
        for (text, domain) in [
            ("192.0.2.7:7471", libc::AF_INET),
            ("[2001:db8::1]:9", libc::AF_INET6),
        ] {
            let a: SocketAddr = text.parse().unwrap();
            let (s, n) = encode(Some(a), domain);
            let p = std::ptr::addr_of!(s).cast::<sockaddr>();
            // SAFETY: `s` is a live sockaddr_storage of at least `n` bytes.
            assert_eq!(unsafe { read(p, n as socklen_t, domain) }, Ok(a));
            let other = if domain == libc::AF_INET {
                libc::AF_INET6
            } else {
                libc::AF_INET
            };
            // SAFETY: as above.
            let wrong = unsafe { read(p, n as socklen_t, other) };
            assert_eq!(wrong, Err(Errno(libc::EAFNOSUPPORT)));
            // SAFETY: as above; a length short of the family's struct is refused before any read beyond it.
            assert_eq!(unsafe { read(p, 4, domain) }, Err(Errno(libc::EINVAL)));
        }
        // SAFETY: a null pointer is refused before any read.
        let null = unsafe { read(std::ptr::null(), 16, libc::AF_INET) };
        assert_eq!(null, Err(Errno(libc::EFAULT)), "bind(2) says EFAULT");
        // SAFETY: as above.
        let empty = unsafe { read(std::ptr::null(), 0, libc::AF_INET) };
        assert_eq!(
            empty,
            Err(Errno(libc::EINVAL)),
            "no address: bind(2) says EINVAL"
        );
        let huge = size_of::<sockaddr_storage>() as socklen_t + 1;
        // SAFETY: as above: a length beyond any address is refused before any read.
        let beyond = unsafe { read(std::ptr::null(), huge, libc::AF_INET) };
        assert_eq!(beyond, Err(Errno(libc::EINVAL)));
    }

    #[test]
    fn getsockname_truncates_to_the_room_given_and_reports_the_full_length() {
        let a: SocketAddr = "[2001:db8::1]:9".parse().unwrap();
        let mut buf = [0xffu8; 8];
        let mut len = buf.len() as socklen_t;
        // SAFETY: `buf` holds `len` bytes, `len` is a live local.
        unsafe { write(Some(a), libc::AF_INET6, buf.as_mut_ptr().cast(), &mut len) }.unwrap();
        assert_eq!(len as usize, size_of::<sockaddr_in6>());
        assert_eq!(buf[..2], (libc::AF_INET6 as sa_family_t).to_ne_bytes());
        assert_eq!(buf[2..4], 9u16.to_be_bytes());
    }
}

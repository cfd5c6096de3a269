//! `struct sockaddr_in` / `sockaddr_in6` bytes to `SocketAddr` (libfabric hands addresses over as raw bytes).

use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6};

const AF_INET: u16 = 2;
const AF_INET6: u16 = 10;

/// Decodes a socket address; `None` for other families or short input.
pub fn decode(b: &[u8]) -> Option<SocketAddr> {
    let family = u16::from_ne_bytes(b.get(0..2)?.try_into().ok()?);
    let port = u16::from_be_bytes(b.get(2..4)?.try_into().ok()?);
    match family {
        AF_INET => {
            let ip: [u8; 4] = b.get(4..8)?.try_into().ok()?;
            Some(SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::from(ip), port)))
        }
        AF_INET6 => {
            let flow = u32::from_be_bytes(b.get(4..8)?.try_into().ok()?);
            let ip: [u8; 16] = b.get(8..24)?.try_into().ok()?;
            let scope = u32::from_ne_bytes(b.get(24..28)?.try_into().ok()?);
            Some(SocketAddr::V6(SocketAddrV6::new(
                Ipv6Addr::from(ip),
                port,
                flow,
                scope,
            )))
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decodes_ipv4_and_ipv6_and_rejects_garbage() {
        let mut v4 = vec![0u8; 16];
        v4[0..2].copy_from_slice(&AF_INET.to_ne_bytes());
        v4[2..4].copy_from_slice(&8080u16.to_be_bytes());
        v4[4..8].copy_from_slice(&[127, 0, 0, 1]);
        assert_eq!(decode(&v4), Some("127.0.0.1:8080".parse().unwrap()));
        let mut v6 = vec![0u8; 28];
        v6[0..2].copy_from_slice(&AF_INET6.to_ne_bytes());
        v6[2..4].copy_from_slice(&443u16.to_be_bytes());
        v6[23] = 1;
        assert_eq!(decode(&v6), Some("[::1]:443".parse().unwrap()));
        assert_eq!(decode(&v4[..5]), None);
        assert_eq!(decode(&[9, 9, 0, 0]), None);
    }
}

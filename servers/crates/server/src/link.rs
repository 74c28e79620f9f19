//! The link speed of the network interface a server listens on, which caps the throughput it
//! reports: a tier that moves 5 GB/s behind a 10 Gb/s NIC can serve clients 1.25 GB/s.

use std::ffi::CStr;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::path::Path;

/// Where the kernel publishes interfaces' link speeds (`<name>/speed`, in Mb/s).
const SYS_CLASS_NET: &str = "/sys/class/net";
/// Bytes per second in one Mb/s.
const MEGABIT_BYTES: u64 = 1_000_000 / 8;

/// The cap on the throughput of a server listening on `addr`, in bytes per second: the link speed
/// of the interface holding `addr`; for an unspecified address (every interface) the fastest
/// known link. `None` (no cap) on loopback, or when no interface or speed is known.
pub fn throughput_cap_bytes_per_s(addr: IpAddr) -> Option<u64> {
    if addr.is_loopback() {
        return None;
    }
    let interfaces = interfaces();
    let names = interfaces
        .iter()
        .filter(|(_, ip)| !ip.is_loopback() && (addr.is_unspecified() || *ip == addr))
        .map(|(name, _)| name.as_str());
    names
        .filter_map(|name| link_speed_bytes_per_s(Path::new(SYS_CLASS_NET), name))
        .max()
}

/// The link speed of interface `name` under `sys_class_net`, in bytes per second; `None` when
/// unknown (no file, not a number, or the -1 and 0 of a link that is down or virtual).
fn link_speed_bytes_per_s(sys_class_net: &Path, name: &str) -> Option<u64> {
    let text = std::fs::read_to_string(sys_class_net.join(name).join("speed")).ok()?;
    let mbps: i64 = text.trim().parse().ok()?;
    (mbps > 0).then(|| mbps as u64 * MEGABIT_BYTES)
}

/// Every interface address of the host as (interface name, address).
fn interfaces() -> Vec<(String, IpAddr)> {
    let mut found = Vec::new();
    let mut head: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs fills `head` with a list we free below with freeifaddrs.
    if unsafe { libc::getifaddrs(&mut head) } != 0 {
        return found;
    }
    let mut cursor = head;
    while !cursor.is_null() {
        // SAFETY: `cursor` is a node of the list getifaddrs returned, not yet freed.
        let entry = unsafe { &*cursor };
        cursor = entry.ifa_next;
        if entry.ifa_addr.is_null() || entry.ifa_name.is_null() {
            continue;
        }
        // SAFETY: a non-null sockaddr of the list; its family says which struct it is.
        let ip = unsafe {
            match i32::from((*entry.ifa_addr).sa_family) {
                libc::AF_INET => {
                    let v4 = &*(entry.ifa_addr as *const libc::sockaddr_in);
                    IpAddr::V4(Ipv4Addr::from(u32::from_be(v4.sin_addr.s_addr)))
                }
                libc::AF_INET6 => {
                    let v6 = &*(entry.ifa_addr as *const libc::sockaddr_in6);
                    IpAddr::V6(Ipv6Addr::from(v6.sin6_addr.s6_addr))
                }
                _ => continue,
            }
        };
        // SAFETY: a non-null, NUL-terminated name of the list.
        let name = unsafe { CStr::from_ptr(entry.ifa_name) };
        found.push((name.to_string_lossy().into_owned(), ip));
    }
    // SAFETY: `head` came from getifaddrs and is freed once.
    unsafe { libc::freeifaddrs(head) };
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_is_not_capped() {
        assert_eq!(
            throughput_cap_bytes_per_s("127.0.0.1".parse().unwrap()),
            None
        );
        assert_eq!(throughput_cap_bytes_per_s("::1".parse().unwrap()), None);
    }

    #[test]
    fn the_host_has_a_loopback_interface() {
        let found = interfaces();
        assert!(found.iter().any(|(_, ip)| ip.is_loopback()), "{found:?}");
    }

    #[test]
    fn an_address_no_interface_holds_is_not_capped() {
        // TEST-NET-1 (RFC 5737) is never assigned to a host.
        assert_eq!(
            throughput_cap_bytes_per_s("192.0.2.1".parse().unwrap()),
            None
        );
    }

    #[test]
    fn link_speeds_are_read_in_megabits_and_unknown_ones_ignored() {
        let dir = tempfile::tempdir().unwrap();
        for (name, speed) in [("eth0", "10000\n"), ("down", "-1\n"), ("odd", "fast\n")] {
            std::fs::create_dir(dir.path().join(name)).unwrap();
            std::fs::write(dir.path().join(name).join("speed"), speed).unwrap();
        }
        assert_eq!(
            link_speed_bytes_per_s(dir.path(), "eth0"),
            Some(1_250_000_000)
        );
        assert_eq!(link_speed_bytes_per_s(dir.path(), "down"), None);
        assert_eq!(link_speed_bytes_per_s(dir.path(), "odd"), None);
        assert_eq!(link_speed_bytes_per_s(dir.path(), "missing"), None);
    }
}

//! Find the process that serves a local TCP port, for server CPU accounting.
//!
//! The kernel lists listening sockets with their inode in `/proc/net/tcp{,6}`; the owning
//! process holds an fd whose link reads `socket:[INODE]`. Reading other processes' fds needs
//! the same user or root, so failure is an ordinary outcome reported in the notes.

use std::collections::HashSet;
use std::fs;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, UdpSocket};

/// Is `ip` an address of this host? Binding a socket to it succeeds only if it is.
pub fn is_local_address(ip: IpAddr) -> bool {
    ip.is_loopback() || ip.is_unspecified() || UdpSocket::bind(SocketAddr::new(ip, 0)).is_ok()
}

/// Parse a `/proc/net/tcp{,6}` address field `HEX:PORT` (each 32-bit group in host order).
fn parse_addr(field: &str) -> Option<(IpAddr, u16)> {
    let (ip_hex, port_hex) = field.split_once(':')?;
    let port = u16::from_str_radix(port_hex, 16).ok()?;
    let group = |i: usize| -> Option<[u8; 4]> {
        Some(
            u32::from_str_radix(ip_hex.get(i * 8..i * 8 + 8)?, 16)
                .ok()?
                .to_ne_bytes(),
        )
    };
    let ip = match ip_hex.len() {
        8 => IpAddr::V4(Ipv4Addr::from(group(0)?)),
        32 => {
            let mut b = [0u8; 16];
            for i in 0..4 {
                b[i * 4..i * 4 + 4].copy_from_slice(&group(i)?);
            }
            IpAddr::V6(Ipv6Addr::from(b))
        }
        _ => return None,
    };
    Some((ip, port))
}

fn same_host_ip(listen: IpAddr, target: IpAddr) -> bool {
    let canon = |ip: IpAddr| match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
        v4 => v4,
    };
    let (l, t) = (canon(listen), canon(target));
    // A wildcard listener serves every local address; connecting to a wildcard reaches any.
    l.is_unspecified() || t.is_unspecified() || l == t
}

/// Inodes of listening sockets (state 0A) on `target`'s port that accept `target`'s address.
pub(crate) fn listening_inodes(table: &str, target: SocketAddr) -> Vec<u64> {
    table
        .lines()
        .skip(1)
        .filter_map(|line| {
            let f: Vec<&str> = line.split_ascii_whitespace().collect();
            let (ip, port) = parse_addr(f.get(1)?)?;
            let listening = *f.get(3)? == "0A";
            let inode: u64 = f.get(9)?.parse().ok()?;
            (listening && port == target.port() && same_host_ip(ip, target.ip()) && inode != 0)
                .then_some(inode)
        })
        .collect()
}

/// The pid owning the listening socket for `target`, with a note on how it was found.
pub fn find_listener_pid(target: SocketAddr) -> Result<(u32, String), String> {
    if !is_local_address(target.ip()) {
        return Err(format!(
            "target {target} is not an address of this host; give the server pid to account its CPU"
        ));
    }
    let mut inodes = HashSet::new();
    for table in ["/proc/net/tcp", "/proc/net/tcp6"] {
        if let Ok(text) = fs::read_to_string(table) {
            inodes.extend(listening_inodes(&text, target));
        }
    }
    if inodes.is_empty() {
        return Err(format!(
            "no listening socket for {target} in /proc/net/tcp{{,6}}"
        ));
    }
    let mut pids = Vec::new();
    let procs = fs::read_dir("/proc").map_err(|e| format!("reading /proc: {e}"))?;
    for p in procs.flatten() {
        let Some(pid) = p.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
            continue;
        };
        // Processes we may not inspect, or that exit meanwhile, are skipped.
        let Ok(fds) = fs::read_dir(p.path().join("fd")) else {
            continue;
        };
        let owns = fds.flatten().any(|fd| {
            fs::read_link(fd.path()).ok().is_some_and(|l| {
                l.to_str()
                    .and_then(|s| s.strip_prefix("socket:["))
                    .and_then(|s| s.strip_suffix(']'))
                    .and_then(|s| s.parse::<u64>().ok())
                    .is_some_and(|i| inodes.contains(&i))
            })
        });
        if owns {
            pids.push(pid);
        }
    }
    match pids.as_slice() {
        [] => Err(format!(
            "listening socket for {target} found but no process owning it is visible (permissions?)"
        )),
        [pid] => Ok((
            *pid,
            format!("server pid {pid} found from the listening socket of {target}"),
        )),
        [pid, ..] => Ok((
            *pid,
            format!(
                "several processes hold the listening socket of {target} ({pids:?}); accounting pid {pid} only"
            ),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_proc_net_tcp() {
        let v4 = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n\
   0: 0100007F:1E14 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 111 1 0 100 0 0 10 0\n\
   1: 00000000:1E15 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 222 1 0 100 0 0 10 0\n\
   2: 0100007F:1E14 0100007F:9C40 01 00000000:00000000 00:00000000 00000000     0        0 333 1 0 100 0 0 10 0\n";
        let t: SocketAddr = "127.0.0.1:7700".parse().unwrap();
        assert_eq!(listening_inodes(v4, t), vec![111]);
        let t: SocketAddr = "127.0.0.1:7701".parse().unwrap();
        assert_eq!(listening_inodes(v4, t), vec![222]);
        let t: SocketAddr = "127.0.0.2:7700".parse().unwrap();
        assert!(listening_inodes(v4, t).is_empty());
        let v6 = "header\n   0: 00000000000000000000000000000000:1E14 00000000000000000000000000000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 444 1 0 100 0 0 10 0\n";
        let t: SocketAddr = "127.0.0.1:7700".parse().unwrap();
        assert_eq!(listening_inodes(v6, t), vec![444]);
    }

    #[test]
    fn finds_our_own_listener() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let (pid, _) = find_listener_pid(l.local_addr().unwrap()).unwrap();
        assert_eq!(pid, std::process::id());
        assert!(!is_local_address("192.0.2.1".parse().unwrap()));
    }
}

//! Free loopback ports for the services the bench starts.

use std::net::{SocketAddr, TcpListener};

/// `n` distinct loopback addresses nothing listens on right now. Every one
/// is held bound until all are picked, then all are released: picked one at
/// a time, the kernel may hand the port it just released out again (seen in
/// a CI run as "node n1 reuses an address"). A port can still be taken by
/// another process between this call and the service binding it.
pub fn free_loopback_addrs(n: usize) -> std::io::Result<Vec<SocketAddr>> {
    let held = (0..n).map(|_| TcpListener::bind(("127.0.0.1", 0))).collect::<std::io::Result<Vec<_>>>()?;
    held.iter().map(TcpListener::local_addr).collect()
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_addresses_are_distinct_loopback_ports() {
        let a = super::free_loopback_addrs(16).unwrap();
        let ports: std::collections::HashSet<u16> = a.iter().map(|a| a.port()).collect();
        assert_eq!(ports.len(), 16);
        assert!(a.iter().all(|a| a.ip().is_loopback() && a.port() != 0));
    }
}

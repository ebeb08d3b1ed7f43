//! The demo's echo server (`nftproxy demo-echo`): answers every TCP connection and UDP
//! datagram with its name and the client address it saw, so the demo can tell which endpoint
//! answered and whether the client was masqueraded.

use std::io::Write;
use std::net::{IpAddr, Ipv6Addr, SocketAddr, TcpListener, UdpSocket};

fn canonical(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(IpAddr::V6(v6), IpAddr::V4),
        v4 => v4,
    }
}

/// Serves on `ports` (TCP and UDP, IPv4 and IPv6) until the process is killed.
pub fn serve(name: &str, ports: &[u16]) -> std::io::Result<()> {
    let mut threads = Vec::new();
    for &port in ports {
        // A [::] socket also accepts IPv4 (as mapped addresses) unless IPV6_V6ONLY is set.
        let any = SocketAddr::new(IpAddr::V6(Ipv6Addr::UNSPECIFIED), port);
        let tcp = TcpListener::bind(any)?;
        let udp = UdpSocket::bind(any)?;
        let tcp_name = name.to_string();
        threads.push(std::thread::spawn(move || {
            for mut stream in tcp.incoming().flatten() {
                let peer = stream.peer_addr().map(|p| canonical(p.ip()));
                if let Ok(peer) = peer {
                    let _ = writeln!(stream, "{tcp_name} {peer}");
                }
            }
        }));
        let udp_name = name.to_string();
        threads.push(std::thread::spawn(move || {
            let mut buf = [0u8; 2048];
            while let Ok((_, peer)) = udp.recv_from(&mut buf) {
                let reply = format!("{udp_name} {}\n", canonical(peer.ip()));
                let _ = udp.send_to(reply.as_bytes(), peer);
            }
        }));
    }
    for t in threads {
        let _ = t.join();
    }
    Ok(())
}

//! The TCP ports a process listens on (read from /proc, as `ss -ltnp` does) and the junk
//! the peer-port tests throw at them.
#![allow(dead_code)]

use std::io::Write;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpStream};
use std::time::Duration;

/// Every TCP address process `pid` listens on (IPv4 and IPv6).
pub fn listening(pid: u32) -> Vec<SocketAddr> {
    let inodes: Vec<String> = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|dir| {
            dir.filter_map(|entry| std::fs::read_link(entry.ok()?.path()).ok())
                .filter_map(|link| {
                    let link = link.to_string_lossy().into_owned();
                    Some(link.strip_prefix("socket:[")?.strip_suffix(']')?.to_owned())
                })
                .collect()
        })
        .unwrap_or_default();
    let mut found = Vec::new();
    for table in ["tcp", "tcp6"] {
        let Ok(text) = std::fs::read_to_string(format!("/proc/{pid}/net/{table}")) else {
            continue;
        };
        for line in text.lines().skip(1) {
            let fields: Vec<&str> = line.split_whitespace().collect();
            // local_address, state 0A = LISTEN, inode.
            if fields.len() < 10 || fields[3] != "0A" || !inodes.iter().any(|i| i == fields[9]) {
                continue;
            }
            if let Some(addr) = parse_proc_addr(fields[1]) {
                found.push(addr);
            }
        }
    }
    found
}

/// "0100007F:1F90" (IPv4, each 32-bit word in host order) to 127.0.0.1:8080.
fn parse_proc_addr(text: &str) -> Option<SocketAddr> {
    let (ip, port) = text.split_once(':')?;
    let port = u16::from_str_radix(port, 16).ok()?;
    let words: Vec<u32> = (0..ip.len() / 8)
        .map(|i| u32::from_str_radix(&ip[i * 8..i * 8 + 8], 16))
        .collect::<Result<_, _>>()
        .ok()?;
    let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_ne_bytes()).collect();
    let ip = match bytes.len() {
        4 => IpAddr::V4(Ipv4Addr::new(bytes[0], bytes[1], bytes[2], bytes[3])),
        16 => IpAddr::V6(Ipv6Addr::from(<[u8; 16]>::try_from(bytes).ok()?)),
        _ => return None,
    };
    // A wildcard listener is reached through loopback.
    let ip = match ip {
        IpAddr::V4(v4) if v4.is_unspecified() => IpAddr::V4(Ipv4Addr::LOCALHOST),
        IpAddr::V6(v6) if v6.is_unspecified() => IpAddr::V6(Ipv6Addr::LOCALHOST),
        ip => ip,
    };
    Some(SocketAddr::new(ip, port))
}

/// Junk a port scanner, a confused client or an attacker sends: random bytes, an HTTP
/// request, a truncated moe-node handshake, and a connection that sends nothing.
pub fn junks(seed: u64) -> Vec<Vec<u8>> {
    let mut state = 0x9E37_79B9_7F4A_7C15u64 ^ seed.wrapping_mul(0x2545_F491_4F6C_DD1D);
    let len = 1 + (seed as usize * 997) % 8192;
    let mut random: Vec<u8> = (0..len)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state as u8
        })
        .collect();
    // Every first byte over 256 seeds (a UCX tcp message starts with its id byte), half of
    // them followed by a small length, as a real header would be.
    random[0] = seed as u8;
    if seed % 2 == 1 && random.len() >= 5 {
        random[1..5].copy_from_slice(&((seed % 64) as u32).to_le_bytes());
    }
    vec![
        random,
        b"GET / HTTP/1.1\r\nHost: x\r\n\r\n".to_vec(),
        b"MOEH\x02\x01\x07\x00".to_vec(),
        vec![0xff; 64 << 10],
        Vec::new(),
    ]
}

/// Sends every junk of `rounds` seeds to `at`, each on its own connection, then hangs up;
/// returns how many connections were accepted.
pub fn throw_junk(at: SocketAddr, rounds: u64) -> usize {
    let mut accepted = 0;
    for junk in (0..rounds).flat_map(junks) {
        let Ok(mut tcp) = TcpStream::connect_timeout(&at, Duration::from_secs(1)) else {
            continue;
        };
        accepted += 1;
        let _ = tcp.set_write_timeout(Some(Duration::from_secs(1)));
        let _ = tcp.write_all(&junk);
        // Give the listener time to read it before the connection closes.
        std::thread::sleep(Duration::from_millis(if rounds > 1 { 2 } else { 50 }));
    }
    accepted
}

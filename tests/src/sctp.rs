//! Just enough SCTP (RFC 9260) to push an association attempt through conntrack and NAT
//! without a kernel SCTP stack: an INIT from the prober and an ABORT back from the echo.
//!
//! The echo's ABORT carries its report (`nettest <local> <peer>`) as the reason of an
//! "User-Initiated Abort" error cause (code 12). Conntrack accepts an ABORT whose
//! verification tag is the INIT's initiate tag as the reply direction, so reverse NAT
//! applies to it just as it would to a real INIT-ACK.

/// SCTP chunk type INIT.
pub const CHUNK_INIT: u8 = 1;
/// SCTP chunk type INIT ACK.
pub const CHUNK_INIT_ACK: u8 = 2;
/// SCTP chunk type ABORT.
pub const CHUNK_ABORT: u8 = 6;
/// Error cause "User-Initiated Abort", whose value is an arbitrary upper-layer reason.
pub const CAUSE_USER_ABORT: u16 = 12;

const COMMON_HEADER_LEN: usize = 12;

/// CRC32c (Castagnoli, reflected), as used for the SCTP checksum.
pub fn crc32c(data: &[u8]) -> u32 {
    const TABLE: [u32; 256] = {
        let mut table = [0u32; 256];
        let mut i = 0;
        while i < 256 {
            let mut crc = i as u32;
            let mut bit = 0;
            while bit < 8 {
                crc = if crc & 1 != 0 {
                    (crc >> 1) ^ 0x82F6_3B78
                } else {
                    crc >> 1
                };
                bit += 1;
            }
            table[i] = crc;
            i += 1;
        }
        table
    };
    let mut crc = !0u32;
    for &b in data {
        crc = TABLE[((crc ^ u32::from(b)) & 0xff) as usize] ^ (crc >> 8);
    }
    !crc
}

/// Fills in the checksum of a complete SCTP packet (common header + chunks).
fn finish(mut packet: Vec<u8>) -> Vec<u8> {
    packet[8..12].fill(0);
    let crc = crc32c(&packet);
    // The CRC is transmitted least significant byte first (what Linux' cpu_to_le32 does).
    packet[8..12].copy_from_slice(&crc.to_le_bytes());
    packet
}

fn common_header(src_port: u16, dst_port: u16, vtag: u32) -> Vec<u8> {
    let mut p = Vec::with_capacity(64);
    p.extend_from_slice(&src_port.to_be_bytes());
    p.extend_from_slice(&dst_port.to_be_bytes());
    p.extend_from_slice(&vtag.to_be_bytes());
    p.extend_from_slice(&[0; 4]);
    p
}

/// An SCTP packet carrying a single INIT chunk (verification tag 0, as required).
pub fn build_init(src_port: u16, dst_port: u16, init_tag: u32, initial_tsn: u32) -> Vec<u8> {
    let mut p = common_header(src_port, dst_port, 0);
    p.extend_from_slice(&[CHUNK_INIT, 0]);
    p.extend_from_slice(&20u16.to_be_bytes());
    p.extend_from_slice(&init_tag.to_be_bytes());
    p.extend_from_slice(&65536u32.to_be_bytes()); // a_rwnd
    p.extend_from_slice(&1u16.to_be_bytes()); // outbound streams
    p.extend_from_slice(&1u16.to_be_bytes()); // max inbound streams
    p.extend_from_slice(&initial_tsn.to_be_bytes());
    finish(p)
}

/// An SCTP packet carrying a single ABORT chunk (T bit clear), optionally with a
/// "User-Initiated Abort" cause whose reason is `reason`.
pub fn build_abort(src_port: u16, dst_port: u16, vtag: u32, reason: Option<&[u8]>) -> Vec<u8> {
    let mut p = common_header(src_port, dst_port, vtag);
    let cause_len = reason.map_or(0, |r| 4 + r.len());
    let padded = cause_len.div_ceil(4) * 4;
    p.push(CHUNK_ABORT);
    p.push(0);
    p.extend_from_slice(
        &u16::try_from(4 + cause_len)
            .expect("reason too long")
            .to_be_bytes(),
    );
    if let Some(reason) = reason {
        p.extend_from_slice(&CAUSE_USER_ABORT.to_be_bytes());
        p.extend_from_slice(
            &u16::try_from(cause_len)
                .expect("reason too long")
                .to_be_bytes(),
        );
        p.extend_from_slice(reason);
        p.resize(p.len() + padded - cause_len, 0);
    }
    finish(p)
}

/// One chunk of a parsed packet.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Chunk {
    pub kind: u8,
    pub flags: u8,
    /// The chunk value (without the 4-byte chunk header and padding).
    pub value: Vec<u8>,
}

/// A parsed SCTP packet.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Packet {
    pub src_port: u16,
    pub dst_port: u16,
    pub vtag: u32,
    pub checksum_ok: bool,
    pub chunks: Vec<Chunk>,
}

impl Packet {
    /// Parses an SCTP packet (starting at the common header). Truncated chunks end the list.
    pub fn parse(buf: &[u8]) -> Option<Packet> {
        if buf.len() < COMMON_HEADER_LEN {
            return None;
        }
        let be16 = |o: usize| u16::from_be_bytes([buf[o], buf[o + 1]]);
        let be32 = |o: usize| u32::from_be_bytes([buf[o], buf[o + 1], buf[o + 2], buf[o + 3]]);
        let sent = u32::from_le_bytes([buf[8], buf[9], buf[10], buf[11]]);
        let mut zeroed = buf.to_vec();
        zeroed[8..12].fill(0);
        let mut chunks = Vec::new();
        let mut off = COMMON_HEADER_LEN;
        while off + 4 <= buf.len() {
            let len = usize::from(be16(off + 2));
            if len < 4 || off + len > buf.len() {
                break;
            }
            chunks.push(Chunk {
                kind: buf[off],
                flags: buf[off + 1],
                value: buf[off + 4..off + len].to_vec(),
            });
            off += len.div_ceil(4) * 4;
        }
        Some(Packet {
            src_port: be16(0),
            dst_port: be16(2),
            vtag: be32(4),
            checksum_ok: crc32c(&zeroed) == sent,
            chunks,
        })
    }

    /// The initiate tag of the first chunk if it is an INIT.
    pub fn init_tag(&self) -> Option<u32> {
        let c = self.chunks.first()?;
        (c.kind == CHUNK_INIT && c.value.len() >= 4)
            .then(|| u32::from_be_bytes([c.value[0], c.value[1], c.value[2], c.value[3]]))
    }

    /// If the packet carries an ABORT: `Some(reason)` where reason is the value of its
    /// first "User-Initiated Abort" cause (empty if there is none).
    pub fn abort_reason(&self) -> Option<Vec<u8>> {
        let c = self.chunks.iter().find(|c| c.kind == CHUNK_ABORT)?;
        let mut off = 0;
        while off + 4 <= c.value.len() {
            let code = u16::from_be_bytes([c.value[off], c.value[off + 1]]);
            let len = usize::from(u16::from_be_bytes([c.value[off + 2], c.value[off + 3]]));
            if len < 4 || off + len > c.value.len() {
                break;
            }
            if code == CAUSE_USER_ABORT {
                return Some(c.value[off + 4..off + len].to_vec());
            }
            off += len.div_ceil(4) * 4;
        }
        Some(Vec::new())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc32c_check_value() {
        assert_eq!(crc32c(b"123456789"), 0xE306_9283);
    }

    #[test]
    fn init_roundtrip() {
        let p = Packet::parse(&build_init(40000, 80, 0xdead_beef, 7)).unwrap();
        assert!(p.checksum_ok);
        assert_eq!((p.src_port, p.dst_port, p.vtag), (40000, 80, 0));
        assert_eq!(p.init_tag(), Some(0xdead_beef));
        assert_eq!(p.abort_reason(), None);
    }

    #[test]
    fn abort_roundtrip() {
        let pkt = build_abort(
            80,
            40000,
            0xdead_beef,
            Some(b"nettest 1.2.3.4:80 5.6.7.8:9"),
        );
        assert_eq!(pkt.len() % 4, 0);
        let p = Packet::parse(&pkt).unwrap();
        assert!(p.checksum_ok);
        assert_eq!(p.vtag, 0xdead_beef);
        assert_eq!(p.abort_reason().unwrap(), b"nettest 1.2.3.4:80 5.6.7.8:9");
        let bare = Packet::parse(&build_abort(80, 40000, 1, None)).unwrap();
        assert_eq!(bare.abort_reason().unwrap(), b"");
        let mut corrupt = pkt.clone();
        corrupt[0] ^= 1;
        assert!(!Packet::parse(&corrupt).unwrap().checksum_ok);
    }
}

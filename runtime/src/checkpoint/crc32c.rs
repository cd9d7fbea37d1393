//! CRC-32C (Castagnoli), the checksum of every checkpoint file: the one
//! iSCSI, ext4 and most storage formats use, so `crc32c` tools can check a
//! file by hand. Table-driven, eight bytes at a time (slice-by-8).

/// The reflected Castagnoli polynomial.
const POLY: u32 = 0x82F6_3B78;

/// `TABLES[k][b]`: the CRC of byte `b` followed by `k` zero bytes.
static TABLES: [[u32; 256]; 8] = tables();

const fn tables() -> [[u32; 256]; 8] {
    let mut t = [[0u32; 256]; 8];
    let mut b = 0;
    while b < 256 {
        let mut crc = b as u32;
        let mut bit = 0;
        while bit < 8 {
            crc = if crc & 1 == 1 {
                (crc >> 1) ^ POLY
            } else {
                crc >> 1
            };
            bit += 1;
        }
        t[0][b] = crc;
        b += 1;
    }
    let mut k = 1;
    while k < 8 {
        let mut b = 0;
        while b < 256 {
            let prev = t[k - 1][b];
            t[k][b] = (prev >> 8) ^ t[0][(prev & 0xFF) as usize];
            b += 1;
        }
        k += 1;
    }
    t
}

/// A running CRC-32C, for data that arrives in pieces.
#[derive(Clone, Copy, Debug)]
pub struct Crc32c(u32);

impl Default for Crc32c {
    fn default() -> Self {
        Crc32c(!0)
    }
}

impl Crc32c {
    pub fn update(&mut self, bytes: &[u8]) {
        let mut crc = self.0;
        let mut chunks = bytes.chunks_exact(8);
        for c in &mut chunks {
            let lo = crc ^ u32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            crc = TABLES[7][(lo & 0xFF) as usize]
                ^ TABLES[6][((lo >> 8) & 0xFF) as usize]
                ^ TABLES[5][((lo >> 16) & 0xFF) as usize]
                ^ TABLES[4][(lo >> 24) as usize]
                ^ TABLES[3][c[4] as usize]
                ^ TABLES[2][c[5] as usize]
                ^ TABLES[1][c[6] as usize]
                ^ TABLES[0][c[7] as usize];
        }
        for &b in chunks.remainder() {
            crc = (crc >> 8) ^ TABLES[0][((crc ^ u32::from(b)) & 0xFF) as usize];
        }
        self.0 = crc;
    }

    pub fn finish(self) -> u32 {
        !self.0
    }
}

/// The CRC-32C of `bytes`.
pub fn crc32c(bytes: &[u8]) -> u32 {
    let mut crc = Crc32c::default();
    crc.update(bytes);
    crc.finish()
}

/// The CRC-32C of `a` followed by `b`, from `crc32c(a)`, `crc32c(b)` and
/// `b`'s length, without the bytes: how a file whose header is written
/// last gets its checksum (zlib's `crc32_combine`, for this polynomial).
/// Appending `len_b` zero bytes to `a` multiplies its register by `x^(8
/// len_b)` modulo the polynomial: square-and-multiply over 32 x 32 bit
/// matrices.
pub fn combine(crc_a: u32, crc_b: u32, len_b: u64) -> u32 {
    /// `matrix * vector` over GF(2): the xor of the columns `vector` picks.
    fn times(matrix: &[u32; 32], mut vector: u32) -> u32 {
        let (mut sum, mut i) = (0, 0);
        while vector != 0 {
            if vector & 1 == 1 {
                sum ^= matrix[i];
            }
            vector >>= 1;
            i += 1;
        }
        sum
    }
    fn square(matrix: &[u32; 32]) -> [u32; 32] {
        std::array::from_fn(|n| times(matrix, matrix[n]))
    }
    if len_b == 0 {
        return crc_a;
    }
    // One zero bit: the register shifts right, folding in the polynomial.
    let mut one_bit = [0u32; 32];
    one_bit[0] = POLY;
    for (n, column) in one_bit.iter_mut().enumerate().skip(1) {
        *column = 1 << (n - 1);
    }
    // Two, then four zero bits; the loop starts at one zero byte.
    let mut power = square(&square(&one_bit));
    let (mut crc, mut len) = (crc_a, len_b);
    while len != 0 {
        power = square(&power);
        if len & 1 == 1 {
            crc = times(&power, crc);
        }
        len >>= 1;
    }
    crc ^ crc_b
}

/// How checksums are written in indexes: eight lowercase hex digits.
pub fn hex(crc: u32) -> String {
    format!("{crc:08x}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_the_published_check_values() {
        // The standard check value (RFC 3720 appendix B.4 and every CRC
        // catalogue) and the iSCSI test vectors.
        assert_eq!(crc32c(b"123456789"), 0xE306_9283);
        assert_eq!(crc32c(&[0u8; 32]), 0x8A91_36AA);
        assert_eq!(crc32c(&[0xFFu8; 32]), 0x62A8_AB43);
        let ascending: Vec<u8> = (0..32).collect();
        assert_eq!(crc32c(&ascending), 0x46DD_794E);
        assert_eq!(crc32c(b""), 0);
    }

    #[test]
    fn pieces_give_the_same_crc_as_the_whole() {
        let data: Vec<u8> = (0..1000u32).map(|i| (i * 31 % 251) as u8).collect();
        for cut in [0, 1, 7, 8, 9, 500, 999, 1000] {
            let mut crc = Crc32c::default();
            crc.update(&data[..cut]);
            crc.update(&data[cut..]);
            assert_eq!(crc.finish(), crc32c(&data), "cut at {cut}");
        }
        // The slice-by-8 path agrees with the byte-at-a-time one.
        let mut bytewise = Crc32c::default();
        for b in &data {
            bytewise.update(std::slice::from_ref(b));
        }
        assert_eq!(bytewise.finish(), crc32c(&data));
    }

    #[test]
    fn combined_crcs_are_the_crc_of_the_joined_bytes() {
        let data: Vec<u8> = (0..5000u32).map(|i| (i * 131 % 257) as u8).collect();
        for cut in [0, 1, 3, 8, 255, 256, 1000, 4095, 4999, 5000] {
            let (a, b) = data.split_at(cut);
            assert_eq!(
                combine(crc32c(a), crc32c(b), b.len() as u64),
                crc32c(&data),
                "cut at {cut}"
            );
        }
        // Lengths past 2^32 bytes (a large rank file): joining three parts
        // in either grouping gives one CRC.
        let (x, y, z) = (crc32c(b"head"), 0x1234_5678, 0x9abc_def0);
        let (n, m) = (3u64 << 32, 12_345u64);
        assert_eq!(
            combine(combine(x, y, n), z, m),
            combine(x, combine(y, z, m), n + m)
        );
        assert_eq!(combine(x, 0, 0), x);
    }
}

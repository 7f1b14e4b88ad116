//! The transfer checksum: XXH3-64 (seed 0, default secret) over a page's transferred bytes, in
//! transfer order.
//!
//! Both sides compute it over the same byte sequence: for each layer, the K chunk(s) then the
//! V chunk(s) of the page's filled slots, exactly as the work requests gather them. A CUDA node
//! must produce the same value (the algorithm is fixed: XXH3-64, seed 0; streaming over chunks is
//! identical to hashing their concatenation).
//!
//! # Why our own streaming XXH3
//! `xxhash-rust` selects its SIMD path at compile time, so a portable build gets SSE2; its
//! streaming form also copies through an internal buffer. The transfer hashes every KV byte
//! twice (prefill before posting, decode after landing), and at SSE2 speed the hash, not the
//! copy, bounded the transfer. [`Checksummer`] is XXH3-64's long-input algorithm with the
//! stripe accumulation dispatched at run time (AVX2 where present, else portable), consuming
//! whole stripes straight from the caller's chunks. Inputs of at most 240 bytes (XXH3's short
//! algorithms) are delegated to `xxhash-rust`. Tests check bit-identity with `xxhash-rust` for
//! every length class and chunking, on both paths.

/// XXH3's default secret (the specification's `kSecret`).
const SECRET: [u8; 192] = [
    0xb8, 0xfe, 0x6c, 0x39, 0x23, 0xa4, 0x4b, 0xbe, 0x7c, 0x01, 0x81, 0x2c, 0xf7, 0x21, 0xad, 0x1c,
    0xde, 0xd4, 0x6d, 0xe9, 0x83, 0x90, 0x97, 0xdb, 0x72, 0x40, 0xa4, 0xa4, 0xb7, 0xb3, 0x67, 0x1f,
    0xcb, 0x79, 0xe6, 0x4e, 0xcc, 0xc0, 0xe5, 0x78, 0x82, 0x5a, 0xd0, 0x7d, 0xcc, 0xff, 0x72, 0x21,
    0xb8, 0x08, 0x46, 0x74, 0xf7, 0x43, 0x24, 0x8e, 0xe0, 0x35, 0x90, 0xe6, 0x81, 0x3a, 0x26, 0x4c,
    0x3c, 0x28, 0x52, 0xbb, 0x91, 0xc3, 0x00, 0xcb, 0x88, 0xd0, 0x65, 0x8b, 0x1b, 0x53, 0x2e, 0xa3,
    0x71, 0x64, 0x48, 0x97, 0xa2, 0x0d, 0xf9, 0x4e, 0x38, 0x19, 0xef, 0x46, 0xa9, 0xde, 0xac, 0xd8,
    0xa8, 0xfa, 0x76, 0x3f, 0xe3, 0x9c, 0x34, 0x3f, 0xf9, 0xdc, 0xbb, 0xc7, 0xc7, 0x0b, 0x4f, 0x1d,
    0x8a, 0x51, 0xe0, 0x4b, 0xcd, 0xb4, 0x59, 0x31, 0xc8, 0x9f, 0x7e, 0xc9, 0xd9, 0x78, 0x73, 0x64,
    0xea, 0xc5, 0xac, 0x83, 0x34, 0xd3, 0xeb, 0xc3, 0xc5, 0x81, 0xa0, 0xff, 0xfa, 0x13, 0x63, 0xeb,
    0x17, 0x0d, 0xdd, 0x51, 0xb7, 0xf0, 0xda, 0x49, 0xd3, 0x16, 0x55, 0x26, 0x29, 0xd4, 0x68, 0x9e,
    0x2b, 0x16, 0xbe, 0x58, 0x7d, 0x47, 0xa1, 0xfc, 0x8f, 0xf8, 0xb8, 0xd1, 0x7a, 0xd0, 0x31, 0xce,
    0x45, 0xcb, 0x3a, 0x8f, 0x95, 0x16, 0x04, 0x28, 0xaf, 0xd7, 0xfb, 0xca, 0xbb, 0x4b, 0x40, 0x7e,
];

const STRIPE: usize = 64;
/// Stripes per block: (secret size − stripe) / secret consume rate (8).
const STRIPES_PER_BLOCK: u64 = ((SECRET.len() - STRIPE) / 8) as u64;
/// Longest input hashed by XXH3's short algorithms.
const MID_MAX: usize = 240;

const P32_1: u64 = 0x9E37_79B1;
const P32_2: u64 = 0x85EB_CA77;
const P32_3: u64 = 0xC2B2_AE3D;
const P64_1: u64 = 0x9E37_79B1_85EB_CA87;
const P64_2: u64 = 0xC2B2_AE3D_27D4_EB4F;
const P64_3: u64 = 0x1656_67B1_9E37_79F9;
const P64_4: u64 = 0x85EB_CA77_C2B2_AE63;
const P64_5: u64 = 0x27D4_EB2F_1656_67C5;

fn read64(b: &[u8], at: usize) -> u64 {
    let mut w = [0u8; 8];
    w.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(w)
}

/// Accumulate `n` consecutive stripes of `input` (at least `64 n` bytes), the first using the
/// secret at stripe index `first` within its block (`first + n <= STRIPES_PER_BLOCK`).
type AccumulateFn = fn(&mut [u64; 8], &[u8], usize, usize);

fn accumulate_scalar(acc: &mut [u64; 8], input: &[u8], first: usize, n: usize) {
    debug_assert!(input.len() >= n * STRIPE && first + n <= STRIPES_PER_BLOCK as usize);
    for s in 0..n {
        let (inp, sec) = (&input[s * STRIPE..], &SECRET[(first + s) * 8..]);
        for i in 0..8 {
            let v = read64(inp, 8 * i);
            let k = v ^ read64(sec, 8 * i);
            acc[i ^ 1] = acc[i ^ 1].wrapping_add(v);
            acc[i] = acc[i].wrapping_add((k & 0xFFFF_FFFF).wrapping_mul(k >> 32));
        }
    }
}

#[cfg(target_arch = "x86_64")]
fn accumulate_avx2(acc: &mut [u64; 8], input: &[u8], first: usize, n: usize) {
    assert!(input.len() >= n * STRIPE && first + n <= STRIPES_PER_BLOCK as usize);
    // SAFETY: chosen only when AVX2 was detected; the bounds are asserted above.
    unsafe { accumulate_avx2_impl(acc, input, first, n) }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn accumulate_avx2_impl(acc: &mut [u64; 8], input: &[u8], first: usize, n: usize) {
    use std::arch::x86_64::*;
    let a = acc.as_mut_ptr().cast::<__m256i>();
    // SAFETY: `acc` is 64 bytes (two unaligned ymm); stripe `s` reads 64 bytes at
    // `input[64 s..]` (within the asserted length) and 64 bytes of the secret at
    // `8 (first + s)` ≤ 8·15, ending at ≤ 184 < 192.
    unsafe {
        let mut acc0 = _mm256_loadu_si256(a);
        let mut acc1 = _mm256_loadu_si256(a.add(1));
        for s in 0..n {
            let p = input.as_ptr().add(s * STRIPE).cast::<__m256i>();
            let k = SECRET.as_ptr().add((first + s) * 8).cast::<__m256i>();
            for (acc_v, j) in [(&mut acc0, 0), (&mut acc1, 1)] {
                let data = _mm256_loadu_si256(p.add(j));
                let key = _mm256_xor_si256(data, _mm256_loadu_si256(k.add(j)));
                let key_hi = _mm256_srli_epi64::<32>(key);
                let product = _mm256_mul_epu32(key, key_hi);
                // acc[i ^ 1] += data[i]: swap the 64-bit halves of each 128-bit lane.
                let swapped = _mm256_shuffle_epi32::<0b01_00_11_10>(data);
                *acc_v = _mm256_add_epi64(*acc_v, _mm256_add_epi64(product, swapped));
            }
        }
        _mm256_storeu_si256(a, acc0);
        _mm256_storeu_si256(a.add(1), acc1);
    }
}

fn scramble(acc: &mut [u64; 8]) {
    let sec = &SECRET[SECRET.len() - STRIPE..];
    for (i, a) in acc.iter_mut().enumerate() {
        let mut x = *a;
        x ^= x >> 47;
        x ^= read64(sec, 8 * i);
        *a = x.wrapping_mul(P32_1);
    }
}

fn pick() -> AccumulateFn {
    #[cfg(target_arch = "x86_64")]
    {
        if crate::simd::level() == crate::simd::Level::Avx2 {
            return accumulate_avx2;
        }
    }
    accumulate_scalar
}

fn avalanche(mut h: u64) -> u64 {
    h ^= h >> 37;
    h = h.wrapping_mul(0x1656_6791_9E37_79F9);
    h ^ (h >> 32)
}

fn mul128_fold64(a: u64, b: u64) -> u64 {
    let p = u128::from(a) * u128::from(b);
    (p as u64) ^ ((p >> 64) as u64)
}

/// Streaming XXH3-64 (seed 0): feed chunks with [`Checksummer::update`], then
/// [`Checksummer::digest`]. Identical to `xxh3_64` of the chunks' concatenation.
#[derive(Clone, Debug)]
pub struct Checksummer {
    acc: [u64; 8],
    accumulate: AccumulateFn,
    /// Stripes consumed so far. A stripe is consumed only once at least one byte after it has
    /// arrived: XXH3 treats the input's last 1..=64 bytes specially (the "last stripe").
    stripes: u64,
    total: u64,
    /// Bytes after the consumed stripes (1..=64 once anything arrived; empty before).
    pending: [u8; STRIPE],
    pending_len: usize,
    /// The input's last 64 bytes (valid once `total >= 64`).
    last: [u8; STRIPE],
    /// The first `MID_MAX` bytes, for inputs short enough for XXH3's other algorithms.
    short: [u8; MID_MAX],
}

impl Default for Checksummer {
    fn default() -> Self {
        Self::new()
    }
}

impl Checksummer {
    pub fn new() -> Self {
        Self::with(pick())
    }

    fn with(accumulate: AccumulateFn) -> Self {
        Self {
            acc: [P32_3, P64_1, P64_2, P64_3, P64_4, P32_2, P64_5, P32_1],
            accumulate,
            stripes: 0,
            total: 0,
            pending: [0; STRIPE],
            pending_len: 0,
            last: [0; STRIPE],
            short: [0; MID_MAX],
        }
    }

    /// Consume `n` whole stripes of `input`, scrambling at every block boundary.
    fn consume(&mut self, mut input: &[u8], mut n: u64) {
        while n > 0 {
            let in_block = self.stripes % STRIPES_PER_BLOCK;
            let take = n.min(STRIPES_PER_BLOCK - in_block);
            (self.accumulate)(&mut self.acc, input, in_block as usize, take as usize);
            self.stripes += take;
            if self.stripes.is_multiple_of(STRIPES_PER_BLOCK) {
                scramble(&mut self.acc);
            }
            input = &input[take as usize * STRIPE..];
            n -= take;
        }
    }

    pub fn update(&mut self, mut data: &[u8]) {
        if data.is_empty() {
            return;
        }
        if (self.total as usize) < MID_MAX {
            let at = self.total as usize;
            let n = (MID_MAX - at).min(data.len());
            self.short[at..at + n].copy_from_slice(&data[..n]);
        }
        if data.len() >= STRIPE {
            self.last.copy_from_slice(&data[data.len() - STRIPE..]);
        } else {
            self.last.copy_within(data.len().., 0);
            self.last[STRIPE - data.len()..].copy_from_slice(data);
        }
        self.total += data.len() as u64;
        if self.pending_len > 0 {
            // Complete the pending stripe; consume it only if more bytes follow it.
            let n = (STRIPE - self.pending_len).min(data.len());
            self.pending[self.pending_len..self.pending_len + n].copy_from_slice(&data[..n]);
            self.pending_len += n;
            data = &data[n..];
            if data.is_empty() {
                return;
            }
            let stripe = self.pending;
            self.consume(&stripe, 1);
            self.pending_len = 0;
        }
        // Whole stripes straight from `data`, keeping back at least one byte.
        let n = (data.len() - 1) / STRIPE;
        self.consume(data, n as u64);
        let rest = &data[n * STRIPE..];
        debug_assert!((1..=STRIPE).contains(&rest.len()));
        self.pending[..rest.len()].copy_from_slice(rest);
        self.pending_len = rest.len();
    }

    pub fn digest(&self) -> u64 {
        let len = self.total as usize;
        if len <= MID_MAX {
            return xxhash_rust::xxh3::xxh3_64(&self.short[..len]);
        }
        debug_assert_eq!(self.stripes, (self.total - 1) / STRIPE as u64);
        let mut acc = self.acc;
        // The last stripe: the input's last 64 bytes, with the secret 7 bytes before its end.
        let sec = &SECRET[SECRET.len() - STRIPE - 7..];
        for i in 0..8 {
            let v = read64(&self.last, 8 * i);
            let k = v ^ read64(sec, 8 * i);
            acc[i ^ 1] = acc[i ^ 1].wrapping_add(v);
            acc[i] = acc[i].wrapping_add((k & 0xFFFF_FFFF).wrapping_mul(k >> 32));
        }
        let mut h = self.total.wrapping_mul(P64_1);
        for i in 0..4 {
            h = h.wrapping_add(mul128_fold64(
                acc[2 * i] ^ read64(&SECRET, 11 + 16 * i),
                acc[2 * i + 1] ^ read64(&SECRET, 11 + 16 * i + 8),
            ));
        }
        avalanche(h)
    }
}

/// Checksum of the concatenation of `chunks`.
pub fn page_checksum<'a>(chunks: impl IntoIterator<Item = &'a [u8]>) -> u64 {
    let mut h = Checksummer::new();
    for c in chunks {
        h.update(c);
    }
    h.digest()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data(n: usize) -> Vec<u8> {
        (0..n as u64)
            .map(|i| (i.wrapping_mul(0x9E37_79B9) >> 7) as u8)
            .collect()
    }

    /// Every accumulate path the machine has.
    fn paths() -> Vec<AccumulateFn> {
        let mut v: Vec<AccumulateFn> = vec![accumulate_scalar];
        #[cfg(target_arch = "x86_64")]
        if std::is_x86_feature_detected!("avx2") {
            v.push(accumulate_avx2);
        }
        v
    }

    #[test]
    fn equals_xxh3_64_for_every_length_class_chunking_and_path() {
        let lens = [
            0usize, 1, 3, 4, 8, 9, 16, 17, 128, 129, 239, 240, 241, 255, 256, 257, 319, 320, 321,
            1023, 1024, 1025, 1087, 1088, 1089, 2048, 4095, 6144, 10_000, 65_536, 368_640,
        ];
        for &len in &lens {
            let d = data(len);
            let want = xxhash_rust::xxh3::xxh3_64(&d);
            for acc in paths() {
                for split in [1usize, 7, 63, 64, 65, 128, 1000, 6144, usize::MAX] {
                    let mut h = Checksummer::with(acc);
                    for c in d.chunks(split.min(len.max(1))) {
                        h.update(c);
                    }
                    assert_eq!(h.digest(), want, "len {len} split {split}");
                }
            }
        }
    }

    #[test]
    fn detects_a_flipped_bit() {
        let d = data(10_000);
        let whole = page_checksum([&d[..]]);
        assert_eq!(whole, page_checksum([&d[..17], &d[17..4096], &d[4096..]]));
        let mut bad = d.clone();
        bad[5000] ^= 1;
        assert_ne!(page_checksum([&bad[..]]), whole);
    }
}

//! AVX-512 VNNI kernels over row-interleaved K-quant weights ([`crate::pack`]): eight rows ·
//! one to four tokens' Q8_K activations per super-block, every result the bits of the one-row
//! kernel (`crate::q8k`'s spec: the same exact integers, the same float steps in the same
//! block order, lane `r` of an 8-lane f32 accumulator standing for row `r`).
//!
//! Why a second layout (a profile of a 1B Q4_K_M decode, issue 38): the GGUF-layout kernel
//! spent more time decoding each super-block's packed 6-bit scales, converting its f16 scales
//! and reducing each row's 512-bit sum to a scalar than multiplying. Repacked at load, eight
//! rows' `d`/`dmin` are one f16x8 load each, each row's scales and mins are plain bytes, the
//! nibbles are ordered so that a 64-byte load's low nibbles are 64 consecutive elements and its
//! high nibbles the next 64 (no activation shuffles), and eight rows' integer sums are reduced
//! together (one transposing tree, [`sum8`]) before one FMA for all eight.

use core::arch::x86_64::*;
use core::mem::MaybeUninit;

use crate::q8k::BlockQ8K;
// Chunk c of a packed Q6_K row is elements 64c..64c+64, as in the GGUF-layout kernel's decode.
use crate::x86_kquant::Q6_GROUP_OF_PAIR;

/// Bytes of one super-block of eight interleaved Q4_K rows: `d[8]`, `dmin[8]` (f16), each
/// row's 8 sub-block scales (u8), the mins as `[pair p][row][k]` (sub-block `2p + k`, u8),
/// then each row's 128 nibble bytes (byte `64h + k`: element `128h + k` low, `128h + 64 + k`
/// high). 32 bytes more than eight GGUF blocks (1,152): the scales unpacked.
pub(crate) const Q4_K_GROUP_BLOCK: usize = 1184;
/// Bytes of one super-block of eight interleaved Q6_K rows: `d[8]` (f16), each row's 16 i8
/// scales, then each row's 192 quant bytes: 128 of low nibbles (byte `k`: element `k` low,
/// `128 + k` high) and 64 of high bit pairs (bits `2j..2j+2` of byte `k`: element `64j + k`).
/// The same size as eight GGUF blocks.
pub(crate) const Q6_K_GROUP_BLOCK: usize = 1680;

/// Bytes of one super-block of eight interleaved Q5_K rows: the Q4_K layout, then each row's
/// 32 bytes of fifth bits in element order (bit `e % 8` of byte `e / 8`). 32 bytes more than
/// eight GGUF blocks (1,408).
pub(crate) const Q5_K_GROUP_BLOCK: usize = Q4_K_GROUP_BLOCK + 8 * 32;

/// Offsets inside a [`Q4_K_GROUP_BLOCK`] (and a [`Q5_K_GROUP_BLOCK`]).
pub(crate) mod q4k_at {
    pub(crate) const D: usize = 0;
    pub(crate) const DMIN: usize = 16;
    pub(crate) const SCALES: usize = 32;
    pub(crate) const MINS: usize = 96;
    pub(crate) const QS: usize = 160;
    /// Q5_K only: each row's 32 bytes of fifth bits.
    pub(crate) const HBITS: usize = super::Q4_K_GROUP_BLOCK;
}

/// Offsets inside a [`Q6_K_GROUP_BLOCK`].
pub(crate) mod q6k_at {
    pub(crate) const D: usize = 0;
    pub(crate) const SCALES: usize = 16;
    pub(crate) const QS: usize = 144;
    /// Quant bytes per row: 128 low-nibble bytes, then 64 high-pair bytes.
    pub(crate) const ROW: usize = 192;
}

/// `out[r] = Σ lanes of v[r]` for eight vectors of 16 i32: pairs interleaved, then quads, then
/// the 128-bit quarters folded (24 instructions where eight separate reductions take ~64).
#[inline]
#[target_feature(enable = "avx2,avx512f")]
fn sum8(v: [__m512i; 8]) -> __m256i {
    // Per quarter: [a0+a2, b0+b2, a1+a3, b1+b3].
    let pair = |a, b| _mm512_add_epi32(_mm512_unpacklo_epi32(a, b), _mm512_unpackhi_epi32(a, b));
    let p = [
        pair(v[0], v[1]),
        pair(v[2], v[3]),
        pair(v[4], v[5]),
        pair(v[6], v[7]),
    ];
    // Per quarter: rows (0, 1, 2, 3) of the four, partially summed.
    let quad = |a, b| _mm512_add_epi32(_mm512_unpacklo_epi64(a, b), _mm512_unpackhi_epi64(a, b));
    let (q0, q1) = (quad(p[0], p[1]), quad(p[2], p[3]));
    // [q0 quarters 0+1, q0 2+3, q1 0+1, q1 2+3].
    let z = _mm512_add_epi32(
        _mm512_shuffle_i64x2::<0b10_00_10_00>(q0, q1),
        _mm512_shuffle_i64x2::<0b11_01_11_01>(q0, q1),
    );
    let w = _mm512_shuffle_i64x2::<0b11_01_10_00>(z, z);
    _mm256_add_epi32(_mm512_castsi512_si256(w), _mm512_extracti64x4_epi64::<1>(w))
}

/// A block's eight row sums, each written by the row loop.
#[inline(always)]
fn written(v: [MaybeUninit<__m512i>; 8]) -> [__m512i; 8] {
    // SAFETY: the callers' row loops write every row `0..8` of every token before this read.
    v.map(|x| unsafe { x.assume_init() })
}

/// The i16 lane of `_mm256_hadd_epi16(bsums, bsums)` holding `bsums[2j] + bsums[2j+1]`.
const fn pair_sum_lane(j: usize) -> i16 {
    (if j < 4 { j } else { j + 4 }) as i16
}

/// For the mins' `madd`: lane `16p' + 2r + k` of register `h` (pairs `p = 2h + p'`) takes the
/// pair sum of sub-block `2p + k`.
static MIN_PAIR_LANES: [[i16; 32]; 2] = {
    let mut t = [[0i16; 32]; 2];
    let mut h = 0;
    while h < 2 {
        let mut lane = 0;
        while lane < 32 {
            let (p, k) = (2 * h + lane / 16, lane % 2);
            t[h][lane] = pair_sum_lane(2 * p + k);
            lane += 1;
        }
        h += 1;
    }
    t
};

#[inline]
#[target_feature(enable = "avx512f")]
fn load512(p: *const u8) -> __m512i {
    // SAFETY: callers pass a pointer with 64 readable bytes (inside a block whose bounds they
    // asserted); the load is unaligned.
    unsafe { _mm512_loadu_si512(p.cast()) }
}

#[inline]
#[target_feature(enable = "avx512f")]
fn load_i16x32(t: &[i16; 32]) -> __m512i {
    // SAFETY: 32 i16 are 64 bytes.
    unsafe { _mm512_loadu_si512(t.as_ptr().cast()) }
}

/// Each token's 8-lane accumulator, lane `r` row `r`, into `[token][row]`.
#[inline]
#[target_feature(enable = "avx")]
fn store8<const T: usize>(v: [__m256; T]) -> [[f32; 8]; T] {
    let mut out = [[0.0f32; 8]; T];
    for (o, v) in out.iter_mut().zip(v) {
        // SAFETY: `o` is 8 f32 = 32 bytes.
        unsafe { _mm256_storeu_ps(o.as_mut_ptr(), v) };
    }
    out
}

/// Eight interleaved Q4_K rows (`FIFTH` = false; `g`: `nb` blocks of [`Q4_K_GROUP_BLOCK`]
/// bytes) or Q5_K rows (`FIFTH`; [`Q5_K_GROUP_BLOCK`]) · `T` Q8_K activation rows: `out[t][r]`
/// is the bits of `q8k::scalar_dot(Q4_K or Q5_K)(row r, a[t])`.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(crate) fn dot8_q45_k_packed<const T: usize, const FIFTH: bool>(
    g: &[u8],
    a: [&[BlockQ8K]; T],
) -> [[f32; 8]; T] {
    use q4k_at::*;
    let block = if FIFTH {
        Q5_K_GROUP_BLOCK
    } else {
        Q4_K_GROUP_BLOCK
    };
    let nb = g.len() / block;
    assert_eq!(g.len(), nb * block);
    assert!(a.iter().all(|t| t.len() == nb));
    let m4 = _mm512_set1_epi8(0x0f);
    // Chunk k (elements 64k..64k+64): maddubs lanes 0–15 are sub-block 2k, 16–31 sub-block 2k+1.
    let sc_lanes: [__m512i; 4] = std::array::from_fn(|k| {
        let (lo, hi) = (2 * k as i16, 2 * k as i16 + 1);
        _mm512_inserti64x4::<1>(
            _mm512_castsi256_si512(_mm256_set1_epi16(lo)),
            _mm256_set1_epi16(hi),
        )
    });
    let min_lanes = MIN_PAIR_LANES.each_ref().map(|t| load_i16x32(t));
    let (mut acc, mut accm) = ([_mm256_setzero_ps(); T], [_mm256_setzero_ps(); T]);
    for b in 0..nb {
        let blk = &g[b * block..(b + 1) * block];
        let at = |off: usize| blk[off..].as_ptr();
        // SAFETY: every load below lies inside `blk` (offsets from the layout, asserted size).
        let (d8, dmin8, mins) = unsafe {
            (
                _mm256_cvtph_ps(_mm_loadu_si128(at(D).cast())),
                _mm256_cvtph_ps(_mm_loadu_si128(at(DMIN).cast())),
                [0, 32].map(|h| _mm512_cvtepu8_epi16(_mm256_loadu_si256(at(MINS + h).cast()))),
            )
        };
        // Every (token, row) is written below before it is read; uninitialised, not zeroed
        // (zeroing T × 8 registers' worth of stack per block was a memset of 10 % of a prefill).
        let mut s = [[MaybeUninit::<__m512i>::uninit(); 8]; T];
        for r in 0..8 {
            let row = QS + 128 * r;
            let (z0, z1) = (load512(at(row)), load512(at(row + 64)));
            let mut q = [
                _mm512_and_si512(z0, m4),
                _mm512_and_si512(_mm512_srli_epi16::<4>(z0), m4),
                _mm512_and_si512(z1, m4),
                _mm512_and_si512(_mm512_srli_epi16::<4>(z1), m4),
            ];
            if FIFTH {
                let sixteen = _mm512_set1_epi8(16);
                for (k, qk) in q.iter_mut().enumerate() {
                    let bits = &blk[HBITS + 32 * r + 8 * k..HBITS + 32 * r + 8 * k + 8];
                    let mask = u64::from_le_bytes(bits.try_into().expect("8 bytes"));
                    *qk = _mm512_mask_add_epi8(*qk, mask, *qk, sixteen);
                }
            }
            // SAFETY: 8 scale bytes of row r inside `blk`.
            let sc8 = unsafe { _mm_loadl_epi64(at(SCALES + 8 * r).cast()) };
            let sc = _mm512_castsi128_si512(_mm_cvtepu8_epi16(sc8));
            let scv = sc_lanes.map(|l| _mm512_permutexvar_epi16(l, sc));
            for t in 0..T {
                let x = &a[t][b];
                let mut v = _mm512_setzero_si512();
                for k in 0..4 {
                    let ak = load512(x.qs[64 * k..].as_ptr().cast());
                    v = _mm512_dpwssd_epi32(v, _mm512_maddubs_epi16(q[k], ak), scv[k]);
                }
                s[t][r].write(v);
            }
        }
        for t in 0..T {
            let x = &a[t][b];
            // SAFETY: `bsums` is 16 i16 = 32 bytes.
            let bs = unsafe { _mm256_loadu_si256(x.bsums.as_ptr().cast()) };
            let pairs = _mm512_castsi256_si512(_mm256_hadd_epi16(bs, bs));
            // Lanes (p % 2)·8 + r: row r's Σ over pairs p of its two mins · pair sums.
            let m = _mm512_add_epi32(
                _mm512_madd_epi16(mins[0], _mm512_permutexvar_epi16(min_lanes[0], pairs)),
                _mm512_madd_epi16(mins[1], _mm512_permutexvar_epi16(min_lanes[1], pairs)),
            );
            let m8 = _mm256_add_epi32(_mm512_castsi512_si256(m), _mm512_extracti64x4_epi64::<1>(m));
            let da = _mm256_set1_ps(x.d);
            let s8 = _mm256_cvtepi32_ps(sum8(written(s[t])));
            acc[t] = _mm256_fmadd_ps(_mm256_mul_ps(d8, da), s8, acc[t]);
            accm[t] = _mm256_fmadd_ps(_mm256_mul_ps(dmin8, da), _mm256_cvtepi32_ps(m8), accm[t]);
        }
    }
    store8(std::array::from_fn(|t| _mm256_sub_ps(acc[t], accm[t])))
}

/// Eight interleaved Q6_K rows (`g`: `nb` blocks of [`Q6_K_GROUP_BLOCK`] bytes) · `T` Q8_K
/// activation rows: `out[t][r]` is the bits of `q8k::scalar_dot(Q6_K)(row r, a[t])`. The
/// unsigned 6-bit values go through `maddubs`; the −32 offset enters once per 16-element group
/// through the activations' `bsums`.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(crate) fn dot8_q6_k_packed<const T: usize>(g: &[u8], a: [&[BlockQ8K]; T]) -> [[f32; 8]; T] {
    use q6k_at::*;
    let nb = g.len() / Q6_K_GROUP_BLOCK;
    assert_eq!(g.len(), nb * Q6_K_GROUP_BLOCK);
    assert!(a.iter().all(|t| t.len() == nb));
    let (m4, m30) = (_mm512_set1_epi8(0x0f), _mm512_set1_epi8(0x30));
    let group_lanes = Q6_GROUP_OF_PAIR.each_ref().map(|t| load_i16x32(t));
    let mut acc = [_mm256_setzero_ps(); T];
    for b in 0..nb {
        let blk = &g[b * Q6_K_GROUP_BLOCK..(b + 1) * Q6_K_GROUP_BLOCK];
        let at = |off: usize| blk[off..].as_ptr();
        // SAFETY: 8 f16 inside `blk`.
        let d8 = unsafe { _mm256_cvtph_ps(_mm_loadu_si128(at(D).cast())) };
        // Every (token, row) is written below before it is read; uninitialised, not zeroed
        // (zeroing T × 8 registers' worth of stack per block was a memset of 10 % of a prefill).
        let mut s = [[MaybeUninit::<__m512i>::uninit(); 8]; T];
        for r in 0..8 {
            let row = QS + ROW * r;
            let (l0, l1, h) = (
                load512(at(row)),
                load512(at(row + 64)),
                load512(at(row + 128)),
            );
            // `c ? a : b` bitwise (ternary-logic table 0xE4) with c = 0x0f: the low nibble
            // from the quant bytes, bits 4–5 from the high pairs (masked to 0x30).
            let blend = |lo, hi| _mm512_ternarylogic_epi32::<0xE4>(lo, hi, m4);
            let q = [
                blend(l0, _mm512_and_si512(_mm512_slli_epi16::<4>(h), m30)),
                blend(l1, _mm512_and_si512(_mm512_slli_epi16::<2>(h), m30)),
                blend(_mm512_srli_epi16::<4>(l0), _mm512_and_si512(h, m30)),
                blend(
                    _mm512_srli_epi16::<4>(l1),
                    _mm512_and_si512(_mm512_srli_epi16::<2>(h), m30),
                ),
            ];
            // SAFETY: 16 scale bytes of row r inside `blk`.
            let sc16 = _mm256_cvtepi8_epi16(unsafe { _mm_loadu_si128(at(SCALES + 16 * r).cast()) });
            // |scale| ≤ 128, so −32 · scale fits an i16.
            let offset = _mm256_mullo_epi16(sc16, _mm256_set1_epi16(-32));
            let sc = _mm512_castsi256_si512(sc16);
            let scv = group_lanes.map(|l| _mm512_permutexvar_epi16(l, sc));
            for t in 0..T {
                let x = &a[t][b];
                // SAFETY: `bsums` is 16 i16 = 32 bytes.
                let bs = unsafe { _mm256_loadu_si256(x.bsums.as_ptr().cast()) };
                let mut v = _mm512_zextsi256_si512(_mm256_madd_epi16(bs, offset));
                for c in 0..4 {
                    let ac = load512(x.qs[64 * c..].as_ptr().cast());
                    v = _mm512_dpwssd_epi32(v, _mm512_maddubs_epi16(q[c], ac), scv[c]);
                }
                s[t][r].write(v);
            }
        }
        for t in 0..T {
            let da = _mm256_set1_ps(a[t][b].d);
            let s8 = _mm256_cvtepi32_ps(sum8(written(s[t])));
            acc[t] = _mm256_fmadd_ps(_mm256_mul_ps(d8, da), s8, acc[t]);
        }
    }
    // The spec's `acc − accm` with `accm` = +0 (Q6_K has no mins): `acc` itself.
    store8(acc)
}

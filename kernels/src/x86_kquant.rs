//! AVX2 kernels of the K-quant · Q8_K dot products (`crate::q8k`, whose spec they follow): the
//! exact integer block sums with 256-bit `maddubs`/`madd` (every partial sum fits its lane:
//! at most 63 · 127 · 2 per i16 pair, ≤ 2^25 per i32), the float part shared with the scalar
//! reference, so the results are the reference's bits.

use core::arch::x86_64::*;

use crate::kquant::scale_min_k4;
use crate::q8k::{BlockQ8K, BlockSums, accumulate, mins_term, q6_offset_term};
use crate::quant::f16_at;

#[inline]
#[target_feature(enable = "avx2")]
fn hsum_i32(v: __m256i) -> i32 {
    let s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v));
    let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b01_00_11_10>(s));
    let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b10_11_00_01>(s));
    _mm_cvtsi128_si32(s)
}

#[inline]
#[target_feature(enable = "avx2")]
fn load32(p: &[u8]) -> __m256i {
    assert!(p.len() >= 32);
    // SAFETY: at least 32 bytes are readable at `p` (asserted); the load is unaligned.
    unsafe { _mm256_loadu_si256(p.as_ptr().cast()) }
}

#[inline]
#[target_feature(enable = "avx2")]
fn load32_i8(p: &[i8]) -> __m256i {
    assert!(p.len() >= 32);
    // SAFETY: as `load32`.
    unsafe { _mm256_loadu_si256(p.as_ptr().cast()) }
}

/// `Σ_c sc_lo(c) · Σ lo·a + sc_hi(c) · Σ hi·a` over a Q4_K/Q5_K block's four 64-element
/// chunks, the 5-bit values' fifth bits from `qh` where given.
#[inline]
#[target_feature(enable = "avx2")]
fn qk45_scaled_sum(scales: &[u8], qh: Option<&[u8]>, qs: &[u8], a: &BlockQ8K) -> i32 {
    let m4 = _mm256_set1_epi8(0x0f);
    let one = _mm256_set1_epi8(1);
    let hbits = qh.map(|h| load32(h));
    let mut acc = _mm256_setzero_si256();
    for c in 0..4 {
        let q = load32(&qs[32 * c..]);
        let mut lo = _mm256_and_si256(q, m4);
        let mut hi = _mm256_and_si256(_mm256_srli_epi16::<4>(q), m4);
        if let Some(h) = hbits {
            // Bit 2c of each qh byte is the fifth bit of the low nibbles' sub-block, 2c+1 of
            // the high nibbles'.
            let shifted = _mm256_srl_epi16(h, _mm_cvtsi32_si128(2 * c as i32));
            let b0 = _mm256_and_si256(shifted, one);
            let b1 = _mm256_and_si256(_mm256_srli_epi16::<1>(shifted), one);
            lo = _mm256_or_si256(lo, _mm256_slli_epi16::<4>(b0));
            hi = _mm256_or_si256(hi, _mm256_slli_epi16::<4>(b1));
        }
        let (sc0, _) = scale_min_k4(2 * c, scales);
        let (sc1, _) = scale_min_k4(2 * c + 1, scales);
        let p0 = _mm256_maddubs_epi16(lo, load32_i8(&a.qs[64 * c..]));
        let p1 = _mm256_maddubs_epi16(hi, load32_i8(&a.qs[64 * c + 32..]));
        let s0 = _mm256_madd_epi16(p0, _mm256_set1_epi16(i16::from(sc0)));
        let s1 = _mm256_madd_epi16(p1, _mm256_set1_epi16(i16::from(sc1)));
        acc = _mm256_add_epi32(acc, _mm256_add_epi32(s0, s1));
    }
    hsum_i32(acc)
}

/// Q4_K weights · Q8_K activations.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) fn dot_q4_k_q8k(w: &[u8], a: &[BlockQ8K]) -> f32 {
    assert_eq!(w.len(), a.len() * 144);
    accumulate(w.chunks_exact(144).zip(a).map(|(b, x)| {
        let (scales, qs) = (&b[4..16], &b[16..144]);
        let sums = BlockSums {
            s: qk45_scaled_sum(scales, None, qs, x),
            m: mins_term(scales, x),
        };
        (f16_at(b, 0), f16_at(b, 2), sums, x.d)
    }))
}

/// Q5_K weights · Q8_K activations.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) fn dot_q5_k_q8k(w: &[u8], a: &[BlockQ8K]) -> f32 {
    assert_eq!(w.len(), a.len() * 176);
    accumulate(w.chunks_exact(176).zip(a).map(|(b, x)| {
        let (scales, qh, qs) = (&b[4..16], &b[16..48], &b[48..176]);
        let sums = BlockSums {
            s: qk45_scaled_sum(scales, Some(qh), qs, x),
            m: mins_term(scales, x),
        };
        (f16_at(b, 0), f16_at(b, 2), sums, x.d)
    }))
}

/// Q6_K weights · Q8_K activations: the unsigned 6-bit values through `maddubs`, the −32
/// offset applied once per 16-element group through the activations' `bsums`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) fn dot_q6_k_q8k(w: &[u8], a: &[BlockQ8K]) -> f32 {
    assert_eq!(w.len(), a.len() * 210);
    let m4 = _mm256_set1_epi8(0x0f);
    let m2 = _mm256_set1_epi8(3);
    accumulate(w.chunks_exact(210).zip(a).map(|(b, x)| {
        let (ql, qh, sc) = (&b[0..128], &b[128..192], &b[192..208]);
        let mut acc = _mm256_setzero_si256();
        for half in 0..2 {
            let ql0 = load32(&ql[64 * half..]);
            let ql1 = load32(&ql[64 * half + 32..]);
            let h = load32(&qh[32 * half..]);
            let nibbles = [
                _mm256_and_si256(ql0, m4),
                _mm256_and_si256(ql1, m4),
                _mm256_and_si256(_mm256_srli_epi16::<4>(ql0), m4),
                _mm256_and_si256(_mm256_srli_epi16::<4>(ql1), m4),
            ];
            for (k, lo) in nibbles.into_iter().enumerate() {
                let hi = _mm256_and_si256(_mm256_srl_epi16(h, _mm_cvtsi32_si128(2 * k as i32)), m2);
                let q = _mm256_or_si256(lo, _mm256_slli_epi16::<4>(hi));
                let p = _mm256_maddubs_epi16(q, load32_i8(&x.qs[128 * half + 32 * k..]));
                // Elements 0..16 take scale 8·half + 2k, elements 16..32 the next.
                let g = 8 * half + 2 * k;
                let scale = _mm256_set_m128i(
                    _mm_set1_epi16(i16::from(sc[g + 1] as i8)),
                    _mm_set1_epi16(i16::from(sc[g] as i8)),
                );
                acc = _mm256_add_epi32(acc, _mm256_madd_epi16(p, scale));
            }
        }
        let sums = BlockSums {
            s: hsum_i32(acc) - q6_offset_term(sc, x),
            m: 0,
        };
        (f16_at(b, 208), 0.0, sums, x.d)
    }))
}

//! The K-quants' dot products on int8 activations, as ggml defines them: the activations of a
//! row are quantized to Q8_K (256 per block: an f32 scale, 256 int8, and the sums of each 16),
//! and each K-quant super-block's dot product with one Q8_K block is an exact integer.
//!
//! # Spec
//! - [`quantize_row_q8_k`] is ggml's `quantize_row_q8_K_ref`: the element of largest magnitude
//!   `max` (its sign kept) sets `iscale = −127 / max`; each value is `min(127,
//!   nearest(iscale · x))` (ties to even); `d = 1 / iscale`; `bsums[j]` sums `qs[16j .. 16j+16]`.
//!   An all-zero block has `d = 0` and zero quants.
//! - Per super-block `i` the integer sums are exact (any summation order gives the same i32):
//!   - Q4_K / Q5_K: `S = Σ_j sc_j · Σ_{l<32} q_{32j+l} · a_{32j+l}` and
//!     `M = Σ_j m_j · (bsums[2j] + bsums[2j+1])` over the eight (scale, min) pairs;
//!   - Q6_K: `S = Σ_g sc_g · Σ_{l<16} (q_{16g+l} − 32) · a_{16g+l}` over the sixteen i8 scales;
//!   - Q2_K: `S = Σ_g sc_g · Σ_{l<16} q_{16g+l} · a_{16g+l}`, `M = Σ_g m_g · bsums[g]` over the
//!     sixteen 4-bit (scale, min) pairs;
//!   - Q3_K: `S = Σ_g (sc_g − 32) · Σ_{l<16} q_{16g+l} · a_{16g+l}` (q in −4..=3).
//! - The float part, in this order and no other: `acc ← fma(d_w · d_a, S as f32, acc)`, and for
//!   Q4_K/Q5_K `accm ← fma(dmin_w · d_a, M as f32, accm)`, block by block; the dot product is
//!   `acc − accm`. Every kernel — the scalar reference here, the SIMD ones in `x86_kquant.rs` —
//!   computes exactly this, so all are bit-identical (tests), and a row's value never depends
//!   on which kernel or batch produced it.
//!
//! llama.cpp computes the same integers but accumulates the float part in its own lane order
//! (and repacks Q4_K on AVX2 machines, with another): its logits and ours differ by float
//! rounding, not by the activations' quantization.

use crate::kquant::{q2_at, q3_high_at, scale_min_k4, scales_q3_k};
use crate::quant::{DType, QK_K, f16_at};

/// One block of 256 activations quantized to int8 (ggml's `block_q8_K`).
#[derive(Clone, Copy, Debug, PartialEq)]
#[repr(C)]
pub struct BlockQ8K {
    /// Scale (`1 / iscale`; negative when the largest-magnitude value is positive, as ggml's).
    pub d: f32,
    pub qs: [i8; QK_K],
    /// `bsums[j] = Σ qs[16j .. 16j + 16]`.
    pub bsums: [i16; QK_K / 16],
}

impl Default for BlockQ8K {
    fn default() -> Self {
        Self {
            d: 0.0,
            qs: [0; QK_K],
            bsums: [0; QK_K / 16],
        }
    }
}

/// Quantize `x` (a multiple of 256 long) into `out` (`x.len() / 256` blocks): ggml's
/// `quantize_row_q8_K_ref`.
pub fn quantize_row_q8_k(x: &[f32], out: &mut [BlockQ8K]) {
    assert_eq!(
        x.len(),
        out.len() * QK_K,
        "quantize_row_q8_k: length mismatch"
    );
    for (chunk, blk) in x.chunks_exact(QK_K).zip(out.iter_mut()) {
        let (mut max, mut amax) = (0.0f32, 0.0f32);
        for &v in chunk {
            if v.abs() > amax {
                amax = v.abs();
                max = v;
            }
        }
        if amax == 0.0 {
            *blk = BlockQ8K::default();
            continue;
        }
        let iscale = -127.0 / max;
        for (q, &v) in blk.qs.iter_mut().zip(chunk) {
            *q = nearest_int(iscale * v).min(127) as i8;
        }
        for (s, q) in blk.bsums.iter_mut().zip(blk.qs.chunks_exact(16)) {
            *s = q.iter().map(|&v| i16::from(v)).sum();
        }
        blk.d = 1.0 / iscale;
    }
}

/// ggml's `nearest_int`: round to nearest, ties to even, for |v| ≤ 2^22 (here |v| ≤ 127.5),
/// by the float adder itself (adding 1.5 · 2^23 leaves the rounded integer in the low
/// mantissa bits) — no libm call, and the compiler vectorises the loop.
#[inline(always)]
fn nearest_int(v: f32) -> i32 {
    debug_assert!(v.abs() <= 4_194_303.0);
    let bits = (v + 12_582_912.0).to_bits() as i32;
    (bits & 0x007f_ffff) - 0x0040_0000
}

/// A super-block's exact integer sums: `s` (quants × activations, scaled) and `m` (the mins'
/// term; 0 for Q6_K).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct BlockSums {
    pub(crate) s: i32,
    pub(crate) m: i32,
}

/// The spec's float part over a row's blocks: `blocks` yields each block's `(d_w, dmin_w)`
/// with its [`BlockSums`] and the activation block's `d`.
#[inline(always)]
pub(crate) fn accumulate(blocks: impl Iterator<Item = (f32, f32, BlockSums, f32)>) -> f32 {
    let (mut acc, mut accm) = (0.0f32, 0.0f32);
    for (d, dmin, sums, da) in blocks {
        acc = (d * da).mul_add(sums.s as f32, acc);
        accm = (dmin * da).mul_add(sums.m as f32, accm);
    }
    acc - accm
}

/// The mins' term of a Q4_K/Q5_K block: `Σ_j m_j · (bsums[2j] + bsums[2j+1])`.
#[inline(always)]
pub(crate) fn mins_term(scales: &[u8], a: &BlockQ8K) -> i32 {
    (0..8)
        .map(|j| {
            let (_, m) = scale_min_k4(j, scales);
            i32::from(m) * (i32::from(a.bsums[2 * j]) + i32::from(a.bsums[2 * j + 1]))
        })
        .sum()
}

/// The Q6_K offset's term: `32 · Σ_g sc_g · bsums[g]` (subtracted from the unsigned sum).
#[inline(always)]
pub(crate) fn q6_offset_term(scales: &[u8], a: &BlockQ8K) -> i32 {
    32 * scales
        .iter()
        .zip(&a.bsums)
        .map(|(&s, &b)| i32::from(s as i8) * i32::from(b))
        .sum::<i32>()
}

/// Q4_K (`qh` = None) or Q5_K (`qh`: its 32 fifth-bit bytes) block sums.
fn qk45_sums(scales: &[u8], qh: Option<&[u8]>, qs: &[u8], a: &BlockQ8K) -> BlockSums {
    let fifth = |l: usize, sub: usize| qh.map_or(0, |h| ((h[l] >> sub) & 1) << 4);
    let mut s = 0i32;
    for c in 0..4 {
        let (sc0, _) = scale_min_k4(2 * c, scales);
        let (sc1, _) = scale_min_k4(2 * c + 1, scales);
        let (mut s0, mut s1) = (0i32, 0i32);
        for l in 0..32 {
            let q = qs[32 * c + l];
            s0 += i32::from((q & 0x0f) | fifth(l, 2 * c)) * i32::from(a.qs[64 * c + l]);
            s1 += i32::from((q >> 4) | fifth(l, 2 * c + 1)) * i32::from(a.qs[64 * c + 32 + l]);
        }
        s += i32::from(sc0) * s0 + i32::from(sc1) * s1;
    }
    BlockSums {
        s,
        m: mins_term(scales, a),
    }
}

fn q6_k_sums(b: &[u8], a: &BlockQ8K) -> BlockSums {
    let (ql, qh, sc) = (&b[0..128], &b[128..192], &b[192..208]);
    let mut s = 0i32;
    for half in 0..2 {
        for k in 0..4 {
            for g in 0..2 {
                let mut sum = 0i32;
                for l in 16 * g..16 * g + 16 {
                    let byte = ql[64 * half + l + 32 * (k & 1)];
                    let lo = if k < 2 { byte & 0x0f } else { byte >> 4 };
                    let hi = (qh[32 * half + l] >> (2 * k)) & 3;
                    let q = i32::from(lo | (hi << 4)) - 32;
                    sum += q * i32::from(a.qs[128 * half + 32 * k + l]);
                }
                s += i32::from(sc[8 * half + 2 * k + g] as i8) * sum;
            }
        }
    }
    BlockSums { s, m: 0 }
}

fn q2_k_sums(b: &[u8], a: &BlockQ8K) -> BlockSums {
    let (sc, qs) = (&b[0..16], &b[16..80]);
    let (mut s, mut m) = (0i32, 0i32);
    for g in 0..16 {
        let sum: i32 = (16 * g..16 * g + 16)
            .map(|e| i32::from(q2_at(qs, e)) * i32::from(a.qs[e]))
            .sum();
        s += i32::from(sc[g] & 0x0f) * sum;
        m += i32::from(sc[g] >> 4) * i32::from(a.bsums[g]);
    }
    BlockSums { s, m }
}

fn q3_k_sums(b: &[u8], a: &BlockQ8K) -> BlockSums {
    let (hmask, qs) = (&b[0..32], &b[32..96]);
    let scales = scales_q3_k(&b[96..108]);
    let mut s = 0i32;
    for (g, &sc) in scales.iter().enumerate() {
        let sum: i32 = (16 * g..16 * g + 16)
            .map(|e| {
                let q = i32::from(q2_at(qs, e)) - if q3_high_at(hmask, e) { 0 } else { 4 };
                q * i32::from(a.qs[e])
            })
            .sum();
        s += (i32::from(sc) - 32) * sum;
    }
    BlockSums { s, m: 0 }
}

/// A block's `(d_w, dmin_w)` and integer sums (the module's spec), for a K-quant `dtype`.
#[inline(always)]
fn block_terms(dtype: DType, b: &[u8], x: &BlockQ8K) -> (f32, f32, BlockSums) {
    match dtype {
        DType::Q2_K => (f16_at(b, 80), f16_at(b, 82), q2_k_sums(b, x)),
        DType::Q3_K => (f16_at(b, 108), 0.0, q3_k_sums(b, x)),
        DType::Q4_K => (
            f16_at(b, 0),
            f16_at(b, 2),
            qk45_sums(&b[4..16], None, &b[16..], x),
        ),
        DType::Q5_K => {
            let sums = qk45_sums(&b[4..16], Some(&b[16..48]), &b[48..], x);
            (f16_at(b, 0), f16_at(b, 2), sums)
        }
        DType::Q6_K => (f16_at(b, 208), 0.0, q6_k_sums(b, x)),
        _ => unreachable!("{dtype:?} does not use Q8_K activations"),
    }
}

/// Scalar reference: a row of K-quant `dtype` weights · its Q8_K activations (the spec).
pub fn dot_scalar(dtype: DType, w: &[u8], a: &[BlockQ8K]) -> f32 {
    let bb = dtype.block_bytes();
    debug_assert_eq!(w.len(), a.len() * bb);
    accumulate(w.chunks_exact(bb).zip(a).map(|(b, x)| {
        let (d, dmin, sums) = block_terms(dtype, b, x);
        (d, dmin, sums, x.d)
    }))
}

/// The scalar reference of `dtype` (a K-quant), as a function pointer.
pub fn scalar_dot(dtype: DType) -> fn(&[u8], &[BlockQ8K]) -> f32 {
    match dtype {
        DType::Q2_K => |w, a| dot_scalar(DType::Q2_K, w, a),
        DType::Q3_K => |w, a| dot_scalar(DType::Q3_K, w, a),
        DType::Q4_K => |w, a| dot_scalar(DType::Q4_K, w, a),
        DType::Q5_K => |w, a| dot_scalar(DType::Q5_K, w, a),
        DType::Q6_K => |w, a| dot_scalar(DType::Q6_K, w, a),
        _ => unreachable!("{dtype:?} does not use Q8_K activations"),
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    use crate::test_util::rand_f32 as rand;

    fn bytes(n: usize, seed: &mut u64) -> Vec<u8> {
        rand(n, seed)
            .iter()
            .map(|v| ((v + 1.0) * 127.9) as u8)
            .collect()
    }

    /// Random K-quant blocks with small finite scales.
    pub(crate) fn weights(dtype: DType, blocks: usize, seed: &mut u64) -> Vec<u8> {
        let mut w = Vec::new();
        let half = |v: f32| half::f16::from_f32(v).to_le_bytes();
        for _ in 0..blocks {
            let r = rand(2, seed);
            let bb = dtype.block_bytes();
            match dtype {
                // f16 `d` last.
                DType::Q6_K | DType::Q3_K => {
                    w.extend(bytes(bb - 2, seed));
                    w.extend(half(r[0] * 0.01));
                }
                // f16 `d`, `dmin` last.
                DType::Q2_K => {
                    w.extend(bytes(bb - 4, seed));
                    w.extend(half(r[0] * 0.01));
                    w.extend(half(r[1] * 0.02));
                }
                _ => {
                    w.extend(half(r[0] * 0.01));
                    w.extend(half(r[1] * 0.02));
                    w.extend(bytes(dtype.block_bytes() - 4, seed));
                }
            }
        }
        w
    }

    #[test]
    fn nearest_int_rounds_ties_to_even_as_round_ties_even() {
        for i in -2600..=2600 {
            let v = i as f32 * 0.05;
            assert_eq!(nearest_int(v), v.round_ties_even() as i32, "{v}");
        }
        for v in [0.5f32, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5, -127.5, 127.49999] {
            assert_eq!(nearest_int(v), v.round_ties_even() as i32, "{v}");
        }
    }

    #[test]
    fn q8_k_follows_ggml_sign_rounding_and_sums() {
        let mut x = vec![0.0f32; 512];
        x[3] = 127.0 / 64.0; // largest magnitude, positive: iscale = -64 exactly, d < 0
        x[4] = -1.0; // 64
        x[5] = 0.5 / 64.0; // iscale·x = -0.5: ties to even, 0
        x[6] = 1.5 / 64.0; // -1.5: ties to even, -2
        x[7] = -2.5 / 64.0; // 2.5: ties to even, 2
        let mut q = vec![BlockQ8K::default(); 2];
        quantize_row_q8_k(&x, &mut q);
        assert_eq!(q[0].d, -1.0 / 64.0);
        assert_eq!(&q[0].qs[3..8], &[-127, 64, 0, -2, 2]);
        assert_eq!(q[0].bsums[0], -127 + 64 - 2 + 2);
        assert_eq!(q[1], BlockQ8K::default(), "an all-zero block");
    }

    /// Each dot product equals the f64 dot of the dequantized weights with the dequantized
    /// activations, to float rounding: the integer sums and the layouts are right.
    #[test]
    fn kquant_dots_equal_the_dequantized_dot_product() {
        let mut seed = 7u64;
        for dtype in [
            DType::Q4_K,
            DType::Q5_K,
            DType::Q6_K,
            DType::Q2_K,
            DType::Q3_K,
        ] {
            let n = 3 * QK_K;
            let w = weights(dtype, 3, &mut seed);
            let x = rand(n, &mut seed);
            let mut a = vec![BlockQ8K::default(); 3];
            quantize_row_q8_k(&x, &mut a);
            let mut wf = vec![0.0f32; n];
            crate::quant::dequantize_row(dtype, &w, &mut wf);
            let (mut exact, mut scale) = (0.0f64, 0.0f64);
            for (i, &wv) in wf.iter().enumerate() {
                let av = f64::from(a[i / QK_K].d) * f64::from(a[i / QK_K].qs[i % QK_K]);
                exact += f64::from(wv) * av;
                scale += (f64::from(wv) * av).abs();
            }
            let got = scalar_dot(dtype)(&w, &a);
            assert!(
                (f64::from(got) - exact).abs() <= scale * 1e-5 + 1e-6,
                "{dtype:?}: {got} vs {exact}"
            );
        }
    }
}

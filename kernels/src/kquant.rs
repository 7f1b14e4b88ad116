//! The GGUF block formats beyond the original five — Q5_0, Q5_1, the K-quants Q4_K, Q5_K,
//! Q6_K (the `_K_M` / `_K_S` mixes people download), and BF16 — as ggml lays them out, with
//! their scalar dequantization.
//!
//! # Spec (ggml's `block_*` structs, little-endian; `QK_K` = 256)
//! - Q5_0 (22 bytes / 32): f16 `d`, u32 `qh`, 16 bytes `qs`. Element `j < 16` is
//!   `(qs[j] & 15) | ((qh >> j) & 1) << 4`, element `j + 16` is `(qs[j] >> 4) | ((qh >> (j+12))
//!   & 16)`; value = `(q − 16) · d`.
//! - Q5_1 (24 bytes / 32): f16 `d`, f16 `m`, then as Q5_0; value = `q · d + m`.
//! - Q4_K (144 bytes / 256): f16 `d`, f16 `dmin`, 12 bytes packing eight 6-bit (scale, min)
//!   pairs ([`scale_min_k4`]), 128 bytes of nibbles: sub-blocks `2i` and `2i+1` are the low and
//!   high nibbles of bytes `32i .. 32i+32`; value = `(d·sc) · q − dmin·m`.
//! - Q5_K (176 bytes / 256): as Q4_K with 32 bytes `qh` after the scales: bit `2i` of `qh[l]` is
//!   the fifth bit of sub-block `2i`'s element `l`, bit `2i+1` of sub-block `2i+1`'s.
//! - Q6_K (210 bytes / 256): 128 bytes `ql`, 64 bytes `qh`, 16 × i8 scales, f16 `d`; each half
//!   (128 elements) takes 64 bytes of `ql` and 32 of `qh` — element `l + 32k` (k = 0..4) is the
//!   low or high nibble of `ql[l]` / `ql[l + 32]` with bits `2k..2k+2` of `qh[l]` on top, minus
//!   32, scaled by `d · scales[l / 16 + 2k]`.
//! - BF16 (2 bytes): the upper 16 bits of an f32.
//! - Q2_K (84 bytes / 256): 16 bytes of (4-bit scale | 4-bit min << 4), one per 16-element
//!   group, 64 bytes `qs` of 2-bit quants, f16 `d`, f16 `dmin`. Element `e = 128n + 32j + 16k +
//!   l` (group `g = e / 16`) is `(qs[32n + 16k + l] >> 2j) & 3`; value = `(d·sc_g) · q −
//!   dmin·m_g`.
//! - Q3_K (110 bytes / 256): 32 bytes `hmask`, 64 bytes `qs`, 12 bytes packing sixteen 6-bit
//!   scales ([`scales_q3_k`]), f16 `d`. Element `e` as Q2_K's, minus 4 where bit `4n + j` of
//!   `hmask[16k + l]` is clear; value = `(d·(sc_g − 32)) · q`.
//!
//! Float operations are the ones written above, each rounded once, in that order (no fused
//! multiply-add) — what the PyPI `gguf` package's reference dequantizers compute, which the
//! tests compare against bit for bit (`tests/fixtures/kquant/`).
//!
//! Q5_0 and Q5_1 multiply int8 activations (Q8_0 / Q8_1 blocks, as llama.cpp does): scalar
//! references here, AVX2 kernels in `x86.rs` with llama.cpp's accumulation order. The K-quants
//! multiply Q8_K activations (`crate::q8k`), BF16 bf16 activations (`crate::bf16`).

use half::f16;

use crate::quant::{BlockQ8, DType, QK, QK_K};

#[inline]
fn f16_at(b: &[u8], off: usize) -> f32 {
    f16::from_le_bytes([b[off], b[off + 1]]).to_f32()
}

/// The `j`-th (scale, min) pair of a Q4_K/Q5_K block's 12 scale bytes (ggml's
/// `get_scale_min_k4`): pairs 0–3 are the low 6 bits of bytes `j` and `j + 4`; pairs 4–7 take
/// their low 4 bits from byte `j + 4` and their high 2 bits from the top of bytes `j − 4` and `j`.
#[inline]
pub fn scale_min_k4(j: usize, s: &[u8]) -> (u8, u8) {
    if j < 4 {
        (s[j] & 63, s[j + 4] & 63)
    } else {
        (
            (s[j + 4] & 0x0f) | ((s[j - 4] >> 6) << 4),
            (s[j + 4] >> 4) | ((s[j] >> 6) << 4),
        )
    }
}

/// Dequantize `src` (whole blocks of `dtype`, one of this module's types) into `out`.
pub(crate) fn dequantize_row(dtype: DType, src: &[u8], out: &mut [f32]) {
    match dtype {
        DType::Q5_0 => q5(src, out, false),
        DType::Q5_1 => q5(src, out, true),
        DType::Q4_K => q4_k(src, out),
        DType::Q5_K => q5_k(src, out),
        DType::Q6_K => q6_k(src, out),
        DType::Q2_K => q2_k(src, out),
        DType::Q3_K => q3_k(src, out),
        DType::BF16 => {
            for (o, b) in out.iter_mut().zip(src.chunks_exact(2)) {
                *o = f32::from_bits(u32::from(u16::from_le_bytes([b[0], b[1]])) << 16);
            }
        }
        DType::F32 | DType::F16 | DType::Q4_0 | DType::Q4_1 | DType::Q8_0 => {
            unreachable!("{dtype:?} is dequantized in quant.rs")
        }
    }
}

fn q5(src: &[u8], out: &mut [f32], with_min: bool) {
    let bb = if with_min { 24 } else { 22 };
    for (o, b) in out.chunks_exact_mut(QK).zip(src.chunks_exact(bb)) {
        let d = f16_at(b, 0);
        let m = if with_min { f16_at(b, 2) } else { 0.0 };
        let h = if with_min { 4 } else { 2 };
        let qh = u32::from_le_bytes([b[h], b[h + 1], b[h + 2], b[h + 3]]);
        let qs = &b[h + 4..h + 20];
        for j in 0..16 {
            let hi0 = (((qh >> j) << 4) & 0x10) as u8;
            let hi1 = ((qh >> (j + 12)) & 0x10) as u8;
            let (x0, x1) = ((qs[j] & 0x0f) | hi0, (qs[j] >> 4) | hi1);
            if with_min {
                o[j] = f32::from(x0) * d + m;
                o[j + 16] = f32::from(x1) * d + m;
            } else {
                o[j] = f32::from(i16::from(x0) - 16) * d;
                o[j + 16] = f32::from(i16::from(x1) - 16) * d;
            }
        }
    }
}

/// The 32 five-bit values of a Q5_0/Q5_1 block (`b`: the block; `h`: offset of `qh`), 0..=31.
#[inline]
fn q5_values(b: &[u8], h: usize) -> [u8; QK] {
    let qh = u32::from_le_bytes([b[h], b[h + 1], b[h + 2], b[h + 3]]);
    let qs = &b[h + 4..h + 20];
    std::array::from_fn(|e| {
        let nib = if e < 16 {
            qs[e] & 0x0f
        } else {
            qs[e - 16] >> 4
        };
        nib | ((((qh >> e) & 1) as u8) << 4)
    })
}

/// Scalar reference: Q5_0 weights · Q8_0 activations (exact integer block sums, then
/// `d_w · d_x · Σ` added block by block).
pub fn dot_q5_0_q8_scalar(w: &[u8], a: &[BlockQ8]) -> f32 {
    debug_assert_eq!(w.len(), a.len() * 22);
    let mut sum = 0.0f32;
    for (b, x) in w.chunks_exact(22).zip(a) {
        let q = q5_values(b, 2);
        let isum: i32 = (0..QK)
            .map(|e| (i32::from(q[e]) - 16) * i32::from(x.qs[e]))
            .sum();
        sum += f16_at(b, 0) * x.d * isum as f32;
    }
    sum
}

/// Scalar reference: Q5_1 weights · Q8_1 activations (`m · s` for the block's offset).
pub fn dot_q5_1_q8_scalar(w: &[u8], a: &[BlockQ8]) -> f32 {
    debug_assert_eq!(w.len(), a.len() * 24);
    let mut sum = 0.0f32;
    for (b, x) in w.chunks_exact(24).zip(a) {
        let q = q5_values(b, 4);
        let isum: i32 = (0..QK).map(|e| i32::from(q[e]) * i32::from(x.qs[e])).sum();
        sum += f16_at(b, 0) * x.d * isum as f32 + f16_at(b, 2) * x.s;
    }
    sum
}

fn q4_k(src: &[u8], out: &mut [f32]) {
    for (o, b) in out.chunks_exact_mut(QK_K).zip(src.chunks_exact(144)) {
        let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
        let (scales, qs) = (&b[4..16], &b[16..144]);
        for i in 0..4 {
            let [(d0, dm0), (d1, dm1)] = [2 * i, 2 * i + 1].map(|j| {
                let (sc, m) = scale_min_k4(j, scales);
                (d * f32::from(sc), dmin * f32::from(m))
            });
            let q = &qs[32 * i..32 * i + 32];
            for l in 0..32 {
                o[64 * i + l] = d0 * f32::from(q[l] & 0x0f) - dm0;
                o[64 * i + 32 + l] = d1 * f32::from(q[l] >> 4) - dm1;
            }
        }
    }
}

fn q5_k(src: &[u8], out: &mut [f32]) {
    for (o, b) in out.chunks_exact_mut(QK_K).zip(src.chunks_exact(176)) {
        let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
        let (scales, qh, qs) = (&b[4..16], &b[16..48], &b[48..176]);
        for i in 0..4 {
            let [(d0, dm0), (d1, dm1)] = [2 * i, 2 * i + 1].map(|j| {
                let (sc, m) = scale_min_k4(j, scales);
                (d * f32::from(sc), dmin * f32::from(m))
            });
            let q = &qs[32 * i..32 * i + 32];
            let (u0, u1) = (1u8 << (2 * i), 2u8 << (2 * i));
            for l in 0..32 {
                let h0 = if qh[l] & u0 != 0 { 16 } else { 0 };
                let h1 = if qh[l] & u1 != 0 { 16 } else { 0 };
                o[64 * i + l] = d0 * f32::from((q[l] & 0x0f) + h0) - dm0;
                o[64 * i + 32 + l] = d1 * f32::from((q[l] >> 4) + h1) - dm1;
            }
        }
    }
}

/// A Q3_K block's sixteen 6-bit scales (before the −32 offset), unpacked from its 12 bytes as
/// ggml's `kmask` shuffle does: scale `j` takes its low 4 bits from the low (j < 8) or high
/// nibble of byte `j % 8`, its high 2 bits from bits `2·(j / 4)` of byte `8 + j % 4`.
#[inline]
pub fn scales_q3_k(b: &[u8]) -> [u8; 16] {
    std::array::from_fn(|j| {
        let lo = if j < 8 {
            b[j % 8] & 0x0f
        } else {
            b[j % 8] >> 4
        };
        let hi = (b[8 + j % 4] >> (2 * (j / 4))) & 3;
        lo | (hi << 4)
    })
}

/// The 2-bit quant of element `e` of a Q2_K/Q3_K block (`qs`: its 64 quant bytes).
#[inline]
pub(crate) fn q2_at(qs: &[u8], e: usize) -> u8 {
    let (n, j, k, l) = (e / 128, (e / 32) % 4, (e / 16) % 2, e % 16);
    (qs[32 * n + 16 * k + l] >> (2 * j)) & 3
}

/// Whether the high bit of element `e` of a Q3_K block is set (`hmask`: its 32 bytes).
#[inline]
pub(crate) fn q3_high_at(hmask: &[u8], e: usize) -> bool {
    let (n, j, k, l) = (e / 128, (e / 32) % 4, (e / 16) % 2, e % 16);
    hmask[16 * k + l] & (1 << (4 * n + j)) != 0
}

fn q2_k(src: &[u8], out: &mut [f32]) {
    for (o, b) in out.chunks_exact_mut(QK_K).zip(src.chunks_exact(84)) {
        let (sc, qs) = (&b[0..16], &b[16..80]);
        let (d, dmin) = (f16_at(b, 80), f16_at(b, 82));
        for (e, v) in o.iter_mut().enumerate() {
            let g = sc[e / 16];
            let (dl, ml) = (d * f32::from(g & 0x0f), dmin * f32::from(g >> 4));
            *v = dl * f32::from(q2_at(qs, e)) - ml;
        }
    }
}

fn q3_k(src: &[u8], out: &mut [f32]) {
    for (o, b) in out.chunks_exact_mut(QK_K).zip(src.chunks_exact(110)) {
        let (hmask, qs) = (&b[0..32], &b[32..96]);
        let scales = scales_q3_k(&b[96..108]);
        let d = f16_at(b, 108);
        for (e, v) in o.iter_mut().enumerate() {
            let dl = d * f32::from(i16::from(scales[e / 16]) - 32);
            let q = i16::from(q2_at(qs, e)) - if q3_high_at(hmask, e) { 0 } else { 4 };
            *v = dl * f32::from(q);
        }
    }
}

fn q6_k(src: &[u8], out: &mut [f32]) {
    for (o, b) in out.chunks_exact_mut(QK_K).zip(src.chunks_exact(210)) {
        let (ql, qh, sc) = (&b[0..128], &b[128..192], &b[192..208]);
        let d = f16_at(b, 208);
        for half in 0..2 {
            let (ql, qh) = (
                &ql[64 * half..64 * half + 64],
                &qh[32 * half..32 * half + 32],
            );
            let sc = &sc[8 * half..8 * half + 8];
            let o = &mut o[128 * half..128 * half + 128];
            for l in 0..32 {
                let is = l / 16;
                let q = [
                    (ql[l] & 0x0f) | ((qh[l] & 3) << 4),
                    (ql[l + 32] & 0x0f) | (((qh[l] >> 2) & 3) << 4),
                    (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4),
                    (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4),
                ];
                for (k, &qk) in q.iter().enumerate() {
                    let s = f32::from(sc[is + 2 * k] as i8);
                    o[l + 32 * k] = d * s * f32::from(i16::from(qk) - 32);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;

    fn fixture(name: &str) -> Vec<u8> {
        let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../tests/fixtures/kquant")
            .join(name);
        std::fs::read(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
    }

    /// Every element of random blocks of every new type dequantizes to the bits the PyPI `gguf`
    /// package's reference dequantizers give (`scripts/gen-kquant-fixture.py`).
    #[test]
    fn dequantization_gives_the_gguf_packages_bits() {
        for (dtype, name) in [
            (DType::Q5_0, "Q5_0"),
            (DType::Q5_1, "Q5_1"),
            (DType::Q4_K, "Q4_K"),
            (DType::Q5_K, "Q5_K"),
            (DType::Q6_K, "Q6_K"),
            (DType::BF16, "BF16"),
            (DType::Q2_K, "Q2_K"),
            (DType::Q3_K, "Q3_K"),
        ] {
            let blocks = fixture(&format!("{name}.blocks"));
            let want: Vec<f32> = fixture(&format!("{name}.f32"))
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect();
            assert_eq!(
                blocks.len() / dtype.block_bytes() * dtype.block_elems(),
                want.len(),
                "{name}: fixture sizes"
            );
            let mut got = vec![f32::NAN; want.len()];
            crate::quant::dequantize_row(dtype, &blocks, &mut got);
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                assert_eq!(g.to_bits(), w.to_bits(), "{name} element {i}: {g} vs {w}");
            }
        }
    }

    /// The Q5 dot products: the SIMD kernel (what `matmul` runs) against the scalar reference,
    /// and both against the f32 dot of the dequantized row with the dequantized activations.
    #[test]
    fn q5_dots_agree_with_their_reference_and_with_dequantized_values() {
        for (dtype, name) in [(DType::Q5_0, "Q5_0"), (DType::Q5_1, "Q5_1")] {
            let w = fixture(&format!("{name}.blocks"));
            let n = w.len() / dtype.block_bytes() * QK;
            let x: Vec<f32> = (0..n)
                .map(|i| ((i * 37 % 101) as f32 - 50.0) / 23.0)
                .collect();
            let mut a = vec![BlockQ8::default(); n / QK];
            crate::quant::quantize_row_q8(&x, &mut a);
            let scalar = match dtype {
                DType::Q5_0 => dot_q5_0_q8_scalar(&w, &a),
                _ => dot_q5_1_q8_scalar(&w, &a),
            };
            let simd = crate::matmul::one_row_kernel(dtype)(&w, &a);
            let mut wf = vec![0.0f32; n];
            dequantize_row(dtype, &w, &mut wf);
            let xq: Vec<f32> = a
                .iter()
                .flat_map(|b| b.qs.iter().map(move |&q| f32::from(q) * b.d))
                .collect();
            let mut exact = 0.0f64;
            let mut scale = 0.0f64;
            for (p, q) in wf.iter().zip(&xq) {
                exact += f64::from(*p) * f64::from(*q);
                scale += f64::from((p * q).abs());
            }
            // The Q8_1 `s` is rounded through f16 (as ggml's is): Q5_1's offset term carries that.
            let tol = scale * 2e-3 + 1e-6;
            assert!(
                (f64::from(scalar) - exact).abs() <= tol,
                "{name}: {scalar} vs {exact}"
            );
            assert!(
                (f64::from(simd) - f64::from(scalar)).abs() <= scale * 1e-5 + 1e-6,
                "{name}: simd {simd} vs scalar {scalar}"
            );
        }
    }

    #[test]
    fn scale_min_pairs_follow_ggml_packing() {
        // Pair 5: low 4 bits from byte 9, high 2 bits from the top of bytes 1 (scale) and 5 (min).
        let mut s = [0u8; 12];
        s[9] = 0xA7;
        s[1] = 0b1100_0000;
        s[5] = 0b0100_0000;
        assert_eq!(scale_min_k4(5, &s), (0x07 | (3 << 4), 0x0A | (1 << 4)));
        s[2] = 0xFF;
        s[6] = 0x41;
        assert_eq!(scale_min_k4(2, &s), (63, 1));
    }

    #[test]
    fn type_numbers_round_trip_and_unknown_ones_are_refused() {
        for d in [
            DType::F32,
            DType::F16,
            DType::BF16,
            DType::Q4_0,
            DType::Q4_1,
            DType::Q5_0,
            DType::Q5_1,
            DType::Q8_0,
            DType::Q4_K,
            DType::Q5_K,
            DType::Q6_K,
            DType::Q2_K,
            DType::Q3_K,
        ] {
            assert_eq!(DType::from_ggml_type(d.ggml_type()), Some(d));
        }
        for unsupported in [9, 15, 16, 17, 23, 29, 39, 1000] {
            assert_eq!(
                DType::from_ggml_type(unsupported),
                None,
                "type {unsupported}"
            );
        }
    }
}

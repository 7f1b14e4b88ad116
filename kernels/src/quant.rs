//! Quantized block formats (the GGUF/ggml layouts) and their scalar reference dot products.
//!
//! Weight blocks are read straight from the (memory-mapped) file bytes, little-endian:
//! - `Q4_0`: f16 `d`, 16 bytes of nibbles; value = (q - 8) · d.
//! - `Q4_1`: f16 `d`, f16 `m`, 16 bytes of nibbles; value = q · d + m.
//! - `Q8_0`: f16 `d`, 32 × i8; value = q · d.
//!
//! In each nibble block byte `j` holds element `j` (low nibble) and element `j + 16` (high nibble).
//!
//! Activations are quantized to [`BlockQ8`] before a quantized dot product, as llama.cpp does
//! (Q8_1 for Q4_1 weights, Q8_0 otherwise — the two differ only in the extra sum `s`, so one block
//! type carries both). `d` and `s` are rounded through f16 exactly like the ggml block fields, so
//! the arithmetic matches llama.cpp's.

use half::f16;

/// Elements per quantization block.
pub const QK: usize = 32;

/// Elements per K-quant super-block (ggml's `QK_K`).
pub const QK_K: usize = 256;

/// Storage type of a weight tensor. Variants carry ggml's names (`Q4_K`, not `Q4K`): they are
/// what users see in file names and llama.cpp's output.
#[allow(non_camel_case_types)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    F32,
    F16,
    Q4_0,
    Q4_1,
    Q8_0,
    /// f16 `d`, 32 high bits, 16 bytes of nibbles; value = (q5 − 16) · d.
    Q5_0,
    /// f16 `d`, f16 `m`, 32 high bits, 16 bytes of nibbles; value = q5 · d + m.
    Q5_1,
    /// 256-element super-block: f16 `d`, f16 `dmin`, 12 bytes of 6-bit scales and mins for eight
    /// 32-element sub-blocks, 128 bytes of nibbles; value = d·sc · q − dmin·m.
    Q4_K,
    /// As `Q4_K` plus 32 bytes of fifth bits.
    Q5_K,
    /// 256-element super-block: 128 bytes of low nibbles, 64 bytes of high 2-bit pairs, sixteen
    /// i8 scales, f16 `d`; value = d · sc · (q6 − 32).
    Q6_K,
    /// bfloat16: the upper half of an f32.
    BF16,
    /// 256-element super-block: sixteen bytes each a 4-bit scale (low) and 4-bit min (high)
    /// for a 16-element group, 64 bytes of 2-bit quants, f16 `d`, f16 `dmin`; value =
    /// d·sc · q − dmin·m.
    Q2_K,
    /// 256-element super-block: 32 bytes of high bits, 64 bytes of 2-bit quants, 12 bytes of
    /// sixteen 6-bit scales, f16 `d`; value = d · (sc − 32) · (q2 − 4·(1 − hbit)).
    Q3_K,
}

impl DType {
    /// Elements per block (1 for the float types).
    pub const fn block_elems(self) -> usize {
        match self {
            DType::F32 | DType::F16 | DType::BF16 => 1,
            DType::Q4_0 | DType::Q4_1 | DType::Q8_0 | DType::Q5_0 | DType::Q5_1 => QK,
            DType::Q4_K | DType::Q5_K | DType::Q6_K | DType::Q2_K | DType::Q3_K => QK_K,
        }
    }

    /// Bytes per block.
    pub const fn block_bytes(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F16 => 2,
            DType::Q4_0 => 18,
            DType::Q4_1 => 20,
            DType::Q8_0 => 34,
            DType::Q5_0 => 22,
            DType::Q5_1 => 24,
            DType::Q4_K => 144,
            DType::Q5_K => 176,
            DType::Q6_K => 210,
            DType::BF16 => 2,
            DType::Q2_K => 84,
            DType::Q3_K => 110,
        }
    }

    /// ggml's `ggml_type` number for this type (what a GGUF tensor header carries).
    pub const fn ggml_type(self) -> u32 {
        match self {
            DType::F32 => 0,
            DType::F16 => 1,
            DType::Q4_0 => 2,
            DType::Q4_1 => 3,
            DType::Q5_0 => 6,
            DType::Q5_1 => 7,
            DType::Q8_0 => 8,
            DType::Q4_K => 12,
            DType::Q5_K => 13,
            DType::Q6_K => 14,
            DType::BF16 => 30,
            DType::Q2_K => 10,
            DType::Q3_K => 11,
        }
    }

    /// The type with ggml number `ty`, if the engine reads it.
    pub const fn from_ggml_type(ty: u32) -> Option<Self> {
        Some(match ty {
            0 => DType::F32,
            1 => DType::F16,
            2 => DType::Q4_0,
            3 => DType::Q4_1,
            6 => DType::Q5_0,
            7 => DType::Q5_1,
            8 => DType::Q8_0,
            12 => DType::Q4_K,
            13 => DType::Q5_K,
            14 => DType::Q6_K,
            30 => DType::BF16,
            10 => DType::Q2_K,
            11 => DType::Q3_K,
            _ => return None,
        })
    }

    /// Bytes for `elems` elements, or `None` when `elems` is not a whole number of blocks or
    /// the size overflows.
    pub fn bytes_for(self, elems: u64) -> Option<u64> {
        let be = self.block_elems() as u64;
        if !elems.is_multiple_of(be) {
            return None;
        }
        (elems / be).checked_mul(self.block_bytes() as u64)
    }

    /// What a dot product with this weight type multiplies: the activations' format (ggml's
    /// `vec_dot_type`, except F16 weights, which take f32 activations here).
    pub const fn activations(self) -> Activations {
        match self {
            DType::Q4_0 | DType::Q4_1 | DType::Q8_0 | DType::Q5_0 | DType::Q5_1 => Activations::Q8,
            DType::Q4_K | DType::Q5_K | DType::Q6_K | DType::Q2_K | DType::Q3_K => Activations::Q8K,
            DType::BF16 => Activations::Bf16,
            DType::F32 | DType::F16 => Activations::F32,
        }
    }

    /// Whether a dot product with this weight type runs on int8 activations in 32-blocks.
    pub const fn uses_q8_activations(self) -> bool {
        matches!(self.activations(), Activations::Q8)
    }
}

/// The format a weight type's dot products read their activations in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Activations {
    /// f32, as they are.
    F32,
    /// int8 in blocks of 32 with an f16-rounded scale (and sum): [`BlockQ8`].
    Q8,
    /// int8 in blocks of 256 with an f32 scale and 16-element sums: `crate::q8k::BlockQ8K`.
    Q8K,
    /// bf16, rounded to nearest even (`crate::bf16`).
    Bf16,
}

/// One block of 32 activations quantized to int8 (ggml's `block_q8_0`/`block_q8_1`).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
#[repr(C)]
pub struct BlockQ8 {
    /// Scale, rounded through f16.
    pub d: f32,
    /// `d · Σ qs`, rounded through f16 (the Q8_1 sum, used by Q4_1 dots).
    pub s: f32,
    pub qs: [i8; QK],
}

#[inline]
pub(crate) fn f16_at(b: &[u8], off: usize) -> f32 {
    f16::from_le_bytes([b[off], b[off + 1]]).to_f32()
}

#[inline]
fn round_f16(x: f32) -> f32 {
    f16::from_f32(x).to_f32()
}

/// Quantize `x` (a multiple of 32 long) into `out` (`x.len() / 32` blocks).
pub fn quantize_row_q8(x: &[f32], out: &mut [BlockQ8]) {
    assert_eq!(x.len(), out.len() * QK, "quantize_row_q8: length mismatch");
    for (chunk, blk) in x.chunks_exact(QK).zip(out.iter_mut()) {
        let amax = chunk.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
        let mut sum = 0i32;
        for (q, &v) in blk.qs.iter_mut().zip(chunk) {
            // Round half to even, as ggml's AVX2 quantizer (`_mm256_round_ps` nearest) does.
            let r = (v * id).round_ties_even() as i8;
            *q = r;
            sum += i32::from(r);
        }
        blk.d = round_f16(d);
        blk.s = round_f16(sum as f32 * d);
    }
}

/// Dequantize one row of `dtype` from `src` bytes into `out`.
pub fn dequantize_row(dtype: DType, src: &[u8], out: &mut [f32]) {
    let n = out.len();
    assert_eq!(
        Some(src.len() as u64),
        dtype.bytes_for(n as u64),
        "dequantize_row: byte length does not match {n} elements of {dtype:?}"
    );
    match dtype {
        DType::F32 => {
            for (o, b) in out.iter_mut().zip(src.chunks_exact(4)) {
                *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        }
        DType::F16 => {
            for (o, b) in out.iter_mut().zip(src.chunks_exact(2)) {
                *o = f16::from_le_bytes([b[0], b[1]]).to_f32();
            }
        }
        DType::Q4_0 => {
            for (o, b) in out.chunks_exact_mut(QK).zip(src.chunks_exact(18)) {
                let d = f16_at(b, 0);
                for j in 0..16 {
                    o[j] = (f32::from(b[2 + j] & 0x0f) - 8.0) * d;
                    o[j + 16] = (f32::from(b[2 + j] >> 4) - 8.0) * d;
                }
            }
        }
        DType::Q4_1 => {
            for (o, b) in out.chunks_exact_mut(QK).zip(src.chunks_exact(20)) {
                let (d, m) = (f16_at(b, 0), f16_at(b, 2));
                for j in 0..16 {
                    o[j] = f32::from(b[4 + j] & 0x0f) * d + m;
                    o[j + 16] = f32::from(b[4 + j] >> 4) * d + m;
                }
            }
        }
        DType::Q8_0 => {
            for (o, b) in out.chunks_exact_mut(QK).zip(src.chunks_exact(34)) {
                let d = f16_at(b, 0);
                for j in 0..QK {
                    o[j] = f32::from(b[2 + j] as i8) * d;
                }
            }
        }
        DType::Q5_0
        | DType::Q5_1
        | DType::Q4_K
        | DType::Q5_K
        | DType::Q6_K
        | DType::BF16
        | DType::Q2_K
        | DType::Q3_K => crate::kquant::dequantize_row(dtype, src, out),
    }
}

/// Scalar reference: Q4_0 weights · Q8_0 activations, in the arithmetic llama.cpp runs for
/// Q4_0 on x86 (its rows repacked eight at a time, `ggml_gemv_q4_0_8x8_q8_0` /
/// `ggml_gemm_q4_0_8x8_q8_0`): each block's exact integer sum, then one f32 accumulator per
/// output, `acc = fma(isum, d_w · d_x, acc)` block after block from 0. Every Q4_0 kernel here
/// (one-row, packed, any token count) computes exactly this, so it is their bit-exact oracle.
pub fn dot_q4_0_q8_scalar(w: &[u8], a: &[BlockQ8]) -> f32 {
    debug_assert_eq!(w.len(), a.len() * 18);
    let mut acc = 0.0f32;
    for (b, x) in w.chunks_exact(18).zip(a) {
        let mut isum = 0i32;
        for j in 0..16 {
            isum += (i32::from(b[2 + j] & 0x0f) - 8) * i32::from(x.qs[j]);
            isum += (i32::from(b[2 + j] >> 4) - 8) * i32::from(x.qs[j + 16]);
        }
        // |isum| ≤ 32 · 8 · 127 < 2^24: exact in f32.
        acc = (isum as f32).mul_add(f16_at(b, 0) * x.d, acc);
    }
    acc
}

/// Scalar reference: Q4_1 weights · Q8_1 activations.
pub fn dot_q4_1_q8_scalar(w: &[u8], a: &[BlockQ8]) -> f32 {
    debug_assert_eq!(w.len(), a.len() * 20);
    let mut sum = 0.0f32;
    for (b, x) in w.chunks_exact(20).zip(a) {
        let mut isum = 0i32;
        for j in 0..16 {
            isum += i32::from(b[4 + j] & 0x0f) * i32::from(x.qs[j]);
            isum += i32::from(b[4 + j] >> 4) * i32::from(x.qs[j + 16]);
        }
        sum += f16_at(b, 0) * x.d * isum as f32 + f16_at(b, 2) * x.s;
    }
    sum
}

/// Scalar reference: Q8_0 weights · Q8_0 activations.
pub fn dot_q8_0_q8_scalar(w: &[u8], a: &[BlockQ8]) -> f32 {
    debug_assert_eq!(w.len(), a.len() * 34);
    let mut sum = 0.0f32;
    for (b, x) in w.chunks_exact(34).zip(a) {
        let mut isum = 0i32;
        for j in 0..QK {
            isum += i32::from(b[2 + j] as i8) * i32::from(x.qs[j]);
        }
        sum += f16_at(b, 0) * x.d * isum as f32;
    }
    sum
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A deterministic pseudo-random generator for test data (no external crate needed).
    pub(crate) fn lcg(seed: &mut u64) -> f32 {
        *seed = seed
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        ((*seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }

    #[test]
    fn q8_roundtrip_is_close() {
        let mut seed = 7;
        let x: Vec<f32> = (0..256).map(|_| lcg(&mut seed) * 3.0).collect();
        let mut q = vec![BlockQ8::default(); 8];
        quantize_row_q8(&x, &mut q);
        for (blk, chunk) in q.iter().zip(x.chunks_exact(QK)) {
            let sum: i32 = blk.qs.iter().map(|&v| i32::from(v)).sum();
            assert!((blk.s - blk.d * sum as f32).abs() <= 1e-2 * blk.s.abs().max(1.0));
            for (&qv, &xv) in blk.qs.iter().zip(chunk) {
                assert!((f32::from(qv) * blk.d - xv).abs() <= blk.d * 0.51 + 1e-3);
            }
        }
    }

    #[test]
    fn zero_block_quantizes_to_zero() {
        let x = [0.0f32; QK];
        let mut q = [BlockQ8::default(); 1];
        quantize_row_q8(&x, &mut q);
        assert_eq!(q[0].d, 0.0);
        assert!(q[0].qs.iter().all(|&v| v == 0));
    }

    #[test]
    fn bytes_for_rejects_partial_blocks() {
        assert_eq!(DType::Q4_1.bytes_for(64), Some(40));
        assert_eq!(DType::Q4_1.bytes_for(33), None);
        assert_eq!(DType::F32.bytes_for(3), Some(12));
        assert_eq!(DType::Q8_0.bytes_for(!31), None);
    }
}

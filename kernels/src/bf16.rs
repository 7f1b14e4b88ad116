//! BF16 weights on bf16 activations, as ggml computes them (BF16's `vec_dot_type` is BF16).
//!
//! # Spec
//! - Activations are rounded to bf16 as ggml's `GGML_FP32_TO_BF16` does: to nearest, ties to
//!   even; a NaN stays a (quiet) NaN.
//! - A row's dot product is what llama.cpp runs on an AVX512-BF16 build (its
//!   `llamafile_sgemm`, for prompts and single tokens alike, once the activations are bf16):
//!   where the row length is a multiple of 32, tinyBLAS's one accumulator of 16 f32 lanes
//!   takes the elements 32 at a time, each lane adding its pair `(2l, 2l+1)` the way
//!   `vdpbf16ps` does — inputs with a zero exponent read as zero, `acc ← (acc +
//!   x[2l+1]·y[2l+1]) + x[2l]·y[2l]` (products exact, each addition rounded, results below the
//!   normal range flushed to zero) — then the lanes are summed in GCC's
//!   `_mm512_reduce_add_ps` order. Other lengths take `ggml_vec_dot_bf16` (tinyBLAS declines
//!   them): two such accumulators over elements `i..i+32` and `i+32..i+64`, 64 at a time,
//!   each summed as above into an f64 with the leftover elements' f32 products, rounded to
//!   f32.
//! - [`dot_bf16_scalar`] is that arithmetic in portable code; the AVX512-BF16 kernel
//!   (`x86_bf16.rs`) runs the instruction itself over one to four tokens per weight load, and
//!   the two give the same bits (tests), so a row's value never depends on the kernel.
//!
//! For prompts llama.cpp's tinyBLAS multiplies BF16 in its own tile order: its prompt logits
//! and ours differ by rounding there.

/// ggml's `GGML_FP32_TO_BF16`.
#[inline]
pub fn to_bf16(x: f32) -> u16 {
    let u = x.to_bits();
    if (u & 0x7fff_ffff) > 0x7f80_0000 {
        return ((u >> 16) | 64) as u16; // quiet the NaN
    }
    ((u + (0x7fff + ((u >> 16) & 1))) >> 16) as u16
}

/// `x` rounded to bf16, element by element.
pub fn quantize_row_bf16(x: &[f32], out: &mut [u16]) {
    assert_eq!(x.len(), out.len(), "quantize_row_bf16: length mismatch");
    for (o, &v) in out.iter_mut().zip(x) {
        *o = to_bf16(v);
    }
}

/// A bf16 as the f32 it is.
#[inline]
pub(crate) fn widen(b: u16) -> f32 {
    f32::from_bits(u32::from(b) << 16)
}

/// `vdpbf16ps`'s reading of an input: zero exponent → ±0.
#[inline]
fn daz(b: u16) -> f32 {
    if b & 0x7f80 == 0 {
        widen(b & 0x8000)
    } else {
        widen(b)
    }
}

/// `vdpbf16ps`'s flush of a subnormal result to ±0.
#[inline]
fn ftz(x: f32) -> f32 {
    if x != 0.0 && x.abs() < f32::MIN_POSITIVE {
        f32::from_bits(x.to_bits() & 0x8000_0000)
    } else {
        x
    }
}

/// One lane of `vdpbf16ps`: `(acc + x1·y1) + x0·y0`.
#[inline]
fn dp_lane(acc: f32, x: [u16; 2], y: [u16; 2]) -> f32 {
    let p1 = ftz(daz(x[1]) * daz(y[1]));
    let p0 = ftz(daz(x[0]) * daz(y[0]));
    ftz(ftz(acc + p1) + p0)
}

/// `_mm512_reduce_add_ps` as GCC implements it: halves, quarters, then (0+2) + (1+3).
#[inline]
pub(crate) fn reduce16(a: &[f32; 16]) -> f32 {
    let t: [f32; 8] = std::array::from_fn(|i| a[i] + a[i + 8]);
    let u: [f32; 4] = std::array::from_fn(|i| t[i] + t[i + 4]);
    (u[0] + u[2]) + (u[1] + u[3])
}

/// The weight `i` of a row of BF16 bytes.
#[inline]
pub(crate) fn weight(w: &[u8], i: usize) -> u16 {
    u16::from_le_bytes([w[2 * i], w[2 * i + 1]])
}

/// Rows whose length is a multiple of this take tinyBLAS's single-accumulator form.
pub(crate) const TINYBLAS_KN: usize = 32;

/// The spec's last steps for `ggml_vec_dot_bf16`: the two accumulators' sums and the leftover
/// elements `from..`.
#[inline]
pub(crate) fn finish(c1: &[f32; 16], c2: &[f32; 16], w: &[u8], a: &[u16], from: usize) -> f32 {
    let mut sum = f64::from(reduce16(c1));
    sum += f64::from(reduce16(c2));
    for (i, &y) in a.iter().enumerate().skip(from) {
        sum += f64::from(widen(weight(w, i)) * widen(y));
    }
    sum as f32
}

/// Scalar reference: one BF16 row (`w`, little-endian bytes) · bf16 activations `a`.
pub fn dot_bf16_scalar(w: &[u8], a: &[u16]) -> f32 {
    assert_eq!(w.len(), 2 * a.len());
    let lane_steps = |c: &mut [f32; 16], base: usize| {
        for (l, lane) in c.iter_mut().enumerate() {
            let e = base + 2 * l;
            *lane = dp_lane(*lane, [weight(w, e), weight(w, e + 1)], [a[e], a[e + 1]]);
        }
    };
    if a.len().is_multiple_of(TINYBLAS_KN) {
        let mut c = [0.0f32; 16];
        for i in (0..a.len()).step_by(TINYBLAS_KN) {
            lane_steps(&mut c, i);
        }
        return reduce16(&c);
    }
    let (mut c1, mut c2) = ([0.0f32; 16], [0.0f32; 16]);
    let whole = a.len() / 64 * 64;
    for i in (0..whole).step_by(64) {
        lane_steps(&mut c1, i);
        lane_steps(&mut c2, i + 32);
    }
    finish(&c1, &c2, w, a, whole)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rounding_to_bf16_is_ggmls() {
        assert_eq!(to_bf16(1.0), 0x3f80);
        // 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties to even (1).
        assert_eq!(to_bf16(1.0 + 2f32.powi(-8)), 0x3f80);
        // 1 + 3·2^-8 is halfway between 1 + 2^-7 and 1 + 2^-6: ties to even (1 + 2^-6).
        assert_eq!(to_bf16(1.0 + 3.0 * 2f32.powi(-8)), 0x3f82);
        assert_eq!(to_bf16(-2.5), 0xc020);
        assert!(widen(to_bf16(f32::NAN)).is_nan());
    }

    #[test]
    fn a_lane_adds_the_odd_product_first_and_flushes_subnormals() {
        // acc = 1, x1·y1 = 2^-24 (half an ulp: ties to even, lost), then x0·y0 = 2^-23 +
        // 2^-24 (an ulp and a half: ties to even, 1 + 2^-22) — two roundings, not one (a
        // fused sum would give 1 + 2^-22 + …, rounded once). Which product goes first is
        // pinned by the kernel-vs-reference test on random data (odd first, as measured).
        let b = |x: f32| to_bf16(x);
        let one = b(1.0);
        let lane = dp_lane(
            1.0,
            [b(2f32.powi(-23) + 2f32.powi(-24)), b(2f32.powi(-24))],
            [one, one],
        );
        assert_eq!(lane, 1.0 + 2f32.powi(-22));
        // A subnormal input reads as zero.
        assert_eq!(dp_lane(1.0, [0, 0x0001], [0, 0x7f00]), 1.0);
    }
}

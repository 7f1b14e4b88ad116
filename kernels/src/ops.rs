//! Element-wise and row kernels: RMSNorm, RoPE, softmax, SwiGLU, f32 dot/axpy, f16 conversion.
//!
//! Numerics follow llama.cpp's CPU backend where it matters for matching its logits: RMSNorm sums
//! in f64, RoPE advances the angle by repeated multiplication in f32, SiLU is `x / (1 + e^-x)`.

use crate::simd::{self, Level};

/// `out = x / sqrt(mean(x²) + eps) · w`
pub fn rms_norm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    assert_eq!(x.len(), w.len());
    assert_eq!(x.len(), out.len());
    assert!(!x.is_empty());
    // As ggml: the square is rounded to f32, the sum kept in f64.
    let sum: f64 = x.iter().map(|&v| f64::from(v * v)).sum();
    let mean = (sum / x.len() as f64) as f32;
    let scale = 1.0 / (mean + eps).sqrt();
    for ((o, &v), &g) in out.iter_mut().zip(x).zip(w) {
        *o = v * scale * g;
    }
}

/// Cos/sin table for one position: `n_rot / 2` pairs, llama.cpp "normal" RoPE. With
/// `freq_factors` (Llama 3's `rope_freqs` tensor, one per pair) pair `i`'s angle is divided by
/// factor `i` before its cosine and sine, as llama.cpp's rope cache does.
pub fn rope_table(
    pos: usize,
    n_rot: usize,
    freq_base: f32,
    freq_factors: Option<&[f32]>,
    cos_sin: &mut Vec<(f32, f32)>,
) {
    assert!(n_rot.is_multiple_of(2), "rope: rotary dims must be even");
    if let Some(f) = freq_factors {
        assert_eq!(
            f.len(),
            n_rot / 2,
            "rope: one frequency factor per rotated pair"
        );
    }
    cos_sin.clear();
    let theta_scale = freq_base.powf(-2.0 / n_rot as f32);
    let mut theta = pos as f32;
    for i in 0..n_rot / 2 {
        let t = freq_factors.map_or(theta, |f| theta / f[i]);
        cos_sin.push((t.cos(), t.sin()));
        theta *= theta_scale;
    }
}

/// Rotate adjacent pairs `(x[2i], x[2i+1])` of every head in `x` (`n_heads × head_dim`) by the
/// angles of `cos_sin`; dims past `2 · cos_sin.len()` are left as they are.
pub fn rope_apply(x: &mut [f32], head_dim: usize, cos_sin: &[(f32, f32)]) {
    assert!(head_dim > 0 && x.len().is_multiple_of(head_dim));
    assert!(cos_sin.len() * 2 <= head_dim);
    for head in x.chunks_exact_mut(head_dim) {
        for (pair, &(c, s)) in head.chunks_exact_mut(2).zip(cos_sin) {
            let (x0, x1) = (pair[0], pair[1]);
            // The contraction GCC applies when it builds ggml (fp-contract=fast): one FMA per
            // output. Matching it is what makes our logits equal llama.cpp's bit for bit on the
            // reference prompt; the plain two-product form differs in the last bit.
            pair[0] = x0.mul_add(c, -(x1 * s));
            pair[1] = x0.mul_add(s, x1 * c);
        }
    }
}

/// Which dims RoPE rotates together.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeStyle {
    /// Adjacent pairs `(x[2i], x[2i+1])` (llama.cpp's `LLAMA_ROPE_TYPE_NORM`: Llama).
    Normal,
    /// The two halves of the rotated dims, `(x[i], x[i + n_rot/2])` (`LLAMA_ROPE_TYPE_NEOX`:
    /// GPT-NeoX, Qwen 2/3).
    Neox,
}

impl RopeStyle {
    /// Rotate every head of `x` (`n_heads × head_dim`) by the angles of `cos_sin`, this style's
    /// pairs; dims past `2 · cos_sin.len()` are left as they are.
    pub fn apply(self, x: &mut [f32], head_dim: usize, cos_sin: &[(f32, f32)]) {
        match self {
            Self::Normal => rope_apply(x, head_dim, cos_sin),
            Self::Neox => rope_apply_neox(x, head_dim, cos_sin),
        }
    }
}

/// [`RopeStyle::Neox`]: pair `i` is `(x[i], x[i + n_rot/2])` with `n_rot = 2 · cos_sin.len()`;
/// the same table and the same one-FMA-per-output arithmetic as [`rope_apply`].
pub fn rope_apply_neox(x: &mut [f32], head_dim: usize, cos_sin: &[(f32, f32)]) {
    assert!(head_dim > 0 && x.len().is_multiple_of(head_dim));
    let half = cos_sin.len();
    assert!(half * 2 <= head_dim);
    for head in x.chunks_exact_mut(head_dim) {
        let (lo, hi) = head[..2 * half].split_at_mut(half);
        for ((a, b), &(c, s)) in lo.iter_mut().zip(hi.iter_mut()).zip(cos_sin) {
            let (x0, x1) = (*a, *b);
            *a = x0.mul_add(c, -(x1 * s));
            *b = x0.mul_add(s, x1 * c);
        }
    }
}

/// In-place numerically stable softmax.
pub fn softmax(x: &mut [f32]) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0.0f64;
    for v in x.iter_mut() {
        *v = (*v - max).exp();
        sum += f64::from(*v);
    }
    let inv = (1.0 / sum) as f32;
    for v in x.iter_mut() {
        *v *= inv;
    }
}

/// `gate = silu(gate) · up`, in place.
///
/// As ggml's `ggml_vec_swiglu_f32` (AVX-512): `x / (1 + ggml_v_expf(-x)) · up`. The exponential
/// must be ggml's polynomial, not libm's: they differ in the last bit for about a quarter of the
/// inputs, and although the Q8 quantization of the down-projection input hides most of that, it
/// occasionally flips a quantized value and the whole row diverges from then on.
pub fn swiglu(gate: &mut [f32], up: &[f32]) {
    assert_eq!(gate.len(), up.len());
    #[cfg(target_arch = "x86_64")]
    if simd::level() == Level::Avx2 {
        // SAFETY: the Avx2 level is only selected when avx2 and fma were detected.
        return unsafe { swiglu_fma(gate, up) };
    }
    swiglu_body(gate, up);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn swiglu_fma(gate: &mut [f32], up: &[f32]) {
    swiglu_body(gate, up);
}

#[inline(always)]
fn swiglu_body(gate: &mut [f32], up: &[f32]) {
    for (g, &u) in gate.iter_mut().zip(up) {
        *g = *g / (1.0 + crate::attention::ggml_expf(0.0 - *g)) * u;
    }
}

/// `y += x`
pub fn add_inplace(y: &mut [f32], x: &[f32]) {
    assert_eq!(x.len(), y.len());
    for (a, &b) in y.iter_mut().zip(x) {
        *a += b;
    }
}

/// Scalar reference dot product.
pub fn dot_f32_scalar(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// f32 dot product (SIMD when available).
#[inline]
pub fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    match simd::level() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the Avx2 level is only selected when avx2, fma and f16c were detected.
        Level::Avx2 => unsafe { crate::x86::dot_f32(a, b) },
        _ => dot_f32_scalar(a, b),
    }
}

/// `y += alpha · x` (SIMD when available).
#[inline]
pub fn axpy(alpha: f32, x: &[f32], y: &mut [f32]) {
    match simd::level() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the Avx2 level is only selected when avx2, fma and f16c were detected.
        Level::Avx2 => unsafe { crate::x86::axpy(alpha, x, y) },
        _ => {
            assert_eq!(x.len(), y.len());
            for (o, &v) in y.iter_mut().zip(x) {
                *o += alpha * v;
            }
        }
    }
}

/// f16 → f32 (SIMD when available).
#[inline]
pub fn f16_to_f32(src: &[half::f16], dst: &mut [f32]) {
    match simd::level() {
        #[cfg(target_arch = "x86_64")]
        Level::Avx2 => {
            // f16 is repr(transparent) over u16.
            let bits: &[u16] = bytemuck_u16(src);
            // SAFETY: the Avx2 level is only selected when avx2, fma and f16c were detected.
            unsafe { crate::x86::f16_to_f32(bits, dst) }
        }
        _ => {
            assert_eq!(src.len(), dst.len());
            for (o, h) in dst.iter_mut().zip(src) {
                *o = h.to_f32();
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
fn bytemuck_u16(s: &[half::f16]) -> &[u16] {
    // SAFETY: `half::f16` is `#[repr(transparent)]` over `u16`: same size, alignment and validity.
    unsafe { std::slice::from_raw_parts(s.as_ptr().cast::<u16>(), s.len()) }
}

/// Argmax (first index of the maximum), `None` for an empty slice.
pub fn argmax(x: &[f32]) -> Option<usize> {
    let mut best: Option<(usize, f32)> = None;
    for (i, &v) in x.iter().enumerate() {
        if best.is_none_or(|(_, b)| v > b) {
            best = Some((i, v));
        }
    }
    best.map(|(i, _)| i)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rope_frequency_factors_divide_each_pairs_angle() {
        let (mut plain, mut ones, mut scaled) = (Vec::new(), Vec::new(), Vec::new());
        let f: Vec<f32> = (0..32).map(|i| 1.0 + i as f32 * 0.25).collect();
        for pos in [0, 1, 7, 513, 4095] {
            rope_table(pos, 64, 10_000.0, None, &mut plain);
            rope_table(pos, 64, 10_000.0, Some(&[1.0; 32]), &mut ones);
            rope_table(pos, 64, 10_000.0, Some(&f), &mut scaled);
            assert_eq!(plain, ones, "factors of 1 change nothing, bit for bit");
            let theta_scale = 10_000f32.powf(-2.0 / 64.0);
            let mut theta = pos as f32;
            for i in 0..32 {
                let t = theta / f[i];
                assert_eq!(scaled[i], (t.cos(), t.sin()), "pos {pos} pair {i}");
                theta *= theta_scale;
            }
        }
    }

    /// NeoX RoPE is the normal rotation applied to the halves interleaved: permuting a head so
    /// that `(x[i], x[i + n/2])` become adjacent, rotating normally and permuting back gives
    /// the same bits; dims past the rotated ones are untouched.
    #[test]
    fn neox_rope_rotates_the_halves_as_normal_rope_rotates_pairs() {
        let (head_dim, n_rot) = (64, 48);
        let mut tbl = Vec::new();
        rope_table(37, n_rot, 1_000_000.0, None, &mut tbl);
        let x = data(2 * head_dim, 11);
        let mut neox = x.clone();
        RopeStyle::Neox.apply(&mut neox, head_dim, &tbl);
        let half = n_rot / 2;
        for (h, (xh, nh)) in x.chunks(head_dim).zip(neox.chunks(head_dim)).enumerate() {
            let mut inter: Vec<f32> = (0..half).flat_map(|i| [xh[i], xh[i + half]]).collect();
            inter.extend_from_slice(&xh[n_rot..]);
            RopeStyle::Normal.apply(&mut inter, head_dim, &tbl);
            for i in 0..half {
                assert_eq!(
                    (nh[i], nh[i + half]),
                    (inter[2 * i], inter[2 * i + 1]),
                    "head {h}"
                );
            }
            assert_eq!(&nh[n_rot..], &xh[n_rot..], "unrotated dims are untouched");
        }
    }

    fn data(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed;
        (0..n)
            .map(|_| {
                s = s.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
                ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
            })
            .collect()
    }

    #[test]
    fn simd_dot_and_axpy_match_scalar() {
        for n in [1, 7, 8, 15, 16, 64, 100, 576] {
            let (a, b) = (data(n, 1), data(n, 2));
            let want = dot_f32_scalar(&a, &b);
            assert!((dot_f32(&a, &b) - want).abs() < 1e-4 * n as f32, "n={n}");
            let mut y1 = b.clone();
            let mut y2 = b.clone();
            axpy(0.37, &a, &mut y1);
            for (o, &v) in y2.iter_mut().zip(&a) {
                *o += 0.37 * v;
            }
            for (p, q) in y1.iter().zip(&y2) {
                assert!((p - q).abs() < 1e-6);
            }
        }
    }

    #[test]
    fn f16_conversion_matches_scalar() {
        let src: Vec<half::f16> = data(37, 3)
            .iter()
            .map(|&v| half::f16::from_f32(v * 100.0))
            .collect();
        let mut dst = vec![0.0; 37];
        f16_to_f32(&src, &mut dst);
        for (h, d) in src.iter().zip(&dst) {
            assert_eq!(h.to_f32(), *d);
        }
    }

    #[test]
    fn rms_norm_unit_weight_gives_unit_rms() {
        let x = data(576, 4);
        let w = vec![1.0; 576];
        let mut out = vec![0.0; 576];
        rms_norm(&x, &w, 1e-5, &mut out);
        let rms = (out.iter().map(|v| v * v).sum::<f32>() / 576.0).sqrt();
        assert!((rms - 1.0).abs() < 1e-3, "rms={rms}");
    }

    #[test]
    fn rope_preserves_norm_and_is_identity_at_zero() {
        let mut x = data(128, 5);
        let orig = x.clone();
        let mut t = Vec::new();
        rope_table(0, 64, 10_000.0, None, &mut t);
        rope_apply(&mut x, 64, &t);
        assert_eq!(x, orig);
        rope_table(17, 64, 10_000.0, None, &mut t);
        rope_apply(&mut x, 64, &t);
        let n0: f32 = orig.iter().map(|v| v * v).sum();
        let n1: f32 = x.iter().map(|v| v * v).sum();
        assert!((n0 - n1).abs() < 1e-3);
        // first pair rotates by exactly `pos` radians
        let (c, s) = (17.0f32.cos(), 17.0f32.sin());
        assert!((x[0] - (orig[0] * c - orig[1] * s)).abs() < 1e-5);
    }

    #[test]
    fn softmax_sums_to_one_and_orders() {
        let mut x = vec![1.0, 2.0, 3.0, -1000.0];
        softmax(&mut x);
        assert!((x.iter().sum::<f32>() - 1.0).abs() < 1e-6);
        assert!(x[2] > x[1] && x[1] > x[0] && x[3] == 0.0);
    }

    #[test]
    fn swiglu_matches_definition() {
        let mut o = [0.0, 1.0, -2.0];
        let u = [3.0, 2.0, 1.0];
        swiglu(&mut o, &u);
        assert_eq!(o[0], 0.0);
        assert!((o[1] - 2.0 / (1.0 + (-1.0f32).exp())).abs() < 1e-6);
        assert!(o[2] < 0.0);
    }

    #[test]
    fn argmax_picks_first_max() {
        assert_eq!(argmax(&[1.0, 3.0, 3.0, 2.0]), Some(1));
        assert_eq!(argmax(&[]), None);
    }
}

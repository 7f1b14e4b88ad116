//! The AVX512-BF16 kernel of `crate::bf16` (whose spec it follows): `vdpbf16ps` itself, one
//! weight load shared by one to four tokens, the lanes summed by the reference's own code.

use core::arch::x86_64::*;

use crate::bf16::{TINYBLAS_KN, finish, reduce16};

#[inline]
#[target_feature(enable = "avx512f,avx512bw")]
fn load32_bf16(p: &[u16]) -> __m512bh {
    assert!(p.len() >= 32);
    // SAFETY: 32 u16 are readable at `p` (asserted); the load is unaligned; `__m512bh` is 32
    // bf16 in a 512-bit register, the same bits.
    unsafe { std::mem::transmute::<__m512i, __m512bh>(_mm512_loadu_si512(p.as_ptr().cast())) }
}

#[inline]
#[target_feature(enable = "avx512f,avx512bw")]
fn load64_bytes_bf16(p: &[u8]) -> __m512bh {
    assert!(p.len() >= 64);
    // SAFETY: as `load32_bf16`, 64 bytes (32 little-endian bf16).
    unsafe { std::mem::transmute::<__m512i, __m512bh>(_mm512_loadu_si512(p.as_ptr().cast())) }
}

/// One BF16 row (`w`, little-endian bytes) · `T` tokens' bf16 activations (1 ≤ T ≤ 4).
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
pub(crate) fn dot_bf16_512<const T: usize>(w: &[u8], a: [&[u16]; T]) -> [f32; T] {
    let n = w.len() / 2;
    assert!(w.len() == 2 * n && a.iter().all(|x| x.len() == n));
    if n.is_multiple_of(TINYBLAS_KN) {
        let mut c = [_mm512_setzero_ps(); T];
        for i in (0..n).step_by(TINYBLAS_KN) {
            let wv = load64_bytes_bf16(&w[2 * i..]);
            for t in 0..T {
                c[t] = _mm512_dpbf16_ps(c[t], wv, load32_bf16(&a[t][i..]));
            }
        }
        let mut out = [0.0f32; T];
        for t in 0..T {
            let mut lanes = [0.0f32; 16];
            // SAFETY: 16 f32 are 64 bytes.
            unsafe { _mm512_storeu_ps(lanes.as_mut_ptr(), c[t]) };
            out[t] = reduce16(&lanes);
        }
        return out;
    }
    let whole = n / 64 * 64;
    let mut c1 = [_mm512_setzero_ps(); T];
    let mut c2 = [_mm512_setzero_ps(); T];
    for i in (0..whole).step_by(64) {
        let w1 = load64_bytes_bf16(&w[2 * i..]);
        let w2 = load64_bytes_bf16(&w[2 * i + 64..]);
        for t in 0..T {
            c1[t] = _mm512_dpbf16_ps(c1[t], w1, load32_bf16(&a[t][i..]));
            c2[t] = _mm512_dpbf16_ps(c2[t], w2, load32_bf16(&a[t][i + 32..]));
        }
    }
    let mut out = [0.0f32; T];
    for t in 0..T {
        let (mut l1, mut l2) = ([0.0f32; 16], [0.0f32; 16]);
        // SAFETY: 16 f32 are 64 bytes.
        unsafe {
            _mm512_storeu_ps(l1.as_mut_ptr(), c1[t]);
            _mm512_storeu_ps(l2.as_mut_ptr(), c2[t]);
        }
        out[t] = finish(&l1, &l2, w, a[t], whole);
    }
    out
}

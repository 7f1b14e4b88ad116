//! AVX2 + FMA + F16C implementations. Each function here has a scalar reference elsewhere in the
//! crate and a test that compares the two. Callers must have checked [`crate::simd::level`].

use core::arch::x86_64::*;

use crate::quant::{BlockQ8, QK};

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn f16_bits_to_f32(bits: u16) -> f32 {
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(i32::from(bits))))
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn hsum(v: __m256) -> f32 {
    let lo = _mm256_castps256_ps128(v);
    let hi = _mm256_extractf128_ps::<1>(v);
    let s = _mm_add_ps(lo, hi);
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_movehdup_ps(s));
    _mm_cvtss_f32(s)
}

#[inline]
fn f16_le(b: &[u8], off: usize) -> u16 {
    u16::from_le_bytes([b[off], b[off + 1]])
}

/// Q4_1 weights · Q8_1 activations.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) fn dot_q4_1_q8(w: &[u8], a: &[BlockQ8]) -> f32 {
    assert_eq!(w.len(), a.len() * 20);
    let m4 = _mm_set1_epi8(0x0f);
    let ones = _mm256_set1_epi16(1);
    let mut acc = _mm256_setzero_ps();
    let mut summ = 0.0f32;
    for (b, x) in w.chunks_exact(20).zip(a) {
        let dw = f16_bits_to_f32(f16_le(b, 0));
        let mw = f16_bits_to_f32(f16_le(b, 2));
        // SAFETY: `b` is 20 bytes long, so bytes 4..20 are in bounds for a 16-byte load;
        // `x.qs` is 32 bytes. Unaligned loads are used throughout.
        let (qs, aq) = unsafe {
            (
                _mm_loadu_si128(b.as_ptr().add(4).cast()),
                _mm256_loadu_si256(x.qs.as_ptr().cast()),
            )
        };
        let lo = _mm_and_si128(qs, m4);
        let hi = _mm_and_si128(_mm_srli_epi16::<4>(qs), m4);
        let wq = _mm256_set_m128i(hi, lo);
        let p16 = _mm256_maddubs_epi16(wq, aq);
        let p32 = _mm256_madd_epi16(p16, ones);
        acc = _mm256_fmadd_ps(_mm256_set1_ps(dw * x.d), _mm256_cvtepi32_ps(p32), acc);
        summ += mw * x.s;
    }
    hsum(acc) + summ
}

/// Q4_0 weights · Q8_0 activations, bit-identical to [`crate::quant::dot_q4_0_q8_scalar`]
/// (llama.cpp's repacked-Q4_0 arithmetic: one f32 accumulator, an FMA per block). Where the
/// packed kernels run this only serves matrices whose rows are not a multiple of eight.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) fn dot_q4_0_q8(w: &[u8], a: &[BlockQ8]) -> f32 {
    assert_eq!(w.len(), a.len() * 18);
    let m4 = _mm_set1_epi8(0x0f);
    let eight = _mm256_set1_epi8(8);
    let ones = _mm256_set1_epi16(1);
    let mut acc = 0.0f32;
    for (b, x) in w.chunks_exact(18).zip(a) {
        let dw = f16_bits_to_f32(f16_le(b, 0));
        // SAFETY: `b` is 18 bytes, so bytes 2..18 are a valid 16-byte load; `x.qs` is 32 bytes.
        let (qs, aq) = unsafe {
            (
                _mm_loadu_si128(b.as_ptr().add(2).cast()),
                _mm256_loadu_si256(x.qs.as_ptr().cast()),
            )
        };
        let lo = _mm_and_si128(qs, m4);
        let hi = _mm_and_si128(_mm_srli_epi16::<4>(qs), m4);
        let wq = _mm256_sub_epi8(_mm256_set_m128i(hi, lo), eight);
        let ax = _mm256_sign_epi8(wq, wq);
        let sy = _mm256_sign_epi8(aq, wq);
        let p32 = _mm256_madd_epi16(_mm256_maddubs_epi16(ax, sy), ones);
        // The block's exact integer sum (the order of integer adds does not matter).
        let s = _mm_add_epi32(
            _mm256_castsi256_si128(p32),
            _mm256_extracti128_si256::<1>(p32),
        );
        let s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
        let s = _mm_add_epi32(s, _mm_shuffle_epi32::<1>(s));
        let isum = _mm_cvtsi128_si32(s);
        acc = (isum as f32).mul_add(dw * x.d, acc);
    }
    acc
}

/// The 16 bytes at `p` as 32 nibbles, low nibbles (elements 0–15) then high (16–31).
/// Safety: `p` is valid for a 16-byte read.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn nibbles(p: *const u8) -> __m256i {
    // SAFETY: the caller's contract.
    let qs = unsafe { _mm_loadu_si128(p.cast()) };
    let m4 = _mm_set1_epi8(0x0f);
    _mm256_set_m128i(
        _mm_and_si128(_mm_srli_epi16::<4>(qs), m4),
        _mm_and_si128(qs, m4),
    )
}

/// 32 bytes, byte `i` = 0xFF where bit `i` of `bits` is set, else 0: each byte takes the qh byte
/// holding its bit, every other bit is forced to 1, and only bytes whose own bit was set compare
/// equal to all ones.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn bit_bytes(bits: u32) -> __m256i {
    let spread = _mm256_shuffle_epi8(
        _mm256_set1_epi32(bits as i32),
        _mm256_set_epi64x(
            0x0303_0303_0303_0303,
            0x0202_0202_0202_0202,
            0x0101_0101_0101_0101,
            0,
        ),
    );
    let others = _mm256_set1_epi64x(0x7fbf_dfef_f7fb_fdfe);
    _mm256_cmpeq_epi8(_mm256_or_si256(spread, others), _mm256_set1_epi64x(-1))
}

/// Q5_0 weights · Q8_0 activations: per block the exact products `(q5 − 16) · a` summed in 8
/// lanes of four, `fma(d_w · d_x, lanes, acc)`, then [`hsum`] — llama.cpp's AVX2 order.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) fn dot_q5_0_q8(w: &[u8], a: &[BlockQ8]) -> f32 {
    assert_eq!(w.len(), a.len() * 22);
    let high = _mm256_set1_epi8(0xF0u8 as i8);
    let ones = _mm256_set1_epi16(1);
    let mut acc = _mm256_setzero_ps();
    for (b, x) in w.chunks_exact(22).zip(a) {
        let dw = f16_bits_to_f32(f16_le(b, 0));
        let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
        // SAFETY: `b` is 22 bytes, so bytes 6..22 are a valid 16-byte load; `x.qs` is 32 bytes.
        let (nib, aq) = unsafe {
            (
                nibbles(b.as_ptr().add(6)),
                _mm256_loadu_si256(x.qs.as_ptr().cast()),
            )
        };
        // Without the fifth bit, OR 0xF0: the nibble read as a signed byte is nibble − 16.
        let wq = _mm256_or_si256(nib, _mm256_andnot_si256(bit_bytes(qh), high));
        let ax = _mm256_sign_epi8(wq, wq);
        let sy = _mm256_sign_epi8(aq, wq);
        let p32 = _mm256_madd_epi16(_mm256_maddubs_epi16(ax, sy), ones);
        acc = _mm256_fmadd_ps(_mm256_set1_ps(dw * x.d), _mm256_cvtepi32_ps(p32), acc);
    }
    hsum(acc)
}

/// Q5_1 weights · Q8_1 activations: the exact products `q5 · a` in 8 lanes of four,
/// `fma(lanes, d_w · d_x, acc)`, `m · s` added per block, then [`hsum`] plus those sums.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) fn dot_q5_1_q8(w: &[u8], a: &[BlockQ8]) -> f32 {
    assert_eq!(w.len(), a.len() * 24);
    let fifth = _mm256_set1_epi8(0x10);
    let ones = _mm256_set1_epi16(1);
    let mut acc = _mm256_setzero_ps();
    let mut summ = 0.0f32;
    for (b, x) in w.chunks_exact(24).zip(a) {
        let dw = f16_bits_to_f32(f16_le(b, 0));
        let mw = f16_bits_to_f32(f16_le(b, 2));
        let qh = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
        // SAFETY: `b` is 24 bytes, so bytes 8..24 are a valid 16-byte load; `x.qs` is 32 bytes.
        let (nib, aq) = unsafe {
            (
                nibbles(b.as_ptr().add(8)),
                _mm256_loadu_si256(x.qs.as_ptr().cast()),
            )
        };
        let wq = _mm256_or_si256(nib, _mm256_and_si256(bit_bytes(qh), fifth));
        let p32 = _mm256_madd_epi16(_mm256_maddubs_epi16(wq, aq), ones);
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p32), _mm256_set1_ps(dw * x.d), acc);
        summ += mw * x.s;
    }
    hsum(acc) + summ
}

/// Q8_0 weights · Q8_0 activations.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) fn dot_q8_0_q8(w: &[u8], a: &[BlockQ8]) -> f32 {
    assert_eq!(w.len(), a.len() * 34);
    let ones = _mm256_set1_epi16(1);
    let mut acc = _mm256_setzero_ps();
    for (b, x) in w.chunks_exact(34).zip(a) {
        let dw = f16_bits_to_f32(f16_le(b, 0));
        // SAFETY: `b` is 34 bytes, so bytes 2..34 are a valid 32-byte load; `x.qs` is 32 bytes.
        let (wq, aq) = unsafe {
            (
                _mm256_loadu_si256(b.as_ptr().add(2).cast()),
                _mm256_loadu_si256(x.qs.as_ptr().cast()),
            )
        };
        let ax = _mm256_sign_epi8(wq, wq);
        let sy = _mm256_sign_epi8(aq, wq);
        let p32 = _mm256_madd_epi16(_mm256_maddubs_epi16(ax, sy), ones);
        acc = _mm256_fmadd_ps(_mm256_set1_ps(dw * x.d), _mm256_cvtepi32_ps(p32), acc);
    }
    hsum(acc)
}

/// Quantize a row to Q8 blocks (same rounding as the scalar reference: half away from zero).
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) fn quantize_row_q8(x: &[f32], out: &mut [BlockQ8]) {
    assert_eq!(x.len(), out.len() * QK);
    let sign_mask = _mm256_set1_ps(-0.0);
    for (chunk, blk) in x.chunks_exact(QK).zip(out.iter_mut()) {
        // SAFETY: `chunk` is exactly 32 f32, four 8-lane loads at offsets 0, 8, 16, 24.
        let v = unsafe {
            [
                _mm256_loadu_ps(chunk.as_ptr()),
                _mm256_loadu_ps(chunk.as_ptr().add(8)),
                _mm256_loadu_ps(chunk.as_ptr().add(16)),
                _mm256_loadu_ps(chunk.as_ptr().add(24)),
            ]
        };
        let mut m = _mm256_andnot_ps(sign_mask, v[0]);
        for vi in &v[1..] {
            m = _mm256_max_ps(m, _mm256_andnot_ps(sign_mask, *vi));
        }
        let amax = {
            let lo = _mm256_castps256_ps128(m);
            let hi = _mm256_extractf128_ps::<1>(m);
            let s = _mm_max_ps(lo, hi);
            let s = _mm_max_ps(s, _mm_movehl_ps(s, s));
            let s = _mm_max_ss(s, _mm_movehdup_ps(s));
            _mm_cvtss_f32(s)
        };
        let d = amax / 127.0;
        let id = _mm256_set1_ps(if amax != 0.0 { 127.0 / amax } else { 0.0 });
        let mut sum = 0i32;
        for (k, vi) in v.iter().enumerate() {
            let y = _mm256_mul_ps(*vi, id);
            // round half to even, as ggml's AVX2 quantizer does
            let r = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(y);
            let i = _mm256_cvtps_epi32(r);
            let mut lanes = [0i32; 8];
            // SAFETY: `lanes` is 8 i32 = 32 bytes.
            unsafe { _mm256_storeu_si256(lanes.as_mut_ptr().cast(), i) };
            for (j, &q) in lanes.iter().enumerate() {
                blk.qs[k * 8 + j] = q as i8;
                sum += q;
            }
        }
        blk.d = half::f16::from_f32(d).to_f32();
        blk.s = half::f16::from_f32(sum as f32 * d).to_f32();
    }
}

/// f32 dot product.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    let n8 = a.len() / 8 * 8;
    let mut acc0 = _mm256_setzero_ps();
    let mut acc1 = _mm256_setzero_ps();
    let mut i = 0;
    while i + 16 <= n8 {
        // SAFETY: i + 16 <= len for both slices.
        unsafe {
            acc0 = _mm256_fmadd_ps(
                _mm256_loadu_ps(a.as_ptr().add(i)),
                _mm256_loadu_ps(b.as_ptr().add(i)),
                acc0,
            );
            acc1 = _mm256_fmadd_ps(
                _mm256_loadu_ps(a.as_ptr().add(i + 8)),
                _mm256_loadu_ps(b.as_ptr().add(i + 8)),
                acc1,
            );
        }
        i += 16;
    }
    if i < n8 {
        // SAFETY: i + 8 <= n8 <= len.
        unsafe {
            acc0 = _mm256_fmadd_ps(
                _mm256_loadu_ps(a.as_ptr().add(i)),
                _mm256_loadu_ps(b.as_ptr().add(i)),
                acc0,
            );
        }
    }
    let mut s = hsum(_mm256_add_ps(acc0, acc1));
    for j in n8..a.len() {
        s += a[j] * b[j];
    }
    s
}

/// y += alpha · x
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) fn axpy(alpha: f32, x: &[f32], y: &mut [f32]) {
    assert_eq!(x.len(), y.len());
    let n8 = x.len() / 8 * 8;
    let va = _mm256_set1_ps(alpha);
    let mut i = 0;
    while i < n8 {
        // SAFETY: i + 8 <= n8 <= len for both slices.
        unsafe {
            let r = _mm256_fmadd_ps(
                va,
                _mm256_loadu_ps(x.as_ptr().add(i)),
                _mm256_loadu_ps(y.as_ptr().add(i)),
            );
            _mm256_storeu_ps(y.as_mut_ptr().add(i), r);
        }
        i += 8;
    }
    for j in n8..x.len() {
        y[j] += alpha * x[j];
    }
}

/// f16 (as raw bits) → f32.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) fn f16_to_f32(src: &[u16], dst: &mut [f32]) {
    assert_eq!(src.len(), dst.len());
    let n8 = src.len() / 8 * 8;
    let mut i = 0;
    while i < n8 {
        // SAFETY: i + 8 <= n8 <= len for both slices (8 × u16 = 16 bytes in, 8 × f32 out).
        unsafe {
            let h = _mm_loadu_si128(src.as_ptr().add(i).cast());
            _mm256_storeu_ps(dst.as_mut_ptr().add(i), _mm256_cvtph_ps(h));
        }
        i += 8;
    }
    for j in n8..src.len() {
        dst[j] = f16_bits_to_f32(src[j]);
    }
}

/// Four Q4_1 weight rows · one Q8_1 activation row: four independent accumulator chains (ILP),
/// the activation block loaded once. Per row the arithmetic is exactly [`dot_q4_1_q8`]'s.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) fn dot4_q4_1_q8(w: [&[u8]; 4], a: &[BlockQ8]) -> [f32; 4] {
    let nb = a.len();
    for r in &w {
        assert_eq!(r.len(), nb * 20);
    }
    let m4 = _mm_set1_epi8(0x0f);
    let ones = _mm256_set1_epi16(1);
    let mut acc = [_mm256_setzero_ps(); 4];
    let mut summ = [0.0f32; 4];
    let p = [w[0].as_ptr(), w[1].as_ptr(), w[2].as_ptr(), w[3].as_ptr()];
    for (b, x) in a.iter().enumerate() {
        // SAFETY: `x.qs` is 32 bytes.
        let aq = unsafe { _mm256_loadu_si256(x.qs.as_ptr().cast()) };
        for r in 0..4 {
            // SAFETY: each row is nb × 20 bytes (asserted); block b spans [20b, 20b + 20).
            let (dm, qs) = unsafe {
                let blk = p[r].add(b * 20);
                (
                    _mm_cvtph_ps(_mm_cvtsi32_si128(blk.cast::<i32>().read_unaligned())),
                    _mm_loadu_si128(blk.add(4).cast()),
                )
            };
            let dw = _mm_cvtss_f32(dm);
            let mw = _mm_cvtss_f32(_mm_movehdup_ps(dm));
            let lo = _mm_and_si128(qs, m4);
            let hi = _mm_and_si128(_mm_srli_epi16::<4>(qs), m4);
            let p32 = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set_m128i(hi, lo), aq), ones);
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(dw * x.d), _mm256_cvtepi32_ps(p32), acc[r]);
            summ[r] += mw * x.s;
        }
    }
    [
        hsum(acc[0]) + summ[0],
        hsum(acc[1]) + summ[1],
        hsum(acc[2]) + summ[2],
        hsum(acc[3]) + summ[3],
    ]
}

/// Four Q8_0 weight rows · one Q8_0 activation row (see [`dot4_q4_1_q8`]).
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) fn dot4_q8_0_q8(w: [&[u8]; 4], a: &[BlockQ8]) -> [f32; 4] {
    let nb = a.len();
    for r in &w {
        assert_eq!(r.len(), nb * 34);
    }
    let ones = _mm256_set1_epi16(1);
    let mut acc = [_mm256_setzero_ps(); 4];
    let p = [w[0].as_ptr(), w[1].as_ptr(), w[2].as_ptr(), w[3].as_ptr()];
    for (b, x) in a.iter().enumerate() {
        // SAFETY: `x.qs` is 32 bytes.
        let aq = unsafe { _mm256_loadu_si256(x.qs.as_ptr().cast()) };
        for r in 0..4 {
            // SAFETY: each row is nb × 34 bytes (asserted); block b spans [34b, 34b + 34).
            let (dbits, wq) = unsafe {
                let blk = p[r].add(b * 34);
                (
                    blk.cast::<u16>().read_unaligned(),
                    _mm256_loadu_si256(blk.add(2).cast()),
                )
            };
            let dw = f16_bits_to_f32(u16::from_le(dbits));
            let ax = _mm256_sign_epi8(wq, wq);
            let sy = _mm256_sign_epi8(aq, wq);
            let p32 = _mm256_madd_epi16(_mm256_maddubs_epi16(ax, sy), ones);
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(dw * x.d), _mm256_cvtepi32_ps(p32), acc[r]);
        }
    }
    [hsum(acc[0]), hsum(acc[1]), hsum(acc[2]), hsum(acc[3])]
}

/// AVX-512 VNNI variant (one `vpdpbusd` instead of `vpmaddubsw` + `vpmaddwd`; the integer
/// sums are exact either way, so results are bit-identical). Four Q4_1 weight rows · one Q8_1 activation row: four independent accumulator chains (ILP),
/// the activation block loaded once. Per row the arithmetic is exactly [`dot_q4_1_q8`]'s.
#[target_feature(enable = "avx2,fma,f16c,avx512vnni,avx512vl")]
pub(crate) fn dot4v_q4_1_q8(w: [&[u8]; 4], a: &[BlockQ8]) -> [f32; 4] {
    let nb = a.len();
    for r in &w {
        assert_eq!(r.len(), nb * 20);
    }
    let m4 = _mm_set1_epi8(0x0f);
    let mut acc = [_mm256_setzero_ps(); 4];
    let mut summ = [0.0f32; 4];
    let p = [w[0].as_ptr(), w[1].as_ptr(), w[2].as_ptr(), w[3].as_ptr()];
    for (b, x) in a.iter().enumerate() {
        // SAFETY: `x.qs` is 32 bytes.
        let aq = unsafe { _mm256_loadu_si256(x.qs.as_ptr().cast()) };
        for r in 0..4 {
            // SAFETY: each row is nb × 20 bytes (asserted); block b spans [20b, 20b + 20).
            let (dm, qs) = unsafe {
                let blk = p[r].add(b * 20);
                (
                    _mm_cvtph_ps(_mm_cvtsi32_si128(blk.cast::<i32>().read_unaligned())),
                    _mm_loadu_si128(blk.add(4).cast()),
                )
            };
            let dw = _mm_cvtss_f32(dm);
            let mw = _mm_cvtss_f32(_mm_movehdup_ps(dm));
            let lo = _mm_and_si128(qs, m4);
            let hi = _mm_and_si128(_mm_srli_epi16::<4>(qs), m4);
            let p32 = _mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_set_m128i(hi, lo), aq);
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(dw * x.d), _mm256_cvtepi32_ps(p32), acc[r]);
            summ[r] += mw * x.s;
        }
    }
    [
        hsum(acc[0]) + summ[0],
        hsum(acc[1]) + summ[1],
        hsum(acc[2]) + summ[2],
        hsum(acc[3]) + summ[3],
    ]
}

/// AVX-512 VNNI variant (one `vpdpbusd` instead of `vpmaddubsw` + `vpmaddwd`; the integer
/// sums are exact either way, so results are bit-identical). Four Q8_0 weight rows · one Q8_0 activation row (see [`dot4_q4_1_q8`]).
#[target_feature(enable = "avx2,fma,f16c,avx512vnni,avx512vl")]
pub(crate) fn dot4v_q8_0_q8(w: [&[u8]; 4], a: &[BlockQ8]) -> [f32; 4] {
    let nb = a.len();
    for r in &w {
        assert_eq!(r.len(), nb * 34);
    }
    let mut acc = [_mm256_setzero_ps(); 4];
    let p = [w[0].as_ptr(), w[1].as_ptr(), w[2].as_ptr(), w[3].as_ptr()];
    for (b, x) in a.iter().enumerate() {
        // SAFETY: `x.qs` is 32 bytes.
        let aq = unsafe { _mm256_loadu_si256(x.qs.as_ptr().cast()) };
        for r in 0..4 {
            // SAFETY: each row is nb × 34 bytes (asserted); block b spans [34b, 34b + 34).
            let (dbits, wq) = unsafe {
                let blk = p[r].add(b * 34);
                (
                    blk.cast::<u16>().read_unaligned(),
                    _mm256_loadu_si256(blk.add(2).cast()),
                )
            };
            let dw = f16_bits_to_f32(u16::from_le(dbits));
            let ax = _mm256_sign_epi8(wq, wq);
            let sy = _mm256_sign_epi8(aq, wq);
            let p32 = _mm256_dpbusd_epi32(_mm256_setzero_si256(), ax, sy);
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(dw * x.d), _mm256_cvtepi32_ps(p32), acc[r]);
        }
    }
    [hsum(acc[0]), hsum(acc[1]), hsum(acc[2]), hsum(acc[3])]
}

/// Four Q4_1 weight rows × four Q8_1 activation rows (tokens), AVX-512 VNNI: each row's weights
/// are unpacked once per block for all four tokens (prefill's weight reuse, in registers). Every
/// (row, token) output is accumulated exactly as [`dot4v_q4_1_q8`] / [`dot_q4_1_q8`] do it —
/// the same per-block products, scale, FMA chain and final sum — so the bits are the same.
/// Returns `out[row][token]`.
#[target_feature(enable = "avx2,fma,f16c,avx512vnni,avx512vl")]
pub(crate) fn dot4x4v_q4_1_q8(w: [&[u8]; 4], a: [&[BlockQ8]; 4]) -> [[f32; 4]; 4] {
    let nb = a[0].len();
    for r in &w {
        assert_eq!(r.len(), nb * 20);
    }
    for t in &a {
        assert_eq!(t.len(), nb);
    }
    let m4 = _mm_set1_epi8(0x0f);
    let mut acc = [[_mm256_setzero_ps(); 4]; 4];
    let mut summ = [[0.0f32; 4]; 4];
    let p = [w[0].as_ptr(), w[1].as_ptr(), w[2].as_ptr(), w[3].as_ptr()];
    for b in 0..nb {
        let mut wq = [_mm256_setzero_si256(); 4];
        let mut dw = [0.0f32; 4];
        let mut mw = [0.0f32; 4];
        for r in 0..4 {
            // SAFETY: each row is nb × 20 bytes (asserted); block b spans [20b, 20b + 20).
            let (dm, qs) = unsafe {
                let blk = p[r].add(b * 20);
                (
                    _mm_cvtph_ps(_mm_cvtsi32_si128(blk.cast::<i32>().read_unaligned())),
                    _mm_loadu_si128(blk.add(4).cast()),
                )
            };
            dw[r] = _mm_cvtss_f32(dm);
            mw[r] = _mm_cvtss_f32(_mm_movehdup_ps(dm));
            let lo = _mm_and_si128(qs, m4);
            let hi = _mm_and_si128(_mm_srli_epi16::<4>(qs), m4);
            wq[r] = _mm256_set_m128i(hi, lo);
        }
        for t in 0..4 {
            let x = &a[t][b];
            // SAFETY: `x.qs` is 32 bytes.
            let aq = unsafe { _mm256_loadu_si256(x.qs.as_ptr().cast()) };
            for r in 0..4 {
                let p32 = _mm256_dpbusd_epi32(_mm256_setzero_si256(), wq[r], aq);
                acc[r][t] = _mm256_fmadd_ps(
                    _mm256_set1_ps(dw[r] * x.d),
                    _mm256_cvtepi32_ps(p32),
                    acc[r][t],
                );
                summ[r][t] += mw[r] * x.s;
            }
        }
    }
    let mut out = [[0.0f32; 4]; 4];
    for r in 0..4 {
        for t in 0..4 {
            out[r][t] = hsum(acc[r][t]) + summ[r][t];
        }
    }
    out
}

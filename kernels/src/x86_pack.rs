//! AVX-512 VNNI kernels over row-interleaved weights ([`crate::pack`]): eight rows, one to four
//! activation rows (tokens), two weight rows per 512-bit register.
//!
//! The one-row kernels ([`crate::x86::dot_q4_1_q8`], [`crate::x86::dot_q8_0_q8`]) keep, per row,
//! an 8-lane f32 accumulator: lane `k` adds `fma(d_w · d_x, Σ of the block's four products
//! 4k..4k+3, acc)` block after block, then the lanes are summed in ggml's `hsum_float_8` order.
//! Here each 512-bit accumulator holds the 8 lanes of two rows (in a permuted lane order), every
//! lane gets the same exact integer sum, the same f32 scale product and the same FMA in the same
//! block order, and each row's lanes are summed in the same order at the end: the bits are the
//! one-row kernel's (tested against it for every token count).
//!
//! Per block and eight rows this is ~45 instructions where the four-row kernel needed ~16 a row:
//! a decode step's mat-vecs stop being bound by instruction issue and read weights at the
//! memory's pace.

use core::arch::x86_64::*;

use crate::pack::Q40PairTerms;
use crate::quant::BlockQ8;

/// Bytes of one block of eight interleaved Q4_1 rows: `d[8]`, `m[8]` (f16), then each row's
/// 16 nibble bytes.
pub(crate) const Q4_1_GROUP_BLOCK: usize = 160;
/// Bytes of one block of eight interleaved Q8_0 rows: `d[8]` (f16), then each row's 32 quants
/// stored offset by 128 (`q ^ 0x80`, an unsigned byte), what `vpdpbusd` multiplies.
pub(crate) const Q8_0_GROUP_BLOCK: usize = 272;

/// Bytes of one block of eight interleaved Q4_0 rows: `d[8]` (f16), then two 64-byte halves:
/// half `h` holds every row's GGUF quant bytes `8h .. 8h + 8` (row `r` at `8r`). A half's low
/// nibbles are elements `8h .. 8h + 8` of each row, its high nibbles elements `16 + 8h ..`.
pub(crate) const Q4_0_GROUP_BLOCK: usize = 144;
/// Bytes of one block of eight interleaved Q5_0 rows: `d[8]` (f16), `qh[8]` (u32), then each
/// row's 16 nibble bytes.
pub(crate) const Q5_0_GROUP_BLOCK: usize = 176;
/// Bytes of one block of eight interleaved Q5_1 rows: `d[8]`, `m[8]` (f16), `qh[8]`, nibbles.
pub(crate) const Q5_1_GROUP_BLOCK: usize = 192;

/// `hsum` of one row's 8 lanes given as its two 4-lane halves (lanes 0–3, lanes 4–7): ggml's
/// `hsum_float_8` order — halves added, then pairs, then the last two.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn finish(lo: __m128, hi: __m128) -> f32 {
    let s = _mm_add_ps(lo, hi);
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_movehdup_ps(s));
    _mm_cvtss_f32(s)
}

/// The four 128-bit quarters of `v`.
#[inline]
#[target_feature(enable = "avx512f")]
fn quarters(v: __m512) -> [__m128; 4] {
    [
        _mm512_extractf32x4_ps::<0>(v),
        _mm512_extractf32x4_ps::<1>(v),
        _mm512_extractf32x4_ps::<2>(v),
        _mm512_extractf32x4_ps::<3>(v),
    ]
}

/// The pair registers of eight rows' nibble bytes (`z0`: rows 0–3, `z1`: rows 4–7, 16 bytes a
/// row): register `p` is (low nibbles of row 2p, of row 2p+1, high nibbles of row 2p, of
/// row 2p+1) — elements 0–15 and 16–31 of the two rows.
#[inline]
#[target_feature(enable = "avx512f,avx512bw")]
fn pair_nibbles(z0: __m512i, z1: __m512i) -> [__m512i; 4] {
    let m4 = _mm512_set1_epi8(0x0f);
    let split = |z| {
        (
            _mm512_and_si512(z, m4),
            _mm512_and_si512(_mm512_srli_epi16::<4>(z), m4),
        )
    };
    let ((l0, h0), (l1, h1)) = (split(z0), split(z1));
    [
        _mm512_shuffle_i64x2::<0x44>(l0, h0),
        _mm512_shuffle_i64x2::<0xEE>(l0, h0),
        _mm512_shuffle_i64x2::<0x44>(l1, h1),
        _mm512_shuffle_i64x2::<0xEE>(l1, h1),
    ]
}

/// Lane indices that spread row scales `dd[2p]`, `dd[2p + 1]` over a pair register whose 128-bit
/// quarters hold (row 2p, row 2p+1, row 2p, row 2p+1) — the Q4_1 pair layout.
#[inline]
#[target_feature(enable = "avx512f")]
fn q4_pair_index(p: i32) -> __m512i {
    let (a, b) = (2 * p, 2 * p + 1);
    _mm512_setr_epi32(a, a, a, a, b, b, b, b, a, a, a, a, b, b, b, b)
}

/// Eight interleaved Q4_1 rows (`g`: `nb` blocks of [`Q4_1_GROUP_BLOCK`] bytes) · `T` Q8_1
/// activation rows. Returns `out[token][row]`, each bit-identical to `dot_q4_1_q8(row, a[t])`.
///
/// Pair register `p` (rows 2p, 2p+1) is `(lo nibbles of 2p, lo of 2p+1, hi of 2p, hi of 2p+1)`
/// against the activation `(a[0..16], a[0..16], a[16..32], a[16..32])`: lanes 0–3 and 8–11 are
/// row 2p's one-row lanes 0–3 and 4–7, lanes 4–7 and 12–15 row 2p+1's.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(crate) fn dot8_q4_1_packed<const T: usize>(g: &[u8], a: [&[BlockQ8]; T]) -> [[f32; 8]; T] {
    let nb = g.len() / Q4_1_GROUP_BLOCK;
    assert_eq!(g.len(), nb * Q4_1_GROUP_BLOCK);
    for t in &a {
        assert_eq!(t.len(), nb);
    }
    let idx = [
        q4_pair_index(0),
        q4_pair_index(1),
        q4_pair_index(2),
        q4_pair_index(3),
    ];
    let mut acc = [[_mm512_setzero_ps(); 4]; T];
    let mut summ = [_mm256_setzero_ps(); T];
    for b in 0..nb {
        // SAFETY: block b spans [160b, 160b + 160) of `g` (length asserted): d at +0 (16 bytes),
        // m at +16 (16 bytes), rows 0–3 at +32 and rows 4–7 at +96 (64 bytes each).
        let (d8, m8, z0, z1) = unsafe {
            let blk = g.as_ptr().add(b * Q4_1_GROUP_BLOCK);
            (
                _mm256_cvtph_ps(_mm_loadu_si128(blk.cast())),
                _mm256_cvtph_ps(_mm_loadu_si128(blk.add(16).cast())),
                _mm512_loadu_si512(blk.add(32).cast()),
                _mm512_loadu_si512(blk.add(96).cast()),
            )
        };
        let w = pair_nibbles(z0, z1);
        for t in 0..T {
            let x = &a[t][b];
            // SAFETY: `x.qs` is 32 bytes.
            let aq = unsafe { _mm256_loadu_si256(x.qs.as_ptr().cast()) };
            let az = _mm512_castsi256_si512(aq);
            let av = _mm512_shuffle_i64x2::<0x50>(az, az);
            let dd = _mm512_castps256_ps512(_mm256_mul_ps(d8, _mm256_set1_ps(x.d)));
            for p in 0..4 {
                let p32 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[p], av);
                let s = _mm512_permutexvar_ps(idx[p], dd);
                acc[t][p] = _mm512_fmadd_ps(s, _mm512_cvtepi32_ps(p32), acc[t][p]);
            }
            summ[t] = _mm256_add_ps(summ[t], _mm256_mul_ps(m8, _mm256_set1_ps(x.s)));
        }
    }
    let mut out = [[0.0f32; 8]; T];
    for t in 0..T {
        let mut sm = [0.0f32; 8];
        // SAFETY: `sm` is 8 f32 = 32 bytes.
        unsafe { _mm256_storeu_ps(sm.as_mut_ptr(), summ[t]) };
        for p in 0..4 {
            let [q0, q1, q2, q3] = quarters(acc[t][p]);
            out[t][2 * p] = finish(q0, q2) + sm[2 * p];
            out[t][2 * p + 1] = finish(q1, q3) + sm[2 * p + 1];
        }
    }
    out
}

/// Eight interleaved Q8_0 rows (`g`: `nb` blocks of [`Q8_0_GROUP_BLOCK`] bytes, quants stored as
/// `q + 128`) · `T` Q8_0 activation rows. Returns `out[token][row]`, each bit-identical to
/// `dot_q8_0_q8(row, a[t])`.
///
/// Pair register `p` is (row 2p's 32 bytes, row 2p+1's) against `(a, a)`; `vpdpbusd` of the
/// offset quants, started from `-128 · Σ a` over each lane's four bytes, is the lane's exact
/// integer sum `Σ q·a` (no saturation: |sum| < 2^17).
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(crate) fn dot8_q8_0_packed<const T: usize>(g: &[u8], a: [&[BlockQ8]; T]) -> [[f32; 8]; T] {
    let nb = g.len() / Q8_0_GROUP_BLOCK;
    assert_eq!(g.len(), nb * Q8_0_GROUP_BLOCK);
    for t in &a {
        assert_eq!(t.len(), nb);
    }
    let offset = _mm512_set1_epi8(-128);
    let idx = [0, 1, 2, 3].map(|p: i32| {
        let (a, b) = (2 * p, 2 * p + 1);
        _mm512_setr_epi32(a, a, a, a, a, a, a, a, b, b, b, b, b, b, b, b)
    });
    let mut acc = [[_mm512_setzero_ps(); 4]; T];
    for b in 0..nb {
        // SAFETY: block b spans [272b, 272b + 272) of `g` (length asserted): d at +0 (16 bytes),
        // then four 64-byte row pairs at +16, +80, +144, +208.
        let (d8, w) = unsafe {
            let blk = g.as_ptr().add(b * Q8_0_GROUP_BLOCK);
            (
                _mm256_cvtph_ps(_mm_loadu_si128(blk.cast())),
                [16, 80, 144, 208].map(|o| _mm512_loadu_si512(blk.add(o).cast())),
            )
        };
        for t in 0..T {
            let x = &a[t][b];
            // SAFETY: `x.qs` is 32 bytes.
            let aq = unsafe { _mm256_loadu_si256(x.qs.as_ptr().cast()) };
            let az = _mm512_castsi256_si512(aq);
            let av = _mm512_shuffle_i64x2::<0x44>(az, az);
            // -128 · (sum of each lane's four activation bytes): 0x80 read as unsigned is 128.
            let corr = _mm512_sub_epi32(
                _mm512_setzero_si512(),
                _mm512_dpbusd_epi32(_mm512_setzero_si512(), offset, av),
            );
            let dd = _mm512_castps256_ps512(_mm256_mul_ps(d8, _mm256_set1_ps(x.d)));
            for p in 0..4 {
                let p32 = _mm512_dpbusd_epi32(corr, w[p], av);
                let s = _mm512_permutexvar_ps(idx[p], dd);
                acc[t][p] = _mm512_fmadd_ps(s, _mm512_cvtepi32_ps(p32), acc[t][p]);
            }
        }
    }
    let mut out = [[0.0f32; 8]; T];
    for t in 0..T {
        for p in 0..4 {
            let [q0, q1, q2, q3] = quarters(acc[t][p]);
            out[t][2 * p] = finish(q0, q1);
            out[t][2 * p + 1] = finish(q2, q3);
        }
    }
    out
}

/// Eight interleaved Q5_0 (`MIN = false`) or Q5_1 (`MIN = true`) rows · `T` Q8 activation
/// rows. Returns `out[token][row]`, each bit-identical to `dot_q5_0_q8` / `dot_q5_1_q8` of the
/// row.
///
/// The register layout is the Q4_1 kernel's ([`dot8_q4_1_packed`]); each row's fifth bits are
/// OR-ed in as 0x10 through a byte mask laid out like the pair register. Q5_0's `q − 16` is
/// `vpdpbusd` of the unsigned values started from `−16 · Σ a` over each lane's four bytes: the same exact integer lane sums as the one-row kernel's signed products.
/// (Q4_0 has its own arithmetic, [`dot8_q4_0_packed`].)
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(crate) fn dot8_q5_packed<const T: usize, const MIN: bool>(
    g: &[u8],
    a: [&[BlockQ8]; T],
) -> [[f32; 8]; T] {
    let gb = if MIN {
        Q5_1_GROUP_BLOCK
    } else {
        Q5_0_GROUP_BLOCK
    };
    let hoff = if MIN { 32 } else { 16 };
    // The rows' nibbles follow the scales and the fifth bits.
    let noff = hoff + 32;
    let nb = g.len() / gb;
    assert_eq!(g.len(), nb * gb);
    for t in &a {
        assert_eq!(t.len(), nb);
    }
    let fifth = _mm512_set1_epi8(0x10);
    // The offset the unsigned values carry.
    let offset = _mm512_set1_epi8(16);
    let idx = [
        q4_pair_index(0),
        q4_pair_index(1),
        q4_pair_index(2),
        q4_pair_index(3),
    ];
    let mut acc = [[_mm512_setzero_ps(); 4]; T];
    let mut summ = [_mm256_setzero_ps(); T];
    for b in 0..nb {
        // SAFETY: block b spans [gb·b, gb·b + gb) of `g` (length asserted): d at +0, m at +16
        // (Q5_1), qh at +hoff (32 bytes), rows 0–3 at +noff and rows 4–7 at +noff+64.
        let (d8, m8, qh, z0, z1) = unsafe {
            let blk = g.as_ptr().add(b * gb);
            let qh: [u32; 8] =
                std::array::from_fn(|i| blk.add(hoff + 4 * i).cast::<u32>().read_unaligned());
            (
                _mm256_cvtph_ps(_mm_loadu_si128(blk.cast())),
                if MIN {
                    _mm256_cvtph_ps(_mm_loadu_si128(blk.add(16).cast()))
                } else {
                    _mm256_setzero_ps()
                },
                qh.map(u32::from_le),
                _mm512_loadu_si512(blk.add(noff).cast()),
                _mm512_loadu_si512(blk.add(noff + 64).cast()),
            )
        };
        let nib = pair_nibbles(z0, z1);
        let w: [__m512i; 4] = std::array::from_fn(|p| {
            // Byte k of the pair register: quarter 0 = row 2p elements 0–15, 1 = row 2p+1's,
            // 2 = row 2p elements 16–31, 3 = row 2p+1's — their fifth bits in that order.
            let (r0, r1) = (u64::from(qh[2 * p]), u64::from(qh[2 * p + 1]));
            let mask = (r0 & 0xffff) | (r1 & 0xffff) << 16 | (r0 >> 16) << 32 | (r1 >> 16) << 48;
            _mm512_or_si512(nib[p], _mm512_maskz_mov_epi8(mask, fifth))
        });
        for t in 0..T {
            let x = &a[t][b];
            // SAFETY: `x.qs` is 32 bytes.
            let aq = unsafe { _mm256_loadu_si256(x.qs.as_ptr().cast()) };
            let az = _mm512_castsi256_si512(aq);
            let av = _mm512_shuffle_i64x2::<0x50>(az, az);
            let corr = if MIN {
                _mm512_setzero_si512()
            } else {
                _mm512_sub_epi32(
                    _mm512_setzero_si512(),
                    _mm512_dpbusd_epi32(_mm512_setzero_si512(), offset, av),
                )
            };
            let dd = _mm512_castps256_ps512(_mm256_mul_ps(d8, _mm256_set1_ps(x.d)));
            for p in 0..4 {
                let p32 = _mm512_dpbusd_epi32(corr, w[p], av);
                let s = _mm512_permutexvar_ps(idx[p], dd);
                acc[t][p] = _mm512_fmadd_ps(s, _mm512_cvtepi32_ps(p32), acc[t][p]);
            }
            if MIN {
                summ[t] = _mm256_add_ps(summ[t], _mm256_mul_ps(m8, _mm256_set1_ps(x.s)));
            }
        }
    }
    let mut out = [[0.0f32; 8]; T];
    for t in 0..T {
        let mut sm = [0.0f32; 8];
        // SAFETY: `sm` is 8 f32 = 32 bytes.
        unsafe { _mm256_storeu_ps(sm.as_mut_ptr(), summ[t]) };
        for p in 0..4 {
            let [q0, q1, q2, q3] = quarters(acc[t][p]);
            let (e, o) = (finish(q0, q2), finish(q1, q3));
            out[t][2 * p] = if MIN { e + sm[2 * p] } else { e };
            out[t][2 * p + 1] = if MIN { o + sm[2 * p + 1] } else { o };
        }
    }
    out
}

/// Eight interleaved Q4_0 rows (`g`: `nb` blocks of [`Q4_0_GROUP_BLOCK`] bytes) · `T` Q8_0
/// activation rows, with the tokens' [`Q40PairTerms`] (`pairs[i]`: tokens `2i`, `2i + 1` of
/// `a`). Returns `out[token][row]`, each bit-identical to `dot_q4_0_q8_scalar` of the row:
/// llama.cpp's repacked-Q4_0 arithmetic, a block's exact integer sum, then
/// `acc = fma(isum, d_w · d_x, acc)` in one f32 lane per (row, token).
///
/// Registers: lane `2r + p` of a weight register is row `r`'s four values of chunk `2k + p`
/// (elements `8k + 4p ..`); against the broadcast eight activation bytes `8k .. 8k + 8` one
/// `vpdpbusd` gives every row both chunks' sums. After a block's four, lanes `2r` and `2r + 1`
/// hold row `r`'s two halves; two permutes and an add fold two tokens' registers into lane
/// `2r + j` = row `r`, token `j` of the pair, and one convert, multiply and FMA per pair finish
/// the block for all eight rows — the per-block float work is shared by sixteen outputs instead
/// of the two of the other kernels' eight-lane accumulators. The values are unsigned (0..15):
/// each token's sums start from `−8 · Σ a` (its [`Q40PairTerms::start`]) in the even lane, so the
/// folded sum is the block's `Σ (q − 8) · a` exactly (|sum| < 2^15).
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(crate) fn dot8_q4_0_packed<const T: usize>(
    g: &[u8],
    a: [&[BlockQ8]; T],
    pairs: [&[Q40PairTerms]; 4],
) -> [[f32; 8]; T] {
    let nb = g.len() / Q4_0_GROUP_BLOCK;
    assert_eq!(g.len(), nb * Q4_0_GROUP_BLOCK);
    assert!((1..=8).contains(&T), "one to four token pairs");
    for t in &a {
        assert_eq!(t.len(), nb);
    }
    let n_pairs = T.div_ceil(2);
    for p in &pairs[..n_pairs] {
        assert_eq!(p.len(), nb);
    }
    let m4 = _mm512_set1_epi8(0x0f);
    let dup = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
    let even = _mm512_setr_epi32(0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30);
    let odd = _mm512_setr_epi32(1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
    let mut acc = [_mm512_setzero_ps(); 4];
    for b in 0..nb {
        // SAFETY: block b spans [144b, 144b + 144) of `g` (length asserted): d at +0 (16
        // bytes), the halves at +16 and +80 (64 bytes each).
        let (dw, z0, z1) = unsafe {
            let blk = g.as_ptr().add(b * Q4_0_GROUP_BLOCK);
            (
                _mm256_cvtph_ps(_mm_loadu_si128(blk.cast())),
                _mm512_loadu_si512(blk.add(16).cast()),
                _mm512_loadu_si512(blk.add(80).cast()),
            )
        };
        // Row r's scale in lanes 2r, 2r + 1.
        let dw = _mm512_permutexvar_ps(dup, _mm512_castps256_ps512(dw));
        // w[k]: elements 8k .. 8k + 8 of every row.
        let w = [
            _mm512_and_si512(z0, m4),
            _mm512_and_si512(z1, m4),
            _mm512_and_si512(_mm512_srli_epi16::<4>(z0), m4),
            _mm512_and_si512(_mm512_srli_epi16::<4>(z1), m4),
        ];
        for (i, acc) in acc.iter_mut().enumerate().take(n_pairs) {
            let terms = &pairs[i][b];
            let mut sums = [_mm512_setzero_si512(); 2];
            for (j, sum) in sums.iter_mut().enumerate() {
                let t = 2 * i + j;
                if t >= T {
                    break;
                }
                let x = &a[t][b];
                let mut s = _mm512_set1_epi64(start_bits(terms.start[j]));
                for (k, wk) in w.iter().enumerate() {
                    // SAFETY: `x.qs` is 32 bytes: bytes 8k .. 8k + 8 (k < 4) are in bounds.
                    let q = unsafe { x.qs.as_ptr().add(8 * k).cast::<i64>().read_unaligned() };
                    s = _mm512_dpbusd_epi32(s, *wk, _mm512_set1_epi64(q));
                }
                *sum = s;
            }
            let isum = _mm512_add_epi32(
                _mm512_permutex2var_epi32(sums[0], even, sums[1]),
                _mm512_permutex2var_epi32(sums[0], odd, sums[1]),
            );
            let dx = _mm512_castpd_ps(_mm512_set1_pd(f64::from_bits(
                u64::from(terms.d[0].to_bits()) | u64::from(terms.d[1].to_bits()) << 32,
            )));
            *acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(dw, dx), *acc);
        }
    }
    let mut lanes = [[0.0f32; 16]; 4];
    for (l, v) in lanes.iter_mut().zip(acc) {
        // SAFETY: `l` is 16 f32 = 64 bytes.
        unsafe { _mm512_storeu_ps(l.as_mut_ptr(), v) };
    }
    std::array::from_fn(|t| std::array::from_fn(|r| lanes[t / 2][2 * r + t % 2]))
}

/// A token's `(−8 · Σ a, 0)` as one 64-bit broadcast: the first in the even lanes.
#[inline]
fn start_bits(start: i32) -> i64 {
    i64::from(start as u32)
}

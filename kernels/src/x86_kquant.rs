//! AVX2 kernels of the K-quant · Q8_K dot products (`crate::q8k`, whose spec they follow): the
//! exact integer block sums with 256-bit `maddubs`/`madd` (every partial sum fits its lane:
//! at most 63 · 127 · 2 per i16 pair, ≤ 2^25 per i32), the float part shared with the scalar
//! reference, so the results are the reference's bits.

use core::arch::x86_64::*;

use crate::kquant::{scale_min_k4, scales_q3_k};
use crate::q8k::{BlockQ8K, BlockSums, KOrder, accumulate, mins_terms, q6_offset_term};
use crate::quant::{DType, f16_at};

#[inline]
#[target_feature(enable = "avx2")]
fn hsum_i32(v: __m256i) -> i32 {
    let s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v));
    let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b01_00_11_10>(s));
    let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b10_11_00_01>(s));
    _mm_cvtsi128_si32(s)
}

#[inline]
#[target_feature(enable = "avx")]
fn store_i32x8(v: __m256i) -> [i32; 8] {
    let mut out = [0i32; 8];
    // SAFETY: 8 i32 = 32 bytes.
    unsafe { _mm256_storeu_si256(out.as_mut_ptr().cast(), v) };
    out
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

/// Chunk `c` of a Q4_K/Q5_K block: the low and the high nibbles of bytes `32c..32c+32`
/// (sub-blocks `2c`, `2c+1`), with the fifth bits of `hbits` (Q5_K's `qh`) where given — bit
/// `2c` of each `qh` byte for the low nibbles' sub-block, `2c+1` for the high.
#[inline]
#[target_feature(enable = "avx2")]
fn qk45_chunk(qs: &[u8], hbits: Option<__m256i>, c: usize) -> [__m256i; 2] {
    let m4 = _mm256_set1_epi8(0x0f);
    let one = _mm256_set1_epi8(1);
    let q = load32(&qs[32 * c..]);
    let mut lo = _mm256_and_si256(q, m4);
    let mut hi = _mm256_and_si256(_mm256_srli_epi16::<4>(q), m4);
    if let Some(h) = hbits {
        let shifted = _mm256_srl_epi16(h, _mm_cvtsi32_si128(2 * c as i32));
        let b0 = _mm256_and_si256(shifted, one);
        let b1 = _mm256_and_si256(_mm256_srli_epi16::<1>(shifted), one);
        lo = _mm256_or_si256(lo, _mm256_slli_epi16::<4>(b0));
        hi = _mm256_or_si256(hi, _mm256_slli_epi16::<4>(b1));
    }
    [lo, hi]
}

/// A Q4_K/Q5_K block's [`BlockSums`]: `Σ_c sc_lo(c) · Σ lo·a + sc_hi(c) · Σ hi·a` over its four
/// 64-element chunks (chunk `c` is sub-block pair `c`), the 5-bit values' fifth bits from `qh`
/// where given; split by pair where `PAIRS` (one horizontal sum per chunk rather than one).
#[inline]
#[target_feature(enable = "avx2")]
fn qk45_sums<const PAIRS: bool>(
    scales: &[u8],
    qh: Option<&[u8]>,
    qs: &[u8],
    a: &BlockQ8K,
    lanes: bool,
) -> BlockSums {
    let hbits = qh.map(|h| load32(h));
    let mut acc = _mm256_setzero_si256();
    let mut slices_s = [0i32; 4];
    for (c, pair) in slices_s.iter_mut().enumerate() {
        let [lo, hi] = qk45_chunk(qs, hbits, c);
        let (sc0, _) = scale_min_k4(2 * c, scales);
        let (sc1, _) = scale_min_k4(2 * c + 1, scales);
        let p0 = _mm256_maddubs_epi16(lo, load32_i8(&a.qs[64 * c..]));
        let p1 = _mm256_maddubs_epi16(hi, load32_i8(&a.qs[64 * c + 32..]));
        let s0 = _mm256_madd_epi16(p0, _mm256_set1_epi16(i16::from(sc0)));
        let s1 = _mm256_madd_epi16(p1, _mm256_set1_epi16(i16::from(sc1)));
        if PAIRS {
            *pair = hsum_i32(_mm256_add_epi32(s0, s1));
        }
        // i32 lane `l`: bytes `4l .. 4l + 4` of each 32 (`maddubs` then `madd` keep them in
        // place): llama.cpp's `vec_dot` lanes.
        acc = _mm256_add_epi32(acc, _mm256_add_epi32(s0, s1));
    }
    let slices_m = mins_terms(scales, a);
    let sums = if PAIRS {
        BlockSums::sliced(4, slices_s, slices_m)
    } else {
        BlockSums::whole(hsum_i32(acc), slices_m.iter().sum())
    };
    if lanes {
        sums.with_lanes(store_i32x8(acc), slices_m)
    } else {
        sums
    }
}

/// Q4_K (`qh` = None: 144-byte blocks) or Q5_K (176) weights · Q8_K activations in `order`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn dot_qk45_q8k(w: &[u8], a: &[BlockQ8K], order: KOrder, fifth: bool) -> f32 {
    let bb = if fifth { 176 } else { 144 };
    assert_eq!(w.len(), a.len() * bb);
    let dtype = if fifth { DType::Q5_K } else { DType::Q4_K };
    let lanes = order == KOrder::Lanes;
    accumulate(
        order,
        dtype,
        w.chunks_exact(bb).zip(a).map(|(b, x)| {
            let (scales, qh, qs) = if fifth {
                (&b[4..16], Some(&b[16..48]), &b[48..176])
            } else {
                (&b[4..16], None, &b[16..144])
            };
            let sums = if order == KOrder::Slices {
                qk45_sums::<true>(scales, qh, qs, x, lanes)
            } else {
                qk45_sums::<false>(scales, qh, qs, x, lanes)
            };
            (f16_at(b, 0), f16_at(b, 2), sums, x.d)
        }),
    )
}

/// Q4_K weights · Q8_K activations.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) fn dot_q4_k_q8k(w: &[u8], a: &[BlockQ8K], order: KOrder) -> f32 {
    dot_qk45_q8k(w, a, order, false)
}

/// Q5_K weights · Q8_K activations.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) fn dot_q5_k_q8k(w: &[u8], a: &[BlockQ8K], order: KOrder) -> f32 {
    dot_qk45_q8k(w, a, order, true)
}

/// Q6_K weights · Q8_K activations: the unsigned 6-bit values through `maddubs`, the −32
/// offset applied once per 16-element group through the activations' `bsums`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) fn dot_q6_k_q8k(w: &[u8], a: &[BlockQ8K], order: KOrder) -> f32 {
    assert_eq!(w.len(), a.len() * 210);
    debug_assert_ne!(order, KOrder::Slices, "Q6_K has no slices order");
    let m4 = _mm256_set1_epi8(0x0f);
    let m2 = _mm256_set1_epi8(3);
    accumulate(
        order,
        DType::Q6_K,
        w.chunks_exact(210).zip(a).map(|(b, x)| {
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
                    let hi =
                        _mm256_and_si256(_mm256_srl_epi16(h, _mm_cvtsi32_si128(2 * k as i32)), m2);
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
            let sums = BlockSums::whole(hsum_i32(acc) - q6_offset_term(sc, x), 0);
            let sums = if order == KOrder::Lanes {
                // Lane `l` less `32 · (bsums[2l]·sc[2l] + bsums[2l+1]·sc[2l+1])` (its `q8sclsub`).
                // SAFETY: `bsums` is 16 i16 = 32 bytes; 16 scale bytes inside the block.
                let (bs, sc16) = unsafe {
                    (
                        _mm256_loadu_si256(x.bsums.as_ptr().cast()),
                        _mm256_cvtepi8_epi16(_mm_loadu_si128(sc.as_ptr().cast())),
                    )
                };
                let offsets = _mm256_slli_epi32::<5>(_mm256_madd_epi16(bs, sc16));
                sums.with_lanes(store_i32x8(_mm256_sub_epi32(acc, offsets)), [0; 4])
            } else {
                sums
            };
            (f16_at(b, 208), 0.0, sums, x.d)
        }),
    )
}

// ---- AVX-512 (F, BW, VNNI): 64 elements per instruction, one to four tokens per weight decode.

/// A K-quant super-block decoded for `maddubs`: four chunks of 64 unsigned quants, chunk `c`
/// against activations `64c .. 64c + 64`, and per chunk the 32 i16 scales of its `maddubs`
/// pairs (pair `p` covers elements `2p, 2p+1`).
struct Decoded {
    q: [__m512i; 4],
    sc: [__m512i; 4],
    /// Per activation `bsums[g]` (16-element group `g`), its i16 weight in the block's second
    /// integer: Q4_K/Q5_K: the group's sub-block min (`M = Σ m · bsums`); Q6_K: −32 · its
    /// scale, folded into `S` (the offset of the unsigned 6-bit values).
    bsum_weights: __m256i,
    /// Q6_K: `bsum_weights` belong to `S` (no `M`).
    fold_into_s: bool,
    /// Q3_K: `q` holds `value + 4`; `bsum_weights` (`−4 · scale`) subtract the 4s per group.
    plus4: bool,
}

#[inline]
#[target_feature(enable = "avx512f,avx512bw")]
fn join(lo: __m256i, hi: __m256i) -> __m512i {
    _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi)
}

#[inline]
#[target_feature(enable = "avx512f,avx512bw")]
fn load64_i8(p: &[i8]) -> __m512i {
    assert!(p.len() >= 64);
    // SAFETY: at least 64 bytes are readable at `p` (asserted); the load is unaligned.
    unsafe { _mm512_loadu_si512(p.as_ptr().cast()) }
}

/// A Q4_K (`qh` = None) or Q5_K block: chunk `c` is the low nibbles of bytes `32c..32c+32`
/// (sub-block 2c) then their high nibbles (2c+1), the fifth bits OR-ed in for Q5_K.
#[inline]
#[target_feature(enable = "avx2,avx512f,avx512bw")]
fn decode_qk45(scales: &[u8], qh: Option<&[u8]>, qs: &[u8]) -> Decoded {
    let hbits = qh.map(|h| load32(h));
    let pairs: [(u8, u8); 8] = std::array::from_fn(|j| scale_min_k4(j, scales));
    let mins: [i16; 16] = std::array::from_fn(|g| i16::from(pairs[g / 2].1));
    let mut d = Decoded {
        q: [_mm512_setzero_si512(); 4],
        sc: [_mm512_setzero_si512(); 4],
        // SAFETY: 16 i16 are 32 bytes.
        bsum_weights: unsafe { _mm256_loadu_si256(mins.as_ptr().cast()) },
        fold_into_s: false,
        plus4: false,
    };
    for c in 0..4 {
        let [lo, hi] = qk45_chunk(qs, hbits, c);
        let (sc0, sc1) = (pairs[2 * c].0, pairs[2 * c + 1].0);
        d.q[c] = join(lo, hi);
        d.sc[c] = join(
            _mm256_set1_epi16(i16::from(sc0)),
            _mm256_set1_epi16(i16::from(sc1)),
        );
    }
    d
}

/// For chunk `c` of a Q6_K block, the group (of 16 elements) of each `maddubs` pair: pairs
/// `8k .. 8k+8` are elements `16k .. 16k+16` of the chunk, group `4c + k`.
static Q6_GROUP_OF_PAIR: [[i16; 32]; 4] = {
    let mut t = [[0i16; 32]; 4];
    let mut c = 0;
    while c < 4 {
        let mut p = 0;
        while p < 32 {
            t[c][p] = (4 * c + p / 8) as i16;
            p += 1;
        }
        c += 1;
    }
    t
};

/// A Q6_K block: chunk `2h + p` is quarters `2p, 2p+1` of half `h` (the activations' order).
#[inline]
#[target_feature(enable = "avx2,avx512f,avx512bw")]
fn decode_q6k(b: &[u8]) -> Decoded {
    let (ql, qh, sc) = (&b[0..128], &b[128..192], &b[192..208]);
    let m4 = _mm256_set1_epi8(0x0f);
    let m2 = _mm256_set1_epi8(3);
    // SAFETY: `sc` is 16 bytes.
    let scales = unsafe { _mm_loadu_si128(sc.as_ptr().cast()) };
    let sc16 = _mm256_cvtepi8_epi16(scales);
    let mut d = Decoded {
        q: [_mm512_setzero_si512(); 4],
        sc: [_mm512_setzero_si512(); 4],
        // |scale| ≤ 128, so −32 · scale fits an i16.
        bsum_weights: _mm256_mullo_epi16(sc16, _mm256_set1_epi16(-32)),
        fold_into_s: true,
        plus4: false,
    };
    let sc16 = _mm512_castsi256_si512(sc16);
    for half in 0..2 {
        let ql0 = load32(&ql[64 * half..]);
        let ql1 = load32(&ql[64 * half + 32..]);
        let h = load32(&qh[32 * half..]);
        let lo = [
            _mm256_and_si256(ql0, m4),
            _mm256_and_si256(ql1, m4),
            _mm256_and_si256(_mm256_srli_epi16::<4>(ql0), m4),
            _mm256_and_si256(_mm256_srli_epi16::<4>(ql1), m4),
        ];
        let mut q = [_mm256_setzero_si256(); 4];
        for k in 0..4 {
            let hi = _mm256_and_si256(_mm256_srl_epi16(h, _mm_cvtsi32_si128(2 * k as i32)), m2);
            q[k] = _mm256_or_si256(lo[k], _mm256_slli_epi16::<4>(hi));
        }
        for p in 0..2 {
            let c = 2 * half + p;
            d.q[c] = join(q[2 * p], q[2 * p + 1]);
            // SAFETY: each table row is 32 i16 = 64 bytes.
            let idx = unsafe { _mm512_loadu_si512(Q6_GROUP_OF_PAIR[c].as_ptr().cast()) };
            d.sc[c] = _mm512_permutexvar_epi16(idx, sc16);
        }
    }
    d
}

/// A Q2_K (`hmask` = None) or Q3_K block: chunk `c` (elements `64c..64c+64`, half `n = c/2`)
/// is the 2-bit fields `2j, 2j+2` (`j = 2·(c % 2)`) of `qs[32n .. 32n+32]`, for Q3_K with the
/// high bit `4n + j` of `hmask` as bit 2 (an unsigned 0..=7; the −4 goes through `bsums`).
#[inline]
#[target_feature(enable = "avx2,avx512f,avx512bw")]
fn decode_q23k(
    qs: &[u8],
    hmask: Option<&[u8]>,
    group_scales: [i16; 16],
    bsum_weights: [i16; 16],
) -> Decoded {
    let m2 = _mm256_set1_epi8(3);
    let one = _mm256_set1_epi8(1);
    let h = hmask.map(|h| load32(h));
    // SAFETY: 16 i16 are 32 bytes.
    let sc16 = unsafe { _mm256_loadu_si256(group_scales.as_ptr().cast()) };
    let sc16 = _mm512_castsi256_si512(sc16);
    let mut d = Decoded {
        q: [_mm512_setzero_si512(); 4],
        sc: [_mm512_setzero_si512(); 4],
        // SAFETY: as above.
        bsum_weights: unsafe { _mm256_loadu_si256(bsum_weights.as_ptr().cast()) },
        fold_into_s: hmask.is_some(),
        plus4: hmask.is_some(),
    };
    for c in 0..4 {
        let (n, j) = (c / 2, 2 * (c % 2));
        let q = load32(&qs[32 * n..]);
        let mut field = [_mm256_setzero_si256(); 2];
        for (f, jj) in field.iter_mut().zip([j, j + 1]) {
            let v = _mm256_and_si256(_mm256_srl_epi16(q, _mm_cvtsi32_si128(2 * jj as i32)), m2);
            *f = match h {
                Some(h) => {
                    let bit = _mm256_srl_epi16(h, _mm_cvtsi32_si128((4 * n + jj) as i32));
                    _mm256_or_si256(v, _mm256_slli_epi16::<2>(_mm256_and_si256(bit, one)))
                }
                None => v,
            };
        }
        d.q[c] = join(field[0], field[1]);
        // SAFETY: each table row is 32 i16 = 64 bytes.
        let idx = unsafe { _mm512_loadu_si512(Q6_GROUP_OF_PAIR[c].as_ptr().cast()) };
        d.sc[c] = _mm512_permutexvar_epi16(idx, sc16);
    }
    d
}

/// Each token's [`BlockSums`]: `S = Σ_c Σ_pairs maddubs(q_c, a_c) · sc_c` (for Q6_K with
/// `−32 · Σ sc_g · bsums[g]` folded in) and `M = Σ_g min_g · bsums[g]` (Q4_K/Q5_K/Q2_K); split
/// into `slices` slices where `slices` > 0 (`crate::q8k::slices_of`: chunk `c` of 64 values
/// lies in slice `c · slices / 4`, and lane `l` of the mins' products — groups `2l`, `2l + 1` —
/// in slice `l · slices / 8`).
#[inline]
#[target_feature(enable = "avx2,avx512f,avx512bw,avx512vnni")]
fn block_sums<const T: usize>(
    d: &Decoded,
    a: [&BlockQ8K; T],
    slices: usize,
    lanes: bool,
) -> [BlockSums; T] {
    debug_assert!(slices == 0 || (!d.fold_into_s && (slices == 2 || slices == 4)));
    let mut out = [BlockSums::whole(0, 0); T];
    for t in 0..T {
        // SAFETY: `bsums` is 16 i16 = 32 bytes.
        let bsums = unsafe { _mm256_loadu_si256(a[t].bsums.as_ptr().cast()) };
        let weighted = _mm256_madd_epi16(bsums, d.bsum_weights);
        // Q3_K's lanes: llama.cpp's `vec_dot` subtracts the 4s per `maddubs` pair
        // (`maddubs(q + 4, a) − maddubs(4, a)`, exact), so each lane holds its own values' signed
        // products, not its 16-value groups' offsets.
        let signed = lanes && d.plus4;
        let chunk = |c: usize, acc: __m512i| {
            let x = load64_i8(&a[t].qs[64 * c..]);
            let mut p = _mm512_maddubs_epi16(d.q[c], x);
            if signed {
                p = _mm512_sub_epi16(p, _mm512_maddubs_epi16(_mm512_set1_epi8(4), x));
            }
            _mm512_dpwssd_epi32(acc, p, d.sc[c])
        };
        out[t] = if slices > 0 {
            let (mut s, mut m) = ([0i32; 4], [0i32; 4]);
            for c in 0..4 {
                s[c * slices / 4] += _mm512_reduce_add_epi32(chunk(c, _mm512_setzero_si512()));
            }
            let mut lanes = [0i32; 8];
            // SAFETY: 8 i32 = 32 bytes.
            unsafe { _mm256_storeu_si256(lanes.as_mut_ptr().cast(), weighted) };
            for (l, v) in lanes.iter().enumerate() {
                m[l * slices / 8] += v;
            }
            BlockSums::sliced(slices, s, m)
        } else {
            let mut acc = (0..4).fold(_mm512_setzero_si512(), |acc, c| chunk(c, acc));
            if d.fold_into_s && !signed {
                acc = _mm512_add_epi32(acc, _mm512_castsi256_si512(weighted));
            }
            let m = if d.fold_into_s { 0 } else { hsum_i32(weighted) };
            let sums = BlockSums::whole(_mm512_reduce_add_epi32(acc), m);
            if lanes {
                // i32 lane `L` of a chunk holds values `4L .. 4L + 4` of its 64, so lanes `l` and
                // `l + 8` hold `vec_dot` lane `l` (Q6_K's offsets, in lanes 0–7, are its too).
                let by_lane = _mm256_add_epi32(
                    _mm512_castsi512_si256(acc),
                    _mm512_extracti64x4_epi64::<1>(acc),
                );
                // Q4_K/Q5_K's mins by pair of sub-blocks: lanes `2p`, `2p + 1` of `weighted`.
                let pair_mins = if d.fold_into_s {
                    [0; 4]
                } else {
                    let w = store_i32x8(weighted);
                    std::array::from_fn(|p| w[2 * p] + w[2 * p + 1])
                };
                sums.with_lanes(store_i32x8(by_lane), pair_mins)
            } else {
                sums
            }
        };
    }
    out
}

/// One K-quant row · `T` tokens' Q8_K activations (1 ≤ T ≤ 4) in `order`, each token's result
/// the scalar reference's bits (`crate::q8k`: same integers, same float steps in the same
/// order).
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vnni")]
pub(crate) fn dot_kquant_512<const T: usize>(
    dtype: DType,
    order: KOrder,
    w: &[u8],
    a: [&[BlockQ8K]; T],
) -> [f32; T] {
    let bb = dtype.block_bytes();
    let n = w.len() / bb;
    assert!(w.len() == n * bb && a.iter().all(|x| x.len() == n));
    let slices = if order == KOrder::Slices {
        crate::q8k::slices_of(dtype)
    } else {
        0
    };
    assert!(
        order != KOrder::Slices || slices > 0,
        "{dtype:?} has no slices order"
    );
    let mut acc = [crate::q8k::Accumulator::new(order, dtype); T];
    let lanes = order == KOrder::Lanes;
    for (i, b) in w.chunks_exact(bb).enumerate() {
        let x: [&BlockQ8K; T] = std::array::from_fn(|t| &a[t][i]);
        let (d, dmin, sums) = match dtype {
            DType::Q4_K => {
                let dec = decode_qk45(&b[4..16], None, &b[16..144]);
                (
                    f16_at(b, 0),
                    f16_at(b, 2),
                    block_sums(&dec, x, slices, lanes),
                )
            }
            DType::Q5_K => {
                let dec = decode_qk45(&b[4..16], Some(&b[16..48]), &b[48..176]);
                (
                    f16_at(b, 0),
                    f16_at(b, 2),
                    block_sums(&dec, x, slices, lanes),
                )
            }
            DType::Q6_K => (
                f16_at(b, 208),
                0.0,
                block_sums(&decode_q6k(b), x, slices, lanes),
            ),
            DType::Q2_K => {
                let sc: [i16; 16] = std::array::from_fn(|g| i16::from(b[g] & 0x0f));
                let mins: [i16; 16] = std::array::from_fn(|g| i16::from(b[g] >> 4));
                let dec = decode_q23k(&b[16..80], None, sc, mins);
                (
                    f16_at(b, 80),
                    f16_at(b, 82),
                    block_sums(&dec, x, slices, lanes),
                )
            }
            DType::Q3_K => {
                let raw = scales_q3_k(&b[96..108]);
                let sc: [i16; 16] = std::array::from_fn(|g| i16::from(raw[g]) - 32);
                let offset: [i16; 16] = std::array::from_fn(|g| -4 * sc[g]);
                let dec = decode_q23k(&b[32..96], Some(&b[0..32]), sc, offset);
                (f16_at(b, 108), 0.0, block_sums(&dec, x, slices, lanes))
            }
            _ => unreachable!("{dtype:?} is not a K-quant"),
        };
        for t in 0..T {
            acc[t].add(d, dmin, &sums[t], x[t].d);
        }
    }
    acc.map(crate::q8k::Accumulator::finish)
}

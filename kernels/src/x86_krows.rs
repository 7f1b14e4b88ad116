//! AVX-512 VNNI kernels for K-quant prompt rows — llama.cpp's tiled order ([`KOrder::Tiled`]:
//! batches of eight or more tokens over Q5_K and Q6_K matrices) and its repacked Q4_K GEMM's
//! ([`KOrder::Slices`]) — sixteen weight rows per vector: i32 lane `r` of every accumulator is
//! row `r`, so no row is ever reduced across lanes.
//!
//! Why a second prompt layout (issue 38: Q5_K_M and Q6_K prefill at 0.8–0.95× llama.cpp, its
//! tiled kernel at ~40 % of the int8 peak, ours at ~32 %): the eight-row kernels
//! ([`crate::x86_kpack`]) keep sixteen 4-value groups of one row in a vector, so every
//! (row, token, super-block) ends in a `vpmulld` by the scales and a share of a transposing tree
//! to bring the row's sum into one lane, ~40 instructions per 32 `vpdpbusd`. Here a vector holds
//! the same four values of sixteen rows ([`RowBlock::codes`]) and a token's four activation bytes
//! are broadcast to it, so a sub-block's sums are already per row: one `vpmulld` scales sixteen
//! rows' sub-block sums for one token, the mins (Q5_K) and the −32 offsets (Q6_K) enter through
//! `vpdpwssd` with the activations' `bsums`, and the float epilogue is five instructions per
//! sixteen rows and token.
//!
//! The integers are the spec's exact sums (`crate::q8k`), in another order; the float steps are
//! the order's, so every output is the bits of the one-row kernel (tests below and `matmul`'s
//! packed-matrix test). Decode rows (other orders) stay with `x86_kpack`'s kernels.

use core::arch::x86_64::*;

use crate::pack::{CODE_BLOCK, Q8KLanes};
use crate::q8k::KOrder;
use crate::quant::DType;
use crate::x86_kpack::{Q4_K_GROUP_BLOCK, Q5_K_GROUP_BLOCK, Q6_K_GROUP_BLOCK, q4k_at, q6k_at};

/// Weight rows per vector (and per [`RowBlock`]): one i32 lane each.
pub(crate) const ROWS: usize = 16;

/// One super-block of sixteen weight rows (two packed groups of eight), unpacked for these
/// kernels. 64-byte aligned so that each vector is one cache line.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
pub(crate) struct RowBlock {
    /// `codes[4 j + k][r]`: row `r`'s values `16 j + 4 k .. 16 j + 4 k + 4` (natural order,
    /// 0..63), one byte each, little-endian — the four values a token's lane-order activation
    /// bytes `64 k + 4 j ..` multiply (`pack::lane_element`).
    codes: [[u32; ROWS]; 64],
    /// Q6_K: lane `r` of `scales[g]` row `r`'s i8 scale of 16-group `g`; Q4_K/Q5_K:
    /// `scales[s]`, its 6-bit scale of 32-value sub-block `s < 8`.
    scales: [[i32; ROWS]; 16],
    /// i16 pairs for `vpdpwssd`, lane `r` = (low, high): Q6_K `pairs[p]` = row `r`'s scales of
    /// groups `2p`, `2p + 1` (`p < 8`); Q4_K/Q5_K the mins of sub-blocks `2p`, `2p + 1` (`p < 4`).
    pairs: [[i16; 2 * ROWS]; 8],
    /// Each row's `d` as f32.
    d: [f32; ROWS],
    /// Each row's `dmin` as f32 (Q4_K/Q5_K).
    dmin: [f32; ROWS],
}

impl Default for RowBlock {
    fn default() -> Self {
        Self {
            codes: [[0; ROWS]; 64],
            scales: [[0; ROWS]; 16],
            pairs: [[0; 2 * ROWS]; 8],
            d: [0.0; ROWS],
            dmin: [0.0; ROWS],
        }
    }
}

/// Whether these kernels take some rows of `dtype` (which ones: [`Kind::of`] their order).
pub(crate) fn takes(dtype: DType) -> bool {
    matches!(dtype, DType::Q4_K | DType::Q5_K | DType::Q6_K)
}

/// Fills `out` (resized to `nb` blocks) from one or two packed groups of `dtype` (`groups`:
/// each group's packed bytes with its [`crate::x86_kpack::unpack_codes`] values); a missing
/// second group leaves rows 8–15 zero (their outputs, zero, are not stored).
pub(crate) fn unpack_rows(dtype: DType, groups: &[(&[u8], &[u8])], out: &mut Vec<RowBlock>) {
    assert!(takes(dtype) && (1..=2).contains(&groups.len()));
    let block = match dtype {
        DType::Q4_K => Q4_K_GROUP_BLOCK,
        DType::Q5_K => Q5_K_GROUP_BLOCK,
        _ => Q6_K_GROUP_BLOCK,
    };
    let nb = groups[0].0.len() / block;
    assert!(
        groups
            .iter()
            .all(|(g, c)| g.len() == nb * block && c.len() == nb * CODE_BLOCK)
    );
    out.clear();
    out.resize(nb, RowBlock::default());
    for (b, rb) in out.iter_mut().enumerate() {
        for (gi, (g, codes)) in groups.iter().enumerate() {
            let blk = &g[b * block..(b + 1) * block];
            let codes = &codes[b * CODE_BLOCK..(b + 1) * CODE_BLOCK];
            for r8 in 0..8 {
                let r = 8 * gi + r8;
                fill_row(dtype, blk, &codes[256 * r8..256 * (r8 + 1)], r8, r, rb);
            }
        }
    }
}

/// Row `r` of `rb` from row `r8` of a packed group block `blk` and its lane-order codes.
fn fill_row(dtype: DType, blk: &[u8], codes: &[u8], r8: usize, r: usize, rb: &mut RowBlock) {
    // Lane-order position 64 k + 4 j + i is natural element 16 j + 4 k + i. (Fixed-size
    // arrays: this runs for every row of every prompt matmul, ~6 % of a prefill as slices.)
    let codes: &[u8; 256] = codes.try_into().expect("256 values per row and block");
    for k in 0..4 {
        for j in 0..16 {
            let at = 64 * k + 4 * j;
            let four = [codes[at], codes[at + 1], codes[at + 2], codes[at + 3]];
            rb.codes[4 * j + k][r] = u32::from_le_bytes(four);
        }
    }
    let f16 = |at: usize| crate::quant::f16_at(blk, at);
    if dtype == DType::Q6_K {
        let sc = |g: usize| i16::from(blk[q6k_at::SCALES + 16 * r8 + g] as i8);
        for g in 0..16 {
            rb.scales[g][r] = i32::from(sc(g));
        }
        for p in 0..8 {
            rb.pairs[p][2 * r] = sc(2 * p);
            rb.pairs[p][2 * r + 1] = sc(2 * p + 1);
        }
        rb.d[r] = f16(q6k_at::D + 2 * r8);
    } else {
        let min = |s: usize| i16::from(blk[q4k_at::MINS + 16 * (s / 2) + 2 * r8 + s % 2]);
        for s in 0..8 {
            rb.scales[s][r] = i32::from(blk[q4k_at::SCALES + 8 * r8 + s]);
        }
        for p in 0..4 {
            rb.pairs[p][2 * r] = min(2 * p);
            rb.pairs[p][2 * r + 1] = min(2 * p + 1);
        }
        rb.d[r] = f16(q4k_at::D + 2 * r8);
        rb.dmin[r] = f16(q4k_at::DMIN + 2 * r8);
    }
}

/// What each (token, super-block) adds to the i16 pairs of [`RowBlock::pairs`], one i32 per
/// pair: Q6_K the `bsums` pairs as they lie; Q4_K/Q5_K the 32-value sums `S_s = bsums[2s] +
/// bsums[2s + 1]` of sub-blocks `2p`, `2p + 1`. Computed once per matmul part for all its groups.
pub(crate) fn pair_terms(dtype: DType, x: &Q8KLanes) -> [i32; 8] {
    let bs = &x.bsums;
    let word = |lo: i32, hi: i32| (lo as u16 as u32 | (hi as u16 as u32) << 16) as i32;
    if dtype == DType::Q6_K {
        std::array::from_fn(|p| word(bs[2 * p].into(), bs[2 * p + 1].into()))
    } else {
        let s = |i: usize| i32::from(bs[2 * i]) + i32::from(bs[2 * i + 1]);
        std::array::from_fn(|p| {
            if p < 4 {
                word(s(2 * p), s(2 * p + 1))
            } else {
                0
            }
        })
    }
}

/// What a call computes: the weight type and the float order (the pairs these kernels take).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    /// Q6_K in [`KOrder::Tiled`].
    Q6Tiled,
    /// Q5_K in [`KOrder::Tiled`].
    Q5Tiled,
    /// Q4_K in [`KOrder::Slices`] (llama.cpp's repacked GEMM, prompt rows in whole fours).
    Q4Slices,
}

impl Kind {
    /// The kind for rows of `dtype` in `order`, where these kernels take it.
    pub(crate) fn of(dtype: DType, order: KOrder) -> Option<Self> {
        match (dtype, order) {
            (DType::Q6_K, KOrder::Tiled) => Some(Self::Q6Tiled),
            (DType::Q5_K, KOrder::Tiled) => Some(Self::Q5Tiled),
            (DType::Q4_K, KOrder::Slices) => Some(Self::Q4Slices),
            _ => None,
        }
    }
}

/// [`Kind`] as a const parameter.
pub(crate) const Q6_TILED: u8 = 0;
pub(crate) const Q5_TILED: u8 = 1;
pub(crate) const Q4_SLICES: u8 = 2;

/// Sixteen rows (`rows`: one [`RowBlock`] per super-block) · `T` tokens' Q8_K activations in
/// lane order (`a[t]`, with their [`pair_terms`] `terms[t]`): `out[t][r]` is the bits of
/// `q8k::scalar_dot(dtype)(row r, a[t], order)` for the [`Kind`] `K` names.
#[target_feature(enable = "avx2,fma,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(crate) fn dot16<const T: usize, const K: u8>(
    rows: &[RowBlock],
    a: [&[Q8KLanes]; T],
    terms: [&[[i32; 8]]; T],
) -> [[f32; ROWS]; T] {
    let nb = rows.len();
    assert!(a.iter().all(|x| x.len() == nb) && terms.iter().all(|x| x.len() == nb));
    let (mut acc, mut accm) = ([_mm512_setzero_ps(); T], [_mm512_setzero_ps(); T]);
    for (b, rb) in rows.iter().enumerate() {
        let x: [&Q8KLanes; T] = std::array::from_fn(|t| &a[t][b]);
        let load = |v: &[f32; ROWS]| {
            // SAFETY: 16 f32 = 64 bytes.
            unsafe { _mm512_loadu_ps(v.as_ptr()) }
        };
        let (d, dmin) = (load(&rb.d), load(&rb.dmin));
        if K == Q4_SLICES {
            // Per slice of 64 values (sub-blocks 2p, 2p + 1): `acc ← fma(S_p, d·da, acc)`,
            // `accm ← fma(M_p, dmin·da, accm)`.
            let dd: [__m512; T] = std::array::from_fn(|t| _mm512_mul_ps(d, _mm512_set1_ps(x[t].d)));
            let dm: [__m512; T] =
                std::array::from_fn(|t| _mm512_mul_ps(dmin, _mm512_set1_ps(x[t].d)));
            for p in 0..4 {
                let s = sub_block_sums::<T, 2>(rb, &x, 2 * p..2 * p + 2);
                for t in 0..T {
                    acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[t]), dd[t], acc[t]);
                    let m = pairs_dot(rb, &terms[t][b], p..p + 1);
                    accm[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(m), dm[t], accm[t]);
                }
            }
            continue;
        }
        let s1 = if K == Q6_TILED {
            sub_block_sums::<T, 1>(rb, &x, 0..16)
        } else {
            sub_block_sums::<T, 2>(rb, &x, 0..8)
        };
        for t in 0..T {
            let da = _mm512_set1_ps(x[t].d);
            let r = if K == Q6_TILED {
                // S = Σ sc·Σ q·a − 32 Σ sc·bsums: exact (|S| < 2^29).
                let pair_sums = pairs_dot(rb, &terms[t][b], 0..8);
                let s = _mm512_sub_epi32(s1[t], _mm512_slli_epi32::<5>(pair_sums));
                _mm512_mul_ps(_mm512_cvtepi32_ps(s), d)
            } else {
                // `r = S·d`, then `fma(−dmin, M, r)`.
                let pair_sums = pairs_dot(rb, &terms[t][b], 0..4);
                let r = _mm512_mul_ps(_mm512_cvtepi32_ps(s1[t]), d);
                _mm512_fnmadd_ps(dmin, _mm512_cvtepi32_ps(pair_sums), r)
            };
            acc[t] = _mm512_fmadd_ps(r, da, acc[t]);
        }
    }
    std::array::from_fn(|t| {
        let mut o = [0.0f32; ROWS];
        // Slices: the spec's `acc − accm`; Tiled: `acc` (`accm` stays +0, unused).
        let v = if K == Q4_SLICES {
            _mm512_sub_ps(acc[t], accm[t])
        } else {
            acc[t]
        };
        // SAFETY: 16 f32 = 64 bytes.
        unsafe { _mm512_storeu_ps(o.as_mut_ptr(), v) };
        o
    })
}

/// Per token, sixteen rows' `Σ_s scale_s · Σ_{sub-block s} q·a` over sub-blocks `subs` of one
/// super-block: sub-blocks of `G` 16-value groups (Q6_K 1, Q4_K/Q5_K 2), each group four
/// `vpdpbusd` (one 64-byte weight vector, each token's four bytes broadcast), one `vpmulld` per
/// sub-block and token. Exact: a sub-block's sum is below 2^17, its scaled sum below 2^24.
#[inline]
#[target_feature(enable = "avx2,avx512f,avx512bw,avx512vnni")]
fn sub_block_sums<const T: usize, const G: usize>(
    rb: &RowBlock,
    x: &[&Q8KLanes; T],
    subs: std::ops::Range<usize>,
) -> [__m512i; T] {
    let mut s1 = [_mm512_setzero_si512(); T];
    for s in subs {
        let mut sub = [_mm512_setzero_si512(); T];
        for j in G * s..G * (s + 1) {
            for k in 0..4 {
                // SAFETY: 64 bytes, one cache line of `rb`.
                let w = unsafe { _mm512_load_si512(rb.codes[4 * j + k].as_ptr().cast()) };
                for t in 0..T {
                    let at = 64 * k + 4 * j;
                    // SAFETY: four bytes inside the token's 256 quants.
                    let four = unsafe { x[t].qs.as_ptr().add(at).cast::<i32>().read_unaligned() };
                    sub[t] = _mm512_dpbusd_epi32(sub[t], w, _mm512_set1_epi32(four));
                }
            }
        }
        // SAFETY: 16 i32 = 64 bytes, aligned.
        let sc = unsafe { _mm512_load_si512(rb.scales[s].as_ptr().cast()) };
        for t in 0..T {
            s1[t] = _mm512_add_epi32(s1[t], _mm512_mullo_epi32(sub[t], sc));
        }
    }
    s1
}

/// `Σ_{p ∈ pairs}` of the i16 pairs `rb.pairs[p]` (per row) times the token's pair `terms[p]`.
#[inline]
#[target_feature(enable = "avx512f,avx512vnni")]
fn pairs_dot(rb: &RowBlock, terms: &[i32; 8], pairs: std::ops::Range<usize>) -> __m512i {
    let mut v = _mm512_setzero_si512();
    for p in pairs {
        // SAFETY: 32 i16 = 64 bytes, aligned.
        let w = unsafe { _mm512_load_si512(rb.pairs[p].as_ptr().cast()) };
        v = _mm512_dpwssd_epi32(v, w, _mm512_set1_epi32(terms[p]));
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::matmul::QMatrix;
    use crate::pack::PackedRows;
    use crate::q8k::{BlockQ8K, KOrder, quantize_row_q8_k, scalar_dot};
    use crate::quant::QK_K;

    /// Random `dtype` blocks: random bytes, the f16 scales finite and small.
    fn random_rows(dtype: DType, rows: usize, cols: usize, seed: &mut u64) -> Vec<u8> {
        let n = rows * cols / QK_K * dtype.block_bytes();
        let r = crate::test_util::rand_f32(n, seed);
        let mut bytes: Vec<u8> = r.iter().map(|v| ((v + 1.0) * 127.9) as u8).collect();
        let scales: &[usize] = if dtype == DType::Q6_K {
            &[208]
        } else {
            &[0, 2]
        };
        for blk in bytes.chunks_mut(dtype.block_bytes()) {
            for &o in scales {
                let v = (f32::from(blk[o]) - 128.0) / 8192.0 + 1e-4;
                blk[o..o + 2].copy_from_slice(&half::f16::from_f32(v).to_le_bytes());
            }
        }
        bytes
    }

    /// Every output of [`dot16`], each kind, one and two groups, 1–8 tokens, equals the spec's
    /// one-row dot product in the kind's order bit for bit.
    #[test]
    fn sixteen_rows_give_the_one_row_bits() {
        if !crate::pack::available() {
            custody_test_skip::skip(
                "kernels::x86_krows::sixteen_rows_give_the_one_row_bits",
                "no AVX-512 F/BW/VL/VNNI on this machine",
                custody_test_skip::Need::Optional,
            );
            return;
        }
        let mut seed = 0x5eed;
        for (dtype, order) in [
            (DType::Q4_K, KOrder::Slices),
            (DType::Q5_K, KOrder::Tiled),
            (DType::Q6_K, KOrder::Tiled),
        ] {
            let kind = Kind::of(dtype, order).expect("a kind");
            let (rows, cols) = (16, 3 * QK_K);
            let w = random_rows(dtype, rows, cols, &mut seed);
            let m = QMatrix::new(dtype, rows, cols, &w).expect("shape");
            let pk = PackedRows::new(&m).expect("packs here");
            let x: Vec<Vec<BlockQ8K>> = (0..8)
                .map(|_| {
                    let f = crate::test_util::rand_f32(cols, &mut seed);
                    let mut q = vec![BlockQ8K::default(); cols / QK_K];
                    quantize_row_q8_k(&f, &mut q);
                    q
                })
                .collect();
            let lanes: Vec<Vec<Q8KLanes>> = x
                .iter()
                .map(|r| r.iter().map(Q8KLanes::from).collect())
                .collect();
            let terms: Vec<Vec<[i32; 8]>> = lanes
                .iter()
                .map(|r| r.iter().map(|b| pair_terms(dtype, b)).collect())
                .collect();
            let mut codes = [Vec::new(), Vec::new()];
            for (g, c) in codes.iter_mut().enumerate() {
                pk.unpack_group(g, c);
            }
            let row_bytes = w.len() / rows;
            for n_groups in [1, 2] {
                let groups: Vec<(&[u8], &[u8])> = (0..n_groups)
                    .map(|g| (pk.group(g), &codes[g][..]))
                    .collect();
                let mut rb = Vec::new();
                unpack_rows(dtype, &groups, &mut rb);
                let got = run(kind, &rb, &lanes, &terms);
                for (t, out) in got.iter().enumerate() {
                    for r in 0..8 * n_groups {
                        let want =
                            scalar_dot(dtype)(&w[r * row_bytes..(r + 1) * row_bytes], &x[t], order);
                        assert_eq!(out[r].to_bits(), want.to_bits(), "{dtype:?} t{t} r{r}");
                    }
                }
            }
        }
    }

    /// All eight tokens, through [`dot16`] at 8 and in calls of 1, 3 and 4.
    fn run(
        kind: Kind,
        rb: &[RowBlock],
        a: &[Vec<Q8KLanes>],
        terms: &[Vec<[i32; 8]>],
    ) -> Vec<[f32; ROWS]> {
        macro_rules! call {
            ($t:literal, $t0:expr) => {{
                let aa: [&[Q8KLanes]; $t] = std::array::from_fn(|i| &a[$t0 + i][..]);
                let tt: [&[[i32; 8]]; $t] = std::array::from_fn(|i| &terms[$t0 + i][..]);
                // SAFETY: `pack::available()` checked by the caller.
                unsafe {
                    match kind {
                        Kind::Q6Tiled => dot16::<$t, Q6_TILED>(rb, aa, tt).to_vec(),
                        Kind::Q5Tiled => dot16::<$t, Q5_TILED>(rb, aa, tt).to_vec(),
                        Kind::Q4Slices => dot16::<$t, Q4_SLICES>(rb, aa, tt).to_vec(),
                    }
                }
            }};
        }
        let all = call!(8, 0);
        let mut split = call!(1, 0);
        split.extend(call!(3, 1));
        split.extend(call!(4, 4));
        assert!(
            all.iter()
                .zip(&split)
                .all(|(p, q)| p.iter().zip(q).all(|(u, v)| u.to_bits() == v.to_bits()))
        );
        all
    }
}

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
//! - The float part follows the path llama.cpp's CPU backend takes for the row on this kind of
//!   CPU (an AVX-512 build; `docs/llamacpp-kquant-arithmetic.md` reads it from the source
//!   compiled here), chosen by [`KOrder::for_row`] from the weight type, the matrix's rows and
//!   where the token row sits in the batch it was computed in ([`RowBatch`]). Super-block by
//!   super-block, `d`/`dmin` the weights' f16 scales as f32, `da` the activations':
//!   - [`KOrder::Block`] (its repacked Q4_K GEMV, and every small batch here):
//!     `acc ← fma(d·da, S, acc)`, `accm ← fma(dmin·da, M, accm)`; the dot product `acc − accm`;
//!   - [`KOrder::Slices`] (its repacked Q4_K and Q2_K GEMMs, rows in whole fours): the same two
//!     steps once per slice of the super-block, in order, `S` and `M` split into the slices'
//!     integer sums — Q4_K (and Q5_K, where asked) four slices of 64 values (pairs of
//!     sub-blocks), Q2_K two of 128;
//!   - [`KOrder::Tiled`] (its tiled VNNI path, batches of eight or more rows of a matrix it does
//!     not repack): `r = S·d`, `r ← fma(−dmin, M, r)`, `acc ← fma(r, da, acc)`; the dot product
//!     `acc`;
//!   - [`KOrder::Lanes`] (its AVX2 `vec_dot`, smaller batches of Q3_K–Q6_K matrices it does
//!     not repack — a decode step's): `S` in eight lanes (`S_l`: values `4l .. 4l + 4` of every
//!     32; Q6_K's −32 offsets by lane), `acc[l] ← fma(da·d, S_l, acc[l])`; mins Q4_K
//!     `accm[p] ← fma(−da·dmin, M_p, accm[p])` by pair, Q5_K `summs ← fma(−da·dmin, M,
//!     summs)`; the dot product `hsum_float_8(acc)` plus `(accm0 + accm2) + (accm1 + accm3)`
//!     or `summs`.
//!
//! Every kernel — the scalar reference here, the SIMD ones in `x86_kquant.rs` and
//! `x86_kpack.rs` — computes exactly this for the order it is given, so all are bit-identical
//! (tests), and a row's value depends on its request's batch, never on the rows of other
//! requests it happens to share a matmul with.
//!
//! What is not followed yet: llama.cpp's small-batch `vec_dot` for Q2_K matrices it does not
//! repack (rows not a multiple of eight). Those rows — prompts of fewer than eight tokens and
//! decode steps — take [`KOrder::Block`] and differ from llama.cpp's in float rounding only.

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

/// Where a token row sits in the batch of rows it was computed in: llama.cpp picks a K-quant
/// matmul's path by the number of rows in the call (one request's prompt chunk, or its one
/// decode token) and, for repacked Q4_K, by the row's index in it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RowBatch {
    /// Rows in the batch (≥ 1).
    pub len: u32,
    /// This row's index in it (< `len`).
    pub index: u32,
}

/// The float order of a K-quant dot product (the module's spec).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KOrder {
    /// One FMA pair per super-block (llama.cpp's repacked Q4_K and Q2_K GEMVs).
    Block,
    /// One FMA pair per slice of a super-block (its repacked Q4_K and Q2_K GEMMs; Q4_K, Q5_K
    /// and Q2_K only: [`slices_of`]).
    Slices,
    /// `r = S·d − dmin·M`, one FMA by `da` per super-block (its tiled VNNI path).
    Tiled,
    /// Eight partial lanes per row, summed at the end (its AVX2 `vec_dot`, small batches of
    /// Q3_K–Q6_K matrices it does not repack; [`has_lanes`]).
    Lanes,
}

impl KOrder {
    /// Batches from which llama.cpp runs its tiled path (`ggml_tiled_min_batch`).
    pub const TILED_MIN_ROWS: u32 = 8;
    /// Rows per repacked group (`ne[1] % 8 == 0` repacks Q4_K on AVX2+ machines).
    const REPACK_ROWS: usize = 8;

    /// The order llama.cpp's CPU backend follows for a row of a `rows`-row `dtype` matrix at
    /// `at` in its batch (`docs/llamacpp-kquant-arithmetic.md` §5).
    pub fn for_row(dtype: DType, rows: usize, at: RowBatch) -> Self {
        Self::for_path(Self::path(dtype, rows), at)
    }

    /// Whether llama.cpp runs a `rows`-row `dtype` matrix through its repacked GEMM/GEMV
    /// (Q4_K, and Q2_K on AVX-512 machines, in whole groups of eight rows) rather than its
    /// tiled path and `vec_dot`.
    pub(crate) fn repacked_gemm(dtype: DType, rows: usize) -> bool {
        matches!(dtype, DType::Q4_K | DType::Q2_K) && rows.is_multiple_of(Self::REPACK_ROWS)
    }

    /// llama.cpp's family of paths for a `rows`-row `dtype` matrix.
    pub(crate) fn path(dtype: DType, rows: usize) -> KPath {
        if Self::repacked_gemm(dtype, rows) {
            KPath::Repacked
        } else if has_lanes(dtype) {
            KPath::TiledOrLanes
        } else {
            KPath::TiledOrBlock
        }
    }

    /// [`KOrder::for_row`] given the matrix's [`KPath`].
    pub(crate) fn for_path(path: KPath, at: RowBatch) -> Self {
        debug_assert!(at.len >= 1 && at.index < at.len, "{at:?}");
        match path {
            // The GEMM for the rows in whole fours, the GEMV for the rest.
            KPath::Repacked if at.index < at.len / 4 * 4 => Self::Slices,
            KPath::Repacked => Self::Block,
            _ if at.len >= Self::TILED_MIN_ROWS => Self::Tiled,
            KPath::TiledOrLanes => Self::Lanes,
            KPath::TiledOrBlock => Self::Block,
        }
    }
}

/// The families of llama.cpp's K-quant matmul paths: a matrix's rows take one of two orders by
/// their batch ([`KOrder::for_path`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum KPath {
    /// Its repacked GEMM ([`KOrder::Slices`]) and GEMV ([`KOrder::Block`]).
    Repacked,
    /// Its tiled path ([`KOrder::Tiled`]) and `vec_dot` ([`KOrder::Lanes`]).
    TiledOrLanes,
    /// Its tiled path and a `vec_dot` whose order is not followed (Q2_K it does not repack:
    /// [`KOrder::Block`]).
    TiledOrBlock,
}

impl KPath {
    pub(crate) const ALL: [Self; 3] = [Self::Repacked, Self::TiledOrLanes, Self::TiledOrBlock];
}

/// Whether [`KOrder::Lanes`] applies to `dtype`.
pub(crate) const fn has_lanes(dtype: DType) -> bool {
    matches!(dtype, DType::Q3_K | DType::Q4_K | DType::Q5_K | DType::Q6_K)
}

/// Slices of a super-block in [`KOrder::Slices`] (0: the type has no such order).
pub(crate) const fn slices_of(dtype: DType) -> usize {
    match dtype {
        DType::Q4_K | DType::Q5_K => 4,
        DType::Q2_K => 2,
        _ => 0,
    }
}

/// A super-block's exact integer sums: `s` (quants × activations, scaled) and `m` (the mins'
/// term; 0 for Q6_K/Q3_K); where computed, also by slice for [`KOrder::Slices`] (`slices`
/// of them, [`slices_of`]: `slices_s[k]` covers values `k · 256 / slices ..`; they sum to `s`
/// and `m`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct BlockSums {
    pub(crate) s: i32,
    pub(crate) m: i32,
    pub(crate) slices: usize,
    pub(crate) slices_s: [i32; 4],
    pub(crate) slices_m: [i32; 4],
    /// [`KOrder::Lanes`] (where computed).
    pub(crate) lanes: Option<LaneSums>,
}

/// A block's sums as llama.cpp's `vec_dot` holds them ([`KOrder::Lanes`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct LaneSums {
    /// `S` by lane: lane `l` holds values `4l .. 4l + 4` of every 32 (Q6_K: with the −32 offsets
    /// of 16-value groups `2l`, `2l + 1`); they sum to `s`.
    pub(crate) s: [i32; 8],
    /// Q4_K: `M` by pair of sub-blocks (its four mins' lanes); they sum to `m`. Zero elsewhere.
    pub(crate) pair_mins: [i32; 4],
}

impl BlockSums {
    /// Sums not split by slice.
    pub(crate) const fn whole(s: i32, m: i32) -> Self {
        Self {
            s,
            m,
            slices: 0,
            slices_s: [0; 4],
            slices_m: [0; 4],
            lanes: None,
        }
    }

    /// With `S` by `vec_dot` lane, and (Q4_K; zeros elsewhere) `M` by pair of sub-blocks.
    pub(crate) fn with_lanes(self, s: [i32; 8], pair_mins: [i32; 4]) -> Self {
        debug_assert_eq!(s.iter().sum::<i32>(), self.s);
        debug_assert!(pair_mins == [0; 4] || pair_mins.iter().sum::<i32>() == self.m);
        Self {
            lanes: Some(LaneSums { s, pair_mins }),
            ..self
        }
    }

    /// Sums split into `slices` slices (the first `slices` entries).
    pub(crate) fn sliced(slices: usize, slices_s: [i32; 4], slices_m: [i32; 4]) -> Self {
        debug_assert!(slices == 2 || slices == 4);
        Self {
            s: slices_s[..slices].iter().sum(),
            m: slices_m[..slices].iter().sum(),
            slices,
            slices_s,
            slices_m,
            lanes: None,
        }
    }
}

/// One row's float accumulators under an order (the module's spec), block by block.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Accumulator {
    order: KOrder,
    /// The mins' term under [`KOrder::Lanes`].
    lane_mins: LaneMins,
    acc: f32,
    accm: f32,
    /// [`KOrder::Lanes`]: the eight lanes, and Q4_K's four mins' lanes.
    lanes: [f32; 8],
    mins: [f32; 4],
}

/// How llama.cpp's `vec_dot` accumulates a type's mins ([`KOrder::Lanes`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum LaneMins {
    /// Q6_K: none.
    None,
    /// Q4_K: four lanes (the pairs of sub-blocks), `((m0 + m2) + (m1 + m3))` at the end.
    Pairs,
    /// Q5_K: one scalar, `summs ← fma(dmin, M, summs)`.
    Total,
}

impl Accumulator {
    pub(crate) const fn new(order: KOrder, dtype: DType) -> Self {
        Self {
            order,
            lane_mins: match dtype {
                DType::Q4_K => LaneMins::Pairs,
                DType::Q5_K => LaneMins::Total,
                _ => LaneMins::None,
            },
            acc: 0.0,
            accm: 0.0,
            lanes: [0.0; 8],
            mins: [0.0; 4],
        }
    }

    /// Adds one super-block: the weights' `d`, `dmin`, its sums, the activations' `da`.
    #[inline(always)]
    pub(crate) fn add(&mut self, d: f32, dmin: f32, sums: &BlockSums, da: f32) {
        match self.order {
            KOrder::Block => {
                self.acc = (d * da).mul_add(sums.s as f32, self.acc);
                self.accm = (dmin * da).mul_add(sums.m as f32, self.accm);
            }
            KOrder::Slices => {
                assert!(sums.slices > 0, "sums not split by slice");
                for (s, m) in sums.slices_s.iter().zip(&sums.slices_m).take(sums.slices) {
                    self.acc = (d * da).mul_add(*s as f32, self.acc);
                    self.accm = (dmin * da).mul_add(*m as f32, self.accm);
                }
            }
            KOrder::Tiled => {
                let r = (-dmin).mul_add(sums.m as f32, sums.s as f32 * d);
                self.acc = r.mul_add(da, self.acc);
            }
            KOrder::Lanes => {
                let lanes = sums.lanes.expect("sums not split by lane");
                // `d = y.d · x.d`, `dmin = −y.d · x.dmin`, as its source writes them.
                let (dl, dm) = (da * d, -da * dmin);
                for (acc, v) in self.lanes.iter_mut().zip(lanes.s) {
                    *acc = dl.mul_add(v as f32, *acc);
                }
                match self.lane_mins {
                    LaneMins::None => {}
                    LaneMins::Pairs => {
                        for (acc, m) in self.mins.iter_mut().zip(lanes.pair_mins) {
                            *acc = dm.mul_add(m as f32, *acc);
                        }
                    }
                    LaneMins::Total => self.accm = dm.mul_add(sums.m as f32, self.accm),
                }
            }
        }
    }

    /// The dot product.
    pub(crate) fn finish(self) -> f32 {
        match self.order {
            KOrder::Block | KOrder::Slices => self.acc - self.accm,
            KOrder::Tiled => self.acc,
            KOrder::Lanes => {
                let lanes = hsum_float_8(self.lanes);
                match self.lane_mins {
                    LaneMins::None => lanes,
                    LaneMins::Pairs => {
                        let m = self.mins;
                        lanes + ((m[0] + m[2]) + (m[1] + m[3]))
                    }
                    LaneMins::Total => lanes + self.accm,
                }
            }
        }
    }
}

/// ggml's `hsum_float_8` (`arch/x86/quants.c`): `((x0 + x4) + (x2 + x6)) + ((x1 + x5) + (x3 +
/// x7))`.
pub(crate) fn hsum_float_8(x: [f32; 8]) -> f32 {
    ((x[0] + x[4]) + (x[2] + x[6])) + ((x[1] + x[5]) + (x[3] + x[7]))
}

/// The spec's float part over a row's blocks: `blocks` yields each block's `(d_w, dmin_w)`
/// with its [`BlockSums`] and the activation block's `d`.
#[inline(always)]
pub(crate) fn accumulate(
    order: KOrder,
    dtype: DType,
    blocks: impl Iterator<Item = (f32, f32, BlockSums, f32)>,
) -> f32 {
    let mut acc = Accumulator::new(order, dtype);
    for (d, dmin, sums, da) in blocks {
        acc.add(d, dmin, &sums, da);
    }
    acc.finish()
}

/// The mins' term of a Q4_K/Q5_K block by pair of sub-blocks: `[p] = Σ_{j ∈ {2p, 2p+1}} m_j ·
/// (bsums[2j] + bsums[2j+1])`.
#[inline(always)]
pub(crate) fn mins_terms(scales: &[u8], a: &BlockQ8K) -> [i32; 4] {
    std::array::from_fn(|p| {
        (2 * p..2 * p + 2)
            .map(|j| {
                let (_, m) = scale_min_k4(j, scales);
                i32::from(m) * (i32::from(a.bsums[2 * j]) + i32::from(a.bsums[2 * j + 1]))
            })
            .sum()
    })
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
    let mut slices_s = [0i32; 4];
    // `vec_dot` lane `l`: values `4l .. 4l + 4` of each 32-value sub-block.
    let mut lanes = [0i32; 8];
    for (c, pair) in slices_s.iter_mut().enumerate() {
        let (sc0, _) = scale_min_k4(2 * c, scales);
        let (sc1, _) = scale_min_k4(2 * c + 1, scales);
        let (mut s0, mut s1) = ([0i32; 8], [0i32; 8]);
        for l in 0..32 {
            let q = qs[32 * c + l];
            s0[l / 4] += i32::from((q & 0x0f) | fifth(l, 2 * c)) * i32::from(a.qs[64 * c + l]);
            s1[l / 4] +=
                i32::from((q >> 4) | fifth(l, 2 * c + 1)) * i32::from(a.qs[64 * c + 32 + l]);
        }
        for (lane, (v0, v1)) in lanes.iter_mut().zip(s0.iter().zip(&s1)) {
            *lane += i32::from(sc0) * v0 + i32::from(sc1) * v1;
        }
        *pair = i32::from(sc0) * s0.iter().sum::<i32>() + i32::from(sc1) * s1.iter().sum::<i32>();
    }
    let pair_mins = mins_terms(scales, a);
    BlockSums::sliced(4, slices_s, pair_mins).with_lanes(lanes, pair_mins)
}

fn q6_k_sums(b: &[u8], a: &BlockQ8K) -> BlockSums {
    let (ql, qh, sc) = (&b[0..128], &b[128..192], &b[192..208]);
    let scale = |g: usize| i32::from(sc[g] as i8);
    let mut s = 0i32;
    // `vec_dot` lane `l`: the unsigned values `4l .. 4l + 4` of each 32 (scaled by their
    // 16-value group's scale), less `32 · (bsums[2l]·sc[2l] + bsums[2l+1]·sc[2l+1])`.
    let mut lanes: [i32; 8] = std::array::from_fn(|l| {
        -32 * (i32::from(a.bsums[2 * l]) * scale(2 * l)
            + i32::from(a.bsums[2 * l + 1]) * scale(2 * l + 1))
    });
    for half in 0..2 {
        for k in 0..4 {
            for g in 0..2 {
                let mut sum = 0i32;
                for l in 16 * g..16 * g + 16 {
                    let byte = ql[64 * half + l + 32 * (k & 1)];
                    let lo = if k < 2 { byte & 0x0f } else { byte >> 4 };
                    let hi = (qh[32 * half + l] >> (2 * k)) & 3;
                    let q = i32::from(lo | (hi << 4));
                    lanes[l / 4] +=
                        scale(8 * half + 2 * k + g) * q * i32::from(a.qs[128 * half + 32 * k + l]);
                    sum += (q - 32) * i32::from(a.qs[128 * half + 32 * k + l]);
                }
                s += scale(8 * half + 2 * k + g) * sum;
            }
        }
    }
    BlockSums::whole(s, 0).with_lanes(lanes, [0; 4])
}

fn q2_k_sums(b: &[u8], a: &BlockQ8K) -> BlockSums {
    let (sc, qs) = (&b[0..16], &b[16..80]);
    // By half (128 values, groups 8h .. 8h + 8).
    let (mut s, mut m) = ([0i32; 4], [0i32; 4]);
    for g in 0..16 {
        let sum: i32 = (16 * g..16 * g + 16)
            .map(|e| i32::from(q2_at(qs, e)) * i32::from(a.qs[e]))
            .sum();
        s[g / 8] += i32::from(sc[g] & 0x0f) * sum;
        m[g / 8] += i32::from(sc[g] >> 4) * i32::from(a.bsums[g]);
    }
    BlockSums::sliced(2, s, m)
}

fn q3_k_sums(b: &[u8], a: &BlockQ8K) -> BlockSums {
    let (hmask, qs) = (&b[0..32], &b[32..96]);
    let scales = scales_q3_k(&b[96..108]);
    let mut s = 0i32;
    // `vec_dot` lane `l`: the signed values `4l .. 4l + 4` of each 32, scaled by their group's.
    let mut lanes = [0i32; 8];
    for (g, &sc) in scales.iter().enumerate() {
        let mut sum = 0i32;
        for e in 16 * g..16 * g + 16 {
            let q = i32::from(q2_at(qs, e)) - if q3_high_at(hmask, e) { 0 } else { 4 };
            let p = q * i32::from(a.qs[e]);
            sum += p;
            lanes[(e % 32) / 4] += (i32::from(sc) - 32) * p;
        }
        s += (i32::from(sc) - 32) * sum;
    }
    BlockSums::whole(s, 0).with_lanes(lanes, [0; 4])
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

/// Scalar reference: a row of K-quant `dtype` weights · its Q8_K activations (the spec) in
/// `order`.
pub fn dot_scalar(dtype: DType, order: KOrder, w: &[u8], a: &[BlockQ8K]) -> f32 {
    let bb = dtype.block_bytes();
    debug_assert_eq!(w.len(), a.len() * bb);
    debug_assert!(
        order != KOrder::Slices || slices_of(dtype) > 0,
        "{dtype:?} has no slices order"
    );
    accumulate(
        order,
        dtype,
        w.chunks_exact(bb).zip(a).map(|(b, x)| {
            let (d, dmin, sums) = block_terms(dtype, b, x);
            (d, dmin, sums, x.d)
        }),
    )
}

/// A K-quant row · Q8_K activations kernel in a given order.
pub type KDot = fn(&[u8], &[BlockQ8K], KOrder) -> f32;

/// The scalar reference of `dtype` (a K-quant), as a function pointer.
pub fn scalar_dot(dtype: DType) -> KDot {
    match dtype {
        DType::Q2_K => |w, a, o| dot_scalar(DType::Q2_K, o, w, a),
        DType::Q3_K => |w, a, o| dot_scalar(DType::Q3_K, o, w, a),
        DType::Q4_K => |w, a, o| dot_scalar(DType::Q4_K, o, w, a),
        DType::Q5_K => |w, a, o| dot_scalar(DType::Q5_K, o, w, a),
        DType::Q6_K => |w, a, o| dot_scalar(DType::Q6_K, o, w, a),
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

    /// The orders a `dtype` row can be computed in.
    pub(crate) fn orders_of(dtype: DType) -> Vec<KOrder> {
        let mut orders = vec![KOrder::Block, KOrder::Tiled];
        if slices_of(dtype) > 0 {
            orders.push(KOrder::Slices);
        }
        if has_lanes(dtype) {
            orders.push(KOrder::Lanes);
        }
        orders
    }

    /// llama.cpp's choice of path, case by case (docs/llamacpp-kquant-arithmetic.md §5).
    #[test]
    fn orders_follow_llama_cpps_choice_of_path() {
        let at = |len, index| RowBatch { len, index };
        // (type, matrix rows, batch length, row index, order)
        let cases = [
            (DType::Q4_K, 2048, 1, 0, KOrder::Block),
            (DType::Q4_K, 2048, 3, 2, KOrder::Block),
            (DType::Q4_K, 2048, 4, 3, KOrder::Slices),
            (DType::Q4_K, 2048, 43, 39, KOrder::Slices),
            (DType::Q4_K, 2048, 43, 40, KOrder::Block),
            (DType::Q4_K, 2048, 43, 42, KOrder::Block),
            (DType::Q4_K, 2044, 43, 0, KOrder::Tiled),
            (DType::Q4_K, 2044, 7, 0, KOrder::Lanes),
            (DType::Q5_K, 2048, 7, 6, KOrder::Lanes),
            (DType::Q5_K, 2048, 8, 7, KOrder::Tiled),
            (DType::Q6_K, 576, 512, 511, KOrder::Tiled),
            (DType::Q6_K, 576, 1, 0, KOrder::Lanes),
            (DType::Q3_K, 576, 9, 0, KOrder::Tiled),
            (DType::Q3_K, 576, 1, 0, KOrder::Lanes),
            (DType::Q2_K, 570, 1, 0, KOrder::Block),
            (DType::Q2_K, 576, 9, 0, KOrder::Slices),
            (DType::Q2_K, 576, 9, 8, KOrder::Block),
            (DType::Q2_K, 570, 9, 0, KOrder::Tiled),
        ];
        for (dtype, rows, len, index, want) in cases {
            assert_eq!(
                KOrder::for_row(dtype, rows, at(len, index)),
                want,
                "{dtype:?} rows {rows} at {index} of {len}"
            );
        }
    }

    /// The three orders are different arithmetic (a test of the tests: a kernel that ignored
    /// its order would pass the bit-for-bit comparisons only if they coincided).
    #[test]
    fn the_orders_round_differently() {
        let mut seed = 11u64;
        for dtype in [
            DType::Q4_K,
            DType::Q5_K,
            DType::Q6_K,
            DType::Q3_K,
            DType::Q2_K,
        ] {
            let w = weights(dtype, 8, &mut seed);
            let orders = orders_of(dtype);
            let mut differ = vec![false; orders.len()];
            for _ in 0..8 {
                let x = rand(8 * QK_K, &mut seed);
                let mut a = vec![BlockQ8K::default(); 8];
                quantize_row_q8_k(&x, &mut a);
                let block = scalar_dot(dtype)(&w, &a, KOrder::Block).to_bits();
                for (d, &o) in differ.iter_mut().zip(&orders) {
                    *d |= o == KOrder::Block || scalar_dot(dtype)(&w, &a, o).to_bits() != block;
                }
            }
            assert!(
                differ.iter().all(|&d| d),
                "{dtype:?}: {orders:?} {differ:?}"
            );
        }
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
            for order in orders_of(dtype) {
                let got = scalar_dot(dtype)(&w, &a, order);
                assert!(
                    (f64::from(got) - exact).abs() <= scale * 1e-5 + 1e-6,
                    "{dtype:?} {order:?}: {got} vs {exact}"
                );
            }
        }
    }
}

//! AVX-512 VNNI kernels over row-interleaved K-quant weights ([`crate::pack`]): eight rows ·
//! one to four tokens' Q8_K activations per super-block, every result the bits of the one-row
//! kernel (`crate::q8k`'s spec: the same exact integers, the same float steps in the same
//! block order, lane `r` of an 8-lane f32 accumulator standing for row `r`).
//!
//! Why a second layout (a profile of a 1B Q4_K_M decode, issue 38): the GGUF-layout kernel
//! spent more time decoding each super-block's packed 6-bit scales, converting its f16 scales
//! and reducing each row's 512-bit sum to a scalar than multiplying. Repacked at load, eight
//! rows' `d`/`dmin` are one f16x8 load each, each row's scales and mins are plain bytes, the
//! values are in lane order (`pack::lane_element`, the activations too: `pack::Q8KLanes`) so
//! one `dpbusd` per 64 values accumulates per-group sums that one `vpmulld` scales, and eight
//! rows' integer sums are reduced together (one transposing tree, [`sum8`]) before one FMA for
//! all eight.

use core::arch::x86_64::*;

use crate::pack::{CODE_BLOCK, Q8KLanes, Weights};
use crate::q8k::KOrder;

/// Bytes of one super-block of eight interleaved Q4_K rows: `d[8]`, `dmin[8]` (f16), each
/// row's 8 sub-block scales (u8), the mins as `[pair p][row][k]` (sub-block `2p + k`, u8),
/// then each row's 128 nibble bytes (byte `64h + k`: lane-order position `128h + k` low, `128h + 64 + k`
/// high). 32 bytes more than eight GGUF blocks (1,152): the scales unpacked.
pub(crate) const Q4_K_GROUP_BLOCK: usize = 1184;
/// Bytes of one super-block of eight interleaved Q6_K rows: `d[8]` (f16), each row's 16 i8
/// scales, then each row's 192 quant bytes: 128 of low nibbles (byte `k`: position `k` low,
/// `128 + k` high) and 64 of high bit pairs (bits `2j..2j+2` of byte `k`: position `64j + k`).
/// The same size as eight GGUF blocks.
pub(crate) const Q6_K_GROUP_BLOCK: usize = 1680;

/// Bytes of one super-block of eight interleaved Q5_K rows: the Q4_K layout, then each row's
/// 32 bytes of fifth bits in lane order (bit `p % 8` of byte `p / 8`: position `p`). 32 bytes more than
/// eight GGUF blocks (1,408).
pub(crate) const Q5_K_GROUP_BLOCK: usize = Q4_K_GROUP_BLOCK + 8 * 32;

/// Offsets inside a [`Q4_K_GROUP_BLOCK`] (and a [`Q5_K_GROUP_BLOCK`]).
pub(crate) mod q4k_at {
    pub(crate) const D: usize = 0;
    pub(crate) const DMIN: usize = 16;
    pub(crate) const SCALES: usize = 32;
    pub(crate) const MINS: usize = 96;
    pub(crate) const QS: usize = 160;
    /// Q5_K only: each row's 32 bytes of fifth bits.
    pub(crate) const HBITS: usize = super::Q4_K_GROUP_BLOCK;
}

/// Offsets inside a [`Q6_K_GROUP_BLOCK`].
pub(crate) mod q6k_at {
    pub(crate) const D: usize = 0;
    pub(crate) const SCALES: usize = 16;
    pub(crate) const QS: usize = 144;
    /// Quant bytes per row: 128 low-nibble bytes, then 64 high-pair bytes.
    pub(crate) const ROW: usize = 192;
}

/// Four vectors of 16 i32 reduced halfway: in each 128-bit quarter, lane `i` holds a partial
/// sum of `v[i]` (pairs interleaved, then quads). [`fold`] finishes two of them.
#[inline]
#[target_feature(enable = "avx2,avx512f")]
fn sum4(v: [__m512i; 4]) -> __m512i {
    // Per quarter: [a0+a2, b0+b2, a1+a3, b1+b3].
    let pair = |a, b| _mm512_add_epi32(_mm512_unpacklo_epi32(a, b), _mm512_unpackhi_epi32(a, b));
    let (p0, p1) = (pair(v[0], v[1]), pair(v[2], v[3]));
    _mm512_add_epi32(_mm512_unpacklo_epi64(p0, p1), _mm512_unpackhi_epi64(p0, p1))
}

/// `out[r] = Σ lanes of rows r` from [`sum4`] of rows 0–3 (`q0`) and 4–7 (`q1`): the 128-bit
/// quarters folded. With `sum4`, 24 instructions for eight rows where eight separate
/// reductions take ~64.
#[inline]
#[target_feature(enable = "avx2,avx512f")]
fn fold(q0: __m512i, q1: __m512i) -> __m256i {
    // [q0 quarters 0+1, q0 2+3, q1 0+1, q1 2+3].
    let z = _mm512_add_epi32(
        _mm512_shuffle_i64x2::<0b10_00_10_00>(q0, q1),
        _mm512_shuffle_i64x2::<0b11_01_11_01>(q0, q1),
    );
    let w = _mm512_shuffle_i64x2::<0b11_01_10_00>(z, z);
    _mm256_add_epi32(_mm512_castsi512_si256(w), _mm512_extracti64x4_epi64::<1>(w))
}

/// The i16 lane of `_mm256_hadd_epi16(bsums, bsums)` holding `bsums[2j] + bsums[2j+1]`.
const fn pair_sum_lane(j: usize) -> i16 {
    (if j < 4 { j } else { j + 4 }) as i16
}

/// For the mins' `madd`: lane `16p' + 2r + k` of register `h` (pairs `p = 2h + p'`) takes the
/// pair sum of sub-block `2p + k`.
static MIN_PAIR_LANES: [[i16; 32]; 2] = {
    let mut t = [[0i16; 32]; 2];
    let mut h = 0;
    while h < 2 {
        let mut lane = 0;
        while lane < 32 {
            let (p, k) = (2 * h + lane / 16, lane % 2);
            t[h][lane] = pair_sum_lane(2 * p + k);
            lane += 1;
        }
        h += 1;
    }
    t
};

#[inline]
#[target_feature(enable = "avx512f")]
fn load512(p: *const u8) -> __m512i {
    // SAFETY: callers pass a pointer with 64 readable bytes (inside a block whose bounds they
    // asserted); the load is unaligned.
    unsafe { _mm512_loadu_si512(p.cast()) }
}

#[inline]
#[target_feature(enable = "avx512f")]
fn load_i16x32(t: &[i16; 32]) -> __m512i {
    // SAFETY: 32 i16 are 64 bytes.
    unsafe { _mm512_loadu_si512(t.as_ptr().cast()) }
}

/// Each token's 8-lane accumulator, lane `r` row `r`, into `[token][row]`.
#[inline]
#[target_feature(enable = "avx")]
fn store8<const T: usize>(v: [__m256; T]) -> [[f32; 8]; T] {
    let mut out = [[0.0f32; 8]; T];
    for (o, v) in out.iter_mut().zip(v) {
        // SAFETY: `o` is 8 f32 = 32 bytes.
        unsafe { _mm256_storeu_ps(o.as_mut_ptr(), v) };
    }
    out
}

/// Bytes ahead of the super-block in hand that [`prefetch_block`] asks for: ~8 KB, what one
/// core's ~25 GB/s needs in flight to cover ~300 ns of memory latency and queueing (6–16
/// blocks of Q4_K measured alike; 2 or 4 fewer, or into L1, slower).
const PREFETCH_BYTES: usize = 8 * 1024;

/// Asks (into L2) for the cache lines of the super-block [`PREFETCH_BYTES`] after the one at
/// `blk`. The compiler orders a block's loads as it likes — it reversed them, and without
/// these hints a decode step ran at a quarter of the memory's pace, every block's first load
/// stalled; with them, at the old kernel's ~85 % of the bandwidth bound.
#[inline(always)]
fn prefetch_block(blk: *const u8, block_bytes: usize) {
    let ahead = blk.wrapping_add(PREFETCH_BYTES.next_multiple_of(block_bytes));
    for line in (0..block_bytes).step_by(64) {
        // SAFETY: a prefetch is a hint that never faults, whatever the address (`wrapping_add`
        // keeps the pointer arithmetic defined past the slice's end).
        unsafe { _mm_prefetch::<_MM_HINT_T1>(ahead.wrapping_add(line).cast()) };
    }
}

/// Multiply-accumulates per iteration of [`dpbusd_chains`]: 16 `vpdpbusd` of 64 products.
pub(crate) const MACS_PER_CHAIN_ITER: u64 = 16 * 64;

/// `iters` rounds of 16 independent `vpdpbusd` chains (enough in flight to cover the
/// instruction's latency on every core this runs on): `crate::simd::int8_dot_peak_macs_per_s`'s
/// probe. Returns a lane of the sums so the work cannot be elided.
#[target_feature(enable = "avx512f,avx512vnni")]
pub(crate) fn dpbusd_chains(iters: u64) -> i32 {
    // Distinct starting values: sixteen equal chains would be computed once and copied.
    let mut acc: [__m512i; 16] = std::array::from_fn(|i| _mm512_set1_epi32(i as i32));
    let b = _mm512_set1_epi8(5);
    for _ in 0..iters {
        // Opaque each round, so no round can be folded into another.
        let a = std::hint::black_box(_mm512_set1_epi8(3));
        for v in acc.iter_mut() {
            *v = _mm512_dpbusd_epi32(*v, a, b);
        }
    }
    let total = acc
        .iter()
        .fold(_mm512_setzero_si512(), |s, v| _mm512_add_epi32(s, *v));
    _mm512_reduce_add_epi32(total)
}

/// Rows per register tile: a tile's `4 × T` accumulators (16 at four tokens), two chunks of each
/// token's activations and one row's weights fit the 32 vector registers, so the inner loop
/// reads each weight and activation byte once per tile, never spilling a partial sum.
const TILE_ROWS: usize = 4;

/// Loads 64 bytes of each token's lane-order quants at `off` (a chunk's start).
#[inline]
#[target_feature(enable = "avx512f")]
fn load_chunk<const T: usize>(x: &[&Q8KLanes; T], off: usize) -> [__m512i; T] {
    std::array::from_fn(|t| load512(x[t].qs[off..off + 64].as_ptr().cast()))
}

/// `acc[t] += dpbusd(q, x[t])` for every token: u8 weights · i8 activations, four products per
/// i32 lane (lane `j`: group `j`), exact (no saturation).
#[inline]
#[target_feature(enable = "avx512f,avx512vnni")]
fn dpbusd_tokens<const T: usize>(acc: &mut [__m512i; T], q: __m512i, x: &[__m512i; T]) {
    for t in 0..T {
        acc[t] = _mm512_dpbusd_epi32(acc[t], q, x[t]);
    }
}

/// Row `r`'s values at lane-order positions `128 h..128 h + 64` and `128 h + 64..128 h + 128` in
/// a packed Q4_K (`FIFTH` = false) or Q5_K block: the low and the high nibbles of its quant
/// bytes `64 h..64 h + 64`, each with its fifth bit for Q5_K.
#[inline]
#[target_feature(enable = "avx2,avx512f,avx512bw")]
fn q45_values<const FIFTH: bool>(blk: &[u8], r: usize, h: usize) -> [__m512i; 2] {
    use q4k_at::*;
    let m4 = _mm512_set1_epi8(0x0f);
    let z = load512(blk[QS + 128 * r + 64 * h..QS + 128 * r + 64 * h + 64].as_ptr());
    let mut q = [
        _mm512_and_si512(z, m4),
        _mm512_and_si512(_mm512_srli_epi16::<4>(z), m4),
    ];
    if FIFTH {
        for (c, qc) in q.iter_mut().enumerate() {
            let k = 2 * h + c;
            let bits = &blk[HBITS + 32 * r + 8 * k..HBITS + 32 * r + 8 * k + 8];
            let mask = u64::from_le_bytes(bits.try_into().expect("8 bytes"));
            *qc = _mm512_mask_add_epi8(*qc, mask, *qc, _mm512_set1_epi8(16));
        }
    }
    q
}

/// Row `r`'s unsigned 6-bit values at lane-order positions `64 p..64 p + 64` and
/// `64 p + 128..64 p + 192` in a packed Q6_K block: the low and the high nibbles of its quant
/// bytes `64 p..`, bits 4–5 of both from the high-pair bytes.
#[inline]
#[target_feature(enable = "avx2,avx512f,avx512bw")]
fn q6_values(blk: &[u8], r: usize, p: usize) -> [__m512i; 2] {
    use q6k_at::*;
    let (m4, m30) = (_mm512_set1_epi8(0x0f), _mm512_set1_epi8(0x30));
    // `c ? a : b` bitwise (ternary-logic table 0xE4) with c = 0x0f: the low nibble from the
    // quant bytes, bits 4–5 from the high pairs (masked to 0x30).
    let blend = |lo, hi| _mm512_ternarylogic_epi32::<0xE4>(lo, hi, m4);
    let row = QS + ROW * r;
    let l = load512(blk[row + 64 * p..row + 64 * p + 64].as_ptr());
    let h = load512(blk[row + 128..row + 192].as_ptr());
    let (h_lo, h_hi) = if p == 0 {
        (_mm512_slli_epi16::<4>(h), h)
    } else {
        (_mm512_slli_epi16::<2>(h), _mm512_srli_epi16::<2>(h))
    };
    [
        blend(l, _mm512_and_si512(h_lo, m30)),
        blend(_mm512_srli_epi16::<4>(l), _mm512_and_si512(h_hi, m30)),
    ]
}

/// Row `r`'s two value vectors at lane-order positions `lo` and `hi` of block `b`'s codes.
#[inline]
#[target_feature(enable = "avx512f")]
fn code_values(codes: &[u8], b: usize, r: usize, lo: usize, hi: usize) -> [__m512i; 2] {
    let row = &codes[b * CODE_BLOCK + 256 * r..b * CODE_BLOCK + 256 * (r + 1)];
    [
        load512(row[lo..lo + 64].as_ptr()),
        load512(row[hi..hi + 64].as_ptr()),
    ]
}

/// Unpacks a packed group (`nb` super-blocks of `dtype` Q4_K, Q5_K or Q6_K) into `out`
/// (`nb` × [`CODE_BLOCK`] bytes): each value one byte, in the order the kernels read it.
#[target_feature(enable = "avx2,avx512f,avx512bw")]
pub(crate) fn unpack_codes(dtype: crate::quant::DType, g: &[u8], out: &mut [u8]) {
    use crate::quant::DType;
    let block = match dtype {
        DType::Q4_K => Q4_K_GROUP_BLOCK,
        DType::Q5_K => Q5_K_GROUP_BLOCK,
        DType::Q6_K => Q6_K_GROUP_BLOCK,
        other => unreachable!("{other:?} has no packed K-quant layout"),
    };
    let nb = g.len() / block;
    assert_eq!(g.len(), nb * block);
    assert_eq!(out.len(), nb * CODE_BLOCK);
    for b in 0..nb {
        let blk = &g[b * block..(b + 1) * block];
        for r in 0..8 {
            for pass in 0..2 {
                // Positions (lo, hi) of this pass's two vectors, as the kernels pair them.
                let (q, lo, hi) = match dtype {
                    DType::Q4_K => (
                        q45_values::<false>(blk, r, pass),
                        128 * pass,
                        128 * pass + 64,
                    ),
                    DType::Q5_K => (
                        q45_values::<true>(blk, r, pass),
                        128 * pass,
                        128 * pass + 64,
                    ),
                    _ => (q6_values(blk, r, pass), 64 * pass, 64 * pass + 128),
                };
                let row = &mut out[b * CODE_BLOCK + 256 * r..b * CODE_BLOCK + 256 * (r + 1)];
                for (v, at) in q.into_iter().zip([lo, hi]) {
                    // SAFETY: 64 bytes at `at` ≤ 192 inside the row's 256.
                    unsafe { _mm512_storeu_si512(row[at..at + 64].as_mut_ptr().cast(), v) };
                }
            }
        }
    }
}

/// Eight interleaved Q4_K rows (`FIFTH` = false; `g`: `nb` blocks of [`Q4_K_GROUP_BLOCK`]
/// bytes) or Q5_K rows (`FIFTH`; [`Q5_K_GROUP_BLOCK`]) · `T` Q8_K activation rows in lane order:
/// `out[t][r]` is the bits of `q8k::scalar_dot(Q4_K or Q5_K)(row r, a[t], order)` — each row's
/// integer `Σ_j scale_j · Σ q·a` is the same exact integer, reached in another order.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(crate) fn dot8_q45_k_packed<const T: usize, const FIFTH: bool>(
    g: &[u8],
    a: [&[Q8KLanes]; T],
    w: Weights,
    order: KOrder,
) -> [[f32; 8]; T] {
    // The order a const parameter: each kernel's epilogue compiled for one order (a runtime
    // choice inside the block loop cost decode ~8 %).
    match order {
        KOrder::Block => q45_weights::<T, FIFTH, ORDER_BLOCK>(g, a, w),
        KOrder::Slices => q45_weights::<T, FIFTH, ORDER_SLICES>(g, a, w),
        KOrder::Tiled => q45_weights::<T, FIFTH, ORDER_TILED>(g, a, w),
        KOrder::Lanes => {
            // llama.cpp never runs a matrix it repacks (every packed Q4_K) through `vec_dot`.
            assert!(FIFTH, "packed Q4_K has no lanes order");
            match w {
                Weights::Codes(c) => q5_lanes_kernel::<T, true>(g, c, a, false),
                Weights::FromMemory => q5_lanes_kernel::<T, false>(g, &[], a, true),
                Weights::Cached => q5_lanes_kernel::<T, false>(g, &[], a, false),
            }
        }
    }
}

/// [`KOrder`] as a const parameter.
const ORDER_BLOCK: u8 = 0;
const ORDER_SLICES: u8 = 1;
const ORDER_TILED: u8 = 2;

const fn order_of(order: u8) -> KOrder {
    match order {
        ORDER_BLOCK => KOrder::Block,
        ORDER_SLICES => KOrder::Slices,
        ORDER_TILED => KOrder::Tiled,
        _ => panic!("not an order the block kernels take"),
    }
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
fn q45_weights<const T: usize, const FIFTH: bool, const ORDER: u8>(
    g: &[u8],
    a: [&[Q8KLanes]; T],
    w: Weights,
) -> [[f32; 8]; T] {
    match w {
        Weights::Codes(c) => q45_kernel::<T, FIFTH, true, ORDER>(g, c, a, false),
        Weights::FromMemory => q45_kernel::<T, FIFTH, false, ORDER>(g, &[], a, true),
        Weights::Cached => q45_kernel::<T, FIFTH, false, ORDER>(g, &[], a, false),
    }
}

/// `permutex2var` indices taking, from a tile pair's [`sum4`] outputs (rows 0–3, rows 4–7),
/// pair `2k`'s eight row sums into lanes 0–7 and pair `2k + 1`'s into lanes 8–15 (pair `p` is
/// quarter `p`; lane `i` of a quarter is the tile's row `i`).
static PAIR_LANES: [[i32; 16]; 2] = {
    let mut t = [[0i32; 16]; 2];
    let mut k = 0;
    while k < 2 {
        let mut lane = 0;
        while lane < 16 {
            let (p, r) = (2 * k + lane / 8, lane % 8);
            t[k][lane] = (if r < 4 { 4 * p + r } else { 16 + 4 * p + r - 4 }) as i32;
            lane += 1;
        }
        k += 1;
    }
    t
};

/// [`dot8_q45_k_packed`]'s body: the values unpacked from `g` (`CODES` = false) or read from
/// `codes` ([`unpack_codes`] of `g`); `prefetch`: hint the blocks ahead into L2.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
fn q45_kernel<const T: usize, const FIFTH: bool, const CODES: bool, const ORDER: u8>(
    g: &[u8],
    codes: &[u8],
    a: [&[Q8KLanes]; T],
    prefetch: bool,
) -> [[f32; 8]; T] {
    use q4k_at::*;
    let block = if FIFTH {
        Q5_K_GROUP_BLOCK
    } else {
        Q4_K_GROUP_BLOCK
    };
    let nb = g.len() / block;
    assert_eq!(g.len(), nb * block);
    assert!(a.iter().all(|t| t.len() == nb));
    assert!(!CODES || codes.len() == nb * CODE_BLOCK);
    let min_lanes = MIN_PAIR_LANES.each_ref().map(|t| load_i16x32(t));
    // SAFETY: 16 i32 = 64 bytes each.
    let pair_lanes = PAIR_LANES
        .each_ref()
        .map(|t| unsafe { _mm512_loadu_si512(t.as_ptr().cast()) });
    let (mut acc, mut accm) = ([_mm256_setzero_ps(); T], [_mm256_setzero_ps(); T]);
    for b in 0..nb {
        let blk = &g[b * block..(b + 1) * block];
        if prefetch {
            prefetch_block(blk.as_ptr(), block);
        }
        let at = |off: usize| blk[off..].as_ptr();
        let x: [&Q8KLanes; T] = std::array::from_fn(|t| &a[t][b]);
        // Per tile, per token: the tile's four row sums, half reduced (`sum4`).
        let mut halves = [[_mm512_setzero_si512(); T]; 2];
        for (tile, half) in halves.iter_mut().enumerate() {
            let mut sums = [[_mm512_setzero_si512(); T]; TILE_ROWS];
            // Pass h: chunks 2h (the low nibbles) and 2h + 1 (the high ones).
            for h in 0..2 {
                let (x_lo, x_hi) = (load_chunk(&x, 128 * h), load_chunk(&x, 128 * h + 64));
                for (i, s) in sums.iter_mut().enumerate() {
                    let r = TILE_ROWS * tile + i;
                    let q = if CODES {
                        code_values(codes, b, r, 128 * h, 128 * h + 64)
                    } else {
                        q45_values::<FIFTH>(blk, r, h)
                    };
                    dpbusd_tokens(s, q[0], &x_lo);
                    dpbusd_tokens(s, q[1], &x_hi);
                }
            }
            for (i, s) in sums.iter_mut().enumerate() {
                let r = TILE_ROWS * tile + i;
                // Lane j (group j) takes sub-block j / 2's scale: the 8 bytes doubled, widened.
                // SAFETY: 8 scale bytes of row r inside `blk`.
                let sc8 = unsafe { _mm_loadl_epi64(at(SCALES + 8 * r).cast()) };
                let sc = _mm512_cvtepu8_epi32(_mm_unpacklo_epi8(sc8, sc8));
                s.iter_mut().for_each(|v| *v = _mm512_mullo_epi32(*v, sc));
            }
            *half = std::array::from_fn(|t| sum4(std::array::from_fn(|i| sums[i][t])));
        }
        // SAFETY: every load below lies inside `blk` (offsets from the layout, asserted size).
        let (d8, dmin8, mins) = unsafe {
            (
                _mm256_cvtph_ps(_mm_loadu_si128(at(D).cast())),
                _mm256_cvtph_ps(_mm_loadu_si128(at(DMIN).cast())),
                [0, 32].map(|h| _mm512_cvtepu8_epi16(_mm256_loadu_si256(at(MINS + h).cast()))),
            )
        };
        for t in 0..T {
            // SAFETY: `bsums` is 16 i16 = 32 bytes.
            let bs = unsafe { _mm256_loadu_si256(x[t].bsums.as_ptr().cast()) };
            let pairs = _mm512_castsi256_si512(_mm256_hadd_epi16(bs, bs));
            // Lanes (p % 2)·8 + r of register p / 2: row r's two mins · pair sums of pair p.
            let [m01, m23] = [0, 1]
                .map(|h| _mm512_madd_epi16(mins[h], _mm512_permutexvar_epi16(min_lanes[h], pairs)));
            let da = _mm256_set1_ps(x[t].d);
            match const { order_of(ORDER) } {
                KOrder::Block | KOrder::Tiled => {
                    let m = _mm512_add_epi32(m01, m23);
                    let m8 = _mm256_cvtepi32_ps(_mm256_add_epi32(
                        _mm512_castsi512_si256(m),
                        _mm512_extracti64x4_epi64::<1>(m),
                    ));
                    let s8 = _mm256_cvtepi32_ps(fold(halves[0][t], halves[1][t]));
                    if ORDER == ORDER_BLOCK {
                        acc[t] = _mm256_fmadd_ps(_mm256_mul_ps(d8, da), s8, acc[t]);
                        accm[t] = _mm256_fmadd_ps(_mm256_mul_ps(dmin8, da), m8, accm[t]);
                    } else {
                        let r = _mm256_fnmadd_ps(dmin8, m8, _mm256_mul_ps(s8, d8));
                        acc[t] = _mm256_fmadd_ps(r, da, acc[t]);
                    }
                }
                KOrder::Lanes => unreachable!("lanes: q5_lanes_kernel"),
                KOrder::Slices => {
                    let (dd, dm) = (_mm256_mul_ps(d8, da), _mm256_mul_ps(dmin8, da));
                    for (k, m) in [m01, m23].into_iter().enumerate() {
                        let s =
                            _mm512_permutex2var_epi32(halves[0][t], pair_lanes[k], halves[1][t]);
                        // Pair 2k in the low half, 2k + 1 in the high one.
                        let halves_f32 = |v: __m512i| {
                            let f = _mm512_castps_pd(_mm512_cvtepi32_ps(v));
                            (
                                _mm256_castpd_ps(_mm512_castpd512_pd256(f)),
                                _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(f)),
                            )
                        };
                        let ((s_lo, s_hi), (m_lo, m_hi)) = (halves_f32(s), halves_f32(m));
                        acc[t] = _mm256_fmadd_ps(s_lo, dd, acc[t]);
                        accm[t] = _mm256_fmadd_ps(m_lo, dm, accm[t]);
                        acc[t] = _mm256_fmadd_ps(s_hi, dd, acc[t]);
                        accm[t] = _mm256_fmadd_ps(m_hi, dm, accm[t]);
                    }
                }
            }
        }
    }
    store8(std::array::from_fn(|t| _mm256_sub_ps(acc[t], accm[t])))
}

/// Eight interleaved Q6_K rows (`g`: `nb` blocks of [`Q6_K_GROUP_BLOCK`] bytes) · `T` Q8_K
/// activation rows in lane order: `out[t][r]` is the bits of `q8k::scalar_dot(Q6_K)(row r,
/// a[t], order)` (`order` not [`KOrder::Slices`]). The unsigned 6-bit values go through
/// `dpbusd`; the −32 offset enters once per 16-element group through the activations' `bsums`.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(crate) fn dot8_q6_k_packed<const T: usize>(
    g: &[u8],
    a: [&[Q8KLanes]; T],
    w: Weights,
    order: KOrder,
) -> [[f32; 8]; T] {
    match (order, w) {
        (KOrder::Block, w) => q6_weights::<T, false>(g, a, w),
        (KOrder::Tiled, w) => q6_weights::<T, true>(g, a, w),
        (KOrder::Lanes, Weights::Codes(c)) => q6_lanes_kernel::<T, true>(g, c, a, false),
        (KOrder::Lanes, Weights::FromMemory) => q6_lanes_kernel::<T, false>(g, &[], a, true),
        (KOrder::Lanes, Weights::Cached) => q6_lanes_kernel::<T, false>(g, &[], a, false),
        (KOrder::Slices, _) => unreachable!("Q6_K has no slices order"),
    }
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
fn q6_weights<const T: usize, const TILED: bool>(
    g: &[u8],
    a: [&[Q8KLanes]; T],
    w: Weights,
) -> [[f32; 8]; T] {
    match w {
        Weights::Codes(c) => q6_kernel::<T, true, TILED>(g, c, a, false),
        Weights::FromMemory => q6_kernel::<T, false, TILED>(g, &[], a, true),
        Weights::Cached => q6_kernel::<T, false, TILED>(g, &[], a, false),
    }
}

/// [`dot8_q6_k_packed`]'s body, as [`q45_kernel`] is [`dot8_q45_k_packed`]'s.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
fn q6_kernel<const T: usize, const CODES: bool, const TILED: bool>(
    g: &[u8],
    codes: &[u8],
    a: [&[Q8KLanes]; T],
    prefetch: bool,
) -> [[f32; 8]; T] {
    use q6k_at::*;
    let nb = g.len() / Q6_K_GROUP_BLOCK;
    assert_eq!(g.len(), nb * Q6_K_GROUP_BLOCK);
    assert!(a.iter().all(|t| t.len() == nb));
    assert!(!CODES || codes.len() == nb * CODE_BLOCK);
    let mut acc = [_mm256_setzero_ps(); T];
    for b in 0..nb {
        let blk = &g[b * Q6_K_GROUP_BLOCK..(b + 1) * Q6_K_GROUP_BLOCK];
        if prefetch {
            prefetch_block(blk.as_ptr(), Q6_K_GROUP_BLOCK);
        }
        let at = |off: usize| blk[off..].as_ptr();
        let x: [&Q8KLanes; T] = std::array::from_fn(|t| &a[t][b]);
        let mut halves = [[_mm512_setzero_si512(); T]; 2];
        for (tile, half) in halves.iter_mut().enumerate() {
            let mut sums = [[_mm512_setzero_si512(); T]; TILE_ROWS];
            // Pass p: chunks p (low nibbles of quant bytes 64p..) and p + 2 (their high ones).
            for p in 0..2 {
                let (x_lo, x_hi) = (load_chunk(&x, 64 * p), load_chunk(&x, 64 * p + 128));
                for (i, s) in sums.iter_mut().enumerate() {
                    let r = TILE_ROWS * tile + i;
                    let q = if CODES {
                        code_values(codes, b, r, 64 * p, 64 * p + 128)
                    } else {
                        q6_values(blk, r, p)
                    };
                    dpbusd_tokens(s, q[0], &x_lo);
                    dpbusd_tokens(s, q[1], &x_hi);
                }
            }
            for (i, s) in sums.iter_mut().enumerate() {
                let r = TILE_ROWS * tile + i;
                // SAFETY: 16 scale bytes of row r inside `blk`.
                let sc16x8 = unsafe { _mm_loadu_si128(at(SCALES + 16 * r).cast()) };
                // Lane j (group j) takes sub-block j's signed scale.
                let sc = _mm512_cvtepi8_epi32(sc16x8);
                // |scale| ≤ 128, so −32 · scale fits an i16.
                let offset =
                    _mm256_mullo_epi16(_mm256_cvtepi8_epi16(sc16x8), _mm256_set1_epi16(-32));
                for (t, v) in s.iter_mut().enumerate() {
                    // SAFETY: `bsums` is 16 i16 = 32 bytes.
                    let bs = unsafe { _mm256_loadu_si256(x[t].bsums.as_ptr().cast()) };
                    let off = _mm512_zextsi256_si512(_mm256_madd_epi16(bs, offset));
                    *v = _mm512_add_epi32(_mm512_mullo_epi32(*v, sc), off);
                }
            }
            *half = std::array::from_fn(|t| sum4(std::array::from_fn(|i| sums[i][t])));
        }
        // SAFETY: 8 f16 inside `blk`.
        let d8 = unsafe { _mm256_cvtph_ps(_mm_loadu_si128(at(D).cast())) };
        for t in 0..T {
            let da = _mm256_set1_ps(x[t].d);
            let s8 = _mm256_cvtepi32_ps(fold(halves[0][t], halves[1][t]));
            acc[t] = if TILED {
                // `r = S·d` (`− dmin·M` is −0·0: no change), then `fma(r, da, acc)`.
                _mm256_fmadd_ps(_mm256_mul_ps(s8, d8), da, acc[t])
            } else {
                _mm256_fmadd_ps(_mm256_mul_ps(d8, da), s8, acc[t])
            };
        }
    }
    // Block: the spec's `acc − accm` with `accm` = +0 (Q6_K has no mins), `acc` itself; Tiled:
    // `acc`.
    store8(acc)
}

// ---- llama.cpp's `vec_dot` order (`KOrder::Lanes`): eight partial lanes per row.
//
// Lane `l` of its AVX2 `vec_dot` sums values `4l .. 4l + 4` of every 32 (a 32-byte vector's i32
// lanes after `maddubs`/`madd`). In the packed lane order (`pack::lane_element`) i32 lane `j` of
// chunk `k` holds values `16j + 4k .. + 4`: its `vec_dot` lane is `4 (j % 2) + k`. So a row's
// chunks are kept apart (four accumulators, each scaled by its groups' scales), and one
// transposing tree ([`lanes16`]) sums each chunk's even and odd lanes: its eight outputs are
// `vec_dot` lanes `[0, 1, 4, 5, 2, 3, 6, 7]` ([`LANES_AT`]), accumulated in that order and summed
// at the end in `hsum_float_8`'s. Rows go by pairs (with its chunks apart, a 4-row tile would
// not fit the registers), the tokens taking turns over each pair's values.

/// The `vec_dot` lane of each output of [`lanes16`] (its own inverse).
const LANES_AT: [usize; 8] = [0, 1, 4, 5, 2, 3, 6, 7];

/// `[a0+a2, b0+b2, a1+a3, b1+b3]` in each 128-bit quarter: the even and the odd lanes of two
/// vectors, half summed.
#[inline]
#[target_feature(enable = "avx512f")]
fn pair_sum(a: __m512i, b: __m512i) -> __m512i {
    _mm512_add_epi32(_mm512_unpacklo_epi32(a, b), _mm512_unpackhi_epi32(a, b))
}

/// For two rows' four scaled chunks `a[k]`, `b[k]`: `[row a's eight | row b's eight]`, each row's
/// `[e0, e1, o0, o1, e2, e3, o2, o3]` (`ek`/`ok` the sums of chunk `k`'s even / odd lanes —
/// `vec_dot` lanes [`LANES_AT`]). Two rows at once: the quarters of the four half-sums are
/// folded together (9 instructions where a fold per row takes 12), and one convert and one
/// multiply-add serve both rows (1B Q6_K decode, one thread: ~26 → ~31 tok/s against a fold per
/// row).
#[inline]
#[target_feature(enable = "avx512f")]
fn lanes16(a: [__m512i; 4], b: [__m512i; 4]) -> __m512i {
    // Per row: [p01 quarters 0+1, p01 2+3, p23 0+1, p23 2+3].
    let half = |v: [__m512i; 4]| {
        let (p01, p23) = (pair_sum(v[0], v[1]), pair_sum(v[2], v[3]));
        _mm512_add_epi32(
            _mm512_shuffle_i64x2::<0b10_00_10_00>(p01, p23),
            _mm512_shuffle_i64x2::<0b11_01_11_01>(p01, p23),
        )
    };
    let (ha, hb) = (half(a), half(b));
    // [a: p01 total, p23 total | b: p01 total, p23 total] — `lanes16`'s order per row.
    _mm512_add_epi32(
        _mm512_shuffle_i64x2::<0b10_00_10_00>(ha, hb),
        _mm512_shuffle_i64x2::<0b11_01_11_01>(ha, hb),
    )
}

/// `permutexvar` indices taking row `2k`'s value into lanes 0–7 and row `2k + 1`'s into 8–15.
#[inline]
#[target_feature(enable = "avx512f")]
fn pair_rows(k: usize) -> __m512i {
    let r = 2 * k as i32;
    _mm512_mask_set1_epi32(_mm512_set1_epi32(r), 0xff00, r + 1)
}

/// `hsum_float_8` of a row's lane accumulator in [`lanes16`]'s order.
fn hsum_lanes(acc: [f32; 8]) -> f32 {
    crate::q8k::hsum_float_8(std::array::from_fn(|l| acc[LANES_AT[l]]))
}

/// A token's four 64-byte chunks of lane-order activations.
#[inline]
#[target_feature(enable = "avx512f")]
fn chunks4(x: &Q8KLanes) -> [__m512i; 4] {
    std::array::from_fn(|k| load512(x.qs[64 * k..64 * k + 64].as_ptr().cast()))
}

/// Each token's chunks, loaded once per block where one or two tokens' fit the registers beside
/// the rest (`None` for more: each row pair reloads them from L1, [`chunks4`]).
#[inline]
#[target_feature(enable = "avx512f")]
fn preload_chunks<const T: usize>(x: &[&Q8KLanes; T]) -> Option<[[__m512i; 4]; T]> {
    (T <= 2).then(|| std::array::from_fn(|t| chunks4(x[t])))
}

/// `mullo(dpbusd(0, q[k], x[k]), sc)` for one token's chunks `x`: each chunk's per-group sums
/// scaled by its groups' scales (lane `j`: group `j`), never summed across chunks.
#[inline]
#[target_feature(enable = "avx512f,avx512vnni")]
fn scaled_chunks(q: &[__m512i; 4], x: &[__m512i; 4], sc: __m512i) -> [__m512i; 4] {
    std::array::from_fn(|k| {
        _mm512_mullo_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), q[k], x[k]), sc)
    })
}

/// Eight packed Q5_K rows · `T` tokens in llama.cpp's `vec_dot` order (`q8k::scalar_dot(Q5_K)(row
/// r, a[t], Lanes)`, bit for bit): per block `acc[l] ← fma(da·d, S_l, acc[l])` and
/// `summs ← fma(−da·dmin, M, summs)`; the dot `hsum_float_8(acc) + summs`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
fn q5_lanes_kernel<const T: usize, const CODES: bool>(
    g: &[u8],
    codes: &[u8],
    a: [&[Q8KLanes]; T],
    prefetch: bool,
) -> [[f32; 8]; T] {
    use q4k_at::*;
    let nb = g.len() / Q5_K_GROUP_BLOCK;
    assert_eq!(g.len(), nb * Q5_K_GROUP_BLOCK);
    assert!(a.iter().all(|t| t.len() == nb));
    assert!(!CODES || codes.len() == nb * CODE_BLOCK);
    let min_lanes = MIN_PAIR_LANES.each_ref().map(|t| load_i16x32(t));
    // `acc[k][t]`: rows 2k, 2k + 1's lanes for token t (`lanes16`); `summs[t]`: lane r row r's
    // mins' term.
    let mut acc = [[_mm512_setzero_ps(); T]; 4];
    let mut summs = [_mm256_setzero_ps(); T];
    for b in 0..nb {
        let blk = &g[b * Q5_K_GROUP_BLOCK..(b + 1) * Q5_K_GROUP_BLOCK];
        if prefetch {
            prefetch_block(blk.as_ptr(), Q5_K_GROUP_BLOCK);
        }
        let at = |off: usize| blk[off..].as_ptr();
        let x: [&Q8KLanes; T] = std::array::from_fn(|t| &a[t][b]);
        let xc = preload_chunks(&x);
        // SAFETY: every load below lies inside `blk` (offsets from the layout, asserted size).
        let (d8, dmin8, mins) = unsafe {
            (
                _mm256_cvtph_ps(_mm_loadu_si128(at(D).cast())),
                _mm256_cvtph_ps(_mm_loadu_si128(at(DMIN).cast())),
                [0, 32].map(|h| _mm512_cvtepu8_epi16(_mm256_loadu_si256(at(MINS + h).cast()))),
            )
        };
        // Per token, lane r: row r's `d = y.d · x.d` and `dmin = −y.d · x.dmin`.
        let (dd, dm): ([__m256; T], [__m256; T]) = (
            std::array::from_fn(|t| _mm256_mul_ps(_mm256_set1_ps(x[t].d), d8)),
            std::array::from_fn(|t| _mm256_mul_ps(_mm256_set1_ps(-x[t].d), dmin8)),
        );
        for t in 0..T {
            // SAFETY: `bsums` is 16 i16 = 32 bytes.
            let bs = unsafe { _mm256_loadu_si256(x[t].bsums.as_ptr().cast()) };
            let pairs = _mm512_castsi256_si512(_mm256_hadd_epi16(bs, bs));
            let m = _mm512_add_epi32(
                _mm512_madd_epi16(mins[0], _mm512_permutexvar_epi16(min_lanes[0], pairs)),
                _mm512_madd_epi16(mins[1], _mm512_permutexvar_epi16(min_lanes[1], pairs)),
            );
            let m8 = _mm256_add_epi32(_mm512_castsi512_si256(m), _mm512_extracti64x4_epi64::<1>(m));
            summs[t] = _mm256_fmadd_ps(dm[t], _mm256_cvtepi32_ps(m8), summs[t]);
        }
        // Row r's four chunks of values and its groups' scales (lane j: sub-block j / 2's).
        let row = |r: usize| {
            let pass = |h: usize| {
                if CODES {
                    code_values(codes, b, r, 128 * h, 128 * h + 64)
                } else {
                    q45_values::<true>(blk, r, h)
                }
            };
            let ([q0, q1], [q2, q3]) = (pass(0), pass(1));
            // SAFETY: 8 scale bytes of row r inside `blk`.
            let sc8 = unsafe { _mm_loadl_epi64(at(SCALES + 8 * r).cast()) };
            (
                [q0, q1, q2, q3],
                _mm512_cvtepu8_epi32(_mm_unpacklo_epi8(sc8, sc8)),
            )
        };
        for (k, acc_k) in acc.iter_mut().enumerate() {
            let ((qa, sca), (qb, scb)) = (row(2 * k), row(2 * k + 1));
            let rows = pair_rows(k);
            for t in 0..T {
                let xt = xc.map_or_else(|| chunks4(x[t]), |c| c[t]);
                let (va, vb) = (scaled_chunks(&qa, &xt, sca), scaled_chunks(&qb, &xt, scb));
                let d = _mm512_permutexvar_ps(rows, _mm512_castps256_ps512(dd[t]));
                let lanes = _mm512_cvtepi32_ps(lanes16(va, vb));
                acc_k[t] = _mm512_fmadd_ps(d, lanes, acc_k[t]);
            }
        }
    }
    let summs = summs.map(|v| store_f32x8(v));
    std::array::from_fn(|t| std::array::from_fn(|r| row_lanes(&acc, r, t) + summs[t][r]))
}

/// Eight packed Q6_K rows · `T` tokens in llama.cpp's `vec_dot` order (`q8k::scalar_dot(Q6_K)(row
/// r, a[t], Lanes)`, bit for bit): lane `l` less its `32 · (bsums[2l]·sc[2l] +
/// bsums[2l+1]·sc[2l+1])`, `acc[l] ← fma(da·d, S_l, acc[l])`; the dot `hsum_float_8(acc)`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
fn q6_lanes_kernel<const T: usize, const CODES: bool>(
    g: &[u8],
    codes: &[u8],
    a: [&[Q8KLanes]; T],
    prefetch: bool,
) -> [[f32; 8]; T] {
    use q6k_at::*;
    let nb = g.len() / Q6_K_GROUP_BLOCK;
    assert_eq!(g.len(), nb * Q6_K_GROUP_BLOCK);
    assert!(a.iter().all(|t| t.len() == nb));
    assert!(!CODES || codes.len() == nb * CODE_BLOCK);
    // `vec_dot` lanes into `lanes16`'s order (the permutation is its own inverse).
    let to_lanes8 = _mm256_setr_epi32(0, 1, 4, 5, 2, 3, 6, 7);
    // `acc[k][t]`: rows 2k, 2k + 1's lanes for token t (`lanes16`).
    let mut acc = [[_mm512_setzero_ps(); T]; 4];
    for b in 0..nb {
        let blk = &g[b * Q6_K_GROUP_BLOCK..(b + 1) * Q6_K_GROUP_BLOCK];
        if prefetch {
            prefetch_block(blk.as_ptr(), Q6_K_GROUP_BLOCK);
        }
        let x: [&Q8KLanes; T] = std::array::from_fn(|t| &a[t][b]);
        let xc = preload_chunks(&x);
        // SAFETY: `bsums` is 16 i16 = 32 bytes.
        let bs: [__m256i; T] =
            std::array::from_fn(|t| unsafe { _mm256_loadu_si256(x[t].bsums.as_ptr().cast()) });
        // SAFETY: 8 f16 inside `blk`.
        let d8 = unsafe { _mm256_cvtph_ps(_mm_loadu_si128(blk[D..].as_ptr().cast())) };
        let dd: [__m256; T] = std::array::from_fn(|t| _mm256_mul_ps(_mm256_set1_ps(x[t].d), d8));
        // Row r's four chunks of values, its groups' scales (lane j: group j's) and as i16.
        let row = |r: usize| {
            // Pass p: chunks p and p + 2.
            let pass = |p: usize| {
                if CODES {
                    code_values(codes, b, r, 64 * p, 64 * p + 128)
                } else {
                    q6_values(blk, r, p)
                }
            };
            let ([q0, q2], [q1, q3]) = (pass(0), pass(1));
            // SAFETY: 16 scale bytes of row r inside `blk`.
            let sc16x8 = unsafe { _mm_loadu_si128(blk[SCALES + 16 * r..].as_ptr().cast()) };
            (
                [q0, q1, q2, q3],
                _mm512_cvtepi8_epi32(sc16x8),
                _mm256_cvtepi8_epi16(sc16x8),
            )
        };
        // A token's lanes' −32 offsets for a row, in `lanes16`'s order.
        let offsets = |bs: __m256i, sc16: __m256i| {
            let o = _mm256_slli_epi32::<5>(_mm256_madd_epi16(bs, sc16));
            _mm256_permutevar8x32_epi32(o, to_lanes8)
        };
        for (k, acc_k) in acc.iter_mut().enumerate() {
            let ((qa, sca, sa), (qb, scb, sb)) = (row(2 * k), row(2 * k + 1));
            let rows = pair_rows(k);
            for t in 0..T {
                let xt = xc.map_or_else(|| chunks4(x[t]), |c| c[t]);
                let (va, vb) = (scaled_chunks(&qa, &xt, sca), scaled_chunks(&qb, &xt, scb));
                let both = _mm512_inserti64x4::<1>(
                    _mm512_castsi256_si512(offsets(bs[t], sa)),
                    offsets(bs[t], sb),
                );
                let sums = _mm512_sub_epi32(lanes16(va, vb), both);
                let d = _mm512_permutexvar_ps(rows, _mm512_castps256_ps512(dd[t]));
                acc_k[t] = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(sums), acc_k[t]);
            }
        }
    }
    std::array::from_fn(|t| std::array::from_fn(|r| row_lanes(&acc, r, t)))
}

/// Row `r`'s dot for token `t` from [`lanes16`]-ordered accumulators (`acc[r / 2][t]`, row `r`
/// in half `r % 2`): `hsum_float_8` in `vec_dot`'s lane order.
fn row_lanes<const T: usize>(acc: &[[__m512; T]; 4], r: usize, t: usize) -> f32 {
    let mut all = [0.0f32; 16];
    // SAFETY: 16 f32 = 64 bytes; AVX-512 F is present wherever a packed kernel runs.
    unsafe { _mm512_storeu_ps(all.as_mut_ptr(), acc[r / 2][t]) };
    let half: [f32; 8] = all[8 * (r % 2)..8 * (r % 2) + 8].try_into().expect("eight");
    hsum_lanes(half)
}

#[inline]
#[target_feature(enable = "avx")]
fn store_f32x8(v: __m256) -> [f32; 8] {
    let mut out = [0.0f32; 8];
    // SAFETY: 8 f32 = 32 bytes.
    unsafe { _mm256_storeu_ps(out.as_mut_ptr(), v) };
    out
}

//! Weights repacked at load: eight rows interleaved block by block, for the AVX-512 VNNI
//! kernels in `x86_pack.rs` (two rows per 512-bit register, eight scales in one load).
//!
//! A decode step reads every weight once per token; with the GGUF layout a row's block is 20
//! (Q4_1) or 34 (Q8_0) bytes with its own scale, and the four-row kernels spent ~16
//! instructions a row-block unpacking them — more than the memory needed to deliver the bytes.
//! Repacked, eight rows' scales are one 16-byte load, two rows' quants one register, and the
//! step's mat-vecs read weights at the memory's pace (`BENCHMARKS.md`, "CPU speed").
//!
//! # Layout (group `g` = rows `8g .. 8g + 8`, block `b` = columns `32b .. 32b + 32`)
//! - Q4_1: `d[8]` f16, `m[8]` f16, then each row's 16 nibble bytes as GGUF stores them:
//!   160 bytes, the same as eight GGUF blocks.
//! - Q8_0: `d[8]` f16, then each row's 32 quants as `q ^ 0x80` (`q + 128`, an unsigned byte):
//!   272 bytes, the same as eight GGUF blocks.
//! - Q5_0 / Q5_1: `d[8]` (and `m[8]`) f16, each row's 32 fifth bits (`qh`, u32), then each row's
//!   16 nibble bytes: 176 / 192 bytes.
//! - Q4_0: `d[8]` f16, then two 64-byte halves, half `h` every row's nibble bytes `8h..8h + 8`:
//!   144 bytes. Its kernel runs llama.cpp's repacked-Q4_0 arithmetic (one f32 lane per row and
//!   token, an FMA per block: [`crate::quant::dot_q4_0_q8_scalar`]) with a pair of tokens'
//!   per-block terms ([`Q40PairTerms`]) prepared with the activations.
//! - Q4_K, Q5_K, Q6_K (block `b` = columns `256b .. 256b + 256`): scales unpacked to bytes,
//!   values in *lane order* ([`lane_element`]: one 64-byte chunk holds four consecutive values
//!   of each of the super-block's sixteen 16-element groups): 1,184 / 1,440 / 1,680 bytes
//!   (`x86_kpack.rs` documents each byte). Their activations are reordered the same way
//!   ([`Q8KLanes`]), so a `dpbusd` over a chunk leaves group `j`'s partial sum in lane `j` and
//!   the four chunks add before one multiply by the scales: half the instructions of the
//!   `maddubs` + `dpwssd` pair that consecutive elements need.
//!
//! # Invariants
//! - Packing moves values, it never computes new ones: the 32-element types' blocks are a
//!   permutation of the GGUF bytes (and, for Q8_0, a fixed relabelling of each quant); the
//!   K-quants' are their nibbles, bit pairs and 6-bit scales, unpacked. Nothing is rounded, so
//!   the packed kernels compute every output with the one-row kernel's arithmetic, bit for bit
//!   (tested for every token count; every value read back in `kquant_layouts_keep_every_value`).
//! - A [`PackedRows`] exists only where its kernel can run: x86-64 with AVX-512 F/BW/VL/VNNI, a
//!   Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K or Q6_K matrix whose rows are a multiple of eight.
//!   Elsewhere [`PackedRows::new`] says `None` and the GGUF-layout kernels run, as before.

use crate::matmul::QMatrix;
use crate::q8k::{BlockQ8K, KOrder};
use crate::quant::{BlockQ8, DType, QK_K};

/// Where a kernel call's weights come from. The first pass over a group streams its packed
/// blocks from memory (prefetched ahead); later token batches over the same group find them in
/// cache, and prefetching the next group there would only spend instructions. A prompt's many
/// token batches instead read the group's values unpacked once ([`PackedRows::unpack_group`]): one byte per
/// value in lane order, so a batch spends no instruction on nibbles or high bits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Weights<'c> {
    FromMemory,
    Cached,
    /// The group's values, [`CODE_BLOCK`] bytes per super-block (the scales still come from the
    /// packed group).
    Codes(&'c [u8]),
}

/// Bytes of one super-block of eight rows' unpacked values: row `r`'s lane-order position `p`
/// at `256 r + p`, the value 0..15 (Q4_K), 0..31 (Q5_K) or 0..63 (Q6_K, before its −32).
pub(crate) const CODE_BLOCK: usize = 8 * 256;

/// Rows per interleaved group.
pub const GROUP_ROWS: usize = 8;

/// A weight matrix repacked into groups of [`GROUP_ROWS`] interleaved rows (see the module
/// documentation). Owned: a copy of the matrix, the same size (Q4_K: 2.8 %, Q5_K: 2.3 % larger).
#[derive(Debug)]
pub struct PackedRows {
    dtype: DType,
    rows: usize,
    cols: usize,
    data: Vec<u8>,
}

/// Whether this machine runs the packed kernels (AVX-512 F, BW, VL and VNNI, and not turned off
/// by `CUSTODY_SIMD`).
pub fn available() -> bool {
    crate::simd::has_vnni512()
}

/// Bytes of one block of [`GROUP_ROWS`] interleaved rows of `dtype`, for the packed types.
fn group_block_bytes(dtype: DType) -> Option<usize> {
    match dtype {
        DType::Q4_0 | DType::Q4_1 | DType::Q5_0 | DType::Q5_1 | DType::Q8_0 => {
            Some(GROUP_ROWS * dtype.block_bytes())
        }
        // The sub-block scales unpacked to bytes: 32 bytes more than the GGUF blocks.
        DType::Q4_K => Some(GROUP_ROWS * 144 + 32),
        DType::Q5_K => Some(GROUP_ROWS * 176 + 32),
        DType::Q6_K => Some(GROUP_ROWS * 210),
        _ => None,
    }
}

/// The element (0..256) of a K-quant super-block at position `pos` of the packed kernels' lane
/// order: position `64k + 4j + i` holds element `16j + 4k + i` (chunk `k` < 4, group `j` < 16,
/// `i` < 4). A 32-bit lane `j` of any chunk thus holds four values of 16-element group `j` —
/// one Q6_K sub-block, half of Q4_K/Q5_K sub-block `j / 2` — so integer sums per lane are sums
/// per group, whichever chunks they came from.
pub(crate) const fn lane_element(pos: usize) -> usize {
    let (k, j, i) = (pos / 64, (pos % 64) / 4, pos % 4);
    16 * j + 4 * k + i
}

/// A Q8_K activation block with its quants in lane order ([`lane_element`]), for the packed
/// K-quant kernels; `d` and `bsums` (sums over the natural 16-element groups) as the block's.
/// Only made from a [`BlockQ8K`], so a packed kernel cannot be handed natural-order quants.
#[derive(Clone, Copy, Debug)]
pub struct Q8KLanes {
    pub(crate) d: f32,
    pub(crate) qs: [i8; QK_K],
    pub(crate) bsums: [i16; QK_K / 16],
}

impl Default for Q8KLanes {
    fn default() -> Self {
        Self::from(&BlockQ8K::default())
    }
}

impl From<&BlockQ8K> for Q8KLanes {
    fn from(b: &BlockQ8K) -> Self {
        Self {
            d: b.d,
            qs: std::array::from_fn(|pos| b.qs[lane_element(pos)]),
            bsums: b.bsums,
        }
    }
}

/// What the packed Q4_0 kernel needs per block beyond a pair of tokens' Q8_0 blocks (tokens
/// `2i`, `2i + 1` of a prompt, the second zero past its end), laid out for 64-bit broadcasts:
/// `d` spreads the two scales over the (row, token) lanes, `start[j]` begins token `j`'s lane
/// sums (its values are stored unsigned, `q = stored − 8`).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
#[repr(C)]
pub struct Q40PairTerms {
    /// The tokens' activation scales (`BlockQ8::d`).
    pub(crate) d: [f32; 2],
    /// `−8 · Σ qs` of each token's block.
    pub(crate) start: [i32; 2],
}

impl Q40PairTerms {
    /// The terms of block `b` for tokens `first` and `second` (absent past a prompt's end).
    pub(crate) fn new(first: &BlockQ8, second: Option<&BlockQ8>) -> Self {
        let start = |x: &BlockQ8| -8 * x.qs.iter().map(|&q| i32::from(q)).sum::<i32>();
        Self {
            d: [first.d, second.map_or(0.0, |x| x.d)],
            start: [start(first), second.map_or(0, start)],
        }
    }
}

/// Element `e` (0..256) of a GGUF Q4_K block's nibbles (`qs`: its 128 quant bytes): sub-blocks
/// `2i`, `2i+1` are the low and high nibbles of bytes `32i..32i+32`.
fn q4_k_nibble(qs: &[u8], e: usize) -> u8 {
    let (i, l) = (e / 64, e % 64);
    if l < 32 {
        qs[32 * i + l] & 0x0f
    } else {
        qs[32 * i + l - 32] >> 4
    }
}

/// One super-block of eight Q4_K rows in the packed layout (`x86_kpack::Q4_K_GROUP_BLOCK`):
/// `d[8]`, `dmin[8]`, scales `[row][8]`, mins `[pair][row][2]`, nibbles `[row][128]` with byte
/// `64h + k` holding lane-order position `128h + k` (low) and `128h + 64 + k` (high).
fn pack_q4_k(blocks: &[&[u8]; GROUP_ROWS], data: &mut Vec<u8>) {
    pack_q45_k(blocks, |k| &k[16..144], data);
}

/// One super-block of eight Q5_K rows: the Q4_K layout of their low four bits, then each row's
/// fifth bits in lane order (`x86_kpack::Q5_K_GROUP_BLOCK`).
fn pack_q5_k(blocks: &[&[u8]; GROUP_ROWS], data: &mut Vec<u8>) {
    pack_q45_k(blocks, |k| &k[48..176], data);
    for k in blocks {
        let qh = &k[16..48];
        // Element e = 64i + l: bit 2i of qh[l] for l < 32 (sub-block 2i), bit 2i+1 of qh[l-32].
        let bit = |e: usize| {
            let (i, l) = (e / 64, e % 64);
            if l < 32 {
                (qh[l] >> (2 * i)) & 1
            } else {
                (qh[l - 32] >> (2 * i + 1)) & 1
            }
        };
        data.extend(
            (0..32)
                .map(|byte| (0..8).fold(0u8, |acc, j| acc | bit(lane_element(8 * byte + j)) << j)),
        );
    }
}

/// The Q4_K layout of eight Q4_K or Q5_K blocks (`qs_of`: a block's 128 nibble bytes).
fn pack_q45_k(blocks: &[&[u8]; GROUP_ROWS], qs_of: impl Fn(&[u8]) -> &[u8], data: &mut Vec<u8>) {
    blocks.iter().for_each(|k| data.extend_from_slice(&k[0..2]));
    blocks.iter().for_each(|k| data.extend_from_slice(&k[2..4]));
    let pairs = blocks.map(|k| -> [(u8, u8); 8] {
        std::array::from_fn(|j| crate::kquant::scale_min_k4(j, &k[4..16]))
    });
    for p in &pairs {
        data.extend(p.iter().map(|&(sc, _)| sc));
    }
    for pair in 0..4 {
        for p in &pairs {
            data.extend([p[2 * pair].1, p[2 * pair + 1].1]);
        }
    }
    for k in blocks {
        // Through a fixed array, not a per-byte `extend`: packing is the whole of a model's
        // load time past the mapping.
        let mut nibbles = [0u8; 256];
        for (pos, n) in nibbles.iter_mut().enumerate() {
            *n = q4_k_nibble(qs_of(k), lane_element(pos));
        }
        let mut out = [0u8; 128];
        for (i, o) in out.iter_mut().enumerate() {
            let (h, l) = (i / 64, i % 64);
            *o = nibbles[128 * h + l] | nibbles[128 * h + 64 + l] << 4;
        }
        data.extend_from_slice(&out);
    }
}

/// Element `e` (0..256) of a GGUF Q6_K block as an unsigned 6-bit value (before the −32).
fn q6_k_value(b: &[u8], e: usize) -> u8 {
    let (half, k, l) = (e / 128, (e % 128) / 32, e % 32);
    let byte = b[64 * half + l + 32 * (k & 1)];
    let lo = if k < 2 { byte & 0x0f } else { byte >> 4 };
    let hi = (b[128 + 32 * half + l] >> (2 * k)) & 3;
    lo | hi << 4
}

/// One super-block of eight Q6_K rows in the packed layout (`x86_kpack::Q6_K_GROUP_BLOCK`):
/// `d[8]`, scales `[row][16]`, then per row 128 low-nibble bytes (byte `k`: lane-order
/// position `k` low, `128 + k` high) and 64 high-pair bytes (bits `2j..2j+2` of byte `k`:
/// position `64j + k`).
fn pack_q6_k(blocks: &[&[u8]; GROUP_ROWS], data: &mut Vec<u8>) {
    blocks
        .iter()
        .for_each(|k| data.extend_from_slice(&k[208..210]));
    blocks
        .iter()
        .for_each(|k| data.extend_from_slice(&k[192..208]));
    for b in blocks {
        let q: [u8; 256] = std::array::from_fn(|pos| q6_k_value(b, lane_element(pos)));
        let mut out = [0u8; 192];
        for k in 0..128 {
            out[k] = (q[k] & 0x0f) | (q[128 + k] & 0x0f) << 4;
        }
        for k in 0..64 {
            out[128 + k] = (0..4).fold(0u8, |acc, j| acc | (q[64 * j + k] >> 4) << (2 * j));
        }
        data.extend_from_slice(&out);
    }
}

impl PackedRows {
    /// The repacked copy of `w`, or `None` where no packed kernel runs it (type, shape or CPU).
    pub fn new(w: &QMatrix<'_>) -> Option<Self> {
        Self::pack(w).filter(|_| available())
    }

    /// The repacking itself, whatever the CPU (tests compare layouts on any machine).
    fn pack(w: &QMatrix<'_>) -> Option<Self> {
        if !w.rows.is_multiple_of(GROUP_ROWS) || !w.cols.is_multiple_of(w.dtype.block_elems()) {
            return None;
        }
        let nb = w.cols / w.dtype.block_elems();
        let packed_bytes = w.rows / GROUP_ROWS * nb * group_block_bytes(w.dtype)?;
        let mut data = Vec::with_capacity(packed_bytes);
        for g in 0..w.rows / GROUP_ROWS {
            let rows: [&[u8]; GROUP_ROWS] = std::array::from_fn(|i| w.row(g * GROUP_ROWS + i));
            for b in 0..nb {
                match w.dtype {
                    DType::Q4_1 => {
                        let blk = |r: &[u8]| -> [u8; 20] {
                            r[b * 20..b * 20 + 20].try_into().expect("20-byte block")
                        };
                        let blocks = rows.map(blk);
                        blocks.iter().for_each(|k| data.extend_from_slice(&k[0..2]));
                        blocks.iter().for_each(|k| data.extend_from_slice(&k[2..4]));
                        blocks
                            .iter()
                            .for_each(|k| data.extend_from_slice(&k[4..20]));
                    }
                    DType::Q4_0 => {
                        // d, then every row's nibble bytes 0..8, then every row's 8..16.
                        let blocks = rows.map(|r| &r[b * 18..b * 18 + 18]);
                        blocks.iter().for_each(|k| data.extend_from_slice(&k[0..2]));
                        for half in [2..10, 10..18] {
                            blocks
                                .iter()
                                .for_each(|k| data.extend_from_slice(&k[half.clone()]));
                        }
                    }
                    DType::Q5_0 | DType::Q5_1 => {
                        // d (and m), then every row's qh, then every row's nibbles.
                        let bb = w.dtype.block_bytes();
                        let blocks = rows.map(|r| &r[b * bb..b * bb + bb]);
                        let scales = if w.dtype == DType::Q5_1 { 2 } else { 1 };
                        for s in 0..scales {
                            blocks
                                .iter()
                                .for_each(|k| data.extend_from_slice(&k[2 * s..2 * s + 2]));
                        }
                        let h = 2 * scales;
                        blocks
                            .iter()
                            .for_each(|k| data.extend_from_slice(&k[h..h + 4]));
                        blocks
                            .iter()
                            .for_each(|k| data.extend_from_slice(&k[h + 4..bb]));
                    }
                    DType::Q8_0 => {
                        let blk = |r: &[u8]| -> [u8; 34] {
                            r[b * 34..b * 34 + 34].try_into().expect("34-byte block")
                        };
                        let blocks = rows.map(blk);
                        blocks.iter().for_each(|k| data.extend_from_slice(&k[0..2]));
                        for k in &blocks {
                            data.extend(k[2..34].iter().map(|q| q ^ 0x80));
                        }
                    }
                    DType::Q4_K => {
                        let blocks = rows.map(|r| &r[b * 144..b * 144 + 144]);
                        pack_q4_k(&blocks, &mut data);
                    }
                    DType::Q5_K => {
                        let blocks = rows.map(|r| &r[b * 176..b * 176 + 176]);
                        pack_q5_k(&blocks, &mut data);
                    }
                    DType::Q6_K => {
                        let blocks = rows.map(|r| &r[b * 210..b * 210 + 210]);
                        pack_q6_k(&blocks, &mut data);
                    }
                    _ => return None,
                }
            }
        }
        assert_eq!(data.len(), packed_bytes, "the layout's size");
        Some(Self {
            dtype: w.dtype,
            rows: w.rows,
            cols: w.cols,
            data,
        })
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    pub fn cols(&self) -> usize {
        self.cols
    }

    /// The packed copy's bytes (what a pass over the matrix reads).
    pub fn data(&self) -> &[u8] {
        &self.data
    }

    /// The bytes of group `g` (rows `8g .. 8g + 8`).
    pub(crate) fn group(&self, g: usize) -> &[u8] {
        let gb = self.data.len() / (self.rows / GROUP_ROWS);
        &self.data[g * gb..(g + 1) * gb]
    }

    /// `out[t][i]` = row `8g + i` · `a[t]` for `T` activation rows, bit-identical to the one-row
    /// kernel of the matrix's type.
    pub(crate) fn dot_group<const T: usize>(
        &self,
        g: usize,
        a: [&[BlockQ8]; T],
    ) -> [[f32; GROUP_ROWS]; T] {
        assert!(
            available(),
            "packed kernels need AVX-512 VNNI (checked at pack)"
        );
        #[cfg(target_arch = "x86_64")]
        {
            let gd = self.group(g);
            // SAFETY: a `PackedRows` is only handed out by `new` when `available()` (AVX-512
            // F/BW/VL/VNNI, AVX2, FMA, F16C detected), re-asserted above.
            unsafe {
                match self.dtype {
                    DType::Q4_1 => crate::x86_pack::dot8_q4_1_packed::<T>(gd, a),
                    DType::Q8_0 => crate::x86_pack::dot8_q8_0_packed::<T>(gd, a),
                    DType::Q5_0 => crate::x86_pack::dot8_q5_packed::<T, false>(gd, a),
                    DType::Q5_1 => crate::x86_pack::dot8_q5_packed::<T, true>(gd, a),
                    _ => unreachable!(
                        "{:?} is not packed over Q8 activations alone (Q4_0: dot_group_q4_0)",
                        self.dtype
                    ),
                }
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            let _ = (g, a);
            unreachable!("packed kernels are x86-64 only")
        }
    }

    /// As [`PackedRows::dot_group`], for Q4_0: `pairs[i]` are the [`Q40PairTerms`] of tokens
    /// `a[2i]`, `a[2i + 1]` (an empty slice past the last pair). Each result the bits of
    /// [`crate::quant::dot_q4_0_q8_scalar`].
    pub(crate) fn dot_group_q4_0<const T: usize>(
        &self,
        g: usize,
        a: [&[BlockQ8]; T],
        pairs: [&[Q40PairTerms]; 4],
    ) -> [[f32; GROUP_ROWS]; T] {
        assert!(
            available(),
            "packed kernels need AVX-512 VNNI (checked at pack)"
        );
        assert_eq!(self.dtype, DType::Q4_0);
        #[cfg(target_arch = "x86_64")]
        {
            // SAFETY: as in `dot_group`: packed matrices exist only where `available()`.
            unsafe { crate::x86_pack::dot8_q4_0_packed::<T>(self.group(g), a, pairs) }
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            let _ = (g, a, pairs);
            unreachable!("packed kernels are x86-64 only")
        }
    }

    /// As [`PackedRows::dot_group`], for the K-quants over Q8_K activations in lane order: each
    /// result the bits of `q8k::scalar_dot(dtype)` in `order` (every token's). `w`: where the
    /// group's weights come from on this call (`Weights::Codes`: [`PackedRows::unpack_group`]'s
    /// output for group `g`).
    pub(crate) fn dot_group_q8k<const T: usize>(
        &self,
        g: usize,
        a: [&[Q8KLanes]; T],
        w: Weights,
        order: KOrder,
    ) -> [[f32; GROUP_ROWS]; T] {
        assert!(
            available(),
            "packed kernels need AVX-512 VNNI (checked at pack)"
        );
        #[cfg(target_arch = "x86_64")]
        {
            use crate::x86_kpack::{dot8_q6_k_packed, dot8_q45_k_packed};
            let gd = self.group(g);
            // SAFETY: as in `dot_group`: packed matrices exist only where `available()`.
            unsafe {
                match self.dtype {
                    DType::Q4_K => dot8_q45_k_packed::<T, false>(gd, a, w, order),
                    DType::Q5_K => dot8_q45_k_packed::<T, true>(gd, a, w, order),
                    DType::Q6_K => dot8_q6_k_packed::<T>(gd, a, w, order),
                    _ => unreachable!("{:?} is not packed over Q8_K activations", self.dtype),
                }
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            let _ = (g, a, w, order);
            unreachable!("packed kernels are x86-64 only")
        }
    }

    /// Whether [`PackedRows::unpack_group`] applies (the K-quants' packed layouts).
    pub(crate) fn has_codes(&self) -> bool {
        matches!(self.dtype, DType::Q4_K | DType::Q5_K | DType::Q6_K)
    }

    /// Group `g`'s values unpacked to one byte each into `out` (resized to
    /// `cols / 256 × CODE_BLOCK`), for `Weights::Codes`: a prompt's token batches then spend no
    /// instruction unpacking them.
    pub(crate) fn unpack_group(&self, g: usize, out: &mut Vec<u8>) {
        assert!(self.has_codes() && available());
        out.resize(self.cols() / QK_K * CODE_BLOCK, 0);
        #[cfg(target_arch = "x86_64")]
        // SAFETY: packed matrices exist only where `available()` (AVX-512 VNNI and BW).
        unsafe {
            crate::x86_kpack::unpack_codes(self.dtype, self.group(g), out)
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::{QK, QK_K, quantize_row_q8};

    fn rand_bytes(n: usize, seed: &mut u64) -> Vec<u8> {
        (0..n)
            .map(|_| {
                *seed = seed
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                (*seed >> 33) as u8
            })
            .collect()
    }

    /// Random GGUF blocks with finite f16 scales (normal range, both signs for `m`).
    fn rand_weights(dtype: DType, rows: usize, cols: usize, seed: &mut u64) -> Vec<u8> {
        let (bb, scales) = match dtype {
            DType::Q4_1 => (20, 2),
            DType::Q4_0 => (18, 1),
            DType::Q8_0 => (34, 1),
            DType::Q5_0 => (22, 1),
            DType::Q5_1 => (24, 2),
            _ => unreachable!(),
        };
        let mut data = rand_bytes(rows * cols / QK * bb, seed);
        for blk in data.chunks_mut(bb) {
            for s in 0..scales {
                let v = (f32::from(blk[2 + s]) - 128.0) / 4096.0 + 1e-4;
                blk[2 * s..2 * s + 2].copy_from_slice(&half::f16::from_f32(v).to_le_bytes());
            }
        }
        data
    }

    fn rand_act(cols: usize, seed: &mut u64) -> Vec<BlockQ8> {
        let x: Vec<f32> = rand_bytes(cols, seed)
            .into_iter()
            .map(|b| (f32::from(b) - 128.0) / 37.0)
            .collect();
        let mut q = vec![BlockQ8::default(); cols / QK];
        quantize_row_q8(&x, &mut q);
        q
    }

    fn check_bits<const T: usize>(dtype: DType, seed: u64) {
        let (rows, cols) = (24, 576);
        let mut seed = seed;
        let data = rand_weights(dtype, rows, cols, &mut seed);
        let w = QMatrix::new(dtype, rows, cols, &data).expect("shape");
        let p = PackedRows::new(&w).expect("packable here");
        let acts: Vec<Vec<BlockQ8>> = (0..T).map(|_| rand_act(cols, &mut seed)).collect();
        let a: [&[BlockQ8]; T] = std::array::from_fn(|t| acts[t].as_slice());
        let one_row = crate::matmul::one_row_kernel(dtype);
        // Q4_0: its pairs' terms, as `QInput::prepare` makes them.
        let pairs: Vec<Vec<Q40PairTerms>> = (0..T.div_ceil(2))
            .map(|i| {
                let second = acts.get(2 * i + 1);
                (acts[2 * i].iter().enumerate())
                    .map(|(b, x)| Q40PairTerms::new(x, second.map(|s| &s[b])))
                    .collect()
            })
            .collect();
        let pair = |i: usize| pairs.get(i).map_or(&[][..], Vec::as_slice);
        for g in 0..rows / GROUP_ROWS {
            let out = if dtype == DType::Q4_0 {
                p.dot_group_q4_0::<T>(g, a, [pair(0), pair(1), pair(2), pair(3)])
            } else {
                p.dot_group::<T>(g, a)
            };
            for t in 0..T {
                for i in 0..GROUP_ROWS {
                    let want = one_row(w.row(g * GROUP_ROWS + i), a[t]);
                    if dtype == DType::Q4_0 {
                        // The one-row kernel is the scalar reference's arithmetic, bit for bit.
                        let scalar =
                            crate::quant::dot_q4_0_q8_scalar(w.row(g * GROUP_ROWS + i), a[t]);
                        assert_eq!(want.to_bits(), scalar.to_bits(), "Q4_0 one-row vs scalar");
                    }
                    assert_eq!(
                        out[t][i].to_bits(),
                        want.to_bits(),
                        "{dtype:?} T={T} group {g} row {i} token {t}: {} vs {want}",
                        out[t][i]
                    );
                }
            }
        }
    }

    #[test]
    fn packed_kernels_give_the_one_row_kernels_bits_for_every_token_count() {
        if !available() {
            custody_test_skip::skip(
                "kernels::pack::packed_kernels_give_the_one_row_kernels_bits_for_every_token_count",
                "no AVX-512 F/BW/VL/VNNI on this machine",
                // CI's hosts vary (Zen 4 has it, Zen 3 does not): counted, never required.
                custody_test_skip::Need::Optional,
            );
            return;
        }
        for dtype in [
            DType::Q4_1,
            DType::Q8_0,
            DType::Q5_0,
            DType::Q5_1,
            DType::Q4_0,
        ] {
            for seed in [1, 2, 3] {
                check_bits::<1>(dtype, seed);
                check_bits::<2>(dtype, seed);
                check_bits::<3>(dtype, seed);
                check_bits::<4>(dtype, seed);
                if dtype == DType::Q4_0 {
                    // Its kernel takes up to eight tokens (four pairs) a call.
                    check_bits::<7>(dtype, seed);
                    check_bits::<8>(dtype, seed);
                }
            }
        }
    }

    /// Random GGUF K-quant blocks (Q4_K, Q5_K or Q6_K) with finite f16 scales of both signs.
    fn rand_kquant(dtype: DType, rows: usize, cols: usize, seed: &mut u64) -> Vec<u8> {
        let bb = dtype.block_bytes();
        let mut data = rand_bytes(rows * cols / QK_K * bb, seed);
        let f16_offsets: &[usize] = if dtype != DType::Q6_K {
            &[0, 2]
        } else {
            &[208]
        };
        for blk in data.chunks_mut(bb) {
            for &o in f16_offsets {
                let v = (f32::from(blk[o]) - 128.0) / 8192.0 + 1e-4;
                blk[o..o + 2].copy_from_slice(&half::f16::from_f32(v).to_le_bytes());
            }
        }
        data
    }

    fn rand_act_q8k(cols: usize, seed: &mut u64) -> Vec<BlockQ8K> {
        let x: Vec<f32> = rand_bytes(cols, seed)
            .into_iter()
            .map(|b| (f32::from(b) - 128.0) / 37.0)
            .collect();
        let mut q = vec![BlockQ8K::default(); cols / QK_K];
        crate::q8k::quantize_row_q8_k(&x, &mut q);
        q
    }

    fn check_kquant_bits<const T: usize>(dtype: DType, seed: u64) {
        let (rows, cols) = (16, 768);
        let mut seed = seed;
        let data = rand_kquant(dtype, rows, cols, &mut seed);
        let w = QMatrix::new(dtype, rows, cols, &data).expect("shape");
        let p = PackedRows::new(&w).expect("packable here");
        let acts: Vec<Vec<BlockQ8K>> = (0..T).map(|_| rand_act_q8k(cols, &mut seed)).collect();
        let lanes: Vec<Vec<Q8KLanes>> = acts
            .iter()
            .map(|a| a.iter().map(Q8KLanes::from).collect())
            .collect();
        let a: [&[BlockQ8K]; T] = std::array::from_fn(|t| acts[t].as_slice());
        let reference = crate::q8k::scalar_dot(dtype);
        let mut codes = Vec::new();
        let cases = (0..rows / GROUP_ROWS).flat_map(|g| (0..3).map(move |s| (g, s)));
        // Every order but Q4_K's lanes (llama.cpp repacks every Q4_K matrix that can be packed,
        // so no packed Q4_K row takes its `vec_dot` order).
        let orders = crate::q8k::tests::orders_of(dtype)
            .into_iter()
            .filter(move |&o| !(dtype == DType::Q4_K && o == KOrder::Lanes));
        for ((g, source), order) in cases.flat_map(|c| orders.clone().map(move |o| (c, o))) {
            let lanes_t = std::array::from_fn(|t| lanes[t].as_slice());
            // Every source of the same weights: packed from memory, cached, unpacked codes.
            let from = match source {
                0 => Weights::FromMemory,
                1 => Weights::Cached,
                _ => {
                    p.unpack_group(g, &mut codes);
                    Weights::Codes(&codes)
                }
            };
            let out = p.dot_group_q8k::<T>(g, lanes_t, from, order);
            for t in 0..T {
                for i in 0..GROUP_ROWS {
                    let want = reference(w.row(g * GROUP_ROWS + i), a[t], order);
                    assert_eq!(
                        out[t][i].to_bits(),
                        want.to_bits(),
                        "{dtype:?} {order:?} T={T} group {g} row {i} token {t} ({from:?}): {} vs {want}",
                        out[t][i]
                    );
                }
            }
        }
    }

    /// The packed K-quant kernels against the scalar reference of `crate::q8k`'s spec, bit for
    /// bit, for every token count (and so against every other kernel of that spec).
    #[test]
    fn packed_kquant_kernels_give_the_references_bits_for_every_token_count() {
        if !available() {
            custody_test_skip::skip(
                "kernels::pack::packed_kquant_kernels_give_the_references_bits_for_every_token_count",
                "no AVX-512 F/BW/VL/VNNI on this machine",
                // CI's hosts vary (Zen 4 has it, Zen 3 does not): counted, never required.
                custody_test_skip::Need::Optional,
            );
            return;
        }
        for dtype in [DType::Q4_K, DType::Q5_K, DType::Q6_K] {
            for seed in [1, 2, 3] {
                check_kquant_bits::<1>(dtype, seed);
                check_kquant_bits::<2>(dtype, seed);
                check_kquant_bits::<3>(dtype, seed);
                check_kquant_bits::<4>(dtype, seed);
            }
        }
    }

    /// The K-quant layouts hold every value of the GGUF blocks: each packed row dequantizes
    /// (through the layout's own definition, read back here) to the GGUF row's values.
    #[test]
    fn kquant_layouts_keep_every_value() {
        let mut seed = 5;
        for dtype in [DType::Q4_K, DType::Q6_K] {
            let data = rand_kquant(dtype, 8, 512, &mut seed);
            let w = QMatrix::new(dtype, 8, 512, &data).expect("shape");
            let p = PackedRows::pack(&w).expect("K-quants pack");
            let gb = group_block_bytes(dtype).expect("packed type");
            assert_eq!(p.data.len(), 2 * gb);
            for b in 0..2 {
                let blk = &p.data[b * gb..(b + 1) * gb];
                for r in 0..GROUP_ROWS {
                    let src = &w.row(r)[b * dtype.block_bytes()..(b + 1) * dtype.block_bytes()];
                    for pos in 0..QK_K {
                        let (want, got) = if dtype == DType::Q4_K {
                            let (h, k) = (pos / 128, pos % 64);
                            let byte = blk[160 + 128 * r + 64 * h + k];
                            let got = if pos % 128 < 64 {
                                byte & 0x0f
                            } else {
                                byte >> 4
                            };
                            (q4_k_nibble(&src[16..144], lane_element(pos)), got)
                        } else {
                            let row = &blk[144 + 192 * r..144 + 192 * (r + 1)];
                            let lo = if pos < 128 {
                                row[pos] & 0x0f
                            } else {
                                row[pos - 128] >> 4
                            };
                            let hi = (row[128 + pos % 64] >> (2 * (pos / 64))) & 3;
                            (q6_k_value(src, lane_element(pos)), lo | hi << 4)
                        };
                        assert_eq!(got, want, "{dtype:?} block {b} row {r} position {pos}");
                    }
                    let (sc, d) = if dtype == DType::Q4_K {
                        let (sc, m) = crate::kquant::scale_min_k4(5, &src[4..16]);
                        assert_eq!(blk[96 + 16 * 2 + 2 * r + 1], m, "min of sub-block 5");
                        (
                            blk[32 + 8 * r + 5] == sc,
                            blk[2 * r..2 * r + 2] == src[0..2],
                        )
                    } else {
                        (
                            blk[16 + 16 * r + 5] == src[192 + 5],
                            blk[2 * r..2 * r + 2] == src[208..210],
                        )
                    };
                    assert!(sc && d, "{dtype:?} block {b} row {r}: scales");
                }
            }
        }
    }

    /// Lane order is a permutation of a super-block whose lane `j` (bytes `4j..4j+4` of each
    /// 64-byte chunk) holds only 16-element group `j`, and `Q8KLanes` moves quants by it.
    #[test]
    fn lane_order_is_a_permutation_grouping_each_lane() {
        let mut seen = [false; QK_K];
        for pos in 0..QK_K {
            let e = lane_element(pos);
            assert!(!seen[e], "element {e} twice");
            seen[e] = true;
            assert_eq!(e / 16, (pos % 64) / 4, "position {pos}: lane and group");
        }
        let mut b = BlockQ8K::default();
        for (i, q) in b.qs.iter_mut().enumerate() {
            *q = (i % 251) as i8;
        }
        let l = Q8KLanes::from(&b);
        assert_eq!(l.qs[4], b.qs[16], "position 4 is group 1's first element");
        assert_eq!(
            l.qs[64], b.qs[4],
            "chunk 1 starts at group 0's fifth element"
        );
    }

    #[test]
    fn packing_is_a_permutation_and_refuses_what_it_cannot_run() {
        let mut seed = 9;
        let data = rand_weights(DType::Q4_1, 16, 64, &mut seed);
        let w = QMatrix::new(DType::Q4_1, 16, 64, &data).expect("shape");
        let p = PackedRows::pack(&w).expect("Q4_1 packs");
        let (mut a, mut b) = (p.data.clone(), data.clone());
        a.sort_unstable();
        b.sort_unstable();
        assert_eq!(a, b, "the same bytes, reordered");
        // Row 9's second block: d at group 1's block 1, slot 1.
        let g1 = p.group(1);
        assert_eq!(&g1[160 + 2..160 + 4], &w.row(9)[20..22]);
        assert_eq!(&g1[160 + 32 + 16..160 + 32 + 32], &w.row(9)[24..40]);
        let odd = rand_weights(DType::Q4_1, 12, 64, &mut seed);
        let w12 = QMatrix::new(DType::Q4_1, 12, 64, &odd).expect("shape");
        assert!(PackedRows::pack(&w12).is_none(), "rows not a multiple of 8");
    }
}

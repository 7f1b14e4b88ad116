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
//! - Q4_0: `d[8]` f16, then each row's 16 nibble bytes: 144 bytes.
//!
//! # Invariants
//! - Packing is a permutation of the GGUF bytes (and, for Q8_0, a fixed relabelling of each
//!   quant): nothing is rounded, so the packed kernels compute every output with the one-row
//!   kernel's arithmetic, bit for bit (tested for every token count).
//! - A [`PackedRows`] exists only where its kernel can run: x86-64 with AVX-512 F/BW/VL/VNNI, a
//!   Q4_0, Q4_1, Q5_0, Q5_1 or Q8_0 matrix whose rows are a multiple of eight. Elsewhere
//!   [`PackedRows::new`] says
//!   `None` and the GGUF-layout kernels run, as before.

use crate::matmul::QMatrix;
use crate::quant::{BlockQ8, DType, QK};

/// Rows per interleaved group.
pub const GROUP_ROWS: usize = 8;

/// A weight matrix repacked into groups of [`GROUP_ROWS`] interleaved rows (see the module
/// documentation). Owned: a copy of the matrix, the same size.
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

impl PackedRows {
    /// The repacked copy of `w`, or `None` where no packed kernel runs it (type, shape or CPU).
    pub fn new(w: &QMatrix<'_>) -> Option<Self> {
        Self::pack(w).filter(|_| available())
    }

    /// The repacking itself, whatever the CPU (tests compare layouts on any machine).
    fn pack(w: &QMatrix<'_>) -> Option<Self> {
        if !w.rows.is_multiple_of(GROUP_ROWS) || !w.cols.is_multiple_of(QK) {
            return None;
        }
        let nb = w.cols / QK;
        let mut data = Vec::with_capacity(w.data.len());
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
                        // d, then every row's nibbles.
                        let blocks = rows.map(|r| &r[b * 18..b * 18 + 18]);
                        blocks.iter().for_each(|k| data.extend_from_slice(&k[0..2]));
                        blocks
                            .iter()
                            .for_each(|k| data.extend_from_slice(&k[2..18]));
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
                    _ => return None,
                }
            }
        }
        debug_assert_eq!(data.len(), w.data.len(), "packing is a permutation");
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

    /// The bytes of group `g` (rows `8g .. 8g + 8`).
    fn group(&self, g: usize) -> &[u8] {
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
                    DType::Q5_0 => crate::x86_pack::dot8_q5_packed::<T, false, true>(gd, a),
                    DType::Q5_1 => crate::x86_pack::dot8_q5_packed::<T, true, true>(gd, a),
                    DType::Q4_0 => crate::x86_pack::dot8_q5_packed::<T, false, false>(gd, a),
                    _ => unreachable!("only Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 are packed"),
                }
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            let _ = (g, a);
            unreachable!("packed kernels are x86-64 only")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::quantize_row_q8;

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
        for g in 0..rows / GROUP_ROWS {
            let out = p.dot_group::<T>(g, a);
            for t in 0..T {
                for i in 0..GROUP_ROWS {
                    let want = one_row(w.row(g * GROUP_ROWS + i), a[t]);
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
                custody_test_skip::Need::OnCi,
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
            }
        }
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

//! Weight layouts the fast kernels read, made once from the GGUF bytes at upload (the host keeps
//! the file's layout; only the device copy is rearranged). Each layout is documented beside its
//! kernel in `kernels/cuda/ops.cu`; the functions here are its only writers.
//!
//! # Spec
//! - [`q4k`]: Q4_K (144-byte super-blocks of 256 weights: f16 d, f16 dmin, 12 scale bytes, 128
//!   quant bytes) into `custody_gemv_q4k`'s tiles — per row, groups of 4 super-blocks (the last
//!   padded with zero blocks): the 4 blocks' 16-byte heads, then their quants interleaved by
//!   32-bit word (word `l` of the 4 blocks side by side). Bytes moved: the file's, plus the
//!   padding (< 4 blocks per row). Pure and exact: [`q4k_unpack`] gives the file's bytes back.
//! - [`q6k`]: Q6_K (210-byte super-blocks: 128 low-nibble bytes, 64 high-pair bytes, 16 int8
//!   scales, f16 d) into `custody_gemv_q6k`'s tiles — per row, groups of 8 super-blocks (the
//!   last padded with zero blocks), lane `l` of a warp owning elements [`lane_element`]`(l, i)`
//!   = 4l..4l+3 and 128+4l..128+4l+3 of each block (so that a warp's x loads are contiguous):
//!   `heads` 9 × 16 bytes per group (the 8 blocks' d, then each block's 16 scales); `qs` 3 × 512
//!   bytes per group (lane l's 16 bytes: its low nibbles of blocks 0–3 as 4 words, of blocks
//!   4–7, then its high pairs of blocks 0–7 as 8 half-words, element i at bits 4i / 2i). The
//!   same bytes as the file's, rearranged; the reference dequantization decides what they mean.
//! - [`q8_0`]: Q8_0 (34-byte blocks of 32: f16 d, 32 int8) into `custody_gemv_q8_0`'s tiles —
//!   per row, groups of 8 blocks (256 elements; the last padded with zero blocks): `heads` the 8
//!   blocks' d (16 bytes), `qs` lane l's 8 quants at 8l: group elements [`lane_element`]`(l, i)`.

/// Bytes of one Q4_K super-block and of its parts.
pub const Q4K_BLOCK_BYTES: usize = 144;
const Q4K_HEAD_BYTES: usize = 16;
const Q4K_QS_BYTES: usize = 128;
const Q4K_WEIGHTS: usize = 256;
/// Super-blocks per tile group.
const GROUP: usize = 4;

/// A Q4_K matrix in the GEMV's layout: `heads` then `qs`, each 16-byte aligned.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Q4kTiles {
    pub heads: Vec<u8>,
    pub qs: Vec<u8>,
}

/// Why a matrix cannot be rearranged.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum RepackError {
    #[error("Q4_K rows of {cols} columns: not a whole number of 256-weight super-blocks")]
    Columns { cols: usize },
    #[error("{rows} × {cols} Q4_K weights take {want} bytes, {got} given")]
    Length {
        rows: usize,
        cols: usize,
        want: usize,
        got: usize,
    },
}

/// The tiles' extent for a `rows × cols` Q4_K matrix.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Q4kShape {
    rows: usize,
    groups_per_row: usize,
}

impl Q4kShape {
    /// `cols` a multiple of 256 (checked by [`q4k`]; a caller making tiles itself asserts it).
    pub fn of(rows: usize, cols: usize) -> Self {
        Self {
            rows,
            groups_per_row: groups(cols),
        }
    }
    /// Blocks per row, padding included.
    pub fn blocks_per_row(&self) -> usize {
        self.groups_per_row * GROUP
    }
    pub fn blocks(&self) -> usize {
        self.rows * self.blocks_per_row()
    }
    pub fn heads_bytes(&self) -> usize {
        self.blocks() * Q4K_HEAD_BYTES
    }
    pub fn qs_bytes(&self) -> usize {
        self.blocks() * Q4K_QS_BYTES
    }
}

/// A Q6_K or Q8_0 matrix in its GEMV's tiles: `heads`, `qs`.
pub type Tiles = Q4kTiles;

const Q6K_BLOCK_BYTES: usize = 210;
/// Q6_K super-blocks per tile group, and a group's heads and quants (16-byte units).
const Q6K_GROUP: usize = 8;
const Q6K_GROUP_HEADS: usize = 9 * 16;
const Q6K_GROUP_QS: usize = 3 * 512;

/// The 6-bit value (0..64) of element `k` (< 256) of a Q6_K block (ggml's `dequantize_row_q6_K`
/// order), and its scale's index.
fn q6k_element(block: &[u8], k: usize) -> (u8, usize) {
    let (n, j) = (k / 128, k % 128);
    let (quad, l) = (j / 32, j % 32);
    let ql = &block[64 * n..];
    let qh = block[128 + 32 * n + l];
    let lo = match quad {
        0 => ql[l] & 0xf,
        1 => ql[l + 32] & 0xf,
        2 => ql[l] >> 4,
        _ => ql[l + 32] >> 4,
    };
    let hi = (qh >> (2 * quad)) & 3;
    (lo | (hi << 4), 8 * n + l / 16 + 2 * quad)
}

/// The element (of a 256-element block or group) that lane `lane`'s `i`-th (< 8) value is:
/// 4·lane + i, then 128 + 4·lane + (i − 4) — each half of a warp's x a contiguous 512 bytes.
pub fn lane_element(lane: usize, i: usize) -> usize {
    if i < 4 {
        4 * lane + i
    } else {
        128 + 4 * lane + (i - 4)
    }
}

fn check_blocks(
    bytes: &[u8],
    rows: usize,
    cols: usize,
    weights: usize,
    block_bytes: usize,
) -> Result<usize, RepackError> {
    if cols == 0 || !cols.is_multiple_of(weights) {
        return Err(RepackError::Columns { cols });
    }
    let want = rows * cols / weights * block_bytes;
    if bytes.len() != want {
        return Err(RepackError::Length {
            rows,
            cols,
            want,
            got: bytes.len(),
        });
    }
    Ok(cols / weights)
}

/// `rows × cols` Q6_K weights (the file's bytes) in `custody_gemv_q6k`'s tiles.
pub fn q6k(bytes: &[u8], rows: usize, cols: usize) -> Result<Tiles, RepackError> {
    let nb = check_blocks(bytes, rows, cols, Q4K_WEIGHTS, Q6K_BLOCK_BYTES)?;
    let ng = nb.div_ceil(Q6K_GROUP);
    let mut heads = vec![0u8; rows * ng * Q6K_GROUP_HEADS];
    let mut qs = vec![0u8; rows * ng * Q6K_GROUP_QS];
    for row in 0..rows {
        for b in 0..nb {
            let block = &bytes[(row * nb + b) * Q6K_BLOCK_BYTES..][..Q6K_BLOCK_BYTES];
            let (t, s) = (row * ng + b / Q6K_GROUP, b % Q6K_GROUP);
            let h = &mut heads[t * Q6K_GROUP_HEADS..][..Q6K_GROUP_HEADS];
            h[2 * s..2 * s + 2].copy_from_slice(&block[208..210]);
            h[16 * (1 + s)..16 * (2 + s)].copy_from_slice(&block[192..208]);
            let q = &mut qs[t * Q6K_GROUP_QS..][..Q6K_GROUP_QS];
            for lane in 0..32 {
                let (mut lo, mut hi) = (0u32, 0u16);
                for i in 0..8 {
                    let (v, _) = q6k_element(block, lane_element(lane, i));
                    lo |= u32::from(v & 0xf) << (4 * i);
                    hi |= u16::from(v >> 4) << (2 * i);
                }
                // Chunk s / 4 holds the low words, chunk 2 the high half-words.
                q[(s / 4) * 512 + 16 * lane + 4 * (s % 4)..][..4]
                    .copy_from_slice(&lo.to_le_bytes());
                q[2 * 512 + 16 * lane + 2 * s..][..2].copy_from_slice(&hi.to_le_bytes());
            }
        }
    }
    Ok(Tiles { heads, qs })
}

/// Bytes of a Q8_0 block, its elements, and the blocks of a tile group.
const Q8_0_BLOCK_BYTES: usize = 34;
const Q8_0_WEIGHTS: usize = 32;
const Q8_0_GROUP: usize = 8;

/// `rows × cols` Q8_0 weights (the file's bytes) in `custody_gemv_q8_0`'s tiles.
pub fn q8_0(bytes: &[u8], rows: usize, cols: usize) -> Result<Tiles, RepackError> {
    let nb = check_blocks(bytes, rows, cols, Q8_0_WEIGHTS, Q8_0_BLOCK_BYTES)?;
    let ng = nb.div_ceil(Q8_0_GROUP);
    let mut heads = vec![0u8; rows * ng * 16];
    const GROUP_WEIGHTS: usize = Q8_0_GROUP * Q8_0_WEIGHTS;
    let mut qs = vec![0u8; rows * ng * GROUP_WEIGHTS];
    for row in 0..rows {
        let blocks = &bytes[row * nb * Q8_0_BLOCK_BYTES..][..nb * Q8_0_BLOCK_BYTES];
        for b in 0..nb {
            let t = row * ng + b / Q8_0_GROUP;
            heads[16 * t + 2 * (b % Q8_0_GROUP)..][..2]
                .copy_from_slice(&blocks[b * Q8_0_BLOCK_BYTES..][..2]);
        }
        for g in 0..ng {
            let tile = &mut qs[(row * ng + g) * GROUP_WEIGHTS..][..GROUP_WEIGHTS];
            for lane in 0..32 {
                for i in 0..8 {
                    let e = GROUP_WEIGHTS * g + lane_element(lane, i);
                    let (b, k) = (e / Q8_0_WEIGHTS, e % Q8_0_WEIGHTS);
                    if b < nb {
                        tile[8 * lane + i] = blocks[b * Q8_0_BLOCK_BYTES + 2 + k];
                    }
                }
            }
        }
    }
    Ok(Tiles { heads, qs })
}

/// Groups per row of `cols` Q4_K columns.
fn groups(cols: usize) -> usize {
    (cols / Q4K_WEIGHTS).div_ceil(GROUP)
}

fn check(bytes: &[u8], rows: usize, cols: usize) -> Result<usize, RepackError> {
    check_blocks(bytes, rows, cols, Q4K_WEIGHTS, Q4K_BLOCK_BYTES)
}

/// `rows × cols` Q4_K weights (the file's bytes) in the GEMV's tiles.
pub fn q4k(bytes: &[u8], rows: usize, cols: usize) -> Result<Q4kTiles, RepackError> {
    let nb = check(bytes, rows, cols)?;
    let ng = groups(cols);
    let shape = Q4kShape::of(rows, cols);
    let mut heads = vec![0u8; shape.heads_bytes()];
    let mut qs = vec![0u8; shape.qs_bytes()];
    for row in 0..rows {
        for b in 0..nb {
            let block = &bytes[(row * nb + b) * Q4K_BLOCK_BYTES..][..Q4K_BLOCK_BYTES];
            let (g, s) = (b / GROUP, b % GROUP);
            let t = row * ng + g;
            heads[(t * GROUP + s) * Q4K_HEAD_BYTES..][..Q4K_HEAD_BYTES]
                .copy_from_slice(&block[..Q4K_HEAD_BYTES]);
            let tile = &mut qs[t * GROUP * Q4K_QS_BYTES..][..GROUP * Q4K_QS_BYTES];
            for (l, word) in block[Q4K_HEAD_BYTES..].chunks_exact(4).enumerate() {
                tile[(l * GROUP + s) * 4..][..4].copy_from_slice(word);
            }
        }
    }
    Ok(Q4kTiles { heads, qs })
}

/// The file's bytes back from [`q4k`]'s tiles (the layout's definition, run backwards: tests).
pub fn q4k_unpack(t: &Q4kTiles, rows: usize, cols: usize) -> Vec<u8> {
    let nb = cols / Q4K_WEIGHTS;
    let ng = groups(cols);
    let mut out = vec![0u8; rows * nb * Q4K_BLOCK_BYTES];
    for row in 0..rows {
        for b in 0..nb {
            let (g, s) = (b / GROUP, b % GROUP);
            let tt = row * ng + g;
            let block = &mut out[(row * nb + b) * Q4K_BLOCK_BYTES..][..Q4K_BLOCK_BYTES];
            block[..Q4K_HEAD_BYTES]
                .copy_from_slice(&t.heads[(tt * GROUP + s) * Q4K_HEAD_BYTES..][..Q4K_HEAD_BYTES]);
            let tile = &t.qs[tt * GROUP * Q4K_QS_BYTES..][..GROUP * Q4K_QS_BYTES];
            for l in 0..Q4K_QS_BYTES / 4 {
                block[Q4K_HEAD_BYTES + 4 * l..][..4]
                    .copy_from_slice(&tile[(l * GROUP + s) * 4..][..4]);
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bytes(n: usize) -> Vec<u8> {
        (0..n).map(|i| (i * 131 % 251) as u8).collect()
    }

    #[test]
    fn q4k_tiles_round_trip_with_a_padded_last_group() {
        for (rows, cols) in [(1, 256), (3, 1280), (2, 2048)] {
            let w = bytes(rows * cols / 256 * Q4K_BLOCK_BYTES);
            let t = q4k(&w, rows, cols).expect("repack");
            assert_eq!(t.heads.len(), rows * groups(cols) * 4 * 16);
            assert_eq!(t.qs.len(), rows * groups(cols) * 4 * 128);
            assert_eq!(q4k_unpack(&t, rows, cols), w, "{rows}×{cols}");
        }
    }

    /// Word l of the 4 blocks of a group sit side by side: a lane's 16-byte load.
    #[test]
    fn a_lanes_sixteen_bytes_are_word_l_of_the_groups_four_blocks() {
        let w = bytes(4 * Q4K_BLOCK_BYTES);
        let t = q4k(&w, 1, 1024).expect("repack");
        for l in 0..32 {
            for s in 0..4 {
                let want = &w[s * Q4K_BLOCK_BYTES + 16 + 4 * l..][..4];
                assert_eq!(&t.qs[16 * l + 4 * s..][..4], want, "lane {l} block {s}");
            }
        }
    }

    /// Lane l's bits in a Q6_K tile are elements 8l..8l+7 of each block, as the reference
    /// order defines them; its scale index is the one the kernel computes from the lane.
    #[test]
    fn a_lanes_q6k_bits_are_its_eight_elements() {
        let w = bytes(8 * Q6K_BLOCK_BYTES);
        let t = q6k(&w, 1, 8 * 256).expect("repack");
        for s in 0..8 {
            let block = &w[s * Q6K_BLOCK_BYTES..][..Q6K_BLOCK_BYTES];
            assert_eq!(
                &t.heads[2 * s..2 * s + 2],
                &block[208..210],
                "d of block {s}"
            );
            for lane in 0..32 {
                let lo = u32::from_le_bytes(
                    t.qs[(s / 4) * 512 + 16 * lane + 4 * (s % 4)..][..4]
                        .try_into()
                        .expect("4 bytes"),
                );
                let hi = u16::from_le_bytes(
                    t.qs[1024 + 16 * lane + 2 * s..][..2]
                        .try_into()
                        .expect("2 bytes"),
                );
                // The kernel's scale indices: one per half of the lane's values.
                let sidx = 2 * (lane / 8) + (lane % 8) / 4;
                for i in 0..8 {
                    let (v, sc) = q6k_element(block, lane_element(lane, i));
                    let got = ((lo >> (4 * i)) & 0xf) as u8 | ((((hi >> (2 * i)) & 3) as u8) << 4);
                    assert_eq!(got, v, "block {s} lane {lane} element {i}");
                    assert_eq!(sc, sidx + if i < 4 { 0 } else { 8 }, "lane {lane}'s scale");
                }
            }
        }
    }

    #[test]
    fn q8_0_tiles_hold_the_blocks_in_order() {
        let w = bytes(9 * Q8_0_BLOCK_BYTES);
        let t = q8_0(&w, 1, 9 * 32).expect("repack");
        assert_eq!(t.heads.len(), 2 * 16);
        assert_eq!(t.qs.len(), 2 * 256);
        for b in 0..9 {
            let block = &w[b * 34..][..34];
            let (g, s) = (b / 8, b % 8);
            assert_eq!(&t.heads[16 * g + 2 * s..][..2], &block[..2]);
        }
        for g in 0..2 {
            for lane in 0..32 {
                for i in 0..8 {
                    let e = 256 * g + lane_element(lane, i);
                    // Past the 9 blocks: the last group's padding, zero.
                    let want = if e < 9 * 32 {
                        w[e / 32 * 34 + 2 + e % 32]
                    } else {
                        0
                    };
                    assert_eq!(
                        t.qs[256 * g + 8 * lane + i],
                        want,
                        "group {g} lane {lane} {i}"
                    );
                }
            }
        }
    }

    #[test]
    fn bad_shapes_are_refused_by_name() {
        assert_eq!(q6k(&[], 1, 100), Err(RepackError::Columns { cols: 100 }));
        assert_eq!(q8_0(&[], 1, 100), Err(RepackError::Columns { cols: 100 }));
        assert_eq!(q4k(&[], 1, 100), Err(RepackError::Columns { cols: 100 }));
        assert!(matches!(
            q4k(&[0; 10], 1, 256),
            Err(RepackError::Length { want: 144, .. })
        ));
    }
}

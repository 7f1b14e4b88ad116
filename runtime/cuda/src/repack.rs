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

/// Groups per row of `cols` Q4_K columns.
fn groups(cols: usize) -> usize {
    (cols / Q4K_WEIGHTS).div_ceil(GROUP)
}

fn check(bytes: &[u8], rows: usize, cols: usize) -> Result<usize, RepackError> {
    if cols == 0 || !cols.is_multiple_of(Q4K_WEIGHTS) {
        return Err(RepackError::Columns { cols });
    }
    let nb = cols / Q4K_WEIGHTS;
    let want = rows * nb * Q4K_BLOCK_BYTES;
    if bytes.len() != want {
        return Err(RepackError::Length {
            rows,
            cols,
            want,
            got: bytes.len(),
        });
    }
    Ok(nb)
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

    #[test]
    fn bad_shapes_are_refused_by_name() {
        assert_eq!(q4k(&[], 1, 100), Err(RepackError::Columns { cols: 100 }));
        assert!(matches!(
            q4k(&[0; 10], 1, 256),
            Err(RepackError::Length { want: 144, .. })
        ));
    }
}

//! Paged attention over an f16 KV cache, with the integrity-tag check.
//!
//! # Spec: the tag check (safety property 1, "no stale read")
//!
//! The KV cache of one layer is a pool of fixed-size pages. Each physical page `p` has a tag:
//! `generation[p]` (bumped by the pool at every allocation), `owner[p]` (an opaque id of the
//! current holder) and `filled[p]` (slots `0..filled[p]` have been written in the current
//! generation, for this layer). A caller holds a block table of [`PageRef`]s: which physical page,
//! at which generation, backs logical page `i` of its sequence.
//!
//! Before reading anything, [`paged_attention`] calls [`check_tags`] over every page the queries
//! will attend, and refuses (returns an [`IntegrityError`], reads nothing, writes nothing to
//! `out`) unless, for each logical page `i` covering slots `i·P .. min((i+1)·P, n_ctx)`:
//! 1. the physical page exists in the pool,
//! 2. `generation[page] == expected generation` (not a stale, reallocated page),
//! 3. `owner[page] == owner` (not someone else's page),
//! 4. `filled[page] >= ` the number of slots attended in that page (no allocated-but-unwritten
//!    slot is ever read).
//!
//! The check is not optional and has no bypass: the only entry point that reads KV memory is
//! [`paged_attention`], and it always checks first.
//!
//! # Numerics
//! K and V are stored as f16 (llama.cpp's default cache type). As in llama.cpp's CPU path the
//! query is rounded to f16 before `Q·K`, scores are scaled by `1/sqrt(head_dim)` and soft-maxed in
//! f32, and the probabilities are rounded to f16 before the weighted sum of V.

use half::f16;
use rayon::prelude::*;

use crate::ops;

/// Shape of one page of one layer's K (or V) cache: `n_kv_heads × page_size × head_dim` f16
/// values, laid out `[kv_head][slot][dim]` so that a head's slots are contiguous.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PageGeometry {
    pub page_size: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
}

impl PageGeometry {
    /// f16 elements per page (per layer, K or V).
    pub const fn page_elems(&self) -> usize {
        self.n_kv_heads * self.page_size * self.head_dim
    }

    /// Element offset of `(page, kv_head, slot)` in a layer's cache.
    pub const fn offset(&self, page: usize, kv_head: usize, slot: usize) -> usize {
        ((page * self.n_kv_heads + kv_head) * self.page_size + slot) * self.head_dim
    }
}

/// One entry of a block table: physical page and the generation it is expected to have.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct PageRef {
    pub page: u32,
    pub generation: u32,
}

/// The tag arrays of one layer of the pool, indexed by physical page.
#[derive(Clone, Copy, Debug)]
pub struct TagView<'a> {
    pub generation: &'a [u32],
    pub owner: &'a [u64],
    /// Slots written in the current generation, for this layer.
    pub filled: &'a [u32],
}

/// A tag mismatch: the read is refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum IntegrityError {
    #[error("page {page} is outside the pool of {n_pages} pages")]
    PageOutOfRange { page: u32, n_pages: usize },
    #[error("block table has {have} pages but {n_ctx} slots need {need}")]
    BlockTableTooShort { have: usize, need: usize, n_ctx: usize },
    #[error("stale page {page}: expected generation {expected}, tag has {found}")]
    StaleGeneration { page: u32, expected: u32, found: u32 },
    #[error("foreign page {page} (generation {generation}): owned by {found:#x}, reader is {expected:#x}")]
    ForeignOwner { page: u32, generation: u32, expected: u64, found: u64 },
    #[error("unwritten slot: page {page} slot {slot} would be read but only {filled} slots are written in generation {generation}")]
    UnwrittenSlot { page: u32, generation: u32, slot: u32, filled: u32 },
    #[error("out-of-order write: page {page} slot {slot} written when {filled} slots are filled (writes are append-only within a generation)")]
    OutOfOrderWrite { page: u32, slot: u32, filled: u32 },
}

/// Verify the tags of every page that attending `n_ctx` slots through `block_table` touches.
/// See the module documentation for the exact rule.
pub fn check_tags(
    block_table: &[PageRef],
    n_ctx: usize,
    page_size: usize,
    tags: &TagView<'_>,
    owner: u64,
) -> Result<(), IntegrityError> {
    assert!(page_size > 0);
    let need = n_ctx.div_ceil(page_size);
    if block_table.len() < need {
        return Err(IntegrityError::BlockTableTooShort { have: block_table.len(), need, n_ctx });
    }
    let n_pages = tags.generation.len();
    debug_assert!(tags.owner.len() == n_pages && tags.filled.len() == n_pages);
    for (i, pr) in block_table[..need].iter().enumerate() {
        let p = pr.page as usize;
        if p >= n_pages || p >= tags.owner.len() || p >= tags.filled.len() {
            return Err(IntegrityError::PageOutOfRange { page: pr.page, n_pages });
        }
        let found = tags.generation[p];
        if found != pr.generation {
            return Err(IntegrityError::StaleGeneration { page: pr.page, expected: pr.generation, found });
        }
        if tags.owner[p] != owner {
            return Err(IntegrityError::ForeignOwner {
                page: pr.page,
                generation: found,
                expected: owner,
                found: tags.owner[p],
            });
        }
        let attended = (n_ctx - i * page_size).min(page_size) as u32;
        let filled = tags.filled[p];
        if filled < attended {
            return Err(IntegrityError::UnwrittenSlot {
                page: pr.page,
                generation: found,
                slot: filled,
                filled,
            });
        }
    }
    Ok(())
}

/// Inputs of one sequence's attention for one layer.
#[derive(Clone, Copy, Debug)]
pub struct AttentionArgs<'a> {
    /// `n_q × n_heads × head_dim`; query `i` is at position `start_pos + i` and attends causally
    /// to slots `0..=start_pos + i`.
    pub q: &'a [f32],
    pub n_heads: usize,
    pub start_pos: usize,
    pub k_cache: &'a [f16],
    pub v_cache: &'a [f16],
    pub geom: PageGeometry,
    pub block_table: &'a [PageRef],
    pub tags: TagView<'a>,
    pub owner: u64,
}

/// Reusable buffers for [`paged_attention`].
#[derive(Debug, Default)]
pub struct AttnScratch {
    k: Vec<f32>,
    v: Vec<f32>,
}

/// Causal paged attention for one sequence. Checks the tags first (see module docs); on a
/// mismatch returns the error without reading the cache or touching `out`.
pub fn paged_attention(
    args: &AttentionArgs<'_>,
    out: &mut [f32],
    scratch: &mut AttnScratch,
) -> Result<(), IntegrityError> {
    let g = args.geom;
    let d = g.head_dim;
    assert!(args.n_heads % g.n_kv_heads == 0, "heads must be a multiple of kv heads");
    assert_eq!(args.q.len() % (args.n_heads * d), 0);
    let n_q = args.q.len() / (args.n_heads * d);
    assert!(n_q > 0);
    assert_eq!(out.len(), args.q.len());
    let n_ctx = args.start_pos + n_q;

    check_tags(args.block_table, n_ctx, g.page_size, &args.tags, args.owner)?;

    // Gather K and V of the attended slots into contiguous f32 per kv head: [kv_head][t][d].
    scratch.k.resize(g.n_kv_heads * n_ctx * d, 0.0);
    scratch.v.resize(g.n_kv_heads * n_ctx * d, 0.0);
    let gather = |(h, (kd, vd)): (usize, (&mut [f32], &mut [f32]))| {
        for (i, pr) in args.block_table[..n_ctx.div_ceil(g.page_size)].iter().enumerate() {
            let slots = (n_ctx - i * g.page_size).min(g.page_size);
            let off = g.offset(pr.page as usize, h, 0);
            let dst = i * g.page_size * d..(i * g.page_size + slots) * d;
            ops::f16_to_f32(&args.k_cache[off..off + slots * d], &mut kd[dst.clone()]);
            ops::f16_to_f32(&args.v_cache[off..off + slots * d], &mut vd[dst]);
        }
    };
    let per_head = n_ctx * d;
    let big = n_ctx * n_q * args.n_heads >= 1 << 14 && rayon::current_num_threads() > 1;
    if big {
        scratch
            .k
            .par_chunks_mut(per_head)
            .zip(scratch.v.par_chunks_mut(per_head))
            .enumerate()
            .for_each(gather);
    } else {
        scratch.k.chunks_mut(per_head).zip(scratch.v.chunks_mut(per_head)).enumerate().for_each(gather);
    }

    let (kf, vf) = (&scratch.k[..], &scratch.v[..]);
    let group = args.n_heads / g.n_kv_heads;
    let scale = 1.0 / (d as f32).sqrt();
    // One (query row, head) → writes `out[i][head]`.
    let attend_one = |i: usize, head: usize, o: &mut [f32], scores: &mut Vec<f32>| {
        let h = head / group;
        let p = args.start_pos + i;
        let qoff = (i * args.n_heads + head) * d;
        let mut q = [0.0f32; 256];
        let q = &mut q[..d];
        for (dst, &src) in q.iter_mut().zip(&args.q[qoff..qoff + d]) {
            *dst = f16::from_f32(src).to_f32();
        }
        let kh = &kf[h * per_head..(h + 1) * per_head];
        let vh = &vf[h * per_head..(h + 1) * per_head];
        scores.clear();
        scores.extend((0..=p).map(|t| ops::dot_f32(q, &kh[t * d..(t + 1) * d]) * scale));
        ops::softmax(scores);
        o.fill(0.0);
        for (t, &w) in scores.iter().enumerate() {
            ops::axpy(f16::from_f32(w).to_f32(), &vh[t * d..(t + 1) * d], o);
        }
    };
    assert!(d <= 256, "head_dim above 256 is not supported");
    if n_q == 1 {
        if big {
            out.par_chunks_mut(d).enumerate().for_each_init(Vec::new, |sc, (head, o)| attend_one(0, head, o, sc));
        } else {
            let mut sc = Vec::with_capacity(n_ctx);
            for (head, o) in out.chunks_mut(d).enumerate() {
                attend_one(0, head, o, &mut sc);
            }
        }
    } else {
        let row = args.n_heads * d;
        let do_row = |sc: &mut Vec<f32>, (i, orow): (usize, &mut [f32])| {
            for (head, o) in orow.chunks_mut(d).enumerate() {
                attend_one(i, head, o, sc);
            }
        };
        if big {
            out.par_chunks_mut(row).enumerate().for_each_init(Vec::new, do_row);
        } else {
            let mut sc = Vec::with_capacity(n_ctx);
            out.chunks_mut(row).enumerate().for_each(|x| do_row(&mut sc, x));
        }
    }
    Ok(())
}

/// Scalar reference attention over plain per-position K/V rows (`[t][kv_head][d]`, f32), used by
/// tests to validate [`paged_attention`]. Applies the same f16 roundings.
pub fn attention_reference(
    q: &[f32],
    n_heads: usize,
    n_kv_heads: usize,
    head_dim: usize,
    start_pos: usize,
    k: &[f32],
    v: &[f32],
) -> Vec<f32> {
    let d = head_dim;
    let n_q = q.len() / (n_heads * d);
    let group = n_heads / n_kv_heads;
    let mut out = vec![0.0; q.len()];
    for i in 0..n_q {
        for head in 0..n_heads {
            let h = head / group;
            let qv: Vec<f32> = q[(i * n_heads + head) * d..][..d].iter().map(|&x| f16::from_f32(x).to_f32()).collect();
            let mut s: Vec<f32> = (0..=start_pos + i)
                .map(|t| {
                    let kr = &k[(t * n_kv_heads + h) * d..][..d];
                    let kr: Vec<f32> = kr.iter().map(|&x| f16::from_f32(x).to_f32()).collect();
                    ops::dot_f32_scalar(&qv, &kr) / (d as f32).sqrt()
                })
                .collect();
            ops::softmax(&mut s);
            let o = &mut out[(i * n_heads + head) * d..][..d];
            for (t, &w) in s.iter().enumerate() {
                let w = f16::from_f32(w).to_f32();
                for (j, ov) in o.iter_mut().enumerate() {
                    *ov += w * f16::from_f32(v[(t * n_kv_heads + h) * d + j]).to_f32();
                }
            }
        }
    }
    out
}

/// Write one slot of K and V (`n_kv_heads × head_dim` each, f32) into `page`, converting to f16.
/// The caller (the page pool) is responsible for the tag bookkeeping of the write.
pub fn write_kv_slot(
    k_cache: &mut [f16],
    v_cache: &mut [f16],
    geom: PageGeometry,
    page: usize,
    slot: usize,
    k: &[f32],
    v: &[f32],
) {
    let d = geom.head_dim;
    assert!(slot < geom.page_size);
    assert_eq!(k.len(), geom.n_kv_heads * d);
    assert_eq!(v.len(), geom.n_kv_heads * d);
    for h in 0..geom.n_kv_heads {
        let off = geom.offset(page, h, slot);
        for (dst, &src) in k_cache[off..off + d].iter_mut().zip(&k[h * d..(h + 1) * d]) {
            *dst = f16::from_f32(src);
        }
        for (dst, &src) in v_cache[off..off + d].iter_mut().zip(&v[h * d..(h + 1) * d]) {
            *dst = f16::from_f32(src);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const G: PageGeometry = PageGeometry { page_size: 4, n_kv_heads: 2, head_dim: 8 };

    fn rnd(n: usize, seed: &mut u64) -> Vec<f32> {
        (0..n)
            .map(|_| {
                *seed = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(7);
                ((*seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
            })
            .collect()
    }

    struct Fixture {
        k: Vec<f16>,
        v: Vec<f16>,
        gens: Vec<u32>,
        owner: Vec<u64>,
        filled: Vec<u32>,
        table: Vec<PageRef>,
        k_rows: Vec<f32>,
        v_rows: Vec<f32>,
    }

    /// Pool of 6 pages; a sequence of `n` tokens written into pages 5, 2, 0, … (scattered).
    fn fixture(n: usize, seed: &mut u64) -> Fixture {
        let n_pages = 6;
        let mut f = Fixture {
            k: vec![f16::ZERO; n_pages * G.page_elems()],
            v: vec![f16::ZERO; n_pages * G.page_elems()],
            gens: vec![3; n_pages],
            owner: vec![0; n_pages],
            filled: vec![0; n_pages],
            table: Vec::new(),
            k_rows: rnd(n * G.n_kv_heads * G.head_dim, seed),
            v_rows: rnd(n * G.n_kv_heads * G.head_dim, seed),
        };
        let order = [5u32, 2, 0, 4, 1, 3];
        for &p in order.iter().take(n.div_ceil(G.page_size)) {
            f.table.push(PageRef { page: p, generation: 3 });
            f.owner[p as usize] = 42;
        }
        let row = G.n_kv_heads * G.head_dim;
        for t in 0..n {
            let pr = f.table[t / G.page_size];
            write_kv_slot(&mut f.k, &mut f.v, G, pr.page as usize, t % G.page_size, &f.k_rows[t * row..][..row], &f.v_rows[t * row..][..row]);
            f.filled[pr.page as usize] += 1;
        }
        f
    }

    fn run(f: &Fixture, q: &[f32], start: usize, owner: u64) -> Result<Vec<f32>, IntegrityError> {
        let args = AttentionArgs {
            q,
            n_heads: 4,
            start_pos: start,
            k_cache: &f.k,
            v_cache: &f.v,
            geom: G,
            block_table: &f.table,
            tags: TagView { generation: &f.gens, owner: &f.owner, filled: &f.filled },
            owner,
        };
        let mut out = vec![f32::NAN; q.len()];
        paged_attention(&args, &mut out, &mut AttnScratch::default()).map(|()| out)
    }

    #[test]
    fn matches_reference_for_prefill_and_decode() {
        let mut seed = 1;
        for n in [1, 3, 4, 5, 13, 24] {
            let f = fixture(n, &mut seed);
            // prefill: all n queries
            let q = rnd(n * 4 * G.head_dim, &mut seed);
            let got = run(&f, &q, 0, 42).expect("tags valid");
            let want = attention_reference(&q, 4, 2, G.head_dim, 0, &f.k_rows, &f.v_rows);
            for (a, b) in got.iter().zip(&want) {
                assert!((a - b).abs() < 1e-4, "n={n}: {a} vs {b}");
            }
            // decode: last query only
            let q1 = &q[(n - 1) * 4 * G.head_dim..];
            let got1 = run(&f, q1, n - 1, 42).expect("tags valid");
            assert_eq!(&got1[..], &got[(n - 1) * 4 * G.head_dim..]);
        }
    }

    #[test]
    fn stale_generation_is_refused_and_out_untouched() {
        let mut seed = 2;
        let mut f = fixture(9, &mut seed);
        f.gens[2] += 1; // page 2 (logical page 1) was reallocated
        let q = rnd(4 * G.head_dim, &mut seed);
        let args_out = run(&f, &q, 8, 42);
        assert_eq!(args_out, Err(IntegrityError::StaleGeneration { page: 2, expected: 3, found: 4 }));
    }

    #[test]
    fn foreign_owner_is_refused() {
        let mut seed = 3;
        let mut f = fixture(9, &mut seed);
        f.owner[0] = 7;
        let q = rnd(4 * G.head_dim, &mut seed);
        assert!(matches!(run(&f, &q, 8, 42), Err(IntegrityError::ForeignOwner { page: 0, found: 7, .. })));
        // and a reader with the wrong identity is refused on the first page
        let f = fixture(9, &mut seed);
        assert!(matches!(run(&f, &q, 8, 41), Err(IntegrityError::ForeignOwner { page: 5, .. })));
    }

    #[test]
    fn unwritten_slot_is_refused() {
        let mut seed = 4;
        let f = fixture(9, &mut seed);
        // 9 slots written (3 pages allocated); a query at position 10 would attend slots 9 and 10
        // of page 0, allocated but never written.
        let q = rnd(4 * G.head_dim, &mut seed);
        assert_eq!(
            run(&f, &q, 10, 42),
            Err(IntegrityError::UnwrittenSlot { page: 0, generation: 3, slot: 1, filled: 1 })
        );
        // position 12 is past the allocated pages altogether.
        assert!(matches!(run(&f, &q, 12, 42), Err(IntegrityError::BlockTableTooShort { .. })));
        let mut f = fixture(12, &mut seed);
        f.filled[0] = 1; // logical page 2 has 1 of 4 slots written
        assert_eq!(
            run(&f, &q, 11, 42),
            Err(IntegrityError::UnwrittenSlot { page: 0, generation: 3, slot: 1, filled: 1 })
        );
    }

    #[test]
    fn out_of_range_page_is_refused() {
        let mut seed = 5;
        let mut f = fixture(4, &mut seed);
        f.table[0].page = 99;
        let q = rnd(4 * G.head_dim, &mut seed);
        assert!(matches!(run(&f, &q, 3, 42), Err(IntegrityError::PageOutOfRange { page: 99, .. })));
    }
}

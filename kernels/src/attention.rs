//! Paged attention over an f16 or q8_0 KV cache, with the integrity-tag check.
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
//! 3. the reader admits `owner[page]` ([`Reader::admits`]): it is the reader's own id, or one
//!    of the at most [`MAX_SHARED`] namespace tags whose read-only shared pages (a prefix cache's)
//!    the reader may attend — never a free page's [`NO_OWNER`]; anything else is someone else's
//!    page,
//! 4. `filled[page] >= ` the number of slots attended in that page (no allocated-but-unwritten
//!    slot is ever read),
//! 5. the page's in-band stamp (the (owner, generation) its data was last written for, stored with
//!    the data and carried in-band by transfers) equals (`owner[page]`, expected generation): a
//!    late remote write that landed after the page changed hands is caught even though rules 1–4
//!    hold.
//!
//! A shared page's owner is its namespace's tag, which no request id equals, so every write of
//! one is refused by the write's owner check: shared pages are read-only by construction.
//!
//! The only entry point that reads KV memory is [`paged_attention`], and it checks first. The one
//! way to skip the check is [`TagCheck::DisabledForIncidentReproduction`], which exists to
//! reproduce the incident on purpose and is only reachable through `--unsafe-reproduction`.
//!
//! # Numerics
//! K and V are stored as f16 (llama.cpp's default cache type) or, if the pool is configured so,
//! as q8_0 blocks ([`KvType::Q8_0`]: llama.cpp's `--cache-type-k/v q8_0` format, 32 values as
//! int8 with one f16 scale, ~53 % of f16's bytes). As in llama.cpp's CPU path the query is
//! rounded to f16 before `Q·K`, scores are scaled by `1/sqrt(head_dim)` and soft-maxed in f32,
//! and the probabilities are rounded to f16 before the weighted sum of V. A q8_0 value is
//! dequantized to `q · d` — exact in f32 (an 8-bit integer times an 11-bit mantissa) — and then
//! takes exactly the f16 path's arithmetic, so every kernel (gathered or in place) gives the same
//! bits for a given cache. (llama.cpp's own q8_0 cache runs only under flash attention, which
//! quantizes the query to q8_0 too; its logits are therefore not ours bit for bit.)

use half::f16;

use crate::ops;

/// How a K or V row is stored in the cache. The cache is an array of 16-bit *words*
/// (little-endian): an f16 row is `head_dim` words; a q8_0 row is `head_dim / 32` blocks of 17
/// words — ggml's `block_q8_0` (an f16 scale `d`, then 32 int8 values; value `i` is
/// `qs[i] · d`), byte for byte.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum KvType {
    #[default]
    F16,
    Q8_0,
}

/// Values per q8_0 block.
pub const Q8_0_BLOCK: usize = 32;
/// Words per q8_0 block (2 bytes of scale + 32 bytes of values).
const Q8_0_WORDS: usize = 17;

impl KvType {
    /// The name configuration files and the transfer handshake use (llama.cpp's `--cache-type`).
    pub const fn name(self) -> &'static str {
        match self {
            KvType::F16 => "f16",
            KvType::Q8_0 => "q8_0",
        }
    }

    /// The type named `name` ([`KvType::name`]), if any.
    pub fn from_name(name: &str) -> Option<Self> {
        [KvType::F16, KvType::Q8_0]
            .into_iter()
            .find(|t| t.name() == name)
    }

    /// Whether rows of `head_dim` values can be stored in this type (q8_0: whole blocks).
    pub const fn supports(self, head_dim: usize) -> bool {
        match self {
            KvType::F16 => head_dim > 0,
            KvType::Q8_0 => head_dim > 0 && head_dim.is_multiple_of(Q8_0_BLOCK),
        }
    }

    /// Words of one row of `head_dim` values.
    pub const fn row_words(self, head_dim: usize) -> usize {
        match self {
            KvType::F16 => head_dim,
            KvType::Q8_0 => head_dim / Q8_0_BLOCK * Q8_0_WORDS,
        }
    }
}

/// Shape of one page of one layer's K (or V) cache: `n_kv_heads × page_size` rows of
/// `head_dim` values stored as `kv`, laid out `[kv_head][slot][row]` so that a head's slots are
/// contiguous.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PageGeometry {
    pub page_size: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub kv: KvType,
}

impl PageGeometry {
    /// Words of one row (one slot of one kv head).
    pub const fn row_words(&self) -> usize {
        self.kv.row_words(self.head_dim)
    }

    /// Words per page (per layer, K or V).
    pub const fn page_words(&self) -> usize {
        self.n_kv_heads * self.page_size * self.row_words()
    }

    /// Word offset of the row of `(page, kv_head, slot)` in a layer's cache.
    pub const fn offset(&self, page: usize, kv_head: usize, slot: usize) -> usize {
        ((page * self.n_kv_heads + kv_head) * self.page_size + slot) * self.row_words()
    }
}

/// The owner value of a free page (request ids and namespace tags are never 0).
pub const NO_OWNER: u64 = 0;

/// Most namespaces one reader may attend shared pages of: its own private namespace and one
/// operator-declared public scope.
pub const MAX_SHARED: usize = 2;

/// Who reads: the owner value of the reader's own pages (its request id) and the tags of the
/// namespaces whose read-only shared pages it may attend. The fields are private so that "a
/// shared owner of 0" — which would admit free pages — cannot be written.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Reader {
    owner: u64,
    /// Namespace tags, `NO_OWNER` where unused.
    shared: [u64; MAX_SHARED],
}

impl Reader {
    /// A reader of its own pages only.
    pub const fn private(owner: u64) -> Self {
        Self {
            owner,
            shared: [NO_OWNER; MAX_SHARED],
        }
    }

    /// A reader of its own pages and of the shared pages of `shared` (at most [`MAX_SHARED`]).
    pub fn with_shared(owner: u64, shared: &[std::num::NonZeroU64]) -> Self {
        assert!(
            shared.len() <= MAX_SHARED,
            "at most {MAX_SHARED} shared namespaces"
        );
        let mut r = Self::private(owner);
        for (slot, tag) in r.shared.iter_mut().zip(shared) {
            debug_assert_ne!(tag.get(), owner, "a namespace tag equal to a request id");
            *slot = tag.get();
        }
        r
    }

    /// The reader's own owner value (its request id).
    pub const fn owner(&self) -> u64 {
        self.owner
    }

    /// Whether the reader attends any shared page.
    pub fn has_shared(&self) -> bool {
        self.shared.iter().any(|&t| t != NO_OWNER)
    }

    /// The reader as the CUDA kernels take it (`CustodyReader` in `kernels/cuda/custody.cuh`):
    /// the owner, then the shared tags (`NO_OWNER` where unused).
    pub const fn words(&self) -> [u64; 1 + MAX_SHARED] {
        [self.owner, self.shared[0], self.shared[1]]
    }

    /// Whether a page whose tag says `tag_owner` is one this reader may attend.
    pub fn admits(&self, tag_owner: u64) -> bool {
        tag_owner == self.owner || (tag_owner != NO_OWNER && self.shared.contains(&tag_owner))
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
    /// The in-band stamp: (owner, generation) that the page's *data* was last written for, kept
    /// with the bytes (a local write sets it; a transfer carries it in the page header). A write
    /// that lands after the page changed hands (a late remote write) leaves its old stamp, which
    /// the check refuses even though the out-of-band tag looks right.
    pub stamp_owner: &'a [u64],
    pub stamp_generation: &'a [u32],
}

/// Whether [`paged_attention`] checks tags. There is exactly one way to turn it off, named for the
/// only reason it exists: reproducing the incident on purpose (`--unsafe-reproduction`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum TagCheck {
    #[default]
    Enforced,
    /// UNSAFE: reads whatever the pages hold. Only for the incident reproduction.
    DisabledForIncidentReproduction,
}

/// A tag mismatch: the read is refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum IntegrityError {
    #[error("page {page} is outside the pool of {n_pages} pages")]
    PageOutOfRange { page: u32, n_pages: usize },
    #[error("block table has {have} pages but {n_ctx} slots need {need}")]
    BlockTableTooShort {
        have: usize,
        need: usize,
        n_ctx: usize,
    },
    #[error("stale page {page}: expected generation {expected}, tag has {found}")]
    StaleGeneration {
        page: u32,
        expected: u32,
        found: u32,
    },
    #[error(
        "foreign page {page} (generation {generation}): owned by {found:#x}, reader is {expected:#x}"
    )]
    ForeignOwner {
        page: u32,
        generation: u32,
        expected: u64,
        found: u64,
    },
    #[error(
        "unwritten slot: page {page} slot {slot} would be read but only {filled} slots are written in generation {generation}"
    )]
    UnwrittenSlot {
        page: u32,
        generation: u32,
        slot: u32,
        filled: u32,
    },
    #[error(
        "out-of-order write: page {page} slot {slot} written when {filled} slots are filled (writes are append-only within a generation)"
    )]
    OutOfOrderWrite { page: u32, slot: u32, filled: u32 },
    #[error(
        "in-band stamp mismatch on page {page} (generation {generation}): its data was last written for {stamp_owner:#x} in generation {stamp_generation} (a late or misdirected write)"
    )]
    InBandMismatch {
        page: u32,
        generation: u32,
        stamp_owner: u64,
        stamp_generation: u32,
    },
}

/// Benchmark of the tag check alone: the mean wall time of the checks one decode step performs
/// for one sequence — `n_layers` calls of [`check_tags`] over a block table covering `n_ctx`
/// slots of `page_size`-slot pages, every page written and owned by the reader (the common case:
/// the check passes and reads every tag) — over `iters` steps. `custody bench` states it as a
/// share of the measured decode step.
pub fn bench_decode_step_tag_checks(
    n_ctx: usize,
    page_size: usize,
    n_layers: usize,
    iters: u32,
) -> std::time::Duration {
    const OWNER: u64 = 7;
    bench_tag_checks(
        n_ctx,
        page_size,
        n_layers,
        iters,
        OWNER,
        Reader::private(OWNER),
    )
}

/// [`bench_decode_step_tag_checks`] when every page is a prefix cache's shared page: owned by
/// one of the two namespaces the reader names (the second, so `admits` compares all three).
pub fn bench_decode_step_tag_checks_shared(
    n_ctx: usize,
    page_size: usize,
    n_layers: usize,
    iters: u32,
) -> std::time::Duration {
    let private = std::num::NonZeroU64::new(0x8000_0000_0000_0001).expect("non-zero");
    let public = std::num::NonZeroU64::new(0x8000_0000_0000_0002).expect("non-zero");
    let reader = Reader::with_shared(7, &[private, public]);
    bench_tag_checks(n_ctx, page_size, n_layers, iters, public.get(), reader)
}

/// Every page tagged `owner` (generation 1, written whole), checked as `reader`.
fn bench_tag_checks(
    n_ctx: usize,
    page_size: usize,
    n_layers: usize,
    iters: u32,
    owner: u64,
    reader: Reader,
) -> std::time::Duration {
    assert!(page_size > 0 && iters > 0);
    let n_pages = n_ctx.div_ceil(page_size);
    let generation = vec![1u32; n_pages];
    let owners = vec![owner; n_pages];
    let filled = vec![page_size as u32; n_pages];
    let table: Vec<PageRef> = (0..n_pages as u32)
        .map(|page| PageRef {
            page,
            generation: 1,
        })
        .collect();
    let tags = TagView {
        generation: &generation,
        owner: &owners,
        filled: &filled,
        stamp_owner: &owners,
        stamp_generation: &generation,
    };
    let t0 = std::time::Instant::now();
    for _ in 0..iters {
        for _ in 0..n_layers {
            let r = check_tags(
                std::hint::black_box(&table),
                n_ctx,
                page_size,
                &tags,
                reader,
            );
            assert!(r.is_ok(), "the benchmark's tags are valid");
        }
    }
    t0.elapsed() / iters
}

/// Verify the tags of every page that attending `n_ctx` slots through `block_table` touches.
/// See the module documentation for the exact rule.
pub fn check_tags(
    block_table: &[PageRef],
    n_ctx: usize,
    page_size: usize,
    tags: &TagView<'_>,
    reader: Reader,
) -> Result<(), IntegrityError> {
    assert!(page_size > 0);
    let need = n_ctx.div_ceil(page_size);
    if block_table.len() < need {
        return Err(IntegrityError::BlockTableTooShort {
            have: block_table.len(),
            need,
            n_ctx,
        });
    }
    let n_pages = tags.generation.len();
    debug_assert!(tags.owner.len() == n_pages && tags.filled.len() == n_pages);
    for (i, pr) in block_table[..need].iter().enumerate() {
        let p = pr.page as usize;
        if p >= n_pages || p >= tags.owner.len() || p >= tags.filled.len() {
            return Err(IntegrityError::PageOutOfRange {
                page: pr.page,
                n_pages,
            });
        }
        let found = tags.generation[p];
        if found != pr.generation {
            return Err(IntegrityError::StaleGeneration {
                page: pr.page,
                expected: pr.generation,
                found,
            });
        }
        let page_owner = tags.owner[p];
        if !reader.admits(page_owner) {
            return Err(IntegrityError::ForeignOwner {
                page: pr.page,
                generation: found,
                expected: reader.owner(),
                found: page_owner,
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
        let (so, sg) = (
            tags.stamp_owner.get(p).copied().unwrap_or(0),
            tags.stamp_generation.get(p).copied().unwrap_or(0),
        );
        if so != page_owner || sg != found {
            return Err(IntegrityError::InBandMismatch {
                page: pr.page,
                generation: found,
                stamp_owner: so,
                stamp_generation: sg,
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
    /// One layer's K (V) cache: words laid out by `geom` ([`KvType`]).
    pub k_cache: &'a [u16],
    pub v_cache: &'a [u16],
    pub geom: PageGeometry,
    pub block_table: &'a [PageRef],
    pub tags: TagView<'a>,
    pub reader: Reader,
    /// Reduction order of the arithmetic (see [`ReduceOrder`]).
    pub order: ReduceOrder,
    /// Always [`TagCheck::Enforced`] outside the incident reproduction.
    pub check: TagCheck,
}

/// Reusable buffers for [`paged_attention`].
#[derive(Debug, Default)]
pub struct AttnScratch {
    k: Vec<f32>,
    v: Vec<f32>,
    /// K transposed for prompt rows on AVX-512 ([`attend_gemm_avx512`]): `[kv_head][dim][slot]`,
    /// slots zero-padded to a multiple of 16.
    kt: Vec<f32>,
    ws: Workspace,
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
    assert!(
        args.n_heads.is_multiple_of(g.n_kv_heads),
        "heads must be a multiple of kv heads"
    );
    assert_eq!(args.q.len() % (args.n_heads * d), 0);
    let n_q = args.q.len() / (args.n_heads * d);
    assert!(n_q > 0);
    assert_eq!(out.len(), args.q.len());
    let n_ctx = args.start_pos + n_q;

    match args.check {
        TagCheck::Enforced => {
            check_tags(
                args.block_table,
                n_ctx,
                g.page_size,
                &args.tags,
                args.reader,
            )?;
        }
        TagCheck::DisabledForIncidentReproduction => {
            // Still refuse what would be out of bounds: the reproduction reads stale pages, it
            // does not read outside the pool.
            let need = n_ctx.div_ceil(g.page_size);
            if args.block_table.len() < need {
                return Err(IntegrityError::BlockTableTooShort {
                    have: args.block_table.len(),
                    need,
                    n_ctx,
                });
            }
            let n_pages = args.tags.generation.len();
            if let Some(pr) = args.block_table[..need]
                .iter()
                .find(|pr| pr.page as usize >= n_pages)
            {
                return Err(IntegrityError::PageOutOfRange {
                    page: pr.page,
                    n_pages,
                });
            }
        }
    }

    #[cfg(target_arch = "x86_64")]
    if n_q == 1
        && args.order == ReduceOrder::Vec
        && crate::simd::has_avx512()
        && (d == 64 || d == 128)
    {
        decode_in_place(args, n_ctx, out);
        return Ok(());
    }

    // Gather K and V of the attended slots into contiguous f32 per kv head: [kv_head][t][d].
    scratch.k.resize(g.n_kv_heads * n_ctx * d, 0.0);
    scratch.v.resize(g.n_kv_heads * n_ctx * d, 0.0);
    // One task per (K or V, kv head): 2 × n_kv_heads tasks balance better over the pool than
    // n_kv_heads would (3 heads on 2 threads is a 2:1 split; 6 tasks split 3:3).
    let n_pages_att = n_ctx.div_ceil(g.page_size);
    let gather = |(i, dst): (usize, &mut [f32])| {
        let (h, cache) = if i < g.n_kv_heads {
            (i, args.k_cache)
        } else {
            (i - g.n_kv_heads, args.v_cache)
        };
        for (pi, pr) in args.block_table[..n_pages_att].iter().enumerate() {
            let slots = (n_ctx - pi * g.page_size).min(g.page_size);
            let off = g.offset(pr.page as usize, h, 0);
            let range = pi * g.page_size * d..(pi * g.page_size + slots) * d;
            rows_to_f32(
                g.kv,
                &cache[off..off + slots * g.row_words()],
                &mut dst[range],
            );
        }
    };
    let per_head = n_ctx * d;
    let big = n_ctx * n_q * args.n_heads >= 1 << 12 && crate::par::current_num_threads() > 1;
    if big {
        // Tasks (K or V, kv head) dealt round-robin to the parts.
        let (kp, vp) = (
            SharedMut(scratch.k.as_mut_ptr()),
            SharedMut(scratch.v.as_mut_ptr()),
        );
        crate::par::run(&|part, parts| {
            for i in (part..2 * g.n_kv_heads).step_by(parts) {
                let (base, h) = if i < g.n_kv_heads {
                    (kp.get(), i)
                } else {
                    (vp.get(), i - g.n_kv_heads)
                };
                // SAFETY: task `i` writes only its own head's `per_head` values of K or V (sized
                // `n_kv_heads × per_head` above); tasks are disjoint and the buffers outlive
                // the section.
                let out =
                    unsafe { std::slice::from_raw_parts_mut(base.add(h * per_head), per_head) };
                gather((i, out));
            }
        });
    } else {
        scratch
            .k
            .chunks_mut(per_head)
            .chain(scratch.v.chunks_mut(per_head))
            .enumerate()
            .for_each(gather);
    }

    // Prompt rows on AVX-512: K transposed too, so scores are computed 16 slots at a time.
    let transposed = gemm_transposed_applies(args.order, d);
    let n_pad = n_ctx.div_ceil(LANES) * LANES;
    if transposed {
        transpose_k(&scratch.k, &mut scratch.kt, g.n_kv_heads, n_ctx, n_pad, d);
    }
    let (kf, vf, ktf) = (&scratch.k[..], &scratch.v[..], &scratch.kt[..]);
    let group = args.n_heads / g.n_kv_heads;
    let scale = 1.0 / (d as f32).sqrt();
    let order = args.order;
    assert!(d <= 256, "head_dim above 256 is not supported");
    // One (query row, kv head) → writes `out[i][heads of h]`: the `group` query heads of kv
    // head `h` are adjacent in `q` and `out`, and share every K and V read.
    let attend_group = |i: usize, h: usize, o: &mut [f32], ws: &mut Workspace| {
        let n_att = args.start_pos + i + 1;
        let qoff = (i * args.n_heads + h * group) * d;
        let q = &args.q[qoff..qoff + group * d];
        let kh = &kf[h * per_head..(h + 1) * per_head];
        let vh = &vf[h * per_head..(h + 1) * per_head];
        #[cfg(target_arch = "x86_64")]
        if transposed {
            let kt = &ktf[h * d * n_pad..(h + 1) * d * n_pad];
            // SAFETY: `transposed` holds only where `has_avx512` (avx512f/vl on top of
            // avx2/fma/f16c) and `d` is a multiple of 16; `kt` is `d × n_pad` with
            // `n_pad >= n_att` rounded up to 16, `vh` holds `n_ctx >= n_att` rows of `d`.
            return unsafe { attend_gemm_avx512(q, kt, n_pad, vh, d, n_att, scale, o, ws) };
        }
        let _ = (ktf, n_pad, transposed);
        for (qg, og) in q.chunks_exact(d).zip(o.chunks_exact_mut(d)) {
            attend_compat(order, qg, kh, vh, d, n_att, scale, og, ws);
        }
    };
    let item_len = group * d;
    if big {
        // (query row, kv head) items dealt round-robin to the parts: causal rows grow in cost,
        // so dealing (not contiguous ranges) keeps the parts even; each item writes its own
        // `group × d` outputs.
        let n_items = n_q * g.n_kv_heads;
        let optr = SharedMut(out.as_mut_ptr());
        crate::par::run(&|part, parts| {
            let mut ws = Workspace::default();
            for item in (part..n_items).step_by(parts) {
                // SAFETY: item `item` writes only `out[item·len .. (item+1)·len]` (`out` holds
                // `n_q × n_kv_heads × len` values); items are disjoint and `out` outlives the
                // section.
                let o = unsafe {
                    std::slice::from_raw_parts_mut(optr.get().add(item * item_len), item_len)
                };
                attend_group(item / g.n_kv_heads, item % g.n_kv_heads, o, &mut ws);
            }
        });
    } else {
        let ws = &mut scratch.ws;
        for (item, o) in out.chunks_mut(item_len).enumerate() {
            attend_group(item / g.n_kv_heads, item % g.n_kv_heads, o, ws);
        }
    }
    Ok(())
}

/// A raw pointer shared by the parts of a section, which write disjoint elements. Read through
/// [`SharedMut::get`] so that closures capture the wrapper, not the (non-`Sync`) pointer field.
#[derive(Clone, Copy)]
struct SharedMut(*mut f32);
impl SharedMut {
    fn get(self) -> *mut f32 {
        self.0
    }
}
// SAFETY: parts write disjoint index sets, and the buffers outlive the section (`par::run`
// returns after every part).
unsafe impl Send for SharedMut {}
// SAFETY: as above.
unsafe impl Sync for SharedMut {}

/// `$f::<NC, G, Q8>(args…)` for head dim `$d` (64 or 128), `$g` heads (1..=4) and cache
/// type `$kv`.
macro_rules! dispatch_nc_g {
    ($d:expr, $g:expr, $kv:expr, $f:ident($($a:expr),*)) => {
        match $kv {
            KvType::F16 => dispatch_nc_g!(@g $d, $g, false, $f($($a),*)),
            KvType::Q8_0 => dispatch_nc_g!(@g $d, $g, true, $f($($a),*)),
        }
    };
    (@g $d:expr, $g:expr, $q8:literal, $f:ident($($a:expr),*)) => {
        match ($d, $g) {
            (64, 1) => $f::<4, 1, $q8>($($a),*),
            (64, 2) => $f::<4, 2, $q8>($($a),*),
            (64, 3) => $f::<4, 3, $q8>($($a),*),
            (64, _) => $f::<4, 4, $q8>($($a),*),
            (_, 1) => $f::<8, 1, $q8>($($a),*),
            (_, 2) => $f::<8, 2, $q8>($($a),*),
            (_, 3) => $f::<8, 3, $q8>($($a),*),
            (_, _) => $f::<8, 4, $q8>($($a),*),
        }
    };
}

/// One decode row's attention over the cache read in place, for the AVX-512 kernels
/// ([`scores_avx512`], [`softmax_compat_avx512`], [`pv_avx512`], [`fold_avx512`]) — no gather
/// into f32 first: each K and V row is loaded and converted in registers, once for the query
/// heads of its kv head. Four phases, each split evenly over the pool's parts (when the context
/// is long enough to be worth a section): the scores by (kv head, slot) rows, the softmax by
/// head, the V sums by (kv head, group of 16 accumulator slots), the final fold on the caller.
/// Each score, each head's softmax and each accumulator slot is computed whole by one part, in the gathered
/// path's order, so the bits are the same whatever the split (tested at 1, 2 and 3 threads).
#[cfg(target_arch = "x86_64")]
fn decode_in_place(args: &AttentionArgs<'_>, n_ctx: usize, out: &mut [f32]) {
    thread_local! {
        static BUFS: std::cell::RefCell<Workspace> = std::cell::RefCell::new(Workspace::default());
    }
    let g = args.geom;
    let (d, n_heads, n_kv) = (g.head_dim, args.n_heads, g.n_kv_heads);
    let group = n_heads / n_kv;
    let n_pad = n_ctx.div_ceil(LANES) * LANES;
    let slots = 4 * LANES;
    BUFS.with_borrow_mut(|b| {
        b.scores.clear();
        b.scores.resize(n_heads * n_pad, f32::NEG_INFINITY);
        b.acc.clear();
        b.acc.resize(n_heads * slots * d, 0.0);
        let (sp, ap) = (
            SharedMut(b.scores.as_mut_ptr()),
            SharedMut(b.acc.as_mut_ptr()),
        );
        let parallel = n_ctx * n_heads >= 1 << 12 && crate::par::current_num_threads() > 1;
        let section = |f: &(dyn Fn(usize, usize) + Sync)| {
            if parallel {
                crate::par::run(f)
            } else {
                f(0, 1)
            }
        };
        // Runs of `units` (kv head × `per_kv`) inside one kv head, then runs of at most four of
        // its heads: f(kv, unit range within the kv head, first head, heads).
        let runs = |units: std::ops::Range<usize>,
                    per_kv: usize,
                    f: &dyn Fn(usize, std::ops::Range<usize>, usize, usize)| {
            let mut u = units.start;
            while u < units.end {
                let kv = u / per_kv;
                let end = units.end.min((kv + 1) * per_kv);
                for h0 in (kv * group..(kv + 1) * group).step_by(4) {
                    let nh = (kv * group + group - h0).min(4);
                    f(kv, u - kv * per_kv..end - kv * per_kv, h0, nh);
                }
                u = end;
            }
        };
        // SAFETY (the four phases): the caller checked `has_avx512`; `d` is 64 or 128 and each
        // run is 1..=4 heads (the `NC`/`G` the kernels assert). Phase 1 writes the scores of
        // its (kv head, slot) rows only, phase 2 its heads' scores only, phase 3 its (kv head,
        // accumulator slot) sums only: parts write disjoint elements of buffers that outlive
        // the sections, and each phase reads only what finished sections wrote.
        section(&|part, parts| {
            runs(
                crate::par::split(n_kv * n_ctx, part, parts, LANES),
                n_ctx,
                &|kv, ts, h0, nh| {
                    // SAFETY: the phases' argument above.
                    unsafe {
                        let qs = &args.q[h0 * d..(h0 + nh) * d];
                        let sc = sp.get().add(h0 * n_pad);
                        dispatch_nc_g!(
                            d,
                            nh,
                            g.kv,
                            scores_avx512(
                                qs,
                                args.k_cache,
                                g,
                                kv,
                                args.block_table,
                                ts.clone(),
                                sc,
                                n_pad
                            )
                        );
                    }
                },
            )
        });
        section(&|part, parts| {
            for head in crate::par::split(n_heads, part, parts, 1) {
                // SAFETY: head `head`'s `n_pad` scores, written by phase 1; this part's alone.
                let sc =
                    unsafe { std::slice::from_raw_parts_mut(sp.get().add(head * n_pad), n_pad) };
                let mut max = f32::NEG_INFINITY;
                for &v in &sc[..n_ctx] {
                    if v > max {
                        max = v;
                    }
                }
                // SAFETY: as above (`has_avx512`).
                unsafe { softmax_compat_avx512(sc, n_ctx, max) };
            }
        });
        section(&|part, parts| {
            runs(
                crate::par::split(n_kv * SLOT_GROUPS, part, parts, 1),
                SLOT_GROUPS,
                &|kv, ms, h0, nh| {
                    // SAFETY: the phases' argument above.
                    unsafe {
                        let sc = sp.get().add(h0 * n_pad).cast_const();
                        let acc = ap.get().add(h0 * slots * d);
                        dispatch_nc_g!(
                            d,
                            nh,
                            g.kv,
                            pv_avx512(
                                args.v_cache,
                                g,
                                kv,
                                args.block_table,
                                n_ctx,
                                ms.clone(),
                                sc,
                                n_pad,
                                acc
                            )
                        );
                    }
                },
            )
        });
        for (head, o) in out.chunks_mut(d).enumerate() {
            // SAFETY: `has_avx512`; head `head`'s 64 × d sums, written by phase 3.
            unsafe {
                let acc = ap.get().add(head * slots * d).cast_const();
                if d == 64 {
                    fold_avx512::<4>(acc, o)
                } else {
                    fold_avx512::<8>(acc, o)
                }
            }
        }
    });
}

/// Which reduction order the attention arithmetic follows. Both are exact emulations of
/// llama.cpp's CPU backend (AVX-512 build, flash attention off), so that our logits match its
/// logits bit for bit where the inputs match (this model amplifies last-bit differences through
/// its int8 activation quantization, so "close" arithmetic is not close enough):
/// - `Gemm`: the path llama.cpp takes when a batch has 2+ query tokens (prompt processing):
///   llamafile's tinyBLAS F16 kernel — one 16-lane FMA chain per output, then a tree reduction.
/// - `Vec`: the single-token (decode) path: `ggml_vec_dot_f16` — four 16-lane accumulators.
///
/// The order is a property of the *request* (prompt rows vs decode rows), never of the batch a
/// row happens to share, so batched results stay bit-identical to unbatched ones.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReduceOrder {
    Gemm,
    Vec,
}

/// Per-task buffers of the attention arithmetic.
#[derive(Debug, Default)]
pub struct Workspace {
    scores: Vec<f32>,
    acc: Vec<f32>,
}

const LANES: usize = 16;

/// `_mm512_reduce_add_ps` as GCC implements it: halves, quarters, then (0+2) + (1+3).
#[inline(always)]
fn reduce16(a: &[f32; LANES]) -> f32 {
    let mut t = [0.0f32; 8];
    for i in 0..8 {
        t[i] = a[i] + a[i + 8];
    }
    let mut u = [0.0f32; 4];
    for i in 0..4 {
        u[i] = t[i] + t[i + 4];
    }
    (u[0] + u[2]) + (u[1] + u[3])
}

/// tinyBLAS dot: lane `e % 16` accumulates `fma(x[e], y[e], acc)` in order; then [`reduce16`].
/// (Written over fixed 16-lane arrays so the compiler vectorises it without changing the order.)
#[inline(always)]
fn dot_gemm(x: &[f32], y: &[f32]) -> f32 {
    debug_assert_eq!(x.len(), y.len());
    let mut acc = [0.0f32; LANES];
    let mut xc = x.chunks_exact(LANES);
    let mut yc = y.chunks_exact(LANES);
    for (xs, ys) in (&mut xc).zip(&mut yc) {
        for l in 0..LANES {
            acc[l] = xs[l].mul_add(ys[l], acc[l]);
        }
    }
    for (l, (a, b)) in xc.remainder().iter().zip(yc.remainder()).enumerate() {
        acc[l] = a.mul_add(*b, acc[l]);
    }
    reduce16(&acc)
}

/// `ggml_vec_dot_f16` (AVX-512, no FP16 arithmetic): element `e < n & !63` goes to accumulator
/// `(e / 16) % 4`, lane `e % 16`; accumulators fold 0+=2, 1+=3, 0+=1; then [`reduce16`] widened
/// to f64; leftovers are added one by one in f64.
#[inline(always)]
fn dot_vec(x: &[f32], y: &[f32]) -> f32 {
    debug_assert_eq!(x.len(), y.len());
    let n = x.len();
    let np = n & !63;
    let mut acc = [[0.0f32; LANES]; 4];
    for (xs, ys) in x[..np].chunks_exact(64).zip(y[..np].chunks_exact(64)) {
        for (a, acc_a) in acc.iter_mut().enumerate() {
            for l in 0..LANES {
                acc_a[l] = xs[a * LANES + l].mul_add(ys[a * LANES + l], acc_a[l]);
            }
        }
    }
    let mut sumf = f64::from(fold4(&acc));
    for e in np..n {
        sumf += f64::from(x[e] * y[e]);
    }
    sumf as f32
}

#[inline(always)]
fn fold4(acc: &[[f32; LANES]; 4]) -> f32 {
    let mut a0 = [0.0f32; LANES];
    for l in 0..LANES {
        let s0 = acc[0][l] + acc[2][l];
        let s1 = acc[1][l] + acc[3][l];
        a0[l] = s0 + s1;
    }
    reduce16(&a0)
}

/// ggml's AVX-512 `ggml_v_expf`, lane by lane (bit-exact: every step is one IEEE operation).
#[inline(always)]
pub fn ggml_expf(x: f32) -> f32 {
    let r = f32::from_bits(0x4b40_0000); // 0x1.8p23
    let z = x.mul_add(f32::from_bits(0x3fb8_aa3b), r);
    let n = z - r;
    if n.is_nan() || n.abs() > 192.0 {
        // |n| > 192 (or NaN from -inf): ggml blends in +inf for n > 0, else 0.
        return if n > 0.0 { f32::INFINITY } else { 0.0 };
    }
    let b = (-n).mul_add(
        f32::from_bits(0x35bf_be8e),
        (-n).mul_add(f32::from_bits(0x3f31_7200), x),
    );
    let u = b * b;
    let j = f32::from_bits(0x3c07_2010)
        .mul_add(b, f32::from_bits(0x3d2b_9f17))
        .mul_add(
            u,
            f32::from_bits(0x3e2a_af33).mul_add(b, f32::from_bits(0x3eff_fedb)),
        )
        .mul_add(u, f32::from_bits(0x3f7f_fff6).mul_add(b, 1.0));
    // _mm512_scalef_ps(j, n) = j · 2^n, rounded once (exact in f64, then to f32). |n| <= 192,
    // so 2^n is a normal f64 built directly from its exponent bits.
    let two_n = f64::from_bits(((n as i64 + 1023) as u64) << 52);
    (f64::from(j) * two_n) as f32
}

/// Attention of one query row and head over `n_att` slots, in llama.cpp's arithmetic:
/// q → f16; scores = (K·q) · scale; softmax with `ggml_expf`, 16-lane sums in f64, scaled by
/// `(f32)(1/sum)`; probabilities → f16; out = V·p.
#[allow(clippy::too_many_arguments)]
fn attend_compat(
    order: ReduceOrder,
    q: &[f32],
    kh: &[f32],
    vh: &[f32],
    d: usize,
    n_att: usize,
    scale: f32,
    o: &mut [f32],
    ws: &mut Workspace,
) {
    #[cfg(target_arch = "x86_64")]
    if crate::simd::has_avx512() {
        // SAFETY: `has_avx512` is true only when avx512f/avx512vl were detected on top of the
        // Avx2 level (avx2, fma, f16c); the body is the same portable code.
        return unsafe { attend_compat_avx512(order, q, kh, vh, d, n_att, scale, o, ws) };
    }
    #[cfg(target_arch = "x86_64")]
    if crate::simd::level() == crate::simd::Level::Avx2 {
        // SAFETY: the Avx2 level is only selected when avx2 and fma were detected; the body is
        // the same portable code, compiled with hardware FMA for `mul_add`.
        return unsafe { attend_compat_fma(order, q, kh, vh, d, n_att, scale, o, ws) };
    }
    attend_compat_body(order, q, kh, vh, d, n_att, scale, o, ws)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)]
unsafe fn attend_compat_fma(
    order: ReduceOrder,
    q: &[f32],
    kh: &[f32],
    vh: &[f32],
    d: usize,
    n_att: usize,
    scale: f32,
    o: &mut [f32],
    ws: &mut Workspace,
) {
    attend_compat_body(order, q, kh, vh, d, n_att, scale, o, ws)
}

/// [`attend_compat_fma`] with 512-bit vectors: one register per 16-lane chain. Every lane's
/// operations and their order are the portable body's, so the bits are the same.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl")]
#[allow(clippy::too_many_arguments)]
unsafe fn attend_compat_avx512(
    order: ReduceOrder,
    q: &[f32],
    kh: &[f32],
    vh: &[f32],
    d: usize,
    n_att: usize,
    scale: f32,
    o: &mut [f32],
    ws: &mut Workspace,
) {
    attend_compat_body(order, q, kh, vh, d, n_att, scale, o, ws)
}

#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn attend_compat_body(
    order: ReduceOrder,
    q: &[f32],
    kh: &[f32],
    vh: &[f32],
    d: usize,
    n_att: usize,
    scale: f32,
    o: &mut [f32],
    ws: &mut Workspace,
) {
    let mut qh = [0.0f32; 256];
    let qh = &mut qh[..d];
    for j in 0..d {
        qh[j] = f16::from_f32(q[j]).to_f32();
    }
    // Scores, padded with -inf to whole 16-lane chunks (masked lanes exp to exactly 0).
    // Plain loops, no closures: closures would not inherit the caller's FMA target feature and
    // `mul_add` would become a libm call.
    let n_pad = n_att.div_ceil(LANES) * LANES;
    let sc = &mut ws.scores;
    sc.clear();
    sc.resize(n_pad, f32::NEG_INFINITY);
    let mut max = f32::NEG_INFINITY;
    for t in 0..n_att {
        let kt = &kh[t * d..(t + 1) * d];
        let dot = match order {
            ReduceOrder::Gemm => dot_gemm(kt, qh),
            ReduceOrder::Vec => dot_vec(kt, qh),
        };
        sc[t] = dot * scale;
        // Scores are finite (finite inputs); a plain compare avoids f32::max's NaN handling.
        if sc[t] > max {
            max = sc[t];
        }
    }
    softmax_compat(sc, n_att, max);
    // out[j] = Σ_t V[t][j] · p[t], lanes over t; vectorised over j (each (lane, j) chain is the
    // same sequential FMA chain llama.cpp runs).
    match order {
        ReduceOrder::Gemm => {
            ws.acc.clear();
            ws.acc.resize(LANES * d, 0.0);
            for t in 0..n_att {
                let p = sc[t];
                let a = &mut ws.acc[(t % LANES) * d..(t % LANES + 1) * d];
                let v = &vh[t * d..(t + 1) * d];
                for j in 0..d {
                    a[j] = v[j].mul_add(p, a[j]);
                }
            }
            for j in 0..d {
                let mut lanes = [0.0f32; LANES];
                for l in 0..LANES {
                    lanes[l] = ws.acc[l * d + j];
                }
                o[j] = reduce16(&lanes);
            }
        }
        ReduceOrder::Vec => {
            // n_kv is padded to a multiple of 256 in llama.cpp, so there are no leftovers.
            ws.acc.clear();
            ws.acc.resize(4 * LANES * d, 0.0);
            for t in 0..n_att {
                let p = sc[t];
                let slot = ((t / LANES) % 4) * LANES + t % LANES;
                let a = &mut ws.acc[slot * d..(slot + 1) * d];
                let v = &vh[t * d..(t + 1) * d];
                for j in 0..d {
                    a[j] = v[j].mul_add(p, a[j]);
                }
            }
            for j in 0..d {
                let mut acc = [[0.0f32; LANES]; 4];
                for a in 0..4 {
                    for l in 0..LANES {
                        acc[a][l] = ws.acc[(a * LANES + l) * d + j];
                    }
                }
                o[j] = f64::from(fold4(&acc)) as f32;
            }
        }
    }
}

/// Whether prompt rows take [`attend_gemm_avx512`]: `Gemm` order, AVX-512, whole 16-lane chunks.
fn gemm_transposed_applies(order: ReduceOrder, d: usize) -> bool {
    cfg!(target_arch = "x86_64")
        && order == ReduceOrder::Gemm
        && crate::simd::has_avx512()
        && d.is_multiple_of(LANES)
        && d <= 256
}

/// K transposed by blocks of 16 slots: `kt[h][t / 16][j][t % 16] = k[h][t][j]` for
/// `t < n_ctx`, zero for `n_ctx <= t < n_pad`. A block's `d × 16` values are contiguous, so the
/// scores of 16 slots read one 4 KB run (d = 64) — a plain `[dim][slot]` layout put the 64
/// dims' rows 8 KB apart, all in one L1 set.
fn transpose_k(k: &[f32], kt: &mut Vec<f32>, n_kv: usize, n_ctx: usize, n_pad: usize, d: usize) {
    kt.clear();
    kt.resize(n_kv * d * n_pad, 0.0);
    for h in 0..n_kv {
        let src = &k[h * n_ctx * d..(h + 1) * n_ctx * d];
        let dst = &mut kt[h * d * n_pad..(h + 1) * d * n_pad];
        for (t, row) in src.chunks_exact(d).enumerate() {
            let blk = &mut dst[(t / LANES) * d * LANES..];
            for (j, &x) in row.iter().enumerate() {
                blk[j * LANES + t % LANES] = x;
            }
        }
    }
}

/// [`attend_compat_body`]'s `Gemm` arithmetic with 16 slots (scores) or 16 dims (the V sums)
/// per register instead of one output's 16 lanes per register, so no horizontal reduction:
/// - score of slot `t` = `reduce16` over lanes `l` of the chain `fma(K[t][16c+l], q[16c+l], ·)`
///   for `c = 0, 1, …` — here lane `t % 16` of register `P_l` runs exactly that chain (K
///   transposed by blocks, [`transpose_k`]), and `reduce16`'s tree is applied to the registers
///   `P_0..P_15`;
/// - `out[j]` = `reduce16` over lanes `l` of the chain `fma(V[t][j], p[t], ·)` over
///   `t ≡ l (mod 16)` ascending — here register `A_l` holds that chain for 16 dims `j`.
///
/// `q` and `o` hold the query heads that share this kv head at one position (`d` each, up to
/// [`MAX_HEADS_PER_PASS`] per pass): each 16-slot block of K and each run of V rows is read once
/// for all of them while it is in L1 — one head at a time streamed a whole kv head's K and V
/// (2 MB at 4,096 slots, d = 64) from L2/L3 per head and position, and an 8,192-token prompt
/// prefilled at half llama.cpp's speed. Every value sees the same IEEE operations in the same
/// order as with one head, so the bits are the portable body's (tested against it).
/// Safety: AVX-512 F/VL present; `d` a multiple of 16 (≤ 256); `kt` holds `d × n_pad` floats
/// with `n_pad >= n_att` a multiple of 16 (padding zero); `vh` holds `n_att × d` floats at least.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl")]
#[allow(clippy::too_many_arguments)]
unsafe fn attend_gemm_avx512(
    q: &[f32],
    kt: &[f32],
    n_pad: usize,
    vh: &[f32],
    d: usize,
    n_att: usize,
    scale: f32,
    o: &mut [f32],
    ws: &mut Workspace,
) {
    debug_assert!(d.is_multiple_of(LANES) && d <= 256 && n_pad >= n_att);
    assert!(kt.len() >= d * n_pad && vh.len() >= n_att * d);
    assert!(q.len().is_multiple_of(d) && o.len() == q.len() && !q.is_empty());
    let per_pass = MAX_HEADS_PER_PASS * d;
    for (qp, op) in q.chunks(per_pass).zip(o.chunks_mut(per_pass)) {
        let n_att_pad = n_att.div_ceil(LANES) * LANES;
        let sc = &mut ws.scores;
        sc.clear();
        sc.resize(qp.len() / d * n_att_pad, f32::NEG_INFINITY);
        gemm_scores(qp, kt, d, n_att, scale, sc);
        gemm_pv(vh, d, n_att, sc, op);
    }
}

/// Heads per pass of [`attend_gemm_avx512`]: its V accumulators (16 registers' worth per head)
/// stay on the stack, 8 KB at eight heads.
const MAX_HEADS_PER_PASS: usize = 8;

/// The softmaxed scores of each head of `q` over slots `0..n_att`, into `sc` (`n_att` rounded
/// up to 16 per head, the padding `-inf` on entry and 0 on return). `d` a multiple of 16 (≤ 256);
/// `kt` as [`attend_gemm_avx512`]'s (its length asserted).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl")]
fn gemm_scores(q: &[f32], kt: &[f32], d: usize, n_att: usize, scale: f32, sc: &mut [f32]) {
    use core::arch::x86_64::*;
    let (nc, n_heads) = (d / LANES, q.len() / d);
    let n_att_pad = sc.len() / n_heads;
    assert!(n_heads <= MAX_HEADS_PER_PASS && kt.len() >= d * n_att_pad);
    let mut qh = [[0.0f32; 256]; MAX_HEADS_PER_PASS];
    for (g, qg) in q.chunks_exact(d).enumerate() {
        for j in 0..d {
            qh[g][j] = f16::from_f32(qg[j]).to_f32();
        }
    }
    let vscale = _mm512_set1_ps(scale);
    for t0 in (0..n_att_pad).step_by(LANES) {
        let blk = kt.as_ptr().wrapping_add(t0 * d);
        for (g, qg) in qh[..n_heads].iter().enumerate() {
            let mut p = [_mm512_setzero_ps(); LANES];
            for c in 0..nc {
                for l in 0..LANES {
                    // SAFETY: block t0/16 spans kt[t0·d .. (t0 + 16)·d] (t0 + 16 <= n_att_pad
                    // <= n_pad); dim 16c + l < d is the 16 floats at (16c + l)·16 inside it.
                    let k = unsafe { _mm512_loadu_ps(blk.add((c * LANES + l) * LANES)) };
                    p[l] = _mm512_fmadd_ps(k, _mm512_set1_ps(qg[c * LANES + l]), p[l]);
                }
            }
            let s = _mm512_mul_ps(reduce16_x16(&p), vscale);
            let mut lanes = [0.0f32; LANES];
            // SAFETY: `lanes` is 16 floats.
            unsafe { _mm512_storeu_ps(lanes.as_mut_ptr(), s) };
            let n = (n_att - t0).min(LANES);
            let row = g * n_att_pad + t0;
            sc[row..row + n].copy_from_slice(&lanes[..n]);
        }
    }
    for row in sc.chunks_exact_mut(n_att_pad) {
        let mut max = f32::NEG_INFINITY;
        for &x in &row[..n_att] {
            if x > max {
                max = x;
            }
        }
        softmax_compat_avx512(row, n_att, max);
    }
}

/// Slots per run of [`gemm_pv`]: a run's V rows for one 16-dim column (256 × 64 bytes) stay
/// in L1 while every head passes over them.
const PV_RUN_SLOTS: usize = 256;

/// `o[g][j] = reduce16` over lanes `l` of the chain `fma(V[t][j], p_g[t], ·)` over
/// `t ≡ l (mod 16)` ascending, for each head `g` of `sc` (probabilities, `n_att` rounded up to 16
/// per head); `o` holds `d` per head of `sc`, `d` a multiple of 16 (lengths asserted).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl")]
fn gemm_pv(vh: &[f32], d: usize, n_att: usize, sc: &[f32], o: &mut [f32]) {
    use core::arch::x86_64::*;
    let (nc, n_heads) = (d / LANES, o.len() / d);
    let n_att_pad = sc.len() / n_heads;
    assert!(n_heads <= MAX_HEADS_PER_PASS && vh.len() >= n_att * d);
    let full = n_att / LANES * LANES;
    for c in 0..nc {
        let mut acc = [[_mm512_setzero_ps(); LANES]; MAX_HEADS_PER_PASS];
        let col = vh.as_ptr().wrapping_add(c * LANES);
        // Ascending runs, each head's chains continued run after run: the same order per chain.
        for r0 in (0..full).step_by(PV_RUN_SLOTS) {
            let r1 = (r0 + PV_RUN_SLOTS).min(full);
            for (g, a) in acc[..n_heads].iter_mut().enumerate() {
                let p = &sc[g * n_att_pad..(g + 1) * n_att_pad];
                for t0 in (r0..r1).step_by(LANES) {
                    for l in 0..LANES {
                        let t = t0 + l;
                        // SAFETY: t < n_att: row t of `vh`, dims 16c..16c+16 < d.
                        let v = unsafe { _mm512_loadu_ps(col.add(t * d)) };
                        a[l] = _mm512_fmadd_ps(v, _mm512_set1_ps(p[t]), a[l]);
                    }
                }
            }
        }
        for (g, a) in acc[..n_heads].iter_mut().enumerate() {
            let p = &sc[g * n_att_pad..(g + 1) * n_att_pad];
            for l in 0..LANES {
                let t = full + l;
                if t < n_att {
                    // SAFETY: as above.
                    let v = unsafe { _mm512_loadu_ps(col.add(t * d)) };
                    a[l] = _mm512_fmadd_ps(v, _mm512_set1_ps(p[t]), a[l]);
                }
            }
            // SAFETY: o[g·d + 16c .. + 16] is inside `o` (d per head).
            unsafe { _mm512_storeu_ps(o.as_mut_ptr().add(g * d + c * LANES), reduce16_x16(a)) };
        }
    }
}

/// [`reduce16`] of 16 values at once: lane `i` of the result is `reduce16` of lane `i` of
/// `p[0..16]` (the same tree: halves, quarters, then (0+2) + (1+3)).
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx512f")]
fn reduce16_x16(p: &[core::arch::x86_64::__m512; LANES]) -> core::arch::x86_64::__m512 {
    use core::arch::x86_64::*;
    let mut t = [_mm512_setzero_ps(); 8];
    for i in 0..8 {
        t[i] = _mm512_add_ps(p[i], p[i + 8]);
    }
    let mut u = [_mm512_setzero_ps(); 4];
    for i in 0..4 {
        u[i] = _mm512_add_ps(t[i], t[i + 4]);
    }
    _mm512_add_ps(_mm512_add_ps(u[0], u[2]), _mm512_add_ps(u[1], u[3]))
}

/// Scores (padded with -inf to whole 16-lane chunks) → probabilities rounded to f16, in
/// llama.cpp's arithmetic: `ggml_expf(s - max)`, 16-lane sums added in f64, scaled by
/// `(f32)(1/sum)`.
#[inline(always)]
fn softmax_compat(sc: &mut [f32], n_att: usize, max: f32) {
    debug_assert!(sc.len().is_multiple_of(LANES) && sc.len() >= n_att);
    let mut sum = 0.0f64;
    for chunk in sc.chunks_exact_mut(LANES) {
        let mut vals = [0.0f32; LANES];
        for l in 0..LANES {
            chunk[l] = ggml_expf(chunk[l] - max);
            vals[l] = chunk[l];
        }
        sum += f64::from(reduce16(&vals));
    }
    let inv = (1.0 / sum) as f32;
    for t in 0..n_att {
        sc[t] = f16::from_f32(sc[t] * inv).to_f32();
    }
}

/// The row (K or V) of slot `t` of `kv_head`: one row's in-bounds words (bounds-checked).
#[inline(always)]
fn cache_row(
    cache: &[u16],
    geom: PageGeometry,
    kv_head: usize,
    bt: &[PageRef],
    t: usize,
) -> *const u16 {
    let off = geom.offset(
        bt[t / geom.page_size].page as usize,
        kv_head,
        t % geom.page_size,
    );
    cache[off..off + geom.row_words()].as_ptr()
}

/// Rows of the cache (`words`: whole rows of `kv`) as f32 into `dst` (their values, row after
/// row): f16 converted, q8_0 dequantized (`q · d`, exact).
fn rows_to_f32(kv: KvType, words: &[u16], dst: &mut [f32]) {
    match kv {
        KvType::F16 => {
            use half::slice::HalfBitsSliceExt;
            ops::f16_to_f32(words.reinterpret_cast::<f16>(), dst);
        }
        KvType::Q8_0 => {
            crate::quant::dequantize_row(crate::quant::DType::Q8_0, words_as_bytes(words), dst)
        }
    }
}

/// The cache's words as the bytes they are stored as (little-endian: the only byte order this
/// crate builds for, below).
pub fn words_as_bytes(words: &[u16]) -> &[u8] {
    // SAFETY: u8 has alignment 1 and every byte of a u16 is initialised; the length is exact.
    unsafe { std::slice::from_raw_parts(words.as_ptr().cast::<u8>(), words.len() * 2) }
}

/// As [`words_as_bytes`], writable: every byte pattern is a valid pair of words.
pub fn words_as_bytes_mut(words: &mut [u16]) -> &mut [u8] {
    // SAFETY: as `words_as_bytes`; any bytes written make valid u16 values.
    unsafe { std::slice::from_raw_parts_mut(words.as_mut_ptr().cast::<u8>(), words.len() * 2) }
}

// The cache's words are ggml's little-endian bytes (`block_q8_0`, f16): a big-endian build
// would read them swapped.
const _: () = assert!(cfg!(target_endian = "little"));

/// `[__m512; NC]`: the `16·NC` values of the cache row at `$row` (`*const u16`, in bounds) as
/// f32 — f16 converted (`vcvtph2ps`), or (`$q8`) each q8_0 value sign-extended, converted and
/// multiplied by its block's scale: `q · d`, exact, the same value [`rows_to_f32`] gives.
/// Expands inside an `unsafe` AVX-512 F/VL function.
#[cfg(target_arch = "x86_64")]
macro_rules! load_row_zmm {
    ($q8:expr, $nc:expr, $row:expr) => {{
        let row: *const u16 = $row;
        let mut out = [_mm512_setzero_ps(); $nc];
        if $q8 {
            let bytes = row.cast::<u8>();
            for (c, o) in out.iter_mut().enumerate() {
                // Chunk `c` is half `c % 2` of block `c / 2` (34 bytes: scale, 32 values).
                // SAFETY: the row holds `16·NC / 32` whole blocks; block `c / 2` is one of them.
                let blk = unsafe { bytes.add((c / 2) * 2 * Q8_0_WORDS) };
                // SAFETY: the block's first two bytes, in bounds (unaligned read).
                let d_bits = unsafe { blk.cast::<u16>().read_unaligned() };
                let d = _mm512_broadcastss_ps(_mm_cvtph_ps(_mm_cvtsi32_si128(i32::from(d_bits))));
                // SAFETY: bytes 2 + 16·(c % 2) .. +16 of the block's 34, in bounds.
                let q = unsafe { _mm_loadu_si128(blk.add(2 + (c % 2) * LANES).cast()) };
                *o = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)), d);
            }
        } else {
            for (c, o) in out.iter_mut().enumerate() {
                // SAFETY: the row holds `16·NC` f16 values; chunk `c` reads 16 of them.
                *o = unsafe { _mm512_cvtph_ps(_mm256_loadu_si256(row.add(c * LANES).cast())) };
            }
        }
        out
    }};
}

/// Slots ahead whose K rows a decode step's scores ask for before they read them: a
/// kv head's rows are contiguous within a 16-slot page only, the pages scattered across the
/// pool, so the hardware prefetcher loses the stream at every page boundary while a deep
/// context's K/V come from DRAM (8 MB a layer at 8,192 tokens on the 1B shape).
const PREFETCH_SLOTS: usize = 32;

/// Ask for the rows of slots `t .. t + n` of `kv_head` that share `t`'s page (contiguous: a
/// page holds a kv head's slots in order) into L2, when `t` is inside the table: one address
/// computation for the span, not one per row (a hint: no effect on results).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn prefetch_span(
    cache: &[u16],
    geom: PageGeometry,
    kv_head: usize,
    bt: &[PageRef],
    t: usize,
    n: usize,
) {
    use std::arch::x86_64::{_MM_HINT_T1, _mm_prefetch};
    let Some(page) = bt.get(t / geom.page_size) else {
        return;
    };
    let rows = n.min(geom.page_size - t % geom.page_size);
    let off = geom.offset(page.page as usize, kv_head, t % geom.page_size);
    let end = (off + rows * geom.row_words()).min(cache.len());
    let span = &cache[off.min(end)..end];
    for line in (0..std::mem::size_of_val(span)).step_by(64) {
        // SAFETY: a prefetch never faults; `line` lies inside `span`.
        unsafe { _mm_prefetch::<_MM_HINT_T1>(span.as_ptr().cast::<i8>().wrapping_add(line)) };
    }
}

/// Scores of `G` query heads of `kv_head` (`qs`: `G × d`, `d = 16·NC`) over slots `ts`, into
/// `sc[g·n_pad + t]`: q rounded to f16, `dot_vec`'s lane assignment (chunk `c` into accumulator
/// `c % 4`), its folds, then the scale — [`attend_compat_body`]'s arithmetic for each score.
/// Safety: AVX-512 F/VL present; `sc` valid for `G × n_pad` floats, `ts.end <= n_pad`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl")]
#[allow(clippy::too_many_arguments)]
unsafe fn scores_avx512<const NC: usize, const G: usize, const Q8: bool>(
    qs: &[f32],
    k_cache: &[u16],
    geom: PageGeometry,
    kv_head: usize,
    bt: &[PageRef],
    ts: std::ops::Range<usize>,
    sc: *mut f32,
    n_pad: usize,
) {
    use std::arch::x86_64::*;
    let d = geom.head_dim;
    assert!(d == NC * LANES && NC.is_multiple_of(4) && qs.len() == G * d && ts.end <= n_pad);
    let mut qh = [[_mm512_setzero_ps(); NC]; G];
    for (g, qg) in qh.iter_mut().enumerate() {
        for (c, qc) in qg.iter_mut().enumerate() {
            let mut tmp = [0.0f32; LANES];
            for l in 0..LANES {
                tmp[l] = f16::from_f32(qs[g * d + c * LANES + l]).to_f32();
            }
            // SAFETY: 16 floats.
            *qc = unsafe { _mm512_loadu_ps(tmp.as_ptr()) };
        }
    }
    let scale = 1.0 / (d as f32).sqrt();
    // Each score's 16 lanes before the final reduction.
    let lanes_of = |t: usize| -> [__m512; G] {
        if !Q8 {
            prefetch_span(k_cache, geom, kv_head, bt, t + PREFETCH_SLOTS, 1);
        }
        let kr = cache_row(k_cache, geom, kv_head, bt, t);
        let kc: [__m512; NC] = load_row_zmm!(Q8, NC, kr);
        std::array::from_fn(|g| {
            let mut acc = [_mm512_setzero_ps(); 4];
            for c in 0..NC {
                acc[c % 4] = _mm512_fmadd_ps(kc[c], qh[g][c], acc[c % 4]);
            }
            _mm512_add_ps(_mm512_add_ps(acc[0], acc[2]), _mm512_add_ps(acc[1], acc[3]))
        })
    };
    // Whole runs of 16 slots: their 16 reductions in one transposing tree (`reduce16_rows`,
    // ~3 instructions a score instead of ~8), one multiply and one store per head.
    let mut t = ts.start;
    while t + LANES <= ts.end {
        // q8_0 rows (68 bytes at 64 dims) share lines: one span a run, not two lines a row
        // (measured: ~5 % faster for q8_0, ~5 % slower for f16).
        if Q8 {
            prefetch_span(k_cache, geom, kv_head, bt, t + PREFETCH_SLOTS, LANES);
        }
        let mut rows = [[_mm512_setzero_ps(); LANES]; G];
        for i in 0..LANES {
            for (g, v) in lanes_of(t + i).into_iter().enumerate() {
                rows[g][i] = v;
            }
        }
        for (g, r) in rows.iter().enumerate() {
            let v = _mm512_mul_ps(reduce16_rows(r), _mm512_set1_ps(scale));
            // SAFETY: g < G, t + 16 ≤ ts.end ≤ n_pad: within the caller's `G × n_pad` scores.
            unsafe { _mm512_storeu_ps(sc.add(g * n_pad + t), v) };
        }
        t += LANES;
    }
    for t in t..ts.end {
        for (g, a0) in lanes_of(t).into_iter().enumerate() {
            // SAFETY: g < G, t < n_pad: within the caller's `G × n_pad` scores.
            unsafe { *sc.add(g * n_pad + t) = reduce16_zmm(a0) * scale };
        }
    }
}

/// [`reduce16`] of each of 16 registers at once: lane `j` of the result is `reduce16` of `p[j]`
/// — each sum in the same order (halves, quarters, then (0+2) + (1+3)), sixteen at a time: two
/// shuffles and one add per pair at every level of the tree, then one permute.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx512f")]
fn reduce16_rows(p: &[core::arch::x86_64::__m512; LANES]) -> core::arch::x86_64::__m512 {
    use core::arch::x86_64::*;
    // Halves: w[m] lanes 0–7 are t of p[2m] (t[i] = a[i] + a[i + 8]), lanes 8–15 of p[2m + 1].
    let w: [__m512; 8] = std::array::from_fn(|m| {
        let (a, b) = (p[2 * m], p[2 * m + 1]);
        _mm512_add_ps(
            _mm512_shuffle_f32x4::<0b01_00_01_00>(a, b),
            _mm512_shuffle_f32x4::<0b11_10_11_10>(a, b),
        )
    });
    // Quarters: z[n] quarter k is u (u[i] = t[i] + t[i + 4]) of p[4n + k].
    let z: [__m512; 4] = std::array::from_fn(|n| {
        let (a, b) = (w[2 * n], w[2 * n + 1]);
        _mm512_add_ps(
            _mm512_shuffle_f32x4::<0b10_00_10_00>(a, b),
            _mm512_shuffle_f32x4::<0b11_01_11_01>(a, b),
        )
    });
    // (u0 + u2), (u1 + u3): s[q] quarter k lanes 0, 1 of p[8q + k], lanes 2, 3 of p[8q + 4 + k].
    let s: [__m512; 2] = std::array::from_fn(|q| {
        let (a, b) = (z[2 * q], z[2 * q + 1]);
        _mm512_add_ps(
            _mm512_shuffle_ps::<0b01_00_01_00>(a, b),
            _mm512_shuffle_ps::<0b11_10_11_10>(a, b),
        )
    });
    // (s0 + s1): lane 4k + j is p[4j + k]'s sum; then into lane order.
    let r = _mm512_add_ps(
        _mm512_shuffle_ps::<0b10_00_10_00>(s[0], s[1]),
        _mm512_shuffle_ps::<0b11_01_11_01>(s[0], s[1]),
    );
    let order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    _mm512_permutexvar_ps(order, r)
}

/// Accumulator slots `16m .. 16m + 16` of [`pv_avx512`]: groups of 16 of the 64.
const SLOT_GROUPS: usize = 4;

/// Runs ahead (of the group's own walk: 64 slots each) whose V rows [`pv_avx512`] asks for
/// before it reads them.
const PV_PREFETCH_RUNS: usize = 4;

/// Runs of one group [`pv_avx512`] takes at a time (its sums loaded and stored once for them).
const PV_RUNS_AT_ONCE: usize = 4;

/// The V sums of `G` heads of `kv_head` for the accumulator slots of groups `ms` (each <
/// [`SLOT_GROUPS`]): slot `s` adds `V[t] · p[t]` for `t = s, s + 64, …` in ascending order (the
/// gathered path's `Vec` order) into `acc[(g·64 + s)·d ..]`, which the caller zeroed. Group `m`
/// walks the runs of 16 consecutive slots `16r .. 16r + 16` with `r ≡ m (mod 4)` in ascending
/// order — slot `16r + i` is accumulator `16m + i` — so its rows are read run by run (a run is
/// one 16-slot page, contiguous), each slot's chain still ascending. The 16 slots' sums of each
/// head stay in `acc` (at most 4 heads × 16 slots × 128 dims × 4 B = 32 KB, L1/L2) rather than
/// in registers: a walk slot by slot, 64 slots apart, kept them in registers but read one
/// isolated row per step from scattered pages, and waited on memory for each (the whole decode
/// attention took ~2× as long at 8,192 slots: `examples/decode_attention.rs`, BENCHMARKS.md).
/// Probabilities at `sc[g·n_pad + t]`.
/// Safety: AVX-512 F/VL present; `sc` valid for `G × n_pad`, `acc` for `G × 64 × d` floats.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl")]
#[allow(clippy::too_many_arguments)]
unsafe fn pv_avx512<const NC: usize, const G: usize, const Q8: bool>(
    v_cache: &[u16],
    geom: PageGeometry,
    kv_head: usize,
    bt: &[PageRef],
    n_att: usize,
    ms: std::ops::Range<usize>,
    sc: *const f32,
    n_pad: usize,
    acc_out: *mut f32,
) {
    use std::arch::x86_64::*;
    let d = geom.head_dim;
    let (slots, run) = (4 * LANES, LANES);
    assert!(d == NC * LANES && ms.end <= SLOT_GROUPS && n_att <= n_pad);
    for m in ms {
        // PV_RUNS_AT_ONCE of the group's runs at a time: each slot's sums are loaded once, take
        // the runs' rows in ascending order, and are stored once.
        for t0 in (m * run..n_att).step_by(PV_RUNS_AT_ONCE * slots) {
            for r in 0..PV_RUNS_AT_ONCE {
                let ahead = t0 + (r + PV_PREFETCH_RUNS) * slots;
                prefetch_span(v_cache, geom, kv_head, bt, ahead, run);
            }
            for i in 0..(n_att - t0).min(run) {
                // Head g's sums of slot 16m + i: g < G and 16m + i < 64 index the caller's
                // `G × 64 × d` sums (chunk c < NC of the slot's d below).
                let a: [*mut f32; G] =
                    std::array::from_fn(|g| acc_out.wrapping_add((g * slots + m * run + i) * d));
                let mut acc: [[__m512; NC]; G] = std::array::from_fn(|g| {
                    std::array::from_fn(|c| {
                        // SAFETY: as above: inside the caller's sums.
                        unsafe { _mm512_loadu_ps(a[g].add(c * LANES)) }
                    })
                });
                for t in (t0 + i..n_att).step_by(slots).take(PV_RUNS_AT_ONCE) {
                    let vr = cache_row(v_cache, geom, kv_head, bt, t);
                    let vc: [__m512; NC] = load_row_zmm!(Q8, NC, vr);
                    for (g, ag) in acc.iter_mut().enumerate() {
                        // SAFETY: g < G, t < n_att <= n_pad.
                        let p = _mm512_set1_ps(unsafe { *sc.add(g * n_pad + t) });
                        for (x, v) in ag.iter_mut().zip(&vc) {
                            *x = _mm512_fmadd_ps(*v, p, *x);
                        }
                    }
                }
                for (g, ag) in acc.iter().enumerate() {
                    for (c, x) in ag.iter().enumerate() {
                        // SAFETY: as above.
                        unsafe { _mm512_storeu_ps(a[g].add(c * LANES), *x) };
                    }
                }
            }
        }
    }
}

/// `out[j] = fold4` over one head's 64 accumulator slots (`a·16 + l`, `acc[slot·d + j]`),
/// vectorised over `j`: the gathered path's final fold.
/// Safety: AVX-512 F/VL present; `acc` valid for `64 × d` floats, `d = 16·NC = o.len()`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl")]
unsafe fn fold_avx512<const NC: usize>(acc: *const f32, o: &mut [f32]) {
    use std::arch::x86_64::*;
    let d = NC * LANES;
    assert_eq!(o.len(), d);
    for c in 0..NC {
        // SAFETY: slot < 64, c < NC: within `64 × d`.
        let x = |slot: usize| unsafe { _mm512_loadu_ps(acc.add(slot * d + c * LANES)) };
        let mut a0 = [_mm512_setzero_ps(); LANES];
        for (l, a) in a0.iter_mut().enumerate() {
            let s0 = _mm512_add_ps(x(l), x(2 * LANES + l));
            let s1 = _mm512_add_ps(x(LANES + l), x(3 * LANES + l));
            *a = _mm512_add_ps(s0, s1);
        }
        let mut t8 = [_mm512_setzero_ps(); 8];
        for i in 0..8 {
            t8[i] = _mm512_add_ps(a0[i], a0[i + 8]);
        }
        let mut u4 = [_mm512_setzero_ps(); 4];
        for i in 0..4 {
            u4[i] = _mm512_add_ps(t8[i], t8[i + 4]);
        }
        let r = _mm512_add_ps(_mm512_add_ps(u4[0], u4[2]), _mm512_add_ps(u4[1], u4[3]));
        // SAFETY: `o` holds d = 16·NC floats.
        unsafe { _mm512_storeu_ps(o.as_mut_ptr().add(c * LANES), r) };
    }
}

/// [`ggml_expf`] on 16 lanes: ggml's own AVX-512 `ggml_v_expf` (`vscalefps` where the scalar
/// version emulates it in f64), so each lane's bits are the scalar function's (tested, including
/// the lanes it blends: |n| > 192, ±inf, NaN).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl")]
#[inline]
fn expf_zmm(x: std::arch::x86_64::__m512) -> std::arch::x86_64::__m512 {
    use std::arch::x86_64::*;
    let c = |bits: u32| _mm512_set1_ps(f32::from_bits(bits));
    let r = c(0x4b40_0000); // 0x1.8p23
    let z = _mm512_fmadd_ps(x, c(0x3fb8_aa3b), r);
    let n = _mm512_sub_ps(z, r);
    let b = _mm512_fnmadd_ps(n, c(0x35bf_be8e), _mm512_fnmadd_ps(n, c(0x3f31_7200), x));
    let u = _mm512_mul_ps(b, b);
    let j = _mm512_fmadd_ps(
        _mm512_fmadd_ps(
            _mm512_fmadd_ps(c(0x3c07_2010), b, c(0x3d2b_9f17)),
            u,
            _mm512_fmadd_ps(c(0x3e2a_af33), b, c(0x3eff_fedb)),
        ),
        u,
        _mm512_fmadd_ps(c(0x3f7f_fff6), b, _mm512_set1_ps(1.0)),
    );
    let res = _mm512_scalef_ps(j, n);
    // Lanes with |n| > 192 or n NaN (the scalar version's early return): +inf if n > 0, else 0.
    let blended = _mm512_cmp_ps_mask::<_CMP_NLE_UQ>(_mm512_abs_ps(n), _mm512_set1_ps(192.0));
    let positive = _mm512_cmp_ps_mask::<_CMP_GT_OQ>(n, _mm512_setzero_ps());
    let alt = _mm512_mask_blend_ps(positive, _mm512_setzero_ps(), _mm512_set1_ps(f32::INFINITY));
    _mm512_mask_blend_ps(blended, res, alt)
}

/// [`softmax_compat`] 16 lanes at a time: the same exp, the same chunk sums added in f64 in
/// chunk order, the same f16 rounding of the probabilities (`vcvtps2ph`, round to nearest even).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl")]
fn softmax_compat_avx512(sc: &mut [f32], n_att: usize, max: f32) {
    use std::arch::x86_64::*;
    assert!(sc.len().is_multiple_of(LANES) && sc.len() >= n_att);
    let m = _mm512_set1_ps(max);
    let mut sum = 0.0f64;
    for chunk in sc.chunks_exact_mut(LANES) {
        // SAFETY: `chunk` is 16 floats.
        unsafe {
            let e = expf_zmm(_mm512_sub_ps(_mm512_loadu_ps(chunk.as_ptr()), m));
            _mm512_storeu_ps(chunk.as_mut_ptr(), e);
            sum += f64::from(reduce16_zmm(e));
        }
    }
    let inv = _mm512_set1_ps((1.0 / sum) as f32);
    // Lanes past `n_att` are exp(-inf) = 0 and stay 0 (the scalar version leaves them as they are).
    for chunk in sc.chunks_exact_mut(LANES) {
        // SAFETY: `chunk` is 16 floats.
        unsafe {
            let p = _mm512_mul_ps(_mm512_loadu_ps(chunk.as_ptr()), inv);
            let h = _mm512_cvtps_ph::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(p);
            _mm512_storeu_ps(chunk.as_mut_ptr(), _mm512_cvtph_ps(h));
        }
    }
}

/// [`reduce16`] on a register: halves, quarters, then (0+2) + (1+3).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl")]
#[inline]
fn reduce16_zmm(a: std::arch::x86_64::__m512) -> f32 {
    use std::arch::x86_64::*;
    let lo = _mm512_castps512_ps256(a);
    let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(a)));
    let t = _mm256_add_ps(lo, hi);
    let u = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps::<1>(t));
    let v = _mm_add_ps(u, _mm_movehl_ps(u, u));
    _mm_cvtss_f32(_mm_add_ss(v, _mm_movehdup_ps(v)))
}

/// Scalar reference attention over plain per-position K/V rows (`[t][kv_head][d]`, f32, values
/// as stored: pass them through the cache type first), used by tests to validate
/// [`paged_attention`]. Applies the same f16 roundings of the query and the probabilities.
#[cfg(test)]
fn attention_reference(
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
            let qv: Vec<f32> = q[(i * n_heads + head) * d..][..d]
                .iter()
                .map(|&x| f16::from_f32(x).to_f32())
                .collect();
            let mut s: Vec<f32> = (0..=start_pos + i)
                .map(|t| {
                    let kr = &k[(t * n_kv_heads + h) * d..][..d];
                    ops::dot_f32_scalar(&qv, kr) / (d as f32).sqrt()
                })
                .collect();
            ops::softmax(&mut s);
            let o = &mut out[(i * n_heads + head) * d..][..d];
            for (t, &w) in s.iter().enumerate() {
                let w = f16::from_f32(w).to_f32();
                for (j, ov) in o.iter_mut().enumerate() {
                    *ov += w * v[(t * n_kv_heads + h) * d + j];
                }
            }
        }
    }
    out
}

/// Write one slot of K and V (`n_kv_heads × head_dim` each, f32) into `page`, stored as
/// `geom.kv`: rounded to f16, or quantized to q8_0 as llama.cpp's CPU backend quantizes a cache
/// row (`quantize_row_q8_0`: `d = amax / 127` stored as f16, values rounded half to even).
/// The caller (the page pool) is responsible for the tag bookkeeping of the write.
pub fn write_kv_slot(
    k_cache: &mut [u16],
    v_cache: &mut [u16],
    geom: PageGeometry,
    page: usize,
    slot: usize,
    k: &[f32],
    v: &[f32],
) {
    let d = geom.head_dim;
    assert!(slot < geom.page_size);
    assert!(geom.kv.supports(d), "{:?} rows of {d} values", geom.kv);
    assert_eq!(k.len(), geom.n_kv_heads * d);
    assert_eq!(v.len(), geom.n_kv_heads * d);
    let rw = geom.row_words();
    for h in 0..geom.n_kv_heads {
        let off = geom.offset(page, h, slot);
        store_row(geom.kv, &k[h * d..(h + 1) * d], &mut k_cache[off..off + rw]);
        store_row(geom.kv, &v[h * d..(h + 1) * d], &mut v_cache[off..off + rw]);
    }
}

/// One row of values into its words (see [`write_kv_slot`]).
fn store_row(kv: KvType, src: &[f32], dst: &mut [u16]) {
    match kv {
        KvType::F16 => {
            for (w, &x) in dst.iter_mut().zip(src) {
                *w = f16::from_f32(x).to_bits();
            }
        }
        KvType::Q8_0 => {
            assert!(src.len() <= 256, "head_dim above 256 is not supported");
            let mut blocks = [crate::quant::BlockQ8::default(); 256 / Q8_0_BLOCK];
            let blocks = &mut blocks[..src.len() / Q8_0_BLOCK];
            crate::quant::quantize_row_q8(src, blocks);
            for (w, b) in dst.chunks_exact_mut(Q8_0_WORDS).zip(blocks.iter()) {
                // `b.d` is already rounded through f16: the conversion back is exact.
                w[0] = f16::from_f32(b.d).to_bits();
                for (wi, pair) in w[1..].iter_mut().zip(b.qs.chunks_exact(2)) {
                    *wi = u16::from_le_bytes([pair[0] as u8, pair[1] as u8]);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const G: PageGeometry = PageGeometry {
        page_size: 4,
        n_kv_heads: 2,
        head_dim: 8,
        kv: KvType::F16,
    };

    fn rnd(n: usize, seed: &mut u64) -> Vec<f32> {
        (0..n)
            .map(|_| {
                *seed = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(7);
                ((*seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
            })
            .collect()
    }

    struct Fixture {
        k: Vec<u16>,
        v: Vec<u16>,
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
            k: vec![0; n_pages * G.page_words()],
            v: vec![0; n_pages * G.page_words()],
            gens: vec![3; n_pages],
            owner: vec![0; n_pages],
            filled: vec![0; n_pages],
            table: Vec::new(),
            k_rows: rnd(n * G.n_kv_heads * G.head_dim, seed),
            v_rows: rnd(n * G.n_kv_heads * G.head_dim, seed),
        };
        let order = [5u32, 2, 0, 4, 1, 3];
        for &p in order.iter().take(n.div_ceil(G.page_size)) {
            f.table.push(PageRef {
                page: p,
                generation: 3,
            });
            f.owner[p as usize] = 42;
        }
        let row = G.n_kv_heads * G.head_dim;
        for t in 0..n {
            let pr = f.table[t / G.page_size];
            write_kv_slot(
                &mut f.k,
                &mut f.v,
                G,
                pr.page as usize,
                t % G.page_size,
                &f.k_rows[t * row..][..row],
                &f.v_rows[t * row..][..row],
            );
            f.filled[pr.page as usize] += 1;
        }
        f
    }

    fn run(f: &Fixture, q: &[f32], start: usize, owner: u64) -> Result<Vec<f32>, IntegrityError> {
        run_as(f, q, start, Reader::private(owner))
    }

    fn run_as(
        f: &Fixture,
        q: &[f32],
        start: usize,
        reader: Reader,
    ) -> Result<Vec<f32>, IntegrityError> {
        let args = AttentionArgs {
            q,
            n_heads: 4,
            start_pos: start,
            k_cache: &f.k,
            v_cache: &f.v,
            geom: G,
            block_table: &f.table,
            tags: TagView {
                generation: &f.gens,
                owner: &f.owner,
                filled: &f.filled,
                stamp_owner: &f.owner,
                stamp_generation: &f.gens,
            },
            reader,
            check: TagCheck::Enforced,
            order: if q.len() > 4 * G.head_dim {
                ReduceOrder::Gemm
            } else {
                ReduceOrder::Vec
            },
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
            let stored =
                |x: &[f32]| -> Vec<f32> { x.iter().map(|&v| f16::from_f32(v).to_f32()).collect() };
            let (k, v) = (stored(&f.k_rows), stored(&f.v_rows));
            let want = attention_reference(&q, 4, 2, G.head_dim, 0, &k, &v);
            for (a, b) in got.iter().zip(&want) {
                assert!((a - b).abs() < 1e-4, "n={n}: {a} vs {b}");
            }
            // decode: last query only (the `Vec` reduction order: equal up to rounding)
            let q1 = &q[(n - 1) * 4 * G.head_dim..];
            let got1 = run(&f, q1, n - 1, 42).expect("tags valid");
            for (a, b) in got1.iter().zip(&got[(n - 1) * 4 * G.head_dim..]) {
                assert!((a - b).abs() < 1e-4, "n={n}: {a} vs {b}");
            }
        }
    }

    #[test]
    fn a_q8_0_cache_attends_the_values_it_stores_for_prompt_and_decode_rows() {
        let mut seed = 3;
        let (n_heads, n_kv, d) = (4, 2, 64);
        let geom = PageGeometry {
            page_size: 16,
            n_kv_heads: n_kv,
            head_dim: d,
            kv: KvType::Q8_0,
        };
        assert_eq!(geom.row_words(), 34, "two 34-byte blocks per row of 64");
        let n_pages = 8;
        let (k, v) = random_cache(geom, n_pages, &mut seed);
        let table = scattered(n_pages, 3);
        let valid = AllValid::new(n_pages);
        let n = 100;
        // The stored values, `[t][kv_head][d]`, decoded from the format's definition.
        let rows = |cache: &[u16]| -> Vec<f32> {
            (0..n)
                .flat_map(|t| (0..n_kv).map(move |h| (t, h)))
                .flat_map(|(t, h)| {
                    decode_row(
                        geom,
                        cache,
                        geom.offset(table[t / 16].page as usize, h, t % 16),
                    )
                })
                .collect()
        };
        let q = rnd(n * n_heads * d, &mut seed);
        let want = attention_reference(&q, n_heads, n_kv, d, 0, &rows(&k), &rows(&v));
        for (q, start, order) in [
            (&q[..], 0, ReduceOrder::Gemm),
            (&q[(n - 1) * n_heads * d..], n - 1, ReduceOrder::Vec),
        ] {
            let args = valid.args(q, n_heads, start, (&k, &v), geom, &table, order);
            let mut got = vec![f32::NAN; q.len()];
            paged_attention(&args, &mut got, &mut AttnScratch::default()).expect("tags valid");
            for (a, b) in got.iter().zip(&want[start * n_heads * d..]) {
                assert!((a - b).abs() < 1e-4, "{order:?}: {a} vs {b}");
            }
        }
        // The stored values are within q8_0's rounding of what was written: half a step
        // (amax / 254) plus the scale's own f16 rounding (≤ 2⁻¹¹ relative, times ≤ 127 steps).
        let mut seed = 3;
        let first = rnd(n_kv * d, &mut seed);
        let got = decode_row(geom, &k, geom.offset(0, 0, 0));
        for (blk, (x, y)) in first[..d].chunks(32).zip(got.chunks(32)).enumerate() {
            let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            for (a, b) in x.iter().zip(y) {
                assert!(
                    (a - b).abs() <= amax / 254.0 + amax / 2048.0,
                    "block {blk}: {a} vs {b}"
                );
            }
        }
    }

    #[test]
    fn every_compiled_variant_of_the_attention_arithmetic_gives_the_same_bits() {
        let mut seed = 17;
        for (d, n_att) in [(64, 1), (64, 37), (64, 600), (48, 129)] {
            let q = rnd(d, &mut seed);
            let kh = rnd(n_att * d, &mut seed);
            let vh = rnd(n_att * d, &mut seed);
            for order in [ReduceOrder::Gemm, ReduceOrder::Vec] {
                let scale = 1.0 / (d as f32).sqrt();
                let mut want = vec![0.0; d];
                let mut ws = Workspace::default();
                attend_compat_body(order, &q, &kh, &vh, d, n_att, scale, &mut want, &mut ws);
                #[cfg(target_arch = "x86_64")]
                {
                    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    if crate::simd::level() == crate::simd::Level::Avx2 {
                        let mut got = vec![0.0; d];
                        // SAFETY: the Avx2 level implies avx2 and fma.
                        unsafe {
                            attend_compat_fma(
                                order, &q, &kh, &vh, d, n_att, scale, &mut got, &mut ws,
                            )
                        };
                        assert_eq!(bits(&got), bits(&want), "fma {order:?} d={d} n={n_att}");
                    }
                    if crate::simd::has_avx512() {
                        let mut got = vec![0.0; d];
                        // SAFETY: has_avx512 implies avx512f/vl on top of avx2/fma/f16c.
                        unsafe {
                            attend_compat_avx512(
                                order, &q, &kh, &vh, d, n_att, scale, &mut got, &mut ws,
                            )
                        };
                        assert_eq!(bits(&got), bits(&want), "avx512 {order:?} d={d} n={n_att}");
                    }
                }
            }
        }
    }

    #[test]
    fn prompt_rows_over_transposed_k_give_the_portable_bits() {
        #[cfg(target_arch = "x86_64")]
        if crate::simd::has_avx512() {
            let mut seed = 19;
            for (d, n_ctx) in [
                (64, 1),
                (64, 16),
                (64, 37),
                (64, 600),
                (128, 129),
                (32, 200),
            ] {
                let n_kv = 2;
                let k = rnd(n_kv * n_ctx * d, &mut seed);
                let v = rnd(n_kv * n_ctx * d, &mut seed);
                let n_pad = n_ctx.div_ceil(LANES) * LANES;
                let mut kt = Vec::new();
                transpose_k(&k, &mut kt, n_kv, n_ctx, n_pad, d);
                let scale = 1.0 / (d as f32).sqrt();
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                for h in 0..n_kv {
                    let kh = &k[h * n_ctx * d..(h + 1) * n_ctx * d];
                    let vh = &v[h * n_ctx * d..(h + 1) * n_ctx * d];
                    let kth = &kt[h * d * n_pad..(h + 1) * d * n_pad];
                    // One head, a GQA group, and more heads than one pass takes.
                    for (n_att, heads) in [(1, 1), (n_ctx / 2 + 1, 4), (n_ctx, 11)] {
                        let q = rnd(heads * d, &mut seed);
                        let (mut want, mut got) = (vec![0.0; heads * d], vec![0.0; heads * d]);
                        let mut ws = Workspace::default();
                        for (qg, wg) in q.chunks_exact(d).zip(want.chunks_exact_mut(d)) {
                            attend_compat_body(
                                ReduceOrder::Gemm,
                                qg,
                                kh,
                                vh,
                                d,
                                n_att,
                                scale,
                                wg,
                                &mut ws,
                            );
                        }
                        // SAFETY: has_avx512; d is a multiple of 16; kt is d × n_pad.
                        unsafe {
                            attend_gemm_avx512(
                                &q, kth, n_pad, vh, d, n_att, scale, &mut got, &mut ws,
                            )
                        };
                        assert_eq!(
                            bits(&got),
                            bits(&want),
                            "d={d} n_ctx={n_ctx} n_att={n_att} heads={heads}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn decode_over_the_cache_in_place_gives_the_gathered_paths_bits_at_any_thread_count() {
        #[cfg(target_arch = "x86_64")]
        if crate::simd::has_avx512() {
            let mut seed = 31;
            let cases = [(64, 3, 9), (128, 2, 10), (64, 1, 4)];
            for kv in [KvType::F16, KvType::Q8_0] {
                for (d, n_kv, n_heads) in cases {
                    let geom = PageGeometry {
                        page_size: 16,
                        n_kv_heads: n_kv,
                        head_dim: d,
                        kv,
                    };
                    decode_in_place_case(geom, n_heads, &mut seed);
                }
            }
        }
    }

    /// A block table of all `n_pages` pages (generation 1), logical page `i` on physical page
    /// `i · stride mod n_pages` (`stride` coprime to `n_pages`).
    fn scattered(n_pages: usize, stride: u32) -> Vec<PageRef> {
        (0..n_pages as u32)
            .map(|i| PageRef {
                page: (i * stride) % n_pages as u32,
                generation: 1,
            })
            .collect()
    }

    /// Tags under which every one of `n_pages` pages is generation 1, owned and written whole
    /// (16 slots) by reader 5.
    struct AllValid {
        gens: Vec<u32>,
        owners: Vec<u64>,
        filled: Vec<u32>,
    }

    impl AllValid {
        fn new(n_pages: usize) -> Self {
            Self {
                gens: vec![1; n_pages],
                owners: vec![5; n_pages],
                filled: vec![16; n_pages],
            }
        }

        /// Reader 5's attention of `q` at `start` over `(k, v)` through `table`.
        #[allow(clippy::too_many_arguments)]
        fn args<'a>(
            &'a self,
            q: &'a [f32],
            n_heads: usize,
            start: usize,
            (k, v): (&'a [u16], &'a [u16]),
            geom: PageGeometry,
            table: &'a [PageRef],
            order: ReduceOrder,
        ) -> AttentionArgs<'a> {
            AttentionArgs {
                q,
                n_heads,
                start_pos: start,
                k_cache: k,
                v_cache: v,
                geom,
                block_table: table,
                tags: TagView {
                    generation: &self.gens,
                    owner: &self.owners,
                    filled: &self.filled,
                    stamp_owner: &self.owners,
                    stamp_generation: &self.gens,
                },
                reader: Reader::private(5),
                order,
                check: TagCheck::Enforced,
            }
        }
    }

    /// A cache of `geom` filled through [`write_kv_slot`] with random rows: 40 pages, every
    /// slot written.
    fn random_cache(geom: PageGeometry, n_pages: usize, seed: &mut u64) -> (Vec<u16>, Vec<u16>) {
        let mut k = vec![0u16; n_pages * geom.page_words()];
        let mut v = vec![0u16; n_pages * geom.page_words()];
        let row = geom.n_kv_heads * geom.head_dim;
        for p in 0..n_pages {
            for slot in 0..geom.page_size {
                let (kr, vr) = (rnd(row, seed), rnd(row, seed));
                write_kv_slot(&mut k, &mut v, geom, p, slot, &kr, &vr);
            }
        }
        (k, v)
    }

    /// The values of the cache row at word `off`, decoded from the format's definition (f16
    /// bits; q8_0: an f16 scale then 32 signed bytes per block, value = byte · scale).
    fn decode_row(geom: PageGeometry, cache: &[u16], off: usize) -> Vec<f32> {
        let words = &cache[off..off + geom.row_words()];
        match geom.kv {
            KvType::F16 => words.iter().map(|&w| f16::from_bits(w).to_f32()).collect(),
            KvType::Q8_0 => words
                .chunks_exact(17)
                .flat_map(|b| {
                    let d = f16::from_bits(b[0]).to_f32();
                    b[1..]
                        .iter()
                        .flat_map(|w| w.to_le_bytes())
                        .map(move |q| f32::from(q as i8) * d)
                })
                .collect(),
        }
    }

    #[cfg(target_arch = "x86_64")]
    fn decode_in_place_case(geom: PageGeometry, n_heads: usize, seed: &mut u64) {
        let (d, n_kv) = (geom.head_dim, geom.n_kv_heads);
        let n_pages = 40;
        let (k, v) = random_cache(geom, n_pages, seed);
        // Pages in a scattered order, all tags valid for owner 5.
        let table = scattered(n_pages, 7);
        let valid = AllValid::new(n_pages);
        for n_ctx in [1, 15, 64, 65, 200, 463, 640] {
            let q = rnd(n_heads * d, seed);
            let kv = (&k[..], &v[..]);
            let args = valid.args(&q, n_heads, n_ctx - 1, kv, geom, &table, ReduceOrder::Vec);
            // The gathered path's arithmetic, head by head.
            let mut want = vec![0.0; n_heads * d];
            let mut ws = Workspace::default();
            let scale = 1.0 / (d as f32).sqrt();
            for (head, o) in want.chunks_mut(d).enumerate() {
                let h = head / (n_heads / n_kv);
                let gather = |cache: &[u16]| -> Vec<f32> {
                    (0..n_ctx)
                        .flat_map(|t| {
                            let off = geom.offset(table[t / 16].page as usize, h, t % 16);
                            decode_row(geom, cache, off)
                        })
                        .collect()
                };
                let qh = &q[head * d..(head + 1) * d];
                let (kh, vh) = (gather(&k), gather(&v));
                attend_compat_body(ReduceOrder::Vec, qh, &kh, &vh, d, n_ctx, scale, o, &mut ws);
            }
            let bits = |x: &[f32]| x.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            for threads in [1, 2, 3] {
                let pool = crate::par::ThreadPool::new(threads).expect("pool");
                let mut got = vec![f32::NAN; n_heads * d];
                pool.install(|| paged_attention(&args, &mut got, &mut AttnScratch::default()))
                    .expect("tags valid");
                assert_eq!(
                    bits(&got),
                    bits(&want),
                    "{geom:?} heads={n_heads} n_ctx={n_ctx} threads={threads}"
                );
            }
        }
    }

    #[test]
    fn the_vector_exp_and_softmax_give_the_scalar_bits() {
        #[cfg(target_arch = "x86_64")]
        if crate::simd::has_avx512() {
            use std::arch::x86_64::*;
            let mut xs: Vec<f32> = (-2000..=400).map(|i| i as f32 * 0.1).collect();
            xs.extend([
                f32::NEG_INFINITY,
                f32::INFINITY,
                f32::NAN,
                -1e30,
                1e30,
                0.0,
                -0.0,
                -87.3,
                -103.9,
                88.7,
            ]);
            let mut seed = 41;
            xs.extend(rnd(4096, &mut seed).into_iter().map(|v| v * 120.0));
            xs.resize(xs.len().div_ceil(LANES) * LANES, -3.0);
            for chunk in xs.chunks_exact(LANES) {
                let mut got = [0.0f32; LANES];
                // SAFETY: has_avx512 was checked; 16 floats in and out.
                unsafe {
                    _mm512_storeu_ps(got.as_mut_ptr(), expf_zmm(_mm512_loadu_ps(chunk.as_ptr())))
                };
                for (x, g) in chunk.iter().zip(got) {
                    let want = ggml_expf(*x);
                    assert!(
                        g.to_bits() == want.to_bits() || (g.is_nan() && want.is_nan()),
                        "exp({x}): {g} vs {want}"
                    );
                }
            }
            for n_att in [1usize, 16, 17, 300] {
                let n_pad = n_att.div_ceil(LANES) * LANES;
                let mut a = rnd(n_pad, &mut seed);
                a[n_att..].fill(f32::NEG_INFINITY);
                let max = a[..n_att].iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let mut b = a.clone();
                softmax_compat(&mut a, n_att, max);
                // SAFETY: has_avx512 was checked.
                unsafe { softmax_compat_avx512(&mut b, n_att, max) };
                let bits = |v: &[f32]| v[..n_att].iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&a), bits(&b), "softmax n_att={n_att}");
            }
        }
    }

    #[test]
    fn ggml_expf_is_accurate_and_handles_the_masked_lanes() {
        for i in -1600..=100 {
            let x = i as f32 * 0.05;
            let (got, want) = (ggml_expf(x), x.exp());
            assert!((got - want).abs() <= want * 4e-7, "{x}: {got} vs {want}");
        }
        assert_eq!(ggml_expf(f32::NEG_INFINITY), 0.0);
        assert_eq!(ggml_expf(-500.0), 0.0);
        assert_eq!(ggml_expf(0.0), 1.0);
    }

    #[test]
    fn reductions_follow_the_documented_lane_order() {
        // 1e8 + 1 - 1e8 style cancellation exposes the order: lane 0 gets 1e8 and -1e8 (so 0),
        // lane 1 gets 1.0 → 1.0 exactly in gemm order; a sequential sum would give the same here,
        // but pairing lanes (0, 8) first is observable with 3 big values.
        let mut x = vec![0.0f32; 32];
        let y = vec![1.0f32; 32];
        x[0] = 1e8;
        x[16] = -1e8;
        x[1] = 1.0;
        assert_eq!(dot_gemm(&x, &y), 1.0);
        let mut a = [0.0f32; LANES];
        a[0] = 1e8;
        a[8] = 1.0;
        a[4] = -1e8;
        // tree: t0 = 1e8 + 1 = 1e8 (f32), u0 = t0 + t4(=-1e8) = 0 → 0, whereas left-to-right
        // summation would also lose the 1; with a[12] instead the tree keeps it:
        assert_eq!(reduce16(&a), 0.0);
        let mut b = [0.0f32; LANES];
        b[0] = 1e8;
        b[4] = -1e8;
        b[1] = 1.0;
        assert_eq!(reduce16(&b), 1.0);
        // vec order: element 64 (past the 64-element main loop) is added in f64 at the end.
        let mut x = vec![0.0f32; 65];
        x[0] = 1e8;
        x[64] = 1.0;
        let y = vec![1.0f32; 65];
        assert_eq!(dot_vec(&x, &y), 1e8 + 1.0);
    }

    #[test]
    fn same_order_gives_bit_identical_rows_whatever_the_batch() {
        let mut seed = 9;
        let n = 21;
        let f = fixture(n, &mut seed);
        let q = rnd(n * 4 * G.head_dim, &mut seed);
        let all = run(&f, &q, 0, 42).expect("ok");
        // The last 5 rows as their own (multi-row, so Gemm) call: identical bits.
        let tail = &q[(n - 5) * 4 * G.head_dim..];
        let part = run(&f, tail, n - 5, 42).expect("ok");
        assert_eq!(&part[..], &all[(n - 5) * 4 * G.head_dim..]);
    }

    #[test]
    fn stale_generation_is_refused_and_out_untouched() {
        let mut seed = 2;
        let mut f = fixture(9, &mut seed);
        f.gens[2] += 1; // page 2 (logical page 1) was reallocated
        let q = rnd(4 * G.head_dim, &mut seed);
        let args_out = run(&f, &q, 8, 42);
        assert_eq!(
            args_out,
            Err(IntegrityError::StaleGeneration {
                page: 2,
                expected: 3,
                found: 4
            })
        );
    }

    #[test]
    fn foreign_owner_is_refused() {
        let mut seed = 3;
        let mut f = fixture(9, &mut seed);
        f.owner[0] = 7;
        let q = rnd(4 * G.head_dim, &mut seed);
        assert!(matches!(
            run(&f, &q, 8, 42),
            Err(IntegrityError::ForeignOwner {
                page: 0,
                found: 7,
                ..
            })
        ));
        // and a reader with the wrong identity is refused on the first page
        let f = fixture(9, &mut seed);
        assert!(matches!(
            run(&f, &q, 8, 41),
            Err(IntegrityError::ForeignOwner { page: 5, .. })
        ));
    }

    /// A prefix cache's shared pages: owned by a namespace tag (stamp included), readable by a
    /// reader that names that tag, by nobody else; a free page is never admitted.
    #[test]
    fn shared_pages_are_read_only_by_their_namespace() {
        let mut seed = 5;
        let mut f = fixture(9, &mut seed);
        let ns = std::num::NonZeroU64::new(0x8000_0000_0000_00a1).unwrap();
        let other = std::num::NonZeroU64::new(0x8000_0000_0000_00b2).unwrap();
        // The sequence's first page became a shared page of `ns`.
        let p0 = f.table[0].page as usize;
        f.owner[p0] = ns.get();
        let q = rnd(4 * G.head_dim, &mut seed);
        let shared = run_as(&f, &q, 8, Reader::with_shared(42, &[ns])).unwrap();
        let mut own = fixture(9, &mut 5);
        own.owner[p0] = 42;
        assert_eq!(
            shared,
            run(&own, &q, 8, 42).unwrap(),
            "same bytes, same output"
        );
        // Its writer's private identity, another namespace, or no namespace: refused.
        for reader in [
            Reader::private(42),
            Reader::with_shared(42, &[other]),
            Reader::with_shared(43, &[other, ns]),
        ] {
            let r = run_as(&f, &q, 8, reader);
            if reader.admits(ns.get()) {
                // 43 does not own the private pages.
                assert!(matches!(
                    r,
                    Err(IntegrityError::ForeignOwner { found: 42, .. })
                ));
            } else {
                assert!(
                    matches!(r, Err(IntegrityError::ForeignOwner { page, .. }) if page == p0 as u32)
                );
            }
        }
        // A free page is refused whatever namespaces the reader names.
        f.owner[p0] = NO_OWNER;
        assert!(matches!(
            run_as(&f, &q, 8, Reader::with_shared(42, &[ns, other])),
            Err(IntegrityError::ForeignOwner {
                found: NO_OWNER,
                ..
            })
        ));
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
            Err(IntegrityError::UnwrittenSlot {
                page: 0,
                generation: 3,
                slot: 1,
                filled: 1
            })
        );
        // position 12 is past the allocated pages altogether.
        assert!(matches!(
            run(&f, &q, 12, 42),
            Err(IntegrityError::BlockTableTooShort { .. })
        ));
        let mut f = fixture(12, &mut seed);
        f.filled[0] = 1; // logical page 2 has 1 of 4 slots written
        assert_eq!(
            run(&f, &q, 11, 42),
            Err(IntegrityError::UnwrittenSlot {
                page: 0,
                generation: 3,
                slot: 1,
                filled: 1
            })
        );
    }

    #[test]
    fn out_of_range_page_is_refused() {
        let mut seed = 5;
        let mut f = fixture(4, &mut seed);
        f.table[0].page = 99;
        let q = rnd(4 * G.head_dim, &mut seed);
        assert!(matches!(
            run(&f, &q, 3, 42),
            Err(IntegrityError::PageOutOfRange { page: 99, .. })
        ));
    }
}

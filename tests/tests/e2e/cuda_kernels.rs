//! The CUDA kernels' execution tier: `kernels/cuda/*.cu` run on the CPU through the project's
//! CUDA-on-CPU shim (`custody_tests::cuda_shim`) against the CPU kernels on random inputs —
//! bit-exact for the checksum and the tag check's verdicts, a stated tolerance for attention's
//! floats — under three schedule seeds each (any difference between seeds is a race), outputs
//! poisoned before each run. The shim's own controls: a racy kernel differs across seeds, a
//! barrier only some threads reach is reported.

use custody_kernels::attention::{
    AttentionArgs, AttnScratch, IntegrityError, PageGeometry, PageRef, Reader, ReduceOrder,
    TagCheck, TagView, check_tags, paged_attention,
};
use custody_tests::cuda_shim::{self, AttentionShape, OwnedTags, Request, Verdict};
use half::f16;
use std::num::NonZeroU64;

const SEEDS: [u64; 3] = [0, 0x9E37_79B9_7F4A_7C15, 0xD1B5_4A32_D192_ED03];

/// A small deterministic generator (xorshift64*): the tests' random inputs, reproducible.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    fn unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
    }
}

#[test]
fn the_gpu_checksum_is_bit_identical_to_the_cpu_checksum() {
    let mut rng = Rng(7);
    // Lengths around every stripe/block boundary past XXH3's short algorithms, and a real
    // page's size (SmolLM2: 16 slots × 30 layers × K and V of 192 f16).
    let lens = [
        241usize, 255, 256, 257, 1023, 1024, 1025, 1087, 1088, 1089, 4096, 10_000, 368_640,
    ];
    let data: Vec<Vec<u8>> = lens
        .iter()
        .map(|&n| (0..n).map(|_| rng.next() as u8).collect())
        .collect();
    // Each page split into random chunks (transfer order: a chunk per layer's K and V).
    let pages: Vec<Vec<&[u8]>> = data
        .iter()
        .map(|d| {
            let mut chunks = Vec::new();
            let mut at = 0;
            while at < d.len() {
                let n = (1 + rng.below(3000) as usize).min(d.len() - at);
                chunks.push(&d[at..at + n]);
                at += n;
            }
            chunks
        })
        .collect();
    let want: Vec<u64> = pages
        .iter()
        .map(|c| custody_kernels::checksum::page_checksum(c.iter().copied()))
        .collect();
    for seed in SEEDS {
        let got = cuda_shim::page_checksums(&pages, seed).expect("launch");
        assert_eq!(got, want, "seed {seed:#x}");
    }
    // And one flipped bit changes the GPU's value as the CPU's.
    let mut bad = data[12].clone();
    bad[100_000] ^= 1;
    let got = cuda_shim::page_checksums(&[vec![&bad[..]]], 0).expect("launch");
    assert_ne!(got[0], want[12]);
    assert_eq!(got[0], custody_kernels::checksum::page_checksum([&bad[..]]));
}

/// The CPU's verdict in the kernel's encoding.
fn cpu_verdict(r: Result<(), IntegrityError>) -> Verdict {
    let v = |code, page, a, b| Verdict { code, page, a, b };
    match r {
        Ok(()) => Verdict::default(),
        Err(IntegrityError::PageOutOfRange { page, n_pages }) => v(1, page, n_pages as u64, 0),
        Err(IntegrityError::BlockTableTooShort { have, need, .. }) => {
            v(2, 0, have as u64, need as u64)
        }
        Err(IntegrityError::StaleGeneration {
            page,
            expected,
            found,
        }) => v(3, page, expected.into(), found.into()),
        Err(IntegrityError::ForeignOwner {
            page,
            expected,
            found,
            ..
        }) => v(4, page, expected, found),
        Err(IntegrityError::UnwrittenSlot {
            page,
            generation,
            filled,
            ..
        }) => v(5, page, filled.into(), generation.into()),
        Err(IntegrityError::InBandMismatch {
            page,
            stamp_owner,
            stamp_generation,
            ..
        }) => v(7, page, stamp_owner, stamp_generation.into()),
        Err(e) => panic!("not a read-side verdict: {e}"),
    }
}

/// A pool of `n_pages` tags where every request owns its pages, then faults: stale, foreign,
/// unwritten, in-band mismatch, out of range, too short — at random places.
fn pool_and_requests(
    rng: &mut Rng,
    n_pages: u32,
    page_size: u32,
    n_req: usize,
) -> (OwnedTags, Vec<Request>) {
    let mut tags = OwnedTags {
        generation: (0..n_pages).map(|_| 1 + rng.below(5) as u32).collect(),
        owner: vec![0; n_pages as usize],
        filled: vec![page_size; n_pages as usize],
        stamp_owner: vec![0; n_pages as usize],
        stamp_generation: vec![0; n_pages as usize],
    };
    let mut free: Vec<u32> = (0..n_pages).collect();
    let mut reqs = Vec::new();
    for r in 0..n_req {
        let owner = 100 + r as u64;
        let n_ctx = 1 + rng.below(u64::from(page_size) * 6) as u32;
        let need = n_ctx.div_ceil(page_size);
        let mut table = Vec::new();
        for _ in 0..need {
            let i = rng.below(free.len() as u64) as usize;
            let p = free.swap_remove(i);
            tags.owner[p as usize] = owner;
            tags.stamp_owner[p as usize] = owner;
            tags.stamp_generation[p as usize] = tags.generation[p as usize];
            table.push(cuda_shim::PageRef {
                page: p,
                generation: tags.generation[p as usize],
            });
        }
        // The last page is filled only as far as attended (as a live request's is).
        let last = table[table.len() - 1].page as usize;
        tags.filled[last] = n_ctx - (need - 1) * page_size;
        // Three requests in four read a prefix cache: their full pages alternate between the
        // namespaces they name (shared pages: owner and stamp the namespace's tag) — their
        // tenant's and the operator's public scope, their tenant's alone (one shared slot
        // unused), or the public scope's alone; the fourth reads only its own pages.
        let names: &[NonZeroU64] = match r % 4 {
            0 => &[tenant_ns(r), PUBLIC_NS],
            1 => &[tenant_ns(r)],
            2 => &[PUBLIC_NS],
            _ => &[],
        };
        for (i, pr) in table[..need as usize - 1].iter().enumerate() {
            if let Some(ns) = names.get(i % 2).or(names.first()) {
                tags.owner[pr.page as usize] = ns.get();
                tags.stamp_owner[pr.page as usize] = ns.get();
            }
        }
        let reader = Reader::with_shared(owner, names);
        reqs.push(Request {
            table,
            n_ctx,
            reader,
        });
    }
    // Faults on every other request, one kind each, at a random page of its table.
    for (k, r) in reqs.iter_mut().enumerate().filter(|(k, _)| k % 2 == 1) {
        let i = rng.below(r.table.len() as u64) as usize;
        let p = r.table[i].page as usize;
        match (k / 2) % 8 {
            0 => tags.generation[p] += 1, // stale: the page was reused
            1 => tags.owner[p] = 999,     // foreign
            2 => tags.filled[p] = tags.filled[p].saturating_sub(1), // unwritten slot
            3 => tags.stamp_generation[p] += 7, // a late write's stamp
            4 => r.table[i].page = n_pages + 3, // outside the pool
            5 => {
                // Another tenant's namespace (its shared page, stamped for it).
                let other = tenant_ns(k + 1).get();
                (tags.owner[p], tags.stamp_owner[p]) = (other, other);
            }
            6 => {
                // A free page: an unused shared slot (0) must not admit it.
                (tags.owner[p], tags.stamp_owner[p]) = (0, 0);
            }
            _ => {
                r.table.pop(); // too short for its context
            }
        }
    }
    (tags, reqs)
}

/// The public scope's namespace tag in [`pool_and_requests`].
const PUBLIC_NS: NonZeroU64 = NonZeroU64::new(1 << 62).expect("nonzero");

/// Request `r`'s tenant namespace tag in [`pool_and_requests`] (never a request id: those are
/// 100 + r).
fn tenant_ns(r: usize) -> NonZeroU64 {
    NonZeroU64::new((1 << 62) + 1 + r as u64).expect("nonzero")
}

fn cpu_check(r: &Request, page_size: u32, tags: &OwnedTags) -> Result<(), IntegrityError> {
    let table: Vec<PageRef> = r
        .table
        .iter()
        .map(|p| PageRef {
            page: p.page,
            generation: p.generation,
        })
        .collect();
    let view = TagView {
        generation: &tags.generation,
        owner: &tags.owner,
        filled: &tags.filled,
        stamp_owner: &tags.stamp_owner,
        stamp_generation: &tags.stamp_generation,
    };
    check_tags(
        &table,
        r.n_ctx as usize,
        page_size as usize,
        &view,
        r.reader,
    )
}

#[test]
fn the_gpu_tag_check_gives_the_cpu_verdict_for_every_fault() {
    let mut rng = Rng(11);
    let page_size = 16;
    let (tags, reqs) = pool_and_requests(&mut rng, 600, page_size, 48);
    let want: Vec<Verdict> = reqs
        .iter()
        .map(|r| cpu_verdict(cpu_check(r, page_size, &tags)))
        .collect();
    let kinds: std::collections::BTreeSet<u32> = want.iter().map(|v| v.code).collect();
    assert_eq!(
        kinds,
        [0, 1, 2, 3, 4, 5, 7].into_iter().collect(),
        "every verdict kind is exercised"
    );
    // Passing readers of shared pages exist, and so do refused reads of another namespace's
    // page and of a free one: the device admits exactly the namespaces a reader names.
    let reads_shared = |r: &Request| {
        r.table.iter().any(|p| {
            tags.owner
                .get(p.page as usize)
                .is_some_and(|&o| o != r.reader.owner())
        })
    };
    assert!(
        reqs.iter()
            .zip(&want)
            .any(|(r, v)| v.code == 0 && reads_shared(r)),
        "a passing reader of shared pages"
    );
    let foreign: Vec<u64> = want.iter().filter(|v| v.code == 4).map(|v| v.b).collect();
    assert!(
        foreign.iter().any(|&o| o > 1 << 62) && foreign.contains(&0),
        "refused: another tenant's namespace and a free page: {foreign:?}"
    );
    for seed in SEEDS {
        let got = cuda_shim::tag_check(&reqs, page_size, &tags, seed).expect("launch");
        assert_eq!(got, want, "seed {seed:#x}");
    }
}

#[test]
fn gpu_attention_refuses_failing_requests_and_matches_the_cpu_for_the_rest() {
    let mut rng = Rng(23);
    let shape = AttentionShape {
        n_heads: 9,
        n_kv_heads: 3,
        head_dim: 64,
        page_size: 16,
    };
    let n_pages = 200u32;
    let (tags, reqs) = pool_and_requests(&mut rng, n_pages, shape.page_size, 12);
    let geom = PageGeometry {
        page_size: shape.page_size as usize,
        n_kv_heads: shape.n_kv_heads as usize,
        head_dim: shape.head_dim as usize,
        kv: custody_kernels::attention::KvType::F16,
    };
    let cache_len = n_pages as usize * geom.n_kv_heads * geom.page_size * geom.head_dim;
    let k: Vec<f16> = (0..cache_len).map(|_| f16::from_f32(rng.unit())).collect();
    let v: Vec<f16> = (0..cache_len).map(|_| f16::from_f32(rng.unit())).collect();
    let row = (shape.n_heads * shape.head_dim) as usize;
    let q: Vec<f32> = (0..reqs.len() * row).map(|_| rng.unit()).collect();
    let (kb, vb): (Vec<u16>, Vec<u16>) = (
        k.iter().map(|x| x.to_bits()).collect(),
        v.iter().map(|x| x.to_bits()).collect(),
    );
    // CPU reference per request.
    let mut want = vec![f32::NAN; q.len()];
    let mut verdicts = Vec::new();
    for (i, r) in reqs.iter().enumerate() {
        let out = &mut want[i * row..(i + 1) * row];
        let res = cpu_attention(&q[i * row..(i + 1) * row], shape, &kb, &vb, r, &tags, out);
        verdicts.push(cpu_verdict(res));
    }
    assert!(verdicts.iter().any(|v| v.code == 0) && verdicts.iter().any(|v| v.code != 0));
    // Poisoned output: a refused request's rows must keep the poison, bit for bit. However the
    // contexts are split (a fault then lies in one CTA's pages while others' pass), the verdicts
    // are the CPU's; under every schedule the outputs are the same bits (no race).
    const POISON: u32 = 0x7fc0_dead;
    for splits in [
        cuda_shim::FlashSplits {
            n: 1,
            pages_per_split: 6,
        },
        cuda_shim::FlashSplits {
            n: 6,
            pages_per_split: 1,
        },
        cuda_shim::FlashSplits {
            n: 3,
            pages_per_split: 2,
        },
    ] {
        let mut first: Option<Vec<f32>> = None;
        for seed in SEEDS {
            let mut out = vec![f32::from_bits(POISON); q.len()];
            let run =
                cuda_shim::flash_decode(&q, &kb, &vb, &reqs, shape, &tags, splits, &mut out, seed)
                    .expect("launch");
            assert_eq!(
                run.verdicts, verdicts,
                "seed {seed:#x} {splits:?}: verdicts"
            );
            check_attention(&out, &want, &verdicts, row, POISON, &format!("{splits:?}"));
            match &first {
                None => first = Some(out),
                Some(f) => assert!(
                    f.iter().zip(&out).all(|(a, b)| a.to_bits() == b.to_bits()),
                    "seed {seed:#x} {splits:?}: output differs from seed 0's — a race"
                ),
            }
        }
    }
}

/// The CPU backend's decode attention for request `r` (the reference), into `out`.
fn cpu_attention(
    q: &[f32],
    shape: AttentionShape,
    kb: &[u16],
    vb: &[u16],
    r: &Request,
    tags: &OwnedTags,
    out: &mut [f32],
) -> Result<(), IntegrityError> {
    let table: Vec<PageRef> = r
        .table
        .iter()
        .map(|p| PageRef {
            page: p.page,
            generation: p.generation,
        })
        .collect();
    let args = AttentionArgs {
        q,
        n_heads: shape.n_heads as usize,
        start_pos: r.n_ctx as usize - 1,
        k_cache: kb,
        v_cache: vb,
        geom: PageGeometry {
            page_size: shape.page_size as usize,
            n_kv_heads: shape.n_kv_heads as usize,
            head_dim: shape.head_dim as usize,
            kv: custody_kernels::attention::KvType::F16,
        },
        block_table: &table,
        tags: TagView {
            generation: &tags.generation,
            owner: &tags.owner,
            filled: &tags.filled,
            stamp_owner: &tags.stamp_owner,
            stamp_generation: &tags.stamp_generation,
        },
        reader: r.reader,
        order: ReduceOrder::Vec,
        check: TagCheck::Enforced,
    };
    paged_attention(&args, out, &mut AttnScratch::default())
}

/// Refused rows keep the poison bit for bit; passing rows are the CPU's within 2e-3 (f32 math
/// in another summation order than the CPU's; outputs are convex combinations of values in
/// [-1, 1]).
fn check_attention(
    out: &[f32],
    want: &[f32],
    verdicts: &[Verdict],
    row: usize,
    poison: u32,
    what: &str,
) {
    check_attention_within(out, want, verdicts, row, poison, 2e-3, what);
}

/// The four architectures' head layouts (GQA groups 3, 4, 7 and 2; head widths 64 and 128:
/// SmolLM2, Llama 3, Qwen 2, Qwen 3), one KV head each, with the contexts the long-context
/// attention tests run to (past 8,192 and past 65,536).
const HEAD_LAYOUTS: [(AttentionShape, u32); 4] = [
    (layout(3, 64), 8_193),
    (layout(4, 128), 65_537),
    (layout(7, 64), 9_000),
    (layout(2, 128), 12_000),
];

const fn layout(n_heads: u32, head_dim: u32) -> AttentionShape {
    AttentionShape {
        n_heads,
        n_kv_heads: 1,
        head_dim,
        page_size: 16,
    }
}

/// A context of `n_ctx` slots written by `owner`: the pool's tags (five spare pages beyond the
/// table's) and the block table's pages in a scrambled order (a real pool's), the last page
/// partly filled.
fn long_context(rng: &mut Rng, page_size: u32, n_ctx: u32, owner: u64) -> (OwnedTags, Vec<u32>) {
    let need = n_ctx.div_ceil(page_size);
    let n_pages = (need + 5) as usize;
    let mut tags = OwnedTags {
        generation: vec![1; n_pages],
        owner: vec![owner; n_pages],
        filled: vec![page_size; n_pages],
        stamp_owner: vec![owner; n_pages],
        stamp_generation: vec![1; n_pages],
    };
    let mut pages: Vec<u32> = (0..n_pages as u32).collect();
    for i in (1..pages.len()).rev() {
        pages.swap(i, rng.below(i as u64 + 1) as usize);
    }
    pages.truncate(need as usize);
    tags.filled[pages[need as usize - 1] as usize] = n_ctx - (need - 1) * page_size;
    (tags, pages)
}

/// Flash decoding past the first kernel's 8,192-slot cap and past 65,536, at the head layouts
/// of the four architectures (GQA groups 3, 4, 7 and 2; head widths 64 and 128; SmolLM2,
/// Llama 3, Qwen 2, Qwen 3): the CPU's output; and by count, its K/V loads ≥ 90 % coalesced
/// and its tag check ≤ 1 % of the bytes it moves.
#[test]
fn flash_decoding_serves_long_contexts_at_every_head_layout() {
    let mut rng = Rng(65537);
    for (shape, n_ctx) in HEAD_LAYOUTS {
        let AttentionShape {
            n_heads,
            n_kv_heads,
            head_dim,
            ..
        } = shape;
        let need = n_ctx.div_ceil(shape.page_size);
        let n_pages = need + 5;
        let owner = 77u64;
        let (tags, pages) = long_context(&mut rng, shape.page_size, n_ctx, owner);
        let req = Request {
            table: pages
                .iter()
                .map(|&page| cuda_shim::PageRef {
                    page,
                    generation: 1,
                })
                .collect(),
            n_ctx,
            reader: Reader::private(owner),
        };
        let geom = PageGeometry {
            page_size: shape.page_size as usize,
            n_kv_heads: n_kv_heads as usize,
            head_dim: head_dim as usize,
            kv: custody_kernels::attention::KvType::F16,
        };
        let cache_len = n_pages as usize * geom.n_kv_heads * geom.page_size * geom.head_dim;
        let kb: Vec<u16> = (0..cache_len)
            .map(|_| f16::from_f32(rng.unit()).to_bits())
            .collect();
        let vb: Vec<u16> = (0..cache_len)
            .map(|_| f16::from_f32(rng.unit()).to_bits())
            .collect();
        let row = (n_heads * head_dim) as usize;
        let q: Vec<f32> = (0..row).map(|_| 2.0 * rng.unit()).collect();
        let mut want = vec![0.0f32; row];
        cpu_attention(&q, shape, &kb, &vb, &req, &tags, &mut want).expect("CPU attends");
        // As the engine cuts a lone row's context.
        let cut = custody_runtime::cuda_forward::Splits::of(
            1,
            n_kv_heads as usize,
            (n_heads / n_kv_heads) as usize,
            shape.page_size as usize,
            need as usize,
        );
        let splits = cuda_shim::FlashSplits {
            n: cut.n as u32,
            pages_per_split: cut.pages_per_split as u32,
        };
        let what = format!("{n_heads}/{n_kv_heads} heads of {head_dim}, context {n_ctx}");
        let mut out = vec![f32::NAN; row];
        let run = cuda_shim::flash_decode(
            &q,
            &kb,
            &vb,
            std::slice::from_ref(&req),
            shape,
            &tags,
            splits,
            &mut out,
            SEEDS[1],
        )
        .expect("launch");
        assert_eq!(run.verdicts, vec![Verdict::default()], "{what}");
        check_attention(&out, &want, &run.verdicts, row, 0, &what);
        let c = run.counts;
        assert!(
            c.coalescing() >= 0.9,
            "{what}: {:.1} % coalesced: {c:?}",
            100.0 * c.coalescing()
        );
        // The ideal: K and V of the attended slots once (f16).
        let kv_bytes = 2 * u64::from(n_ctx) * u64::from(head_dim) * 2;
        let moved = c.dram_bytes();
        assert!(
            moved as f64 <= 1.05 * kv_bytes as f64,
            "{what}: moved {moved} B for {kv_bytes} B of K/V: {c:?}"
        );
        // The tag check's bytes in the same DRAM model: the distinct 32-byte sectors of the
        // five tag arrays its pages touch.
        let tag_bytes: u64 = [4u64, 8, 4, 8, 4]
            .iter()
            .map(|&size| {
                let sectors: std::collections::BTreeSet<u64> =
                    pages.iter().map(|&p| u64::from(p) * size / 32).collect();
                sectors.len() as u64 * 32
            })
            .sum();
        assert!(
            (tag_bytes as f64) <= 0.01 * moved as f64,
            "{what}: the tag check's {tag_bytes} B are more than 1 % of {moved} B"
        );
        eprintln!(
            "{what}: {} splits of {} pages; flash decode {:.1} % coalesced, {moved} B moved for {kv_bytes} B of K/V ({:.3}×), tag check {:.2} %",
            splits.n,
            splits.pages_per_split,
            100.0 * c.coalescing(),
            moved as f64 / kv_bytes as f64,
            100.0 * tag_bytes as f64 / moved as f64
        );
    }
}

/// The tensor-core prefill kernel past 8,192 and past 65,536 slots at the four architectures'
/// head layouts (head widths 64 and 128): a tile of rows at the end of the context, each row
/// causal (attending its own position and before), gives each row the CPU's output; a tile whose
/// context holds a stale page gives its rows the CPU's verdicts — rows ending before the page
/// still get their output, no row after it does — and by count its K/V loads are coalesced.
#[test]
fn the_prefill_kernel_serves_long_contexts_and_each_rows_verdict() {
    let mut rng = Rng(4099);
    for ((shape, n_ctx), rows) in HEAD_LAYOUTS.into_iter().zip([20u32, 5, 70, 17]) {
        let AttentionShape {
            n_heads,
            n_kv_heads,
            head_dim,
            ..
        } = shape;
        let need = n_ctx.div_ceil(shape.page_size);
        let n_pages = need + 5;
        let owner = 91u64;
        let (mut tags, pages) = long_context(&mut rng, shape.page_size, n_ctx, owner);
        // A prefix-cache hit being prefilled: the context's first full pages are a namespace's
        // shared pages, the rest the request's own.
        let shared = (need as usize - 1) / 2;
        for &p in &pages[..shared] {
            (tags.owner[p as usize], tags.stamp_owner[p as usize]) =
                (PUBLIC_NS.get(), PUBLIC_NS.get());
        }
        let reader = Reader::with_shared(owner, &[PUBLIC_NS]);
        let table: Vec<cuda_shim::PageRef> = pages
            .iter()
            .map(|&page| cuda_shim::PageRef {
                page,
                generation: 1,
            })
            .collect();
        // The tile's rows: the last `rows` positions, in order.
        let reqs: Vec<Request> = (n_ctx - rows + 1..=n_ctx)
            .map(|n| Request {
                table: table.clone(),
                n_ctx: n,
                reader,
            })
            .collect();
        let tiles: Vec<u32> = (0..rows)
            .step_by(64)
            .flat_map(|r0| [r0, (rows - r0).min(64)])
            .collect();
        let geom_len =
            n_pages as usize * n_kv_heads as usize * shape.page_size as usize * head_dim as usize;
        let kb: Vec<u16> = (0..geom_len)
            .map(|_| f16::from_f32(rng.unit()).to_bits())
            .collect();
        let vb: Vec<u16> = (0..geom_len)
            .map(|_| f16::from_f32(rng.unit()).to_bits())
            .collect();
        let row = (n_heads * head_dim) as usize;
        let q: Vec<f32> = (0..row * rows as usize).map(|_| 2.0 * rng.unit()).collect();
        let what = format!("{n_heads}/{n_kv_heads} heads of {head_dim}, {rows} rows to {n_ctx}");
        let run = |tags: &OwnedTags, out: &mut [f32]| {
            cuda_shim::flash_prefill(&q, &kb, &vb, &reqs, &tiles, shape, tags, out, SEEDS[2])
                .expect("launch")
        };
        let want = |tags: &OwnedTags| -> (Vec<f32>, Vec<Verdict>) {
            let mut want = vec![0.0f32; row * rows as usize];
            let verdicts = reqs
                .iter()
                .enumerate()
                .map(|(i, r)| {
                    let qi = &q[i * row..(i + 1) * row];
                    cpu_verdict(cpu_attention(
                        qi,
                        shape,
                        &kb,
                        &vb,
                        r,
                        tags,
                        &mut want[i * row..(i + 1) * row],
                    ))
                })
                .collect();
            (want, verdicts)
        };
        // All pages good: every row's output.
        let (expect, verdicts) = want(&tags);
        let mut out = vec![f32::from_bits(0x7fc0_0001); row * rows as usize];
        let got = run(&tags, &mut out);
        assert_eq!(got.verdicts, verdicts, "{what}");
        assert!(verdicts.iter().all(|v| v.code == 0), "{what}");
        // f16 queries and softmax weights on tensor cores: within 4e-3 of the f32 CPU.
        check_attention_within(&out, &expect, &got.verdicts, row, 0x7fc0_0001, 4e-3, &what);
        let c = got.counts;
        assert!(
            c.coalescing() >= 0.9,
            "{what}: {:.1} % coalesced: {c:?}",
            100.0 * c.coalescing()
        );
        // A stale page inside the last row's last page but one: rows that end before it pass.
        let stale = pages[need as usize - 2] as usize;
        let mut bad_tags = tags.clone();
        bad_tags.generation[stale] = 2;
        let (expect, verdicts) = want(&bad_tags);
        let mut out = vec![f32::from_bits(0x7fc0_0001); row * rows as usize];
        let got = run(&bad_tags, &mut out);
        assert_eq!(got.verdicts, verdicts, "{what}: stale page");
        assert!(
            verdicts.iter().any(|v| v.code != 0),
            "{what}: some row fails"
        );
        check_attention_within(&out, &expect, &got.verdicts, row, 0x7fc0_0001, 4e-3, &what);
        // Another namespace's page among the shared ones: no row reads past it.
        if shared > 0 {
            let mut foreign = tags.clone();
            let p = pages[shared - 1] as usize;
            (foreign.owner[p], foreign.stamp_owner[p]) = (tenant_ns(7).get(), tenant_ns(7).get());
            let (expect, verdicts) = want(&foreign);
            let mut out = vec![f32::from_bits(0x7fc0_0001); row * rows as usize];
            let got = run(&foreign, &mut out);
            assert_eq!(got.verdicts, verdicts, "{what}: another namespace's page");
            assert!(
                verdicts.iter().all(|v| v.code == 4),
                "{what}: every row refused"
            );
            check_attention_within(&out, &expect, &got.verdicts, row, 0x7fc0_0001, 4e-3, &what);
        }
        eprintln!(
            "{what}: prefill {:.1} % coalesced; {} of {rows} rows pass with a stale page at slot {}",
            100.0 * c.coalescing(),
            verdicts.iter().filter(|v| v.code == 0).count(),
            (need - 2) * shape.page_size
        );
    }
}

/// [`check_attention`] with the tolerance `tol`.
fn check_attention_within(
    out: &[f32],
    want: &[f32],
    verdicts: &[Verdict],
    row: usize,
    poison: u32,
    tol: f32,
    what: &str,
) {
    for (i, vd) in verdicts.iter().enumerate() {
        let (g, w) = (&out[i * row..(i + 1) * row], &want[i * row..(i + 1) * row]);
        if vd.code != 0 {
            assert!(
                g.iter().all(|x| x.to_bits() == poison),
                "{what}: row {i}: refused but written"
            );
            continue;
        }
        let worst = g
            .iter()
            .zip(w)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f32, f32::max);
        assert!(worst < tol, "{what}: row {i}: max |Δ| {worst}");
    }
}

#[test]
fn the_shim_catches_a_race_and_a_divergent_barrier() {
    let results: Vec<u32> = SEEDS
        .iter()
        .map(|&s| cuda_shim::control_race(s).expect("launch").to_bits())
        .collect();
    assert!(
        results.windows(2).any(|w| w[0] != w[1]),
        "a racy kernel gave one result under every schedule: {results:?}"
    );
    let e = cuda_shim::control_divergent().expect_err("a divergent barrier");
    assert!(e.0.contains("divergent barrier"), "{e}");
}

fn close(got: &[f32], want: &[f32], tol: f32, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let err = (g - w).abs() / w.abs().max(1.0);
        assert!(
            err <= tol,
            "{what}[{i}]: GPU {g} vs CPU {w} (relative {err:e} > {tol:e})"
        );
    }
}

/// Run `f` under every seed on a poisoned copy of `init`; the results must agree bit for bit.
fn every_seed(init: &[f32], f: impl Fn(&mut [f32], u64)) -> Vec<f32> {
    let mut first: Option<Vec<f32>> = None;
    for seed in SEEDS {
        let mut buf = init.to_vec();
        f(&mut buf, seed);
        match &first {
            None => first = Some(buf),
            Some(x) => assert!(
                x.iter().zip(&buf).all(|(a, b)| a.to_bits() == b.to_bits()),
                "seed {seed:#x} differs from seed 0: a race"
            ),
        }
    }
    first.expect("seeds")
}

#[test]
fn gpu_row_kernels_match_the_cpu_ops() {
    use custody_kernels::ops;
    let mut rng = Rng(31);
    let (rows, dim) = (5usize, 576usize);
    let x: Vec<f32> = (0..rows * dim).map(|_| rng.unit() * 3.0).collect();
    let w: Vec<f32> = (0..dim).map(|_| rng.unit()).collect();
    let poison = vec![f32::NAN; rows * dim];
    // RMSNorm (the CPU sums squares in f64; the GPU in f32 over 128 lanes).
    let got = every_seed(&poison, |o, s| {
        cuda_shim::rms_norm(&x, &w, 1e-5, o, s).expect("launch")
    });
    let mut want = vec![0.0; rows * dim];
    for r in 0..rows {
        ops::rms_norm(
            &x[r * dim..(r + 1) * dim],
            &w,
            1e-5,
            &mut want[r * dim..(r + 1) * dim],
        );
    }
    close(&got, &want, 1e-5, "rms_norm");
    // RoPE at positions up to a long context: both pair styles, with and without Llama 3's
    // frequency factors.
    let positions = [0u32, 1, 17, 511, 2047];
    let factors: Vec<f32> = (0..32).map(|i| 1.0 + i as f32 * 0.25).collect();
    for (style, with_factors) in [
        (ops::RopeStyle::Normal, false),
        (ops::RopeStyle::Normal, true),
        (ops::RopeStyle::Neox, false),
        (ops::RopeStyle::Neox, true),
    ] {
        let ones = vec![1.0f32; 32];
        let f = if with_factors { &factors } else { &ones };
        let shape = cuda_shim::RopeShape {
            n_heads: 9,
            head_dim: 64,
            n_rot: 64,
            freq_base: 100_000.0,
            freq_factors: f,
            neox: style == ops::RopeStyle::Neox,
        };
        let row = (shape.n_heads * shape.head_dim) as usize;
        let q: Vec<f32> = (0..positions.len() * row).map(|_| rng.unit()).collect();
        let got = every_seed(&q, |o, s| {
            cuda_shim::rope(o, &positions, shape, s).expect("launch")
        });
        let mut want = q.clone();
        let mut tbl = Vec::new();
        for (r, &p) in positions.iter().enumerate() {
            let ff = with_factors.then_some(&factors[..]);
            ops::rope_table(p as usize, 64, 100_000.0, ff, &mut tbl);
            style.apply(&mut want[r * row..(r + 1) * row], 64, &tbl);
        }
        close(
            &got,
            &want,
            1e-5,
            &format!("rope {style:?} factors {with_factors}"),
        );
    }
    // Softmax, and SwiGLU (the CPU uses ggml's exp polynomial, the GPU expf).
    let got = every_seed(&x, |o, s| cuda_shim::softmax(o, dim, s).expect("launch"));
    let mut want = x.clone();
    for r in want.chunks_mut(dim) {
        ops::softmax(r);
    }
    close(&got, &want, 1e-6, "softmax");
    let up: Vec<f32> = (0..rows * dim).map(|_| rng.unit()).collect();
    let got = every_seed(&x, |o, s| cuda_shim::swiglu(o, &up, s).expect("launch"));
    let mut want = x.clone();
    ops::swiglu(&mut want, &up);
    close(&got, &want, 1e-5, "swiglu");
}

/// A random `rows × cols` weight matrix of `dtype` as GGUF bytes (finite scales).
fn weights(
    rng: &mut Rng,
    dtype: custody_kernels::quant::DType,
    rows: usize,
    cols: usize,
) -> Vec<u8> {
    use custody_kernels::quant::DType;
    let half = |rng: &mut Rng, scale: f32| f16::from_f32(rng.unit() * scale).to_le_bytes();
    let mut w = Vec::new();
    for _ in 0..rows {
        match dtype {
            DType::F32 => (0..cols).for_each(|_| w.extend((rng.unit()).to_le_bytes())),
            DType::F16 => (0..cols).for_each(|_| w.extend(half(rng, 1.0))),
            DType::Q4_0 | DType::Q4_1 | DType::Q8_0 => {
                for _ in 0..cols / 32 {
                    w.extend(half(rng, 0.1));
                    if dtype == DType::Q4_1 {
                        w.extend(half(rng, 0.5));
                    }
                    let n = if dtype == DType::Q8_0 { 32 } else { 16 };
                    (0..n).for_each(|_| w.push(rng.next() as u8));
                }
            }
            DType::Q5_0 | DType::Q5_1 => {
                for _ in 0..cols / 32 {
                    w.extend(half(rng, 0.1));
                    if dtype == DType::Q5_1 {
                        w.extend(half(rng, 0.5));
                    }
                    (0..20).for_each(|_| w.push(rng.next() as u8));
                }
            }
            DType::Q4_K | DType::Q5_K | DType::Q6_K | DType::Q2_K | DType::Q3_K => {
                for _ in 0..cols / 256 {
                    let block = dtype.block_bytes();
                    if matches!(dtype, DType::Q6_K | DType::Q3_K) {
                        (0..block - 2).for_each(|_| w.push(rng.next() as u8));
                        w.extend(half(rng, 0.01));
                    } else if dtype == DType::Q2_K {
                        (0..block - 4).for_each(|_| w.push(rng.next() as u8));
                        w.extend(half(rng, 0.01));
                        w.extend(half(rng, 0.02));
                    } else {
                        w.extend(half(rng, 0.01));
                        w.extend(half(rng, 0.02));
                        (0..block - 4).for_each(|_| w.push(rng.next() as u8));
                    }
                }
            }
            DType::BF16 => (0..cols)
                .for_each(|_| w.extend(((rng.unit().to_bits() >> 16) as u16).to_le_bytes())),
        }
    }
    w
}

#[test]
fn gpu_matvec_matches_the_dequantized_reference_for_every_weight_type() {
    use custody_kernels::quant::{DType, dequantize_row};
    let mut rng = Rng(41);
    let (rows, cols, n) = (24usize, 256usize, 3usize);
    let x: Vec<f32> = (0..n * cols).map(|_| rng.unit()).collect();
    // `dtype_code` in runtime/engine/src/cuda_forward.rs, `CustodyDType` in ops.cu.
    for (code, dtype) in [
        (0, DType::F32),
        (1, DType::F16),
        (2, DType::Q4_0),
        (3, DType::Q4_1),
        (4, DType::Q8_0),
        (5, DType::Q5_0),
        (6, DType::Q5_1),
        (7, DType::Q4_K),
        (8, DType::Q5_K),
        (9, DType::Q6_K),
        (10, DType::BF16),
        (11, DType::Q2_K),
        (12, DType::Q3_K),
    ] {
        let w = weights(&mut rng, dtype, rows, cols);
        assert_eq!(
            w.len() as u64,
            dtype.bytes_for((rows * cols) as u64).expect("blocks")
        );
        // Reference: each row dequantized by the CPU, the dot product in f64.
        let row_bytes = w.len() / rows;
        let mut want = vec![0.0f32; n * rows];
        let mut deq = vec![0.0f32; cols];
        for o in 0..rows {
            dequantize_row(dtype, &w[o * row_bytes..(o + 1) * row_bytes], &mut deq);
            for r in 0..n {
                let dot: f64 = deq
                    .iter()
                    .zip(&x[r * cols..(r + 1) * cols])
                    .map(|(a, b)| f64::from(*a) * f64::from(*b))
                    .sum();
                want[r * rows + o] = dot as f32;
            }
        }
        let poison = vec![f32::NAN; n * rows];
        let got = every_seed(&poison, |o, s| {
            cuda_shim::matvec(&w, code as u32, rows, cols, &x, o, s).expect("launch")
        });
        close(&got, &want, 1e-4, &format!("matvec {dtype:?}"));
    }
}

#[test]
fn gpu_gather_then_scatter_moves_a_pages_chunks_exactly() {
    let mut rng = Rng(53);
    let pool: Vec<u8> = (0..1 << 16).map(|_| rng.next() as u8).collect();
    // A page's chunks (K then V of each layer) scattered through the pool, gathered in order.
    let mut chunks = Vec::new();
    let mut at = 0u64;
    for i in 0..20u64 {
        let len = 64 + rng.below(700);
        chunks.push(cuda_shim::Chunk {
            src_off: i * 3000 + rng.below(100),
            dst_off: at,
            len,
        });
        at += len;
    }
    let mut staged = vec![0xEEu8; at as usize];
    cuda_shim::copy_chunks(&pool, &mut staged, &chunks, SEEDS[1]).expect("gather");
    let want: Vec<u8> = chunks
        .iter()
        .flat_map(|c| {
            pool[c.src_off as usize..(c.src_off + c.len) as usize]
                .iter()
                .copied()
        })
        .collect();
    assert_eq!(staged, want, "gathered bytes");
    // Scatter back into a poisoned pool: exactly the chunks' bytes return, nothing else moves.
    let back: Vec<cuda_shim::Chunk> = chunks
        .iter()
        .map(|c| cuda_shim::Chunk {
            src_off: c.dst_off,
            dst_off: c.src_off,
            len: c.len,
        })
        .collect();
    let mut dst = vec![0xEEu8; pool.len()];
    cuda_shim::copy_chunks(&staged, &mut dst, &back, SEEDS[2]).expect("scatter");
    for (i, (&d, &p)) in dst.iter().zip(&pool).enumerate() {
        let inside = chunks
            .iter()
            .any(|c| (c.src_off..c.src_off + c.len).contains(&(i as u64)));
        assert_eq!(d, if inside { p } else { 0xEE }, "byte {i}");
    }
}

/// The KV-write kernel stores each value as the CPU pool does: `custody_float_to_half` is
/// bit-identical to `half::f16::from_f32` on random floats of every magnitude, on every
/// rounding halfway case near the f16 boundaries, on subnormals, overflow, infinities and NaNs;
/// a row whose page is `CUSTODY_NO_PAGE` is not written.
#[test]
fn the_kv_write_kernel_rounds_to_f16_as_the_cpu_does() {
    use custody_cuda::device::{bytes_of, bytes_of_mut};
    use custody_cuda::{Arg, Device, Kernel, LaunchDims};
    let mut rng = Rng(0x5eed);
    let mut vals: Vec<f32> = vec![
        0.0,
        -0.0,
        1.0,
        65504.0,
        65519.99,
        65520.0,
        1e9,
        -1e9,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
        -f32::NAN,
        f32::from_bits(0x7fc0_1234),
        f32::from_bits(0x7f80_0001),
        6.1035156e-5,
        6.0e-5,
        5.96e-8,
        2.98e-8,
        2.9802322e-8,
        1.0e-8,
        f32::MIN_POSITIVE,
    ];
    // Halfway cases: the f16 grid's midpoints at every exponent, either side.
    for e in -24i32..16 {
        let ulp = 2f32.powi(e - 10);
        let base = 2f32.powi(e);
        for k in [1.0f32, 3.0, 5.0, 1023.0] {
            vals.push(base + ulp * k / 2.0);
            vals.push(-(base + ulp * k / 2.0));
        }
    }
    while !vals.len().is_multiple_of(16) || vals.len() < 4096 {
        let bits = rng.next() as u32;
        vals.push(f32::from_bits(bits));
    }
    let (kvd, rows) = (16usize, vals.len() / 16);
    let mut dev = custody_tests::cuda_shim::ShimDevice::new(SEEDS[1]);
    let put = |d: &mut custody_tests::cuda_shim::ShimDevice, b: &[u8]| {
        let p = d.alloc_zeroed(b.len()).expect("alloc");
        d.upload(p, b).expect("upload");
        p
    };
    let k = put(&mut dev, bytes_of(&vals));
    let v = put(&mut dev, bytes_of(&vals));
    // Row r → page r, slot 0 (one slot per page, one KV head of 16); the last row skipped.
    let mut pages: Vec<u32> = (0..rows as u32).collect();
    pages[rows - 1] = u32::MAX;
    let pages_d = put(&mut dev, bytes_of(&pages));
    let slots_d = put(&mut dev, bytes_of(&vec![0u32; rows]));
    let poison = vec![0xABCDu16; rows * kvd];
    let kc = put(&mut dev, bytes_of(&poison));
    let vc = put(&mut dev, bytes_of(&poison));
    let args = [
        Arg::Ptr(k),
        Arg::Ptr(v),
        Arg::Ptr(pages_d),
        Arg::Ptr(slots_d),
        Arg::U32(1),
        Arg::U32(kvd as u32),
        Arg::U32(1),
        Arg::Ptr(kc),
        Arg::Ptr(vc),
    ];
    dev.launch(
        Kernel::KvWrite,
        LaunchDims::grid2(rows as u32, 1, 128),
        &args,
    )
    .expect("launch");
    for cache in [kc, vc] {
        let mut got = vec![0u16; rows * kvd];
        dev.download(cache, bytes_of_mut(&mut got))
            .expect("download");
        for (i, (&x, &g)) in vals.iter().zip(&got).enumerate() {
            let want = if i / kvd == rows - 1 {
                0xABCD
            } else {
                f16::from_f32(x).to_bits()
            };
            assert_eq!(g, want, "value {x:e} ({:#010x}) at {i}", x.to_bits());
        }
    }
}

/// A product's outputs and counts under one schedule seed: the first kept, every later one
/// equal to it bit for bit (a difference is a race).
fn same_as_first(
    first: &mut Option<(Vec<f32>, cuda_shim::Counts)>,
    got: Vec<f32>,
    counts: cuda_shim::Counts,
    what: &str,
) {
    match first {
        None => *first = Some((got, counts)),
        Some((g0, c0)) => {
            assert!(
                g0.iter().zip(&got).all(|(a, b)| a.to_bits() == b.to_bits()),
                "{what} differs from seed 0: a race"
            );
            assert_eq!(*c0, counts, "{what}: counts differ across schedules");
        }
    }
}

/// One tiled GEMV launch (`custody_gemv_q4k`, `_q6k`, `_q8_0`) on a counting shim device: the
/// outputs and the launch's counts.
fn gemv_tiled(
    kernel: custody_cuda::Kernel,
    tiles: &custody_cuda::repack::Tiles,
    rows: usize,
    cols: usize,
    x: &[f32],
    seed: u64,
) -> (Vec<f32>, cuda_shim::Counts) {
    use custody_cuda::{Arg, Device, LaunchDims};
    let n = x.len() / cols;
    let mut dev = cuda_shim::ShimDevice::counting(seed);
    let put = |dev: &mut cuda_shim::ShimDevice, b: &[u8]| {
        let p = dev.alloc_zeroed(b.len()).expect("alloc");
        dev.upload(p, b).expect("upload");
        p
    };
    let heads = put(&mut dev, &tiles.heads);
    let qs = put(&mut dev, &tiles.qs);
    let xp = put(&mut dev, custody_cuda::device::bytes_of(x));
    let poison = vec![f32::NAN; n * rows];
    let out = put(&mut dev, custody_cuda::device::bytes_of(&poison));
    let dims = LaunchDims::grid2((rows as u32).div_ceil(4), (n as u32).div_ceil(8), 128);
    let args = [
        Arg::Ptr(heads),
        Arg::Ptr(qs),
        Arg::U32(rows as u32),
        Arg::U32(cols as u32),
        Arg::Ptr(xp),
        Arg::U32(n as u32),
        Arg::Ptr(out),
    ];
    dev.launch(kernel, dims, &args).expect("launch");
    let mut got = vec![0.0f32; n * rows];
    dev.download(out, custody_cuda::device::bytes_of_mut(&mut got))
        .expect("download");
    let counts = dev.take_counts();
    assert_eq!(counts.len(), 1);
    (got, counts[0].counts)
}

/// The decode GEMVs on their tiles (Q4_K, Q6_K, Q8_0) give the dequantized reference at the
/// shapes that exercise their edges (a padded last group, rows not a multiple of a block's 4
/// warps, batches past one block's 8 rows), the same bits under every schedule; and by count
/// each is what it was built to be: ≥ 90 % of its sectors are ones a perfectly coalesced access
/// needs, and it moves at most 1.15× the ideal bytes (the file's weights once, x once, the
/// outputs once) when the columns fill whole tile groups (as 2,048-, 4,096-, 8,192- and
/// 14,336-wide rows do for Q4_K; multiples of 2,048 for Q6_K, of 256 for Q8_0).
#[test]
fn the_tiled_gemvs_match_the_reference_and_are_coalesced_by_count() {
    use custody_cuda::Kernel;
    use custody_cuda::repack;
    use custody_kernels::quant::{DType, dequantize_row};
    let mut rng = Rng(4141);
    type Repack = fn(&[u8], usize, usize) -> Result<repack::Tiles, repack::RepackError>;
    let kinds: [(DType, Kernel, Repack, usize); 3] = [
        (DType::Q4_K, Kernel::GemvQ4K, repack::q4k, 4 * 256),
        (DType::Q6_K, Kernel::GemvQ6K, repack::q6k, 8 * 256),
        (DType::Q8_0, Kernel::GemvQ8_0, repack::q8_0, 256),
    ];
    let shapes = [
        (9, 1280, 3),
        (4, 256, 1),
        (6, 2048, 9),
        (8, 2048, 1),
        (5, 2304, 2),
    ];
    for ((dtype, kernel, repack, whole), (rows, cols, n)) in kinds
        .into_iter()
        .flat_map(|k| shapes.into_iter().map(move |sh| (k, sh)))
    {
        let w = weights(&mut rng, dtype, rows, cols);
        let x: Vec<f32> = (0..n * cols).map(|_| rng.unit()).collect();
        let row_bytes = w.len() / rows;
        let mut want = vec![0.0f32; n * rows];
        let mut deq = vec![0.0f32; cols];
        for o in 0..rows {
            dequantize_row(dtype, &w[o * row_bytes..(o + 1) * row_bytes], &mut deq);
            for r in 0..n {
                let dot: f64 = deq
                    .iter()
                    .zip(&x[r * cols..(r + 1) * cols])
                    .map(|(a, b)| f64::from(*a) * f64::from(*b))
                    .sum();
                want[r * rows + o] = dot as f32;
            }
        }
        let tiles = repack(&w, rows, cols).expect("repack");
        let what = format!("{} {rows}×{cols}, batch {n}", kernel.name());
        let mut first: Option<(Vec<f32>, cuda_shim::Counts)> = None;
        for seed in SEEDS {
            let (got, counts) = gemv_tiled(kernel, &tiles, rows, cols, &x, seed);
            same_as_first(&mut first, got, counts, &format!("{what}: seed {seed:#x}"));
        }
        let (got, counts) = first.expect("seeds");
        close(&got, &want, 1e-4, &what);
        let ideal = (w.len() + x.len() * 4 + n * rows * 4) as f64;
        eprintln!(
            "{what}: {:.1} % coalesced, {:.3}× the ideal bytes",
            100.0 * counts.coalescing(),
            counts.dram_bytes() as f64 / ideal
        );
        assert!(
            counts.coalescing() >= 0.9,
            "{what}: {:.1} % coalesced: {counts:?}",
            100.0 * counts.coalescing()
        );
        assert_eq!(counts.store_bytes, (n * rows * 4) as u64, "{what}");
        if cols.is_multiple_of(whole) {
            let ratio = counts.dram_bytes() as f64 / ideal;
            assert!(
                ratio <= 1.15,
                "{what}: moves {ratio:.3}× the ideal bytes: {counts:?}"
            );
        }
    }
}

/// `x` (`n` rows of `cols`) on `dev`, quantized there by `custody_quantize_q8`: (xq, xs).
fn quantize_on(
    dev: &mut cuda_shim::ShimDevice,
    x: &[f32],
    cols: usize,
) -> (custody_cuda::DevicePtr, custody_cuda::DevicePtr) {
    use custody_cuda::{Arg, Device, Kernel, LaunchDims};
    let n = x.len() / cols;
    let xp = dev.alloc_zeroed(x.len() * 4).expect("alloc");
    dev.upload(xp, custody_cuda::device::bytes_of(x))
        .expect("upload");
    let xq = dev.alloc_zeroed(n * cols).expect("alloc");
    let xs = dev.alloc_zeroed(n * cols / 4).expect("alloc");
    let args = [
        Arg::Ptr(xp),
        Arg::U32(cols as u32),
        Arg::Ptr(xq),
        Arg::Ptr(xs),
    ];
    dev.launch(
        Kernel::QuantizeQ8,
        LaunchDims::grid2(n as u32, 1, 128),
        &args,
    )
    .expect("quantize");
    (xq, xs)
}

/// An int8-x product's grid: `custody_mmq_q4k` (64 × 64 a CTA) or the dp4a GEMV (4 rows × 8).
fn q8_product_dims(
    kernel: custody_cuda::Kernel,
    rows: usize,
    n: usize,
) -> custody_cuda::LaunchDims {
    use custody_cuda::{Kernel, LaunchDims};
    match kernel {
        Kernel::MmqQ4K => {
            LaunchDims::grid2((rows as u32).div_ceil(64), (n as u32).div_ceil(64), 128)
        }
        _ => LaunchDims::grid2((rows as u32).div_ceil(4), (n as u32).div_ceil(8), 128),
    }
}

/// Activations quantized for the dp4a GEMVs, on the host: per block of 32, d = max |x| / 127,
/// q = round-half-even(x · 127 / max |x|), scales (d, d · Σq); the bytes in the Q4_K GEMV's
/// lane order (`custody_q8_block`, kernels/cuda/custody.cuh) — an independent statement of it.
struct Q8Ref {
    xq: Vec<u8>,
    xs: Vec<f32>,
    /// The values the quantized x stands for, d · q, row-major.
    values: Vec<f32>,
}

fn q8_reference(x: &[f32], cols: usize) -> Q8Ref {
    assert!(cols.is_multiple_of(256));
    let mut r = Q8Ref {
        xq: vec![0; x.len()],
        xs: vec![0.0; x.len() / 16],
        values: vec![0.0; x.len()],
    };
    for (row, xr) in x.chunks(cols).enumerate() {
        for (j, block) in xr.chunks(32).enumerate() {
            let amax = block.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            let d = amax / 127.0;
            let mut sum = 0i32;
            for (i, &v) in block.iter().enumerate() {
                let q = if amax > 0.0 {
                    (v * (127.0 / amax)).round_ties_even() as i32
                } else {
                    0
                };
                sum += q;
                let e = (32 * j + i) % 256;
                let (b, c, h, p) = ((32 * j + i) / 256, e / 64, (e % 64) / 32, (e % 32) / 4);
                r.xq[row * cols + 8 * (32 * b + 8 * c + p) + 4 * h + e % 4] = q as i8 as u8;
                r.values[row * cols + 32 * j + i] = d * q as f32;
            }
            let at = 2 * (row * cols / 32 + j);
            r.xs[at] = d;
            r.xs[at + 1] = d * sum as f32;
        }
    }
    r
}

/// The int8-activation path's pieces on the shim: `custody_quantize_q8` is the host's
/// quantization bit for bit (bytes and scales), and so are the quantized copies
/// `custody_rms_norm` and `custody_add_rms_norm` store beside their output; the dp4a GEMV
/// (`custody_gemv_q4k_q8`) and the int8 tensor-core kernel (`custody_mmq_q4k`, its MMAs
/// emulated in the PTX fragment layout) on them are the dequantized weights times the quantized
/// x (an f64 reference, within 1e-4) at the edge shapes (a padded last tile group, rows and x
/// rows not filling a block's tile), the same bits under every schedule, ≥ 90 % coalesced and —
/// for columns that fill whole tile groups — within 1.15× the ideal bytes (the weights once,
/// the int8 x and its scales once, the outputs once).
#[test]
fn the_dp4a_gemv_multiplies_the_quantized_activations_its_producers_store() {
    use custody_cuda::device::{bytes_of, bytes_of_mut};
    use custody_cuda::repack;
    use custody_cuda::{Arg, Device, DevicePtr, Kernel, LaunchDims};
    use custody_kernels::quant::{DType, dequantize_row};
    let mut rng = Rng(7171);
    let put = |dev: &mut cuda_shim::ShimDevice, b: &[u8]| {
        let p = dev.alloc_zeroed(b.len()).expect("alloc");
        dev.upload(p, b).expect("upload");
        p
    };
    let get_u8 = |dev: &mut cuda_shim::ShimDevice, p: DevicePtr, n: usize| {
        let mut v = vec![0u8; n];
        dev.download(p, &mut v).expect("download");
        v
    };
    let get_f32 = |dev: &mut cuda_shim::ShimDevice, p: DevicePtr, n: usize| {
        let mut v = vec![0.0f32; n];
        dev.download(p, bytes_of_mut(&mut v)).expect("download");
        v
    };
    let shapes = [
        (9, 1280, 3),
        (4, 256, 1),
        (6, 2048, 9),
        (5, 2304, 2),
        (70, 1024, 21),
        (64, 2048, 64),
    ];
    for ((rows, cols, n), kernel) in shapes
        .into_iter()
        .flat_map(|sh| [(sh, Kernel::GemvQ4KQ8), (sh, Kernel::MmqQ4K)])
    {
        let w = weights(&mut rng, DType::Q4_K, rows, cols);
        // A zero block among them: its scale is 0 and its bytes 0.
        let mut x: Vec<f32> = (0..n * cols).map(|_| 3.0 * rng.unit()).collect();
        x[32..64].fill(0.0);
        let want_q = q8_reference(&x, cols);
        let row_bytes = w.len() / rows;
        let mut want = vec![0.0f32; n * rows];
        let mut deq = vec![0.0f32; cols];
        for o in 0..rows {
            dequantize_row(
                DType::Q4_K,
                &w[o * row_bytes..(o + 1) * row_bytes],
                &mut deq,
            );
            for r in 0..n {
                let dot: f64 = deq
                    .iter()
                    .zip(&want_q.values[r * cols..(r + 1) * cols])
                    .map(|(a, b)| f64::from(*a) * f64::from(*b))
                    .sum();
                want[r * rows + o] = dot as f32;
            }
        }
        let tiles = repack::q4k(&w, rows, cols).expect("repack");
        let what = format!("{} {rows}×{cols}, batch {n}", kernel.name());
        let mut first: Option<(Vec<f32>, cuda_shim::Counts)> = None;
        for seed in SEEDS {
            let mut dev = cuda_shim::ShimDevice::counting(seed);
            let (xq, xs) = quantize_on(&mut dev, &x, cols);
            // The quantize launch's counts are not the product's.
            dev.take_counts();
            assert_eq!(get_u8(&mut dev, xq, n * cols), want_q.xq, "{what}: bytes");
            let xs_got = get_f32(&mut dev, xs, n * cols / 16);
            assert!(
                xs_got
                    .iter()
                    .zip(&want_q.xs)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "{what}: scales"
            );
            let heads = put(&mut dev, &tiles.heads);
            let qs = put(&mut dev, &tiles.qs);
            let out = put(&mut dev, bytes_of(&vec![f32::NAN; n * rows]));
            let args = [
                Arg::Ptr(heads),
                Arg::Ptr(qs),
                Arg::U32(rows as u32),
                Arg::U32(cols as u32),
                Arg::Ptr(xq),
                Arg::Ptr(xs),
                Arg::U32(n as u32),
                Arg::Ptr(out),
            ];
            dev.launch(kernel, q8_product_dims(kernel, rows, n), &args)
                .expect("product");
            let got = get_f32(&mut dev, out, n * rows);
            let counts = dev.take_counts().pop().expect("counted").counts;
            same_as_first(&mut first, got, counts, &format!("{what}: seed {seed:#x}"));
        }
        let (got, counts) = first.expect("seeds");
        close(&got, &want, 1e-4, &what);
        let ideal = (w.len() + n * cols + n * cols / 4 + n * rows * 4) as f64;
        let ratio = counts.dram_bytes() as f64 / ideal;
        eprintln!(
            "{what}: {:.1} % coalesced, {ratio:.3}× the ideal bytes",
            100.0 * counts.coalescing()
        );
        assert!(counts.coalescing() >= 0.9, "{what}: {counts:?}");
        if cols.is_multiple_of(1024) {
            assert!(ratio <= 1.15, "{what}: {ratio:.3}× the ideal bytes");
        }
    }
    // The norms' quantized copies are their outputs', quantized.
    let (rows, dim, eps) = (3usize, 768usize, 1e-5f32);
    let x: Vec<f32> = (0..rows * dim).map(|_| 4.0 * rng.unit()).collect();
    let y: Vec<f32> = (0..rows * dim).map(|_| rng.unit()).collect();
    let w: Vec<f32> = (0..dim).map(|_| 1.0 + rng.unit()).collect();
    for (kernel, seed) in [(Kernel::RmsNorm, SEEDS[1]), (Kernel::AddRmsNorm, SEEDS[2])] {
        let mut dev = cuda_shim::ShimDevice::new(seed);
        let (xp, yp, wp) = (
            put(&mut dev, bytes_of(&x)),
            put(&mut dev, bytes_of(&y)),
            put(&mut dev, bytes_of(&w)),
        );
        let op = dev.alloc_zeroed(rows * dim * 4).expect("alloc");
        let xq = dev.alloc_zeroed(rows * dim).expect("alloc");
        let xs = dev.alloc_zeroed(rows * dim / 4).expect("alloc");
        let mut args = vec![Arg::Ptr(xp)];
        if kernel == Kernel::AddRmsNorm {
            args.push(Arg::Ptr(yp));
        }
        args.extend([
            Arg::Ptr(wp),
            Arg::F32(eps),
            Arg::U32(dim as u32),
            Arg::Ptr(op),
            Arg::Ptr(xq),
            Arg::Ptr(xs),
        ]);
        dev.launch(kernel, LaunchDims::grid2(rows as u32, 1, 128), &args)
            .expect("norm");
        let out = get_f32(&mut dev, op, rows * dim);
        let want_q = q8_reference(&out, dim);
        assert_eq!(
            get_u8(&mut dev, xq, rows * dim),
            want_q.xq,
            "{kernel:?}: bytes"
        );
        let xs_got = get_f32(&mut dev, xs, rows * dim / 16);
        assert!(
            xs_got
                .iter()
                .zip(&want_q.xs)
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "{kernel:?}: scales"
        );
    }
}

/// The fused int8-x products are their parts: `custody_gemv_q4k_q8_qkv` and
/// `custody_mmq_q4k_qkv` give, bit for bit, what `custody_gemv_q4k_q8` / `custody_mmq_q4k` give
/// for Q, K and V one by one — at ragged sizes (Q's rows not a multiple of a CTA's 64, K/V's
/// fewer than one CTA's), where the fused grid's CTA-to-matrix mapping has edges — and the
/// `_swiglu` kernels give silu(gate) · up of the separate products (within 1e-6: the host's
/// `exp`), under every schedule.
#[test]
fn the_fused_int8_products_are_their_parts() {
    use custody_cuda::device::{bytes_of, bytes_of_mut};
    use custody_cuda::{Arg, Device, DevicePtr, Kernel, LaunchDims, repack};
    use custody_kernels::quant::DType;
    let mut rng = Rng(9191);
    let (q_rows, kv_rows, ffn_rows, cols) = (70usize, 20usize, 40usize, 1024usize);
    let mats: Vec<repack::Tiles> = [q_rows, kv_rows, kv_rows, ffn_rows, ffn_rows]
        .iter()
        .map(|&rows| {
            repack::q4k(&weights(&mut rng, DType::Q4_K, rows, cols), rows, cols).expect("repack")
        })
        .collect();
    for (n, seed) in [(3usize, SEEDS[0]), (21, SEEDS[1]), (64, SEEDS[2])] {
        let tensor_cores = n > 8;
        let x: Vec<f32> = (0..n * cols).map(|_| 2.0 * rng.unit()).collect();
        let mut dev = cuda_shim::ShimDevice::new(seed);
        let mut put = |b: &[u8]| {
            let p = dev.alloc_zeroed(b.len()).expect("alloc");
            dev.upload(p, b).expect("upload");
            p
        };
        let tiles: Vec<(DevicePtr, DevicePtr)> =
            mats.iter().map(|t| (put(&t.heads), put(&t.qs))).collect();
        let outs: Vec<DevicePtr> = [q_rows, kv_rows, kv_rows, ffn_rows, ffn_rows, q_rows]
            .iter()
            .chain(&[kv_rows, kv_rows, ffn_rows])
            .map(|&rows| put(bytes_of(&vec![f32::NAN; n * rows])))
            .collect();
        let (xq, xs) = quantize_on(&mut dev, &x, cols);
        let (single, qkv, swiglu) = if tensor_cores {
            (Kernel::MmqQ4K, Kernel::MmqQ4KQkv, Kernel::MmqQ4KSwiglu)
        } else {
            (
                Kernel::GemvQ4KQ8,
                Kernel::GemvQ4KQ8Qkv,
                Kernel::GemvQ4KQ8Swiglu,
            )
        };
        let dims = |rows: usize| q8_product_dims(single, rows, n);
        // Each matrix alone: Q, K, V, gate, up.
        for (i, &rows) in [q_rows, kv_rows, kv_rows, ffn_rows, ffn_rows]
            .iter()
            .enumerate()
        {
            let (h, q) = tiles[i];
            let args = [
                Arg::Ptr(h),
                Arg::Ptr(q),
                Arg::U32(rows as u32),
                Arg::U32(cols as u32),
                Arg::Ptr(xq),
                Arg::Ptr(xs),
                Arg::U32(n as u32),
                Arg::Ptr(outs[i]),
            ];
            dev.launch(single, dims(rows), &args).expect("single");
        }
        let ((qh, qq), (kh, kq), (vh, vq)) = (tiles[0], tiles[1], tiles[2]);
        let args = [
            Arg::Ptr(qh),
            Arg::Ptr(qq),
            Arg::U32(q_rows as u32),
            Arg::Ptr(kh),
            Arg::Ptr(kq),
            Arg::Ptr(vh),
            Arg::Ptr(vq),
            Arg::U32(kv_rows as u32),
            Arg::U32(cols as u32),
            Arg::Ptr(xq),
            Arg::Ptr(xs),
            Arg::U32(n as u32),
            Arg::Ptr(outs[5]),
            Arg::Ptr(outs[6]),
            Arg::Ptr(outs[7]),
        ];
        let qkv_dims = match tensor_cores {
            true => {
                let ctas = q_rows.div_ceil(64) + 2 * kv_rows.div_ceil(64);
                LaunchDims::grid2(ctas as u32, (n as u32).div_ceil(64), 128)
            }
            false => dims(q_rows + 2 * kv_rows),
        };
        dev.launch(qkv, qkv_dims, &args).expect("qkv");
        let ((gh, gq), (uh, uq)) = (tiles[3], tiles[4]);
        let args = [
            Arg::Ptr(gh),
            Arg::Ptr(gq),
            Arg::Ptr(uh),
            Arg::Ptr(uq),
            Arg::U32(ffn_rows as u32),
            Arg::U32(cols as u32),
            Arg::Ptr(xq),
            Arg::Ptr(xs),
            Arg::U32(n as u32),
            Arg::Ptr(outs[8]),
        ];
        let swiglu_dims = match tensor_cores {
            true => LaunchDims::grid2((ffn_rows as u32).div_ceil(32), (n as u32).div_ceil(64), 128),
            false => dims(ffn_rows),
        };
        dev.launch(swiglu, swiglu_dims, &args).expect("swiglu");
        let mut get = |p: DevicePtr, rows: usize| {
            let mut v = vec![0.0f32; n * rows];
            dev.download(p, bytes_of_mut(&mut v)).expect("download");
            v
        };
        let what = format!("{} / {}, batch {n}", qkv.name(), swiglu.name());
        for (alone, fused, rows) in [(0, 5, q_rows), (1, 6, kv_rows), (2, 7, kv_rows)] {
            let (a, f) = (get(outs[alone], rows), get(outs[fused], rows));
            assert!(
                a.iter().zip(&f).all(|(x, y)| x.to_bits() == y.to_bits()),
                "{what}: matrix {alone} differs fused"
            );
        }
        let (g, u, got) = (
            get(outs[3], ffn_rows),
            get(outs[4], ffn_rows),
            get(outs[8], ffn_rows),
        );
        let want: Vec<f32> = g
            .iter()
            .zip(&u)
            .map(|(&g, &u)| g / (1.0 + (-g).exp()) * u)
            .collect();
        close(&got, &want, 1e-6, &what);
    }
}

/// The shim's warp collectives: a butterfly sum gives every lane the warp's total, a shuffle
/// down reads the lane below's value, and a warp whose lanes do not all reach a collective is
/// reported (as a divergent barrier is).
#[test]
fn the_shim_runs_warp_shuffles_and_reports_a_divergent_one() {
    for seed in SEEDS {
        let got = cuda_shim::control_warp_sum(seed).expect("launch");
        // 64 threads: warp 0 holds 0..32, warp 1 32..64.
        let want: Vec<u32> = (0..64)
            .map(|t: u32| {
                if t < 32 {
                    (0..32).sum()
                } else {
                    (32..64).sum()
                }
            })
            .collect();
        assert_eq!(got.sum, want, "seed {seed:#x}");
        let down: Vec<u32> = (0..64)
            .map(|t: u32| if t % 32 + 1 < 32 { t + 1 } else { t })
            .collect();
        assert_eq!(got.down, down, "seed {seed:#x}");
    }
    let e = cuda_shim::control_warp_divergent().expect_err("a divergent collective");
    assert!(e.0.contains("divergent warp collective"), "{e}");
}

/// The fused residual add and RMSNorm is the add then `custody_rms_norm`, bit for bit (the same
/// arithmetic in the same order), with `x` left holding the sum, under every schedule.
#[test]
fn the_fused_residual_norm_is_the_add_then_the_norm_bit_for_bit() {
    use custody_cuda::device::{bytes_of, bytes_of_mut};
    use custody_cuda::{Arg, Device, Kernel, LaunchDims};
    let mut rng = Rng(5150);
    let (rows, dim, eps) = (3usize, 576usize, 1e-5f32);
    let x: Vec<f32> = (0..rows * dim).map(|_| 4.0 * rng.unit()).collect();
    let y: Vec<f32> = (0..rows * dim).map(|_| rng.unit()).collect();
    let w: Vec<f32> = (0..dim).map(|_| 1.0 + rng.unit()).collect();
    let sum: Vec<f32> = x.iter().zip(&y).map(|(a, b)| a + b).collect();
    let mut want = vec![f32::NAN; rows * dim];
    cuda_shim::rms_norm(&sum, &w, eps, &mut want, 0).expect("rms_norm");
    for seed in SEEDS {
        let mut dev = cuda_shim::ShimDevice::new(seed);
        let mut put = |b: &[u8]| {
            let p = dev.alloc_zeroed(b.len()).expect("alloc");
            dev.upload(p, b).expect("upload");
            p
        };
        let (xp, yp, wp) = (put(bytes_of(&x)), put(bytes_of(&y)), put(bytes_of(&w)));
        let op = put(bytes_of(&vec![f32::NAN; rows * dim]));
        let args = [
            Arg::Ptr(xp),
            Arg::Ptr(yp),
            Arg::Ptr(wp),
            Arg::F32(eps),
            Arg::U32(dim as u32),
            Arg::Ptr(op),
            // No quantized copy.
            Arg::Ptr(custody_cuda::DevicePtr(0)),
            Arg::Ptr(custody_cuda::DevicePtr(0)),
        ];
        dev.launch(
            Kernel::AddRmsNorm,
            LaunchDims::grid2(rows as u32, 1, 128),
            &args,
        )
        .expect("launch");
        let (mut got, mut got_x) = (vec![0.0f32; rows * dim], vec![0.0f32; rows * dim]);
        dev.download(op, bytes_of_mut(&mut got)).expect("download");
        dev.download(xp, bytes_of_mut(&mut got_x))
            .expect("download");
        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&got), bits(&want), "seed {seed:#x}: the norm");
        assert_eq!(bits(&got_x), bits(&sum), "seed {seed:#x}: the residual");
    }
}

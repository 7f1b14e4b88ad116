//! The CUDA kernels' execution tier: `kernels/cuda/*.cu` run on the CPU through the project's
//! CUDA-on-CPU shim (`custody_tests::cuda_shim`) against the CPU kernels on random inputs —
//! bit-exact for the checksum and the tag check's verdicts, a stated tolerance for attention's
//! floats — under three schedule seeds each (any difference between seeds is a race), outputs
//! poisoned before each run. The shim's own controls: a racy kernel differs across seeds, a
//! barrier only some threads reach is reported.

use custody_kernels::attention::{
    AttentionArgs, AttnScratch, IntegrityError, PageGeometry, PageRef, ReduceOrder, TagCheck,
    TagView, check_tags, paged_attention,
};
use custody_tests::cuda_shim::{self, AttentionShape, OwnedTags, Request, Verdict};
use half::f16;

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
        reqs.push(Request {
            table,
            n_ctx,
            owner,
        });
    }
    // Faults on every other request, one kind each, at a random page of its table.
    for (k, r) in reqs.iter_mut().enumerate().filter(|(k, _)| k % 2 == 1) {
        let i = rng.below(r.table.len() as u64) as usize;
        let p = r.table[i].page as usize;
        match (k / 2) % 6 {
            0 => tags.generation[p] += 1, // stale: the page was reused
            1 => tags.owner[p] = 999,     // foreign
            2 => tags.filled[p] = tags.filled[p].saturating_sub(1), // unwritten slot
            3 => tags.stamp_generation[p] += 7, // a late write's stamp
            4 => r.table[i].page = n_pages + 3, // outside the pool
            _ => {
                r.table.pop(); // too short for its context
            }
        }
    }
    (tags, reqs)
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
    check_tags(&table, r.n_ctx as usize, page_size as usize, &view, r.owner)
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
        let table: Vec<PageRef> = r
            .table
            .iter()
            .map(|p| PageRef {
                page: p.page,
                generation: p.generation,
            })
            .collect();
        let args = AttentionArgs {
            q: &q[i * row..(i + 1) * row],
            n_heads: shape.n_heads as usize,
            start_pos: r.n_ctx as usize - 1,
            k_cache: &k,
            v_cache: &v,
            geom,
            block_table: &table,
            tags: TagView {
                generation: &tags.generation,
                owner: &tags.owner,
                filled: &tags.filled,
                stamp_owner: &tags.stamp_owner,
                stamp_generation: &tags.stamp_generation,
            },
            owner: r.owner,
            order: ReduceOrder::Vec,
            check: TagCheck::Enforced,
        };
        let res = paged_attention(
            &args,
            &mut want[i * row..(i + 1) * row],
            &mut AttnScratch::default(),
        );
        verdicts.push(cpu_verdict(res));
    }
    assert!(verdicts.iter().any(|v| v.code == 0) && verdicts.iter().any(|v| v.code != 0));
    // Poisoned output: a refused request's rows must keep the poison, bit for bit.
    const POISON: u32 = 0x7fc0_dead;
    let mut first: Option<Vec<f32>> = None;
    for seed in SEEDS {
        let mut out = vec![f32::from_bits(POISON); q.len()];
        let got =
            cuda_shim::paged_attention_decode(&q, &kb, &vb, &reqs, shape, &tags, &mut out, seed)
                .expect("launch");
        assert_eq!(got, verdicts, "seed {seed:#x}: verdicts");
        for (i, vd) in verdicts.iter().enumerate() {
            let (g, w) = (&out[i * row..(i + 1) * row], &want[i * row..(i + 1) * row]);
            if vd.code != 0 {
                assert!(
                    g.iter().all(|x| x.to_bits() == POISON),
                    "request {i}: refused but written"
                );
                continue;
            }
            // Tolerance: f32 math in another summation order than the CPU's f16-rounded query
            // and 16-lane chains; outputs are convex combinations of values in [-1, 1].
            let worst = g
                .iter()
                .zip(w)
                .map(|(a, b)| (a - b).abs())
                .fold(0.0f32, f32::max);
            assert!(worst < 2e-3, "request {i}: max |Δ| {worst}");
        }
        // Deterministic across schedules (no race): bit-identical outputs for every seed.
        match &first {
            None => first = Some(out),
            Some(f) => assert!(
                f.iter().zip(&out).all(|(a, b)| a.to_bits() == b.to_bits()),
                "seed {seed:#x}: output differs from seed 0's — a race"
            ),
        }
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

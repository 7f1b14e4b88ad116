//! Decode attention at depth, the kernel alone: one query row of the 1B shape (32 heads over 8
//! kv heads of 64) attending `n_ctx` slots in each of 16 layers' caches (distinct memory, so
//! K and V stream from DRAM as in a real step), pages in a scattered order. Prints the best of
//! 20 steps: µs per layer, ms per step, and the K/V bytes' effective read rate.
//!
//! `cargo run --release -p custody-kernels --example decode_attention -- [n_ctx] [threads]
//! [f16|q8_0]` (defaults 8192, 2, f16; BENCHMARKS.md, "decode attention at depth").
use custody_kernels::attention::{
    AttentionArgs, AttnScratch, KvType, PageGeometry, PageRef, Reader, ReduceOrder, TagCheck,
    TagView, paged_attention, write_kv_slot,
};

const LAYERS: usize = 16;
const STEPS: usize = 20;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let n_ctx: usize = args.get(1).map_or(8192, |s| s.parse().expect("n_ctx"));
    let threads: usize = args.get(2).map_or(2, |s| s.parse().expect("threads"));
    let kv = KvType::from_name(args.get(3).map_or("f16", String::as_str)).expect("f16 or q8_0");
    let (n_heads, n_kv, d) = (32, 8, 64);
    let geom = PageGeometry {
        page_size: 16,
        n_kv_heads: n_kv,
        head_dim: d,
        kv,
    };
    let n_pages = n_ctx.div_ceil(16) + 8;
    let mut seed = 1u64;
    let mut rnd = || {
        seed = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(7);
        ((seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    };
    let caches: Vec<(Vec<u16>, Vec<u16>)> = (0..LAYERS)
        .map(|_| {
            let mut k = vec![0u16; n_pages * geom.page_words()];
            let mut v = vec![0u16; n_pages * geom.page_words()];
            for p in 0..n_pages {
                for slot in 0..16 {
                    let row: Vec<f32> = (0..n_kv * d).map(|_| rnd()).collect();
                    write_kv_slot(&mut k, &mut v, geom, p, slot, &row, &row);
                }
            }
            (k, v)
        })
        .collect();
    let table: Vec<PageRef> = (0..n_pages as u32)
        .map(|i| PageRef {
            page: (i * 7919) % n_pages as u32,
            generation: 1,
        })
        .collect();
    let (gens, owners) = (vec![1u32; n_pages], vec![5u64; n_pages]);
    let filled = vec![16u32; n_pages];
    let q: Vec<f32> = (0..n_heads * d).map(|_| rnd()).collect();
    let pool = custody_kernels::par::ThreadPool::new(threads).expect("pool");
    let (mut out, mut scratch) = (vec![0.0f32; n_heads * d], AttnScratch::default());
    let mut best = f64::MAX;
    pool.install(|| {
        for _ in 0..STEPS {
            let t0 = std::time::Instant::now();
            for (k, v) in &caches {
                let args = AttentionArgs {
                    q: &q,
                    n_heads,
                    start_pos: n_ctx - 1,
                    k_cache: k,
                    v_cache: v,
                    geom,
                    block_table: &table,
                    tags: TagView {
                        generation: &gens,
                        owner: &owners,
                        filled: &filled,
                        stamp_owner: &owners,
                        stamp_generation: &gens,
                    },
                    reader: Reader::private(5),
                    order: ReduceOrder::Vec,
                    check: TagCheck::Enforced,
                };
                paged_attention(&args, &mut out, &mut scratch).expect("tags are valid");
            }
            best = best.min(t0.elapsed().as_secs_f64());
        }
    });
    let bytes = (2 * LAYERS * n_ctx * n_kv * geom.row_words() * 2) as f64;
    println!(
        "{} n_ctx {n_ctx} threads {threads}: {:.0} µs/layer, {:.2} ms/step, {:.1} GB/s of K/V",
        kv.name(),
        best / LAYERS as f64 * 1e6,
        best * 1e3,
        bytes / best / 1e9
    );
}

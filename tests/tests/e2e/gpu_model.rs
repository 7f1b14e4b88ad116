//! The CUDA engine's counted performance model (`custody_tests::gpu_model`) on a small shape,
//! so that a regression in what the kernels move fails here: a decode step of the real forward
//! pass on the counting shim moves at most 1.15× the ideal bytes (weights once, K/V once), its
//! hot kernels (the Q4_K GEMV, flash decoding) are ≥ 90 % coalesced, every kernel it launches is
//! counted (a kernel whose accesses bypass `CUSTODY_LD`/`CUSTODY_ST` would show as moving
//! nothing), and the step is one graph launch of the host whose nodes are every kernel of the
//! forward pass (the model prices the launch at 4 µs, each node at 1 µs). The served shapes'
//! figures: `cargo run -p custody-tests --example gpu_model` (BENCHMARKS.md).

use custody_cuda::Kernel;
use custody_tests::gpu_model::{self, Shape};

/// A small Llama-shaped model: widths that fill whole Q4_K tile groups, GQA 4 heads per KV head.
const SMALL: Shape = Shape {
    name: "small",
    n_layers: 4,
    dim: 1024,
    ffn_dim: 2048,
    n_heads: 16,
    n_kv_heads: 4,
    vocab: 4096,
};

#[test]
fn a_counted_decode_step_moves_the_ideal_bytes_coalesced() {
    // Batch 16 (the tensor-core products) over the served context BENCHMARKS.md uses: 16 rows
    // over 300 slots of this 1,024-wide model are a step whose activations (each product's f32
    // outputs, the norms) are 15 % of its weights and K/V — unlike a served shape's.
    for (batch, ctx) in [(1, 300), (3, 300), (16, 1024)] {
        let m = gpu_model::decode_step(SMALL, batch, ctx, 1024).expect("counted step");
        eprintln!("{}", gpu_model::render(&m));
        let ratio = m.dram_bytes() / m.ideal_bytes;
        assert!(
            ratio <= 1.15,
            "batch {batch}: moves {ratio:.3}× the ideal bytes"
        );
        // One row multiplies f32 x; more, int8 x (quantized by its producers) with dp4a, and
        // from MMQ_MIN_ROWS on integer tensor cores, each matrix a launch of its own.
        use custody_runtime::cuda_forward::{MMQ_MIN_ROWS, Q8_MIN_ROWS};
        let int8 = batch >= Q8_MIN_ROWS;
        let mmq = batch >= MMQ_MIN_ROWS;
        let products = match (int8, mmq) {
            (_, true) => vec![Kernel::MmqQ4K, Kernel::MmqQ4KSwiglu, Kernel::MmqQ4KQkv],
            (true, false) => vec![
                Kernel::GemvQ4KQ8,
                Kernel::GemvQ4KQ8Swiglu,
                Kernel::GemvQ4KQ8Qkv,
            ],
            _ => vec![Kernel::GemvQ4K, Kernel::GemvQ4KSwiglu, Kernel::GemvQ4KQkv],
        };
        for hot in products.into_iter().chain([Kernel::FlashDecode]) {
            let l = m
                .lines
                .iter()
                .find(|l| l.kernel == hot)
                .unwrap_or_else(|| panic!("{hot:?} not launched"));
            assert!(
                l.coalescing() >= 0.9,
                "batch {batch}: {hot:?} {:.1} % coalesced",
                100.0 * l.coalescing()
            );
        }
        for l in &m.lines {
            assert!(
                l.dram_bytes > 0.0,
                "batch {batch}: {:?} counted as moving nothing (an access not through CUSTODY_LD/ST)",
                l.kernel
            );
        }
        // Per layer: 2 norms fused with the residual adds, Q, K and V in one, RoPE fused with
        // the KV write, flash decoding (merged by its last split), O, gate and up fused with the
        // SwiGLU, down (8; with int8 x, the SwiGLU's output quantized before down: 9); then the
        // tag sync, the embedding, the first norm and the head — all nodes of one graph the host
        // launches once.
        let per_layer = if int8 { 9 } else { 8 };
        assert_eq!(
            m.launches(),
            (per_layer * SMALL.n_layers + 4) as f64,
            "batch {batch}"
        );
        assert_eq!(m.graph_nodes(), m.launches(), "batch {batch}");
        assert_eq!(m.host_launches(), 1.0, "batch {batch}: one graph per step");
        // Back per step: each row's logits whole, as wide as the model's vocabulary, and one
        // 24-byte verdict per row and layer.
        assert_eq!(
            m.device_to_host_bytes,
            (batch * SMALL.vocab * 4 + SMALL.n_layers * batch * 24) as f64,
            "batch {batch}: bytes back per step"
        );
        // The tags cross once per step, and only the changed pages' (one per row here: its
        // last page), never the pool's: the bytes the tag sync writes on the device.
        let per_row_tags = (8 + 8 + 4 + 4 + 4 + 4 * SMALL.n_layers) as f64;
        assert!(
            m.tag_bytes > 0.0 && m.tag_bytes <= batch as f64 * per_row_tags,
            "batch {batch}: {} B of tags uploaded",
            m.tag_bytes
        );
    }
}

/// `custody gpu-check speed`'s measurement (`custody_engine::cuda_speed`) on the shim at a tiny
/// shape: weights made on the device, decode at two batch sizes over a written context, a
/// prefill — every row passing its tag check — with decode steps replayed as graphs and the
/// prefill run kernel by kernel through the prefill kernel; and a model
/// made on the device gives finite logits that depend on the token.
#[test]
fn the_speed_check_runs_on_weights_made_on_the_device() {
    use custody_kernels::attention::{KvType, PageGeometry, Reader, ReduceOrder, TagCheck};
    use custody_runtime::cuda_forward::CudaForward;
    use custody_runtime::cuda_speed::{self, SpeedPlan};
    use custody_runtime::kv::PagePool;
    use custody_runtime::model::{Logits, Rows, Segment};
    use custody_tests::cuda_shim::ShimDevice;

    let tiny = Shape {
        name: "tiny",
        n_layers: 2,
        dim: 256,
        ffn_dim: 512,
        n_heads: 4,
        n_kv_heads: 2,
        vocab: 512,
    };
    let plan = SpeedPlan {
        batches: vec![1, 3],
        ctx: 40,
        warmup: 1,
        steps: 2,
        prefill_tokens: 24,
    };
    let s = cuda_speed::measure(ShimDevice::new(0), tiny, &plan, 5).expect("measured");
    assert_eq!(s.decode.len(), 2);
    for d in &s.decode {
        assert!(d.tok_s.is_finite() && d.tok_s > 0.0, "{d:?}");
    }
    assert!(s.prefill_tok_s.is_finite() && s.prefill_tok_s > 0.0);
    // Batch 1 and batch 3 (padded to 4) — 3 pages of context, rounded up to 4, throughout; the
    // 24-row prefill runs kernel by kernel (its prompt through the prefill kernel).
    assert_eq!(s.graphs_held, 2);
    let table = cuda_speed::render(&s, Some(&s));
    assert!(table.contains("| 3 | 40 |"), "{table}");

    let geom = PageGeometry {
        page_size: 16,
        n_kv_heads: 2,
        head_dim: 64,
        kv: KvType::F16,
    };
    let mut pool = PagePool::new(geom, tiny.n_layers, 4);
    let mut fwd = CudaForward::synthetic(ShimDevice::new(0), tiny.config(64), &pool, 4, 9, true)
        .expect("made on the device");
    let pages = pool.alloc(1, 1).expect("alloc");
    let tokens = [3u32, 300];
    let seg = Segment {
        tokens: &tokens,
        start_pos: 0,
        block_table: &pages,
        reader: Reader::private(1),
        logits: Logits::All,
        order: ReduceOrder::Gemm,
        rows: Rows::Prompt { len: 2, chunk: 2 },
        check: TagCheck::Enforced,
    };
    let out = fwd.forward(&mut pool, &[seg]).expect("forward");
    let l = out[0].as_ref().expect("passes its check");
    assert_eq!(l.len(), 2 * tiny.vocab);
    assert!(l.iter().all(|x| x.is_finite()), "non-finite logits");
    let (a, b) = l.split_at(tiny.vocab);
    assert!(a != b, "both tokens gave the same logits");
    assert!(a.iter().any(|&x| x != a[0]), "constant logits");
}

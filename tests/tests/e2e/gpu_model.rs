//! The CUDA engine's counted performance model (`custody_tests::gpu_model`) on a small shape,
//! so that a regression in what the kernels move fails here: a decode step of the real forward
//! pass on the counting shim moves at most 1.15× the ideal bytes (weights once, K/V once), its
//! hot kernels (the Q4_K GEMV, flash decoding) are ≥ 90 % coalesced, every kernel it launches is
//! counted (a kernel whose accesses bypass `CUSTODY_LD`/`CUSTODY_ST` would show as moving
//! nothing), and the step's launch count is the forward pass's (one per kernel: no CUDA graph
//! yet — the model prices each at 4 µs). The served shapes' figures: `cargo run -p custody-tests
//! --example gpu_model` (BENCHMARKS.md).

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
    for batch in [1, 3] {
        let m = gpu_model::decode_step(SMALL, batch, 300, 1024).expect("counted step");
        eprintln!("{}", gpu_model::render(&m));
        let ratio = m.dram_bytes() / m.ideal_bytes;
        assert!(
            ratio <= 1.15,
            "batch {batch}: moves {ratio:.3}× the ideal bytes"
        );
        for hot in [Kernel::GemvQ4K, Kernel::FlashDecode] {
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
        // Per layer: 2 norms fused with the residual adds, 7 products, 2 RoPE, the KV write,
        // decode and merge, the SwiGLU (15); then the tag sync, the embedding, the first norm
        // and the head — all nodes of one graph the host launches once.
        assert_eq!(
            m.launches(),
            (15 * SMALL.n_layers + 4) as f64,
            "batch {batch}"
        );
        assert_eq!(m.graph_nodes(), m.launches(), "batch {batch}");
        assert_eq!(m.host_launches(), 1.0, "batch {batch}: one graph per step");
        // The logits come back whole, as wide as the model's vocabulary.
        assert!(
            m.device_to_host_bytes >= (batch * SMALL.vocab * 4) as f64,
            "batch {batch}: {} B back per step",
            m.device_to_host_bytes
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

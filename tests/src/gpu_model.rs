//! The CUDA engine's performance model, counted on the CPU: one decode step of the real
//! `CudaForward` (every kernel it launches, with the grids it uses) on a counting shim device
//! ([`crate::cuda_shim::ShimDevice::counting`]), for a synthetic Q4_K model at a served shape.
//!
//! One transformer layer and a small vocabulary are run; a layer's launches are repeated
//! `n_layers` times in the model and the output head's counts scaled by the vocabulary (a GEMV's
//! traffic is linear in its rows). The context's K/V exists as the pool's tags say (claimed
//! slots; the bytes are zeros: counts do not depend on values). Time on an H200 is modeled per
//! launch as max(DRAM bytes / 4.8 TB/s, FLOPs / peak) plus what starting it costs: 4 µs for a
//! launch of the host's (a kernel on its own, or a graph), 1 µs for a node of a replayed graph
//! (the gap between dependent kernels the GPU's front end leaves: NVIDIA measured ~0.5 µs per
//! node for back-to-back kernels on a V100 — developer.nvidia.com/blog/cuda-graphs — so 1 µs is
//! the pessimistic side), FLOPs counted for the GEMVs (2 per weight per row: FP32 FMA at
//! 67 TFLOP/s on f32 x, `dp4a` at 134 TOP/s on int8 x, int8 MMAs at 1,979 TOP/s) and attention (4 per slot and dimension
//! per query head, FP32). Host↔device copies per step are reported, not priced.

use crate::cuda_shim::{Counts, ShimDevice};
use custody_cuda::Kernel;
use custody_kernels::DType;
use custody_kernels::attention::{KvType, Reader, ReduceOrder, TagCheck};
use custody_runtime::cuda_forward::CudaForward;
use custody_runtime::gguf::write::Synthetic;
use custody_runtime::kv::PagePool;
use custody_runtime::model::{Logits, Rows, Segment};

/// H200 SXM: HBM3e bandwidth, FP32 CUDA-core peak, and a kernel launch without a CUDA graph.
pub const HBM_BYTES_PER_S: f64 = 4.8e12;
pub const FP32_FLOPS_PER_S: f64 = 67e12;
/// `dp4a` on the same SMs: 64 per clock per SM (the CUDA guide's 32-bit integer multiply-add
/// rate for compute capability 9.0), 4 multiply-adds each — 132 SMs × 1.98 GHz × 64 × 8 ops.
/// Only the arithmetic is priced: the int-to-float conversions and the scales' loads the kernel
/// also issues per dp4a pair are not (a GPU run measures them).
pub const DP4A_OPS_PER_S: f64 = 134e12;
/// The integer tensor cores' dense INT8 peak (NVIDIA's H200 datasheet: 3,958 TOPS with
/// sparsity, half without), for `custody_mmq_q4k`'s MMAs.
pub const INT8_TENSOR_OPS_PER_S: f64 = 1979e12;
pub const LAUNCH_S: f64 = 4e-6;
/// A kernel run as a node of a replayed graph.
pub const GRAPH_NODE_S: f64 = 1e-6;
const PAGE_SIZE: usize = 16;
/// Q4_K: 144 bytes per 256 weights.
const Q4K_BYTES_PER_WEIGHT: f64 = 144.0 / 256.0;

/// The shapes measured (shared with `custody gpu-check speed`).
pub use custody_runtime::cuda_speed::{LLAMA_3_1_8B, LLAMA_3_2_1B, ServedShape as Shape};

/// One kernel's share of a decode step, scaled to the whole model.
#[derive(Clone, Debug)]
pub struct KernelLine {
    pub kernel: Kernel,
    /// Runs per step (on their own or as graph nodes).
    pub launches: f64,
    /// Of those, the runs the host launched itself (not a graph's nodes).
    pub host_launches: f64,
    pub dram_bytes: f64,
    pub sectors: f64,
    pub ideal_sectors: f64,
    pub flops: f64,
    pub modeled_s: f64,
}

impl KernelLine {
    pub fn coalescing(&self) -> f64 {
        if self.sectors == 0.0 {
            0.0
        } else {
            self.ideal_sectors / self.sectors
        }
    }
}

/// A decode step of `batch` rows at context `ctx`, modeled.
#[derive(Clone, Debug)]
pub struct StepModel {
    pub shape: Shape,
    pub batch: usize,
    pub ctx: usize,
    pub lines: Vec<KernelLine>,
    /// Weights once (Q4_K) plus every row's K and V read once (f16).
    pub ideal_bytes: f64,
    pub host_to_device_bytes: f64,
    pub device_to_host_bytes: f64,
    /// The changed tags the step wrote into the device's copy (one packed upload per step).
    pub tag_bytes: f64,
    /// Graphs the host launched in the step.
    pub graph_launches: f64,
}

impl StepModel {
    pub fn dram_bytes(&self) -> f64 {
        self.lines.iter().map(|l| l.dram_bytes).sum()
    }
    /// Kernel runs per step.
    pub fn launches(&self) -> f64 {
        self.lines.iter().map(|l| l.launches).sum()
    }
    /// What the host launches per step: graphs and the kernels run on their own.
    pub fn host_launches(&self) -> f64 {
        self.graph_launches + self.lines.iter().map(|l| l.host_launches).sum::<f64>()
    }
    /// Kernel runs that were graph nodes.
    pub fn graph_nodes(&self) -> f64 {
        self.lines
            .iter()
            .map(|l| l.launches - l.host_launches)
            .sum()
    }
    pub fn modeled_s(&self) -> f64 {
        self.graph_launches * LAUNCH_S + self.lines.iter().map(|l| l.modeled_s).sum::<f64>()
    }
    /// The modeled time without any launch cost (host launches and graph nodes).
    pub fn modeled_kernels_s(&self) -> f64 {
        self.modeled_s() - self.host_launches() * LAUNCH_S - self.graph_nodes() * GRAPH_NODE_S
    }
    /// The bandwidth limit: the ideal bytes at HBM speed.
    pub fn bound_s(&self) -> f64 {
        self.ideal_bytes / HBM_BYTES_PER_S
    }
}

/// Why a model run failed.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("synthetic model: {0}")]
    Load(String),
    #[error(transparent)]
    Forward(#[from] custody_runtime::cuda_forward::CudaForwardError),
    #[error(transparent)]
    Device(#[from] custody_cuda::DeviceError),
    #[error("pool: {0}")]
    Pool(String),
    #[error("row {row} failed its tag check: {why}")]
    Integrity { row: usize, why: String },
}

/// Count one decode step of `shape` at `batch` rows, each at context `ctx`, running one layer
/// and `counted_vocab` output rows.
pub fn decode_step(
    shape: Shape,
    batch: usize,
    ctx: usize,
    counted_vocab: usize,
) -> Result<StepModel, ModelError> {
    let synth = Synthetic {
        n_layers: 1,
        dim: shape.dim,
        ffn_dim: shape.ffn_dim,
        n_heads: shape.n_heads,
        n_kv_heads: shape.n_kv_heads,
        vocab: counted_vocab,
        context_length: ctx + 1,
        dtype: DType::Q4_K,
        untied_output: true,
        seed: 1,
    };
    let m =
        custody_runtime::cuda_check::load(&synth).map_err(|e| ModelError::Load(e.to_string()))?;
    let pages_per_row = (ctx + 1).div_ceil(PAGE_SIZE);
    let mut pool = PagePool::new(
        m.page_geometry(PAGE_SIZE, KvType::F16),
        1,
        batch * pages_per_row,
    );
    let mut tables = Vec::with_capacity(batch);
    for b in 0..batch {
        let owner = 1 + b as u64;
        let pages = pool
            .alloc(owner, pages_per_row)
            .map_err(|e| ModelError::Pool(e.to_string()))?;
        for pos in 0..ctx {
            pool.claim_slot_checked(
                0,
                pages[pos / PAGE_SIZE],
                pos % PAGE_SIZE,
                owner,
                TagCheck::Enforced,
            )
            .map_err(|e| ModelError::Pool(e.to_string()))?;
        }
        tables.push((owner, pages));
    }
    let mut fwd = CudaForward::new_without_gemm(ShimDevice::counting(0), &m, &pool, batch)?;
    fwd.set_tag_audit(false); // a debug build's whole-copy check is not a step's traffic
    // The context's tags reach the device before the counted step (as the steps that wrote
    // them would have sent them); the weights' upload is not the step's either.
    fwd.sync_tags(&mut pool)?;
    fwd.device_mut().take_counts();
    fwd.device_mut().transfers.clear();
    let graphs_before = fwd.device_mut().graph_launches();
    let token = [1u32];
    let segments: Vec<Segment<'_>> = tables
        .iter()
        .map(|(owner, pages)| Segment {
            tokens: &token,
            start_pos: ctx,
            block_table: pages,
            reader: Reader::private(*owner),
            logits: Logits::Last,
            order: ReduceOrder::Vec,
            rows: Rows::Decode,
            check: TagCheck::Enforced,
        })
        .collect();
    let results = fwd.forward(&mut pool, &segments)?;
    for (row, r) in results.iter().enumerate() {
        if let Err(e) = r {
            return Err(ModelError::Integrity {
                row,
                why: e.to_string(),
            });
        }
    }
    let dev = fwd.device_mut();
    let graph_launches = (dev.graph_launches() - graphs_before) as f64;
    let launches = dev.take_counts();
    let tag_bytes = launches
        .iter()
        .filter(|l| l.kernel == Kernel::TagApply)
        .map(|l| l.counts.store_bytes as f64)
        .sum();
    let n = launches.len();
    // The step's launches in order: the tag sync, the embedding and the first norm (once), one
    // layer's (repeated `n_layers` times), the head (once).
    let in_layer = |i: usize| i >= 3 && i + 1 < n;
    let scale_of = |i: usize| {
        if in_layer(i) {
            shape.n_layers as f64
        } else {
            1.0
        }
    };
    // The step's copies (`CudaForward::forward`'s order): its inputs up, the last of them the
    // poisoned verdicts (one per row and layer); then, after the graph, the verdicts down (one
    // per row and layer) and each row's logits (as wide as the real vocabulary). No copy falls
    // between two launches (`e2e::gpu_model` asserts the totals).
    let (mut up, mut down) = (0.0f64, 0.0f64);
    let last_up = dev.transfers.iter().rposition(|t| t.to_device);
    let first_down = dev.transfers.iter().position(|t| !t.to_device);
    for (i, t) in dev.transfers.iter().enumerate() {
        let scale = if Some(i) == last_up || Some(i) == first_down {
            shape.n_layers as f64
        } else if t.to_device {
            1.0
        } else {
            shape.vocab as f64 / counted_vocab as f64
        };
        let bytes = t.bytes as f64 * scale;
        if t.to_device {
            up += bytes;
        } else {
            down += bytes;
        }
    }
    let mut lines: Vec<KernelLine> = Vec::new();
    let mut products = layer_products(&shape).into_iter();
    for (i, l) in launches.iter().enumerate() {
        let head = i == n - 1;
        let scale = if head {
            shape.vocab as f64 / counted_vocab as f64
        } else {
            scale_of(i)
        };
        // A product's weights: the head's counted rows, else the layer's next product's.
        let weights = match l.kernel {
            _ if head => (shape.dim * counted_vocab) as f64,
            k if is_product(k) => products.next().unwrap_or(0.0),
            _ => 0.0,
        };
        let flops = flops_of(l.kernel, &shape, batch, ctx, weights);
        // The head's traffic scales with the vocabulary; it is still one launch.
        add_line(
            &mut lines,
            Run {
                kernel: l.kernel,
                in_graph: l.in_graph,
                launches: scale_of(i),
                scale,
            },
            &l.counts,
            flops * scale,
        );
    }
    let kv_bytes =
        (batch * ctx * shape.n_kv_heads * shape.head_dim() * 2 * 2 * shape.n_layers) as f64;
    let weights = shape.layer_weights() * shape.n_layers as f64 + shape.head_weights();
    Ok(StepModel {
        shape,
        batch,
        ctx,
        lines,
        ideal_bytes: weights * Q4K_BYTES_PER_WEIGHT + kv_bytes,
        host_to_device_bytes: up,
        device_to_host_bytes: down,
        tag_bytes,
        graph_launches,
    })
}

/// The weights of a layer's product launches, in the forward pass's order: Q, K and V (one
/// launch), O, gate and up (one launch), down.
fn layer_products(s: &Shape) -> Vec<f64> {
    let (d, kv, f) = (s.dim, s.n_kv_heads * s.head_dim(), s.ffn_dim);
    let w = vec![d * d + 2 * kv * d, d * d, 2 * f * d, d * f];
    debug_assert_eq!(w.iter().sum::<usize>() as f64, s.layer_weights());
    w.into_iter().map(|x| x as f64).collect()
}

/// The Q4_K product kernels, on f32 x and on int8 x.
fn is_product(k: Kernel) -> bool {
    matches!(
        k,
        Kernel::GemvQ4K
            | Kernel::GemvQ4KSwiglu
            | Kernel::GemvQ4KQkv
            | Kernel::GemvQ4KQ8
            | Kernel::GemvQ4KQ8Swiglu
            | Kernel::GemvQ4KQ8Qkv
            | Kernel::MmqQ4K
            | Kernel::MmqQ4KQkv
            | Kernel::MmqQ4KSwiglu
    )
}

/// FLOPs of one launch: a product's 2 per weight per row, attention's 4 per slot and dimension
/// per query head (the row kernels' are negligible).
fn flops_of(k: Kernel, s: &Shape, batch: usize, ctx: usize, weights: f64) -> f64 {
    match k {
        k if is_product(k) => 2.0 * weights * batch as f64,
        Kernel::FlashDecode => 4.0 * (ctx * s.head_dim() * s.n_heads * batch) as f64,
        _ => 0.0,
    }
}

/// The arithmetic rate a kernel's FLOPs run at: dp4a for the products on int8 x, FP32 FMA else.
fn peak_of(k: Kernel) -> f64 {
    match k {
        Kernel::GemvQ4KQ8 | Kernel::GemvQ4KQ8Swiglu | Kernel::GemvQ4KQ8Qkv => DP4A_OPS_PER_S,
        Kernel::MmqQ4K | Kernel::MmqQ4KQkv | Kernel::MmqQ4KSwiglu => INT8_TENSOR_OPS_PER_S,
        _ => FP32_FLOPS_PER_S,
    }
}

/// One counted launch as the model weighs it: the runs it stands for (a layer's, once per
/// layer) and the factor its traffic scales by.
struct Run {
    kernel: Kernel,
    in_graph: bool,
    launches: f64,
    scale: f64,
}

fn add_line(lines: &mut Vec<KernelLine>, run: Run, c: &Counts, flops: f64) {
    let Run {
        kernel,
        in_graph,
        launches,
        scale,
    } = run;
    let dram = c.dram_bytes() as f64 * scale;
    let start_s = if in_graph { GRAPH_NODE_S } else { LAUNCH_S };
    let modeled = launches * start_s + (dram / HBM_BYTES_PER_S).max(flops / peak_of(kernel));
    let host_launches = if in_graph { 0.0 } else { launches };
    let line = KernelLine {
        kernel,
        launches,
        host_launches,
        dram_bytes: dram,
        sectors: c.sectors as f64 * scale,
        ideal_sectors: c.ideal_sectors as f64 * scale,
        flops,
        modeled_s: modeled,
    };
    match lines.iter_mut().find(|l| l.kernel == kernel) {
        Some(l) => {
            l.launches += line.launches;
            l.host_launches += line.host_launches;
            l.dram_bytes += line.dram_bytes;
            l.sectors += line.sectors;
            l.ideal_sectors += line.ideal_sectors;
            l.flops += line.flops;
            l.modeled_s += line.modeled_s;
        }
        None => lines.push(line),
    }
}

/// The model as a Markdown table.
pub fn render(m: &StepModel) -> String {
    let mut out = format!(
        "### {} (Q4_K, synthetic), batch {}, context {}\n\n| kernel | runs/step | DRAM MB/step | coalesced | modeled µs |\n|---|---:|---:|---:|---:|\n",
        m.shape.name, m.batch, m.ctx
    );
    for l in &m.lines {
        out.push_str(&format!(
            "| {} | {:.0} | {:.2} | {:.1} % | {:.1} |\n",
            l.kernel.name(),
            l.launches,
            l.dram_bytes / 1e6,
            100.0 * l.coalescing(),
            l.modeled_s * 1e6
        ));
    }
    let step = m.modeled_s();
    out.push_str(&format!(
        "\nbytes moved per token {:.1} MB vs ideal {:.1} MB (**{:.3}×**); host launches per step **{:.0}** ({:.0} graph, {:.0} kernel runs as its nodes); host→device {:.0} B, device→host {:.0} B per step; modeled step {:.1} µs ({:.0} tok/s), bandwidth limit {:.1} µs (**{:.2}×**); kernels alone (no launch or node cost) {:.1} µs (**{:.2}×**)\n",
        m.dram_bytes() / m.batch as f64 / 1e6,
        m.ideal_bytes / m.batch as f64 / 1e6,
        m.dram_bytes() / m.ideal_bytes,
        m.host_launches(),
        m.graph_launches,
        m.graph_nodes(),
        m.host_to_device_bytes,
        m.device_to_host_bytes,
        step * 1e6,
        m.batch as f64 / step,
        m.bound_s() * 1e6,
        step / m.bound_s(),
        m.modeled_kernels_s() * 1e6,
        m.modeled_kernels_s() / m.bound_s()
    ));
    out
}

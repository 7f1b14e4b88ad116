//! The CUDA engine's speed at served shapes — what `custody gpu-check speed` measures on a GPU
//! (`e2e::cuda_speed` runs the same code on the CUDA-on-CPU shim at a tiny shape): synthetic
//! Llama-family models of Llama-3.2-1B / Llama-3.1-8B shape with weights made on the device
//! ([`CudaForward::synthetic`]), decode steps at a batch of rows whose contexts are already
//! written (the pool's tags say so; the K/V bytes are the device's zeros: a step's time does not
//! depend on their values), and one prefill.
//!
//! # Spec
//! - A decode measurement: `warmup` steps (graph capture), then `steps` timed steps, each row
//!   one token at the next position; tok/s = rows × steps / wall time, the host's work per step
//!   (uploads, verdicts, each row's logits downloaded whole) included — what a caller of
//!   [`CudaForward::forward`] gets.
//! - A prefill measurement: one sequence of `prefill_tokens` prompt tokens in one step (the
//!   last row's logits), run twice on fresh pages, the second timed.
//! - Every row must pass its tag check (a failure is an error, never a fast step).

use std::time::Instant;

use custody_cuda::Device;
use custody_kernels::attention::{
    IntegrityError, KvType, PageGeometry, PageRef, Reader, ReduceOrder, TagCheck,
};

use crate::cuda_check::CheckError;
use crate::cuda_forward::{CudaForward, CudaForwardError};
use crate::kv::PagePool;
use crate::model::{ArchSpec, Logits, ModelConfig, Rows, Segment};

/// Page size of the measured pools (slots).
const PAGE_SIZE: usize = 16;

/// A served model's shape (Llama family, GQA).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ServedShape {
    pub name: &'static str,
    pub n_layers: usize,
    pub dim: usize,
    pub ffn_dim: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub vocab: usize,
}

/// Llama-3.2-1B's body (16 layers, 2,048 wide, 32/8 heads × 64, FFN 8,192, 128,256 tokens).
pub const LLAMA_3_2_1B: ServedShape = ServedShape {
    name: "Llama-3.2-1B",
    n_layers: 16,
    dim: 2048,
    ffn_dim: 8192,
    n_heads: 32,
    n_kv_heads: 8,
    vocab: 128_256,
};

/// Llama-3.1-8B's body (32 layers, 4,096 wide, 32/8 heads × 128, FFN 14,336, 128,256 tokens).
pub const LLAMA_3_1_8B: ServedShape = ServedShape {
    name: "Llama-3.1-8B",
    n_layers: 32,
    dim: 4096,
    ffn_dim: 14_336,
    n_heads: 32,
    n_kv_heads: 8,
    vocab: 128_256,
};

impl ServedShape {
    pub fn head_dim(&self) -> usize {
        self.dim / self.n_heads
    }

    /// Weights of one layer's products.
    pub fn layer_weights(&self) -> f64 {
        let kv = self.n_kv_heads * self.head_dim();
        (2 * self.dim * self.dim + 2 * self.dim * kv + 3 * self.dim * self.ffn_dim) as f64
    }

    /// Weights of the output head.
    pub fn head_weights(&self) -> f64 {
        (self.vocab * self.dim) as f64
    }

    /// The engine's configuration for this shape (Llama 3's RoPE base and norm epsilon).
    pub fn config(&self, context_length: usize) -> ModelConfig {
        let head_dim = self.head_dim();
        ModelConfig {
            arch: "llama".into(),
            spec: ArchSpec::find("llama").expect("llama is a built-in architecture"),
            name: format!("{} (synthetic)", self.name),
            n_layers: self.n_layers,
            dim: self.dim,
            ffn_dim: self.ffn_dim,
            n_heads: self.n_heads,
            n_kv_heads: self.n_kv_heads,
            head_dim,
            rope_dims: head_dim,
            rope_base: 500_000.0,
            rms_eps: 1e-5,
            context_length,
            vocab_size: self.vocab,
        }
    }

    fn geometry(&self) -> PageGeometry {
        PageGeometry {
            page_size: PAGE_SIZE,
            n_kv_heads: self.n_kv_heads,
            head_dim: self.head_dim(),
            kv: KvType::F16,
        }
    }
}

/// What to measure.
#[derive(Clone, Debug)]
pub struct SpeedPlan {
    pub batches: Vec<usize>,
    /// Slots already written per row when decoding starts.
    pub ctx: usize,
    pub warmup: usize,
    pub steps: usize,
    pub prefill_tokens: usize,
}

/// One decode measurement.
#[derive(Clone, Copy, Debug)]
pub struct DecodeSpeed {
    pub batch: usize,
    pub ctx: usize,
    pub steps: usize,
    pub step_ms: f64,
    pub tok_s: f64,
}

/// One shape's measurements.
#[derive(Clone, Debug)]
pub struct ShapeSpeed {
    pub shape: ServedShape,
    pub decode: Vec<DecodeSpeed>,
    pub prefill_tokens: usize,
    pub prefill_tok_s: f64,
    /// Graphs the decode steps left held (one per batch and context bucket in use).
    pub graphs_held: usize,
}

/// Measure `shape` on `dev` as `plan` says.
pub fn measure<D: Device>(
    dev: D,
    shape: ServedShape,
    plan: &SpeedPlan,
    seed: u64,
) -> Result<ShapeSpeed, CheckError> {
    let max_batch = plan.batches.iter().copied().max().unwrap_or(1);
    let row_pages = (plan.ctx + plan.warmup + plan.steps).div_ceil(PAGE_SIZE);
    let prefill_pages = plan.prefill_tokens.div_ceil(PAGE_SIZE);
    let n_pages = max_batch * row_pages + prefill_pages;
    let mut pool = PagePool::new(shape.geometry(), shape.n_layers, n_pages);
    let context_length = (plan.ctx + plan.warmup + plan.steps).max(plan.prefill_tokens);
    let max_rows = max_batch.max(plan.prefill_tokens);
    let mut fwd = CudaForward::synthetic(
        dev,
        shape.config(context_length),
        &pool,
        max_rows,
        seed,
        true,
    )?;
    // Debug builds' whole-copy comparison would be timed with the steps.
    fwd.set_tag_audit(false);
    let mut decode = Vec::with_capacity(plan.batches.len());
    for &batch in &plan.batches {
        decode.push(decode_speed(&mut fwd, &mut pool, shape, plan, batch)?);
    }
    let prefill_tok_s = prefill_speed(&mut fwd, &mut pool, shape, plan)?;
    Ok(ShapeSpeed {
        shape,
        decode,
        prefill_tokens: plan.prefill_tokens,
        prefill_tok_s,
        graphs_held: fwd.graphs_held(),
    })
}

/// A row: its owner, pages and next position.
struct Row {
    owner: u64,
    pages: Vec<PageRef>,
    pos: usize,
}

fn decode_speed<D: Device>(
    fwd: &mut CudaForward<D>,
    pool: &mut PagePool,
    shape: ServedShape,
    plan: &SpeedPlan,
    batch: usize,
) -> Result<DecodeSpeed, CheckError> {
    let row_pages = (plan.ctx + plan.warmup + plan.steps).div_ceil(PAGE_SIZE);
    let mut rows = Vec::with_capacity(batch);
    for b in 0..batch {
        let owner = 1000 + b as u64;
        let pages = pool.alloc(owner, row_pages)?;
        // The context as written: every layer's slots claimed, as the steps that wrote them
        // would have.
        for pos in 0..plan.ctx {
            for layer in 0..shape.n_layers {
                pool.claim_slot_checked(
                    layer,
                    pages[pos / PAGE_SIZE],
                    pos % PAGE_SIZE,
                    owner,
                    TagCheck::Enforced,
                )
                .map_err(|e| integrity("pool", e))?;
            }
        }
        rows.push(Row {
            owner,
            pages,
            pos: plan.ctx,
        });
    }
    fwd.sync_tags(pool).map_err(CudaForwardError::from)?;
    let tokens: Vec<[u32; 1]> = (0..batch)
        .map(|b| [(b * 7919 % shape.vocab) as u32])
        .collect();
    let mut timed = std::time::Duration::ZERO;
    for step in 0..plan.warmup + plan.steps {
        let segs: Vec<Segment<'_>> = rows
            .iter()
            .zip(&tokens)
            .map(|(r, t)| decode_segment(r, t))
            .collect();
        let t = Instant::now();
        let out = fwd.forward(pool, &segs)?;
        if step >= plan.warmup {
            timed += t.elapsed();
        }
        for r in out {
            r.map_err(|e| integrity("device", e))?;
        }
        rows.iter_mut().for_each(|r| r.pos += 1);
    }
    for r in &rows {
        pool.release(r.owner, &r.pages)?;
    }
    let secs = timed.as_secs_f64().max(1e-9);
    Ok(DecodeSpeed {
        batch,
        ctx: plan.ctx,
        steps: plan.steps,
        step_ms: 1e3 * secs / plan.steps.max(1) as f64,
        tok_s: (batch * plan.steps) as f64 / secs,
    })
}

fn integrity(backend: &'static str, e: IntegrityError) -> CheckError {
    CheckError::Integrity {
        backend,
        error: e.to_string(),
    }
}

fn decode_segment<'a>(r: &'a Row, token: &'a [u32; 1]) -> Segment<'a> {
    Segment {
        tokens: token,
        start_pos: r.pos,
        block_table: &r.pages,
        reader: Reader::private(r.owner),
        logits: Logits::Last,
        order: ReduceOrder::Vec,
        rows: Rows::Decode,
        check: TagCheck::Enforced,
    }
}

/// Prefill tokens per second: one prompt in one step, the second of two runs.
fn prefill_speed<D: Device>(
    fwd: &mut CudaForward<D>,
    pool: &mut PagePool,
    shape: ServedShape,
    plan: &SpeedPlan,
) -> Result<f64, CheckError> {
    let n = plan.prefill_tokens;
    let tokens: Vec<u32> = (0..n).map(|t| (t * 31 % shape.vocab) as u32).collect();
    let mut secs = 0.0;
    for _ in 0..2 {
        let owner = 7;
        let pages = pool.alloc(owner, n.div_ceil(PAGE_SIZE))?;
        let seg = Segment {
            tokens: &tokens,
            start_pos: 0,
            block_table: &pages,
            reader: Reader::private(owner),
            logits: Logits::Last,
            order: ReduceOrder::Gemm,
            rows: Rows::Prompt { len: n, chunk: n },
            check: TagCheck::Enforced,
        };
        let t = Instant::now();
        let out = fwd.forward(pool, &[seg])?;
        secs = t.elapsed().as_secs_f64();
        for r in out {
            r.map_err(|e| integrity("device", e))?;
        }
        pool.release(owner, &pages)?;
    }
    Ok(n as f64 / secs.max(1e-9))
}

/// Measurements as Markdown tables: decode per batch (with a second run's figures beside it,
/// e.g. the tag check compiled out), prefill.
pub fn render(on: &ShapeSpeed, off: Option<&ShapeSpeed>) -> String {
    let mut out = format!(
        "### {} (Q4_K, synthetic weights made on the device)\n\n| batch | context | decode tok/s | step ms |",
        on.shape.name
    );
    if off.is_some() {
        out.push_str(" tok/s, tag check compiled out | check's cost |");
    }
    out.push_str(if off.is_some() {
        "\n|---:|---:|---:|---:|---:|---:|\n"
    } else {
        "\n|---:|---:|---:|---:|\n"
    });
    for (i, d) in on.decode.iter().enumerate() {
        out.push_str(&format!(
            "| {} | {} | {:.1} | {:.3} |",
            d.batch, d.ctx, d.tok_s, d.step_ms
        ));
        if let Some(o) = off.and_then(|o| o.decode.get(i)) {
            out.push_str(&format!(
                " {:.1} | {:+.1} % |",
                o.tok_s,
                100.0 * (o.tok_s / d.tok_s - 1.0)
            ));
        }
        out.push('\n');
    }
    out.push_str(&format!(
        "\nprefill: {} tokens in one step, {:.0} tok/s",
        on.prefill_tokens, on.prefill_tok_s
    ));
    if let Some(o) = off {
        out.push_str(&format!(
            " ({:.0} tok/s without the check)",
            o.prefill_tok_s
        ));
    }
    out.push_str(&format!("; graphs held {}\n", on.graphs_held));
    out
}

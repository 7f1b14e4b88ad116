//! The CUDA backend checked against the CPU backend on synthetic models — what `e2e::cuda_forward`
//! asserts on the CUDA-on-CPU shim and `custody gpu-check` reports on a GPU: the same batches
//! (two sequences prefilled together, then greedy decode steps) through [`Model::forward`] and
//! [`CudaForward::forward`], logits compared.

use custody_transport::Discard;
use std::time::{Duration, Instant};

use custody_cuda::Device;
use custody_kernels::DType;
use custody_kernels::attention::{PageRef, Reader, ReduceOrder, TagCheck};

use crate::cuda_forward::{CudaForward, CudaForwardError};
use crate::gguf::write::Synthetic;
use crate::gguf::{Gguf, GgufError};
use crate::kv::{PagePool, PoolError};
use crate::model::{Logits, Model, ModelError, Rows, Scratch, Segment};

/// Page size of the check's pools.
const PAGE_SIZE: usize = 8;

#[derive(Debug, thiserror::Error)]
pub enum CheckError {
    #[error(transparent)]
    Forward(#[from] CudaForwardError),
    #[error("synthetic model: {0}")]
    Model(#[from] ModelError),
    #[error("synthetic model file: {0}")]
    File(#[from] std::io::Error),
    #[error(transparent)]
    Gguf(#[from] GgufError),
    #[error(transparent)]
    Pool(#[from] PoolError),
    #[error("a segment failed its integrity check on the {backend}: {error}")]
    Integrity {
        backend: &'static str,
        error: String,
    },
}

/// The weight types `custody gpu-check forward` compares, each on a [`Synthetic::tiny`] model.
pub const FORWARD_DTYPES: [DType; 5] = [
    DType::F32,
    DType::F16,
    DType::Q8_0,
    DType::Q4_0,
    DType::Q4_1,
];

/// `custody gpu-check speed`'s model: ~110 M weights, big enough for the device to matter,
/// small enough to build quickly.
pub fn speed_model() -> Synthetic {
    Synthetic {
        n_layers: 8,
        dim: 1024,
        ffn_dim: 2816,
        n_heads: 16,
        n_kv_heads: 4,
        vocab: 8192,
        context_length: 2048,
        dtype: DType::Q8_0,
        untied_output: true,
        seed: 1,
    }
}

/// `synthetic` as a loaded model (written to a temporary file, mapped, and unlinked).
pub fn load(synthetic: &Synthetic) -> Result<Model, CheckError> {
    // One name per call: concurrent loads (parallel tests) never share a file.
    static CALLS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let path = std::env::temp_dir().join(format!(
        "custody-synthetic-{}-{n}-{:?}-{}.gguf",
        std::process::id(),
        synthetic.dtype,
        synthetic.seed
    ));
    synthetic.build().write(&path)?;
    let g = Gguf::open(&path);
    std::fs::remove_file(&path)
        .discard("the mapping outlives the name; a leftover name is harmless");
    Ok(Model::from_gguf(g?)?)
}

/// The stated tolerance on max |Δlogit| / max |logit|: F32 activations are f32 on both
/// backends (only summation order differs: measured 6.3e-4); F16's too, except that the
/// device's GEMM path (prompts over `GEMV_MAX_ROWS` rows) rounds them to f16 (11 significant
/// bits: measured 1.2e-3); BF16's are rounded to bf16 on the CPU (llama.cpp's arithmetic, 8
/// significant bits: measured 8.3e-3) and the quantized types' to int8 (Q8, Q8_K), f32 on the
/// device's GEMVs and f16 on its GEMM path.
pub fn tolerance(dtype: DType) -> f32 {
    match dtype {
        DType::F32 => 1e-3,
        DType::F16 => 2e-3,
        DType::BF16 => 2e-2,
        DType::Q4_0
        | DType::Q4_1
        | DType::Q8_0
        | DType::Q5_0
        | DType::Q5_1
        | DType::Q4_K
        | DType::Q5_K
        | DType::Q6_K
        | DType::Q2_K
        | DType::Q3_K => 3e-2,
    }
}

/// How the two backends agreed on one model.
#[derive(Debug, Clone)]
pub struct Agreement {
    pub dtype: DType,
    /// Worst max |Δlogit| / max |logit| over every row compared.
    pub max_rel_err: f32,
    pub greedy_compared: usize,
    pub greedy_agreed: usize,
    /// Greedy disagreements where the CPU's top-2 margin was above 4× the tolerance.
    pub clear_disagreements: usize,
    /// Every logit the device returned, in order (to compare runs bit for bit).
    pub device_logits: Vec<f32>,
    pub cpu_time: Duration,
    pub device_time: Duration,
}

impl Agreement {
    pub fn pass(&self) -> bool {
        self.max_rel_err <= tolerance(self.dtype) && self.clear_disagreements == 0
    }
}

fn max_abs(v: &[f32]) -> f32 {
    v.iter().fold(0.0f32, |m, x| m.max(x.abs()))
}

/// (argmax, top-1 minus top-2).
fn argmax_and_margin(l: &[f32]) -> (usize, f32) {
    let (mut best, mut second) = (0usize, f32::NEG_INFINITY);
    for (i, &x) in l.iter().enumerate() {
        if x > l[best] {
            second = l[best];
            best = i;
        } else if i != best && x > second {
            second = x;
        }
    }
    (best, l[best] - second)
}

fn rel_err(cpu: &[f32], dev: &[f32]) -> f32 {
    debug_assert_eq!(cpu.len(), dev.len());
    let d = cpu
        .iter()
        .zip(dev)
        .fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
    d / max_abs(cpu).max(1e-6)
}

struct Seq {
    owner: u64,
    tokens: Vec<u32>,
    pages: Vec<PageRef>,
    start: usize,
}

/// Two sequences (13 and 70 prompt tokens: 83 rows, the GEMM path) prefilled in one batch, then `steps - 1` greedy
/// decode steps of both, on each backend with its own pool; the CPU's tokens feed both.
pub fn compare_with_cpu<D: Device>(
    dev: D,
    model: &Model,
    dtype: DType,
    steps: usize,
) -> Result<Agreement, CheckError> {
    let n_pages = 64;
    let geom = model.page_geometry(PAGE_SIZE, custody_kernels::attention::KvType::F16);
    let mut cpu_pool = PagePool::new(geom, model.config.n_layers, n_pages);
    let mut dev_pool = PagePool::new(geom, model.config.n_layers, n_pages);
    // The first step's 13 + 70 prompt rows take the products to the GEMM path (over
    // `GEMV_MAX_ROWS`); the decode steps after it, the GEMVs.
    let mut fwd = CudaForward::new(dev, model, &dev_pool, 128)?;
    let mut scratch = Scratch::default();
    let vocab = model.config.vocab_size;
    let mut seqs = Vec::new();
    for (owner, len) in [(11u64, 13usize), (12, 70)] {
        let tokens = (0..len)
            .map(|i| ((i * 37 + owner as usize * 5) % vocab) as u32)
            .collect();
        let n = (len + steps).div_ceil(PAGE_SIZE);
        let pages = cpu_pool.alloc(owner, n)?;
        let same = dev_pool.alloc(owner, n)?;
        debug_assert_eq!(pages, same, "both pools allocate alike");
        seqs.push(Seq {
            owner,
            tokens,
            pages,
            start: 0,
        });
    }
    let mut a = Agreement {
        dtype,
        max_rel_err: 0.0,
        greedy_compared: 0,
        greedy_agreed: 0,
        clear_disagreements: 0,
        device_logits: Vec::new(),
        cpu_time: Duration::ZERO,
        device_time: Duration::ZERO,
    };
    for step in 0..steps {
        let logits = if step == 0 { Logits::All } else { Logits::Last };
        let segs: Vec<Segment<'_>> = seqs
            .iter()
            .map(|s| Segment {
                tokens: &s.tokens[s.start..],
                start_pos: s.start,
                block_table: &s.pages,
                reader: Reader::private(s.owner),
                logits,
                order: if s.tokens.len() - s.start >= 2 {
                    ReduceOrder::Gemm
                } else {
                    ReduceOrder::Vec
                },
                rows: if s.tokens.len() - s.start >= 2 {
                    Rows::Prompt {
                        len: s.tokens.len(),
                        chunk: s.tokens.len(),
                    }
                } else {
                    Rows::Decode
                },
                check: TagCheck::Enforced,
            })
            .collect();
        let t = Instant::now();
        let cpu = model.forward(&mut cpu_pool, &segs, &mut scratch);
        a.cpu_time += t.elapsed();
        let t = Instant::now();
        let gpu = fwd.forward(&mut dev_pool, &segs)?;
        a.device_time += t.elapsed();
        drop(segs);
        for ((c, g), s) in cpu.into_iter().zip(gpu).zip(&mut seqs) {
            let c = c.map_err(|e| CheckError::Integrity {
                backend: "CPU",
                error: e.to_string(),
            })?;
            let g = g.map_err(|e| CheckError::Integrity {
                backend: "device",
                error: e.to_string(),
            })?;
            a.max_rel_err = a.max_rel_err.max(rel_err(&c, &g));
            let (ct, margin) = argmax_and_margin(&c[c.len() - vocab..]);
            let (gt, _) = argmax_and_margin(&g[g.len() - vocab..]);
            a.greedy_compared += 1;
            if ct == gt {
                a.greedy_agreed += 1;
            } else if margin > 4.0 * tolerance(dtype) * max_abs(&c) {
                a.clear_disagreements += 1;
            }
            a.device_logits.extend_from_slice(&g);
            s.start = s.tokens.len();
            s.tokens.push(ct as u32);
        }
    }
    Ok(a)
}

//! `custody gpu-check`: the CUDA backend on a real GPU, against the CPU backend — what
//! `scripts/gpu-check.sh` runs on a lent GPU. Stages: `device` (open device 0, compile the
//! kernels with NVRTC), `forward` (synthetic models in every weight type: logits within the
//! stated tolerance, greedy tokens where the margin is clear, the same result twice), `cache`
//! (the prefix cache's shared pages read on the device and KV offload's host tier restored onto
//! it: `custody_engine::cuda_check::cache`), `speed`
//! (the CPU-vs-device parity and wall time of a 110 M-weight model, then decode tok/s at each
//! batch and prefill tok/s at the Llama-3.2-1B and Llama-3.1-8B shapes with weights made on the
//! device, tag check in vs compiled out: `custody_engine::cuda_speed`). Exit 1 on a failure.

use anyhow::{Result, bail};
use clap::{Args, ValueEnum};
use custody_runtime::cuda_check::{self, Agreement};
use custody_runtime::cuda_forward::CudaForward;
use custody_runtime::cuda_speed::{self, LLAMA_3_1_8B, LLAMA_3_2_1B, ServedShape, SpeedPlan};
use custody_runtime::gguf::write::Synthetic;

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub(crate) enum Stage {
    Device,
    Forward,
    Cache,
    Speed,
}

#[derive(Args, Debug)]
pub(crate) struct GpuCheckArgs {
    /// Which check to run.
    #[arg(value_enum)]
    stage: Stage,
    /// CUDA device ordinal.
    #[arg(long, default_value_t = 0)]
    device: usize,
    /// `speed`: the shapes measured (1b, 8b).
    #[arg(long, value_delimiter = ',')]
    shapes: Option<Vec<String>>,
    /// `speed`: decode batch sizes.
    #[arg(long, value_delimiter = ',')]
    batches: Option<Vec<usize>>,
    /// `speed`: slots already written per row before decoding.
    #[arg(long)]
    ctx: Option<usize>,
    /// `speed`: timed decode steps per batch.
    #[arg(long)]
    steps: Option<usize>,
    /// `speed`: prompt tokens of the prefill measurement.
    #[arg(long)]
    prefill: Option<usize>,
}

impl GpuCheckArgs {
    fn speed_flags_given(&self) -> bool {
        self.shapes.is_some()
            || self.batches.is_some()
            || self.ctx.is_some()
            || self.steps.is_some()
            || self.prefill.is_some()
    }
}

/// Device `ordinal`, or why this machine or binary cannot use one.
fn open(ordinal: usize) -> Result<Box<dyn custody_cuda::Device>> {
    #[cfg(feature = "cuda")]
    {
        use anyhow::Context as _;
        let d = custody_cuda::CudaDevice::open(ordinal).context("opening the CUDA device")?;
        Ok(Box::new(d))
    }
    #[cfg(not(feature = "cuda"))]
    {
        let why = custody_cuda::open(ordinal).err().map_or_else(
            || "built without `--features cuda`".to_owned(),
            |e| e.to_string(),
        );
        bail!("this binary cannot use a GPU: {why}")
    }
}

/// Device `ordinal` with the kernels built without flash decoding's tag check (measuring the
/// check's cost only).
fn open_without_tag_check(ordinal: usize) -> Result<Box<dyn custody_cuda::Device>> {
    #[cfg(feature = "cuda")]
    {
        use anyhow::Context as _;
        let d = custody_cuda::CudaDevice::open_without_tag_check(ordinal)
            .context("opening the CUDA device")?;
        Ok(Box::new(d))
    }
    #[cfg(not(feature = "cuda"))]
    {
        open(ordinal)
    }
}

pub(crate) fn gpu_check(a: GpuCheckArgs) -> Result<()> {
    if a.stage != Stage::Speed && a.speed_flags_given() {
        bail!("--shapes, --batches, --ctx, --steps and --prefill are the `speed` stage's flags");
    }
    match a.stage {
        Stage::Device => {
            let d = open(a.device)?;
            println!("device: {}", d.describe());
            Ok(())
        }
        Stage::Forward => forward(a.device),
        Stage::Cache => cache(a.device),
        Stage::Speed => speed(&a),
    }
}

fn report(a: &Agreement) {
    println!(
        "{:<6} max |dlogit|/max|logit| {:.2e} (tolerance {:.0e})  greedy {}/{}  clear disagreements {}  {}",
        format!("{:?}", a.dtype),
        a.max_rel_err,
        cuda_check::tolerance(a.dtype),
        a.greedy_agreed,
        a.greedy_compared,
        a.clear_disagreements,
        if a.pass() { "PASS" } else { "FAIL" }
    );
}

fn forward(ordinal: usize) -> Result<()> {
    let mut failed = 0;
    for dtype in cuda_check::FORWARD_DTYPES {
        let model = cuda_check::load(&Synthetic::tiny(dtype, 7))?;
        let first = cuda_check::compare_with_cpu(open(ordinal)?, &model, dtype, 6)?;
        let again = cuda_check::compare_with_cpu(open(ordinal)?, &model, dtype, 6)?;
        report(&first);
        let same = first
            .device_logits
            .iter()
            .zip(&again.device_logits)
            .all(|(x, y)| x.to_bits() == y.to_bits());
        if !same {
            println!("{dtype:?}: FAIL: two runs gave different logits (a race)");
        }
        failed += usize::from(!first.pass() || !same);
    }
    failed += usize::from(!int8_paths(ordinal)?);
    if failed > 0 {
        bail!("{failed} checks failed");
    }
    Ok(())
}

/// The prefix cache and KV offload on the device: cached runs give the device's uncached tokens
/// and the expected hits, restored pages are read, none refused.
fn cache(ordinal: usize) -> Result<()> {
    let check = cuda_check::cache::cache_and_offload(open(ordinal)?, open(ordinal)?)?;
    for t in &check.turns {
        println!(
            "{:<8} cached {:>3}/{:<3} tokens {:?} (uncached {:?}, CPU {:?})",
            t.tenant,
            t.device.cached_tokens,
            t.expected_cached,
            t.device.tokens,
            t.uncached.tokens,
            t.cpu.tokens
        );
    }
    println!(
        "restored from the host tier {}, offloaded {}, refused {}; the CPU's tokens and hits: {}",
        check.restored,
        check.offload.offloaded,
        check.offload.refused,
        if check.cpu_agrees() {
            "yes"
        } else {
            "no (reported, not required)"
        }
    );
    let faults = check.faults();
    for f in &faults {
        println!("FAIL: {f}");
    }
    if !faults.is_empty() {
        bail!("{} cache checks failed", faults.len());
    }
    println!("cache: PASS");
    Ok(())
}

/// Q4_K products on int8 activations (the dp4a GEMVs, the int8 tensor-core MMAs) against the
/// CPU and against the same workload on f32 activations.
fn int8_paths(ordinal: usize) -> Result<bool> {
    let model = cuda_check::load(&cuda_check::int8_model())?;
    let mut runs = Vec::new();
    for dp4a in [true, false] {
        let pool = cuda_check::int8_pool(&model);
        let mut fwd = CudaForward::new(open(ordinal)?, &model, &pool, 32)?;
        fwd.set_dp4a(dp4a)?;
        runs.push(cuda_check::run_int8_workload(&mut fwd, &model, |_, _| {})?);
    }
    let (int8, f32_run) = (&runs[0], &runs[1]);
    let pass = cuda_check::int8_passes(int8, f32_run);
    let steps = |r: &cuda_check::Int8Run| {
        r.rel_err
            .iter()
            .map(|e| format!("{e:.2e}"))
            .collect::<Vec<_>>()
            .join(" / ")
    };
    println!(
        "Q4_K int8 x (tensor cores / dp4a / f32 x): max |dlogit|/max|logit| vs CPU {} (f32 x: {}; tolerance {:.0e}), vs f32 x {:.2e} (tolerance {:.0e})  {}",
        steps(int8),
        steps(f32_run),
        cuda_check::INT8_CPU_TOL,
        int8.rel_err_to(f32_run),
        cuda_check::int8_vs_f32_tolerance(),
        if pass { "PASS" } else { "FAIL" }
    );
    Ok(pass)
}

fn speed(a: &GpuCheckArgs) -> Result<()> {
    let ordinal = a.device;
    let shapes = a
        .shapes
        .clone()
        .unwrap_or_else(|| vec!["1b".into(), "8b".into()])
        .iter()
        .map(|s| match s.as_str() {
            "1b" => Ok(LLAMA_3_2_1B),
            "8b" => Ok(LLAMA_3_1_8B),
            other => bail!("unknown shape {other:?}: 1b or 8b"),
        })
        .collect::<Result<Vec<ServedShape>>>()?;
    let plan = SpeedPlan {
        batches: a.batches.clone().unwrap_or_else(|| vec![1, 8, 64]),
        ctx: a.ctx.unwrap_or(1024),
        warmup: 3,
        steps: a.steps.unwrap_or(32),
        prefill_tokens: a.prefill.unwrap_or(512),
    };
    parity(ordinal)?;
    for shape in shapes {
        let on = cuda_speed::measure(open(ordinal)?, shape, &plan, 1)?;
        let off = cuda_speed::measure(open_without_tag_check(ordinal)?, shape, &plan, 1)?;
        println!("{}", cuda_speed::render(&on, Some(&off)));
    }
    Ok(())
}

/// The CPU-vs-device parity of a 110 M-weight model's logits, and both backends' wall time.
fn parity(ordinal: usize) -> Result<()> {
    let s = cuda_check::speed_model();
    let model = cuda_check::load(&s)?;
    let a = cuda_check::compare_with_cpu(open(ordinal)?, &model, s.dtype, 16)?;
    report(&a);
    println!(
        "speed: 2 sequences, 83-token prefill (the GEMM path) + 15 decode steps: CPU {:.1} ms, device {:.1} ms ({:.2}x)",
        a.cpu_time.as_secs_f64() * 1e3,
        a.device_time.as_secs_f64() * 1e3,
        a.cpu_time.as_secs_f64() / a.device_time.as_secs_f64().max(1e-9)
    );
    if !a.pass() {
        bail!("the larger model's logits are outside the tolerance");
    }
    Ok(())
}

//! `custody gpu-check`: the CUDA backend on a real GPU, against the CPU backend — what
//! `scripts/gpu-check.sh` runs on a lent GPU. Stages: `device` (open device 0, compile the
//! kernels with NVRTC), `forward` (synthetic models in every weight type: logits within the
//! stated tolerance, greedy tokens where the margin is clear, the same result twice), `speed`
//! (a larger synthetic model's batched steps, CPU vs device wall time). Exit 1 on a failure.

use anyhow::{Result, bail};
use clap::{Args, ValueEnum};
use custody_runtime::cuda_check::{self, Agreement};
use custody_runtime::gguf::write::Synthetic;

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub(crate) enum Stage {
    Device,
    Forward,
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

pub(crate) fn gpu_check(a: GpuCheckArgs) -> Result<()> {
    match a.stage {
        Stage::Device => {
            let d = open(a.device)?;
            println!("device: {}", d.describe());
            Ok(())
        }
        Stage::Forward => forward(a.device),
        Stage::Speed => speed(a.device),
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
    if failed > 0 {
        bail!("{failed} weight types failed");
    }
    Ok(())
}

fn speed(ordinal: usize) -> Result<()> {
    let s = cuda_check::speed_model();
    let model = cuda_check::load(&s)?;
    let a = cuda_check::compare_with_cpu(open(ordinal)?, &model, s.dtype, 16)?;
    report(&a);
    println!(
        "speed: 2 sequences, 34-token prefill + 15 decode steps: CPU {:.1} ms, device {:.1} ms ({:.2}x)",
        a.cpu_time.as_secs_f64() * 1e3,
        a.device_time.as_secs_f64() * 1e3,
        a.cpu_time.as_secs_f64() / a.device_time.as_secs_f64().max(1e-9)
    );
    if !a.pass() {
        bail!("the larger model's logits are outside the tolerance");
    }
    Ok(())
}

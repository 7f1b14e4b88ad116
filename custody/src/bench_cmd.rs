//! `custody bench`: the engine benchmark's flags, the engine it runs on loaded from them, its
//! progress shown (the benchmarks themselves: `custody-bench`).

use anyhow::Result;
use clap::Args;

use crate::common::{Common, load};

#[derive(Args, Debug)]
pub(crate) struct BenchCmd {
    #[command(flatten)]
    common: Common,
    #[command(flatten)]
    bench: custody_bench::engine::BenchArgs,
}

pub(crate) fn bench(a: BenchCmd) -> Result<()> {
    a.bench.validate()?;
    let l = load(&a.common, Some(a.bench.context_needed()))?;
    let loaded = custody_bench::engine::Loaded {
        engine: l.engine,
        tokenizer: l.tokenizer,
        pool: l.pool,
    };
    let reps = a.bench.reps as u64;
    let shown = crate::progress::Progress::counted("bench", reps, "reps");
    let done = custody_bench::engine::bench(&a.bench, loaded, &|n| shown.set(n));
    shown.finish(reps);
    Ok(done?)
}

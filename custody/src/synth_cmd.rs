//! `custody audit synth`: a realistic synthetic audit log at scale, with injected exposures whose
//! answers are written next to it (`<out>/synth-truth.json`, outside the table directories).

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use clap::Args;
use custody_audit::digest;
use custody_audit::synth::{self, SynthConfig};

#[derive(Args, Debug)]
pub(crate) struct SynthArgs {
    /// Audit root to create (must be empty or absent).
    #[arg(long)]
    out: PathBuf,
    /// Events to record in all (whole requests: a little more).
    #[arg(long)]
    events: u64,
    #[arg(long, default_value_t = 1)]
    seed: u64,
    #[arg(long, default_value_t = 100)]
    tenants: u32,
    /// Nodes, each with its own writer thread into the same root.
    #[arg(long, default_value_t = 4)]
    nodes: u32,
    /// Injected exposures (known answers).
    #[arg(long, default_value_t = 8)]
    exposures: u32,
    /// Fraction of requests with the incident's fault besides the `--exposures` (e.g. 0.01: an
    /// incident across a fleet, for the forensic query's cost); 0 = none.
    #[arg(long, default_value_t = 0.0)]
    fault_rate: f64,
    /// Pages in each node's pool.
    #[arg(long, default_value_t = 8192)]
    pool_pages: u32,
    /// Fraction of requests that start from a cached prompt prefix (and of finished ones that
    /// share theirs): prefix-cache `share`, `hit` and `evict` rows; 0 = no prefix cache.
    #[arg(long, default_value_t = 0.0)]
    cache_hit_rate: f64,
    /// Fraction of shared prefixes in a public scope (hits across tenants, not exposures).
    #[arg(long, default_value_t = 0.1)]
    public_share: f64,
    /// Signing key (`custody audit keygen`); default: a fresh one, its public key written to
    /// `<out>/synth-key.pub`.
    #[arg(long)]
    key: Option<PathBuf>,
}

pub(crate) fn synth(a: SynthArgs) -> Result<()> {
    let key = match &a.key {
        Some(p) => digest::read_signing_key(p).map_err(anyhow::Error::msg)?,
        None => digest::generate_key().context("reading /dev/urandom")?,
    };
    let mut cfg = SynthConfig::new(a.events, a.seed);
    cfg.tenants = a.tenants;
    cfg.nodes = a.nodes;
    cfg.exposures = a.exposures;
    cfg.fault_rate = a.fault_rate;
    cfg.pool_pages = a.pool_pages;
    cfg.cache_hit_rate = a.cache_hit_rate;
    cfg.public_share = a.public_share;
    let progress = AtomicU64::new(0);
    let done = AtomicBool::new(false);
    let t0 = Instant::now();
    let shown = crate::progress::Progress::counted("synth", a.events, "events");
    let truth = std::thread::scope(|s| {
        s.spawn(|| {
            while !done.load(Ordering::Relaxed) {
                std::thread::sleep(Duration::from_millis(100));
                shown.set(progress.load(Ordering::Relaxed));
            }
        });
        let r = synth::generate(&cfg, &a.out, &key, &progress);
        done.store(true, Ordering::Relaxed);
        r
    })
    .with_context(|| format!("generating a synthetic log in {}", a.out.display()))?;
    shown.finish(progress.load(Ordering::Relaxed));
    let wall_s = t0.elapsed().as_secs_f64();
    let truth_path = a.out.join("synth-truth.json");
    std::fs::write(&truth_path, serde_json::to_string_pretty(&truth)?)
        .with_context(|| format!("writing {}", truth_path.display()))?;
    if a.key.is_none() {
        let pub_path = a.out.join("synth-key.pub");
        std::fs::write(&pub_path, digest::hex(key.verifying_key().as_bytes()))
            .with_context(|| format!("writing {}", pub_path.display()))?;
    }
    let parquet_bytes = custody_bench::parquet_bytes(&a.out)?;
    let summary = serde_json::json!({
        "events": truth.events,
        "requests": truth.requests,
        "page_allocs": truth.page_allocs,
        "page_writes": truth.page_writes,
        "page_reads": truth.page_reads,
        "injected_exposures": truth.exposures.len(),
        "wall_s": wall_s,
        "events_per_s": truth.events as f64 / wall_s,
        "parquet_bytes": parquet_bytes,
        "bytes_per_event": parquet_bytes as f64 / truth.events as f64,
        "truth": truth_path,
    });
    println!("{summary}");
    Ok(())
}

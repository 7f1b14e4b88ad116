//! `custody bench-offload`: KV offload against references measured in the same run — the time
//! to first token of a multi-turn follow-up whose earlier turn is served from each tier (the
//! pool, host memory, local disk, an object store) vs recomputed, each tier's restore bandwidth
//! vs this machine's memcpy, and what write-back costs a decoding workload's throughput.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use clap::Args;
use custody_runtime::engine::{Event, GenerateRequest};
use custody_runtime::kv::{KvType, PagePool};
use custody_runtime::offload::seal::SealKeys;
use custody_runtime::offload::store::{DiskStore, HostArena, PageStore};
use custody_runtime::offload::{OffloadConfig, TierSpec};
use custody_runtime::prefix_cache::{CacheScope, NamespaceSecret};
use custody_runtime::{Engine, EngineConfig, Model, SamplingParams, Tokenizer};

use crate::stats::median;
use crate::{Context, Result, bail};

#[derive(Args, Debug)]
pub struct BenchOffloadArgs {
    /// GGUF model; default: the embedded one.
    #[arg(long)]
    model: Option<PathBuf>,
    /// The conversation so far (tokens): the follow-up repeats it and adds `--follow-tokens`.
    #[arg(long, default_value_t = 4096)]
    prompt_tokens: usize,
    #[arg(long, default_value_t = 64)]
    follow_tokens: usize,
    /// Repetitions per scenario (medians reported); scenarios alternate within a repetition.
    #[arg(long, default_value_t = 3)]
    reps: usize,
    /// Compute threads.
    #[arg(long, default_value_t = 2)]
    threads: usize,
    /// The disk tier's directory (default: a temporary directory, removed at the end).
    #[arg(long)]
    disk_dir: Option<PathBuf>,
    /// Also measure an object-store tier at this `s3://bucket/prefix` (the `AWS_*` variables
    /// configure the client).
    #[arg(long)]
    object_url: Option<String>,
    /// Seal with AES-256-GCM as well as the MAC (every tier then holds ciphertext).
    #[arg(long)]
    encrypt: bool,
    /// Before each disk restore, drop the OS page cache (`/proc/sys/vm/drop_caches`, root) so
    /// the pages come from the device.
    #[arg(long)]
    drop_caches: bool,
    /// Requests in the write-back cost's workload (8 running at a time, 64-token prompts, 96
    /// generated tokens each — decoding dominates — in a pool that holds a third of them: every
    /// admission evicts, and each request's full pages, output included, are written back).
    #[arg(long, default_value_t = 24)]
    writeback_requests: usize,
    /// Run only one part: `ttft` (the follow-ups and restore bandwidth) or `writeback`.
    #[arg(long)]
    only: Option<Part>,
}

/// A part of the benchmark.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum Part {
    Ttft,
    Writeback,
}

/// Where a scenario's earlier turn is when its follow-up arrives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Source {
    /// Not cached: the follow-up computes its whole prompt.
    Recompute,
    /// Still in the pool (a prefix-cache hit).
    Pool,
    Host,
    Disk,
    Object,
}

impl Source {
    fn name(self) -> &'static str {
        match self {
            Source::Recompute => "recompute",
            Source::Pool => "pool",
            Source::Host => "host",
            Source::Disk => "disk",
            Source::Object => "object",
        }
    }
}

/// One follow-up: its time to first token and the prompt tokens it did not compute.
#[derive(Clone, Copy, Debug)]
struct Sample {
    ttft_s: f64,
    cached_tokens: usize,
}

struct Ctx<'a> {
    a: &'a BenchOffloadArgs,
    path: PathBuf,
    disk_dir: PathBuf,
    conversation: Vec<u32>,
    follow_up: Vec<u32>,
    pool: custody_runtime::par::ThreadPool,
}

fn request(prompt: &[u32], max_tokens: usize, cache: Option<CacheScope>) -> GenerateRequest {
    GenerateRequest {
        decoding: Default::default(),
        prompt: prompt.to_vec(),
        max_tokens,
        sampling: SamplingParams::default(),
        stop_ids: Vec::new(),
        tenant: "acme".into(),
        cache,
    }
}

/// Run `engine` until `id` has its first token (returned: seconds since `t0`) and then until
/// it has no work; `cached_tokens` from its end.
fn until_done(engine: &mut Engine, id: u64, t0: Instant) -> Result<Sample> {
    let (mut ttft_s, mut cached_tokens) = (None, 0);
    // Bounded: each step makes progress (a token, or a prefill chunk) until the engine idles.
    for _ in 0..1_000_000 {
        if !engine.has_work() {
            break;
        }
        for ev in engine.step() {
            match ev {
                Event::Token { id: i, .. } if i == id => {
                    ttft_s.get_or_insert(t0.elapsed().as_secs_f64());
                }
                Event::Finished {
                    id: i,
                    cached_tokens: c,
                    ..
                } if i == id => cached_tokens = c,
                Event::Token { .. } | Event::Finished { .. } => {}
                other => bail!("benchmark request ended early: {other:?}"),
            }
        }
    }
    Ok(Sample {
        ttft_s: ttft_s.context("no first token")?,
        cached_tokens,
    })
}

impl Ctx<'_> {
    fn engine(&self, context: usize, pool_tokens: usize) -> Result<Engine> {
        let model =
            Model::load(&self.path).with_context(|| format!("loading {}", self.path.display()))?;
        let geom = model.page_geometry(16, KvType::F16);
        let per_token = PagePool::bytes_per_token(geom, model.config.n_layers);
        let kv_budget_mib = (pool_tokens * per_token).div_ceil(1 << 20);
        Ok(Engine::new(
            model,
            EngineConfig {
                context_length: Some(context),
                kv_budget_mib,
                prefix_cache: Some(true),
                ..EngineConfig::default()
            },
        )?)
    }

    fn tier(&self, source: Source, rep: usize) -> Result<Option<Arc<dyn PageStore>>> {
        Ok(match source {
            Source::Recompute | Source::Pool => None,
            Source::Host => Some(Arc::new(HostArena::new())),
            Source::Disk => {
                let d = self.disk_dir.join(format!("rep{rep}"));
                if d.exists() {
                    std::fs::remove_dir_all(&d)?;
                }
                Some(Arc::new(DiskStore::open(&d).context("disk tier")?))
            }
            Source::Object => {
                let url = self.a.object_url.as_deref().context("no --object-url")?;
                Some(Arc::new(
                    custody_runtime::offload_s3::S3PageStore::from_env(&format!(
                        "{}/bench-{}-{rep}",
                        url.trim_end_matches('/'),
                        std::process::id()
                    ))
                    .context("object tier")?,
                ))
            }
        })
    }

    /// The conversation's first turn, then (after its pages went to `source`) the follow-up.
    fn follow_up_once(&self, source: Source, rep: usize) -> Result<Sample> {
        let context = self.follow_up.len() + 2;
        let mut engine = self.engine(context, context * 3 / 2)?;
        let secret = NamespaceSecret::generate().context("secret")?;
        if let Some(store) = self.tier(source, rep)? {
            let layout = engine.offload_layout();
            let aes = self.a.encrypt.then_some([0x5a; 32]);
            engine.enable_offload(OffloadConfig {
                tiers: vec![TierSpec {
                    store,
                    budget_bytes: if source == Source::Object { 0 } else { 1 << 40 },
                }],
                keys: SealKeys::new(&secret.offload_mac_key(), aes.as_ref()),
                layout,
                node: 1,
                token_only: false,
                queue_pages: 64,
            })?;
        }
        let scope = CacheScope {
            private: secret.private("acme", None),
            public: None,
        };
        self.pool.install(|| -> Result<Sample> {
            let first = engine.submit(request(&self.conversation, 1, Some(scope.clone())))?;
            until_done(&mut engine, first, Instant::now())?;
            if !matches!(source, Source::Recompute | Source::Pool) {
                engine.evict_cached();
                engine.offload_flush();
                if source == Source::Disk && self.a.drop_caches {
                    std::fs::write("/proc/sys/vm/drop_caches", "1")
                        .context("--drop-caches needs root")?;
                }
            }
            let cache = (source != Source::Recompute).then_some(scope);
            let t0 = Instant::now();
            let id = engine.submit(request(&self.follow_up, 1, cache))?;
            let s = until_done(&mut engine, id, t0)?;
            let whole = self.conversation.len() / 16 * 16;
            if source != Source::Recompute && s.cached_tokens < whole {
                bail!(
                    "the follow-up served from {} took only {} of the conversation's {whole} tokens from it",
                    source.name(),
                    s.cached_tokens
                );
            }
            Ok(s)
        })
    }
}

/// This machine's memcpy bandwidth over 256 MiB, GB/s (the restore bandwidth's reference).
fn memcpy_gbps() -> f64 {
    let src = vec![7u8; 256 << 20];
    let mut dst = vec![0u8; 256 << 20];
    let mut best = f64::MAX;
    for _ in 0..5 {
        let t = Instant::now();
        dst.copy_from_slice(std::hint::black_box(&src));
        best = best.min(t.elapsed().as_secs_f64());
    }
    std::hint::black_box(&dst);
    src.len() as f64 / best / 1e9
}

/// A distinct prompt of `n` tokens (`seed` starts it).
fn prompt(tok: &Tokenizer, seed: usize, n: usize) -> Result<Vec<u32>> {
    let text = format!(
        "Case {seed}: notes of the review. {}",
        "The ledger was checked against the harbor records and the signal logs. ".repeat(n / 8 + 8)
    );
    let mut ids = tok.encode(&text, false)?;
    if ids.len() < n {
        bail!("prompt text too short: {} tokens", ids.len());
    }
    ids.truncate(n);
    Ok(ids)
}

/// Throughput (generated tokens per second) of the write-back workload, offload on or off.
fn writeback_once(ctx: &Ctx<'_>, tok: &Tokenizer, offload: bool, rep: usize) -> Result<(f64, u64)> {
    const RUNNING: usize = 8;
    const PROMPT: usize = 64;
    const GEN: usize = 96;
    let n = ctx.a.writeback_requests;
    let mut engine = ctx.engine(PROMPT + GEN + 1, n * (PROMPT + GEN) / 3)?;
    let secret = NamespaceSecret::generate().context("secret")?;
    if offload {
        let d = ctx.disk_dir.join(format!("wb{rep}"));
        if d.exists() {
            std::fs::remove_dir_all(&d)?;
        }
        let page = engine.offload_layout().body_bytes() as u64 + 1024;
        let layout = engine.offload_layout();
        engine.enable_offload(OffloadConfig {
            tiers: vec![
                TierSpec {
                    store: Arc::new(HostArena::new()),
                    budget_bytes: 64 * page,
                },
                TierSpec {
                    store: Arc::new(DiskStore::open(&d).context("disk tier")?),
                    budget_bytes: 1 << 40,
                },
            ],
            keys: SealKeys::new(&secret.offload_mac_key(), None),
            layout,
            node: 1,
            token_only: false,
            queue_pages: 64,
        })?;
    }
    let scope = CacheScope {
        private: secret.private("acme", None),
        public: None,
    };
    let prompts: Vec<Vec<u32>> = (0..n)
        .map(|i| prompt(tok, 10_000 * (rep + 1) + i, PROMPT))
        .collect::<Result<_>>()?;
    ctx.pool.install(|| -> Result<(f64, u64)> {
        let t0 = Instant::now();
        let mut next = 0;
        let mut generated = 0usize;
        let mut running = 0usize;
        for _ in 0..10_000_000 {
            while running < RUNNING && next < n {
                engine.submit(request(&prompts[next], GEN, Some(scope.clone())))?;
                next += 1;
                running += 1;
            }
            if !engine.has_work() {
                break;
            }
            for ev in engine.step() {
                match ev {
                    Event::Token { .. } => generated += 1,
                    Event::Finished { .. } => running -= 1,
                    other => bail!("benchmark request ended early: {other:?}"),
                }
            }
        }
        let s = t0.elapsed().as_secs_f64();
        let mut waits = 0;
        if offload {
            engine.offload_flush();
            let st = engine.offload_stats().context("offload on")?;
            if st.offloaded == 0 {
                bail!("the write-back workload offloaded nothing");
            }
            waits = st.write_back_waits;
        }
        Ok((generated as f64 / s, waits))
    })
}

pub fn bench_offload(a: BenchOffloadArgs) -> Result<()> {
    let path = a
        .model
        .clone()
        .unwrap_or_else(custody_runtime::config::default_model_path);
    let tok = Tokenizer::from_gguf(
        &custody_runtime::gguf::Gguf::open(&path)
            .with_context(|| format!("reading {}", path.display()))?,
    )?;
    let conversation = prompt(&tok, 1, a.prompt_tokens)?;
    let mut follow_up = conversation.clone();
    follow_up.extend(prompt(&tok, 2, a.follow_tokens)?);
    let temp = a.disk_dir.is_none();
    let disk_dir = a.disk_dir.clone().unwrap_or_else(|| {
        std::env::temp_dir().join(format!("custody-bench-offload-{}", std::process::id()))
    });
    let ctx = Ctx {
        a: &a,
        path,
        disk_dir: disk_dir.clone(),
        conversation,
        follow_up,
        pool: custody_runtime::par::ThreadPool::new(a.threads).context("compute pool")?,
    };
    let mut sources = vec![Source::Recompute, Source::Pool, Source::Host, Source::Disk];
    if a.object_url.is_some() {
        sources.push(Source::Object);
    }
    println!(
        "# custody bench-offload: a {}-token conversation's {}-token follow-up, {} threads, reps {} (medians){}",
        a.prompt_tokens,
        a.follow_tokens,
        a.threads,
        a.reps,
        if a.encrypt { ", AES-256-GCM" } else { "" }
    );
    if a.only != Some(Part::Writeback) {
        ttft_part(&ctx, &sources)?;
    }
    if a.only != Some(Part::Ttft) {
        writeback_part(&ctx, &tok)?;
    }
    if temp && disk_dir.exists() {
        std::fs::remove_dir_all(&disk_dir)?;
    }
    Ok(())
}

/// The follow-ups from every source, and the restore bandwidth.
fn ttft_part(ctx: &Ctx<'_>, sources: &[Source]) -> Result<()> {
    let a = ctx.a;
    let mut samples: Vec<Vec<Sample>> = vec![Vec::new(); sources.len()];
    for rep in 0..a.reps {
        for (i, s) in sources.iter().enumerate() {
            samples[i].push(ctx.follow_up_once(*s, rep)?);
        }
    }
    let page_bytes = {
        let e = ctx.engine(64, 64)?;
        e.offload_layout().body_bytes()
    };
    let ttft: Vec<f64> = samples
        .iter()
        .map(|v| median(v.iter().map(|s| s.ttft_s).collect()))
        .collect();
    let memcpy = memcpy_gbps();
    let (recompute, pool) = (ttft[0], ttft[1]);
    for (i, s) in sources.iter().enumerate() {
        let cached = samples[i][0].cached_tokens;
        let restore = (*s != Source::Recompute && *s != Source::Pool).then(|| {
            let bytes = (cached / 16 * page_bytes) as f64;
            let extra = ttft[i] - pool;
            if extra <= 0.0 {
                // The restore hid in the run-to-run spread of the pool's TTFT: no figure.
                return ", restore not measurable (TTFT within the pool's)".to_owned();
            }
            format!(
                ", restore {:.2} GB/s = {:.3}x memcpy",
                bytes / extra / 1e9,
                bytes / extra / 1e9 / memcpy
            )
        });
        println!(
            "follow-up served from {:9}: TTFT {:8.1} ms = {:.3}x recompute, {} prompt tokens not computed{}",
            s.name(),
            ttft[i] * 1e3,
            ttft[i] / recompute,
            cached,
            restore.unwrap_or_default()
        );
    }
    println!("memcpy {memcpy:.2} GB/s (256 MiB, best of 5)");
    Ok(())
}

/// What write-back costs a decoding workload whose admissions evict.
fn writeback_part(ctx: &Ctx<'_>, tok: &Tokenizer) -> Result<()> {
    let a = ctx.a;
    let (mut off, mut on, mut waits) = (Vec::new(), Vec::new(), 0);
    for rep in 0..a.reps {
        // Alternate the order: drift hits both alike.
        for offload in if rep % 2 == 0 {
            [false, true]
        } else {
            [true, false]
        } {
            let (t, w) = writeback_once(ctx, tok, offload, rep)?;
            waits += w;
            if offload { on.push(t) } else { off.push(t) }
        }
    }
    let (off, on) = (median(off), median(on));
    println!(
        "write-back: {} requests (8 running, 64-token prompts, 96 tokens each), pool a third of them: {:.1} tok/s without offload, {:.1} tok/s with host+disk write-back = {:+.2}% ({waits} write-backs waited for the worker)",
        a.writeback_requests,
        off,
        on,
        (on / off - 1.0) * 100.0
    );
    Ok(())
}

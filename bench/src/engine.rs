//! `custody bench`: prefill and decode throughput, the tag check's share of a decode step,
//! and (with `--audit-cost`) what auditing costs, each against a reference in the same run.

use std::path::{Path, PathBuf};
use std::time::Instant;

use crate::{Context, Result, bail};
use clap::Args;
use custody_runtime::engine::{Event, GenerateRequest};
use custody_runtime::{Engine, SamplingParams};

use crate::stats::{median, median_ci};

#[derive(Args, Debug)]
pub struct BenchArgs {
    /// Prompt length (tokens) for the prefill measurement.
    #[arg(long, default_value_t = 512)]
    pub prompt_tokens: usize,
    /// Decode steps measured after the prefill.
    #[arg(long, default_value_t = 128)]
    pub gen_tokens: usize,
    /// Repetitions; the median is reported.
    #[arg(long, default_value_t = 3)]
    pub reps: usize,
    /// JSON file with the prompt ids (a list, or an object with `all_ids`); default: a built-in
    /// text repeated to length.
    #[arg(long)]
    pub prompt_ids: Option<PathBuf>,
    /// Print one JSON object instead of text.
    #[arg(long)]
    pub json: bool,
    /// Also run every repetition with the audit writer recording (to a temporary directory) and
    /// report the throughput ratio, audit on vs off, measured in the same run.
    #[arg(long)]
    pub audit_cost: bool,
    /// With --audit-cost: fsync the live segment at most this often (0 = after every batch).
    #[arg(long, default_value_t = 0)]
    pub audit_fsync_interval_ms: u64,
    /// Concurrent sequences: each gets the prompt, all decode together (continuous batching);
    /// decode tok/s is then the aggregate over the sequences.
    #[arg(long, default_value_t = 1)]
    pub batch: usize,
    /// Also measure what chunked prefill costs the running sequences: while `--batch`
    /// sequences decode, a prompt of this many tokens arrives; the decode steps' wall time (each
    /// running sequence's inter-token latency) is reported before and while it is prefilled in
    /// `engine.max_batch_tokens` chunks, with its time to first token. 0: not measured.
    #[arg(long, default_value_t = 0)]
    pub long_prompt_tokens: usize,
    /// Also measure what a JSON-schema output constraint costs a decode step, at 1 and 8
    /// sequences (`constrained.rs`), and its compile time.
    #[arg(long)]
    pub constraint_cost: bool,
}

/// Decode steps timed before the long prompt arrives (the undisturbed inter-token latency).
const BASELINE_STEPS: usize = 8;

/// One repetition's timings.
#[derive(Clone, Copy, Debug)]
struct RunTimes {
    /// From submitting until every sequence has its first token (prompt processing).
    prefill_s: f64,
    /// From then until every sequence has generated its tokens.
    decode_s: f64,
    /// Tokens generated after the first one, over all sequences.
    decode_tokens: usize,
}

/// `batch` sequences with the prompt `ids`, each then generating `gen_tokens` more tokens: the
/// engine's own scheduling (prefill in `max_batch_tokens` chunks, then one decode row per
/// sequence per step).
fn bench_once(
    engine: &mut Engine,
    ids: &[u32],
    gen_tokens: usize,
    batch: usize,
) -> Result<RunTimes> {
    let t0 = Instant::now();
    for _ in 0..batch {
        engine.submit(request(ids, gen_tokens + 1))?;
    }
    let mut tokens = std::collections::HashMap::new();
    // Bounded: each step either makes progress or the engine has no work left.
    let max_steps = batch * (ids.len() + gen_tokens + 2);
    let mut prefill_s = None;
    for _ in 0..max_steps {
        if !engine.has_work() {
            break;
        }
        for ev in engine.step() {
            match ev {
                Event::Token { id, .. } => *tokens.entry(id).or_insert(0usize) += 1,
                Event::Finished { .. } => {}
                other => bail!("benchmark request ended early: {other:?}"),
            }
        }
        if prefill_s.is_none() && tokens.len() == batch {
            prefill_s = Some(t0.elapsed().as_secs_f64());
        }
    }
    let total = t0.elapsed().as_secs_f64();
    let prefill_s = prefill_s.context("the prompts were never processed")?;
    let generated: usize = tokens.values().sum();
    if engine.has_work() || generated != batch * (gen_tokens + 1) {
        bail!(
            "expected {} tokens from {batch} sequences, got {generated}",
            batch * (gen_tokens + 1)
        );
    }
    Ok(RunTimes {
        prefill_s,
        decode_s: total - prefill_s,
        decode_tokens: generated - batch,
    })
}

/// The running sequences' inter-token latency while a long prompt is prefilled.
#[derive(Debug)]
struct Interference {
    max_batch_tokens: usize,
    /// Median decode step before the long prompt arrived, ms.
    baseline_step_ms: f64,
    /// Steps from its arrival to its first token (each also decoded every running sequence).
    steps: usize,
    step_p50_ms: f64,
    step_max_ms: f64,
    /// From its submission to its first token, s.
    long_ttft_s: f64,
}

/// A benchmark request: greedy, no stop tokens, never cached.
fn request(prompt: &[u32], max_tokens: usize) -> GenerateRequest {
    GenerateRequest {
        decoding: Default::default(),
        prompt: prompt.to_vec(),
        max_tokens,
        sampling: SamplingParams::default(),
        stop_ids: Vec::new(),
        tenant: "bench".into(),
        cache: None,
    }
}

/// One step's wall time (ms), how many tokens it gave the running sequences, and whether it gave
/// the long prompt (`long`) its token.
struct StepOutcome {
    ms: f64,
    decoded: usize,
    long_token: bool,
}

fn timed_step(
    engine: &mut Engine,
    long: Option<custody_runtime::engine::RequestId>,
) -> Result<StepOutcome> {
    let t = Instant::now();
    let events = engine.step();
    let ms = t.elapsed().as_secs_f64() * 1e3;
    let (mut decoded, mut long_token) = (0, false);
    for ev in events {
        match ev {
            Event::Token { id, .. } if Some(id) == long => long_token = true,
            Event::Token { .. } => decoded += 1,
            Event::Finished { .. } => {}
            other => bail!("benchmark request ended early: {other:?}"),
        }
    }
    Ok(StepOutcome {
        ms,
        decoded,
        long_token,
    })
}

/// `batch` sequences with the prompt `short` decode; after [`BASELINE_STEPS`] timed steps the
/// prompt `long` arrives and every step until its first token is timed. The running sequences
/// are then aborted (not part of any throughput figure).
fn interference(
    engine: &mut Engine,
    short: &[u32],
    long: &[u32],
    batch: usize,
) -> Result<Interference> {
    // Enough to decode through the long prompt's prefill (each step gives it at least
    // `max_batch_tokens - batch` of its tokens) and no more: the pool reserves what a sequence
    // may grow to.
    let room = engine.max_batch_tokens() - batch;
    let prefill_steps = long.len().div_ceil(room);
    // The first sequence decodes while the others are prefilled.
    let start_steps = batch * short.len().div_ceil(room) + 1;
    let max_tokens = start_steps + BASELINE_STEPS + prefill_steps + 2;
    let running: Vec<_> = (0..batch)
        .map(|_| engine.submit(request(short, max_tokens)))
        .collect::<Result<_, _>>()?;
    // Until a step gives every sequence a token (all prefilled, all decoding): bounded by one
    // step per prompt token.
    let mut all_decoding = false;
    for _ in 0..start_steps {
        if timed_step(engine, None)?.decoded == batch {
            all_decoding = true;
            break;
        }
    }
    if !all_decoding {
        bail!("the {batch} sequences never decoded together");
    }
    let mut baseline = Vec::with_capacity(BASELINE_STEPS);
    for _ in 0..BASELINE_STEPS {
        baseline.push(timed_step(engine, None)?.ms);
    }
    let t_long = Instant::now();
    let long_id = engine.submit(request(long, 1))?;
    let (mut during, mut ttft) = (Vec::new(), None);
    for _ in 0..prefill_steps + 2 {
        let s = timed_step(engine, Some(long_id))?;
        if s.decoded != batch {
            bail!(
                "a running sequence missed a decode step ({} of {batch})",
                s.decoded
            );
        }
        during.push(s.ms);
        if s.long_token {
            ttft = Some(t_long.elapsed().as_secs_f64());
            break;
        }
    }
    for id in running {
        // Whether it still existed does not matter: the measurement is over.
        let _ = engine.abort(id, "bench: interference measured");
    }
    let long_ttft_s = ttft.context("the long prompt never got its first token")?;
    let steps = during.len();
    Ok(Interference {
        max_batch_tokens: engine.max_batch_tokens(),
        baseline_step_ms: median(baseline),
        steps,
        step_p50_ms: median(during.clone()),
        step_max_ms: during.iter().copied().fold(0.0, f64::max),
        long_ttft_s,
    })
}

fn read_prompt_ids(path: &Path) -> Result<Vec<u32>> {
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(path)?)
        .with_context(|| format!("parsing {}", path.display()))?;
    let arr = v.get("all_ids").unwrap_or(&v);
    let ids: Vec<u32> =
        serde_json::from_value(arr.clone()).context("prompt ids must be a list of token ids")?;
    Ok(ids)
}

/// What the engine benchmark runs on (the binary loads it from its flags and config, with a
/// context of at least [`BenchArgs::context_needed`]).
#[derive(Debug)]
pub struct Loaded {
    pub engine: Engine,
    pub tokenizer: custody_runtime::Tokenizer,
    pub pool: custody_runtime::par::ThreadPool,
}

impl BenchArgs {
    /// The context the benchmark's sequences need.
    pub fn context_needed(&self) -> usize {
        let interference = if self.long_prompt_tokens > 0 {
            // The running sequences decode through the long prompt's prefill (≤ one step per
            // prompt token) before they are stopped; the long prompt needs its own context.
            (self.prompt_tokens + BASELINE_STEPS + self.long_prompt_tokens + 2)
                .max(self.long_prompt_tokens + 1)
        } else {
            0
        };
        (self.prompt_tokens + self.gen_tokens + 1).max(interference)
    }

    /// Refuse a measurement of nothing (before anything is loaded).
    pub fn validate(&self) -> Result<()> {
        if self.reps == 0 || self.prompt_tokens == 0 || self.gen_tokens == 0 || self.batch == 0 {
            bail!("--reps, --prompt-tokens, --gen-tokens and --batch must be positive");
        }
        Ok(())
    }
}

/// `custody bench`: `progress` is told each repetition started (and, at the end, `reps`).
pub fn bench(a: &BenchArgs, loaded: Loaded, progress: &(dyn Fn(u64) + Sync)) -> Result<()> {
    a.validate()?;
    let Loaded {
        mut engine,
        tokenizer,
        pool,
    } = loaded;
    let mut ids = match &a.prompt_ids {
        Some(p) => read_prompt_ids(p)?,
        None => {
            let text =
                "The history of the printing press begins in the fifteenth century. ".repeat(64);
            tokenizer.encode(&text, true)?
        }
    };
    if ids.len() < a.prompt_tokens {
        bail!(
            "prompt has only {} tokens, {} requested",
            ids.len(),
            a.prompt_tokens
        );
    }
    let long_ids: Vec<u32> = ids
        .iter()
        .copied()
        .cycle()
        .take(a.long_prompt_tokens)
        .collect();
    ids.truncate(a.prompt_tokens);
    if a.long_prompt_tokens > 0 && engine.max_batch_tokens() <= a.batch {
        bail!(
            "--long-prompt-tokens: engine.max_batch_tokens ({}) leaves no room for a prefill chunk beside {} decode rows",
            engine.max_batch_tokens(),
            a.batch
        );
    }
    let threads = pool.current_num_threads();
    let (mut prefill, mut decode, mut check_frac) = (Vec::new(), Vec::new(), Vec::new());
    let (mut prefill_audit, mut decode_audit) = (Vec::new(), Vec::new());
    // Per repetition: (prefill ratio on/off, decode ratio on/off) from the same repetition, and
    // the audited run's events, writer-thread CPU seconds while generating and for sealing the
    // run's one segment at close, and wall seconds.
    let (mut paired_prefill, mut paired_decode) = (Vec::new(), Vec::new());
    let mut audited_runs: Vec<(u64, f64, f64, f64)> = Vec::new();
    let audit_dir =
        std::env::temp_dir().join(format!("custody-bench-audit-{}", std::process::id()));
    pool.install(|| -> Result<()> {
        for rep in 0..a.reps {
            progress(rep as u64);
            // Alternate which configuration runs first, so that order effects (cache warmth,
            // frequency drift) do not bias the on-vs-off ratio.
            let order = if rep % 2 == 0 {
                [false, true]
            } else {
                [true, false]
            };
            for audited in order {
                if audited && !a.audit_cost {
                    continue;
                }
                let writer = if audited {
                    let _ = std::fs::remove_dir_all(&audit_dir);
                    let key = custody_audit::digest::generate_key()?;
                    let mut wcfg = custody_audit::writer::WriterConfig::new(&audit_dir, 0, key);
                    if a.audit_fsync_interval_ms > 0 {
                        wcfg.fsync = custody_audit::writer::FsyncPolicy::Interval(
                            std::time::Duration::from_millis(a.audit_fsync_interval_ms),
                        );
                    }
                    let w = std::sync::Arc::new(custody_audit::writer::AuditWriter::open(wcfg)?);
                    engine.set_audit(Some(w.clone()));
                    Some(w)
                } else {
                    engine.set_audit(None);
                    None
                };
                let t = bench_once(&mut engine, &ids, a.gen_tokens, a.batch)?;
                let (tp, td) = (t.prefill_s, t.decode_s);
                let (prompt_tokens, decode_tokens) = (a.prompt_tokens * a.batch, t.decode_tokens);
                if let Some(w) = writer {
                    engine.set_audit(None);
                    let events = w.sync()?;
                    let running_cpu_ns = w.writer_cpu_ns();
                    w.close()?;
                    audited_runs.push((
                        events,
                        running_cpu_ns as f64 / 1e9,
                        w.writer_cpu_ns().saturating_sub(running_cpu_ns) as f64 / 1e9,
                        tp + td,
                    ));
                    prefill_audit.push(prompt_tokens as f64 / tp);
                    decode_audit.push(decode_tokens as f64 / td);
                } else {
                    prefill.push(prompt_tokens as f64 / tp);
                    decode.push(decode_tokens as f64 / td);
                    // A decode step checks every running sequence's block table.
                    let steps = decode_tokens / a.batch;
                    check_frac.push(
                        a.batch as f64
                            * tag_check_cost(
                                &engine,
                                a.prompt_tokens + a.gen_tokens / 2,
                                td / steps as f64,
                            ),
                    );
                }
            }
            if a.audit_cost {
                let n = prefill.len();
                paired_prefill.push(prefill_audit[n - 1] / prefill[n - 1]);
                paired_decode.push(decode_audit[n - 1] / decode[n - 1]);
            }
        }
        Ok(())
    })?;
    progress(a.reps as u64);
    let interfered = if a.long_prompt_tokens > 0 {
        Some(pool.install(|| interference(&mut engine, &ids, &long_ids, a.batch))?)
    } else {
        None
    };
    let constraint = if a.constraint_cost {
        let eos = tokenizer
            .eos_id
            .context("the model names no end-of-text token")?;
        let grammars =
            custody_runtime::grammar::Grammars::new(std::sync::Arc::new(tokenizer), eos)?;
        let mut out = Vec::new();
        for batch in [1, 8] {
            out.push(pool.install(|| {
                crate::constrained::measure(
                    &mut engine,
                    &grammars,
                    &ids,
                    a.gen_tokens,
                    batch,
                    a.reps,
                )
            })?);
        }
        out
    } else {
        Vec::new()
    };
    let _ = std::fs::remove_dir_all(&audit_dir);
    let audit = (!prefill_audit.is_empty()).then(|| (median(prefill_audit), median(decode_audit)));
    let cpu_bound = if a.audit_cost {
        Some(audit_cpu_bound(&audited_runs, &audit_dir)?)
    } else {
        None
    };
    let (p, d, c) = (median(prefill), median(decode), median(check_frac));
    let bound = pool.install(|| DecodeBound::measure(&engine, a));
    let compute = pool.install(|| PrefillBound::measure(&engine, a));
    let machinery = custody_runtime::prefix_cache::bench_machinery(
        a.prompt_tokens.max(16),
        engine.pool().page_size(),
        engine.model().config.n_layers,
        200,
    );
    if a.json {
        println!(
            "{}",
            serde_json::json!({
                "threads": threads, "prompt_tokens": a.prompt_tokens, "gen_tokens": a.gen_tokens, "batch": a.batch,
                "prefill_tok_s": p, "decode_tok_s": d, "tag_check_fraction_of_decode_step": c,
                "prefix_cache_scope_chain_lookup_us": machinery.scope_chain_lookup.as_secs_f64() * 1e6,
                "prefix_cache_shared_tag_check_ratio": machinery.shared_tag_check_ratio,
                "simd": format!("{:?}", custody_kernels::simd::level()),
                "kv_cache_type": engine.pool().geometry().kv.name(),
                "decode_weight_bytes": bound.weight_bytes, "decode_kv_bytes_at_mid_context": bound.kv_bytes,
                "read_bandwidth_gb_s": bound.read_gb_s, "decode_bound_tok_s": bound.tok_s(a.batch),
                "decode_fraction_of_bound": d / bound.tok_s(a.batch),
                "prefill_macs_per_token": compute.macs_per_token, "int8_peak_gmac_s": compute.peak_macs_s.map(|m| m / 1e9),
                "prefill_bound_tok_s": compute.tok_s(), "prefill_fraction_of_bound": compute.tok_s().map(|b| p / b),
                "audited_prefill_tok_s": audit.map(|x| x.0), "audited_decode_tok_s": audit.map(|x| x.1),
                "audit_paired_prefill_ratio": (!paired_prefill.is_empty()).then(|| median_ci(&paired_prefill)),
                "audit_paired_decode_ratio": (!paired_decode.is_empty()).then(|| median_ci(&paired_decode)),
                "long_prompt": interfered.as_ref().map(|i| serde_json::json!({
                    "tokens": a.long_prompt_tokens, "max_batch_tokens": i.max_batch_tokens,
                    "decode_step_ms_before": i.baseline_step_ms, "prefill_steps": i.steps,
                    "decode_step_ms_p50_during": i.step_p50_ms, "decode_step_ms_max_during": i.step_max_ms,
                    "time_to_first_token_s": i.long_ttft_s,
                })),
                "constraint_cost": constraint.iter().map(|c| serde_json::json!({
                    "batch": c.batch, "plain_decode_tok_s": c.plain_decode_tok_s,
                    "constrained_decode_tok_s": c.constrained_decode_tok_s,
                    "on_step_decode_tok_s": c.on_step_decode_tok_s,
                    "on_step_wall_fraction": c.on_step_wall_fraction(),
                    "step_wait_ahead_us": c.step_wait_ahead_us, "step_wait_on_step_us": c.step_wait_on_step_us,
                    "waited_fraction_ahead": c.waited_fraction_of_step().0, "waited_fraction_on_step": c.waited_fraction_of_step().1,
                    "mask_us": c.mask_us, "mask_fraction_of_step": c.mask_fraction_of_step(),
                    "wall_fraction_of_step": c.wall_fraction_of_step(), "compile_ms": c.compile_ms,
                })).collect::<Vec<_>>(),
                "audit_cpu_bound": cpu_bound.as_ref().map(|b| serde_json::json!({
                    "events_per_run": b.events_per_run, "producer_ns_per_event": b.producer_ns_per_event,
                    "writer_cpu_ms_per_run": b.writer_cpu_ms_per_run, "seal_cpu_ms_per_segment": b.seal_cpu_ms_per_segment, "fraction_of_wall": b.fraction_of_wall,
                })),
            })
        );
    } else {
        println!(
            "threads {threads}  prompt {} tokens  gen {} tokens  sequences {}  kv cache {}  (median of {})",
            a.prompt_tokens,
            a.gen_tokens,
            a.batch,
            engine.pool().geometry().kv.name(),
            a.reps
        );
        println!("prefill  {p:8.1} tok/s");
        println!("decode   {d:8.1} tok/s");
        println!(
            "memory bound: {:.1} MB weights + {:.1} MB K/V per step, read at {:.1} GB/s ({threads} threads, measured now) = {:.1} tok/s; decode reaches {:.0} % of it",
            bound.weight_bytes as f64 / 1e6,
            bound.kv_bytes as f64 / 1e6,
            bound.read_gb_s,
            bound.tok_s(a.batch),
            d / bound.tok_s(a.batch) * 100.0
        );
        if let Some(b) = compute.tok_s() {
            println!(
                "compute bound: {:.3} GMAC per prompt token, int8 dot products at {:.1} GMAC/s ({threads} threads, measured now) = {b:.1} tok/s; prefill reaches {:.0} % of it",
                compute.macs_per_token as f64 / 1e9,
                compute.peak_macs_s.unwrap_or_default() / 1e9,
                p / b * 100.0
            );
        }
        println!("tag check: {:.3} % of a decode step", c * 100.0);
        println!(
            "prefix cache on a miss: namespace + chain + lookup {:.1} us for the {}-token prompt ({:.4} % of its prefill); tag checks over shared pages {:.2}x those over own pages",
            machinery.scope_chain_lookup.as_secs_f64() * 1e6,
            a.prompt_tokens,
            machinery.scope_chain_lookup.as_secs_f64() * p / a.prompt_tokens as f64 * 100.0,
            machinery.shared_tag_check_ratio
        );
        if let Some((ap, ad)) = audit {
            println!(
                "audit on: prefill {ap:8.1} tok/s ({:+.2} %), decode {ad:8.1} tok/s ({:+.2} %)",
                (ap / p - 1.0) * 100.0,
                (ad / d - 1.0) * 100.0
            );
            for (what, r) in [("prefill", &paired_prefill), ("decode", &paired_decode)] {
                let (m, lo, hi) = median_ci(r);
                println!(
                    "audit on/off, paired by repetition, {what}: median {:+.2} %  (95 % CI of the median {:+.2} % .. {:+.2} %, n = {})",
                    (m - 1.0) * 100.0,
                    (lo - 1.0) * 100.0,
                    (hi - 1.0) * 100.0,
                    r.len()
                );
            }
        }
        if let Some(i) = &interfered {
            println!(
                "chunked prefill: a {}-token prompt arriving beside {} decoding sequences (max_batch_tokens {}): decode step {:.1} ms before, {:.1} ms median / {:.1} ms max over its {} prefill steps; its first token after {:.2} s",
                a.long_prompt_tokens,
                a.batch,
                i.max_batch_tokens,
                i.baseline_step_ms,
                i.step_p50_ms,
                i.step_max_ms,
                i.steps,
                i.long_ttft_s
            );
        }
        for c in &constraint {
            println!(
                "JSON-schema constraint, {} sequences: decode {:.1} tok/s with masks ahead, {:.1} with masks on the step, vs {:.1} unconstrained ({:+.2} % / {:+.2} % by wall time); the constraint costs the step {:.1} us per token with masks ahead ({:.2} % of a step), {:.1} us with masks on the step ({:.2} %); a mask alone {:.1} us = {:.2} % of a step; compiling the schema {:.1} ms",
                c.batch,
                c.constrained_decode_tok_s,
                c.on_step_decode_tok_s,
                c.plain_decode_tok_s,
                c.wall_fraction_of_step() * 100.0,
                c.on_step_wall_fraction() * 100.0,
                c.step_wait_ahead_us,
                c.waited_fraction_of_step().0 * 100.0,
                c.step_wait_on_step_us,
                c.waited_fraction_of_step().1 * 100.0,
                c.mask_us,
                c.mask_fraction_of_step() * 100.0,
                c.compile_ms
            );
        }
        if let Some(b) = &cpu_bound {
            println!(
                "audit CPU: {:.0} events/run, producer {:.0} ns/event, writer thread {:.2} ms/run = {:.4} % of the audited run's wall time (upper bound on the throughput cost); sealing a segment: {:.1} ms CPU, once per rotation",
                b.events_per_run,
                b.producer_ns_per_event,
                b.writer_cpu_ms_per_run,
                b.fraction_of_wall * 100.0,
                b.seal_cpu_ms_per_segment
            );
        }
    }
    Ok(())
}

/// A decode step's memory-bandwidth bound, from figures measured in the same run: every weight
/// byte is read once per step (for all the batch's sequences together) and every sequence reads
/// its own K/V (both, every layer, in the pool's cache type) up to its position (taken at the
/// middle of the measured decode); the machine streams reads at `read_gb_s` with the
/// benchmark's threads (measured over the weights themselves).
#[derive(Debug)]
pub struct DecodeBound {
    pub weight_bytes: u64,
    /// Per sequence, at the middle of the measured decode.
    pub kv_bytes: u64,
    pub read_gb_s: f64,
}

impl DecodeBound {
    fn measure(engine: &Engine, a: &BenchArgs) -> Self {
        let m = engine.model();
        let geom = engine.pool().geometry();
        let per_token = custody_runtime::kv::PagePool::bytes_per_token(geom, m.config.n_layers);
        Self {
            weight_bytes: m.decode_weight_bytes(),
            kv_bytes: (per_token * (a.prompt_tokens + a.gen_tokens / 2)) as u64,
            read_gb_s: read_bandwidth_gb_s(engine),
        }
    }

    /// Decode tok/s (all sequences together) if every step only waited for its bytes.
    pub fn tok_s(&self, batch: usize) -> f64 {
        let step_bytes = self.weight_bytes as f64 + batch as f64 * self.kv_bytes as f64;
        batch as f64 * self.read_gb_s * 1e9 / step_bytes
    }
}

/// Streaming read bandwidth with the installed pool's threads, GB/s: the best of five passes
/// over the weights a decode step reads (hundreds of MB for served sizes: beyond any cache),
/// each thread summing its share of every matrix — the step's reads without its compute. (Over
/// the model's own resident bytes, so the probe adds nothing to the process's peak memory.)
fn read_bandwidth_gb_s(engine: &Engine) -> f64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    let model = engine.model();
    let mut best = f64::INFINITY;
    let (bytes, sink) = (AtomicU64::new(0), AtomicU64::new(0));
    for _ in 0..5 {
        bytes.store(0, Ordering::Relaxed);
        let t0 = Instant::now();
        custody_runtime::par::run(&|part, parts| {
            let read = model.stream_decode_weights(part, parts);
            bytes.fetch_add(read.bytes, Ordering::Relaxed);
            sink.fetch_add(read.sum, Ordering::Relaxed);
        });
        best = best.min(t0.elapsed().as_secs_f64());
    }
    std::hint::black_box(sink.load(Ordering::Relaxed));
    bytes.load(Ordering::Relaxed) as f64 / best / 1e9
}

/// A prompt's compute bound, from figures measured in the same run: every prompt token costs
/// the layers' multiply-accumulates (at the prompt's mean depth for its attention), and the
/// machine's threads together retire 8-bit multiply-accumulates at most at `peak_macs_s` (the
/// widest dot instruction the kernels use, measured on every benchmark thread at once).
#[derive(Debug)]
pub struct PrefillBound {
    pub macs_per_token: u64,
    /// `None` where the int8 dot-product kernels do not run (no AVX-512 VNNI).
    pub peak_macs_s: Option<f64>,
}

impl PrefillBound {
    fn measure(engine: &Engine, a: &BenchArgs) -> Self {
        let rates = std::sync::Mutex::new(Vec::new());
        custody_runtime::par::run(&|_, _| {
            let r = custody_kernels::simd::int8_dot_peak_macs_per_s(
                std::time::Duration::from_millis(200),
            );
            rates.lock().expect("not poisoned").push(r);
        });
        let rates = rates.into_inner().expect("not poisoned");
        Self {
            macs_per_token: engine.model().prefill_macs_per_token(a.prompt_tokens / 2),
            peak_macs_s: rates.iter().copied().sum::<Option<f64>>(),
        }
    }

    /// Prefill tok/s (all sequences together) if every token only waited for its arithmetic.
    pub fn tok_s(&self) -> Option<f64> {
        self.peak_macs_s.map(|p| p / self.macs_per_token as f64)
    }
}

/// CPU that auditing adds to a generation, counted rather than inferred from a noisy
/// throughput difference: events recorded per run × the producer-side cost of one `record`
/// (measured here on the same mix the writer benchmark uses) + the writer thread's own CPU time
/// (schedstat, includes its fsyncs) while the generation runs. Divided by the audited run's wall
/// time this bounds the throughput cost from above: it assumes every audit nanosecond lands on
/// the critical path, although the writer runs on its own thread. Sealing (Parquet, zstd,
/// SHA-256, Ed25519 digest) happens once per segment rotation, not per run; the benchmark seals
/// one segment per run and reports that cost separately.
#[derive(Debug)]
pub struct AuditCpuBound {
    pub events_per_run: f64,
    pub producer_ns_per_event: f64,
    pub writer_cpu_ms_per_run: f64,
    pub seal_cpu_ms_per_segment: f64,
    pub fraction_of_wall: f64,
}

pub fn audit_cpu_bound(runs: &[(u64, f64, f64, f64)], scratch: &Path) -> Result<AuditCpuBound> {
    assert!(!runs.is_empty());
    let n = runs.len() as f64;
    let events_per_run = runs.iter().map(|r| r.0 as f64).sum::<f64>() / n;
    let writer_cpu_s = runs.iter().map(|r| r.1).sum::<f64>() / n;
    let seal_cpu_s = runs.iter().map(|r| r.2).sum::<f64>() / n;
    let wall_s = runs.iter().map(|r| r.3).sum::<f64>() / n;
    let _ = std::fs::remove_dir_all(scratch);
    let key = custody_audit::digest::generate_key()?;
    let w = custody_audit::writer::AuditWriter::open(custody_audit::writer::WriterConfig::new(
        scratch, 0, key,
    ))?;
    let t0 = Instant::now();
    let recorded = crate::audit::record_mix(&w, 200_000)?;
    let producer_s = t0.elapsed().as_secs_f64() / recorded as f64;
    w.close()?;
    let _ = std::fs::remove_dir_all(scratch);
    Ok(AuditCpuBound {
        events_per_run,
        producer_ns_per_event: producer_s * 1e9,
        writer_cpu_ms_per_run: writer_cpu_s * 1e3,
        seal_cpu_ms_per_segment: seal_cpu_s * 1e3,
        fraction_of_wall: (events_per_run * producer_s + writer_cpu_s) / wall_s,
    })
}

/// The tag check's share of a decode step: the checks one decode step of one sequence performs
/// over `ctx` slots (the kernel's own benchmark of `check_tags`) against the measured step time.
fn tag_check_cost(engine: &Engine, ctx: usize, step_s: f64) -> f64 {
    let ps = engine.pool().page_size();
    let layers = engine.model().config.n_layers;
    let check = custody_kernels::attention::bench_decode_step_tag_checks(ctx, ps, layers, 200);
    check.as_secs_f64() / step_s
}

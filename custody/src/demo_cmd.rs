//! `custody demo`: the main job, end to end, in a few minutes on a laptop-class CPU.
//!
//! A prefill and a decode node (real gRPC control plane and real `tcp` KV transport on
//! loopback, in this process) serve the same short multi-tenant workload twice, each run
//! recorded into its own audit root (Parquet, digest-chained):
//! 1. **protected** — `configs/disagg-{prefill,decode}.toml`, every protection on;
//! 2. **incident** — `configs/incident{-prefill,}.toml` with `--unsafe-reproduction` armed: the
//!    pools cannot hold one context, an over-length prompt is "rejected" by truncation and flows
//!    on, the tag check and checksum are off — the incident's faults, on purpose.
//!
//! Then, from the audit files alone, it prints both exposure summaries (zero vs the reproduced
//! leak) and writes a compliance report per run.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use clap::Args;
use custody_runtime::config::UnsafeReproduction;
use custody_runtime::disagg::client::{Pair, PairOptions};
use custody_runtime::{Engine, GenerateRequest, Model, SamplingParams, Tokenizer};

use crate::config::Config;

#[derive(Args, Debug)]
pub(crate) struct DemoArgs {
    /// Output directory: `<out>/{protected,incident}/audit` and the two reports.
    #[arg(long, default_value = "demo-out")]
    out: PathBuf,
    /// GGUF model (default: the embedded SmolLM2-135M-Instruct, fetched by scripts/fetch-model.sh).
    #[arg(long)]
    model: Option<PathBuf>,
    /// Directory holding disagg-prefill.toml, disagg-decode.toml, incident-prefill.toml and
    /// incident.toml.
    #[arg(long, default_value = "configs")]
    configs: PathBuf,
    /// Tokens generated per request.
    #[arg(long, default_value_t = 8)]
    max_tokens: usize,
}

/// One request of the workload.
struct Job {
    tenant: &'static str,
    what: String,
    prompt: Vec<u32>,
}

/// The workload: tenant A's confidential memos, tenant C's ordinary questions, then tenant B's
/// long document — 400 tokens, longer than the incident's prefill pool (272 tokens).
fn workload(tok: &Tokenizer) -> Result<Vec<Job>> {
    let mut jobs = Vec::new();
    for k in 0..3usize {
        let text = format!(
            "CONFIDENTIAL memo {k} for tenant A. Account numbers: {}. The merger with company {} \
             closes on day {}. Do not share the board's position on the {} acquisition, the \
             salary bands {}, or the password hint {}. ",
            (0..12)
                .map(|i| format!("{}", 100_000 + 7919 * (k * 12 + i)))
                .collect::<Vec<_>>()
                .join(", "),
            ["Northwind", "Globex", "Initech"][k],
            11 + k,
            ["Acme", "Umbrella", "Hooli"][k],
            (0..8)
                .map(|i| format!("L{i}={}", 50 + 13 * (k + i)))
                .collect::<Vec<_>>()
                .join(" "),
            ["blue heron", "red fox", "green owl"][k],
        );
        jobs.push(Job {
            tenant: "tenant-a",
            what: format!("confidential memo {k}"),
            prompt: tok.encode(&text, true)?,
        });
    }
    for q in [
        "What is the capital of France?",
        "Give me three tips for writing clear emails.",
    ] {
        jobs.push(Job {
            tenant: "tenant-c",
            what: format!("{q:?}"),
            prompt: tok.encode(q, true)?,
        });
    }
    let long: Vec<u32> = (0..400u32).map(|i| 1000 + (i * 37) % 5000).collect();
    jobs.push(Job {
        tenant: "tenant-b",
        what: "a 400-token document".into(),
        prompt: long,
    });
    Ok(jobs)
}

/// The demo's log file in `--out`: the nodes' log lines go there, not between its progress lines
/// (unless `RUST_LOG` or `CUSTODY_LOG` asks for them on stderr).
pub(crate) const LOG_FILE: &str = "demo.log";

/// The log file for `custody demo` (`<out>/demo.log`, created), or `None` when it cannot be made
/// (the logs then stay on stderr).
pub(crate) fn log_file(a: &DemoArgs) -> Option<std::fs::File> {
    std::fs::create_dir_all(&a.out).ok()?;
    std::fs::File::create(a.out.join(LOG_FILE)).ok()
}

/// What the incident run arms, said once in the demo's own output (the nodes' ERROR lines about
/// it go to the log file).
const UNSAFE_WORDS: &str = "      UNSAFE on purpose: this run recreates the incident. The nodes' KV pools are too small \
for one context, an over-length prompt is truncated instead of rejected, and the page tag check \
and transfer checksum are off, so one tenant's response can be computed from another's pages. \
Never run a real node with --unsafe-reproduction.";

struct Run {
    name: &'static str,
    prefill_cfg: &'static str,
    decode_cfg: &'static str,
    armed: bool,
}

const RUNS: [Run; 2] = [
    Run {
        name: "protected",
        prefill_cfg: "disagg-prefill.toml",
        decode_cfg: "disagg-decode.toml",
        armed: false,
    },
    Run {
        name: "incident",
        prefill_cfg: "incident-prefill.toml",
        decode_cfg: "incident.toml",
        armed: true,
    },
];

pub(crate) fn demo(a: DemoArgs) -> Result<()> {
    // Both nodes' engine threads compute on one pool of every core.
    crate::common::set_default_pool(0)?;
    let t_start = Instant::now();
    let model_path = a
        .model
        .clone()
        .unwrap_or_else(custody_runtime::config::default_model_path);
    if !model_path.exists() {
        bail!(
            "model not found at {}: run scripts/fetch-model.sh or pass --model PATH",
            model_path.display()
        );
    }
    let load =
        || Model::load(&model_path).with_context(|| format!("loading {}", model_path.display()));
    let model = load()?;
    let fingerprint = model.gguf().sha256_hex();
    let tok = Tokenizer::from_gguf(model.gguf())?;
    let jobs = workload(&tok)?;
    std::fs::create_dir_all(&a.out).with_context(|| format!("creating {}", a.out.display()))?;
    println!(
        "custody demo: {} requests from 3 tenants, served twice by a prefill/decode pair on loopback (model {}, sha256 {}…)\n",
        jobs.len(),
        model_path
            .file_name()
            .map_or_else(String::new, |n| n.to_string_lossy().into_owned()),
        &fingerprint[..12]
    );
    println!("(the nodes' logs: {})\n", a.out.join(LOG_FILE).display());
    let mut summaries = Vec::new();
    for (i, run) in RUNS.iter().enumerate() {
        println!(
            "[{}/2] {} run ({} + {}{})",
            i + 1,
            run.name,
            run.prefill_cfg,
            run.decode_cfg,
            if run.armed {
                ", --unsafe-reproduction: the incident's faults armed on purpose"
            } else {
                ", every protection on"
            }
        );
        if run.armed {
            println!("{UNSAFE_WORDS}");
        }
        let root = a.out.join(run.name).join("audit");
        serve(run, &root, &a, &jobs, &fingerprint, load)?;
        let (summary, report) = forensics(&root, &a.out.join(format!("report-{}.html", run.name)))?;
        println!("      exposure (from the audit files alone): {summary}");
        println!("      compliance report: {}\n", report.display());
        summaries.push((run.name, summary));
    }
    println!("== exposure summaries ==");
    for (name, s) in &summaries {
        println!("{name:>10}: {s}");
    }
    println!(
        "\nThe same workload leaked nothing with the protections on; with the incident's faults \
         armed, the audit log names every affected response, whose data it was, and how much. \
         Explore: custody query {}/incident/audit   ({:.0} s in all)",
        a.out.display(),
        t_start.elapsed().as_secs_f64()
    );
    Ok(())
}

fn serve(
    run: &Run,
    root: &Path,
    a: &DemoArgs,
    jobs: &[Job],
    fingerprint: &str,
    load: impl Fn() -> Result<Model>,
) -> Result<()> {
    if root.exists() {
        std::fs::remove_dir_all(root).with_context(|| format!("clearing {}", root.display()))?;
    }
    let key = custody_audit::digest::generate_key()?;
    let mut engines = Vec::new();
    let mut writers = Vec::new();
    let mut unsafe_all = UnsafeReproduction::default();
    for (node, (file, role)) in [(run.prefill_cfg, "prefill"), (run.decode_cfg, "decode")]
        .into_iter()
        .enumerate()
    {
        let path = a.configs.join(file);
        let cfg = Config::load(&path).with_context(|| format!("loading {}", path.display()))?;
        let unsafe_ = cfg.armed_switches(run.armed);
        let mut engine = Engine::new_with_unsafe(load()?, cfg.engine.clone(), &unsafe_)
            .with_context(|| format!("starting the {role} engine from {}", path.display()))?;
        engine.set_release_fill(cfg.disagg.release_fill);
        let w = Arc::new(custody_audit::writer::AuditWriter::open(
            custody_audit::writer::WriterConfig::new(root, node as u32 + 1, key.clone()),
        )?);
        engine = engine.with_audit(w.clone());
        custody_runtime::disagg::node::record_start(&mut engine, role, fingerprint, &unsafe_);
        println!(
            "      {role} node {}: context {} tokens, pool {} tokens{}",
            node + 1,
            engine.context_length(),
            engine.pool().n_pages() * engine.pool().page_size(),
            if unsafe_.any() {
                format!(", UNSAFE: {}", unsafe_.names().join(", "))
            } else {
                String::new()
            }
        );
        unsafe_all = unsafe_;
        engines.push(engine);
        writers.push(w);
    }
    let de = engines.pop().context("decode engine")?;
    let pe = engines.pop().context("prefill engine")?;
    let fleet = custody_runtime::disagg::tls::Fleet::new("custody demo fleet", 2)?;
    let opts = PairOptions::loopback(fingerprint, unsafe_all, Some(Arc::new(fleet)));
    let pair = Pair::start(pe, de, opts).context("starting the prefill/decode pair")?;
    for (n, job) in jobs.iter().enumerate() {
        let t0 = Instant::now();
        let req = GenerateRequest {
            decoding: Default::default(),
            prompt: job.prompt.clone(),
            max_tokens: a.max_tokens,
            sampling: SamplingParams::default(),
            stop_ids: vec![],
            tenant: job.tenant.into(),
            cache: None,
        };
        let outcome = match pair.generate(&req) {
            Ok(g) => format!(
                "{} tokens, time to first token {:.0} ms",
                g.tokens.len(),
                g.ttft.as_secs_f64() * 1e3
            ),
            Err(s) => format!("refused: {}", s.message()),
        };
        println!(
            "      [{}/{}] {} sends {} ({} tokens) → {outcome} ({:.1} s)",
            n + 1,
            jobs.len(),
            job.tenant,
            job.what,
            job.prompt.len(),
            t0.elapsed().as_secs_f64()
        );
    }
    drop(pair);
    for w in writers {
        w.close().context("sealing the audit log")?;
    }
    Ok(())
}

/// The exposure summary and the compliance report, from the sealed files alone.
fn forensics(root: &Path, report: &Path) -> Result<(String, PathBuf)> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    let (summary, html) = rt.block_on(async {
        let vs = custody_query::session_over_verified(root, None).await?;
        if !vs.report.ok() {
            bail!("the audit log did not verify: {:?}", vs.report.problems);
        }
        custody_query::prepare_forensics(&vs.ctx).await?;
        let e = custody_query::forensics::exposure(&vs.ctx, None, None).await?;
        let scope = custody_query::report::ReportScope {
            root: root.display().to_string(),
            from_ns: None,
            to_ns: None,
            generated_ns: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos() as i64),
        };
        let html = custody_query::report::render(&vs, &scope).await?;
        Ok((custody_query::report::one_line(&e), html))
    })?;
    std::fs::write(report, html).with_context(|| format!("writing {}", report.display()))?;
    Ok((summary, report.to_owned()))
}

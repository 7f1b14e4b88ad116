//! `custody`: a thin binary over the Custody crates. `main → try_main`; exit code 0 on success,
//! 1 on any error (printed as a chain to stderr), 2 on usage errors (clap).

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use clap::{Args, Parser, Subcommand};
use custody_runtime::engine::{Event, GenerateRequest};
use custody_runtime::tokenizer::StreamDecoder;
use custody_runtime::{ChatMessage, Config, Engine, Model, SamplingParams, Tokenizer};

#[cfg(feature = "forensics")]
mod demo_cmd;
mod disagg_cmd;
mod probe_cmd;
#[cfg(feature = "forensics")]
mod query_cmd;
mod serve_cmd;
mod synth_cmd;

#[derive(Parser, Debug)]
#[command(
    name = "custody",
    version,
    about = "Multi-tenant LLM inference with integrity-tagged, audited KV pages"
)]
struct Cli {
    /// More log output on stderr: -v info, -vv debug, -vvv trace (default: warn; the servers,
    /// nodes and the probe: info). `RUST_LOG` / `CUSTODY_LOG` override it.
    #[arg(short, long, action = clap::ArgAction::Count, global = true)]
    verbose: u8,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Generate a completion and stream it to stdout.
    Generate(GenerateArgs),
    /// Serve the OpenAI-compatible HTTP API (a colocated engine, or in front of a pair)
    ///
    /// By default the engine runs in this process. With `--prefill http://host:port` (or
    /// `[serve] prefill`) the server fronts a disaggregated prefill/decode pair instead: the
    /// pair runs the engines and keeps the audit logs, this process authenticates, limits,
    /// streams, and checks the pair's output against a colocated reference (the canary).
    ///
    /// Endpoints: POST /v1/chat/completions and /v1/completions (streaming over SSE or whole;
    /// usage, finish_reason, stop, max_tokens, temperature, top_p, seed), GET /v1/models,
    /// GET /health, GET /metrics (Prometheus text).
    ///
    /// Tenants are configured in `[[serve.tenants]]` with the SHA-256 of each API key
    /// (`custody serve hash-key`), a concurrency limit and a token budget per minute. The
    /// tenant id is recorded with every audit event of its requests. Every response carries
    /// `x-request-id: req-<node>-<n>`, where `n` is the `request` column of the audit tables on
    /// that node (`custody forensics request --node <node> <n>`); requests refused before
    /// admission get `refused-<node>-<n>` and appear only in the server's log.
    ///
    /// Errors use OpenAI's JSON error body: 400 malformed or over-length (nothing is computed
    /// or stored for it), 401 bad key, 404 unknown model, 429 over a tenant limit, 503 when
    /// the audit log cannot keep up, the engine queue is full, or the server is draining.
    ///
    /// At start-up the server measures prefill throughput and computes golden-prompt reference
    /// outputs; a background canary re-runs them through the serving path every
    /// `canary_interval_s` and exports the result (metric `custody_canary_ok`, audit event
    /// `node_events` kind `canary`). SIGINT/SIGTERM: refuse new work, let in-flight requests
    /// finish (up to `drain_timeout_s`, then they are aborted), then seal the audit log.
    /// See configs/single-node.toml ([serve], documented) and configs/serve-demo.toml.
    #[command(verbatim_doc_comment)]
    Serve(serve_cmd::ServeArgs),
    /// Check a running server's output against a colocated reference, token for token
    ///
    /// Loads the model locally, runs the golden prompts greedy (each alone), sends the same
    /// prompts to the server's /v1/completions (greedy, as token ids) — or, with --prefill, to
    /// a disaggregated pair's front door — and compares the output token ids. Exit code 0 when
    /// every prompt matches, 1 otherwise.
    #[command(verbatim_doc_comment)]
    Validate(serve_cmd::ValidateArgs),
    /// Measure prefill and decode throughput (tokens/s) and the cost of the tag check.
    Bench(BenchArgs),
    /// The audit log: keys, verification, writer benchmark, synthetic log at scale.
    #[command(subcommand)]
    Audit(AuditCmd),
    /// Run a prefill node: the front door of a disaggregated pair
    ///
    /// Admits requests, reserves pages on the decode node, computes prompt KV and writes it
    /// into the decode node's pages over the KV transport, then relays decode's tokens. Config:
    /// `[disagg]`, `[engine]`, `[audit]`, `[unsafe_reproduction]` (see
    /// configs/disagg-prefill.toml).
    Prefill(disagg_cmd::RoleArgs),
    /// Run a decode node: verifies every transferred page, then generates
    ///
    /// Reserves pages for prefilled requests, verifies every transferred page (in-band tag and
    /// checksum) before reading it, and generates. See configs/disagg-decode.toml.
    Decode(disagg_cmd::RoleArgs),
    /// Benchmark the disaggregated path against references measured in the same run
    ///
    /// KV transfer on loopback vs memcpy (with and without checksum), time to first token and
    /// decode tok/s disaggregated vs colocated, and the cost of zero/canary fill on release.
    BenchDisagg(disagg_cmd::BenchDisaggArgs),
    /// The eBPF witness: record a process's KV transfers from outside it (needs root)
    ///
    /// Attaches uprobes to the KV transport's probe points (and libibverbs' control path where
    /// used) of a running process or an executable, and records every posted work request,
    /// completion and registration into an audit root (`rdma_ops`, `rdma_mr`) as the observing
    /// host's node — an independent record that `custody forensics crosscheck` compares with
    /// the engine's. Needs root (CAP_BPF, CAP_PERFMON).
    Probe(probe_cmd::ProbeArgs),
    /// SQL over an audit root (only files a verified digest chain names)
    ///
    /// `-c SQL`, `-f FILE`, or an interactive prompt (`\d`, `\d table`, `\q`). Files that no
    /// verified digest names are not read (the tool says so).
    #[cfg(feature = "forensics")]
    Query(query_cmd::QueryArgs),
    /// Canned forensic questions over an audit root (--show-sql prints each one's SQL)
    #[cfg(feature = "forensics")]
    #[command(subcommand)]
    Forensics(query_cmd::ForensicsCmd),
    /// The compliance report: one self-contained HTML file
    ///
    /// Inline SVG charts, no network: requests and tokens per tenant over time, integrity
    /// violations and prevented exposures, transfer outcomes, latency distribution, the audit
    /// log's own verification, and the exposure summary.
    #[cfg(feature = "forensics")]
    Report(query_cmd::ReportArgs),
    /// The main job: the incident, prevented and then reproduced, and its forensics
    ///
    /// A prefill/decode pair on loopback serves a multi-tenant workload with every protection
    /// on, then again with the incident's faults armed (`configs/incident*.toml`,
    /// `--unsafe-reproduction`); prints both exposure summaries from the audit files alone and
    /// writes a compliance report per run.
    #[cfg(feature = "forensics")]
    Demo(demo_cmd::DemoArgs),
}

#[derive(Subcommand, Debug)]
enum AuditCmd {
    /// Create an Ed25519 signing key (hex seed, mode 0600) and its public key (`<out>.pub`).
    Keygen {
        #[arg(long)]
        out: PathBuf,
    },
    /// Verify the digest chain and every sealed file under an audit root. Exit code 1 on any
    /// problem.
    Verify {
        root: PathBuf,
        /// Expected public key (hex file from `keygen`); default: trust the key in the first digest.
        #[arg(long)]
        public_key: Option<PathBuf>,
        /// Only digests sealed at or after this UTC time (`YYYY-MM-DD` or `YYYY-MM-DDTHH:MM:SSZ`).
        #[arg(long)]
        from: Option<String>,
        /// Only digests sealed before this UTC time.
        #[arg(long)]
        to: Option<String>,
    },
    /// Generate a realistic synthetic log (many tenants, long contexts, page reuse) through the
    /// real writers, with injected exposures whose answers go to `<out>/synth-truth.json`.
    Synth(synth_cmd::SynthArgs),
    /// Writer throughput (events/s on one core) and bytes per event on disk for a realistic mix.
    Bench {
        #[arg(long, default_value_t = 2_000_000)]
        events: u64,
        #[arg(long)]
        dir: Option<PathBuf>,
        /// The eBPF witness's mix instead (`rdma_ops` rows: per page, three posted work requests
        /// and two completions), handed over as columns in batches as its collector does, into
        /// one segment sealed at the end (the live segment's and the sealing's cost apart).
        #[arg(long)]
        witness: bool,
    },
}

/// Audit options shared by commands that run the engine.
#[derive(Args, Debug)]
pub(crate) struct AuditArgs {
    /// Record every page event into this audit root (Parquet); requires --audit-key.
    #[arg(long)]
    audit_dir: Option<PathBuf>,
    /// Ed25519 signing key for the digest chain (`custody audit keygen`).
    #[arg(long)]
    audit_key: Option<PathBuf>,
    /// Node id recorded in the audit log.
    #[arg(long, default_value_t = 0)]
    node: u32,
}

#[derive(Args, Debug)]
pub(crate) struct Common {
    /// GGUF model (any Llama-family model); default: config's model.path, else the embedded one.
    #[arg(long)]
    model: Option<PathBuf>,
    /// Node configuration (TOML).
    #[arg(long)]
    config: Option<PathBuf>,
    /// Compute threads (0 = the config's, else all cores).
    #[arg(long, default_value_t = 0)]
    threads: usize,
}

#[derive(Args, Debug)]
pub(crate) struct GenerateArgs {
    #[command(flatten)]
    common: Common,
    /// The prompt text.
    #[arg(long)]
    prompt: String,
    /// Wrap the prompt as a user message in the model's chat template.
    #[arg(long)]
    chat: bool,
    /// System message (with --chat).
    #[arg(long)]
    system: Option<String>,
    #[arg(long, default_value_t = 128)]
    max_tokens: usize,
    /// 0 = greedy.
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    #[arg(long, default_value_t = 0)]
    top_k: usize,
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    #[command(flatten)]
    audit: AuditArgs,
    /// Send the request to a prefill node's front door (`http://host:port`) instead of running
    /// the model in this process (the model file is still read, for the tokenizer).
    #[arg(long)]
    prefill: Option<String>,
    /// Tenant id recorded with the request (with --prefill).
    #[arg(long, default_value = "cli")]
    tenant: String,
}

#[derive(Args, Debug)]
struct BenchArgs {
    #[command(flatten)]
    common: Common,
    /// Prompt length (tokens) for the prefill measurement.
    #[arg(long, default_value_t = 512)]
    prompt_tokens: usize,
    /// Decode steps measured after the prefill.
    #[arg(long, default_value_t = 128)]
    gen_tokens: usize,
    /// Repetitions; the median is reported.
    #[arg(long, default_value_t = 3)]
    reps: usize,
    /// JSON file with the prompt ids (a list, or an object with `all_ids`); default: a built-in
    /// text repeated to length.
    #[arg(long)]
    prompt_ids: Option<PathBuf>,
    /// Print one JSON object instead of text.
    #[arg(long)]
    json: bool,
    /// Also run every repetition with the audit writer recording (to a temporary directory) and
    /// report the throughput ratio, audit on vs off, measured in the same run.
    #[arg(long)]
    audit_cost: bool,
    /// With --audit-cost: fsync the live segment at most this often (0 = after every batch).
    #[arg(long, default_value_t = 0)]
    audit_fsync_interval_ms: u64,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    init_logging(&cli);
    match try_main(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// Logs go to stderr (stdout is the command's output), without escape codes when stderr is not
/// a terminal. Level: `RUST_LOG` or `CUSTODY_LOG` if set; else `-v` counted up from the
/// command's default — warn for interactive commands, info for the long-running servers,
/// nodes and probe (their logs are their output).
fn init_logging(cli: &Cli) {
    use std::io::IsTerminal;
    const LEVELS: [&str; 5] = ["error", "warn", "info", "debug", "trace"];
    let daemon = matches!(
        cli.cmd,
        Cmd::Serve(_) | Cmd::Prefill(_) | Cmd::Decode(_) | Cmd::Probe(_)
    );
    let base = if daemon { 2 } else { 1 };
    let level = LEVELS[(base + usize::from(cli.verbose)).min(LEVELS.len() - 1)];
    let filter = tracing_subscriber::EnvFilter::try_from_env("RUST_LOG")
        .or_else(|_| tracing_subscriber::EnvFilter::try_from_env("CUSTODY_LOG"))
        .unwrap_or_else(|_| level.into());
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .with_env_filter(filter)
        .init();
}

fn try_main(cli: Cli) -> Result<()> {
    match cli.cmd {
        Cmd::Generate(a) => generate(a),
        Cmd::Serve(a) => serve_cmd::serve(a),
        Cmd::Validate(a) => serve_cmd::validate(a),
        Cmd::Bench(a) => bench(a),
        Cmd::Audit(a) => audit_cmd(a),
        Cmd::Prefill(a) => disagg_cmd::prefill(a),
        Cmd::Decode(a) => disagg_cmd::decode(a),
        Cmd::BenchDisagg(a) => disagg_cmd::bench_disagg(a),
        Cmd::Probe(a) => probe_cmd::probe(a),
        #[cfg(feature = "forensics")]
        Cmd::Query(a) => query_cmd::query(a),
        #[cfg(feature = "forensics")]
        Cmd::Forensics(c) => query_cmd::forensics_cmd(c, parse_utc),
        #[cfg(feature = "forensics")]
        Cmd::Report(a) => query_cmd::report_cmd(a, parse_utc),
        #[cfg(feature = "forensics")]
        Cmd::Demo(a) => demo_cmd::demo(a),
    }
}

/// The audit writer from flags, falling back to the config's `[audit]` section.
pub(crate) fn open_audit(
    a: &AuditArgs,
    cfg_path: Option<&Path>,
) -> Result<Option<std::sync::Arc<custody_audit::writer::AuditWriter>>> {
    use custody_audit::writer::{Backpressure, FsyncPolicy, WriterConfig};
    let conf = match cfg_path {
        Some(p) => Config::load(p)?.audit,
        None => custody_runtime::config::AuditSection::default(),
    };
    let Some(dir) = a.audit_dir.clone().or(conf.dir) else {
        return Ok(None);
    };
    let key_path = a.audit_key.clone().or(conf.key).context(
        "an audit directory needs a signing key: --audit-key or [audit] key (create one with `custody audit keygen`)",
    )?;
    let key = custody_audit::digest::read_signing_key(&key_path).map_err(anyhow::Error::msg)?;
    let node = if a.node != 0 { a.node } else { conf.node };
    let mut cfg = WriterConfig::new(&dir, node, key);
    cfg.fsync = match conf.fsync_interval_ms {
        0 => FsyncPolicy::EveryBatch,
        ms => FsyncPolicy::Interval(std::time::Duration::from_millis(ms)),
    };
    if conf.allow_drop {
        tracing::warn!(
            "audit allow_drop is on: events may be dropped under load (each drop is counted in the log)"
        );
        cfg.backpressure = Backpressure::AllowDrop;
    }
    let w = custody_audit::writer::AuditWriter::open(cfg)
        .with_context(|| format!("opening audit log {}", dir.display()))?;
    Ok(Some(std::sync::Arc::new(w)))
}

/// `YYYY-MM-DD` or `YYYY-MM-DDTHH:MM:SSZ` (UTC) → Unix nanoseconds.
fn parse_utc(s: &str) -> Result<i64> {
    let bad =
        || anyhow::anyhow!("invalid time {s:?}: use YYYY-MM-DD or YYYY-MM-DDTHH:MM:SSZ (UTC)");
    let (date, time) = s.split_once('T').unwrap_or((s, "00:00:00Z"));
    let d: Vec<i64> = date
        .split('-')
        .map(|x| x.parse().map_err(|_| bad()))
        .collect::<Result<_>>()?;
    let t: Vec<i64> = time
        .trim_end_matches('Z')
        .split(':')
        .map(|x| x.parse().map_err(|_| bad()))
        .collect::<Result<_>>()?;
    let [y, m, dd] = <[i64; 3]>::try_from(d).map_err(|_| bad())?;
    let [hh, mm, ss] = <[i64; 3]>::try_from(t).map_err(|_| bad())?;
    // days from civil (proleptic Gregorian)
    let y2 = if m <= 2 { y - 1 } else { y };
    let era = y2.div_euclid(400);
    let yoe = y2 - era * 400;
    let doy = (153 * (if m > 2 { m - 3 } else { m + 9 }) + 2) / 5 + dd - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    Ok((days * 86_400 + hh * 3600 + mm * 60 + ss) * 1_000_000_000)
}

fn audit_cmd(a: AuditCmd) -> Result<()> {
    use custody_audit::digest;
    match a {
        AuditCmd::Keygen { out } => {
            let key = digest::generate_key().context("reading /dev/urandom")?;
            let pub_path = digest::write_key(&key, &out)
                .with_context(|| format!("writing {}", out.display()))?;
            println!(
                "signing key: {}\npublic key:  {}",
                out.display(),
                pub_path.display()
            );
            Ok(())
        }
        AuditCmd::Verify {
            root,
            public_key,
            from,
            to,
        } => {
            let key = public_key
                .as_deref()
                .map(digest::read_verifying_key)
                .transpose()
                .map_err(anyhow::Error::msg)?;
            let from = from.as_deref().map(parse_utc).transpose()?;
            let to = to.as_deref().map(parse_utc).transpose()?;
            if !root.is_dir() {
                bail!("audit root {} is not a directory", root.display());
            }
            let r = digest::verify(&root, key.as_ref(), from, to);
            if key.is_none() {
                eprintln!(
                    "note: no --public-key given; signatures were checked against the key named in each node's first digest"
                );
            }
            println!("valid digests: {}", r.valid_digests);
            println!("valid files:   {}", r.valid_files);
            for p in &r.live_segments {
                println!(
                    "unsealed live segment (recoverable, not yet covered by a digest): {}",
                    p.display()
                );
            }
            for p in &r.problems {
                println!("FAIL: {p}");
            }
            if r.ok() {
                println!("audit log verified: OK");
                Ok(())
            } else {
                println!(
                    "audit log verification FAILED: {} problem(s)",
                    r.problems.len()
                );
                std::process::exit(1);
            }
        }
        AuditCmd::Bench {
            events,
            dir,
            witness,
        } => audit_bench(events, dir, witness),
        AuditCmd::Synth(a) => synth_cmd::synth(a),
    }
}

/// Record `events` (at least; whole batches) of the eBPF witness's rows for 16-page transfers:
/// per page three posted work requests and two completions, in `record_all` batches of 256.
fn record_witness_mix(w: &custody_audit::writer::AuditWriter, events: u64) -> Result<u64> {
    use custody_audit::{AuditSink, RdmaOp, RdmaOpRows};
    const BATCH: usize = 256;
    let mut n = 0u64;
    let mut page = 0u64;
    let mut batch = RdmaOpRows::with_capacity(BATCH + 5);
    while n < events {
        page += 1;
        let ts = custody_audit::mono_now_ns();
        let wr_id = ((page / 16) << 16) | (page % 16);
        let base = 0x7f00_0000_0000 + (page % 4096) * 361_536;
        for (i, (off, bytes)) in [(0u64, 175_104u64), (175_104, 175_104), (0, 48)]
            .into_iter()
            .enumerate()
        {
            batch.push(RdmaOp {
                ts_ns: ts,
                ktime_ns: ts + 1_000_000,
                pid: 4242,
                tid: 4243,
                op: "post_write",
                ctx: (1 << 32) | 1,
                wr_id,
                chain_index: i as u32,
                opcode: u32::from(i == 2),
                flags: if i == 2 { 2 } else { 0 },
                imm: (page % 16) as u32,
                remote_addr: base + off,
                rkey: (page / 16) as u32,
                num_sge: if i == 2 { 1 } else { 30 },
                bytes,
                ..RdmaOp::default()
            });
        }
        for (tid, opcode, bytes) in [(4244u32, 1u32, 48u64), (4245, 129, 48)] {
            batch.push(RdmaOp {
                ts_ns: ts + 20_000,
                ktime_ns: ts + 1_020_000,
                pid: 4242,
                tid,
                op: "complete",
                ctx: (2 << 32) | 1,
                wr_id,
                opcode,
                imm: (page % 16) as u32,
                bytes,
                ..RdmaOp::default()
            });
        }
        n += 5;
        if batch.len() >= BATCH {
            w.record_rdma_ops(std::mem::replace(
                &mut batch,
                RdmaOpRows::with_capacity(BATCH + 5),
            ))?;
        }
    }
    w.record_rdma_ops(batch)?;
    Ok(n)
}

/// Record `events` (at least; whole requests) of the realistic per-request mix the audit
/// benchmarks use: lifecycle, 8 page allocs, 28 write-ahead page writes, 8 run-length reads,
/// 8 releases. Returns the number recorded.
fn record_mix(w: &custody_audit::writer::AuditWriter, events: u64) -> Result<u64> {
    use custody_audit::{AuditSink, Event, PageKind, RequestKind, Writer};
    let mut n = 0u64;
    let mut req = 0u64;
    let tenants = ["acme", "globex", "initech", "umbrella"];
    while n < events {
        req += 1;
        let tenant: std::sync::Arc<str> = tenants[(req % 4) as usize].into();
        let ts = custody_audit::mono_now_ns();
        let pages: Vec<u32> = (0..8).map(|i| ((req * 8 + i) % 4096) as u32).collect();
        let rec = |ev: Event, n: &mut u64| -> Result<()> {
            w.record(ev).map_err(anyhow::Error::msg)?;
            *n += 1;
            Ok(())
        };
        rec(
            Event::Request {
                ts_ns: ts,
                request: req,
                tenant: tenant.clone(),
                kind: RequestKind::Admitted,
                prompt_tokens: 100,
                output_tokens: 0,
            },
            &mut n,
        )?;
        for &p in &pages {
            rec(
                Event::Page {
                    ts_ns: ts,
                    request: req,
                    tenant: tenant.clone(),
                    page: p,
                    generation: (req % 1000) as u32,
                    kind: PageKind::Alloc,
                },
                &mut n,
            )?;
        }
        for step in 0..28u32 {
            let p = pages[(step as usize * 8 / 28).min(7)];
            let kind = PageKind::Write {
                slot_start: step % 16,
                slot_end: step % 16 + 1,
                writer: Writer::Local,
            };
            rec(
                Event::Page {
                    ts_ns: ts + u64::from(step) * 1000,
                    request: req,
                    tenant: tenant.clone(),
                    page: p,
                    generation: (req % 1000) as u32,
                    kind,
                },
                &mut n,
            )?;
        }
        for &p in &pages {
            rec(
                Event::Read {
                    ts_ns: ts,
                    request: req,
                    tenant: tenant.clone(),
                    page: p,
                    generation: (req % 1000) as u32,
                    slot_start: 0,
                    slot_end: 16,
                    first_step: 1,
                    last_step: 28,
                    verified: true,
                },
                &mut n,
            )?;
            rec(
                Event::Page {
                    ts_ns: ts,
                    request: req,
                    tenant: tenant.clone(),
                    page: p,
                    generation: (req % 1000) as u32,
                    kind: PageKind::Release,
                },
                &mut n,
            )?;
        }
        rec(
            Event::Request {
                ts_ns: ts,
                request: req,
                tenant: tenant.clone(),
                kind: RequestKind::Finished {
                    reason: "length".into(),
                },
                prompt_tokens: 100,
                output_tokens: 28,
            },
            &mut n,
        )?;
    }
    Ok(n)
}

/// Writer throughput and bytes per event: a realistic mix (per request: lifecycle, page allocs,
/// write-ahead records per step, run-length reads, releases), recorded from one producer thread.
fn audit_bench(events: u64, dir: Option<PathBuf>, witness: bool) -> Result<()> {
    use custody_audit::writer::{AuditWriter, FsyncPolicy, WriterConfig};
    let dir = dir.unwrap_or_else(|| {
        std::env::temp_dir().join(format!("custody-audit-bench-{}", std::process::id()))
    });
    if dir.exists() {
        std::fs::remove_dir_all(&dir)?;
    }
    let key = custody_audit::digest::generate_key()?;
    let mut cfg = WriterConfig::new(&dir, 0, key);
    cfg.fsync = FsyncPolicy::Interval(std::time::Duration::from_millis(100));
    if witness {
        // One segment, sealed at the end: the live-segment work and the sealing are measured
        // apart (`writer_live_ns_per_event`, `writer_seal_ns_per_event`).
        cfg.rotate_bytes = u64::MAX;
    }
    let w = AuditWriter::open(cfg)?;
    let t0 = Instant::now();
    let n = if witness {
        record_witness_mix(&w, events)?
    } else {
        record_mix(&w, events)?
    };
    w.sync()?;
    let recorded = t0.elapsed();
    let live_cpu_s = w.writer_cpu_ns() as f64 / 1e9;
    w.close()?;
    let total = t0.elapsed();
    let writer_cpu_s = w.writer_cpu_ns() as f64 / 1e9;
    let bytes = synth_cmd::parquet_bytes(&dir)?;
    let json = serde_json::json!({
        "events": n,
        "record_events_per_s": n as f64 / recorded.as_secs_f64(),
        "sealed_events_per_s": n as f64 / total.as_secs_f64(),
        "writer_thread_cpu_s": writer_cpu_s,
        // With --witness (one segment): the live segment's work and the sealing, apart. Without
        // it, segments rotate every 64 MiB during the run and "live" includes their sealing.
        "writer_live_ns_per_event": live_cpu_s * 1e9 / n as f64,
        "writer_seal_ns_per_event": (writer_cpu_s - live_cpu_s) * 1e9 / n as f64,
        "writer_events_per_cpu_s": if writer_cpu_s > 0.0 { n as f64 / writer_cpu_s } else { 0.0 },
        "parquet_bytes": bytes,
        "bytes_per_event": bytes as f64 / n as f64,
    });
    println!("{json}");
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}

pub(crate) struct Loaded {
    pub(crate) engine: Engine,
    pub(crate) tokenizer: Tokenizer,
    pub(crate) pool: rayon::ThreadPool,
}

pub(crate) fn load(c: &Common, context_override: Option<usize>) -> Result<Loaded> {
    let cfg = match &c.config {
        Some(p) => Config::load(p)?,
        None => Config::default(),
    };
    let path = c
        .model
        .clone()
        .or(cfg.model.path.clone())
        .unwrap_or_else(custody_runtime::config::default_model_path);
    if !path.exists() {
        bail!(
            "model not found at {}: run scripts/fetch-model.sh (the embedded default) or pass --model PATH",
            path.display()
        );
    }
    let threads = if c.threads > 0 {
        c.threads
    } else {
        cfg.engine.threads
    };
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .context("building the compute thread pool")?;
    let t0 = Instant::now();
    let model = Model::load(&path).with_context(|| format!("loading model {}", path.display()))?;
    let tokenizer = Tokenizer::from_gguf(model.gguf())
        .with_context(|| format!("loading tokenizer from {}", path.display()))?;
    let mut ecfg = cfg.engine;
    if let Some(n) = context_override {
        ecfg.context_length = Some(
            ecfg.context_length
                .map_or(n, |c| c.max(n))
                .min(model.config.context_length),
        );
    }
    tracing::info!(
        model = %model.config.name,
        layers = model.config.n_layers,
        dim = model.config.dim,
        heads = model.config.n_heads,
        kv_heads = model.config.n_kv_heads,
        weights = ?model.weight_dtype(),
        threads = pool.current_num_threads(),
        load_ms = t0.elapsed().as_millis() as u64,
        "model loaded"
    );
    let engine = Engine::new(model, ecfg)?;
    Ok(Loaded {
        engine,
        tokenizer,
        pool,
    })
}

fn generate(a: GenerateArgs) -> Result<()> {
    if a.prefill.is_some() {
        return disagg_cmd::generate_remote(a);
    }
    let Loaded {
        mut engine,
        tokenizer,
        pool,
    } = load(&a.common, None)?;
    let audit = open_audit(&a.audit, a.common.config.as_deref())?;
    if let Some(w) = &audit {
        engine = engine.with_audit(w.clone());
    }
    let text = if a.chat {
        let mut msgs = Vec::new();
        if let Some(s) = &a.system {
            msgs.push(ChatMessage {
                role: "system".into(),
                content: s.clone(),
            });
        }
        msgs.push(ChatMessage {
            role: "user".into(),
            content: a.prompt.clone(),
        });
        tokenizer.apply_chat_template(&msgs)?
    } else {
        a.prompt.clone()
    };
    let prompt = tokenizer.encode(&text, false)?;
    let req = GenerateRequest {
        prompt,
        max_tokens: a.max_tokens,
        sampling: SamplingParams {
            temperature: a.temperature,
            top_k: a.top_k,
            top_p: a.top_p,
            seed: a.seed,
        },
        stop_ids: tokenizer.stop_ids.clone(),
        tenant: "cli".into(),
    };
    let n_prompt = req.prompt.len();
    let id = engine.submit(req).context("request rejected")?;
    let t0 = Instant::now();
    let mut first_token_at = None;
    let mut n_gen = 0usize;
    let mut dec = StreamDecoder::default();
    let mut out = std::io::stdout();
    pool.install(|| -> Result<()> {
        while engine.has_work() {
            for ev in engine.step() {
                match ev {
                    Event::Token { id: rid, token } if rid == id => {
                        first_token_at.get_or_insert_with(|| t0.elapsed());
                        n_gen += 1;
                        out.write_all(dec.push(&tokenizer, token)?.as_bytes())?;
                        out.flush()?;
                    }
                    Event::Failed { error, .. } => {
                        bail!("generation failed: integrity error: {error}")
                    }
                    _ => {}
                }
            }
        }
        Ok(())
    })?;
    writeln!(out)?;
    if let Some(w) = audit {
        w.close().context("sealing the audit log")?;
    }
    let total = t0.elapsed();
    let ttft = first_token_at.unwrap_or(total);
    let decode_s = (total - ttft).as_secs_f64();
    eprintln!(
        "[{} prompt tokens, {} generated; prefill {:.1} tok/s, decode {:.1} tok/s]",
        n_prompt,
        n_gen,
        n_prompt as f64 / ttft.as_secs_f64(),
        if n_gen > 1 && decode_s > 0.0 {
            (n_gen - 1) as f64 / decode_s
        } else {
            0.0
        }
    );
    Ok(())
}

/// One prefill of `ids` then `gen_tokens` decode steps: (prefill seconds, decode seconds, steps).
fn bench_once(engine: &mut Engine, ids: &[u32], gen_tokens: usize) -> Result<(f64, f64, usize)> {
    let req = GenerateRequest {
        prompt: ids.to_vec(),
        max_tokens: gen_tokens + 1,
        sampling: SamplingParams::default(),
        stop_ids: Vec::new(),
        tenant: "bench".into(),
    };
    engine.submit(req)?;
    let t0 = Instant::now();
    let ev = engine.step();
    let t_prefill = t0.elapsed().as_secs_f64();
    if !matches!(ev.first(), Some(Event::Token { .. })) {
        bail!("prefill did not complete in one step: {ev:?}");
    }
    let t1 = Instant::now();
    let mut steps = 0;
    while engine.has_work() {
        engine.step();
        steps += 1;
    }
    let t_decode = t1.elapsed().as_secs_f64();
    if steps != gen_tokens {
        bail!("expected {gen_tokens} decode steps, ran {steps}");
    }
    Ok((t_prefill, t_decode, steps))
}

fn read_prompt_ids(path: &Path) -> Result<Vec<u32>> {
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(path)?)
        .with_context(|| format!("parsing {}", path.display()))?;
    let arr = v.get("all_ids").unwrap_or(&v);
    let ids: Vec<u32> =
        serde_json::from_value(arr.clone()).context("prompt ids must be a list of token ids")?;
    Ok(ids)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn bench(a: BenchArgs) -> Result<()> {
    if a.reps == 0 || a.prompt_tokens == 0 || a.gen_tokens == 0 {
        bail!("--reps, --prompt-tokens and --gen-tokens must be positive");
    }
    let Loaded {
        mut engine,
        tokenizer,
        pool,
    } = load(&a.common, Some(a.prompt_tokens + a.gen_tokens + 1))?;
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
    ids.truncate(a.prompt_tokens);
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
                let (tp, td, steps) = bench_once(&mut engine, &ids, a.gen_tokens)?;
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
                    prefill_audit.push(a.prompt_tokens as f64 / tp);
                    decode_audit.push(a.gen_tokens as f64 / td);
                } else {
                    prefill.push(a.prompt_tokens as f64 / tp);
                    decode.push(a.gen_tokens as f64 / td);
                    check_frac.push(tag_check_cost(
                        &engine,
                        a.prompt_tokens + a.gen_tokens / 2,
                        td / steps as f64,
                    ));
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
    let _ = std::fs::remove_dir_all(&audit_dir);
    let audit = (!prefill_audit.is_empty()).then(|| (median(prefill_audit), median(decode_audit)));
    let cpu_bound = if a.audit_cost {
        Some(audit_cpu_bound(&audited_runs, &audit_dir)?)
    } else {
        None
    };
    let (p, d, c) = (median(prefill), median(decode), median(check_frac));
    if a.json {
        println!(
            "{}",
            serde_json::json!({
                "threads": threads, "prompt_tokens": a.prompt_tokens, "gen_tokens": a.gen_tokens,
                "prefill_tok_s": p, "decode_tok_s": d, "tag_check_fraction_of_decode_step": c,
                "simd": format!("{:?}", custody_kernels::simd::level()),
                "audited_prefill_tok_s": audit.map(|x| x.0), "audited_decode_tok_s": audit.map(|x| x.1),
                "audit_paired_prefill_ratio": (!paired_prefill.is_empty()).then(|| median_ci(&paired_prefill)),
                "audit_paired_decode_ratio": (!paired_decode.is_empty()).then(|| median_ci(&paired_decode)),
                "audit_cpu_bound": cpu_bound.as_ref().map(|b| serde_json::json!({
                    "events_per_run": b.events_per_run, "producer_ns_per_event": b.producer_ns_per_event,
                    "writer_cpu_ms_per_run": b.writer_cpu_ms_per_run, "seal_cpu_ms_per_segment": b.seal_cpu_ms_per_segment, "fraction_of_wall": b.fraction_of_wall,
                })),
            })
        );
    } else {
        println!(
            "threads {threads}  prompt {} tokens  gen {} tokens  (median of {})",
            a.prompt_tokens, a.gen_tokens, a.reps
        );
        println!("prefill  {p:8.1} tok/s");
        println!("decode   {d:8.1} tok/s");
        println!("tag check: {:.3} % of a decode step", c * 100.0);
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

/// CPU that auditing adds to a generation, counted rather than inferred from a noisy
/// throughput difference: events recorded per run × the producer-side cost of one `record`
/// (measured here on the same mix the writer benchmark uses) + the writer thread's own CPU time
/// (schedstat, includes its fsyncs) while the generation runs. Divided by the audited run's wall
/// time this bounds the throughput cost from above: it assumes every audit nanosecond lands on
/// the critical path, although the writer runs on its own thread. Sealing (Parquet, zstd,
/// SHA-256, Ed25519 digest) happens once per segment rotation, not per run; the benchmark seals
/// one segment per run and reports that cost separately.
#[derive(Debug)]
struct AuditCpuBound {
    events_per_run: f64,
    producer_ns_per_event: f64,
    writer_cpu_ms_per_run: f64,
    seal_cpu_ms_per_segment: f64,
    fraction_of_wall: f64,
}

fn audit_cpu_bound(runs: &[(u64, f64, f64, f64)], scratch: &Path) -> Result<AuditCpuBound> {
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
    let recorded = record_mix(&w, 200_000)?;
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

/// Median of `v` with a distribution-free 95 % confidence interval (order statistics of the
/// binomial sign test): (median, low, high). With fewer than 6 values the interval is the range.
fn median_ci(v: &[f64]) -> (f64, f64, f64) {
    assert!(!v.is_empty());
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let n = s.len();
    let m = s[n / 2];
    // Largest k with P(Binomial(n, 1/2) < k) <= 2.5 %: the interval is [s[k-1], s[n-k]].
    let mut k = 0usize;
    let mut cdf = 0.0f64;
    let mut c = 1.0f64; // C(n, i)
    let p = 0.5f64.powi(n as i32);
    for i in 0..n {
        if cdf + c * p > 0.025 {
            break;
        }
        cdf += c * p;
        k = i + 1;
        c = c * (n - i) as f64 / (i + 1) as f64;
    }
    if k == 0 {
        (m, s[0], s[n - 1])
    } else {
        (m, s[k - 1], s[n - k])
    }
}

/// The tag check's share of a decode step: time `n_layers` checks of a block table covering
/// `ctx` slots (what one decode step of one sequence performs) against the measured step time.
fn tag_check_cost(engine: &Engine, ctx: usize, step_s: f64) -> f64 {
    use custody_kernels::attention::{PageRef, TagView, check_tags};
    let ps = engine.pool().page_size();
    let n_pages = ctx.div_ceil(ps);
    let generation = vec![1u32; n_pages];
    let owner = vec![7u64; n_pages];
    let filled = vec![ps as u32; n_pages];
    let table: Vec<PageRef> = (0..n_pages as u32)
        .map(|page| PageRef {
            page,
            generation: 1,
        })
        .collect();
    let tags = TagView {
        generation: &generation,
        owner: &owner,
        filled: &filled,
        stamp_owner: &owner,
        stamp_generation: &generation,
    };
    let layers = engine.model().config.n_layers;
    let iters = 200;
    let t0 = Instant::now();
    for _ in 0..iters {
        for _ in 0..layers {
            let r = check_tags(std::hint::black_box(&table), ctx, ps, &tags, 7);
            assert!(r.is_ok());
        }
    }
    t0.elapsed().as_secs_f64() / iters as f64 / step_s
}

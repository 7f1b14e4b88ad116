//! `custody`: a thin binary over the Custody crates — argument parsing and dispatch only; each
//! subcommand lives in its own file (`*_cmd.rs`), the benchmarks in `custody-bench`, what
//! several share in `common.rs`, the audit writer in `audit_open.rs`. `main → try_main`; exit code 0 on success, 1 on any error (printed as
//! a chain to stderr), 2 on usage errors (clap), 3 from `audit verify` when the log is consistent
//! but unauthenticated (no `--public-key`; `--allow-tofu` accepts it).

use std::process::ExitCode;

use anyhow::Result;
use clap::{Parser, Subcommand};

mod audit_cmd;
mod audit_open;
mod bench_cmd;
mod certs_cmd;
#[cfg(feature = "cluster")]
mod cluster_cmd;
mod common;
mod config;
mod cosign_client;
#[cfg(feature = "forensics")]
mod demo_cmd;
mod disagg_cmd;
mod generate_cmd;
mod gpu_check_cmd;
mod node_proofs;
mod probe_cmd;
mod progress;
#[cfg(feature = "forensics")]
mod query_cmd;
mod receipt_cmd;
mod serve_cmd;
mod synth_cmd;
mod witness_cmd;

#[derive(Parser, Debug)]
#[command(
    name = "custody",
    version,
    about = "Multi-tenant LLM inference with integrity-tagged, audited KV pages"
)]
struct Cli {
    /// More logs on stderr: -v info, -vv debug (default warn; servers and nodes info)
    ///
    /// `-v` info, `-vv` debug, `-vvv` trace. The default is warn, except for the long-running
    /// servers, nodes and the probe (info: their logs are their output). `RUST_LOG` or
    /// `CUSTODY_LOG` override it.
    #[arg(short, long, action = clap::ArgAction::Count, global = true)]
    verbose: u8,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Generate a completion and stream it to stdout.
    Generate(generate_cmd::GenerateArgs),
    /// Serve the OpenAI-compatible HTTP API (a colocated engine, or in front of a pair)
    ///
    /// By default the engine runs in this process. With `--prefill http://host:port` (or
    /// `[serve] prefill`) the server fronts a disaggregated prefill/decode pair instead: the
    /// pair runs the engines and keeps the audit logs, this process authenticates, limits,
    /// streams, and checks the pair's output against a colocated reference (the canary).
    ///
    /// Endpoints: POST /v1/chat/completions and /v1/completions (streaming over SSE or whole;
    /// usage, finish_reason, stop, max_tokens, temperature, top_p, seed), GET /v1/models,
    /// GET /health. GET /metrics (Prometheus text: every tenant's counts) only on the
    /// operator's listener, `--metrics-listen` / `[serve] metrics_listen` (127.0.0.1:9464).
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
    Bench(bench_cmd::BenchCmd),
    /// Check the CUDA backend on this machine's GPU against the CPU backend
    ///
    /// Stages: `device` (open it, compile the kernels with NVRTC), `forward` (synthetic models
    /// in every weight type: logits within the stated tolerance, greedy tokens agree where the
    /// margin is clear, two runs identical), `speed` (a ~110 M-weight synthetic model, CPU vs
    /// device). Needs a build with `--features cuda`; `scripts/gpu-check.sh` runs all three.
    #[command(verbatim_doc_comment)]
    GpuCheck(gpu_check_cmd::GpuCheckArgs),
    /// The audit log: keys, verification, writer benchmark, synthetic log at scale.
    #[command(subcommand)]
    Audit(audit_cmd::AuditCmd),
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
    BenchDisagg(custody_bench::disagg::BenchDisaggArgs),
    /// Benchmark the router's decision: ns per routing decision at 1×1 to 64×64 nodes
    ///
    /// The router's own code (registry lock, checks, cache-aware prefill choice, power of two
    /// choices for decode) on synthetic ready nodes; see BENCHMARKS.md for the latency a
    /// request gains through it and the policy's simulated balance at 64×64.
    BenchRouter(custody_bench::router::BenchRouterArgs),
    /// Benchmark KV offload: a follow-up's time to first token served from each tier
    ///
    /// The pool, host memory, local disk (and an object store with --object-url) vs recompute,
    /// each tier's restore bandwidth vs memcpy, and what write-back costs a decoding workload.
    BenchOffload(custody_bench::offload::BenchOffloadArgs),
    /// A fleet's CA and node certificates for mutual TLS between its processes
    ///
    /// Creates (or reuses) `<out>/ca.pem` and `ca.key`, and for each `--node ROLE:ID` a
    /// certificate `<role>-<id>.pem` and key naming `custody-node:<role>:<id>` — what the
    /// nodes' `[tls]` sections point at. Roles: prefill, decode, front (an HTTP server or
    /// client that may assert a tenant to a prefill node).
    #[command(verbatim_doc_comment)]
    Certs(certs_cmd::CertsArgs),
    /// The eBPF witness: record a process's KV transfers from outside it (needs root)
    ///
    /// Attaches uprobes to the KV transport's probe points (and libibverbs' control path where
    /// used) of a running process or an executable, and records every posted work request,
    /// completion and registration into an audit root (`rdma_ops`, `rdma_mr`) as the observing
    /// host's node — an independent record that `custody forensics crosscheck` compares with
    /// the engine's. Needs root (CAP_BPF, CAP_PERFMON).
    Probe(probe_cmd::ProbeArgs),
    /// A transparency-log witness for the nodes' Merkle trees (C2SP tlog-witness): cosigns a
    /// node's checkpoint only if it extends the last one cosigned, keeps split-view evidence
    #[command(subcommand)]
    Witness(witness_cmd::WitnessCmd),
    /// A tenant's receipt (`GET /v1/audit/receipt/{request_id}`), checked offline
    #[command(subcommand)]
    Receipt(receipt_cmd::ReceiptCmd),
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
    /// A Ballista cluster for `custody query|forensics … --cluster df://HOST:PORT`
    ///
    /// One scheduler (port 50050) and any number of executors (ports 50051-50053 by default;
    /// a second one on the same host moves all three). The querying process verifies the digest
    /// chain itself and hands the cluster only the verified files, by name.
    #[cfg(feature = "cluster")]
    #[command(subcommand)]
    Cluster(cluster_cmd::ClusterCmd),
    /// The main job: the incident, prevented and then reproduced, and its forensics
    ///
    /// A prefill/decode pair on loopback serves a multi-tenant workload with every protection
    /// on, then again with the incident's faults armed (`configs/incident*.toml`,
    /// `--unsafe-reproduction`); prints both exposure summaries from the audit files alone and
    /// writes a compliance report per run.
    #[cfg(feature = "forensics")]
    Demo(demo_cmd::DemoArgs),
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
        Cmd::Serve(_)
            | Cmd::Prefill(_)
            | Cmd::Decode(_)
            | Cmd::Probe(_)
            | Cmd::Witness(witness_cmd::WitnessCmd::Serve { .. })
    ) || is_cluster_process(&cli.cmd);
    let base = if daemon { 2 } else { 1 };
    let level = LEVELS[(base + usize::from(cli.verbose)).min(LEVELS.len() - 1)];
    let explicit = tracing_subscriber::EnvFilter::try_from_env("RUST_LOG")
        .or_else(|_| tracing_subscriber::EnvFilter::try_from_env("CUSTODY_LOG"));
    if explicit.is_err()
        && let Some(file) = own_log_file(&cli.cmd)
    {
        // The demo's progress lines alone on the terminal; its nodes' logs (info) in a file.
        tracing_subscriber::fmt()
            .with_writer(std::sync::Mutex::new(file))
            .with_ansi(false)
            .with_env_filter(tracing_subscriber::EnvFilter::new("info"))
            .init();
        return;
    }
    let filter = explicit.unwrap_or_else(|_| level.into());
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .with_env_filter(filter)
        .init();
}

/// A command whose logs go to a file of its own (the demo's), not between its output's lines.
#[cfg(feature = "forensics")]
fn own_log_file(cmd: &Cmd) -> Option<std::fs::File> {
    match cmd {
        Cmd::Demo(a) => demo_cmd::log_file(a),
        _ => None,
    }
}

#[cfg(not(feature = "forensics"))]
fn own_log_file(_: &Cmd) -> Option<std::fs::File> {
    None
}

#[cfg(feature = "cluster")]
fn is_cluster_process(cmd: &Cmd) -> bool {
    matches!(cmd, Cmd::Cluster(_))
}

#[cfg(not(feature = "cluster"))]
fn is_cluster_process(_: &Cmd) -> bool {
    false
}

fn try_main(cli: Cli) -> Result<()> {
    match cli.cmd {
        Cmd::Generate(a) => generate_cmd::generate(a),
        Cmd::Serve(a) => serve_cmd::serve(a),
        Cmd::Validate(a) => serve_cmd::validate(a),
        Cmd::Bench(a) => bench_cmd::bench(a),
        Cmd::GpuCheck(a) => gpu_check_cmd::gpu_check(a),
        Cmd::Audit(a) => audit_cmd::audit_cmd(a),
        Cmd::Prefill(a) => disagg_cmd::prefill(a),
        Cmd::Decode(a) => disagg_cmd::decode(a),
        Cmd::BenchDisagg(a) => Ok(custody_bench::disagg::bench_disagg(a)?),
        Cmd::BenchRouter(a) => Ok(custody_bench::router::bench_router(a)?),
        Cmd::BenchOffload(a) => Ok(custody_bench::offload::bench_offload(a)?),
        Cmd::Certs(a) => certs_cmd::certs(a),
        Cmd::Probe(a) => probe_cmd::probe(a),
        Cmd::Witness(c) => witness_cmd::witness_cmd(c),
        Cmd::Receipt(c) => receipt_cmd::receipt_cmd(c),
        #[cfg(feature = "forensics")]
        Cmd::Query(a) => query_cmd::query(a),
        #[cfg(feature = "forensics")]
        Cmd::Forensics(c) => query_cmd::forensics_cmd(c, common::parse_utc),
        #[cfg(feature = "forensics")]
        Cmd::Report(a) => query_cmd::report_cmd(a, common::parse_utc),
        #[cfg(feature = "forensics")]
        Cmd::Demo(a) => demo_cmd::demo(a),
        #[cfg(feature = "cluster")]
        Cmd::Cluster(c) => cluster_cmd::cluster(c),
    }
}

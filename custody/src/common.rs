//! What several subcommands share: model/engine loading, the audit writer from flags and
//! config, and UTC time parsing.

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, Result, bail};
use clap::Args;
use custody_runtime::{Engine, Model, Tokenizer};

use crate::config::Config;

/// Audit options shared by commands that run the engine.
#[derive(Args, Debug)]
pub(crate) struct AuditArgs {
    /// Record every page event into this audit root (Parquet); requires --audit-key.
    #[arg(long)]
    pub(crate) audit_dir: Option<PathBuf>,
    /// Ed25519 signing key for the digest chain (`custody audit keygen`).
    #[arg(long)]
    pub(crate) audit_key: Option<PathBuf>,
    /// Node id recorded in the audit log.
    #[arg(long, default_value_t = 0)]
    pub(crate) node: u32,
    /// Also publish the log's signed checkpoints into this directory (another disk or mount);
    /// repeatable; added to [audit] checkpoint_dirs.
    #[arg(long)]
    pub(crate) checkpoint_dir: Vec<PathBuf>,
    /// Also publish them to this object-store prefix (`s3://bucket/prefix`).
    #[arg(long)]
    pub(crate) checkpoint_url: Option<String>,
    /// Keep in this log the checkpoints another node (a peer) publishes into this directory;
    /// repeatable; added to [audit] checkpoints_from.
    #[arg(long)]
    pub(crate) checkpoints_from: Vec<PathBuf>,
}

#[derive(Args, Debug)]
pub(crate) struct Common {
    /// GGUF model (architectures llama, qwen2, qwen3: README "Models"); default: config's model.path, else the embedded one.
    #[arg(long)]
    pub(crate) model: Option<PathBuf>,
    /// Node configuration (TOML).
    #[arg(long)]
    pub(crate) config: Option<PathBuf>,
    /// Compute threads (0 = the config's, else all cores).
    #[arg(long, default_value_t = 0)]
    pub(crate) threads: usize,
}

/// How this process talks to the fleet, from `[tls]`: mutual TLS, or (said loudly) plaintext on
/// loopback.
pub(crate) fn fleet_security(
    tls: &custody_runtime::disagg::config::TlsSection,
) -> Result<custody_runtime::disagg::tls::Security> {
    let s = custody_runtime::disagg::tls::Security::from_section(tls).context("[tls]")?;
    match s.own() {
        Some(id) => tracing::info!(identity = %id, "mutual TLS"),
        None => tracing::warn!(
            "[tls] insecure_loopback = true: plaintext, loopback only (anyone on this host can talk to this process)"
        ),
    }
    Ok(s)
}

/// The audit writer from flags, falling back to the config's `[audit]` section.
pub(crate) fn open_audit(
    a: &AuditArgs,
    cfg_path: Option<&Path>,
) -> Result<Option<std::sync::Arc<custody_audit::writer::AuditWriter>>> {
    Ok(open_node_audit(a, cfg_path)?.map(|n| n.writer))
}

/// A node's audit writer, and what a pair's peer checkpoint exchange needs of it.
pub(crate) struct NodeAudit {
    pub(crate) writer: std::sync::Arc<custody_audit::writer::AuditWriter>,
    /// The writer's newest checkpoint (one of its sinks).
    pub(crate) latest: std::sync::Arc<custody_audit::checkpoint::Latest>,
    /// The writer's checkpoint interval.
    pub(crate) checkpoint_interval: std::time::Duration,
}

/// [`open_audit`], with the writer's newest checkpoint kept for a peer exchange.
pub(crate) fn open_node_audit(a: &AuditArgs, cfg_path: Option<&Path>) -> Result<Option<NodeAudit>> {
    use custody_audit::writer::{Backpressure, FsyncPolicy, WriterConfig};
    let conf = match cfg_path {
        Some(p) => Config::load(p)?.audit,
        None => custody_audit::config::AuditSection::default(),
    };
    let Some(dir) = a.audit_dir.clone().or(conf.dir.clone()) else {
        return Ok(None);
    };
    let key_path = a.audit_key.clone().or(conf.key.clone()).context(
        "an audit directory needs a signing key: --audit-key or [audit] key (create one with `custody audit keygen`)",
    )?;
    let key = custody_audit::digest::read_signing_key(&key_path).map_err(anyhow::Error::msg)?;
    let node = if a.node != 0 { a.node } else { conf.node };
    let mut cfg = WriterConfig::new(&dir, node, key);
    cfg.fsync = match conf.fsync_interval_ms {
        0 => FsyncPolicy::EveryBatch,
        ms => FsyncPolicy::Interval(std::time::Duration::from_millis(ms)),
    };
    if conf.checkpoint_interval_s > 0 {
        cfg.checkpoint_interval = std::time::Duration::from_secs(conf.checkpoint_interval_s);
    }
    cfg.checkpoint_sinks = checkpoint_sinks(a, &conf)?;
    let latest = std::sync::Arc::new(custody_audit::checkpoint::Latest::default());
    cfg.checkpoint_sinks.push(latest.clone());
    let checkpoint_interval = cfg.checkpoint_interval;
    if conf.allow_drop {
        tracing::warn!(
            "audit allow_drop is on: events may be dropped under load (each drop is counted in the log)"
        );
        cfg.backpressure = Backpressure::AllowDrop;
    }
    let w = custody_audit::writer::AuditWriter::open(cfg)
        .with_context(|| format!("opening audit log {}", dir.display()))?;
    let w = std::sync::Arc::new(w);
    for from in conf.checkpoints_from.iter().chain(&a.checkpoints_from) {
        relay_checkpoints(from.clone(), w.clone(), None)?;
    }
    Ok(Some(NodeAudit {
        writer: w,
        latest,
        checkpoint_interval,
    }))
}

/// How often a relay looks for new checkpoints in a peer's checkpoint directory.
const CHECKPOINT_RELAY_INTERVAL: std::time::Duration = std::time::Duration::from_secs(1);

/// A thread that keeps, in `log`, the checkpoints another node publishes into `dir` (see
/// `custody_audit::checkpoint::Relay`), until `stop` is set or the log is closed.
pub(crate) fn relay_checkpoints(
    dir: PathBuf,
    log: std::sync::Arc<custody_audit::writer::AuditWriter>,
    stop: Option<std::sync::Arc<std::sync::atomic::AtomicBool>>,
) -> Result<()> {
    use std::sync::atomic::Ordering;
    let mut relay = custody_audit::checkpoint::Relay::new(&dir, log);
    std::thread::Builder::new()
        .name("checkpoint-relay".into())
        .spawn(move || {
            while !stop.as_ref().is_some_and(|s| s.load(Ordering::Acquire)) {
                if let Err(e) = relay.poll() {
                    tracing::debug!(error = %e, "checkpoint relay stopped: the log is closed");
                    return;
                }
                std::thread::sleep(CHECKPOINT_RELAY_INTERVAL);
            }
            // A last look: what the node published just before the stop.
            let _ = relay.poll();
        })
        .with_context(|| format!("starting the checkpoint relay from {}", dir.display()))?;
    Ok(())
}

/// Where the writer publishes its checkpoints, from flags and `[audit]`.
fn checkpoint_sinks(
    a: &AuditArgs,
    conf: &custody_audit::config::AuditSection,
) -> Result<Vec<std::sync::Arc<dyn custody_audit::checkpoint::CheckpointSink>>> {
    use custody_audit::checkpoint::{CheckpointSink, DirSink, StdoutSink};
    let mut sinks: Vec<std::sync::Arc<dyn CheckpointSink>> = Vec::new();
    for d in conf.checkpoint_dirs.iter().chain(&a.checkpoint_dir) {
        sinks.push(std::sync::Arc::new(DirSink::new(d)));
    }
    if conf.checkpoint_stdout {
        sinks.push(std::sync::Arc::new(StdoutSink));
    }
    if let Some(url) = a.checkpoint_url.as_ref().or(conf.checkpoint_url.as_ref()) {
        sinks.push(object_checkpoint_sink(url)?);
    }
    Ok(sinks)
}

#[cfg(feature = "forensics")]
fn object_checkpoint_sink(
    url: &str,
) -> Result<std::sync::Arc<dyn custody_audit::checkpoint::CheckpointSink>> {
    let sink = custody_query::checkpoints::ObjectCheckpointSink::s3(url)
        .with_context(|| format!("checkpoint place {url}"))?;
    Ok(std::sync::Arc::new(sink))
}

#[cfg(not(feature = "forensics"))]
fn object_checkpoint_sink(
    url: &str,
) -> Result<std::sync::Arc<dyn custody_audit::checkpoint::CheckpointSink>> {
    anyhow::bail!("checkpoint place {url}: object stores need a build with the `forensics` feature")
}

/// `YYYY-MM-DD` or `YYYY-MM-DDTHH:MM:SSZ` (UTC) → Unix nanoseconds.
/// The prompt's token ids: a raw prompt (BOS as the model asks), or — `chat` — a user message
/// (after an optional system message) rendered by the model's chat template, which places its
/// own BOS (`Tokenizer::encode_chat`).
pub(crate) fn prompt_ids(
    tokenizer: &Tokenizer,
    chat: bool,
    system: Option<&str>,
    prompt: &str,
) -> Result<Vec<u32>> {
    if !chat {
        return Ok(tokenizer.encode(prompt, false)?);
    }
    let message = |role: &str, content: &str| custody_runtime::ChatMessage {
        role: role.into(),
        content: content.into(),
    };
    let mut msgs: Vec<_> = system.map(|s| message("system", s)).into_iter().collect();
    msgs.push(message("user", prompt));
    Ok(tokenizer.encode_chat(&msgs)?)
}

pub(crate) fn parse_utc(s: &str) -> Result<i64> {
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

/// Make a pool of `threads` compute threads (0: one per core) the process's default, for engines
/// that step on threads of their own (a node's actor, the demo's pair). The first call wins: one
/// process has one default pool.
pub(crate) fn set_default_pool(threads: usize) -> Result<()> {
    let pool = custody_runtime::par::ThreadPool::new(threads)
        .context("building the compute thread pool")?;
    if custody_runtime::par::set_global(pool).is_err() {
        tracing::debug!("the process's compute pool was already set");
    }
    Ok(())
}

pub(crate) struct Loaded {
    pub(crate) engine: Engine,
    pub(crate) tokenizer: Tokenizer,
    pub(crate) pool: custody_runtime::par::ThreadPool,
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
    let pool = custody_runtime::par::ThreadPool::new(threads)
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

/// Seal a node's log after a clean shutdown: a `node_events` row `stop` first, so that an
/// incarnation without one is known to have ended otherwise (killed, crashed) — and the rows it
/// had not yet written are known to be lost, not absent (`custody forensics fleet`).
pub(crate) fn stop_and_seal(w: &custody_audit::writer::AuditWriter) -> anyhow::Result<()> {
    use anyhow::Context as _;
    let ev = custody_audit::Event::Node {
        ts_ns: custody_audit::mono_now_ns(),
        kind: "stop".into(),
        detail: "clean shutdown".into(),
    };
    custody_audit::AuditSink::record(w, ev).context("recording the stop")?;
    w.close().context("sealing the audit log")?;
    Ok(())
}

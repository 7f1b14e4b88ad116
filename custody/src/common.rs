//! What several subcommands share: model/engine loading, the fleet's security, prompts and UTC
//! time parsing (the audit writer: `audit_open.rs`).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use clap::Args;
use custody_runtime::{Engine, Model, Tokenizer};

use crate::config::Config;

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
    let message = custody_runtime::ChatMessage::new;
    let mut msgs: Vec<_> = system.map(|s| message("system", s)).into_iter().collect();
    msgs.push(message("user", prompt));
    Ok(tokenizer.encode_chat(&msgs)?)
}

/// `YYYY-MM-DD` or `YYYY-MM-DDTHH:MM:SSZ` (UTC) → Unix nanoseconds.
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
/// `[kv_offload]` resolved for an engine node: `None` when no tier is configured; the object
/// tier's S3 client built here (the engine knows no network).
pub(crate) fn offload_setup(
    cfg: &crate::config::Config,
    node: u32,
    token_only: bool,
) -> Result<Option<custody_runtime::offload::OffloadSetup>> {
    let s = &cfg.kv_offload;
    if !s.enabled() {
        if token_only {
            bail!("[unsafe_reproduction] token_only_offload needs a [kv_offload] tier");
        }
        return Ok(None);
    }
    let object = match &s.object_url {
        Some(url) => Some(Arc::new(
            custody_runtime::offload_s3::S3PageStore::from_env(url)
                .with_context(|| format!("[kv_offload] object_url {url}"))?,
        )
            as Arc<dyn custody_runtime::offload::store::PageStore>),
        None => None,
    };
    Ok(Some(custody_runtime::offload::OffloadSetup {
        section: s.clone(),
        object,
        node,
        token_only,
    }))
}

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
    let mut tokenizer = Tokenizer::from_gguf(model.gguf())
        .with_context(|| format!("loading tokenizer from {}", path.display()))?;
    if let Some(t) = cfg
        .model
        .chat_template()
        .context("reading [model] chat_template_file")?
    {
        tokenizer.set_chat_template(t);
    }
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

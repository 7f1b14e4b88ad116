//! Node configuration (TOML) and start-up validation of the KV pool against the context length.

use std::path::{Path, PathBuf};

use serde::Deserialize;

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("invalid config {path}: {source}")]
    Parse {
        path: PathBuf,
        source: toml::de::Error,
    },
    #[error("invalid config: {0}")]
    Invalid(String),
}

/// The whole node configuration.
#[derive(Clone, Debug, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Config {
    #[serde(default)]
    pub model: ModelSection,
    #[serde(default)]
    pub engine: EngineConfig,
    #[serde(default)]
    pub audit: AuditSection,
}

/// Where and how the node records its audit log (read by the binary, which owns the writer: the
/// runtime itself only sees the sink trait).
#[derive(Clone, Debug, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct AuditSection {
    /// Audit root; unset = audit off.
    pub dir: Option<PathBuf>,
    /// Ed25519 signing key (`custody audit keygen`). Keep it outside the audit root.
    pub key: Option<PathBuf>,
    /// Node id recorded with every event.
    pub node: u32,
    /// fsync the live segment at most this often; 0 = after every batch.
    pub fsync_interval_ms: u64,
    /// Drop (and count) events instead of pausing admission when the queue is full.
    pub allow_drop: bool,
}

#[derive(Clone, Debug, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ModelSection {
    /// GGUF path; unset means the embedded default model (fetched by `scripts/fetch-model.sh`).
    pub path: Option<PathBuf>,
}

/// Engine limits. Every queue and batch is bounded by one of these.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct EngineConfig {
    /// Advertised context length in tokens (prompt + generated); unset = the model's.
    pub context_length: Option<usize>,
    /// Token slots per KV page.
    pub page_size: usize,
    /// Memory budget of the KV pool, MiB.
    pub kv_budget_mib: usize,
    /// If the pool cannot hold one full context: lower the context (logged loudly) instead of
    /// refusing to start.
    pub allow_context_reduction: bool,
    /// Tokens per engine step (prefill chunks + decode tokens).
    pub max_batch_tokens: usize,
    /// Concurrently running sequences.
    pub max_running: usize,
    /// Admitted requests waiting for pages or a running slot.
    pub max_waiting: usize,
    /// Compute threads; 0 = all cores.
    pub threads: usize,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            context_length: None,
            page_size: 16,
            kv_budget_mib: 512,
            allow_context_reduction: false,
            max_batch_tokens: 512,
            max_running: 16,
            max_waiting: 256,
            threads: 0,
        }
    }
}

impl EngineConfig {
    pub fn validate(&self) -> Result<(), ConfigError> {
        let bad = |m: &str| Err(ConfigError::Invalid(m.to_owned()));
        if self.page_size == 0 || self.page_size > 1024 {
            return bad("engine.page_size must be in 1..=1024");
        }
        if self.max_batch_tokens == 0 || self.max_running == 0 {
            return bad("engine.max_batch_tokens and engine.max_running must be positive");
        }
        if self.context_length == Some(0) {
            return bad("engine.context_length must be positive");
        }
        Ok(())
    }
}

impl Config {
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.into(),
            source,
        })?;
        let cfg: Config = toml::from_str(&text).map_err(|source| ConfigError::Parse {
            path: path.into(),
            source,
        })?;
        cfg.engine.validate()?;
        Ok(cfg)
    }
}

/// Where the embedded default model is cached (must agree with `scripts/fetch-model.sh`).
pub fn default_model_path() -> PathBuf {
    if let Ok(p) = std::env::var("CUSTODY_MODEL") {
        return PathBuf::from(p);
    }
    let cache = std::env::var_os("CUSTODY_CACHE_DIR")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("XDG_CACHE_HOME").map(|p| PathBuf::from(p).join("custody")))
        .or_else(|| std::env::var_os("HOME").map(|p| PathBuf::from(p).join(".cache/custody")))
        .unwrap_or_else(|| PathBuf::from(".cache/custody"));
    cache.join("SmolLM2-135M-Instruct.Q4_1.gguf")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_rejects_unknown_fields() {
        let c: Config =
            toml::from_str("[engine]\npage_size = 32\nkv_budget_mib = 64\n").expect("parse");
        assert_eq!(c.engine.page_size, 32);
        assert_eq!(c.engine.max_running, 16);
        assert!(toml::from_str::<Config>("[engine]\npage_sise = 32\n").is_err());
    }

    #[test]
    fn shipped_single_node_config_is_valid() {
        let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/single-node.toml");
        let c = Config::load(&p).expect("configs/single-node.toml must parse");
        assert!(c.engine.kv_budget_mib > 0);
    }
}

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
    /// Disaggregated roles: addresses and transfer options.
    #[serde(default)]
    pub disagg: DisaggSection,
    /// The OpenAI-compatible HTTP server (`custody serve`): listen address, tenants and their
    /// keys and limits, the canary. Plain data: the HTTP code lives in `custody-server`.
    #[serde(default)]
    pub serve: ServeSection,
    /// Switches that recreate the incident's faults. Ignored unless the command line also says
    /// `--unsafe-reproduction` (see [`Config::unsafe_switches`]).
    #[serde(default)]
    pub unsafe_reproduction: UnsafeReproduction,
}

/// The disaggregated pair (`custody prefill` / `custody decode`).
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct DisaggSection {
    /// Decode: gRPC control-plane listen address. Prefill: the decode node's control address.
    pub decode_control: String,
    /// Decode: KV transport (tcp) listen address; advertised to prefill in the handshake.
    pub decode_transport: String,
    /// KV transport of both nodes: "tcp" (software, everywhere) or "verbs" (RDMA; needs a build
    /// with `--features rdma` and a device). Both nodes must agree (the handshake checks).
    pub transport: String,
    /// With `transport = "verbs"`: the device (e.g. "mlx5_0"); empty = the first one.
    pub verbs_device: String,
    /// Prefill: gRPC front-door listen address (clients submit generations here).
    pub prefill_listen: String,
    /// Verify a checksum of every transferred page before marking it written.
    pub checksum: bool,
    /// What released pages are overwritten with: "none", "zero" or "canary".
    pub release_fill: crate::kv::ReleaseFill,
}

impl Default for DisaggSection {
    fn default() -> Self {
        Self {
            decode_control: "127.0.0.1:7071".into(),
            decode_transport: "127.0.0.1:7072".into(),
            transport: "tcp".into(),
            verbs_device: String::new(),
            prefill_listen: "127.0.0.1:7070".into(),
            checksum: true,
            release_fill: crate::kv::ReleaseFill::None,
        }
    }
}

/// `custody serve`: the HTTP front of a node.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct ServeSection {
    /// HTTP listen address.
    pub listen: String,
    /// Model id served in `/v1/models` and answered in `model`; empty = the GGUF's name.
    pub model_name: String,
    /// `max_tokens` when a request does not say (lowered to what the context leaves). Every
    /// request reserves its whole `prompt + max_tokens` up front, so "until the context is
    /// full" would make every request hold a full context of pages.
    pub default_max_tokens: usize,
    /// Largest accepted request body, bytes.
    pub max_body_bytes: usize,
    /// Requests waiting for the engine thread's command queue (beyond it: 503).
    pub queue_capacity: usize,
    /// On SIGINT/SIGTERM, in-flight requests get this long to finish before they are aborted;
    /// then the audit log is sealed.
    pub drain_timeout_s: u64,
    /// Refuse new work (503) when the audit writer's queue holds more than this fraction of its
    /// capacity: a request admitted then would stall on the log (fail-closed) anyway.
    pub audit_high_water: f64,
    /// Background canary: every this many seconds, the golden prompts run greedy through the
    /// serving engine (batched with live traffic) and must equal the reference computed alone
    /// at start-up, token for token. 0 = off.
    pub canary_interval_s: u64,
    /// A first token sooner than `prompt_tokens / (calibrated prefill tok/s × this factor)`
    /// is flagged as a prefill anomaly (prompt KV that was not computed). 0 = off.
    pub prefill_anomaly_factor: f64,
    /// Only prompts at least this long are checked for prefill anomalies (short prompts are
    /// dominated by fixed costs).
    pub prefill_anomaly_min_tokens: usize,
    /// Front a disaggregated pair instead of running an engine here: the prefill node's gRPC
    /// front door (`http://host:port`, its `[disagg] prefill_listen`). Empty = colocated.
    pub prefill: String,
    /// Who may call, by API key.
    pub tenants: Vec<TenantSection>,
}

impl Default for ServeSection {
    fn default() -> Self {
        Self {
            listen: "127.0.0.1:8080".into(),
            model_name: String::new(),
            default_max_tokens: 256,
            max_body_bytes: 1 << 20,
            queue_capacity: 256,
            drain_timeout_s: 30,
            audit_high_water: 0.9,
            canary_interval_s: 60,
            prefill_anomaly_factor: 8.0,
            prefill_anomaly_min_tokens: 64,
            prefill: String::new(),
            tenants: Vec::new(),
        }
    }
}

/// One tenant of `custody serve`.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct TenantSection {
    /// Tenant id: recorded with every audit event of its requests.
    pub id: String,
    /// SHA-256 (lowercase hex) of each API key the tenant may use (`custody serve hash-key`).
    /// Only hashes are stored, so a leaked config does not leak keys.
    pub keys_sha256: Vec<String>,
    /// Requests of this tenant in flight at once (beyond: 429).
    #[serde(default = "default_max_concurrent")]
    pub max_concurrent: usize,
    /// Token budget per minute, prompt + max_tokens charged at admission and unused output
    /// refunded at the end (beyond: 429). 0 = unlimited.
    #[serde(default)]
    pub tokens_per_minute: u64,
}

fn default_max_concurrent() -> usize {
    8
}

impl ServeSection {
    pub fn validate(&self) -> Result<(), ConfigError> {
        let bad = |m: String| Err(ConfigError::Invalid(m));
        if self.default_max_tokens == 0 || self.max_body_bytes == 0 || self.queue_capacity == 0 {
            return bad(
                "serve.default_max_tokens, serve.max_body_bytes and serve.queue_capacity must be positive"
                    .into(),
            );
        }
        if !(self.audit_high_water > 0.0 && self.audit_high_water <= 1.0) {
            return bad("serve.audit_high_water must be in (0, 1]".into());
        }
        let mut seen = std::collections::BTreeSet::new();
        for t in &self.tenants {
            if t.id.is_empty() || t.id.starts_with('_') {
                return bad(format!(
                    "serve.tenants: tenant id {:?} must be non-empty and must not start with '_' (reserved for the server's own requests, e.g. _canary)",
                    t.id
                ));
            }
            if t.max_concurrent == 0 {
                return bad(format!(
                    "serve.tenants {}: max_concurrent must be positive",
                    t.id
                ));
            }
            if t.keys_sha256.is_empty() {
                return bad(format!("serve.tenants {}: no keys_sha256", t.id));
            }
            for k in &t.keys_sha256 {
                if k.len() != 64
                    || !k
                        .bytes()
                        .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
                {
                    return bad(format!(
                        "serve.tenants {}: {k:?} is not a SHA-256 in lowercase hex (64 characters; `custody serve hash-key` prints one)",
                        t.id
                    ));
                }
                if !seen.insert(k.clone()) {
                    return bad(format!("serve.tenants: key hash {k} is listed twice"));
                }
            }
        }
        Ok(())
    }
}

/// The incident's faults, recreated on purpose. Each is logged at ERROR on startup and recorded
/// in the audit log. None takes effect without `--unsafe-reproduction` on the command line.
#[derive(Clone, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields, default)]
pub struct UnsafeReproduction {
    /// Start even when the KV pool cannot hold one full context.
    pub skip_pool_check: bool,
    /// The legacy "rejection": an over-length prompt is truncated to one token and the request
    /// flows on to decode, whose reservation is for the full prompt.
    pub truncate_overlength: bool,
    /// Attention reads pages without checking their tags.
    pub disable_tag_check: bool,
    /// Transferred pages are marked written without verifying their checksum.
    pub disable_checksum: bool,
}

impl UnsafeReproduction {
    pub fn any(&self) -> bool {
        self.skip_pool_check
            || self.truncate_overlength
            || self.disable_tag_check
            || self.disable_checksum
    }

    /// The switches that are on, by name.
    pub fn names(&self) -> Vec<&'static str> {
        let mut v = Vec::new();
        if self.skip_pool_check {
            v.push("skip_pool_check");
        }
        if self.truncate_overlength {
            v.push("truncate_overlength");
        }
        if self.disable_tag_check {
            v.push("disable_tag_check");
        }
        if self.disable_checksum {
            v.push("disable_checksum");
        }
        v
    }
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
    /// The unsafe switches in effect: the configured ones only when `armed` (the command line's
    /// `--unsafe-reproduction`), else none. Logged loudly either way when any is configured.
    pub fn unsafe_switches(&self, armed: bool) -> UnsafeReproduction {
        let u = &self.unsafe_reproduction;
        if !u.any() {
            return UnsafeReproduction::default();
        }
        if armed {
            tracing::error!(switches = ?u.names(), "UNSAFE REPRODUCTION ARMED: this node recreates the incident's faults and may leak data between tenants");
            u.clone()
        } else {
            tracing::warn!(switches = ?u.names(), "[unsafe_reproduction] is configured but IGNORED: pass --unsafe-reproduction to arm it");
            UnsafeReproduction::default()
        }
    }

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
        cfg.serve.validate()?;
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
    fn serve_section_rejects_bad_tenants() {
        let ok = format!(
            "[[serve.tenants]]\nid = \"acme\"\nkeys_sha256 = [\"{}\"]\n",
            "a".repeat(64)
        );
        let c: Config = toml::from_str(&ok).expect("parse");
        c.serve.validate().expect("valid");
        assert_eq!(c.serve.tenants[0].max_concurrent, 8);
        for bad in [
            ok.replace(&"a".repeat(64), "not-a-hash"),
            ok.replace(&"a".repeat(64), &"A".repeat(64)),
            ok.replace("acme", "_canary"),
            format!("{ok}{}", ok.replace("acme", "other")),
        ] {
            let c: Config = toml::from_str(&bad).expect("parse");
            assert!(c.serve.validate().is_err(), "{bad}");
        }
    }

    #[test]
    fn parses_and_rejects_unknown_fields() {
        let c: Config =
            toml::from_str("[engine]\npage_size = 32\nkv_budget_mib = 64\n").expect("parse");
        assert_eq!(c.engine.page_size, 32);
        assert_eq!(c.engine.max_running, 16);
        assert!(toml::from_str::<Config>("[engine]\npage_sise = 32\n").is_err());
    }

    #[test]
    fn shipped_disaggregated_and_incident_configs_are_valid() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../configs");
        for f in ["disagg-prefill.toml", "disagg-decode.toml"] {
            let c = Config::load(&dir.join(f)).expect(f);
            assert!(
                !c.unsafe_reproduction.any(),
                "{f} must not carry unsafe switches"
            );
            assert!(c.disagg.checksum);
        }
        let c = Config::load(&dir.join("incident.toml")).expect("incident.toml");
        // 768 tokens of pool (17 MiB at 23,040 B/token for SmolLM2-135M) < 1024 advertised.
        assert!(c.engine.kv_budget_mib * (1 << 20) / 23_040 < c.engine.context_length.unwrap_or(0));
        assert!(c.unsafe_reproduction.any());
        assert_eq!(
            c.unsafe_switches(false),
            UnsafeReproduction::default(),
            "not armed without the flag"
        );
        assert!(c.unsafe_switches(true).disable_tag_check);
        Config::load(&dir.join("incident-prefill.toml")).expect("incident-prefill.toml");
    }

    #[test]
    fn shipped_single_node_config_is_valid() {
        let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../configs/single-node.toml");
        let c = Config::load(&p).expect("configs/single-node.toml must parse");
        assert!(c.engine.kv_budget_mib > 0);
        let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../configs/serve-demo.toml");
        let c = Config::load(&p).expect("configs/serve-demo.toml must parse");
        assert_eq!(c.serve.tenants.len(), 3);
        assert!(
            c.serve.listen.starts_with("127.0.0.1:"),
            "demo keys: loopback only"
        );
    }
}

//! The engine's configuration sections: `[model]`, `[engine]` (every queue and batch bound) and
//! `[unsafe_reproduction]`. Plain data, deserialised by the binary from the node's TOML file
//! (which assembles every crate's section); the engine validates its own at start-up.

use std::path::PathBuf;

use custody_kernels::attention::KvType;
use serde::Deserialize;

/// A configuration section's values are not acceptable.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("invalid config: {0}")]
    Invalid(String),
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
    /// The prefix cache without the tenant in its key: one namespace for every request, so a
    /// prompt another tenant sent is a cache hit (the leak prefix caches are known for).
    pub shared_prefix_cache: bool,
    /// The KV offload tiers keyed on tokens alone, and a restored page taken whatever its
    /// namespace: another tenant's offloaded page is a hit (sglang #37160, LMCache #4825).
    pub token_only_offload: bool,
}

impl UnsafeReproduction {
    pub fn any(&self) -> bool {
        self.skip_pool_check
            || self.truncate_overlength
            || self.disable_tag_check
            || self.disable_checksum
            || self.shared_prefix_cache
            || self.token_only_offload
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
        if self.shared_prefix_cache {
            v.push("shared_prefix_cache");
        }
        if self.token_only_offload {
            v.push("token_only_offload");
        }
        v
    }
}

#[derive(Clone, Debug, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ModelSection {
    /// GGUF path; unset means the embedded default model (fetched by `scripts/fetch-model.sh`).
    pub path: Option<PathBuf>,
    /// A Jinja chat template used instead of the GGUF's `tokenizer.chat_template` (as
    /// llama.cpp's `--chat-template-file`, vLLM's `--chat-template`): for files whose template
    /// predates tool calling.
    pub chat_template_file: Option<PathBuf>,
}

impl ModelSection {
    /// The configured template file's text, if one is configured.
    pub fn chat_template(&self) -> std::io::Result<Option<String>> {
        self.chat_template_file
            .as_ref()
            .map(std::fs::read_to_string)
            .transpose()
    }
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
    /// Where the forward pass runs: `"cpu"` (the default) or `"cuda"` (CUDA device 0; refused
    /// at startup with what is missing — a build without the `cuda` feature, the driver, NVRTC,
    /// a device).
    pub backend: Backend,
    /// Reuse the KV of full prompt pages across requests of one cache namespace (which the
    /// server derives from the authenticated tenant: `prefix_cache.rs`). Cached pages stay in
    /// the pool until it needs them (LRU). Unset: on, on both backends (the device's tag check
    /// admits a reader's shared namespaces as the CPU's does).
    pub prefix_cache: Option<bool>,
    /// How the KV cache stores K and V: `"f16"` (the default, llama.cpp's) or `"q8_0"`
    /// (llama.cpp's `--cache-type-k/v q8_0` blocks: 34 bytes per 32 values, ~53 % of f16's
    /// memory and bytes read per decode step; its accuracy cost is in BENCHMARKS.md). The tag
    /// check is the same for both. CPU backend only (CUDA refuses `q8_0` at startup).
    #[serde(deserialize_with = "kv_type_by_name")]
    pub kv_cache_type: KvType,
}

/// `engine.kv_cache_type` by its name ([`KvType::name`]); any other value is refused by name.
fn kv_type_by_name<'de, D: serde::Deserializer<'de>>(d: D) -> Result<KvType, D::Error> {
    let name = String::deserialize(d)?;
    KvType::from_name(&name).ok_or_else(|| {
        serde::de::Error::custom(format!(
            "engine.kv_cache_type {name:?}: expected \"f16\" or \"q8_0\""
        ))
    })
}

/// `[prefix_cache]`: how the namespaces of the prefix cache are derived (the node that derives
/// them — `custody serve`, or a prefill node — from the tenant it authenticated). The engine's
/// `engine.prefix_cache` turns the cache itself on or off.
#[derive(Clone, Debug, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct PrefixCacheSection {
    /// A file holding the namespace secret (64 hex digits). Unset: a fresh random secret per
    /// process (namespaces then last as long as the process's cache does).
    pub secret_file: Option<PathBuf>,
    /// Operator-declared public scopes: prompt prefixes every tenant may share (a published
    /// system prompt). Nothing is shared across tenants except through one of these.
    pub public: Vec<PublicScopeSection>,
}

/// One `[[prefix_cache.public]]` scope: a name and the prompt prefix it covers.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct PublicScopeSection {
    /// The scope's name (in the audit log as `public:<scope>`).
    pub scope: String,
    /// The prefix as raw prompt text (tokenized as a completion prompt is).
    #[serde(default)]
    pub text: Option<String>,
    /// The prefix as a published system prompt: rendered through the model's chat template as
    /// a chat's first message.
    #[serde(default)]
    pub system_prompt: Option<String>,
}

impl PrefixCacheSection {
    pub fn validate(&self) -> Result<(), ConfigError> {
        let mut scopes = std::collections::BTreeSet::new();
        for p in &self.public {
            if p.scope.is_empty() || p.scope.len() > 64 || !scopes.insert(&p.scope) {
                return Err(ConfigError::Invalid(format!(
                    "prefix_cache.public: scope {:?} must be unique, 1 to 64 bytes",
                    p.scope
                )));
            }
            if p.text.is_some() == p.system_prompt.is_some() {
                return Err(ConfigError::Invalid(format!(
                    "prefix_cache.public {}: give exactly one of text and system_prompt",
                    p.scope
                )));
            }
        }
        Ok(())
    }
}

/// `[kv_offload]`: where prefix-cache pages the pool evicts go — host memory, a local disk
/// directory, an object store — sealed ([`crate::offload`]). Off unless a tier is configured.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct KvOffloadSection {
    /// The host-memory tier's size, MiB of sealed pages (0: no host tier).
    pub host_mib: u64,
    /// The disk tier's directory (page files, fsync'd); needs `disk_mib`.
    pub disk_dir: Option<PathBuf>,
    /// The disk tier's size, MiB.
    pub disk_mib: u64,
    /// The object-store tier (`s3://bucket/prefix`), shared by a fleet's prefill nodes.
    pub object_url: Option<String>,
    /// The object tier's size, MiB (0: unbounded).
    pub object_mib: u64,
    /// Which page leaves a full tier first: `lru` (least recently stored or hit).
    pub eviction: Eviction,
    /// The MAC key (64 hex digits). Unset: derived from the prefix-cache secret (a fleet sharing
    /// `[prefix_cache] secret_file` shares it).
    pub mac_key_file: Option<PathBuf>,
    /// An AES-256-GCM key (64 hex digits): every tier then holds ciphertext, so a copied disk or
    /// a leaked bucket is not a KV leak.
    pub encrypt_key_file: Option<PathBuf>,
    /// Offload jobs in flight at most (write-backs, moves, prefetches).
    pub queue_pages: usize,
}

impl Default for KvOffloadSection {
    fn default() -> Self {
        Self {
            host_mib: 0,
            disk_dir: None,
            disk_mib: 0,
            object_url: None,
            object_mib: 0,
            eviction: Eviction::Lru,
            mac_key_file: None,
            encrypt_key_file: None,
            queue_pages: 64,
        }
    }
}

/// `kv_offload.eviction`.
#[derive(Clone, Copy, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum Eviction {
    #[default]
    Lru,
}

impl KvOffloadSection {
    /// Whether any tier is configured.
    pub fn enabled(&self) -> bool {
        self.host_mib > 0 || self.disk_dir.is_some() || self.object_url.is_some()
    }

    pub fn validate(&self) -> Result<(), ConfigError> {
        let bad = |m: &str| Err(ConfigError::Invalid(format!("kv_offload: {m}")));
        if self.disk_dir.is_some() != (self.disk_mib > 0) {
            return bad("disk_dir and disk_mib go together");
        }
        if self.object_url.is_none() && self.object_mib > 0 {
            return bad("object_mib without object_url");
        }
        if let Some(u) = &self.object_url
            && !u.starts_with("s3://")
        {
            return bad("object_url must be s3://bucket[/prefix]");
        }
        if self.queue_pages == 0 || self.queue_pages > 4096 {
            return bad("queue_pages must be in 1..=4096");
        }
        if !self.enabled() && (self.mac_key_file.is_some() || self.encrypt_key_file.is_some()) {
            return bad("keys are given but no tier is configured");
        }
        Ok(())
    }
}

/// The forward pass's backend (chosen once, at startup).
#[derive(Clone, Copy, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum Backend {
    #[default]
    Cpu,
    Cuda,
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
            backend: Backend::Cpu,
            prefix_cache: None,
            kv_cache_type: KvType::F16,
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

//! The node's TOML file: every crate's section assembled in one document, each section defined by
//! the crate it configures — `[model]`, `[engine]`, `[unsafe_reproduction]` (custody-engine),
//! `[audit]` (custody-audit), `[disagg]` (custody-disagg), `[serve]` and `[fleet]` (custody-server).

use std::path::{Path, PathBuf};

use custody_audit::config::AuditSection;
use custody_runtime::config::{EngineConfig, ModelSection, UnsafeReproduction};
use custody_runtime::disagg::config::{DisaggSection, TlsSection};
use custody_server::config::ServeSection;
use serde::Deserialize;

/// Why a config file was not loaded.
#[derive(Debug, thiserror::Error)]
pub(crate) enum LoadError {
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
    #[error("{path}: {message}")]
    Invalid { path: PathBuf, message: String },
}

/// The whole node configuration.
#[derive(Clone, Debug, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub(crate) struct Config {
    #[serde(default)]
    pub(crate) model: ModelSection,
    #[serde(default)]
    pub(crate) engine: EngineConfig,
    #[serde(default)]
    pub(crate) audit: AuditSection,
    /// Disaggregated roles: addresses and transfer options.
    #[serde(default)]
    pub(crate) disagg: DisaggSection,
    /// Mutual TLS between the fleet's processes: CA, certificate, key, the identities dealt
    /// with (or the loopback-only insecure mode).
    #[serde(default)]
    pub(crate) tls: TlsSection,
    /// The OpenAI-compatible HTTP server (`custody serve`): listen address, tenants and their
    /// keys and limits, the canary. Plain data: the HTTP code lives in `custody-server`.
    #[serde(default)]
    pub(crate) serve: ServeSection,
    /// `custody serve` as the router of many prefill and decode nodes: the nodes, probes,
    /// health thresholds and routing policy.
    #[serde(default)]
    pub(crate) fleet: custody_server::config::FleetSection,
    /// The prefix cache's namespaces (`custody serve` and prefill nodes): the secret, the
    /// operator-declared public scopes.
    #[serde(default)]
    pub(crate) prefix_cache: custody_runtime::config::PrefixCacheSection,
    /// KV offload (`custody serve` and prefill nodes): the tiers the prefix cache's evicted
    /// pages go to, their sizes, the keys.
    #[serde(default)]
    pub(crate) kv_offload: custody_runtime::config::KvOffloadSection,
    /// Switches that recreate the incident's faults. Ignored unless the command line also says
    /// `--unsafe-reproduction` (see [`Config::unsafe_switches`]).
    #[serde(default)]
    pub(crate) unsafe_reproduction: UnsafeReproduction,
}

impl Config {
    /// The unsafe switches in effect: the configured ones only when `armed` (the command line's
    /// `--unsafe-reproduction`), else none. Logged loudly either way when any is configured.
    pub(crate) fn unsafe_switches(&self, armed: bool) -> UnsafeReproduction {
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

    /// [`Config::unsafe_switches`] without its log lines: for a caller that says so in its own
    /// output (the demo, which only exists with `forensics`).
    #[cfg(feature = "forensics")]
    pub(crate) fn armed_switches(&self, armed: bool) -> UnsafeReproduction {
        if armed {
            self.unsafe_reproduction.clone()
        } else {
            UnsafeReproduction::default()
        }
    }

    /// Read, parse (unknown fields are errors) and validate the sections that validate.
    pub(crate) fn load(path: &Path) -> Result<Self, LoadError> {
        let text = std::fs::read_to_string(path).map_err(|source| LoadError::Read {
            path: path.into(),
            source,
        })?;
        let cfg: Config = toml::from_str(&text).map_err(|source| LoadError::Parse {
            path: path.into(),
            source,
        })?;
        let invalid = |message: String| LoadError::Invalid {
            path: path.into(),
            message,
        };
        cfg.engine.validate().map_err(|e| invalid(e.to_string()))?;
        cfg.serve.validate().map_err(|e| invalid(e.to_string()))?;
        if cfg.fleet.is_router() {
            cfg.fleet.validate().map_err(|e| invalid(e.to_string()))?;
        }
        cfg.prefix_cache
            .validate()
            .map_err(|e| invalid(e.to_string()))?;
        cfg.kv_offload
            .validate()
            .map_err(|e| invalid(e.to_string()))?;
        Ok(cfg)
    }
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
        let q8: Config = toml::from_str("[engine]\nkv_cache_type = \"q8_0\"\n").expect("q8_0");
        assert_eq!(q8.engine.kv_cache_type.name(), "q8_0");
        assert_eq!(c.engine.kv_cache_type.name(), "f16", "the default");
        let e = toml::from_str::<Config>("[engine]\nkv_cache_type = \"q4_0\"\n")
            .expect_err("not a cache type")
            .to_string();
        assert!(e.contains("kv_cache_type \"q4_0\""), "{e}");
    }

    #[test]
    fn shipped_disaggregated_and_incident_configs_are_valid() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs");
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
    fn shipped_fleet_configs_are_valid() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs");
        let r = Config::load(&dir.join("fleet-router.toml")).expect("fleet-router.toml");
        assert!(r.fleet.is_router());
        assert_eq!((r.fleet.prefill.len(), r.fleet.decode.len()), (2, 2));
        for n in [1, 2] {
            let c = Config::load(&dir.join(format!("fleet-prefill-{n}.toml"))).expect("prefill");
            assert_eq!(c.disagg.decode.len(), 2);
            assert_eq!(c.audit.node, n);
        }
        for n in [3, 4] {
            let c = Config::load(&dir.join(format!("fleet-decode-{n}.toml"))).expect("decode");
            assert!(c.disagg.checksum && !c.disagg.health_listen.is_empty());
            assert_eq!(c.audit.node, n);
        }
    }

    #[test]
    fn shipped_single_node_config_is_valid() {
        let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/single-node.toml");
        let c = Config::load(&p).expect("configs/single-node.toml must parse");
        assert!(c.engine.kv_budget_mib > 0);
        let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/serve-demo.toml");
        let c = Config::load(&p).expect("configs/serve-demo.toml must parse");
        assert_eq!(c.serve.tenants.len(), 3);
        assert!(
            c.serve.listen.starts_with("127.0.0.1:"),
            "demo keys: loopback only"
        );
    }
}

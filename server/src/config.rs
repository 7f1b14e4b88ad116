//! `[serve]` and `[[serve.tenants]]`: the HTTP front's listen address, limits, canary and
//! tenants (plain data; the binary deserialises it from the node's TOML file and calls
//! [`ServeSection::validate`]).

use serde::Deserialize;

/// The `[serve]` section's values are not acceptable (the message names the field).
#[derive(Debug, thiserror::Error)]
#[error("invalid config: {0}")]
pub struct ServeConfigError(String);

/// `custody serve`: the HTTP front of a node.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct ServeSection {
    /// HTTP listen address: the tenants' API (`/v1/…`, `/health…`). Nothing served here
    /// tells one tenant anything of another's.
    pub listen: String,
    /// The operator's listener: `/metrics` (every tenant's counts, the prefix cache's hits, the
    /// fleet's nodes) and the health endpoints. Loopback by default — never on the tenants'
    /// port, and never reachable by them: put it where only the operator's scraper reaches.
    /// Empty = off.
    pub metrics_listen: String,
    /// Model id served in `/v1/models` and answered in `model`; empty = the GGUF's name.
    pub model_name: String,
    /// `max_tokens` when a request does not say (lowered to what the context leaves). Every
    /// request reserves its whole `prompt + max_tokens` up front, so "until the context is
    /// full" would make every request hold a full context of pages.
    pub default_max_tokens: usize,
    /// Largest accepted request body, bytes.
    pub max_body_bytes: usize,
    /// Most choices one request may ask for (`n`; above: 400). Each choice holds its own
    /// pages past the shared prompt pages and its own `max_tokens` of the tenant's budget.
    pub max_n: usize,
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
            metrics_listen: DEFAULT_METRICS_LISTEN.into(),
            model_name: String::new(),
            default_max_tokens: 256,
            max_body_bytes: 1 << 20,
            max_n: 8,
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

/// `[serve] metrics_listen`'s default (Prometheus' conventional exporter range, loopback).
pub const DEFAULT_METRICS_LISTEN: &str = "127.0.0.1:9464";

fn default_max_concurrent() -> usize {
    8
}

impl ServeSection {
    pub fn validate(&self) -> Result<(), ServeConfigError> {
        let bad = |m: String| Err(ServeConfigError(m));
        if self.default_max_tokens == 0
            || self.max_body_bytes == 0
            || self.queue_capacity == 0
            || self.max_n == 0
        {
            return bad(
                "serve.default_max_tokens, serve.max_body_bytes and serve.queue_capacity must be positive"
                    .into(),
            );
        }
        if !self.metrics_listen.is_empty() && self.metrics_listen == self.listen {
            return bad(format!(
                "serve.metrics_listen {:?} is the API's own address: /metrics shows every tenant's traffic and must not be served to tenants",
                self.metrics_listen
            ));
        }
        if !(self.audit_high_water > 0.0 && self.audit_high_water <= 1.0) {
            return bad("serve.audit_high_water must be in (0, 1]".into());
        }
        let mut seen = std::collections::BTreeSet::new();
        for t in &self.tenants {
            // Tenant ids are written into `key=value` audit rows (`front_request`, `route`):
            // no whitespace, quote or '=' that could forge another field.
            if t.id
                .chars()
                .any(|c| c.is_whitespace() || c.is_control() || c == '"' || c == '=')
            {
                return bad(format!(
                    "serve.tenants: tenant id {:?} must not contain whitespace, control characters, '\"' or '='",
                    t.id
                ));
            }
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

/// `[fleet]`: `custody serve` as the router of N prefill × M decode nodes (`fleet.rs`). Empty
/// `prefill`: not a router.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct FleetSection {
    /// The prefill nodes (`[[fleet.prefill]]`): node id and front door (`http://host:port`).
    pub prefill: Vec<FleetNode>,
    /// The decode nodes (`[[fleet.decode]]`): node id and control plane (`http://host:port`).
    pub decode: Vec<FleetNode>,
    /// Every node's load report (the active health probe) is asked for this often.
    pub probe_interval_ms: u64,
    /// A probe not answered within this failed.
    pub probe_timeout_ms: u64,
    /// Attempts of one request across pairs (only failures before its first KV write was
    /// posted are retried).
    pub max_attempts: u32,
    /// Health thresholds (`custody_router::health`).
    pub ready_after_ok: u32,
    pub not_ready_after_failures: u32,
    pub failed_after_failures: u32,
    pub circuit_open_ms: u64,
    /// Routing policy (`custody_router::policy`).
    pub cache_match_ratio: f64,
    pub balance_abs_requests: u32,
    pub balance_rel: f64,
    /// Prefix keys the router remembers per prefill node (its approximate view of their caches).
    pub index_keys_per_node: usize,
    /// The power-of-two-choices draws' seed (0: from the OS at start).
    pub seed: u64,
}

/// One node of the fleet as the router knows it.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct FleetNode {
    pub node: u32,
    pub url: String,
}

impl Default for FleetSection {
    fn default() -> Self {
        Self {
            prefill: Vec::new(),
            decode: Vec::new(),
            probe_interval_ms: 250,
            probe_timeout_ms: 1000,
            max_attempts: 3,
            ready_after_ok: 2,
            not_ready_after_failures: 1,
            failed_after_failures: 3,
            circuit_open_ms: 1000,
            cache_match_ratio: 0.5,
            balance_abs_requests: 8,
            balance_rel: 1.5,
            index_keys_per_node: 1 << 16,
            seed: 0,
        }
    }
}

impl FleetSection {
    pub fn is_router(&self) -> bool {
        !self.prefill.is_empty()
    }

    pub fn validate(&self) -> Result<(), ServeConfigError> {
        let bad = |m: &str| Err(ServeConfigError(format!("[fleet]: {m}")));
        if self.decode.is_empty() {
            return bad("a router needs at least one [[fleet.decode]] node");
        }
        let mut ids = std::collections::BTreeSet::new();
        for n in self.prefill.iter().chain(&self.decode) {
            if n.node == 0 || !ids.insert(n.node) {
                return bad(&format!("node {} is 0 or listed twice", n.node));
            }
        }
        if self.probe_interval_ms == 0 || self.probe_timeout_ms == 0 || self.max_attempts == 0 {
            return bad("probe_interval_ms, probe_timeout_ms and max_attempts must be positive");
        }
        if self.index_keys_per_node == 0 {
            return bad("index_keys_per_node must be positive");
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Deserialize)]
    struct File {
        serve: ServeSection,
    }

    #[test]
    fn serve_section_rejects_bad_tenants() {
        let ok = format!(
            "[[serve.tenants]]\nid = \"acme\"\nkeys_sha256 = [\"{}\"]\n",
            "a".repeat(64)
        );
        let c: File = toml::from_str(&ok).expect("parse");
        c.serve.validate().expect("valid");
        assert_eq!(c.serve.tenants[0].max_concurrent, 8);
        for bad in [
            ok.replace(&"a".repeat(64), "not-a-hash"),
            ok.replace(&"a".repeat(64), &"A".repeat(64)),
            ok.replace("acme", "_canary"),
            ok.replace("acme", "a transfer=1"),
            format!("{ok}{}", ok.replace("acme", "other")),
        ] {
            let c: File = toml::from_str(&bad).expect("parse");
            assert!(c.serve.validate().is_err(), "{bad}");
        }
    }
}

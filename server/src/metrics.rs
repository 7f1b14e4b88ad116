//! `/metrics`: Prometheus text exposition format (version 0.0.4), rendered by hand — a few
//! counters, gauges and fixed-bucket histograms do not justify a metrics dependency.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::Mutex;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::time::Duration;

use crate::engine_thread::EngineGauges;

/// Audit writer figures the server exports and admits by (implemented by the binary over the
/// writer, which this crate does not link).
pub trait AuditStats: Send + Sync + std::fmt::Debug {
    fn queue_depth(&self) -> u64;
    fn queue_capacity(&self) -> u64;
    fn dropped_total(&self) -> u64;
    /// Rounds in which the node's newest tree checkpoint did not get every configured tlog
    /// witness's cosignature (0 without `[audit] witnesses`).
    fn uncosigned_rounds(&self) -> u64 {
        0
    }
    /// `[audit] require_cosignatures`: the newest tree checkpoint lacks the cosignatures it must
    /// have, so the node takes no new work (fail-closed; false when not configured).
    fn cosignatures_missing(&self) -> bool {
        false
    }
}

/// Seconds; latency buckets from 1 ms to 60 s.
const LATENCY_BOUNDS_S: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];

/// A fixed-bucket histogram of durations.
#[derive(Debug)]
pub struct Histogram {
    counts: Vec<AtomicU64>,
    sum_ns: AtomicU64,
    count: AtomicU64,
}

impl Default for Histogram {
    fn default() -> Self {
        Self {
            counts: LATENCY_BOUNDS_S.iter().map(|_| AtomicU64::new(0)).collect(),
            sum_ns: AtomicU64::new(0),
            count: AtomicU64::new(0),
        }
    }
}

impl Histogram {
    pub fn observe(&self, d: Duration) {
        let s = d.as_secs_f64();
        if let Some(i) = LATENCY_BOUNDS_S.iter().position(|&b| s <= b) {
            self.counts[i].fetch_add(1, Ordering::Relaxed);
        }
        self.sum_ns
            .fetch_add(d.as_nanos() as u64, Ordering::Relaxed);
        self.count.fetch_add(1, Ordering::Relaxed);
    }

    fn render(&self, out: &mut String, name: &str, help: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        let mut cum = 0u64;
        for (b, c) in LATENCY_BOUNDS_S.iter().zip(&self.counts) {
            cum += c.load(Ordering::Relaxed);
            let _ = writeln!(out, "{name}_bucket{{le=\"{b}\"}} {cum}");
        }
        let n = self.count.load(Ordering::Relaxed);
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {n}");
        let sum = self.sum_ns.load(Ordering::Relaxed) as f64 / 1e9;
        let _ = writeln!(out, "{name}_sum {sum}\n{name}_count {n}");
    }
}

/// Everything the server counts itself (the engine's state comes from [`EngineGauges`]).
#[derive(Debug, Default)]
pub struct Metrics {
    /// (tenant, endpoint, HTTP status) → requests.
    requests: Mutex<BTreeMap<(String, &'static str, u16), u64>>,
    /// (tenant, "prompt" | "completion") → tokens.
    tokens: Mutex<BTreeMap<(String, &'static str), u64>>,
    /// tenant → (prompt tokens, of them served from the prefix cache), finished requests.
    prefix: Mutex<BTreeMap<String, (u64, u64)>>,
    pub in_flight: AtomicI64,
    /// Refused because the audit writer's queue was above its high-water mark.
    pub audit_backpressure_rejections_total: AtomicU64,
    pub time_to_first_token: Histogram,
    pub inter_token: Histogram,
    pub request_duration: Histogram,
    pub canary_pass_total: AtomicU64,
    pub canary_fail_total: AtomicU64,
    /// 1 pass, 0 fail, -1 not run yet.
    pub canary_ok: AtomicI64,
    /// The server was started without an audit log (`--no-audit`): `custody_audit_disabled 1`.
    pub audit_disabled: std::sync::atomic::AtomicBool,
}

impl Metrics {
    pub fn new() -> Self {
        Self {
            canary_ok: AtomicI64::new(-1),
            ..Self::default()
        }
    }

    pub fn request(&self, tenant: &str, endpoint: &'static str, status: u16) {
        let mut m = self.requests.lock().unwrap_or_else(|p| p.into_inner());
        *m.entry((tenant.to_owned(), endpoint, status)).or_default() += 1;
    }

    pub fn tokens(&self, tenant: &str, prompt: usize, completion: usize) {
        let mut m = self.tokens.lock().unwrap_or_else(|p| p.into_inner());
        *m.entry((tenant.to_owned(), "prompt")).or_default() += prompt as u64;
        *m.entry((tenant.to_owned(), "completion")).or_default() += completion as u64;
    }

    /// A finished request's prompt tokens and how many of them came from the prefix cache.
    pub fn prefix_cache(&self, tenant: &str, prompt: usize, cached: usize) {
        let mut m = self.prefix.lock().unwrap_or_else(|p| p.into_inner());
        let e = m.entry(tenant.to_owned()).or_default();
        e.0 += prompt as u64;
        e.1 += cached as u64;
    }

    /// The whole exposition.
    pub fn render(&self, g: &EngineGauges, audit: Option<&dyn AuditStats>) -> String {
        let mut o = String::with_capacity(8 << 10);
        let ld = |a: &AtomicU64| a.load(Ordering::Relaxed);
        o.push_str("# HELP custody_requests_total HTTP requests answered, by tenant, endpoint and status.\n# TYPE custody_requests_total counter\n");
        for ((t, e, s), n) in self
            .requests
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
        {
            let _ = writeln!(
                o,
                "custody_requests_total{{tenant=\"{}\",endpoint=\"{e}\",status=\"{s}\"}} {n}",
                escape(t)
            );
        }
        o.push_str("# HELP custody_tokens_total Tokens processed, by tenant and kind (prompt, completion).\n# TYPE custody_tokens_total counter\n");
        for ((t, k), n) in self.tokens.lock().unwrap_or_else(|p| p.into_inner()).iter() {
            let _ = writeln!(
                o,
                "custody_tokens_total{{tenant=\"{}\",kind=\"{k}\"}} {n}",
                escape(t)
            );
        }
        let prefix = self
            .prefix
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        o.push_str("# HELP custody_prefix_cache_tokens_total Prompt tokens of finished requests by tenant: all of them (kind=prompt) and those served from the prefix cache (kind=cached).\n# TYPE custody_prefix_cache_tokens_total counter\n");
        for (t, (prompt, cached)) in &prefix {
            for (k, n) in [("prompt", prompt), ("cached", cached)] {
                let _ = writeln!(
                    o,
                    "custody_prefix_cache_tokens_total{{tenant=\"{}\",kind=\"{k}\"}} {n}",
                    escape(t)
                );
            }
        }
        o.push_str("# HELP custody_prefix_cache_hit_rate Share of a tenant's prompt tokens served from the prefix cache (finished requests).\n# TYPE custody_prefix_cache_hit_rate gauge\n");
        for (t, (prompt, cached)) in &prefix {
            let rate = if *prompt == 0 {
                0.0
            } else {
                *cached as f64 / *prompt as f64
            };
            let _ = writeln!(
                o,
                "custody_prefix_cache_hit_rate{{tenant=\"{}\"}} {rate}",
                escape(t)
            );
        }
        let gauge = |o: &mut String, name: &str, help: &str, v: f64| {
            let _ = writeln!(o, "# HELP {name} {help}\n# TYPE {name} gauge\n{name} {v}");
        };
        let counter = |o: &mut String, name: &str, help: &str, v: u64| {
            let _ = writeln!(o, "# HELP {name} {help}\n# TYPE {name} counter\n{name} {v}");
        };
        gauge(
            &mut o,
            "custody_requests_in_flight",
            "HTTP generation requests being served.",
            self.in_flight.load(Ordering::Relaxed) as f64,
        );
        gauge(
            &mut o,
            "custody_queue_depth",
            "Admitted requests waiting for KV pages or a running slot.",
            ld(&g.waiting) as f64,
        );
        gauge(
            &mut o,
            "custody_running_requests",
            "Requests in prefill or decode.",
            ld(&g.running) as f64,
        );
        let (total, free) = (ld(&g.pages_total), ld(&g.pages_free));
        gauge(
            &mut o,
            "custody_prefix_cache_pages",
            "KV pages the prefix cache holds (part of the used pages).",
            ld(&g.prefix_cache_pages) as f64,
        );
        gauge(
            &mut o,
            "custody_prefix_cache_unheld_pages",
            "Cached pages no request holds: returned to the pool when it needs them.",
            ld(&g.prefix_cache_unheld_pages) as f64,
        );
        counter(
            &mut o,
            "custody_prefix_cache_evictions_total",
            "Cached pages evicted (least recently used, never while a request holds them).",
            ld(&g.prefix_cache_evictions_total),
        );
        o.push_str("# HELP custody_kv_offload_pages KV offload: pages each tier holds.\n# TYPE custody_kv_offload_pages gauge\n");
        for (i, tier) in ["host", "disk", "object"].iter().enumerate() {
            o.push_str(&format!(
                "custody_kv_offload_pages{{tier=\"{tier}\"}} {}\n",
                ld(&g.offload_pages[i])
            ));
        }
        for (name, help, v) in [
            (
                "custody_kv_offload_offloaded_total",
                "Evicted cached pages stored in the first offload tier.",
                &g.offload_offloaded_total,
            ),
            (
                "custody_kv_offload_restored_total",
                "Offloaded pages verified and restored into the pool (hits).",
                &g.offload_restored_total,
            ),
            (
                "custody_kv_offload_refused_total",
                "Offloaded pages that failed verification at a restore (a miss and an integrity violation each).",
                &g.offload_refused_total,
            ),
            (
                "custody_kv_offload_evicted_total",
                "Offloaded pages that left their last tier (over its size).",
                &g.offload_evicted_total,
            ),
        ] {
            counter(&mut o, name, help, ld(v));
        }
        gauge(
            &mut o,
            "custody_kv_pages_total",
            "KV pool size, pages.",
            total as f64,
        );
        gauge(
            &mut o,
            "custody_kv_pages_used",
            "KV pages allocated (reserved by requests or quarantined).",
            total.saturating_sub(free) as f64,
        );
        gauge(
            &mut o,
            "custody_kv_pool_occupancy_ratio",
            "Allocated fraction of the KV pool.",
            if total > 0 {
                total.saturating_sub(free) as f64 / total as f64
            } else {
                0.0
            },
        );
        counter(
            &mut o,
            "custody_engine_steps_total",
            "Engine batches run.",
            ld(&g.steps_total),
        );
        counter(
            &mut o,
            "custody_integrity_violations_total",
            "Requests failed by the KV tag check (a refused read; no output was returned).",
            ld(&g.integrity_violations_total),
        );
        counter(
            &mut o,
            "custody_checksum_failures_total",
            "Transferred KV pages that failed their checksum (disaggregated decode only; a single node transfers nothing).",
            0,
        );
        counter(
            &mut o,
            "custody_transfer_failures_total",
            "KV transfers that failed (disaggregated only; a single node transfers nothing).",
            0,
        );
        counter(
            &mut o,
            "custody_aborted_requests_total",
            "Requests aborted (client gone, stop sequence, shutdown, audit failure).",
            ld(&g.aborted_total),
        );
        counter(
            &mut o,
            "custody_prefill_anomalies_total",
            "First tokens that came sooner than computing the prompt can take (prompt KV not computed?).",
            ld(&g.prefill_anomalies_total),
        );
        gauge(
            &mut o,
            "custody_calibrated_prefill_tokens_per_second",
            "Prefill throughput measured at start-up (the anomaly check's yardstick).",
            ld(&g.calibrated_prefill_tok_s) as f64,
        );
        gauge(
            &mut o,
            "custody_audit_failed",
            "1 when the engine's audit sink failed and it serves nothing (fail-closed).",
            u8::from(g.audit_failed.load(Ordering::Relaxed)) as f64,
        );
        gauge(
            &mut o,
            "custody_audit_disabled",
            "1 when this server runs without an audit log (--no-audit): nothing it serves is recorded.",
            u8::from(self.audit_disabled.load(Ordering::Relaxed)) as f64,
        );
        if let Some(a) = audit {
            gauge(
                &mut o,
                "custody_audit_queue_depth",
                "Audit events queued for the writer.",
                a.queue_depth() as f64,
            );
            gauge(
                &mut o,
                "custody_audit_queue_capacity",
                "Audit writer queue capacity, events.",
                a.queue_capacity() as f64,
            );
            counter(
                &mut o,
                "custody_audit_dropped_events_total",
                "Audit events dropped (only with [audit] allow_drop; each drop is also counted in the log).",
                a.dropped_total(),
            );
            counter(
                &mut o,
                "custody_audit_uncosigned_checkpoints_total",
                "Rounds in which a tlog witness did not cosign the newest tree checkpoint (down, refused, or the node rolled back; each also a node_events row).",
                a.uncosigned_rounds(),
            );
        }
        counter(
            &mut o,
            "custody_audit_backpressure_rejections_total",
            "Requests refused (503) because the audit writer could not keep up.",
            ld(&self.audit_backpressure_rejections_total),
        );
        let _ = writeln!(
            o,
            "# HELP custody_canary_runs_total Canary runs (golden prompts, greedy, token for token against the start-up reference).\n# TYPE custody_canary_runs_total counter\ncustody_canary_runs_total{{result=\"pass\"}} {}\ncustody_canary_runs_total{{result=\"fail\"}} {}",
            ld(&self.canary_pass_total),
            ld(&self.canary_fail_total)
        );
        gauge(
            &mut o,
            "custody_canary_ok",
            "Last canary result: 1 pass, 0 fail, -1 not run yet.",
            self.canary_ok.load(Ordering::Relaxed) as f64,
        );
        self.time_to_first_token.render(
            &mut o,
            "custody_time_to_first_token_seconds",
            "From request received to first token.",
        );
        self.inter_token.render(
            &mut o,
            "custody_inter_token_seconds",
            "Between consecutive tokens of one request.",
        );
        self.request_duration.render(
            &mut o,
            "custody_request_duration_seconds",
            "From request received to its last token.",
        );
        o
    }
}

/// Label values: backslash, quote and newline escaped.
fn escape(s: &str) -> String {
    s.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_is_cumulative() {
        let h = Histogram::default();
        h.observe(Duration::from_micros(500));
        h.observe(Duration::from_millis(20));
        h.observe(Duration::from_secs(100));
        let mut o = String::new();
        h.render(&mut o, "x", "help");
        assert!(o.contains("x_bucket{le=\"0.001\"} 1\n"), "{o}");
        assert!(o.contains("x_bucket{le=\"0.025\"} 2\n"), "{o}");
        assert!(o.contains("x_bucket{le=\"60\"} 2\n"), "{o}");
        assert!(o.contains("x_bucket{le=\"+Inf\"} 3\n"), "{o}");
        assert!(o.contains("x_count 3\n"), "{o}");
    }

    #[test]
    fn labels_are_escaped() {
        let m = Metrics::new();
        m.request("a\"b", "chat", 200);
        let o = m.render(&EngineGauges::default(), None);
        assert!(
            o.contains(
                "custody_requests_total{tenant=\"a\\\"b\",endpoint=\"chat\",status=\"200\"} 1"
            ),
            "{o}"
        );
    }
}

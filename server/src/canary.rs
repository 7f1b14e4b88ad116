//! Output validation: golden prompts, run greedy, must produce the same tokens as a colocated
//! reference — token for token, because the incident's corrupted outputs were fluent text that
//! no HTTP code or latency graph flagged.
//!
//! The reference is computed at start-up with each prompt alone on an otherwise idle engine.
//! The background canary then sends the same prompts through the serving path (the engine
//! thread, batched with live traffic, on recycled pages) and compares; `custody validate`
//! does the same against a running server over HTTP.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use custody_audit as audit;
use custody_runtime::engine::{Engine, GenerateRequest};
use custody_runtime::{SamplingParams, Tokenizer};

use crate::backend::Backend;
use crate::engine_thread::{Out, run_alone};
use crate::metrics::Metrics;

/// Built-in golden prompts (raw text, no chat template): short, varied, and long enough that
/// a wrong page read changes the continuation.
pub const GOLDEN_TEXTS: &[(&str, &str)] = &[
    ("capital", "The capital of France is"),
    (
        "rivers",
        "Here is a list of the longest rivers in Europe, from longest to shortest:\n1.",
    ),
    (
        "code",
        "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    ),
];

/// Tokens generated per golden prompt.
pub const GOLDEN_MAX_TOKENS: usize = 24;

/// The tenant the server's own validation requests run as (tenant ids from the config may not
/// start with '_').
pub const CANARY_TENANT: &str = "_canary";

/// One golden prompt and its reference output.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Golden {
    pub name: String,
    pub prompt: Vec<u32>,
    pub max_tokens: usize,
    pub expected: Vec<u32>,
}

impl Golden {
    pub fn request(&self, tenant: &str, stop_ids: &[u32]) -> GenerateRequest {
        GenerateRequest {
            decoding: Default::default(),
            prompt: self.prompt.clone(),
            max_tokens: self.max_tokens,
            sampling: SamplingParams::default(),
            stop_ids: stop_ids.to_vec(),
            tenant: tenant.into(),
            cache: None,
        }
    }
}

/// Why the golden reference could not be computed.
#[derive(Debug, thiserror::Error)]
pub enum GoldenError {
    #[error("golden prompt {name}: {source}")]
    Tokenize {
        name: &'static str,
        source: custody_runtime::tokenizer::TokenizerError,
    },
    #[error("golden prompt {name}: {source}")]
    Run {
        name: &'static str,
        source: crate::engine_thread::RunAloneError,
    },
}

/// Compute the reference outputs: each golden prompt alone, greedy, on `engine` (which must
/// have no other work). Recorded in the audit log like any request, as tenant `tenant`.
pub fn reference(
    engine: &mut Engine,
    pool: &custody_runtime::par::ThreadPool,
    tokenizer: &Tokenizer,
    tenant: &str,
) -> Result<Vec<Golden>, GoldenError> {
    let mut out = Vec::new();
    for &(name, text) in GOLDEN_TEXTS {
        let prompt = tokenizer
            .encode(text, false)
            .map_err(|source| GoldenError::Tokenize { name, source })?;
        let mut g = Golden {
            name: (*name).into(),
            prompt,
            max_tokens: GOLDEN_MAX_TOKENS,
            expected: Vec::new(),
        };
        let (tokens, _) = run_alone(engine, pool, g.request(tenant, &tokenizer.stop_ids))
            .map_err(|source| GoldenError::Run { name, source })?;
        g.expected = tokens;
        out.push(g);
    }
    Ok(out)
}

/// Index of the first differing token, if the outputs differ.
pub fn first_divergence(expected: &[u32], got: &[u32]) -> Option<usize> {
    let n = expected.len().min(got.len());
    match (0..n).find(|&i| expected[i] != got[i]) {
        Some(i) => Some(i),
        None if expected.len() != got.len() => Some(n),
        None => None,
    }
}

/// One prompt that did not match.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct Mismatch {
    pub name: String,
    /// First differing token position (None when the request failed outright).
    pub first_divergence: Option<usize>,
    pub expected: Vec<u32>,
    pub got: Vec<u32>,
    pub error: Option<String>,
}

/// A canary or validation run.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct Report {
    pub checked: usize,
    pub mismatches: Vec<Mismatch>,
}

impl Report {
    pub fn pass(&self) -> bool {
        self.checked > 0 && self.mismatches.is_empty()
    }

    /// Count `g`'s run: its tokens, or why it produced none.
    pub fn add<E: std::fmt::Display>(&mut self, g: &Golden, got: Result<Vec<u32>, E>) {
        self.checked += 1;
        match got {
            Ok(got) => {
                if let Some(i) = first_divergence(&g.expected, &got) {
                    self.mismatches.push(Mismatch {
                        name: g.name.clone(),
                        first_divergence: Some(i),
                        expected: g.expected.clone(),
                        got,
                        error: None,
                    });
                }
            }
            Err(e) => self.mismatches.push(Mismatch {
                name: g.name.clone(),
                first_divergence: None,
                expected: g.expected.clone(),
                got: Vec::new(),
                error: Some(e.to_string()),
            }),
        }
    }
}

/// Send every golden prompt through the engine thread at once (so they batch with each other
/// and with live traffic) and compare.
async fn run_once(engine: &Backend, golden: &[Golden], stop_ids: &[u32]) -> Report {
    let mut pending = Vec::new();
    for g in golden {
        let r = engine
            .submit(g.request(CANARY_TENANT, stop_ids), 0, None)
            .await;
        pending.push((g, r));
    }
    let mut report = Report {
        checked: 0,
        mismatches: Vec::new(),
    };
    for (g, r) in pending {
        let got = match r {
            Err((_, e)) => Err(e.message),
            Ok((_, _, mut events)) => {
                let mut toks = Vec::new();
                let mut res = Err("the engine dropped the request".to_owned());
                while let Some(ev) = events.rx.recv().await {
                    match ev {
                        Out::Token { token, .. } => toks.push(token),
                        Out::Finished { .. } => {
                            res = Ok(std::mem::take(&mut toks));
                            break;
                        }
                        Out::Failed(e) => {
                            res = Err(format!("integrity: {e}"));
                            break;
                        }
                        Out::Aborted(e) => {
                            res = Err(format!("aborted: {e}"));
                            break;
                        }
                    }
                }
                res
            }
        };
        report.add(g, got);
    }
    report
}

/// The background canary: every `interval`, one run; the result goes to the metrics, the log
/// and the audit log (`node_events`, kind `canary`). Runs until the task is aborted.
pub(crate) async fn canary_loop(
    engine: Backend,
    golden: Arc<Vec<Golden>>,
    stop_ids: Vec<u32>,
    metrics: Arc<Metrics>,
    interval: Duration,
) {
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tick.tick().await; // the first tick is immediate: the reference was just computed
    loop {
        tick.tick().await;
        let report = run_once(&engine, &golden, &stop_ids).await;
        let pass = report.pass();
        if pass {
            metrics.canary_pass_total.fetch_add(1, Ordering::Relaxed);
            tracing::info!(
                checked = report.checked,
                "canary: outputs match the reference"
            );
        } else {
            metrics.canary_fail_total.fetch_add(1, Ordering::Relaxed);
            tracing::error!(report = ?report, "CANARY FAILED: served output differs from the reference");
        }
        metrics.canary_ok.store(i64::from(pass), Ordering::Relaxed);
        let detail = serde_json::json!({"pass": pass, "report": report}).to_string();
        let ev = audit::Event::Node {
            ts_ns: audit::mono_now_ns(),
            kind: "canary".into(),
            detail,
        };
        if engine.record(ev).await.is_err() {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn divergence_positions() {
        assert_eq!(first_divergence(&[1, 2, 3], &[1, 2, 3]), None);
        assert_eq!(first_divergence(&[1, 2, 3], &[1, 9, 3]), Some(1));
        assert_eq!(first_divergence(&[1, 2, 3], &[1, 2]), Some(2));
        assert_eq!(first_divergence(&[1], &[1, 2]), Some(1));
        let g = Golden {
            name: "g".into(),
            prompt: vec![1],
            max_tokens: 3,
            expected: vec![1, 2, 3],
        };
        let mut r = Report {
            checked: 0,
            mismatches: Vec::new(),
        };
        r.add::<&str>(&g, Ok(vec![1, 2, 3]));
        assert!(r.pass());
        r.add(&g, Err("boom"));
        assert!(!r.pass());
    }
}

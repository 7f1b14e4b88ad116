//! The prefix cache and KV offload on a device: what `e2e::cuda_forward` asserts on the shim and
//! `custody gpu-check cache` reports on a GPU. One script of requests through three engines —
//! the device's with the prefix cache and a host offload tier, the device's without a cache,
//! the CPU's with a cache — then every cached page of the device's engine evicted into the tier
//! and a follow-up served from it:
//! - acme's first turn (5 full pages: 2 of the operator's public scope, 3 of its own), its
//!   follow-up (a hit on all 5), bravo's prompt behind the same public prefix (a hit on the 2
//!   public pages only), charlie sending acme's exact first prompt (the 2 public pages, nothing
//!   of acme's) — each request's reader names two shared namespaces (its tenant's, the public
//!   scope's), the most the device's tag check takes;
//! - after the eviction, acme's follow-up again: its 6 full pages restored from the tier
//!   (verified, staged onto the device), and a new tenant, delta, served only the public pages.
//!
//! A device passes when its cached runs give its own uncached tokens and the expected hits, and
//! no restored page is refused. On the shim the tokens are also the CPU's, bit for bit (the
//! test asserts it); on a GPU, summation order may move a near-tie, so the CPU's agreement is
//! reported, not required.

use std::sync::Arc;

use custody_cuda::Device;
use custody_kernels::DType;

use super::{CheckError, load};
use crate::config::EngineConfig;
use crate::engine::{AdmissionError, Engine, Event, GenerateRequest, StartupError};
use crate::gguf::write::Synthetic;
use crate::offload::seal::SealKeys;
use crate::offload::store::HostArena;
use crate::offload::{OffloadConfig, OffloadError, OffloadStats, TierSpec};
use crate::prefix_cache::{CacheScope, NamespaceSecret, PublicPrefix};

/// Tokens per page of the check's engines.
const PAGE_TOKENS: usize = 8;
/// Greedy tokens generated per request.
const MAX_TOKENS: usize = 5;
/// Steps one request may take before the check gives up on it (bounds the loop).
const MAX_STEPS: usize = 256;

/// Why the cache check could not run.
#[derive(Debug, thiserror::Error)]
pub enum CacheCheckError {
    #[error(transparent)]
    Check(#[from] CheckError),
    #[error("engine: {0}")]
    Startup(#[from] StartupError),
    #[error("offload: {0}")]
    Offload(#[from] OffloadError),
    #[error("request not admitted: {0}")]
    Admission(#[from] AdmissionError),
    #[error("{tenant}'s request did not finish in {MAX_STEPS} steps")]
    Unfinished { tenant: String },
}

/// One request's greedy tokens, how many prompt tokens the prefix cache served, and the
/// integrity failure that stopped it, if one did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Served {
    pub tokens: Vec<u32>,
    pub cached_tokens: usize,
    pub failed: Option<String>,
}

/// One request of the script on each engine.
#[derive(Clone, Debug)]
pub struct Turn {
    pub tenant: &'static str,
    /// The prompt tokens the prefix cache must serve.
    pub expected_cached: usize,
    /// The device without a cache (the tokens a cached run must give).
    pub uncached: Served,
    pub device: Served,
    pub cpu: Served,
}

impl Turn {
    /// What is wrong with the device's run (empty: nothing).
    fn faults(&self) -> Vec<String> {
        let mut out = Vec::new();
        let d = &self.device;
        if let Some(f) = d.failed.as_ref().or(self.uncached.failed.as_ref()) {
            out.push(format!("{}: failed its tag check: {f}", self.tenant));
        }
        if d.tokens != self.uncached.tokens {
            out.push(format!(
                "{}: cached tokens {:?} differ from uncached {:?}",
                self.tenant, d.tokens, self.uncached.tokens
            ));
        }
        if d.cached_tokens != self.expected_cached {
            out.push(format!(
                "{}: {} prompt tokens served by the cache, {} expected",
                self.tenant, d.cached_tokens, self.expected_cached
            ));
        }
        out
    }
}

/// The script's outcome.
#[derive(Clone, Debug)]
pub struct CacheCheck {
    /// The four requests before the eviction, then the two after it.
    pub turns: Vec<Turn>,
    /// The device engine's offload counters at the end.
    pub offload: OffloadStats,
    /// Restores the follow-up after the eviction made (the tier's).
    pub restored: u64,
}

impl CacheCheck {
    /// Everything that failed; empty when the device passes.
    pub fn faults(&self) -> Vec<String> {
        let mut out: Vec<String> = self.turns.iter().flat_map(Turn::faults).collect();
        if self.restored < 6 {
            out.push(format!(
                "{} pages restored from the host tier, 6 expected",
                self.restored
            ));
        }
        if self.offload.refused > 0 {
            out.push(format!("{} restored pages refused", self.offload.refused));
        }
        out
    }

    /// Whether the device's tokens and hits were the CPU's for every request.
    pub fn cpu_agrees(&self) -> bool {
        self.turns.iter().all(|t| t.cpu == t.device)
    }
}

/// The script's tenants, prompts and scopes.
struct Script {
    secret: NamespaceSecret,
    system: Vec<u32>,
    first: Vec<u32>,
    follow_up: Vec<u32>,
    other: Vec<u32>,
}

impl Script {
    fn new() -> Self {
        let turn =
            |seed: u32, n: u32| -> Vec<u32> { (0..n).map(|t| (t * 7 + seed * 31) % 256).collect() };
        let system: Vec<u32> = (0..2 * PAGE_TOKENS as u32)
            .map(|t| (t * 11 + 5) % 256)
            .collect();
        let first = [system.clone(), turn(1, 3 * PAGE_TOKENS as u32)].concat();
        let follow_up = [first.clone(), turn(2, 10)].concat();
        let other = [system.clone(), turn(3, 3 * PAGE_TOKENS as u32)].concat();
        let secret = NamespaceSecret::from_hex(&"3d".repeat(32))
            .unwrap_or_else(|e| unreachable!("a fixed 32-byte hex secret: {e}"));
        Self {
            secret,
            system,
            first,
            follow_up,
            other,
        }
    }

    /// A tenant's scope: its own namespace and the public scope of the system prompt.
    fn scope(&self, tenant: &str) -> CacheScope {
        CacheScope {
            private: self.secret.private(tenant, None),
            public: Some(PublicPrefix {
                namespace: self.secret.public("helpdesk"),
                tokens: self.system.clone().into(),
            }),
        }
    }
}

/// An engine config of the check (page size 8, 1 MiB of KV: 128 slots of context).
fn config(prefix_cache: bool) -> EngineConfig {
    EngineConfig {
        context_length: Some(128),
        page_size: PAGE_TOKENS,
        kv_budget_mib: 1,
        max_batch_tokens: 48,
        prefix_cache: Some(prefix_cache),
        ..EngineConfig::default()
    }
}

/// Run one request to its end and let the offload's jobs land.
pub fn serve_one(
    e: &mut Engine,
    tenant: &str,
    prompt: &[u32],
    cache: Option<CacheScope>,
) -> Result<Served, CacheCheckError> {
    let id = e.submit(GenerateRequest {
        decoding: Default::default(),
        prompt: prompt.to_vec(),
        max_tokens: MAX_TOKENS,
        sampling: Default::default(),
        stop_ids: vec![],
        tenant: tenant.into(),
        cache,
    })?;
    let mut out = Served::default();
    let mut finished = false;
    for _ in 0..MAX_STEPS {
        if finished || !e.has_work() {
            break;
        }
        for ev in e.step() {
            match ev {
                Event::Token { id: i, token, .. } if i == id => out.tokens.push(token),
                Event::Finished {
                    id: i,
                    cached_tokens,
                    ..
                } if i == id => {
                    out.cached_tokens = cached_tokens;
                    finished = true;
                }
                Event::Failed { id: i, error } if i == id => {
                    out.failed = Some(error.to_string());
                    finished = true;
                }
                _ => {}
            }
        }
    }
    if !finished {
        return Err(CacheCheckError::Unfinished {
            tenant: tenant.into(),
        });
    }
    e.offload_flush();
    Ok(out)
}

/// The three engines of the check.
struct Engines {
    /// The device's, with the prefix cache and a host offload tier.
    dev: Engine,
    /// The device's, without a cache.
    plain: Engine,
    /// The CPU's, with the prefix cache.
    cpu: Engine,
}

impl Engines {
    /// One request of the script through every engine.
    fn turn(
        &mut self,
        s: &Script,
        tenant: &'static str,
        prompt: &[u32],
        expected_cached: usize,
    ) -> Result<Turn, CacheCheckError> {
        Ok(Turn {
            tenant,
            expected_cached,
            uncached: serve_one(&mut self.plain, tenant, prompt, None)?,
            device: serve_one(&mut self.dev, tenant, prompt, Some(s.scope(tenant)))?,
            cpu: serve_one(&mut self.cpu, tenant, prompt, Some(s.scope(tenant)))?,
        })
    }
}

/// The check on `device` and on a second device for the uncached reference (`uncached`).
pub fn cache_and_offload(
    device: Box<dyn Device>,
    uncached: Box<dyn Device>,
) -> Result<CacheCheck, CacheCheckError> {
    let synthetic = Synthetic::tiny(DType::F32, 7);
    let s = Script::new();
    let mut e = Engines {
        dev: Engine::new_on_device(load(&synthetic)?, config(true), device)?,
        plain: Engine::new_on_device(load(&synthetic)?, config(false), uncached)?,
        cpu: Engine::new(load(&synthetic)?, config(true))?,
    };
    let layout = e.dev.offload_layout();
    e.dev.enable_offload(OffloadConfig {
        tiers: vec![TierSpec {
            store: Arc::new(HostArena::new()),
            budget_bytes: 64 << 20,
        }],
        keys: SealKeys::new(&s.secret.offload_mac_key(), None),
        layout,
        node: 1,
        token_only: false,
        queue_pages: 64,
    })?;
    let public = 2 * PAGE_TOKENS;
    let mut turns = vec![
        e.turn(&s, "acme", &s.first, 0)?,
        e.turn(&s, "acme", &s.follow_up, s.first.len())?,
        e.turn(&s, "bravo", &s.other, public)?,
        e.turn(&s, "charlie", &s.first, public)?,
    ];
    // Every cached page of the device's engine into the host tier; then the follow-up (its 6
    // full pages: the first turn's 5 and its own sixth, restored) and a new tenant. The CPU's
    // engine still holds its pages in its pool: the same hits, no restore.
    e.dev.evict_cached();
    e.dev.offload_flush();
    let before = e.dev.offload_stats().unwrap_or_default().restored;
    let follow_pages = (s.follow_up.len() / PAGE_TOKENS) * PAGE_TOKENS;
    turns.push(e.turn(&s, "acme", &s.follow_up, follow_pages)?);
    turns.push(e.turn(&s, "delta", &s.first, public)?);
    let offload = e.dev.offload_stats().unwrap_or_default();
    Ok(CacheCheck {
        turns,
        restored: offload.restored - before,
        offload,
    })
}

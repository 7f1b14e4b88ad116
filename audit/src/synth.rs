//! A deterministic synthetic audit log at scale, with injected exposures whose answers are known.
//!
//! Each node is simulated as the engine behaves (`runtime/engine/src/engine.rs`), step by step, and
//! recorded through its own real [`AuditWriter`] into one audit root, so the log is sealed,
//! chained, signed and verifiable like a production one:
//!
//! - a bounded page pool per node with a LIFO free list (a released page is the next one handed
//!   out, so pages are reused across many generations and tenants);
//! - up to `max_batch` requests in flight per node, interleaved step by step; a request reserves
//!   `ceil((prompt + max_tokens) / page_size)` pages at admission (one `alloc` each), writes its
//!   prompt in chunked prefill (`write` rows split by page, up to a page per row), then one slot
//!   per decode step (write-ahead), and when it ends flushes one run-length `page_reads` row per
//!   page it attended (`[0, filled)`, first and last step), releases every page and finishes;
//! - many tenants with skewed popularity, long prompts (log-uniform), a few rejected requests;
//! - with `cache_hit_rate` > 0, the prefix cache: a finished request may share its full prompt
//!   pages (`prefix_cache` `share` rows; the pages stay allocated to the cache, a fraction in a
//!   public scope), and that fraction of later requests starts from a cached prefix — its own
//!   tenant's or a public one (one `hit` row per page, the hit pages attended but not written);
//!   the cache is bounded and evicts unheld entries, least recently used first (`evict` rows
//!   and the writer's page `release`). Neither kind of hit is an exposure;
//! - `exposures` injected incidents: a request whose prompt KV was truncated to one slot (the
//!   incident's fault) but which attended the whole prompt with the tag check disabled
//!   (`verdict = 'unchecked'`), so it read whatever the recycled pages last held.
//!
//! The generator keeps, per node, the tenant that last wrote every slot of the pool, and computes
//! for every read row the slots whose latest earlier write was another tenant's — the definition
//! in `docs/forensics.md`, evaluated independently of any SQL. The injected requests' counts are
//! the ground truth ([`SynthTruth`]); every other read is checked to have none.
//!
//! Deterministic: the same configuration and seed give the same events in the same per-node
//! order (timestamps and file names aside).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use ed25519_dalek::SigningKey;
use serde::{Deserialize, Serialize};

use crate::writer::{AuditWriter, FsyncPolicy, WriterConfig, WriterError};
use crate::{AuditSink, Event, PageKind, RequestKind, SinkError, Writer, mono_now_ns};

/// Events counted locally before they are added to the shared progress counter.
const PROGRESS_EVERY: u64 = 1 << 16;

#[derive(Debug, thiserror::Error)]
pub enum SynthError {
    #[error("synthetic log configuration: {0}")]
    Config(String),
    #[error("audit root {0} is not empty: the ground truth only holds for a log generated alone")]
    NotEmpty(PathBuf),
    #[error("audit I/O on {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(transparent)]
    Writer(#[from] WriterError),
    #[error(transparent)]
    Sink(#[from] SinkError),
    #[error("generator thread for node {0} panicked")]
    Panicked(u32),
}

/// What to generate. [`SynthConfig::new`] gives realistic defaults for the rest.
#[derive(Clone, Debug)]
pub struct SynthConfig {
    /// Events to record in all (at least: every request in flight is completed).
    pub events: u64,
    pub seed: u64,
    pub tenants: u32,
    /// Nodes, each with its own writer (and thread) into the same root; ids `1..=nodes`.
    pub nodes: u32,
    /// Injected exposures (spread over the nodes and over time).
    pub exposures: u32,
    pub page_size: u32,
    /// Pages in each node's pool.
    pub pool_pages: u32,
    /// Requests in flight per node.
    pub max_batch: usize,
    /// Prompt length, log-uniform in `[min, max]` tokens.
    pub prompt_tokens: (u32, u32),
    /// `max_tokens` of a request, drawn from these; the output is uniform in `1..=max_tokens`.
    pub max_tokens: Vec<u32>,
    /// Prompt tokens one request prefills per engine step (chunked prefill).
    pub prefill_chunk: u32,
    /// Per mille of requests rejected at admission (no pages).
    pub reject_per_mille: u32,
    /// Fraction of admitted requests with the incident's faults (as `exposures`, but at a rate:
    /// a realistic fleet in an incident, for the forensic query's cost): prompt KV truncated and
    /// attended unchecked, and one stray write into a page another request holds. Those whose
    /// recycled pages held only their own tenant's data expose nothing and are not retried.
    pub fault_rate: f64,
    /// Seal the live segment at this size (larger files: fewer, bigger Parquet files).
    pub rotate_bytes: u64,
    /// Fraction of admitted requests that start from a cached prefix (and of finished ones that
    /// share their prompt pages); 0 = no prefix cache.
    pub cache_hit_rate: f64,
    /// Fraction of shared prefixes in an operator-declared public scope (hit across tenants).
    pub public_share: f64,
}

impl SynthConfig {
    pub fn new(events: u64, seed: u64) -> Self {
        Self {
            events,
            seed,
            tenants: 100,
            nodes: 4,
            exposures: 8,
            page_size: 16,
            pool_pages: 8192,
            max_batch: 32,
            prompt_tokens: (256, 8192),
            max_tokens: vec![128, 256, 512, 1024],
            prefill_chunk: 2048,
            reject_per_mille: 5,
            fault_rate: 0.0,
            rotate_bytes: 256 << 20,
            cache_hit_rate: 0.0,
            public_share: 0.1,
        }
    }

    fn max_request_pages(&self) -> u64 {
        let max_out = self.max_tokens.iter().copied().max().unwrap_or(0);
        (u64::from(self.prompt_tokens.1) + u64::from(max_out)).div_ceil(u64::from(self.page_size))
    }

    fn check(&self) -> Result<(), SynthError> {
        let bad = |m: &str| Err(SynthError::Config(m.to_owned()));
        if self.events == 0 {
            return bad("events must be positive");
        }
        if !(2..=100_000).contains(&self.tenants) {
            return bad("tenants must be in 2..=100000 (an exposure needs another tenant)");
        }
        if !(1..=64).contains(&self.nodes) {
            return bad("nodes must be in 1..=64");
        }
        if !(1..=1024).contains(&self.page_size) {
            return bad("page_size must be in 1..=1024 (as the engine's)");
        }
        let (lo, hi) = self.prompt_tokens;
        if lo < 2 || lo > hi {
            return bad("prompt_tokens must be a range [min, max] with 2 <= min <= max");
        }
        if self.max_tokens.is_empty() || self.max_tokens.contains(&0) {
            return bad("max_tokens must be non-empty and positive");
        }
        if self.max_batch == 0 || self.prefill_chunk == 0 {
            return bad("max_batch and prefill_chunk must be positive");
        }
        if self.max_request_pages() > u64::from(self.pool_pages) {
            return bad("pool_pages must hold the largest request");
        }
        if u64::from(self.pool_pages) * u64::from(self.page_size) > u64::from(u32::MAX) {
            return bad("pool_pages * page_size must fit in u32");
        }
        if !(0.0..=1.0).contains(&self.fault_rate) {
            return bad("fault_rate must be in [0, 1]");
        }
        if !(0.0..=1.0).contains(&self.cache_hit_rate) || !(0.0..=1.0).contains(&self.public_share)
        {
            return bad("cache_hit_rate and public_share must be in [0, 1]");
        }
        if self.reject_per_mille >= 1000 {
            return bad("reject_per_mille must be below 1000");
        }
        Ok(())
    }
}

/// One injected exposure: the answer the exposure query must give for it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct InjectedExposure {
    pub node: u32,
    pub request: u64,
    pub recipient_tenant: String,
    /// (source tenant, foreign slots of its data attended), by tenant name.
    pub sources: Vec<(String, u64)>,
    pub foreign_slots: u64,
}

/// The ground truth and the shape of a generated log.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SynthTruth {
    pub seed: u64,
    pub nodes: u32,
    pub tenants: u32,
    pub page_size: u32,
    pub pool_pages: u32,
    /// Events recorded (all tables, all nodes).
    pub events: u64,
    pub requests: u64,
    pub page_allocs: u64,
    pub page_writes: u64,
    pub page_reads: u64,
    /// Prefix-cache rows: pages shared, pages hit (of them in a public scope across tenants).
    #[serde(default)]
    pub cache_shares: u64,
    #[serde(default)]
    pub cache_hits: u64,
    #[serde(default)]
    pub cache_public_cross_tenant_hits: u64,
    /// Every response that could have seen another tenant's data, by (node, request).
    pub exposures: Vec<InjectedExposure>,
}

/// `tenant-007`: zero-padded so that name order is index order.
fn tenant_name(i: u32, tenants: u32) -> String {
    let width = tenants.saturating_sub(1).max(1).ilog10() as usize + 1;
    format!("tenant-{i:0width$}")
}

/// Generate the log under `root` (which must be empty or absent). `progress` is advanced by the
/// events recorded so far (in steps of 65 536 per node), for a caller that reports it.
pub fn generate(
    cfg: &SynthConfig,
    root: &Path,
    key: &SigningKey,
    progress: &AtomicU64,
) -> Result<SynthTruth, SynthError> {
    cfg.check()?;
    if root.exists() {
        let mut entries = std::fs::read_dir(root).map_err(|source| SynthError::Io {
            path: root.to_owned(),
            source,
        })?;
        if entries.next().is_some() {
            return Err(SynthError::NotEmpty(root.to_owned()));
        }
    }
    let per_node = cfg.events.div_ceil(u64::from(cfg.nodes));
    let results: Vec<Result<NodeTotals, SynthError>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..cfg.nodes)
            .map(|i| {
                let node = i + 1;
                // Exposures round-robin over the nodes.
                let injections =
                    cfg.exposures / cfg.nodes + u32::from(i < cfg.exposures % cfg.nodes);
                let h =
                    s.spawn(move || run_node(cfg, root, key, node, per_node, injections, progress));
                (node, h)
            })
            .collect();
        handles
            .into_iter()
            .map(|(node, h)| h.join().unwrap_or(Err(SynthError::Panicked(node))))
            .collect()
    });
    let mut truth = SynthTruth {
        seed: cfg.seed,
        nodes: cfg.nodes,
        tenants: cfg.tenants,
        page_size: cfg.page_size,
        pool_pages: cfg.pool_pages,
        events: 0,
        requests: 0,
        page_allocs: 0,
        page_writes: 0,
        page_reads: 0,
        cache_shares: 0,
        cache_hits: 0,
        cache_public_cross_tenant_hits: 0,
        exposures: Vec::new(),
    };
    for r in results {
        let t = r?;
        truth.events += t.events;
        truth.requests += t.requests;
        truth.page_allocs += t.allocs;
        truth.page_writes += t.writes;
        truth.page_reads += t.reads;
        truth.cache_shares += t.cache_shares;
        truth.cache_hits += t.cache_hits;
        truth.cache_public_cross_tenant_hits += t.cache_public_cross;
        truth.exposures.extend(t.exposures);
    }
    truth.exposures.sort_by_key(|e| (e.node, e.request));
    assert!(truth.events >= cfg.events, "every node records its share");
    Ok(truth)
}

fn run_node(
    cfg: &SynthConfig,
    root: &Path,
    key: &SigningKey,
    node: u32,
    budget: u64,
    injections: u32,
    progress: &AtomicU64,
) -> Result<NodeTotals, SynthError> {
    let mut wc = WriterConfig::new(root, node, key.clone());
    // Sealing fsyncs every file; the live segment needs no fsync for a generated log.
    wc.fsync = FsyncPolicy::Never;
    wc.rotate_bytes = cfg.rotate_bytes;
    wc.rotate_interval = std::time::Duration::from_secs(3600);
    let writer = AuditWriter::open(wc)?;
    let mut sim = NodeSim::new(cfg, node, &writer, budget, injections, progress);
    let r = sim.run();
    // Seal whatever is left even when the simulation failed, then report the first error.
    let closed = writer.close();
    let totals = r?;
    closed?;
    progress.fetch_add(totals.events % PROGRESS_EVERY, Ordering::Relaxed);
    Ok(totals)
}

#[derive(Debug, Default)]
struct NodeTotals {
    events: u64,
    requests: u64,
    allocs: u64,
    writes: u64,
    reads: u64,
    cache_shares: u64,
    cache_hits: u64,
    cache_public_cross: u64,
    exposures: Vec<InjectedExposure>,
}

/// SplitMix64: small, fast, and good enough for a workload.
#[derive(Debug)]
struct Rng(u64);

impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in `[0, 1)`.
    fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
    /// Uniform in `0..n` (`n > 0`).
    fn below(&mut self, n: u32) -> u32 {
        debug_assert!(n > 0);
        (((self.next_u64() >> 32) * u64::from(n)) >> 32) as u32
    }
    fn log_uniform(&mut self, lo: u32, hi: u32) -> u32 {
        let (l, h) = (f64::from(lo).ln(), f64::from(hi).ln());
        ((l + self.unit() * (h - l)).exp().round() as u32).clamp(lo, hi)
    }
}

#[derive(Debug)]
struct Req {
    id: u64,
    tenant: u32,
    pages: Vec<(u32, u32)>,
    prompt: u32,
    max_tokens: u32,
    output: u32,
    /// Prompt tokens whose KV has been computed (prefill progress).
    prefilled: u32,
    generated: u32,
    /// Per logical page: (slots attended so far, first step attended); 0 slots = not attended.
    reads: Vec<(u32, u32)>,
    /// The incident's fault: prompt KV truncated to one slot, whole prompt attended unchecked.
    injected: bool,
    /// One of the `exposures` owed (retried on the next request if it exposes nothing), not a
    /// `fault_rate` draw.
    owed: bool,
    /// The cache entry its first `hit_pages` pages are (not its own: attended, never written,
    /// not released by it).
    hit: Option<u64>,
    hit_pages: u32,
    /// Whether that entry is in a public scope.
    public_hit: bool,
}

/// A cached prefix: the full prompt pages its writer shared.
#[derive(Debug)]
struct CacheEntry {
    writer: u64,
    tenant: u32,
    pages: Vec<(u32, u32)>,
    public: bool,
    readers: u32,
    last_used: u32,
}

/// At most this share of a node's pool is held by its prefix cache.
const CACHE_POOL_FRACTION: usize = 4;

struct NodeSim<'a> {
    cfg: &'a SynthConfig,
    node: u32,
    sink: &'a AuditWriter,
    progress: &'a AtomicU64,
    rng: Rng,
    /// This node's own copies (no reference counts shared with other nodes' threads).
    tenants: Vec<Arc<str>>,
    ps: u32,
    free: Vec<u32>,
    generation: Vec<u32>,
    /// Per pool slot (`page * ps + slot`): 1 + index of the tenant that last wrote it, 0 = never.
    last_writer: Vec<u32>,
    active: Vec<Req>,
    /// The prefix cache, by entry id (ids grow: the newest entry has the largest).
    cache: BTreeMap<u64, CacheEntry>,
    next_entry: u64,
    cache_pages: usize,
    step: u32,
    ts_ns: u64,
    next_id: u64,
    budget: u64,
    /// Event-count thresholds at which the next admitted request is injected, in order.
    inject_at: Vec<u64>,
    inject_pending: u32,
    totals: NodeTotals,
}

impl std::fmt::Debug for NodeSim<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NodeSim")
            .field("node", &self.node)
            .field("step", &self.step)
            .field("active", &self.active.len())
            .finish_non_exhaustive()
    }
}

impl<'a> NodeSim<'a> {
    fn new(
        cfg: &'a SynthConfig,
        node: u32,
        sink: &'a AuditWriter,
        budget: u64,
        injections: u32,
        progress: &'a AtomicU64,
    ) -> Self {
        let pool = cfg.pool_pages;
        // Spread the injections over the run, away from the cold start (fresh pages).
        let inject_at = (1..=u64::from(injections))
            .map(|j| budget * j / (u64::from(injections) + 1))
            .collect();
        Self {
            cfg,
            node,
            sink,
            progress,
            rng: Rng(cfg.seed ^ u64::from(node).wrapping_mul(0xA076_1D64_78BD_642F)),
            tenants: (0..cfg.tenants)
                .map(|i| Arc::from(tenant_name(i, cfg.tenants)))
                .collect(),
            ps: cfg.page_size,
            // LIFO: pop() hands out page 0 first, then whatever was released last.
            free: (0..pool).rev().collect(),
            generation: vec![0; pool as usize],
            last_writer: vec![0; pool as usize * cfg.page_size as usize],
            active: Vec::with_capacity(cfg.max_batch),
            cache: BTreeMap::new(),
            next_entry: 0,
            cache_pages: 0,
            step: 0,
            ts_ns: mono_now_ns(),
            next_id: 1,
            budget,
            inject_at,
            inject_pending: 0,
            totals: NodeTotals::default(),
        }
    }

    fn emit(&mut self, ev: Event) -> Result<(), SynthError> {
        self.sink.record(ev)?;
        self.totals.events += 1;
        if self.totals.events.is_multiple_of(PROGRESS_EVERY) {
            self.progress.fetch_add(PROGRESS_EVERY, Ordering::Relaxed);
        }
        Ok(())
    }

    fn run(&mut self) -> Result<NodeTotals, SynthError> {
        let start = format!(
            "role=colocated synthetic=1 seed={} page_size={} pool_pages={} max_batch={}",
            self.cfg.seed, self.ps, self.cfg.pool_pages, self.cfg.max_batch
        );
        self.emit(Event::Node {
            ts_ns: mono_now_ns(),
            kind: "start".into(),
            detail: start,
        })?;
        if !self.inject_at.is_empty() || self.cfg.fault_rate > 0.0 {
            self.emit(Event::Node {
                ts_ns: mono_now_ns(),
                kind: "unsafe_reproduction".into(),
                detail: "truncate_overlength,disable_tag_check".into(),
            })?;
        }
        // Bound: every step makes progress (admits, prefills or decodes; a request ends after at
        // most prompt/chunk + max_tokens steps), and admission stops at the budget.
        // An injection that found only its own tenant's data is retried on the next request, past
        // the budget if need be, within this allowance.
        let limit = self
            .budget
            .saturating_add(self.budget / 4)
            .saturating_add(1 << 20);
        let max_steps = limit.saturating_mul(4);
        while self.admitting(limit)? || !self.active.is_empty() {
            assert!(
                u64::from(self.step) < max_steps,
                "node {} made no progress",
                self.node
            );
            self.step += 1;
            // The clock is the real one (monotonic), so wall_ns are recent and ordered.
            self.ts_ns = self.ts_ns.max(mono_now_ns());
            if self.admitting(limit)? {
                self.admit()?;
            }
            let mut i = 0;
            while i < self.active.len() {
                if self.advance(i)? {
                    let r = self.active.swap_remove(i);
                    self.retire(r)?;
                } else {
                    i += 1;
                }
            }
        }
        while self.evict_one()? {}
        assert_eq!(
            self.free.len(),
            self.cfg.pool_pages as usize,
            "every page is back on the free list"
        );
        assert!(self.inject_pending == 0 && self.inject_at.is_empty());
        Ok(std::mem::take(&mut self.totals))
    }

    fn owed(&self) -> bool {
        self.inject_pending > 0 || !self.inject_at.is_empty()
    }

    /// Whether new requests are admitted: until the budget, then while injections are owed.
    fn admitting(&self, limit: u64) -> Result<bool, SynthError> {
        let owed = self.owed();
        if owed && self.totals.events >= limit {
            return Err(SynthError::Config(format!(
                "node {}: {} injected exposures found no other tenant's data; raise the events",
                self.node,
                self.inject_pending as usize + self.inject_at.len()
            )));
        }
        Ok(self.totals.events < self.budget || owed)
    }

    fn admit(&mut self) -> Result<(), SynthError> {
        while self.active.len() < self.cfg.max_batch
            && (self.totals.events < self.budget || self.owed())
        {
            if self
                .inject_at
                .first()
                .is_some_and(|&at| self.totals.events >= at)
            {
                self.inject_at.remove(0);
                self.inject_pending += 1;
            }
            let (lo, hi) = self.cfg.prompt_tokens;
            let prompt = self.rng.log_uniform(lo, hi);
            let mt = &self.cfg.max_tokens;
            let max_tokens = mt[self.rng.below(mt.len() as u32) as usize];
            // Skewed popularity: a few tenants send most requests.
            let u = self.rng.unit();
            let tenant = ((u * u * f64::from(self.cfg.tenants)) as u32).min(self.cfg.tenants - 1);
            let output = 1 + self.rng.below(max_tokens);
            let reject = self.rng.below(1000) < self.cfg.reject_per_mille;
            // Drawn only with a rate, so that the sequence of a cache-free seed is unchanged.
            let hit = if self.cfg.cache_hit_rate > 0.0
                && self.rng.unit() < self.cfg.cache_hit_rate
                && !reject
                && self.inject_pending == 0
            {
                // The tenant's own newest prefix, else the newest public one.
                let newest = |public: bool| {
                    self.cache
                        .iter()
                        .rev()
                        .find(|(_, e)| if public { e.public } else { e.tenant == tenant })
                };
                newest(false)
                    .or_else(|| newest(true))
                    .map(|(&id, e)| (id, e.pages.len() as u32, e.public))
            } else {
                None
            };
            let hit_pages = hit.map_or(0, |h| h.1);
            // A hit leaves at least one prompt token to compute.
            let prompt = prompt.max(hit_pages * self.ps + 1);
            let need = (prompt + max_tokens).div_ceil(self.ps) as usize - hit_pages as usize;
            while self.free.len() < need && self.evict_one_except(hit.map(|h| h.0))? {}
            if self.free.len() < need {
                // The engine would queue it; the next request is drawn when pages are free.
                return Ok(());
            }
            let id = self.next_id;
            self.next_id += 1;
            let t = self.tenants[tenant as usize].clone();
            if reject {
                return self.emit(Event::Request {
                    ts_ns: self.ts_ns,
                    request: id,
                    tenant: t,
                    kind: RequestKind::Rejected {
                        reason: "prompt exceeds the tenant's context quota".into(),
                    },
                    prompt_tokens: prompt,
                    output_tokens: 0,
                });
            }
            self.totals.requests += 1;
            self.emit(Event::Request {
                ts_ns: self.ts_ns,
                request: id,
                tenant: t.clone(),
                kind: RequestKind::Admitted,
                prompt_tokens: prompt,
                output_tokens: 0,
            })?;
            let mut pages = Vec::with_capacity(need + hit_pages as usize);
            if let Some((entry, _, public)) = hit {
                self.hit(id, tenant, entry, public, &mut pages)?;
            }
            for _ in 0..need {
                let Some(p) = self.free.pop() else {
                    unreachable!("free pages checked above")
                };
                let g = self.generation[p as usize].wrapping_add(1);
                self.generation[p as usize] = g;
                pages.push((p, g));
                self.totals.allocs += 1;
                self.emit(Event::Page {
                    ts_ns: self.ts_ns,
                    request: id,
                    tenant: t.clone(),
                    page: p,
                    generation: g,
                    kind: PageKind::Alloc,
                })?;
            }
            let owed = self.inject_pending > 0;
            if owed {
                self.inject_pending -= 1;
            }
            // Drawn only with a rate, so that the sequence of a rate-free seed is unchanged.
            // (A request that starts from a cached prefix is never a faulty one.)
            let injected = (owed
                || (self.cfg.fault_rate > 0.0 && self.rng.unit() < self.cfg.fault_rate))
                && hit.is_none();
            let n_pages = pages.len();
            self.active.push(Req {
                id,
                tenant,
                pages,
                prompt,
                max_tokens,
                output,
                prefilled: hit_pages * self.ps,
                generated: 0,
                reads: vec![(0, 0); n_pages],
                injected,
                owed,
                hit: hit.map(|h| h.0),
                hit_pages,
                public_hit: hit.is_some_and(|h| h.2),
            });
        }
        Ok(())
    }

    /// Write-ahead record of slots `start..end` of request `i`'s sequence, split by page, and the
    /// writer bookkeeping. Returns nothing to attend: the caller marks reads.
    fn write(&mut self, i: usize, start: u32, end: u32) -> Result<(), SynthError> {
        let ps = self.ps;
        let mut pos = start;
        while pos < end {
            let idx = pos / ps;
            let stop = ((idx + 1) * ps).min(end);
            let r = &self.active[i];
            let (page, generation) = r.pages[idx as usize];
            let tenant = r.tenant;
            let ev = Event::Page {
                ts_ns: self.ts_ns,
                request: r.id,
                tenant: self.tenants[tenant as usize].clone(),
                page,
                generation,
                kind: PageKind::Write {
                    slot_start: pos - idx * ps,
                    slot_end: stop - idx * ps,
                    writer: Writer::Local,
                },
            };
            self.emit(ev)?;
            self.totals.writes += 1;
            let base = (page * ps) as usize;
            self.last_writer[base + (pos - idx * ps) as usize..base + (stop - idx * ps) as usize]
                .fill(tenant + 1);
            pos = stop;
        }
        Ok(())
    }

    /// The incident's other symptom, for `fault_rate` faults: a write of faulty request `i`
    /// lands in a page another request holds — in a slot that request reserved but never
    /// writes or attends (`prompt + output - 1`), so no answer changes, but the page's history
    /// now has an overlapping write (the forensic query's clearing must stay local to it).
    fn stray_write(&mut self, i: usize) -> Result<(), SynthError> {
        let ps = self.ps;
        let Some(j) = (0..self.active.len()).find(|&j| j != i && !self.active[j].injected) else {
            return Ok(());
        };
        let (v, s) = (&self.active[j], &self.active[i]);
        let q = v.prompt + v.output - 1;
        let (page, generation) = v.pages[(q / ps) as usize];
        let slot = q % ps;
        let ev = Event::Page {
            ts_ns: self.ts_ns,
            request: s.id,
            tenant: self.tenants[s.tenant as usize].clone(),
            page,
            generation,
            kind: PageKind::Write {
                slot_start: slot,
                slot_end: slot + 1,
                writer: Writer::Local,
            },
        };
        let tenant = s.tenant;
        self.emit(ev)?;
        self.totals.writes += 1;
        self.last_writer[(page * ps + slot) as usize] = tenant + 1;
        Ok(())
    }

    /// Attend slots `0..n` of request `i`'s sequence (pages from `from_pos`'s page on changed).
    fn attend(&mut self, i: usize, from_pos: u32, n: u32) {
        let (ps, step) = (self.ps, self.step);
        let r = &mut self.active[i];
        for idx in from_pos / ps..n.div_ceil(ps) {
            let filled = (n - idx * ps).min(ps);
            let run = &mut r.reads[idx as usize];
            if run.0 == 0 {
                run.1 = step;
            }
            run.0 = run.0.max(filled);
        }
    }

    /// One engine step of request `i`; true when it is done.
    fn advance(&mut self, i: usize) -> Result<bool, SynthError> {
        let r = &self.active[i];
        let (prompt, prefilled, generated, injected, hit_end) = (
            r.prompt,
            r.prefilled,
            r.generated,
            r.injected,
            r.hit_pages * self.ps,
        );
        if prefilled < prompt {
            let end = (prefilled + self.cfg.prefill_chunk).min(prompt);
            if !injected {
                self.write(i, prefilled, end)?;
            } else if prefilled == 0 {
                // The fault: one slot of prompt KV, the rest of the prompt never written.
                self.write(i, 0, 1)?;
            }
            // A hit's first step attends the cached pages too.
            let from = if prefilled == hit_end { 0 } else { prefilled };
            self.attend(i, from, end);
            let r = &mut self.active[i];
            r.prefilled = end;
            if end == prompt {
                r.generated = 1;
            }
        } else {
            // Decode: the KV of the latest token, then attend everything so far.
            let pos = prompt + generated - 1;
            if injected && generated == 1 && self.cfg.fault_rate > 0.0 {
                self.stray_write(i)?;
            }
            self.write(i, pos, pos + 1)?;
            self.attend(i, pos, pos + 1);
            self.active[i].generated += 1;
        }
        let r = &self.active[i];
        Ok(r.prefilled == r.prompt && r.generated >= r.output)
    }

    fn cache_record(
        &self,
        event: crate::CacheEvent,
        request: u64,
        tenant: u32,
        e: &CacheEntry,
        (page, generation): (u32, u32),
        hit_tokens: u32,
    ) -> Event {
        let (namespace, scope, kind) = if e.public {
            (0xC000_0000_0000_0000, "public:synthetic", "public")
        } else {
            (
                0x8000_0000_0000_0000 | u64::from(e.tenant),
                "tenant",
                "tenant",
            )
        };
        Event::Cache(Box::new(crate::CacheRecord {
            ts_ns: self.ts_ns,
            event,
            request,
            tenant: self.tenants[tenant as usize].clone(),
            page,
            generation,
            namespace,
            scope: scope.into(),
            scope_kind: kind,
            writer: e.writer,
            writer_tenant: self.tenants[e.tenant as usize].clone(),
            hit_tokens,
        }))
    }

    /// Request `id` of `tenant` starts from cache entry `entry`: one `hit` row per page, the
    /// pages pushed onto its block table.
    fn hit(
        &mut self,
        id: u64,
        tenant: u32,
        entry: u64,
        public: bool,
        pages: &mut Vec<(u32, u32)>,
    ) -> Result<(), SynthError> {
        let step = self.step;
        let e = self.cache.get_mut(&entry).expect("a chosen entry");
        e.readers += 1;
        e.last_used = step;
        let e = &self.cache[&entry];
        let hit_tokens = e.pages.len() as u32 * self.ps;
        let rows: Vec<Event> = e
            .pages
            .iter()
            .map(|&p| self.cache_record(crate::CacheEvent::Hit, id, tenant, e, p, hit_tokens))
            .collect();
        pages.extend(&e.pages);
        let cross = public && e.tenant != tenant;
        for row in rows {
            self.emit(row)?;
            self.totals.cache_hits += 1;
            self.totals.cache_public_cross += u64::from(cross);
        }
        Ok(())
    }

    /// A finished request shares its full prompt pages (its own, written whole) with
    /// probability `cache_hit_rate`, within the cache's bound. Returns how many of its pages
    /// (after its hit pages, which it does not own) went to the cache: `0` or all of them.
    fn share(&mut self, r: &Req) -> Result<usize, SynthError> {
        if self.cfg.cache_hit_rate == 0.0 || r.injected || r.hit.is_some() {
            return Ok(0);
        }
        if self.rng.unit() >= self.cfg.cache_hit_rate {
            return Ok(0);
        }
        let n = (r.prompt / self.ps) as usize;
        let bound = self.cfg.pool_pages as usize / CACHE_POOL_FRACTION;
        while n > 0 && self.cache_pages + n > bound && self.evict_one()? {}
        if n == 0 || self.cache_pages + n > bound {
            return Ok(0);
        }
        let public = self.rng.unit() < self.cfg.public_share;
        let e = CacheEntry {
            writer: r.id,
            tenant: r.tenant,
            pages: r.pages[..n].to_vec(),
            public,
            readers: 0,
            last_used: self.step,
        };
        let rows: Vec<Event> = e
            .pages
            .iter()
            .map(|&p| self.cache_record(crate::CacheEvent::Share, r.id, r.tenant, &e, p, 0))
            .collect();
        for row in rows {
            self.emit(row)?;
            self.totals.cache_shares += 1;
        }
        self.cache_pages += n;
        self.cache.insert(self.next_entry, e);
        self.next_entry += 1;
        Ok(n)
    }

    fn evict_one(&mut self) -> Result<bool, SynthError> {
        self.evict_one_except(None)
    }

    /// Evict the least recently used entry no request holds (and not `keep`): `evict` rows,
    /// its pages released by their writer. False when there is none.
    fn evict_one_except(&mut self, keep: Option<u64>) -> Result<bool, SynthError> {
        let Some(id) = self
            .cache
            .iter()
            .filter(|(id, e)| e.readers == 0 && Some(**id) != keep)
            .min_by_key(|(id, e)| (e.last_used, **id))
            .map(|(&id, _)| id)
        else {
            return Ok(false);
        };
        let Some(e) = self.cache.remove(&id) else {
            unreachable!("found above")
        };
        for &(page, generation) in &e.pages {
            let row = self.cache_record(
                crate::CacheEvent::Evict,
                e.writer,
                e.tenant,
                &e,
                (page, generation),
                0,
            );
            self.emit(row)?;
            self.emit(Event::Page {
                ts_ns: self.ts_ns,
                request: e.writer,
                tenant: self.tenants[e.tenant as usize].clone(),
                page,
                generation,
                kind: PageKind::Release,
            })?;
            self.free.push(page);
        }
        self.cache_pages -= e.pages.len();
        Ok(true)
    }

    fn retire(&mut self, r: Req) -> Result<(), SynthError> {
        let ps = self.ps;
        let t = self.tenants[r.tenant as usize].clone();
        let mut foreign: BTreeMap<u32, u64> = BTreeMap::new();
        for (idx, &(filled, first_step)) in r.reads.iter().enumerate() {
            if filled == 0 {
                continue;
            }
            let (page, generation) = r.pages[idx];
            // The definition, evaluated on the simulator's own state: the latest earlier write of
            // each attended slot, by tenant.
            let base = (page * ps) as usize;
            // A public scope's page is a shared read, not foreign (docs/forensics.md, Sharing).
            let public = r.public_hit && (idx as u32) < r.hit_pages;
            for &w in &self.last_writer[base..base + filled as usize] {
                if w != 0 && w - 1 != r.tenant && !public {
                    *foreign.entry(w - 1).or_default() += 1;
                }
            }
            self.totals.reads += 1;
            self.emit(Event::Read {
                ts_ns: self.ts_ns,
                request: r.id,
                tenant: t.clone(),
                page,
                generation,
                slot_start: 0,
                slot_end: filled,
                first_step,
                last_step: self.step,
                verified: !r.injected,
            })?;
        }
        assert!(
            r.injected || foreign.is_empty(),
            "node {} request {}: a normal request attended only its own writes",
            self.node,
            r.id
        );
        if let Some(entry) = r.hit {
            let step = self.step;
            let Some(e) = self.cache.get_mut(&entry) else {
                unreachable!("a held entry is never evicted")
            };
            e.readers -= 1;
            e.last_used = step;
        }
        let shared = self.share(&r)?;
        for &(page, generation) in &r.pages[r.hit_pages as usize + shared..] {
            self.emit(Event::Page {
                ts_ns: self.ts_ns,
                request: r.id,
                tenant: t.clone(),
                page,
                generation,
                kind: PageKind::Release,
            })?;
            self.free.push(page);
        }
        let reason = if r.output >= r.max_tokens {
            "length"
        } else {
            "stop"
        };
        self.emit(Event::Request {
            ts_ns: self.ts_ns,
            request: r.id,
            tenant: t,
            kind: RequestKind::Finished {
                reason: reason.into(),
            },
            prompt_tokens: r.prompt,
            output_tokens: r.output,
        })?;
        if r.injected {
            if foreign.is_empty() {
                // Its recycled pages held only its own tenant's data (or nothing): no exposure;
                // an owed one is injected into the next request instead.
                if r.owed {
                    self.inject_pending += 1;
                }
            } else {
                let n = self.cfg.tenants;
                self.totals.exposures.push(InjectedExposure {
                    node: self.node,
                    request: r.id,
                    recipient_tenant: tenant_name(r.tenant, n),
                    foreign_slots: foreign.values().sum(),
                    sources: foreign
                        .into_iter()
                        .map(|(k, v)| (tenant_name(k, n), v))
                        .collect(),
                });
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tenant_names_sort_by_index() {
        assert_eq!(tenant_name(7, 100), "tenant-07");
        assert_eq!(tenant_name(0, 2), "tenant-0");
        assert_eq!(tenant_name(99, 1000), "tenant-099");
        let names: Vec<String> = (0..120).map(|i| tenant_name(i, 120)).collect();
        assert!(names.windows(2).all(|w| w[0] < w[1]));
    }

    #[test]
    fn rejects_bad_configs() {
        let mut c = SynthConfig::new(1000, 1);
        c.tenants = 1;
        assert!(matches!(c.check(), Err(SynthError::Config(_))));
        let mut c = SynthConfig::new(1000, 1);
        c.pool_pages = 10;
        assert!(matches!(c.check(), Err(SynthError::Config(_))));
        assert!(SynthConfig::new(1000, 1).check().is_ok());
    }
}

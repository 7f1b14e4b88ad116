//! KV offload: prefix-cache pages the pool evicts go, sealed, to slower tiers — host memory, local
//! disk, an object store — and come back as hits, verified like a transferred page.
//!
//! # Spec
//! - **What leaves**: only a prefix-cache page (a whole page, read-only, owned by its namespace)
//!   that the pool evicts. It leaves sealed ([`seal`]): its tag (namespace, generation, filled
//!   slots, writer node/request/tenant), the model fingerprint and geometry, and a MAC (optionally
//!   AES-GCM ciphertext) over all of it.
//! - **What comes back**: a page found under a request's chain key is opened with exactly that key
//!   and the chain's namespace for the page ([`seal::Expect`]); a page that fails any check is a
//!   clean miss — its tokens are recomputed — an `integrity_violations` row, and is deleted from
//!   its tier. Only a [`seal::VerifiedPage`] enters a pool ([`crate::kv::PagePool::restore`]),
//!   as a shared page of its namespace whose slots count as written by the original writer.
//! - **Keys**: the chain key (namespace in every link, so another tenant cannot even name a
//!   page); under `[unsafe_reproduction] token_only_offload` a chain over the tokens alone and no
//!   namespace check — the external-tier leak this module exists to prevent, reproduced on purpose.
//! - **Tiers** are ordered (host, disk, object); a page enters the first and moves down when a
//!   tier is over its byte budget (least recently used first: a hit refreshes a page); a page
//!   leaves the last tier for good (an `evict` row). Every tier's bytes are bounded by its budget
//!   (`0`: unbounded, only for an object store).
//! - **Off the step loop**: sealing, writes, moves, deletes and prefetches run on one worker
//!   thread ([`worker`]); the engine thread only copies a page's bytes out on eviction and opens
//!   (MAC, decrypt, copy) the pages it restores. Jobs in flight are bounded
//!   ([`OffloadConfig::queue_pages`]); a write-back that finds the queue full waits for the worker
//!   (backpressure, counted), moves and prefetches wait for the next step. A restore the prefetch
//!   did not reach reads its tier from the engine thread.
//! - **Bounded**: the index holds one entry per stored page, and the stores are bounded by their
//!   budgets; the prefetched set by `queue_pages`.

pub mod seal;
pub mod store;
mod worker;

use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::Arc;
use std::sync::mpsc;

use seal::{Layout, OpenError, PageMeta, SealKeys, VerifiedPage};
use store::{PageStore, StoreError, Tier};

use crate::prefix_cache::BlockKey;

/// A node's `[kv_offload]`, resolved by its binary (which builds the object store: the engine
/// knows no network), applied to an engine once its namespaces exist ([`OffloadSetup::enable`]).
#[derive(Debug, Clone)]
pub struct OffloadSetup {
    pub section: crate::config::KvOffloadSection,
    /// The object tier's store, when `object_url` is set.
    pub object: Option<Arc<dyn PageStore>>,
    /// This node's id (recorded as a page's writer node).
    pub node: u32,
    /// `[unsafe_reproduction] token_only_offload`, armed.
    pub token_only: bool,
}

impl OffloadSetup {
    /// Turn `engine`'s offload on: the tiers of the section (host, disk, object, in that order),
    /// the MAC key from `mac_key_file` or derived from the namespaces' secret, the AES key from
    /// `encrypt_key_file`.
    pub fn enable(
        &self,
        engine: &mut crate::Engine,
        namespaces: &crate::prefix_cache::Namespaces,
    ) -> Result<(), OffloadError> {
        let s = &self.section;
        s.validate()
            .map_err(|e| OffloadError::Config(e.to_string()))?;
        let mib = |m: u64| m * 1024 * 1024;
        let mut tiers = Vec::new();
        if s.host_mib > 0 {
            tiers.push(TierSpec {
                store: Arc::new(store::HostArena::new()),
                budget_bytes: mib(s.host_mib),
            });
        }
        if let Some(dir) = &s.disk_dir {
            tiers.push(TierSpec {
                store: Arc::new(store::DiskStore::open(dir)?),
                budget_bytes: mib(s.disk_mib),
            });
        }
        match (&s.object_url, &self.object) {
            (Some(_), Some(store)) => tiers.push(TierSpec {
                store: store.clone(),
                budget_bytes: mib(s.object_mib),
            }),
            (Some(url), None) => {
                return Err(OffloadError::Config(format!(
                    "object_url {url}: no object store was built for it"
                )));
            }
            (None, _) => {}
        }
        let mac = match &s.mac_key_file {
            Some(p) => read_key_file(p, "mac_key_file")?,
            None => namespaces.offload_mac_key(),
        };
        let aes = match &s.encrypt_key_file {
            Some(p) => Some(read_key_file(p, "encrypt_key_file")?),
            None => None,
        };
        engine.enable_offload(OffloadConfig {
            tiers,
            keys: SealKeys::new(&mac, aes.as_ref()),
            layout: engine.offload_layout(),
            node: self.node,
            token_only: self.token_only,
            queue_pages: s.queue_pages,
        })
    }
}

/// A 32-byte key from a file of 64 hex digits.
fn read_key_file(path: &std::path::Path, what: &str) -> Result<[u8; 32], OffloadError> {
    let bad = |why: String| OffloadError::Config(format!("{what} {}: {why}", path.display()));
    let text = std::fs::read_to_string(path).map_err(|e| bad(e.to_string()))?;
    let t = text.trim();
    if t.len() != 64 {
        return Err(bad(format!(
            "expected 64 hex digits, got {} characters",
            t.len()
        )));
    }
    let mut k = [0u8; 32];
    for (i, out) in k.iter_mut().enumerate() {
        *out = u8::from_str_radix(&t[2 * i..2 * i + 2], 16).map_err(|_| bad("not hex".into()))?;
    }
    Ok(k)
}

/// One tier as configured: its store and byte budget.
#[derive(Debug, Clone)]
pub struct TierSpec {
    pub store: Arc<dyn PageStore>,
    /// Bytes of sealed pages the tier may hold; `0`: unbounded (an object store only).
    pub budget_bytes: u64,
}

/// What the engine is given to offload with.
#[derive(Debug)]
pub struct OffloadConfig {
    /// In order: the first receives evicted pages, the last evicts for good.
    pub tiers: Vec<TierSpec>,
    pub keys: SealKeys,
    pub layout: Layout,
    /// This node's id (a page's writer node).
    pub node: u32,
    /// `[unsafe_reproduction] token_only_offload`.
    pub token_only: bool,
    /// Jobs in flight at most (write-backs, moves, deletes, prefetches).
    pub queue_pages: usize,
}

/// The offload could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum OffloadError {
    #[error("kv_offload: {0}")]
    Config(String),
    #[error("kv_offload: {0}")]
    Store(#[from] StoreError),
    #[error("kv_offload: cannot start its worker thread: {0}")]
    Thread(std::io::Error),
}

/// Something the engine records (table `kv_offload`) or must act on.
#[derive(Debug)]
pub enum Happened {
    /// A page is being stored in `tier` (from the pool, or moved down from the tier above):
    /// recorded when the job is handed out (write-ahead, as page writes are), so a node that
    /// stops with writes in flight has no stored page without its row; a store that then fails
    /// is a [`Happened::Failed`].
    Offloaded {
        key: BlockKey,
        /// Known unless the page was listed from a tier at start-up and never opened.
        meta: Option<PageMeta>,
        tier: Tier,
        /// The pool page it left (`None`: moved between tiers).
        page: Option<(u32, u32)>,
    },
    /// A page left its last tier (over budget), or a refused page was deleted.
    Evicted {
        key: BlockKey,
        meta: Option<PageMeta>,
        tier: Tier,
        reason: &'static str,
    },
    /// A write-back or move did not store the page in `tier` (its `offload` row stands
    /// contradicted: recorded as an `evict` from `tier`). A failed read or delete is only logged.
    Failed {
        key: BlockKey,
        tier: Tier,
        error: String,
    },
}

#[derive(Debug)]
struct Entry {
    tier: usize,
    bytes: u64,
    last_used: u64,
    /// A move or delete is in flight: not restorable from the index, not chosen again.
    busy: bool,
    /// Known once the page was sealed here or opened (a page listed from disk at start-up is
    /// known by its key only).
    meta: Option<PageMeta>,
}

#[derive(Debug)]
struct TierState {
    store: Arc<dyn PageStore>,
    budget_bytes: u64,
    used_bytes: u64,
    /// Of `used_bytes`, the pages being moved down (still here until the move completes).
    moving_bytes: u64,
    /// `(last_used, key)` of this tier's entries that are not busy.
    lru: BTreeSet<(u64, BlockKey)>,
}

/// The offload's counters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct OffloadStats {
    pub offloaded: u64,
    pub moved: u64,
    pub evicted: u64,
    pub restored: u64,
    pub refused: u64,
    /// Write-backs that waited for the worker (the queue was full).
    pub write_back_waits: u64,
    pub prefetched: u64,
}

/// A restore's input: the sealed bytes and the tier they came from.
#[derive(Debug)]
pub struct Fetched {
    pub sealed: Vec<u8>,
    pub tier: Tier,
}

/// The engine's offload: the index of stored pages, the tiers and the worker.
#[derive(Debug)]
pub struct Offload {
    tiers: Vec<TierState>,
    index: HashMap<BlockKey, Entry>,
    /// Write-backs in flight (sealing or the first put).
    pending: HashSet<BlockKey>,
    /// Prefetched sealed pages, not yet opened (bounded by `queue_pages`).
    prefetched: HashMap<BlockKey, Fetched>,
    /// Prefetches in flight.
    fetching: HashSet<BlockKey>,
    keys: Arc<SealKeys>,
    layout: Layout,
    node: u32,
    token_only: bool,
    queue_pages: usize,
    in_flight: usize,
    jobs: mpsc::SyncSender<worker::Job>,
    done: mpsc::Receiver<worker::Done>,
    tick: u64,
    stats: OffloadStats,
    /// What happened since the engine last asked (start-up evictions, completions).
    happened: Vec<Happened>,
}

impl Offload {
    /// Start the worker and index what the non-shared tiers already hold (a restarted node's
    /// disk), enforcing the budgets at once.
    pub fn start(cfg: OffloadConfig) -> Result<Self, OffloadError> {
        if cfg.tiers.is_empty() {
            return Err(OffloadError::Config("no tier configured".into()));
        }
        if cfg.queue_pages == 0 {
            return Err(OffloadError::Config(
                "queue_pages must be at least 1".into(),
            ));
        }
        for (i, t) in cfg.tiers.iter().enumerate() {
            if t.budget_bytes == 0 && t.store.tier() != Tier::Object {
                return Err(OffloadError::Config(format!(
                    "the {} tier needs a size (only an object store may be unbounded)",
                    t.store.tier().name()
                )));
            }
            if t.store.shared() && i + 1 != cfg.tiers.len() {
                return Err(OffloadError::Config(
                    "a shared (object) tier must be the last".into(),
                ));
            }
        }
        let keys = Arc::new(cfg.keys);
        let stores: Vec<Arc<dyn PageStore>> = cfg.tiers.iter().map(|t| t.store.clone()).collect();
        let (jobs, done) = worker::spawn(stores, keys.clone(), cfg.layout, cfg.queue_pages)
            .map_err(OffloadError::Thread)?;
        let mut o = Self {
            tiers: cfg
                .tiers
                .into_iter()
                .map(|t| TierState {
                    store: t.store,
                    budget_bytes: t.budget_bytes,
                    used_bytes: 0,
                    moving_bytes: 0,
                    lru: BTreeSet::new(),
                })
                .collect(),
            index: HashMap::new(),
            pending: HashSet::new(),
            prefetched: HashMap::new(),
            fetching: HashSet::new(),
            keys,
            layout: cfg.layout,
            node: cfg.node,
            token_only: cfg.token_only,
            queue_pages: cfg.queue_pages,
            in_flight: 0,
            jobs,
            done,
            tick: 0,
            stats: OffloadStats::default(),
            happened: Vec::new(),
        };
        for t in 0..o.tiers.len() {
            if o.tiers[t].store.shared() {
                continue;
            }
            for s in o.tiers[t].store.list()? {
                if o.index.contains_key(&s.key) {
                    continue;
                }
                o.insert(s.key, t, s.bytes, None);
            }
        }
        o.enforce_budgets();
        Ok(o)
    }

    pub fn layout(&self) -> &Layout {
        &self.layout
    }
    pub fn node(&self) -> u32 {
        self.node
    }
    pub fn token_only(&self) -> bool {
        self.token_only
    }
    pub fn stats(&self) -> OffloadStats {
        self.stats
    }
    /// Pages the index knows, per tier (in tier order).
    pub fn pages_per_tier(&self) -> Vec<(Tier, usize)> {
        let mut v: Vec<(Tier, usize)> = self.tiers.iter().map(|t| (t.store.tier(), 0)).collect();
        for e in self.index.values() {
            v[e.tier].1 += 1;
        }
        v
    }
    /// Which tier holds `key`, if the index knows it.
    pub fn tier_of(&self, key: &BlockKey) -> Option<Tier> {
        self.index.get(key).map(|e| self.tiers[e.tier].store.tier())
    }

    fn insert(&mut self, key: BlockKey, tier: usize, bytes: u64, meta: Option<PageMeta>) {
        self.tick += 1;
        let e = Entry {
            tier,
            bytes,
            last_used: self.tick,
            busy: false,
            meta,
        };
        self.tiers[tier].used_bytes += bytes;
        self.tiers[tier].lru.insert((e.last_used, key));
        self.index.insert(key, e);
    }

    fn remove(&mut self, key: &BlockKey) -> Option<Entry> {
        let e = self.index.remove(key)?;
        let t = &mut self.tiers[e.tier];
        t.used_bytes -= e.bytes;
        if e.busy {
            t.moving_bytes -= e.bytes;
        }
        t.lru.remove(&(e.last_used, *key));
        Some(e)
    }

    fn touch(&mut self, key: &BlockKey) {
        self.tick += 1;
        let tick = self.tick;
        if let Some(e) = self.index.get_mut(key) {
            let t = &mut self.tiers[e.tier];
            if t.lru.remove(&(e.last_used, *key)) {
                t.lru.insert((tick, *key));
            }
            e.last_used = tick;
        }
    }

    fn send(&mut self, job: worker::Job) -> bool {
        if self.in_flight >= self.queue_pages {
            return false;
        }
        match self.jobs.try_send(job) {
            Ok(()) => {
                self.in_flight += 1;
                true
            }
            Err(mpsc::TrySendError::Full(_)) => false,
            Err(mpsc::TrySendError::Disconnected(_)) => {
                unreachable!("the offload worker lives as long as its sender")
            }
        }
    }

    /// Whether a page under `key` is stored or on its way.
    pub fn knows(&self, key: &BlockKey) -> bool {
        self.index.contains_key(key) || self.pending.contains(key)
    }

    /// Hand an evicted page (its bytes in transfer order) to the first tier. `page` is the pool
    /// page and generation it leaves. Returns whether it was queued (not when already stored).
    /// With the queue full it first waits for the worker to finish a job (backpressure): a
    /// burst of evictions — a long prompt's admission — costs the engine thread the worker's
    /// time instead of losing pages, which would lose whole conversations (the cache evicts
    /// leaves first, so a chain's first pages come last).
    pub fn write_back(&mut self, meta: PageMeta, page: (u32, u32), body: Vec<u8>) -> bool {
        debug_assert_eq!(body.len(), self.layout.body_bytes());
        if self.knows(&meta.key) {
            return false;
        }
        while self.in_flight >= self.queue_pages {
            self.stats.write_back_waits += 1;
            match self.done.recv() {
                Ok(d) => self.complete(d),
                Err(_) => unreachable!("the offload worker lives as long as its receiver"),
            }
        }
        let key = meta.key;
        let row = Happened::Offloaded {
            key,
            meta: Some(meta.clone()),
            tier: self.tiers[0].store.tier(),
            page: Some(page),
        };
        let sent = self.send(worker::Job::Seal { meta, body });
        assert!(sent, "room was made for the write-back");
        self.pending.insert(key);
        self.happened.push(row);
        true
    }

    /// How many leading `keys` could be restored now (indexed and not moving, or prefetched).
    pub fn restorable(&self, keys: &[BlockKey]) -> usize {
        keys.iter()
            .take_while(|k| {
                self.prefetched.contains_key(*k) || self.index.get(*k).is_some_and(|e| !e.busy)
            })
            .count()
    }

    /// Start fetching `keys` (a request's chain past its pool hits, in order) into memory, off
    /// the engine thread: those indexed in a tier below host, and — when the last tier is shared
    /// — keys not indexed at all (another node may have stored them). Returns how many were
    /// started.
    pub fn prefetch(&mut self, keys: &[BlockKey]) -> usize {
        let shared = self.tiers.last().is_some_and(|t| t.store.shared());
        if self.prefetched.len() >= self.queue_pages {
            // Prefetched pages no admission took (its request ended while waiting, or its
            // restore stopped at an earlier page): drop them all rather than never prefetch
            // again — they are copies, and a restore without one reads its tier.
            self.prefetched.clear();
        }
        let mut started = 0;
        for k in keys {
            if self.prefetched.contains_key(k) || self.fetching.contains(k) {
                continue;
            }
            let tier = match self.index.get(k) {
                Some(e) if e.busy => break,
                Some(e) if self.tiers[e.tier].store.tier() == Tier::Host => continue,
                Some(e) => e.tier,
                None if shared && !self.pending.contains(k) => self.tiers.len() - 1,
                None => break,
            };
            if self.prefetched.len() + self.fetching.len() >= self.queue_pages
                || !self.send(worker::Job::Fetch { key: *k, tier })
            {
                break;
            }
            self.fetching.insert(*k);
            started += 1;
        }
        started
    }

    /// Drop the prefetched copies of `keys` an admission did not take.
    pub fn forget_prefetched(&mut self, keys: &[BlockKey]) {
        for k in keys {
            self.prefetched.remove(k);
        }
    }

    /// Whether any of `keys` is being prefetched.
    pub fn fetching_any(&self, keys: &[BlockKey]) -> bool {
        !self.fetching.is_empty() && keys.iter().any(|k| self.fetching.contains(k))
    }

    /// The sealed bytes under `key`: prefetched, or read from its tier now (on the caller's
    /// thread). `Ok(None)`: not there (a miss).
    pub fn fetch(&mut self, key: &BlockKey) -> Result<Option<Fetched>, StoreError> {
        if let Some(f) = self.prefetched.remove(key) {
            return Ok(Some(f));
        }
        let Some(e) = self.index.get(key).filter(|e| !e.busy) else {
            return Ok(None);
        };
        let store = self.tiers[e.tier].store.clone();
        match store.get(key)? {
            Some(sealed) => Ok(Some(Fetched {
                sealed,
                tier: store.tier(),
            })),
            None => {
                // Gone from under the index (deleted outside the node): forget it.
                self.remove(key);
                Ok(None)
            }
        }
    }

    /// Open a fetched page for the reader's lookup (see [`seal::open`]).
    pub fn open(&self, sealed: &[u8], expect: seal::Expect<'_>) -> Result<VerifiedPage, OpenError> {
        seal::open(&self.keys, &self.layout, sealed, expect)
    }

    /// A page was restored from its tier: it is fresh (least recently used last), and its meta
    /// is known.
    pub fn restored(&mut self, key: &BlockKey, meta: &PageMeta) {
        self.stats.restored += 1;
        self.touch(key);
        if let Some(e) = self.index.get_mut(key)
            && e.meta.is_none()
        {
            e.meta = Some(meta.clone());
        }
    }

    /// A page failed to open: it leaves the index and its tier (deleted by the worker); the
    /// caller records the violation.
    pub fn refused(&mut self, key: &BlockKey, tier: Tier) {
        self.stats.refused += 1;
        let meta = self.remove(key).and_then(|e| e.meta);
        let t = self.tiers.iter().position(|t| t.store.tier() == tier);
        if let Some(t) = t
            && !self.send(worker::Job::Delete { key: *key, tier: t })
        {
            // The queue is full: delete on this thread (a refused page is rare, and must not
            // be found again).
            if let Err(e) = self.tiers[t].store.delete(key) {
                tracing::error!(error = %e, "a refused offloaded page could not be deleted");
            }
        }
        self.happened.push(Happened::Evicted {
            key: *key,
            meta,
            tier,
            reason: "refused",
        });
    }

    /// Take the worker's completions, move pages down where a tier is over budget, and return
    /// what happened since the last call.
    pub fn poll(&mut self) -> Vec<Happened> {
        while let Ok(d) = self.done.try_recv() {
            self.complete(d);
        }
        self.enforce_budgets();
        std::mem::take(&mut self.happened)
    }

    /// [`Offload::poll`] until no job is in flight (tests, shutdown, benchmarks).
    pub fn flush(&mut self) -> Vec<Happened> {
        let mut out = Vec::new();
        loop {
            out.extend(self.poll());
            if self.in_flight == 0 {
                return out;
            }
            match self.done.recv() {
                Ok(d) => self.complete(d),
                Err(_) => unreachable!("the offload worker lives as long as its receiver"),
            }
        }
    }

    /// Wait up to `timeout` for one completion (the engine, idle but for a prefetch).
    pub fn wait(&mut self, timeout: std::time::Duration) {
        if let Ok(d) = self.done.recv_timeout(timeout) {
            self.complete(d);
        }
    }

    fn complete(&mut self, d: worker::Done) {
        assert!(self.in_flight > 0, "a completion with no job in flight");
        self.in_flight -= 1;
        match d {
            worker::Done::Stored { meta, bytes } => {
                self.pending.remove(&meta.key);
                self.stats.offloaded += 1;
                self.insert(meta.key, 0, bytes, Some(meta));
            }
            worker::Done::Moved { key, to, bytes } => {
                let meta = self.remove(&key).and_then(|e| e.meta);
                self.stats.moved += 1;
                self.insert(key, to, bytes, meta);
            }
            worker::Done::Deleted => {}
            worker::Done::Fetched { key, tier, sealed } => {
                self.fetching.remove(&key);
                if let Some(sealed) = sealed {
                    self.stats.prefetched += 1;
                    let tier = self.tiers[tier].store.tier();
                    self.prefetched.insert(key, Fetched { sealed, tier });
                }
            }
            worker::Done::Failed {
                key,
                tier,
                error,
                kind,
            } => {
                let tier = self.tiers[tier].store.tier();
                tracing::warn!(tier = tier.name(), ?kind, %error, "offload store failed");
                self.pending.remove(&key);
                self.fetching.remove(&key);
                match kind {
                    worker::Failure::Vanished => {
                        self.remove(&key);
                    }
                    worker::Failure::Write => {
                        if let Some(e) = self.index.get_mut(&key)
                            && e.busy
                        {
                            // A move that failed: the page stays where it was.
                            e.busy = false;
                            let t = &mut self.tiers[e.tier];
                            t.moving_bytes -= e.bytes;
                            t.lru.insert((e.last_used, key));
                        }
                    }
                    worker::Failure::Delete | worker::Failure::Fetch => return,
                }
                self.happened.push(Happened::Failed { key, tier, error });
            }
        }
    }

    /// Move least recently used pages down from every tier over its budget (the last tier
    /// evicts for good), as far as the job queue allows.
    fn enforce_budgets(&mut self) {
        for t in 0..self.tiers.len() {
            loop {
                let ts = &self.tiers[t];
                if ts.budget_bytes == 0 || ts.used_bytes - ts.moving_bytes <= ts.budget_bytes {
                    break;
                }
                let Some(&(_, key)) = ts.lru.first() else {
                    break;
                };
                if t + 1 < self.tiers.len() {
                    if !self.send(worker::Job::Move {
                        key,
                        from: t,
                        to: t + 1,
                    }) {
                        return;
                    }
                    let Some(e) = self.index.get_mut(&key) else {
                        unreachable!("an LRU entry not in the index")
                    };
                    e.busy = true;
                    self.happened.push(Happened::Offloaded {
                        key,
                        meta: e.meta.clone(),
                        tier: self.tiers[t + 1].store.tier(),
                        page: None,
                    });
                    self.tiers[t].lru.remove(&(e.last_used, key));
                    // Counted as leaving now, so the loop moves only what is over.
                    self.tiers[t].moving_bytes += e.bytes;
                } else {
                    if !self.send(worker::Job::Delete { key, tier: t }) {
                        return;
                    }
                    let meta = self.remove(&key).and_then(|e| e.meta);
                    self.stats.evicted += 1;
                    self.happened.push(Happened::Evicted {
                        key,
                        meta,
                        tier: self.tiers[t].store.tier(),
                        reason: "budget",
                    });
                }
            }
        }
    }
}

impl Drop for Offload {
    fn drop(&mut self) {
        // Let the worker finish what it was handed (a page half-written to disk is only a
        // `.tmp`); its completions are not recorded once the engine is gone.
        while self.in_flight > 0 && self.done.recv().is_ok() {
            self.in_flight -= 1;
        }
    }
}

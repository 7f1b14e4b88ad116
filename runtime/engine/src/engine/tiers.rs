//! The engine's side of KV offload ([`crate::offload`]): prefix-cache pages the pool evicts are
//! written back, sealed, to the offload tiers; a request's chain past its pool hits is
//! prefetched at submission and restored at admission, each page verified for the reader's own
//! lookup before its slots count as written; every step is in the audit log (`kv_offload`,
//! `page_events`, `integrity_violations`).

use std::sync::Arc;

use custody_audit::{self as audit, PageKind};

use super::{Engine, Seq, now_ns};
use crate::offload::seal::{self, Expect, Layout, PageMeta};
use crate::offload::{Happened, Offload, OffloadConfig, OffloadError, OffloadStats};
use crate::prefix_cache::{BlockKey, CacheScope, CachedPage, token_only_keys};

/// How long an admission waits for its prefetch before it restores (or misses) without it.
pub(super) const PREFETCH_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

impl Engine {
    /// The layout pages of this engine's pool are sealed for: the model's fingerprint (SHA-256
    /// of its GGUF file — computed here, once per call) and the pool's geometry.
    pub fn offload_layout(&self) -> Layout {
        Layout {
            fingerprint: self.model.gguf().sha256(),
            geom: self.pool.geometry(),
            n_layers: self.pool.n_layers() as u32,
        }
    }

    /// Turn KV offload on: the prefix cache's evicted pages go to `cfg`'s tiers. Needs the
    /// prefix cache (only its pages are offloaded) and `cfg.layout` equal to
    /// [`Engine::offload_layout`]. Recorded in `node_events` (`kv_offload`).
    pub fn enable_offload(&mut self, cfg: OffloadConfig) -> Result<(), OffloadError> {
        if self.cache.is_none() {
            return Err(OffloadError::Config(
                "needs the prefix cache (engine.prefix_cache): only its pages are offloaded".into(),
            ));
        }
        if cfg.layout != self.offload_layout() {
            return Err(OffloadError::Config(
                "the layout is not this engine's model and pool".into(),
            ));
        }
        let detail = format!(
            "tiers={} keys={:?} token_only={}",
            cfg.tiers
                .iter()
                .map(|t| format!("{}:{}B", t.store.tier().name(), t.budget_bytes))
                .collect::<Vec<_>>()
                .join(","),
            cfg.keys,
            cfg.token_only
        );
        if cfg.token_only {
            tracing::error!(
                "UNSAFE REPRODUCTION: the KV offload tiers are keyed on TOKENS ONLY: another tenant's offloaded page is a hit"
            );
        }
        let o = Offload::start(cfg)?;
        tracing::info!(%detail, "kv offload on");
        self.emit(audit::Event::Node {
            ts_ns: now_ns(),
            kind: "kv_offload".into(),
            detail,
        });
        self.offload = Some(o);
        self.record_offload();
        Ok(())
    }

    /// The offload's counters (`None` when it is off).
    pub fn offload_stats(&self) -> Option<OffloadStats> {
        self.offload.as_ref().map(Offload::stats)
    }

    /// Pages the offload tiers hold, per tier (empty when off).
    pub fn offload_pages(&self) -> Vec<(crate::offload::store::Tier, usize)> {
        self.offload
            .as_ref()
            .map(Offload::pages_per_tier)
            .unwrap_or_default()
    }

    /// Evict every cached page no request holds (each written back to the offload tiers when
    /// offload is on) and return how many: an operator's flush of the pool's cache, and how
    /// benchmarks put a conversation in a tier.
    pub fn evict_cached(&mut self) -> usize {
        let before = self.cache.as_ref().map_or(0, |c| c.stats().evictions);
        self.evict_until_free(self.pool.n_pages());
        let after = self.cache.as_ref().map_or(0, |c| c.stats().evictions);
        (after - before) as usize
    }

    /// Wait until every offload job handed out so far is done, and record what happened (tests,
    /// benchmarks, a draining node).
    pub fn offload_flush(&mut self) {
        let Some(o) = &mut self.offload else { return };
        let happened = o.flush();
        self.emit_offload(happened);
    }

    /// Record what the offload did since the last call (called every step).
    pub(super) fn record_offload(&mut self) {
        let Some(o) = &mut self.offload else { return };
        let happened = o.poll();
        self.emit_offload(happened);
    }

    fn emit_offload(&mut self, happened: Vec<Happened>) {
        if self.sink.is_none() {
            return;
        }
        // The `bytes` column: a page's K/V bytes (the same for every page of the pool).
        let bytes = self
            .offload
            .as_ref()
            .map_or(0, |o| o.layout().body_bytes() as u64);
        for h in happened {
            let rec = match h {
                Happened::Offloaded {
                    key,
                    meta,
                    tier,
                    page,
                } => match &meta {
                    Some(m) => offload_record(audit::OffloadEvent::Offload, tier.name(), m, bytes)
                        .with_page(page)
                        .by(m.writer.request, m.writer.tenant.clone()),
                    None => bare_record(audit::OffloadEvent::Offload, tier.name(), key),
                },
                Happened::Evicted {
                    key,
                    meta,
                    tier,
                    reason,
                } => {
                    let r = match &meta {
                        Some(m) => {
                            offload_record(audit::OffloadEvent::Evict, tier.name(), m, bytes)
                                .by(m.writer.request, m.writer.tenant.clone())
                        }
                        None => bare_record(audit::OffloadEvent::Evict, tier.name(), key),
                    };
                    audit::OffloadRecord {
                        detail: Some(reason.into()),
                        ..r
                    }
                }
                Happened::Failed { key, tier, error } => audit::OffloadRecord {
                    detail: Some(format!("store failed: {error}")),
                    ..bare_record(audit::OffloadEvent::Evict, tier.name(), key)
                },
            };
            self.emit(audit::Event::Offload(Box::new(rec)));
        }
    }

    /// The keys `s`'s chain is stored under in the offload tiers, for pages `from..n` (the
    /// chain's keys, or the tokens-only chain's under the unsafe reproduction).
    fn offload_keys(&self, s: &Seq, scope: &CacheScope, n: usize) -> Vec<BlockKey> {
        let ps = self.pool.page_size();
        if self.offload.as_ref().is_some_and(Offload::token_only) {
            token_only_keys(&s.prompt, ps, n)
        } else {
            scope
                .chain(&s.prompt, ps, n)
                .iter()
                .map(|l| l.key)
                .collect()
        }
    }

    /// Pages of `s`'s prompt a hit may cover (all but its last token's).
    fn hit_pages(&self, s: &Seq) -> usize {
        (s.prompt.len() - 1) / self.pool.page_size()
    }

    /// At submission: start fetching the offloaded pages `s`'s prompt may restore, so that its
    /// admission finds them in memory. Returns whether any fetch started.
    pub(super) fn prefetch_for(&mut self, s: &mut Seq) -> bool {
        let (Some(_), Some(cache), Some(scope)) = (&self.offload, &self.cache, &s.cache) else {
            return false;
        };
        let n = self.hit_pages(s);
        let chain = scope.chain(&s.prompt, self.pool.page_size(), n);
        let in_pool = cache.lookup(&chain);
        let keys = self.offload_keys(s, scope, n);
        let Some(o) = &mut self.offload else {
            return false;
        };
        let started = o.prefetch(&keys[in_pool..]) > 0;
        if started {
            s.prefetch = Some((keys, std::time::Instant::now() + PREFETCH_WAIT));
        }
        started
    }

    /// Whether `s`'s admission should wait for its prefetch (in flight, and not past its wait).
    pub(super) fn awaits_prefetch(&mut self, s: &Seq) -> bool {
        let Some((keys, deadline)) = &s.prefetch else {
            return false;
        };
        std::time::Instant::now() < *deadline
            && self.offload.as_ref().is_some_and(|o| o.fetching_any(keys))
    }

    /// After `s`'s admission restored what it could: the prefetched copies it did not take go.
    pub(super) fn prefetch_done(&mut self, s: &mut Seq) {
        if let (Some((keys, _)), Some(o)) = (s.prefetch.take(), &mut self.offload) {
            o.forget_prefetched(&keys);
        }
    }

    /// While the next admission waits for a prefetch and nothing runs: block briefly on the
    /// offload worker instead of spinning.
    pub(super) fn wait_for_offload(&mut self) {
        if let Some(o) = &mut self.offload {
            o.wait(std::time::Duration::from_millis(2));
        }
    }

    /// How many pages after `s`'s `in_pool` pool hits its admission can restore.
    pub(super) fn restorable_for(&self, s: &Seq, in_pool: usize) -> usize {
        let (Some(o), Some(scope)) = (&self.offload, &s.cache) else {
            return 0;
        };
        let n = self.hit_pages(s);
        if in_pool >= n {
            return 0;
        }
        let keys = self.offload_keys(s, scope, n);
        o.restorable(&keys[in_pool..])
    }

    /// Restore up to `count` pages of `s`'s chain after its `in_pool` pool hits (whose last is
    /// `parent`), each verified for this reader before it enters the pool, cached, and held for
    /// `s`. Stops at the first page that is missing or refused (a refused page is an
    /// `integrity_violations` row and leaves its tier). The pool must have `count` free pages.
    pub(super) fn restore_for(
        &mut self,
        s: &Seq,
        in_pool: usize,
        count: usize,
        mut parent: Option<BlockKey>,
    ) -> Vec<CachedPage> {
        let Some(scope) = s.cache.clone() else {
            return Vec::new();
        };
        debug_assert!(self.pool.n_free() >= count, "restore needs free pages");
        let n = in_pool + count;
        let chain = scope.chain(&s.prompt, self.pool.page_size(), n);
        let keys = self.offload_keys(s, &scope, n);
        let mut out = Vec::with_capacity(count);
        for (link, okey) in chain[in_pool..].iter().zip(&keys[in_pool..]) {
            let Some(page) = self.restore_one(s, link, okey, parent) else {
                break;
            };
            parent = Some(link.key);
            out.push(page);
        }
        out
    }

    fn restore_one(
        &mut self,
        s: &Seq,
        link: &crate::prefix_cache::ChainLink<'_>,
        okey: &BlockKey,
        parent: Option<BlockKey>,
    ) -> Option<CachedPage> {
        let o = self.offload.as_mut()?;
        let token_only = o.token_only();
        let node = o.node();
        let fetched = match o.fetch(okey) {
            Ok(Some(f)) => f,
            Ok(None) => return None,
            Err(e) => {
                tracing::warn!(request = s.id, error = %e, "offloaded page unreadable: a miss");
                return None;
            }
        };
        let expect = Expect {
            key: okey,
            namespace: (!token_only).then(|| link.namespace.tag()),
        };
        let page = match o.open(&fetched.sealed, expect) {
            Ok(p) => p,
            Err(e) => {
                o.refused(okey, fetched.tier);
                tracing::error!(request = s.id, tier = fetched.tier.name(), error = %e, "offloaded page refused: recomputed");
                self.emit(audit::Event::IntegrityViolation {
                    ts_ns: now_ns(),
                    request: s.id,
                    tenant: s.tenant.clone(),
                    page: None,
                    generation: None,
                    kind: e.kind().into(),
                    detail: format!("{} tier, key {}: {e}", fetched.tier.name(), seal::hex(okey)),
                });
                self.record_offload();
                return None;
            }
        };
        o.restored(okey, page.meta());
        let tag = link.namespace.tag();
        let pr = match self.pool.restore(&page, tag) {
            Ok(pr) => pr,
            Err(e) => unreachable!("restore runs with free pages counted: {e}"),
        };
        // The CUDA backend reads K/V on the device: the verified bytes go there before the page
        // is cached (its tag reaches the device with the step's tag changes).
        if let Err(e) = self.stage_to_device(&[pr]) {
            self.device_failed(&e);
            // The engine stops; the page's bytes never reached the device, so it is freed
            // rather than cached. A release of a page just restored cannot fail.
            let released = self.pool.release(tag.get(), &[pr]);
            debug_assert!(released.is_ok(), "{released:?}");
            return None;
        }
        let m = page.meta();
        let cached = CachedPage {
            key: link.key,
            page: pr,
            tag,
            scope: link.namespace.label().clone(),
            kind: link.namespace.kind().clone(),
            writer: m.writer.request,
            writer_tenant: m.writer.tenant.clone(),
            writer_node: (m.writer.node != node).then_some(m.writer.node),
            offload_key: *okey,
        };
        let Some(cache) = &mut self.cache else {
            unreachable!("offload runs only with the prefix cache")
        };
        // Held by `s` (the one reference an insert gives); its parent is the previous link.
        cache.insert(cached.clone(), parent);
        self.emit_restore(s, &cached, m, fetched.tier.name(), page.body().len());
        Some(cached)
    }

    /// A restore's rows: the page's allocation and write under its original writer (so the
    /// forensics see the restore as that writer's write), and the `kv_offload` `restore` row for
    /// the reader.
    fn emit_restore(
        &mut self,
        s: &Seq,
        page: &CachedPage,
        meta: &PageMeta,
        tier: &'static str,
        bytes: usize,
    ) {
        if self.sink.is_none() {
            return;
        }
        let ps = self.pool.page_size() as u32;
        let (w, wt) = (meta.writer.request, meta.writer.tenant.clone());
        self.emit_pages(w, &wt, &[page.page], PageKind::Alloc);
        let write = PageKind::Write {
            slot_start: 0,
            slot_end: ps,
            writer: audit::Writer::Restore,
        };
        self.emit_pages(w, &wt, &[page.page], write);
        let moved = (meta.namespace != page.tag).then(|| {
            format!(
                "UNSAFE token-only restore: namespace {:016x} restored into {:016x}",
                meta.namespace, page.tag
            )
        });
        let rec = audit::OffloadRecord {
            detail: moved,
            ..offload_record(audit::OffloadEvent::Restore, tier, meta, bytes as u64)
                .with_page(Some((page.page.page, page.page.generation)))
                .by(s.id, s.tenant.clone())
        };
        self.emit(audit::Event::Offload(Box::new(rec)));
    }

    /// Before a cached page returns to the pool's free list: hand its bytes to the offload's
    /// first tier, unless a tier already has it.
    pub(super) fn write_back(&mut self, ev: &CachedPage) {
        match &self.offload {
            Some(o) if !o.knows(&ev.offload_key) => {}
            _ => return,
        }
        // The CUDA backend: the page's device K/V into the pool's host memory first.
        if let Err(e) = self.stage_to_host(&[ev.page]) {
            self.device_failed(&e);
            return;
        }
        let Some(o) = &mut self.offload else { return };
        let body = match self.pool.export_shared(ev.page, ev.tag) {
            Ok(b) => b,
            Err(e) => {
                tracing::error!(error = %e, "cached page not offloaded");
                return;
            }
        };
        let meta = PageMeta {
            key: ev.offload_key,
            namespace: ev.tag,
            kind: ev.kind.clone(),
            scope: ev.scope.clone(),
            generation: ev.page.generation,
            filled: self.pool.page_size() as u32,
            writer: seal::Writer {
                node: ev.writer_node.unwrap_or(o.node()),
                request: ev.writer,
                tenant: ev.writer_tenant.clone(),
            },
        };
        o.write_back(meta, (ev.page.page, ev.page.generation), body);
    }
}

/// A `kv_offload` row of `meta`'s page (request and page to be filled in).
fn offload_record(
    event: audit::OffloadEvent,
    tier: &'static str,
    meta: &PageMeta,
    bytes: u64,
) -> audit::OffloadRecord {
    audit::OffloadRecord {
        namespace: Some(meta.namespace.get()),
        scope: Some(meta.scope.clone()),
        writer_node: Some(meta.writer.node),
        writer_request: Some(meta.writer.request),
        writer_tenant: Some(meta.writer.tenant.clone()),
        bytes,
        ..bare_record(event, tier, meta.key)
    }
}

/// A `kv_offload` row that knows only the key.
fn bare_record(
    event: audit::OffloadEvent,
    tier: &'static str,
    key: BlockKey,
) -> audit::OffloadRecord {
    audit::OffloadRecord {
        ts_ns: now_ns(),
        event,
        request: 0,
        tenant: Arc::from(""),
        tier,
        page: None,
        generation: None,
        key,
        namespace: None,
        scope: None,
        writer_node: None,
        writer_request: None,
        writer_tenant: None,
        bytes: 0,
        detail: None,
    }
}

/// Builder steps of a [`audit::OffloadRecord`].
trait RecordExt {
    fn with_page(self, page: Option<(u32, u32)>) -> Self;
    fn by(self, request: u64, tenant: Arc<str>) -> Self;
}

impl RecordExt for audit::OffloadRecord {
    fn with_page(self, page: Option<(u32, u32)>) -> Self {
        Self {
            page: page.map(|p| p.0),
            generation: page.map(|p| p.1),
            ..self
        }
    }
    fn by(self, request: u64, tenant: Arc<str>) -> Self {
        Self {
            request,
            tenant,
            ..self
        }
    }
}

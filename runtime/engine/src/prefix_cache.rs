//! The prefix cache: a prompt's full KV pages computed once and attended by later requests of
//! the same namespace.
//!
//! # Spec
//! - **Namespaces are derived by whoever authenticated the tenant**, never taken from a client:
//!   [`NamespaceSecret::private`] is HMAC-SHA-256(server secret, tenant ‖ salt) — a client's
//!   `cache_salt` is inside the tenant's MAC, so it selects another namespace *of that tenant*
//!   (narrows), never another tenant's (widens); [`NamespaceSecret::public`] is the MAC of an
//!   operator-declared public scope (no tenant in it: shared by every tenant whose prompt starts
//!   with the scope's declared tokens). A namespace's **tag** (64 bits of its MAC, top bit set,
//!   so no request id equals one) is what the page pool stores as a shared page's owner.
//! - **Keys** form a hash chain over full pages: `key(i) = SHA-256(key(i−1) ‖ namespace key of
//!   page i ‖ the page's tokens)`, `key(−1)` = 32 zero bytes. A key names the page's whole token
//!   history and the namespace of every page before it, so equal keys mean equal K/V (one model,
//!   one engine) in the same namespace.
//! - Only full pages are cached; a hit leaves at least one prompt token to compute (its logits
//!   are the first output). Pages wholly inside a matching public prefix belong to the public
//!   namespace; every other page (the one straddling the prefix's end included: it holds tenant
//!   tokens) to the tenant's.
//! - A cached page is a pool page handed to its namespace ([`crate::kv::PagePool::share`]): its
//!   owner and stamp are the namespace's tag, so the pool's own write check refuses every write
//!   of it, and the read check admits only readers that name the tag
//!   ([`custody_kernels::attention::Reader`]). A lookup that returned a wrong page would still be
//!   refused at the read.
//! - Entries are held by reference count (`readers`). An entry no request holds stays cached
//!   until the pool needs its page: eviction takes the least recently used entry that no request
//!   holds and no cached entry extends (a leaf). A reader of page `i` holds pages `0..i` too, so
//!   an entry's readers are at least its children's: every unheld entry is evictable, leaves
//!   first. A held entry is never evicted (asserted).
//! - Bounded: one entry per pool page at most; every operation is O(pages touched · log n).

use std::collections::{BTreeSet, HashMap};
use std::num::NonZeroU64;
use std::sync::Arc;

use custody_kernels::attention::PageRef;
use sha2::{Digest, Sha256};

/// A chain key: SHA-256 of the page's history and namespaces.
pub type BlockKey = [u8; 32];

/// Length of a namespace secret, bytes.
pub const SECRET_BYTES: usize = 32;

/// The server's secret the namespaces are derived from. `Debug` redacts it.
#[derive(Clone)]
pub struct NamespaceSecret([u8; SECRET_BYTES]);

impl std::fmt::Debug for NamespaceSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("NamespaceSecret(<redacted>)")
    }
}

/// A secret could not be made or read.
#[derive(Debug, thiserror::Error)]
pub enum SecretError {
    #[error("the OS random generator failed")]
    Random,
    #[error("a prefix-cache secret must be exactly {SECRET_BYTES} bytes (64 hex digits), got {0}")]
    Length(usize),
    #[error("the prefix-cache secret is not hex: {0}")]
    NotHex(String),
}

/// What a namespace is for (recorded with every share and hit).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ScopeKind {
    /// One tenant's (optionally narrowed by a salt).
    Tenant,
    /// An operator-declared public scope, shared by every tenant.
    Public,
    /// `[unsafe_reproduction] shared_prefix_cache`: one namespace for everyone — the leak.
    UnsafeGlobal,
}

/// A cache namespace: the key its chain starts from and the tag its pages are owned by.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Namespace {
    key: [u8; 32],
    tag: NonZeroU64,
    kind: ScopeKind,
    /// `tenant`, `tenant+salt`, `public:<name>` or `unsafe:global`: what the audit log says.
    label: Arc<str>,
}

impl Namespace {
    /// The owner value of this namespace's shared pages.
    pub fn tag(&self) -> NonZeroU64 {
        self.tag
    }
    pub fn kind(&self) -> &ScopeKind {
        &self.kind
    }
    pub fn label(&self) -> &Arc<str> {
        &self.label
    }
}

/// Domain separation of the MACs (`v1`: change it if the message layout changes).
const DOMAIN: &[u8] = b"custody prefix-cache namespace v1";

impl NamespaceSecret {
    /// A fresh secret from the OS CSPRNG (a process's own: its namespaces end with it, as its
    /// cache does).
    pub fn generate() -> Result<Self, SecretError> {
        use ring::rand::SecureRandom;
        let mut b = [0u8; SECRET_BYTES];
        ring::rand::SystemRandom::new()
            .fill(&mut b)
            .map_err(|_| SecretError::Random)?;
        Ok(Self(b))
    }

    /// A secret from 64 hex digits (surrounding whitespace ignored).
    pub fn from_hex(text: &str) -> Result<Self, SecretError> {
        let t = text.trim();
        if t.len() != 2 * SECRET_BYTES {
            return Err(SecretError::Length(t.len() / 2));
        }
        let mut b = [0u8; SECRET_BYTES];
        for (i, out) in b.iter_mut().enumerate() {
            *out = u8::from_str_radix(&t[2 * i..2 * i + 2], 16)
                .map_err(|e| SecretError::NotHex(e.to_string()))?;
        }
        Ok(Self(b))
    }

    fn derive(&self, kind: ScopeKind, fields: &[&[u8]], label: String) -> Namespace {
        let key = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, &self.0);
        let mut ctx = ring::hmac::Context::with_key(&key);
        ctx.update(DOMAIN);
        ctx.update(&[match kind {
            ScopeKind::Tenant => 1,
            ScopeKind::Public => 2,
            ScopeKind::UnsafeGlobal => 3,
        }]);
        for f in fields {
            // Length-prefixed: ("ab", "c") and ("a", "bc") are different messages.
            ctx.update(&(f.len() as u64).to_le_bytes());
            ctx.update(f);
        }
        let mac = ctx.sign();
        let mut k = [0u8; 32];
        k.copy_from_slice(mac.as_ref());
        let low = u64::from_le_bytes([k[0], k[1], k[2], k[3], k[4], k[5], k[6], k[7]]);
        let tag = NonZeroU64::new(low | (1 << 63)).unwrap_or(NonZeroU64::MAX);
        Namespace {
            key: k,
            tag,
            kind,
            label: label.into(),
        }
    }

    /// The namespace of an authenticated `tenant`, narrowed by the client's `salt` if any.
    pub fn private(&self, tenant: &str, salt: Option<&str>) -> Namespace {
        match salt {
            None => self.derive(ScopeKind::Tenant, &[tenant.as_bytes()], "tenant".into()),
            Some(s) => self.derive(
                ScopeKind::Tenant,
                &[tenant.as_bytes(), s.as_bytes()],
                "tenant+salt".into(),
            ),
        }
    }

    /// The namespace of the operator-declared public scope `scope`.
    pub fn public(&self, scope: &str) -> Namespace {
        self.derive(
            ScopeKind::Public,
            &[scope.as_bytes()],
            format!("public:{scope}"),
        )
    }

    /// The MAC key of offloaded pages when `[kv_offload]` names none of its own: a fleet that
    /// shares this secret reads its nodes' pages, and nobody else can forge one.
    pub fn offload_mac_key(&self) -> [u8; 32] {
        let key = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, &self.0);
        let mac = ring::hmac::sign(&key, b"custody kv offload mac key v1");
        let mut k = [0u8; 32];
        k.copy_from_slice(mac.as_ref());
        k
    }

    /// The one namespace of `[unsafe_reproduction] shared_prefix_cache`: tenants not in the key.
    pub fn unsafe_global(&self) -> Namespace {
        self.derive(ScopeKind::UnsafeGlobal, &[], "unsafe:global".into())
    }
}

/// An operator-declared public prefix: the tokens a prompt must start with for its pages to be
/// cached in the public namespace.
#[derive(Clone, Debug)]
pub struct PublicPrefix {
    pub namespace: Namespace,
    pub tokens: Arc<[u32]>,
}

/// Where a request's pages may be cached and looked up, set by the server that authenticated
/// its tenant (the engine never derives one).
#[derive(Clone, Debug)]
pub struct CacheScope {
    pub private: Namespace,
    pub public: Option<PublicPrefix>,
}

impl CacheScope {
    /// The namespaces a request of this scope may read shared pages of.
    pub fn tags(&self) -> Vec<NonZeroU64> {
        let mut v = vec![self.private.tag];
        if let Some(p) = &self.public
            && p.namespace.tag != self.private.tag
        {
            v.push(p.namespace.tag);
        }
        v
    }

    /// The chain over `tokens`' full pages (`page_size` tokens each): page `i`'s key and
    /// namespace, for the first `n_pages` pages.
    pub fn chain(&self, tokens: &[u32], page_size: usize, n_pages: usize) -> Vec<ChainLink<'_>> {
        self.links(tokens, page_size, None, 0..n_pages)
    }

    /// Links `pages` of the chain over `tokens` (only full pages), given the key of the link
    /// before `pages.start` (`None` exactly when it is 0): a running sequence extends its chain
    /// page by page without hashing its history again.
    pub fn links(
        &self,
        tokens: &[u32],
        page_size: usize,
        before: Option<BlockKey>,
        pages: std::ops::Range<usize>,
    ) -> Vec<ChainLink<'_>> {
        assert!(page_size > 0);
        assert_eq!(
            before.is_some(),
            pages.start > 0,
            "the previous key, exactly when needed"
        );
        let end = pages.end.min(tokens.len() / page_size);
        let public_pages = self.public.as_ref().map_or(0, |p| {
            let m = p
                .tokens
                .iter()
                .zip(tokens)
                .take_while(|(a, b)| a == b)
                .count();
            m / page_size
        });
        let mut prev = before.unwrap_or([0u8; 32]);
        let mut out = Vec::with_capacity(end.saturating_sub(pages.start));
        for i in pages.start..end {
            let ns = match &self.public {
                Some(p) if i < public_pages => &p.namespace,
                _ => &self.private,
            };
            let mut h = Sha256::new();
            h.update(prev);
            h.update(ns.key);
            for t in &tokens[i * page_size..(i + 1) * page_size] {
                h.update(t.to_le_bytes());
            }
            prev = h.finalize().into();
            out.push(ChainLink {
                key: prev,
                namespace: ns,
            });
        }
        out
    }
}

/// The namespaces could not be set up from the configuration.
#[derive(Debug, thiserror::Error)]
pub enum NamespaceError {
    #[error("prefix_cache.secret_file {path}: {reason}")]
    Secret { path: String, reason: String },
    #[error("prefix-cache secret: {0}")]
    Random(SecretError),
    #[error("prefix_cache.public {scope}: cannot tokenize: {reason}")]
    Tokenize { scope: String, reason: String },
}

/// A node's namespace material: the secret, the operator's public scopes (tokenized once), and
/// the incident reproduction's switch. The node that authenticated a request's tenant (`custody
/// serve`, or a prefill node for the tenant its front's certificate vouched for) makes the
/// request's [`CacheScope`] here — and only here.
#[derive(Debug)]
pub struct Namespaces {
    secret: NamespaceSecret,
    public: Vec<PublicPrefix>,
    /// `[unsafe_reproduction] shared_prefix_cache`: every request in one namespace.
    unsafe_global: bool,
}

impl Namespaces {
    /// Read the secret (or draw one) and tokenize the public scopes.
    pub fn from_section(
        cfg: &crate::config::PrefixCacheSection,
        tokenizer: &crate::Tokenizer,
        unsafe_global: bool,
    ) -> Result<Self, NamespaceError> {
        let secret = match &cfg.secret_file {
            Some(p) => {
                let bad = |reason: String| NamespaceError::Secret {
                    path: p.display().to_string(),
                    reason,
                };
                let text = std::fs::read_to_string(p).map_err(|e| bad(e.to_string()))?;
                NamespaceSecret::from_hex(&text).map_err(|e| bad(e.to_string()))?
            }
            None => NamespaceSecret::generate().map_err(NamespaceError::Random)?,
        };
        let mut public = Vec::with_capacity(cfg.public.len());
        for p in &cfg.public {
            let tokens = match (&p.text, &p.system_prompt) {
                (Some(t), _) => tokenizer.encode(t, false),
                (None, Some(sys)) => {
                    tokenizer.encode_chat(&[crate::ChatMessage::new("system", sys.clone())])
                }
                (None, None) => unreachable!("validated: one of text and system_prompt"),
            }
            .map_err(|e| NamespaceError::Tokenize {
                scope: p.scope.clone(),
                reason: e.to_string(),
            })?;
            public.push(PublicPrefix {
                namespace: secret.public(&p.scope),
                tokens: tokens.into(),
            });
        }
        Ok(Self {
            secret,
            public,
            unsafe_global,
        })
    }

    /// The scope of a request of authenticated `tenant` with the client's `salt` and `prompt`:
    /// the tenant's namespace (narrowed by the salt) and the public scope whose declared prefix
    /// the prompt shares the most tokens with, if any.
    pub fn scope(&self, tenant: &str, salt: Option<&str>, prompt: &[u32]) -> CacheScope {
        if self.unsafe_global {
            return CacheScope {
                private: self.secret.unsafe_global(),
                public: None,
            };
        }
        let shared = |p: &PublicPrefix| {
            p.tokens
                .iter()
                .zip(prompt)
                .take_while(|(a, b)| a == b)
                .count()
        };
        let public = self
            .public
            .iter()
            .map(|p| (shared(p), p))
            .filter(|(n, _)| *n > 0)
            .max_by_key(|(n, _)| *n)
            .map(|(_, p)| p.clone());
        CacheScope {
            private: self.secret.private(tenant, salt),
            public,
        }
    }

    /// The MAC key offloaded pages are sealed with by default ([`NamespaceSecret::offload_mac_key`]).
    pub fn offload_mac_key(&self) -> [u8; 32] {
        self.secret.offload_mac_key()
    }

    /// One line per public scope for the audit log's `node_events` (`prefix_scope`): its name,
    /// its length in tokens and its namespace tag; and the unsafe global namespace when armed.
    pub fn describe(&self) -> Vec<String> {
        let mut v: Vec<String> = self
            .public
            .iter()
            .map(|p| {
                format!(
                    "scope={} tokens={} namespace={:016x}",
                    p.namespace.label(),
                    p.tokens.len(),
                    p.namespace.tag()
                )
            })
            .collect();
        if self.unsafe_global {
            v.push(format!(
                "scope=unsafe:global namespace={:016x} (UNSAFE: tenants share one namespace)",
                self.secret.unsafe_global().tag()
            ));
        }
        v
    }
}

/// One page of a chain: its key and the namespace it is cached in.
#[derive(Clone, Copy, Debug)]
pub struct ChainLink<'a> {
    pub key: BlockKey,
    pub namespace: &'a Namespace,
}

/// A cached page as a hit or an eviction reports it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CachedPage {
    pub key: BlockKey,
    pub page: PageRef,
    pub tag: NonZeroU64,
    pub scope: Arc<str>,
    pub kind: ScopeKind,
    /// The request that computed the page, and its tenant.
    pub writer: u64,
    pub writer_tenant: Arc<str>,
    /// The node it was computed on, when not this one (a page restored from a shared tier).
    pub writer_node: Option<u32>,
    /// The key an offload tier stores it under: `key`, or under
    /// `[unsafe_reproduction] token_only_offload` the chain over its tokens alone
    /// ([`token_only_keys`]).
    pub offload_key: BlockKey,
}

/// The chain over `tokens`' first `n_pages` full pages with **no namespace** in any link: the key
/// of an external tier that knows only tokens (`[unsafe_reproduction] token_only_offload`, the
/// SGLang/LMCache leak). Never used otherwise.
pub fn token_only_keys(tokens: &[u32], page_size: usize, n_pages: usize) -> Vec<BlockKey> {
    assert!(page_size > 0);
    let end = n_pages.min(tokens.len() / page_size);
    let mut prev = [0u8; 32];
    let mut out = Vec::with_capacity(end);
    for page in tokens.chunks_exact(page_size).take(end) {
        let mut h = Sha256::new();
        h.update(b"custody token-only chain");
        h.update(prev);
        for t in page {
            h.update(t.to_le_bytes());
        }
        prev = h.finalize().into();
        out.push(prev);
    }
    out
}

#[derive(Debug)]
struct Entry {
    page: CachedPage,
    parent: Option<BlockKey>,
    children: u32,
    readers: u32,
    last_used: u64,
}

/// The cache's counters (for `/metrics` and tests).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CacheStats {
    pub entries: usize,
    pub held: usize,
    pub shares: u64,
    pub hits_pages: u64,
    pub evictions: u64,
}

/// The cache's index: chain key → cached page, with reference counts and an LRU of the
/// evictable leaves.
#[derive(Debug, Default)]
pub struct PrefixCache {
    entries: HashMap<BlockKey, Entry>,
    /// `(last_used, key)` of every entry no request holds and no entry extends.
    evictable_leaves: BTreeSet<(u64, BlockKey)>,
    /// Entries no request holds (leaves or not).
    unheld: usize,
    tick: u64,
    stats: CacheStats,
}

impl PrefixCache {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn stats(&self) -> CacheStats {
        CacheStats {
            entries: self.entries.len(),
            held: self.entries.len() - self.unheld,
            ..self.stats
        }
    }

    /// How many leading links of `chain` are cached.
    pub fn lookup(&self, chain: &[ChainLink<'_>]) -> usize {
        chain
            .iter()
            .take_while(|l| {
                self.entries
                    .get(&l.key)
                    .is_some_and(|e| e.page.tag == l.namespace.tag)
            })
            .count()
    }

    /// Entries no request holds: pages eviction can return to the pool.
    pub fn evictable(&self) -> usize {
        self.unheld
    }

    fn is_leaf_unheld(e: &Entry) -> bool {
        e.readers == 0 && e.children == 0
    }

    /// Change an entry under the LRU's bookkeeping.
    fn update(&mut self, key: &BlockKey, f: impl FnOnce(&mut Entry, u64)) {
        self.tick += 1;
        let tick = self.tick;
        let Some(e) = self.entries.get_mut(key) else {
            unreachable!("update of an entry not in the cache")
        };
        let (was_leaf, was_unheld) = (Self::is_leaf_unheld(e), e.readers == 0);
        if was_leaf {
            self.evictable_leaves.remove(&(e.last_used, *key));
        }
        f(e, tick);
        if Self::is_leaf_unheld(e) {
            self.evictable_leaves.insert((e.last_used, *key));
        }
        match (was_unheld, e.readers == 0) {
            (true, false) => self.unheld -= 1,
            (false, true) => self.unheld += 1,
            _ => {}
        }
    }

    /// Take a reference on each of the first `n` links' entries (they must be cached: see
    /// [`PrefixCache::lookup`]) and return their pages.
    pub fn acquire(&mut self, chain: &[ChainLink<'_>], n: usize) -> Vec<CachedPage> {
        let mut out = Vec::with_capacity(n);
        for l in &chain[..n] {
            self.update(&l.key, |e, tick| {
                e.readers += 1;
                e.last_used = tick;
            });
            out.push(self.entries[&l.key].page.clone());
        }
        self.stats.hits_pages += n as u64;
        out
    }

    /// Drop one reference on each of `keys`' entries.
    pub fn release(&mut self, keys: &[BlockKey]) {
        // Deepest first, so a parent is never a leaf while its child is still counted.
        for k in keys.iter().rev() {
            self.update(k, |e, tick| {
                assert!(e.readers > 0, "release of an unheld cache entry");
                e.readers -= 1;
                e.last_used = tick;
            });
        }
    }

    /// Whether `key` is cached.
    pub fn contains(&self, key: &BlockKey) -> bool {
        self.entries.contains_key(key)
    }

    /// Add a page just shared by its writer, who holds it (one reference). Its parent (the
    /// previous link, if any) must be cached.
    pub fn insert(&mut self, page: CachedPage, parent: Option<BlockKey>) {
        assert!(!self.entries.contains_key(&page.key), "a key cached twice");
        if let Some(p) = &parent {
            self.update(p, |e, _| e.children += 1);
        }
        self.tick += 1;
        let key = page.key;
        self.entries.insert(
            key,
            Entry {
                page,
                parent,
                children: 0,
                readers: 1,
                last_used: self.tick,
            },
        );
        self.stats.shares += 1;
    }

    /// Remove the least recently used entry no request holds and none extends, and return its
    /// page (the caller returns it to the pool); `None` when every entry is held.
    pub fn evict_one(&mut self) -> Option<CachedPage> {
        let (_, key) = self.evictable_leaves.pop_first()?;
        let Some(e) = self.entries.remove(&key) else {
            unreachable!("an evictable leaf not in the cache")
        };
        assert!(
            e.readers == 0 && e.children == 0,
            "eviction of a held or extended entry"
        );
        self.unheld -= 1;
        if let Some(p) = &e.parent {
            self.update(p, |pe, _| pe.children -= 1);
        }
        self.stats.evictions += 1;
        Some(e.page)
    }
}

/// What the namespace and chain machinery costs one request (`custody bench` reports it).
#[derive(Clone, Copy, Debug)]
pub struct MachineryCost {
    /// Deriving the request's namespace (one HMAC-SHA-256) and its chain over the prompt's full
    /// pages (one SHA-256 per page), then the lookup, on a miss: the cost a request pays.
    pub scope_chain_lookup: std::time::Duration,
    /// One decode step's tag checks when every page of the context is a shared page (the
    /// reader names two namespaces) over the same checks when every page is the reader's own.
    pub shared_tag_check_ratio: f64,
}

/// Measure [`MachineryCost`] for a `prompt_tokens`-token prompt of `page_size`-token pages and
/// `n_layers` layers, `iters` times each.
pub fn bench_machinery(
    prompt_tokens: usize,
    page_size: usize,
    n_layers: usize,
    iters: u32,
) -> MachineryCost {
    assert!(iters > 0 && page_size > 0);
    let secret = NamespaceSecret([7; SECRET_BYTES]);
    let prompt: Vec<u32> = (0..prompt_tokens as u32).map(|t| t * 31 % 49_152).collect();
    let cache = PrefixCache::new();
    let t0 = std::time::Instant::now();
    for i in 0..iters {
        let scope = CacheScope {
            private: secret.private(if i % 2 == 0 { "acme" } else { "globex" }, None),
            public: None,
        };
        let chain = scope.chain(std::hint::black_box(&prompt), page_size, usize::MAX);
        assert_eq!(cache.lookup(&chain), 0);
    }
    let scope_chain_lookup = t0.elapsed() / iters;
    let own = custody_kernels::attention::bench_decode_step_tag_checks(
        prompt_tokens,
        page_size,
        n_layers,
        iters,
    );
    let shared = custody_kernels::attention::bench_decode_step_tag_checks_shared(
        prompt_tokens,
        page_size,
        n_layers,
        iters,
    );
    MachineryCost {
        scope_chain_lookup,
        shared_tag_check_ratio: shared.as_secs_f64() / own.as_secs_f64().max(1e-12),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn secret() -> NamespaceSecret {
        NamespaceSecret::from_hex(&"2a".repeat(32)).unwrap()
    }

    fn scope(tenant: &str) -> CacheScope {
        CacheScope {
            private: secret().private(tenant, None),
            public: None,
        }
    }

    #[test]
    fn namespaces_are_the_tenants_and_a_salt_only_narrows() {
        let s = secret();
        let (a, b) = (s.private("acme", None), s.private("bravo", None));
        assert_ne!(a.tag(), b.tag());
        assert_eq!(a, s.private("acme", None), "deterministic");
        // The victim's salt does not reach the victim's namespace, nor does any salt.
        let victim_salted = s.private("acme", Some("x"));
        assert_ne!(s.private("bravo", Some("x")), victim_salted);
        assert_ne!(victim_salted, a);
        // Length prefixes: tenant "ab" + salt "c" is not tenant "a" + salt "bc".
        assert_ne!(s.private("ab", Some("c")), s.private("a", Some("bc")));
        // Another secret, other namespaces; a public scope is no tenant's.
        let other = NamespaceSecret::from_hex(&"2b".repeat(32)).unwrap();
        assert_ne!(other.private("acme", None), a);
        assert_ne!(s.public("acme").tag(), a.tag());
        assert!(a.tag().get() >= 1 << 63, "tags are never request ids");
        assert!(format!("{s:?}").contains("redacted"));
        assert!(NamespaceSecret::from_hex("abcd").is_err());
        assert!(NamespaceSecret::from_hex(&"zz".repeat(32)).is_err());
    }

    #[test]
    fn links_extend_a_chain_as_hashing_it_whole_would() {
        let toks: Vec<u32> = (0..80).collect();
        let s = scope("acme");
        let whole = s.chain(&toks, 16, 5);
        let head = s.links(&toks, 16, None, 0..2);
        let tail = s.links(&toks, 16, Some(head[1].key), 2..5);
        let keys: Vec<BlockKey> = head.iter().chain(&tail).map(|l| l.key).collect();
        assert_eq!(keys, whole.iter().map(|l| l.key).collect::<Vec<_>>());
    }

    #[test]
    fn chains_bind_history_and_namespace() {
        let toks: Vec<u32> = (0..40).collect();
        let a = scope("acme");
        let b = scope("bravo");
        let ca = a.chain(&toks, 16, 10);
        assert_eq!(ca.len(), 2, "full pages only");
        assert_ne!(ca[0].key, b.chain(&toks, 16, 10)[0].key);
        let mut other = toks.clone();
        other[3] = 99;
        let co = a.chain(&other, 16, 10);
        assert_ne!(ca[1].key, co[1].key, "page 1's key covers page 0's tokens");
        // A public prefix of 20 tokens: page 0 public, page 1 (straddling) the tenant's.
        let public = PublicPrefix {
            namespace: secret().public("sys"),
            tokens: toks[..20].into(),
        };
        let pa = CacheScope {
            public: Some(public.clone()),
            ..a.clone()
        };
        let pb = CacheScope {
            public: Some(public),
            ..b.clone()
        };
        let (la, lb) = (pa.chain(&toks, 16, 10), pb.chain(&toks, 16, 10));
        assert_eq!(la[0].key, lb[0].key, "the public page is shared");
        assert_eq!(la[0].namespace.kind(), &ScopeKind::Public);
        assert_ne!(la[1].key, lb[1].key, "the straddling page is not");
        assert_eq!(la[1].namespace.kind(), &ScopeKind::Tenant);
    }

    fn page(key: BlockKey, p: u32, ns: &Namespace) -> CachedPage {
        CachedPage {
            key,
            page: PageRef {
                page: p,
                generation: 1,
            },
            tag: ns.tag(),
            scope: ns.label().clone(),
            kind: ns.kind().clone(),
            writer: 1,
            writer_tenant: "acme".into(),
            writer_node: None,
            offload_key: key,
        }
    }

    #[test]
    fn eviction_is_lru_leaves_first_and_never_held() {
        let s = scope("acme");
        let toks: Vec<u32> = (0..64).collect();
        let chain = s.chain(&toks, 16, 4);
        let mut c = PrefixCache::new();
        let mut parent = None;
        for (i, l) in chain.iter().enumerate() {
            c.insert(page(l.key, i as u32, l.namespace), parent);
            parent = Some(l.key);
        }
        assert_eq!(c.lookup(&chain), 4);
        assert_eq!(c.evictable(), 0);
        assert_eq!(c.evict_one(), None, "every entry is held by its writer");
        // A second reader of the first two pages, then the writer lets go.
        let got = c.acquire(&chain, 2);
        assert_eq!(got.len(), 2);
        let keys: Vec<BlockKey> = chain.iter().map(|l| l.key).collect();
        c.release(&keys);
        assert_eq!(c.evictable(), 2);
        // Leaves first: page 3, then page 2; pages 0 and 1 are held.
        assert_eq!(c.evict_one().map(|p| p.page.page), Some(3));
        assert_eq!(c.evict_one().map(|p| p.page.page), Some(2));
        assert_eq!(c.evict_one(), None);
        assert_eq!(c.lookup(&chain), 2);
        c.release(&keys[..2]);
        assert_eq!(c.evict_one().map(|p| p.page.page), Some(1));
        assert_eq!(c.evict_one().map(|p| p.page.page), Some(0));
        assert_eq!(c.stats().entries, 0);
    }

    #[test]
    fn lookup_stops_at_another_namespaces_entry() {
        let (a, b) = (scope("acme"), scope("bravo"));
        let toks: Vec<u32> = (0..32).collect();
        let mut c = PrefixCache::new();
        let la = a.chain(&toks, 16, 2);
        c.insert(page(la[0].key, 0, la[0].namespace), None);
        assert_eq!(c.lookup(&la), 1);
        assert_eq!(c.lookup(&b.chain(&toks, 16, 2)), 0);
    }
}

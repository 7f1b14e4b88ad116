//! The prefix cache on the engine: hits give the uncached output bit for bit, namespaces
//! isolate (a wrong lookup is refused by the read's tag check, not trusted), eviction is LRU
//! under pool pressure and never takes a held page, and every share, hit and eviction is in the
//! audit log.

use std::collections::BTreeMap;
use std::sync::Arc;

use custody_audit::{CacheEvent, Event as AEvent, MemorySink, PageKind};
use custody_runtime::engine::{Event, GenerateRequest};
use custody_runtime::prefix_cache::{CacheScope, NamespaceSecret, PublicPrefix};
use custody_runtime::{Engine, EngineConfig, SamplingParams};

use crate::{engine_with, small_cfg, tokenizer};

pub const PAGE: usize = 16;

pub fn secret() -> NamespaceSecret {
    NamespaceSecret::from_hex(&"5c".repeat(32)).expect("secret")
}

pub fn scope(tenant: &str) -> CacheScope {
    CacheScope {
        private: secret().private(tenant, None),
        public: None,
    }
}

/// A prompt of about `words` words, distinct per `seed`.
pub fn text(seed: usize, words: usize) -> String {
    const W: [&str; 16] = [
        "ledger", "harbor", "quartz", "meadow", "signal", "copper", "lantern", "orbit", "velvet",
        "summit", "canyon", "ember", "falcon", "glacier", "juniper", "marble",
    ];
    let mut x = (seed as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    (0..words)
        .map(|_| {
            // SplitMix64: no two seeds share a run of words by accident.
            x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = x;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            W[((z ^ (z >> 31)) % W.len() as u64) as usize]
        })
        .collect::<Vec<_>>()
        .join(" ")
}

fn req(tenant: &str, prompt: Vec<u32>, cache: Option<CacheScope>) -> GenerateRequest {
    GenerateRequest {
        decoding: Default::default(),
        prompt,
        max_tokens: 6,
        sampling: SamplingParams::default(),
        stop_ids: vec![],
        tenant: tenant.into(),
        cache,
    }
}

/// What one request produced.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
struct Outcome {
    tokens: Vec<u32>,
    cached_tokens: usize,
    failed: bool,
}

/// Submit `r` alone and run the engine until it is done.
fn run_one(e: &mut Engine, r: GenerateRequest) -> (u64, Outcome) {
    let id = e.submit(r).expect("admitted");
    let mut o = Outcome::default();
    while e.has_work() {
        for ev in e.step() {
            match ev {
                Event::Token { id: i, token, .. } if i == id => o.tokens.push(token),
                Event::Finished {
                    id: i,
                    cached_tokens,
                    ..
                } if i == id => o.cached_tokens = cached_tokens,
                Event::Failed { id: i, .. } if i == id => o.failed = true,
                _ => {}
            }
        }
    }
    (id, o)
}

fn cached_engine(kv_budget_mib: usize) -> (Engine, MemorySink) {
    let sink = MemorySink::default();
    let e = engine_with(EngineConfig {
        kv_budget_mib,
        // Small pools hold one 256-token context (SmolLM2: 22.5 KiB of K/V per token).
        context_length: Some(if kv_budget_mib < 64 { 256 } else { 2048 }),
        prefix_cache: Some(true),
        ..small_cfg()
    })
    .with_audit(Arc::new(sink.clone()));
    (e, sink)
}

fn cache_rows(sink: &MemorySink) -> Vec<custody_audit::CacheRecord> {
    sink.events
        .lock()
        .expect("sink")
        .iter()
        .filter_map(|e| match e {
            AEvent::Cache(c) => Some((**c).clone()),
            _ => None,
        })
        .collect()
}

#[test]
fn a_hit_reuses_the_prefix_and_gives_the_uncached_output_bit_for_bit() {
    let tok = tokenizer();
    let p = tok.encode(&text(1, 120), false).expect("tokenize");
    assert!(p.len() > 4 * PAGE, "{} tokens", p.len());
    let mut turn2 = p.clone();
    turn2.extend(tok.encode(&text(2, 30), false).expect("tokenize"));

    let mut plain = engine_with(EngineConfig {
        prefix_cache: Some(false),
        ..small_cfg()
    });
    let (_, want1) = run_one(&mut plain, req("acme", p.clone(), Some(scope("acme"))));
    let (_, want2) = run_one(&mut plain, req("acme", turn2.clone(), Some(scope("acme"))));
    assert_eq!(want1.cached_tokens, 0, "no cache, nothing cached");

    let (mut e, sink) = cached_engine(64);
    let (w, first) = run_one(&mut e, req("acme", p.clone(), Some(scope("acme"))));
    assert_eq!(first.cached_tokens, 0);
    assert_eq!(first.tokens, want1.tokens);
    // Same tenant, same prompt: every full page but the one holding the last token is a hit.
    let (r2, again) = run_one(&mut e, req("acme", p.clone(), Some(scope("acme"))));
    assert_eq!(again.cached_tokens, (p.len() - 1) / PAGE * PAGE);
    assert_eq!(
        again.tokens, want1.tokens,
        "a hit changes no bit of the output"
    );
    // The next turn of the chat: the whole first prompt (and the first answer's full pages,
    // where they match) come from the cache.
    let (_, next) = run_one(&mut e, req("acme", turn2.clone(), Some(scope("acme"))));
    assert!(next.cached_tokens >= p.len() / PAGE * PAGE, "{next:?}");
    assert_eq!(next.tokens, want2.tokens);
    // Another tenant, the same prompt: a miss.
    let (_, other) = run_one(&mut e, req("bravo", p.clone(), Some(scope("bravo"))));
    assert_eq!(other.cached_tokens, 0);
    assert_eq!(other.tokens, want1.tokens);
    // No scope (the CLI, the canary): never cached, never reads the cache.
    let (_, none) = run_one(&mut e, req("acme", p.clone(), None));
    assert_eq!(none.cached_tokens, 0);

    // The audit log: shares by the writer, hits naming the writer and the hit length.
    let rows = cache_rows(&sink);
    let hits: Vec<_> = rows
        .iter()
        .filter(|c| c.event == CacheEvent::Hit && c.request == r2)
        .collect();
    assert_eq!(hits.len(), (p.len() - 1) / PAGE);
    assert!(hits.iter().all(|h| h.writer == w
        && h.writer_tenant.as_ref() == "acme"
        && h.hit_tokens as usize == again.cached_tokens
        && h.scope_kind == "tenant"));
    let shared: Vec<_> = rows
        .iter()
        .filter(|c| c.event == CacheEvent::Share && c.request == w)
        .collect();
    assert!(
        shared.len() >= p.len() / PAGE,
        "the first request shared its full pages"
    );
    // Every page is either free, held by the cache, or neither leaked: the pool adds up.
    let stats = e.prefix_cache_stats().expect("cache on");
    assert_eq!(
        stats.held, 0,
        "nobody holds a cached page once every request ended"
    );
    assert_eq!(e.pool().n_free() + stats.entries, e.pool().n_pages());
}

#[test]
fn a_lookup_that_returns_another_namespaces_pages_is_refused_by_the_tag_check() {
    let tok = tokenizer();
    let p = tok.encode(&text(3, 100), false).expect("tokenize");
    let (mut e, sink) = cached_engine(64);
    let (_, victim) = run_one(&mut e, req("acme", p.clone(), Some(scope("acme"))));
    assert!(!victim.failed);
    // A broken index: bravo's lookups land on acme's chain.
    e.fault_injection().misdirect_cache_lookups(scope("acme"));
    let (id, attacker) = run_one(&mut e, req("bravo", p.clone(), Some(scope("bravo"))));
    assert!(
        attacker.failed,
        "the read of acme's shared pages must be refused"
    );
    assert!(
        attacker.tokens.is_empty(),
        "no token from another namespace's pages"
    );
    let violations: Vec<String> = sink
        .events
        .lock()
        .expect("sink")
        .iter()
        .filter_map(|ev| match ev {
            AEvent::IntegrityViolation { request, kind, .. } if *request == id => {
                Some(kind.clone())
            }
            _ => None,
        })
        .collect();
    assert_eq!(violations, ["ForeignOwner"]);
}

/// Public scopes: pages wholly inside the declared prefix are shared by every tenant (and
/// recorded as public); the page straddling its end and everything after are not.
#[test]
fn a_public_scope_is_shared_across_tenants_and_nothing_else_is() {
    let tok = tokenizer();
    let sys = tok.encode(&text(4, 70), false).expect("tokenize");
    let public = PublicPrefix {
        namespace: secret().public("helpdesk"),
        tokens: sys.clone().into(),
    };
    let with_public = |t: &str| CacheScope {
        public: Some(public.clone()),
        ..scope(t)
    };
    let ask = |q: usize| {
        let mut v = sys.clone();
        v.extend(tok.encode(&text(q, 40), false).expect("tokenize"));
        v
    };
    let (mut e, sink) = cached_engine(64);
    let (a, _) = run_one(&mut e, req("acme", ask(10), Some(with_public("acme"))));
    let (b, bravo) = run_one(&mut e, req("bravo", ask(11), Some(with_public("bravo"))));
    assert_eq!(bravo.cached_tokens, sys.len() / PAGE * PAGE);
    let rows = cache_rows(&sink);
    let b_hits: Vec<_> = rows
        .iter()
        .filter(|c| c.event == CacheEvent::Hit && c.request == b)
        .collect();
    assert_eq!(b_hits.len(), sys.len() / PAGE);
    assert!(b_hits.iter().all(|h| h.scope_kind == "public"
        && h.scope.as_ref() == "public:helpdesk"
        && h.writer == a));
    // acme's own pages after the prefix went into acme's namespace, which bravo never read.
    assert!(
        rows.iter()
            .any(|c| c.event == CacheEvent::Share && c.request == a && c.scope_kind == "tenant")
    );
}

#[test]
fn eviction_is_lru_under_pressure_never_takes_a_held_page_and_is_audited() {
    let tok = tokenizer();
    // A pool of about 700 tokens (45 pages of 16): a few prompts of ~100 tokens fill it.
    let (mut e, sink) = cached_engine(16);
    let n_pages = e.pool().n_pages();
    let prompts: Vec<Vec<u32>> = (0..24)
        .map(|i| tok.encode(&text(20 + i, 90), false).expect("tokenize"))
        .collect();
    let mut out = BTreeMap::new();
    for (i, p) in prompts.iter().enumerate() {
        let (_, o) = run_one(&mut e, req("acme", p.clone(), Some(scope("acme"))));
        assert!(!o.failed);
        out.insert(i, o);
        let st = e.prefix_cache_stats().expect("cache on");
        assert_eq!(e.pool().n_free() + st.entries, n_pages, "pages add up");
    }
    let st = e.prefix_cache_stats().expect("cache on");
    assert!(
        st.evictions > 0,
        "the pool filled and the cache gave pages back"
    );
    // The most recent prompt is still cached; the first was evicted.
    let (_, recent) = run_one(
        &mut e,
        req("acme", prompts[23].clone(), Some(scope("acme"))),
    );
    assert!(recent.cached_tokens > 0);
    let (_, oldest) = run_one(&mut e, req("acme", prompts[0].clone(), Some(scope("acme"))));
    assert_eq!(oldest.cached_tokens, 0, "least recently used went first");
    assert_eq!(oldest.tokens, out[&0].tokens);
    // Every eviction is a `prefix_cache` evict row and a page release by the writer.
    let events = sink.events.lock().expect("sink").clone();
    let evicts = events
        .iter()
        .filter(|e| matches!(e, AEvent::Cache(c) if c.event == CacheEvent::Evict))
        .count() as u64;
    assert_eq!(evicts, e.prefix_cache_stats().expect("on").evictions);
    let released_shared = events
        .iter()
        .filter(|e| {
            matches!(e, AEvent::Page { kind: PageKind::Release, page, generation, .. }
                if events.iter().any(|c| matches!(c, AEvent::Cache(c)
                    if c.event == CacheEvent::Evict && c.page == *page && c.generation == *generation)))
        })
        .count() as u64;
    assert_eq!(released_shared, evicts);
}

/// Held pages survive pressure: a request that holds cached pages keeps them while others
/// need the pool; when nothing more can be evicted, a request waits instead.
#[test]
fn a_page_a_running_request_holds_is_never_evicted() {
    let tok = tokenizer();
    let (mut e, _sink) = cached_engine(16);
    let base = tok.encode(&text(40, 110), false).expect("tokenize");
    let (_, _) = run_one(&mut e, req("acme", base.clone(), Some(scope("acme"))));
    // A long-running reader of the cached prefix, and a stream of other prompts that fill the
    // pool while it runs.
    let mut holder = req("acme", base.clone(), Some(scope("acme")));
    holder.max_tokens = 40;
    let hid = e.submit(holder).expect("admitted");
    let mut others = (0..20)
        .map(|i| tok.encode(&text(60 + i, 90), false).expect("tokenize"))
        .collect::<Vec<_>>()
        .into_iter();
    let mut holder_tokens = Vec::new();
    let mut done = false;
    while !done {
        if e.n_waiting() == 0
            && let Some(p) = others.next()
        {
            e.submit(req("acme", p, Some(scope("acme"))))
                .expect("admitted");
        }
        for ev in e.step() {
            match ev {
                Event::Token { id, token, .. } if id == hid => holder_tokens.push(token),
                Event::Failed { id, error } => panic!("request {id} failed: {error}"),
                Event::Finished { id, .. } if id == hid => done = true,
                _ => {}
            }
        }
    }
    while e.has_work() {
        e.step();
    }
    assert_eq!(
        holder_tokens.len(),
        40,
        "the holder ran to its end on its cached pages"
    );
    let st = e.prefix_cache_stats().expect("on");
    assert!(st.evictions > 0);
    assert_eq!(e.pool().n_free() + st.entries, e.pool().n_pages());
}

/// Disaggregated: a hit on the prefill node computes only the prompt's tail, and the cached pages
/// are still transferred — checksummed and verified by decode like any other — so decode's
/// output equals the colocated engine's token for token. Decode caches nothing (it holds no
/// namespace); another tenant's request is a miss on the prefill node.
#[test]
fn a_prefill_node_hit_transfers_the_cached_pages_and_decode_gives_the_colocated_output() {
    use crate::disagg::{cfg, fingerprint, model};
    use custody_runtime::config::PrefixCacheSection;
    use custody_runtime::prefix_cache::Namespaces;
    let tok = tokenizer();
    let p = tok.encode(&text(70, 100), false).expect("tokenize");
    let (pa, da) = (MemorySink::default(), MemorySink::default());
    let pe = Engine::new(
        model(),
        EngineConfig {
            prefix_cache: Some(true),
            ..cfg(2048, 64)
        },
    )
    .expect("prefill engine")
    .with_audit(Arc::new(pa.clone()));
    let de = Engine::new(model(), cfg(2048, 64))
        .expect("decode engine")
        .with_audit(Arc::new(da.clone()));
    let ns = Namespaces::from_section(&PrefixCacheSection::default(), &tok, false).expect("ns");
    let pair = crate::disagg::start_engines_ns(
        pe,
        de,
        fingerprint(),
        Default::default(),
        std::time::Duration::from_secs(30),
        (None, None),
        false,
        Some(Arc::new(ns)),
    );
    let r = |tenant: &str| GenerateRequest {
        decoding: Default::default(),
        max_tokens: 8,
        ..req(tenant, p.clone(), None)
    };
    let first = pair.generate(&r("acme")).expect("first");
    let again = pair.generate(&r("acme")).expect("again");
    let other = pair.generate(&r("bravo")).expect("other");
    assert_eq!(first.cached_tokens, 0);
    assert_eq!(again.cached_tokens as usize, (p.len() - 1) / PAGE * PAGE);
    assert_eq!(
        other.cached_tokens, 0,
        "another tenant misses on the prefill node"
    );
    let want = crate::reference::greedy(&mut engine_with(small_cfg()), p.clone(), 8);
    for g in [&first, &again, &other] {
        assert_eq!(g.tokens, want, "the colocated engine's tokens");
    }
    // The hit's pages went to decode like any other: one transfer row per prompt page.
    let transfers = pa
        .events
        .lock()
        .expect("sink")
        .iter()
        .filter(|e| matches!(e, AEvent::Transfer { request, .. } if *request == again.request))
        .count();
    assert_eq!(transfers, p.len().div_ceil(PAGE));
    let hits = cache_rows(&pa)
        .iter()
        .filter(|c| c.event == CacheEvent::Hit && c.request == again.request)
        .count();
    assert_eq!(hits, (p.len() - 1) / PAGE);
    assert!(cache_rows(&da).is_empty(), "decode shares nothing");
}

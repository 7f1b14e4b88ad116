//! KV offload on the engine with the real model: prefix-cache pages the pool evicts are sealed
//! into a host tier and a disk tier and come back as hits — output equal to the uncached run
//! token for token — and every page that fails verification (flipped, cut, another model's,
//! another namespace's) is a miss and an `integrity_violations` row, never a read.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use custody_audit::{Event as AEvent, MemorySink, OffloadEvent, OffloadRecord};
use custody_query::datafusion::object_store::aws::AmazonS3Builder;
use custody_runtime::config::KvOffloadSection;
use custody_runtime::engine::{Event, GenerateRequest};
use custody_runtime::offload::seal::{self, Layout, PageMeta, SealKeys};
use custody_runtime::offload::store::{DiskStore, HostArena, PageStore};
use custody_runtime::offload::{OffloadConfig, OffloadSetup, TierSpec};
use custody_runtime::offload_s3::S3PageStore;
use custody_runtime::prefix_cache::CacheScope;
use custody_runtime::{Engine, EngineConfig, SamplingParams};

use crate::prefix_cache::{PAGE, scope, secret, text};
use crate::serve::{
    CacheOpts, KEY, KEY_BRAVO, TestServer, attack_with_cuts_of, cache_cfg, complete,
    exposure_names_exactly, ks_two_sample, public_scope,
};
use crate::{engine_with, small_cfg, tokenizer};

/// Sealed bytes of one SmolLM2 page (16 slots × 22.5 KiB) plus its header and MAC.
const PAGE_BYTES: u64 = 16 * 23_040 + 512;

fn req(tenant: &str, prompt: Vec<u32>, cache: Option<CacheScope>) -> GenerateRequest {
    GenerateRequest {
        decoding: Default::default(),
        prompt,
        max_tokens: 4,
        sampling: SamplingParams::default(),
        stop_ids: vec![],
        tenant: tenant.into(),
        cache,
    }
}

#[derive(Debug, Default, Clone, PartialEq, Eq)]
struct Outcome {
    id: u64,
    tokens: Vec<u32>,
    cached_tokens: usize,
    failed: bool,
}

fn run(e: &mut Engine, r: GenerateRequest) -> Outcome {
    let id = e.submit(r).expect("admitted");
    let mut o = Outcome {
        id,
        ..Outcome::default()
    };
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
    // Write-backs land before the next request looks (the worker runs beside the engine).
    e.offload_flush();
    o
}

fn temp_dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("custody-offload-{name}-{}", std::process::id()));
    if d.exists() {
        std::fs::remove_dir_all(&d).expect("clear");
    }
    d
}

/// A cached engine with a pool of about 45 pages (context 256) and `tiers`' offload.
fn offload_engine(
    disk: &Path,
    host_pages: u64,
    disk_pages: u64,
    token_only: bool,
    object: Option<TierSpec>,
) -> (Engine, MemorySink) {
    let sink = MemorySink::default();
    let mut e = engine_with(EngineConfig {
        kv_budget_mib: 16,
        context_length: Some(256),
        prefix_cache: Some(true),
        ..small_cfg()
    })
    .with_audit(Arc::new(sink.clone()));
    let layout = e.offload_layout();
    let mut tiers = vec![
        TierSpec {
            store: Arc::new(HostArena::new()),
            budget_bytes: host_pages * PAGE_BYTES,
        },
        TierSpec {
            store: Arc::new(DiskStore::open(disk).expect("disk tier")),
            budget_bytes: disk_pages * PAGE_BYTES,
        },
    ];
    tiers.extend(object);
    let cfg = OffloadConfig {
        tiers,
        keys: SealKeys::new(&secret().offload_mac_key(), None),
        layout,
        node: 1,
        token_only,
        queue_pages: 64,
    };
    e.enable_offload(cfg).expect("offload on");
    (e, sink)
}

fn offload_rows(sink: &MemorySink) -> Vec<OffloadRecord> {
    sink.events
        .lock()
        .expect("sink")
        .iter()
        .filter_map(|e| match e {
            AEvent::Offload(o) => Some((**o).clone()),
            _ => None,
        })
        .collect()
}

fn violations(sink: &MemorySink, request: u64) -> Vec<String> {
    sink.events
        .lock()
        .expect("sink")
        .iter()
        .filter_map(|ev| match ev {
            AEvent::IntegrityViolation {
                request: r, kind, ..
            } if *r == request => Some(kind.clone()),
            _ => None,
        })
        .collect()
}

fn restores_of(sink: &MemorySink, request: u64) -> Vec<OffloadRecord> {
    offload_rows(sink)
        .into_iter()
        .filter(|o| o.event == OffloadEvent::Restore && o.request == request)
        .collect()
}

/// Conversations of one tenant: a first turn of ~90 tokens, and a follow-up that repeats it.
fn conversations(n: usize) -> Vec<(Vec<u32>, Vec<u32>)> {
    let tok = tokenizer();
    (0..n)
        .map(|i| {
            let first = tok.encode(&text(500 + i, 90), false).expect("tokenize");
            let mut second = first.clone();
            second.extend(tok.encode(&text(900 + i, 12), false).expect("tokenize"));
            (first, second)
        })
        .collect()
}

#[test]
fn a_working_set_five_times_the_pool_is_served_from_every_tier_token_for_token() {
    let dir = temp_dir("tiers");
    let moto = crate::s3::Moto::start();
    // Pool ≈ 45 pages; 40 conversations of ~6 full pages each ≈ 5× the pool. Host holds 40
    // pages, disk 60, the bucket 60: the oldest conversations leave every tier.
    let convs = conversations(40);
    let object = TierSpec {
        store: bucket(&moto, "tiers"),
        budget_bytes: 60 * PAGE_BYTES,
    };
    let (mut e, sink) = offload_engine(&dir, 40, 60, false, Some(object));
    let mut plain = engine_with(EngineConfig {
        kv_budget_mib: 16,
        context_length: Some(256),
        prefix_cache: Some(false),
        ..small_cfg()
    });
    for (first, _) in &convs {
        let o = run(&mut e, req("acme", first.clone(), Some(scope("acme"))));
        assert!(!o.failed);
    }
    let tiers = e.offload_pages();
    assert!(
        tiers.iter().all(|(_, n)| *n > 0),
        "both tiers hold pages: {tiers:?}"
    );
    // Follow-ups, newest conversation first: the pool's, then the host tier's, then disk's.
    let mut served = std::collections::BTreeMap::<String, usize>::new();
    for i in (0..convs.len()).rev().step_by(3) {
        let second = &convs[i].1;
        let want = run(&mut plain, req("acme", second.clone(), None));
        let got = run(&mut e, req("acme", second.clone(), Some(scope("acme"))));
        assert_eq!(got.tokens, want.tokens, "conversation {i}: token for token");
        assert!(!got.failed);
        let restored = restores_of(&sink, got.id);
        for r in &restored {
            *served.entry(r.tier.to_owned()).or_default() += 1;
            assert_eq!(r.writer_tenant.as_deref(), Some("acme"));
            assert_eq!(r.tenant.as_ref(), "acme");
        }
        if got.cached_tokens == 0 {
            *served.entry("recomputed".into()).or_default() += 1;
        }
        assert!(violations(&sink, got.id).is_empty());
    }
    for tier in ["host", "disk", "object", "recomputed"] {
        assert!(served.get(tier).copied().unwrap_or(0) > 0, "{served:?}");
    }
    // Another tenant's identical prompt: no hit anywhere, no restore.
    let other = run(
        &mut e,
        req("bravo", convs[39].1.clone(), Some(scope("bravo"))),
    );
    assert_eq!(other.cached_tokens, 0);
    assert!(restores_of(&sink, other.id).is_empty());
    // Every restore is a write by the original writer in `page_events` (the forensics' rule).
    let events = sink.events.lock().expect("sink").clone();
    let restore_writes = events
        .iter()
        .filter(|ev| {
            matches!(ev, AEvent::Page { kind: custody_audit::PageKind::Write {
                writer: custody_audit::Writer::Restore, .. }, tenant, .. } if tenant.as_ref() == "acme")
        })
        .count();
    let restores = offload_rows(&sink)
        .iter()
        .filter(|o| o.event == OffloadEvent::Restore)
        .count();
    assert_eq!(restore_writes, restores);
    assert!(
        offload_rows(&sink)
            .iter()
            .any(|o| o.event == OffloadEvent::Evict && o.detail.as_deref() == Some("budget")),
        "the oldest pages left the last tier"
    );
    drop(e);
    std::fs::remove_dir_all(&dir).expect("clean");
}

/// Fill the pool with other prompts until earlier pages have left it for the tiers.
fn push_out(e: &mut Engine, fillers: usize, seed: usize) {
    let tok = tokenizer();
    for i in 0..fillers {
        let p = tok.encode(&text(seed + i, 90), false).expect("tokenize");
        assert!(!run(e, req("zulu", p, Some(scope("zulu")))).failed);
    }
}

/// An engine whose disk tier holds acme's `victim` prompt's pages: the engine, its log, the
/// uncached output, and the file and key of the victim's first page.
struct OnDisk {
    e: Engine,
    sink: MemorySink,
    want: Vec<u32>,
    key: [u8; 32],
    path: PathBuf,
}

fn victim_on_disk(dir: &Path, victim: &[u32]) -> OnDisk {
    // One page of host room: every offloaded page moves on to disk.
    let (mut e, sink) = offload_engine(dir, 1, 400, false, None);
    let want = run(&mut e, req("acme", victim.to_vec(), None)).tokens;
    assert!(!run(&mut e, req("acme", victim.to_vec(), Some(scope("acme")))).failed);
    push_out(&mut e, 12, 710);
    let key = scope("acme").chain(victim, PAGE, 1)[0].key;
    let path = dir.join(format!("{}.kvpage", seal::hex(&key)));
    assert!(path.exists(), "acme's first page is on disk");
    OnDisk {
        e,
        sink,
        want,
        key,
        path,
    }
}

#[test]
fn a_flipped_cut_foreign_or_misfiled_page_is_a_miss_and_a_violation_never_a_read() {
    let tok = tokenizer();
    let victim = tok.encode(&text(700, 90), false).expect("tokenize");
    // Each case on a fresh node: the victim's first page on disk, then changed there.
    type Tamper = fn(&[u8], &Layout, &SealKeys, &PageMeta) -> Vec<u8>;
    let cases: [(&str, Tamper, &str); 4] = [
        (
            "flipped",
            |good, _, _, _| {
                let mut f = good.to_vec();
                f[good.len() / 2] ^= 1;
                f
            },
            "offload_mac",
        ),
        (
            "truncated",
            |good, _, _, _| good[..good.len() / 3].to_vec(),
            "offload_mac",
        ),
        (
            "another model's",
            |_, layout, keys, meta| {
                let other = Layout {
                    fingerprint: [0xee; 32],
                    ..*layout
                };
                seal::seal(keys, &other, meta, &vec![0u8; layout.body_bytes()]).expect("seal")
            },
            "offload_model",
        ),
        (
            "another namespace's",
            |_, layout, keys, meta| {
                let bravo = PageMeta {
                    namespace: scope("bravo").private.tag(),
                    ..meta.clone()
                };
                seal::seal(keys, layout, &bravo, &vec![0u8; layout.body_bytes()]).expect("seal")
            },
            "offload_namespace",
        ),
    ];
    for (what, tamper, kind) in cases {
        let dir = temp_dir("tamper");
        let OnDisk {
            mut e,
            sink,
            want,
            key,
            path,
        } = victim_on_disk(&dir, &victim);
        let good = std::fs::read(&path).expect("read");
        let layout = e.offload_layout();
        let keys = SealKeys::new(&secret().offload_mac_key(), None);
        let expect = seal::Expect {
            key: &key,
            namespace: Some(scope("acme").private.tag()),
        };
        let meta = seal::open(&keys, &layout, &good, expect)
            .expect("the stored page opens")
            .meta()
            .clone();
        std::fs::write(&path, tamper(&good, &layout, &keys, &meta)).expect("tamper");
        let o = run(&mut e, req("acme", victim.clone(), Some(scope("acme"))));
        assert!(!o.failed, "{what}: a miss, not a failure");
        assert_eq!(o.cached_tokens, 0, "{what}: the first page missed");
        assert_eq!(o.tokens, want, "{what}: recomputed, token for token");
        assert_eq!(violations(&sink, o.id), [kind], "{what}");
        assert!(
            restores_of(&sink, o.id).is_empty(),
            "{what}: nothing restored"
        );
        assert!(!path.exists(), "{what}: the refused page left its tier");
        assert!(
            offload_rows(&sink)
                .iter()
                .any(|r| r.event == OffloadEvent::Evict
                    && r.key == key
                    && r.detail.as_deref() == Some("refused"))
        );
        drop(e);
        std::fs::remove_dir_all(&dir).expect("clean");
    }
}

#[test]
fn a_restarted_node_serves_hits_from_its_disk() {
    let tok = tokenizer();
    let victim = tok.encode(&text(720, 90), false).expect("tokenize");
    let dir = temp_dir("restart");
    let OnDisk { e, want, .. } = victim_on_disk(&dir, &victim);
    drop(e);
    // A new process's engine over the same directory and secret.
    let (mut e, sink) = offload_engine(&dir, 1, 400, false, None);
    let o = run(&mut e, req("acme", victim.clone(), Some(scope("acme"))));
    assert_eq!(o.tokens, want);
    assert_eq!(o.cached_tokens, (victim.len() - 1) / PAGE * PAGE);
    let r = restores_of(&sink, o.id);
    assert_eq!(r.len(), (victim.len() - 1) / PAGE);
    assert!(r.iter().all(|r| r.tier == "disk"
        && r.writer_tenant.as_deref() == Some("acme")
        && r.writer_node == Some(1)));
    // Another tenant on the restarted node: nothing.
    let b = run(&mut e, req("bravo", victim.clone(), Some(scope("bravo"))));
    assert_eq!(b.cached_tokens, 0);
    assert!(restores_of(&sink, b.id).is_empty());
    drop(e);
    std::fs::remove_dir_all(&dir).expect("clean");
}

#[test]
fn token_only_offload_reproduces_the_cross_tenant_hit() {
    let tok = tokenizer();
    let victim = tok.encode(&text(740, 90), false).expect("tokenize");
    let dir = temp_dir("token-only");
    let (mut e, sink) = offload_engine(&dir, 400, 400, true, None);
    let a = run(&mut e, req("acme", victim.clone(), Some(scope("acme"))));
    push_out(&mut e, 12, 760);
    // bravo sends acme's prompt: acme's offloaded pages are bravo's hits — the leak.
    let b = run(&mut e, req("bravo", victim.clone(), Some(scope("bravo"))));
    assert_eq!(b.tokens, a.tokens);
    assert!(b.cached_tokens > 0, "the reproduction leaks");
    let r = restores_of(&sink, b.id);
    assert!(!r.is_empty());
    assert!(r.iter().all(|r| r.tenant.as_ref() == "bravo"
        && r.writer_tenant.as_deref() == Some("acme")
        && r.detail.as_deref().is_some_and(|d| d.starts_with("UNSAFE"))));
    drop(e);
    std::fs::remove_dir_all(&dir).expect("clean");
}

/// The moto server's bucket under `prefix`, as an object tier.
fn bucket(moto: &crate::s3::Moto, prefix: &str) -> Arc<S3PageStore> {
    Arc::new(
        S3PageStore::with_builder(
            &format!("s3://{}/{prefix}", crate::s3::BUCKET),
            AmazonS3Builder::new()
                .with_endpoint(&moto.endpoint)
                .with_allow_http(true)
                .with_access_key_id("test")
                .with_secret_access_key("test")
                .with_region("us-east-1"),
        )
        .expect("object tier"),
    )
}

/// A prefill node's engine whose tiers are one page of host memory and the fleet's bucket
/// (`store`), pages sealed with the fleet's MAC key and AES key.
fn fleet_node(node: u32, store: Arc<S3PageStore>) -> (Engine, MemorySink) {
    let sink = MemorySink::default();
    let mut e = engine_with(EngineConfig {
        kv_budget_mib: 16,
        context_length: Some(256),
        prefix_cache: Some(true),
        ..small_cfg()
    })
    .with_audit(Arc::new(sink.clone()));
    let layout = e.offload_layout();
    e.enable_offload(OffloadConfig {
        tiers: vec![
            TierSpec {
                store: Arc::new(HostArena::new()),
                budget_bytes: PAGE_BYTES,
            },
            TierSpec {
                store,
                budget_bytes: 0,
            },
        ],
        keys: SealKeys::new(&secret().offload_mac_key(), Some(&[0x42; 32])),
        layout,
        node,
        token_only: false,
        queue_pages: 64,
    })
    .expect("offload on");
    (e, sink)
}

#[test]
fn two_prefill_nodes_share_the_object_tier_with_isolation_intact() {
    let moto = crate::s3::Moto::start();
    let bucket = || bucket(&moto, "fleet-kv");
    let tok = tokenizer();
    let victim = tok.encode(&text(780, 90), false).expect("tokenize");
    let (mut a, _) = fleet_node(1, bucket());
    let first = run(&mut a, req("acme", victim.clone(), Some(scope("acme"))));
    push_out(&mut a, 10, 790);
    let key = scope("acme").chain(&victim, PAGE, 1)[0].key;
    let stored = bucket()
        .get(&key)
        .expect("get")
        .expect("acme's page is in the bucket");
    // Ciphertext: without the fleet's AES key the page does not open.
    let layout = a.offload_layout();
    let expect = seal::Expect {
        key: &key,
        namespace: Some(scope("acme").private.tag()),
    };
    let plain_keys = SealKeys::new(&secret().offload_mac_key(), None);
    assert_eq!(
        seal::open(&plain_keys, &layout, &stored, expect).unwrap_err(),
        seal::OpenError::Decrypt
    );
    drop(a);
    // Another prefill node of the fleet: acme's follow-up is served from the bucket.
    let (mut b, sink) = fleet_node(2, bucket());
    let o = run(&mut b, req("acme", victim.clone(), Some(scope("acme"))));
    assert_eq!(o.tokens, first.tokens, "token for token");
    assert_eq!(o.cached_tokens, (victim.len() - 1) / PAGE * PAGE);
    let r = restores_of(&sink, o.id);
    assert_eq!(r.len(), (victim.len() - 1) / PAGE);
    assert!(
        r.iter()
            .all(|r| r.tier == "object" && r.writer_node == Some(1) && r.tenant.as_ref() == "acme")
    );
    // bravo, same prompt, same node: nothing of acme's, no violation (bravo's keys name
    // nothing in the bucket).
    let x = run(&mut b, req("bravo", victim.clone(), Some(scope("bravo"))));
    assert_eq!(x.cached_tokens, 0);
    assert!(restores_of(&sink, x.id).is_empty());
    assert!(violations(&sink, x.id).is_empty());
    drop(b);
    // A truncated object in the bucket: a third node misses, says so, and recomputes.
    bucket()
        .put(&key, &stored[..stored.len() / 2])
        .expect("truncate");
    let (mut c, sink) = fleet_node(3, bucket());
    let o = run(&mut c, req("acme", victim.clone(), Some(scope("acme"))));
    assert_eq!(o.tokens, first.tokens, "recomputed, token for token");
    assert_eq!(o.cached_tokens, 0);
    assert_eq!(violations(&sink, o.id), ["offload_mac"]);
    assert!(restores_of(&sink, o.id).is_empty());
    assert_eq!(
        bucket().get(&key).expect("get"),
        None,
        "the refused object is deleted"
    );
}

/// A serving node (`custody serve`'s code, in this process) whose pool of `kv_budget_mib` holds
/// `context` tokens and whose prefix cache offloads to `section`'s tiers.
fn offload_server(
    name: &str,
    section: KvOffloadSection,
    object: Option<Arc<dyn PageStore>>,
    kv_budget_mib: usize,
    context: usize,
    token_only: bool,
) -> TestServer {
    let engine = engine_with(EngineConfig {
        kv_budget_mib,
        context_length: Some(context),
        prefix_cache: Some(true),
        ..small_cfg()
    });
    TestServer::start_opts(
        name,
        cache_cfg(),
        None,
        engine,
        tokenizer(),
        CacheOpts {
            prefix_cache: public_scope(None),
            unsafe_shared: false,
            kv_offload: Some(OffloadSetup {
                section,
                object,
                node: 3,
                token_only,
            }),
        },
    )
}

fn disk_section(dir: &Path) -> KvOffloadSection {
    KvOffloadSection {
        disk_dir: Some(dir.to_path_buf()),
        disk_mib: 256,
        ..KvOffloadSection::default()
    }
}

/// The incident's class for external KV tiers (sglang #37160, LMCache #4825):
/// `[unsafe_reproduction] token_only_offload` keys the disk tier on tokens alone, so bravo's
/// prompt that starts like acme's is served acme's offloaded pages. The forensics name every
/// such restore as an exposure, exactly: per bravo request, the slots of acme's pages it
/// attended — computed here from the prompts alone.
#[test]
fn token_only_offload_leaks_and_the_forensics_name_every_cross_tenant_restore() {
    let dir = temp_dir("leak");
    let tok = tokenizer();
    let srv = offload_server("offload-unsafe", disk_section(&dir), None, 8, 256, true);
    let victim: Vec<Vec<u32>> = (0..3)
        .map(|k| tok.encode(&text(1030 + k, 90), false).expect("tokenize"))
        .collect();
    for v in &victim {
        complete(&srv, KEY, serde_json::json!(v), None);
    }
    // acme's other prompts push the victim's pages out of the pool, onto disk.
    for f in 0..4 {
        let p = tok.encode(&text(1060 + f, 90), false).expect("tokenize");
        complete(&srv, KEY, serde_json::json!(p), None);
    }
    let expected = attack_with_cuts_of(&srv, &victim, 1050);
    let audit = srv.stop();
    let cache = exposure_names_exactly(&audit, &expected);
    assert!(
        cache
            .iter()
            .any(|(r, w, _, x)| r == "bravo" && w == "acme" && *x),
        "{cache:?}"
    );
    std::fs::remove_dir_all(&dir).expect("clean");
}

/// The timing audit (Gu et al., ICML 2025) with the victim's pages in an offload tier: acme
/// sends prompts, and its later traffic pushes their pages out of the pool (11 pages) into the
/// tier; bravo then times those prompts against fresh ones of the same length, interleaved; a
/// two-sample KS test finds no difference. The same audit by acme (whose pages *are* restored
/// from the tier) finds one at once — proof the test can fail.
#[test]
fn timing_audit_across_tiers_finds_no_cross_tenant_signal_and_finds_the_same_tenant_one() {
    const N_PER_GROUP: usize = 15;
    const PROMPT_TOKENS: usize = 64;
    let tok = tokenizer();
    let prompt = |seed: usize| {
        let mut t = tok.encode(&text(seed, 100), false).expect("tokenize");
        assert!(t.len() >= PROMPT_TOKENS);
        t.truncate(PROMPT_TOKENS);
        serde_json::json!(t)
    };
    let dir = temp_dir("timing");
    let host = KvOffloadSection {
        host_mib: 256,
        ..KvOffloadSection::default()
    };
    // The object tier alone (no host tier in front of it): a bucket on the local S3 server.
    let moto = crate::s3::Moto::start();
    let object = KvOffloadSection {
        host_mib: 0,
        object_url: Some(format!("s3://{}/timing", crate::s3::BUCKET)),
        object_mib: 256,
        ..KvOffloadSection::default()
    };
    let store = bucket(&moto, "timing") as Arc<dyn PageStore>;
    for (tier, section, object) in [
        ("host", host, None),
        ("disk", disk_section(&dir), None),
        ("object", object, Some(store)),
    ] {
        let name = format!("offload-timing-{tier}");
        let srv = offload_server(&name, section, object, 4, 128, false);
        let timed = |key: &str, p: serde_json::Value| {
            let t0 = Instant::now();
            let (_, cached) = complete(&srv, key, p, None);
            (t0.elapsed().as_secs_f64() * 1e3, cached)
        };
        for s in 0..3 {
            timed(KEY_BRAVO, prompt(19_000 + s));
        }
        let audit = |prober: &str, key: &str, seed0: usize| {
            // The victim's requests: N prompts of 4 pages each, far more than the pool holds.
            for i in 0..N_PER_GROUP {
                complete(&srv, KEY, prompt(seed0 + 2 * i), None);
            }
            let (mut primed, mut fresh, mut hits) = (Vec::new(), Vec::new(), 0);
            for i in 0..N_PER_GROUP {
                let (p, f) = (prompt(seed0 + 2 * i), prompt(seed0 + 2 * i + 1));
                // Alternate which goes first, so drift in the machine's load hits both alike.
                let order = if i % 2 == 0 {
                    [(true, p), (false, f)]
                } else {
                    [(false, f), (true, p)]
                };
                for (is_primed, q) in order {
                    let (ms, cached) = timed(key, q);
                    hits += usize::from(cached > 0);
                    if is_primed {
                        primed.push(ms)
                    } else {
                        fresh.push(ms)
                    }
                }
            }
            let (d, p) = ks_two_sample(&primed, &fresh);
            let med = |v: &[f64]| {
                let mut v = v.to_vec();
                v.sort_by(f64::total_cmp);
                v[v.len() / 2]
            };
            eprintln!(
                "offload timing audit, {tier} tier, prober {prober}: n = {N_PER_GROUP} + {N_PER_GROUP}, median primed {:.1} ms, fresh {:.1} ms, KS D = {d:.3}, p = {p:.3e}, hits {hits}",
                med(&primed),
                med(&fresh)
            );
            (p, hits)
        };
        let (p_other, hits_other) = audit("bravo", KEY_BRAVO, 30_000);
        let (p_same, hits_same) = audit("acme", KEY, 40_000);
        // The operator sees the tier at work: its pages, its restores, no refusal.
        let restores = srv.metric("custody_kv_offload_restored_total");
        assert!(
            restores >= N_PER_GROUP as f64,
            "{tier}: {restores} restores"
        );
        assert_eq!(srv.metric("custody_kv_offload_refused_total"), 0.0);
        assert!(srv.metric(&format!("custody_kv_offload_pages{{tier=\"{tier}\"}}")) > 0.0);
        let sealed = srv.stop();
        // The same tenant's hits came from the tier (the pool had let them go; the last two
        // primed prompts may still have been in the pool when the audit began).
        let restored = restored_per_tier(&sealed);
        let pages = ((PROMPT_TOKENS - 1) / PAGE) as u64;
        assert!(
            restored.get(tier).copied().unwrap_or(0) >= (N_PER_GROUP as u64 - 2) * pages,
            "{tier}: {restored:?}"
        );
        assert_eq!(hits_other, 0, "{tier}: no cross-tenant hit");
        assert_eq!(hits_same, N_PER_GROUP, "{tier}: every primed prompt hit");
        assert!(
            p_same < 1e-6,
            "{tier}: the audit sees a hit (p = {p_same:.3e})"
        );
        assert!(
            p_other > 1e-3,
            "{tier}: a cross-tenant timing signal (p = {p_other:.3e})"
        );
    }
    std::fs::remove_dir_all(&dir).expect("clean");
}

/// `kv_offload` restore rows per tier in a sealed root.
fn restored_per_tier(audit: &Path) -> BTreeMap<String, u64> {
    let mut out = BTreeMap::new();
    for b in crate::audit::read_table(audit, "kv_offload") {
        let (ev, tier) = (
            crate::audit::col_str(&b, "event"),
            crate::audit::col_str(&b, "tier"),
        );
        for i in 0..ev.len() {
            if ev[i].as_deref() == Some("restore") {
                *out.entry(tier[i].clone().unwrap_or_default()).or_default() += 1;
            }
        }
    }
    out
}

/// A disaggregated pair (in this process, real gRPC and KV transport) whose prefill node caches
/// prefixes under the fleet's namespace secret (`secret_file`) and offloads to `section`'s tiers
/// (plus `object`), as `custody prefill` sets it up (`OffloadSetup::enable`). Its prefill log.
fn offload_pair(
    node: u32,
    secret_file: &Path,
    section: KvOffloadSection,
    object: Option<Arc<dyn PageStore>>,
) -> (custody_runtime::disagg::client::Pair, MemorySink) {
    use crate::disagg::{cfg, fingerprint, model};
    use custody_runtime::config::PrefixCacheSection;
    use custody_runtime::prefix_cache::Namespaces;
    let sink = MemorySink::default();
    let mut pe = Engine::new(
        model(),
        EngineConfig {
            prefix_cache: Some(true),
            ..cfg(256, 16)
        },
    )
    .expect("prefill engine")
    .with_audit(Arc::new(sink.clone()));
    let ns = Namespaces::from_section(
        &PrefixCacheSection {
            secret_file: Some(secret_file.to_path_buf()),
            public: Vec::new(),
        },
        &tokenizer(),
        false,
    )
    .expect("namespaces");
    OffloadSetup {
        section,
        object,
        node,
        token_only: false,
    }
    .enable(&mut pe, &ns)
    .expect("offload on");
    let de = Engine::new(model(), cfg(256, 16)).expect("decode engine");
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
    (pair, sink)
}

fn pair_req(tenant: &str, prompt: &[u32]) -> GenerateRequest {
    GenerateRequest {
        decoding: Default::default(),
        prompt: prompt.to_vec(),
        max_tokens: 4,
        sampling: SamplingParams::default(),
        stop_ids: vec![],
        tenant: tenant.into(),
        cache: None,
    }
}

/// Other prompts through `pair` until earlier pages left its prefill pool (~45 pages).
fn push_out_pair(pair: &custody_runtime::disagg::client::Pair, seed: usize) {
    let tok = tokenizer();
    for i in 0..9 {
        let p = tok.encode(&text(seed + i, 90), false).expect("tokenize");
        pair.generate(&pair_req("zulu", &p)).expect("filler");
    }
}

fn secret_file(name: &str) -> PathBuf {
    let p = std::env::temp_dir().join(format!(
        "custody-offload-{name}-{}.secret",
        std::process::id()
    ));
    std::fs::write(&p, "5c".repeat(32)).expect("secret");
    p
}

/// A prefill node restarted over its disk tier serves the conversation it cached before, through
/// the pair, token for token; other tenants still miss.
#[test]
fn a_restarted_prefill_node_serves_hits_from_its_disk_tier() {
    let dir = temp_dir("pair-restart");
    let secret = secret_file("pair-restart");
    let tok = tokenizer();
    let p = tok.encode(&text(1200, 90), false).expect("tokenize");
    let (pair, _) = offload_pair(1, &secret, disk_section(&dir), None);
    let first = pair.generate(&pair_req("acme", &p)).expect("first");
    push_out_pair(&pair, 1210);
    drop(pair);
    // The node again, a new process's engine over the same directory and secret.
    let (pair, sink) = offload_pair(1, &secret, disk_section(&dir), None);
    let again = pair.generate(&pair_req("acme", &p)).expect("again");
    assert_eq!(again.tokens, first.tokens, "token for token");
    assert_eq!(again.cached_tokens as usize, (p.len() - 1) / PAGE * PAGE);
    let r = restores_of(&sink, again.request);
    assert_eq!(r.len(), (p.len() - 1) / PAGE);
    assert!(r.iter().all(|r| r.tier == "disk"));
    let other = pair.generate(&pair_req("bravo", &p)).expect("other");
    assert_eq!(other.cached_tokens, 0);
    assert!(restores_of(&sink, other.request).is_empty());
    drop(pair);
    std::fs::remove_dir_all(&dir).expect("clean");
    std::fs::remove_file(&secret).expect("clean");
}

/// Two prefill nodes (two pairs) share one bucket: acme's conversation cached on node 1 is a hit
/// on node 2, token for token; bravo's identical prompt on node 2 is not.
#[test]
fn two_prefill_nodes_of_a_fleet_share_the_object_tier_through_their_pairs() {
    let moto = crate::s3::Moto::start();
    let secret = secret_file("pair-bucket");
    let tok = tokenizer();
    let p = tok.encode(&text(1300, 90), false).expect("tokenize");
    let section = KvOffloadSection {
        host_mib: 1,
        object_url: Some(format!("s3://{}/pairs", crate::s3::BUCKET)),
        ..KvOffloadSection::default()
    };
    let store = || Some(bucket(&moto, "pairs") as Arc<dyn PageStore>);
    let (one, _) = offload_pair(1, &secret, section.clone(), store());
    let first = one.generate(&pair_req("acme", &p)).expect("first");
    push_out_pair(&one, 1310);
    let (two, sink) = offload_pair(2, &secret, section, store());
    let hit = two.generate(&pair_req("acme", &p)).expect("hit");
    assert_eq!(hit.tokens, first.tokens, "token for token");
    assert_eq!(hit.cached_tokens as usize, (p.len() - 1) / PAGE * PAGE);
    let r = restores_of(&sink, hit.request);
    assert!(!r.is_empty());
    assert!(
        r.iter()
            .all(|r| r.writer_node == Some(1) && r.tier == "object")
    );
    let other = two.generate(&pair_req("bravo", &p)).expect("other");
    assert_eq!(other.cached_tokens, 0);
    assert!(restores_of(&sink, other.request).is_empty());
    assert!(violations(&sink, other.request).is_empty());
    drop((one, two));
    std::fs::remove_file(&secret).expect("clean");
}

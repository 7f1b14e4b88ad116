//! Forensics at scale, in miniature: the synthetic log (`custody audit synth`) answers the
//! exposure question with exactly its injected ground truth, and the exposure SQL (which prunes
//! reads that provably attended only their own writes) equals the definition evaluated directly on
//! adversarial logs that break every engine invariant the pruning could lean on.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;

use custody_audit::synth::{self, SynthConfig};
use custody_audit::writer::{AuditWriter, WriterConfig};
use custody_audit::{AuditSink, Event, PageKind, Writer};
use custody_query::forensics::Exposure;
use ed25519_dalek::SigningKey;

use crate::audit::tmp_dir;

/// The exposure answer over the verified files of `root`.
fn exposure_of(root: &Path, key: &SigningKey) -> Exposure {
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .expect("rt");
    rt.block_on(async {
        let vs = custody_query::session_over_verified(root, Some(&key.verifying_key()))
            .await
            .expect("session");
        assert!(vs.report.problems.is_empty(), "{:?}", vs.report.problems);
        assert!(vs.report.live_segments.is_empty(), "everything is sealed");
        custody_query::prepare_forensics(&vs.ctx)
            .await
            .expect("prepare");
        custody_query::forensics::exposure(&vs.ctx, None, None)
            .await
            .expect("exposure")
    })
}

/// (node, request, recipient, per-source slots, foreign slots, unchecked) per affected response.
type Answer = Vec<(u32, u64, String, Vec<(String, u64)>, u64, bool)>;

fn answer(e: &Exposure) -> Answer {
    e.affected
        .iter()
        .map(|a| {
            (
                a.node,
                a.request,
                a.recipient_tenant.clone(),
                a.sources.clone(),
                a.foreign_slots,
                a.unchecked,
            )
        })
        .collect()
}

fn small_synth(events: u64, seed: u64) -> SynthConfig {
    let mut cfg = SynthConfig::new(events, seed);
    cfg.nodes = 2;
    cfg.tenants = 20;
    cfg.exposures = 4;
    cfg.pool_pages = 1024;
    cfg.max_batch = 8;
    cfg.prompt_tokens = (64, 2048);
    cfg.max_tokens = vec![64, 128, 256];
    cfg.prefill_chunk = 512;
    cfg
}

#[test]
fn synthetic_log_exposure_equals_the_injected_truth() {
    let root = tmp_dir("synth-truth");
    let key = custody_audit::digest::generate_key().expect("key");
    let cfg = small_synth(200_000, 7);
    let truth = synth::generate(&cfg, &root, &key, &AtomicU64::new(0)).expect("generate");
    assert!(truth.events >= 200_000, "{truth:?}");
    assert_eq!(truth.exposures.len(), 4, "{truth:?}");
    // A realistic log: pages reused across many generations, long prompts, several sources.
    assert!(
        truth.page_allocs > 20 * u64::from(cfg.pool_pages),
        "pages are reused: {} allocs of {} pages per node",
        truth.page_allocs,
        cfg.pool_pages
    );
    assert!(truth.exposures.iter().any(|x| x.sources.len() > 1));

    let got = exposure_of(&root, &key);
    let want = truth_answer(&truth);
    assert_eq!(answer(&got), want, "exactly the injected exposures");
    assert_eq!(got.prevented, 0);

    // Deterministic: the same seed gives the same log (ground truth and all counts).
    let again_root = tmp_dir("synth-truth-again");
    let again = synth::generate(&cfg, &again_root, &key, &AtomicU64::new(0)).expect("again");
    assert_eq!(again, truth);
    let _ = std::fs::remove_dir_all(&root);
    let _ = std::fs::remove_dir_all(&again_root);
}

/// With the prefix cache: requests that start from their own tenant's or a public scope's
/// cached prefix attend pages other requests wrote; neither is an exposure, and the answer is
/// still exactly the injected truth (computed by the generator, not by SQL).
#[test]
fn synthetic_log_with_prefix_cache_hits_equals_the_injected_truth() {
    let root = tmp_dir("synth-cache");
    let key = custody_audit::digest::generate_key().expect("key");
    let mut cfg = small_synth(200_000, 13);
    cfg.cache_hit_rate = 0.4;
    cfg.public_share = 0.3;
    let truth = synth::generate(&cfg, &root, &key, &AtomicU64::new(0)).expect("generate");
    assert!(truth.cache_hits > 1000, "{truth:?}");
    assert!(truth.cache_public_cross_tenant_hits > 100, "{truth:?}");
    assert_eq!(truth.exposures.len(), 4, "{truth:?}");
    let got = exposure_of(&root, &key);
    let want = truth_answer(&truth);
    assert_eq!(
        answer(&got),
        want,
        "hits are not exposures; the injected ones are found"
    );
    let _ = std::fs::remove_dir_all(&root);
}

/// The generator's ground truth as an [`Answer`] (its exposures' reads are all unchecked).
fn truth_answer(truth: &synth::SynthTruth) -> Answer {
    truth
        .exposures
        .iter()
        .map(|x| {
            (
                x.node,
                x.request,
                x.recipient_tenant.clone(),
                x.sources.clone(),
                x.foreign_slots,
                true,
            )
        })
        .collect()
}

/// (node, request, tenant) → source tenant → (foreign slots, any of them unchecked).
type Oracle = BTreeMap<(u32, u64, u32), BTreeMap<u32, (u64, bool)>>;

/// SplitMix64, for the adversarial logs.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: u32) -> u32 {
        (self.next() % u64::from(n)) as u32
    }
}

/// Records one node's page writes and reads through a real writer, and evaluates the exposure
/// definition as it goes (in recording = sequence order): for each attended slot, the latest
/// earlier write's tenant. Tenants are `t0`, `t1`, …; one page generation.
struct Recorder {
    w: AuditWriter,
    node: u32,
    ts: u64,
    tenants: Vec<Arc<str>>,
    last_writer: BTreeMap<(u32, u32), u32>,
}

impl Recorder {
    fn open(root: &Path, key: &SigningKey, node: u32) -> Self {
        Self {
            w: AuditWriter::open(WriterConfig::new(root, node, key.clone())).expect("writer"),
            node,
            ts: 0,
            tenants: (0..3).map(|i| Arc::from(format!("t{i}"))).collect(),
            last_writer: BTreeMap::new(),
        }
    }

    /// Request `req` writes slots `[a, b)` of `page`, recorded under tenant `wt`.
    fn write(&mut self, req: u64, wt: u32, page: u32, (a, b): (u32, u32)) {
        self.ts += 1;
        self.w
            .record(Event::Page {
                ts_ns: self.ts,
                request: req,
                tenant: self.tenants[wt as usize].clone(),
                page,
                generation: 1,
                kind: PageKind::Write {
                    slot_start: a,
                    slot_end: b,
                    writer: Writer::Local,
                },
            })
            .expect("record");
        for s in a..b {
            self.last_writer.insert((page, s), wt);
        }
    }

    /// Request `req` of tenant `tenant` attends slots `[a, b)` of `page`.
    fn read(
        &mut self,
        oracle: &mut Oracle,
        (req, tenant): (u64, u32),
        page: u32,
        (a, b): (u32, u32),
        verified: bool,
    ) {
        self.ts += 1;
        self.w
            .record(Event::Read {
                ts_ns: self.ts,
                request: req,
                tenant: self.tenants[tenant as usize].clone(),
                page,
                generation: 1,
                slot_start: a,
                slot_end: b,
                first_step: 1,
                last_step: 2,
                verified,
            })
            .expect("record");
        for s in a..b {
            if let Some(&src) = self.last_writer.get(&(page, s))
                && src != tenant
            {
                let e = oracle
                    .entry((self.node, req, tenant))
                    .or_default()
                    .entry(src)
                    .or_default();
                e.0 += 1;
                e.1 |= !verified;
            }
        }
    }

    fn close(self) {
        self.w.close().expect("seal");
    }
}

fn oracle_answer(oracle: Oracle) -> Answer {
    oracle
        .into_iter()
        .map(|((node, req, tenant), sources)| {
            let unchecked = sources.values().any(|v| v.1);
            let total = sources.values().map(|v| v.0).sum();
            let sources = sources
                .into_iter()
                .map(|(t, v)| (format!("t{t}"), v.0))
                .collect();
            (node, req, format!("t{tenant}"), sources, total, unchecked)
        })
        .collect()
}

/// A log that follows the engine's pattern most of the time (a request fills its own page in
/// order and reads what it wrote) and breaks it the rest: writes and reads of random ranges of
/// random pages at random times, requests sharing tenants, writes recorded under another tenant,
/// reads before writes, writes after reads, and pages wider than the pruning's 62-slot bitmask.
/// Returns the answer by the definition, evaluated in recording (= sequence) order.
fn adversarial_log(root: &Path, key: &SigningKey, seed: u64) -> Answer {
    let mut rng = Rng(seed);
    let page_size = [8u32, 16, 70][rng.below(3) as usize];
    // From mostly noise to mostly the engine's pattern (where reads are cleared in bulk), and from
    // requests sharing pages to a page each.
    let structured_per_10 = [5, 8, 10][(seed % 3) as usize];
    let pages = [4u32, 8][(seed / 3 % 2) as usize];
    // Requests all active at once (long, interleaved lifetimes), or coming and going.
    let sliced = seed / 6 % 2 == 1;
    let mut oracle: Oracle = BTreeMap::new();
    for node in 1..=2u32 {
        let mut rec = Recorder::open(root, key, node);
        // Sliced: at any time two requests are active, each for about 60 events, and a page
        // passes from request to request (with what the previous holders left in it).
        let requests = 11u64;
        let req_tenant: Vec<u32> = (0..requests).map(|_| rng.below(3)).collect();
        let home: Vec<u32> = (0..requests).map(|i| (i as u32) % pages).collect();
        let mut filled = vec![0u32; requests as usize];
        for ts in 0..300u64 {
            let req = if sliced {
                ((ts / 30) as u32 + rng.below(2)).min(requests as u32 - 1)
            } else {
                rng.below(requests as u32)
            } as usize;
            let tenant = req_tenant[req];
            let structured = rng.below(10) < structured_per_10;
            let (page, a, b, write) = if structured {
                if rng.below(3) > 0 && filled[req] < page_size {
                    let n = 1 + rng.below(page_size - filled[req]).min(3);
                    let a = filled[req];
                    filled[req] += n;
                    (home[req], a, a + n, true)
                } else {
                    // Now and then beyond what it wrote (the incident's read of stale slots).
                    let end = (filled[req] + rng.below(3)).clamp(1, page_size);
                    (home[req], 0, end, false)
                }
            } else {
                let a = rng.below(page_size);
                let b = a + 1 + rng.below(page_size - a);
                (rng.below(pages), a, b, rng.below(2) == 0)
            };
            if write {
                // Now and then recorded under another tenant than the request's.
                let wt = if rng.below(20) == 0 {
                    rng.below(3)
                } else {
                    tenant
                };
                rec.write(req as u64, wt, page, (a, b));
            } else {
                let verified = rng.below(2) == 0;
                rec.read(&mut oracle, (req as u64, tenant), page, (a, b), verified);
            }
        }
        rec.close();
    }
    oracle_answer(oracle)
}

/// One step of a scripted page history: request, tenant, write (or read), slots.
struct Op(u64, u32, bool, (u32, u32));

/// Page histories that each break one step the query's epochs lean on, with the definition's
/// answer: an anchor still writing when a later request reads (that read needs the epochs before
/// the anchor, even when it is of the anchor's tenant and only reads), a partial writer between
/// the anchor and the read, a slot only a long-gone request wrote, a read before any anchor.
const SCRIPTS: &[&[Op]] = &[
    // Anchor 1 still writes slots 2..4 after request 2 read them: 2..4 are request 0's.
    &[
        Op(0, 0, true, (0, 4)),
        Op(1, 1, true, (0, 2)),
        Op(2, 2, false, (0, 4)),
        Op(1, 1, true, (2, 4)),
    ],
    // The same with a reader of the anchor's own tenant (a prefix-cache hit's shape: it only
    // reads): 2..4 are still request 0's, another tenant's — not cleared as the anchor's.
    &[
        Op(0, 0, true, (0, 4)),
        Op(1, 1, true, (0, 2)),
        Op(2, 1, false, (0, 4)),
        Op(1, 1, true, (2, 4)),
    ],
    // A partial writer (1) after the anchor (0): slot 0 is 1's, 1..4 are 0's.
    &[
        Op(0, 0, true, (0, 4)),
        Op(0, 0, false, (0, 4)),
        Op(1, 1, true, (0, 1)),
        Op(2, 2, false, (0, 4)),
    ],
    // Slots 4..8 were written once, by request 0; requests 1 and 2 write only 0..4 (not
    // anchors: they do not cover 4..8); request 3 reads 0..8.
    &[
        Op(0, 0, true, (0, 8)),
        Op(1, 1, true, (0, 4)),
        Op(1, 1, false, (0, 4)),
        Op(2, 2, true, (0, 4)),
        Op(2, 2, false, (0, 4)),
        Op(3, 1, false, (0, 8)),
    ],
    // No anchor before the read (interleaved starts), then one after it.
    &[
        Op(0, 0, true, (0, 2)),
        Op(1, 1, true, (2, 4)),
        Op(0, 0, true, (4, 6)),
        Op(2, 2, false, (0, 6)),
        Op(3, 0, true, (0, 6)),
        Op(4, 1, false, (0, 6)),
    ],
];

#[test]
fn exposure_sql_equals_the_definition_on_scripted_page_histories() {
    let key = custody_audit::digest::generate_key().expect("key");
    for (i, script) in SCRIPTS.iter().enumerate() {
        let root = tmp_dir(&format!("synth-scripted-{i}"));
        let mut oracle: Oracle = BTreeMap::new();
        let mut rec = Recorder::open(&root, &key, 1);
        // The same history on two pages, the second after unrelated traffic on a third.
        for page in [0u32, 1] {
            for &Op(req, tenant, write, slots) in script.iter() {
                let req = req + u64::from(page) * 100;
                if write {
                    rec.write(req, tenant, page, slots);
                } else {
                    rec.read(&mut oracle, (req, tenant), page, slots, false);
                }
            }
            rec.write(999, 0, 2, (0, 4));
            rec.read(&mut oracle, (999, 0), 2, (0, 4), true);
        }
        rec.close();
        let want = oracle_answer(oracle);
        assert!(!want.is_empty(), "script {i} exposes data");
        assert_eq!(answer(&exposure_of(&root, &key)), want, "script {i}");
        let _ = std::fs::remove_dir_all(&root);
    }
}

/// A node's request ids restart with its process: request 5 of its first incarnation (tenant
/// t1) and request 5 of its second (tenant t2) both read tenant t0's data. They are two affected
/// responses, in one total order (node, request, recipient, source) — not one response whose
/// recipient is whichever row came first.
#[test]
fn restarted_request_ids_are_separate_responses_in_a_total_order() {
    let key = custody_audit::digest::generate_key().expect("key");
    let root = tmp_dir("synth-restart");
    let mut oracle: Oracle = BTreeMap::new();
    for (page, reader) in [(0u32, 1u32), (1, 2)] {
        // One incarnation: a writer of t0, then request 5 of `reader` attends its slots.
        let mut rec = Recorder::open(&root, &key, 1);
        rec.write(4, 0, page, (0, 4));
        rec.read(&mut oracle, (5, reader), page, (0, 4), false);
        rec.close();
    }
    let want = oracle_answer(oracle);
    assert_eq!(want.len(), 2, "{want:?}");
    for _ in 0..3 {
        assert_eq!(answer(&exposure_of(&root, &key)), want);
    }
    let _ = std::fs::remove_dir_all(&*root);
}

#[test]
fn exposure_sql_equals_the_definition_on_adversarial_logs() {
    let key = custody_audit::digest::generate_key().expect("key");
    let mut exposed = 0;
    for seed in 0..24u64 {
        let root = tmp_dir(&format!("synth-adversarial-{seed}"));
        let want = adversarial_log(&root, &key, seed);
        let got = exposure_of(&root, &key);
        assert_eq!(answer(&got), want, "seed {seed}");
        exposed += want.len();
        let _ = std::fs::remove_dir_all(&root);
    }
    assert!(
        exposed > 24,
        "the logs do expose data ({exposed} responses)"
    );
}

/// What `--show-sql` prints is a script that runs as printed (settings, comments, several
/// statements): the exposure script returns exactly the exposure query's rows, then the
/// prevented count; a `;` inside a comment or a string does not split a statement.
#[test]
fn show_sql_scripts_run_as_printed() {
    let key = custody_audit::digest::generate_key().expect("key");
    let root = tmp_dir("synth-show-sql");
    let want = adversarial_log(&root, &key, 3);
    assert!(!want.is_empty(), "seed 3 exposes data");
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .expect("rt");
    rt.block_on(async {
        let vs = forensic_session(&root, &key).await;
        let (_, rows) = custody_query::forensics::exposure_with_rows(&vs.ctx, None, None)
            .await
            .expect("exposure");
        let script = custody_query::forensics::exposure_script(None, None);
        let results = custody_query::run_script(&vs.ctx, &script)
            .await
            .expect("the printed script runs");
        assert_eq!(results.len(), 2, "affected rows, then prevented exposures");
        let pretty = |b: &[datafusion_batches::RecordBatch]| {
            datafusion_batches::pretty_format_batches(b)
                .expect("format")
                .to_string()
        };
        assert_eq!(pretty(&results[0]), pretty(&rows));
        let odd = "-- a comment; with a semicolon\nSELECT 'a;b' AS x;\nSELECT 2 AS y";
        let results = custody_query::run_script(&vs.ctx, odd).await.expect("odd");
        assert_eq!(results.len(), 2);
        assert!(pretty(&results[0]).contains("a;b"));
        assert!(matches!(
            custody_query::run_script(&vs.ctx, "-- nothing\n").await,
            Err(custody_query::QueryError::NoStatement)
        ));
    });
    let _ = std::fs::remove_dir_all(&root);
}

mod datafusion_batches {
    pub use custody_query::datafusion::arrow::record_batch::RecordBatch;
    pub use custody_query::datafusion::arrow::util::pretty::pretty_format_batches;
}

/// With faulty requests at a realistic rate (1 %), the exposure query still equals the truth,
/// and its clearing stays local in time: only reads near a fault are suspect (expanded to slots
/// and joined with earlier writes), not every read of every page a fault ever touched.
#[test]
fn faults_at_a_rate_make_only_nearby_reads_suspect() {
    let root = tmp_dir("synth-fault-rate");
    let key = custody_audit::digest::generate_key().expect("key");
    let mut cfg = small_synth(200_000, 11);
    cfg.exposures = 0;
    cfg.fault_rate = 0.01;
    // A small, busy pool: each page's history is long, so a page-wide rule would make many
    // reads suspect for every stray write.
    cfg.pool_pages = 48;
    cfg.max_batch = 2;
    cfg.prompt_tokens = (64, 256);
    cfg.max_tokens = vec![32, 64];
    let truth = synth::generate(&cfg, &root, &key, &AtomicU64::new(0)).expect("generate");
    assert!(!truth.exposures.is_empty(), "{truth:?}");
    let got = exposure_of(&root, &key);
    let want = truth_answer(&truth);
    assert_eq!(
        answer(&got),
        want,
        "exactly the faulty requests that read foreign data"
    );
    // The query's own suspect set: the reads its preparation keeps.
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .expect("rt");
    let (suspect, reads) = rt.block_on(async {
        let vs = forensic_session(&root, &key).await;
        custody_query::forensics::prepare_exposure(&vs.ctx, None, None)
            .await
            .expect("prepare");
        let one = |sql: &'static str| {
            let ctx = vs.ctx.clone();
            async move {
                let b = custody_query::run_script(&ctx, sql)
                    .await
                    .expect("sql")
                    .pop()
                    .expect("rows");
                let c = b[0].column(0);
                custody_query::datafusion::arrow::compute::cast(
                    c,
                    &custody_query::datafusion::arrow::datatypes::DataType::Int64,
                )
                .expect("cast")
                .as_any()
                .downcast_ref::<custody_query::datafusion::arrow::array::Int64Array>()
                .expect("i64")
                .value(0)
            }
        };
        (
            one("SELECT COUNT(*) FROM exposure_candidates WHERE is_read = 1").await,
            one("SELECT COUNT(*) FROM all_page_reads").await,
        )
    });
    // Measured here (200 k events, 30 641 read rows): 167 suspect, the faulty requests' own
    // reads and those of the requests their stray writes met; with the clearing decided over a
    // page's whole history, 977 (and the query 3x slower).
    assert!(
        suspect * 100 < reads,
        "{suspect} of {reads} reads suspect with 1 % faulty requests: the clearing is not local"
    );
    let _ = std::fs::remove_dir_all(&root);
}

/// A verified session over `root` with the forensic views.
async fn forensic_session(root: &Path, key: &SigningKey) -> custody_query::VerifiedSession {
    let vs = custody_query::session_over_verified(root, Some(&key.verifying_key()))
        .await
        .expect("session");
    custody_query::prepare_forensics(&vs.ctx)
        .await
        .expect("prepare");
    vs
}

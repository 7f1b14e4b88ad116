//! Disaggregated prefill/decode: an in-process pair (both roles in one process, real gRPC and the
//! real tcp KV transport over loopback) against the colocated engine, the incident reproduction,
//! and fault injection.

use custody_runtime::transport::TransportKind;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use custody_audit::{Event as AEv, MemorySink, PageKind, Writer};
use custody_runtime::config::UnsafeReproduction;
use custody_runtime::disagg::client::{Pair, PairOptions};
use custody_runtime::engine::GenerateRequest;
use custody_runtime::{Engine, EngineConfig, Model, SamplingParams};

use crate::reference::greedy;
use crate::tokenizer;

pub fn model() -> Model {
    Model::load(&custody_tests::model_path()).expect("load model")
}

pub fn fingerprint() -> String {
    static FP: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    FP.get_or_init(|| model().gguf().sha256_hex()).clone()
}

pub fn cfg(context: usize, budget_mib: usize) -> EngineConfig {
    EngineConfig {
        context_length: Some(context),
        kv_budget_mib: budget_mib,
        ..EngineConfig::default()
    }
}

/// The test suite's fleet: one CA, real certificates for every in-process pair and front.
pub fn fleet() -> Arc<custody_runtime::disagg::tls::Fleet> {
    static FLEET: std::sync::OnceLock<Arc<custody_runtime::disagg::tls::Fleet>> =
        std::sync::OnceLock::new();
    FLEET
        .get_or_init(|| {
            Arc::new(custody_runtime::disagg::tls::Fleet::new("custody test fleet", 2).expect("CA"))
        })
        .clone()
}

/// A control-plane client of a pair's decode node, as its prefill node (1) would be.
pub async fn decode_client(
    addr: std::net::SocketAddr,
) -> custody_runtime::disagg::proto::decode_client::DecodeClient<
    custody_runtime::disagg::tonic::transport::Channel,
> {
    use custody_runtime::disagg::tls::{NodeIdentity, Role, Security};
    let tls = fleet()
        .node_tls(
            NodeIdentity::new(Role::Prefill, 1),
            vec![NodeIdentity::new(Role::Decode, 2)],
        )
        .expect("prefill certificate");
    let channel = Security::Tls(tls)
        .channel(&format!("http://{addr}"), Role::Decode)
        .await
        .expect("connect decode");
    custody_runtime::disagg::proto::decode_client::DecodeClient::new(channel)
}

pub struct Nodes {
    pub pair: Pair,
    pub prefill_audit: MemorySink,
    pub decode_audit: MemorySink,
}

/// Records into a memory sink and (optionally) a real audit writer.
#[derive(Debug)]
pub struct Tee(
    pub MemorySink,
    pub Option<Arc<dyn custody_audit::AuditSink>>,
);

impl custody_audit::AuditSink for Tee {
    fn record(&self, e: AEv) -> Result<(), custody_audit::SinkError> {
        if let Some(w) = &self.1 {
            w.record(e.clone())?;
        }
        self.0.record(e)
    }
}

pub fn start_pair(
    prefill: EngineConfig,
    decode: EngineConfig,
    unsafe_: UnsafeReproduction,
    lease: Duration,
) -> Nodes {
    start_pair_with(prefill, decode, unsafe_, lease, None)
}

/// A pair whose nodes compile constraints over the embedded model's vocabulary, so that
/// decoding options (constraints, biases, penalties, log-probabilities) travel with requests.
pub fn start_pair_decoding(prefill: EngineConfig, decode: EngineConfig) -> Nodes {
    let (pa, da) = (MemorySink::default(), MemorySink::default());
    let pe = Engine::new(model(), prefill)
        .expect("prefill engine")
        .with_audit(Arc::new(Tee(pa.clone(), None)));
    let de = Engine::new(model(), decode)
        .expect("decode engine")
        .with_audit(Arc::new(Tee(da.clone(), None)));
    let grammars = Arc::new(
        custody_runtime::grammar::Grammars::for_tokenizer(Arc::new(crate::tokenizer()))
            .expect("grammars"),
    );
    let mut opts =
        PairOptions::loopback(&fingerprint(), UnsafeReproduction::default(), Some(fleet()));
    opts.prefill.transport_kind = transport_under_test();
    opts.decode.transport_kind = transport_under_test();
    opts.prefill.grammars = Some(grammars.clone());
    opts.decode.grammars = Some(grammars);
    Nodes {
        pair: Pair::start(pe, de, opts).expect("pair starts"),
        prefill_audit: pa,
        decode_audit: da,
    }
}

pub type Writers = (
    Arc<dyn custody_audit::AuditSink>,
    Arc<dyn custody_audit::AuditSink>,
);

/// The KV transport the pair tests run over: `tcp` unless `CUSTODY_TEST_TRANSPORT` says
/// `verbs` (or `verbs:<device>`) — the same protocol tests then run over RDMA, on a machine with
/// a device and a build with `--features rdma`:
/// `CUSTODY_TEST_TRANSPORT=verbs cargo test -p custody-tests --features rdma --test e2e disagg`.
/// The fault-injection test needs the software transport's injected faults and stays on tcp.
pub fn transport_under_test() -> TransportKind {
    match std::env::var("CUSTODY_TEST_TRANSPORT").as_deref() {
        Ok("verbs") => TransportKind::Verbs { device: None },
        Ok(v) if v.starts_with("verbs:") => TransportKind::Verbs {
            device: Some(v["verbs:".len()..].to_owned()),
        },
        Ok("tcp") | Err(_) => TransportKind::Tcp,
        Ok(other) => panic!("CUSTODY_TEST_TRANSPORT={other:?}: want tcp, verbs or verbs:<device>"),
    }
}

pub fn start_pair_with(
    prefill: EngineConfig,
    decode: EngineConfig,
    unsafe_: UnsafeReproduction,
    lease: Duration,
    writers: Option<Writers>,
) -> Nodes {
    start_pair_exchanging(prefill, decode, unsafe_, lease, writers, None)
}

/// Each node's side of the peer checkpoint exchange: (prefill's, decode's).
pub type PeerSides = (
    custody_runtime::disagg::checkpoints::PeerCheckpoints,
    custody_runtime::disagg::checkpoints::PeerCheckpoints,
);

/// [`start_pair_with`], the nodes exchanging checkpoints when `peer` is given.
pub fn start_pair_exchanging(
    prefill: EngineConfig,
    decode: EngineConfig,
    unsafe_: UnsafeReproduction,
    lease: Duration,
    writers: Option<Writers>,
    peer: Option<PeerSides>,
) -> Nodes {
    start_pair_full(prefill, decode, unsafe_, lease, writers, peer, false)
}

/// A pair with TLS on its KV transport (`[disagg] transport_encryption = true`).
pub fn start_pair_encrypted(prefill: EngineConfig, decode: EngineConfig) -> Nodes {
    start_pair_full(
        prefill,
        decode,
        UnsafeReproduction::default(),
        Duration::from_secs(30),
        None,
        None,
        true,
    )
}

fn start_pair_full(
    prefill: EngineConfig,
    decode: EngineConfig,
    unsafe_: UnsafeReproduction,
    lease: Duration,
    writers: Option<Writers>,
    peer: Option<PeerSides>,
    transport_encryption: bool,
) -> Nodes {
    let (prefill_peer, decode_peer) = match peer {
        Some((p, d)) => (Some(p), Some(d)),
        None => (None, None),
    };
    let (pa, da) = (MemorySink::default(), MemorySink::default());
    let (pw, dw) = match writers {
        Some((p, d)) => (Some(p), Some(d)),
        None => (None, None),
    };
    let pe = Engine::new_with_unsafe(model(), prefill, &unsafe_)
        .expect("prefill engine")
        .with_audit(Arc::new(Tee(pa.clone(), pw)));
    let de = Engine::new_with_unsafe(model(), decode, &unsafe_)
        .expect("decode engine")
        .with_audit(Arc::new(Tee(da.clone(), dw)));
    let pair = start_engines(
        pe,
        de,
        fingerprint(),
        unsafe_,
        lease,
        (prefill_peer, decode_peer),
        transport_encryption,
    );
    Nodes {
        pair,
        prefill_audit: pa,
        decode_audit: da,
    }
}

/// A pair of the given engines (of the model whose fingerprint is `fp`).
pub fn start_engines(
    pe: Engine,
    de: Engine,
    fp: String,
    unsafe_: UnsafeReproduction,
    lease: Duration,
    peers: (
        Option<custody_runtime::disagg::checkpoints::PeerCheckpoints>,
        Option<custody_runtime::disagg::checkpoints::PeerCheckpoints>,
    ),
    transport_encryption: bool,
) -> Pair {
    start_engines_ns(
        pe,
        de,
        fp,
        unsafe_,
        lease,
        peers,
        transport_encryption,
        None,
    )
}

/// [`start_engines`], the prefill node deriving prefix-cache namespaces from `namespaces`.
#[allow(clippy::too_many_arguments)]
pub fn start_engines_ns(
    pe: Engine,
    de: Engine,
    fp: String,
    unsafe_: UnsafeReproduction,
    lease: Duration,
    (prefill_peer, decode_peer): (
        Option<custody_runtime::disagg::checkpoints::PeerCheckpoints>,
        Option<custody_runtime::disagg::checkpoints::PeerCheckpoints>,
    ),
    transport_encryption: bool,
    namespaces: Option<Arc<custody_runtime::prefix_cache::Namespaces>>,
) -> Pair {
    let mut opts = PairOptions::loopback(&fp, unsafe_, Some(fleet()));
    opts.prefill.transport_kind = transport_under_test();
    opts.prefill.checkpoints = prefill_peer;
    opts.prefill.namespaces = namespaces;
    opts.decode.transport_kind = transport_under_test();
    opts.decode.reservation_lease = lease;
    opts.decode.checkpoints = decode_peer;
    opts.transport_encryption = transport_encryption;
    Pair::start(pe, de, opts).expect("pair starts")
}

pub fn req(tenant: &str, prompt: Vec<u32>, max_tokens: usize) -> GenerateRequest {
    GenerateRequest {
        decoding: Default::default(),
        prompt,
        max_tokens,
        sampling: SamplingParams::default(),
        stop_ids: vec![],
        tenant: tenant.into(),
        cache: None,
    }
}

fn prompts() -> Vec<Vec<u32>> {
    let tok = tokenizer();
    [
        "The capital of France is",
        "Write a haiku about the sea and the sky, in English, with a title.",
        "1, 2, 3, 4, 5,",
        "In a distant galaxy, a small robot named Custody guarded the keys to every vault. One day,",
    ]
    .iter()
    .map(|p| tok.encode(p, true).expect("encode"))
    .collect()
}

#[test]
fn disaggregated_greedy_output_equals_colocated_token_for_token() {
    let prompts = prompts();
    let n = 12;
    let mut colo = crate::engine_with(cfg(2048, 64));
    let want: Vec<Vec<u32>> = prompts
        .iter()
        .map(|p| greedy(&mut colo, p.clone(), n))
        .collect();
    let nodes = start_pair(
        cfg(2048, 64),
        cfg(2048, 64),
        UnsafeReproduction::default(),
        Duration::from_secs(30),
    );
    // One at a time, then all concurrently.
    for (p, w) in prompts.iter().zip(&want) {
        let got = nodes
            .pair
            .generate(&req("tenant-a", p.clone(), n))
            .expect("generate");
        assert_eq!(
            &got.tokens, w,
            "disaggregated output differs for prompt {p:?}"
        );
        assert_eq!(got.finish_reason, "length");
    }
    let reqs: Vec<_> = prompts
        .iter()
        .map(|p| req("tenant-b", p.clone(), n))
        .collect();
    for (got, w) in nodes.pair.generate_many(&reqs).into_iter().zip(&want) {
        assert_eq!(
            &got.expect("generate").tokens,
            w,
            "concurrent disaggregated output differs"
        );
    }
    // Every transfer was checked and recorded on both sides.
    let d = nodes.decode_audit.events.lock().expect("lock").clone();
    let p = nodes.prefill_audit.events.lock().expect("lock").clone();
    let verified = d
        .iter()
        .filter(|e| matches!(e, AEv::Transfer { outcome, .. } if outcome == "verified"))
        .count();
    let completed = p
        .iter()
        .filter(|e| matches!(e, AEv::Transfer { outcome, .. } if outcome == "completed"))
        .count();
    let pages: usize = prompts.iter().map(|p| p.len().div_ceil(16)).sum::<usize>() * 2;
    assert_eq!((verified, completed), (pages, pages));
    assert!(d.iter().any(|e| matches!(
        e,
        AEv::Page {
            kind: PageKind::Write {
                writer: Writer::Transfer,
                ..
            },
            ..
        }
    )));
    // Nothing leaked on either node.
    let ds = nodes.pair.decode.stats_blocking().expect("stats");
    assert_eq!(
        (ds.free_pages, ds.quarantined_pages, ds.live_requests),
        (ds.pool_pages, 0, 0),
        "{ds:?}"
    );
    let ps = nodes.pair.prefill.stats_blocking().expect("stats");
    assert_eq!(
        (ps.free_pages, ps.live_requests),
        (ps.pool_pages, 0),
        "{ps:?}"
    );
}

#[test]
fn over_length_prompt_is_a_clear_client_error_with_nothing_allocated_or_transferred_on_either_node()
{
    use custody_runtime::disagg::proto::ReserveRequest;
    let nodes = start_pair(
        cfg(1024, 32),
        cfg(1024, 32),
        UnsafeReproduction::default(),
        Duration::from_secs(30),
    );
    let err = nodes
        .pair
        .generate(&req("tenant-x", vec![42; 1100], 8))
        .expect_err("over-length must be refused");
    assert_eq!(
        err.code(),
        custody_runtime::disagg::tonic::Code::InvalidArgument,
        "{err:?}"
    );
    assert!(
        err.message().contains("exceeds the context length of 1024"),
        "{}",
        err.message()
    );
    // The prefill node recorded the rejection and nothing else for it; decode never heard of it.
    let p = nodes.prefill_audit.events.lock().expect("lock").clone();
    assert!(
        matches!(
            &p[..],
            [AEv::Request {
                kind: custody_audit::RequestKind::Rejected { .. },
                prompt_tokens: 1100,
                ..
            }]
        ),
        "{p:?}"
    );
    assert!(nodes.decode_audit.events.lock().expect("lock").is_empty());
    // Decode's own admission refuses it too (defence in depth, if a buggy prefill asked).
    let addr = nodes.pair.decode_addr;
    let st = nodes
        .pair
        .block_on(async move {
            let mut c = decode_client(addr).await;
            c.reserve(ReserveRequest {
                decoding: None,
                origin_request: 99,
                origin_node: 1,
                tenant: "tenant-x".into(),
                prompt: vec![42; 1100],
                max_tokens: 8,
                sampling: None,
                stop_ids: vec![],
                route: None,
            })
            .await
        })
        .expect_err("decode refuses too");
    assert_eq!(
        st.code(),
        custody_runtime::disagg::tonic::Code::InvalidArgument
    );
    let d = nodes.decode_audit.events.lock().expect("lock").clone();
    assert!(
        matches!(
            &d[..],
            [AEv::Request {
                kind: custody_audit::RequestKind::Rejected { .. },
                ..
            }]
        ),
        "{d:?}"
    );
    assert!(
        !d.iter()
            .any(|e| matches!(e, AEv::Page { .. } | AEv::Transfer { .. }))
    );
    let ds = nodes.pair.decode.stats_blocking().expect("stats");
    assert_eq!(ds.free_pages, ds.pool_pages);
}

/// The incident's pools: context 1024 advertised, prefill pool 272 tokens, decode pool 768.
fn incident_cfgs() -> (EngineConfig, EngineConfig) {
    (cfg(1024, 6), cfg(1024, 17))
}

fn all_unsafe() -> UnsafeReproduction {
    UnsafeReproduction {
        skip_pool_check: true,
        truncate_overlength: true,
        disable_tag_check: true,
        disable_checksum: true,
        shared_prefix_cache: false,
        token_only_offload: false,
    }
}

/// Tenant A's confidential prompts (distinct content each).
fn tenant_a_prompts() -> Vec<Vec<u32>> {
    let tok = tokenizer();
    (0..3)
        .map(|k| {
            let text = format!(
                "CONFIDENTIAL memo {k} for tenant A. Account numbers: {}. The merger with company {} closes on day {}. \
                 Do not share the board's position on the {} acquisition, the salary bands {}, or the password hint {}. ",
                (0..12).map(|i| format!("{}", 100_000 + 7919 * (k * 12 + i))).collect::<Vec<_>>().join(", "),
                ["Northwind", "Globex", "Initech"][k],
                11 + k,
                ["Acme", "Umbrella", "Hooli"][k],
                (0..8).map(|i| format!("L{i}={}", 50 + 13 * (k + i))).collect::<Vec<_>>().join(" "),
                ["blue heron", "red fox", "green owl"][k],
            );
            let t = tok.encode(&text, true).expect("encode");
            assert!(t.len() > 120 && t.len() <= 240, "prompt of {} tokens", t.len());
            t
        })
        .collect()
}

/// Count slot by slot what a request read that was, per the audit log, last written for another
/// tenant: a join of its reads against the latest write of each (page, slot) before the read.
fn audit_foreign_slots(events: &[AEv], reader: u64) -> (usize, usize) {
    let mut tenant_of_req: HashMap<u64, String> = HashMap::new();
    let mut last_write: HashMap<(u32, u32), String> = HashMap::new();
    let (mut foreign, mut unchecked) = (0, 0);
    for e in events {
        match e {
            AEv::Request {
                request, tenant, ..
            } => {
                tenant_of_req.insert(*request, tenant.to_string());
            }
            AEv::Page {
                tenant,
                page,
                kind:
                    PageKind::Write {
                        slot_start,
                        slot_end,
                        ..
                    },
                ..
            } => {
                for s in *slot_start..*slot_end {
                    last_write.insert((*page, s), tenant.to_string());
                }
            }
            AEv::Read {
                request,
                tenant,
                page,
                slot_start,
                slot_end,
                verified,
                ..
            } if *request == reader => {
                if !verified {
                    unchecked += 1;
                }
                for s in *slot_start..*slot_end {
                    if last_write
                        .get(&(*page, s))
                        .is_some_and(|t| t.as_str() != &**tenant)
                    {
                        foreign += 1;
                    }
                }
            }
            _ => {}
        }
    }
    (foreign, unchecked)
}

/// The layer whose K rows the oracle compares: the last one, whose K depends on the whole prefix
/// (layer 0's depends only on token and position, so two prompts sharing a token at a position
/// would be indistinguishable there).
const ORACLE_LAYER: usize = 29;

/// K rows (all KV heads) of slots `0..n` of a block table, from raw page bytes.
fn k_rows(
    pages: &[Vec<u8>],
    n: usize,
    page_size: usize,
    heads: usize,
    head_dim: usize,
) -> Vec<Vec<u8>> {
    (0..n)
        .map(|t| {
            let (p, s) = (t / page_size, t % page_size);
            let mut row = Vec::new();
            for h in 0..heads {
                let off = ((h * page_size + s) * head_dim) * 2;
                row.extend_from_slice(&pages[p][off..off + head_dim * 2]);
            }
            row
        })
        .collect()
}

#[test]
fn incident_reproduces_with_the_unsafe_switches_and_the_audit_log_and_an_oracle_agree_on_the_leak()
{
    let (pc, dc) = incident_cfgs();
    // Protections on, the incident's pools do not even start.
    assert!(matches!(
        Engine::new(model(), dc.clone()),
        Err(custody_runtime::StartupError::PoolTooSmall { .. })
    ));
    // Both nodes also record into one real audit root (Parquet, digest-chained): the forensic
    // SQL must find the same leak from the files alone.
    let root = std::env::temp_dir().join(format!("custody-incident-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    let key = custody_audit::digest::generate_key().expect("key");
    let open = |node| {
        Arc::new(
            custody_audit::writer::AuditWriter::open(custody_audit::writer::WriterConfig::new(
                &root,
                node,
                key.clone(),
            ))
            .expect("writer"),
        )
    };
    let (pw, dw) = (open(1), open(2));
    let sinks: Writers = (pw.clone(), dw.clone());
    let nodes = start_pair_with(pc, dc, all_unsafe(), Duration::from_secs(30), Some(sinks));
    // Tenant A fills the decode pool with confidential prompts (concurrently: spread over pages).
    let a_prompts = tenant_a_prompts();
    let a_reqs: Vec<_> = a_prompts
        .iter()
        .map(|p| req("tenant-a", p.clone(), 8))
        .collect();
    let a_out: Vec<Vec<u32>> = nodes
        .pair
        .generate_many(&a_reqs)
        .into_iter()
        .map(|r| r.expect("tenant A served").tokens)
        .collect();
    // Tenant B sends an over-length prompt (400 tokens > the prefill pool's 272).
    let b_prompt: Vec<u32> = (0..400u32).map(|i| 1000 + (i * 37) % 5000).collect();
    let b = nodes
        .pair
        .generate(&req("tenant-b", b_prompt.clone(), 8))
        .expect("the legacy path serves it: a coherent-looking reply, HTTP 200 equivalent");
    assert_eq!(b.tokens.len(), 8);

    let events = nodes.decode_audit.events.lock().expect("lock").clone();
    let b_id = events
        .iter()
        .find_map(|e| match e {
            AEv::Request {
                request,
                tenant,
                kind: custody_audit::RequestKind::Admitted,
                ..
            } if &**tenant == "tenant-b" => Some(*request),
            _ => None,
        })
        .expect("B admitted on decode");
    // The audit log shows it: B's reads were unchecked and covered slots last written for A.
    let (foreign_audit, unchecked) = audit_foreign_slots(&events, b_id);
    assert!(unchecked > 0, "B's reads are recorded as unchecked");
    assert!(
        foreign_audit > 100,
        "the audit log must show B attending A's slots (got {foreign_audit})"
    );
    // Only one page (1 slot) was transferred for B.
    let b_transfers = events
        .iter()
        .filter(|e| matches!(e, AEv::Transfer { request, .. } if *request == b_id))
        .count();
    assert_eq!(b_transfers, 1);

    // The oracle: independent of the engine's record, compare the bytes B attended (raw decode
    // pool memory) with A's KV as a separate colocated engine computes it.
    let b_pages: Vec<u32> = events
        .iter()
        .filter_map(|e| match e {
            AEv::Page {
                request,
                page,
                kind: PageKind::Alloc,
                ..
            } if *request == b_id => Some(*page),
            _ => None,
        })
        .collect();
    let cfgm = model().config.clone();
    let (heads, hd, ps) = (cfgm.n_kv_heads, cfgm.head_dim, 16);
    let b_bytes = nodes
        .pair
        .decode
        .inspect_k_blocking(ORACLE_LAYER, b_pages)
        .expect("inspect");
    let b_rows = k_rows(&b_bytes, b_prompt.len(), ps, heads, hd);
    let mut dict: HashMap<Vec<u8>, usize> = HashMap::new();
    let sink = MemorySink::default();
    let mut colo = Engine::new(model(), cfg(1024, 32))
        .expect("colocated")
        .with_audit(Arc::new(sink.clone()));
    for (k, (p, out)) in a_prompts.iter().zip(&a_out).enumerate() {
        let mut toks = p.clone();
        toks.extend_from_slice(&out[..out.len() - 1]);
        sink.events.lock().expect("lock").clear();
        // Generate as the pair did (prompt as a batch, then token by token), so the KV
        // of every position has the same arithmetic as the one the pair wrote.
        colo.submit(req(
            "oracle",
            toks[..toks.len() - (out.len() - 1)].to_vec(),
            out.len(),
        ))
        .expect("oracle request");
        while colo.has_work() {
            colo.step();
        }
        let pages: Vec<u32> = sink
            .events
            .lock()
            .expect("lock")
            .iter()
            .filter_map(|e| match e {
                AEv::Page {
                    page,
                    kind: PageKind::Alloc,
                    ..
                } => Some(*page),
                _ => None,
            })
            .collect();
        let raw: Vec<Vec<u8>> = pages
            .iter()
            .map(|&pg| colo.pool().test_oracle_k_page_bytes(ORACLE_LAYER, pg))
            .collect();
        for row in k_rows(&raw, toks.len(), ps, heads, hd) {
            dict.insert(row, k);
        }
    }
    let foreign_oracle = b_rows
        .iter()
        .skip(1)
        .filter(|r| dict.contains_key(*r))
        .count();
    eprintln!(
        "incident: tenant B attended {foreign_oracle} slots of tenant A's KV (oracle), audit log says {foreign_audit}"
    );
    assert!(
        foreign_oracle > 100,
        "B must have attended A's KV (oracle found {foreign_oracle})"
    );
    assert_eq!(
        foreign_oracle, foreign_audit,
        "the audit log and the independent oracle must agree slot for slot"
    );

    // The forensic tool, over the sealed, verified Parquet files only.
    drop(nodes);
    pw.close().expect("seal prefill log");
    dw.close().expect("seal decode log");
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .expect("rt");
    let exposure = rt.block_on(async {
        let vs = custody_query::session_over_verified(&root, Some(&key.verifying_key()))
            .await
            .expect("session");
        assert!(vs.report.problems.is_empty(), "{:?}", vs.report.problems);
        custody_query::prepare_forensics(&vs.ctx)
            .await
            .expect("prepare");
        let e = custody_query::forensics::exposure(&vs.ctx, None, None)
            .await
            .expect("exposure");
        // The tenant and request questions over the same files.
        let t = custody_query::run_script(
            &vs.ctx,
            &custody_query::forensics::tenant_sql("tenant-b", None, None),
        )
        .await
        .expect("tenant sql")
        .pop()
        .expect("the tenant answer");
        assert_eq!(
            t.iter().map(|b| b.num_rows()).sum::<usize>(),
            1,
            "B received from A only"
        );
        let r = vs
            .ctx
            .sql(&custody_query::forensics::request_sql(2, b_id))
            .await
            .expect("request sql")
            .collect()
            .await
            .expect("request");
        assert!(
            r.iter().map(|b| b.num_rows()).sum::<usize>() >= 4,
            "admitted, alloc, transfer, reads, release"
        );
        // The anomalies include the incident's signature for B: its 400-token prompt arrived as
        // one transferred slot, and it read pages with no write in their generation.
        let an = vs
            .ctx
            .sql(custody_query::forensics::ANOMALIES_SQL)
            .await
            .expect("anomalies sql")
            .collect()
            .await
            .expect("anomalies");
        let text = custody_query::datafusion::arrow::util::pretty::pretty_format_batches(&an)
            .expect("format")
            .to_string();
        assert!(
            text.contains("short_transfer")
                && text.contains("prompt of 400 tokens, 1 slots transferred"),
            "{text}"
        );
        assert!(text.contains("read_without_write"), "{text}");
        assert!(!text.contains("sequence_gap"), "{text}");
        e
    });
    eprintln!("{}", exposure.summary());
    assert_eq!(exposure.affected_responses(), 1, "{exposure:?}");
    let a = &exposure.affected[0];
    assert_eq!(
        (a.node, a.request, a.recipient_tenant.as_str()),
        (2, b_id, "tenant-b")
    );
    assert_eq!(
        a.sources,
        vec![("tenant-a".to_owned(), foreign_oracle as u64)],
        "exact foreign-slot count per source tenant"
    );
    assert!(a.unchecked);
    assert_eq!(exposure.max_foreign_slots(), foreign_oracle as u64);
    let _ = std::fs::remove_dir_all(&root);
}

/// The incident's audit root, sealed, at `root` (nodes 1 and 2): tenant A's confidential
/// prompts, then tenant B's over-length prompt served by the pair with every unsafe switch on —
/// B reads A's slots unchecked. Returns the log's signing key. For the forensic tools' tests
/// (the test above checks this workload's leak against an independent oracle).
pub(crate) fn incident_audit_root(root: &std::path::Path) -> custody_audit::digest::SigningKey {
    let (pc, dc) = incident_cfgs();
    let key = custody_audit::digest::generate_key().expect("key");
    let open = |node| {
        Arc::new(
            custody_audit::writer::AuditWriter::open(custody_audit::writer::WriterConfig::new(
                root,
                node,
                key.clone(),
            ))
            .expect("writer"),
        )
    };
    let (pw, dw) = (open(1), open(2));
    let nodes = start_pair_with(
        pc,
        dc,
        all_unsafe(),
        Duration::from_secs(30),
        Some((pw.clone(), dw.clone())),
    );
    let a_reqs: Vec<_> = tenant_a_prompts()
        .into_iter()
        .map(|p| req("tenant-a", p, 8))
        .collect();
    for r in nodes.pair.generate_many(&a_reqs) {
        r.expect("tenant A served");
    }
    let b_prompt: Vec<u32> = (0..400u32).map(|i| 1000 + (i * 37) % 5000).collect();
    nodes
        .pair
        .generate(&req("tenant-b", b_prompt, 8))
        .expect("the legacy path serves B");
    drop(nodes);
    pw.close().expect("seal prefill log");
    dw.close().expect("seal decode log");
    key
}

/// Slots each decode request read that were, per the audit log, last written by another
/// request (any tenant): 0 means no stale read. Also: reads that were not tag-verified.
fn audit_stale_slots(events: &[AEv]) -> (usize, usize) {
    let mut last_write: HashMap<(u32, u32), u64> = HashMap::new();
    let (mut stale, mut unchecked) = (0, 0);
    for e in events {
        match e {
            AEv::Page {
                request,
                page,
                kind:
                    PageKind::Write {
                        slot_start,
                        slot_end,
                        ..
                    },
                ..
            } => {
                for s in *slot_start..*slot_end {
                    last_write.insert((*page, s), *request);
                }
            }
            AEv::Read {
                request,
                page,
                slot_start,
                slot_end,
                verified,
                ..
            } => {
                unchecked += usize::from(!verified);
                for s in *slot_start..*slot_end {
                    if last_write.get(&(*page, s)) != Some(request) {
                        stale += 1;
                    }
                }
            }
            _ => {}
        }
    }
    (stale, unchecked)
}

#[test]
fn faults_at_every_protocol_state_over_500_requests_leave_no_stale_read_and_no_leaked_page() {
    if transport_under_test() != TransportKind::Tcp {
        custody_tests::skip(
            "e2e::disagg::faults_at_every_protocol_state_over_500_requests_leave_no_stale_read_and_no_leaked_page",
            "transport fault injection exists in the tcp transport only (this run tests verbs)",
            custody_tests::Need::Optional,
        );
        return;
    }
    use custody_runtime::disagg::client::collect;
    use custody_runtime::disagg::decode::DecodeFault;
    use custody_runtime::disagg::prefill::PrefillFault;
    use custody_runtime::sampling::Rng;

    let lease = Duration::from_millis(800);
    let nodes = start_pair(
        cfg(1024, 24),
        cfg(1024, 24),
        UnsafeReproduction::default(),
        lease,
    );
    let tok = tokenizer();
    let texts = [
        "Hello, my name is",
        "The weather today is",
        "Tenant secret: the vault code is",
        "Once upon a time",
        "The best way to learn Rust is",
        "Paris is the capital of",
    ];
    let prompts: Vec<Vec<u32>> = texts
        .iter()
        .map(|t| tok.encode(t, true).expect("encode"))
        .collect();
    let n_tok = 4;
    let mut colo = crate::engine_with(cfg(1024, 24));
    let want: Vec<Vec<u32>> = prompts
        .iter()
        .map(|p| greedy(&mut colo, p.clone(), n_tok))
        .collect();

    let mut rng = Rng::new(0xC057_0D1E);
    let (mut ok, mut failed, mut aborted, mut total) = (0usize, 0usize, 0usize, 0usize);
    let mut fault_counts: HashMap<&str, usize> = HashMap::new();
    let rt = nodes.pair.runtime();
    for _batch in 0..50 {
        let fault = rng.next_u64() % 10;
        let mut tasks = Vec::new();
        match fault {
            0 => {
                nodes
                    .pair
                    .decode
                    .fault_inject(DecodeFault::CorruptNextPayload);
                *fault_counts.entry("corrupt").or_default() += 1;
            }
            1 => {
                nodes
                    .pair
                    .decode
                    .fault_inject(DecodeFault::HoldNextReservation);
                *fault_counts.entry("late_writes").or_default() += 1;
                // After the lease expired (key invalidated, pages freed), another request takes
                // the pages; then the held writes arrive.
                let (decode, mut client, p) = (
                    nodes.pair.decode.clone(),
                    nodes.pair.client(),
                    prompts[0].clone(),
                );
                let want0 = want[0].clone();
                tasks.push(rt.spawn(async move {
                    tokio::time::sleep(lease + Duration::from_millis(300)).await;
                    let r = req("tenant-c", p, n_tok);
                    let late = tokio::spawn(async move { collect(&mut client, &r).await });
                    tokio::time::sleep(Duration::from_millis(30)).await;
                    decode.fault_inject(DecodeFault::ReleaseHeld);
                    let got = late.await.map_err(|e| {
                        custody_runtime::disagg::tonic::Status::internal(e.to_string())
                    })?;
                    if let Ok(g) = &got {
                        assert_eq!(
                            g.tokens, want0,
                            "a request on reallocated pages saw late writes"
                        );
                    }
                    got.map(Some)
                }));
            }
            2 => {
                *fault_counts.entry("disconnect").or_default() += 1;
                let (prefill, d) = (nodes.pair.prefill.clone(), rng.next_u64() % 60);
                rt.spawn(async move {
                    tokio::time::sleep(Duration::from_millis(d)).await;
                    prefill.fault_inject(PrefillFault::DisconnectTransport);
                });
            }
            _ => {}
        }
        for _ in 0..10 {
            let k = (rng.next_u64() % prompts.len() as u64) as usize;
            let tenant = if k.is_multiple_of(2) {
                "tenant-a"
            } else {
                "tenant-b"
            };
            let r = req(tenant, prompts[k].clone(), n_tok);
            let mut client = nodes.pair.client();
            let abort_after = rng
                .next_u64()
                .is_multiple_of(5)
                .then(|| Duration::from_millis(rng.next_u64() % 120));
            let w = want[k].clone();
            tasks.push(rt.spawn(async move {
                let fut = collect(&mut client, &r);
                let got = match abort_after {
                    // The client goes away at a random point of the protocol.
                    Some(d) => match tokio::time::timeout(d, fut).await {
                        Ok(x) => x,
                        Err(_) => return Ok(None),
                    },
                    None => fut.await,
                };
                if let Ok(g) = &got {
                    assert_eq!(g.tokens, w, "a served request must be exactly right");
                }
                got.map(Some)
            }));
        }
        for t in tasks {
            total += 1;
            match rt.block_on(t).expect("task") {
                Ok(Some(_)) => ok += 1,
                Ok(None) => aborted += 1,
                Err(s) => {
                    assert!(!s.message().is_empty(), "every failure is a clean error");
                    failed += 1;
                }
            }
        }
    }
    eprintln!(
        "fault injection: {total} requests: {ok} served exactly, {failed} clean errors, {aborted} aborted by the client; faults {fault_counts:?}"
    );
    assert!(total >= 500);
    assert!(ok > total / 2, "most requests are served");
    // No page leaked: wait for leases and quarantines to settle.
    let t0 = std::time::Instant::now();
    loop {
        let ds = nodes.pair.decode.stats_blocking().expect("stats");
        let ps = nodes.pair.prefill.stats_blocking().expect("stats");
        let settled = ds.free_pages == ds.pool_pages
            && ds.quarantined_pages == 0
            && ds.live_requests == 0
            && ds.reservations == 0
            && ps.free_pages == ps.pool_pages
            && ps.live_requests == 0;
        if settled {
            eprintln!("settled: {ds:?} {ps:?}");
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "pages leaked: {ds:?} {ps:?}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    // Zero stale reads per the audit log; every read was tag-verified.
    let events = nodes.decode_audit.events.lock().expect("lock").clone();
    let (stale, unchecked) = audit_stale_slots(&events);
    assert_eq!((stale, unchecked), (0, 0));
    let verify_failures = events
        .iter()
        .filter(|e| matches!(e, AEv::Transfer { outcome, .. } if outcome.starts_with("rejected")))
        .count();
    let ds = nodes.pair.decode.stats_blocking().expect("stats");
    eprintln!(
        "decode: {} transfers rejected at verification, {} late/invalid-key writes refused, {} leases expired",
        verify_failures, ds.transport.rejected_writes, ds.leases_expired
    );
    if fault_counts.contains_key("corrupt") {
        assert!(
            verify_failures > 0,
            "corruption in flight must be caught by the checksum"
        );
    }
    if fault_counts.contains_key("late_writes") {
        assert!(
            ds.transport.rejected_writes > 0 && ds.leases_expired > 0,
            "late writes must be refused: {ds:?}"
        );
    }
}

/// The transport's probe points are in the dynamic symbol table (uprobes attach by name) and
/// start with a 5-byte nop (a cheap probe site).
#[test]
fn transport_probe_points_are_exported_and_start_with_a_five_byte_nop() {
    let exe = std::env::current_exe().expect("exe");
    let out = std::process::Command::new("nm")
        .arg("-D")
        .arg(&exe)
        .output()
        .expect("nm (binutils) is needed for this test");
    let syms = String::from_utf8_lossy(&out.stdout);
    for name in [
        "custody_kv_post_write",
        "custody_kv_complete",
        "custody_kv_register",
        "custody_kv_invalidate",
    ] {
        assert!(
            syms.lines().any(|l| l.ends_with(&format!(" T {name}"))),
            "{name} is not exported in the dynamic symbol table"
        );
    }
    use custody_runtime::transport::abi;
    for f in [
        abi::custody_kv_post_write as *const u8,
        abi::custody_kv_complete as *const u8,
    ] {
        // SAFETY: reading the first 5 bytes of a function's code (mapped readable and executable).
        let head = unsafe { std::slice::from_raw_parts(f, 5) };
        assert_eq!(head, [0x0f, 0x1f, 0x44, 0x00, 0x00]);
    }
}

/// The pair refuses to run on a mismatch (here: context length and page size), over the real
/// control plane, before any transfer can happen.
#[test]
fn verbs_transport_where_unavailable_is_a_clear_error_and_the_pair_does_not_start() {
    if transport_under_test() != TransportKind::Tcp {
        return; // a device is under test
    }
    let verbs = TransportKind::Verbs { device: None };
    let mut opts =
        PairOptions::loopback(&fingerprint(), UnsafeReproduction::default(), Some(fleet()));
    opts.prefill.reserve_wait = Duration::from_secs(1);
    opts.prefill.transport_kind = verbs.clone();
    opts.decode.transport_kind = verbs;
    opts.decode.reservation_lease = Duration::from_secs(1);
    let (pe, de) = (
        Engine::new(model(), cfg(2048, 64)).expect("prefill"),
        Engine::new(model(), cfg(2048, 64)).expect("decode"),
    );
    let msg = Pair::start(pe, de, opts)
        .expect_err("verbs without RDMA must not start")
        .to_string();
    // Without the `rdma` feature: says how to get it; with it but without a device (these
    // machines): says there is no device.
    assert!(
        msg.contains("--features rdma") || msg.contains("no RDMA device"),
        "{msg}"
    );
}

#[test]
fn handshake_refuses_a_mismatched_pair() {
    let (pe, de) = (
        Engine::new(model(), cfg(2048, 64)).expect("prefill"),
        Engine::new(
            model(),
            EngineConfig {
                page_size: 32,
                ..cfg(1024, 64)
            },
        )
        .expect("decode"),
    );
    let mut opts =
        PairOptions::loopback(&fingerprint(), UnsafeReproduction::default(), Some(fleet()));
    opts.prefill.reserve_wait = Duration::from_secs(1);
    opts.decode.reservation_lease = Duration::from_secs(1);
    let err = Pair::start(pe, de, opts).expect_err("mismatched pair must not start");
    let msg = err.to_string();
    assert!(
        msg.contains("refuses to run")
            && msg.contains("page_size")
            && msg.contains("context length"),
        "{msg}"
    );
}

/// One incident scenario for the parameterised accuracy test.
struct Scenario {
    page_size: usize,
    prefill_mib: usize,
    decode_mib: usize,
    /// Tenants whose confidential prompts fill the decode pool first, and prompts per tenant.
    victims: &'static [&'static str],
    per_tenant: usize,
    /// The over-length prompt's length (> the prefill pool, ≤ the decode pool).
    b_len: u32,
    seed: u64,
}

/// Run the incident under `sc`; return (oracle foreign slots per source tenant, the forensic
/// SQL's answer for the victim request) — they must be equal.
fn run_scenario(sc: &Scenario) -> (std::collections::BTreeMap<String, u64>, Vec<(String, u64)>) {
    use custody_runtime::sampling::Rng;
    let mk = |mib| EngineConfig {
        page_size: sc.page_size,
        ..cfg(1024, mib)
    };
    let root = std::env::temp_dir().join(format!(
        "custody-scenario-{}-{}",
        std::process::id(),
        sc.seed
    ));
    let _ = std::fs::remove_dir_all(&root);
    let key = custody_audit::digest::generate_key().expect("key");
    let open = |node| {
        Arc::new(
            custody_audit::writer::AuditWriter::open(custody_audit::writer::WriterConfig::new(
                &root,
                node,
                key.clone(),
            ))
            .expect("writer"),
        )
    };
    let (pw, dw) = (open(1), open(2));
    let sinks: Writers = (pw.clone(), dw.clone());
    let nodes = start_pair_with(
        mk(sc.prefill_mib),
        mk(sc.decode_mib),
        all_unsafe(),
        Duration::from_secs(30),
        Some(sinks),
    );
    let tok = tokenizer();
    let mut rng = Rng::new(sc.seed);
    let mut victims: Vec<(String, Vec<u32>)> = Vec::new();
    for (ti, t) in sc.victims.iter().enumerate() {
        for k in 0..sc.per_tenant {
            // A distinct first word per prompt: prompts share no prefix, so no KV row is shared.
            let head = [
                "Zebra", "Quartz", "Mango", "Falcon", "Walnut", "Copper", "Violet",
            ][ti * sc.per_tenant + k];
            let text = format!(
                "{head}: private record {k} of {t}: customer ids {}. Contract value {} on day {}. Internal notes: {}.",
                (0..14)
                    .map(|_| (rng.next_u64() % 900_000 + 100_000).to_string())
                    .collect::<Vec<_>>()
                    .join(", "),
                rng.next_u64() % 1_000_000,
                rng.next_u64() % 28 + 1,
                (0..10)
                    .map(|_| [
                        "alpha", "bravo", "delta", "echo", "kilo", "lima", "oscar", "tango"
                    ][(rng.next_u64() % 8) as usize])
                    .collect::<Vec<_>>()
                    .join(" "),
            );
            let p = tok.encode(&text, true).expect("encode");
            assert!(
                p.len() >= 60 && p.len() <= 240,
                "prompt of {} tokens",
                p.len()
            );
            victims.push(((*t).to_owned(), p));
        }
    }
    let reqs: Vec<_> = victims.iter().map(|(t, p)| req(t, p.clone(), 8)).collect();
    let outs: Vec<Vec<u32>> = nodes
        .pair
        .generate_many(&reqs)
        .into_iter()
        .map(|r| r.expect("victim served").tokens)
        .collect();
    let b_prompt: Vec<u32> = (0..sc.b_len)
        .map(|_| 1000 + (rng.next_u64() % 5000) as u32)
        .collect();
    nodes
        .pair
        .generate(&req("tenant-b", b_prompt.clone(), 8))
        .expect("legacy path serves it");
    let events = nodes.decode_audit.events.lock().expect("lock").clone();
    let b_id = events
        .iter()
        .find_map(|e| match e {
            AEv::Request {
                request,
                tenant,
                kind: custody_audit::RequestKind::Admitted,
                ..
            } if &**tenant == "tenant-b" => Some(*request),
            _ => None,
        })
        .expect("B admitted on decode");
    let b_pages: Vec<u32> = events
        .iter()
        .filter_map(|e| match e {
            AEv::Page {
                request,
                page,
                kind: PageKind::Alloc,
                ..
            } if *request == b_id => Some(*page),
            _ => None,
        })
        .collect();
    let mc = model().config.clone();
    let b_bytes = nodes
        .pair
        .decode
        .inspect_k_blocking(ORACLE_LAYER, b_pages)
        .expect("inspect");
    let b_rows = k_rows(
        &b_bytes,
        b_prompt.len(),
        sc.page_size,
        mc.n_kv_heads,
        mc.head_dim,
    );
    // The oracle: A's KV as a separate colocated engine computes it, matched byte for byte.
    let sink = MemorySink::default();
    let mut colo = Engine::new(model(), mk(32))
        .expect("colocated")
        .with_audit(Arc::new(sink.clone()));
    let mut dict: HashMap<Vec<u8>, String> = HashMap::new();
    for ((t, p), out) in victims.iter().zip(&outs) {
        let mut toks = p.clone();
        toks.extend_from_slice(&out[..out.len() - 1]);
        sink.events.lock().expect("lock").clear();
        // Generate as the pair did (prompt as a batch, then token by token), so the KV
        // of every position has the same arithmetic as the one the pair wrote.
        colo.submit(req(
            "oracle",
            toks[..toks.len() - (out.len() - 1)].to_vec(),
            out.len(),
        ))
        .expect("oracle request");
        while colo.has_work() {
            colo.step();
        }
        let pages: Vec<u32> = sink
            .events
            .lock()
            .expect("lock")
            .iter()
            .filter_map(|e| match e {
                AEv::Page {
                    page,
                    kind: PageKind::Alloc,
                    ..
                } => Some(*page),
                _ => None,
            })
            .collect();
        let raw: Vec<Vec<u8>> = pages
            .iter()
            .map(|&pg| colo.pool().test_oracle_k_page_bytes(ORACLE_LAYER, pg))
            .collect();
        for row in k_rows(&raw, toks.len(), sc.page_size, mc.n_kv_heads, mc.head_dim) {
            dict.insert(row, t.clone());
        }
    }
    let mut oracle: std::collections::BTreeMap<String, u64> = Default::default();
    for r in b_rows.iter().skip(1) {
        if let Some(t) = dict.get(r) {
            *oracle.entry(t.clone()).or_default() += 1;
        }
    }
    drop(nodes);
    pw.close().expect("seal");
    dw.close().expect("seal");
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .expect("rt");
    let exposure = rt.block_on(async {
        let vs = custody_query::session_over_verified(&root, Some(&key.verifying_key()))
            .await
            .expect("session");
        assert!(vs.report.problems.is_empty(), "{:?}", vs.report.problems);
        custody_query::prepare_forensics(&vs.ctx)
            .await
            .expect("prepare");
        custody_query::forensics::exposure(&vs.ctx, None, None)
            .await
            .expect("exposure")
    });
    let _ = std::fs::remove_dir_all(&root);
    assert_eq!(
        exposure.affected_responses(),
        usize::from(!oracle.is_empty()),
        "{exposure:?}"
    );
    let sql = exposure
        .affected
        .first()
        .map(|a| {
            assert_eq!((a.request, a.recipient_tenant.as_str()), (b_id, "tenant-b"));
            a.sources.clone()
        })
        .unwrap_or_default();
    (oracle, sql)
}

/// Accuracy is the product: on scenarios the tool was not tuned on (page sizes, pool sizes,
/// several source tenants, seeds), the forensic SQL's answer equals the byte oracle exactly —
/// same affected request, same source tenants, same foreign-slot counts.
#[test]
fn exposure_report_equals_the_oracle_across_scenarios() {
    let scenarios = [
        Scenario {
            page_size: 32,
            prefill_mib: 6,
            decode_mib: 17,
            victims: &["tenant-a", "tenant-c"],
            per_tenant: 2,
            b_len: 400,
            seed: 11,
        },
        Scenario {
            page_size: 8,
            prefill_mib: 6,
            decode_mib: 20,
            victims: &["tenant-a", "tenant-c", "tenant-d"],
            per_tenant: 1,
            b_len: 300,
            seed: 29,
        },
        // The default page size, four victims, a larger decode pool, another seed.
        Scenario {
            page_size: 16,
            prefill_mib: 7,
            decode_mib: 24,
            victims: &["tenant-a", "tenant-c", "tenant-d", "tenant-e"],
            per_tenant: 1,
            b_len: 350,
            seed: 47,
        },
    ];
    for sc in &scenarios {
        let (oracle, sql) = run_scenario(sc);
        eprintln!(
            "page {} victims {:?}: oracle {oracle:?}, SQL {sql:?}",
            sc.page_size, sc.victims
        );
        assert!(
            !oracle.is_empty(),
            "the scenario must leak (page {})",
            sc.page_size
        );
        let sql_map: std::collections::BTreeMap<String, u64> = sql.into_iter().collect();
        assert_eq!(
            sql_map, oracle,
            "page size {}: SQL answer != oracle",
            sc.page_size
        );
    }
}

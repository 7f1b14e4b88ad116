//! Disaggregated prefill/decode: an in-process pair (both roles in one process, real gRPC and the
//! real tcp KV transport over loopback) against the colocated engine, the incident reproduction,
//! and fault injection.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use custody_audit::{Event as AEv, MemorySink, PageKind, Writer};
use custody_runtime::config::UnsafeReproduction;
use custody_runtime::disagg::client::{Pair, PairOptions};
use custody_runtime::disagg::decode::DecodeOptions;
use custody_runtime::disagg::prefill::PrefillOptions;
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

pub struct Nodes {
    pub pair: Pair,
    pub prefill_audit: MemorySink,
    pub decode_audit: MemorySink,
}

pub fn start_pair(
    prefill: EngineConfig,
    decode: EngineConfig,
    unsafe_: UnsafeReproduction,
    lease: Duration,
) -> Nodes {
    let (pa, da) = (MemorySink::default(), MemorySink::default());
    let pe = Engine::new_with_unsafe(model(), prefill, &unsafe_)
        .expect("prefill engine")
        .with_audit(Arc::new(pa.clone()));
    let de = Engine::new_with_unsafe(model(), decode, &unsafe_)
        .expect("decode engine")
        .with_audit(Arc::new(da.clone()));
    let opts = PairOptions {
        prefill: PrefillOptions {
            node_id: 1,
            unsafe_: unsafe_.clone(),
            fingerprint: fingerprint(),
            reserve_wait: Duration::from_secs(30),
        },
        decode: DecodeOptions {
            node_id: 2,
            transport_listen: "127.0.0.1:0".parse().expect("addr"),
            checksum: true,
            reservation_lease: lease,
            unsafe_,
            fingerprint: fingerprint(),
        },
    };
    let pair = Pair::start(pe, de, opts).expect("pair starts");
    Nodes {
        pair,
        prefill_audit: pa,
        decode_audit: da,
    }
}

pub fn req(tenant: &str, prompt: Vec<u32>, max_tokens: usize) -> GenerateRequest {
    GenerateRequest {
        prompt,
        max_tokens,
        sampling: SamplingParams::default(),
        stop_ids: vec![],
        tenant: tenant.into(),
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
    let want: Vec<Vec<u32>> = prompts.iter().map(|p| greedy(&mut colo, p.clone(), n)).collect();
    let nodes = start_pair(cfg(2048, 64), cfg(2048, 64), UnsafeReproduction::default(), Duration::from_secs(30));
    // One at a time, then all concurrently.
    for (p, w) in prompts.iter().zip(&want) {
        let got = nodes.pair.generate(&req("tenant-a", p.clone(), n)).expect("generate");
        assert_eq!(&got.tokens, w, "disaggregated output differs for prompt {p:?}");
        assert_eq!(got.finish_reason, "length");
    }
    let reqs: Vec<_> = prompts.iter().map(|p| req("tenant-b", p.clone(), n)).collect();
    for (got, w) in nodes.pair.generate_many(&reqs).into_iter().zip(&want) {
        assert_eq!(&got.expect("generate").tokens, w, "concurrent disaggregated output differs");
    }
    // Every transfer was checked and recorded on both sides.
    let d = nodes.decode_audit.events.lock().expect("lock").clone();
    let p = nodes.prefill_audit.events.lock().expect("lock").clone();
    let verified = d.iter().filter(|e| matches!(e, AEv::Transfer { outcome, .. } if outcome == "verified")).count();
    let completed = p.iter().filter(|e| matches!(e, AEv::Transfer { outcome, .. } if outcome == "completed")).count();
    let pages: usize = prompts.iter().map(|p| p.len().div_ceil(16)).sum::<usize>() * 2;
    assert_eq!((verified, completed), (pages, pages));
    assert!(d.iter().any(|e| matches!(e, AEv::Page { kind: PageKind::Write { writer: Writer::Transfer, .. }, .. })));
    // Nothing leaked on either node.
    let ds = nodes.pair.decode.stats_blocking().expect("stats");
    assert_eq!((ds.free_pages, ds.quarantined_pages, ds.live_requests), (ds.pool_pages, 0, 0), "{ds:?}");
    let ps = nodes.pair.prefill.stats_blocking().expect("stats");
    assert_eq!((ps.free_pages, ps.live_requests), (ps.pool_pages, 0), "{ps:?}");
}

/// Events of `request` on a node.
pub fn events_of(sink: &MemorySink, request: u64) -> Vec<AEv> {
    sink.events
        .lock()
        .expect("lock")
        .iter()
        .filter(|e| match e {
            AEv::Request { request: r, .. }
            | AEv::Page { request: r, .. }
            | AEv::Read { request: r, .. }
            | AEv::Transfer { request: r, .. }
            | AEv::IntegrityViolation { request: r, .. } => *r == request,
        })
        .cloned()
        .collect()
}

pub fn _unused(_: HashMap<u8, u8>) {}

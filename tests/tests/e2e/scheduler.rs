//! Admission, start-up validation and continuous batching.

use std::collections::HashMap;

use custody_runtime::engine::{AdmissionError, Event, FinishReason, GenerateRequest, StartupError};
use custody_runtime::{Engine, EngineConfig, Model, SamplingParams};

use crate::reference::greedy;
use crate::{engine_with, small_cfg, tokenizer};

fn req(prompt: Vec<u32>, max_tokens: usize) -> GenerateRequest {
    GenerateRequest {
        decoding: Default::default(),
        prompt,
        max_tokens,
        sampling: SamplingParams::default(),
        stop_ids: vec![],
        tenant: "tenant-a".into(),
        cache: None,
    }
}

#[test]
fn over_length_requests_are_rejected_before_any_page_is_allocated() {
    let mut e = engine_with(small_cfg());
    let free = e.pool().n_free();
    let ctx = e.context_length();
    let err = e
        .submit(req(vec![42; ctx - 10], 11))
        .expect_err("over-length must be rejected");
    assert_eq!(
        err,
        AdmissionError::ContextExceeded {
            prompt_tokens: ctx - 10,
            max_tokens: 11,
            context_length: ctx
        }
    );
    let err = e
        .submit(req(vec![42; ctx + 1], 1))
        .expect_err("over-length prompt");
    assert!(matches!(err, AdmissionError::ContextExceeded { .. }));
    assert_eq!(e.submit(req(vec![], 1)), Err(AdmissionError::EmptyPrompt));
    assert_eq!(
        e.submit(req(vec![1], 0)),
        Err(AdmissionError::ZeroMaxTokens)
    );
    assert!(matches!(
        e.submit(req(vec![1_000_000], 1)),
        Err(AdmissionError::BadToken { .. })
    ));
    // Nothing was allocated, queued or run: no step does anything.
    assert_eq!(e.pool().n_free(), free);
    assert!(!e.has_work());
    assert!(e.step().is_empty());
    assert_eq!(e.pool().n_free(), free);
    // Exactly at the limit is admitted (whole prompt, never shortened).
    assert!(e.submit(req(vec![42; ctx - 1], 1)).is_ok());
}

#[test]
fn pool_smaller_than_context_refuses_to_start() {
    let load = || Model::load(&custody_tests::model_path()).expect("model");
    // 23,040 B/token for SmolLM2-135M: 16 MiB holds 720 tokens, far below 2048.
    let cfg = EngineConfig {
        context_length: Some(2048),
        kv_budget_mib: 16,
        ..EngineConfig::default()
    };
    match Engine::new(load(), cfg.clone()) {
        Err(StartupError::PoolTooSmall {
            pool_tokens,
            context_length: 2048,
            ..
        }) => assert!(pool_tokens < 2048),
        other => panic!("expected PoolTooSmall, got {other:?}"),
    }
    // Only when explicitly allowed, the context is lowered to what the pool holds.
    let e = Engine::new(
        load(),
        EngineConfig {
            allow_context_reduction: true,
            ..cfg
        },
    )
    .expect("lowered");
    assert!(e.context_length() < 2048);
    assert_eq!(
        e.context_length(),
        e.pool().n_pages() * e.pool().page_size()
    );
    // And a context beyond the model's trained one is refused.
    let big = EngineConfig {
        context_length: Some(1 << 20),
        kv_budget_mib: 64,
        ..EngineConfig::default()
    };
    assert!(matches!(
        Engine::new(load(), big),
        Err(StartupError::ContextBeyondModel { .. })
    ));
}

#[test]
fn asking_for_the_cuda_backend_without_one_is_a_clear_startup_error() {
    let cuda = EngineConfig {
        backend: custody_runtime::config::Backend::Cuda,
        ..EngineConfig::default()
    };
    let e = match Engine::new(crate::disagg::model(), cuda) {
        Err(e @ StartupError::Backend(_)) => e.to_string(),
        Err(e) => panic!("another error: {e}"),
        Ok(_) => panic!("a CUDA engine started on a machine without CUDA"),
    };
    // This build has no `cuda` feature (the test suite's): it says how to get one.
    assert!(e.contains("--features cuda"), "{e}");
    // The names operators write (`backend = "cuda"`), through the config's serde.
    let parsed: EngineConfig = serde_json::from_str(r#"{"backend": "cuda"}"#).expect("parse");
    assert_eq!(parsed.backend, custody_runtime::config::Backend::Cuda);
    assert!(serde_json::from_str::<EngineConfig>(r#"{"backend": "rocm"}"#).is_err());
}

#[test]
fn batched_generation_equals_each_prompt_alone() {
    let tok = tokenizer();
    let prompts = [
        "The capital of France is",
        "Rust is a programming language that",
        "Once upon a time, in a small village,",
        "def fibonacci(n):",
        "The three primary colours are",
    ];
    let ids: Vec<Vec<u32>> = prompts
        .iter()
        .map(|p| tok.encode(p, true).expect("enc"))
        .collect();
    let n = 24;
    let alone: Vec<Vec<u32>> = ids
        .iter()
        .map(|p| greedy(&mut engine_with(small_cfg()), p.clone(), n))
        .collect();

    // All together, with a small step budget so prefill chunks and decode steps interleave.
    let mut e = engine_with(EngineConfig {
        max_batch_tokens: 7,
        ..small_cfg()
    });
    let mut out: HashMap<u64, Vec<u32>> = HashMap::new();
    let rids: Vec<u64> = ids
        .iter()
        .map(|p| e.submit(req(p.clone(), n)).expect("admit"))
        .collect();
    let mut finished = 0;
    let mut mixed_steps = 0;
    while e.has_work() {
        let evs = e.step();
        if evs
            .iter()
            .filter(|ev| matches!(ev, Event::Token { .. }))
            .count()
            > 1
        {
            mixed_steps += 1;
        }
        for ev in evs {
            match ev {
                Event::Token { id, token, .. } => out.entry(id).or_default().push(token),
                Event::Finished {
                    reason,
                    generated_tokens,
                    ..
                } => {
                    assert_eq!((reason, generated_tokens), (FinishReason::Length, n));
                    finished += 1;
                }
                Event::Failed { error, .. } => panic!("{error}"),
                Event::Aborted { reason, .. } => panic!("{reason}"),
                Event::Prefilled { .. } => panic!("no prefill-only request was submitted"),
            }
        }
    }
    assert_eq!(finished, prompts.len());
    assert!(mixed_steps > 0, "requests were never batched together");
    for (i, rid) in rids.iter().enumerate() {
        assert_eq!(
            out[rid], alone[i],
            "prompt {i} ({:?}) differs when batched",
            prompts[i]
        );
    }
    assert_eq!(e.pool().n_free(), e.pool().n_pages());
}

#[test]
fn sampling_is_reproducible_with_a_seed() {
    let tok = tokenizer();
    let p = tok
        .encode("Write a short poem about the sea.", true)
        .expect("enc");
    let run = |seed| {
        let mut e = engine_with(small_cfg());
        let params = SamplingParams {
            temperature: 0.9,
            top_k: 40,
            top_p: 0.95,
            seed,
        };
        let id = e
            .submit(GenerateRequest {
                decoding: Default::default(),
                prompt: p.clone(),
                max_tokens: 20,
                sampling: params,
                stop_ids: vec![],
                tenant: "tenant-a".into(),
                cache: None,
            })
            .expect("admit");
        let mut v = Vec::new();
        while e.has_work() {
            for ev in e.step() {
                if let Event::Token { id: r, token, .. } = ev {
                    assert_eq!(r, id);
                    v.push(token);
                }
            }
        }
        v
    };
    assert_eq!(run(7), run(7));
    assert_ne!(run(7), run(8));
}

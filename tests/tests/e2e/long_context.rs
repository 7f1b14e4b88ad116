//! Long contexts against llama.cpp (issue 38): two tiny F32 models whose context is configured at
//! 40,960 tokens read a 32,800-token prompt, and the logits at its last 16 positions are
//! llama.cpp's (`scripts/llamacpp/gen_long_context.py`; `tests/fixtures/long/`). Every matrix is
//! F32 in both engines, so what a long context adds — RoPE at positions near 2^15 (Llama 3
//! frequency factors; NeoX pairs), scores and softmax over 32,800 slots of the F16 cache, 64
//! prefill chunks each attending everything before it, 2,050 pages per sequence each tag-checked
//! at every read — is all that is measured. The served path (`submit`/`step`) must then produce
//! llama.cpp's greedy token after the prompt.

use custody_runtime::{Engine, EngineConfig, Event, GenerateRequest, Model};
use custody_tests::{fixture, read_npy_f32, read_npy_i32};
use serde_json::Value;

use crate::reference::compare_logits;

/// (model, bound on the mean and the max |Δlogit| over the kept positions and the vocabulary).
/// Measured 2026-12-03: mean 2.2e-7 / max 1.9e-6 on both (the short-prompt F32 minis: ~3e-6,
/// arch_models) — sums over 32,800 softmax terms and 16-wide dot products rounded in another
/// SIMD order. A wrong RoPE angle at depth, a lost or repeated chunk or page, or a softmax over
/// the wrong slots moves these logits (std ~4) by orders of magnitude more.
const CASES: &[(&str, f64, f64)] = &[("llama3-long", 1e-6, 2e-5), ("qwen2-long", 1e-6, 2e-5)];

/// A top-1 minus top-2 margin above which the greedy token must be llama.cpp's: far above the
/// max |Δlogit| bound.
const CLEAR_MARGIN: f64 = 1e-3;

fn meta(name: &str) -> Value {
    let text = std::fs::read_to_string(fixture(&format!("long/{name}.json"))).expect("fixture");
    serde_json::from_str(&text).expect("json")
}

fn engine(name: &str, meta: &Value, kv_budget_mib: usize) -> Result<Engine, String> {
    let path = fixture(&format!("long/{name}.F32.gguf"));
    let model = Model::load(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    assert_eq!(
        model.gguf().sha256_hex(),
        meta["sha256"].as_str().expect("sha"),
        "{name}: not the file the fixture was made from"
    );
    let cfg = EngineConfig {
        context_length: Some(meta["n_ctx"].as_u64().expect("n_ctx") as usize),
        kv_budget_mib,
        ..EngineConfig::default()
    };
    Engine::new(model, cfg).map_err(|e| e.to_string())
}

#[test]
fn a_32k_token_prompt_gives_llama_cpps_last_logits() {
    for &(name, mean_bound, max_bound) in CASES {
        let meta = meta(name);
        let (shape, ids) = read_npy_i32(&fixture(&format!("long/{name}.ids.npy")));
        let ids: Vec<u32> = ids.iter().map(|&t| u32::try_from(t).expect("id")).collect();
        assert_eq!(
            shape,
            [meta["n_prompt"].as_u64().expect("n_prompt") as usize]
        );
        assert!(
            ids.len() >= 32_768,
            "{name}: a long context is ≥ 32k tokens"
        );

        // The pool is checked at start: a budget that cannot hold one full context is refused.
        let small = engine(name, &meta, 1).expect_err("a 1 MiB pool cannot hold 40,960 tokens");
        assert!(small.contains("context"), "{name}: {small}");

        let mut e = engine(name, &meta, 32).expect("engine");
        let t0 = std::time::Instant::now();
        let ours = e.score(&ids).expect("score");
        let secs = t0.elapsed().as_secs_f64();
        let (shape, theirs) = read_npy_f32(&fixture(&format!("long/{name}.npy")));
        let (last, vocab) = (shape[0], shape[1]);
        assert_eq!(ours.len(), ids.len() * vocab, "{name}");
        let first = meta["first_position"].as_u64().expect("first") as usize;
        assert_eq!(first + last, ids.len());
        let tail = &ours[first * vocab..];
        let (mean, max, _) = compare_logits(tail, &theirs, vocab);
        eprintln!(
            "{name}: {} prompt tokens scored in {secs:.1} s; last {last} positions |dlogit| \
             mean {mean:.2e} max {max:.2e}",
            ids.len()
        );
        assert!(
            mean <= mean_bound && max <= max_bound,
            "{name}: |dlogit| mean {mean} max {max}, bounds {mean_bound} / {max_bound}"
        );
        let scored = custody_kernels::ops::argmax(&ours[(ids.len() - 1) * vocab..]).expect("vocab");
        served_token_is_llama_cpps(&mut e, name, &meta, &ids, scored as u32);
    }
}

/// The whole prompt through the scheduler (chunked prefill, pages allocated as it grows), one
/// greedy token: the scored argmax at the last position, and llama.cpp's where its margin is clear.
fn served_token_is_llama_cpps(e: &mut Engine, name: &str, meta: &Value, ids: &[u32], scored: u32) {
    let margin = meta["margin"]
        .as_array()
        .expect("margins")
        .last()
        .expect("one")
        .as_f64()
        .expect("margin");
    let want = meta["llamacpp_argmax"]
        .as_array()
        .expect("argmax")
        .last()
        .expect("one")
        .as_u64()
        .expect("id") as u32;
    e.submit(GenerateRequest {
        decoding: Default::default(),
        prompt: ids.to_vec(),
        max_tokens: 1,
        sampling: Default::default(),
        stop_ids: vec![],
        tenant: "long".into(),
        cache: None,
    })
    .expect("a 32,800-token prompt fits the 40,960-token context");
    let mut got = None;
    // 32,800 / 512 prefill chunks, then the token: bounded well above that.
    for _ in 0..200 {
        for ev in e.step() {
            match ev {
                Event::Token { token, .. } => got = Some(token),
                Event::Finished { .. } => {}
                other => panic!("{name}: {other:?}"),
            }
        }
        if got.is_some() {
            break;
        }
    }
    let got = got.unwrap_or_else(|| panic!("{name}: no token after 200 steps"));
    assert_eq!(got, scored, "{name}: served and scored paths disagree");
    if margin >= CLEAR_MARGIN {
        assert_eq!(
            got, want,
            "{name}: llama.cpp's greedy token by a margin of {margin}"
        );
    }
}

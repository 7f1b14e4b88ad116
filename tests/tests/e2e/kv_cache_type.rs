//! `engine.kv_cache_type = "q8_0"` (issue 38): K and V stored as llama.cpp's q8_0 blocks. What
//! it costs in accuracy is measured on the embedded model against what the same cache type
//! costs llama.cpp itself (`scripts/llamacpp/gen_kv_cache_reference.py`,
//! `tests/fixtures/kv-cache/`); what it saves is its bytes; what it must not change is anything
//! else — the tag check (`e2e::integrity` runs its property test on both types), batched ==
//! alone, and where it cannot run it is refused by name.

use custody_kernels::DType;
use custody_runtime::engine::{Event, GenerateRequest};
use custody_runtime::gguf::write::Synthetic;
use custody_runtime::kv::{KvType, PagePool};
use custody_runtime::{Engine, EngineConfig, Model, SamplingParams};
use custody_tests::cuda_shim::ShimDevice;
use custody_tests::{fixture, read_npy_f32};
use serde_json::Value;

use crate::reference::compare_logits;

fn cfg(kv: KvType) -> EngineConfig {
    EngineConfig {
        context_length: Some(2048),
        kv_budget_mib: 64,
        kv_cache_type: kv,
        ..EngineConfig::default()
    }
}

fn json(path: &str) -> Value {
    serde_json::from_str(&std::fs::read_to_string(fixture(path)).expect("fixture")).expect("json")
}

/// The unsigned integers of the array `v[key]`.
fn numbers<'a>(v: &'a Value, key: &str) -> impl Iterator<Item = u64> + 'a {
    v[key]
        .as_array()
        .unwrap_or_else(|| panic!("{key}: an array"))
        .iter()
        .map(|x| x.as_u64().expect("an unsigned integer"))
}

/// Mean and max of KL(p ‖ q) over rows, p = softmax(base), q = softmax(other), in f64.
fn kl_rows(base: &[f32], other: &[f32], vocab: usize) -> (f64, f64) {
    let log_softmax = |row: &[f32]| -> Vec<f64> {
        let m = row
            .iter()
            .fold(f64::NEG_INFINITY, |m, &x| m.max(f64::from(x)));
        let z = row
            .iter()
            .map(|&x| (f64::from(x) - m).exp())
            .sum::<f64>()
            .ln();
        row.iter().map(|&x| f64::from(x) - m - z).collect()
    };
    let (mut sum, mut max) = (0.0, 0.0f64);
    let rows = base.len() / vocab;
    for r in 0..rows {
        let lp = log_softmax(&base[r * vocab..(r + 1) * vocab]);
        let lq = log_softmax(&other[r * vocab..(r + 1) * vocab]);
        let kl: f64 = lp.iter().zip(&lq).map(|(p, q)| p.exp() * (p - q)).sum();
        sum += kl;
        max = max.max(kl);
    }
    (sum / rows as f64, max)
}

#[test]
fn a_q8_0_cache_costs_no_more_accuracy_than_llama_cpps_own_and_stores_17_of_32_bytes() {
    let src = json("llamacpp-smollm2/teacher_forced/long_context.json");
    let theirs = json("kv-cache/q8_0.json");
    let ids: Vec<u32> = numbers(&src, "ids").map(|i| i as u32).collect();
    assert_eq!(theirs["n_tokens"].as_u64(), Some(ids.len() as u64));
    let model = || Model::load(&custody_tests::model_path()).expect("load model");
    let mut f16 = Engine::new(model(), cfg(KvType::F16)).expect("f16 engine");
    let mut q8 = Engine::new(model(), cfg(KvType::Q8_0)).expect("q8_0 engine");

    // Bytes: 34 per 32 values instead of 64, so the same budget holds 32/17 as many tokens.
    let c = &q8.model().config;
    let (b16, b8) = (
        PagePool::bytes_per_token(f16.pool().geometry(), c.n_layers),
        PagePool::bytes_per_token(q8.pool().geometry(), c.n_layers),
    );
    assert_eq!(
        (b16 * 17, b8 * 32),
        (b16 * 17, b16 * 17),
        "{b16} vs {b8} B/token"
    );
    assert!(q8.pool().n_pages() * 17 >= f16.pool().n_pages() * 32 - 17);

    let vocab = c.vocab_size;
    let (a, b) = (f16.score(&ids).expect("f16"), q8.score(&ids).expect("q8_0"));
    let (mean, max, agree) = compare_logits(&b, &a, vocab);
    let (kl, kl_max) = kl_rows(&a, &b, vocab);
    let llama = &theirs["llamacpp_q8_0_vs_f16_flash_attn"];
    let num = |k: &str| llama[k].as_f64().expect(k);
    eprintln!(
        "q8_0 vs f16 cache over {} positions: |dlogit| mean {mean:.4} max {max:.3}, top-1 {:.2} %, \
         KL mean {kl:.2e} max {kl_max:.2e}; llama.cpp's own: |dlogit| mean {:.4} max {:.3}, \
         top-1 {:.2} %, KL mean {:.2e} max {:.2e}",
        ids.len(),
        agree * 100.0,
        num("mean_abs_dlogit"),
        num("max_abs_dlogit"),
        num("top1_agreement") * 100.0,
        num("mean_kl"),
        num("max_kl"),
    );
    // The same storage format and quantizer: ours may not cost more than llama.cpp's (whose
    // flash attention also rounds the query to q8_0), with a margin for one model's noise.
    assert!(
        kl <= num("mean_kl") * 1.5,
        "KL {kl} vs llama.cpp's {}",
        num("mean_kl")
    );
    assert!(agree >= num("top1_agreement") - 0.01, "top-1 {agree}");
    assert!(
        mean > 0.0,
        "a q8_0 cache that changes nothing is not storing q8_0"
    );

    // Against llama.cpp's q8_0 cache at the fixture's saved rows.
    let (shape, rows_theirs) = read_npy_f32(&fixture("kv-cache/q8_0.npy"));
    let rows: Vec<usize> = numbers(&theirs, "saved_rows").map(|r| r as usize).collect();
    assert_eq!(shape, [rows.len(), vocab]);
    let ours: Vec<f32> = rows
        .iter()
        .flat_map(|&r| b[r * vocab..(r + 1) * vocab].iter().copied())
        .collect();
    let (m2, x2, a2) = compare_logits(&ours, &rows_theirs, vocab);
    eprintln!(
        "ours q8_0 vs llama.cpp q8_0 at {} rows: |dlogit| mean {m2:.4} max {x2:.3}, top-1 {:.0} %",
        rows.len(),
        a2 * 100.0
    );
    assert!(m2 <= 2.0 * num("mean_abs_dlogit"), "mean {m2}");
}

fn greedy(prompt: Vec<u32>) -> GenerateRequest {
    GenerateRequest {
        decoding: Default::default(),
        prompt,
        max_tokens: 24,
        sampling: SamplingParams::default(),
        stop_ids: vec![],
        tenant: "kv".into(),
        cache: None,
    }
}

/// Each request's tokens, run to completion together.
fn run(e: &mut Engine, prompts: &[Vec<u32>]) -> Vec<Vec<u32>> {
    let ids: Vec<u64> = prompts
        .iter()
        .map(|p| e.submit(greedy(p.clone())).expect("admit"))
        .collect();
    let mut out = vec![Vec::new(); ids.len()];
    for _ in 0..200 {
        if !e.has_work() {
            break;
        }
        for ev in e.step() {
            match ev {
                Event::Token { id, token, .. } => {
                    out[ids.iter().position(|&i| i == id).expect("ours")].push(token)
                }
                Event::Failed { error, .. } => panic!("{error}"),
                _ => {}
            }
        }
    }
    out
}

#[test]
fn a_q8_0_cache_gives_each_request_the_same_tokens_alone_and_batched() {
    let tok = crate::tokenizer();
    let prompts: Vec<Vec<u32>> = [
        "The lighthouse keeper climbed the spiral stairs",
        "def merge_sorted(a, b):\n",
        "In 1869 the Suez Canal opened, shortening the sea route",
    ]
    .iter()
    .map(|t| tok.encode(t, true).expect("encode"))
    .collect();
    let model = || Model::load(&custody_tests::model_path()).expect("load model");
    let mut e = Engine::new(model(), cfg(KvType::Q8_0)).expect("engine");
    let together = run(&mut e, &prompts);
    for (p, t) in prompts.iter().zip(&together) {
        assert_eq!(t.len(), 24);
        assert_eq!(
            &run(&mut e, std::slice::from_ref(p))[0],
            t,
            "alone vs batched"
        );
    }
    // And the f16 cache's tokens differ somewhere: the type is in effect on the served path.
    let mut f16 = Engine::new(model(), cfg(KvType::F16)).expect("engine");
    let plain = run(&mut f16, &prompts);
    eprintln!(
        "greedy tokens equal to the f16 cache's: {:?} of 24",
        plain
            .iter()
            .zip(&together)
            .map(|(a, b)| a.iter().zip(b).take_while(|(x, y)| x == y).count())
            .collect::<Vec<_>>()
    );
}

#[test]
fn a_q8_0_cache_is_refused_by_name_where_it_cannot_run() {
    let tiny =
        || custody_runtime::cuda_check::load(&Synthetic::tiny(DType::F32, 7)).expect("model");
    let cfg = |kv| EngineConfig {
        context_length: Some(256),
        ..cfg(kv)
    };
    // Rows of 16 values are not whole q8_0 blocks.
    let e = Engine::new(tiny(), cfg(KvType::Q8_0)).expect_err("head_dim 16");
    assert!(e.to_string().contains("kv_cache_type"), "{e}");
    assert!(e.to_string().contains("head_dim is 16"), "{e}");
    // The CUDA kernels read f16 pages.
    let e = Engine::new_on_device(tiny(), cfg(KvType::Q8_0), Box::new(ShimDevice::new(0)))
        .expect_err("cuda");
    assert!(e.to_string().contains("kv_cache_type"), "{e}");
    // The f16 default starts on both.
    Engine::new(tiny(), cfg(KvType::F16)).expect("f16 on the CPU");
}

/// A pair whose pools both store q8_0: the prompt's pages (full and partial) travel as q8_0
/// bytes, are checksummed and verified like f16 pages, and decode continues from them to
/// exactly the tokens a colocated q8_0 engine gives.
#[test]
fn a_q8_0_pair_decodes_what_a_colocated_q8_0_engine_decodes() {
    use crate::disagg::{req, start_pair};
    use custody_runtime::config::UnsafeReproduction;
    let tok = crate::tokenizer();
    let prompts: Vec<Vec<u32>> = [
        "The lighthouse keeper climbed the spiral stairs every evening at dusk. From the lantern \
         room he could see the fishing boats returning, their wakes drawing white lines across",
        "def merge_sorted(a, b):\n",
    ]
    .iter()
    .map(|t| tok.encode(t, true).expect("encode"))
    .collect();
    let lens: Vec<usize> = prompts.iter().map(Vec::len).collect();
    assert!(
        lens.iter().any(|&n| n > 16 && n % 16 != 0),
        "full and partial pages: {lens:?}"
    );
    let model = || Model::load(&custody_tests::model_path()).expect("load model");
    let mut colo = Engine::new(model(), cfg(KvType::Q8_0)).expect("engine");
    let want = run(&mut colo, &prompts);
    let nodes = start_pair(
        cfg(KvType::Q8_0),
        cfg(KvType::Q8_0),
        UnsafeReproduction::default(),
        std::time::Duration::from_secs(30),
    );
    for (p, w) in prompts.iter().zip(&want) {
        let got = nodes
            .pair
            .generate(&req("tenant-a", p.clone(), 24))
            .expect("generate");
        assert_eq!(&got.tokens, w, "pair vs colocated for {p:?}");
    }
}

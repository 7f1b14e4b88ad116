//! The GGUF types people download, on the real model: llama.cpp's own requantizations of the
//! embedded SmolLM2 (`scripts/llamacpp/gen_requant_reference.py`: Q2_K, Q3_K_M, Q4_K_S,
//! Q4_K_M, Q5_K_S, Q5_K_M, Q6_K, Q8_0, Q5_0, Q5_1, Q4_0, BF16 — each a mix, as real files are),
//! against llama.cpp's logits on each.
//! The files (100–270 MB) are not committed: their SHA-256 and llama.cpp's outputs are, and each
//! file is tested where it is present (`CUSTODY_REQUANT_DIR`, default ~/.cache/custody/requant).

use std::path::PathBuf;

use custody_runtime::{Engine, Model};
use custody_tests::{fixture, read_npy_f32};
use serde_json::Value;

use crate::reference::{compare_logits, ids};
use crate::small_cfg;

fn indices(v: &Value) -> Vec<usize> {
    ids(v).into_iter().map(|i| i as usize).collect()
}

fn requant_dir() -> PathBuf {
    std::env::var_os("CUSTODY_REQUANT_DIR").map_or_else(
        || {
            let home = std::env::var_os("HOME")
                .map(PathBuf::from)
                .unwrap_or_default();
            home.join(".cache/custody/requant")
        },
        PathBuf::from,
    )
}

/// (file, top-1 agreement required on llama.cpp's greedy continuation, bound on the mean and on
/// the max |Δlogit| over the saved rows). Every type runs the arithmetic llama.cpp's CPU backend
/// runs for it on this machine, so every bound is 0 — bit for bit, all 43 teacher-forced
/// positions' top-1 and both saved rows: Q8_0, Q5_0 and Q5_1 (int8 activations, its AVX2
/// accumulation order); Q4_0 (its repacked rows: one f32 FMA per block and output,
/// `quant::dot_q4_0_q8_scalar`); BF16 (bf16 activations, tinyBLAS's `vdpbf16ps` accumulation,
/// `custody_kernels::bf16`); the K-quant mixes (Q8_K activations, llama.cpp's integer sums and
/// its float order for a batch of 43 rows, `custody_kernels::q8k::KOrder`: the tiled VNNI path
/// for Q3_K/Q5_K/Q6_K, the repacked GEMM for the Q4_K/Q2_K rows in whole fours and its GEMV for
/// the last three). With the float order they had before (one FMA per super-block for every
/// row) the K-mixes differed by mean / max |Δlogit| up to 0.30 / 1.16 (Q4_K_S) and top-1 21/24
/// (Q5_K_M), 2026-12-02. Served greedily (prompt in one batch, then one decode step per token:
/// llama.cpp's GEMV / 8-lane `vec_dot` orders), every file gives llama.cpp's own generation token
/// for token; with the prompt orders alone (decode in one FMA per super-block) Q5_K_S kept 4 of
/// 24, Q3_K_M 5, Q6_K 10, Q5_K_M 13.
const CASES: [(&str, f64, f64, f64); 13] = [
    ("Q8_0", 1.0, 0.0, 0.0),
    // The embedded model plus Llama 3 style RoPE frequency factors (`rope_freqs.weight`).
    ("ROPE_FREQS", 1.0, 0.0, 0.0),
    ("Q5_0", 1.0, 0.0, 0.0),
    ("Q5_1", 1.0, 0.0, 0.0),
    ("Q4_0", 1.0, 0.0, 0.0),
    ("Q4_K_M", 1.0, 0.0, 0.0),
    ("Q5_K_M", 1.0, 0.0, 0.0),
    ("Q6_K", 1.0, 0.0, 0.0),
    ("BF16", 1.0, 0.0, 0.0),
    ("Q3_K_M", 1.0, 0.0, 0.0),
    ("Q2_K", 1.0, 0.0, 0.0),
    ("Q4_K_S", 1.0, 0.0, 0.0),
    ("Q5_K_S", 1.0, 0.0, 0.0),
];

#[test]
fn llama_cpp_requantizations_agree_with_llama_cpp_where_present() {
    let dir = requant_dir();
    let mut tested = Vec::new();
    for (name, need_top1, mean_bound, max_bound) in CASES {
        let meta: Value = serde_json::from_str(
            &std::fs::read_to_string(fixture(&format!("llamacpp-requant/{name}.json")))
                .expect("fixture"),
        )
        .expect("json");
        let path = dir.join(meta["file"].as_str().expect("file"));
        if !path.exists() {
            // Not fetched by scripts/setup.sh (made by scripts/llamacpp/gen_requant_reference.py).
            custody_tests::skip(
                &format!("e2e::quant_types::llama_cpp_requantizations ({name})"),
                &format!("{} not present", path.display()),
                custody_tests::Need::Optional,
            );
            continue;
        }
        let model = Model::load(&path).expect("load");
        assert_eq!(
            model.gguf().sha256_hex(),
            meta["sha256"].as_str().expect("sha"),
            "{name}: not the file the fixture was made from"
        );
        let ids = ids(&meta["ids"]);
        let n_prompt = meta["n_prompt"].as_u64().expect("n") as usize;
        let theirs_argmax = indices(&meta["llamacpp_argmax"]);
        let mut e = Engine::new(model, small_cfg()).expect("engine");
        // Served greedily (the prompt as one batch, then one decode step per token, as
        // llama.cpp generated the continuation).
        let served =
            crate::reference::greedy(&mut e, ids[..n_prompt].to_vec(), ids.len() - n_prompt);
        let ours = e.score(&ids).expect("score");
        let vocab = ours.len() / ids.len();
        let positions = n_prompt - 1..ids.len() - 1;
        let agree = positions
            .clone()
            .filter(|&p| {
                custody_kernels::ops::argmax(&ours[p * vocab..(p + 1) * vocab])
                    == Some(theirs_argmax[p])
            })
            .count();
        let top1 = agree as f64 / positions.len() as f64;
        let (shape, saved) = read_npy_f32(&fixture(&format!("llamacpp-requant/{name}.npy")));
        assert_eq!(shape[1], vocab);
        let ours_rows: Vec<f32> = indices(&meta["saved_rows"])
            .iter()
            .flat_map(|&r| ours[r * vocab..(r + 1) * vocab].iter().copied())
            .collect();
        let (mean, max, _) = compare_logits(&ours_rows, &saved, vocab);
        let same_served = served
            .iter()
            .zip(&ids[n_prompt..])
            .take_while(|(a, b)| a == b)
            .count();
        eprintln!(
            "{name}: top-1 {agree}/{} on llama.cpp's continuation, saved rows mean |dlogit| {mean:.4}, max {max:.4}; served greedily: {same_served}/{} tokens llama.cpp's",
            positions.len(),
            served.len()
        );
        assert!(
            top1 >= need_top1,
            "{name}: top-1 agreement {top1} < {need_top1}"
        );
        assert!(
            mean <= mean_bound,
            "{name}: mean |dlogit| {mean} > {mean_bound}"
        );
        assert!(max <= max_bound, "{name}: max |dlogit| {max} > {max_bound}");
        assert_eq!(
            served[..],
            ids[n_prompt..],
            "{name}: served greedily, not llama.cpp's generation"
        );
        tested.push(name);
    }
    eprintln!("requantized types tested: {tested:?}");
}

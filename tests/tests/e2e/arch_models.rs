//! The architectures and vocabularies people download, on tiny committed models: `llama` with a
//! SentencePiece vocabulary (Mistral-style), `llama` with Llama 3's byte-level BPE and RoPE
//! frequency factors, `qwen2` (Q/K/V biases, NeoX RoPE) and `qwen3` (per-head Q/K norm, Q wider
//! than the embedding) — random weights written with the `gguf` package and quantized by
//! llama.cpp's own quantizer into K-quant mixes and legacy types
//! (`scripts/llamacpp/gen_arch_fixtures.py`; `tests/fixtures/arch/`). Against llama.cpp on
//! each file: logits at every position of a prompt and llama.cpp's greedy continuation
//! (teacher-forced), greedy tokens wherever llama.cpp's top-2 margin is clear, tokenization of
//! a corpus with non-ASCII text and special tokens, detokenization, and the chat template.

use std::path::Path;

use custody_kernels::attention::KvType;
use custody_runtime::gguf::Gguf;
use custody_runtime::{Engine, EngineConfig, Model, Tokenizer};
use custody_tests::{fixture, read_npy_f32};
use serde_json::Value;

use crate::reference::{compare_logits, ids};

/// A margin (llama.cpp's top-1 minus top-2 logit) above which the greedy token must agree: well
/// above the largest |Δlogit| of any case below, so a disagreement there is a defect.
const CLEAR_MARGIN: f32 = 0.5;

/// (file, bound on the mean and the max |Δlogit| over every position and the whole vocabulary).
/// - F32 (every matrix f32, f32 activations in both engines): equal to the last bits (max
///   |Δ| 3e-6 on logits of std ~4: llama.cpp sums these short rows — 16 to 128 wide — in its
///   own SIMD order) — the architecture (norms, biases, RoPE style and factors, GQA, tied
///   heads, per-head norms) is llama.cpp's.
/// - Q8_0, Q6_K, Q5_0 and every K-quant mix: llama.cpp's int8 products and its float order
///   (`custody_kernels::q8k::KOrder` for the K-quants: its tiled path, its repacked Q4_K/Q2_K
///   GEMM and GEMV, by the batch's rows): bit for bit. Before the K-quants followed those
///   orders (2026-12-02, mean / max): llama-spm.Q4_K_M 0.018 / 0.34, qwen2.Q4_K_M 0.019 /
///   0.40, qwen3.Q4_K_M 0.043 / 0.33, llama-spm.Q2_K 0.009 / 0.21, on logits of standard
///   deviation ~4.
const CASES: &[(&str, f64, f64)] = &[
    ("llama-spm.F32", 1e-6, 1e-5),
    ("llama3.F32", 1e-6, 1e-5),
    ("qwen2.F32", 1e-6, 1e-5),
    ("qwen3.F32", 1e-6, 1e-5),
    ("llama-spm.Q8_0", 0.0, 0.0),
    ("llama3.Q6_K", 0.0, 0.0),
    ("qwen2.Q5_0", 0.0, 0.0),
    ("llama-spm.Q5_K_M", 0.0, 0.0),
    ("llama-spm.Q4_K_M", 0.0, 0.0),
    ("llama3.Q4_K_M", 0.0, 0.0),
    ("qwen2.Q4_K_M", 0.0, 0.0),
    ("qwen3.Q4_K_M", 0.0, 0.0),
    ("llama-spm.Q3_K_M", 0.0, 0.0),
    ("llama-spm.Q2_K", 0.0, 0.0),
];

fn json(name: &str) -> Value {
    serde_json::from_str(&std::fs::read_to_string(fixture(name)).expect("fixture")).expect("json")
}

fn cfg() -> EngineConfig {
    EngineConfig {
        kv_budget_mib: 16,
        ..EngineConfig::default()
    }
}

fn load(path: &Path, sha: &str) -> Model {
    let model = Model::load(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    assert_eq!(
        model.gguf().sha256_hex(),
        sha,
        "{}: not the file the fixture was made from",
        path.display()
    );
    model
}

#[test]
fn every_architecture_and_type_gives_llama_cpps_logits() {
    let mut failures = Vec::new();
    for &(name, mean_bound, max_bound) in CASES {
        let meta = json(&format!("arch/{name}.json"));
        let path = fixture(&format!("arch/{name}.gguf"));
        let model = load(&path, meta["sha256"].as_str().expect("sha"));
        let ids = ids(&meta["ids"]);
        let mut e = Engine::new(model, cfg()).expect("engine");
        if max_bound == 0.0 {
            // Bit for bit: served greedily (the prompt as one batch, then a decode step per
            // token, as llama.cpp generated the continuation), the tokens are llama.cpp's.
            let n_prompt = meta["n_prompt"].as_u64().expect("n_prompt") as usize;
            let served =
                crate::reference::greedy(&mut e, ids[..n_prompt].to_vec(), ids.len() - n_prompt);
            if served[..] != ids[n_prompt..] {
                failures.push(format!(
                    "{name}: served {served:?}, llama.cpp generated {:?}",
                    &ids[n_prompt..]
                ));
            }
        }
        let ours = e.score(&ids).expect("score");
        let (shape, theirs) = read_npy_f32(&fixture(&format!("arch/{name}.npy")));
        assert_eq!(shape, [ids.len(), ours.len() / ids.len()], "{name}");
        let vocab = shape[1];
        let (mean, max, _) = compare_logits(&ours, &theirs, vocab);
        let margins: Vec<f64> = meta["margin"]
            .as_array()
            .expect("margins")
            .iter()
            .map(|m| m.as_f64().expect("margin"))
            .collect();
        let argmax = ids_of(&meta["llamacpp_argmax"]);
        let (mut clear, mut agree) = (0, 0);
        for (p, &m) in margins.iter().enumerate() {
            let ours_top = custody_kernels::ops::argmax(&ours[p * vocab..(p + 1) * vocab]);
            if ours_top == Some(argmax[p]) {
                agree += 1;
            } else if m >= f64::from(CLEAR_MARGIN) {
                failures.push(format!(
                    "{name} position {p}: llama.cpp's top token {} by a margin of {m}, ours {ours_top:?}",
                    argmax[p]
                ));
            }
            clear += usize::from(m >= f64::from(CLEAR_MARGIN));
        }
        eprintln!(
            "{name}: {} positions, |dlogit| mean {mean:.4} max {max:.4}; greedy agrees at {agree}, \
             {clear} with a clear margin",
            ids.len()
        );
        if mean > mean_bound || max > max_bound {
            failures.push(format!(
                "{name}: |dlogit| mean {mean} max {max}, bounds {mean_bound} / {max_bound}"
            ));
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

fn ids_of(v: &Value) -> Vec<usize> {
    ids(v).into_iter().map(|i| i as usize).collect()
}

fn bytes_of(v: &Value) -> Vec<u8> {
    v.as_array()
        .expect("bytes")
        .iter()
        .map(|b| b.as_u64().expect("byte") as u8)
        .collect()
}

/// The tokenizer of `model`'s fixture files (every type of a model shares its vocabulary).
fn tokenizer(file: &str) -> Tokenizer {
    Tokenizer::from_gguf(&Gguf::open(&fixture(&format!("arch/{file}"))).expect("gguf"))
        .expect("tokenizer")
}

#[test]
fn every_vocabulary_tokenizes_and_detokenizes_as_llama_cpp() {
    for model in ["llama-spm", "llama3", "qwen2", "qwen3"] {
        let t = json(&format!("arch/{model}.tokenize.json"));
        let tok = tokenizer(t["file"].as_str().expect("file"));
        let texts = t["texts"].as_array().expect("texts");
        assert!(texts.len() >= 10, "{model}: a corpus, not a sample");
        for case in texts {
            let text = case["text"].as_str().expect("text");
            let raw = tok.encode(text, true).expect("encode");
            assert_eq!(raw, ids(&case["ids"]), "{model}: {text:?}");
            let with_bos = tok.encode(text, false).expect("encode");
            assert_eq!(with_bos, ids(&case["ids_bos"]), "{model} (BOS): {text:?}");
            let back = tok.decode(&raw).expect("decode");
            let want = String::from_utf8_lossy(&bytes_of(&case["detokenize_special"])).into_owned();
            assert_eq!(back, want, "{model}: detokenized {text:?}");
        }
        eprintln!("{model}: {} texts tokenized as llama.cpp does", texts.len());
    }
}

#[test]
fn every_chat_template_renders_as_llama_cpp_python_does() {
    for model in ["llama-spm", "llama3", "qwen2", "qwen3"] {
        let c = json(&format!("arch/{model}.chat.json"));
        let tok = tokenizer(c["file"].as_str().expect("file"));
        // Qwen 3's template also strips an earlier assistant turn's `<think>` block.
        for case in std::iter::once(&c).chain(c.get("think_case")) {
            let messages: Vec<custody_runtime::tokenizer::ChatMessage> =
                serde_json::from_value(case["messages"].clone()).expect("messages");
            let rendered = tok.apply_chat_template(&messages).expect("render");
            assert_eq!(
                rendered,
                case["rendered"].as_str().expect("rendered"),
                "{model}"
            );
            assert_eq!(
                tok.encode(&rendered, true).expect("encode"),
                ids(&case["ids"]),
                "{model}: the rendered chat's ids"
            );
        }
    }
}

/// The path a served request takes — its prompt in one batch (only the last row's logits), then
/// one decode step per token — gives llama.cpp's logits on that path bit for bit
/// (`scripts/llamacpp/gen_decode_reference.py`: SHA-256 of each row), on every quantized file:
/// its single-token attention, its GEMV and `vec_dot` K-quant orders (`q8k::KOrder::{Block,
/// Lanes}`), its last layer's feed-forward for the output row alone.
#[test]
fn the_decode_path_gives_llama_cpps_logits_bit_for_bit() {
    use custody_kernels::attention::{Reader, ReduceOrder, TagCheck};
    use custody_runtime::kv::PagePool;
    use custody_runtime::model::{Logits, Rows, Scratch, Segment};
    use sha2::{Digest, Sha256};

    const PAGE: usize = 16;
    let reference = json("arch/decode.json");
    let files = reference["files"].as_object().expect("files");
    assert!(files.len() >= 10, "every quantized fixture");
    let mut failures = Vec::new();
    for (name, r) in files {
        let meta = json(&format!("arch/{name}.json"));
        let model = load(
            &fixture(&format!("arch/{name}.gguf")),
            r["sha256"].as_str().expect("sha"),
        );
        let ids = ids(&meta["ids"]);
        let n_prompt = r["n_prompt"].as_u64().expect("n_prompt") as usize;
        let c = &model.config;
        let n_pages = ids.len().div_ceil(PAGE);
        let mut pool = PagePool::new(model.page_geometry(PAGE, KvType::F16), c.n_layers, n_pages);
        let table = pool.alloc(7, n_pages).expect("pages");
        let mut s = Scratch::default();
        let mut step = |tokens: &[u32], start_pos: usize, rows: Rows| {
            let seg = Segment {
                tokens,
                start_pos,
                block_table: &table,
                reader: Reader::private(7),
                logits: Logits::Last,
                order: if rows == Rows::Decode {
                    ReduceOrder::Vec
                } else {
                    ReduceOrder::Gemm
                },
                rows,
                check: TagCheck::Enforced,
            };
            let row = model
                .forward(&mut pool, &[seg], &mut s)
                .remove(0)
                .expect("tag check");
            let bytes: Vec<u8> = row.iter().flat_map(|v| v.to_le_bytes()).collect();
            hex(&Sha256::digest(&bytes))
        };
        let prompt = Rows::Prompt {
            len: n_prompt,
            chunk: 512,
        };
        let mut ours = vec![step(&ids[..n_prompt], 0, prompt)];
        for p in n_prompt..ids.len() - 1 {
            ours.push(step(&ids[p..=p], p, Rows::Decode));
        }
        let theirs: Vec<&str> = r["rows_sha256"]
            .as_array()
            .expect("rows")
            .iter()
            .map(|h| h.as_str().expect("hash"))
            .collect();
        assert_eq!(ours.len(), theirs.len(), "{name}");
        let differing: Vec<usize> = (0..ours.len()).filter(|&i| ours[i] != theirs[i]).collect();
        eprintln!(
            "{name}: {} decode-path rows, {} differ",
            ours.len(),
            differing.len()
        );
        if !differing.is_empty() {
            failures.push(format!(
                "{name}: rows {differing:?} differ from llama.cpp's"
            ));
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// A chat with tools — the first turn, then the call and its result in the history — renders
/// as llama-cpp-python renders it (its `tools` variable, Hugging Face's `tojson`), for each
/// tool format: Qwen 2.5 and 3 (the GGUF's template), Llama 3 and Mistral (templates given as
/// `[model] chat_template_file`), and tokenizes as llama.cpp tokenizes the rendering with the
/// tiny model's vocabulary. `scripts/llamacpp/gen_tool_fixtures.py` made the fixtures.
#[test]
fn tool_chats_render_as_llama_cpp_python_does() {
    use custody_runtime::tools::{ToolDef, ToolFormat};
    for (case, format) in [
        ("qwen2", ToolFormat::Hermes),
        ("qwen3", ToolFormat::Hermes),
        ("llama3", ToolFormat::Llama3Json),
        ("mistral", ToolFormat::Mistral),
    ] {
        let c = json(&format!("tools/{case}.json"));
        let mut tok = tokenizer(c["file"].as_str().expect("file"));
        if let Some(t) = c["template_file"].as_str() {
            tok.set_chat_template(
                std::fs::read_to_string(fixture(&format!("tools/{t}"))).expect("template"),
            );
        }
        assert_eq!(tok.tool_format(), Some(format), "{case}");
        let tools: Vec<ToolDef> = c["tools"]
            .as_array()
            .expect("tools")
            .iter()
            .map(|t| {
                let f = &t["function"];
                ToolDef {
                    name: f["name"].as_str().expect("name").into(),
                    description: f["description"].as_str().map(str::to_owned),
                    parameters: f["parameters"].clone(),
                    strict: false,
                }
            })
            .collect();
        let turns = c["turns"].as_array().expect("turns");
        assert_eq!(turns.len(), 2, "{case}: a first turn and a follow-up");
        for turn in turns {
            let messages: Vec<custody_runtime::ChatMessage> =
                serde_json::from_value(turn["messages"].clone()).expect("messages");
            let rendered = tok
                .apply_chat_template_tools(&messages, &tools)
                .expect("render");
            assert_eq!(
                rendered,
                turn["rendered"].as_str().expect("rendered"),
                "{case}"
            );
            assert_eq!(
                tok.encode_chat_tools(&messages, &tools).expect("encode"),
                ids(&turn["ids"]),
                "{case}: the rendered chat's ids, as llama.cpp tokenizes it"
            );
        }
    }
}

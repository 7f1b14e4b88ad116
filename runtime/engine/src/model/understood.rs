//! Every tensor and metadata key of a GGUF file is either read by the forward pass or known to
//! be irrelevant to its output; anything else is refused at load, by name.
//!
//! Why: a GGUF is a bag of named tensors and keys. An engine that ignores a tensor it does not
//! read for the declared architecture (a QKV bias in a `llama` file, per-head Q/K norms where
//! the spec has none) or a key that changes the arithmetic (`rope.scaling.type = yarn`) still
//! loads the file and generates fluent, plausible, wrong text, with no warning. Refusing is
//! the only safe answer until the engine implements what the file asks for. What a file may
//! carry is its architecture's [`super::arch::ArchSpec`]: Llama's tensors plus the spec's own.

use std::collections::BTreeSet;

use crate::gguf::{Gguf, Value};

use super::{ModelConfig, ModelError};

/// Keys under `<arch>.` the forward pass reads (`ModelConfig::from_gguf`).
const ARCH_KEYS_READ: &[&str] = &[
    "block_count",
    "context_length",
    "embedding_length",
    "feed_forward_length",
    "attention.head_count",
    "attention.head_count_kv",
    "attention.layer_norm_rms_epsilon",
    "rope.freq_base",
    "rope.dimension_count",
    // The head size where stated (`ModelConfig::head_dim`).
    "attention.key_length",
    "attention.value_length",
    // The tokenizer's token count is the vocabulary; this one only restates it.
    "vocab_size",
];

/// Tokenizer keys that are read (`tokenizer.rs`) or do not change token ids or logits (the
/// fill-in-the-middle ids, Hugging Face's copy of the tokenizer).
const TOKENIZER_KEYS: &[&str] = &[
    "tokenizer.ggml.model",
    "tokenizer.ggml.pre",
    "tokenizer.ggml.tokens",
    "tokenizer.ggml.scores",
    "tokenizer.ggml.token_type",
    "tokenizer.ggml.merges",
    "tokenizer.ggml.bos_token_id",
    "tokenizer.ggml.eos_token_id",
    "tokenizer.ggml.eot_token_id",
    "tokenizer.ggml.eom_token_id",
    "tokenizer.ggml.unknown_token_id",
    "tokenizer.ggml.padding_token_id",
    "tokenizer.ggml.separator_token_id",
    "tokenizer.ggml.add_bos_token",
    "tokenizer.ggml.add_eos_token",
    "tokenizer.ggml.add_space_prefix",
    "tokenizer.ggml.prefix_token_id",
    "tokenizer.ggml.suffix_token_id",
    "tokenizer.ggml.middle_token_id",
    "tokenizer.ggml.fim_pre_token_id",
    "tokenizer.ggml.fim_suf_token_id",
    "tokenizer.ggml.fim_mid_token_id",
    "tokenizer.ggml.fim_pad_token_id",
    "tokenizer.ggml.fim_rep_token_id",
    "tokenizer.ggml.fim_sep_token_id",
    "tokenizer.chat_template",
    "tokenizer.huggingface.json",
];

/// Why a tensor the forward pass does not read matters, for the tensors people meet.
fn tensor_hint(name: &str) -> &'static str {
    if name.ends_with(".bias") {
        "a bias this architecture's layers do not have (Q/K/V biases are read for qwen2)"
    } else if name.contains("attn_q_norm") || name.contains("attn_k_norm") {
        "a per-head Q/K RMSNorm this architecture does not have (read for qwen3)"
    } else {
        "a tensor this architecture's forward pass does not read"
    }
}

/// The tensors the forward pass reads for `c`: Llama's, plus what its architecture's spec adds.
fn tensors_read(c: &ModelConfig) -> BTreeSet<String> {
    let mut read: BTreeSet<String> = ["token_embd.weight", "output_norm.weight", "output.weight"]
        .into_iter()
        .map(str::to_owned)
        .collect();
    if c.spec.rope_freqs {
        read.insert(super::ROPE_FREQS.to_owned());
    }
    for i in 0..c.n_layers {
        for t in [
            "attn_norm",
            "attn_q",
            "attn_k",
            "attn_v",
            "attn_output",
            "ffn_norm",
            "ffn_gate",
            "ffn_up",
            "ffn_down",
        ] {
            read.insert(format!("blk.{i}.{t}.weight"));
        }
        for t in c.spec.extra_layer_tensors() {
            read.insert(format!("blk.{i}.{t}"));
        }
    }
    read
}

/// Refuse a file carrying anything the engine would silently ignore (module docs).
pub(super) fn check(g: &Gguf, c: &ModelConfig) -> Result<(), ModelError> {
    let read = tensors_read(c);
    if let Some(name) = g.tensors.keys().find(|n| !read.contains(*n)) {
        return Err(ModelError::NotUnderstood {
            what: format!("tensor {name:?}"),
            why: tensor_hint(name),
        });
    }
    let has_rope_freqs = g.tensors.contains_key(super::ROPE_FREQS);
    for (key, value) in &g.metadata {
        check_key(key, value, c, has_rope_freqs)?;
    }
    Ok(())
}

fn check_key(
    key: &str,
    value: &Value,
    c: &ModelConfig,
    has_rope_freqs: bool,
) -> Result<(), ModelError> {
    let refuse = |why: &'static str| {
        Err(ModelError::NotUnderstood {
            what: format!("metadata key {key:?}"),
            why,
        })
    };
    if key.starts_with("general.") || key.starts_with("quantize.") {
        // Provenance (names, licence, file type) and the quantizer's notes (imatrix): they
        // describe the file; the tensors' own types say how to read it.
        return Ok(());
    }
    if key.starts_with("tokenizer.") {
        if TOKENIZER_KEYS.contains(&key) || key.starts_with("tokenizer.chat_template.") {
            return Ok(());
        }
        return refuse("a tokenizer setting this engine does not apply");
    }
    if key == "split.count" {
        return match value.as_u64() {
            Some(1) => Ok(()),
            _ => refuse("a split GGUF (gguf-split); merge its parts into one file first"),
        };
    }
    if key.starts_with("split.") {
        return Ok(());
    }
    let Some(rest) = key.strip_prefix(&format!("{}.", c.arch)) else {
        return refuse("a key of no known namespace for this architecture");
    };
    if ARCH_KEYS_READ.contains(&rest) {
        return Ok(());
    }
    match rest {
        "rope.scaling.type" if matches!(value, Value::String(s) if s == "none") => Ok(()),
        // Llama 3's scaling is the per-pair factors of `rope_freqs.weight`, which the forward
        // pass applies; the type only names it (llama.cpp reads nothing else from it).
        "rope.scaling.type" if matches!(value, Value::String(s) if s == "llama3") => {
            if c.spec.rope_freqs && has_rope_freqs {
                Ok(())
            } else {
                refuse("Llama 3 RoPE scaling without its rope_freqs.weight factors")
            }
        }
        _ if rest.starts_with("rope.scaling.") => {
            refuse("RoPE scaling (linear, YaRN, Llama 3) that the forward pass would not apply")
        }
        _ if rest.starts_with("expert_") => {
            refuse("a mixture of experts, which this engine does not run")
        }
        _ => refuse("a hyper-parameter this engine does not apply"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf::write::Synthetic;
    use custody_kernels::DType;
    use custody_transport::Discard;

    fn synthetic() -> crate::gguf::write::GgufWriter {
        Synthetic::tiny(DType::Q8_0, 3).build()
    }

    fn load(w: &crate::gguf::write::GgufWriter) -> Result<crate::model::Model, ModelError> {
        let dir = std::env::temp_dir().join(format!("custody-understood-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let path = dir.join(format!("{}.gguf", rand_name()));
        w.write(&path).expect("write");
        let r = crate::model::Model::load(&path);
        std::fs::remove_file(&path).discard("a leftover temporary file is harmless");
        r
    }

    fn rand_name() -> String {
        use std::sync::atomic::{AtomicU32, Ordering};
        static N: AtomicU32 = AtomicU32::new(0);
        format!("m{}", N.fetch_add(1, Ordering::Relaxed))
    }

    #[test]
    fn a_file_of_only_read_tensors_and_known_keys_loads() {
        load(&synthetic()).expect("the synthetic model is fully understood");
    }

    #[test]
    fn an_unread_tensor_is_refused_by_name() {
        for (name, hint) in [
            ("blk.0.attn_q.bias", "read for qwen2"),
            ("blk.0.ffn_gate_inp.weight", "does not read"),
            ("blk.1.attn_k_norm.weight", "read for qwen3"),
            ("blk.0.mystery.weight", "does not read"),
        ] {
            let mut w = synthetic();
            w.tensor(name, 1, 32, DType::F32, &[0.5; 32]);
            let err = load(&w).expect_err(name).to_string();
            assert!(err.contains(name) && err.contains(hint), "{name}: {err}");
        }
    }

    /// `rope_freqs.weight` is read, not refused: factors of 1 leave the logits as they are (bit
    /// for bit), other factors move them, and a tensor of the wrong length is refused.
    #[test]
    fn rope_frequency_factors_are_applied() {
        let score = |factors: Option<&[f32]>| {
            let mut w = synthetic();
            if let Some(f) = factors {
                w.tensor(super::super::ROPE_FREQS, 1, f.len(), DType::F32, f);
            }
            let model = load(&w).expect("loads");
            let cfg = crate::EngineConfig {
                kv_budget_mib: 4,
                ..crate::EngineConfig::default()
            };
            let mut e = crate::Engine::new(model, cfg).expect("engine");
            e.score(&[1, 5, 9, 33, 70, 2, 200, 17]).expect("score")
        };
        let half_dims = 8; // head dim 16 (64 / 4 heads), all rotated
        let plain = score(None);
        assert_eq!(score(Some(&vec![1.0; half_dims])), plain);
        let f: Vec<f32> = (0..half_dims).map(|i| 1.0 + i as f32).collect();
        assert_ne!(
            score(Some(&f)),
            plain,
            "factors other than 1 must change the logits"
        );
        let mut w = synthetic();
        w.tensor(super::super::ROPE_FREQS, 1, 3, DType::F32, &[1.0; 3]);
        let err = load(&w).expect_err("3 factors for 8 pairs").to_string();
        assert!(err.contains("rope_freqs"), "{err}");
    }

    /// An architecture with no spec is refused naming it and the supported ones — before any
    /// tensor is read, whatever its tensors look like.
    #[test]
    fn an_unknown_architecture_is_refused_by_name() {
        for arch in ["gemma3", "phi3", "qwen2moe", "mamba"] {
            let mut w = synthetic();
            w.meta("general.architecture", Value::String(arch.into()));
            let err = load(&w).expect_err(arch).to_string();
            assert!(
                err.contains(arch) && err.contains("llama, mistral, qwen2, qwen3"),
                "{arch}: {err}"
            );
        }
    }

    /// A spec's extra tensors are required: a qwen2 file without its biases, or a qwen3 file
    /// without its Q/K norms, is refused naming the missing tensor (not run without them).
    #[test]
    fn an_architectures_own_tensors_are_required() {
        for (arch, missing) in [
            ("qwen2", "blk.0.attn_q.bias"),
            ("qwen3", "blk.0.attn_q_norm"),
        ] {
            let mut w = synthetic();
            w.meta("general.architecture", Value::String(arch.into()))
                .rename_meta_prefix("llama.", &format!("{arch}."));
            let err = load(&w).expect_err(arch).to_string();
            assert!(err.contains(missing), "{arch}: {err}");
        }
    }

    #[test]
    fn a_key_that_would_change_the_arithmetic_is_refused_by_name() {
        for (key, value) in [
            ("llama.rope.scaling.type", Value::String("yarn".into())),
            ("llama.rope.scaling.factor", Value::F32(8.0)),
            ("llama.expert_count", Value::U32(8)),
            ("llama.attention.value_length", Value::U32(7)),
            ("llama.sliding_window", Value::U32(4096)),
            ("tokenizer.ggml.remove_extra_whitespaces", Value::Bool(true)),
            ("qwen2.block_count", Value::U32(2)),
            ("split.count", Value::U16(2)),
        ] {
            let mut w = synthetic();
            w.meta(key, value);
            let err = load(&w).expect_err(key).to_string();
            assert!(err.contains(key), "{key}: {err}");
        }
        // Llama 3 scaling is accepted exactly when its factors are in the file.
        let mut w = synthetic();
        w.meta("llama.rope.scaling.type", Value::String("llama3".into()));
        let err = load(&w)
            .expect_err("llama3 scaling, no factors")
            .to_string();
        assert!(
            err.contains("rope.scaling.type") && err.contains("rope_freqs"),
            "{err}"
        );
        w.tensor(super::super::ROPE_FREQS, 1, 8, DType::F32, &[1.0; 8]);
        load(&w).expect("llama3 scaling with its factors loads");
        let mut w = synthetic();
        w.meta("llama.rope.scaling.type", Value::String("none".into()));
        w.meta("general.license", Value::String("apache-2.0".into()));
        w.meta("quantize.imatrix.file", Value::String("x.dat".into()));
        load(&w).expect("harmless keys load");
    }
}

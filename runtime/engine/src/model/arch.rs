//! Architectures as data: how each supported GGUF architecture's layer differs from Llama's.
//!
//! The forward pass is one function; it reads an [`ArchSpec`] and never matches on an
//! architecture's name. The loader reads exactly the tensors a spec names (and
//! `understood.rs` refuses any other), so a spec is also the list of what a file of that
//! architecture may carry. Adding an architecture is adding a row here when its differences are
//! among the switches below; anything else (sliding windows, experts, other norms) is a new
//! switch with its own code and test, never a silent approximation.

use custody_kernels::ops::RopeStyle;

/// One architecture's differences from Llama.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ArchSpec {
    /// `general.architecture` values this spec serves (the first is its name).
    pub names: &'static [&'static str],
    /// Which dims RoPE rotates together: adjacent pairs (Llama) or halves (GPT-NeoX: Qwen).
    pub rope: RopeStyle,
    /// Q, K and V projections carry biases (`blk.N.attn_{q,k,v}.bias`), added after the matmul.
    pub qkv_bias: bool,
    /// Each head of Q and K is RMS-normalised with its own weights (`blk.N.attn_{q,k}_norm`)
    /// after the projection and before RoPE (Qwen 3).
    pub qk_norm: bool,
    /// The file may carry Llama 3's RoPE frequency factors (`rope_freqs.weight`).
    pub rope_freqs: bool,
}

/// Llama 1/2/3, Mistral-style and SmolLM GGUFs (`llama`; `mistral` as some converters name it).
pub const LLAMA: ArchSpec = ArchSpec {
    names: &["llama", "mistral"],
    rope: RopeStyle::Normal,
    qkv_bias: false,
    qk_norm: false,
    rope_freqs: true,
};

/// Qwen 2 / 2.5: Llama with Q/K/V biases and NeoX RoPE.
pub const QWEN2: ArchSpec = ArchSpec {
    names: &["qwen2"],
    rope: RopeStyle::Neox,
    qkv_bias: true,
    qk_norm: false,
    rope_freqs: false,
};

/// Qwen 3 (dense): Llama with per-head Q/K RMSNorm and NeoX RoPE; its head size is stated
/// (`attention.key_length`), not derived, and Q may be wider than the embedding.
pub const QWEN3: ArchSpec = ArchSpec {
    names: &["qwen3"],
    rope: RopeStyle::Neox,
    qkv_bias: false,
    qk_norm: true,
    rope_freqs: false,
};

/// Every architecture the engine runs.
pub const SUPPORTED: &[ArchSpec] = &[LLAMA, QWEN2, QWEN3];

impl ArchSpec {
    /// The spec serving `general.architecture = name`, if any.
    pub fn find(name: &str) -> Option<&'static ArchSpec> {
        SUPPORTED.iter().find(|s| s.names.contains(&name))
    }

    /// The spec's own name.
    pub fn name(&self) -> &'static str {
        self.names[0]
    }

    /// Per-layer tensors (`blk.N.<role>.<kind>`) beyond Llama's, as (role, kind) pairs.
    pub fn extra_layer_tensors(&self) -> impl Iterator<Item = &'static str> {
        let bias = self
            .qkv_bias
            .then_some(["attn_q.bias", "attn_k.bias", "attn_v.bias"].as_slice());
        let norm = self
            .qk_norm
            .then_some(["attn_q_norm.weight", "attn_k_norm.weight"].as_slice());
        bias.into_iter().chain(norm).flatten().copied()
    }
}

/// The names of every supported architecture, for error messages.
pub fn supported_names() -> String {
    SUPPORTED
        .iter()
        .flat_map(|s| s.names.iter().copied())
        .collect::<Vec<_>>()
        .join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_name_finds_its_own_spec_and_no_name_is_served_twice() {
        let mut seen = std::collections::BTreeSet::new();
        for s in SUPPORTED {
            for n in s.names {
                assert!(seen.insert(*n), "{n} served twice");
                assert_eq!(ArchSpec::find(n), Some(s));
            }
        }
        assert_eq!(ArchSpec::find("gemma3"), None);
    }

    #[test]
    fn extra_tensors_follow_the_switches() {
        assert_eq!(LLAMA.extra_layer_tensors().count(), 0);
        let q2: Vec<_> = QWEN2.extra_layer_tensors().collect();
        assert_eq!(q2, ["attn_q.bias", "attn_k.bias", "attn_v.bias"]);
        let q3: Vec<_> = QWEN3.extra_layer_tensors().collect();
        assert_eq!(q3, ["attn_q_norm.weight", "attn_k_norm.weight"]);
    }
}

//! Writing GGUF v3 files, and synthetic Llama-family models built with it: a few layers, small
//! dimensions, seeded random weights quantized to the model's own GGUF types (block layouts and
//! rounding as ggml's reference quantizers). For tests that need a model other than the
//! embedded one (the CUDA forward pass on the shim, a model small enough to carry to a GPU),
//! never a hub download.
//!
//! # Spec
//! - [`GgufWriter::to_bytes`] is read back by [`super::Gguf`] exactly: every key with its type,
//!   every tensor with its shape, type and bytes (tests below).
//! - [`Synthetic::build`] is deterministic in its seed.

use std::path::Path;

use custody_kernels::DType;
use half::f16;

use super::Value;

/// A GGUF file being assembled.
#[derive(Debug, Default)]
pub struct GgufWriter {
    metadata: Vec<(String, Value)>,
    tensors: Vec<PendingTensor>,
}

#[derive(Debug)]
struct PendingTensor {
    name: String,
    /// GGUF order: the fastest-varying dimension first.
    shape: Vec<u64>,
    dtype: DType,
    bytes: Vec<u8>,
}

/// Tensor data is aligned to this many bytes (`general.alignment`'s default).
const ALIGNMENT: usize = 32;

fn type_code(v: &Value) -> u32 {
    match v {
        Value::U8(_) => 0,
        Value::I8(_) => 1,
        Value::U16(_) => 2,
        Value::I16(_) => 3,
        Value::U32(_) => 4,
        Value::I32(_) => 5,
        Value::F32(_) => 6,
        Value::Bool(_) => 7,
        Value::String(_) => 8,
        Value::Array(_) => 9,
        Value::U64(_) => 10,
        Value::I64(_) => 11,
        Value::F64(_) => 12,
    }
}

fn dtype_code(d: DType) -> u32 {
    d.ggml_type()
}

fn put_string(out: &mut Vec<u8>, s: &str) {
    out.extend((s.len() as u64).to_le_bytes());
    out.extend(s.as_bytes());
}

fn put_value(out: &mut Vec<u8>, v: &Value) {
    match v {
        Value::U8(x) => out.push(*x),
        Value::I8(x) => out.extend(x.to_le_bytes()),
        Value::U16(x) => out.extend(x.to_le_bytes()),
        Value::I16(x) => out.extend(x.to_le_bytes()),
        Value::U32(x) => out.extend(x.to_le_bytes()),
        Value::I32(x) => out.extend(x.to_le_bytes()),
        Value::F32(x) => out.extend(x.to_le_bytes()),
        Value::Bool(x) => out.push(u8::from(*x)),
        Value::String(s) => put_string(out, s),
        Value::Array(items) => {
            // GGUF arrays are homogeneous: the first element's type (u8 for an empty array).
            let ty = items.first().map_or(0, type_code);
            assert!(
                items.iter().all(|i| type_code(i) == ty),
                "mixed-type GGUF array"
            );
            out.extend(ty.to_le_bytes());
            out.extend((items.len() as u64).to_le_bytes());
            items.iter().for_each(|i| put_value(out, i));
        }
        Value::U64(x) => out.extend(x.to_le_bytes()),
        Value::I64(x) => out.extend(x.to_le_bytes()),
        Value::F64(x) => out.extend(x.to_le_bytes()),
    }
}

impl GgufWriter {
    pub fn new() -> Self {
        Self::default()
    }

    /// Set `key` (replacing an earlier value of it: a GGUF names each key once).
    pub fn meta(&mut self, key: &str, v: Value) -> &mut Self {
        self.metadata.retain(|(k, _)| k != key);
        self.metadata.push((key.to_owned(), v));
        self
    }

    /// Move every key under `from` (e.g. `llama.`) to `to` (`qwen2.`): the same model as
    /// another architecture declares it.
    pub fn rename_meta_prefix(&mut self, from: &str, to: &str) -> &mut Self {
        for (k, _) in &mut self.metadata {
            if let Some(rest) = k.strip_prefix(from) {
                *k = format!("{to}{rest}");
            }
        }
        self
    }

    /// A tensor of `rows × cols` values (`cols` fastest), quantized to `dtype`.
    pub fn tensor(&mut self, name: &str, rows: usize, cols: usize, dtype: DType, values: &[f32]) {
        assert_eq!(values.len(), rows * cols, "{name}");
        let shape = if rows == 1 {
            vec![cols as u64]
        } else {
            vec![cols as u64, rows as u64]
        };
        let mut bytes = Vec::new();
        for row in values.chunks(cols) {
            quantize_row(dtype, row, &mut bytes);
        }
        self.tensors.push(PendingTensor {
            name: name.to_owned(),
            shape,
            dtype,
            bytes,
        });
    }

    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::new();
        out.extend(b"GGUF");
        out.extend(3u32.to_le_bytes());
        out.extend((self.tensors.len() as u64).to_le_bytes());
        out.extend((self.metadata.len() as u64).to_le_bytes());
        for (k, v) in &self.metadata {
            put_string(&mut out, k);
            out.extend(type_code(v).to_le_bytes());
            put_value(&mut out, v);
        }
        let mut offset = 0usize;
        for t in &self.tensors {
            put_string(&mut out, &t.name);
            out.extend((t.shape.len() as u32).to_le_bytes());
            t.shape.iter().for_each(|d| out.extend(d.to_le_bytes()));
            out.extend(dtype_code(t.dtype).to_le_bytes());
            out.extend((offset as u64).to_le_bytes());
            offset = (offset + t.bytes.len()).next_multiple_of(ALIGNMENT);
        }
        out.resize(out.len().next_multiple_of(ALIGNMENT), 0);
        for t in &self.tensors {
            out.extend(&t.bytes);
            out.resize(out.len().next_multiple_of(ALIGNMENT), 0);
        }
        out
    }

    pub fn write(&self, path: &Path) -> std::io::Result<()> {
        std::fs::write(path, self.to_bytes())
    }
}

/// Append one row of `x` in `dtype`'s GGUF encoding (ggml's reference quantizers).
///
/// # Panics
/// For Q5_0, Q5_1 and the K-quants, which this writer has no quantizer for (tests take such
/// blocks from llama.cpp's own quantizer).
pub fn quantize_row(dtype: DType, x: &[f32], out: &mut Vec<u8>) {
    const QK: usize = 32;
    let half = |v: f32| f16::from_f32(v).to_le_bytes();
    match dtype {
        DType::F32 => x.iter().for_each(|v| out.extend(v.to_le_bytes())),
        DType::F16 => x.iter().for_each(|&v| out.extend(half(v))),
        DType::Q4_0 => {
            assert!(x.len().is_multiple_of(QK));
            for b in x.chunks(QK) {
                // The value of largest magnitude maps to -8.
                let max = b
                    .iter()
                    .fold(0.0f32, |m, &v| if v.abs() > m.abs() { v } else { m });
                let d = max / -8.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                out.extend(half(d));
                let q = |v: f32| ((v * id + 8.5) as i32).clamp(0, 15) as u8;
                for j in 0..QK / 2 {
                    out.push(q(b[j]) | (q(b[j + QK / 2]) << 4));
                }
            }
        }
        DType::Q4_1 => {
            assert!(x.len().is_multiple_of(QK));
            for b in x.chunks(QK) {
                let min = b.iter().copied().fold(f32::INFINITY, f32::min);
                let max = b.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let d = (max - min) / 15.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                out.extend(half(d));
                out.extend(half(min));
                let q = |v: f32| (((v - min) * id + 0.5) as i32).clamp(0, 15) as u8;
                for j in 0..QK / 2 {
                    out.push(q(b[j]) | (q(b[j + QK / 2]) << 4));
                }
            }
        }
        DType::Q8_0 => {
            assert!(x.len().is_multiple_of(QK));
            for b in x.chunks(QK) {
                let amax = b.iter().fold(0.0f32, |m, &v| m.max(v.abs()));
                let d = amax / 127.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                out.extend(half(d));
                out.extend(b.iter().map(|&v| (v * id).round() as i8 as u8));
            }
        }
        // ggml's `GGML_FP32_TO_BF16`: round to nearest even (NaN kept quiet).
        DType::BF16 => x.iter().for_each(|&v| {
            let b = v.to_bits();
            let h = if v.is_nan() {
                (b >> 16) | 64
            } else {
                (b + (0x7fff + ((b >> 16) & 1))) >> 16
            };
            out.extend((h as u16).to_le_bytes());
        }),
        DType::Q4_K => x.chunks(256).for_each(|b| quantize_q4k_block(b, out)),
        DType::Q5_0 | DType::Q5_1 | DType::Q5_K | DType::Q6_K | DType::Q2_K | DType::Q3_K => {
            panic!("the GGUF writer has no quantizer for {dtype:?}")
        }
    }
}

/// One Q4_K super-block (256 values): per 32-value sub-block a 6-bit scale and min, relative
/// to the block's f16 `d` and `dmin`; x ≈ d·sc·q − dmin·m, q in 0..16. A plain
/// min/max quantizer (not llama.cpp's search): synthetic weights need the layout, not its best
/// rounding.
fn quantize_q4k_block(b: &[f32], out: &mut Vec<u8>) {
    assert_eq!(b.len(), 256, "Q4_K rows are whole 256-value super-blocks");
    let mut scale = [0.0f32; 8];
    let mut min = [0.0f32; 8];
    for (j, sub) in b.chunks(32).enumerate() {
        let lo = sub.iter().copied().fold(0.0f32, f32::min);
        let hi = sub.iter().copied().fold(0.0f32, f32::max);
        scale[j] = (hi - lo) / 15.0;
        min[j] = -lo;
    }
    let d = scale.iter().copied().fold(0.0f32, f32::max) / 63.0;
    let dmin = min.iter().copied().fold(0.0f32, f32::max) / 63.0;
    // The f16 values the reader will use.
    let (d, dmin) = (f16::from_f32(d).to_f32(), f16::from_f32(dmin).to_f32());
    let six = |v: f32, unit: f32| {
        if unit > 0.0 {
            (v / unit).round().clamp(0.0, 63.0) as u8
        } else {
            0
        }
    };
    let sc: Vec<u8> = scale.iter().map(|&v| six(v, d)).collect();
    let m: Vec<u8> = min.iter().map(|&v| six(v, dmin)).collect();
    out.extend(f16::from_f32(d).to_le_bytes());
    out.extend(f16::from_f32(dmin).to_le_bytes());
    let mut packed = [0u8; 12];
    for j in 0..4 {
        packed[j] = (sc[j] & 63) | ((sc[j + 4] >> 4) << 6);
        packed[j + 4] = (m[j] & 63) | ((m[j + 4] >> 4) << 6);
        packed[j + 8] = (sc[j + 4] & 0xf) | ((m[j + 4] & 0xf) << 4);
    }
    out.extend(packed);
    let q = |k: usize| {
        let j = k / 32;
        let step = d * f32::from(sc[j]);
        if step == 0.0 {
            return 0u8;
        }
        ((b[k] + dmin * f32::from(m[j])) / step)
            .round()
            .clamp(0.0, 15.0) as u8
    };
    for c in 0..4 {
        for l in 0..32 {
            out.push(q(64 * c + l) | (q(64 * c + 32 + l) << 4));
        }
    }
}

/// A synthetic Llama-family model's shape, weight type and seed.
#[derive(Clone, Debug)]
pub struct Synthetic {
    pub n_layers: usize,
    pub dim: usize,
    pub ffn_dim: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub vocab: usize,
    pub context_length: usize,
    /// The projection and FFN matrices' type (embeddings and output: the same; norms: F32).
    pub dtype: DType,
    /// A separate `output.weight` (else tied to the embeddings).
    pub untied_output: bool,
    pub seed: u64,
}

impl Synthetic {
    /// Two layers, dim 64 (4 heads of 16, 2 KV heads), FFN 128, vocabulary 256.
    pub fn tiny(dtype: DType, seed: u64) -> Self {
        Self {
            n_layers: 2,
            dim: 64,
            ffn_dim: 128,
            n_heads: 4,
            n_kv_heads: 2,
            vocab: 256,
            context_length: 512,
            dtype,
            untied_output: true,
            seed,
        }
    }

    /// The model as a GGUF file.
    pub fn build(&self) -> GgufWriter {
        let mut w = GgufWriter::new();
        let mut rng = SplitMix(self.seed);
        let u32v = |v: usize| Value::U32(v as u32);
        w.meta("general.architecture", Value::String("llama".into()))
            .meta(
                "general.name",
                Value::String(format!("synthetic-{:?}-{}", self.dtype, self.seed)),
            )
            .meta("llama.block_count", u32v(self.n_layers))
            .meta("llama.embedding_length", u32v(self.dim))
            .meta("llama.feed_forward_length", u32v(self.ffn_dim))
            .meta("llama.attention.head_count", u32v(self.n_heads))
            .meta("llama.attention.head_count_kv", u32v(self.n_kv_heads))
            .meta("llama.context_length", u32v(self.context_length))
            .meta("llama.rope.freq_base", Value::F32(10_000.0))
            .meta("llama.attention.layer_norm_rms_epsilon", Value::F32(1e-5))
            .meta("tokenizer.ggml.model", Value::String("gpt2".into()))
            .meta(
                "tokenizer.ggml.tokens",
                Value::Array(
                    (0..self.vocab)
                        .map(|i| Value::String(format!("<t{i}>")))
                        .collect(),
                ),
            );
        let (d, f, v) = (self.dim, self.ffn_dim, self.vocab);
        let head_dim = d / self.n_heads;
        let kvd = self.n_kv_heads * head_dim;
        // Scales that keep activations O(1) through the layers (1/sqrt(fan-in)).
        let mut mat = |w: &mut GgufWriter, name: &str, rows: usize, cols: usize, dtype: DType| {
            let s = 1.0 / (cols as f32).sqrt();
            let vals: Vec<f32> = (0..rows * cols).map(|_| rng.uniform() * s * 1.7).collect();
            w.tensor(name, rows, cols, dtype, &vals);
        };
        mat(&mut w, "token_embd.weight", v, d, self.dtype);
        for i in 0..self.n_layers {
            let n = |s: &str| format!("blk.{i}.{s}.weight");
            mat(&mut w, &n("attn_q"), d, d, self.dtype);
            mat(&mut w, &n("attn_k"), kvd, d, self.dtype);
            mat(&mut w, &n("attn_v"), kvd, d, self.dtype);
            mat(&mut w, &n("attn_output"), d, d, self.dtype);
            mat(&mut w, &n("ffn_gate"), f, d, self.dtype);
            mat(&mut w, &n("ffn_up"), f, d, self.dtype);
            mat(&mut w, &n("ffn_down"), d, f, self.dtype);
        }
        if self.untied_output {
            mat(&mut w, "output.weight", v, d, self.dtype);
        }
        let mut norm = |w: &mut GgufWriter, name: &str| {
            let vals: Vec<f32> = (0..d).map(|_| 1.0 + 0.2 * rng.uniform()).collect();
            w.tensor(name, 1, d, DType::F32, &vals);
        };
        for i in 0..self.n_layers {
            norm(&mut w, &format!("blk.{i}.attn_norm.weight"));
            norm(&mut w, &format!("blk.{i}.ffn_norm.weight"));
        }
        norm(&mut w, "output_norm.weight");
        w
    }
}

/// SplitMix64: a seeded, dependency-free generator for weights.
#[derive(Debug)]
struct SplitMix(u64);

impl SplitMix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [-1, 1).
    fn uniform(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf::Gguf;
    use crate::model::{Model, ModelConfig};
    use custody_transport::Discard;

    fn read_back(w: &GgufWriter) -> Gguf {
        let dir = std::env::temp_dir().join(format!("custody-gguf-write-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let path = dir.join(format!("{:p}.gguf", w));
        w.write(&path).expect("write");
        let g = Gguf::open(&path).expect("read back");
        std::fs::remove_dir_all(&dir).discard("a leftover temporary directory is harmless");
        g
    }

    /// The Q4_K writer's blocks read back through the engine's dequantization within the
    /// quantization step of each sub-block (range / 15, plus the 6-bit scale's rounding).
    #[test]
    fn q4k_blocks_dequantize_to_their_values() {
        let x: Vec<f32> = (0..512)
            .map(|i| ((i * 37 % 101) as f32 / 50.0) - 1.0)
            .collect();
        let mut bytes = Vec::new();
        quantize_row(DType::Q4_K, &x, &mut bytes);
        assert_eq!(bytes.len(), 2 * 144);
        let mut back = vec![0.0f32; 512];
        custody_kernels::quant::dequantize_row(DType::Q4_K, &bytes, &mut back);
        let worst = x
            .iter()
            .zip(&back)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f32, f32::max);
        assert!(worst < 0.15, "max |Δ| {worst}");
    }

    #[test]
    fn what_is_written_reads_back() {
        let mut w = GgufWriter::new();
        w.meta("a.u32", Value::U32(7))
            .meta("a.f32", Value::F32(0.5))
            .meta("a.s", Value::String("x".into()))
            .meta("a.arr", Value::Array(vec![Value::I32(-1), Value::I32(2)]));
        let vals: Vec<f32> = (0..64).map(|i| i as f32 / 8.0 - 4.0).collect();
        w.tensor("t.f32", 2, 32, DType::F32, &vals);
        w.tensor("t.q8", 2, 32, DType::Q8_0, &vals);
        let g = read_back(&w);
        assert_eq!(g.get_u64("a.u32").expect("u32"), 7);
        assert_eq!(g.get_str("a.s").expect("s"), "x");
        assert_eq!(g.get_array("a.arr").expect("arr").len(), 2);
        let (info, bytes) = g.tensor("t.f32").expect("f32");
        assert_eq!(info.shape, [32, 2]);
        assert_eq!(bytes.len(), 256);
        assert_eq!(
            f32::from_le_bytes(bytes[4..8].try_into().expect("4")),
            vals[1]
        );
        let (info, bytes) = g.tensor("t.q8").expect("q8");
        assert_eq!((info.dtype, bytes.len()), (DType::Q8_0, 68));
    }

    /// Each quantizer's blocks dequantize (with the engine's own dequantizer) to within the
    /// type's step of the input.
    #[test]
    fn quantized_rows_dequantize_close_to_their_input() {
        let x: Vec<f32> = (0..128)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 25.0)
            .collect();
        for (dtype, tol) in [
            (DType::F32, 0.0),
            (DType::F16, 2e-3),
            (DType::Q8_0, 0.02),
            (DType::Q4_1, 0.15),
            (DType::Q4_0, 0.3),
        ] {
            let mut bytes = Vec::new();
            quantize_row(dtype, &x, &mut bytes);
            let mut back = vec![0.0; x.len()];
            custody_kernels::quant::dequantize_row(dtype, &bytes, &mut back);
            let err = x
                .iter()
                .zip(&back)
                .fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
            assert!(err <= tol, "{dtype:?}: max error {err}");
        }
    }

    #[test]
    fn a_synthetic_model_loads_as_the_shape_it_was_built_with() {
        for dtype in [
            DType::F32,
            DType::F16,
            DType::Q4_0,
            DType::Q4_1,
            DType::Q8_0,
        ] {
            let s = Synthetic::tiny(dtype, 3);
            let m = Model::from_gguf(read_back(&s.build())).expect("loads");
            let c: &ModelConfig = &m.config;
            assert_eq!(
                (c.n_layers, c.dim, c.n_kv_heads, c.head_dim),
                (2, 64, 2, 16)
            );
            assert_eq!((c.vocab_size, c.ffn_dim), (256, 128));
            assert_eq!(m.weight_dtype(), dtype);
        }
        assert_eq!(
            Synthetic::tiny(DType::Q8_0, 9).build().to_bytes(),
            Synthetic::tiny(DType::Q8_0, 9).build().to_bytes(),
            "deterministic in its seed"
        );
    }
}

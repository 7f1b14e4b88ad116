//! The model — Llama and the variants `model/arch.rs` describes: configuration and weights from
//! GGUF, and the batched forward pass
//! over the tagged KV page pool.
//!
//! One forward call runs a batch of *segments* — each a run of consecutive tokens of one sequence
//! (a whole prompt, a prefill chunk, or one decode token) — through every layer together: the
//! linear layers see all rows of the batch at once (weight reuse), attention runs per segment over
//! that segment's own pages. A segment whose page tags fail the check is marked failed at the
//! first layer that notices; its rows are still carried through the linear layers (they are
//! independent rows) but it writes no further KV and returns no logits.

pub mod arch;
mod understood;

use std::path::Path;
use std::sync::Arc;

use custody_kernels::attention::{
    AttnScratch, IntegrityError, KvType, PageGeometry, PageRef, Reader, ReduceOrder, TagCheck,
};
use custody_kernels::matmul::matmul_many;
use custody_kernels::q8k::RowBatch;
use custody_kernels::{DType, PackedRows, QInput, QMatrix, ops};

pub use self::arch::ArchSpec;
use crate::gguf::{Gguf, GgufError};
use crate::kv::{AttendRead, PagePool};

#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error(transparent)]
    Gguf(#[from] GgufError),
    #[error("unsupported architecture {0:?} (supported: {names})", names = arch::supported_names())]
    UnsupportedArch(String),
    #[error("tensor {name:?}: shape {found:?}, expected {expected:?}")]
    Shape {
        name: String,
        expected: Vec<u64>,
        found: Vec<u64>,
    },
    #[error("invalid hyper-parameter: {0}")]
    Config(String),
    /// Something in the file the engine would otherwise ignore (`model/understood.rs`).
    #[error("{what}: {why}; refused rather than ignored (ignoring it gives plausible, wrong text)")]
    NotUnderstood { what: String, why: &'static str },
}

/// Hyper-parameters read from GGUF metadata.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    /// `general.architecture` as the file states it: the prefix of its hyper-parameter keys.
    pub arch: String,
    /// What the forward pass does differently for this architecture.
    pub spec: &'static ArchSpec,
    pub name: String,
    pub n_layers: usize,
    pub dim: usize,
    pub ffn_dim: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub rope_dims: usize,
    pub rope_base: f32,
    pub rms_eps: f32,
    pub context_length: usize,
    pub vocab_size: usize,
}

impl ModelConfig {
    pub fn from_gguf(g: &Gguf) -> Result<Self, ModelError> {
        let arch = g.get_str("general.architecture")?.to_owned();
        let spec =
            ArchSpec::find(&arch).ok_or_else(|| ModelError::UnsupportedArch(arch.clone()))?;
        let k = |s: &str| format!("{arch}.{s}");
        let u = |s: &str| g.get_u64(&k(s)).map(|v| v as usize);
        let n_heads = u("attention.head_count")?;
        let dim = u("embedding_length")?;
        let head_dim = Self::head_dim(g, &arch, dim, n_heads)?;
        let n_kv_heads = u("attention.head_count_kv").unwrap_or(n_heads);
        if n_kv_heads == 0 || n_heads % n_kv_heads != 0 {
            return Err(ModelError::Config(format!(
                "{n_heads} heads not a multiple of {n_kv_heads} kv heads"
            )));
        }
        let rope_dims = u("rope.dimension_count").unwrap_or(head_dim);
        if rope_dims > head_dim || rope_dims % 2 != 0 || head_dim > MAX_HEAD_DIM {
            return Err(ModelError::Config(format!(
                "rope dims {rope_dims} / head dim {head_dim}"
            )));
        }
        let vocab_size = g.get_array("tokenizer.ggml.tokens")?.len();
        let cfg = Self {
            name: g.get_str("general.name").unwrap_or("unnamed").to_owned(),
            n_layers: u("block_count")?,
            dim,
            ffn_dim: u("feed_forward_length")?,
            n_heads,
            n_kv_heads,
            head_dim,
            rope_dims,
            spec,
            rope_base: g.get_f64(&k("rope.freq_base")).unwrap_or(10_000.0) as f32,
            rms_eps: g
                .get_f64(&k("attention.layer_norm_rms_epsilon"))
                .unwrap_or(1e-5) as f32,
            context_length: u("context_length")?,
            vocab_size,
            arch,
        };
        if cfg.n_layers == 0 || cfg.n_layers > 1024 || cfg.context_length == 0 {
            return Err(ModelError::Config(format!(
                "{} layers, context {}",
                cfg.n_layers, cfg.context_length
            )));
        }
        Ok(cfg)
    }

    /// The head size: stated by `attention.key_length` (Qwen 3, where Q is wider than the
    /// embedding), else the embedding split across the heads. Keys and values of different
    /// sizes are refused: the KV pages hold one size for both.
    fn head_dim(g: &Gguf, arch: &str, dim: usize, n_heads: usize) -> Result<usize, ModelError> {
        if n_heads == 0 {
            return Err(ModelError::Config("0 attention heads".into()));
        }
        let key = |s: &str| g.get_u64(&format!("{arch}.attention.{s}")).ok();
        match (key("key_length"), key("value_length")) {
            (None, None) if dim.is_multiple_of(n_heads) => Ok(dim / n_heads),
            (None, None) => Err(ModelError::Config(format!(
                "embedding length {dim} not divisible by {n_heads} heads"
            ))),
            (Some(k), Some(v)) if k == v && k > 0 => Ok(k as usize),
            (k, v) => Err(ModelError::Config(format!(
                "{arch}.attention.key_length {k:?} and {arch}.attention.value_length {v:?}: \
                 the engine runs heads whose keys and values have one stated size"
            ))),
        }
    }

    pub fn kv_dim(&self) -> usize {
        self.n_kv_heads * self.head_dim
    }

    /// Width of the Q projection and of attention's output (`n_heads × head_dim`): the
    /// embedding length for Llama, wider for Qwen 3.
    pub fn q_dim(&self) -> usize {
        self.n_heads * self.head_dim
    }
}

/// What [`Model::stream_decode_weights`] read: how many bytes, and their wrapping u64 sum (kept
/// so that the reads cannot be optimised away).
#[derive(Clone, Copy, Debug)]
pub struct StreamedWeights {
    pub bytes: u64,
    pub sum: u64,
}

/// A weight matrix located in the GGUF map.
#[derive(Clone, Debug)]
pub(crate) struct Mat {
    pub(crate) name: String,
    pub(crate) dtype: DType,
    pub(crate) rows: usize,
    pub(crate) cols: usize,
    /// The matrix repacked for the 512-bit mat-vec kernels, where this CPU runs them
    /// (`custody_kernels::pack`): the forward pass reads it instead of the mapped bytes. Shared,
    /// so a tied output head is packed once.
    pub(crate) packed: Option<Arc<PackedRows>>,
}

#[derive(Debug)]
pub(crate) struct Layer {
    pub(crate) attn_norm: Vec<f32>,
    pub(crate) wq: Mat,
    pub(crate) wk: Mat,
    pub(crate) wv: Mat,
    pub(crate) wo: Mat,
    pub(crate) ffn_norm: Vec<f32>,
    pub(crate) w_gate: Mat,
    pub(crate) w_up: Mat,
    pub(crate) w_down: Mat,
    /// Q/K/V biases, where the architecture has them ([`ArchSpec::qkv_bias`]).
    pub(crate) qkv_bias: Option<QkvBias>,
    /// Per-head Q/K RMSNorm weights (`head_dim` each), where the architecture has them
    /// ([`ArchSpec::qk_norm`]).
    pub(crate) qk_norm: Option<QkNorm>,
}

/// A layer's Q, K and V biases (`q_dim`, `kv_dim`, `kv_dim` long).
#[derive(Debug)]
pub(crate) struct QkvBias {
    pub(crate) q: Vec<f32>,
    pub(crate) k: Vec<f32>,
    pub(crate) v: Vec<f32>,
}

/// A layer's per-head Q and K RMSNorm weights (`head_dim` each, shared by every head).
#[derive(Debug)]
pub(crate) struct QkNorm {
    pub(crate) q: Vec<f32>,
    pub(crate) k: Vec<f32>,
}

/// A loaded model. Weights stay in the memory map.
#[derive(Debug)]
pub struct Model {
    pub(crate) gguf: Gguf,
    pub config: ModelConfig,
    pub(crate) tok_embd: Mat,
    pub(crate) output: Mat,
    pub(crate) output_norm: Vec<f32>,
    /// Llama 3's RoPE frequency factors (`rope_freqs.weight`, one per rotated pair), if the file
    /// has them: each pair's angle is divided by its factor.
    pub(crate) rope_freqs: Option<Vec<f32>>,
    pub(crate) layers: Vec<Layer>,
}

/// Which logits a segment wants back.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Logits {
    None,
    Last,
    All,
}

/// One run of consecutive tokens of one sequence.
#[derive(Clone, Copy, Debug)]
pub struct Segment<'a> {
    pub tokens: &'a [u32],
    /// Position of `tokens[0]`; slots `0..start_pos` must already be written.
    pub start_pos: usize,
    pub block_table: &'a [PageRef],
    /// Whose pages the segment writes (its own, `reader.owner()`) and reads.
    pub reader: Reader,
    pub logits: Logits,
    /// Attention reduction order: a property of the request (prompt vs decode rows), so that a
    /// row's arithmetic never depends on what else shares its batch.
    pub order: ReduceOrder,
    /// Which batch each row belongs to for the K-quants' float order (also a property of the
    /// request).
    pub rows: Rows,
    /// Always `Enforced` except in the incident reproduction.
    pub check: TagCheck,
}

/// The batch llama.cpp would compute a segment's rows in — what the K-quant matmuls' float order
/// depends on (`custody_kernels::q8k::KOrder`). A property of the request, never of this step:
/// a prompt's rows get the batches of the whole prompt evaluated from its start in chunks, so a
/// prefix-cache hit, or a chunk cut short because other requests' rows share the step, gives
/// every row the same arithmetic as computing the whole prompt alone.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Rows {
    /// Rows of a prompt of `len` tokens evaluated in chunks of `chunk` (llama.cpp's `n_batch`):
    /// position `p` is row `p mod chunk` of a batch of `min(chunk, len − chunk·⌊p/chunk⌋)`.
    Prompt { len: usize, chunk: usize },
    /// One token decoded (a batch of one).
    Decode,
}

impl Rows {
    /// The batch of the row at position `pos`.
    pub fn at(self, pos: usize) -> RowBatch {
        let one = RowBatch { len: 1, index: 0 };
        match self {
            Self::Decode => one,
            Self::Prompt { len, chunk } => {
                assert!(
                    pos < len && chunk > 0,
                    "position {pos} of a {len}-token prompt"
                );
                let start = pos / chunk * chunk;
                let to_u32 = |v: usize| u32::try_from(v).expect("a batch under 2^32 rows");
                RowBatch {
                    len: to_u32((len - start).min(chunk)),
                    index: to_u32(pos - start),
                }
            }
        }
    }
}

/// Reusable activation buffers (sized for the largest batch seen).
#[derive(Debug, Default)]
pub struct Scratch {
    x: Vec<f32>,
    xn: Vec<f32>,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    att: Vec<f32>,
    tmp: Vec<f32>,
    gate: Vec<f32>,
    up: Vec<f32>,
    qin: QInput,
    attn: AttnScratch,
    rope: Vec<Vec<(f32, f32)>>,
}

/// Llama 3's RoPE frequency factors tensor.
pub(crate) const ROPE_FREQS: &str = "rope_freqs.weight";

/// A projection group (Q/K/V, gate/up) over the same input `x` (row `t` at `rows[t]` in its
/// batch, [`Rows`]; `cols` wide): one prepared input and one parallel section when the matrices
/// share an activation format (int8 blocks or f32), one per format otherwise — GGUF mixes such
/// as Q5_0 beside Q8_0 in one layer.
fn project(
    qin: &mut QInput,
    x: &[f32],
    rows: &[RowBatch],
    cols: usize,
    jobs: &mut [(QMatrix<'_>, &mut [f32])],
) {
    let first = jobs[0].0.dtype.activations();
    if jobs.iter().all(|(w, _)| w.dtype.activations() == first) {
        qin.prepare_rows(x, rows, cols, jobs[0].0.dtype);
        matmul_many(jobs, qin);
        return;
    }
    for (w, out) in jobs.iter_mut() {
        qin.prepare_rows(x, rows, cols, w.dtype);
        custody_kernels::matmul::matmul(w, qin, out);
    }
}

/// The rows whose logits a batch wants (segments that did not fail), in order, and the batch
/// each is in after the selection (as llama.cpp's `n_outputs` rows: a lone last row is a batch
/// of one; every row of a segment that wants them all keeps its batch).
struct OutputRows {
    rows: Vec<usize>,
    batches: Vec<RowBatch>,
}

impl OutputRows {
    fn new(
        segments: &[Segment<'_>],
        row0: &[usize],
        row_batches: &[RowBatch],
        failed: &[Option<IntegrityError>],
    ) -> Self {
        let mut out = Self {
            rows: Vec::new(),
            batches: Vec::new(),
        };
        for ((sg, &r0), f) in segments.iter().zip(row0).zip(failed) {
            match (f, sg.logits) {
                (Some(_), _) | (None, Logits::None) => {}
                (None, Logits::Last) => {
                    out.rows.push(r0 + sg.tokens.len() - 1);
                    out.batches.push(RowBatch { len: 1, index: 0 });
                }
                (None, Logits::All) => {
                    out.rows.extend(r0..r0 + sg.tokens.len());
                    out.batches
                        .extend_from_slice(&row_batches[r0..r0 + sg.tokens.len()]);
                }
            }
        }
        debug_assert!(out.rows.is_sorted() && out.rows.len() == out.batches.len());
        out
    }
}

/// Add `bias` to every row of `x` (rows of `bias.len()`): ggml's `add` after the projection.
fn add_rows(x: &mut [f32], bias: &[f32]) {
    debug_assert!(x.len().is_multiple_of(bias.len()));
    for row in x.chunks_exact_mut(bias.len()) {
        for (v, &b) in row.iter_mut().zip(bias) {
            *v += b;
        }
    }
}

/// RMS-normalise every head of `x` (heads of `w.len()`) in place with the weights `w`: Qwen 3's
/// per-head Q/K norm, ggml's `rms_norm` then `mul` on each head.
fn norm_heads(x: &mut [f32], w: &[f32], eps: f32) {
    let mut head = [0.0f32; MAX_HEAD_DIM];
    let head = &mut head[..w.len()];
    for h in x.chunks_exact_mut(w.len()) {
        head.copy_from_slice(h);
        ops::rms_norm(head, w, eps, h);
    }
}

/// The largest head size the engine runs (checked at load; the attention kernels' bound).
const MAX_HEAD_DIM: usize = 256;

impl Model {
    pub fn load(path: &Path) -> Result<Self, ModelError> {
        Self::from_gguf(Gguf::open(path)?)
    }

    pub fn from_gguf(gguf: Gguf) -> Result<Self, ModelError> {
        let config = ModelConfig::from_gguf(&gguf)?;
        understood::check(&gguf, &config)?;
        let c = &config;
        let mat = |name: &str, rows: usize, cols: usize| -> Result<Mat, ModelError> {
            let (info, _) = gguf.tensor(name)?;
            let expected = vec![cols as u64, rows as u64];
            if info.shape != expected {
                return Err(ModelError::Shape {
                    name: name.into(),
                    expected,
                    found: info.shape.clone(),
                });
            }
            let m = Mat {
                name: name.into(),
                dtype: info.dtype,
                rows,
                cols,
                packed: None,
            };
            Ok(m)
        };
        let vec_f32 = |name: &str, n: usize| -> Result<Vec<f32>, ModelError> {
            let (info, data) = gguf.tensor(name)?;
            if info.shape != [n as u64] {
                return Err(ModelError::Shape {
                    name: name.into(),
                    expected: vec![n as u64],
                    found: info.shape.clone(),
                });
            }
            let mut out = vec![0.0; n];
            custody_kernels::quant::dequantize_row(info.dtype, data, &mut out);
            Ok(out)
        };
        let tok_embd = mat("token_embd.weight", c.vocab_size, c.dim)?;
        let output = if gguf.tensors.contains_key("output.weight") {
            mat("output.weight", c.vocab_size, c.dim)?
        } else {
            tok_embd.clone()
        };
        let mut layers = Vec::with_capacity(c.n_layers);
        for i in 0..c.n_layers {
            let n = |s: &str| format!("blk.{i}.{s}.weight");
            let b = |s: &str| format!("blk.{i}.{s}.bias");
            let qkv_bias = match c.spec.qkv_bias {
                true => Some(QkvBias {
                    q: vec_f32(&b("attn_q"), c.q_dim())?,
                    k: vec_f32(&b("attn_k"), c.kv_dim())?,
                    v: vec_f32(&b("attn_v"), c.kv_dim())?,
                }),
                false => None,
            };
            let qk_norm = match c.spec.qk_norm {
                true => Some(QkNorm {
                    q: vec_f32(&n("attn_q_norm"), c.head_dim)?,
                    k: vec_f32(&n("attn_k_norm"), c.head_dim)?,
                }),
                false => None,
            };
            layers.push(Layer {
                attn_norm: vec_f32(&n("attn_norm"), c.dim)?,
                wq: mat(&n("attn_q"), c.q_dim(), c.dim)?,
                wk: mat(&n("attn_k"), c.kv_dim(), c.dim)?,
                wv: mat(&n("attn_v"), c.kv_dim(), c.dim)?,
                wo: mat(&n("attn_output"), c.dim, c.q_dim())?,
                ffn_norm: vec_f32(&n("ffn_norm"), c.dim)?,
                w_gate: mat(&n("ffn_gate"), c.ffn_dim, c.dim)?,
                w_up: mat(&n("ffn_up"), c.ffn_dim, c.dim)?,
                w_down: mat(&n("ffn_down"), c.dim, c.ffn_dim)?,
                qkv_bias,
                qk_norm,
            });
        }
        let output_norm = vec_f32("output_norm.weight", c.dim)?;
        // `understood::check` has refused the tensor where the spec does not allow it.
        let rope_freqs = match gguf.tensors.contains_key(ROPE_FREQS) {
            true => Some(vec_f32(ROPE_FREQS, c.rope_dims / 2)?),
            false => None,
        };
        let mut model = Self {
            gguf,
            config,
            tok_embd,
            output,
            output_norm,
            rope_freqs,
            layers,
        };
        model.pack_weights();
        Ok(model)
    }

    /// The GGUF file the model was loaded from (its metadata carries the tokenizer).
    pub fn gguf(&self) -> &Gguf {
        &self.gguf
    }

    pub(crate) fn tensor_bytes(&self, m: &Mat) -> &[u8] {
        self.gguf
            .tensor(&m.name)
            .unwrap_or_else(|e| unreachable!("validated at load: {e}"))
            .1
    }

    fn qm<'a>(&'a self, m: &'a Mat) -> QMatrix<'a> {
        let (_, data) = self
            .gguf
            .tensor(&m.name)
            .unwrap_or_else(|e| unreachable!("validated at load: {e}"));
        QMatrix::new(m.dtype, m.rows, m.cols, data)
            .unwrap_or_else(|| unreachable!("validated at load"))
            .with_packed(m.packed.as_deref())
    }

    /// Repack every matrix the forward pass multiplies by, where this CPU has the packed
    /// kernels, and release the mapped originals' pages: the packed copy replaces the original
    /// in memory rather than doubling it (the embedding lookups of a tied output head fault
    /// back in only the rows they read).
    fn pack_weights(&mut self) {
        let pack = |model: &Self, m: &Mat| {
            let packed = PackedRows::new(&model.qm(m)).map(Arc::new)?;
            if let Err(e) = model.gguf.release_tensor_pages(&m.name) {
                unreachable!("validated at load: {e}")
            }
            Some(packed)
        };
        self.output.packed = pack(self, &self.output);
        for i in 0..self.layers.len() {
            let l = &self.layers[i];
            let packed =
                [&l.wq, &l.wk, &l.wv, &l.wo, &l.w_gate, &l.w_up, &l.w_down].map(|m| pack(self, m));
            let [wq, wk, wv, wo, w_gate, w_up, w_down] = packed;
            let l = &mut self.layers[i];
            (l.wq.packed, l.wk.packed, l.wv.packed, l.wo.packed) = (wq, wk, wv, wo);
            (l.w_gate.packed, l.w_up.packed, l.w_down.packed) = (w_gate, w_up, w_down);
        }
    }

    /// Weight bytes one decode step reads per sequence's batch (every matrix the forward pass
    /// multiplies by, once: packed copies where packed; the embedding row and the norms are
    /// negligible): the numerator of a decode step's memory-bandwidth bound.
    pub fn decode_weight_bytes(&self) -> u64 {
        self.decode_weights().map(|w| w.len() as u64).sum()
    }

    /// Multiply-accumulates one prompt token costs in the layers' matrices (`rows × cols` each;
    /// the output head is computed for the last prompt token only, so it is not counted), plus
    /// its attention at depth `position` (Q·K and P·V over `position + 1` slots, every head):
    /// the numerator of a prefill's compute bound.
    pub fn prefill_macs_per_token(&self, position: usize) -> u64 {
        let matrices: usize = self
            .layers
            .iter()
            .flat_map(|l| [&l.wq, &l.wk, &l.wv, &l.wo, &l.w_gate, &l.w_up, &l.w_down])
            .map(|m| m.rows * m.cols)
            .sum();
        let c = &self.config;
        let attention = c.n_layers * c.n_heads * c.head_dim * 2 * (position + 1);
        (matrices + attention) as u64
    }

    /// The bytes of every matrix a decode step reads (packed copies where packed).
    fn decode_weights(&self) -> impl Iterator<Item = &[u8]> {
        fn bytes<'a>(model: &'a Model, m: &'a Mat) -> &'a [u8] {
            match &m.packed {
                Some(p) => p.data(),
                None => model.tensor_bytes(m),
            }
        }
        self.layers
            .iter()
            .flat_map(|l| [&l.wq, &l.wk, &l.wv, &l.wo, &l.w_gate, &l.w_up, &l.w_down])
            .chain(std::iter::once(&self.output))
            .map(|m| bytes(self, m))
    }

    /// Part `part` of `parts` of every matrix a decode step reads, read once with no compute
    /// but a running sum (returned, so the reads cannot be elided): a benchmark's probe of the
    /// read bandwidth a decode step is bounded by, over the very bytes it reads.
    pub fn stream_decode_weights(&self, part: usize, parts: usize) -> StreamedWeights {
        let (mut bytes, mut sum) = (0u64, 0u64);
        for w in self.decode_weights() {
            let n = w.len() / parts / 64 * 64;
            let mine = &w[part * n..(part + 1) * n];
            let mut lanes = [0u64; 8];
            for c in mine.chunks_exact(64) {
                for (i, l) in lanes.iter_mut().enumerate() {
                    let v = u64::from_le_bytes(c[8 * i..8 * i + 8].try_into().expect("8 bytes"));
                    *l = l.wrapping_add(v);
                }
            }
            bytes += n as u64;
            sum = lanes.iter().fold(sum, |acc, l| acc.wrapping_add(*l));
        }
        StreamedWeights { bytes, sum }
    }

    /// KV page geometry for a given page size and cache type.
    pub fn page_geometry(&self, page_size: usize, kv: KvType) -> PageGeometry {
        PageGeometry {
            page_size,
            n_kv_heads: self.config.n_kv_heads,
            head_dim: self.config.head_dim,
            kv,
        }
    }

    /// Dtype of the weight matrices (for reporting).
    pub fn weight_dtype(&self) -> DType {
        self.layers
            .first()
            .map_or(self.output.dtype, |l| l.wq.dtype)
    }

    /// Layer `l`'s feed-forward block over the first `batches.len()` rows of `s.x` (row `t` at
    /// `batches[t]` in its batch), added into them.
    fn feed_forward(&self, l: &Layer, s: &mut Scratch, batches: &[RowBatch]) {
        let (c, dim, rows) = (&self.config, self.config.dim, batches.len());
        for r in 0..rows {
            ops::rms_norm(
                &s.x[r * dim..(r + 1) * dim],
                &l.ffn_norm,
                c.rms_eps,
                &mut s.xn[r * dim..(r + 1) * dim],
            );
        }
        let ffn = rows * c.ffn_dim;
        project(
            &mut s.qin,
            &s.xn[..rows * dim],
            batches,
            dim,
            &mut [
                (self.qm(&l.w_gate), &mut s.gate[..ffn]),
                (self.qm(&l.w_up), &mut s.up[..ffn]),
            ],
        );
        ops::swiglu(&mut s.gate[..ffn], &s.up[..ffn]);
        s.qin
            .prepare_rows(&s.gate[..ffn], batches, c.ffn_dim, l.w_down.dtype);
        custody_kernels::matmul::matmul(&self.qm(&l.w_down), &s.qin, &mut s.tmp[..rows * dim]);
        ops::add_inplace(&mut s.x[..rows * dim], &s.tmp[..rows * dim]);
    }

    /// Run a batch. Returns, per segment, its logits (`rows × vocab`, rows per [`Logits`]) or the
    /// integrity error that failed it.
    pub fn forward(
        &self,
        pool: &mut PagePool,
        segments: &[Segment<'_>],
        s: &mut Scratch,
    ) -> Vec<Result<Vec<f32>, IntegrityError>> {
        let c = &self.config;
        let ps = pool.page_size();
        let n: usize = segments.iter().map(|sg| sg.tokens.len()).sum();
        assert!(n > 0, "forward: empty batch");
        let (dim, qd, kvd) = (c.dim, c.q_dim(), c.kv_dim());
        s.x.resize(n * dim, 0.0);
        s.xn.resize(n * dim, 0.0);
        s.q.resize(n * qd, 0.0);
        s.k.resize(n * kvd, 0.0);
        s.v.resize(n * kvd, 0.0);
        s.att.resize(n * qd, 0.0);
        s.tmp.resize(n * dim, 0.0);
        s.gate.resize(n * c.ffn_dim, 0.0);
        s.up.resize(n * c.ffn_dim, 0.0);

        // Row layout and per-row positions.
        let mut row0 = Vec::with_capacity(segments.len());
        let mut positions = Vec::with_capacity(n);
        for sg in segments {
            row0.push(positions.len());
            positions.extend(sg.start_pos..sg.start_pos + sg.tokens.len());
        }
        let mut failed: Vec<Option<IntegrityError>> = vec![None; segments.len()];
        // Each row's batch, as its request says (the K-quants' float order depends on it, as
        // llama.cpp's does on its batch).
        let batches: Vec<RowBatch> = segments
            .iter()
            .flat_map(|sg| (sg.start_pos..sg.start_pos + sg.tokens.len()).map(|p| sg.rows.at(p)))
            .collect();
        // Set after the last layer's attention.
        let mut output: Option<OutputRows> = None;

        // Embeddings.
        let embd = self.qm(&self.tok_embd);
        for (r, &t) in segments.iter().flat_map(|sg| sg.tokens).enumerate() {
            let t = t as usize;
            assert!(
                t < c.vocab_size,
                "token id {t} outside vocabulary (validated at admission)"
            );
            embd.dequantize_row(t, &mut s.x[r * dim..(r + 1) * dim]);
        }
        // RoPE tables, one per row (positions are shared by all layers).
        s.rope.resize_with(n, Vec::new);
        for (tbl, &p) in s.rope.iter_mut().zip(&positions) {
            ops::rope_table(p, c.rope_dims, c.rope_base, self.rope_freqs.as_deref(), tbl);
        }

        for (li, l) in self.layers.iter().enumerate() {
            // --- attention block
            for r in 0..n {
                ops::rms_norm(
                    &s.x[r * dim..(r + 1) * dim],
                    &l.attn_norm,
                    c.rms_eps,
                    &mut s.xn[r * dim..(r + 1) * dim],
                );
            }
            project(
                &mut s.qin,
                &s.xn,
                &batches,
                dim,
                &mut [
                    (self.qm(&l.wq), &mut s.q[..]),
                    (self.qm(&l.wk), &mut s.k[..]),
                    (self.qm(&l.wv), &mut s.v[..]),
                ],
            );
            if let Some(b) = &l.qkv_bias {
                add_rows(&mut s.q[..n * qd], &b.q);
                add_rows(&mut s.k[..n * kvd], &b.k);
                add_rows(&mut s.v[..n * kvd], &b.v);
            }
            if let Some(qk) = &l.qk_norm {
                norm_heads(&mut s.q[..n * qd], &qk.q, c.rms_eps);
                norm_heads(&mut s.k[..n * kvd], &qk.k, c.rms_eps);
            }
            for r in 0..n {
                let rope = c.spec.rope;
                rope.apply(&mut s.q[r * qd..(r + 1) * qd], c.head_dim, &s.rope[r]);
                rope.apply(&mut s.k[r * kvd..(r + 1) * kvd], c.head_dim, &s.rope[r]);
            }
            for (si, sg) in segments.iter().enumerate() {
                let r0 = row0[si];
                let rows = r0..r0 + sg.tokens.len();
                if failed[si].is_none() {
                    for r in rows.clone() {
                        let pos = positions[r];
                        let Some(&pr) = sg.block_table.get(pos / ps) else {
                            failed[si] = Some(IntegrityError::BlockTableTooShort {
                                have: sg.block_table.len(),
                                need: pos / ps + 1,
                                n_ctx: pos + 1,
                            });
                            break;
                        };
                        if let Err(e) = pool.write_slot_checked(
                            li,
                            pr,
                            pos % ps,
                            sg.reader.owner(),
                            sg.check,
                            &s.k[r * kvd..(r + 1) * kvd],
                            &s.v[r * kvd..(r + 1) * kvd],
                        ) {
                            failed[si] = Some(e);
                            break;
                        }
                    }
                }
                let out = &mut s.att[rows.start * qd..rows.end * qd];
                if failed[si].is_some() {
                    out.fill(0.0);
                    continue;
                }
                let read = AttendRead {
                    q: &s.q[rows.start * qd..rows.end * qd],
                    n_heads: c.n_heads,
                    start_pos: sg.start_pos,
                    block_table: sg.block_table,
                    reader: sg.reader,
                    order: sg.order,
                    check: sg.check,
                };
                if let Err(e) = pool.attend(li, &read, out, &mut s.attn) {
                    out.fill(0.0);
                    failed[si] = Some(e);
                }
            }
            s.qin.prepare_rows(&s.att, &batches, qd, l.wo.dtype);
            custody_kernels::matmul::matmul(&self.qm(&l.wo), &s.qin, &mut s.tmp);
            ops::add_inplace(&mut s.x, &s.tmp);

            // After the last layer's attention only the rows whose logits are wanted go on (as
            // llama.cpp's graphs select `inp_out_ids` there): the others' K/V are written, and
            // their feed-forward output would feed nothing.
            let ffn_batches = if li + 1 == self.layers.len() {
                let out = OutputRows::new(segments, &row0, &batches, &failed);
                for (i, &r) in out.rows.iter().enumerate() {
                    // Rows ascend, so row `r ≥ i` moves down or stays.
                    s.x.copy_within(r * dim..(r + 1) * dim, i * dim);
                }
                &output.insert(out).batches
            } else {
                &batches
            };
            if ffn_batches.is_empty() {
                continue;
            }
            self.feed_forward(l, s, ffn_batches);
        }

        // Output head, for the rows whose logits are wanted (now the first rows of `s.x`).
        let want = output.map_or(0, |o| o.rows.len());
        let mut logits_all = vec![0.0f32; want * c.vocab_size];
        if want > 0 {
            let mut h = vec![0.0f32; want * dim];
            for (x, h) in s.x.chunks_exact(dim).zip(h.chunks_exact_mut(dim)) {
                ops::rms_norm(x, &self.output_norm, c.rms_eps, h);
            }
            s.qin.prepare(&h, want, dim, self.output.dtype);
            custody_kernels::matmul::matmul(&self.qm(&self.output), &s.qin, &mut logits_all);
        }
        let mut cursor = 0;
        segments
            .iter()
            .zip(failed)
            .map(|(sg, f)| match f {
                Some(e) => Err(e),
                None => {
                    let rows = match sg.logits {
                        Logits::None => 0,
                        Logits::Last => 1,
                        Logits::All => sg.tokens.len(),
                    };
                    let out =
                        logits_all[cursor * c.vocab_size..(cursor + rows) * c.vocab_size].to_vec();
                    cursor += rows;
                    Ok(out)
                }
            })
            .collect()
    }
}

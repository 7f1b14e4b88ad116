//! The forward pass on a CUDA device ([`custody_cuda::Device`]): the same batch of segments,
//! the same results and the same tag rules as [`Model::forward`], with the weights, the
//! activations and the K/V bytes in device memory and every step a kernel of `kernels/cuda`.
//!
//! # Spec
//! - The host [`PagePool`] stays the one authority on tags (allocation, generations, owners,
//!   written slots, in-band stamps): a row's KV write is claimed on it first
//!   ([`PagePool::claim_slot_checked`], the CPU write's own check), and only claimed rows are
//!   stored by the KV-write kernel; the pool's tags are then uploaded and the attention kernel
//!   checks every page of each row's block table against them *before it reads a slot* — a
//!   failing segment gets its [`IntegrityError`] instead of logits, as on the CPU. The pool's
//!   host K/V bytes are not used.
//! - The K/V bytes live in one plain device allocation ([`DeviceKv`]), sized once from the
//!   pool's page count (the engine's memory budget): `[layer][K|V][page][kv_head][slot][dim]`
//!   f16 — the CPU pool's page layout.
//! - The incident reproduction's disabled tag check exists only on the CPU backend: a segment
//!   asking for it here is refused (`TagCheckRequired`).
//! - A decoding step runs as one CUDA graph: batches of up to [`MAX_GRAPH_ROWS`] rows with no
//!   prompt for the prefill kernel (below) are padded to a power of two (padding rows: token 0, position 0, no KV write, no readable page — their
//!   verdict is a failure no segment sees) and each (padded rows, flash-decoding splits) shape
//!   is captured once and replayed; every per-step value (tokens, positions, tables, the tag
//!   changes' count, write slots) is in device memory the host fills before the replay, never a
//!   launch argument. Larger batches, and steps with such a prompt (prefill: their tiles vary
//!   from step to step), launch their kernels one by one, unpadded — as vLLM and SGLang keep
//!   graphs for decoding.
//!   Graphs are dropped before any buffer they name is replaced; at most [`MAX_GRAPHS`] are held.
//! - Products: batches of up to [`GEMV_MAX_ROWS`] rows (decode) through the quantized GEMVs of
//!   `kernels/cuda`, which read the weights in their quantized form — Q4_K ones, from
//!   [`Q8_MIN_ROWS`] rows, on activations their producer quantized to int8 (blocks of 32, a
//!   scale each) with `dp4a`, and from [`MMQ_MIN_ROWS`] on integer tensor cores
//!   (`custody_mmq_q4k`); larger ones (prefill, big
//!   batches) through the library GEMM ([`Device::gemm_f16`], cuBLASLt on a GPU) on f16 copies
//!   of the weights made once at load (every type but F32 and BF16, whose values f16 may not
//!   hold: those keep the per-element kernel) — 2 bytes per weight more device memory,
//!   [`CudaForward::gemm_weight_bytes`], named in [`CudaForward::describe`].
//! - Attention: decoding rows through paged flash decoding, split over pages; the rows of each
//!   segment of at least `PREFILL_MIN_ROWS` (16) through `custody_flash_prefill`, tensor-core
//!   MMAs over tiles of up to 64 rows, when head_dim is a multiple of 16 up to 128 — the step's
//!   other rows through flash decoding still (one row at a time, a prompt's rows would re-read
//!   its context once per row). Both check the pages they read before the first load and give each row the
//!   CPU's verdict.
//! - Numerics: f32 activations (the CPU quantizes them to Q8 for quantized weights), rounded to
//!   f16 only as the inputs of the GEMM path and of the prefill kernel's MMAs (Q and the softmax
//!   weights), and to int8 per block of 32 as the inputs of the dp4a GEMVs; no contraction; logits agree with the CPU's within a stated tolerance, not bit
//!   for bit (`e2e::cuda_forward`).

use custody_cuda::device::{bytes_of, bytes_of_mut};
use custody_cuda::repack::RepackError;
use custody_cuda::{
    Arg, Device, DeviceError, DevicePtr, DeviceTags, Download, GemmF16, GraphId, Kernel,
    LaunchDims, Verdict,
};
use custody_kernels::DType;
use custody_kernels::attention::{IntegrityError, MAX_SHARED, PageRef, TagCheck};
use custody_kernels::ops::RopeStyle;

use crate::kv::PagePool;
use crate::model::{ArchSpec, Logits, Mat, Model, ModelConfig, Segment};

/// Threads per block of the row kernels (`CUSTODY_OPS_THREADS`, `CUSTODY_ATT_THREADS`).
const THREADS: u32 = 128;
/// `custody_gemv_q4k`'s rows per block (one per warp) and x rows per block.
const GEMV_WARPS: u32 = 4;
const GEMV_BATCH: u32 = 8;
/// `custody_mmq_q4k`'s weight rows and x rows per CTA (`CUSTODY_MMQ_ROWS`, `CUSTODY_MMQ_X`).
const MMQ_TILE: u32 = 64;
/// Batches up to this many rows take their products through the quantized GEMVs; larger ones
/// through the library GEMM on f16 weights. At 64 rows the GEMV still reads the quantized
/// weights once per 8 rows mostly from L2, and meets the decode bytes target (≤ 1.15× the
/// ideal, `gpu_model`); past it the products are compute-bound and tensor cores win.
pub const GEMV_MAX_ROWS: usize = 64;
/// Steps from this many rows up to [`GEMV_MAX_ROWS`] take their Q4_K products on activations
/// quantized to int8 by the kernel that produces them (`custody_q8_block`: the norms, flash
/// decoding's merge; one `custody_quantize_q8` launch before the down product) and multiply with
/// `dp4a` — four multiply-adds an instruction where FP32 FMA makes one, and the products are
/// compute-bound from a few rows. A single row keeps f32 x: its GEMVs are bandwidth-bound either
/// way, and the quantize launch would be one graph node more.
pub const Q8_MIN_ROWS: usize = 2;
/// From this many rows the int8-x products run on integer tensor cores (`custody_mmq_q4k`:
/// m16n8k32 MMAs over 64 weight rows × 64 x rows a CTA; Q/K/V and gate/up+SwiGLU fused as the
/// GEMVs are) instead of the dp4a GEMV, which is compute-bound past its 8 x rows a block.
pub const MMQ_MIN_ROWS: usize = GEMV_BATCH as usize + 1;
/// `custody_flash_prefill`'s rows per CTA (`CUSTODY_FP_ROWS`) and widest head
/// (`CUSTODY_FP_MAX_DIM`; head_dim a multiple of 16 up to it).
const PREFILL_TILE_ROWS: usize = 64;
/// A segment's rows go to the prefill kernel from this many on (a 16-row MMA tile); fewer — a
/// decoding row — to flash decoding, whose splits spread a long context over many CTAs.
const PREFILL_MIN_ROWS: usize = 16;
const PREFILL_MAX_DIM: usize = 128;
/// `CUSTODY_NO_PAGE`: a row the KV-write kernel skips.
const NO_PAGE: u32 = u32::MAX;
/// `CUSTODY_FD_MAX_GROUP`, `CUSTODY_FD_MAX_DIM`: the query heads per KV head and the head
/// width flash decoding serves (head_dim a power of two from 8).
pub const MAX_GQA_GROUP: usize = 8;
pub const MAX_HEAD_DIM: usize = 256;
/// Flash decoding's CTAs per launch to aim for (2 per SM of an H100/H200's 132): a batch whose
/// rows × KV heads fill fewer gets its contexts split into more chunks.
const TARGET_CTAS: usize = 264;
/// Batches up to this many rows run as a captured graph (padded to a power of two); larger ones
/// (prefill) launch kernel by kernel: padding them would cost up to twice their compute.
pub const MAX_GRAPH_ROWS: usize = 256;
/// Graphs held at once (the oldest is dropped first): power-of-two row counts up to
/// [`MAX_GRAPH_ROWS`] times the split layouts of power-of-two context lengths in use.
pub const MAX_GRAPHS: usize = 64;
/// `custody_tag_apply`'s blocks (each strides over the step's changes): two per SM of an H200.
const TAG_APPLY_BLOCKS: u32 = 264;

/// Why the CUDA forward pass could not run (distinct from a segment's integrity failure).
#[derive(Debug, thiserror::Error)]
pub enum CudaForwardError {
    #[error(transparent)]
    Device(#[from] DeviceError),
    #[error("weight {name}: {source}")]
    Repack {
        name: String,
        source: custody_cuda::repack::RepackError,
    },
    #[error(
        "the CUDA attention kernel serves head_dim a power of two in 8..={MAX_HEAD_DIM} and up to {MAX_GQA_GROUP} query heads per KV head: this model has head_dim {head_dim}, {group} per KV head"
    )]
    AttentionShape { head_dim: usize, group: usize },
    #[error("batch of {rows} rows exceeds the {max_rows} this backend was sized for")]
    BatchTooLarge { rows: usize, max_rows: usize },
    #[error(
        "the tag check cannot be disabled on the CUDA backend (the incident reproduction is CPU-only)"
    )]
    TagCheckRequired,
}

/// A weight matrix on the device.
#[derive(Debug, Clone, Copy)]
struct DevMat {
    layout: Layout,
    dtype: u32,
    rows: u32,
    cols: u32,
    /// The weights as f16, row-major, for the GEMM path (`None`: the GEMVs serve every batch).
    f16: Option<DevicePtr>,
}

/// How a [`DevMat`]'s bytes are laid out, and so which kernel reads it.
#[derive(Debug, Clone, Copy)]
enum Layout {
    /// The GGUF bytes as they are in the file (`custody_matvec`, `custody_embed`).
    Gguf(DevicePtr),
    /// In a GEMV's tiles (`custody_cuda::repack`): Q4_K (`custody_gemv_q4k`), Q6_K
    /// (`custody_gemv_q6k`), Q8_0 (`custody_gemv_q8_0`) — `gemv` is the kernel that reads them.
    Tiles {
        gemv: Kernel,
        heads: DevicePtr,
        qs: DevicePtr,
    },
}

/// The GEMV and tile layout for weights of `dtype`, if it has one (else `custody_matvec` reads
/// the file's bytes).
type Repack = fn(&[u8], usize, usize) -> Result<custody_cuda::repack::Tiles, RepackError>;

fn tiled(dtype: DType) -> Option<(Kernel, Repack)> {
    match dtype {
        DType::Q4_K => Some((Kernel::GemvQ4K, custody_cuda::repack::q4k)),
        DType::Q6_K => Some((Kernel::GemvQ6K, custody_cuda::repack::q6k)),
        DType::Q8_0 => Some((Kernel::GemvQ8_0, custody_cuda::repack::q8_0)),
        _ => None,
    }
}

impl DevMat {
    /// The file-layout bytes (the embedding lookup reads only these).
    fn gguf(&self) -> DevicePtr {
        match self.layout {
            Layout::Gguf(p) => p,
            Layout::Tiles { .. } => {
                unreachable!("the embedding is uploaded in the file's layout")
            }
        }
    }
}

#[derive(Debug, Clone, Copy)]
struct DevLayer {
    attn_norm: DevicePtr,
    wq: DevMat,
    wk: DevMat,
    wv: DevMat,
    wo: DevMat,
    ffn_norm: DevicePtr,
    w_gate: DevMat,
    w_up: DevMat,
    w_down: DevMat,
    /// Q, K, V biases ([`ArchSpec::qkv_bias`]).
    qkv_bias: Option<[DevicePtr; 3]>,
    /// Per-head Q and K norm weights ([`ArchSpec::qk_norm`]).
    qk_norm: Option<[DevicePtr; 2]>,
}

/// The device page pool: K and V of every layer in one allocation, plus the device's copy of
/// the pool's tags the attention kernels check (`filled` per layer), kept current by
/// [`CudaForward::sync_tags`] from the pool's change log once per step.
#[derive(Debug)]
struct DeviceKv {
    k: Vec<DevicePtr>,
    v: Vec<DevicePtr>,
    generation: DevicePtr,
    owner: DevicePtr,
    filled: DevicePtr,
    stamp_owner: DevicePtr,
    stamp_generation: DevicePtr,
    n_pages: u32,
    /// The packed tag changes' upload buffer: the count, then every page's entry at most
    /// ([`DeviceKv::staging_bytes`]); allocated once, so a captured graph's pointer stays valid.
    staging: DevicePtr,
}

impl DeviceKv {
    /// The staging buffer's size: the count, then for each of `n_pages` pages its owner and
    /// stamp owner (u64), page, generation, stamp generation and `filled` per layer (u32).
    fn staging_bytes(n_pages: usize, n_layers: usize) -> usize {
        8 + n_pages * (16 + 4 * (3 + n_layers))
    }

    /// The tags `layer`'s attention checks.
    fn tags(&self, layer: usize) -> DeviceTags {
        DeviceTags {
            generation: self.generation.0,
            owner: self.owner.0,
            filled: self
                .filled
                .offset((layer * self.n_pages as usize * 4) as u64)
                .0,
            stamp_owner: self.stamp_owner.0,
            stamp_generation: self.stamp_generation.0,
            n_pages: self.n_pages,
        }
    }
}

/// Activation and per-row buffers, sized for `max_rows` rows (addresses: `Copy`, so that a
/// launch can borrow the device while the addresses are in hand).
#[derive(Debug, Clone, Copy)]
struct Buffers {
    x: DevicePtr,
    xn: DevicePtr,
    q: DevicePtr,
    k: DevicePtr,
    v: DevicePtr,
    att: DevicePtr,
    tmp: DevicePtr,
    gate: DevicePtr,
    up: DevicePtr,
    logits: DevicePtr,
    tokens: DevicePtr,
    positions: DevicePtr,
    write_pages: DevicePtr,
    write_slots: DevicePtr,
    tables: DevicePtr,
    table_off: DevicePtr,
    table_len: DevicePtr,
    n_ctx: DevicePtr,
    /// Each row's reader (`CustodyReader`: `Reader::words`, three u64).
    readers: DevicePtr,
    /// The rows the head computes in a kernel-by-kernel step ([`StepShape::head_rows`]).
    head_rows: DevicePtr,
    /// A kernel-by-kernel step's prefill tiles: (first row, rows) per tile.
    tiles: DevicePtr,
    /// Flash decoding's arrival counts per (row, KV head): zero between launches (the last
    /// split to arrive resets its count).
    arrivals: DevicePtr,
    /// The rows flash decoding serves in a step with prefill tiles.
    decode_rows: DevicePtr,
    verdicts: DevicePtr,
    /// Flash decoding's per-(row, split) partial outputs and first failing page indices.
    partial: DevicePtr,
    bad: DevicePtr,
    /// The GEMM path's activations as f16 (rows × the widest product input).
    x16: DevicePtr,
    /// A product input quantized for the dp4a GEMVs (up to [`GEMV_MAX_ROWS`] rows × the widest).
    q8: Q8,
    /// Block-table entries the `tables` buffer holds.
    table_capacity: usize,
}

/// Activations quantized for the dp4a GEMVs, in `custody_q8_block`'s layout (kernels/cuda/
/// custody.cuh): `xq` a row's int8 values in the Q4_K GEMV's lane order, `xs` each block of
/// 32's scale and scaled sum. One buffer serves every product of a step in turn: each producer
/// overwrites it after the previous product read it (launches on one stream are ordered).
#[derive(Debug, Clone, Copy)]
struct Q8 {
    xq: DevicePtr,
    xs: DevicePtr,
}

impl Q8 {
    fn args(q8: Option<Q8>) -> [Arg; 2] {
        match q8 {
            Some(q) => [Arg::Ptr(q.xq), Arg::Ptr(q.xs)],
            None => [Arg::Ptr(DevicePtr(0)), Arg::Ptr(DevicePtr(0))],
        }
    }
}

/// The model on a device, ready to run batches.
#[derive(Debug)]
pub struct CudaForward<D: Device> {
    dev: D,
    config: ModelConfig,
    page_size: usize,
    max_rows: usize,
    tok_embd: DevMat,
    output: DevMat,
    output_norm: DevicePtr,
    /// RoPE frequency factors, one per rotated pair: the file's (Llama 3) or all 1 (dividing
    /// by 1 changes no bit, so one kernel serves both).
    rope_factors: DevicePtr,
    layers: Vec<DevLayer>,
    kv: DeviceKv,
    bufs: Buffers,
    /// Debug builds: compare the device's whole copy of the tags with the pool's after each
    /// sync (on by default; the performance model turns it off: its copies are not a step's).
    #[cfg_attr(not(debug_assertions), allow(dead_code))]
    audit_tags: bool,
    /// Steps as graphs (on by default; off runs every kernel on its own — the comparison).
    use_graphs: bool,
    /// Captured steps, oldest first (at most [`MAX_GRAPHS`]).
    graphs: std::collections::VecDeque<(StepShape, GraphId)>,
    /// Device memory the GEMM path's f16 weight copies take.
    gemm_weight_bytes: u64,
    /// Whether any product is Q4_K tiles (the dp4a GEMVs' only weights).
    has_q4k: bool,
    /// The dp4a GEMVs for steps of [`Q8_MIN_ROWS`]..=[`GEMV_MAX_ROWS`] rows (on by default;
    /// off keeps f32 x in every GEMV — the comparison).
    use_q8: bool,
}

/// What a captured step's launches depend on: the rows they run (padded) and how flash
/// decoding cuts the contexts. Everything else a step varies is in device memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct StepShape {
    rows: usize,
    splits: Splits,
    graph: bool,
    /// Rows the output head computes: all `rows` in a graph; in a kernel-by-kernel step only
    /// the rows whose logits are returned, gathered first (`custody_gather_rows`).
    head_rows: usize,
    /// Tiles of `custody_flash_prefill` (in a kernel-by-kernel step whose heads fit it: the
    /// rows of each segment of at least [`PREFILL_MIN_ROWS`], in runs of
    /// [`PREFILL_TILE_ROWS`]); 0: none.
    prefill_tiles: usize,
    /// Rows flash decoding serves (and `splits` cuts): every row, or those the tiles leave.
    decode_rows: usize,
}

/// `CustodyDType` in kernels/cuda/ops.cu. Exhaustive: a weight type the engine gains does not
/// compile until it is placed here (with its dequantization in `custody_weight`).
fn dtype_code(m: &Mat) -> u32 {
    match m.dtype {
        DType::F32 => 0,
        DType::F16 => 1,
        DType::Q4_0 => 2,
        DType::Q4_1 => 3,
        DType::Q8_0 => 4,
        DType::Q5_0 => 5,
        DType::Q5_1 => 6,
        DType::Q4_K => Q4K_CODE,
        DType::Q5_K => 8,
        DType::Q6_K => 9,
        DType::BF16 => 10,
        DType::Q2_K => 11,
        DType::Q3_K => 12,
    }
}

/// Every switch of an [`ArchSpec`] has its CUDA kernel: RoPE style and frequency factors
/// (`custody_rope`), Q/K/V biases (`custody_add_rows`), per-head Q/K norm (`custody_rms_norm`
/// over heads). The destructuring is exhaustive, so a switch added to the spec does not compile
/// until it is placed here (and given a kernel, or refused).
fn neox_flag(spec: &ArchSpec) -> u32 {
    let ArchSpec {
        names: _,
        rope,
        qkv_bias: _,
        qk_norm: _,
        rope_freqs: _,
    } = *spec;
    u32::from(rope == RopeStyle::Neox)
}

fn f32_bytes(v: &[f32]) -> &[u8] {
    bytes_of(v)
}

/// (row, split) pairs a batch of `rows` rows can launch: [`Splits::of`] keeps rows × splits
/// within `rows + TARGET_CTAS`.
fn split_capacity(rows: usize) -> usize {
    rows + TARGET_CTAS
}

/// How flash decoding cuts a batch's contexts: `pages_per_split` pages per CTA, `n` CTAs per
/// row and KV head.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Splits {
    pub n: usize,
    pub pages_per_split: usize,
}

/// Slots a split attends at least, per query head it serves: its partial (G × (head_dim + 2)
/// floats, written, then read by the merge) stays under 2 / 128 of the K/V bytes it reads.
const MIN_SPLIT_SLOTS_PER_HEAD: usize = 128;

impl Splits {
    /// Enough splits that rows × KV heads × splits reaches [`TARGET_CTAS`] (one when the batch
    /// alone does), none shorter than [`MIN_SPLIT_SLOTS_PER_HEAD`] × `group` slots nor longer
    /// than the longest row's table needs.
    pub fn of(
        rows: usize,
        n_kv_heads: usize,
        group: usize,
        page_size: usize,
        max_pages: usize,
    ) -> Self {
        let max_pages = max_pages.max(1);
        let min_pages = (MIN_SPLIT_SLOTS_PER_HEAD * group)
            .div_ceil(page_size)
            .max(1);
        let want = TARGET_CTAS
            .div_ceil((rows * n_kv_heads).max(1))
            .clamp(1, max_pages.div_ceil(min_pages));
        let pages_per_split = max_pages.div_ceil(want);
        let n = max_pages.div_ceil(pages_per_split);
        debug_assert!(rows * n <= split_capacity(rows));
        Self { n, pages_per_split }
    }
}

/// The weights on the device.
struct DevWeights {
    tok_embd: DevMat,
    output: DevMat,
    output_norm: DevicePtr,
    rope_factors: DevicePtr,
    layers: Vec<DevLayer>,
}

/// `m`'s f16 copy when a step of `rows` rows takes its product to the GEMM.
fn gemm_weights(m: &DevMat, rows: usize) -> Option<DevicePtr> {
    if rows > GEMV_MAX_ROWS { m.f16 } else { None }
}

/// A matrix's Q4_K tiles (heads, quants), if it is held so.
fn q4k_tiles(m: &DevMat) -> Option<(DevicePtr, DevicePtr)> {
    match m.layout {
        Layout::Tiles {
            gemv: Kernel::GemvQ4K,
            heads,
            qs,
        } => Some((heads, qs)),
        _ => None,
    }
}

/// Which kernels a step's Q4_K products take: f32 x, int8 x with dp4a (from [`Q8_MIN_ROWS`]
/// rows, when the step's inputs were quantized), or int8 x on tensor cores (from
/// [`MMQ_MIN_ROWS`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Q4kPath {
    F32,
    Dp4a,
    TensorCores,
}

/// A path's kernels: one matrix, Q/K/V fused, gate/up fused with the SwiGLU.
struct Q4kKernels {
    single: Kernel,
    qkv: Kernel,
    swiglu: Kernel,
}

impl Q4kPath {
    fn of(q8: Option<Q8>, rows: usize) -> Self {
        match q8 {
            None => Self::F32,
            Some(_) if rows >= MMQ_MIN_ROWS => Self::TensorCores,
            Some(_) => Self::Dp4a,
        }
    }

    fn kernels(self) -> Q4kKernels {
        let [single, qkv, swiglu] = match self {
            Self::F32 => [Kernel::GemvQ4K, Kernel::GemvQ4KQkv, Kernel::GemvQ4KSwiglu],
            Self::Dp4a => [
                Kernel::GemvQ4KQ8,
                Kernel::GemvQ4KQ8Qkv,
                Kernel::GemvQ4KQ8Swiglu,
            ],
            Self::TensorCores => [Kernel::MmqQ4K, Kernel::MmqQ4KQkv, Kernel::MmqQ4KSwiglu],
        };
        Q4kKernels {
            single,
            qkv,
            swiglu,
        }
    }

    /// The launch grid over `n` x rows: `mmq_ctas` CTAs along the weight rows on tensor cores
    /// (64 x rows each), else one warp per weight row of `rows` (4 a block, 8 x rows each).
    fn dims(self, mmq_ctas: u32, rows: u32, n: usize) -> LaunchDims {
        match self {
            Self::TensorCores => {
                LaunchDims::grid2(mmq_ctas, (n as u32).div_ceil(MMQ_TILE), THREADS)
            }
            Self::F32 | Self::Dp4a => LaunchDims::grid2(
                rows.div_ceil(GEMV_WARPS),
                (n as u32).div_ceil(GEMV_BATCH),
                THREADS,
            ),
        }
    }
}

/// Whether a product of `m` takes Q8 x in a step whose inputs were quantized (`q8`): Q4_K tiles
/// (their widths are multiples of 256, the quantized layout's unit).
fn takes_q8(m: &DevMat, q8: Option<Q8>) -> Option<Q8> {
    q4k_tiles(m).and(q8)
}

/// Flash decoding's limits: head_dim a power of two in 8..=[`MAX_HEAD_DIM`], up to
/// [`MAX_GQA_GROUP`] query heads per KV head.
fn check_attention_shape(c: &ModelConfig) -> Result<(), CudaForwardError> {
    let group = c.n_heads / c.n_kv_heads;
    if !c.head_dim.is_power_of_two()
        || !(8..=MAX_HEAD_DIM).contains(&c.head_dim)
        || group > MAX_GQA_GROUP
    {
        return Err(CudaForwardError::AttentionShape {
            head_dim: c.head_dim,
            group,
        });
    }
    Ok(())
}

/// `DType::Q4_K`'s code in `custody_weight`.
const Q4K_CODE: u32 = 7;
const Q4K_WEIGHTS: usize = 256;
const Q4K_BLOCK_BYTES: usize = 144;

/// Parts of one kind, `stride_bytes` apart.
#[derive(Clone, Copy)]
struct Strided {
    at: DevicePtr,
    stride_bytes: u64,
}

/// `custody_fill_q4k` over `n_blocks` blocks, grid-striding.
fn fill_q4k<D: Device>(
    dev: &mut D,
    heads: Strided,
    qs: Strided,
    n_blocks: usize,
    blocks_per_row: usize,
    real_per_row: usize,
    seed: u64,
) -> Result<(), DeviceError> {
    let args = [
        Arg::Ptr(heads.at),
        Arg::U64(heads.stride_bytes),
        Arg::Ptr(qs.at),
        Arg::U64(qs.stride_bytes),
        Arg::U64(n_blocks as u64),
        Arg::U32(blocks_per_row as u32),
        Arg::U32(real_per_row as u32),
        Arg::U64(seed),
    ];
    let blocks = (n_blocks.div_ceil(THREADS as usize) as u32).clamp(1, 4096);
    dev.launch(
        Kernel::FillQ4K,
        LaunchDims::grid2(blocks, 1, THREADS),
        &args,
    )
}

/// A `rows × cols` Q4_K matrix of random blocks, in the GEMV's tiles.
fn fill_q4k_tiles<D: Device>(
    dev: &mut D,
    rows: usize,
    cols: usize,
    seed: u64,
) -> Result<DevMat, DeviceError> {
    assert!(cols.is_multiple_of(Q4K_WEIGHTS), "whole super-blocks");
    let tiles = custody_cuda::repack::Q4kShape::of(rows, cols);
    let heads = dev.alloc_zeroed(tiles.heads_bytes())?;
    let qs = dev.alloc_zeroed(tiles.qs_bytes())?;
    fill_q4k(
        dev,
        Strided {
            at: heads,
            stride_bytes: 16,
        },
        Strided {
            at: qs,
            stride_bytes: 128,
        },
        tiles.blocks(),
        tiles.blocks_per_row(),
        cols / Q4K_WEIGHTS,
        seed,
    )?;
    Ok(DevMat {
        layout: Layout::Tiles {
            gemv: Kernel::GemvQ4K,
            heads,
            qs,
        },
        dtype: Q4K_CODE,
        rows: rows as u32,
        cols: cols as u32,
        f16: None,
    })
}

/// A `rows × cols` Q4_K table of random blocks in the file's layout (the embedding's).
fn fill_q4k_table<D: Device>(
    dev: &mut D,
    rows: usize,
    cols: usize,
    seed: u64,
) -> Result<DevMat, DeviceError> {
    let bytes = dev.alloc_zeroed(rows * (cols / Q4K_WEIGHTS) * Q4K_BLOCK_BYTES)?;
    fill_q4k_table_at(dev, bytes, rows, cols, seed)?;
    Ok(DevMat {
        layout: Layout::Gguf(bytes),
        dtype: Q4K_CODE,
        rows: rows as u32,
        cols: cols as u32,
        f16: None,
    })
}

/// [`fill_q4k_table`] into `bytes` (at least the table's size).
fn fill_q4k_table_at<D: Device>(
    dev: &mut D,
    bytes: DevicePtr,
    rows: usize,
    cols: usize,
    seed: u64,
) -> Result<(), DeviceError> {
    assert!(cols.is_multiple_of(Q4K_WEIGHTS), "whole super-blocks");
    let per_row = cols / Q4K_WEIGHTS;
    let stride = Q4K_BLOCK_BYTES as u64;
    fill_q4k(
        dev,
        Strided {
            at: bytes,
            stride_bytes: stride,
        },
        Strided {
            at: bytes.offset(16),
            stride_bytes: stride,
        },
        rows * per_row,
        per_row,
        per_row,
        seed,
    )
}

/// Whether a product of `dtype` weights gets an f16 copy for the GEMM path: every type but
/// F32 and BF16, whose values f16 may not hold (their products keep the per-element kernel).
fn has_f16_copy(dtype: DType) -> bool {
    !matches!(dtype, DType::F32 | DType::BF16)
}

/// A `rows × cols` matrix in `dtype` (file bytes at `at`) dequantized to a new f16 matrix.
fn dequant_f16<D: Device>(
    dev: &mut D,
    at: DevicePtr,
    dtype: u32,
    rows: usize,
    cols: usize,
) -> Result<DevicePtr, DeviceError> {
    let out = dev.alloc_zeroed(rows * cols * 2)?;
    let args = [
        Arg::Ptr(at),
        Arg::U32(dtype),
        Arg::U32(cols as u32),
        Arg::Ptr(out),
    ];
    dev.launch(
        Kernel::DequantF16,
        LaunchDims::grid2(rows as u32, 1, THREADS),
        &args,
    )?;
    Ok(out)
}

/// `bytes` (a `rows × cols` matrix in `dtype`, the file's layout) uploaded to `scratch` and
/// dequantized to a new f16 matrix (the upload waits for the previous dequantization: one
/// stream).
fn f16_copy<D: Device>(
    dev: &mut D,
    scratch: DevicePtr,
    bytes: &[u8],
    dtype: u32,
    rows: usize,
    cols: usize,
) -> Result<DevicePtr, DeviceError> {
    dev.upload(scratch, bytes)?;
    dequant_f16(dev, scratch, dtype, rows, cols)
}

fn upload_bytes<D: Device>(dev: &mut D, bytes: &[u8]) -> Result<DevicePtr, DeviceError> {
    let ptr = dev.alloc_zeroed(bytes.len())?;
    dev.upload(ptr, bytes)?;
    Ok(ptr)
}

impl<D: Device> CudaForward<D> {
    /// Upload `model`'s weights and size the device pool for `pool` (its page count and
    /// geometry) and batches of up to `max_rows` rows.
    pub fn new(
        dev: D,
        model: &Model,
        pool: &PagePool,
        max_rows: usize,
    ) -> Result<Self, CudaForwardError> {
        Self::new_with(dev, model, pool, max_rows, true)
    }

    /// [`Self::new`] without the GEMM path's f16 weights: the GEMVs serve every batch. For the
    /// performance model, which counts decode steps of 8B-shaped weights held in host memory.
    pub fn new_without_gemm(
        dev: D,
        model: &Model,
        pool: &PagePool,
        max_rows: usize,
    ) -> Result<Self, CudaForwardError> {
        Self::new_with(dev, model, pool, max_rows, false)
    }

    fn new_with(
        mut dev: D,
        model: &Model,
        pool: &PagePool,
        max_rows: usize,
        gemm: bool,
    ) -> Result<Self, CudaForwardError> {
        let c = model.config.clone();
        check_attention_shape(&c)?;
        let wants_f16 = |dtype: DType| gemm && has_f16_copy(dtype);
        // The file bytes of each product with an f16 copy pass through one buffer (sized for
        // the largest) on their way to `custody_dequant_f16`.
        let scratch_bytes = model
            .layers
            .iter()
            .flat_map(|l| [&l.wq, &l.wk, &l.wv, &l.wo, &l.w_gate, &l.w_up, &l.w_down])
            .chain([&model.output])
            .filter(|m| wants_f16(m.dtype))
            .map(|m| model.tensor_bytes(m).len())
            .max()
            .unwrap_or(0);
        let scratch = dev.alloc_zeroed(scratch_bytes)?;
        // A product's f16 copy for the GEMM path, if it gets one.
        let f16_of = |dev: &mut D, m: &Mat| -> Result<Option<DevicePtr>, DeviceError> {
            if !wants_f16(m.dtype) {
                return Ok(None);
            }
            let bytes = model.tensor_bytes(m);
            f16_copy(dev, scratch, bytes, dtype_code(m), m.rows, m.cols).map(Some)
        };
        // A product's weights: Q4_K, Q6_K and Q8_0 in their GEMV's tiles, every other type as
        // in the file; and as f16 for the GEMM path.
        let upload_mat = |dev: &mut D, m: &Mat| -> Result<DevMat, CudaForwardError> {
            let bytes = model.tensor_bytes(m);
            let layout = match tiled(m.dtype) {
                Some((gemv, repack)) => {
                    let t = repack(bytes, m.rows, m.cols).map_err(|source| {
                        CudaForwardError::Repack {
                            name: m.name.clone(),
                            source,
                        }
                    })?;
                    Layout::Tiles {
                        gemv,
                        heads: upload_bytes(dev, &t.heads)?,
                        qs: upload_bytes(dev, &t.qs)?,
                    }
                }
                None => Layout::Gguf(upload_bytes(dev, bytes)?),
            };
            Ok(DevMat {
                layout,
                dtype: dtype_code(m),
                rows: m.rows as u32,
                cols: m.cols as u32,
                f16: f16_of(dev, m)?,
            })
        };
        // The embedding table, looked up by row: always the file's layout.
        let upload_table = |dev: &mut D, m: &Mat| -> Result<DevMat, CudaForwardError> {
            Ok(DevMat {
                layout: Layout::Gguf(upload_bytes(dev, model.tensor_bytes(m))?),
                dtype: dtype_code(m),
                rows: m.rows as u32,
                cols: m.cols as u32,
                f16: None,
            })
        };
        let upload_vec = |dev: &mut D, v: &[f32]| -> Result<DevicePtr, CudaForwardError> {
            let ptr = dev.alloc_zeroed(v.len() * 4)?;
            dev.upload(ptr, f32_bytes(v))?;
            Ok(ptr)
        };
        let tok_embd = upload_table(&mut dev, &model.tok_embd)?;
        // A tied output head shares the table's bytes unless the product reads another layout
        // (a tiled type's table is then held twice: the file's for lookups, the tiles for the
        // head).
        let output =
            if model.output.name == model.tok_embd.name && tiled(model.output.dtype).is_none() {
                DevMat {
                    f16: f16_of(&mut dev, &model.output)?,
                    ..tok_embd
                }
            } else {
                upload_mat(&mut dev, &model.output)?
            };
        let output_norm = upload_vec(&mut dev, &model.output_norm)?;
        let ones = vec![1.0f32; c.rope_dims / 2];
        let rope_factors = upload_vec(&mut dev, model.rope_freqs.as_deref().unwrap_or(&ones))?;
        let mut layers = Vec::with_capacity(c.n_layers);
        for l in &model.layers {
            let qkv_bias = match &l.qkv_bias {
                Some(b) => Some([
                    upload_vec(&mut dev, &b.q)?,
                    upload_vec(&mut dev, &b.k)?,
                    upload_vec(&mut dev, &b.v)?,
                ]),
                None => None,
            };
            let qk_norm = match &l.qk_norm {
                Some(n) => Some([upload_vec(&mut dev, &n.q)?, upload_vec(&mut dev, &n.k)?]),
                None => None,
            };
            layers.push(DevLayer {
                qkv_bias,
                qk_norm,
                attn_norm: upload_vec(&mut dev, &l.attn_norm)?,
                wq: upload_mat(&mut dev, &l.wq)?,
                wk: upload_mat(&mut dev, &l.wk)?,
                wv: upload_mat(&mut dev, &l.wv)?,
                wo: upload_mat(&mut dev, &l.wo)?,
                ffn_norm: upload_vec(&mut dev, &l.ffn_norm)?,
                w_gate: upload_mat(&mut dev, &l.w_gate)?,
                w_up: upload_mat(&mut dev, &l.w_up)?,
                w_down: upload_mat(&mut dev, &l.w_down)?,
            });
        }
        let w = DevWeights {
            tok_embd,
            output,
            output_norm,
            rope_factors,
            layers,
        };
        Ok(Self::with_weights(dev, c, w, pool, max_rows)?)
    }

    /// A model of `config`'s shape whose weights are made on the device
    /// (`custody_fill_q4k`, deterministic in `seed`): every product Q4_K in the GEMV's tiles,
    /// the embedding Q4_K in the file's layout, norms 1 — for measuring speed at served sizes
    /// (`custody gpu-check speed`) without writing or uploading gigabytes. Llama-family
    /// configurations only (no biases, no Q/K norm). With `gemm`, each product also gets the
    /// GEMM path's f16 copy — of a random Q4_K matrix made like its tiles (same heads, its own
    /// quants: speed, not parity, is what these weights are for); without, the GEMVs serve
    /// every batch (the performance model, which holds 8B-shaped weights in host memory).
    pub fn synthetic(
        mut dev: D,
        config: ModelConfig,
        pool: &PagePool,
        max_rows: usize,
        seed: u64,
        gemm: bool,
    ) -> Result<Self, CudaForwardError> {
        let c = config;
        check_attention_shape(&c)?;
        let largest = (c.vocab_size.max(c.ffn_dim) * c.dim).div_ceil(Q4K_WEIGHTS) * Q4K_BLOCK_BYTES;
        let scratch = if gemm {
            Some(dev.alloc_zeroed(largest)?)
        } else {
            None
        };
        let mut n = 0u64;
        let mut mat = |dev: &mut D, rows: usize, cols: usize| -> Result<DevMat, DeviceError> {
            n += 1;
            let m = fill_q4k_tiles(dev, rows, cols, seed.wrapping_add(n))?;
            let Some(scratch) = scratch else {
                return Ok(m);
            };
            fill_q4k_table_at(dev, scratch, rows, cols, seed.wrapping_add(n))?;
            let f16 = dequant_f16(dev, scratch, Q4K_CODE, rows, cols)?;
            Ok(DevMat {
                f16: Some(f16),
                ..m
            })
        };
        let ones = |dev: &mut D, len: usize| upload_bytes(dev, f32_bytes(&vec![1.0f32; len]));
        let mut layers = Vec::with_capacity(c.n_layers);
        let (qd, kvd) = (c.q_dim(), c.kv_dim());
        for _ in 0..c.n_layers {
            layers.push(DevLayer {
                attn_norm: ones(&mut dev, c.dim)?,
                wq: mat(&mut dev, qd, c.dim)?,
                wk: mat(&mut dev, kvd, c.dim)?,
                wv: mat(&mut dev, kvd, c.dim)?,
                wo: mat(&mut dev, c.dim, qd)?,
                ffn_norm: ones(&mut dev, c.dim)?,
                w_gate: mat(&mut dev, c.ffn_dim, c.dim)?,
                w_up: mat(&mut dev, c.ffn_dim, c.dim)?,
                w_down: mat(&mut dev, c.dim, c.ffn_dim)?,
                qkv_bias: None,
                qk_norm: None,
            });
        }
        let w = DevWeights {
            tok_embd: fill_q4k_table(&mut dev, c.vocab_size, c.dim, seed)?,
            output: mat(&mut dev, c.vocab_size, c.dim)?,
            output_norm: ones(&mut dev, c.dim)?,
            rope_factors: ones(&mut dev, c.rope_dims / 2)?,
            layers,
        };
        Ok(Self::with_weights(dev, c, w, pool, max_rows)?)
    }

    /// The device pool and buffers beside uploaded weights.
    fn with_weights(
        mut dev: D,
        c: ModelConfig,
        w: DevWeights,
        pool: &PagePool,
        max_rows: usize,
    ) -> Result<Self, DeviceError> {
        assert!(max_rows > 0);
        // The engine refuses any other cache type on this backend before it gets here.
        assert_eq!(
            pool.geometry().kv,
            custody_kernels::attention::KvType::F16,
            "the CUDA kernels read f16 pages"
        );
        let kv = Self::alloc_kv(&mut dev, pool, c.n_layers)?;
        let bufs = Self::alloc_buffers(&mut dev, &c, max_rows, 1024)?;
        let gemm_weight_bytes = w
            .layers
            .iter()
            .flat_map(|l| [l.wq, l.wk, l.wv, l.wo, l.w_gate, l.w_up, l.w_down])
            .chain([w.output])
            .filter(|m| m.f16.is_some())
            .map(|m| u64::from(m.rows) * u64::from(m.cols) * 2)
            .sum();
        let has_q4k = w
            .layers
            .iter()
            .flat_map(|l| [l.wq, l.wk, l.wv, l.wo, l.w_gate, l.w_up, l.w_down])
            .chain([w.output])
            .any(|m| q4k_tiles(&m).is_some());
        Ok(Self {
            dev,
            page_size: pool.page_size(),
            config: c,
            max_rows,
            tok_embd: w.tok_embd,
            output: w.output,
            output_norm: w.output_norm,
            rope_factors: w.rope_factors,
            layers: w.layers,
            kv,
            bufs,
            audit_tags: true,
            use_graphs: true,
            graphs: std::collections::VecDeque::new(),
            gemm_weight_bytes,
            has_q4k,
            use_q8: true,
        })
    }

    /// The device pool: one allocation for every layer's K and V.
    fn alloc_kv(dev: &mut D, pool: &PagePool, n_layers: usize) -> Result<DeviceKv, DeviceError> {
        let n_pages = pool.n_pages();
        let part_bytes = (n_pages * pool.geometry().page_words() * 2) as u64;
        let all = dev.alloc_zeroed((part_bytes as usize) * 2 * n_layers)?;
        let part = |i: usize| all.offset(part_bytes * i as u64);
        Ok(DeviceKv {
            k: (0..n_layers).map(|l| part(2 * l)).collect(),
            v: (0..n_layers).map(|l| part(2 * l + 1)).collect(),
            generation: dev.alloc_zeroed(n_pages * 4)?,
            owner: dev.alloc_zeroed(n_pages * 8)?,
            filled: dev.alloc_zeroed(n_layers * n_pages * 4)?,
            staging: dev.alloc_zeroed(DeviceKv::staging_bytes(n_pages, n_layers))?,
            stamp_owner: dev.alloc_zeroed(n_pages * 8)?,
            stamp_generation: dev.alloc_zeroed(n_pages * 4)?,
            n_pages: n_pages as u32,
        })
    }

    fn alloc_buffers(
        dev: &mut D,
        c: &ModelConfig,
        rows: usize,
        table_capacity: usize,
    ) -> Result<Buffers, DeviceError> {
        let qd = c.n_heads * c.head_dim;
        let mut f = |elems: usize| dev.alloc_zeroed(elems * 4);
        Ok(Buffers {
            x: f(rows * c.dim)?,
            xn: f(rows * c.dim)?,
            q: f(rows * qd)?,
            k: f(rows * c.kv_dim())?,
            v: f(rows * c.kv_dim())?,
            att: f(rows * qd)?,
            tmp: f(rows * c.dim)?,
            gate: f(rows * c.ffn_dim)?,
            up: f(rows * c.ffn_dim)?,
            logits: f(rows * c.vocab_size)?,
            tokens: f(rows)?,
            positions: f(rows)?,
            write_pages: f(rows)?,
            write_slots: f(rows)?,
            tables: f(table_capacity * 2)?,
            table_off: f(rows)?,
            table_len: f(rows)?,
            n_ctx: f(rows)?,
            readers: f(rows * 2 * (1 + MAX_SHARED))?,
            head_rows: f(rows)?,
            tiles: f(rows * 2)?,
            arrivals: f(rows * c.n_kv_heads)?,
            decode_rows: f(rows)?,
            // One verdict per row and layer (6 words each): read once after the step.
            verdicts: f(c.n_layers * rows * 6)?,
            partial: f(split_capacity(rows) * c.n_heads * (c.head_dim + 2))?,
            bad: f(split_capacity(rows) * c.n_kv_heads)?,
            // f16: half a float each.
            x16: f((rows * c.dim.max(c.q_dim()).max(c.ffn_dim)).div_ceil(2))?,
            q8: {
                // A byte per value and two floats per 32 (an eighth of a float per value).
                let values = rows.min(GEMV_MAX_ROWS) * c.dim.max(c.q_dim()).max(c.ffn_dim);
                Q8 {
                    xq: f(values.div_ceil(4))?,
                    xs: f(values.div_ceil(16))?,
                }
            },
            table_capacity,
        })
    }

    /// Copy `pages`' K/V (every layer) from the device into `pool`'s host memory: before the
    /// disaggregated transfer path reads them (it sends host memory; device-to-NIC transfers
    /// are not built). The device and host pools have the same page layout.
    pub fn stage_to_host(
        &mut self,
        pool: &mut PagePool,
        pages: &[PageRef],
    ) -> Result<(), DeviceError> {
        let page_bytes = (pool.geometry().page_words() * 2) as u64;
        for layer in 0..self.config.n_layers {
            for pr in pages {
                let at = page_bytes * u64::from(pr.page);
                let (k, v) = pool.host_page_kv_mut(layer, pr.page);
                self.dev
                    .download(self.kv.k[layer].offset(at), bytes_of_mut(k))?;
                self.dev
                    .download(self.kv.v[layer].offset(at), bytes_of_mut(v))?;
            }
        }
        Ok(())
    }

    /// Copy `pages`' K/V from `pool`'s host memory to the device: after a transfer landed in
    /// them and was verified, before decode reads them.
    pub fn stage_to_device(
        &mut self,
        pool: &mut PagePool,
        pages: &[PageRef],
    ) -> Result<(), DeviceError> {
        let page_bytes = (pool.geometry().page_words() * 2) as u64;
        for layer in 0..self.config.n_layers {
            for pr in pages {
                let at = page_bytes * u64::from(pr.page);
                let (k, v) = pool.host_page_kv_mut(layer, pr.page);
                self.dev.upload(self.kv.k[layer].offset(at), bytes_of(k))?;
                self.dev.upload(self.kv.v[layer].offset(at), bytes_of(v))?;
            }
        }
        Ok(())
    }

    /// Debug builds: whether each tag sync is followed by the whole-copy comparison.
    pub fn set_tag_audit(&mut self, on: bool) {
        self.audit_tags = on;
    }

    /// The device (the performance model reads a counting device's counts through it).
    pub fn device_mut(&mut self) -> &mut D {
        &mut self.dev
    }

    /// Whether steps run as captured graphs (the default) or kernel by kernel; turning them
    /// off drops the graphs held.
    pub fn set_graphs(&mut self, on: bool) -> Result<(), DeviceError> {
        self.use_graphs = on;
        if !on {
            self.drop_graphs()?;
        }
        Ok(())
    }

    /// Q4_K products on int8 x with dp4a in steps of [`Q8_MIN_ROWS`]..=[`GEMV_MAX_ROWS`] rows
    /// (on by default), or on f32 x. The held graphs are dropped: they name the other kernels.
    pub fn set_dp4a(&mut self, on: bool) -> Result<(), DeviceError> {
        self.use_q8 = on;
        self.drop_graphs()
    }

    /// Graphs held now.
    pub fn graphs_held(&self) -> usize {
        self.graphs.len()
    }

    /// Drop every graph (before a buffer they name is replaced).
    fn drop_graphs(&mut self) -> Result<(), DeviceError> {
        while let Some((_, g)) = self.graphs.pop_front() {
            self.dev.drop_graph(g)?;
        }
        Ok(())
    }

    /// What the backend runs on, for the startup log line.
    /// The device, and what the GEMM path's weights cost it.
    pub fn describe(&self) -> String {
        format!(
            "{}; f16 weights for the GEMM path (batches over {GEMV_MAX_ROWS} rows): {} MiB",
            self.dev.describe(),
            self.gemm_weight_bytes >> 20
        )
    }

    /// Device memory the GEMM path's f16 copies of the weights take.
    pub fn gemm_weight_bytes(&self) -> u64 {
        self.gemm_weight_bytes
    }

    /// `x` (`elems` floats) as f16 in the GEMM path's input buffer.
    fn stage_f16(&mut self, x: DevicePtr, elems: usize) -> Result<(), DeviceError> {
        let args = [Arg::Ptr(x), Arg::Ptr(self.bufs.x16), Arg::U64(elems as u64)];
        let blocks = elems.div_ceil(THREADS as usize) as u32;
        self.launch(Kernel::ToF16, LaunchDims::grid2(blocks, 1, THREADS), &args)
    }

    /// `out` = `m` · the f16 input buffer's `n` rows, by the library GEMM on `w16`.
    fn gemm(
        &mut self,
        w16: DevicePtr,
        m: DevMat,
        out: DevicePtr,
        n: usize,
    ) -> Result<(), DeviceError> {
        self.dev.gemm_f16(GemmF16 {
            w: w16,
            x: self.bufs.x16,
            out,
            rows: m.rows,
            cols: m.cols,
            n: n as u32,
        })
    }

    fn launch(&mut self, k: Kernel, dims: LaunchDims, args: &[Arg]) -> Result<(), DeviceError> {
        self.dev.launch(k, dims, args)
    }

    /// RMSNorm of `rows` rows of `width` (the embedding, or one head for the Q/K norm; `out`
    /// may be `x`: each element is read before it is written, by the same thread).
    /// `x += y`, then `out` = RMSNorm(x) · w, per row of the model's width (one kernel).
    /// With `q8`, `out` is also stored quantized for the dp4a GEMVs.
    fn add_rms_norm(
        &mut self,
        x: DevicePtr,
        y: DevicePtr,
        w: DevicePtr,
        out: DevicePtr,
        rows: usize,
        q8: Option<Q8>,
    ) -> Result<(), DeviceError> {
        let c = &self.config;
        let [xq, xs] = Q8::args(q8);
        let args = [
            Arg::Ptr(x),
            Arg::Ptr(y),
            Arg::Ptr(w),
            Arg::F32(c.rms_eps),
            Arg::U32(c.dim as u32),
            Arg::Ptr(out),
            xq,
            xs,
        ];
        self.launch(
            Kernel::AddRmsNorm,
            LaunchDims::grid2(rows as u32, 1, THREADS),
            &args,
        )
    }

    fn rms_norm(
        &mut self,
        x: DevicePtr,
        w: DevicePtr,
        out: DevicePtr,
        rows: usize,
        width: usize,
        q8: Option<Q8>,
    ) -> Result<(), DeviceError> {
        let c = &self.config;
        debug_assert!(q8.is_none() || width.is_multiple_of(256));
        let [xq, xs] = Q8::args(q8);
        let args = [
            Arg::Ptr(x),
            Arg::Ptr(w),
            Arg::F32(c.rms_eps),
            Arg::U32(width as u32),
            Arg::Ptr(out),
            xq,
            xs,
        ];
        self.launch(
            Kernel::RmsNorm,
            LaunchDims::grid2(rows as u32, 1, THREADS),
            &args,
        )
    }

    /// `out` = `m` · x for `rows` rows of x: the GEMM path, the dp4a GEMV on `x`'s quantized
    /// copy (`q8`: Q4_K tiles only — [`takes_q8`]), or the GEMV or per-element kernel on f32 x.
    fn matvec(
        &mut self,
        m: DevMat,
        x: DevicePtr,
        out: DevicePtr,
        rows: usize,
        q8: Option<Q8>,
    ) -> Result<(), DeviceError> {
        if let Some(w16) = gemm_weights(&m, rows) {
            self.stage_f16(x, rows * m.cols as usize)?;
            return self.gemm(w16, m, out, rows);
        }
        if let (Some(q), Some((heads, qs))) = (takes_q8(&m, q8), q4k_tiles(&m)) {
            let path = Q4kPath::of(Some(q), rows);
            let dims = path.dims(m.rows.div_ceil(MMQ_TILE), m.rows, rows);
            let args = [
                Arg::Ptr(heads),
                Arg::Ptr(qs),
                Arg::U32(m.rows),
                Arg::U32(m.cols),
                Arg::Ptr(q.xq),
                Arg::Ptr(q.xs),
                Arg::U32(rows as u32),
                Arg::Ptr(out),
            ];
            return self.launch(path.kernels().single, dims, &args);
        }
        match m.layout {
            Layout::Gguf(w) => {
                let args = [
                    Arg::Ptr(w),
                    Arg::U32(m.dtype),
                    Arg::U32(m.rows),
                    Arg::U32(m.cols),
                    Arg::Ptr(x),
                    Arg::Ptr(out),
                ];
                self.launch(
                    Kernel::Matvec,
                    LaunchDims::grid2(m.rows, rows as u32, THREADS),
                    &args,
                )
            }
            Layout::Tiles { gemv, heads, qs } => {
                let args = [
                    Arg::Ptr(heads),
                    Arg::Ptr(qs),
                    Arg::U32(m.rows),
                    Arg::U32(m.cols),
                    Arg::Ptr(x),
                    Arg::U32(rows as u32),
                    Arg::Ptr(out),
                ];
                let dims = LaunchDims::grid2(
                    m.rows.div_ceil(GEMV_WARPS),
                    (rows as u32).div_ceil(GEMV_BATCH),
                    THREADS,
                );
                self.launch(gemv, dims, &args)
            }
        }
    }

    fn elementwise(
        &mut self,
        k: Kernel,
        a: DevicePtr,
        b: DevicePtr,
        n: usize,
    ) -> Result<(), DeviceError> {
        let blocks = n.div_ceil(THREADS as usize) as u32;
        self.launch(
            k,
            LaunchDims::grid2(blocks, 1, THREADS),
            &[Arg::Ptr(a), Arg::Ptr(b), Arg::U64(n as u64)],
        )
    }

    /// `x` (`n` elements) += `bias` on every row of `bias`'s `width`.
    fn add_rows(
        &mut self,
        x: DevicePtr,
        bias: DevicePtr,
        width: usize,
        n: usize,
    ) -> Result<(), DeviceError> {
        let blocks = n.div_ceil(THREADS as usize) as u32;
        self.launch(
            Kernel::AddRows,
            LaunchDims::grid2(blocks, 1, THREADS),
            &[
                Arg::Ptr(x),
                Arg::Ptr(bias),
                Arg::U32(width as u32),
                Arg::U64(n as u64),
            ],
        )
    }

    /// The architecture's steps between the Q/K/V projections and RoPE: biases, then the
    /// per-head norm (the CPU forward pass's order).
    fn qkv_extras(&mut self, l: &DevLayer, n: usize) -> Result<(), DeviceError> {
        let c = self.config.clone();
        let (bf, qd, kvd) = (self.bufs, c.q_dim(), c.kv_dim());
        if let Some([bq, bk, bv]) = l.qkv_bias {
            self.add_rows(bf.q, bq, qd, n * qd)?;
            self.add_rows(bf.k, bk, kvd, n * kvd)?;
            self.add_rows(bf.v, bv, kvd, n * kvd)?;
        }
        if let Some([nq, nk]) = l.qk_norm {
            self.rms_norm(bf.q, nq, bf.q, n * c.n_heads, c.head_dim, None)?;
            self.rms_norm(bf.k, nk, bf.k, n * c.n_kv_heads, c.head_dim, None)?;
        }
        Ok(())
    }

    fn upload_u32(&mut self, dst: DevicePtr, v: &[u32]) -> Result<(), DeviceError> {
        self.dev.upload_async(dst, bytes_of(v))
    }

    /// Stage the pages whose tag changed since the last step ([`PagePool::take_tag_changes`])
    /// in the staging buffer — their count first, zero when nothing changed — for the step's
    /// `custody_tag_apply` (one packed upload per step, not per layer).
    fn stage_tags(&mut self, pool: &mut PagePool) -> Result<usize, DeviceError> {
        let pages = pool.take_tag_changes();
        let n = pages.len();
        let n_layers = pool.n_layers();
        debug_assert!(
            n <= self.kv.n_pages as usize,
            "a page changes once per step"
        );
        let mut wide: Vec<u64> = Vec::with_capacity(1 + 2 * n);
        let mut narrow: Vec<u32> = Vec::with_capacity((3 + n_layers) * n);
        let t = pool.tags(0);
        wide.push(n as u64);
        wide.extend(pages.iter().map(|&p| t.owner[p as usize]));
        wide.extend(pages.iter().map(|&p| t.stamp_owner[p as usize]));
        narrow.extend(&pages);
        narrow.extend(pages.iter().map(|&p| t.generation[p as usize]));
        narrow.extend(pages.iter().map(|&p| t.stamp_generation[p as usize]));
        for layer in 0..n_layers {
            let f = pool.tags(layer).filled;
            narrow.extend(pages.iter().map(|&p| f[p as usize]));
        }
        let mut packed = bytes_of(&wide).to_vec();
        packed.extend_from_slice(bytes_of(&narrow));
        debug_assert!(packed.len() <= DeviceKv::staging_bytes(self.kv.n_pages as usize, n_layers));
        self.dev.upload_async(self.kv.staging, &packed)?;
        Ok(n)
    }

    /// Apply the staged tag changes to the device's copy (fixed grid: the same launch every
    /// step, so a graph holds it).
    fn apply_tags(&mut self) -> Result<(), DeviceError> {
        let kv = &self.kv;
        let args = [
            Arg::Ptr(kv.staging),
            Arg::U32(self.config.n_layers as u32),
            Arg::U32(kv.n_pages),
            Arg::Ptr(kv.generation),
            Arg::Ptr(kv.owner),
            Arg::Ptr(kv.stamp_owner),
            Arg::Ptr(kv.stamp_generation),
            Arg::Ptr(kv.filled),
        ];
        let blocks = kv.n_pages.div_ceil(THREADS).clamp(1, TAG_APPLY_BLOCKS);
        self.launch(
            Kernel::TagApply,
            LaunchDims::grid2(blocks, 1, THREADS),
            &args,
        )
    }

    /// Bring the device's copy of the tags up to date now, outside a step: the changes staged
    /// and applied by one launch. Debug builds then check the whole copy against the pool (a
    /// tag write that bypassed the change log would show here). Each `forward` does the same
    /// inside its step; the performance model calls this first so that its counted step sees
    /// only the step's own changes.
    pub fn sync_tags(&mut self, pool: &mut PagePool) -> Result<(), DeviceError> {
        self.stage_tags(pool)?;
        self.apply_tags()?;
        #[cfg(debug_assertions)]
        if self.audit_tags {
            self.assert_tags_match(pool)?;
        }
        Ok(())
    }

    /// Debug builds: the device's whole copy of the tags equals the pool's.
    #[cfg(debug_assertions)]
    fn assert_tags_match(&mut self, pool: &PagePool) -> Result<(), DeviceError> {
        let n = self.kv.n_pages as usize;
        let t = pool.tags(0);
        let mut g = vec![0u32; n];
        let mut o = vec![0u64; n];
        let mut so = vec![0u64; n];
        let mut sg = vec![0u32; n];
        self.dev
            .download(self.kv.generation, bytes_of_mut(&mut g))?;
        self.dev.download(self.kv.owner, bytes_of_mut(&mut o))?;
        self.dev
            .download(self.kv.stamp_owner, bytes_of_mut(&mut so))?;
        self.dev
            .download(self.kv.stamp_generation, bytes_of_mut(&mut sg))?;
        assert!(
            g == t.generation && o == t.owner && so == t.stamp_owner && sg == t.stamp_generation,
            "the device's tags differ from the pool's: a tag write bypassed PagePool::tag_changed"
        );
        for layer in 0..pool.n_layers() {
            let mut f = vec![0u32; n];
            let at = self.kv.filled.offset((layer * n * 4) as u64);
            self.dev.download(at, bytes_of_mut(&mut f))?;
            assert!(
                f == pool.tags(layer).filled,
                "layer {layer}'s filled slots on the device differ from the pool's"
            );
        }
        Ok(())
    }

    /// Run a batch: per segment, its logits (`rows × vocab`, rows per [`Logits`]) or the
    /// integrity error that failed it — [`Model::forward`]'s contract. `Err` only for a device
    /// failure or a batch this backend cannot run (then no tag changed... except the claims of
    /// rows already made: the engine aborts the batch's requests on such an error).
    ///
    /// The host fills the step's inputs (tokens, positions, tables, write slots, tag changes,
    /// poisoned verdicts), runs the step (one graph replay, see the module's spec), then reads
    /// every layer's verdicts and the wanted logits back.
    pub fn forward(
        &mut self,
        pool: &mut PagePool,
        segments: &[Segment<'_>],
    ) -> Result<Vec<Result<Vec<f32>, IntegrityError>>, CudaForwardError> {
        let rows = Rows::of(segments);
        assert!(!rows.positions.is_empty(), "forward: empty batch");
        self.check_batch(segments, &rows)?;
        let wanted = wanted_rows(segments, &rows);
        // A step with a prompt for the prefill kernel runs kernel by kernel (its tiles vary
        // step to step; graphs are for decoding), whether or not graphs are on — so that a step
        // takes the same kernels either way (`set_graphs`' comparison is bit for bit).
        let plan = self
            .prefill_fits()
            .then(|| PrefillPlan::of(&rows, segments.len()))
            .filter(|p| !p.tiles.is_empty());
        let mut shape = self.step_shape(&rows, wanted.len(), plan.is_none());
        if !shape.graph {
            let b = self.bufs.head_rows;
            self.upload_u32(b, &wanted)?;
            if let Some(plan) = plan {
                self.plan_prefill(&rows, plan, &mut shape)?;
            }
        }
        self.upload_inputs(segments, &rows, shape.rows)?;
        self.upload_tables(segments, &rows, shape.rows)?;
        let mut failed: Vec<Option<IntegrityError>> = vec![None; segments.len()];
        self.claim_rows(pool, segments, &rows, shape.rows, &mut failed)?;
        self.stage_tags(pool)?;
        let poisoned = self.poison_verdicts(shape.rows)?;
        self.run_step(shape)?;
        #[cfg(debug_assertions)]
        if self.audit_tags {
            self.assert_tags_match(pool)?;
        }
        self.read_verdicts(segments, &rows, shape.rows, poisoned, &mut failed)?;
        self.read_logits(segments, &rows, shape, failed)
    }

    /// The step's launch shape: rows padded to a power of two (a graph: a `decoding` step — no
    /// prompt tiles — of up to [`MAX_GRAPH_ROWS`] rows) or as they are, and the splits of the
    /// longest context rounded up to a power of two of pages (so that the contexts of a decoding
    /// batch map to few graphs).
    fn step_shape(&self, rows: &Rows, wanted: usize, decoding: bool) -> StepShape {
        let c = &self.config;
        let n = rows.positions.len();
        let graph = self.use_graphs && decoding && n <= MAX_GRAPH_ROWS;
        let padded = if graph {
            n.next_power_of_two().min(self.max_rows)
        } else {
            n
        };
        let max_pages = rows
            .positions
            .iter()
            .map(|&p| (p + 1).div_ceil(self.page_size))
            .max()
            .unwrap_or(1);
        let splits = Splits::of(
            padded,
            c.n_kv_heads,
            c.n_heads / c.n_kv_heads,
            self.page_size,
            if graph {
                max_pages.next_power_of_two()
            } else {
                max_pages
            },
        );
        debug_assert!(padded >= n && padded <= self.max_rows);
        StepShape {
            rows: padded,
            splits,
            graph,
            head_rows: if graph { padded } else { wanted },
            prefill_tiles: 0,
            decode_rows: padded,
        }
    }

    /// Whether the model's heads fit `custody_flash_prefill` (else flash decoding serves every
    /// step).
    fn prefill_fits(&self) -> bool {
        let d = self.config.head_dim;
        d.is_multiple_of(16) && d <= PREFILL_MAX_DIM
    }

    /// Divide a kernel-by-kernel step's attention (see [`PrefillPlan`]): upload the tiles and
    /// the rows left to flash decoding, whose splits are cut for those rows alone.
    fn plan_prefill(
        &mut self,
        rows: &Rows,
        plan: PrefillPlan,
        shape: &mut StepShape,
    ) -> Result<(), DeviceError> {
        let c = &self.config;
        let max_pages = plan
            .decode_rows
            .iter()
            .map(|&r| (rows.positions[r as usize] + 1).div_ceil(self.page_size))
            .max()
            .unwrap_or(1);
        shape.splits = Splits::of(
            plan.decode_rows.len(),
            c.n_kv_heads,
            c.n_heads / c.n_kv_heads,
            self.page_size,
            max_pages,
        );
        shape.prefill_tiles = plan.tiles.len() / 2;
        shape.decode_rows = plan.decode_rows.len();
        let b = self.bufs;
        self.upload_u32(b.tiles, &plan.tiles)?;
        if !plan.decode_rows.is_empty() {
            self.upload_u32(b.decode_rows, &plan.decode_rows)?;
        }
        Ok(())
    }

    /// Every launch of a step, in order: the tag changes applied, the embedding, the layers,
    /// the output head over all `shape.rows` rows.
    fn launch_step(&mut self, shape: StepShape) -> Result<(), DeviceError> {
        let c = self.config.clone();
        let (n, bf) = (shape.rows, self.bufs);
        self.apply_tags()?;
        let e = self.tok_embd;
        let args = [
            Arg::Ptr(e.gguf()),
            Arg::U32(e.dtype),
            Arg::U32(e.cols),
            Arg::Ptr(bf.tokens),
            Arg::Ptr(bf.x),
        ];
        self.launch(
            Kernel::Embed,
            LaunchDims::grid2(n as u32, 1, THREADS),
            &args,
        )?;
        // Each residual add is fused with the norm that follows it (the next layer's attention
        // norm, or the output norm after the last layer): only the first norm stands alone.
        // The step's quantized inputs: the norms' rows (model width), attention's output
        // (written by flash decoding's merge when its heads are whole blocks of 32) and the
        // SwiGLU's (quantized by a launch of its own, only for a Q4_K down product).
        let q8 = self.q8_step(shape);
        let xn_q8 = q8.filter(|_| c.dim.is_multiple_of(256));
        // The prefill kernel stores no int8 copy: a step with prompt tiles quantizes the
        // attention's output with a launch of its own (for a Q4_K O product).
        let merge_q8 = q8.filter(|_| {
            shape.prefill_tiles == 0
                && c.head_dim.is_multiple_of(32)
                && c.q_dim().is_multiple_of(256)
        });
        self.rms_norm(bf.x, self.layers[0].attn_norm, bf.xn, n, c.dim, xn_q8)?;
        for li in 0..c.n_layers {
            let l = self.layers[li];
            self.qkv(&l, n, xn_q8)?;
            self.qkv_extras(&l, n)?;
            self.rope_kv_write(li, n)?;
            self.attend(li, shape, merge_q8)?;
            let att_q8 = match (merge_q8, takes_q8(&l.wo, q8)) {
                (Some(q), _) => Some(q),
                (None, Some(q)) => {
                    self.quantize_q8(bf.att, c.q_dim(), n, q)?;
                    Some(q)
                }
                (None, None) => None,
            };
            self.matvec(l.wo, bf.att, bf.tmp, n, att_q8)?;
            self.add_rms_norm(bf.x, bf.tmp, l.ffn_norm, bf.xn, n, xn_q8)?;
            self.gate_up_swiglu(&l, n, xn_q8)?;
            let down_q8 = takes_q8(&l.w_down, q8);
            if let Some(q) = down_q8 {
                self.quantize_q8(bf.gate, c.ffn_dim, n, q)?;
            }
            self.matvec(l.w_down, bf.gate, bf.tmp, n, down_q8)?;
            let next_norm = match self.layers.get(li + 1) {
                Some(next) => next.attn_norm,
                None => self.output_norm,
            };
            self.add_rms_norm(bf.x, bf.tmp, next_norm, bf.xn, n, xn_q8)?;
        }
        // `xn` holds the output norm's rows (fused with the last layer's residual add).
        if shape.graph {
            return self.matvec(self.output, bf.xn, bf.logits, n, xn_q8);
        }
        let h = shape.head_rows;
        if h == 0 {
            return Ok(());
        }
        let args = [
            Arg::Ptr(bf.xn),
            Arg::Ptr(bf.head_rows),
            Arg::U32(c.dim as u32),
            Arg::Ptr(bf.tmp),
        ];
        self.launch(
            Kernel::GatherRows,
            LaunchDims::grid2(h as u32, 1, THREADS),
            &args,
        )?;
        // The gathered rows have no quantized copy: the head reads them as f32.
        self.matvec(self.output, bf.tmp, bf.logits, h, None)
    }

    /// The quantized-input buffer when this step takes Q4_K products on int8 x
    /// ([`Q8_MIN_ROWS`]..=[`GEMV_MAX_ROWS`] rows and a Q4_K product in the model).
    fn q8_step(&self, shape: StepShape) -> Option<Q8> {
        let fits = (Q8_MIN_ROWS..=GEMV_MAX_ROWS).contains(&shape.rows);
        (fits && self.has_q4k && self.use_q8).then_some(self.bufs.q8)
    }

    /// `x` (`rows` rows of `width`, a multiple of 256) quantized into `q8`.
    fn quantize_q8(
        &mut self,
        x: DevicePtr,
        width: usize,
        rows: usize,
        q8: Q8,
    ) -> Result<(), DeviceError> {
        debug_assert!(width.is_multiple_of(256) && rows <= GEMV_MAX_ROWS);
        let args = [
            Arg::Ptr(x),
            Arg::U32(width as u32),
            Arg::Ptr(q8.xq),
            Arg::Ptr(q8.xs),
        ];
        self.launch(
            Kernel::QuantizeQ8,
            LaunchDims::grid2(rows as u32, 1, THREADS),
            &args,
        )
    }

    /// Run the step: its graph replayed (captured first if this shape has none; the oldest
    /// graph dropped past [`MAX_GRAPHS`]), or its kernels one by one.
    fn run_step(&mut self, shape: StepShape) -> Result<(), DeviceError> {
        if !shape.graph {
            return self.launch_step(shape);
        }
        let held = self
            .graphs
            .iter()
            .find(|(s, _)| *s == shape)
            .map(|&(_, g)| g);
        let graph = match held {
            Some(g) => g,
            None => {
                if self.graphs.len() == MAX_GRAPHS
                    && let Some((_, oldest)) = self.graphs.pop_front()
                {
                    self.dev.drop_graph(oldest)?;
                }
                self.dev.begin_capture()?;
                let launched = self.launch_step(shape);
                // The capture ends whether or not every launch was recorded; a graph of a
                // failed step is dropped, not held.
                let g = self.dev.end_capture()?;
                if let Err(e) = launched {
                    self.dev.drop_graph(g)?;
                    return Err(e);
                }
                self.graphs.push_back((shape, g));
                g
            }
        };
        debug_assert!(self.graphs.len() <= MAX_GRAPHS);
        self.dev.replay(graph)
    }

    fn check_batch(&self, segments: &[Segment<'_>], rows: &Rows) -> Result<(), CudaForwardError> {
        let n = rows.positions.len();
        if n > self.max_rows {
            return Err(CudaForwardError::BatchTooLarge {
                rows: n,
                max_rows: self.max_rows,
            });
        }
        for sg in segments {
            if sg.check != TagCheck::Enforced {
                return Err(CudaForwardError::TagCheckRequired);
            }
        }
        Ok(())
    }

    /// The rows' tokens and positions, padded to `padded` rows with token 0 at position 0.
    fn upload_inputs(
        &mut self,
        segments: &[Segment<'_>],
        rows: &Rows,
        padded: usize,
    ) -> Result<(), DeviceError> {
        let mut tokens: Vec<u32> = segments
            .iter()
            .flat_map(|sg| sg.tokens.iter().copied())
            .collect();
        debug_assert!(
            tokens
                .iter()
                .all(|&t| (t as usize) < self.config.vocab_size),
            "validated at admission"
        );
        tokens.resize(padded, 0);
        let mut positions: Vec<u32> = rows.positions.iter().map(|&p| p as u32).collect();
        positions.resize(padded, 0);
        let b = self.bufs;
        self.upload_u32(b.tokens, &tokens)?;
        self.upload_u32(b.positions, &positions)
    }

    /// Each row's block table (its segment's), flattened, and the per-row table windows,
    /// contexts and readers of the attention launch; padding rows up to `padded` get an empty
    /// table (their verdict fails, and no segment reads it). A larger table buffer drops the
    /// graphs first (they name the old one).
    fn upload_tables(
        &mut self,
        segments: &[Segment<'_>],
        rows: &Rows,
        padded: usize,
    ) -> Result<(), CudaForwardError> {
        let mut flat = Vec::new();
        let mut seg_off = Vec::with_capacity(segments.len());
        for sg in segments {
            seg_off.push(flat.len() as u32 / 2);
            for pr in sg.block_table {
                flat.extend([pr.page, pr.generation]);
            }
        }
        let entries = flat.len() / 2;
        if entries > self.bufs.table_capacity {
            self.drop_graphs()?;
            let cap = entries.next_power_of_two();
            self.bufs.tables = self.dev.alloc_zeroed(cap * 8)?;
            self.bufs.table_capacity = cap;
        }
        let (mut off, mut len, mut n_ctx, mut readers) = (
            vec![0u32; padded],
            vec![0u32; padded],
            vec![1u32; padded],
            vec![[0u64; 1 + MAX_SHARED]; padded],
        );
        for (r, &si) in rows.segment.iter().enumerate() {
            let sg = &segments[si];
            off[r] = seg_off[si];
            len[r] = sg.block_table.len() as u32;
            n_ctx[r] = rows.positions[r] as u32 + 1;
            // The device's check admits what the CPU's does: the row's own pages and the
            // shared pages of the namespaces its reader names (a prefix cache's).
            readers[r] = sg.reader.words();
        }
        let b = self.bufs;
        if !flat.is_empty() {
            self.upload_u32(b.tables, &flat)?;
        }
        self.upload_u32(b.table_off, &off)?;
        self.upload_u32(b.table_len, &len)?;
        self.upload_u32(b.n_ctx, &n_ctx)?;
        self.dev
            .upload_async(b.readers, bytes_of(readers.as_flattened()))?;
        Ok(())
    }

    /// Claim each live row's slot in every layer on the host pool (the CPU write's check; a
    /// segment whose claim fails is failed), once per step before any layer runs: the step's
    /// tags are then final, and the device's copy is brought up to date once, inside the step.
    /// The rows' pages and slots serve the KV-write kernel of every layer (a failed or padding
    /// row's page is `NO_PAGE`: not written).
    fn claim_rows(
        &mut self,
        pool: &mut PagePool,
        segments: &[Segment<'_>],
        rows: &Rows,
        padded: usize,
        failed: &mut [Option<IntegrityError>],
    ) -> Result<(), DeviceError> {
        let ps = self.page_size;
        let mut pages = vec![NO_PAGE; padded];
        let mut slots = vec![0u32; padded];
        'segments: for (si, sg) in segments.iter().enumerate() {
            for r in rows.range(si) {
                let pos = rows.positions[r];
                let Some(&pr) = sg.block_table.get(pos / ps) else {
                    failed[si] = Some(IntegrityError::BlockTableTooShort {
                        have: sg.block_table.len(),
                        need: pos / ps + 1,
                        n_ctx: pos + 1,
                    });
                    continue 'segments;
                };
                for layer in 0..self.config.n_layers {
                    if let Err(e) =
                        pool.claim_slot_checked(layer, pr, pos % ps, sg.reader.owner(), sg.check)
                    {
                        failed[si] = Some(e);
                        continue 'segments;
                    }
                }
                pages[r] = pr.page;
                slots[r] = (pos % ps) as u32;
            }
        }
        let b = self.bufs;
        self.upload_u32(b.write_pages, &pages)?;
        self.upload_u32(b.write_slots, &slots)
    }

    /// RoPE on the rows' Q and K, then the claimed rows' K/V of `layer` stored in the device
    /// pool (one launch: `custody_rope_kv_write`).
    fn rope_kv_write(&mut self, layer: usize, n: usize) -> Result<(), DeviceError> {
        let b = self.bufs;
        let c = &self.config;
        let args = [
            Arg::Ptr(b.q),
            Arg::Ptr(b.k),
            Arg::Ptr(b.v),
            Arg::Ptr(b.positions),
            Arg::U32(c.n_heads as u32),
            Arg::U32(c.n_kv_heads as u32),
            Arg::U32(c.head_dim as u32),
            Arg::U32(c.rope_dims as u32),
            Arg::F32(c.rope_base),
            Arg::Ptr(self.rope_factors),
            Arg::U32(neox_flag(c.spec)),
            Arg::Ptr(b.write_pages),
            Arg::Ptr(b.write_slots),
            Arg::U32(self.page_size as u32),
            Arg::Ptr(self.kv.k[layer]),
            Arg::Ptr(self.kv.v[layer]),
        ];
        self.launch(
            Kernel::RopeKvWrite,
            LaunchDims::grid2(n as u32, 1, THREADS),
            &args,
        )
    }

    /// `q`, `k`, `v` = W_q · xn, W_k · xn, W_v · xn: one launch when all three are Q4_K tiles
    /// (`custody_gemv_q4k_qkv`), else three.
    fn qkv(&mut self, l: &DevLayer, n: usize, q8: Option<Q8>) -> Result<(), DeviceError> {
        let bf = self.bufs;
        if let (Some(q16), Some(k16), Some(v16)) = (
            gemm_weights(&l.wq, n),
            gemm_weights(&l.wk, n),
            gemm_weights(&l.wv, n),
        ) {
            // One conversion of `xn` for the three GEMMs.
            self.stage_f16(bf.xn, n * l.wq.cols as usize)?;
            self.gemm(q16, l.wq, bf.q, n)?;
            self.gemm(k16, l.wk, bf.k, n)?;
            return self.gemm(v16, l.wv, bf.v, n);
        }
        let (Some((qh, qq)), Some((kh, kq)), Some((vh, vq))) =
            (q4k_tiles(&l.wq), q4k_tiles(&l.wk), q4k_tiles(&l.wv))
        else {
            self.matvec(l.wq, bf.xn, bf.q, n, q8)?;
            self.matvec(l.wk, bf.xn, bf.k, n, q8)?;
            return self.matvec(l.wv, bf.xn, bf.v, n, q8);
        };
        debug_assert_eq!(l.wk.rows, l.wv.rows);
        debug_assert!(l.wq.cols == l.wk.cols && l.wk.cols == l.wv.cols);
        let args = [
            Arg::Ptr(qh),
            Arg::Ptr(qq),
            Arg::U32(l.wq.rows),
            Arg::Ptr(kh),
            Arg::Ptr(kq),
            Arg::Ptr(vh),
            Arg::Ptr(vq),
            Arg::U32(l.wk.rows),
            Arg::U32(l.wq.cols),
        ];
        let x = match q8 {
            Some(q) => vec![Arg::Ptr(q.xq), Arg::Ptr(q.xs)],
            None => vec![Arg::Ptr(bf.xn)],
        };
        let outs = [
            Arg::U32(n as u32),
            Arg::Ptr(bf.q),
            Arg::Ptr(bf.k),
            Arg::Ptr(bf.v),
        ];
        let args: Vec<Arg> = args.into_iter().chain(x).chain(outs).collect();
        let path = Q4kPath::of(q8, n);
        // On tensor cores each matrix has CTAs of its own (one matrix per CTA).
        let ctas = l.wq.rows.div_ceil(MMQ_TILE) + 2 * l.wk.rows.div_ceil(MMQ_TILE);
        let dims = path.dims(ctas, l.wq.rows + 2 * l.wk.rows, n);
        self.launch(path.kernels().qkv, dims, &args)
    }

    /// `gate` = silu(W_gate · xn) · (W_up · xn): one launch when both are Q4_K tiles
    /// (`custody_gemv_q4k_swiglu`), else the two products and the SwiGLU.
    fn gate_up_swiglu(
        &mut self,
        l: &DevLayer,
        n: usize,
        q8: Option<Q8>,
    ) -> Result<(), DeviceError> {
        let bf = self.bufs;
        if let (Some(g16), Some(u16)) = (gemm_weights(&l.w_gate, n), gemm_weights(&l.w_up, n)) {
            self.stage_f16(bf.xn, n * l.w_gate.cols as usize)?;
            self.gemm(g16, l.w_gate, bf.gate, n)?;
            self.gemm(u16, l.w_up, bf.up, n)?;
            return self.elementwise(Kernel::Swiglu, bf.gate, bf.up, n * self.config.ffn_dim);
        }
        let (Some((gh, gq)), Some((uh, uq))) = (q4k_tiles(&l.w_gate), q4k_tiles(&l.w_up)) else {
            self.matvec(l.w_gate, bf.xn, bf.gate, n, q8)?;
            self.matvec(l.w_up, bf.xn, bf.up, n, q8)?;
            return self.elementwise(Kernel::Swiglu, bf.gate, bf.up, n * self.config.ffn_dim);
        };
        let m = l.w_gate;
        debug_assert_eq!((m.rows, m.cols), (l.w_up.rows, l.w_up.cols));
        let args = [
            Arg::Ptr(gh),
            Arg::Ptr(gq),
            Arg::Ptr(uh),
            Arg::Ptr(uq),
            Arg::U32(m.rows),
            Arg::U32(m.cols),
        ];
        let x = match q8 {
            Some(q) => vec![Arg::Ptr(q.xq), Arg::Ptr(q.xs)],
            None => vec![Arg::Ptr(bf.xn)],
        };
        let args: Vec<Arg> = args
            .into_iter()
            .chain(x)
            .chain([Arg::U32(n as u32), Arg::Ptr(bf.gate)])
            .collect();
        let path = Q4kPath::of(q8, n);
        // On tensor cores 32 output rows a CTA: its warps make 16 gate and 16 up rows each.
        let dims = path.dims(m.rows.div_ceil(MMQ_TILE / 2), m.rows, n);
        self.launch(path.kernels().swiglu, dims, &args)
    }

    /// Every row's verdicts (`rows` rows × layers) poisoned: a row the kernels did not report
    /// on reads as a failure, never as a pass. Returns the poisoned verdicts (the download's
    /// buffer).
    fn poison_verdicts(&mut self, rows: usize) -> Result<Vec<Verdict>, DeviceError> {
        let poison = Verdict {
            code: u32::MAX,
            ..Verdict::default()
        };
        let verdicts = vec![poison; rows * self.config.n_layers];
        self.dev
            .upload_async(self.bufs.verdicts, bytes_of(&verdicts))?;
        Ok(verdicts)
    }

    /// Attention of every row of `layer` over its segment's pages, the tag check inside the
    /// kernel; the verdicts land in the layer's part of the verdict buffer.
    /// Layer `layer`'s attention: the step's prompt tiles through `custody_flash_prefill` and
    /// its other rows through flash decoding (`shape.decode_rows` of them: every row in a
    /// graph's step, the rows listed in `bufs.decode_rows` otherwise). Both write each row's
    /// output and verdict themselves.
    /// With `q8`, flash decoding's merge also stores the output quantized for the O product.
    fn attend(
        &mut self,
        layer: usize,
        shape: StepShape,
        q8: Option<Q8>,
    ) -> Result<(), DeviceError> {
        let tags = self.kv.tags(layer);
        let splits = shape.splits;
        let b = self.bufs;
        let (n_heads, n_kv_heads) = (self.config.n_heads as u32, self.config.n_kv_heads as u32);
        let verdicts = b
            .verdicts
            .offset((layer * shape.rows * size_of::<Verdict>()) as u64);
        let mut args = vec![
            Arg::Ptr(b.q),
            Arg::Ptr(self.kv.k[layer]),
            Arg::Ptr(self.kv.v[layer]),
            Arg::Ptr(b.tables),
            Arg::Ptr(b.table_off),
            Arg::Ptr(b.table_len),
            Arg::Ptr(b.n_ctx),
            Arg::Ptr(b.readers),
            Arg::U32(n_heads),
            Arg::U32(n_kv_heads),
            Arg::U32(self.config.head_dim as u32),
            Arg::U32(self.page_size as u32),
            Arg::Tags(tags),
        ];
        let common = args.len();
        if shape.prefill_tiles > 0 {
            args.extend([Arg::Ptr(b.tiles), Arg::Ptr(b.att), Arg::Ptr(verdicts)]);
            let dims = LaunchDims::grid2(n_heads, shape.prefill_tiles as u32, THREADS);
            self.launch(Kernel::FlashPrefill, dims, &args)?;
        }
        if shape.decode_rows == 0 {
            return Ok(());
        }
        args.truncate(common);
        // In a graph's step every row, in order (null); else the rows the prefill kernel left.
        let rows = if shape.prefill_tiles > 0 {
            b.decode_rows
        } else {
            DevicePtr(0)
        };
        args.extend([
            Arg::U32(splits.pages_per_split as u32),
            Arg::Ptr(b.partial),
            Arg::Ptr(b.bad),
            Arg::Ptr(b.arrivals),
            Arg::Ptr(b.att),
            Arg::Ptr(verdicts),
            Arg::Ptr(rows),
        ]);
        args.extend(Q8::args(q8));
        let dims = LaunchDims {
            grid: [n_kv_heads, shape.decode_rows as u32, splits.n as u32],
            block: [THREADS, 1, 1],
        };
        self.launch(Kernel::FlashDecode, dims, &args)
    }

    /// Every layer's verdicts, read once after the step: a live segment whose rows got a
    /// failing verdict in a layer is failed with the CPU check's error (the first such layer's).
    fn read_verdicts(
        &mut self,
        segments: &[Segment<'_>],
        rows: &Rows,
        padded: usize,
        mut verdicts: Vec<Verdict>,
        failed: &mut [Option<IntegrityError>],
    ) -> Result<(), DeviceError> {
        self.dev
            .download(self.bufs.verdicts, bytes_of_mut(&mut verdicts))?;
        for layer in verdicts.chunks(padded) {
            debug_assert!(
                layer[..rows.positions.len()]
                    .iter()
                    .all(|v| v.code != u32::MAX),
                "a live row without a verdict"
            );
            for (si, sg) in segments.iter().enumerate() {
                if failed[si].is_some() {
                    continue;
                }
                // The last row attends the segment's whole context: its verdict is the CPU
                // check's over the segment; any earlier row's failure fails the segment too.
                let range = rows.range(si);
                let n_ctx = sg.start_pos + sg.tokens.len();
                let last = &layer[range.end - 1];
                let bad = std::iter::once(last)
                    .chain(&layer[range])
                    .find(|v| v.code != 0);
                if let Some(v) = bad {
                    failed[si] = Some(v.to_error(sg.block_table, n_ctx).unwrap_or(
                        IntegrityError::BlockTableTooShort {
                            have: 0,
                            need: 0,
                            n_ctx,
                        },
                    ));
                }
            }
        }
        Ok(())
    }

    /// The logits of the rows each live segment wants, downloaded per segment: at their row in
    /// a graph's step, at their place among the gathered rows in a kernel-by-kernel one.
    fn read_logits(
        &mut self,
        segments: &[Segment<'_>],
        rows: &Rows,
        shape: StepShape,
        failed: Vec<Option<IntegrityError>>,
    ) -> Result<Vec<Result<Vec<f32>, IntegrityError>>, CudaForwardError> {
        let vocab = self.config.vocab_size;
        let b = self.bufs;
        let mut results = Vec::with_capacity(segments.len());
        // Where each passing segment's rows start in the logits buffer.
        let mut starts = Vec::with_capacity(segments.len());
        let mut gathered = 0;
        for (si, (sg, f)) in segments.iter().zip(failed).enumerate() {
            let wanted = sg.logits.rows(rows.range(si));
            let first = if shape.graph { wanted.start } else { gathered };
            gathered += wanted.len();
            match f {
                Some(e) => results.push(Err(e)),
                None => {
                    results.push(Ok(vec![0.0f32; wanted.len() * vocab]));
                    starts.push(first);
                }
            }
        }
        // One wait for every segment's logits (pinned, asynchronous copies on a GPU).
        let mut parts: Vec<Download<'_>> = results
            .iter_mut()
            .filter_map(|r| r.as_mut().ok())
            .zip(starts)
            .filter(|(l, _)| !l.is_empty())
            .map(|(l, first)| Download {
                src: b.logits.offset((first * vocab * 4) as u64),
                dst: bytes_of_mut(l),
            })
            .collect();
        self.dev.download_all(&mut parts)?;
        drop(parts);
        Ok(results)
    }
}

/// The rows whose logits the step returns, segment by segment (what the head computes in a
/// kernel-by-kernel step).
fn wanted_rows(segments: &[Segment<'_>], rows: &Rows) -> Vec<u32> {
    let mut out = Vec::new();
    for (si, sg) in segments.iter().enumerate() {
        out.extend(sg.logits.rows(rows.range(si)).map(|r| r as u32));
    }
    out
}

impl Logits {
    /// Of a segment's batch rows `range`, those whose logits are returned.
    fn rows(self, range: std::ops::Range<usize>) -> std::ops::Range<usize> {
        match self {
            Logits::None => range.end..range.end,
            Logits::Last => range.end - 1..range.end,
            Logits::All => range,
        }
    }
}

/// The batch's rows: each row's position and segment, in batch order.
#[derive(Debug)]
struct Rows {
    positions: Vec<usize>,
    segment: Vec<usize>,
    /// First row of each segment, and one past the last row.
    starts: Vec<usize>,
}

/// How a kernel-by-kernel step's attention divides its rows.
struct PrefillPlan {
    /// `custody_flash_prefill`'s tiles: (first row, rows) for each run of at most
    /// [`PREFILL_TILE_ROWS`] consecutive rows of a segment of at least [`PREFILL_MIN_ROWS`].
    tiles: Vec<u32>,
    /// The other rows (flash decoding's), ascending.
    decode_rows: Vec<u32>,
}

impl PrefillPlan {
    fn of(rows: &Rows, n_segments: usize) -> Self {
        let mut plan = Self {
            tiles: Vec::new(),
            decode_rows: Vec::new(),
        };
        for si in 0..n_segments {
            let r = rows.range(si);
            if r.len() < PREFILL_MIN_ROWS {
                plan.decode_rows.extend(r.map(|i| i as u32));
                continue;
            }
            for start in r.clone().step_by(PREFILL_TILE_ROWS) {
                plan.tiles.push(start as u32);
                plan.tiles
                    .push((r.end - start).min(PREFILL_TILE_ROWS) as u32);
            }
        }
        plan
    }
}

impl Rows {
    fn of(segments: &[Segment<'_>]) -> Self {
        let mut r = Rows {
            positions: Vec::new(),
            segment: Vec::new(),
            starts: Vec::new(),
        };
        for (si, sg) in segments.iter().enumerate() {
            r.starts.push(r.positions.len());
            r.positions
                .extend(sg.start_pos..sg.start_pos + sg.tokens.len());
            r.segment.extend(std::iter::repeat_n(si, sg.tokens.len()));
        }
        r.starts.push(r.positions.len());
        r
    }

    fn range(&self, si: usize) -> std::ops::Range<usize> {
        self.starts[si]..self.starts[si + 1]
    }
}

//! Quantized mat-vec / mat-mul: `out[t][r] = W[r] · x[t]` for a row-major weight matrix `W`
//! (`rows × cols`, GGUF layout) and `n_tok` input rows.
//!
//! Every output element is computed by the same per-row arithmetic whatever other rows share
//! the call, so a request's results are bit-identical whether it runs alone or batched with
//! others (the engine's "batched == alone" guarantee depends on this). The K-quants follow
//! llama.cpp's float order, which depends on the row's own batch — the rows of one request's
//! prompt chunk, or its one decode token ([`QInput::prepare_rows`], `crate::q8k::KOrder`) —
//! and never on another request's rows. Work is split statically over rows across the installed
//! compute pool ([`crate::par`]): part `i` gets the same rows every call, so a worker keeps
//! reading the same weights. Each part walks a tile of rows for every token so the tile's weights
//! stay in L1/L2 (weight reuse is what makes prefill faster per token than decode).

use crate::pack::{GROUP_ROWS, PackedRows, Q8KLanes, Q40PairTerms, Weights};
use crate::q8k::{self, BlockQ8K, KOrder, KPath, RowBatch};
use crate::quant::{self, Activations, BlockQ8, DType, QK, QK_K};
use crate::simd::{self, Level};

/// A borrowed weight matrix in its storage format.
#[derive(Clone, Copy, Debug)]
pub struct QMatrix<'a> {
    pub dtype: DType,
    pub rows: usize,
    pub cols: usize,
    pub data: &'a [u8],
    /// The same matrix repacked for the 512-bit kernels, where the loader made one: the
    /// mat-vecs then read it instead of `data` (same bits; `crate::pack`).
    pub packed: Option<&'a PackedRows>,
}

impl<'a> QMatrix<'a> {
    /// Validates that `data` holds exactly `rows × cols` elements of `dtype`.
    pub fn new(dtype: DType, rows: usize, cols: usize, data: &'a [u8]) -> Option<Self> {
        let want = dtype.bytes_for((rows as u64).checked_mul(cols as u64)?)?;
        (dtype.bytes_for(cols as u64).is_some() && want == data.len() as u64).then_some(Self {
            dtype,
            rows,
            cols,
            data,
            packed: None,
        })
    }

    /// The matrix with its repacked copy (which must be of this matrix: same type and shape).
    pub fn with_packed(self, packed: Option<&'a PackedRows>) -> Self {
        if let Some(p) = packed {
            assert!(
                (p.dtype(), p.rows(), p.cols()) == (self.dtype, self.rows, self.cols),
                "QMatrix::with_packed: a packed copy of another matrix"
            );
        }
        Self { packed, ..self }
    }

    fn row_bytes(&self) -> usize {
        self.cols / self.dtype.block_elems() * self.dtype.block_bytes()
    }

    pub fn row(&self, r: usize) -> &'a [u8] {
        let rb = self.row_bytes();
        &self.data[r * rb..(r + 1) * rb]
    }

    /// Dequantize row `r` into `out` (`cols` long).
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        quant::dequantize_row(self.dtype, self.row(r), out);
    }
}

/// Input rows prepared for a weight type, in its activation format (`DType::activations`): Q8
/// blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0), Q8_K blocks (the K-quants), bf16 (BF16), or f32
/// (F32, F16). Prepare once, use for every matrix that reads the same input (Q/K/V, gate/up).
#[derive(Debug, Default)]
pub struct QInput {
    n_tok: usize,
    cols: usize,
    q8: Vec<BlockQ8>,
    q8k: Vec<BlockQ8K>,
    /// `q8k` in the packed K-quant kernels' lane order, where those kernels run.
    q8k_lanes: Vec<Q8KLanes>,
    /// Q4_0's per-block terms for each pair of tokens (`[pair][block]`), where the packed
    /// kernels run.
    q4_0_pairs: Vec<Q40PairTerms>,
    bf: Vec<u16>,
    f: Vec<f32>,
    /// Each row's place in its batch: what the K-quants' float order depends on.
    batches: Vec<RowBatch>,
    /// Q8_K activations: each row's [`KOrder`] over a matrix of each `q8k::KPath` (in
    /// `KPath::ALL`'s order), and the end of its run of rows of one order.
    k_orders: [KOrders; 3],
}

/// Rows' K-quant orders and runs (`QInput::k_orders`).
#[derive(Debug, Default)]
struct KOrders {
    order: Vec<KOrder>,
    /// `run_end[t]`: the first row after `t` in another order (or the end).
    run_end: Vec<usize>,
}

impl KOrders {
    fn compute(&mut self, path: KPath, batches: &[RowBatch]) {
        self.order.clear();
        self.order
            .extend(batches.iter().map(|&at| KOrder::for_path(path, at)));
        let n = batches.len();
        self.run_end.clear();
        self.run_end.resize(n, n);
        for t in (0..n.saturating_sub(1)).rev() {
            if self.order[t + 1] == self.order[t] {
                self.run_end[t] = self.run_end[t + 1];
            } else {
                self.run_end[t] = t + 1;
            }
        }
    }
}

impl QInput {
    /// Prepare `x` (`n_tok × cols`, row-major) for weights of type `dtype`, its rows one batch.
    pub fn prepare(&mut self, x: &[f32], n_tok: usize, cols: usize, dtype: DType) {
        let len = u32::try_from(n_tok).expect("fewer than 2^32 rows");
        self.batches.clear();
        self.batches
            .extend((0..len).map(|index| RowBatch { len, index }));
        self.prepare_with_batches(x, cols, dtype);
    }

    /// As [`QInput::prepare`], row `t` at `rows[t]` in its batch (for the K-quants' float
    /// order): a request's prompt rows in the batches llama.cpp would evaluate the prompt in,
    /// a decode row a batch of its own.
    pub fn prepare_rows(&mut self, x: &[f32], rows: &[RowBatch], cols: usize, dtype: DType) {
        assert!(
            rows.iter().all(|b| b.index < b.len),
            "QInput::prepare_rows: a row outside its batch"
        );
        self.batches.clear();
        self.batches.extend_from_slice(rows);
        self.prepare_with_batches(x, cols, dtype);
    }

    /// [`QInput::prepare`]'s work, `self.batches` set.
    fn prepare_with_batches(&mut self, x: &[f32], cols: usize, dtype: DType) {
        let n_tok = self.batches.len();
        assert_eq!(x.len(), n_tok * cols, "QInput::prepare: shape mismatch");
        debug_assert_eq!(self.batches.len(), n_tok);
        if dtype.activations() == Activations::Q8K {
            for (k, path) in self.k_orders.iter_mut().zip(KPath::ALL) {
                k.compute(path, &self.batches);
            }
        } else {
            // No K-quant matrix reads these rows (`k_orders_of` asserts).
            for k in &mut self.k_orders {
                k.order.clear();
                k.run_end.clear();
            }
        }
        self.n_tok = n_tok;
        self.cols = cols;
        self.bf.clear();
        self.q4_0_pairs.clear();
        if dtype.activations() == Activations::Bf16 {
            self.bf.resize(n_tok * cols, 0);
            crate::bf16::quantize_row_bf16(x, &mut self.bf);
            self.q8.clear();
            self.q8k.clear();
            self.f.clear();
        } else if dtype.activations() == Activations::Q8K {
            assert!(
                cols.is_multiple_of(QK_K),
                "Q8_K input width must be a multiple of {QK_K}"
            );
            self.q8k.resize(n_tok * cols / QK_K, BlockQ8K::default());
            quantize_rows(x, cols, &mut self.q8k, &q8k::quantize_row_q8_k);
            self.q8k_lanes.clear();
            if crate::pack::available() {
                self.q8k_lanes.extend(self.q8k.iter().map(Q8KLanes::from));
            }
            self.q8.clear();
            self.f.clear();
        } else if dtype.uses_q8_activations() {
            assert!(
                cols.is_multiple_of(QK),
                "quantized input width must be a multiple of {QK}"
            );
            self.q8.resize(n_tok * cols / QK, BlockQ8::default());
            let quantize = |xr: &[f32], qr: &mut [BlockQ8]| match simd::level() {
                #[cfg(target_arch = "x86_64")]
                // SAFETY: the Avx2 level is only selected when avx2, fma and f16c were detected.
                Level::Avx2 => unsafe { crate::x86::quantize_row_q8(xr, qr) },
                _ => quant::quantize_row_q8(xr, qr),
            };
            quantize_rows(x, cols, &mut self.q8, &quantize);
            if dtype == DType::Q4_0 && crate::pack::available() {
                self.prepare_q4_0_pairs();
            }
            self.q8k.clear();
            self.f.clear();
        } else {
            self.q8.clear();
            self.q8k.clear();
            self.f.clear();
            self.f.extend_from_slice(x);
        }
    }

    pub fn n_tok(&self) -> usize {
        self.n_tok
    }

    /// The K-quant float order of row `t` over a `rows`-row `dtype` matrix.
    fn k_order(&self, dtype: DType, rows: usize, t: usize) -> KOrder {
        self.k_orders_of(dtype, rows).order[t]
    }

    /// The end of the run of rows from `t` (before `end`) that share row `t`'s K-quant order.
    fn k_order_run_end(&self, dtype: DType, rows: usize, t: usize, end: usize) -> usize {
        self.k_orders_of(dtype, rows).run_end[t].min(end)
    }

    fn k_orders_of(&self, dtype: DType, rows: usize) -> &KOrders {
        let path = KOrder::path(dtype, rows);
        let k = &self.k_orders[KPath::ALL.iter().position(|&p| p == path).expect("a path")];
        assert_eq!(
            k.order.len(),
            self.n_tok,
            "K-quant orders of Q8_K activations"
        );
        k
    }

    /// [`Q40PairTerms`] of every token pair and block, from `q8`.
    fn prepare_q4_0_pairs(&mut self) {
        let per_row = self.cols / QK;
        let row = |t: usize| &self.q8[t * per_row..(t + 1) * per_row];
        for first in (0..self.n_tok).step_by(2) {
            let second = (first + 1 < self.n_tok).then(|| row(first + 1));
            for (b, x) in row(first).iter().enumerate() {
                self.q4_0_pairs
                    .push(Q40PairTerms::new(x, second.map(|s| &s[b])));
            }
        }
        debug_assert_eq!(self.q4_0_pairs.len(), self.n_tok.div_ceil(2) * per_row);
    }
}

/// Quantize the rows of `x` (`cols` wide) into `out` (the same number of rows, each
/// `out.len() / rows` blocks) with `f`, in parallel for prompts (16 rows or more).
fn quantize_rows<B: Send>(
    x: &[f32],
    cols: usize,
    out: &mut [B],
    f: &(dyn Fn(&[f32], &mut [B]) + Sync),
) {
    let n_tok = x.len() / cols;
    let per_row = out.len() / n_tok;
    debug_assert_eq!(out.len(), n_tok * per_row);
    if n_tok < 16 || crate::par::current_num_threads() == 1 {
        x.chunks(cols)
            .zip(out.chunks_mut(per_row))
            .for_each(|(xr, qr)| f(xr, qr));
        return;
    }
    let dst = OutPtr(out.as_mut_ptr());
    crate::par::run(&|part, parts| {
        let rows = crate::par::split(n_tok, part, parts, 1);
        // SAFETY: parts' row ranges are disjoint and within the `n_tok` rows of `per_row`
        // blocks of `out`, which outlives the section (`run` returns after every part).
        let dst = unsafe {
            std::slice::from_raw_parts_mut(
                dst.get().add(rows.start * per_row),
                rows.len() * per_row,
            )
        };
        x[rows.start * cols..rows.end * cols]
            .chunks(cols)
            .zip(dst.chunks_mut(per_row))
            .for_each(|(xr, qr)| f(xr, qr));
    });
}

type Q8Dot = fn(&[u8], &[BlockQ8]) -> f32;
type Q8Dot4 = fn([&[u8]; 4], &[BlockQ8]) -> [f32; 4];

/// A four-row kernel where one exists (same per-row arithmetic as the one-row kernel).
fn q8_dot4_fn(dtype: DType) -> Option<Q8Dot4> {
    #[cfg(target_arch = "x86_64")]
    if simd::level() == Level::Avx2 {
        let vnni = simd::has_vnni();
        return match (dtype, vnni) {
            // SAFETY: avx2/fma/f16c (and, for the `v` variants, avx512vnni/avx512vl) were
            // detected at run time before these levels were selected.
            (DType::Q4_1, true) => Some(|w, a| unsafe { crate::x86::dot4v_q4_1_q8(w, a) }),
            // SAFETY: as above.
            (DType::Q8_0, true) => Some(|w, a| unsafe { crate::x86::dot4v_q8_0_q8(w, a) }),
            // SAFETY: as above.
            (DType::Q4_1, false) => Some(|w, a| unsafe { crate::x86::dot4_q4_1_q8(w, a) }),
            // SAFETY: as above.
            (DType::Q8_0, false) => Some(|w, a| unsafe { crate::x86::dot4_q8_0_q8(w, a) }),
            _ => None,
        };
    }
    let _ = dtype;
    None
}

type Q8Dot4x4 = fn([&[u8]; 4], [&[BlockQ8]; 4]) -> [[f32; 4]; 4];

/// A four-row × four-token kernel where one exists (same per-output arithmetic as the one-row
/// kernel).
fn q8_dot4x4_fn(dtype: DType) -> Option<Q8Dot4x4> {
    #[cfg(target_arch = "x86_64")]
    if simd::level() == Level::Avx2 && simd::has_vnni() && dtype == DType::Q4_1 {
        // SAFETY: avx2/fma/f16c and avx512vnni/avx512vl were detected at run time.
        return Some(|w, a| unsafe { crate::x86::dot4x4v_q4_1_q8(w, a) });
    }
    let _ = dtype;
    None
}

fn q8_dot_fn(dtype: DType) -> Q8Dot {
    #[cfg(target_arch = "x86_64")]
    if simd::level() == Level::Avx2 {
        return match dtype {
            // SAFETY: the Avx2 level is only selected when avx2, fma and f16c were detected.
            DType::Q4_0 => |w, a| unsafe { crate::x86::dot_q4_0_q8(w, a) },
            // SAFETY: as above.
            DType::Q4_1 => |w, a| unsafe { crate::x86::dot_q4_1_q8(w, a) },
            // SAFETY: as above.
            DType::Q8_0 => |w, a| unsafe { crate::x86::dot_q8_0_q8(w, a) },
            // SAFETY: as above.
            DType::Q5_0 => |w, a| unsafe { crate::x86::dot_q5_0_q8(w, a) },
            // SAFETY: as above.
            DType::Q5_1 => |w, a| unsafe { crate::x86::dot_q5_1_q8(w, a) },
            DType::F32
            | DType::F16
            | DType::BF16
            | DType::Q4_K
            | DType::Q5_K
            | DType::Q6_K
            | DType::Q2_K
            | DType::Q3_K => {
                unreachable!("{dtype:?} weights do not use Q8 activations")
            }
        };
    }
    scalar_q8_dot_fn(dtype)
}

/// The K-quant · Q8_K kernel of `dtype` (bit-identical to its scalar reference, `crate::q8k`).
fn q8k_dot_fn(dtype: DType) -> q8k::KDot {
    #[cfg(target_arch = "x86_64")]
    if simd::level() == Level::Avx2 {
        return match dtype {
            // SAFETY: the Avx2 level is only selected when avx2, fma and f16c were detected.
            DType::Q4_K => |w, a, o| unsafe { crate::x86_kquant::dot_q4_k_q8k(w, a, o) },
            // SAFETY: as above.
            DType::Q5_K => |w, a, o| unsafe { crate::x86_kquant::dot_q5_k_q8k(w, a, o) },
            // SAFETY: as above.
            DType::Q6_K => |w, a, o| unsafe { crate::x86_kquant::dot_q6_k_q8k(w, a, o) },
            // No 256-bit kernels for the rarer 2- and 3-bit types: the scalar reference (the
            // 512-bit kernels cover them where they run).
            DType::Q2_K | DType::Q3_K => q8k::scalar_dot(dtype),
            _ => unreachable!("{dtype:?} does not use Q8_K activations"),
        };
    }
    q8k::scalar_dot(dtype)
}

fn scalar_q8_dot_fn(dtype: DType) -> Q8Dot {
    match dtype {
        DType::Q4_0 => quant::dot_q4_0_q8_scalar,
        DType::Q4_1 => quant::dot_q4_1_q8_scalar,
        DType::Q8_0 => quant::dot_q8_0_q8_scalar,
        DType::Q5_0 => crate::kquant::dot_q5_0_q8_scalar,
        DType::Q5_1 => crate::kquant::dot_q5_1_q8_scalar,
        DType::F32
        | DType::F16
        | DType::BF16
        | DType::Q4_K
        | DType::Q5_K
        | DType::Q6_K
        | DType::Q2_K
        | DType::Q3_K => {
            unreachable!("{dtype:?} weights do not use Q8 activations")
        }
    }
}

/// Raw output pointer shared by the parts of a section, which write disjoint elements. Read
/// through [`OutPtr::get`] so that closures capture the wrapper, not the pointer field.
struct OutPtr<T>(*mut T);
impl<T> OutPtr<T> {
    fn get(self) -> *mut T {
        self.0
    }
}
impl<T> Clone for OutPtr<T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for OutPtr<T> {}
// SAFETY: parts write disjoint index sets (distinct row ranges), and the borrow of the output
// slice outlives the parallel section (`par::run` returns after every part).
unsafe impl<T> Send for OutPtr<T> {}
// SAFETY: as above.
unsafe impl<T> Sync for OutPtr<T> {}

/// Rows per task tile: small enough to stay in L1/L2, large enough to amortise task overhead.
const TILE_ROWS: usize = 16;

/// `out[t * rows + r] = W[r] · x[t]` for all tokens `t` and rows `r`.
pub fn matmul(w: &QMatrix<'_>, x: &QInput, out: &mut [f32]) {
    matmul_many(&mut [(*w, out)], x)
}

/// Several matrices over the same input (Q/K/V, gate/up) in one parallel section: one hand-off
/// instead of one per matrix, which is what a decode step's small matrices need.
///
/// The jobs' rows are laid end to end and split statically into one contiguous range per part,
/// aligned to the four-row kernel; a part that spans two jobs computes the end of one and the
/// start of the next.
pub fn matmul_many(jobs: &mut [(QMatrix<'_>, &mut [f32])], x: &QInput) {
    let mut outs = Vec::with_capacity(jobs.len());
    let mut total_rows = 0;
    for (w, out) in jobs.iter_mut() {
        assert_eq!(
            x.cols, w.cols,
            "matmul: input width {} != weight cols {}",
            x.cols, w.cols
        );
        assert_eq!(out.len(), x.n_tok * w.rows, "matmul: output shape mismatch");
        outs.push(OutPtr(out.as_mut_ptr()));
        total_rows += w.rows;
    }
    let jobs: &[(QMatrix<'_>, &mut [f32])] = jobs;
    let part_rows = |part: usize, parts: usize| {
        // Aligned to the packed kernels' 8-row groups (and so to the four-row kernels').
        let range = crate::par::split(total_rows, part, parts, GROUP_ROWS);
        let mut first = 0;
        for (j, (w, _)) in jobs.iter().enumerate() {
            let (r0, r1) = (range.start.max(first), range.end.min(first + w.rows));
            if r0 < r1 {
                run_rows(w, x, outs[j], r0 - first, r1 - first);
            }
            first += w.rows;
        }
    };
    if crate::par::current_num_threads() == 1 || x.n_tok * total_rows < 64 {
        part_rows(0, 1);
    } else {
        crate::par::run(&part_rows);
    }
}

/// Rows `r0..r1` of `w` for every token, into the output behind `p` (`n_tok × w.rows`).
fn run_rows(w: &QMatrix<'_>, x: &QInput, p: OutPtr<f32>, r0: usize, r1: usize) {
    if let Some(pk) = w.packed {
        // Packed matrices have rows in whole groups, and parts' ranges are group-aligned.
        debug_assert!(r0.is_multiple_of(GROUP_ROWS) && r1.is_multiple_of(GROUP_ROWS));
        run_groups(pk, x, p, r0 / GROUP_ROWS, r1 / GROUP_ROWS);
        return;
    }
    let (rows, n_tok) = (w.rows, x.n_tok);
    if w.dtype.activations() == Activations::Q8K {
        run_rows_q8k(w, x, p, r0, r1);
    } else if w.dtype.activations() == Activations::Bf16 {
        run_rows_bf16(w, x, p, r0, r1);
    } else if w.dtype.uses_q8_activations() {
        let dot = q8_dot_fn(w.dtype);
        let dot4 = q8_dot4_fn(w.dtype);
        let dot4x4 = q8_dot4x4_fn(w.dtype);
        let per_row = w.cols / QK;
        let act = |t: usize| &x.q8[t * per_row..(t + 1) * per_row];
        for tr0 in (r0..r1).step_by(TILE_ROWS) {
            let tr1 = (tr0 + TILE_ROWS).min(r1);
            // Four rows × four tokens at a time where a kernel exists (the rest below).
            let mut t_done = 0;
            if let Some(dot4x4) = dot4x4 {
                let r_end = tr0 + (tr1 - tr0) / 4 * 4;
                while t_done + 4 <= n_tok {
                    let t = t_done;
                    for r in (tr0..r_end).step_by(4) {
                        let v = dot4x4(
                            [w.row(r), w.row(r + 1), w.row(r + 2), w.row(r + 3)],
                            [act(t), act(t + 1), act(t + 2), act(t + 3)],
                        );
                        for (k, row) in v.iter().enumerate() {
                            for (j, vj) in row.iter().enumerate() {
                                // SAFETY: t + j < n_tok, r + k < rows: in bounds of the output
                                // (n_tok × rows, asserted by the caller); parts' rows are
                                // disjoint.
                                unsafe { *p.get().add((t + j) * rows + r + k) = *vj };
                            }
                        }
                    }
                    // Rows of the tile past the last multiple of four: one row at a time.
                    for r in r_end..tr1 {
                        for j in t..t + 4 {
                            // SAFETY: as above.
                            unsafe { *p.get().add(j * rows + r) = dot(w.row(r), act(j)) };
                        }
                    }
                    t_done += 4;
                }
            }
            for t in t_done..n_tok {
                let a = act(t);
                let mut r = tr0;
                if let Some(dot4) = dot4 {
                    while r + 4 <= tr1 {
                        let v = dot4([w.row(r), w.row(r + 1), w.row(r + 2), w.row(r + 3)], a);
                        for (k, vk) in v.into_iter().enumerate() {
                            // SAFETY: t < n_tok, r + k < rows: in bounds of the output (len
                            // n_tok × rows, asserted by the caller); tasks' row ranges are disjoint.
                            unsafe { *p.get().add(t * rows + r + k) = vk };
                        }
                        r += 4;
                    }
                }
                for r in r..tr1 {
                    let v = dot(w.row(r), a);
                    // SAFETY: as above — in bounds, disjoint rows per task.
                    unsafe { *p.get().add(t * rows + r) = v };
                }
            }
        }
    } else {
        let mut tmp = vec![0.0f32; w.cols];
        for r in r0..r1 {
            w.dequantize_row(r, &mut tmp);
            for t in 0..n_tok {
                let v = crate::ops::dot_f32(&tmp, &x.f[t * w.cols..(t + 1) * w.cols]);
                // SAFETY: as above — in bounds, disjoint rows per task.
                unsafe { *p.get().add(t * rows + r) = v };
            }
        }
    }
}

/// A row kernel over one to four tokens' activations (of type `A`), each result the bits of
/// the one-token kernel.
trait TokensKernel<A: ?Sized> {
    /// `a`: tokens `t0 .. t0 + T`, all in one run ([`TokensKernel::run_end`]).
    fn dot<const T: usize>(&self, w: &[u8], t0: usize, a: [&A; T]) -> [f32; T];

    /// The end of the run of tokens from `t` (before `end`) that one call may take together.
    fn run_end(&self, _t: usize, end: usize) -> usize {
        end
    }
}

/// A one-token kernel, run token by token.
struct OneToken<A: ?Sized>(fn(&[u8], &A) -> f32);

impl<A: ?Sized> TokensKernel<A> for OneToken<A> {
    fn dot<const T: usize>(&self, w: &[u8], _t0: usize, a: [&A; T]) -> [f32; T] {
        std::array::from_fn(|t| (self.0)(w, a[t]))
    }
}

/// The K-quant row kernels over a matrix's tokens, each token in its [`KOrder`]: the AVX-512
/// VNNI kernel (`x86_kquant::dot_kquant_512`, four tokens per super-block decode) where it runs,
/// the one-row kernel elsewhere.
struct KQuantRows<'x> {
    dtype: DType,
    rows: usize,
    x: &'x QInput,
    vnni: bool,
}

impl<'x> KQuantRows<'x> {
    fn new(w: &QMatrix<'_>, x: &'x QInput) -> Self {
        Self {
            dtype: w.dtype,
            rows: w.rows,
            x,
            vnni: cfg!(target_arch = "x86_64") && simd::has_vnni512(),
        }
    }
}

impl TokensKernel<[BlockQ8K]> for KQuantRows<'_> {
    fn dot<const T: usize>(&self, w: &[u8], t0: usize, a: [&[BlockQ8K]; T]) -> [f32; T] {
        let order = self.x.k_order(self.dtype, self.rows, t0);
        #[cfg(target_arch = "x86_64")]
        if self.vnni {
            // SAFETY: `vnni` is set only where `has_vnni512` found AVX2/FMA/F16C and AVX-512
            // F/BW/VL/VNNI at run time.
            return unsafe { crate::x86_kquant::dot_kquant_512::<T>(self.dtype, order, w, a) };
        }
        let dot = q8k_dot_fn(self.dtype);
        std::array::from_fn(|t| dot(w, a[t], order))
    }

    fn run_end(&self, t: usize, end: usize) -> usize {
        self.x.k_order_run_end(self.dtype, self.rows, t, end)
    }
}

/// The AVX512-BF16 kernel (`x86_bf16::dot_bf16_512`); only constructed where it runs.
struct Bf16Avx512(());

impl Bf16Avx512 {
    fn new() -> Option<Self> {
        (cfg!(target_arch = "x86_64") && simd::has_avx512bf16()).then_some(Self(()))
    }
}

impl TokensKernel<[u16]> for Bf16Avx512 {
    fn dot<const T: usize>(&self, w: &[u8], _t0: usize, a: [&[u16]; T]) -> [f32; T] {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: a `Bf16Avx512` exists only where `has_avx512bf16` found AVX-512 F/BW/BF16.
        return unsafe { crate::x86_bf16::dot_bf16_512::<T>(w, a) };
        #[cfg(not(target_arch = "x86_64"))]
        unreachable!("no AVX512-BF16 here ({w:?}, {a:?})")
    }
}

/// Rows `r0..r1` of `w` for every token, up to four tokens per kernel call: row by row, every
/// token over one row while its weights are in L1. `act(t)` is token `t`'s activations.
fn run_rows_by_four<'x, A: ?Sized + 'x>(
    w: &QMatrix<'_>,
    n_tok: usize,
    act: impl Fn(usize) -> &'x A,
    k: &impl TokensKernel<A>,
    p: OutPtr<f32>,
    (r0, r1): (usize, usize),
) {
    fn pad<const T: usize>(v: [f32; T]) -> [f32; 4] {
        std::array::from_fn(|i| if i < T { v[i] } else { 0.0 })
    }
    for r in r0..r1 {
        let wr = w.row(r);
        let mut t = 0;
        while t < n_tok {
            let n = (k.run_end(t, n_tok) - t).min(4);
            debug_assert!(n >= 1);
            let vals = match n {
                1 => pad(k.dot::<1>(wr, t, [act(t)])),
                2 => pad(k.dot::<2>(wr, t, [act(t), act(t + 1)])),
                3 => pad(k.dot::<3>(wr, t, [act(t), act(t + 1), act(t + 2)])),
                _ => k.dot::<4>(wr, t, [act(t), act(t + 1), act(t + 2), act(t + 3)]),
            };
            for (j, v) in vals[..n].iter().enumerate() {
                // SAFETY: t + j < n_tok, r < rows: in bounds of the output (n_tok × rows,
                // asserted by `matmul_many`); parts' row ranges are disjoint.
                unsafe { *p.get().add((t + j) * w.rows + r) = *v };
            }
            t += n;
        }
    }
}

/// Rows `r0..r1` of a K-quant matrix for every token: four tokens per super-block decode where
/// the 512-bit kernels run, the one-row kernel elsewhere (the same bits).
fn run_rows_q8k(w: &QMatrix<'_>, x: &QInput, p: OutPtr<f32>, r0: usize, r1: usize) {
    let per_row = w.cols / QK_K;
    let act = |t: usize| &x.q8k[t * per_row..(t + 1) * per_row];
    run_rows_by_four(w, x.n_tok, act, &KQuantRows::new(w, x), p, (r0, r1));
}

/// Rows `r0..r1` of a BF16 matrix for every token (`crate::bf16`): four tokens per weight load
/// where AVX512-BF16 runs, the scalar reference (the same bits) elsewhere.
fn run_rows_bf16(w: &QMatrix<'_>, x: &QInput, p: OutPtr<f32>, r0: usize, r1: usize) {
    let cols = w.cols;
    let act = |t: usize| &x.bf[t * cols..(t + 1) * cols];
    match Bf16Avx512::new() {
        Some(k) => run_rows_by_four(w, x.n_tok, act, &k, p, (r0, r1)),
        None => {
            let k = OneToken(crate::bf16::dot_bf16_scalar as fn(&[u8], &[u16]) -> f32);
            run_rows_by_four(w, x.n_tok, act, &k, p, (r0, r1));
        }
    }
}

/// Groups `g0..g1` of a packed matrix for every token, four tokens at a time: a group's weights
/// (2.9 KB of Q4_1 at 576 columns, 9 KB of Q4_K at 2,048) stay in L1 while every token passes
/// over them.
fn run_groups(pk: &PackedRows, x: &QInput, p: OutPtr<f32>, g0: usize, g1: usize) {
    if pk.dtype().activations() == Activations::Q8K {
        let per_row = pk.cols() / QK_K;
        // Made by `prepare` wherever a `PackedRows` can exist (`pack::available`).
        assert_eq!(x.q8k_lanes.len(), x.q8k.len(), "lane-order activations");
        let act = |t: usize| &x.q8k_lanes[t * per_row..(t + 1) * per_row];
        let kernel = Q8KGroups { x };
        #[cfg(target_arch = "x86_64")]
        if crate::x86_krows::takes(pk.dtype()) {
            // Runs of tokens in one order: prompt rows (tiled, slices) sixteen rows at a time.
            let (dtype, rows) = (pk.dtype(), pk.rows());
            let mut t = 0;
            while t < x.n_tok {
                let end = x.k_order_run_end(dtype, rows, t, x.n_tok);
                if let Some(kind) = crate::x86_krows::Kind::of(dtype, x.k_order(dtype, rows, t)) {
                    run_rows16(pk, kind, t..end, act, p, (g0, g1));
                } else {
                    run_groups_with(pk, t..end, act, &kernel, p, (g0, g1));
                }
                t = end;
            }
            return;
        }
        run_groups_with(pk, 0..x.n_tok, act, &kernel, p, (g0, g1));
    } else if pk.dtype() == DType::Q4_0 {
        let per_row = pk.cols() / QK;
        // Made by `prepare` for Q4_0 wherever a `PackedRows` can exist (`pack::available`).
        assert_eq!(
            x.q4_0_pairs.len(),
            x.n_tok.div_ceil(2) * per_row,
            "Q4_0 pair terms"
        );
        let act = |t: usize| &x.q8[t * per_row..(t + 1) * per_row];
        let kernel = Q40Groups {
            pairs: &x.q4_0_pairs,
            per_row,
        };
        run_groups_with(pk, 0..x.n_tok, act, &kernel, p, (g0, g1));
    } else {
        let per_row = pk.cols() / QK;
        let act = |t: usize| &x.q8[t * per_row..(t + 1) * per_row];
        run_groups_with(pk, 0..x.n_tok, act, &Q8Groups, p, (g0, g1));
    }
}

/// A packed group kernel over one to four (eight, where `MAX_BATCH` says so) tokens'
/// activations of type `A`.
trait GroupKernel<A: ?Sized> {
    /// `a`: tokens `t0 .. t0 + T` (`t0` a multiple of four). `w`: where group `g`'s weights
    /// come from on this call ([`Weights::FromMemory`] on the first token batch over it in this
    /// matmul, cached later, or unpacked by [`GroupKernel::unpack`]).
    fn dot<const T: usize>(
        &self,
        pk: &PackedRows,
        g: usize,
        t0: usize,
        a: [&A; T],
        w: Weights,
    ) -> [[f32; GROUP_ROWS]; T];

    /// Tokens one call takes: four, or eight where [`GroupKernel::dot8`] exists.
    const MAX_BATCH: usize = 4;

    /// The end of the run of tokens from `t` (before `end`) that one call may take together.
    fn run_end(&self, _pk: &PackedRows, _t: usize, end: usize) -> usize {
        end
    }

    /// Eight tokens at once, where `MAX_BATCH` is eight (a separate method, so that the other
    /// kernels are not instantiated for eight).
    fn dot8(
        &self,
        _pk: &PackedRows,
        _g: usize,
        _t0: usize,
        _a: [&A; 8],
        _w: Weights,
    ) -> [[f32; GROUP_ROWS]; 8] {
        unreachable!("MAX_BATCH is four")
    }

    /// Group `g`'s values unpacked into `scratch` for `n_tok` tokens' batches, where that pays
    /// (by default nowhere: the 32-element types unpack 4-bit values in two instructions per
    /// 64, and a pre-unpacked Q4_0 group measured 10–15 % slower, BENCHMARKS.md).
    fn unpack<'s>(
        _pk: &PackedRows,
        _g: usize,
        _n_tok: usize,
        _scratch: &'s mut Vec<u8>,
    ) -> Option<&'s [u8]> {
        None
    }
}

/// [`PackedRows::dot_group`]: Q8_0 / Q8_1 activations.
struct Q8Groups;

impl GroupKernel<[BlockQ8]> for Q8Groups {
    fn dot<const T: usize>(
        &self,
        pk: &PackedRows,
        g: usize,
        _t0: usize,
        a: [&[BlockQ8]; T],
        // The 32-element types' kernels load in ascending order: the hardware prefetcher keeps
        // up without hints; their 4-bit values unpack in two instructions per 64.
        _w: Weights,
    ) -> [[f32; GROUP_ROWS]; T] {
        pk.dot_group::<T>(g, a)
    }
}

/// [`PackedRows::dot_group_q4_0`]: Q8_0 activations and their pairs' [`Q40PairTerms`].
struct Q40Groups<'x> {
    /// `[pair][block]`, as `QInput::q4_0_pairs`.
    pairs: &'x [Q40PairTerms],
    per_row: usize,
}

impl GroupKernel<[BlockQ8]> for Q40Groups<'_> {
    fn dot<const T: usize>(
        &self,
        pk: &PackedRows,
        g: usize,
        t0: usize,
        a: [&[BlockQ8]; T],
        // As `Q8Groups`: ascending loads, nibbles unpacked in two instructions per 64.
        _w: Weights,
    ) -> [[f32; GROUP_ROWS]; T] {
        debug_assert!(t0.is_multiple_of(2), "token pairs start at even tokens");
        let pair = |i: usize| {
            let p = t0 / 2 + i;
            if 2 * i < T {
                &self.pairs[p * self.per_row..(p + 1) * self.per_row]
            } else {
                &[][..]
            }
        };
        pk.dot_group_q4_0::<T>(g, a, [pair(0), pair(1), pair(2), pair(3)])
    }

    /// Eight: the block's weight registers (unpacked from nibbles) serve four pairs.
    const MAX_BATCH: usize = 8;

    fn dot8(
        &self,
        pk: &PackedRows,
        g: usize,
        t0: usize,
        a: [&[BlockQ8]; 8],
        w: Weights,
    ) -> [[f32; GROUP_ROWS]; 8] {
        self.dot::<8>(pk, g, t0, a, w)
    }
}

/// [`PackedRows::dot_group_q8k`]: Q8_K activations in lane order (the K-quants), each token in
/// its [`KOrder`] (a call's tokens share one: [`GroupKernel::run_end`]).
struct Q8KGroups<'x> {
    x: &'x QInput,
}

/// Tokens from which a K-quant group is unpacked once per matmul rather than per batch of four:
/// unpacking costs about one batch's worth of the kernel's unpacking work plus a 16 KB (2,048
/// columns) store that stays in L1/L2; from the second batch on every batch saves it.
const UNPACK_MIN_TOKENS: usize = 8;

impl GroupKernel<[Q8KLanes]> for Q8KGroups<'_> {
    fn dot<const T: usize>(
        &self,
        pk: &PackedRows,
        g: usize,
        t0: usize,
        a: [&[Q8KLanes]; T],
        w: Weights,
    ) -> [[f32; GROUP_ROWS]; T] {
        let order = self.x.k_order(pk.dtype(), pk.rows(), t0);
        debug_assert_eq!(
            self.x.k_order_run_end(pk.dtype(), pk.rows(), t0, t0 + T),
            t0 + T
        );
        pk.dot_group_q8k::<T>(g, a, w, order)
    }

    fn run_end(&self, pk: &PackedRows, t: usize, end: usize) -> usize {
        self.x.k_order_run_end(pk.dtype(), pk.rows(), t, end)
    }

    fn unpack<'s>(
        pk: &PackedRows,
        g: usize,
        n_tok: usize,
        scratch: &'s mut Vec<u8>,
    ) -> Option<&'s [u8]> {
        (n_tok >= UNPACK_MIN_TOKENS && pk.has_codes()).then(|| {
            pk.unpack_group(g, scratch);
            &scratch[..]
        })
    }
}

std::thread_local! {
    /// Each compute thread's unpacked group ([`GroupKernel::unpack`]): ≤ 64 KB at 8,192
    /// columns, reused across groups and matmuls.
    static GROUP_CODES: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Bytes of a prompt's activations one token tile may hold: the tile is read once per group
/// and must stay in this core's L2 (1 MB on Zen 4, 2 MB on recent Intel) beside a group
/// tile's weights; a whole 512-token prompt at 2,048 columns (1.3 MB of Q8_0) would instead
/// come from L3 for every group of eight rows.
const TOKEN_TILE_BYTES: usize = 256 * 1024;
/// Bytes of packed weights one group tile may hold: read from memory once, then from L2 for
/// every token tile.
const GROUP_TILE_BYTES: usize = 384 * 1024;

/// Token and group tile sizes for a part of a matmul: tokens a multiple of four (the kernels'
/// batch), at least eight, at most the prompt; groups at least one. Measured on the 1B shape
/// (one thread, 512 tokens): Q4_0 +6 %, Q8_0 +8 % prefill. The K-quants, whose groups are
/// unpacked once per token tile ([`GroupKernel::unpack`]), lost 4 % to the repeated unpacking:
/// they keep the whole prompt as one tile.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Tiles {
    tokens: usize,
    groups: usize,
}

impl Tiles {
    /// `act_bytes_per_token`: `None` where the prompt stays one tile (tiling declined).
    fn new(n_tok: usize, act_bytes_per_token: Option<usize>, group_bytes: usize) -> Self {
        let tokens =
            act_bytes_per_token.map_or(n_tok, |b| (TOKEN_TILE_BYTES / b.max(1) / 4 * 4).max(8));
        let tiles = Self {
            tokens: tokens.min(n_tok).max(1),
            groups: (GROUP_TILE_BYTES / group_bytes.max(1)).max(1),
        };
        debug_assert!(tiles.tokens >= 1 && tiles.groups >= 1);
        tiles
    }
}

std::thread_local! {
    /// Each compute thread's two unpacked groups and their sixteen-row blocks
    /// ([`run_rows16`]): ≤ 550 KB at 14,336 columns (5,760 + 2 × 2,048 bytes per super-block),
    /// reused across matmuls.
    #[cfg(target_arch = "x86_64")]
    static ROW_BLOCKS: std::cell::RefCell<([Vec<u8>; 2], Vec<crate::x86_krows::RowBlock>)> =
        const { std::cell::RefCell::new(([Vec::new(), Vec::new()], Vec::new())) };
}

/// Tokens `tokens` (all in one order, `kind`'s) of groups `g0..g1` of a packed K-quant
/// matrix, sixteen rows (two groups) at a time in `x86_krows`' layout, eight tokens a call.
#[cfg(target_arch = "x86_64")]
fn run_rows16<'x>(
    pk: &PackedRows,
    kind: crate::x86_krows::Kind,
    tokens: std::ops::Range<usize>,
    act: impl Fn(usize) -> &'x [Q8KLanes],
    p: OutPtr<f32>,
    (g0, g1): (usize, usize),
) {
    use crate::x86_krows::{
        Kind, Q4_SLICES, Q5_TILED, Q6_TILED, ROWS, RowBlock, dot16, pair_terms, unpack_rows,
    };
    let (dtype, rows, nb) = (pk.dtype(), pk.rows(), pk.cols() / QK_K);
    // Each (token, block)'s pair terms, once for all the groups.
    let terms: Vec<[i32; 8]> = tokens
        .clone()
        .flat_map(|t| act(t).iter().map(|b| pair_terms(dtype, b)))
        .collect();
    let term = |t: usize| &terms[(t - tokens.start) * nb..(t - tokens.start + 1) * nb];
    // One call of `T` tokens from `t` over `rb`.
    fn call<'a, 'b, const T: usize>(
        kind: Kind,
        rb: &[RowBlock],
        t: usize,
        act: &dyn Fn(usize) -> &'a [Q8KLanes],
        term: &dyn Fn(usize) -> &'b [[i32; 8]],
    ) -> [[f32; ROWS]; T] {
        let (a, terms) = (
            std::array::from_fn(|i| act(t + i)),
            std::array::from_fn(|i| term(t + i)),
        );
        // SAFETY: packed matrices exist only where `pack::available()` (AVX-512 VNNI, BW, VL).
        unsafe {
            match kind {
                Kind::Q6Tiled => dot16::<T, Q6_TILED>(rb, a, terms),
                Kind::Q5Tiled => dot16::<T, Q5_TILED>(rb, a, terms),
                Kind::Q4Slices => dot16::<T, Q4_SLICES>(rb, a, terms),
            }
        }
    }
    ROW_BLOCKS.with_borrow_mut(|(codes, rb)| {
        for g in (g0..g1).step_by(2) {
            let n_groups = (g1 - g).min(2);
            for (i, c) in codes.iter_mut().enumerate().take(n_groups) {
                pk.unpack_group(g + i, c);
            }
            let groups: Vec<(&[u8], &[u8])> = (0..n_groups)
                .map(|i| (pk.group(g + i), &codes[i][..]))
                .collect();
            unpack_rows(dtype, &groups, rb);
            let store = |t0: usize, out: &[[f32; ROWS]]| {
                for (j, vals) in out.iter().enumerate() {
                    for (i, v) in vals[..n_groups * GROUP_ROWS].iter().enumerate() {
                        // SAFETY: t0 + j < n_tok and 8g + i < rows: in bounds of the output
                        // (n_tok × rows, asserted by `matmul_many`); parts' groups are disjoint.
                        unsafe { *p.get().add((t0 + j) * rows + g * GROUP_ROWS + i) = *v };
                    }
                }
            };
            let mut t = tokens.start;
            while t < tokens.end {
                // Eight tokens a call, the rest by four, two and one.
                let n = [8, 4, 2, 1]
                    .into_iter()
                    .find(|&n| n <= tokens.end - t)
                    .expect("a token left");
                match n {
                    8 => store(t, &call::<8>(kind, rb, t, &act, &term)),
                    4 => store(t, &call::<4>(kind, rb, t, &act, &term)),
                    2 => store(t, &call::<2>(kind, rb, t, &act, &term)),
                    _ => store(t, &call::<1>(kind, rb, t, &act, &term)),
                }
                t += n;
            }
        }
    });
}

fn run_groups_with<'x, A: ?Sized + 'x, K: GroupKernel<A>>(
    pk: &PackedRows,
    tokens: std::ops::Range<usize>,
    act: impl Fn(usize) -> &'x A,
    kernel: &K,
    p: OutPtr<f32>,
    (g0, g1): (usize, usize),
) {
    let rows = pk.rows();
    let store = |g: usize, t0: usize, out: &[[f32; GROUP_ROWS]]| {
        for (j, vals) in out.iter().enumerate() {
            for (i, v) in vals.iter().enumerate() {
                // SAFETY: t0 + j < n_tok and 8g + i < rows: in bounds of the output (n_tok ×
                // rows, asserted by `matmul_many`); parts' group ranges are disjoint.
                unsafe { *p.get().add((t0 + j) * rows + g * GROUP_ROWS + i) = *v };
            }
        }
    };
    let n_tok = tokens.len();
    let tiles = Tiles::new(
        n_tok,
        // (`act(t)` exists only for a non-empty input.)
        (!pk.has_codes() && n_tok > 0).then(|| std::mem::size_of_val(act(tokens.start))),
        pk.data().len() / (rows / GROUP_ROWS),
    );
    // One call (one to four tokens) of group `g`.
    let call = |g: usize, t: usize, t_end: usize, w: Weights| match t_end - t {
        1 => store(g, t, &kernel.dot::<1>(pk, g, t, [act(t)], w)),
        2 => store(g, t, &kernel.dot::<2>(pk, g, t, [act(t), act(t + 1)], w)),
        3 => store(
            g,
            t,
            &kernel.dot::<3>(pk, g, t, [act(t), act(t + 1), act(t + 2)], w),
        ),
        _ => store(
            g,
            t,
            &kernel.dot::<4>(pk, g, t, [act(t), act(t + 1), act(t + 2), act(t + 3)], w),
        ),
    };
    GROUP_CODES.with_borrow_mut(|scratch| {
        // Group tiles, then token tiles, then groups, then token batches: each group tile's
        // weights come from memory once and each token tile's activations from L2.
        for gt in (g0..g1).step_by(tiles.groups) {
            for tt in tokens.clone().step_by(tiles.tokens) {
                let tt_end = (tt + tiles.tokens).min(tokens.end);
                for g in gt..(gt + tiles.groups).min(g1) {
                    let codes = K::unpack(pk, g, tt_end - tt, scratch);
                    let mut t = tt;
                    while t < tt_end {
                        let w = match codes {
                            Some(c) => Weights::Codes(c),
                            None if t == tokens.start => Weights::FromMemory,
                            None => Weights::Cached,
                        };
                        let t_end = (t + K::MAX_BATCH).min(kernel.run_end(pk, t, tt_end));
                        debug_assert!(t_end > t);
                        if t_end - t == 8 {
                            let a = std::array::from_fn(|i| act(t + i));
                            store(g, t, &kernel.dot8(pk, g, t, a, w));
                        } else {
                            for t in (t..t_end).step_by(4) {
                                call(g, t, (t + 4).min(t_end), w);
                            }
                        }
                        t = t_end;
                    }
                }
            }
        }
    });
}

/// The one-row kernel of `dtype` that a decode step runs where nothing is packed: what every
/// multi-row and packed kernel must equal bit for bit.
#[cfg(test)]
pub(crate) fn one_row_kernel(dtype: DType) -> fn(&[u8], &[BlockQ8]) -> f32 {
    q8_dot_fn(dtype)
}

/// Scalar reference of [`matmul`] (single-threaded, no SIMD). Used by tests.
#[cfg(test)]
fn matmul_scalar(w: &QMatrix<'_>, x: &QInput, out: &mut [f32]) {
    assert_eq!(x.cols, w.cols);
    assert_eq!(out.len(), x.n_tok * w.rows);
    let mut tmp = vec![0.0f32; w.cols];
    for t in 0..x.n_tok {
        for r in 0..w.rows {
            out[t * w.rows + r] = if w.dtype.activations() == Activations::Bf16 {
                crate::bf16::dot_bf16_scalar(w.row(r), &x.bf[t * w.cols..(t + 1) * w.cols])
            } else if w.dtype.activations() == Activations::Q8K {
                let per_row = w.cols / QK_K;
                let order = x.k_order(w.dtype, w.rows, t);
                q8k::scalar_dot(w.dtype)(w.row(r), &x.q8k[t * per_row..(t + 1) * per_row], order)
            } else if w.dtype.uses_q8_activations() {
                let per_row = w.cols / QK;
                scalar_q8_dot_fn(w.dtype)(w.row(r), &x.q8[t * per_row..(t + 1) * per_row])
            } else {
                w.dequantize_row(r, &mut tmp);
                crate::ops::dot_f32_scalar(&tmp, &x.f[t * w.cols..(t + 1) * w.cols])
            };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::f16;

    use crate::test_util::rand_f32;

    /// Build random weight bytes of `dtype` (valid blocks with finite scales).
    fn rand_weights(dtype: DType, rows: usize, cols: usize, seed: &mut u64) -> Vec<u8> {
        let n_blocks = rows * cols / dtype.block_elems();
        let mut out = Vec::new();
        for _ in 0..n_blocks {
            let r = rand_f32(40, seed);
            let byte = |i: usize| ((r[i] + 1.0) * 127.9) as u8;
            match dtype {
                DType::F32 => out.extend_from_slice(&r[0].to_le_bytes()),
                DType::F16 => out.extend_from_slice(&f16::from_f32(r[0]).to_le_bytes()),
                DType::Q4_0 => {
                    out.extend_from_slice(&f16::from_f32(r[0] * 0.1).to_le_bytes());
                    out.extend((0..16).map(|i| byte(i + 1)));
                }
                DType::Q4_1 => {
                    out.extend_from_slice(&f16::from_f32(r[0] * 0.1).to_le_bytes());
                    out.extend_from_slice(&f16::from_f32(r[1] * 0.5).to_le_bytes());
                    out.extend((0..16).map(|i| byte(i + 2)));
                }
                DType::Q8_0 => {
                    out.extend_from_slice(&f16::from_f32(r[0] * 0.01).to_le_bytes());
                    out.extend((0..32).map(|i| byte(i + 2 - (i / 30) * 2)));
                }
                DType::Q5_0 | DType::Q5_1 => {
                    out.extend_from_slice(&f16::from_f32(r[0] * 0.1).to_le_bytes());
                    if dtype == DType::Q5_1 {
                        out.extend_from_slice(&f16::from_f32(r[1] * 0.5).to_le_bytes());
                    }
                    out.extend((0..20).map(|i| byte(i + 2)));
                }
                // Random bytes with the block's size (scales may be any f16, even inf/NaN:
                // these tests compare paths, not values), not used by the quantized kernels.
                _ => out.extend((0..dtype.block_bytes()).map(|i| byte(i % 40))),
            }
        }
        out
    }

    #[test]
    fn matmul_matches_scalar_reference_for_every_type() {
        let mut seed = 11;
        for dtype in [
            DType::F32,
            DType::F16,
            DType::Q4_0,
            DType::Q4_1,
            DType::Q8_0,
        ] {
            for (rows, cols, n_tok) in [(1, 32, 1), (37, 64, 3), (100, 576, 17)] {
                let wb = rand_weights(dtype, rows, cols, &mut seed);
                let w = QMatrix::new(dtype, rows, cols, &wb).expect("shape");
                let x = rand_f32(n_tok * cols, &mut seed);
                let mut qi = QInput::default();
                qi.prepare(&x, n_tok, cols, dtype);
                let mut got = vec![0.0; n_tok * rows];
                let mut want = vec![0.0; n_tok * rows];
                matmul(&w, &qi, &mut got);
                matmul_scalar(&w, &qi, &mut want);
                for (g, e) in got.iter().zip(&want) {
                    assert!(
                        (g - e).abs() <= 1e-3 * e.abs().max(1.0),
                        "{dtype:?} {g} vs {e}"
                    );
                }
            }
        }
    }

    #[test]
    fn quantized_dot_is_close_to_float_dot() {
        // The Q8 activation quantization error must stay small relative to the exact product.
        let mut seed = 5;
        let (rows, cols) = (8, 256);
        let wb = rand_weights(DType::Q4_1, rows, cols, &mut seed);
        let w = QMatrix::new(DType::Q4_1, rows, cols, &wb).expect("shape");
        let x = rand_f32(cols, &mut seed);
        let mut qi = QInput::default();
        qi.prepare(&x, 1, cols, DType::Q4_1);
        let mut got = vec![0.0; rows];
        matmul(&w, &qi, &mut got);
        let mut row = vec![0.0; cols];
        for (r, g) in got.iter().enumerate() {
            w.dequantize_row(r, &mut row);
            let exact = crate::ops::dot_f32_scalar(&row, &x);
            let scale: f32 = row.iter().map(|v| v.abs()).sum::<f32>() / 64.0;
            assert!((g - exact).abs() < 0.05 * scale.max(0.1), "{g} vs {exact}");
        }
    }

    #[test]
    fn simd_quantize_matches_scalar() {
        let mut seed = 9;
        let x = rand_f32(32 * 20, &mut seed);
        let mut a = vec![BlockQ8::default(); 20];
        quant::quantize_row_q8(&x, &mut a);
        let mut qi = QInput::default();
        qi.prepare(&x, 1, x.len(), DType::Q8_0);
        assert_eq!(qi.q8, a);
    }

    #[test]
    fn batched_rows_are_bit_identical_to_single_rows() {
        let mut seed = 3;
        let (rows, cols, n_tok) = (70, 128, 5);
        let wb = rand_weights(DType::Q4_1, rows, cols, &mut seed);
        let w = QMatrix::new(DType::Q4_1, rows, cols, &wb).expect("shape");
        let x = rand_f32(n_tok * cols, &mut seed);
        let mut qi = QInput::default();
        qi.prepare(&x, n_tok, cols, DType::Q4_1);
        let mut all = vec![0.0; n_tok * rows];
        matmul(&w, &qi, &mut all);
        for t in 0..n_tok {
            let mut one = QInput::default();
            one.prepare(&x[t * cols..(t + 1) * cols], 1, cols, DType::Q4_1);
            let mut o = vec![0.0; rows];
            matmul(&w, &one, &mut o);
            assert_eq!(&all[t * rows..(t + 1) * rows], &o[..]);
        }
    }

    #[test]
    fn four_row_kernels_are_bit_identical_to_the_one_row_kernels() {
        let mut seed = 21;
        for dtype in [DType::Q4_1, DType::Q8_0] {
            let (rows, cols) = (4, 576);
            let wb = rand_weights(dtype, rows, cols, &mut seed);
            let w = QMatrix::new(dtype, rows, cols, &wb).expect("shape");
            let x = rand_f32(cols, &mut seed);
            let mut qi = QInput::default();
            qi.prepare(&x, 1, cols, dtype);
            if let Some(dot4) = q8_dot4_fn(dtype) {
                let four = dot4([w.row(0), w.row(1), w.row(2), w.row(3)], &qi.q8);
                for (r, v) in four.iter().enumerate() {
                    assert_eq!(
                        v.to_bits(),
                        q8_dot_fn(dtype)(w.row(r), &qi.q8).to_bits(),
                        "{dtype:?} row {r}"
                    );
                }
            }
        }
    }

    #[test]
    fn four_by_four_kernels_are_bit_identical_to_the_one_row_kernels() {
        let mut seed = 23;
        for dtype in [DType::Q4_0, DType::Q4_1, DType::Q8_0] {
            let (rows, cols, n_tok) = (8, 576, 4);
            let wb = rand_weights(dtype, rows, cols, &mut seed);
            let w = QMatrix::new(dtype, rows, cols, &wb).expect("shape");
            let x = rand_f32(n_tok * cols, &mut seed);
            let mut qi = QInput::default();
            qi.prepare(&x, n_tok, cols, dtype);
            let per_row = cols / QK;
            let act = |t: usize| &qi.q8[t * per_row..(t + 1) * per_row];
            if let Some(k) = q8_dot4x4_fn(dtype) {
                let v = k(
                    [w.row(4), w.row(5), w.row(6), w.row(7)],
                    [act(0), act(1), act(2), act(3)],
                );
                for (r, row) in v.iter().enumerate() {
                    for (t, got) in row.iter().enumerate() {
                        let want = q8_dot_fn(dtype)(w.row(4 + r), act(t));
                        assert_eq!(got.to_bits(), want.to_bits(), "{dtype:?} row {r} token {t}");
                    }
                }
            }
        }
    }

    /// K-quant blocks of [`rand_weights`] with finite f16 super-block scales (`d`, and `dmin`
    /// for Q4_K/Q5_K), so that results compare by their bits; other types unchanged.
    fn finite_scales(dtype: DType, mut bytes: Vec<u8>) -> Vec<u8> {
        let offsets: &[usize] = match dtype {
            DType::Q4_K | DType::Q5_K => &[0, 2],
            DType::Q6_K => &[208],
            _ => &[],
        };
        for blk in bytes.chunks_mut(dtype.block_bytes()) {
            for &o in offsets {
                let v = (f32::from(blk[o]) - 128.0) / 8192.0 + 1e-4;
                blk[o..o + 2].copy_from_slice(&f16::from_f32(v).to_le_bytes());
            }
        }
        bytes
    }

    #[test]
    fn tiles_keep_a_token_tile_in_l2_and_whole_prompts_where_declined() {
        // (tokens, activation bytes per token, group bytes) → (token tile, group tile).
        let cases = [
            // Q8_0 activations at 2,048 columns (64 blocks × 40 bytes), Q4_0 groups.
            ((512, Some(2_560), 9_216), (100, 42)),
            // Fewer tokens than a tile: the prompt.
            ((17, Some(2_560), 9_216), (17, 42)),
            // At 576 columns (the test below): 364 tokens a tile.
            ((370, Some(720), 2_592), (364, 151)),
            // Very wide rows: never under eight tokens.
            ((512, Some(200_000), 400_000), (8, 1)),
            // Declined (unpacked K-quant groups): the whole prompt.
            ((512, None, 9_472), (512, 41)),
            ((1, Some(2_560), 9_216), (1, 42)),
        ];
        for ((n_tok, act, group), (tokens, groups)) in cases {
            assert_eq!(
                Tiles::new(n_tok, act, group),
                Tiles { tokens, groups },
                "{n_tok} tokens, {act:?} B/token, {group} B/group"
            );
        }
    }

    #[test]
    fn packed_matrices_give_the_unpacked_bits_at_any_thread_and_token_count() {
        if !crate::pack::available() {
            custody_test_skip::skip(
                "kernels::matmul::packed_matrices_give_the_unpacked_bits_at_any_thread_and_token_count",
                "no AVX-512 F/BW/VL/VNNI on this machine",
                // CI's hosts vary (Zen 4 has it, Zen 3 does not): counted, never required.
                custody_test_skip::Need::Optional,
            );
            return;
        }
        let mut seed = 31;
        for dtype in [
            DType::Q4_1,
            DType::Q8_0,
            DType::Q5_0,
            DType::Q5_1,
            DType::Q4_0,
            DType::Q4_K,
            DType::Q5_K,
            DType::Q6_K,
        ] {
            // 8 and more tokens: K-quant groups unpacked once (`GroupKernel::unpack`). 370: the
            // 32-element types' prompts in two token tiles (364 + 6 at 576 columns, `Tiles`).
            let long: &[usize] = if dtype.block_elems() == QK_K {
                &[]
            } else {
                &[370]
            };
            for &n_tok in [1, 2, 3, 4, 5, 7, 8, 9, 17].iter().chain(long) {
                let cols = if dtype.block_elems() == QK_K {
                    768
                } else {
                    576
                };
                // A packed job (64 rows), an unpacked one (13 rows) and another packed (24 rows)
                // in one section, as a projection group is.
                let wa = finite_scales(dtype, rand_weights(dtype, 64, cols, &mut seed));
                let wb = finite_scales(dtype, rand_weights(dtype, 13, cols, &mut seed));
                let wc = finite_scales(dtype, rand_weights(dtype, 24, cols, &mut seed));
                let a = QMatrix::new(dtype, 64, cols, &wa).expect("shape");
                let b = QMatrix::new(dtype, 13, cols, &wb).expect("shape");
                let c = QMatrix::new(dtype, 24, cols, &wc).expect("shape");
                let (pa, pc) = (PackedRows::new(&a), PackedRows::new(&c));
                assert!(pa.is_some() && pc.is_some() && PackedRows::new(&b).is_none());
                let x = rand_f32(n_tok * cols, &mut seed);
                let mut qi = QInput::default();
                qi.prepare(&x, n_tok, cols, dtype);
                let run = |a: QMatrix<'_>, c: QMatrix<'_>, threads: usize| {
                    let pool = crate::par::ThreadPool::new(threads).expect("pool");
                    pool.install(|| {
                        let mut oa = vec![0.0f32; n_tok * 64];
                        let mut ob = vec![0.0f32; n_tok * 13];
                        let mut oc = vec![0.0f32; n_tok * 24];
                        matmul_many(
                            &mut [(a, &mut oa[..]), (b, &mut ob[..]), (c, &mut oc[..])],
                            &qi,
                        );
                        [oa, ob, oc]
                            .concat()
                            .iter()
                            .map(|f| f.to_bits())
                            .collect::<Vec<u32>>()
                    })
                };
                let want = run(a, c, 1);
                for threads in [1, 2, 3] {
                    let got = run(
                        a.with_packed(pa.as_ref()),
                        c.with_packed(pc.as_ref()),
                        threads,
                    );
                    assert_eq!(got, want, "{dtype:?} n_tok {n_tok} threads {threads}");
                }
            }
        }
    }

    #[test]
    fn matmul_at_one_two_and_three_threads_gives_the_same_bits() {
        let mut seed = 29;
        for dtype in [DType::Q4_1, DType::Q8_0, DType::F16] {
            for (rows, cols, n_tok) in [(70, 128, 1), (70, 128, 21), (261, 64, 6)] {
                let wb = rand_weights(dtype, rows, cols, &mut seed);
                let w = QMatrix::new(dtype, rows, cols, &wb).expect("shape");
                let wb2 = rand_weights(dtype, 13, cols, &mut seed);
                let w2 = QMatrix::new(dtype, 13, cols, &wb2).expect("shape");
                let x = rand_f32(n_tok * cols, &mut seed);
                let runs: Vec<(Vec<u32>, Vec<u32>)> = [1, 2, 3]
                    .into_iter()
                    .map(|threads| {
                        let pool = crate::par::ThreadPool::new(threads).expect("pool");
                        pool.install(|| {
                            let mut qi = QInput::default();
                            qi.prepare(&x, n_tok, cols, dtype);
                            let (mut a, mut b) = (vec![0.0; n_tok * rows], vec![0.0; n_tok * 13]);
                            matmul_many(&mut [(w, &mut a[..]), (w2, &mut b[..])], &qi);
                            let bits = |v: Vec<f32>| v.iter().map(|f| f.to_bits()).collect();
                            (bits(a), bits(b))
                        })
                    })
                    .collect();
                assert_eq!(
                    runs[0], runs[1],
                    "{dtype:?} {rows}x{cols} n={n_tok}: 2 threads"
                );
                assert_eq!(
                    runs[0], runs[2],
                    "{dtype:?} {rows}x{cols} n={n_tok}: 3 threads"
                );
            }
        }
    }

    /// `matmul(w, qi)` at 1, 2 and 3 threads gives `want`, bit for bit.
    fn assert_bits_at_1_to_3_threads(w: &QMatrix<'_>, qi: &QInput, want: &[f32], what: &str) {
        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        for threads in [1, 2, 3] {
            let pool = crate::par::ThreadPool::new(threads).expect("pool");
            let got = pool.install(|| {
                let mut got = vec![0.0; want.len()];
                matmul(w, qi, &mut got);
                got
            });
            assert_eq!(bits(&got), bits(want), "{what}: {threads} threads");
        }
    }

    /// The K-quants' int8 kernels (`crate::q8k`): what `matmul` runs equals the scalar
    /// reference bit for bit, at 1, 2 and 3 threads, batched or one token at a time — with
    /// activations at full scale (±127 after quantization) in some blocks.
    #[test]
    fn kquant_kernels_give_the_scalar_references_bits_at_any_thread_and_token_count() {
        let mut seed = 31;
        for dtype in [
            DType::Q4_K,
            DType::Q5_K,
            DType::Q6_K,
            DType::Q2_K,
            DType::Q3_K,
        ] {
            // 16 rows: Q4_K in llama.cpp's repacked orders (pairs for rows in whole fours).
            let shapes = [
                (1, 256, 1),
                (37, 512, 3),
                (70, 768, 9),
                (9, 256, 6),
                (16, 512, 11),
            ];
            for (rows, cols, n_tok) in shapes {
                let wb = crate::q8k::tests::weights(dtype, rows * cols / QK_K, &mut seed);
                let w = QMatrix::new(dtype, rows, cols, &wb).expect("shape");
                let mut x = rand_f32(n_tok * cols, &mut seed);
                x[..cols / 2].iter_mut().for_each(|v| *v = v.signum() * 3.0);
                // One batch of every row; two (a prompt chunk and a decode row, as a step
                // that batches two requests); the last rows of a longer batch (a prompt whose
                // first five rows came from the prefix cache).
                let batch = |len: usize, from: usize| {
                    let len32 = len as u32;
                    (from as u32..len32).map(move |index| RowBatch { len: len32, index })
                };
                let mut splits: Vec<Vec<RowBatch>> =
                    vec![batch(n_tok, 0).collect(), batch(n_tok + 5, 5).collect()];
                if n_tok > 1 {
                    splits.push(batch(n_tok - 1, 0).chain(batch(1, 0)).collect());
                }
                for at in &splits {
                    let mut qi = QInput::default();
                    qi.prepare_rows(&x, at, cols, dtype);
                    let mut want = vec![0.0; n_tok * rows];
                    matmul_scalar(&w, &qi, &mut want);
                    let what = format!("{dtype:?} {rows}x{cols} rows {at:?}");
                    assert_bits_at_1_to_3_threads(&w, &qi, &want, &what);
                }
                let mut qi = QInput::default();
                qi.prepare(&x, n_tok, cols, dtype);
                // The one-row kernel (AVX2 where the 512-bit ones do not run) in every order.
                let per_row = cols / QK_K;
                for order in crate::q8k::tests::orders_of(dtype) {
                    for t in 0..n_tok {
                        for r in 0..rows {
                            let a = &qi.q8k[t * per_row..(t + 1) * per_row];
                            let one = q8k_dot_fn(dtype)(w.row(r), a, order);
                            let want = q8k::scalar_dot(dtype)(w.row(r), a, order);
                            assert_eq!(one.to_bits(), want.to_bits(), "{dtype:?} {order:?}");
                        }
                    }
                }
                // A row alone (a decode step) is its own batch: llama.cpp's GEMV or `vec_dot`.
                let alone = KOrder::for_row(dtype, rows, RowBatch { len: 1, index: 0 });
                for t in 0..n_tok {
                    let mut one = QInput::default();
                    one.prepare(&x[t * cols..(t + 1) * cols], 1, cols, dtype);
                    let mut o = vec![0.0; rows];
                    matmul(&w, &one, &mut o);
                    let a = &one.q8k[..per_row];
                    let want: Vec<f32> = (0..rows)
                        .map(|r| q8k::scalar_dot(dtype)(w.row(r), a, alone))
                        .collect();
                    assert_eq!(want, o, "{dtype:?} token {t}");
                }
            }
        }
    }

    /// BF16 rows on bf16 activations (`crate::bf16`): what `matmul` runs (AVX512-BF16 where
    /// present, 1–4 tokens per weight load) equals the scalar reference bit for bit, with
    /// leftovers past the last 64 and at 1–3 threads — the reference models `vdpbf16ps`.
    #[test]
    fn bf16_kernels_give_the_scalar_references_bits() {
        let mut seed = 37;
        for (rows, cols, n_tok) in [(3, 64, 1), (9, 576, 2), (17, 100, 3), (33, 1536, 7)] {
            let wv = rand_f32(rows * cols, &mut seed);
            let wb: Vec<u8> = wv
                .iter()
                .flat_map(|&v| crate::bf16::to_bf16(v * 3.0).to_le_bytes())
                .collect();
            let w = QMatrix::new(DType::BF16, rows, cols, &wb).expect("shape");
            let x = rand_f32(n_tok * cols, &mut seed);
            let mut qi = QInput::default();
            qi.prepare(&x, n_tok, cols, DType::BF16);
            let mut want = vec![0.0; n_tok * rows];
            matmul_scalar(&w, &qi, &mut want);
            assert_bits_at_1_to_3_threads(&w, &qi, &want, &format!("{rows}x{cols} n={n_tok}"));
            // And close to the exact product of the bf16 values.
            let mut row = vec![0.0; cols];
            w.dequantize_row(0, &mut row);
            let exact: f64 = row
                .iter()
                .zip(&qi.bf[..cols])
                .map(|(a, &b)| f64::from(*a) * f64::from(crate::bf16::widen(b)))
                .sum();
            assert!(
                (f64::from(want[0]) - exact).abs() < 1e-3 * cols as f64,
                "{want:?}"
            );
        }
    }

    #[test]
    fn qmatrix_rejects_wrong_sizes() {
        assert!(QMatrix::new(DType::Q4_1, 2, 32, &[0u8; 40]).is_some());
        assert!(QMatrix::new(DType::Q4_1, 2, 32, &[0u8; 39]).is_none());
        assert!(QMatrix::new(DType::Q4_1, 1, 33, &[0u8; 40]).is_none());
    }
}

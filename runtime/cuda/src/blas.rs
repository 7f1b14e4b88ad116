//! [`Lt`]: the forward pass's GEMMs ([`GemmF16`]) through cuBLASLt — prefill and large batches,
//! where the products are compute-bound and the library's tensor-core kernels are the ones to
//! use (decode at small batch stays on the quantized GEMVs of `kernels/cuda`, which read 3–4×
//! fewer bytes).
//!
//! Through cudarc's `cublaslt::result` layer, not its `Matmul` trait: that one stores the output
//! in the inputs' type, and the forward pass wants f16 inputs with f32 accumulation *and* f32
//! output (the residual stream stays f32, as on the CPU backend).
//!
//! Row-major `out[n × rows] = x[n × cols] · w[rows × cols]ᵀ` is, in cuBLAS's column-major terms,
//! `D[rows × n] = op(A)[rows × cols] · B[cols × n]` with `A` = `w` read as a `cols × rows` matrix
//! (ld `cols`) and transposed, `B` = `x` as `cols × n` (ld `cols`), `D` = `out` as `rows × n`
//! (ld `rows`). Heuristics are asked once per shape (at most [`MAX_SHAPES`] kept); the workspace
//! is the device's own allocation, so a matmul can be captured into a graph.

use std::collections::HashMap;
use std::ffi::c_void;
use std::mem::size_of;

use cudarc::cublaslt::{result, sys};

use crate::device::{DeviceError, GemmF16};

/// cuBLASLt's workspace (NVIDIA's recommendation for Hopper: 32 MiB).
pub const WORKSPACE_BYTES: usize = 32 << 20;

/// Shapes whose chosen algorithm is remembered (a model has ~7 product shapes per token count;
/// prefill chunk sizes vary): the cache is cleared when full.
const MAX_SHAPES: usize = 1024;

/// The (rows, cols, n) of a GEMM.
type Shape = (u32, u32, u32);

/// A cuBLASLt handle, its workspace and the algorithms chosen so far.
pub struct Lt {
    handle: sys::cublasLtHandle_t,
    workspace: u64,
    algos: HashMap<Shape, sys::cublasLtMatmulAlgo_t>,
}

fn lt_error(g: GemmF16, e: impl std::fmt::Debug) -> DeviceError {
    DeviceError::Gemm {
        gemm: g,
        why: format!("cuBLASLt: {e:?}"),
    }
}

/// The descriptors of one GEMM shape, destroyed on drop.
struct Descs {
    matmul: sys::cublasLtMatmulDesc_t,
    a: sys::cublasLtMatrixLayout_t,
    b: sys::cublasLtMatrixLayout_t,
    d: sys::cublasLtMatrixLayout_t,
}

impl Drop for Descs {
    fn drop(&mut self) {
        // SAFETY: each descriptor was created by `Descs::new` and is destroyed once, here.
        // A drop cannot report; a failed destroy leaks a few bytes of host memory.
        unsafe {
            let freed = [
                result::destroy_matrix_layout(self.d),
                result::destroy_matrix_layout(self.b),
                result::destroy_matrix_layout(self.a),
                result::destroy_matmul_desc(self.matmul),
            ];
            debug_assert!(freed.iter().all(Result::is_ok), "{freed:?}");
        }
    }
}

impl Descs {
    fn new(g: GemmF16) -> Result<Self, result::CublasError> {
        use sys::cudaDataType_t::{CUDA_R_16F, CUDA_R_32F};
        let (rows, cols, n) = (u64::from(g.rows), u64::from(g.cols), u64::from(g.n));
        let matmul =
            result::create_matmul_desc(sys::cublasComputeType_t::CUBLAS_COMPUTE_32F, CUDA_R_32F)?;
        // Built one at a time so that each created one is destroyed if a later one fails.
        let mut descs = Self {
            matmul,
            a: std::ptr::null_mut(),
            b: std::ptr::null_mut(),
            d: std::ptr::null_mut(),
        };
        let transpose: i32 = 1; // CUBLAS_OP_T
        // SAFETY: `matmul` is live; the attribute is an i32 (cublasOperation_t), passed by
        // pointer with its size.
        unsafe {
            result::set_matmul_desc_attribute(
                descs.matmul,
                sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSA,
                (&raw const transpose).cast::<c_void>(),
                size_of::<i32>(),
            )?;
        }
        descs.a = result::create_matrix_layout(CUDA_R_16F, cols, rows, i64::from(g.cols))?;
        descs.b = result::create_matrix_layout(CUDA_R_16F, cols, n, i64::from(g.cols))?;
        descs.d = result::create_matrix_layout(CUDA_R_32F, rows, n, i64::from(g.rows))?;
        Ok(descs)
    }
}

impl Lt {
    /// A handle for the current context; `workspace` names [`WORKSPACE_BYTES`] of its memory.
    pub fn new(workspace: u64) -> Result<Self, DeviceError> {
        let handle =
            result::create_handle().map_err(|e| DeviceError::Driver(format!("cuBLASLt: {e:?}")))?;
        Ok(Self {
            handle,
            workspace,
            algos: HashMap::new(),
        })
    }

    fn algo(&mut self, g: GemmF16, d: &Descs) -> Result<sys::cublasLtMatmulAlgo_t, DeviceError> {
        let shape = (g.rows, g.cols, g.n);
        if let Some(a) = self.algos.get(&shape) {
            return Ok(*a);
        }
        let pref = result::create_matmul_pref().map_err(|e| lt_error(g, e))?;
        let bytes = WORKSPACE_BYTES;
        // SAFETY: `pref` and the descriptors are live; the workspace attribute is a usize passed
        // by pointer with its size; `pref` is destroyed once below.
        let chosen = unsafe {
            let chosen = result::set_matmul_pref_attribute(
                pref,
                sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                (&raw const bytes).cast::<c_void>(),
                size_of::<usize>(),
            )
            .and_then(|()| {
                result::get_matmul_algo_heuristic(self.handle, d.matmul, d.a, d.b, d.d, d.d, pref)
            });
            let freed = result::destroy_matmul_pref(pref);
            debug_assert!(freed.is_ok(), "{freed:?}");
            chosen
        }
        .map_err(|e| lt_error(g, e))?;
        if self.algos.len() >= MAX_SHAPES {
            self.algos.clear();
        }
        self.algos.insert(shape, chosen.algo);
        Ok(chosen.algo)
    }

    /// Enqueue `g` on `stream` (after everything before it there).
    pub fn gemm(&mut self, g: GemmF16, stream: sys::cudaStream_t) -> Result<(), DeviceError> {
        let d = Descs::new(g).map_err(|e| lt_error(g, e))?;
        let algo = self.algo(g, &d)?;
        let (alpha, beta) = (1.0f32, 0.0f32);
        // SAFETY: the descriptors describe `g`'s matrices, which the caller's contract puts in
        // live allocations of at least those sizes; `out` is both C (read with beta = 0) and D;
        // the workspace holds WORKSPACE_BYTES; alpha and beta outlive the call (cuBLASLt reads
        // host scalars before it returns).
        unsafe {
            result::matmul(
                self.handle,
                d.matmul,
                (&raw const alpha).cast::<c_void>(),
                (&raw const beta).cast::<c_void>(),
                g.w.0 as *const c_void,
                d.a,
                g.x.0 as *const c_void,
                d.b,
                g.out.0 as *const c_void,
                d.d,
                g.out.0 as *mut c_void,
                d.d,
                &raw const algo,
                self.workspace as *mut c_void,
                WORKSPACE_BYTES,
                stream.cast(),
            )
        }
        .map_err(|e| lt_error(g, e))
    }
}

impl Drop for Lt {
    fn drop(&mut self) {
        // SAFETY: the handle was created in `new` and is destroyed once, here; the caller has
        // synchronized the stream (the device's drop does before freeing memory).
        let freed = unsafe { result::destroy_handle(self.handle) };
        debug_assert!(freed.is_ok(), "{freed:?}");
    }
}

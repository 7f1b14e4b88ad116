//! [`CudaDevice`]: a real GPU through cudarc (feature `cuda`). The kernels are compiled once at
//! open with NVRTC for the device's own architecture, from [`crate::KERNEL_SOURCES`], and every
//! launch and copy goes to one stream of its own (not the legacy default stream: a graph cannot
//! be captured there). Copies are stream-ordered; `upload` and `download` wait before they
//! return (the host buffer is the caller's, borrowed for the call only), `upload_async` — a
//! step's inputs — copies the bytes into pinned memory ([`crate::pinned`]) and returns at once,
//! the DMA running ahead of the step's graph. Downloads stay pageable: the logits go into the
//! caller's own vectors, and a pinned bounce would add a host copy as large as the transfer it
//! speeds. Graphs are stream captures
//! (`cuStreamBeginCapture`, thread-local mode), instantiated once and replayed with
//! `cuGraphLaunch`. GEMMs go to cuBLASLt on the same stream ([`crate::blas`]), with a workspace
//! of the device's own, so that they are captured like launches.
//!
//! Not run on a GPU yet (no device was lent to this project's sessions): it compiles and lints
//! in CI, and `open` without a driver is a typed error there. `scripts/gpu-check.sh` is the
//! prepared first run on a GPU.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaFunction, CudaGraph, CudaStream, result, sys};

use crate::blas::{Lt, WORKSPACE_BYTES};
use crate::device::{
    Arg, Device, DeviceError, DevicePtr, Download, GemmF16, GraphId, Kernel, LaunchDims,
};
use crate::pinned::Pinned;
use crate::{CudaUnavailable, module_source};

/// An opened CUDA device with Custody's kernels loaded.
pub struct CudaDevice {
    // Dropped first (fields drop in order, after `Drop::drop` has synchronized the stream):
    // the cuBLASLt handle and the pinned region go while the context still exists.
    lt: Lt,
    pinned: Pinned,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    functions: HashMap<Kernel, CudaFunction>,
    name: String,
    arch: &'static str,
    allocations: Vec<sys::CUdeviceptr>,
    capturing: bool,
    graphs: HashMap<GraphId, CudaGraph>,
    next_graph: u32,
}

impl std::fmt::Debug for CudaDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaDevice")
            .field("name", &self.name)
            .field("arch", &self.arch)
            .finish_non_exhaustive()
    }
}

// SAFETY: the context, stream and functions are driver handles usable from any thread once the
// context is bound to it; every method binds it first (`bind`).
unsafe impl Send for CudaDevice {}

fn driver(e: impl std::fmt::Display) -> DeviceError {
    DeviceError::Driver(e.to_string())
}

impl CudaDevice {
    /// Open device `ordinal` (after [`crate::open`]'s library checks) and compile the kernels.
    pub fn open(ordinal: usize) -> Result<Self, CudaUnavailable> {
        Self::open_with(ordinal, &[])
    }

    /// [`Self::open`] with the kernels compiled without the tag check in flash decoding
    /// (`CUSTODY_BENCH_NO_TAG_CHECK`): only for measuring what the check costs
    /// (`custody gpu-check speed`); the engine never opens a device this way. Named in the
    /// device's description.
    pub fn open_without_tag_check(ordinal: usize) -> Result<Self, CudaUnavailable> {
        Self::open_with(ordinal, &["-DCUSTODY_BENCH_NO_TAG_CHECK"])
    }

    fn open_with(ordinal: usize, defines: &[&str]) -> Result<Self, CudaUnavailable> {
        crate::open(ordinal)?;
        let no_device = |why: String| CudaUnavailable::NoDevice { ordinal, why };
        let ctx = CudaContext::new(ordinal).map_err(|e| no_device(e.to_string()))?;
        let (major, minor) = ctx
            .compute_capability()
            .map_err(|e| no_device(e.to_string()))?;
        // NVRTC wants a `'static` architecture name: one per process and device, leaked once.
        let arch: &'static str = Box::leak(format!("sm_{major}{minor}").into_boxed_str());
        let opts = cudarc::nvrtc::CompileOptions {
            arch: Some(arch),
            // No contraction: a*b+c stays two roundings, as on the CPU backend.
            fmad: Some(false),
            options: ["-std=c++17", "-default-device"]
                .iter()
                .chain(defines)
                .map(|o| o.to_string())
                .collect(),
            ..Default::default()
        };
        let ptx = cudarc::nvrtc::compile_ptx_with_opts(module_source(), opts)
            .map_err(|e| no_device(format!("NVRTC: {e}")))?;
        let module = ctx.load_module(ptx).map_err(|e| no_device(e.to_string()))?;
        let mut functions = HashMap::new();
        for &k in Kernel::ALL {
            let f = module
                .load_function(k.name())
                .map_err(|e| no_device(format!("{}: {e}", k.name())))?;
            functions.insert(k, f);
        }
        let mut name = ctx.name().map_err(|e| no_device(e.to_string()))?;
        if !defines.is_empty() {
            name.push_str(&format!(" [kernels built with {}]", defines.join(" ")));
        }
        let stream = ctx.new_stream().map_err(|e| no_device(e.to_string()))?;
        // The workspace, the cuBLASLt handle and the pinned region belong to this context.
        ctx.bind_to_thread().map_err(|e| no_device(e.to_string()))?;
        // SAFETY: a plain allocation for cuBLASLt's workspace, freed in `Drop` with the others.
        let workspace = unsafe { result::malloc_sync(WORKSPACE_BYTES) }
            .map_err(|e| no_device(format!("cuBLASLt workspace: {e}")))?;
        let lt = Lt::new(workspace).map_err(|e| no_device(e.to_string()))?;
        let pinned = Pinned::new().map_err(|e| no_device(e.to_string()))?;
        Ok(Self {
            pinned,
            stream,
            ctx,
            functions,
            name,
            arch,
            allocations: vec![workspace],
            capturing: false,
            graphs: HashMap::new(),
            next_graph: 0,
            lt,
        })
    }

    fn bind(&self) -> Result<(), DeviceError> {
        self.ctx.bind_to_thread().map_err(driver)
    }

    /// Copies and allocations are refused while a graph is captured (see the trait's spec).
    fn not_capturing(&self, what: &'static str) -> Result<(), DeviceError> {
        if self.capturing {
            return Err(DeviceError::Capturing { what });
        }
        self.bind()
    }
}

impl Drop for CudaDevice {
    fn drop(&mut self) {
        if self.bind().is_err() {
            return;
        }
        // Work still queued may read the memory about to be freed.
        let idle = self.stream.synchronize();
        debug_assert!(
            idle.is_ok(),
            "synchronizing before the drop failed: {idle:?}"
        );
        for &p in &self.allocations {
            // SAFETY: `p` came from `malloc_sync` on this context and is freed once, here.
            let freed = unsafe { result::free_sync(p) };
            // A drop cannot report: the allocation goes with the context anyway.
            debug_assert!(
                freed.is_ok(),
                "freeing a device allocation failed: {freed:?}"
            );
        }
    }
}

impl Device for CudaDevice {
    fn alloc_zeroed(&mut self, bytes: usize) -> Result<DevicePtr, DeviceError> {
        self.not_capturing("an allocation")?;
        // SAFETY: a plain device allocation of `bytes` (never managed memory), zeroed before
        // use; freed in `Drop`.
        let p = unsafe { result::malloc_sync(bytes.max(1)) }
            .map_err(|_| DeviceError::OutOfMemory { bytes })?;
        self.allocations.push(p);
        // SAFETY: `p` names `bytes` bytes of this context's memory; ordered on the stream
        // before any launch that could read it.
        unsafe { result::memset_d8_async(p, 0, bytes, self.stream.cu_stream()) }.map_err(driver)?;
        Ok(DevicePtr(p))
    }

    fn upload(&mut self, dst: DevicePtr, src: &[u8]) -> Result<(), DeviceError> {
        self.not_capturing("a copy to the device")?;
        // SAFETY: the caller's contract: `dst` names at least `src.len()` bytes of an
        // allocation; `src` outlives the copy (the stream is synchronized before returning).
        unsafe { result::memcpy_htod_async(dst.0, src, self.stream.cu_stream()) }
            .map_err(driver)?;
        self.stream.synchronize().map_err(driver)?;
        self.pinned.reset(0)
    }

    fn upload_async(&mut self, dst: DevicePtr, src: &[u8]) -> Result<(), DeviceError> {
        self.not_capturing("a copy to the device")?;
        if !self.pinned.fits(src.len()) {
            // Every staged copy must have finished before the region is reused.
            self.stream.synchronize().map_err(driver)?;
            self.pinned.reset(src.len())?;
        }
        let staged = self.pinned.stage(src);
        // SAFETY: `dst` names at least `src.len()` bytes of an allocation (the caller's
        // contract); `staged` is pinned memory that is not reused before the stream is waited
        // for (`Pinned::reset` only after a synchronize).
        unsafe { result::memcpy_htod_async(dst.0, staged, self.stream.cu_stream()) }.map_err(driver)
    }

    fn download(&mut self, src: DevicePtr, dst: &mut [u8]) -> Result<(), DeviceError> {
        self.not_capturing("a copy from the device")?;
        // SAFETY: as `upload`, the other way: ordered after every launch before it.
        unsafe { result::memcpy_dtoh_async(dst, src.0, self.stream.cu_stream()) }
            .map_err(driver)?;
        self.stream.synchronize().map_err(driver)?;
        // The stream is idle: every staged upload has been read.
        self.pinned.reset(0)
    }

    fn download_all(&mut self, parts: &mut [Download<'_>]) -> Result<(), DeviceError> {
        self.not_capturing("a copy from the device")?;
        let total: usize = parts.iter().map(|p| p.dst.len().next_multiple_of(16)).sum();
        if !self.pinned.fits(total) {
            // The region is reused (and grown): every staged upload must have been read.
            self.stream.synchronize().map_err(driver)?;
            self.pinned.reset(total)?;
        }
        let mut landed = Vec::with_capacity(parts.len());
        for p in parts.iter() {
            let at = self.pinned.take(p.dst.len());
            // SAFETY: `at` is `p.dst.len()` bytes of pinned memory no other copy uses before
            // the reset below (after the synchronize); `p.src` names at least that many bytes
            // of an allocation (the caller's contract). Ordered after every launch before it.
            unsafe {
                let staged = std::slice::from_raw_parts_mut(at, p.dst.len());
                result::memcpy_dtoh_async(staged, p.src.0, self.stream.cu_stream())
            }
            .map_err(driver)?;
            landed.push(at);
        }
        self.stream.synchronize().map_err(driver)?;
        for (p, at) in parts.iter_mut().zip(landed) {
            // SAFETY: the copy into `at` has finished (the stream is idle); the pinned bytes
            // and `p.dst` do not overlap (one is the region, the other the caller's memory).
            unsafe { std::ptr::copy_nonoverlapping(at, p.dst.as_mut_ptr(), p.dst.len()) };
        }
        // The stream is idle: every staged copy, up or down, has finished.
        self.pinned.reset(0)
    }

    fn launch(
        &mut self,
        kernel: Kernel,
        dims: LaunchDims,
        args: &[Arg],
    ) -> Result<(), DeviceError> {
        if args.len() != kernel.arity() {
            return Err(DeviceError::Arity {
                kernel,
                expected: kernel.arity(),
                got: args.len(),
            });
        }
        self.bind()?;
        let f = &self.functions[&kernel];
        // One slot per argument, alive until cuLaunchKernel has copied the parameters.
        let mut slots: Vec<[u64; 6]> = args.iter().map(Arg::words).collect();
        let mut params: Vec<*mut c_void> = slots
            .iter_mut()
            .map(|s| s.as_mut_ptr().cast::<c_void>())
            .collect();
        let [gx, gy, gz] = dims.grid;
        let [bx, by, bz] = dims.block;
        // SAFETY: `f` is a function of the loaded module; `params` holds one pointer per C
        // parameter (the arity is checked above), each to storage of at least that parameter's
        // size that lives until the launch has read it (cuLaunchKernel copies parameters before
        // it returns); the device pointers are the caller's allocations.
        unsafe {
            result::launch_kernel(
                f.cu_function(),
                (gx, gy, gz),
                (bx, by, bz),
                0,
                self.stream.cu_stream(),
                &mut params,
            )
        }
        .map_err(|e| DeviceError::Launch {
            kernel,
            why: e.to_string(),
        })
    }

    fn gemm_f16(&mut self, g: GemmF16) -> Result<(), DeviceError> {
        if g.rows == 0 || g.cols == 0 || g.n == 0 {
            return Err(DeviceError::Gemm {
                gemm: g,
                why: "an empty dimension".into(),
            });
        }
        self.bind()?;
        self.lt.gemm(g, self.stream.cu_stream().cast())
    }

    fn describe(&self) -> String {
        format!("CUDA device {} ({})", self.name, self.arch)
    }

    fn begin_capture(&mut self) -> Result<(), DeviceError> {
        self.not_capturing("a capture")?;
        self.stream
            .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(driver)?;
        self.capturing = true;
        Ok(())
    }

    fn end_capture(&mut self) -> Result<GraphId, DeviceError> {
        if !self.capturing {
            return Err(DeviceError::NotCapturing);
        }
        self.capturing = false;
        self.bind()?;
        let graph = self
            .stream
            .end_capture(sys::CUgraphInstantiate_flags_enum(0))
            .map_err(driver)?
            .ok_or_else(|| DeviceError::Driver("the capture recorded no graph".into()))?;
        let id = GraphId(self.next_graph);
        self.next_graph += 1;
        self.graphs.insert(id, graph);
        Ok(id)
    }

    fn replay(&mut self, graph: GraphId) -> Result<(), DeviceError> {
        self.not_capturing("a replay")?;
        let g = self.graphs.get(&graph).ok_or(DeviceError::NoGraph(graph))?;
        g.launch().map_err(driver)
    }

    fn drop_graph(&mut self, graph: GraphId) -> Result<(), DeviceError> {
        self.not_capturing("dropping a graph")?;
        // A graph the stream may still run: wait before destroying it.
        self.stream.synchronize().map_err(driver)?;
        self.graphs
            .remove(&graph)
            .map(drop)
            .ok_or(DeviceError::NoGraph(graph))
    }
}

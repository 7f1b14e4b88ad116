//! The device boundary the CUDA forward pass runs against: memory, copies and kernel launches,
//! with device addresses as plain numbers. Two implementations: [`crate::CudaDevice`] (a real
//! GPU through cudarc, feature `cuda`) and the test crate's CUDA-on-CPU shim, which runs the
//! same kernel sources on the host — so the forward pass's host code is the same on both.
//!
//! # Spec
//! - A [`DevicePtr`] is an address in the device's memory; the host never dereferences one.
//!   Allocations are plain device memory ([`Device::alloc_zeroed`]; never managed memory).
//! - [`Device::launch`] takes the kernel's arguments in its C signature's order, each as the
//!   [`Arg`] variant of its C type; the implementation checks the count against [`Kernel::arity`].
//! - Launches are ordered: a download sees every launch before it (one stream).
//! - Graphs (CUDA graphs): between [`Device::begin_capture`] and [`Device::end_capture`] a launch
//!   is recorded, not run, and a copy or allocation is [`DeviceError::Capturing`] (a copy's host
//!   pointer would be frozen into the graph). [`Device::replay`] runs the recorded launches in
//!   order with the arguments they were recorded with — pointers and scalars are fixed, only the
//!   memory they name changes between replays — as one launch of the host.
//! - [`Device::gemm_f16`] is the one product the device does not run from `kernels/cuda`: a
//!   GEMM by the library made for it (cuBLASLt on a GPU; a reference loop on the shim), ordered
//!   and captured like a launch.

use custody_kernels::attention::{IntegrityError, PageRef};

/// An address in device memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct DevicePtr(pub u64);

impl DevicePtr {
    /// `self + bytes`.
    pub fn offset(self, bytes: u64) -> DevicePtr {
        DevicePtr(self.0 + bytes)
    }
}

/// `CustodyTags` (kernels/cuda/custody.cuh): the pool's page tags on the device, one layer's
/// `filled`. Layout-identical to the C struct (passed by value to the attention kernels).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceTags {
    pub generation: u64,
    pub owner: u64,
    pub filled: u64,
    pub stamp_owner: u64,
    pub stamp_generation: u64,
    pub n_pages: u32,
}

/// `CustodyVerdict`: `code` 0 = may read, else `IntegrityError`'s variant index + 1.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Verdict {
    pub code: u32,
    pub page: u32,
    pub a: u64,
    pub b: u64,
}

impl Verdict {
    /// The CPU check's error this verdict encodes (`None`: the request may read), for a request
    /// with `block_table` attending `n_ctx` slots — the inverse of the kernels' encoding.
    pub fn to_error(&self, block_table: &[PageRef], n_ctx: usize) -> Option<IntegrityError> {
        let generation = || {
            block_table
                .iter()
                .find(|pr| pr.page == self.page)
                .map_or(0, |pr| pr.generation)
        };
        Some(match self.code {
            0 => return None,
            1 => IntegrityError::PageOutOfRange {
                page: self.page,
                n_pages: self.a as usize,
            },
            2 => IntegrityError::BlockTableTooShort {
                have: self.a as usize,
                need: self.b as usize,
                n_ctx,
            },
            3 => IntegrityError::StaleGeneration {
                page: self.page,
                expected: self.a as u32,
                found: self.b as u32,
            },
            4 => IntegrityError::ForeignOwner {
                page: self.page,
                generation: generation(),
                expected: self.a,
                found: self.b,
            },
            5 => IntegrityError::UnwrittenSlot {
                page: self.page,
                generation: self.b as u32,
                slot: self.a as u32,
                filled: self.a as u32,
            },
            // 6 is the write side's `OutOfOrderWrite`: checked by the host, never by a kernel.
            _ => IntegrityError::InBandMismatch {
                page: self.page,
                generation: generation(),
                stamp_owner: self.a,
                stamp_generation: self.b as u32,
            },
        })
    }
}

/// One kernel argument, as its C type.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Arg {
    Ptr(DevicePtr),
    U32(u32),
    U64(u64),
    F32(f32),
    Tags(DeviceTags),
}

impl Arg {
    /// The argument as launchers store it: six 64-bit words, a pointer, integer or float's
    /// bits in the first (little-endian: a `u32` parameter reads its low half), a
    /// `DeviceTags` in all six — `CustodyTags`' C layout. Each kernel parameter is read from
    /// the start of its own slot (`cuLaunchKernel`'s parameter pointers; the shim's launcher).
    pub fn words(&self) -> [u64; 6] {
        let mut s = [0u64; 6];
        match *self {
            Arg::Ptr(p) => s[0] = p.0,
            Arg::U32(v) => s[0] = v.into(),
            Arg::U64(v) => s[0] = v,
            Arg::F32(v) => s[0] = v.to_bits().into(),
            Arg::Tags(t) => {
                s = [
                    t.generation,
                    t.owner,
                    t.filled,
                    t.stamp_owner,
                    t.stamp_generation,
                    t.n_pages.into(),
                ]
            }
        }
        s
    }
}

/// A captured sequence of launches ([`Device::end_capture`]), replayable until dropped.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct GraphId(pub u32);

/// Grid and block dimensions of one launch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LaunchDims {
    pub grid: [u32; 3],
    pub block: [u32; 3],
}

impl LaunchDims {
    /// A 1-D block of `threads` over a 2-D grid.
    pub fn grid2(x: u32, y: u32, threads: u32) -> Self {
        Self {
            grid: [x, y, 1],
            block: [threads, 1, 1],
        }
    }
}

macro_rules! kernels {
    ($($variant:ident = $name:literal, $arity:literal;)*) => {
        /// The kernels of `kernels/cuda` the host launches, by their `extern "C"` names.
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        pub enum Kernel { $($variant),* }

        impl Kernel {
            pub const ALL: &'static [Kernel] = &[$(Kernel::$variant),*];

            /// The kernel's symbol in the module.
            pub fn name(self) -> &'static str {
                match self { $(Kernel::$variant => $name),* }
            }

            /// How many arguments its C signature takes.
            pub fn arity(self) -> usize {
                match self { $(Kernel::$variant => $arity),* }
            }
        }
    };
}

kernels! {
    Embed = "custody_embed", 5;
    RmsNorm = "custody_rms_norm", 7;
    AddRmsNorm = "custody_add_rms_norm", 8;
    Matvec = "custody_matvec", 6;
    GemvQ4K = "custody_gemv_q4k", 7;
    GemvQ6K = "custody_gemv_q6k", 7;
    GemvQ8_0 = "custody_gemv_q8_0", 7;
    Rope = "custody_rope", 8;
    KvWrite = "custody_kv_write", 9;
    FlashDecode = "custody_flash_decode", 22;
    FlashPrefill = "custody_flash_prefill", 16;
    TagCheck = "custody_tag_check", 8;
    TagApply = "custody_tag_apply", 8;
    AddRows = "custody_add_rows", 4;
    Swiglu = "custody_swiglu", 3;
    Softmax = "custody_softmax", 2;
    PageChecksum = "custody_page_checksum", 5;
    CopyChunks = "custody_copy_chunks", 5;
    FillQ4K = "custody_fill_q4k", 8;
    GatherRows = "custody_gather_rows", 4;
    RopeKvWrite = "custody_rope_kv_write", 16;
    GemvQ4KSwiglu = "custody_gemv_q4k_swiglu", 9;
    GemvQ4KQkv = "custody_gemv_q4k_qkv", 14;
    DequantF16 = "custody_dequant_f16", 4;
    ToF16 = "custody_to_f16", 3;
    QuantizeQ8 = "custody_quantize_q8", 4;
    GemvQ4KQ8 = "custody_gemv_q4k_q8", 8;
    GemvQ4KQ8Qkv = "custody_gemv_q4k_q8_qkv", 15;
    GemvQ4KQ8Swiglu = "custody_gemv_q4k_q8_swiglu", 10;
    MmqQ4K = "custody_mmq_q4k", 8;
    MmqQ4KQkv = "custody_mmq_q4k_qkv", 15;
    MmqQ4KSwiglu = "custody_mmq_q4k_swiglu", 10;
}

/// One GEMM of the forward pass's products for the library: `out[r][o] = Σ_k w[o][k] · x[r][k]`
/// with `w` (`rows × cols`) and `x` (`n × cols`) IEEE binary16, row-major, accumulated in f32
/// and stored as f32 (`out`: `n × rows`, row-major — the GEMVs' output layout).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct GemmF16 {
    pub w: DevicePtr,
    pub x: DevicePtr,
    pub out: DevicePtr,
    /// Output features (rows of `w`).
    pub rows: u32,
    /// Input features (columns of `w` and `x`).
    pub cols: u32,
    /// Activation rows (tokens).
    pub n: u32,
}

/// What a device operation can fail with.
#[derive(Debug, thiserror::Error)]
pub enum DeviceError {
    #[error("device out of memory: {bytes} bytes requested")]
    OutOfMemory { bytes: usize },
    #[error("{kernel:?} takes {expected} arguments, {got} given")]
    Arity {
        kernel: Kernel,
        expected: usize,
        got: usize,
    },
    #[error("kernel {kernel:?} failed: {why}")]
    Launch { kernel: Kernel, why: String },
    #[error("device: {0}")]
    Driver(String),
    #[error("{what} while a graph is being captured")]
    Capturing { what: &'static str },
    #[error("no graph is being captured")]
    NotCapturing,
    #[error("no graph {0:?} on this device")]
    NoGraph(GraphId),
    #[error("GEMM {gemm:?} failed: {why}")]
    Gemm { gemm: GemmF16, why: String },
}

/// One copy of [`Device::download_all`]: `dst.len()` bytes from `src`.
#[derive(Debug)]
pub struct Download<'a> {
    pub src: DevicePtr,
    pub dst: &'a mut [u8],
}

/// A CUDA device as the forward pass sees it.
pub trait Device: std::fmt::Debug + Send {
    /// `bytes` of plain device memory, zeroed.
    fn alloc_zeroed(&mut self, bytes: usize) -> Result<DevicePtr, DeviceError>;
    /// Copy `src` to `dst` (which names at least `src.len()` bytes of one allocation).
    fn upload(&mut self, dst: DevicePtr, src: &[u8]) -> Result<(), DeviceError>;
    /// [`Device::upload`] without waiting for the copy: `src` is taken before the call returns
    /// (a GPU stages it in pinned memory and copies it asynchronously), and the copy is ordered
    /// before every later launch and copy. For a step's inputs; the default waits.
    fn upload_async(&mut self, dst: DevicePtr, src: &[u8]) -> Result<(), DeviceError> {
        self.upload(dst, src)
    }
    /// Copy `dst.len()` bytes from `src`, after every launch before it has finished.
    fn download(&mut self, src: DevicePtr, dst: &mut [u8]) -> Result<(), DeviceError>;
    /// Every copy of `parts` ([`Device::download`] each): a GPU makes them asynchronous DMA
    /// copies into pinned memory, waits once for all of them, then hands the bytes over — a
    /// step's logits, one part per segment. The default downloads them one by one.
    fn download_all(&mut self, parts: &mut [Download<'_>]) -> Result<(), DeviceError> {
        for p in parts.iter_mut() {
            self.download(p.src, p.dst)?;
        }
        Ok(())
    }
    /// Run `kernel` over `dims` with `args` (in its C signature's order).
    fn launch(&mut self, kernel: Kernel, dims: LaunchDims, args: &[Arg])
    -> Result<(), DeviceError>;
    /// Run `g` (see [`GemmF16`]) after every launch before it; recorded while capturing.
    fn gemm_f16(&mut self, g: GemmF16) -> Result<(), DeviceError>;
    /// What the device is, for the startup log line.
    fn describe(&self) -> String;
    /// Record launches from now on instead of running them (see the module's spec).
    fn begin_capture(&mut self) -> Result<(), DeviceError>;
    /// Stop recording; the recorded launches become a graph.
    fn end_capture(&mut self) -> Result<GraphId, DeviceError>;
    /// Run `graph`'s launches, in their recorded order, as one launch.
    fn replay(&mut self, graph: GraphId) -> Result<(), DeviceError>;
    /// Forget `graph` (its launches' pointers may name memory about to be replaced).
    fn drop_graph(&mut self, graph: GraphId) -> Result<(), DeviceError>;
}

impl<D: Device + ?Sized> Device for Box<D> {
    fn alloc_zeroed(&mut self, bytes: usize) -> Result<DevicePtr, DeviceError> {
        (**self).alloc_zeroed(bytes)
    }
    fn upload(&mut self, dst: DevicePtr, src: &[u8]) -> Result<(), DeviceError> {
        (**self).upload(dst, src)
    }
    fn upload_async(&mut self, dst: DevicePtr, src: &[u8]) -> Result<(), DeviceError> {
        (**self).upload_async(dst, src)
    }
    fn download(&mut self, src: DevicePtr, dst: &mut [u8]) -> Result<(), DeviceError> {
        (**self).download(src, dst)
    }
    fn download_all(&mut self, parts: &mut [Download<'_>]) -> Result<(), DeviceError> {
        (**self).download_all(parts)
    }
    fn launch(&mut self, k: Kernel, dims: LaunchDims, args: &[Arg]) -> Result<(), DeviceError> {
        (**self).launch(k, dims, args)
    }
    fn gemm_f16(&mut self, g: GemmF16) -> Result<(), DeviceError> {
        (**self).gemm_f16(g)
    }
    fn describe(&self) -> String {
        (**self).describe()
    }
    fn begin_capture(&mut self) -> Result<(), DeviceError> {
        (**self).begin_capture()
    }
    fn end_capture(&mut self) -> Result<GraphId, DeviceError> {
        (**self).end_capture()
    }
    fn replay(&mut self, graph: GraphId) -> Result<(), DeviceError> {
        (**self).replay(graph)
    }
    fn drop_graph(&mut self, graph: GraphId) -> Result<(), DeviceError> {
        (**self).drop_graph(graph)
    }
}

/// Plain-old-data values uploaded as bytes (little-endian hosts and devices: x86-64, CUDA).
pub fn bytes_of<T: Pod>(v: &[T]) -> &[u8] {
    // SAFETY: `T: Pod` has no padding and no invalid bit patterns; the slice is live for the
    // returned lifetime and `size_of_val` is its exact length in bytes.
    unsafe { std::slice::from_raw_parts(v.as_ptr().cast(), std::mem::size_of_val(v)) }
}

/// [`bytes_of`] for writing: downloads into typed buffers.
pub fn bytes_of_mut<T: Pod>(v: &mut [T]) -> &mut [u8] {
    // SAFETY: as `bytes_of`; every bit pattern is a valid `T`, so any bytes written are too.
    unsafe { std::slice::from_raw_parts_mut(v.as_mut_ptr().cast(), std::mem::size_of_val(v)) }
}

/// Types whose every bit pattern is valid and that have no padding.
///
/// # Safety
/// Implement only for such types.
pub unsafe trait Pod: Copy {}
// SAFETY: primitive integers and floats: no padding, every bit pattern valid.
unsafe impl Pod for u8 {}
// SAFETY: as above.
unsafe impl Pod for u16 {}
// SAFETY: as above.
unsafe impl Pod for u32 {}
// SAFETY: as above.
unsafe impl Pod for u64 {}
// SAFETY: as above.
unsafe impl Pod for f32 {}
// SAFETY: `repr(C)` u32, u32, u64, u64: no padding (offsets 0, 4, 8, 16), every pattern valid.
unsafe impl Pod for Verdict {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_kernel_table_names_each_kernel_once_and_in_the_sources() {
        let all: String = crate::KERNEL_SOURCES.iter().map(|(_, s)| *s).collect();
        let mut names = std::collections::BTreeSet::new();
        for k in Kernel::ALL {
            assert!(names.insert(k.name()), "{k:?} twice");
            let decl = format!("__global__ void {}(", k.name());
            let at = all
                .find(&decl)
                .unwrap_or_else(|| panic!("{decl} not in the sources"));
            // Arity: the parameter list's commas up to its closing parenthesis.
            let params = &all[at + decl.len()..];
            let params = &params[..params.find(')').expect("closing parenthesis")];
            assert_eq!(params.matches(',').count() + 1, k.arity(), "{k:?}");
        }
    }

    #[test]
    fn the_tags_and_verdict_layouts_are_the_c_ones() {
        assert_eq!(std::mem::size_of::<Verdict>(), 24);
        assert_eq!(std::mem::size_of::<DeviceTags>(), 48);
        assert_eq!(std::mem::offset_of!(DeviceTags, n_pages), 40);
    }
}

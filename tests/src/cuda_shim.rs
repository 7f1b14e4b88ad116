//! Custody's CUDA kernels (`kernels/cuda/*.cu`) executed on the CPU through the project's
//! CUDA-on-CPU shim (`kernels/cuda/shim`): each launch runs the kernel source with the grid and
//! block its GPU launcher uses, under a schedule seed (0: thread order; others: a permutation per
//! barrier phase). Built by this crate's `build.rs`; tests only.

use std::ffi::c_char;

/// `CustodyPageRef` (= `custody_kernels::attention::PageRef`'s layout).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PageRef {
    pub page: u32,
    pub generation: u32,
}

/// `CustodyTags`: the pool's tags, one layer's `filled`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct Tags {
    pub generation: *const u32,
    pub owner: *const u64,
    pub filled: *const u32,
    pub stamp_owner: *const u64,
    pub stamp_generation: *const u32,
    pub n_pages: u32,
}

/// `CustodyVerdict` (the device boundary's own definition).
pub use custody_cuda::Verdict;

unsafe extern "C" {
    fn custody_shim_page_checksum(
        ptrs: *const *const u8,
        lens: *const u64,
        page_chunks: *const u32,
        n_pages: u32,
        out: *mut u64,
        seed: u64,
        err: *mut c_char,
        err_len: usize,
    ) -> i32;
    fn custody_shim_tag_check(
        tables: *const PageRef,
        table_off: *const u32,
        table_len: *const u32,
        n_ctx: *const u32,
        readers: *const u64,
        n_req: u32,
        page_size: u32,
        tags: Tags,
        out: *mut Verdict,
        seed: u64,
        err: *mut c_char,
        err_len: usize,
    ) -> i32;
    fn custody_shim_control_race(out: *mut f32, seed: u64, err: *mut c_char, err_len: usize)
    -> i32;
    fn custody_shim_control_divergent(err: *mut c_char, err_len: usize) -> i32;
}

unsafe extern "C" {
    fn custody_shim_control_warp_sum(
        out: *mut u32,
        seed: u64,
        err: *mut c_char,
        err_len: usize,
    ) -> i32;
    fn custody_shim_control_warp_divergent(err: *mut c_char, err_len: usize) -> i32;
}

/// The warp-collective control's outputs: per thread of a 64-thread block, its warp's sum of
/// thread ids (butterfly) and its shuffle-down neighbour's id.
#[derive(Debug)]
pub struct WarpSum {
    pub sum: Vec<u32>,
    pub down: Vec<u32>,
}

/// Run the warp-collective control.
pub fn control_warp_sum(seed: u64) -> Result<WarpSum, ShimError> {
    let mut out = vec![u32::MAX; 128];
    // SAFETY: the kernel writes 128 u32 (two per thread of its 64).
    run(|e, l| unsafe { custody_shim_control_warp_sum(out.as_mut_ptr(), seed, e, l) })?;
    let down = out.split_off(64);
    Ok(WarpSum { sum: out, down })
}

/// Run the control whose lanes do not all reach a warp collective (must be reported).
pub fn control_warp_divergent() -> Result<(), ShimError> {
    // SAFETY: no buffers.
    run(|e, l| unsafe { custody_shim_control_warp_divergent(e, l) })
}

/// Why a shim launch failed (a divergent barrier, …).
#[derive(Debug)]
pub struct ShimError(pub String);

impl std::fmt::Display for ShimError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "CUDA shim: {}", self.0)
    }
}

impl std::error::Error for ShimError {}

fn check(rc: i32, err: &[u8]) -> Result<(), ShimError> {
    if rc == 0 {
        return Ok(());
    }
    let end = err.iter().position(|&b| b == 0).unwrap_or(err.len());
    Err(ShimError(String::from_utf8_lossy(&err[..end]).into_owned()))
}

/// The pages of one checksum launch: page `p`'s chunks, in transfer order.
pub fn page_checksums(pages: &[Vec<&[u8]>], seed: u64) -> Result<Vec<u64>, ShimError> {
    let mut ptrs = Vec::new();
    let mut lens = Vec::new();
    let mut page_chunks = vec![0u32];
    for p in pages {
        for c in p {
            ptrs.push(c.as_ptr());
            lens.push(c.len() as u64);
        }
        page_chunks.push(ptrs.len() as u32);
    }
    let mut out = vec![u64::MAX; pages.len()];
    let mut err = [0u8; 256];
    // SAFETY: every pointer names `lens[i]` live bytes for the call; `out` has one slot per page;
    // `page_chunks` has `pages.len() + 1` entries.
    let rc = unsafe {
        custody_shim_page_checksum(
            ptrs.as_ptr(),
            lens.as_ptr(),
            page_chunks.as_ptr(),
            pages.len() as u32,
            out.as_mut_ptr(),
            seed,
            err.as_mut_ptr().cast(),
            err.len(),
        )
    };
    check(rc, &err).map(|()| out)
}

/// One request of a tag check or attention launch.
#[derive(Clone, Debug)]
pub struct Request {
    pub table: Vec<PageRef>,
    pub n_ctx: u32,
    pub reader: custody_kernels::attention::Reader,
}

/// The pool's tags as owned vectors (a [`Tags`] borrows them).
#[derive(Clone, Debug, Default)]
pub struct OwnedTags {
    pub generation: Vec<u32>,
    pub owner: Vec<u64>,
    pub filled: Vec<u32>,
    pub stamp_owner: Vec<u64>,
    pub stamp_generation: Vec<u32>,
}

impl OwnedTags {
    fn view(&self) -> Tags {
        let n = self.generation.len();
        assert!(
            self.owner.len() == n
                && self.filled.len() == n
                && self.stamp_owner.len() == n
                && self.stamp_generation.len() == n
        );
        Tags {
            generation: self.generation.as_ptr(),
            owner: self.owner.as_ptr(),
            filled: self.filled.as_ptr(),
            stamp_owner: self.stamp_owner.as_ptr(),
            stamp_generation: self.stamp_generation.as_ptr(),
            n_pages: n as u32,
        }
    }
}

struct Flat {
    tables: Vec<PageRef>,
    off: Vec<u32>,
    len: Vec<u32>,
    n_ctx: Vec<u32>,
    /// `CustodyReader`s: [`custody_kernels::attention::Reader::words`] per request.
    readers: Vec<u64>,
}

fn flatten(reqs: &[Request]) -> Flat {
    let mut f = Flat {
        tables: Vec::new(),
        off: Vec::new(),
        len: Vec::new(),
        n_ctx: Vec::new(),
        readers: Vec::new(),
    };
    for r in reqs {
        f.off.push(f.tables.len() as u32);
        f.len.push(r.table.len() as u32);
        f.tables.extend_from_slice(&r.table);
        f.n_ctx.push(r.n_ctx);
        f.readers.extend(r.reader.words());
    }
    // A valid pointer even for an empty table.
    f.tables.push(PageRef {
        page: 0,
        generation: 0,
    });
    f
}

/// Each request's tag-check verdict.
pub fn tag_check(
    reqs: &[Request],
    page_size: u32,
    tags: &OwnedTags,
    seed: u64,
) -> Result<Vec<Verdict>, ShimError> {
    let f = flatten(reqs);
    let mut out = vec![
        Verdict {
            code: u32::MAX,
            ..Verdict::default()
        };
        reqs.len()
    ];
    let mut err = [0u8; 256];
    // SAFETY: the arrays have one entry per request (tables: every request's entries); the tag
    // arrays cover `n_pages` pages; `out` one verdict per request.
    let rc = unsafe {
        custody_shim_tag_check(
            f.tables.as_ptr(),
            f.off.as_ptr(),
            f.len.as_ptr(),
            f.n_ctx.as_ptr(),
            f.readers.as_ptr(),
            reqs.len() as u32,
            page_size,
            tags.view(),
            out.as_mut_ptr(),
            seed,
            err.as_mut_ptr().cast(),
            err.len(),
        )
    };
    check(rc, &err).map(|()| out)
}

/// The shape of one decode-attention launch.
#[derive(Clone, Copy, Debug)]
pub struct AttentionShape {
    pub n_heads: u32,
    pub n_kv_heads: u32,
    pub head_dim: u32,
    pub page_size: u32,
}

/// The shim's racy control kernel's result under `seed`.
pub fn control_race(seed: u64) -> Result<f32, ShimError> {
    let mut out = f32::NAN;
    let mut err = [0u8; 256];
    // SAFETY: one float to write.
    let rc =
        unsafe { custody_shim_control_race(&mut out, seed, err.as_mut_ptr().cast(), err.len()) };
    check(rc, &err).map(|()| out)
}

/// The shim's divergent-barrier control kernel (must fail).
pub fn control_divergent() -> Result<(), ShimError> {
    let mut err = [0u8; 256];
    // SAFETY: no arguments but the message buffer.
    let rc = unsafe { custody_shim_control_divergent(err.as_mut_ptr().cast(), err.len()) };
    check(rc, &err)
}

unsafe extern "C" {
    fn custody_shim_rms_norm(
        x: *const f32,
        w: *const f32,
        eps: f32,
        rows: u32,
        dim: u32,
        out: *mut f32,
        seed: u64,
        err: *mut c_char,
        err_len: usize,
    ) -> i32;
    fn custody_shim_rope(
        x: *mut f32,
        positions: *const u32,
        rows: u32,
        n_heads: u32,
        head_dim: u32,
        n_rot: u32,
        freq_base: f32,
        freq_factors: *const f32,
        neox: u32,
        seed: u64,
        err: *mut c_char,
        err_len: usize,
    ) -> i32;
    fn custody_shim_softmax(
        x: *mut f32,
        rows: u32,
        n: u32,
        seed: u64,
        err: *mut c_char,
        err_len: usize,
    ) -> i32;
    fn custody_shim_swiglu(
        gate: *mut f32,
        up: *const f32,
        n: u64,
        seed: u64,
        err: *mut c_char,
        err_len: usize,
    ) -> i32;
    fn custody_shim_matvec(
        w: *const u8,
        dtype: u32,
        out_rows: u32,
        cols: u32,
        x: *const f32,
        n: u32,
        out: *mut f32,
        seed: u64,
        err: *mut c_char,
        err_len: usize,
    ) -> i32;
    fn custody_shim_copy_chunks(
        src: *const u8,
        src_off: *const u64,
        dst: *mut u8,
        dst_off: *const u64,
        len: *const u64,
        n_chunks: u32,
        seed: u64,
        err: *mut c_char,
        err_len: usize,
    ) -> i32;
}

/// Run a launcher that reports into an error buffer.
fn run(f: impl FnOnce(*mut c_char, usize) -> i32) -> Result<(), ShimError> {
    let mut err = [0u8; 256];
    let rc = f(err.as_mut_ptr().cast(), err.len());
    check(rc, &err)
}

/// RMSNorm of each `dim`-long row of `x` into `out`.
pub fn rms_norm(
    x: &[f32],
    w: &[f32],
    eps: f32,
    out: &mut [f32],
    seed: u64,
) -> Result<(), ShimError> {
    let dim = w.len();
    assert!(dim > 0 && x.len().is_multiple_of(dim) && out.len() == x.len());
    // SAFETY: `x`/`out` hold `rows × dim` floats, `w` `dim`.
    run(|e, n| unsafe {
        custody_shim_rms_norm(
            x.as_ptr(),
            w.as_ptr(),
            eps,
            (x.len() / dim) as u32,
            dim as u32,
            out.as_mut_ptr(),
            seed,
            e,
            n,
        )
    })
}

/// The shape of a RoPE launch.
#[derive(Clone, Copy, Debug)]
pub struct RopeShape<'a> {
    pub n_heads: u32,
    pub head_dim: u32,
    pub n_rot: u32,
    pub freq_base: f32,
    /// One per rotated pair (all 1 for plain RoPE).
    pub freq_factors: &'a [f32],
    /// NeoX pairs `(i, i + n_rot/2)` instead of adjacent ones.
    pub neox: bool,
}

/// RoPE in place on rows of `n_heads × head_dim`, row `i` at `positions[i]`.
pub fn rope(x: &mut [f32], positions: &[u32], s: RopeShape, seed: u64) -> Result<(), ShimError> {
    assert_eq!(x.len(), positions.len() * (s.n_heads * s.head_dim) as usize);
    assert_eq!(s.freq_factors.len(), s.n_rot as usize / 2);
    // SAFETY: `x` holds every row (asserted), `positions` one per row, a factor per pair.
    run(|e, n| unsafe {
        custody_shim_rope(
            x.as_mut_ptr(),
            positions.as_ptr(),
            positions.len() as u32,
            s.n_heads,
            s.head_dim,
            s.n_rot,
            s.freq_base,
            s.freq_factors.as_ptr(),
            u32::from(s.neox),
            seed,
            e,
            n,
        )
    })
}

/// Softmax in place of each `n`-long row.
pub fn softmax(x: &mut [f32], n: usize, seed: u64) -> Result<(), ShimError> {
    assert!(n > 0 && x.len().is_multiple_of(n));
    // SAFETY: `x` holds `rows × n` floats.
    run(|e, l| unsafe {
        custody_shim_softmax(x.as_mut_ptr(), (x.len() / n) as u32, n as u32, seed, e, l)
    })
}

/// `gate = silu(gate) · up`.
pub fn swiglu(gate: &mut [f32], up: &[f32], seed: u64) -> Result<(), ShimError> {
    assert_eq!(gate.len(), up.len());
    // SAFETY: both hold `gate.len()` floats.
    run(|e, l| unsafe {
        custody_shim_swiglu(
            gate.as_mut_ptr(),
            up.as_ptr(),
            gate.len() as u64,
            seed,
            e,
            l,
        )
    })
}

/// `out[r][o] = Σ_k W[o][k] · x[r][k]`, W `out_rows × cols` of GGUF type `dtype` (its
/// `custody_kernels::quant::DType` index) as file bytes.
#[allow(clippy::too_many_arguments)]
pub fn matvec(
    w: &[u8],
    dtype: u32,
    out_rows: usize,
    cols: usize,
    x: &[f32],
    out: &mut [f32],
    seed: u64,
) -> Result<(), ShimError> {
    assert!(cols > 0 && x.len().is_multiple_of(cols));
    let n = x.len() / cols;
    assert_eq!(out.len(), n * out_rows);
    // SAFETY: `w` holds the matrix (the caller's layout), `x` `n × cols`, `out` `n × out_rows`.
    run(|e, l| unsafe {
        custody_shim_matvec(
            w.as_ptr(),
            dtype,
            out_rows as u32,
            cols as u32,
            x.as_ptr(),
            n as u32,
            out.as_mut_ptr(),
            seed,
            e,
            l,
        )
    })
}

/// One chunk of a gather/scatter: `len` bytes from `src + src_off` to `dst + dst_off`.
#[derive(Clone, Copy, Debug)]
pub struct Chunk {
    pub src_off: u64,
    pub dst_off: u64,
    pub len: u64,
}

/// Copy `chunks` from `src` to `dst` (a page's K/V chunks to a staging buffer, or back).
pub fn copy_chunks(
    src: &[u8],
    dst: &mut [u8],
    chunks: &[Chunk],
    seed: u64,
) -> Result<(), ShimError> {
    for c in chunks {
        assert!(c.src_off + c.len <= src.len() as u64 && c.dst_off + c.len <= dst.len() as u64);
    }
    let so: Vec<u64> = chunks.iter().map(|c| c.src_off).collect();
    let d: Vec<u64> = chunks.iter().map(|c| c.dst_off).collect();
    let len: Vec<u64> = chunks.iter().map(|c| c.len).collect();
    // SAFETY: every chunk lies within `src` and `dst` (asserted above).
    run(|e, l| unsafe {
        custody_shim_copy_chunks(
            src.as_ptr(),
            so.as_ptr(),
            dst.as_mut_ptr(),
            d.as_ptr(),
            len.as_ptr(),
            chunks.len() as u32,
            seed,
            e,
            l,
        )
    })
}

/// What one counted launch did (`custody_shim::Counts`, kernels/cuda/shim/cuda_shim.h): the
/// bytes its lanes asked for, its warp-level memory instructions, the 32-byte sectors they
/// touched against the fewest that could hold their bytes, and the distinct sectors of the
/// launch (the DRAM traffic model).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counts {
    pub load_bytes: u64,
    pub store_bytes: u64,
    pub load_requests: u64,
    pub store_requests: u64,
    pub sectors: u64,
    pub ideal_sectors: u64,
    pub dram_sectors: u64,
    pub warp_collectives: u64,
}

impl Counts {
    /// Ideal sectors over sectors touched: 1.0 is perfectly coalesced.
    pub fn coalescing(&self) -> f64 {
        if self.sectors == 0 {
            return 0.0;
        }
        self.ideal_sectors as f64 / self.sectors as f64
    }

    /// Bytes the DRAM model moves (each distinct sector once).
    pub fn dram_bytes(&self) -> u64 {
        self.dram_sectors * 32
    }
}

/// One counted launch of a [`ShimDevice`].
#[derive(Clone, Copy, Debug)]
pub struct CountedLaunch {
    pub kernel: Kernel,
    pub dims: LaunchDims,
    pub counts: Counts,
    /// Run by a graph's replay (a node of it), not launched by the host on its own.
    pub in_graph: bool,
}

/// One node a [`ShimDevice`] recorded while capturing.
#[derive(Clone, Debug)]
enum Recorded {
    Launch {
        kernel: Kernel,
        dims: LaunchDims,
        args: Vec<Arg>,
    },
    Gemm(GemmF16),
}

unsafe extern "C" {
    fn custody_shim_count_begin();
    fn custody_shim_count_end(out: *mut Counts);
    fn custody_shim_launch(
        name: *const c_char,
        grid: *const u32,
        block: *const u32,
        args: *const u64,
        seed: u64,
        err: *mut c_char,
        err_len: usize,
    ) -> i32;
}

/// The shim as a [`custody_cuda::Device`]: "device" memory is host memory this value owns
/// (addresses are real pointers), every copy is bounds-checked against the allocation it
/// names, and each launch runs the kernel's source on the CPU under this device's schedule
/// seed. What the CUDA forward pass runs on in CI.
#[derive(Debug)]
pub struct ShimDevice {
    seed: u64,
    /// Each allocation: its words and where its 256-byte-aligned start is (as `cuMemAlloc`
    /// aligns; the counted sectors depend on it).
    allocations: Vec<ShimAlloc>,
    launches: u64,
    /// `Some` when this device counts its launches' memory traffic.
    counted: Option<Vec<CountedLaunch>>,
    /// Host↔device bytes copied (uploads, downloads).
    pub uploaded_bytes: u64,
    pub downloaded_bytes: u64,
    /// When counting: every copy, with the number of launches made before it.
    pub transfers: Vec<Transfer>,
    /// The launches being recorded (`Some` between `begin_capture` and `end_capture`).
    capture: Option<Vec<Recorded>>,
    graphs: std::collections::HashMap<GraphId, Vec<Recorded>>,
    next_graph: u32,
    /// Graph replays so far (each one launch of the host's).
    graph_launches: u64,
    /// GEMMs run so far (on their own or as graph nodes): the library's work, which the
    /// counters do not see.
    gemms: u64,
}

/// One host↔device copy of a counting [`ShimDevice`].
#[derive(Clone, Copy, Debug)]
pub struct Transfer {
    /// Counted launches held before this copy (its place among [`ShimDevice::take_counts`]'s).
    pub after_launches: u64,
    pub bytes: u64,
    pub to_device: bool,
}

impl ShimDevice {
    pub fn new(seed: u64) -> Self {
        Self {
            seed,
            allocations: Vec::new(),
            launches: 0,
            counted: None,
            uploaded_bytes: 0,
            downloaded_bytes: 0,
            transfers: Vec::new(),
            capture: None,
            graphs: std::collections::HashMap::new(),
            next_graph: 0,
            graph_launches: 0,
            gemms: 0,
        }
    }

    /// GEMMs run so far ([`Device::gemm_f16`]: the library's, not counted by kernel).
    pub fn gemms(&self) -> u64 {
        self.gemms
    }

    /// Graph replays so far.
    pub fn graph_launches(&self) -> u64 {
        self.graph_launches
    }

    /// Graphs held (captured and not dropped).
    pub fn graphs_held(&self) -> usize {
        self.graphs.len()
    }

    fn not_capturing(&self, what: &'static str) -> Result<(), DeviceError> {
        match self.capture {
            Some(_) => Err(DeviceError::Capturing { what }),
            None => Ok(()),
        }
    }

    fn note_transfer(&mut self, bytes: usize, to_device: bool) {
        if let Some(counted) = &self.counted {
            self.transfers.push(Transfer {
                after_launches: counted.len() as u64,
                bytes: bytes as u64,
                to_device,
            });
        }
    }

    /// A device that counts every launch's memory traffic (slower: each access is recorded).
    pub fn counting(seed: u64) -> Self {
        Self {
            counted: Some(Vec::new()),
            ..Self::new(seed)
        }
    }

    /// The counted launches so far, and forget them (empty unless [`Self::counting`]).
    pub fn take_counts(&mut self) -> Vec<CountedLaunch> {
        self.counted
            .as_mut()
            .map(std::mem::take)
            .unwrap_or_default()
    }

    /// Kernels run so far (on their own or as graph nodes).
    pub fn launches(&self) -> u64 {
        self.launches
    }

    /// The allocation holding `[p, p + len)`, as a byte range of it.
    fn span(&mut self, p: DevicePtr, len: usize) -> Result<&mut [u8], DeviceError> {
        for a in &mut self.allocations {
            let words = &mut a.words[a.start_words..];
            let base = words.as_ptr() as u64;
            let bytes = a.bytes as u64;
            if p.0 >= base && p.0 + len as u64 <= base + bytes {
                let start = (p.0 - base) as usize;
                let all = custody_cuda::device::bytes_of_mut(words);
                return Ok(&mut all[start..start + len]);
            }
        }
        Err(DeviceError::Driver(format!(
            "shim: {len} bytes at {:#x} are not inside one allocation",
            p.0
        )))
    }
}

use custody_cuda::{Arg, Device, DeviceError, DevicePtr, GemmF16, GraphId, Kernel, LaunchDims};

/// One [`ShimDevice`] allocation.
#[derive(Debug)]
struct ShimAlloc {
    words: Box<[u64]>,
    /// The device address is `words[start_words..]`'s (256-byte aligned).
    start_words: usize,
    bytes: usize,
}

impl Device for ShimDevice {
    fn alloc_zeroed(&mut self, bytes: usize) -> Result<DevicePtr, DeviceError> {
        self.not_capturing("an allocation")?;
        const ALIGN_WORDS: usize = 256 / 8;
        let words = vec![0u64; bytes.div_ceil(8).max(1) + ALIGN_WORDS].into_boxed_slice();
        let misaligned = (words.as_ptr() as usize / 8) % ALIGN_WORDS;
        let start_words = (ALIGN_WORDS - misaligned) % ALIGN_WORDS;
        let p = DevicePtr(words[start_words..].as_ptr() as u64);
        self.allocations.push(ShimAlloc {
            words,
            start_words,
            bytes: bytes.div_ceil(8).max(1) * 8,
        });
        Ok(p)
    }

    fn upload(&mut self, dst: DevicePtr, src: &[u8]) -> Result<(), DeviceError> {
        self.not_capturing("a copy to the device")?;
        self.span(dst, src.len())?.copy_from_slice(src);
        self.uploaded_bytes += src.len() as u64;
        self.note_transfer(src.len(), true);
        Ok(())
    }

    fn download(&mut self, src: DevicePtr, dst: &mut [u8]) -> Result<(), DeviceError> {
        self.not_capturing("a copy from the device")?;
        dst.copy_from_slice(self.span(src, dst.len())?);
        self.downloaded_bytes += dst.len() as u64;
        self.note_transfer(dst.len(), false);
        Ok(())
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
        if let Some(recording) = &mut self.capture {
            recording.push(Recorded::Launch {
                kernel,
                dims,
                args: args.to_vec(),
            });
            return Ok(());
        }
        self.run(kernel, dims, args, false)
    }

    fn gemm_f16(&mut self, g: GemmF16) -> Result<(), DeviceError> {
        if let Some(recording) = &mut self.capture {
            recording.push(Recorded::Gemm(g));
            return Ok(());
        }
        self.run_gemm(g)
    }

    fn describe(&self) -> String {
        format!("CUDA-on-CPU shim (schedule seed {})", self.seed)
    }

    fn begin_capture(&mut self) -> Result<(), DeviceError> {
        self.not_capturing("a capture")?;
        self.capture = Some(Vec::new());
        Ok(())
    }

    fn end_capture(&mut self) -> Result<GraphId, DeviceError> {
        let recorded = self.capture.take().ok_or(DeviceError::NotCapturing)?;
        let id = GraphId(self.next_graph);
        self.next_graph += 1;
        self.graphs.insert(id, recorded);
        Ok(id)
    }

    fn replay(&mut self, graph: GraphId) -> Result<(), DeviceError> {
        self.not_capturing("a replay")?;
        let nodes = self.graphs.get(&graph).ok_or(DeviceError::NoGraph(graph))?;
        // Cloned: running a node borrows the device mutably (a graph is a few hundred nodes).
        let nodes = nodes.clone();
        self.graph_launches += 1;
        for n in &nodes {
            match n {
                Recorded::Launch { kernel, dims, args } => self.run(*kernel, *dims, args, true)?,
                Recorded::Gemm(g) => self.run_gemm(*g)?,
            }
        }
        Ok(())
    }

    fn drop_graph(&mut self, graph: GraphId) -> Result<(), DeviceError> {
        self.not_capturing("dropping a graph")?;
        self.graphs
            .remove(&graph)
            .map(drop)
            .ok_or(DeviceError::NoGraph(graph))
    }
}

impl ShimDevice {
    /// A GEMM now: the reference loop standing in for cuBLASLt (f16 inputs widened exactly,
    /// f32 products summed in order), bounds-checked like a copy.
    fn run_gemm(&mut self, g: GemmF16) -> Result<(), DeviceError> {
        let (rows, cols, n) = (g.rows as usize, g.cols as usize, g.n as usize);
        if rows == 0 || cols == 0 || n == 0 {
            return Err(DeviceError::Gemm {
                gemm: g,
                why: "an empty dimension".into(),
            });
        }
        let widen = |b: &[u8]| -> Vec<f32> {
            b.chunks_exact(2)
                .map(|h| half::f16::from_le_bytes([h[0], h[1]]).to_f32())
                .collect()
        };
        let w = widen(self.span(g.w, rows * cols * 2)?);
        let x = widen(self.span(g.x, n * cols * 2)?);
        let out = self.span(g.out, n * rows * 4)?;
        for (r, xr) in x.chunks_exact(cols).enumerate() {
            for (o, wo) in w.chunks_exact(cols).enumerate() {
                let v: f32 = wo.iter().zip(xr).map(|(a, b)| a * b).sum();
                let at = (r * rows + o) * 4;
                out[at..at + 4].copy_from_slice(&v.to_le_bytes());
            }
        }
        self.gemms += 1;
        Ok(())
    }

    /// Run one kernel now (its arity checked by the caller), counted when counting.
    fn run(
        &mut self,
        kernel: Kernel,
        dims: LaunchDims,
        args: &[Arg],
        in_graph: bool,
    ) -> Result<(), DeviceError> {
        let words: Vec<u64> = args.iter().flat_map(Arg::words).collect();
        let name = std::ffi::CString::new(kernel.name()).expect("no NUL in a kernel name");
        let mut err = [0u8; 256];
        self.launches += 1;
        if self.counted.is_some() {
            // SAFETY: starts this OS thread's counters; no argument.
            unsafe { custody_shim_count_begin() };
        }
        // SAFETY: `words` holds one 6-word slot per argument of the kernel's C signature (the
        // arity is checked above); every pointer argument is an address of one of this device's
        // allocations, as the forward pass only passes those; grid and block are 3 words each.
        let rc = unsafe {
            custody_shim_launch(
                name.as_ptr(),
                dims.grid.as_ptr(),
                dims.block.as_ptr(),
                words.as_ptr(),
                self.seed,
                err.as_mut_ptr().cast(),
                err.len(),
            )
        };
        if let Some(counted) = &mut self.counted {
            let mut counts = Counts::default();
            // SAFETY: ends the counting begun above on this thread; `counts` is a live `Counts`.
            unsafe { custody_shim_count_end(&mut counts) };
            counted.push(CountedLaunch {
                kernel,
                dims,
                counts,
                in_graph,
            });
        }
        check(rc, &err).map_err(|e| DeviceError::Launch { kernel, why: e.0 })
    }
}

/// How a flash-decoding launch cuts the contexts (`custody_flash_decode`'s grid.z and pages per
/// CTA).
#[derive(Clone, Copy, Debug)]
pub struct FlashSplits {
    pub n: u32,
    pub pages_per_split: u32,
}

/// What an attention run returns: each request's verdict and its one launch's counts (the
/// merge, and the verdicts, are made within it).
#[derive(Debug)]
pub struct FlashRun {
    pub verdicts: Vec<Verdict>,
    pub counts: Counts,
}

/// Paged flash decoding (`custody_flash_decode`, merged by each row's last split) on a counting shim
/// device: writes `out` for the requests that pass their tag check.
#[allow(clippy::too_many_arguments)]
pub fn flash_decode(
    q: &[f32],
    k_cache: &[u16],
    v_cache: &[u16],
    reqs: &[Request],
    shape: AttentionShape,
    tags: &OwnedTags,
    splits: FlashSplits,
    out: &mut [f32],
    seed: u64,
) -> Result<FlashRun, DeviceError> {
    let kv = KvCaches { k_cache, v_cache };
    flash_run(q, kv, reqs, shape, tags, Attend::Decode(splits), out, seed)
}

/// Prefill attention on tensor cores (`custody_flash_prefill`) on a counting shim device: `reqs` are the rows, `tiles` (first row, rows) pairs
/// of consecutive rows of one block table each; writes `out` for the rows that pass.
#[allow(clippy::too_many_arguments)]
pub fn flash_prefill(
    q: &[f32],
    k_cache: &[u16],
    v_cache: &[u16],
    reqs: &[Request],
    tiles: &[u32],
    shape: AttentionShape,
    tags: &OwnedTags,
    out: &mut [f32],
    seed: u64,
) -> Result<FlashRun, DeviceError> {
    let kv = KvCaches { k_cache, v_cache };
    flash_run(q, kv, reqs, shape, tags, Attend::Prefill(tiles), out, seed)
}

/// The K and V caches an attention launch reads.
struct KvCaches<'a> {
    k_cache: &'a [u16],
    v_cache: &'a [u16],
}

/// Which attention kernel runs before the merge.
enum Attend<'a> {
    Decode(FlashSplits),
    /// `custody_flash_prefill` over these tiles.
    Prefill(&'a [u32]),
}

#[allow(clippy::too_many_arguments)]
fn flash_run(
    q: &[f32],
    kv: KvCaches<'_>,
    reqs: &[Request],
    shape: AttentionShape,
    tags: &OwnedTags,
    attend: Attend<'_>,
    out: &mut [f32],
    seed: u64,
) -> Result<FlashRun, DeviceError> {
    use custody_cuda::device::{bytes_of, bytes_of_mut};
    let (k_cache, v_cache) = (kv.k_cache, kv.v_cache);
    let splits = match attend {
        Attend::Decode(s) => s,
        Attend::Prefill(_) => FlashSplits {
            n: 1,
            pages_per_split: 0,
        },
    };
    let n = reqs.len();
    assert_eq!(out.len(), q.len());
    let f = flatten(reqs);
    let mut dev = ShimDevice::counting(seed);
    let mut put = |b: &[u8]| -> Result<DevicePtr, DeviceError> {
        let p = dev.alloc_zeroed(b.len())?;
        dev.upload(p, b)?;
        Ok(p)
    };
    let qp = put(bytes_of(q))?;
    let kp = put(bytes_of(k_cache))?;
    let vp = put(bytes_of(v_cache))?;
    let table_words: Vec<u32> = f
        .tables
        .iter()
        .flat_map(|p| [p.page, p.generation])
        .collect();
    let tables = put(bytes_of(&table_words))?;
    let off = put(bytes_of(&f.off))?;
    let len = put(bytes_of(&f.len))?;
    let n_ctx = put(bytes_of(&f.n_ctx))?;
    let readers = put(bytes_of(&f.readers))?;
    let dt = custody_cuda::DeviceTags {
        generation: put(bytes_of(&tags.generation))?.0,
        owner: put(bytes_of(&tags.owner))?.0,
        filled: put(bytes_of(&tags.filled))?.0,
        stamp_owner: put(bytes_of(&tags.stamp_owner))?.0,
        stamp_generation: put(bytes_of(&tags.stamp_generation))?.0,
        n_pages: tags.generation.len() as u32,
    };
    let pairs = n * shape.n_heads as usize * splits.n as usize;
    let partial = put(bytes_of(&vec![
        f32::NAN;
        pairs * (shape.head_dim as usize + 2)
    ]))?;
    // Every CTA writes its entry; zeros are a valid index should one not (never a wild read).
    let bad = put(bytes_of(&vec![
        0u32;
        n * (shape.n_kv_heads * splits.n) as usize
    ]))?;
    let outp = put(bytes_of(out))?;
    let poisoned = vec![
        Verdict {
            code: u32::MAX,
            ..Verdict::default()
        };
        n
    ];
    let verdicts = put(bytes_of(&poisoned))?;
    let table = [
        Arg::Ptr(tables),
        Arg::Ptr(off),
        Arg::Ptr(len),
        Arg::Ptr(n_ctx),
        Arg::Ptr(readers),
    ];
    let shape_args = [
        Arg::U32(shape.n_heads),
        Arg::U32(shape.n_kv_heads),
        Arg::U32(shape.head_dim),
        Arg::U32(shape.page_size),
        Arg::Tags(dt),
    ];
    let mut decode = vec![Arg::Ptr(qp), Arg::Ptr(kp), Arg::Ptr(vp)];
    decode.extend(table);
    decode.extend(shape_args);
    let (kernel, grid) = match attend {
        Attend::Decode(_) => {
            let arrivals = put(bytes_of(&vec![0u32; n * shape.n_kv_heads as usize]))?;
            decode.extend([
                Arg::U32(splits.pages_per_split),
                Arg::Ptr(partial),
                Arg::Ptr(bad),
                Arg::Ptr(arrivals),
                Arg::Ptr(outp),
                Arg::Ptr(verdicts),
                // Every row, in order.
                Arg::Ptr(DevicePtr(0)),
                // No quantized copy of the output.
                Arg::Ptr(DevicePtr(0)),
                Arg::Ptr(DevicePtr(0)),
            ]);
            let grid = LaunchDims {
                grid: [shape.n_kv_heads, n as u32, splits.n],
                block: [128, 1, 1],
            };
            (Kernel::FlashDecode, grid)
        }
        Attend::Prefill(tiles) => {
            let tiles_p = put(bytes_of(tiles))?;
            decode.extend([Arg::Ptr(tiles_p), Arg::Ptr(outp), Arg::Ptr(verdicts)]);
            let grid = LaunchDims::grid2(shape.n_heads, (tiles.len() / 2) as u32, 128);
            (Kernel::FlashPrefill, grid)
        }
    };
    dev.launch(kernel, grid, &decode)?;
    dev.download(outp, bytes_of_mut(out))?;
    let mut got = poisoned;
    dev.download(verdicts, bytes_of_mut(&mut got))?;
    let counts = dev.take_counts();
    Ok(FlashRun {
        verdicts: got,
        counts: counts[0].counts,
    })
}
